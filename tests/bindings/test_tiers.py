"""The KV tiers through Python: whole blocks put and got back byte for byte
in RAM, on disk (also after reopening) and in a real redis-server; a payload
is returned only for the meta it was stored under (another salt, corrupt or
truncated bytes miss); Tiers under a PrefixCache bring evicted blocks back
with their exact rows."""

import threading

import numpy as np
import pytest

import pagekv
from conftest import rows, small_cache


def served(cache, pc, tokens, seed, salt=None):
    """Admit tokens, append rows for the uncached rest, publish; returns (seq, hit)."""
    seq, hit = pc.admit(tokens, salt=salt)
    k, v = rows(cache, len(tokens), seed)
    assert cache.append(seq, k[:, hit:], v[:, hit:])
    pc.publish(seq, tokens)
    return seq, hit, k, v


def test_host_store_round_trip_and_misses():
    cache = small_cache()
    pc = pagekv.PrefixCache(cache)
    tokens = list(range(100, 125))
    seq, _, _, _ = served(cache, pc, tokens, 1, salt="alice")
    metas = pc.block_metas(tokens, salt="alice")
    assert len(metas) == 3
    assert metas[0].parent is None and metas[1].parent == metas[0].key
    assert [m.key for m in metas] == pc.keys(tokens, salt="alice")
    assert metas[2].tokens == tokens[16:24]
    store = pagekv.HostStore(1 << 20, cache=cache)
    assert store.tier == "host" and store.kv_bytes == cache.block_payload_bytes
    payloads = [cache.read_block(b) for b in cache.block_table(seq)[:3]]
    for m, p in zip(metas, payloads):
        store.put(m, p)
    assert all(store.contains_many(metas))
    assert metas[1].key in store and metas[1] in store
    assert store.get(metas[1]) == payloads[1]
    assert store.get_many(metas) == payloads
    # The same tokens under another salt are other blocks: a miss.
    bob = pc.block_metas(tokens, salt="bob")
    assert bob[0].key != metas[0].key
    assert store.get(bob[0]) is None and bob[0] not in store
    store.remove(metas[0])
    assert store.get(metas[0]) is None
    st = store.stats()
    assert st["puts"] == 3 and st["blocks_now"] == 2 and st["hits"] >= 4
    store.check_invariants()


def test_a_block_moved_by_hand_into_another_cache_holds_the_same_rows(tmp_path):
    cache = small_cache()
    pc = pagekv.PrefixCache(cache)
    tokens = list(range(7, 7 + 16))
    seq, _, k, v = served(cache, pc, tokens, 3)
    metas = pc.block_metas(tokens)
    disk = pagekv.DiskStore(str(tmp_path / "kv.bin"), 1 << 20, cache=cache)
    disk.put_many(metas, [cache.read_block(b) for b in cache.block_table(seq)])
    disk.flush()
    del disk
    # Reopened: the blocks survived; written into a fresh cache's sequence.
    disk = pagekv.DiskStore(str(tmp_path / "kv.bin"), 1 << 20, cache=cache)
    other = small_cache()
    s2 = other.add_sequence()
    zeros = np.zeros_like(k)
    assert other.append(s2, zeros, zeros)
    for i, m in enumerate(metas):
        data = disk.get(m)
        assert data is not None
        other.write_block(s2, i, data)
    k2, v2 = other.read(s2)
    np.testing.assert_array_equal(k2, k)
    np.testing.assert_array_equal(v2, v)
    # A payload of the wrong size, or not bytes at all, is refused by name.
    with pytest.raises(ValueError, match="payload"):
        disk.put(metas[0], b"\0" * 10)
    with pytest.raises(ValueError, match="bytes-like"):
        disk.put(metas[0], 12)
    with pytest.raises(pagekv.InvalidArgumentError):
        other.write_block(s2, 0, b"\0" * 3)


def test_write_block_is_refused_for_a_shared_block():
    cache = small_cache()
    seq = cache.add_sequence()
    k, v = rows(cache, 8, 5)
    assert cache.append(seq, k, v)
    fork = cache.fork(seq)
    data = cache.read_block(cache.block_table(seq)[0])
    with pytest.raises(pagekv.FailedPreconditionError):
        cache.write_block(fork, 0, data)
    cache.free(fork)
    cache.write_block(seq, 0, data)


def test_redis_store_round_trip_with_a_real_server(redis_server):
    cache = small_cache()
    pc = pagekv.PrefixCache(cache, hash="xxh3", seed=42)
    tokens = list(range(300, 300 + 24))
    seq, _, _, _ = served(cache, pc, tokens, 9)
    metas = pc.block_metas(tokens)
    payloads = [cache.read_block(b) for b in cache.block_table(seq)]
    key = "k" * 32
    store = pagekv.RedisStore(redis_server, cache=cache, namespace="test", payload_key=key)
    assert store.tier == "redis"
    assert store.contains_many(metas) == [False, False, False]
    store.put_many(metas, payloads)
    assert store.contains_many(metas) == [True, True, True]
    assert store.get_many(metas) == payloads
    # Another process's view: a second store on the same namespace and key.
    again = pagekv.RedisStore(redis_server, cache=cache, namespace="test", payload_key=key)
    assert again.get(metas[2]) == payloads[2]
    # Without the key its reads are refused (unauthenticated), never returned.
    stranger = pagekv.RedisStore(redis_server, cache=cache, namespace="test")
    assert stranger.get(metas[0]) is None
    assert stranger.stats()["unauthenticated"] >= 1
    # Another namespace holds nothing.
    assert pagekv.RedisStore(redis_server, cache=cache, namespace="other").get(metas[0]) is None
    store.remove(metas[1].key)
    assert not store.contains(metas[1])
    assert store.stats()["healthy"]


def test_redis_store_down_is_an_unavailable_error():
    import socket

    with socket.socket() as s:  # a closed loopback port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cache = small_cache()
    store = pagekv.RedisStore(f"redis://127.0.0.1:{port}", cache=cache, timeout_ms=200)
    pc = pagekv.PrefixCache(cache)
    meta = pc.block_metas(list(range(8)))[0]
    with pytest.raises(pagekv.Error):
        store.put(meta, b"\0" * cache.block_payload_bytes)
    assert not store.stats()["healthy"]


def test_tiers_under_a_prefix_cache_bring_evicted_blocks_back(redis_server):
    cache = small_cache(num_blocks=6)
    tiers = pagekv.Tiers(cache, host_bytes=1 << 20, redis_url=redis_server, redis_namespace="pytest")
    pc = pagekv.PrefixCache(cache, tiers=tiers, record_events=True)
    first = list(range(100, 100 + 33))
    seq, hit, k, v = served(cache, pc, first, 11)
    assert hit == 0
    pc.free(seq)
    for base, seed in ((500, 12), (900, 13)):  # push the first prompt's blocks out of the pool
        s, _, _, _ = served(cache, pc, list(range(base, base + 40)), seed)
        pc.free(s)
    tiers.drain()
    assert pc.lookup(first)["num_tokens"] == 32
    seq, hit = pc.admit(first)
    assert hit == 32
    k2, v2 = cache.read(seq, 0, 32)
    np.testing.assert_array_equal(k2, k[:, :32])
    np.testing.assert_array_equal(v2, v[:, :32])
    assert pc.stats()["hit_blocks"] >= 4
    st = tiers.stats()
    assert [t["name"] for t in st["tiers"]] == ["host", "redis"]
    assert st["load_hits"]["host"] + st["load_hits"]["redis"] >= 4
    assert tiers.store("redis").stats()["puts"] > 0
    assert any(e["tier"] in ("host", "redis") for e in pc.events())
    cache.check_invariants()


def test_tiers_for_another_cache_and_a_second_prefix_cache_are_refused():
    cache, other = small_cache(), small_cache(block_len=16)
    tiers = pagekv.Tiers(other, host_bytes=1 << 20)
    with pytest.raises(ValueError, match="make the Tiers with this cache"):
        pagekv.PrefixCache(cache, tiers=tiers)
    pc = pagekv.PrefixCache(cache)
    with pytest.raises(pagekv.FailedPreconditionError, match="one per KvCache"):
        pagekv.PrefixCache(cache)
    with pytest.raises(LookupError, match="no disk tier"):
        tiers.store("disk")
    with pytest.raises(ValueError):
        tiers.store("tape")
    with pytest.raises(ValueError, match="block_len and kv_bytes"):
        pagekv.HostStore(1 << 20)
    with pytest.raises(ValueError, match="hex"):
        pagekv.HostStore(1 << 20, cache=cache).contains("zz" * 16)
    del pc


def test_stores_release_the_gil_for_other_threads(redis_server):
    """Four threads put and get through one Redis store at once: every payload comes back intact."""
    cache = small_cache()
    pc = pagekv.PrefixCache(cache)
    store = pagekv.RedisStore(redis_server, cache=cache, namespace="threads")
    n = cache.block_payload_bytes
    errors = []

    def work(t):
        try:
            for i in range(20):
                meta = pc.block_metas([t * 1000 + i] * 8)[0]
                data = bytes([(t * 20 + i) % 256]) * n
                store.put(meta, data)
                assert store.get(meta) == data
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.stats()["puts"] == 80
