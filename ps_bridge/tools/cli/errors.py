"""The error type of the `ps-bridge` commands (its own module: every command module imports it)."""


class UsageError(Exception):
    """An error in the user's input: printed as one line `ps-bridge: error: ...`, without a traceback."""
