"""Zero-copy views of a block's slab: NumPy views and DLPack, both ways."""

import numpy as np
import pytest

import pagekv
from conftest import rows, small_cache


def address(a):
    return a.__array_interface__["data"][0]


def test_a_view_shows_the_rows_the_cache_holds_without_a_copy():
    c = small_cache(dtype="f16")
    s = c.add_sequence()
    k, v = rows(c, 11, seed=20, dtype=np.float16)
    assert c.append(s, k, v)
    b1 = c.block_table(s)[1]
    view = c.block_view(b1, layer=1, head=0, plane="v")
    assert view.shape == (8, 8) and view.dtype == np.float16
    assert not view.flags.writeable and not view.flags.owndata
    np.testing.assert_array_equal(view[:3], v[1, 8:11, 0])
    # Written through the cache afterwards: the view sees it.
    k2, v2 = rows(c, 2, seed=21, dtype=np.float16)
    assert c.append(s, k2, v2)
    np.testing.assert_array_equal(view[3:5], v2[1, :, 0])
    # Another view of the same slab is the same memory.
    assert address(c.block_view(b1, 1, 0, "v")) == address(view)


def test_a_write_through_a_writable_view_is_what_the_cache_reads():
    c = small_cache()
    s = c.add_sequence()
    k, v = rows(c, 8, seed=22)
    assert c.append(s, k, v)
    b = c.block_table(s)[0]
    w = c.block_view(b, layer=0, head=1, plane="k", writable=True)
    w[2, :] = 42.0
    rk, _ = c.read(s)
    expect = k.copy()
    expect[0, 2, 1, :] = 42.0
    np.testing.assert_array_equal(rk, expect)


def test_writable_views_of_shared_or_free_blocks_are_refused():
    c = small_cache()
    s = c.add_sequence()
    k, v = rows(c, 4, seed=23)
    assert c.append(s, k, v)
    b = c.block_table(s)[0]
    child = c.fork(s)
    with pytest.raises(pagekv.FailedPreconditionError, match="shared by 2"):
        c.block_view(b, 0, 0, writable=True)
    with pytest.raises(RuntimeError):  # the built-in base
        c.block_dlpack(b, 0, 0, writable=True)
    ro = c.block_view(b, 0, 0)  # reading is fine
    with pytest.raises(ValueError):
        ro[0, 0] = 1.0
    free_block = next(x for x in range(c.num_blocks) if c.ref_count(x) == 0)
    with pytest.raises(pagekv.FailedPreconditionError, match="free"):
        c.block_view(free_block, 0, 0, writable=True)
    # The child's own copy (after copy-on-write) is writable again.
    k1, v1 = rows(c, 1, seed=24)
    assert c.append(child, k1, v1)
    c.block_view(c.block_table(child)[0], 0, 0, writable=True)[0, 0] = 7.0
    assert c.read(child)[0][0, 0, 0, 0] == 7.0
    assert c.read(s)[0][0, 0, 0, 0] == k[0, 0, 0, 0]


def test_dlpack_with_numpy_shares_the_arena():
    c = small_cache()
    s = c.add_sequence()
    k, v = rows(c, 8, seed=25)
    assert c.append(s, k, v)
    b = c.block_table(s)[0]
    t = c.block_dlpack(b, layer=1, head=1, plane="v")
    assert hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__")
    assert tuple(t.__dlpack_device__()) == (1, 0)  # kDLCPU
    a = np.from_dlpack(t)
    assert a.shape == (8, 8) and a.dtype == np.float32
    np.testing.assert_array_equal(a, v[1, :, 1])
    assert address(a) == address(c.block_view(b, 1, 1, "v"))
    # Writes through the arena show in the DLPack consumer's array.
    c.block_view(b, 1, 1, "v", writable=True)[5, 3] = -3.5
    assert a[5, 3] == -3.5
    # And writes through a writable DLPack export show in the cache.
    w = np.from_dlpack(c.block_dlpack(b, 0, 0, "k", writable=True))
    w[1, 1] = 9.25
    assert c.read(s)[0][0, 1, 0, 1] == 9.25


def test_a_view_keeps_the_cache_alive():
    c = small_cache()
    s = c.add_sequence()
    k, v = rows(c, 3, seed=26)
    assert c.append(s, k, v)
    view = c.block_view(c.block_table(s)[0], 0, 0)
    del c
    import gc

    gc.collect()
    np.testing.assert_array_equal(view[:3], k[0, :, 0])  # the arena is still mapped


def test_view_arguments_are_checked():
    c = small_cache()
    with pytest.raises(pagekv.OutOfRangeError, match="block 16 outside"):
        c.block_view(16, 0, 0)
    with pytest.raises(IndexError, match="layer 2 outside"):
        c.block_view(0, 2, 0)
    with pytest.raises(pagekv.OutOfRangeError, match="head -1"):
        c.block_view(0, 0, -1)
    with pytest.raises(pagekv.InvalidArgumentError, match='plane "q"'):
        c.block_view(0, 0, 0, plane="q")
