"""A toy continuous-batching scheduler with PageKV as its block manager.

Requests share system prompts; each is admitted through the prefix cache
(the cached part of its prompt costs no compute), decoded one token per
step, preempted (freed and re-queued) when the pool runs short, and
published when it finishes. The "model" writes K = V = a function of
(token, position), so every token's KV is checked at the end against what
recomputing it would give: a prefix hit must never hand over other KV.

    PYTHONPATH=build/release/python python examples/python/toy_scheduler.py
"""

import collections
import random

import numpy as np

import pagekv

LAYERS, HEADS, DIM, BLOCK = 2, 2, 16, 8


def fake_kv(tokens, start):
    """K and V rows of tokens at positions start.. (deterministic)."""
    pos = np.arange(start, start + len(tokens), dtype=np.float32)
    t = np.asarray(tokens, dtype=np.float32)
    row = (t[:, None] * 0.001 + pos[:, None] * 0.01 + np.arange(DIM, dtype=np.float32)[None, :])
    kv = np.broadcast_to(row[None, :, None, :], (LAYERS, len(tokens), HEADS, DIM))
    return np.ascontiguousarray(kv, dtype=np.float16)


class Request:
    def __init__(self, rid, prompt, max_new):
        self.rid, self.prompt, self.max_new = rid, prompt, max_new
        self.out, self.seq, self.computed = [], None, 0

    @property
    def tokens(self):
        return self.prompt + self.out


def main(num_requests=60, num_blocks=48, seed=0):
    rng = random.Random(seed)
    cache = pagekv.KvCache(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, block_len=BLOCK,
                           num_blocks=num_blocks, dtype="f16")
    prefix = pagekv.PrefixCache(cache)
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(16, 40))] for _ in range(3)]
    waiting = collections.deque(
        Request(i, rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))],
                rng.randrange(4, 20)) for i in range(num_requests))
    running, done, steps, computed, preemptions = [], [], 0, 0, 0
    while waiting or running:
        # Admit while the pool can hold the uncached part of the next prompt.
        while waiting:
            r = waiting[0]
            hit = prefix.lookup(r.tokens)["num_tokens"]
            if cache.stats()["blocks_free"] < -(-(len(r.tokens) - hit + 1) // BLOCK) + 1:
                break
            waiting.popleft()
            r.seq, cached = prefix.admit(r.tokens, label=f"req-{r.rid}")
            if not cache.append(r.seq, *(2 * [fake_kv(r.tokens[cached:], cached)])):
                prefix.free(r.seq)  # cannot happen with the check above; kept honest
                waiting.appendleft(r)
                break
            prefix.publish(r.seq, r.tokens)  # its full prompt blocks serve the next requests at once
            computed += len(r.tokens) - cached
            running.append(r)
        # One decode step: every running request appends one token.
        for r in list(running):
            token = (sum(r.tokens[-3:]) * 31 + r.rid) % 1000
            if sum(cache.blocks_needed(r.seq, 1)) > cache.stats()["blocks_free"]:
                prefix.free(r.seq)  # preempt: recomputed later, mostly from the prefix cache
                running.remove(r)
                waiting.append(r)
                preemptions += 1
                continue
            assert cache.append(r.seq, *(2 * [fake_kv([token], len(r.tokens))]))
            r.out.append(token)
            computed += 1
            if len(r.out) == r.max_new:
                k, _ = cache.read(r.seq)
                np.testing.assert_array_equal(k, fake_kv(r.tokens, 0))  # every row, hits included
                prefix.publish(r.seq, r.tokens)
                prefix.free(r.seq)
                running.remove(r)
                done.append(r)
        steps += 1
    cache.check_invariants()
    total = sum(len(r.tokens) for r in done)
    stats = prefix.stats()
    print(f"{len(done)} requests in {steps} steps, {preemptions} preemptions; computed {computed} of {total} "
          f"tokens; prefix hits {stats['hit_tokens']} tokens ({stats['token_hit_rate']:.0%} of prompts)")
    return done, stats


if __name__ == "__main__":
    main()
