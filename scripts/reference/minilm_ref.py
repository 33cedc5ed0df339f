#!/usr/bin/env python3
"""Independent numpy reference of all-MiniLM-L6-v2 sentence embeddings (BERT encoder).

metashard's Rust tests call this script as a subprocess and compare their embeddings with
what it prints. It shares no code with metashard: the safetensors file is parsed here
(format: 8-byte little-endian header length N, N bytes of JSON mapping tensor name to
{dtype, shape, data_offsets}, then the raw little-endian data; offsets are relative to the
end of the header), hyper-parameters come from config.json, and tokenization uses the
Hugging Face `tokenizers` package on tokenizer.json (an outside implementation).

Model (BERT, post-LayerNorm), per the BERT paper and the sentence-transformers module list
(modules.json: Transformer -> Pooling(mean) -> Normalize):
  x = LN(word_emb[id] + pos_emb[pos] + type_emb[0])
  per layer: a = LN(x + Attn(x) @ Wo.T + bo);  x = LN(a + GELU(a @ Wi.T + bi) @ Wd.T + bd)
  Attn: 12 heads of 32 dims, scores / sqrt(32), padded keys masked out, softmax
  GELU is the erf form: 0.5 * x * (1 + erf(x / sqrt(2)))
  embedding = mean of the last hidden states over non-padding tokens, then L2-normalised.

Shapes: safetensors (PyTorch) shapes are row-major, outermost first; a Linear weight is
[out, in] (ggml order ne = [in, out]) and y = x @ W.T + b.

Output: JSON on stdout, diagnostics on stderr, exit status 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np


def log(msg: str) -> None:
    print(f"minilm_ref: {msg}", file=sys.stderr, flush=True)


class RefError(Exception):
    """Bad input or a model folder that does not match what this reference expects."""


# ---------------------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------------------

_ST_DTYPES = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I64": "<i8", "I32": "<i4"}
_MAX_HEADER = 100 * 1024 * 1024


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Parse a .safetensors file; return name -> numpy array (memory-mapped, read-only)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise RefError(f"{path}: shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise RefError(f"{path}: header length {n} is larger than the file ({size} bytes)")
            header = json.loads(f.read(n).decode("utf-8"))
    except FileNotFoundError:
        raise RefError(f"model file not found: {path}")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RefError(f"{path}: header is not valid JSON: {e}")
    if not isinstance(header, dict):
        raise RefError(f"{path}: header is not a JSON object")
    base = 8 + n
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (lo, hi) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise RefError(f"{path}: tensor '{name}' has a malformed header entry {info!r}")
        if dt not in _ST_DTYPES:
            raise RefError(f"{path}: tensor '{name}' has dtype {dt}, supported: {sorted(_ST_DTYPES)}")
        npdt = np.dtype(_ST_DTYPES[dt])
        count = math.prod(shape)
        if not (0 <= lo <= hi and base + hi <= size) or hi - lo != count * npdt.itemsize:
            raise RefError(
                f"{path}: tensor '{name}' data_offsets [{lo}, {hi}) do not fit shape {shape} "
                f"of {dt} in a file of {size} bytes"
            )
        out[name] = raw[base + lo : base + hi].view(npdt).reshape(shape)
    return out


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------


class Bert:
    def __init__(self, model_dir: str, dtype):
        cfg_path = os.path.join(model_dir, "config.json")
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except FileNotFoundError:
            raise RefError(f"config not found: {cfg_path}")
        try:
            self.n_layer = int(cfg["num_hidden_layers"])
            self.n_embd = int(cfg["hidden_size"])
            self.n_head = int(cfg["num_attention_heads"])
            self.n_ff = int(cfg["intermediate_size"])
            self.eps = float(cfg["layer_norm_eps"])
            self.n_pos = int(cfg["max_position_embeddings"])
            self.n_vocab = int(cfg["vocab_size"])
            act = cfg.get("hidden_act", "gelu")
        except KeyError as e:
            raise RefError(f"{cfg_path}: missing field {e}")
        if act != "gelu":
            raise RefError(f"{cfg_path}: hidden_act is '{act}', this reference implements 'gelu' (erf)")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise RefError(f"{cfg_path}: only absolute position embeddings are implemented")
        if self.n_embd % self.n_head:
            raise RefError(f"{cfg_path}: hidden_size {self.n_embd} not divisible by heads {self.n_head}")
        pool_path = os.path.join(model_dir, "1_Pooling", "config.json")
        if os.path.exists(pool_path):
            with open(pool_path) as f:
                pool = json.load(f)
            if not pool.get("pooling_mode_mean_tokens", False):
                raise RefError(f"{pool_path}: only mean pooling is implemented")
        self.head_dim = self.n_embd // self.n_head

        st = read_safetensors(os.path.join(model_dir, "model.safetensors"))
        E, F = self.n_embd, self.n_ff

        def w(name: str, shape: list[int]) -> np.ndarray:
            a = st.get(name)
            if a is None:
                raise RefError(f"model.safetensors: tensor '{name}' is missing")
            if list(a.shape) != shape:
                raise RefError(f"model.safetensors: tensor '{name}' has shape {list(a.shape)}, expected {shape}")
            return np.ascontiguousarray(a, dtype=dtype)

        self.word = w("embeddings.word_embeddings.weight", [self.n_vocab, E])
        self.pos = w("embeddings.position_embeddings.weight", [self.n_pos, E])
        self.type0 = w("embeddings.token_type_embeddings.weight", [int(cfg.get("type_vocab_size", 2)), E])[0]
        self.emb_ln = (w("embeddings.LayerNorm.weight", [E]), w("embeddings.LayerNorm.bias", [E]))
        self.layers = []
        for i in range(self.n_layer):
            p = f"encoder.layer.{i}."
            self.layers.append(
                {
                    "wq": w(p + "attention.self.query.weight", [E, E]),
                    "bq": w(p + "attention.self.query.bias", [E]),
                    "wk": w(p + "attention.self.key.weight", [E, E]),
                    "bk": w(p + "attention.self.key.bias", [E]),
                    "wv": w(p + "attention.self.value.weight", [E, E]),
                    "bv": w(p + "attention.self.value.bias", [E]),
                    "wo": w(p + "attention.output.dense.weight", [E, E]),
                    "bo": w(p + "attention.output.dense.bias", [E]),
                    "ln1": (w(p + "attention.output.LayerNorm.weight", [E]), w(p + "attention.output.LayerNorm.bias", [E])),
                    "wi": w(p + "intermediate.dense.weight", [F, E]),
                    "bi": w(p + "intermediate.dense.bias", [F]),
                    "wd": w(p + "output.dense.weight", [E, F]),
                    "bd": w(p + "output.dense.bias", [E]),
                    "ln2": (w(p + "output.LayerNorm.weight", [E]), w(p + "output.LayerNorm.bias", [E])),
                }
            )

    def layer_norm(self, x: np.ndarray, ln) -> np.ndarray:
        g, b = ln
        mu = x.mean(axis=-1, keepdims=True)
        d = x - mu
        var = (d * d).mean(axis=-1, keepdims=True)
        return d / np.sqrt(var + self.eps) * g + b

    @staticmethod
    def gelu(x: np.ndarray) -> np.ndarray:
        # erf form; math.erf element-wise (numpy has no erf) is exact and fast enough here
        erf = np.frompyfunc(math.erf, 1, 1)
        xd = x.astype(np.float64)
        e = erf(xd * (1.0 / math.sqrt(2.0))).astype(np.float64)
        return (0.5 * xd * (1.0 + e)).astype(x.dtype)

    def forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """ids, mask: (B, T) int; returns last hidden states (B, T, E)."""
        B, T = ids.shape
        H, D = self.n_head, self.head_dim
        dt = self.word.dtype
        x = self.word[ids] + self.pos[np.arange(T)][None] + self.type0
        x = self.layer_norm(x, self.emb_ln)
        key_pad = (mask == 0)[:, None, None, :]  # (B, 1, 1, T)
        scale = dt.type(1.0 / math.sqrt(D))
        for L in self.layers:
            q = (x @ L["wq"].T + L["bq"]).reshape(B, T, H, D).transpose(0, 2, 1, 3)
            k = (x @ L["wk"].T + L["bk"]).reshape(B, T, H, D).transpose(0, 2, 1, 3)
            v = (x @ L["wv"].T + L["bv"]).reshape(B, T, H, D).transpose(0, 2, 1, 3)
            s = (q @ k.transpose(0, 1, 3, 2)) * scale  # (B, H, T, T)
            s = np.where(key_pad, -np.inf, s)
            s = s - s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=-1, keepdims=True)
            o = (p @ v).transpose(0, 2, 1, 3).reshape(B, T, H * D)
            a = self.layer_norm(x + o @ L["wo"].T + L["bo"], L["ln1"])
            f = self.gelu(a @ L["wi"].T + L["bi"]) @ L["wd"].T + L["bd"]
            x = self.layer_norm(a + f, L["ln2"])
        return x

    def embed(self, seqs: list[list[int]]):
        for i, s in enumerate(seqs):
            if not s:
                raise RefError(f"sequence {i} is empty")
            if len(s) > self.n_pos:
                raise RefError(f"sequence {i} has {len(s)} tokens, more than max_position_embeddings {self.n_pos}")
            bad = [t for t in s if t < 0 or t >= self.n_vocab]
            if bad:
                raise RefError(f"sequence {i}: token ids out of range [0, {self.n_vocab}): {bad[:8]}")
        B, T = len(seqs), max(len(s) for s in seqs)
        ids = np.zeros((B, T), dtype=np.int64)  # pad id 0 ([PAD])
        mask = np.zeros((B, T), dtype=np.int64)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1
        hidden = self.forward(ids, mask)
        m = mask[..., None].astype(hidden.dtype)
        pooled = (hidden * m).sum(axis=1) / m.sum(axis=1)
        norm = np.sqrt((pooled * pooled).sum(axis=-1, keepdims=True))
        emb = pooled / np.maximum(norm, 1e-12)
        return emb, hidden, mask


# ---------------------------------------------------------------------------------------
# Tokenizer (outside implementation: HF `tokenizers`)
# ---------------------------------------------------------------------------------------


def tokenize(model_dir: str, sentences: list[str]) -> list[list[int]]:
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise RefError(f"tokenizing text needs the 'tokenizers' package (or pass --ids): {e}")
    path = os.path.join(model_dir, "tokenizer.json")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - file missing or unparsable
        raise RefError(f"cannot load {path}: {e}")
    # tokenizer.json asks for fixed padding to 128 and truncation at 128; sentence-transformers
    # pads to the longest sentence itself and truncates at max_seq_length (256 in
    # sentence_bert_config.json). Padding is done in Bert.embed, so drop it here.
    max_len = 256
    sb = os.path.join(model_dir, "sentence_bert_config.json")
    if os.path.exists(sb):
        with open(sb) as f:
            max_len = int(json.load(f).get("max_seq_length", max_len))
    tok.no_padding()
    tok.enable_truncation(max_length=max_len)
    return [e.ids for e in tok.encode_batch(sentences)]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="folder with config.json, model.safetensors, tokenizer.json")
    ap.add_argument("--ids-only", action="store_true", help="only tokenize; print input_ids")
    ap.add_argument("--ids", help='token ids as JSON, e.g. "[[101, 7592, 102], [101, 102]]"; skips tokenization')
    ap.add_argument("--dtype", choices=("f32", "f64"), default="f32")
    ap.add_argument("--hidden-out", help="write the last hidden states, float32 LE, (n_seq, max_len, hidden)")
    ap.add_argument("sentences", nargs="*")
    args = ap.parse_args(argv)

    if args.ids is not None:
        if args.sentences:
            raise RefError("give either --ids or sentences, not both")
        try:
            seqs = json.loads(args.ids)
            if not isinstance(seqs, list) or not all(isinstance(s, list) for s in seqs):
                raise ValueError("not a list of lists")
            seqs = [[int(t) for t in s] for s in seqs]
        except (ValueError, TypeError) as e:
            raise RefError(f"--ids must be a JSON list of lists of integers: {e}")
    else:
        if not args.sentences:
            raise RefError("no sentences given")
        seqs = tokenize(args.model, args.sentences)
    if not seqs:
        raise RefError("no sequences given")

    if args.ids_only:
        print(json.dumps({"input_ids": seqs}))
        return 0

    dtype = np.float32 if args.dtype == "f32" else np.float64
    t0 = time.time()
    model = Bert(args.model, dtype)
    t1 = time.time()
    emb, hidden, mask = model.embed(seqs)
    t2 = time.time()
    log(f"load {t1 - t0:.2f}s, forward ({len(seqs)} seqs, max len {hidden.shape[1]}) {t2 - t1:.2f}s")
    if args.hidden_out:
        with open(args.hidden_out, "wb") as f:
            f.write(hidden.astype("<f4").tobytes())
    out = {
        "input_ids": seqs,
        "embeddings": [[float(v) for v in row] for row in emb],
        "dtype": args.dtype,
        "hidden_shape": list(hidden.shape),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except RefError as e:
        print(f"minilm_ref: error: {e}", file=sys.stderr)
        sys.exit(2)
