"""Overlapping TensorStore operations without holding unbounded memory, and without leaving any behind.

TensorStore runs operations concurrently, which is what makes many small arrays fast; but a write
copies its source and a read allocates its result, so starting everything at once would hold a
second copy of a rank's whole share. ``in_flight`` keeps a byte-bounded window of started operations.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable
from typing import Any, Protocol, TypeVar

C = TypeVar("C")
P = TypeVar("P", bound="Pending")


class Pending(Protocol):
    """A started TensorStore operation (``ts.Future``, ``ts.WriteFutures``)."""

    def result(self) -> Any: ...


def settle(operations: Iterable[Pending]) -> None:
    """Wait for every operation, ignoring its outcome: an operation of a failed save must not outlive it,
    or it would race with the retry's writes to the same keys."""
    for operation in operations:
        try:
            operation.result()
        except Exception:  # the failure that matters is already propagating
            pass


def in_flight(
    operations: Iterable[tuple[int, Callable[[], tuple[C, P]]]], limit_bytes: int
) -> Generator[tuple[C, P], None, None]:
    """Start ``(nbytes, start)`` operations in order and yield ``(context, pending)`` oldest first, to finish.

    A new operation starts only when it fits under ``limit_bytes`` beside those still unfinished (or
    runs alone if it is bigger), so I/O overlaps across arrays while the bytes held stay bounded.
    The caller must finish each yielded operation before asking for the next. Whatever was started
    and not yielded is settled when the iteration ends early (an error, or ``close()``).
    """
    window: deque[tuple[int, tuple[C, P]]] = deque()
    pending = 0
    try:
        for nbytes, start in operations:
            while window and pending + nbytes > limit_bytes:
                done_bytes, done = window.popleft()
                pending -= done_bytes
                yield done
            window.append((nbytes, start()))
            pending += nbytes
        while window:
            yield window.popleft()[1]
    finally:
        settle(operation for _, (_, operation) in window)
