"""pagekv.plan() against the CLI's `pagekv plan --json` (the same planner
through another front end) and against bytes counted by hand."""

import json
import subprocess

import pytest

import pagekv


def cli_plan(cli, *args):
    out = subprocess.run([cli, "plan", "--json", *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def test_bytes_counted_by_hand():
    p = pagekv.plan(num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128, block_len=16, dtype="f16",
                    seq_len=4096, batch=3)
    per_token = 32 * 2 * 8 * 128 * 2  # layers, K and V, KV heads, head_dim, bytes
    assert p["attention"] == "GQA"
    assert p["bytes_per_token"] == per_token
    assert p["bytes_per_block"] == 16 * per_token  # 4 KiB slabs: no padding
    assert p["blocks_per_sequence"] == 4096 // 16
    assert p["num_blocks"] == 3 * 256
    assert p["total_bytes"] == 3 * 4096 * per_token


def test_mla_reduction():
    p = pagekv.plan(preset="deepseek-v3", dtype="bf16", budget="24GiB", seq_len=32768)
    assert p["attention"] == "MLA"
    assert p["bytes_per_token"] == 61 * (512 + 64) * 2
    assert p["mla_reduction"] > 70


@pytest.mark.parametrize(
    "kwargs, flags",
    [
        (dict(preset="llama3-8b", budget="1GiB"), ["--preset", "llama3-8b", "--budget", "1GiB"]),
        (dict(preset="qwen2.5-7b", dtype="int8", batch=4, seq_len=8192),
         ["--preset", "qwen2.5-7b", "--dtype", "int8", "--batch", "4", "--seq-len", "8192"]),
        (dict(num_layers=4, num_kv_heads=2, head_dim=64, block_len=32, dtype="int4", num_blocks=100),
         ["--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--block-len", "32", "--dtype", "int4",
          "--max-blocks", "100"]),
        (dict(preset="llama3-8b", budget=1 << 30, layer_dtypes="0=f16,1:30=int8,31=f16"),
         ["--preset", "llama3-8b", "--budget", "1GiB", "--layer-dtypes", "0=f16,1:30=int8,31=f16"]),
    ],
)
def test_the_same_numbers_as_the_cli(cli, kwargs, flags):
    p = pagekv.plan(**kwargs)
    j = cli_plan(cli, *flags)
    compared = 0
    for key, value in j.items():
        if key in p and isinstance(value, (int, float)) and not isinstance(value, bool):
            assert p[key] == value, key
            compared += 1
    assert compared >= 8


def test_presets_and_errors():
    names = [p["name"] for p in pagekv.presets()]
    assert "llama3-8b" in names and "deepseek-v3" in names
    with pytest.raises(pagekv.NotFoundError, match="llama3-8b"):  # the error lists the names
        pagekv.plan(preset="nope", budget="1GiB")
    with pytest.raises(ValueError, match="no pool size"):
        pagekv.plan(num_layers=2, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="batch -1"):
        pagekv.plan(preset="llama3-8b", batch=-1)
