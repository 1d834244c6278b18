"""Selective activation offloading (ByteScale §5.2): the torch floor's host-memory tier.

See :mod:`lightning_bytescale.offload.offloader`.
"""

from lightning_bytescale.offload.offloader import (
    ActivationOffloader,
    OffloadError,
    OffloadStats,
    PassStats,
    Tag,
    micro_batch_offload_ratio,
    offloaded_layers,
)

__all__ = [
    "ActivationOffloader",
    "OffloadError",
    "OffloadStats",
    "PassStats",
    "Tag",
    "micro_batch_offload_ratio",
    "offloaded_layers",
]
