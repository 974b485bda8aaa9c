"""``python -m knapspec_dist.cli.standalone``: the ``knapspec`` commands that need no Ray,
for a machine without it (the GPU image: scripts/gpu_run.sh, docs/gpu-check.md).

gpu-check, bench and throughput run one replica in this process; the same modules register
them here and in ``knapspec`` (cli/main.py), so their options are the same in both. The other
commands are left out because importing them imports Ray (the job layer and the engine).
"""

from __future__ import annotations

import argparse
import sys

from knapspec_dist.cli import bench, gpu_check, throughput
from knapspec_dist.cli.common import command_parser, run

COMMANDS = (gpu_check, bench, throughput)
PROG = "python -m knapspec_dist.cli.standalone"


def parser() -> argparse.ArgumentParser:
    return command_parser(PROG, "knapspec's commands that need no Ray", COMMANDS)


def main(argv: list[str] | None = None) -> int:
    return run(parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
