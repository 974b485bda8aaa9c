#!/usr/bin/env python
"""Generate from ready-made prompts in Parquet (``--prompt-column``, default ``prompt``).

The same job as ``jobs/summarize.py`` (checkpoints, resume, retries, baseline speedup),
without the summarization prompt: prompts are used as is, or ``--text-column`` messages are
wrapped in the model's chat template.  ``python jobs/generate.py --help`` lists the options.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from knapspec_dist.cli.job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(mode="generate"))
