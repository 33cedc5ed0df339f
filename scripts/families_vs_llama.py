#!/usr/bin/env python3
"""Greedy tokens of the families' synthetic GGUFs under llama.cpp and under metashard, side by
side (an outside reference for every architecture; issue 18).

The files are the ones `cargo nextest run --release --test families` writes under
$TMPDIR/metashard-families-*/ (the newest of each name is taken). llama.cpp runs them through
`scripts/llama_greedy.cpp`, built here against a llama.cpp build (LLAMA_CPP, default
/tmp/llama.cpp with build/; how to build it: ../shared/anchors/README.md). Two adjustments
make the files comparable, both differences of llama.cpp's choosing:
- llama.cpp gives a model whose name contains "phi3" special-token attributes that this
  vocabulary lacks, so the copy it loads is renamed;
- llama.cpp does not apply Phi-3's sliding window (Hugging Face's mask does, and so does
  metashard: docs/models.md), so for Phi-3 both sides also run a copy whose
  `phi3.attention.sliding_window` key is hidden.
Usage: scripts/families_vs_llama.py [N_PREDICT]. Exits 1 if any file both sides load gives
different tokens."""
import glob, json, os, subprocess, sys, tempfile

repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
llama = os.environ.get("LLAMA_CPP", "/tmp/llama.cpp")
ours_bin = os.environ.get("BIN", os.path.join(repo, "target/release/metashard"))
n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
# "Hello, Qwen3!" in the synthetic byte-level vocabulary (tests/families.rs's PROMPT).
prompt_text = "Hello, Qwen3!"
prompt = list(prompt_text.encode())
work = tempfile.mkdtemp(prefix="families-vs-llama-")
exe = os.path.join(work, "llama_greedy")
b = os.path.join(llama, "build")
libs = [f"{b}/src/libllama.a", f"{b}/ggml/src/libggml.a", f"{b}/ggml/src/libggml-cpu.a",
        f"{b}/ggml/src/libggml-base.a"]
subprocess.run(["g++", "-O2", "-std=c++17", os.path.join(repo, "scripts/llama_greedy.cpp"),
                f"-I{llama}/include", f"-I{llama}/ggml/include", "-o", exe, *libs,
                "-fopenmp", "-lpthread", "-ldl"], check=True)

files = {}
for p in sorted(glob.glob(os.path.join(tempfile.gettempdir(), "metashard-families-*/*.gguf")),
                key=os.path.getmtime):
    files[os.path.basename(p)] = p
if not files:
    sys.exit("no files: run `cargo nextest run --release --test families` first")


def theirs(path):
    r = subprocess.run([exe, path, str(n), *map(str, prompt)], capture_output=True, text=True)
    return [int(x) for x in r.stdout.split()] if r.returncode == 0 else None


def ours(path):
    r = subprocess.run([ours_bin, "run", "--model", path, "--raw", "-p", prompt_text, "-n", str(n),
                        "--json", "--ignore-eos"], capture_output=True, text=True)
    return json.loads(r.stdout)["tokens"] if r.returncode == 0 else None


bad = 0
print(f"{'file':38} {'result':14} llama.cpp / metashard")
for name, path in sorted(files.items()):
    data = open(path, "rb").read()
    variants = [("", data)]
    key = b"phi3.attention.sliding_window"
    if key in data:
        variants.append((" (no window)", data.replace(key, key[:-1] + b"_")))
    for tag, d in variants:
        cp = os.path.join(work, name)
        open(cp, "wb").write(d.replace(b"synthetic phi3", b"synthetic ph-3"))
        ours_path = os.path.join(work, "ours-" + name)
        open(ours_path, "wb").write(d)
        t, o = theirs(cp), ours(ours_path)
        if t is None or o is None:
            verdict = "not loaded by " + ("both" if t is None and o is None
                                          else "llama.cpp" if t is None else "metashard")
        elif t == o:
            verdict = "same"
        elif tag == "" and len(variants) > 1:
            verdict = "differ (window)"
        else:
            verdict, bad = "DIFFERENT", bad + 1
        print(f"{name + tag:38} {verdict:14} {t} / {o}")
sys.exit(1 if bad else 0)
