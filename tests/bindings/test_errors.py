"""Bad input raises a pagekv.Error subclass that names the problem; nothing
changes and nothing aborts."""

import numpy as np
import pytest

import pagekv
from conftest import rows, small_cache


def test_the_hierarchy():
    assert issubclass(pagekv.InvalidArgumentError, pagekv.Error)
    assert issubclass(pagekv.InvalidArgumentError, ValueError)
    assert issubclass(pagekv.ResourceExhaustedError, MemoryError)
    assert issubclass(pagekv.NotFoundError, LookupError)
    assert issubclass(pagekv.OutOfRangeError, IndexError)
    assert issubclass(pagekv.Error, Exception)


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(), pagekv.InvalidArgumentError, "no model geometry"),
        (dict(num_layers=2, num_kv_heads=2, head_dim=8), pagekv.InvalidArgumentError, "no pool size"),
        (dict(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=4, block_len=12), ValueError, "block_len"),
        (dict(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=4, dtype="f12"), ValueError, "f12"),
        (dict(num_layers=2, num_kv_heads=2, head_dim=8, budget="12 parsecs"), ValueError, "parsecs"),
        (dict(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=0), ValueError, "num_blocks 0"),
        (dict(num_layers=0, num_kv_heads=2, head_dim=8, num_blocks=4), ValueError, "num_layers"),
        (dict(num_layers=2, num_kv_heads=3, num_q_heads=4, head_dim=8, num_blocks=4), ValueError, "multiple"),
        (dict(preset="gpt-17"), pagekv.NotFoundError, "gpt-17"),
    ],
)
def test_bad_geometry(kwargs, error, text):
    with pytest.raises(error, match=text):
        pagekv.KvCache(prefault=False, **kwargs)


def test_bad_rows_change_nothing():
    c = small_cache()
    s = c.add_sequence()
    k, v = rows(c, 4, seed=30)
    with pytest.raises(pagekv.InvalidArgumentError, match="float64"):
        c.append(s, k.astype(np.float64), v.astype(np.float64))
    with pytest.raises(ValueError, match="dimension 2 is 3"):
        c.append(s, np.zeros((2, 4, 3, 8), np.float32), np.zeros((2, 4, 3, 8), np.float32))
    with pytest.raises(ValueError, match="4 dimensions"):
        c.append(s, np.zeros((2, 4, 16), np.float32), v)
    with pytest.raises(ValueError, match="same tokens"):
        c.append(s, k, v[:, :3])
    with pytest.raises(ValueError, match="v: missing"):
        c.append(s, k)
    assert c.length(s) == 0 and c.stats()["blocks_used"] == 0


def test_unknown_sequences_and_ranges():
    c = small_cache()
    with pytest.raises(pagekv.NotFoundError, match="does not exist"):
        c.fork(99)
    with pytest.raises(pagekv.NotFoundError):
        c.free(99)
    s = c.add_sequence()
    with pytest.raises(pagekv.Error):
        c.truncate(s, 5)  # longer than the sequence
    with pytest.raises(pagekv.OutOfRangeError):
        c.read(s, 0, 1)
    c.free(s)
    with pytest.raises(pagekv.NotFoundError):
        c.free(s)  # freed twice


def test_a_pool_the_os_cannot_map_is_a_memory_error():
    with pytest.raises(MemoryError):
        pagekv.KvCache(num_layers=80, num_kv_heads=64, head_dim=256, block_len=1024, num_blocks=2**24,
                       prefault=False)
