#!/usr/bin/env python3
"""Goldens for the deepseek2 runner (multi-head latent attention, experts):
each case is a small random-weight GGUF that `pagekv synth-model` writes
deterministically (its sha256 recorded, so a changed writer is caught before
any logit is compared); tools/reference.py's DeepseekModel, a float64 numpy
forward pass in the unabsorbed form, gives

  - the logits of every prompt position at a few rows (one forward pass),
  - 64 greedy steps after the prompt: each step's chosen id, its top-5 ids
    and logits and the margin between the first two.

    python3 tools/make_deepseek_goldens.py --pagekv build/release/bin/pagekv \\
        --out tests/data/deepseek2_goldens.json
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

CASES = [
    # name, preset, weight type
    ("tiny-deepseek2", "tiny-deepseek2", "f32"),
    ("tiny-deepseek2-lite", "tiny-deepseek2-lite", "f32"),
    ("tiny-deepseek2-q8_0", "tiny-deepseek2", "q8_0"),
]
SEED, PROMPT, STEPS = 11, 40, 64


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pagekv", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rng = np.random.default_rng(20261203)
    ids = [1] + [int(x) for x in rng.integers(3, 512, PROMPT - 1)]
    rows = [0, 15, 16, PROMPT - 1]
    out = {"generator": "tools/make_deepseek_goldens.py (tools/reference.py DeepseekModel, float64 numpy, unabsorbed)",
           "seed": SEED, "ids": ids, "rows": rows, "steps": STEPS, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, preset, weight_type in CASES:
            path = os.path.join(tmp, name + ".gguf")
            subprocess.run([args.pagekv, "synth-model", "--preset", preset, "--seed", str(SEED), "--weight-type",
                            weight_type, "--out", path], check=True, stdout=subprocess.DEVNULL)
            model = reference.load_model(reference.Gguf(path))
            logits = model.forward(ids, [], 0)
            greedy, top = reference.greedy(model, ids, STEPS)
            out["cases"].append({
                "name": name, "preset": preset, "weight_type": weight_type,
                "sha256": hashlib.sha256(open(path, "rb").read()).hexdigest(),
                "logits": [[round(float(x), 7) for x in logits[r]] for r in rows],
                "greedy": greedy, "top5": top,
            })
            margins = sorted(t["margin"] for t in top)
            print(f"{name}: greedy {greedy[:8]}..., smallest margins {margins[:3]}", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump(out, f)
        f.write("\n")


if __name__ == "__main__":
    main()
