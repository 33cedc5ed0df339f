#!/usr/bin/env python3
"""Outside reference for metashard's tokenizers, built on HF `tokenizers` and `transformers`.

  tokenize_ref.py gguf PATH.gguf "text"...        ids from a byte-level BPE built from the
                                                  GGUF vocab + merges (HF tokenizers)
  tokenize_ref.py hf-gguf PATH.gguf "text"...     ids from transformers'
                                                  AutoTokenizer.from_pretrained(dir, gguf_file=..)
                                                  (every tokenizer model transformers reads)
  tokenize_ref.py hf-json tokenizer.json "text"...  ids from the model's own tokenizer.json
  tokenize_ref.py chat TEMPLATE "json"...         each JSON {"messages", "gen", "bos", "eos"}
                                                  rendered by transformers'
                                                  render_jinja_template (what apply_chat_template
                                                  calls) with the template in file TEMPLATE or, for
                                                  a .gguf, the file's own template and tokens
  tokenize_ref.py wordpiece tokenizer.json "text"...  ids from Tokenizer.from_file
  tokenize_ref.py batch -                         a JSON list of jobs on stdin, each
                                                  {"kind": "gguf"|"hf-gguf"|"hf-json"|"chat", "path",
                                                  "inputs", "no_special", "decode"}, in one process
                                                  (transformers imported once): one JSON line per
                                                  job, the list of its results

Each prints one JSON list of ids per text. Options (before the texts):
  --stdin-json        read the texts as a JSON list of strings from stdin
  --no-special        encode without adding special tokens (BOS / [CLS] [SEP])
  --max-len N         (wordpiece) truncate to N tokens including specials; default: none
  --decode            print the decoded string of the ids instead (JSON string per text)

For GGUF the pre-tokenizer is chosen from `tokenizer.ggml.pre` the way llama.cpp groups it:
"smollm" (and starcoder, refact, command-r, codeshell, exaone) = Digits(individual_digits)
then ByteLevel's GPT-2 regex; "gpt2"/"gpt-2"/"phi-2"/"mpt"/"olmo"/"jais" = ByteLevel alone.
Control (type 3) and user-defined (type 4) tokens are added as special tokens, so they are
matched whole in the input as HF and llama.cpp do.
"""

import argparse
import json
import sys


def die(msg):
    print(f"tokenize_ref.py: {msg}", file=sys.stderr)
    sys.exit(2)


try:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
except ImportError:
    die("the `tokenizers` package is missing: pip install tokenizers")


def gguf_tokenizer(path):
    try:
        import gguf
    except ImportError:
        die("the `gguf` package is missing: pip install gguf")
    r = gguf.GGUFReader(path)

    def field(key):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    model = field("tokenizer.ggml.model")
    if model != "gpt2":
        die(f"{path}: tokenizer model {model!r} is not byte-level BPE")
    tokens = field("tokenizer.ggml.tokens")
    merges = field("tokenizer.ggml.merges")
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = field("tokenizer.ggml.pre") or "gpt2"

    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais"):
        tok.pre_tokenizer = byte_level
    else:
        die(f"{path}: pre-tokenizer {pre!r} has no reference here")
    tok.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (3, 4)
    ]
    tok.add_special_tokens(specials)
    bos = field("tokenizer.ggml.bos_token_id")
    add_bos = bool(field("tokenizer.ggml.add_bos_token"))
    return tok, (bos if add_bos else None)


def import_transformers():
    """transformers without torch: its GGUF reader (transformers 5) imports torch only for
    tensor dtypes and tensors, which reading a tokenizer never touches, so a stand-in module
    takes torch's place when torch is absent."""
    import importlib.machinery
    import importlib.util
    import types

    if importlib.util.find_spec("torch") is None:
        torch = types.ModuleType("torch")
        torch.__spec__ = importlib.machinery.ModuleSpec("torch", None)

        class _Unused:
            def __init__(self, *a, **k):
                raise RuntimeError("torch is not installed (tokenizer reference only)")

        def attr(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Unused

        torch.__getattr__ = attr
        sys.modules["torch"] = torch
    try:
        import transformers  # noqa: F401
        import transformers.modeling_gguf_pytorch_utils as mg
    except ImportError as e:
        die(f"the `{e.name}` package is missing: pip install transformers gguf")
    # The legacy config path asks for torch before reading metadata; it reads no tensors here.
    mg.is_torch_available = lambda: True
    import transformers.utils.logging as tl

    tl.set_verbosity_error()
    return transformers


def hf_gguf(path):
    import os

    tf = import_transformers()
    d, f = os.path.split(os.path.abspath(path))
    return tf.AutoTokenizer.from_pretrained(d, gguf_file=f)


def chat(template, convs):
    """The rendered text of each conversation (see the module docs)."""
    import_transformers()
    from transformers.utils.chat_template_utils import render_jinja_template

    tok = None
    if template.endswith(".gguf"):
        tok = hf_gguf(template)
        text = tok.chat_template
    else:
        with open(template, encoding="utf-8") as f:
            text = f.read()
    out = []
    for c in convs:
        if tok is not None:
            out.append(
                tok.apply_chat_template(c["messages"], tokenize=False, add_generation_prompt=c["gen"])
            )
        else:
            kw = {f"{k}_token": c[k] for k in ("bos", "eos") if c.get(k) is not None}
            rendered, _ = render_jinja_template(
                conversations=[c["messages"]],
                chat_template=text,
                add_generation_prompt=c["gen"],
                **kw,
            )
            out.append(rendered[0])
    return out


def hf_ids(kind, path, texts, no_special=False, decode=False):
    """Ids (or decoded text) of each text by transformers from a GGUF ("hf-gguf") or by the
    model's own tokenizer.json ("hf-json")."""
    if kind == "hf-gguf":
        tok = hf_gguf(path)
        enc = lambda t: tok(t, add_special_tokens=not no_special)["input_ids"]  # noqa: E731
    else:
        tok = Tokenizer.from_file(path)
        enc = lambda t: tok.encode(t, add_special_tokens=not no_special).ids  # noqa: E731
    out = []
    for t in texts:
        ids = enc(t)
        out.append(tok.decode(ids) if decode else ids)
    return out


def batch(jobs):
    for j in jobs:
        if j["kind"] == "chat":
            res = chat(j["path"], j["inputs"])
        elif j["kind"] == "gguf":
            tok, bos = gguf_tokenizer(j["path"])
            res = []
            for t in j["inputs"]:
                ids = tok.encode(t, add_special_tokens=False).ids
                res.append(([bos] if bos is not None and not j.get("no_special") else []) + ids)
        else:
            res = hf_ids(j["kind"], j["path"], j["inputs"], j.get("no_special", False), j.get("decode", False))
        print(json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["gguf", "hf-gguf", "hf-json", "chat", "batch", "wordpiece"])
    ap.add_argument("path")
    ap.add_argument("texts", nargs="*")
    ap.add_argument("--stdin-json", action="store_true")
    ap.add_argument("--no-special", action="store_true")
    ap.add_argument("--max-len", type=int)
    ap.add_argument("--decode", action="store_true")
    a = ap.parse_args()
    texts = json.load(sys.stdin) if a.stdin_json else a.texts

    if a.kind == "batch":
        batch(texts)
        return
    if a.kind == "chat":
        for r in chat(a.path, texts):
            print(json.dumps(r))
        return
    if a.kind in ("hf-gguf", "hf-json"):
        for r in hf_ids(a.kind, a.path, texts, a.no_special, a.decode):
            print(json.dumps(r))
        return
    if a.kind == "gguf":
        tok, bos = gguf_tokenizer(a.path)
        for t in texts:
            ids = tok.encode(t, add_special_tokens=False).ids
            if bos is not None and not a.no_special:
                ids = [bos] + ids
            if a.decode:
                print(json.dumps(tok.decode(ids, skip_special_tokens=False)))
            else:
                print(json.dumps(ids))
    else:
        tok = Tokenizer.from_file(a.path)
        tok.no_padding()
        if a.max_len:
            tok.enable_truncation(max_length=a.max_len)
        else:
            tok.no_truncation()
        for t in texts:
            ids = tok.encode(t, add_special_tokens=not a.no_special).ids
            if a.decode:
                print(json.dumps(tok.decode(ids)))
            else:
                print(json.dumps(ids))


if __name__ == "__main__":
    main()
