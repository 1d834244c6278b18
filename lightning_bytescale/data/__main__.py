"""``python -m lightning_bytescale.data``: see :mod:`lightning_bytescale.cli.data`."""

import sys

from lightning_bytescale.cli.data import main

sys.exit(main())
