"""Fixtures of the Python module's tests: the module from the build tree
(tests/bindings/run.sh puts <build>/python on PYTHONPATH), the CLI binary to
compare against, and small caches."""

import os

import numpy as np
import pytest

import pagekv


@pytest.fixture
def cli():
    path = os.environ.get("PAGEKV_CLI")
    if not path:
        pytest.skip("PAGEKV_CLI not set (tests/bindings/run.sh sets it)")
    return path


def small_cache(**overrides):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_len=8, num_blocks=16, dtype="f32",
                prefault=False)
    args.update(overrides)
    return pagekv.KvCache(**args)


def rows(cache, n, seed, dtype=np.float32):
    """Random K and V rows for n tokens, shaped as append takes them."""
    rng = np.random.default_rng(seed)
    shape = (cache.num_layers, n, cache.num_heads, cache.row_elems)
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)
