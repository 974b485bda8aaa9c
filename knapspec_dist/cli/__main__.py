"""``python -m knapspec_dist.cli``: the ``knapspec`` command."""

import sys

from knapspec_dist.cli.main import main

sys.exit(main())
