"""``python -m lightning_bytescale.data``: see :mod:`lightning_bytescale.data.cli`."""

import sys

from lightning_bytescale.data.cli import main

sys.exit(main())
