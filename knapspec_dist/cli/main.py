"""The ``knapspec`` command line: generate, profile, bench, peer, books, demo.

User errors (bad path, config, prompt, option) print one ``error: ...`` line and exit 2, with
no traceback; SIGTERM / SIGINT one warning line and exit 143 / 130; anything else is a bug and
keeps its traceback. Its job commands need Ray; ``cli/standalone.py`` has the commands that
run without it.
"""

from __future__ import annotations

import argparse
import sys

from knapspec_dist.cli import (
    bench,
    books,
    demo,
    generate,
    gpu_check,
    job,
    peer,
    profile,
    throughput,
)
from knapspec_dist.cli.common import command_parser, run

# One module per subcommand, each with register(subparsers); the order of `knapspec --help`.
COMMANDS = (generate, demo, profile, bench, throughput, peer, books, job, gpu_check)


def parser() -> argparse.ArgumentParser:
    return command_parser("knapspec", __doc__.splitlines()[0], COMMANDS)


def main(argv: list[str] | None = None) -> int:
    return run(parser(), argv)


if __name__ == "__main__":  # python -m knapspec_dist.cli.main (tests/test_bad_setups.py)
    sys.exit(main())
