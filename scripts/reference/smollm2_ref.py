#!/usr/bin/env python3
"""Independent numpy reference of the SmolLM2 (llama architecture) forward pass, and of the other
decoder families metashard runs (qwen2, qwen3, gemma2, gemma3, phi3, and the mixtures of
experts qwen3moe, qwen2moe, olmoe and Mixtral).

metashard's Rust tests call this script as a subprocess and compare their logits and
greedy tokens with what it prints. It shares no code with metashard: it reads the GGUF
file with the `gguf` PyPI package (GGUFReader + gguf.quants.dequantize), dequantizes
every weight once to float32 (or float64 with --dtype f64) and runs the decoder in numpy.

Sources of the facts used here (formats and algorithms only, no code taken):
  * GGUF layout and tensor naming: ggml's docs/gguf.md and gguf-py's constants.
  * llama forward: RMSNorm -> attention with RoPE and grouped-query heads -> residual ->
    RMSNorm -> SwiGLU feed-forward -> residual; final RMSNorm; output projection.
  * qwen2 (Hugging Face's Qwen2 modelling: q_proj/k_proj/v_proj with biases, o_proj without;
    RoPE by rotate_half, i.e. pairs (x[i], x[i + n_rot/2]): llama.cpp's LLAMA_ROPE_TYPE_NEOX).
    Biases are added wherever the file has them (llama files may carry them too).
  * llama with rope_freqs.weight (Llama 3.1 and later): each pair's frequency divided by its
    factor, as llama.cpp's ggml_rope_ext applies the tensor the converter computes from
    Hugging Face's rope_scaling "llama3".
  * qwen3 (Hugging Face's Qwen3: q_norm / k_norm, an RMS norm over each head's features
    before RoPE; head size from qwen3.attention.key_length; NeoX RoPE).
  * gemma2 / gemma3 (Hugging Face's Gemma2 / Gemma3 text modelling, llama.cpp's hparams):
    embeddings times sqrt(n_embd); post_attention_norm / post_ffw_norm on each block's output
    before the residual add; MLP gelu_tanh(gate) * up; NeoX RoPE; attention scale
    1/sqrt(head_dim) (1/sqrt(n_embd/n_head) for the 27B models: 46 layers for gemma2, 62 for
    gemma3); sliding-window attention (a token sees the last `window` positions) on layers
    l with l % pattern < pattern - 1 (gemma2: pattern 2, window 4096 unless the file says,
    one RoPE base; gemma3: pattern 6, the file's window, local RoPE base 10000); gemma2 also
    soft-caps the attention scores and the logits, cap * tanh(x / cap). GGUF stores Gemma's
    RMS norm weights with the 1 + w already added, so they multiply as any other.
  * phi3 (Hugging Face's Phi3 modelling; llama.cpp's LLM_ARCH_PHI3 tensors): llama's layer
    with Q | K | V in one matrix (attn_qkv, ne = [n_embd, (n_head + 2 n_head_kv) head_dim],
    rows Q then K then V) and gate | up in one matrix named ffn_up (ne = [n_embd, 2 n_ff],
    gate rows first: silu(gate) * up, HF's `gate, up = up_states.chunk(2)`); NeoX RoPE over
    phi3.rope.dimension_count dims of each head (partial rotary: the rest pass through);
    with phi3.attention.sliding_window, every layer attends through the window (HF's mask);
    LongRoPE (rope_factors_long/short): HF's Phi-3 LongRoPE, inv_freq / factor and cos, sin
    times phi3.rope.scaling.attn_factor, with llama.cpp's choice of factors: the long ones
    when the context (here the cache: prompt + steps + 1) exceeds
    phi3.rope.scaling.original_context_length, the short ones otherwise.
  * mixtures of experts (Hugging Face's Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock,
    MixtralSparseMoeBlock; llama.cpp's build_moe_ffn and tensor names ffn_gate_inp,
    ffn_{gate,up,down}_exps with ne = [n_embd, n_ff_exp, n_expert] (down: [n_ff_exp, n_embd,
    n_expert]), ffn_*_shexp, ffn_gate_inp_shexp): router probabilities softmax(W_r h) over
    all experts, the {arch}.expert_used_count largest per token, their probabilities as
    weights, divided by their sum for qwen3moe and Mixtral (norm_topk_prob; the file's
    {arch}.expert_weights_norm when present), not for qwen2moe; each selected expert's SwiGLU
    output times its weight, summed; qwen2moe adds its shared expert's SwiGLU output times
    sigmoid(w_shexp_gate . h). Mixtral is a llama file with llama.expert_count > 0; files
    written before the 3-D expert tensors hold one 2-D tensor per expert,
    blk.N.ffn_{gate,up,down}.E.weight (llama.cpp's LLM_TENSOR_FFN_*_EXP), stacked here.
  * olmoe (Hugging Face's OlmoeAttention and OlmoeSparseMoeBlock; llama.cpp's LLM_ARCH_OLMOE):
    no biases; q_norm / k_norm are RMS norms over the whole Q projection (n_head * head_dim)
    and the whole K projection (n_head_kv * head_dim), applied before the split into heads;
    NeoX RoPE; experts as above with norm_topk_prob False (weights not divided by their sum).
  * llama.cpp runs LLM_ARCH_LLAMA with LLAMA_ROPE_TYPE_NORM: the HF->GGUF converter
    permutes the rows of Q and K so that the rotation acts on ADJACENT pairs
    (x[2i], x[2i+1]) of each head, theta_i = pos * base^(-2i / n_rot).
    This was checked here: the adjacent-pair mode produces coherent text, the NeoX
    (half-split) mode does not (see scripts/reference/README.md).

Shape convention (write it down once, it matters):
  GGUF/ggml lists a tensor's shape as ne = [ne0, ne1, ...] with ne0 the contiguous
  (fastest) axis. numpy arrays from GGUFReader / dequantize come REVERSED, i.e.
  (ne1, ne0) for a matrix. A llama linear weight has ne = [n_in, n_out], so its numpy
  array is (n_out, n_in) and y = x @ W.T. token_embd has ne = [n_embd, n_vocab], so its
  numpy array is (n_vocab, n_embd): one row per token id, and (tied output) the logits
  are h @ token_embd.T.

Output: JSON on stdout, diagnostics on stderr, exit status 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np


def log(msg: str) -> None:
    print(f"smollm2_ref: {msg}", file=sys.stderr, flush=True)


class RefError(Exception):
    """Bad input or a model file that does not match what this reference expects."""


# ---------------------------------------------------------------------------------------
# GGUF loading
# ---------------------------------------------------------------------------------------


@dataclass
class HParams:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    rms_eps: float
    n_vocab: int
    n_ctx_train: int
    attn_scale: float = 0.0  # 0: 1/sqrt(head_dim)
    embd_scale: float = 1.0
    swa_window: int = 0  # 0: no sliding window
    swa_pattern: int = 0
    swa_rope_base: float = 0.0
    attn_softcap: float = 0.0  # 0: none
    final_softcap: float = 0.0
    gelu: bool = False  # the MLP's gate activation: tanh GELU (Gemma) or SiLU
    rope_factors: np.ndarray | None = None  # Llama 3's rope_freqs: pair i's angle / factor i
    rope_mscale: float = 1.0  # LongRoPE's attention factor on cos and sin
    long_rope: tuple | None = None  # (long, short, original context) of Phi-3's LongRoPE
    n_expert: int = 0  # a mixture of experts when > 0
    n_expert_used: int = 0
    moe_norm: bool = True  # the selected experts' weights divided by their sum
    router_log: list | None = None  # per experts_ffn call (layer), each token's chosen experts


@dataclass
class Layer:
    attn_norm: np.ndarray  # (n_embd,)
    wq: np.ndarray  # (n_head*head_dim, n_embd)       ggml ne = [n_embd, n_head*head_dim]
    wk: np.ndarray  # (n_head_kv*head_dim, n_embd)    ggml ne = [n_embd, n_head_kv*head_dim]
    wv: np.ndarray  # (n_head_kv*head_dim, n_embd)
    wo: np.ndarray  # (n_embd, n_head*head_dim)       ggml ne = [n_head*head_dim, n_embd]
    ffn_norm: np.ndarray  # (n_embd,)
    w_gate: np.ndarray | None  # (n_ff, n_embd)       ggml ne = [n_embd, n_ff]; None: experts
    w_up: np.ndarray | None  # (n_ff, n_embd)
    w_down: np.ndarray | None  # (n_embd, n_ff)      ggml ne = [n_ff, n_embd]
    bq: np.ndarray | None = None  # (n_head*head_dim,)  biases where the file has them
    bk: np.ndarray | None = None  # (n_head_kv*head_dim,)
    bv: np.ndarray | None = None
    bo: np.ndarray | None = None  # (n_embd,)
    q_norm: np.ndarray | None = None  # (head_dim,)  per-head norms where the file has them
    k_norm: np.ndarray | None = None
    q_norm_full: np.ndarray | None = None  # (n_head*head_dim,)  over the whole projection (olmoe)
    k_norm_full: np.ndarray | None = None  # (n_head_kv*head_dim,)
    post_attn_norm: np.ndarray | None = None  # (n_embd,)  post-block norms (Gemma)
    post_ffw_norm: np.ndarray | None = None
    moe: dict | None = None  # the experts' arrays (see load_experts)


@dataclass
class Model:
    arch: str
    hp: HParams
    tok_embd: np.ndarray  # (n_vocab, n_embd), also the output matrix (tied)
    output: np.ndarray  # (n_vocab, n_embd): output.weight if present, else tok_embd
    output_norm: np.ndarray  # (n_embd,)
    layers: list[Layer]
    tokens: list[bytes] = field(default_factory=list)  # GGUF vocab strings (UTF-8 bytes)
    token_types: list[int] = field(default_factory=list)
    merges: list[str] = field(default_factory=list)
    special: dict = field(default_factory=dict)


def _field_scalar(reader, key: str, required: bool = True):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise RefError(f"GGUF metadata key '{key}' is missing")
        return None
    # Scalars: the last part holds the value (a 1-element numpy array).
    return f.parts[f.data[0]][0].item() if len(f.data) == 1 else None


def _field_str(reader, key: str) -> str | None:
    f = reader.fields.get(key)
    if f is None:
        return None
    return bytes(f.parts[f.data[0]]).decode("utf-8")


def _field_str_array(reader, key: str) -> list[bytes]:
    f = reader.fields.get(key)
    if f is None:
        return []
    return [bytes(f.parts[i]) for i in f.data]


def load_model(path: str, dtype, want_vocab: bool) -> Model:
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError as e:
        raise RefError(f"the 'gguf' package is needed (pip install -r scripts/requirements.txt): {e}")

    t0 = time.time()
    try:
        reader = GGUFReader(path, "r")
    except FileNotFoundError:
        raise RefError(f"model file not found: {path}")
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad model file
        raise RefError(f"cannot parse GGUF file {path}: {e}")

    arch = _field_str(reader, "general.architecture")
    archs = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe", "qwen2moe", "olmoe")
    if arch not in archs:
        raise RefError(f"{path}: general.architecture is '{arch}', this reference handles {', '.join(archs)}")

    def u(key, required=True):
        return _field_scalar(reader, f"{arch}.{key}", required)

    n_embd = int(u("embedding_length"))
    n_head = int(u("attention.head_count"))
    n_head_kv = int(u("attention.head_count_kv", False) or n_head)
    head_dim = int(u("attention.key_length", False) or n_embd // n_head)
    n_rot = int(u("rope.dimension_count", False) or head_dim)
    tensors = {t.name: t for t in reader.tensors}
    tok_t = tensors.get("token_embd.weight")
    if tok_t is None:
        raise RefError(f"{path}: tensor 'token_embd.weight' is missing")
    n_vocab_meta = u("vocab_size", False)
    # ggml ne = [n_embd, n_vocab]; the vocab count is ne1.
    n_vocab = int(tok_t.shape[1])
    if n_vocab_meta is not None and int(n_vocab_meta) != n_vocab:
        raise RefError(f"{path}: llama.vocab_size={n_vocab_meta} but token_embd.weight has ne1={n_vocab}")
    hp = HParams(
        n_layer=int(u("block_count")),
        n_embd=n_embd,
        n_ff=int(u("feed_forward_length", False) or u("expert_feed_forward_length", False) or 0),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_rot=n_rot,
        rope_base=float(u("rope.freq_base", False) or 10000.0),
        rms_eps=float(u("attention.layer_norm_rms_epsilon")),
        n_vocab=n_vocab,
        n_ctx_train=int(u("context_length", False) or 0),
    )
    hp.n_expert = int(u("expert_count", False) or 0)
    if hp.n_expert:
        hp.n_expert_used = int(u("expert_used_count"))
        norm = u("expert_weights_norm", False)
        hp.moe_norm = bool(norm) if norm is not None else arch not in ("qwen2moe", "olmoe")
    gemma = arch in ("gemma2", "gemma3")
    if gemma:
        hp.gelu = True
        hp.embd_scale = math.sqrt(n_embd)
        large = {"gemma2": 46, "gemma3": 62}[arch]
        hp.attn_scale = 1.0 / math.sqrt(n_embd / n_head if hp.n_layer == large else head_dim)
        if arch == "gemma2":
            hp.swa_window = int(u("attention.sliding_window", False) or 4096)
            hp.swa_pattern, hp.swa_rope_base = 2, hp.rope_base
            hp.attn_softcap = float(u("attn_logit_softcapping", False) or 0.0)
            hp.final_softcap = float(u("final_logit_softcapping", False) or 0.0)
        else:
            hp.swa_window = int(u("attention.sliding_window"))
            hp.swa_pattern, hp.swa_rope_base = 6, 10000.0
    if arch == "phi3":
        hp.swa_window = int(u("attention.sliding_window", False) or 0)
        hp.swa_pattern, hp.swa_rope_base = 0, hp.rope_base  # pattern 0: every layer
        have = [t in tensors for t in ("rope_factors_long.weight", "rope_factors_short.weight")]
        if any(have) and not all(have):
            raise RefError(f"{path}: LongRoPE needs both rope_factors_long and rope_factors_short")
    if head_dim * n_head != n_embd and u("attention.key_length", False) is None:
        raise RefError(f"{path}: {n_head} heads do not divide the width {n_embd}")
    if n_head % n_head_kv or n_rot > head_dim or n_rot % 2:
        raise RefError(f"{path}: inconsistent head metadata {hp}")
    log(f"parsed {path} in {time.time() - t0:.2f}s: {hp}")

    t1 = time.time()

    def get(name: str, ne: list[int]) -> np.ndarray:
        t = tensors.get(name)
        if t is None:
            raise RefError(f"{path}: tensor '{name}' is missing")
        got = [int(x) for x in t.shape]
        if got != ne:
            raise RefError(f"{path}: tensor '{name}' has ggml shape {got}, expected {ne}")
        a = dequantize(t.data, t.tensor_type)
        # numpy shape is ggml ne reversed
        a = np.ascontiguousarray(a.reshape(tuple(reversed(ne))), dtype=dtype)
        return a

    E, F, HD = hp.n_embd, hp.n_ff, hp.head_dim

    def opt(name: str, ne: list[int]):
        return get(name, ne) if name in tensors else None

    def attn_qkv(p: str):
        """Q, K, V weights: three tensors, or the rows of Phi-3's fused attn_qkv."""
        Q, KVW = hp.n_head * HD, hp.n_head_kv * HD
        # Phi-3 files may hold three tensors too (llama.cpp's llama-model.cpp loads attn_qkv
        # as not required for LLM_ARCH_PHI3, then attn_q / attn_k / attn_v).
        if arch != "phi3" or p + "attn_qkv.weight" not in tensors:
            return (
                get(p + "attn_q.weight", [E, Q]),
                get(p + "attn_k.weight", [E, KVW]),
                get(p + "attn_v.weight", [E, KVW]),
            )
        w = get(p + "attn_qkv.weight", [E, Q + 2 * KVW])
        return w[:Q], w[Q : Q + KVW], w[Q + KVW :]

    def gate_up(p: str):
        """Gate and up weights: two tensors, or the halves of Phi-3's fused ffn_up."""
        if arch != "phi3":
            return get(p + "ffn_gate.weight", [E, F]), get(p + "ffn_up.weight", [E, F])
        w = get(p + "ffn_up.weight", [E, 2 * F])
        return w[:F], w[F:]

    def experts(p: str, base: str, ne: list[int]) -> np.ndarray:
        """A role's experts: the 3-D tensor, or (files written before it) one 2-D tensor per
        expert, blk.N.<base>.E.weight (llama.cpp's LLM_TENSOR_FFN_*_EXP), stacked."""
        if p + base + "_exps.weight" in tensors or p + base + ".0.weight" not in tensors:
            return get(p + base + "_exps.weight", ne)
        return np.stack([get(f"{p}{base}.{x}.weight", ne[:2]) for x in range(ne[2])])

    def load_experts(p: str) -> dict:
        X = hp.n_expert
        FX = int(u("expert_feed_forward_length", False) or F)
        e = {
            "router": get(p + "ffn_gate_inp.weight", [E, X]),  # (X, E)
            "gate": experts(p, "ffn_gate", [E, FX, X]),  # (X, FX, E)
            "up": experts(p, "ffn_up", [E, FX, X]),
            "down": experts(p, "ffn_down", [FX, E, X]),  # (X, E, FX)
        }
        if arch == "qwen2moe":
            FS = int(u("expert_shared_feed_forward_length"))
            e["shexp_gate_inp"] = get(p + "ffn_gate_inp_shexp.weight", [E])
            e["shexp_gate"] = get(p + "ffn_gate_shexp.weight", [E, FS])
            e["shexp_up"] = get(p + "ffn_up_shexp.weight", [E, FS])
            e["shexp_down"] = get(p + "ffn_down_shexp.weight", [FS, E])
        return e

    layers = []
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        wq, wk, wv = attn_qkv(p)
        w_gate, w_up = gate_up(p) if not hp.n_expert else (None, None)
        if arch in ("qwen2", "qwen2moe"):
            for b in ("attn_q.bias", "attn_k.bias", "attn_v.bias"):
                if p + b not in tensors:
                    raise RefError(f"{path}: qwen2 tensor '{p + b}' is missing")
        layers.append(
            Layer(
                attn_norm=get(p + "attn_norm.weight", [E]),
                wq=wq,
                wk=wk,
                wv=wv,
                wo=get(p + "attn_output.weight", [hp.n_head * HD, E]),
                ffn_norm=get(p + "ffn_norm.weight", [E]),
                w_gate=w_gate,
                w_up=w_up,
                w_down=get(p + "ffn_down.weight", [F, E]) if not hp.n_expert else None,
                bq=opt(p + "attn_q.bias", [hp.n_head * HD]),
                bk=opt(p + "attn_k.bias", [hp.n_head_kv * HD]),
                bv=opt(p + "attn_v.bias", [hp.n_head_kv * HD]),
                bo=opt(p + "attn_output.bias", [E]),
                q_norm=opt(p + "attn_q_norm.weight", [HD]) if arch != "olmoe" else None,
                k_norm=opt(p + "attn_k_norm.weight", [HD]) if arch != "olmoe" else None,
                q_norm_full=get(p + "attn_q_norm.weight", [hp.n_head * HD]) if arch == "olmoe" else None,
                k_norm_full=get(p + "attn_k_norm.weight", [hp.n_head_kv * HD]) if arch == "olmoe" else None,
                post_attn_norm=opt(p + "post_attention_norm.weight", [E]),
                post_ffw_norm=opt(p + "post_ffw_norm.weight", [E]),
                moe=load_experts(p) if hp.n_expert else None,
            )
        )
    tok_embd = get("token_embd.weight", [E, hp.n_vocab])
    output = get("output.weight", [E, hp.n_vocab]) if "output.weight" in tensors else tok_embd
    if output is tok_embd:
        log("output.weight absent: output projection is tied to token_embd.weight")
    output_norm = get("output_norm.weight", [E])
    if "rope_freqs.weight" in tensors:
        hp.rope_factors = get("rope_freqs.weight", [hp.n_rot // 2]).astype(np.float64)
    if arch == "phi3" and "rope_factors_long.weight" in tensors:
        long_f = get("rope_factors_long.weight", [hp.n_rot // 2]).astype(np.float64)
        short_f = get("rope_factors_short.weight", [hp.n_rot // 2]).astype(np.float64)
        orig = int(u("rope.scaling.original_context_length", False) or hp.n_ctx_train)
        hp.long_rope = (long_f, short_f, orig)
        hp.rope_mscale = float(u("rope.scaling.attn_factor", False) or 1.0)
    log(f"dequantized weights to {np.dtype(dtype).name} in {time.time() - t1:.2f}s")

    m = Model(arch=arch, hp=hp, tok_embd=tok_embd, output=output, output_norm=output_norm, layers=layers)
    if want_vocab:
        m.tokens = _field_str_array(reader, "tokenizer.ggml.tokens")
        f = reader.fields.get("tokenizer.ggml.token_type")
        m.token_types = [int(f.parts[i][0]) for i in f.data] if f is not None else []
        m.merges = [b.decode("utf-8") for b in _field_str_array(reader, "tokenizer.ggml.merges")]
        for k in ("bos", "eos", "padding", "unknown"):
            v = _field_scalar(reader, f"tokenizer.ggml.{k}_token_id", False)
            if v is not None:
                m.special[k] = int(v)
    return m


# ---------------------------------------------------------------------------------------
# Forward pass
# ---------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # x * w / sqrt(mean(x^2) + eps), over the embedding axis
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps)) * w


def rope_tables(hp: HParams, positions: np.ndarray, dtype, base: float | None = None):
    # theta_i = pos * base^(-2i/n_rot), i = 0 .. n_rot/2-1 (computed in float64, then cast)
    i = np.arange(hp.n_rot // 2, dtype=np.float64)
    inv_freq = (hp.rope_base if base is None else base) ** (-2.0 * i / hp.n_rot)
    if hp.rope_factors is not None:
        inv_freq = inv_freq / hp.rope_factors
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # (n, n_rot/2)
    m = hp.rope_mscale
    return (m * np.cos(ang)).astype(dtype), (m * np.sin(ang)).astype(dtype)


def rope_norm(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int) -> np.ndarray:
    """ggml 'normal' RoPE: rotate adjacent pairs (x[2i], x[2i+1]) of the first n_rot dims.

    x: (n_tokens, n_heads, head_dim); cos/sin: (n_tokens, n_rot/2).
    """
    out = x.copy()
    x0 = x[..., 0:n_rot:2]
    x1 = x[..., 1:n_rot:2]
    c = cos[:, None, :]
    s = sin[:, None, :]
    out[..., 0:n_rot:2] = x0 * c - x1 * s
    out[..., 1:n_rot:2] = x0 * s + x1 * c
    return out


def rope_neox(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int) -> np.ndarray:
    """NeoX RoPE (pairs (x[i], x[i + n_rot/2])): qwen2, and the --rope neox experiment."""
    out = x.copy()
    h = n_rot // 2
    x0 = x[..., 0:h]
    x1 = x[..., h:n_rot]
    c = cos[:, None, :]
    s = sin[:, None, :]
    out[..., 0:h] = x0 * c - x1 * s
    out[..., h:n_rot] = x0 * s + x1 * c
    return out


class KVCache:
    def __init__(self, hp: HParams, n_ctx: int, dtype):
        shape = (hp.n_layer, hp.n_head_kv, n_ctx, hp.head_dim)
        self.k = np.zeros(shape, dtype=dtype)
        self.v = np.zeros(shape, dtype=dtype)
        self.n_ctx = n_ctx
        self.n_past = 0


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    # GELU with the tanh approximation (Hugging Face's gelu_pytorch_tanh).
    c = x.dtype.type(math.sqrt(2.0 / math.pi))
    return x.dtype.type(0.5) * x * (1.0 + np.tanh(c * (x + x.dtype.type(0.044715) * x * x * x)))


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    return x.dtype.type(cap) * np.tanh(x / x.dtype.type(cap))


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    y = x @ w.T
    return y if b is None else y + b


def experts_ffn(hp: HParams, e: dict, h: np.ndarray) -> np.ndarray:
    """A mixture of SwiGLU experts over h (n, E), token by token."""
    logits = h @ e["router"].T  # (n, X)
    z = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        top = np.argsort(-probs[t], kind="stable")[: hp.n_expert_used]
        if hp.router_log is not None:
            if t == 0:
                hp.router_log.append([])
            hp.router_log[-1].append([int(x) for x in top])
        w = probs[t, top]
        if hp.moe_norm:
            w = w / w.sum()
        for x, wx in zip(top, w):
            y = (silu(e["gate"][x] @ h[t]) * (e["up"][x] @ h[t])) @ e["down"][x].T
            out[t] += wx * y
    if "shexp_gate" in e:
        s = (silu(h @ e["shexp_gate"].T) * (h @ e["shexp_up"].T)) @ e["shexp_down"].T
        g = 1.0 / (1.0 + np.exp(-(h @ e["shexp_gate_inp"])))  # (n,)
        out += s * g[:, None]
    return out


def forward(m: Model, cache: KVCache, tokens: list[int], rope_mode: str = "norm") -> np.ndarray:
    """Run `tokens` at positions n_past.. through the model; return logits (n, n_vocab)."""
    hp = m.hp
    n = len(tokens)
    p0 = cache.n_past
    if p0 + n > cache.n_ctx:
        raise RefError(f"KV cache overflow: {p0} + {n} > {cache.n_ctx}")
    dtype = m.tok_embd.dtype
    H, KV, HD = hp.n_head, hp.n_head_kv, hp.head_dim
    G = H // KV  # query heads per kv head: query head h uses kv head h // G
    scale = dtype.type(hp.attn_scale or 1.0 / math.sqrt(HD))
    rope = rope_norm if rope_mode == "norm" else rope_neox

    positions = np.arange(p0, p0 + n)
    cos, sin = rope_tables(hp, positions, dtype)
    if hp.swa_window:
        cos_l, sin_l = rope_tables(hp, positions, dtype, hp.swa_rope_base)
    T = p0 + n  # keys visible after this batch
    # causal mask: query at position p0+i sees keys 0..p0+i; a local layer only the last
    # `window` of them
    key_pos = np.arange(T)
    masked_global = key_pos[None, :] > positions[:, None]  # (n, T)
    masked_local = masked_global | (positions[:, None] - key_pos[None, :] >= max(hp.swa_window, 1))

    x = m.tok_embd[np.asarray(tokens)] * dtype.type(hp.embd_scale)  # (n, E)
    for li, L in enumerate(m.layers):
        # pattern 0: every layer is local (llama.cpp's set_swa_pattern)
        local = hp.swa_window > 0 and (hp.swa_pattern == 0 or li % hp.swa_pattern < hp.swa_pattern - 1)
        masked = masked_local if local else masked_global
        c_, s_ = (cos_l, sin_l) if local else (cos, sin)
        h = rms_norm(x, L.attn_norm, hp.rms_eps)
        q = linear(h, L.wq, L.bq)
        k = linear(h, L.wk, L.bk)
        if L.q_norm_full is not None:
            q = rms_norm(q, L.q_norm_full, hp.rms_eps)
        if L.k_norm_full is not None:
            k = rms_norm(k, L.k_norm_full, hp.rms_eps)
        q = q.reshape(n, H, HD)  # head h = columns h*HD .. (h+1)*HD
        k = k.reshape(n, KV, HD)
        v = linear(h, L.wv, L.bv).reshape(n, KV, HD)
        if L.q_norm is not None:
            q = rms_norm(q, L.q_norm, hp.rms_eps)
        if L.k_norm is not None:
            k = rms_norm(k, L.k_norm, hp.rms_eps)
        q = rope(q, c_, s_, hp.n_rot)
        k = rope(k, c_, s_, hp.n_rot)
        cache.k[li, :, p0:T, :] = k.transpose(1, 0, 2)
        cache.v[li, :, p0:T, :] = v.transpose(1, 0, 2)
        K = cache.k[li, :, :T, :]  # (KV, T, HD)
        V = cache.v[li, :, :T, :]
        # (H, n, HD) -> (KV, G*n, HD): the G query heads of kv group g are heads g*G .. g*G+G-1
        qg = q.transpose(1, 0, 2).reshape(KV, G * n, HD)
        s = (qg @ K.transpose(0, 2, 1)) * scale  # (KV, G*n, T)
        if hp.attn_softcap:
            s = softcap(s, hp.attn_softcap)
        s = s.reshape(KV, G, n, T)
        s = np.where(masked[None, None], -np.inf, s)
        s = s - s.max(axis=-1, keepdims=True)
        pr = np.exp(s)
        pr /= pr.sum(axis=-1, keepdims=True)
        o = pr.reshape(KV, G * n, T) @ V  # (KV, G*n, HD)
        o = o.reshape(H, n, HD).transpose(1, 0, 2).reshape(n, H * HD)
        a = linear(o, L.wo, L.bo)
        if L.post_attn_norm is not None:
            a = rms_norm(a, L.post_attn_norm, hp.rms_eps)
        x = x + a
        h = rms_norm(x, L.ffn_norm, hp.rms_eps)
        act = gelu_tanh if hp.gelu else silu
        if L.moe is not None:
            ff = experts_ffn(hp, L.moe, h)
        else:
            ff = (act(h @ L.w_gate.T) * (h @ L.w_up.T)) @ L.w_down.T
        if L.post_ffw_norm is not None:
            ff = rms_norm(ff, L.post_ffw_norm, hp.rms_eps)
        x = x + ff
    cache.n_past = T
    x = rms_norm(x, m.output_norm, hp.rms_eps)
    logits = x @ m.output.T
    return softcap(logits, hp.final_softcap) if hp.final_softcap else logits


# ---------------------------------------------------------------------------------------
# Byte-level BPE vocabulary helpers (human checks only)
# ---------------------------------------------------------------------------------------


def byte_unicode_table() -> dict[str, int]:
    """GPT-2 byte-level alphabet, inverted: unicode char -> byte value.

    Bytes that are printable Latin-1 ('!'..'~', 0xA1..0xAC, 0xAE..0xFF) stand for
    themselves; the remaining 68 bytes map, in increasing order, to U+0100, U+0101, ...
    """
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def detokenize(m: Model, ids: list[int]) -> str:
    inv = byte_unicode_table()
    out = bytearray()
    for t in ids:
        s = m.tokens[t].decode("utf-8")
        if m.token_types and m.token_types[t] == 3:  # control token: emit its text as is
            out += s.encode("utf-8")
            continue
        for ch in s:
            if ch not in inv:
                raise RefError(f"token {t} ({s!r}) has char {ch!r} outside the byte-level alphabet")
            out.append(inv[ch])
    return out.decode("utf-8", errors="replace")


def build_tokenizer(m: Model):
    """A HF `tokenizers` byte-level BPE built from the GGUF vocab and merges.

    Pre-tokenization for tokenizer.ggml.pre = "smollm" (llama.cpp llama-vocab.cpp): split
    every digit on its own, then the GPT-2 regex; no prefix space.
    """
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError as e:
        raise RefError(f"--text needs the 'tokenizers' package: {e}")
    vocab = {t.decode("utf-8"): i for i, t in enumerate(m.tokens)}
    merges = [tuple(mm.split(" ")) for mm in m.merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [m.tokens[i].decode("utf-8") for i, ty in enumerate(m.token_types) if ty == 3]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def parse_tokens(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.split(",") if x.strip() != ""]
    except ValueError:
        raise RefError(f"--tokens must be comma-separated integers, got {s!r}")
    return ids


def write_f32(path: str, rows: list[np.ndarray]) -> None:
    arr = np.stack(rows).astype("<f4", copy=False)
    with open(path, "wb") as f:
        f.write(arr.tobytes())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="path to the SmolLM2 GGUF file")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="prompt token ids, comma-separated")
    src.add_argument("--text", help="prompt text, tokenized with a BPE built from the GGUF vocab")
    src.add_argument("--chat", help="user message wrapped in the ChatML template (default system prompt)")
    ap.add_argument("--steps", type=int, default=0, help="greedy tokens to generate (default 0)")
    ap.add_argument("--logits-out", help="write float32 LE logits of the last prompt position")
    ap.add_argument(
        "--all-logits-out",
        help="write (steps+1) float32 LE rows: logits at the last prompt position, then at each "
        "generated token's input position",
    )
    ap.add_argument("--prompt-logits-out", help="write float32 LE logits of every prompt position")
    ap.add_argument(
        "--router-out",
        help="write JSON: per layer, each prompt token's chosen experts (by falling probability)",
    )
    ap.add_argument("--dtype", choices=("f32", "f64"), default="f32")
    ap.add_argument("--detok", action="store_true", help="add the decoded text to the JSON")
    ap.add_argument("--rope", choices=("norm", "neox"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.steps < 0:
        raise RefError(f"--steps must be >= 0, got {args.steps}")
    dtype = np.float32 if args.dtype == "f32" else np.float64
    prompt: list[int] = []
    if args.tokens is not None:
        prompt = parse_tokens(args.tokens)  # fail fast, before the slow model load
        if not prompt:
            raise RefError("the prompt is empty")
    need_vocab = args.detok or args.text is not None or args.chat is not None
    t0 = time.time()
    m = load_model(args.model, dtype, need_vocab)
    t_load = time.time() - t0
    if args.rope is None:
        # The pairing each family's GGUF files need (see the module docstring).
        args.rope = "norm" if m.arch == "llama" else "neox"

    if args.tokens is None:
        text = args.text
        if args.chat is not None:
            text = (
                "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                "Hugging Face<|im_end|>\n<|im_start|>user\n" + args.chat + "<|im_end|>\n"
                "<|im_start|>assistant\n"
            )
        prompt = build_tokenizer(m).encode(text, add_special_tokens=False).ids
    if not prompt:
        raise RefError("the prompt is empty")
    bad = [t for t in prompt if t < 0 or t >= m.hp.n_vocab]
    if bad:
        raise RefError(f"prompt token ids out of range [0, {m.hp.n_vocab}): {bad[:8]}")

    n_ctx = len(prompt) + args.steps + 1
    if m.hp.n_ctx_train and n_ctx > m.hp.n_ctx_train:
        raise RefError(f"prompt + steps = {n_ctx} exceeds the training context {m.hp.n_ctx_train}")
    cache = KVCache(m.hp, n_ctx, dtype)
    if m.hp.long_rope is not None:
        long_f, short_f, orig = m.hp.long_rope
        m.hp.rope_factors = long_f if n_ctx > orig else short_f

    t1 = time.time()
    if args.router_out:
        m.hp.router_log = []
    logits = forward(m, cache, prompt, args.rope)
    t_prompt = time.time() - t1
    if args.router_out:
        with open(args.router_out, "w") as f:
            json.dump(m.hp.router_log, f)
        m.hp.router_log = None
    last = logits[-1]
    rows = [last]
    generated: list[int] = []
    t2 = time.time()
    if args.steps > 0:
        nxt = int(np.argmax(last))
        for step in range(args.steps):
            generated.append(nxt)
            # the input position of the last generated token is only needed for --all-logits-out
            if step == args.steps - 1 and not args.all_logits_out:
                break
            lg = forward(m, cache, [nxt], args.rope)[-1]
            rows.append(lg)
            nxt = int(np.argmax(lg))
    t_gen = time.time() - t2

    if args.logits_out:
        write_f32(args.logits_out, [last])
    if args.all_logits_out:
        write_f32(args.all_logits_out, rows)
    if args.prompt_logits_out:
        write_f32(args.prompt_logits_out, list(logits))

    out = {
        "prompt_tokens": prompt,
        "generated": generated,
        "last_logits_argmax": int(np.argmax(last)),
        "n_vocab": m.hp.n_vocab,
        "dtype": args.dtype,
        "timing_s": {"load": round(t_load, 3), "prompt": round(t_prompt, 3), "generate": round(t_gen, 3)},
    }
    if args.detok:
        out["prompt_text"] = detokenize(m, prompt)
        out["generated_text"] = detokenize(m, generated)
    log(f"load {t_load:.2f}s, prompt ({len(prompt)} tok) {t_prompt:.2f}s, {args.steps} steps {t_gen:.2f}s")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except RefError as e:
        print(f"smollm2_ref: error: {e}", file=sys.stderr)
        sys.exit(2)
