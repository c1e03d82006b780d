"""The peer for `paged_attention_test --bench`: PyTorch's scaled_dot_product_attention
over a contiguous cache ([batch, kv_heads, ctx, head_dim]) of the same decode shapes,
timed with CUDA events on the same GPU. Run by scripts/cuda-device-check.sh on a
machine with PyTorch and a GPU; prints one JSON line per shape."""
import json

import torch
import torch.nn.functional as F


def main():
    dev = torch.device("cuda")
    d = 128
    for dtype_name, dtype in (("f16", torch.float16), ("bf16", torch.bfloat16)):
        for q_heads, kv_heads in ((32, 32), (32, 8), (64, 8)):
            for batch, ctx in ((8, 4096), (32, 4096), (8, 16384)):
                k = torch.zeros(batch, kv_heads, ctx, d, device=dev, dtype=dtype)
                v = torch.zeros_like(k)
                q = torch.zeros(batch, q_heads, 1, d, device=dev, dtype=dtype)
                for _ in range(3):
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                iters = 20
                a.record()
                for _ in range(iters):
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                b.record()
                torch.cuda.synchronize()
                us = 1e3 * a.elapsed_time(b) / iters
                nbytes = 2 * k.numel() * k.element_size()
                print("SDPA " + json.dumps({"batch": batch, "ctx": ctx, "q_heads": q_heads, "kv_heads": kv_heads,
                                            "dtype": dtype_name, "us": round(us, 2),
                                            "gbps": round(nbytes / (us * 1e3), 1)}), flush=True)
                del k, v, q


if __name__ == "__main__":
    main()
