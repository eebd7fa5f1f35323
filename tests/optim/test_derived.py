"""The caches of values derived from factors: kept while the sources are the same objects
and no factor update of the layer (forget) came since; a stale entry of the same sources
lends its buffers to the recomputation."""

from __future__ import annotations

import torch

from singd_cuda.optim.derived import DerivedCache, GroupCache


class Calls:
    """A derive that records what it was given and returns new values."""

    def __init__(self) -> None:
        self.outs: list = []

    def __call__(self, *sources, out=None):
        self.outs.append(out)
        return (torch.zeros(1),) if out is None else out


def test_derived_cache_keeps_values_until_forget_or_new_sources():
    cache, derive = DerivedCache(), Calls()
    first, second = object(), object()
    sources = (torch.ones(2),)
    values = cache.get(first, sources, derive)
    assert cache.get(first, sources, derive) is values and derive.outs == [None]
    other = cache.get(second, sources, derive)
    cache.forget(second)  # another layer's forget leaves this one fresh
    assert cache.get(first, sources, derive) is values and len(derive.outs) == 2
    cache.forget(first, first)
    assert cache.get(first, sources, derive) is values  # recomputed into its buffers
    assert derive.outs[-1] is values
    assert cache.get(first, sources, derive) is values and len(derive.outs) == 3
    assert cache.get(first, (torch.ones(2),), derive) is not values  # new sources
    assert derive.outs[-1] is None
    assert cache.get(second, sources, derive) is other and derive.outs[-1] is other
    cache.forget(first, second)
    found, stale = cache.get_many([first, second], [sources, sources], lambda i, s: ("new", i))
    assert stale == [0, 1] and found[0] == ("new", 0) and found[1] is other
    assert cache.get_many([first, second], [sources, sources], None)[1] == []
    cache.forget(first)
    cache.put(first, sources, ("put",))
    assert cache.get(first, sources, derive) == ("put",)
    cache.forget(first, second)
    other_sources = (torch.ones(3),)
    cache.put_many([first, second], iter([sources, other_sources]), [("a",), ("b",)])
    calls = len(derive.outs)
    assert cache.get(first, sources, derive) == ("a",)
    assert cache.get(second, other_sources, derive) == ("b",) and len(derive.outs) == calls
    assert cache.get(second, sources, derive) != ("b",)  # held for other sources


def test_group_cache_keeps_values_until_a_member_is_forgotten():
    cache, calls = GroupCache(), []
    a, b, c = object(), object(), object()
    sources = (torch.ones(2),)

    def derive(previous=None):
        calls.append(previous)
        return (len(calls),)

    values = cache.get([a, b], sources, derive, into=True)
    assert cache.get([a, b], sources, derive, into=True) is values and calls == [None]
    cache.forget(c)
    assert cache.get([a, b], sources, derive, into=True) is values
    for _ in range(2):  # every forget stales, also a second one in a row
        cache.forget(b)
        values = cache.get([a, b], sources, derive, into=True)
        assert calls[-1] is not None and cache.get([a, b], sources, derive) is values
    assert len(calls) == 3
    assert cache.get([a, b], (torch.ones(2),), derive, into=True) != values  # new sources
    assert calls[-1] is None
    cache.get([b, c], sources, derive)  # shares b: the entry of [a, b] goes
    assert len(cache.values()) == 1
