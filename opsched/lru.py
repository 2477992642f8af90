"""A small thread-safe LRU cache whose entries can be tied to the objects they were made for.

opsched caches what is costly to redo per call (compiled plans, ONNX Runtime
sessions, imported graphs, the plan chosen for a plan) under keys that hold
``id()`` of the objects involved: plans and graphs are immutable, so their
identity is the cheapest key.  An id may be reused once its object is gone,
so such an entry keeps the objects themselves (``owners``) and is a hit only
when they are the very objects asked about.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any


class IdentityLRU:
    """At most ``size`` entries, least recently used dropped first; safe across threads."""

    def __init__(self, size: int) -> None:
        self.size = max(1, int(size))
        self._items: OrderedDict[Hashable, tuple[tuple[Any, ...], Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, *owners: Any) -> Any | None:
        """The value stored under ``key`` for exactly these ``owners`` (by identity), or None."""
        with self._lock:
            hit = self._items.get(key)
            if hit is None or len(hit[0]) != len(owners) or any(a is not b for a, b in zip(hit[0], owners)):
                return None
            self._items.move_to_end(key)
            return hit[1]

    def put(self, key: Hashable, value: Any, *owners: Any) -> None:
        """Store ``value`` under ``key`` for ``owners``, dropping the oldest entries beyond ``size``."""
        with self._lock:
            self._items[key] = (owners, value)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get_or_make(self, key: Hashable, make: Callable[[], Any], *owners: Any) -> Any:
        """The cached value, or ``make()`` stored and returned (``make`` runs outside the lock)."""
        hit = self.get(key, *owners)
        if hit is None:
            hit = make()
            self.put(key, hit, *owners)
        return hit

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


__all__ = ["IdentityLRU"]
