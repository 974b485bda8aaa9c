#!/usr/bin/env python
"""Summarize long documents from Parquet with KnapSpec self-speculative decoding on Ray.

Submit it to a cluster (data paths absolute or URIs: the working directory is copied)::

    ray job submit --working-dir . -- python jobs/summarize.py \
        --input /data/docs.parquet --output /data/summaries --model /models/llama-3.1-70b \
        --tp 8 --replicas 2 --device cuda --dtype bf16

or run it where Ray runs (it joins RAY_ADDRESS's cluster, else starts a local Ray).  All
options: ``python jobs/summarize.py --help``; the code is ``knapspec_dist.jobs``.
"""

import os
import sys

# With `ray job submit --working-dir .` the package sits next to this folder; elsewhere it
# is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from knapspec_dist.cli.job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(mode="summarize"))
