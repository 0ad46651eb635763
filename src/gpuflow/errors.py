"""One exception type for mistakes a user can fix; the CLI turns it into a message and exit 2."""


class UserError(Exception):
    """A problem in the user's input (flags, config, workload, data) with a fix they can apply."""


class NonFiniteLossError(RuntimeError):
    """Training diverged: the loss stayed NaN/inf for too many consecutive steps."""
