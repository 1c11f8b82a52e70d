"""The one way MoC replaces a method of Lightning's: once, marked, and never wrapped twice.

Lightning offers no hook at a few points MoC must act (a Trainer's ``enable_checkpointing`` check, what
``ckpt_path="last"`` means, a strategy that loads checkpoints itself, the end of a restore), so MoC wraps the method
that does the work there. Every callback of every Trainer in a process asks for the wrap; only the first one may
install it, or the wrapped method would run MoC's part twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_WRAPPED = "_moc_wrapped"
"""Set on each wrapper: ``owner.name`` carries it once wrapped (a bound method reads it from its function)."""


def wrap_once(owner: object, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``owner.name`` by ``wrap(method)`` unless it is wrapped already; ``False`` when ``owner`` has no such
    method (nothing replaced, for the caller to accept or refuse).

    ``owner`` is a class (``wrap`` gets the function and its wrapper takes ``self``, for every instance) or one object
    (``wrap`` gets the bound method and its wrapper does not take ``self``, for that object only).
    """
    method = getattr(owner, name, None)
    if method is None:
        return False
    if not getattr(method, _WRAPPED, False):
        wrapped = wrap(method)
        setattr(wrapped, _WRAPPED, True)
        setattr(owner, name, wrapped)
    return True
