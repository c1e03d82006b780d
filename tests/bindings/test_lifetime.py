"""No leak across many caches: 10,000 create / use / destroy cycles, views
included, keep the process's resident memory bounded."""

import gc

import numpy as np

import pagekv


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def cycle(i):
    c = pagekv.KvCache(num_layers=2, num_kv_heads=2, head_dim=16, block_len=16, num_blocks=8, dtype="f16",
                       prefault=True)
    s = c.add_sequence(f"s{i}")
    k = np.full((2, 20, 2, 16), i % 7, dtype=np.float16)
    assert c.append(s, k, k)
    child = c.fork(s)
    view = c.block_view(c.block_table(s)[0], 1, 1, "v")
    assert view[0, 0] == i % 7
    np.from_dlpack(c.block_dlpack(c.block_table(child)[1], 0, 0))
    c.free(child)
    c.free(s)


def test_ten_thousand_caches_keep_memory_bounded():
    for i in range(1000):
        cycle(i)
    gc.collect()
    base = rss_bytes()
    for i in range(1000, 10000):
        cycle(i)
    gc.collect()
    grown = rss_bytes() - base
    assert grown < 8 << 20, f"resident memory grew by {grown} bytes over 9,000 caches"
