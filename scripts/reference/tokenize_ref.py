#!/usr/bin/env python3
"""Outside reference for metashard's tokenizers, built on HF `tokenizers` (PyPI).

  tokenize_ref.py gguf PATH.gguf "text"...        ids from a byte-level BPE built from the
                                                  GGUF vocab + merges (HF tokenizers)
  tokenize_ref.py wordpiece tokenizer.json "text"...  ids from Tokenizer.from_file

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["gguf", "wordpiece"])
    ap.add_argument("path")
    ap.add_argument("texts", nargs="*")
    ap.add_argument("--stdin-json", action="store_true")
    ap.add_argument("--no-special", action="store_true")
    ap.add_argument("--max-len", type=int)
    ap.add_argument("--decode", action="store_true")
    a = ap.parse_args()
    texts = json.load(sys.stdin) if a.stdin_json else a.texts

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
