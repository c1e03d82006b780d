"""Prefix caching through Python: hits, salts that never share, what a hit
holds, events."""

import numpy as np
import pytest

import pagekv
from conftest import rows, small_cache


def serve(cache, prefix, tokens, salt=None, seed=0):
    """One request: admit, append the KV of the tokens not cached, publish.
    Returns (sequence, tokens that were cached)."""
    seq, cached = prefix.admit(tokens, salt=salt)
    k, v = rows(cache, len(tokens), seed=seed)
    assert cache.append(seq, k[:, cached:], v[:, cached:])
    prefix.publish(seq, tokens)
    return seq, cached, k, v


def test_a_second_request_hits_the_first_ones_blocks():
    c = small_cache(num_blocks=32)
    p = pagekv.PrefixCache(c)
    tokens = list(range(100, 125))  # 3 full blocks of 8, and 1 token
    a, cached, k, v = serve(c, p, tokens, seed=1)
    assert cached == 0
    assert p.stats()["inserted"] == 3
    match = p.lookup(tokens + [7, 8])
    assert match["num_tokens"] == 24 and match["blocks"] == c.block_table(a)[:3]
    b, cached, _, _ = serve(c, p, tokens[:20] + [1, 2, 3], seed=2)
    assert cached == 16  # two full blocks shared; the third differs at token 20
    assert c.block_table(b)[:2] == c.block_table(a)[:2]
    assert all(c.ref_count(x) == 2 for x in c.block_table(a)[:2])
    rk, _ = c.read(b, 0, 16)
    np.testing.assert_array_equal(rk, k[:, :16])  # the KV the first request wrote
    c.check_invariants()


def test_different_salts_never_share():
    c = small_cache(num_blocks=32)
    p = pagekv.PrefixCache(c)
    tokens = list(range(40))
    serve(c, p, tokens, salt="tenant-a")
    assert p.lookup(tokens, salt="tenant-a")["num_tokens"] == 32
    assert p.lookup(tokens, salt="tenant-b")["num_tokens"] == 0
    assert p.lookup(tokens)["num_tokens"] == 0  # no salt is its own tenant
    assert p.keys(tokens[:8], salt="tenant-a") != p.keys(tokens[:8], salt="tenant-b")
    assert p.lookup(tokens, salt="tenant-a", model_fingerprint="other-weights")["num_tokens"] == 0


def test_freed_blocks_stay_cached_until_the_pool_needs_them():
    c = small_cache(num_blocks=4)
    p = pagekv.PrefixCache(c, record_events=True)
    tokens = list(range(17))
    a, _, _, _ = serve(c, p, tokens)
    p.free(a)
    assert c.stats()["blocks_cached_free"] == 2
    assert p.lookup(tokens)["num_tokens"] == 16
    events = p.events()
    assert [e["type"] for e in events] == ["BlockStored"]
    assert events[0]["token_ids"] == tokens[:16] and len(events[0]["keys"]) == 2
    # A sequence that needs the whole pool evicts them (deepest first).
    s = c.add_sequence()
    k, v = rows(c, 32, seed=3)
    assert c.append(s, k, v)
    assert p.lookup(tokens)["num_tokens"] == 0
    assert p.stats()["evicted"] == 2
    assert [e["type"] for e in p.events()] == ["BlockRemoved", "BlockRemoved"]


def test_bad_prefix_arguments():
    c = small_cache()
    with pytest.raises(ValueError, match="hash"):
        pagekv.PrefixCache(c, hash="md5")
    with pytest.raises(ValueError, match="seed"):
        pagekv.PrefixCache(c, seed=3)
    p = pagekv.PrefixCache(c, hash="xxh3", seed=3)
    with pytest.raises(ValueError, match="salt"):
        p.lookup([1, 2, 3], salt="")
    with pytest.raises(pagekv.NotFoundError):
        p.publish(12345, [1, 2, 3])


def test_the_prefix_cache_keeps_its_kv_cache_alive():
    c = small_cache()
    p = pagekv.PrefixCache(c)
    del c
    import gc

    gc.collect()
    assert p.lookup(list(range(20)))["num_tokens"] == 0
