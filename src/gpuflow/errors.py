"""One exception type for mistakes a user can fix; the CLI turns it into a message and exit 2."""


class UserError(Exception):
    """A problem in the user's input (flags, config, workload, data) with a fix they can apply."""


class NonFiniteLossError(RuntimeError):
    """Training diverged: the loss stayed NaN/inf for too many consecutive steps."""


EXIT_USER_ERROR = 2
# EX_TEMPFAIL of sysexits.h: "try again later". A wrapper script requeues the job on it.
EXIT_PREEMPTED = 75


class Preempted(Exception):  # noqa: N818 (a way to stop, not a fault)
    """The run stopped on SIGTERM or SIGUSR1 after writing a checkpoint; the CLI exits with
    :data:`EXIT_PREEMPTED`."""
