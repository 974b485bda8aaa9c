"""The ``knapspec`` command line: generate, profile, bench, demo.

User errors (bad path, config, prompt, option) print one ``error: ...`` line and exit 2, with
no traceback; SIGTERM / SIGINT one warning line and exit 143 / 130; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from knapspec_dist.cli import bench, demo, generate, gpu_check, job, profile, throughput
from knapspec_dist.cli.common import emit, stopped
from knapspec_dist.errors import UserError
from knapspec_dist.jobs.termination import JobTerminated

# One module per subcommand, each with register(subparsers); the order of `knapspec --help`.
COMMANDS = (generate, demo, profile, bench, throughput, job, gpu_check)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="knapspec", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except UserError as e:
        emit(f"error: {e}", error=True)
        return 2
    except JobTerminated as e:  # demo, bench, generate: as `knapspec job` does
        return stopped(e.signum)
    except KeyboardInterrupt:
        return stopped(signal.SIGINT)


if __name__ == "__main__":  # python -m knapspec_dist.cli.main (tests/test_bad_setups.py)
    sys.exit(main())
