"""The block manager's behaviours through Python, checked against what the
test itself appended (a record kept in NumPy, independent of the cache)."""

import numpy as np
import pytest

import pagekv
from conftest import rows, small_cache


def test_append_and_read_back_every_token():
    c = small_cache()
    s = c.add_sequence("a")
    k, v = rows(c, 21, seed=1)
    assert c.append(s, k[:, :13], v[:, :13])
    assert c.append(s, k[:, 13:], v[:, 13:])
    assert c.length(s) == 21
    assert len(c.block_table(s)) == 3  # ceil(21 / 8)
    rk, rv = c.read(s)
    np.testing.assert_array_equal(rk, k)
    np.testing.assert_array_equal(rv, v)
    rk, rv = c.read(s, 5, 9)
    np.testing.assert_array_equal(rk, k[:, 5:14])
    c.check_invariants()


def test_an_append_that_does_not_fit_changes_nothing():
    c = small_cache(num_blocks=4)
    a = c.add_sequence()
    k, v = rows(c, 20, seed=2)
    assert c.append(a, k, v)  # 3 blocks
    before = c.stats()
    table = c.block_table(a)
    b = c.add_sequence()
    k2, v2 = rows(c, 9, seed=3)  # needs 2 blocks, 1 is free
    assert c.blocks_needed(b, 9) == (2, False)
    assert not c.append(b, k2, v2)
    assert c.stats() == {**before, "num_sequences": before["num_sequences"] + 1}
    assert c.length(b) == 0 and c.block_table(b) == []
    assert c.block_table(a) == table
    rk, _ = c.read(a)
    np.testing.assert_array_equal(rk, k)
    c.check_invariants()


def test_copy_on_write_exactly_when_a_shared_partial_block_is_appended_to():
    c = small_cache()
    parent = c.add_sequence()
    k, v = rows(c, 12, seed=4)  # one full block, one with 4 of 8 slots
    assert c.append(parent, k, v)
    child = c.fork(parent)
    assert c.block_table(child) == c.block_table(parent)
    assert all(c.ref_count(b) == 2 for b in c.block_table(parent))
    assert c.stats()["blocks_used"] == 2  # the fork allocated nothing
    assert c.blocks_needed(child, 1) == (0, True)
    k1, v1 = rows(c, 1, seed=5)
    assert c.append(child, k1, v1)
    pt, ct = c.block_table(parent), c.block_table(child)
    assert ct[0] == pt[0]  # the full block stays shared
    assert ct[1] != pt[1]  # the partial one was copied for the child
    assert c.ref_count(pt[0]) == 2 and c.ref_count(pt[1]) == 1 and c.ref_count(ct[1]) == 1
    rk, _ = c.read(parent)
    np.testing.assert_array_equal(rk, k)  # the parent never sees the child's token
    ck, cv = c.read(child)
    np.testing.assert_array_equal(ck, np.concatenate([k, k1], axis=1))
    np.testing.assert_array_equal(cv, np.concatenate([v, v1], axis=1))
    # A second append to the child copies nothing more.
    assert c.blocks_needed(child, 1) == (0, False)
    c.check_invariants()


def test_appending_after_a_full_shared_block_copies_nothing():
    c = small_cache()
    parent = c.add_sequence()
    k, v = rows(c, 16, seed=6)  # two full blocks
    assert c.append(parent, k, v)
    child = c.fork(parent)
    assert c.blocks_needed(child, 3) == (1, False)
    k1, v1 = rows(c, 3, seed=7)
    assert c.append(child, k1, v1)
    assert c.block_table(child)[:2] == c.block_table(parent)
    c.check_invariants()


def test_truncate_returns_the_blocks_left_empty():
    c = small_cache()
    s = c.add_sequence()
    k, v = rows(c, 30, seed=8)  # 4 blocks
    assert c.append(s, k, v)
    free = c.stats()["blocks_free"]
    c.truncate(s, 9)  # 2 blocks hold tokens 0-8
    assert c.stats()["blocks_free"] == free + 2
    assert c.length(s) == 9 and len(c.block_table(s)) == 2
    rk, _ = c.read(s)
    np.testing.assert_array_equal(rk, k[:, :9])
    c.truncate(s, 0)
    assert c.stats()["blocks_free"] == c.num_blocks
    c.free(s)
    assert s not in c and len(c) == 0
    assert c.leak_report().strip() == "no blocks referenced"
    c.check_invariants()


def test_stats_and_memory_report_agree_with_the_layout():
    c = small_cache(dtype="f16")
    s = c.add_sequence("x")
    k, v = rows(c, 5, seed=9, dtype=np.float16)
    assert c.append(s, k, v)
    st = c.stats()
    assert st["blocks_used"] == 1 and st["tokens_logical"] == 5
    assert c.bytes_per_token == 2 * 2 * 2 * 8 * 2  # layers, K and V, heads, head_dim, bytes
    assert st["bytes_holding_tokens"] == 5 * c.bytes_per_token
    assert c.sequence_stats(s)["label"] == "x"
    assert "bytes" in c.memory_report() or "B" in c.memory_report()
    assert "x" in c.leak_report() or str(s) in c.leak_report()


def test_bf16_rows_travel_as_bit_patterns():
    c = small_cache(dtype="bf16")
    s = c.add_sequence()
    k, v = rows(c, 3, seed=10)
    kb = (k.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16
    vb = (v.view(np.uint32) >> 16).astype(np.uint16)
    assert c.append(s, kb, vb)
    rk, rv = c.read(s)
    assert rk.dtype == np.uint16
    np.testing.assert_array_equal(rk, kb)
    np.testing.assert_array_equal(rv, vb)


def test_int8_rows_are_the_stored_bytes():
    c = small_cache(dtype="int8", head_dim=16)
    assert c.format.startswith("int8")
    s = c.add_sequence()
    rng = np.random.default_rng(11)
    k = rng.integers(0, 256, size=(2, 4, 2, 16 + 2), dtype=np.uint8)  # 16 codes + an f16 scale
    v = rng.integers(0, 256, size=(2, 4, 2, 16 + 2), dtype=np.uint8)
    assert c.append(s, k, v)
    rk, rv = c.read(s)
    np.testing.assert_array_equal(rk, k)
    np.testing.assert_array_equal(rv, v)


def test_mla_cache_holds_one_latent_row():
    c = pagekv.KvCache(num_layers=2, kv_lora_rank=16, rope_dim=8, num_q_heads=4, head_dim=8, block_len=8,
                       num_blocks=4, dtype="f32", prefault=False)
    assert c.num_heads == 1 and c.row_elems == 24
    s = c.add_sequence()
    k = np.random.default_rng(12).standard_normal((2, 3, 1, 24)).astype(np.float32)
    assert c.append(s, k)
    rk, rv = c.read(s)
    assert rv is None
    np.testing.assert_array_equal(rk, k)
    with pytest.raises(pagekv.InvalidArgumentError, match="MLA"):
        c.append(s, k, k)


def test_a_preset_geometry_with_a_budget():
    c = pagekv.KvCache(preset="stories260k", budget="1MiB", prefault=False)
    p = pagekv.plan(preset="stories260k", budget="1MiB")
    assert c.num_blocks == p["num_blocks"]
    assert c.bytes_per_block == p["bytes_per_block"]
    assert c.bytes_per_token == p["bytes_per_token"]
