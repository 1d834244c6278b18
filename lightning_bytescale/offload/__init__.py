"""Selective activation offloading (ByteScale §5.2): the torch floor's host-memory tier.

See :mod:`lightning_bytescale.offload.offloader`, whose public names (its ``__all__``) this
package re-exports.
"""

from lightning_bytescale.offload import offloader as _offloader
from lightning_bytescale.offload.offloader import *  # noqa: F403

__all__ = list(_offloader.__all__)
