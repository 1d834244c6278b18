"""Where the public ``attention`` function finds the current micro-batch's layout.

The engine wraps each micro-batch's forward in :func:`attention_context`; the model calls
:func:`lightning_bytescale.packed_attention.attention` and never sees a ring.  The stack is
thread-local, so concurrent forwards in different threads do not see each other's layouts.
Backward passes do not read it: ring attention stores its layout and group with the saved
tensors, because autograd may run backward in another thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from lightning_bytescale.packed_attention.layout import AttentionLayout


@dataclass(frozen=True)
class AttentionScope:
    """One entry of the context stack: the layout and the process group its ring uses."""

    layout: AttentionLayout
    group: Any = None  # torch.distributed ProcessGroup; None means the global (WORLD) group


class _Stack(threading.local):
    def __init__(self) -> None:
        self.scopes: list[AttentionScope] = []


_STACK = _Stack()


@contextmanager
def attention_context(layout: AttentionLayout, group: Any = None) -> Iterator[AttentionLayout]:
    """Make ``layout`` the current layout for :func:`attention` inside the ``with`` block.

    ``group`` is the process group ring P2P runs on; ``None`` (the default) is the global
    group.  Ring peers are always named by their global ranks.  Contexts nest; the innermost
    one wins.
    """
    if not isinstance(layout, AttentionLayout):
        raise TypeError(
            f"attention_context expects an AttentionLayout, got {type(layout).__name__}; "
            "build one from the micro-batch (PackedMicroBatch.layout)"
        )
    _STACK.scopes.append(AttentionScope(layout, group))
    try:
        yield layout
    finally:
        _STACK.scopes.pop()


def current_scope() -> AttentionScope | None:
    """The innermost active scope, or ``None`` outside any :func:`attention_context`."""
    return _STACK.scopes[-1] if _STACK.scopes else None


def current_layout() -> AttentionLayout | None:
    """The innermost active layout, or ``None`` outside any :func:`attention_context`."""
    scope = current_scope()
    return None if scope is None else scope.layout
