"""Selective activation offloading (ByteScale §5.2): the torch floor's host-memory tier.

See :mod:`lightning_bytescale.offload.offloader`, whose public names (its ``__all__``) this
package re-exports, and :func:`find_blocks` (:mod:`lightning_bytescale.offload.blocks`), the
model's transformer blocks that per-layer offload hooks and the profiler times.
"""

from lightning_bytescale.offload import offloader as _offloader
from lightning_bytescale.offload.blocks import find_blocks
from lightning_bytescale.offload.offloader import *  # noqa: F403

__all__ = [*_offloader.__all__, "find_blocks"]
