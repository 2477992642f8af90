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
    """At most ``size`` entries, least recently used dropped first; safe across threads.

    ``on_evict(key, value)`` is called (outside the lock) for every entry dropped
    to make room or taken out with :meth:`pop`, e.g. to close a session."""

    def __init__(self, size: int, on_evict: Callable[[Hashable, Any], None] | None = None) -> None:
        self.size = max(1, int(size))
        self.on_evict = on_evict
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
        dropped = []
        with self._lock:
            self._items[key] = (owners, value)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                old_key, (_, old) = self._items.popitem(last=False)
                dropped.append((old_key, old))
        if self.on_evict is not None:
            for k, v in dropped:
                self.on_evict(k, v)

    def pop(self, key: Hashable) -> Any | None:
        """Take the entry under ``key`` out (whatever its owners) and return its value, or None."""
        with self._lock:
            hit = self._items.pop(key, None)
        if hit is None:
            return None
        if self.on_evict is not None:
            self.on_evict(key, hit[1])
        return hit[1]

    def keys(self) -> list[Hashable]:
        """The keys, least recently used first (a copy)."""
        with self._lock:
            return list(self._items)

    def get_or_make(self, key: Hashable, make: Callable[[], Any], *owners: Any) -> Any:
        """The cached value, or ``make()`` stored and returned (``make`` runs outside the lock)."""
        hit = self.get(key, *owners)
        if hit is None:
            hit = make()
            self.put(key, hit, *owners)
        return hit

    def clear(self) -> None:
        with self._lock:
            items = list(self._items.items())
            self._items.clear()
        if self.on_evict is not None:
            for k, (_, v) in items:
                self.on_evict(k, v)

    def __len__(self) -> int:
        return len(self._items)


__all__ = ["IdentityLRU"]
