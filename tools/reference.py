#!/usr/bin/env python3
"""An independent reference for PageKV's model runner: reads a GGUF file with
the `gguf` package (which also dequantizes every weight type), tokenizes with
Hugging Face's `tokenizers` built from the file's vocabulary and merges,
renders chat templates with `jinja2`, and runs a float64 numpy forward pass.
It shares no code with the C++.

    python3 tools/reference.py goldens --model M.gguf --out tests/data/smollm2-goldens.json
    python3 tools/reference.py tokenize --model M.gguf --text "Hello"
    python3 tools/reference.py logits --model M.gguf --ids "[1, 2, 3]" --rows 0,-1

What the forward pass implements (GGUF semantics as llama.cpp defines them):
architectures llama and qwen2 (q/k/v biases); grouped-query attention;
rotary embeddings on the first rope.dimension_count dimensions of each head,
adjacent pairs for llama (the converter permutes Q and K for that) and
halves for qwen2, with linear, YaRN or llama3 scaling from metadata and
per-frequency factors from a rope_freqs tensor (what converters write for
Llama 3.1) or computed by Hugging Face's llama3 rule; RMSNorm; SwiGLU; tied
embeddings when output.weight is absent.

deepseek2 (DeepseekModel): multi-head latent attention computed in the
unabsorbed form Hugging Face's modeling_deepseek.py uses (per-head keys
[W_UK c_kv, k_pe] and values W_UV c_kv materialised from the latent rows,
from attn_k_b / attn_v_b or a legacy attn_kv_b), an optional q LoRA, YaRN
with DeepSeek's mscale (softmax scale times yarn_get_mscale(factor,
mscale_all_dim)^2, rope tables unscaled), leading dense layers, then
mixture-of-experts layers: softmax or sigmoid gates, the selection bias
(exp_probs_b) for the choice only, group-limited routing (a group scores the
sum of its two best experts, as DeepSeek-V3's noaux_tc), top-k, weights
normalised and scaled, shared experts added.
"""
import argparse
import hashlib
import json
import math
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

# ---------------------------------------------------------------------------
# GGUF reading


class Gguf:
    def __init__(self, path):
        self.reader = GGUFReader(path)
        self.fields = self.reader.fields
        self.tensors = {t.name: t for t in self.reader.tensors}

    def value(self, key, default=None):
        f = self.fields.get(key)
        if f is None:
            return default
        tname = f.types[0].name
        if tname == "ARRAY":
            etype = f.types[1].name
            if etype == "STRING":
                return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            return [f.parts[i].tolist()[0] for i in f.data]
        if tname == "STRING":
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        v = f.parts[f.data[0]].tolist()[0]
        return bool(v) if tname == "BOOL" else v

    def tensor(self, name):
        """float64 array in row-major order: [rows][cols] for matrices."""
        t = self.tensors[name]
        data = dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return np.asarray(data, dtype=np.float64).reshape(shape)

    def has(self, name):
        return name in self.tensors


# ---------------------------------------------------------------------------
# Tokenizer: Hugging Face `tokenizers` from the GGUF's vocabulary

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class SpmTokenizer:
    """SentencePiece (tokenizer.ggml.model "llama") through Google's
    `sentencepiece` library, its model rebuilt from the GGUF's pieces, scores
    and types: BPE, byte fallback, spaces escaped to U+2581, the dummy prefix
    as tokenizer.ggml.add_space_prefix says. Control and user-defined pieces
    written in the text are cut out of the raw text first (longest match at
    each position), as Hugging Face matches its added tokens: the converter
    stores user-defined pieces pre-normalized (Gemma's runs of spaces as
    literal spaces, not U+2581), which SentencePiece's own matcher, running
    after the escaping, would never find."""

    def __init__(self, g):
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb

        tokens = g.value("tokenizer.ggml.tokens")
        scores = g.value("tokenizer.ggml.scores") or [0.0] * len(tokens)
        types = g.value("tokenizer.ggml.token_type") or [1] * len(tokens)
        unk = g.value("tokenizer.ggml.unknown_token_id", 0)
        m = pb.ModelProto()
        for i, (t, sc, ty) in enumerate(zip(tokens, scores, types)):
            p = m.pieces.add()
            p.piece = t
            p.score = sc
            p.type = pb.ModelProto.SentencePiece.UNKNOWN if i == unk else (ty if ty in (1, 3, 4, 5, 6) else 1)
        m.trainer_spec.model_type = pb.TrainerSpec.BPE
        m.trainer_spec.byte_fallback = 6 in types
        m.trainer_spec.unk_id = unk
        m.trainer_spec.bos_id = g.value("tokenizer.ggml.bos_token_id", -1)
        m.trainer_spec.eos_id = g.value("tokenizer.ggml.eos_token_id", -1)
        m.trainer_spec.pad_id = g.value("tokenizer.ggml.padding_token_id", -1)
        m.normalizer_spec.name = "identity"
        m.normalizer_spec.add_dummy_prefix = g.value("tokenizer.ggml.add_space_prefix", True)
        m.normalizer_spec.escape_whitespaces = True
        m.normalizer_spec.remove_extra_whitespaces = False
        self.sp = spm.SentencePieceProcessor(model_proto=m.SerializeToString())
        self.controls = {}  # first character -> pieces, longest first
        for t in sorted({t for t, ty in zip(tokens, types) if ty in (3, 4) and t}, key=len, reverse=True):
            self.controls.setdefault(t[0], []).append(t)
        self.ids = {t: i for i, t in reversed(list(enumerate(tokens)))}

    class Encoding:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text, add_special_tokens=False):
        out, i, begin = [], 0, 0
        while i < len(text):
            hit = next((c for c in self.controls.get(text[i], ()) if text.startswith(c, i)), None)
            if hit is None:
                i += 1
                continue
            if i > begin:
                out += self.sp.encode(text[begin:i])
            out.append(self.ids[hit])
            i = begin = i + len(hit)
        if begin < len(text):
            out += self.sp.encode(text[begin:])
        return SpmTokenizer.Encoding(out)

    def decode(self, ids):
        return self.sp.decode(ids)


def make_tokenizer(g):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    model = g.value("tokenizer.ggml.model")
    if model == "llama":
        return SpmTokenizer(g)
    if model != "gpt2":
        raise SystemExit(f"reference: tokenizer.ggml.model {model!r}: only gpt2 (byte-level BPE) is implemented here")
    tokens = g.value("tokenizer.ggml.tokens")
    types = g.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in g.value("tokenizer.ggml.merges")]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = g.value("tokenizer.ggml.pre", "default")
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in ("llama-bpe", "llama3", "smaug-bpe"):
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "qwen2":
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in ("default", "gpt2", "gpt-2"):
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise SystemExit(f"reference: tokenizer.ggml.pre {pre!r} is not implemented here")
    tk.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
    tk.add_special_tokens(specials)
    return tk


def encode(tk, text):
    """Ids of text, special tokens written in it parsed, no BOS/EOS added."""
    return tk.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------------
# Chat templates (jinja2, sandboxed as Hugging Face renders them)


def render_chat(template, messages, bos_token, eos_token, add_generation_prompt=True):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, bos_token=bos_token, eos_token=eos_token,
                                            add_generation_prompt=add_generation_prompt)


# ---------------------------------------------------------------------------
# The forward pass, float64


class Model:
    rope_magnitude = None  # what multiplies the rope tables, when not YaRN's default

    def __init__(self, g):
        arch = g.value("general.architecture")
        if arch not in ("llama", "qwen2"):
            raise SystemExit(f"reference: architecture {arch!r} is not implemented here")
        self.arch = arch
        a = arch
        self.dim = g.value(f"{a}.embedding_length")
        self.n_layers = g.value(f"{a}.block_count")
        self.n_heads = g.value(f"{a}.attention.head_count")
        self.n_kv = g.value(f"{a}.attention.head_count_kv", self.n_heads)
        self.head_dim = g.value(f"{a}.attention.key_length", self.dim // self.n_heads)
        self.eps = g.value(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
        self.base = g.value(f"{a}.rope.freq_base", 10000.0)
        self.n_rot = g.value(f"{a}.rope.dimension_count", self.head_dim)
        self.neox = arch == "qwen2"
        scaling = g.value(f"{a}.rope.scaling.type", "none")
        factor = g.value(f"{a}.rope.scaling.factor", 1.0) or 1.0
        self.freq_scale = 1.0 / factor if scaling in ("linear", "yarn") else 1.0
        self.yarn = scaling == "yarn"
        self.orig_ctx = g.value(f"{a}.rope.scaling.original_context_length", g.value(f"{a}.context_length"))
        self.attn_factor = g.value(f"{a}.rope.scaling.attn_factor", 1.0) or 1.0
        self.freq_factors = g.tensor("rope_freqs.weight") if g.has("rope_freqs.weight") else None
        if scaling == "llama3" and self.freq_factors is None:
            # Hugging Face's _compute_llama3_parameters, as divisors of each
            # frequency: wavelengths below orig/high keep theirs, above
            # orig/low are slowed by `factor`, a smooth blend between.
            low = g.value(f"{a}.rope.scaling.low_freq_factor", 1.0)
            high = g.value(f"{a}.rope.scaling.high_freq_factor", 4.0)
            inv = self.base ** (-np.arange(0, self.n_rot, 2, dtype=np.float64) / self.n_rot)
            wavelen = 2 * math.pi / inv
            smooth = (self.orig_ctx / wavelen - low) / (high - low)
            scaled = np.where(wavelen > self.orig_ctx / low, inv / factor, inv)
            medium = (wavelen >= self.orig_ctx / high) & (wavelen <= self.orig_ctx / low)
            scaled = np.where(medium, (1 - smooth) * inv / factor + smooth * inv, scaled)
            self.freq_factors = inv / scaled
        elif scaling not in ("none", "linear", "yarn", "llama3"):
            raise SystemExit(f"reference: rope scaling {scaling!r} is not implemented here")
        self.emb = g.tensor("token_embd.weight")
        self.out = g.tensor("output.weight") if g.has("output.weight") else self.emb
        self.out_norm = g.tensor("output_norm.weight")
        self.layers = []
        for l in range(self.n_layers):
            p = f"blk.{l}."
            L = {k: g.tensor(p + k + ".weight") for k in
                 ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
            for b in ("attn_q", "attn_k", "attn_v"):
                L[b + ".bias"] = g.tensor(p + b + ".bias") if g.has(p + b + ".bias") else None
            self.layers.append(L)
        self.vocab = self.emb.shape[0]

    def norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):
        """x: [tokens][heads][head_dim]; pos: [tokens]."""
        half = self.n_rot // 2
        i = np.arange(half, dtype=np.float64)
        theta_extrap = pos[:, None] * self.base ** (-2.0 * i / self.n_rot)[None, :]
        if self.freq_factors is not None:
            theta_extrap = theta_extrap / self.freq_factors[None, :half]
        theta = theta_extrap * self.freq_scale
        mscale = self.attn_factor
        if self.yarn:
            beta_fast, beta_slow = 32.0, 1.0

            def corr(n_rot):
                return self.n_rot * math.log(self.orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(self.base))

            lo = max(0.0, math.floor(corr(beta_fast)))
            hi = min(self.n_rot - 1.0, math.ceil(corr(beta_slow)))
            ramp = 1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)
            mix = ramp[None, :]
            theta = theta * (1 - mix) + theta_extrap * mix
            mscale *= 1.0 + 0.1 * math.log(1.0 / self.freq_scale)
        if self.rope_magnitude is not None:
            mscale = self.rope_magnitude
        cos = np.cos(theta)[:, None, :] * mscale
        sin = np.sin(theta)[:, None, :] * mscale
        out = x.copy()
        if self.neox:
            a, b = x[..., :half], x[..., half:self.n_rot]
            out[..., :half] = a * cos - b * sin
            out[..., half:self.n_rot] = a * sin + b * cos
        else:
            a, b = x[..., 0:self.n_rot:2], x[..., 1:self.n_rot:2]
            out[..., 0:self.n_rot:2] = a * cos - b * sin
            out[..., 1:self.n_rot:2] = a * sin + b * cos
        return out

    def forward(self, tokens, cache, start):
        """Logits [n][vocab] of tokens at positions start.. ; cache: list of (k, v) per layer, extended."""
        n = len(tokens)
        pos = np.arange(start, start + n, dtype=np.float64)
        x = self.emb[np.asarray(tokens)]
        hd, G = self.head_dim, self.n_heads // self.n_kv
        for l, L in enumerate(self.layers):
            h = self.norm(x, L["attn_norm"])
            q = h @ L["attn_q"].T
            k = h @ L["attn_k"].T
            v = h @ L["attn_v"].T
            if L["attn_q.bias"] is not None:
                q, k, v = q + L["attn_q.bias"], k + L["attn_k.bias"], v + L["attn_v.bias"]
            q = self.rope(q.reshape(n, self.n_heads, hd), pos)
            k = self.rope(k.reshape(n, self.n_kv, hd), pos)
            v = v.reshape(n, self.n_kv, hd)
            if len(cache) <= l:
                cache.append((k, v))
            else:
                cache[l] = (np.concatenate([cache[l][0], k]), np.concatenate([cache[l][1], v]))
            K, V = cache[l]
            total = K.shape[0]
            Kh = np.repeat(K, G, axis=1)  # [total][heads][hd]
            Vh = np.repeat(V, G, axis=1)
            s = np.einsum("thd,Thd->htT", q, Kh) / math.sqrt(hd)
            mask = (np.arange(total)[None, :] > (start + np.arange(n))[:, None])
            s = np.where(mask[None, :, :], -np.inf, s)
            s = s - s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            p = p / p.sum(axis=-1, keepdims=True)
            att = np.einsum("htT,Thd->thd", p, Vh).reshape(n, self.n_heads * hd)
            x = x + att @ L["attn_output"].T
            h = self.norm(x, L["ffn_norm"])
            gate = h @ L["ffn_gate"].T
            up = h @ L["ffn_up"].T
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ L["ffn_down"].T
        return self.norm(x, self.out_norm) @ self.out.T


def silu_glu(gate, up):
    return gate / (1.0 + np.exp(-gate)) * up


class DeepseekModel(Model):
    def __init__(self, g):  # noqa: C901 (one reader of the whole metadata)
        a = "deepseek2"
        if g.value("general.architecture") != a:
            raise SystemExit("reference: not a deepseek2 file")
        self.arch = a
        self.dim = g.value(f"{a}.embedding_length")
        self.n_layers = g.value(f"{a}.block_count")
        self.n_heads = g.value(f"{a}.attention.head_count")
        self.eps = g.value(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
        self.base = g.value(f"{a}.rope.freq_base", 10000.0)
        self.rope_dim = self.n_rot = g.value(f"{a}.rope.dimension_count")
        self.rank = g.value(f"{a}.attention.kv_lora_rank")
        self.q_lora = g.value(f"{a}.attention.q_lora_rank", 0)
        if g.value(f"{a}.attention.key_length_mla") is not None:
            qk = g.value(f"{a}.attention.key_length_mla")
            self.v_dim = g.value(f"{a}.attention.value_length_mla")
        else:
            qk = g.value(f"{a}.attention.key_length")
            self.v_dim = g.value(f"{a}.attention.value_length")
        self.qk = qk
        self.nope = qk - self.rope_dim
        self.neox = False
        self.freq_factors = None
        scaling = g.value(f"{a}.rope.scaling.type", "none")
        factor = g.value(f"{a}.rope.scaling.factor", 1.0) or 1.0
        self.yarn = scaling == "yarn"
        self.freq_scale = 1.0 / factor if self.yarn else 1.0
        self.orig_ctx = g.value(f"{a}.rope.scaling.original_context_length", g.value(f"{a}.context_length"))
        self.attn_factor = g.value(f"{a}.rope.scaling.attn_factor", 1.0) or 1.0
        self.scale = 1.0 / math.sqrt(qk)
        self.rope_magnitude = self.attn_factor
        if self.yarn:
            # modeling_deepseek.py: softmax_scale *= yarn_get_mscale(factor,
            # mscale_all_dim)^2; the rotary tables carry mscale / mscale_all_dim,
            # 1 when the two are equal (the converter keeps mscale_all_dim only).
            mscale_all_dim = g.value(f"{a}.rope.scaling.yarn_log_multiplier") / 0.1
            m = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
            self.scale *= (self.attn_factor * m) ** 2
        elif scaling != "none":
            raise SystemExit(f"reference: rope scaling {scaling!r} is not implemented for deepseek2")
        self.dense_layers = g.value(f"{a}.leading_dense_block_count", 0)
        self.n_experts = g.value(f"{a}.expert_count", 0)
        self.n_used = g.value(f"{a}.expert_used_count", 0)
        self.sigmoid = g.value(f"{a}.expert_gating_func", 1) == 2
        self.w_norm = bool(g.value(f"{a}.expert_weights_norm", False))
        self.w_scale = g.value(f"{a}.expert_weights_scale", 1.0) or 1.0
        self.groups = g.value(f"{a}.expert_group_count", 0)
        self.groups_used = g.value(f"{a}.expert_group_used_count", 0)
        self.emb = g.tensor("token_embd.weight")
        self.out = g.tensor("output.weight") if g.has("output.weight") else self.emb
        self.out_norm = g.tensor("output_norm.weight")
        H = self.n_heads
        self.layers = []
        for l in range(self.n_layers):
            p = f"blk.{l}."

            def t(name):
                return g.tensor(p + name) if g.has(p + name) else None
            L = {k: t(k + ".weight") for k in (
                "attn_norm", "attn_q", "attn_q_a", "attn_q_a_norm", "attn_q_b", "attn_kv_a_mqa", "attn_kv_a_norm",
                "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp", "ffn_gate_exps",
                "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")}
            L["exp_probs_b"] = t("exp_probs_b.bias")
            if g.has(p + "attn_k_b.weight"):
                L["w_uk"] = t("attn_k_b.weight").transpose(0, 2, 1)  # (H, rank, nope) -> [h][nope][rank]
                L["w_uv"] = t("attn_v_b.weight")                     # [h][v][rank]
            else:
                kv_b = t("attn_kv_b.weight").reshape(H, self.nope + self.v_dim, self.rank)
                L["w_uk"], L["w_uv"] = kv_b[:, :self.nope, :], kv_b[:, self.nope:, :]
            self.layers.append(L)
        self.vocab = self.emb.shape[0]

    def moe(self, L, h):
        logits = h @ L["ffn_gate_inp"].T  # [n][E]
        if self.sigmoid:
            probs = 1.0 / (1.0 + np.exp(-logits))
        else:
            z = np.exp(logits - logits.max(axis=-1, keepdims=True))
            probs = z / z.sum(axis=-1, keepdims=True)
        out = np.zeros_like(h)
        E = self.n_experts
        for i in range(h.shape[0]):
            sel = probs[i] + (L["exp_probs_b"] if L["exp_probs_b"] is not None else 0.0)
            if self.groups > 1:
                grouped = sel.reshape(self.groups, E // self.groups)
                score = np.sort(grouped, axis=1)[:, -2:].sum(axis=1)
                keep = np.argsort(-score, kind="stable")[: self.groups_used]
                mask = np.full(self.groups, True)
                mask[keep] = False
                sel = np.where(np.repeat(mask, E // self.groups), -np.inf, sel)
            chosen = np.argsort(-sel, kind="stable")[: self.n_used]
            w = probs[i][chosen]
            if self.w_norm:
                w = w / max(w.sum(), 6.103515625e-5)
            w = w * self.w_scale
            for e, we in zip(chosen, w):
                y = silu_glu(h[i] @ L["ffn_gate_exps"][e].T, h[i] @ L["ffn_up_exps"][e].T) @ L["ffn_down_exps"][e].T
                out[i] += we * y
        if L["ffn_gate_shexp"] is not None:
            out += silu_glu(h @ L["ffn_gate_shexp"].T, h @ L["ffn_up_shexp"].T) @ L["ffn_down_shexp"].T
        return out

    def forward(self, tokens, cache, start):
        """Logits [n][vocab]; cache: per layer (c_kv [T][rank], k_pe [T][rope]), extended."""
        n = len(tokens)
        pos = np.arange(start, start + n, dtype=np.float64)
        x = self.emb[np.asarray(tokens)]
        H, nope, rope = self.n_heads, self.nope, self.rope_dim
        for l, L in enumerate(self.layers):
            h = self.norm(x, L["attn_norm"])
            if L["attn_q_a"] is not None:
                q = self.norm(h @ L["attn_q_a"].T, L["attn_q_a_norm"]) @ L["attn_q_b"].T
            else:
                q = h @ L["attn_q"].T
            q = q.reshape(n, H, self.qk)
            q_nope, q_pe = q[..., :nope], self.rope(q[..., nope:].copy(), pos)
            kv = h @ L["attn_kv_a_mqa"].T
            c = self.norm(kv[:, :self.rank], L["attn_kv_a_norm"])
            k_pe = self.rope(kv[:, None, self.rank:].copy(), pos)[:, 0, :]
            if len(cache) <= l:
                cache.append((c, k_pe))
            else:
                cache[l] = (np.concatenate([cache[l][0], c]), np.concatenate([cache[l][1], k_pe]))
            C, KPE = cache[l]
            total = C.shape[0]
            k_nope = np.einsum("tr,har->tha", C, L["w_uk"])   # [T][H][nope]
            v = np.einsum("tr,hjr->thj", C, L["w_uv"])        # [T][H][v]
            s = (np.einsum("tha,Tha->htT", q_nope, k_nope) + np.einsum("thr,Tr->htT", q_pe, KPE)) * self.scale
            mask = (np.arange(total)[None, :] > (start + np.arange(n))[:, None])
            s = np.where(mask[None, :, :], -np.inf, s)
            s = s - s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            p = p / p.sum(axis=-1, keepdims=True)
            att = np.einsum("htT,Thj->thj", p, v).reshape(n, H * self.v_dim)
            x = x + att @ L["attn_output"].T
            h = self.norm(x, L["ffn_norm"])
            if l < self.dense_layers:
                x = x + silu_glu(h @ L["ffn_gate"].T, h @ L["ffn_up"].T) @ L["ffn_down"].T
            else:
                x = x + self.moe(L, h)
        return self.norm(x, self.out_norm) @ self.out.T


class Gemma3Model(Model):
    """gemma3 as llama.cpp reads the GGUF (and Hugging Face's Gemma3 computes):
    embeddings times sqrt(dim); per layer RMSNorm, q / k / v, per-head
    RMSNorm of q and k, NEOX rotary (sliding layers at rope.freq_base_swa,
    default 10000, unscaled; global ones at rope.freq_base with linear
    scaling), attention scaled by 1 / sqrt(head_dim) (dim / heads for the
    62-layer 27B) over the last sliding_window positions on sliding layers
    (l % P < P - 1 for the pattern P, 6 by default), output projection,
    post-attention RMSNorm, residual, RMSNorm, GELU(tanh) gate times up, down,
    post-FFN RMSNorm, residual; final RMSNorm, tied classifier, optional
    final soft-capping. Norm weights as stored (the converter added 1)."""

    def __init__(self, g):  # noqa: C901
        a = "gemma3"
        self.arch = a
        self.dim = g.value(f"{a}.embedding_length")
        self.n_layers = g.value(f"{a}.block_count")
        self.n_heads = g.value(f"{a}.attention.head_count")
        self.n_kv = g.value(f"{a}.attention.head_count_kv", self.n_heads)
        self.head_dim = g.value(f"{a}.attention.key_length", self.dim // self.n_heads)
        self.eps = g.value(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
        self.n_rot = self.head_dim
        self.neox = True
        self.base_global = g.value(f"{a}.rope.freq_base", 10000.0)
        self.base_local = g.value(f"{a}.rope.freq_base_swa", 10000.0)
        scaling = g.value(f"{a}.rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise SystemExit(f"reference: gemma3 rope scaling {scaling!r} is not implemented here")
        factor = g.value(f"{a}.rope.scaling.factor", 1.0) or 1.0
        self.scale_global = 1.0 / factor if scaling == "linear" else 1.0
        self.freq_factors, self.yarn, self.attn_factor = None, False, 1.0
        self.window = g.value(f"{a}.attention.sliding_window", 0) or 0
        pattern = g.value(f"{a}.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            self.sliding = [bool(x) and self.window > 0 for x in pattern]
        else:
            self.sliding = [self.window > 0 and pattern > 1 and l % pattern < pattern - 1 for l in range(self.n_layers)]
        self.q_scale = 1.0 / math.sqrt(self.dim // self.n_heads if self.n_layers == 62 else self.head_dim)
        self.softcap = g.value(f"{a}.final_logit_softcapping", 0.0) or 0.0
        self.emb = g.tensor("token_embd.weight")
        self.out = g.tensor("output.weight") if g.has("output.weight") else self.emb
        self.out_norm = g.tensor("output_norm.weight")
        names = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output",
                 "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")
        self.layers = [{k: g.tensor(f"blk.{l}.{k}.weight") for k in names} for l in range(self.n_layers)]
        self.vocab = self.emb.shape[0]

    def forward(self, tokens, cache, start, rows=None):
        """Logits of the positions `rows` (indices into tokens; all when None)."""
        n = len(tokens)
        pos = np.arange(start, start + n, dtype=np.float64)
        x = self.emb[np.asarray(tokens)] * math.sqrt(self.dim)
        hd, G = self.head_dim, self.n_heads // self.n_kv
        for l, L in enumerate(self.layers):
            sliding = self.sliding[l]
            self.base = self.base_local if sliding else self.base_global
            self.freq_scale = 1.0 if sliding else self.scale_global
            h = self.norm(x, L["attn_norm"])
            q = self.norm((h @ L["attn_q"].T).reshape(n, self.n_heads, hd), L["attn_q_norm"])
            k = self.norm((h @ L["attn_k"].T).reshape(n, self.n_kv, hd), L["attn_k_norm"])
            v = (h @ L["attn_v"].T).reshape(n, self.n_kv, hd)
            q = self.rope(q, pos) * self.q_scale
            k = self.rope(k, pos)
            if len(cache) <= l:
                cache.append((k, v))
            else:
                cache[l] = (np.concatenate([cache[l][0], k]), np.concatenate([cache[l][1], v]))
            K, V = cache[l]
            total = K.shape[0]
            s = np.einsum("thd,Thd->htT", q, np.repeat(K, G, axis=1))
            qpos = (start + np.arange(n))[:, None]
            kpos = np.arange(total)[None, :]
            mask = kpos > qpos
            if sliding:
                mask |= kpos <= qpos - self.window  # a query sees its last `window` positions
            s = np.where(mask[None, :, :], -np.inf, s)
            s = s - s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            p = p / p.sum(axis=-1, keepdims=True)
            att = np.einsum("htT,Thd->thd", p, np.repeat(V, G, axis=1)).reshape(n, self.n_heads * hd)
            x = x + self.norm(att @ L["attn_output"].T, L["post_attention_norm"])
            h = self.norm(x, L["ffn_norm"])
            gate = h @ L["ffn_gate"].T
            up = h @ L["ffn_up"].T
            gelu = 0.5 * gate * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate ** 3)))
            x = x + self.norm((gelu * up) @ L["ffn_down"].T, L["post_ffw_norm"])
        if rows is not None:
            x = x[rows]
        logits = self.norm(x, self.out_norm) @ self.out.T
        if self.softcap > 0:
            logits = self.softcap * np.tanh(logits / self.softcap)
        return logits


def load_model(g):
    arch = g.value("general.architecture")
    if arch == "deepseek2":
        return DeepseekModel(g)
    if arch == "gemma3":
        return Gemma3Model(g)
    return Model(g)


def log_softmax(z):
    z = z - z.max()
    return z - math.log(np.exp(z).sum())


# ---------------------------------------------------------------------------

PLAIN_PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little robot who",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, 3 astronauts flew 384,400 km to the Moon; the trip took 76 hours.",
    "Caf\u00e9, na\u00efve, r\u00e9sum\u00e9 \u2014 and \u65e5\u672c\u8a9e, \u0440\u0443\u0441\u0441\u043a\u0438\u0439, \U0001F600!",
    "The three primary colors are",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three planets."}],
    [{"role": "user", "content": "What is 12 times 7?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
]
NLL_TEXT = "/usr/share/common-licenses/Apache-2.0"


def greedy(model, ids, steps):
    cache = []
    logits = model.forward(ids, cache, 0)[-1]
    out, top = [], []
    pos = len(ids)
    for _ in range(steps):
        order = np.argsort(-logits, kind="stable")[:5]
        top.append({"ids": [int(i) for i in order], "logits": [float(logits[i]) for i in order],
                    "margin": float(logits[order[0]] - logits[order[1]])})
        nxt = int(order[0])
        out.append(nxt)
        logits = model.forward([nxt], cache, pos)[-1]
        pos += 1
    return out, top


def cmd_goldens(args):
    g = Gguf(args.model)
    tk = make_tokenizer(g)
    model = Model(g)
    template = g.value("tokenizer.chat_template")
    tokens = g.value("tokenizer.ggml.tokens")
    bos = g.value("tokenizer.ggml.bos_token_id")
    eos = g.value("tokenizer.ggml.eos_token_id")
    prompts = []
    for p in PLAIN_PROMPTS:
        prompts.append({"kind": "plain", "prompt": p, "ids": encode(tk, p)})
    for m in CHATS:
        text = render_chat(template, m, tokens[bos] if bos is not None else "", tokens[eos])
        prompts.append({"kind": "chat", "messages": m, "prompt": text, "ids": encode(tk, text)})
    for p in prompts:
        p["greedy"], p["top5"] = greedy(model, p["ids"], args.steps)
        print(f"{p['kind']}: {len(p['ids'])} ids; continuation {tk.decode(p['greedy'])!r}", file=sys.stderr)
    raw = open(NLL_TEXT, "rb").read()
    ids = encode(tk, raw.decode("utf-8"))[: args.nll_tokens]
    logits = model.forward(ids, [], 0)
    nll = -np.mean([log_softmax(logits[i])[ids[i + 1]] for i in range(len(ids) - 1)])
    print(f"nll over {len(ids)} tokens: {nll:.6f}", file=sys.stderr)
    out = {
        "generator": "tools/reference.py (float64 numpy; gguf 0.19.0, tokenizers 0.23.3, Jinja2 3.1.6)",
        "model": {"file": args.model.split("/")[-1], "sha256": hashlib.sha256(open(args.model, "rb").read()).hexdigest()},
        "conventions": ("ids: the prompt encoded with special tokens parsed and no BOS (the model's add_bos_token is "
                        "false); chat prompts are the GGUF's chat template rendered with add_generation_prompt; "
                        "greedy: the next token is the argmax of the last logits, repeated, each step's top5 "
                        "before choosing; nll: mean of -log p(token i+1 | tokens 0..i) over the first nll_tokens "
                        "tokens of the text file, in one forward pass from position 0"),
        "prompts": prompts,
        "nll": {"file": NLL_TEXT, "sha256": hashlib.sha256(raw).hexdigest(), "tokens": len(ids), "ids": ids,
                "mean_nll": float(nll)},
    }
    with open(args.out, "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


def cmd_logits(args):
    """Logits of every position of a token sequence, for the rows asked."""
    g = Gguf(args.model)
    model = load_model(g)
    ids = json.loads(args.ids)
    logits = model.forward(ids, [], 0)
    rows = [int(r) % len(ids) for r in args.rows.split(",")]
    print(json.dumps({"rows": rows, "logits": [[float(x) for x in logits[r]] for r in rows]}))


def cmd_tokenize(args):
    g = Gguf(args.model)
    tk = make_tokenizer(g)
    print(json.dumps(encode(tk, args.text)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    gp = sub.add_parser("goldens")
    gp.add_argument("--model", required=True)
    gp.add_argument("--out", required=True)
    gp.add_argument("--steps", type=int, default=64)
    gp.add_argument("--nll-tokens", type=int, default=2048)
    tp = sub.add_parser("tokenize")
    tp.add_argument("--model", required=True)
    tp.add_argument("--text", required=True)
    lp = sub.add_parser("logits")
    lp.add_argument("--model", required=True)
    lp.add_argument("--ids", required=True, help="a JSON array of token ids")
    lp.add_argument("--rows", default="-1", help="positions whose logits to print, e.g. 0,47,-1")
    args = ap.parse_args()
    {"goldens": cmd_goldens, "tokenize": cmd_tokenize, "logits": cmd_logits}[args.cmd](args)


if __name__ == "__main__":
    main()
