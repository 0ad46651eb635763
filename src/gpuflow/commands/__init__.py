"""`gpuflow` subcommands that live in their own modules (see cli._COMMAND_MODULES)."""
