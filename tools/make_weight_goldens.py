#!/usr/bin/env python3
"""Goldens for the weight-format decoders: random blocks of every GGUF type
PageKV reads, and their values as the `gguf` package dequantizes them (an
implementation independent of PageKV's C++).

    python3 tools/make_weight_goldens.py > tests/data/weight_formats.json

Each block's half-precision scale fields are set to finite values of a
realistic size (random bytes there could be NaN or infinity); every other
byte is random.
"""
import json
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

# type -> (name, byte offsets of the f16 fields in a block)
TYPES = {
    T.Q4_0: ("q4_0", [0]),
    T.Q4_1: ("q4_1", [0, 2]),
    T.Q5_0: ("q5_0", [0]),
    T.Q5_1: ("q5_1", [0, 2]),
    T.Q8_0: ("q8_0", [0]),
    T.Q2_K: ("q2_k", [80, 82]),
    T.Q3_K: ("q3_k", [108]),
    T.Q4_K: ("q4_k", [0, 2]),
    T.Q5_K: ("q5_k", [0, 2]),
    T.Q6_K: ("q6_k", [208]),
}


def main():
    rng = np.random.default_rng(20261201)
    out = {"generator": "tools/make_weight_goldens.py", "gguf_version": "0.19.0", "cases": []}
    for qtype, (name, halves) in TYPES.items():
        block_elems, block_bytes = quants.GGML_QUANT_SIZES[qtype]
        n_blocks = 6
        raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
        for off in halves:
            vals = (rng.standard_normal(n_blocks) * 0.02).astype(np.float16)
            raw[:, off:off + 2] = vals.view(np.uint8).reshape(n_blocks, 2)
        values = quants.dequantize(raw.reshape(-1), qtype).astype(np.float32).reshape(-1)
        assert values.size == n_blocks * block_elems
        out["cases"].append({
            "type": name,
            "bytes": raw.reshape(-1).tobytes().hex(),
            "values": [float(v) for v in values],
        })
    json.dump(out, sys.stdout, indent=None, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
