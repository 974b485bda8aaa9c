"""User-facing errors: the CLI prints these as one line, without a traceback."""


class UserError(Exception):
    """Bad input from the user (path, config, prompt, option); never a bug in the engine."""
