#!/usr/bin/env python3
"""Goldens for the gemma3 runner on the real Gemma 3 270M (Q4_K_M) file that
scripts/fetch-model.sh gemma3 fetches, from tools/reference.py: Google's
`sentencepiece` library (its model rebuilt from the GGUF's vocabulary) for
the token ids, jinja2 for the chat prompts (Gemma 3's published template
shape, written out below: the file carries none), and Gemma3Model, a float64
numpy forward pass that masks the sliding layers' windows explicitly.

  - tokenize: ids of texts that catch SentencePiece details (no dummy
    prefix, user-defined newline and tab runs, byte fallback, control
    tokens written in the text), no BOS;
  - prompts: plain ones (BOS, then the text: add_bos_token is true), chat
    ones (the template writes <bos>), and a long one past the 512-token
    window; for each 64 greedy steps with every step's top-5 ids and logits;
  - nll: the mean NLL of BOS + the first 2,047 tokens of a licence text,
    one forward pass (its late positions see only their window).

    python3 tools/make_gemma_goldens.py --model ~/.cache/pagekv/models/gemma-3-270m-q4_k_m.gguf \\
        --out tests/data/gemma3_goldens.json
"""
import argparse
import hashlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference  # noqa: E402

# Gemma 3's chat format (system text folded into the first user turn,
# assistant turns named "model", contents trimmed).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")

TOKENIZE = [
    "Hello world",
    " leading space and  two  spaces",
    "line one\nline two\n\n\nafter three newlines",
    "\tindented\t\ttabs\n\t\t\tdeeper",
    "Caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \u0440\u0443\u0441\u0441\u043a\u0438\u0439 \U0001F600\U0001F680 \u2603",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "x = [i ** 2 for i in range(10)]  # squares\r\n",
    "\u0000\u0007 control bytes \u00ff\u0100",
]


def greedy(model, ids, steps):
    cache = []
    logits = model.forward(ids, cache, 0, rows=[-1])[-1]
    out, top = [], []
    for k in range(steps):
        order = np.argsort(-logits, kind="stable")[:5]
        top.append({"ids": [int(i) for i in order], "logits": [float(logits[i]) for i in order],
                    "margin": float(logits[order[0]] - logits[order[1]])})
        out.append(int(order[0]))
        logits = model.forward([out[-1]], cache, len(ids) + k)[-1]
    return out, top


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--nll-tokens", type=int, default=2048)
    args = ap.parse_args()
    g = reference.Gguf(args.model)
    tk = reference.make_tokenizer(g)
    model = reference.load_model(g)
    tokens = g.value("tokenizer.ggml.tokens")
    bos = g.value("tokenizer.ggml.bos_token_id")
    eos = g.value("tokenizer.ggml.eos_token_id")
    out = {
        "generator": "tools/make_gemma_goldens.py (tools/reference.py: sentencepiece 0.2.3, Jinja2 3.1.6, "
                     "Gemma3Model float64 numpy with explicit window masks)",
        "model": {"file": os.path.basename(args.model),
                  "sha256": hashlib.sha256(open(args.model, "rb").read()).hexdigest()},
        "tokenize": [{"text": t, "ids": reference.encode(tk, t)} for t in TOKENIZE],
        "prompts": [],
    }
    raw = open(reference.NLL_TEXT, "rb").read().decode("utf-8")
    for p in reference.PLAIN_PROMPTS:
        out["prompts"].append({"kind": "plain", "prompt": p, "ids": [bos] + reference.encode(tk, p)})
    for m in reference.CHATS:
        text = reference.render_chat(GEMMA3_TEMPLATE, m, tokens[bos], tokens[eos])
        out["prompts"].append({"kind": "chat", "messages": m, "prompt": text, "ids": reference.encode(tk, text)})
    long_ids = [bos] + reference.encode(tk, raw)[:700]
    out["prompts"].append({"kind": "long", "prompt": tk.decode(long_ids[1:]), "ids": long_ids})
    for p in out["prompts"]:
        p["greedy"], p["top5"] = greedy(model, p["ids"], args.steps)
        print(f"{p['kind']}: {len(p['ids'])} ids; continuation {tk.decode(p['greedy'])!r}; smallest margin "
              f"{min(t['margin'] for t in p['top5']):.4f}", file=sys.stderr)
    ids = ([bos] + reference.encode(tk, raw))[: args.nll_tokens]
    total = 0.0
    cache = []
    hidden_rows = list(range(len(ids) - 1))
    logits = model.forward(ids, cache, 0, rows=hidden_rows)
    for i in hidden_rows:
        total -= reference.log_softmax(logits[i])[ids[i + 1]]
    nll = total / len(hidden_rows)
    print(f"nll over {len(ids)} tokens: {nll:.6f}", file=sys.stderr)
    out["nll"] = {"file": reference.NLL_TEXT, "sha256": hashlib.sha256(raw.encode()).hexdigest(), "tokens": len(ids),
                  "ids": ids, "mean_nll": float(nll)}
    with open(args.out, "w") as f:
        json.dump(out, f, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
