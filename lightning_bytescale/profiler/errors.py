"""The profiler's error class, on its own so every profiler module can raise it."""

from __future__ import annotations

from lightning_bytescale.errors import ByteScaleError


class ProfileError(ByteScaleError, ValueError):
    """The profiler cannot run as asked (bad lengths, no layers found, budget too small...)."""
