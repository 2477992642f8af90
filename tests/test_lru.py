"""opsched.lru.IdentityLRU: hits only for the very objects an entry was made for; bounded, oldest out first."""

from __future__ import annotations

import threading

from opsched.lru import IdentityLRU


class Obj:
    pass


def test_a_hit_needs_the_same_owner_objects_not_equal_ones():
    cache = IdentityLRU(4)
    a, b = Obj(), Obj()
    cache.put("k", 1, a, b)
    assert cache.get("k", a, b) == 1
    assert cache.get("k", a, Obj()) is None  # another object under a reused id
    assert cache.get("k", a) is None and cache.get("missing", a, b) is None


def test_least_recently_used_goes_first():
    cache = IdentityLRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a is now the most recent
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0


def test_get_or_make_makes_once():
    cache = IdentityLRU(8)
    calls = []

    def make():
        calls.append(1)
        return "value"

    assert cache.get_or_make("k", make) == "value" == cache.get_or_make("k", make)
    assert len(calls) == 1


def test_threads_share_it_safely():
    cache = IdentityLRU(16)

    def work(n):
        for i in range(500):
            cache.put((n, i % 20), i)
            cache.get((n, (i + 7) % 20))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 16
