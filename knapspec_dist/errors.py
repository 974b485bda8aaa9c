"""User-facing errors: the CLI prints these as one line, without a traceback."""

import signal


def first_line(e: BaseException) -> str:
    """An error's first non-empty line, or its type's name: what one log line or cell holds."""
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    return lines[0] if lines else type(e).__name__


class UserError(Exception):
    """Bad input from the user (path, config, prompt, option); never a bug in the engine."""


class Stopped(BaseException):
    """A run stopped by SIGTERM or SIGINT (``signum``); the command line turns it into one line
    and exit 128 + signum. A BaseException so that no row swallows it as its error."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)

    @staticmethod
    def exit_code(signum: int) -> int:
        """The shell's convention: 128 + the signal (SIGTERM 143, SIGINT 130)."""
        return 128 + int(signum)
