"""``python -m shardopt``: the same as the ``shardopt`` command."""

import sys

from shardopt.cli import main

sys.exit(main())
