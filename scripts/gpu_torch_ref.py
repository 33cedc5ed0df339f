#!/usr/bin/env python3
"""PyTorch's figures for the CUDA issue's side-by-side benchmarks, on the GPU machine.

    python3 scripts/gpu_torch_ref.py [--gguf SmolLM2.gguf] [--tokens 64] > torch_ref.json

Prints one JSON object: a device-to-device copy of 256 MiB f32 (GB/s, bytes read and written),
torch.matmul 4096^3 in f16 and bf16 (TFLOP/s), each the median of CUDA-event-timed runs after
warm-up; with --gguf (and the `gguf` package), SmolLM2's greedy decoding speed with
transformers' eager generate in f32 and f16 (tokens/s, prompt excluded). Parts that cannot run
(no transformers, no gguf) are reported as errors in the JSON, not raised.
"""

import argparse
import json
import statistics
import sys
import time


def timed(fn, reps=20, warmup=3):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def kernels():
    import torch

    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    n = 64 << 20
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    s = timed(lambda: y.copy_(x))
    out["copy f32 256 MiB"] = {"seconds": s, "rate": 2 * n * 4 / s / 1e9, "unit": "GB/s"}
    g = 4096
    for name, dt in [("f16", torch.float16), ("bf16", torch.bfloat16)]:
        a = torch.randn(g, g, device="cuda", dtype=dt)
        b = torch.randn(g, g, device="cuda", dtype=dt)
        s = timed(lambda: torch.matmul(a, b))
        out[f"gemm {name} {g}^3"] = {"seconds": s, "rate": 2 * g**3 / s / 1e12, "unit": "TFLOP/s"}
    return out


def generate(gguf_path, tokens):
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Name three colors."}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(prompt, return_tensors="pt").input_ids.cuda()
    res = {}
    for label, dt in [("f32", torch.float32), ("f16", torch.float16)]:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=dt).cuda().eval()
        model.generation_config.pad_token_id = tok.eos_token_id
        kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        with torch.no_grad():
            model.generate(ids, **kw)  # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            torch.cuda.synchronize()
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(ids, **kw)
            torch.cuda.synchronize()
            total = time.perf_counter() - t0
        n = out.shape[1] - ids.shape[1]
        res[f"smollm2 decode {label}"] = {
            "tokens": n,
            "rate": (n - 1) / max(total - prefill, 1e-9),
            "unit": "tokens/s",
            "text": tok.decode(out[0, ids.shape[1] :]),
        }
        del model
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gguf")
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    out = {}
    try:
        out.update(kernels())
    except Exception as e:  # reported, not raised: the other parts still run
        out["kernels_error"] = repr(e)
    if a.gguf:
        try:
            out.update(generate(a.gguf, a.tokens))
        except Exception as e:
            out["generate_error"] = repr(e)
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
