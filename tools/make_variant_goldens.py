#!/usr/bin/env python3
"""Goldens for the runner's architecture variants (qwen2 biases and rotary
halves, partial rotary, linear / YaRN / llama3 rope scaling, a rope_freqs
tensor): each variant is a small random-weight GGUF that `pagekv synth-model`
writes deterministically; tools/reference.py's float64 forward pass gives
the logits PageKV must reproduce. The file's sha256 is recorded, so a
changed synthetic writer is caught before the logits are compared.

    python3 tools/make_variant_goldens.py --pagekv build/release/bin/pagekv \
        --out tests/data/model_variants.json
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference  # noqa: E402

VARIANTS = [
    ("qwen2", ["--arch", "qwen2"]),
    ("qwen2-partial-rotary", ["--arch", "qwen2", "--rope-dims", "8"]),
    ("llama-partial-rotary", ["--rope-dims", "8"]),
    ("llama-linear", ["--rope-scaling", "linear", "--rope-factor", "4"]),
    ("llama-yarn", ["--rope-scaling", "yarn", "--rope-factor", "4", "--rope-orig-context", "128"]),
    ("llama-llama3", ["--rope-scaling", "llama3", "--rope-factor", "8", "--rope-orig-context", "64"]),
    ("llama-rope-freqs", ["--rope-freqs"]),
    ("qwen2-yarn-q8_0", ["--arch", "qwen2", "--rope-scaling", "yarn", "--rope-factor", "2", "--weight-type", "q8_0"]),
]
PRESET, SEED, TOKENS = "tiny", 7, 96


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pagekv", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rng = np.random.default_rng(20261201)
    ids = [1] + [int(x) for x in rng.integers(3, 512, TOKENS - 1)]
    rows = [0, TOKENS // 2, TOKENS - 1]
    out = {"generator": "tools/make_variant_goldens.py (tools/reference.py, float64 numpy)",
           "preset": PRESET, "seed": SEED, "ids": ids, "rows": rows, "variants": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in VARIANTS:
            path = os.path.join(tmp, name + ".gguf")
            subprocess.run([args.pagekv, "synth-model", "--preset", PRESET, "--seed", str(SEED), "--out", path] + flags,
                           check=True, stdout=subprocess.DEVNULL)
            model = reference.Model(reference.Gguf(path))
            logits = model.forward(ids, [], 0)
            out["variants"].append({
                "name": name, "flags": flags,
                "sha256": hashlib.sha256(open(path, "rb").read()).hexdigest(),
                "logits": [[round(float(x), 7) for x in logits[r]] for r in rows],
            })
            print(f"{name}: top token at the last row {int(np.argmax(logits[-1]))}", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump(out, f)
        f.write("\n")


if __name__ == "__main__":
    main()
