//! The CUDA backend's parts that need no GPU: every kernel compiles with NVRTC for sm_80
//! (A100) and sm_90 (H100) (NVRTC needs no GPU); the kernels' argument structs match
//! `kernels.cu`; library discovery; the one-GPU communicator's rendezvous (barriers, deadline
//! naming the late ranks, mismatched collectives, abort). CI installs NVRTC from PyPI (`nvidia-cuda-nvrtc-cu12`) and points
//! `METASHARD_CUDA_LIBS` at it; elsewhere the test looks for that wheel through `python3`, and
//! without NVRTC it skips with one line, unless `METASHARD_REQUIRE_NVRTC=1` (set by
//! `scripts/test.sh`) makes that a failure.
#![cfg(feature = "cuda")]

use metashard::DType;
use metashard::cuda::comm::{Deposit, Rendezvous};
use metashard::cuda::kernels::{
    Fault, Ids, KERNELS, SOURCE, Tensor, compile, dtype_code, kernels_for,
};
use metashard::cuda::libs::{Lib, candidates_in, present};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "support/decoders.rs"]
mod decoders;

/// The `lib/` folder of the NVRTC wheel, asked of python3.
fn wheel_dir() -> Option<String> {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import nvidia.cuda_nvrtc as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))",
        ])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    if std::env::var_os("METASHARD_CUDA_LIBS").is_none()
        && let Some(d) = wheel_dir()
    {
        // SAFETY: no other test of this binary reads or writes the environment.
        unsafe { std::env::set_var("METASHARD_CUDA_LIBS", d) };
    }
    if !present(Lib::Nvrtc) {
        let required = std::env::var("METASHARD_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "METASHARD_REQUIRE_NVRTC=1 but NVRTC was not found"
        );
        println!("skipped: NVRTC not found (pip install nvidia-cuda-nvrtc-cu12)");
        return;
    }
    for arch in ["compute_80", "compute_90"] {
        let ptx = compile(arch).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            ptx.contains(&format!(".target sm_{}", &arch[8..])),
            "{arch}"
        );
        for k in KERNELS {
            assert!(
                ptx.contains(&format!(".entry {k}(")),
                "{k} missing from the PTX for {arch}"
            );
        }
    }
}

#[test]
fn every_listed_kernel_is_defined_once_and_every_defined_one_listed() {
    let mut defined: Vec<&str> = SOURCE
        .split("extern \"C\" __global__ void ")
        .skip(1)
        .map(|s| s.split('(').next().unwrap())
        .collect();
    defined.sort();
    let mut listed = KERNELS.to_vec();
    listed.sort();
    assert_eq!(defined, listed);
}

#[test]
fn argument_structs_have_the_kernels_layout() {
    // struct Tensor: a pointer, ne[4], nb[4], two ints; struct Fault: two ints, five i64;
    // struct Ids: a Tensor and four i64 (the expert window).
    assert_eq!(std::mem::size_of::<Tensor>(), 80);
    assert_eq!(std::mem::size_of::<Fault>(), 48);
    assert_eq!(std::mem::size_of::<Ids>(), 112);
    assert!(SOURCE.contains("struct Ids {\n    Tensor t;\n    i64 rows, lo, hi, at;\n};"));
    // Every type of the table has kernels, codes 0..=15 in the table's order.
    let codes: Vec<i32> = DType::ALL.iter().filter_map(|&d| kernels_for(d)).collect();
    assert_eq!(codes, (0..=15).collect::<Vec<i32>>());
    for d in DType::ALL {
        if let Some(c) = kernels_for(d) {
            assert_eq!(dtype_code(d), c, "{d}");
        }
    }
    for (name, code) in [
        ("T_F32", 0),
        ("T_I32", 3),
        ("T_Q8_0", 4),
        ("T_Q4_1", 6),
        ("T_Q4_K", 11),
        ("T_IQ4_XS", 15),
    ] {
        assert!(SOURCE.contains(&format!("#define {name} {code}")), "{name}");
    }
}

#[test]
fn library_candidates_are_versions_of_the_library_only() {
    let dir = std::env::temp_dir().join(format!("metashard-libs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for n in [
        "libnvrtc.so.12",
        "libnvrtc-builtins.so.12.9",
        "libnvrtc.alt.so.12",
        "libnvrtc.so",
        "libcublas.so.13",
    ] {
        std::fs::write(dir.join(n), b"").unwrap();
    }
    let names = |stem| -> Vec<String> {
        candidates_in(&dir, stem)
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    };
    assert_eq!(names("nvrtc"), ["libnvrtc.so", "libnvrtc.so.12"]);
    assert_eq!(names("cublas"), ["libcublas.so.13"]);
    assert!(names("nccl").is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `world` ranks on threads, each running `f(rank, &rendezvous)`; their results in rank order.
fn ranks<T: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(usize, &Rendezvous) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let rv = Arc::new(Rendezvous::new("cuda0", world, timeout));
    let f = Arc::new(f);
    let hs: Vec<_> = (0..world)
        .map(|r| {
            let (rv, f) = (rv.clone(), f.clone());
            std::thread::spawn(move || f(r, &rv))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn rendezvous_hands_every_rank_every_deposit_many_times() {
    let out = ranks(3, Duration::from_secs(10), |r, rv| {
        let mut seen = Vec::new();
        for round in 0..200u64 {
            let d = Deposit {
                a: 1000 * round + r as u64,
                sig: (1, round),
            };
            let all = rv.meet(r, d, "all-reduce").unwrap();
            seen.push(all.iter().map(|d| d.a).collect::<Vec<_>>());
            rv.barrier(r, None).unwrap();
        }
        seen
    });
    for (r, seen) in out.iter().enumerate() {
        for (round, all) in seen.iter().enumerate() {
            let want: Vec<u64> = (0..3).map(|q| 1000 * round as u64 + q).collect();
            assert_eq!(all, &want, "rank {r} round {round}");
        }
    }
}

#[test]
fn rendezvous_names_the_late_rank_within_the_deadline() {
    let t = Duration::from_millis(200);
    let start = Instant::now();
    let out = ranks(3, t, |r, rv| {
        if r == 2 {
            return Ok(Vec::new());
        }
        rv.meet(r, Deposit::default(), "all-reduce")
    });
    let waited = start.elapsed();
    for (r, res) in out.iter().take(2).enumerate() {
        let e = res.as_ref().unwrap_err().to_string();
        assert!(e.contains("[2]"), "rank {r}: {e}");
    }
    assert!(waited < Duration::from_secs(5), "{waited:?}");
}

#[test]
fn rendezvous_refuses_mismatched_collectives_and_stays_failed() {
    let out = ranks(2, Duration::from_secs(10), |r, rv| {
        let d = Deposit {
            a: 0,
            sig: (1 + r as u8, 0),
        };
        let first = rv.meet(r, d, "a collective").map(|_| ());
        let again = rv.meet(r, Deposit::default(), "all-reduce").map(|_| ());
        (first, again, rv.failure())
    });
    for (first, again, failure) in out {
        assert!(
            first
                .unwrap_err()
                .to_string()
                .contains("different collective")
        );
        assert!(again.is_err());
        assert!(failure.is_some());
    }
}

#[test]
fn an_abort_releases_waiting_ranks_at_once() {
    let start = Instant::now();
    let out = ranks(2, Duration::from_secs(30), |r, rv| {
        if r == 1 {
            std::thread::sleep(Duration::from_millis(50));
            rv.fail_with("rank 1: its thread panicked".into());
            return Err("aborted".to_string());
        }
        rv.meet(r, Deposit::default(), "all-reduce")
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    assert!(
        out[0].as_ref().unwrap_err().contains("panicked"),
        "{:?}",
        out[0]
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}

// ---- the new weight types' device code, compiled by the host C++ compiler ------------------

/// The weight types of `kernels_qx.cu`, with the byte
/// offsets of their f16 fields (ggml-common.h), which random blocks keep finite.
const QX_TYPES: &[(DType, &[usize])] = &[
    (DType::Q5_0, &[0]),
    (DType::Q5_1, &[0, 2]),
    (DType::Q2_K, &[80, 82]),
    (DType::Q3_K, &[108]),
    (DType::Q4_K, &[0, 2]),
    (DType::Q5_K, &[0, 2]),
    (DType::Q6_K, &[208]),
    (DType::IQ4_NL, &[0]),
    (DType::IQ4_XS, &[0]),
];

/// Plain C++ for the CUDA names the host-testable section uses.
const HOST_PRELUDE: &str = r#"
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
#define __device__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
static inline float h2f(u16 h) { _Float16 f; std::memcpy(&f, &h, 2); return (float)f; }
static inline u16 f2h(float x) { _Float16 f = (_Float16)x; u16 h; std::memcpy(&h, &f, 2); return h; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline int __float2int_rz(float x) { return (int)x; }
static inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
static inline float __int_as_float(int i) { float x; std::memcpy(&x, &i, 4); return x; }
static inline u32 __vsub4(u32 a, u32 b) {
    u32 r = 0;
    for (int i = 0; i < 4; i++) r |= (((a >> (8 * i)) - (b >> (8 * i))) & 0xff) << (8 * i);
    return r;
}
static inline u32 __byte_perm(u32 x, u32 y, u32 s) {
    unsigned long long b = ((unsigned long long)y << 32) | x;
    u32 r = 0;
    for (int i = 0; i < 4; i++) r |= (u32)((b >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
"#;

/// The driver: `prog d TYPE NBLK IN OUT` writes every element by `load_qx` (NaN for Q8_0, Q4_0
/// and Q4_1, which are kernels.cu's), then every element as the GEMV's warp produces it
/// (`qx_lanes`, `lane8`: integer quants, exact in floats, with their scale and offset; a failure
/// where no lane or two lanes wrote an element); `prog q TYPE NBLK IN OUT` quantizes NBLK blocks of floats by
/// `quantize32_qx` or `quantize256_qx` (into a buffer of 0x5a bytes: every byte is written).
const HOST_MAIN: &str = r#"
int main(int argc, char **argv) {
    if (argc != 6) return 2;
    int type = atoi(argv[2]), nblk = atoi(argv[3]);
    FILE *in = fopen(argv[4], "rb"), *out = fopen(argv[5], "wb");
    if (!in || !out) return 3;
    if (argv[1][0] == 'd') {
        int be = qx_block_elems(type), bb = qx_block_bytes(type);
        std::vector<char> row((size_t)nblk * bb);
        if (fread(row.data(), 1, row.size(), in) != row.size()) return 4;
        i64 n = (i64)nblk * be;
        std::vector<float> elem(n, NAN), lanes(n, NAN);
        std::vector<int> hits(n, 0);
        if (is_qx(type)) for (i64 i = 0; i < n; i++) elem[i] = load_qx(row.data(), type, i);
        for (int lane = 0; lane < 32; lane++) {
            int t, first, step;
            qx_lanes(type, lane, &t, &first, &step);
            for (i64 b = first; b < nblk; b += step) {
                float q[8], dl, ml;
                int e0, e1;
                const char *blk = row.data() + b * bb;
                switch (type) {
                case T_Q8_0: lane8<T_Q8_0>(blk, t, q, &dl, &ml, &e0, &e1); break;
                case T_Q4_0: lane8<T_Q4_0>(blk, t, q, &dl, &ml, &e0, &e1); break;
                case T_Q4_1: lane8<T_Q4_1>(blk, t, q, &dl, &ml, &e0, &e1); break;
                case T_Q5_0: lane8<T_Q5_0>(blk, t, q, &dl, &ml, &e0, &e1); break;
                case T_Q5_1: lane8<T_Q5_1>(blk, t, q, &dl, &ml, &e0, &e1); break;
                case T_Q2_K: lane8<T_Q2_K>(blk, t, q, &dl, &ml, &e0, &e1); break;
                case T_Q3_K: lane8<T_Q3_K>(blk, t, q, &dl, &ml, &e0, &e1); break;
                case T_Q4_K: lane8<T_Q4_K>(blk, t, q, &dl, &ml, &e0, &e1); break;
                case T_Q5_K: lane8<T_Q5_K>(blk, t, q, &dl, &ml, &e0, &e1); break;
                case T_Q6_K: lane8<T_Q6_K>(blk, t, q, &dl, &ml, &e0, &e1); break;
                case T_IQ4_NL: lane8<T_IQ4_NL>(blk, t, q, &dl, &ml, &e0, &e1); break;
                default: lane8<T_IQ4_XS>(blk, t, q, &dl, &ml, &e0, &e1); break;
                }
                for (int i = 0; i < 8; i++) {
                    // The quants are integers; each element is dl q (- ml) as the table forms it.
                    if (q[i] != (float)(int)q[i]) { fprintf(stderr, "quant %g not an integer\n", q[i]); return 6; }
                    i64 a = b * be + (i < 4 ? e0 + i : e1 + i - 4);
                    bool min = type == T_Q4_1 || type == T_Q5_1 || type == T_Q2_K || type == T_Q4_K || type == T_Q5_K;
                    lanes[a] = min ? dl * q[i] - ml : dl * q[i];
                    hits[a]++;
                }
            }
        }
        for (i64 i = 0; i < n; i++) if (hits[i] != 1) { fprintf(stderr, "element %lld read by %d lanes\n", i, hits[i]); return 5; }
        // The same through `lane8i` (signed bytes for the integer dot products), where the
        // 8-bit-activation GEMV has the type.
        std::vector<float> ilanes(n, NAN);
        if (has_q8a(type)) {
            std::fill(hits.begin(), hits.end(), 0);
            for (int lane = 0; lane < 32; lane++) {
                int t, first, step;
                qx_lanes(type, lane, &t, &first, &step);
                for (i64 b = first; b < nblk; b += step) {
                    int lo, hi, e0, e1;
                    float dl, ml;
                    const char *blk = row.data() + b * bb;
                    switch (type) {
                    case T_Q8_0: lane8i<T_Q8_0>(blk, t, &lo, &hi, &dl, &ml, &e0, &e1); break;
                    case T_Q4_0: lane8i<T_Q4_0>(blk, t, &lo, &hi, &dl, &ml, &e0, &e1); break;
                    case T_Q4_1: lane8i<T_Q4_1>(blk, t, &lo, &hi, &dl, &ml, &e0, &e1); break;
                    case T_Q5_0: lane8i<T_Q5_0>(blk, t, &lo, &hi, &dl, &ml, &e0, &e1); break;
                    case T_Q5_1: lane8i<T_Q5_1>(blk, t, &lo, &hi, &dl, &ml, &e0, &e1); break;
                    case T_Q4_K: lane8i<T_Q4_K>(blk, t, &lo, &hi, &dl, &ml, &e0, &e1); break;
                    case T_Q5_K: lane8i<T_Q5_K>(blk, t, &lo, &hi, &dl, &ml, &e0, &e1); break;
                    default: lane8i<T_Q6_K>(blk, t, &lo, &hi, &dl, &ml, &e0, &e1); break;
                    }
                    for (int i = 0; i < 8; i++) {
                        int q = (signed char)(((i < 4 ? lo : hi) >> (8 * (i & 3))) & 0xff);
                        i64 a = b * be + (i < 4 ? e0 + i : e1 + i - 4);
                        bool min = type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K;
                        ilanes[a] = min ? dl * (float)q - ml : dl * (float)q;
                        hits[a]++;
                    }
                }
            }
            for (i64 i = 0; i < n; i++) if (hits[i] != 1) { fprintf(stderr, "element %lld read by %d lanes (lane8i)\n", i, hits[i]); return 7; }
        }
        fwrite(elem.data(), 4, n, out);
        fwrite(lanes.data(), 4, n, out);
        fwrite(ilanes.data(), 4, n, out);
    } else {
        int be = qx_block_elems(type);
        std::vector<float> x((size_t)nblk * be);
        if (fread(x.data(), 4, x.size(), in) != x.size()) return 4;
        std::vector<char> blk(qx_block_bytes(type), (char)0x5a);
        for (int b = 0; b < nblk; b++) {
            if (be == 32) quantize32_qx(x.data() + 32 * b, type, blk.data());
            else quantize256_qx(x.data() + 256 * b, type, blk.data());
            fwrite(blk.data(), 1, blk.size(), out);
        }
    }
    fclose(out);
    return 0;
}
"#;

/// The host-testable part of `kernels_qx.cu` with the prelude and the driver, built once with
/// the host C++ compiler (`CXX`, else `c++`); `None` (after one printed line) without one,
/// which `METASHARD_REQUIRE_NVRTC=1` (CI) makes a failure.
fn host_program() -> Option<std::path::PathBuf> {
    static PROG: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    PROG.get_or_init(|| {
        let begin = "// HOST-TESTABLE BEGIN";
        let end = "// HOST-TESTABLE END";
        let (a, b) = (SOURCE.find(begin).unwrap(), SOURCE.find(end).unwrap());
        // The type codes are kernels.cu's defines.
        let codes: String = SOURCE
            .lines()
            .filter(|l| l.starts_with("#define T_"))
            .map(|l| format!("{l}\n"))
            .collect();
        let section = format!("{codes}{}", &SOURCE[a..b]);
        let dir = std::env::temp_dir().join(format!("metashard-qx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("qx.cc");
        std::fs::write(&src, format!("{HOST_PRELUDE}{section}{HOST_MAIN}")).unwrap();
        let exe = dir.join("qx");
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        // No contraction into fused multiply-adds: the CPU reference rounds each operation.
        let out = std::process::Command::new(&cxx)
            .args(["-O2", "-std=c++17", "-ffp-contract=off", "-o"])
            .arg(&exe)
            .arg(&src)
            .output();
        match out {
            Ok(o) if o.status.success() => Some(exe),
            Ok(o) => panic!(
                "{cxx} could not compile kernels_qx.cu's host-testable part:\n{}",
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => {
                let required = std::env::var("METASHARD_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
                assert!(!required, "no host C++ compiler ({cxx}: {e})");
                println!("skipped: no host C++ compiler ({cxx}: {e})");
                None
            }
        }
    })
    .clone()
}

/// Runs the host program in `mode` on `input`; its output bytes.
fn run_host(exe: &std::path::Path, mode: &str, dt: DType, nblk: usize, input: &[u8]) -> Vec<u8> {
    let dir = exe.parent().unwrap();
    let (i, o) = (
        dir.join(format!("{mode}-{dt}.in")),
        dir.join(format!("{mode}-{dt}.out")),
    );
    std::fs::write(&i, input).unwrap();
    let code = kernels_for(dt).unwrap().to_string();
    let r = std::process::Command::new(exe)
        .args([mode, &code, &nblk.to_string()])
        .arg(&i)
        .arg(&o)
        .output()
        .unwrap();
    assert!(
        r.status.success(),
        "{dt} {mode}: {:?} {}",
        r.status,
        String::from_utf8_lossy(&r.stderr)
    );
    std::fs::read(&o).unwrap()
}

/// A deterministic byte stream.
fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn host_new_weight_types_dequantize_as_the_dtype_table_element_by_element_and_lane_by_lane() {
    // Random bytes cover every quant and scale bit pattern; the f16 fields are kept finite
    // (exponent below 31). Values must equal the table's (ggml's reference dequantizers,
    // checked against gguf-py in tests/quant_formats.rs) bit for bit, both as `load_qx` reads
    // single elements (get_rows, copies, the cuBLAS path's expansion) and as the GEMV's 32
    // lanes read a row (`lane8`, every quantized type; `lane8i`, the signed-byte quants of the
    // 8-bit-activation GEMV, for its types), each element by exactly one lane.
    let Some(exe) = host_program() else { return };
    let older: &[(DType, &[usize])] = &[
        (DType::Q8_0, &[0]),
        (DType::Q4_0, &[0]),
        (DType::Q4_1, &[0, 2]),
    ];
    for (seed, &(dt, halves)) in QX_TYPES.iter().chain(older).enumerate() {
        let nblk = if dt.block_size() == 32 { 21 } else { 5 };
        let mut row = random_bytes(nblk * dt.type_size(), seed as u64 + 1);
        for b in 0..nblk {
            for &h in halves {
                row[b * dt.type_size() + h + 1] &= 0xbf;
            }
        }
        let n = nblk * dt.block_size();
        let want = metashard::dtype::bytes_to_f32(dt, &row, n).unwrap();
        let got = f32s(&run_host(&exe, "d", dt, nblk, &row));
        let (elem, rest) = got.split_at(n);
        let (lanes, ilanes) = rest.split_at(n);
        let qx = QX_TYPES.iter().any(|&(t, _)| t == dt);
        let q8a = [
            DType::Q8_0,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q5_0,
            DType::Q5_1,
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
        ]
        .contains(&dt);
        for (what, v) in [
            ("load_qx", elem),
            ("lane8 lanes", lanes),
            ("lane8i lanes", ilanes),
        ] {
            if (what == "load_qx" && !qx) || (what == "lane8i lanes" && !q8a) {
                continue;
            }
            for (i, (a, b)) in v.iter().zip(&want).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{dt} {what}: element {i}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn host_quantizing_copies_into_every_new_type_equal_the_reference_quantizers() {
    // k_quantize's Q5_0, Q5_1 and IQ4_NL blocks and k_quantize_qk's super-blocks (their scale
    // searches included) equal the table's reference quantizers byte for byte: random values
    // of several scales, groups of zeros, a constant group, wide and tiny magnitudes, a whole
    // super-block of zeros, an outlier.
    let Some(exe) = host_program() else { return };
    let mut x: Vec<f32> = random_bytes(4 * 256 * 10, 7)
        .chunks_exact(4)
        .map(|c| (u32::from_le_bytes(c.try_into().unwrap()) >> 8) as f32 / (1 << 23) as f32 - 1.0)
        .collect();
    x[32..64].fill(0.0);
    x[64..96].fill(0.75);
    x[96..128].iter_mut().for_each(|v| *v *= 1e4);
    x[128..160].iter_mut().for_each(|v| *v *= 1e-12);
    x[160] = -3.5;
    x[256..512].fill(0.0);
    x[512..768].iter_mut().for_each(|v| *v = v.abs() + 0.25);
    x[768..1024].iter_mut().for_each(|v| *v = -v.abs() * 3.0);
    x[1024..1040].fill(0.0);
    x[1300] = 40.0;
    for (i, v) in x[1536..1792].iter_mut().enumerate() {
        *v *= (i % 7) as f32 * 0.3;
    }
    let input: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    for &(dt, _) in QX_TYPES {
        let want = metashard::dtype::f32_to_bytes(dt, &x).unwrap();
        let got = run_host(&exe, "q", dt, x.len() / dt.block_size(), &input);
        assert_eq!(got.len(), want.len(), "{dt}");
        for (b, (g, w)) in got
            .chunks_exact(dt.type_size())
            .zip(want.chunks_exact(dt.type_size()))
            .enumerate()
        {
            assert_eq!(g, w, "{dt}: block {b}");
        }
    }
}

// ---- on a GPU: decoders in every new weight type ------------------------------------------

/// Why the GPU tests cannot run here, if they cannot.
fn no_gpu() -> Option<String> {
    match metashard::cuda::device::gpu_count() {
        Ok(0) => Some("the CUDA driver sees no GPU".into()),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// The prompt the GPU decoder tests run.
const GPU_PROMPT: &[u32] = &[72, 101, 108, 108, 111, 44, 32, 81, 119, 101, 110, 51, 33];

/// The decoder file at `path` on `cuda` and `cuda:0x2` against `cpu:1x2` (exact products): the
/// prompt's logits within NMSE 1e-4 and 6 greedy tokens equal; what differs goes to
/// `failures`, named by `label`.
fn gpu_decodes_as_the_cpu(path: &std::path::Path, label: &str, failures: &mut Vec<String>) {
    gpu_decodes_as_the_cpu_on(path, label, &["cuda", "cuda:0x2"], None, failures)
}

/// The same on `devices`, the experts split as `experts` (None: the model split's default).
fn gpu_decodes_as_the_cpu_on(
    path: &std::path::Path,
    label: &str,
    devices: &[&str],
    experts: Option<metashard::models::split::ExpertSplit>,
    failures: &mut Vec<String>,
) {
    use metashard::cpu::Precision;
    use metashard::models::layer_split::SplitMode;
    use metashard::runtime::{OpenOptions, open_decoder};
    use metashard::verify::{greedy, nmse};
    let run = |devices: &str, experts| {
        let opts = OpenOptions {
            precision: Precision::Exact,
            split_mode: SplitMode::Tensor,
            experts,
            ..OpenOptions::default()
        };
        let (set, m) = open_decoder(path.to_str().unwrap(), devices, &opts, &|_, _| {})?;
        greedy(&m, &set, GPU_PROMPT, 6)
    };
    // The reference is one CPU device: expert groups need a device per group, so it runs the
    // experts' default split there (one device's result is the same under every split).
    let reference = match experts {
        Some(metashard::models::split::ExpertSplit::Both { .. }) => None,
        e => e,
    };
    let (want_logits, want) = match run("cpu:1x2", reference) {
        Ok(r) => r,
        Err(e) => return failures.push(format!("{label} on the CPU: {e}")),
    };
    for &devices in devices {
        match run(devices, experts) {
            Ok((logits, toks)) => {
                let e = nmse(&logits, &want_logits);
                println!("{label} {devices}: prompt logits NMSE {e:.2e}, tokens {toks:?}");
                if e >= 1e-4 || toks != want {
                    failures.push(format!(
                        "{label} on {devices}: NMSE {e:.2e}, tokens {toks:?} vs {want:?}"
                    ));
                }
            }
            Err(e) => failures.push(format!("{label} on {devices}: {e}")),
        }
    }
}

#[test]
fn synthetic_decoders_in_every_new_weight_type_decode_on_the_gpu_as_on_the_cpu() {
    // A Llama-style decoder written by the project's GGUF writer (random weights, width 256 so
    // every matrix is whole super-blocks), every matrix in one of the new types: the prompt's
    // logits (13 positions: the dequantize-then-cuBLAS path) within NMSE 1e-4 of the CPU's and
    // 6 greedy tokens (one position per step: the GEMV) equal to the CPU's, on `cuda` and on
    // `cuda:0x2` (split through the meta backend). The GPU's stand-in for the real Q4_K_M
    // files (253 MB, more than a GPU call carries).
    use metashard::models::hparams::DecoderConfig;
    use metashard::models::synthetic::gguf_bytes;
    if let Some(why) = no_gpu() {
        println!("skipped: {why}");
        return;
    }
    let dir = std::env::temp_dir().join(format!("metashard-qx-models-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = DecoderConfig::llama(2, 256, 512, 4, 2, 300);
    let mut failures = Vec::new();
    for (seed, &(dt, _)) in QX_TYPES.iter().enumerate() {
        let path = dir.join(format!("synthetic-{dt}.gguf"));
        std::fs::write(&path, gguf_bytes(&cfg, dt, false, 64, seed as u64).unwrap()).unwrap();
        gpu_decodes_as_the_cpu(&path, dt.name(), &mut failures);
    }
    std::fs::remove_dir_all(&dir).ok();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_decoder_family_decodes_on_the_gpu_as_on_the_cpu() {
    // Each decoder architecture on the table (the families' small configurations of
    // tests/support/decoders.rs, Q8_0 weights, Gemma's output tied): Qwen2's biases, Qwen3's
    // QK-norm, Gemma's sliding windows, soft-capping and post-norms, Phi-3's fused QKV, and
    // the mixtures of experts (router top-k by `argsort`, experts by `mul_mat_id`, Qwen2-MoE's
    // shared expert and sigmoid gate) on `cuda` and `cuda:0x2` against the CPU: the prompt's
    // logits within NMSE 1e-4 and 6 greedy tokens equal.
    use metashard::models::arch::ARCHS;
    use metashard::models::synthetic::gguf_bytes;
    if let Some(why) = no_gpu() {
        println!("skipped: {why}");
        return;
    }
    let mut failures = Vec::new();
    for (seed, arch) in ARCHS.iter().enumerate() {
        if arch.decoder().is_err() {
            continue;
        }
        let cfg = decoders::config(arch);
        let tied = arch.name.starts_with("gemma");
        // Mixtral is GGUF `llama` with experts.
        let name = format!(
            "{}{}",
            arch.name,
            if cfg.moe.is_some() { "-moe" } else { "" }
        );
        let bytes = gguf_bytes(&cfg, DType::Q8_0, tied, 64, seed as u64).unwrap();
        let path = decoders::write("cuda-families", &format!("{name}.gguf"), &bytes);
        gpu_decodes_as_the_cpu(&path, &name, &mut failures);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn mixtures_of_experts_split_whole_experts_decode_on_the_gpu_as_on_the_cpu() {
    // Expert parallelism on the GPU: each MoE family with 8 experts (Q8_0), the experts split
    // whole over `cuda:0x2` and `cuda:0x3` (8 over 3: uneven), and in two expert groups
    // (`both`) over `cuda:0x4` and `cuda:0x3`, so every expert product runs the
    // windowed `mul_mat_id` (ids outside a device's experts give zero rows, the output zeroed
    // first) and the MoE block's Routed partial sums meet in one all-reduce: the prompt's logits
    // within NMSE 1e-4 of the CPU's and 6 greedy tokens equal.
    use metashard::models::arch::ARCHS;
    use metashard::models::split::ExpertSplit;
    use metashard::models::synthetic::gguf_bytes;
    if let Some(why) = no_gpu() {
        println!("skipped: {why}");
        return;
    }
    let mut failures = Vec::new();
    for (seed, arch) in ARCHS.iter().enumerate() {
        if arch.decoder().is_err() {
            continue;
        }
        let mut cfg = decoders::config(arch);
        let Some(moe) = cfg.moe.as_mut() else {
            continue;
        };
        moe.n_expert = 8;
        let name = format!("{}-8x-expert-parallel", arch.name);
        let bytes = gguf_bytes(&cfg, DType::Q8_0, false, 64, seed as u64).unwrap();
        let path = decoders::write("cuda-experts", &format!("{name}.gguf"), &bytes);
        gpu_decodes_as_the_cpu_on(
            &path,
            &name,
            &["cuda:0x2", "cuda:0x3"],
            Some(ExpertSplit::Expert),
            &mut failures,
        );
        // Both: whole experts over two groups, column then row inside a group (2 + 2 devices,
        // and 2 + 1: uneven), so the gate and up products are GroupRouted and the down
        // product's partial sums meet in the same all-reduce.
        gpu_decodes_as_the_cpu_on(
            &path,
            &format!("{name} in 2 expert groups"),
            &["cuda:0x4", "cuda:0x3"],
            Some(ExpertSplit::Both { groups: 2 }),
            &mut failures,
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn eight_bit_activation_products_on_the_gpu_follow_the_f32_reference() {
    // `Precision::Q8` on the GPU (`k_quantize_q8a`, `gemv_q8a`): for each type the 8-bit GEMV
    // has, products with 1, 3 and 8 activation rows, two batches sharing the weights
    // (broadcast), two products of the same computed activations (the second reuses the
    // quantized rows), and `mul_mat_id` with 2 of 4 experts per token, all within 2% of the
    // largest value of an f64 product of the dequantized weights (8-bit activations: about
    // 0.4% per value), and not equal to the f32 path's results (the 8-bit path ran).
    use metashard::Graph;
    use metashard::cpu::{CpuOptions, Precision};
    use metashard::devices::parse_devices_with;
    if let Some(why) = no_gpu() {
        println!("skipped: {why}");
        return;
    }
    let run = |precision: Precision, g: &mut Graph| {
        let dev = parse_devices_with("cuda", CpuOptions { precision }).unwrap();
        dev[0].init_backend().unwrap().graph_compute(g).unwrap();
    };
    let (k, n, experts) = (512usize, 72usize, 4usize);
    let rand = |len: usize, seed: u64| -> Vec<f32> {
        random_bytes(len * 4, seed)
            .chunks_exact(4)
            .map(|c| {
                (u32::from_le_bytes(c.try_into().unwrap()) >> 8) as f32 / (1 << 23) as f32 - 1.0
            })
            .collect()
    };
    let mut failures = Vec::new();
    for (seed, dt) in [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
    ]
    .into_iter()
    .enumerate()
    {
        let seed = seed as u64 * 10;
        let wv = rand(k * n * experts, seed + 1);
        let wb = metashard::dtype::f32_to_bytes(dt, &wv).unwrap();
        let wd = metashard::dtype::bytes_to_f32(dt, &wb, wv.len()).unwrap();
        let rows = wb.len() / (n * experts);
        for m in [1usize, 3, 8] {
            let xv = rand(k * m * 2, seed + 2 + m as u64);
            let build = || {
                let mut g = Graph::new();
                let w = g.input("w", dt, [k, n, 1, 1]).unwrap();
                g.set_data(w, wb[..rows * n].to_vec()).unwrap();
                let w2 = g.input("w2", dt, [k, n, 1, 1]).unwrap();
                g.set_data(w2, wb[rows * n..2 * rows * n].to_vec()).unwrap();
                let x = g.input_f32("x", [k, m, 2, 1], &xv).unwrap();
                let xs = g.scale(x, 1.0).unwrap();
                let outs = [g.mul_mat(w, xs).unwrap(), g.mul_mat(w2, xs).unwrap()];
                for &o in &outs {
                    g.set_output(o);
                }
                (g, outs)
            };
            let (mut g8, outs) = build();
            run(Precision::Q8, &mut g8);
            let (mut gf, _) = build();
            run(Precision::Exact, &mut gf);
            for (i, &o) in outs.iter().enumerate() {
                let got = g8.read_f32(o).unwrap();
                let f32_path = gf.read_f32(o).unwrap();
                let wm = &wd[i * k * n..(i + 1) * k * n];
                let want: Vec<f64> = (0..2 * m)
                    .flat_map(|col| {
                        let xc = &xv[col * k..(col + 1) * k];
                        (0..n).map(move |r| {
                            wm[r * k..(r + 1) * k]
                                .iter()
                                .zip(xc)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                        })
                    })
                    .collect();
                let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
                let err = got
                    .iter()
                    .zip(&want)
                    .fold(0f64, |a, (&g, &w)| a.max((g as f64 - w).abs()));
                let label = format!("{dt} M={m} product {i}");
                if err > 0.02 * scale {
                    failures.push(format!("{label}: error {err:.3e} of {scale:.3e}"));
                }
                if got == f32_path {
                    failures.push(format!("{label}: equals the f32 path bit for bit"));
                }
            }
        }
        // mul_mat_id: 3 tokens, 2 of 4 experts each, one activation row per token (n_b = 1).
        let ids_v: Vec<i32> = vec![0, 3, 2, 1, 3, 3];
        let xv = rand(k * 3, seed + 9);
        let mut g = Graph::new();
        let w = g.input("experts", dt, [k, n, experts, 1]).unwrap();
        g.set_data(w, wb.clone()).unwrap();
        let x = g.input_f32("x", [k, 1, 3, 1], &xv).unwrap();
        let ids = g.input_i32("ids", [2, 3, 1, 1], &ids_v).unwrap();
        let o = g.mul_mat_id(w, x, ids).unwrap();
        g.set_output(o);
        run(Precision::Q8, &mut g);
        let got = g.read_f32(o).unwrap();
        let mut err = 0f64;
        let mut scale = 0f64;
        for t in 0..3 {
            for e in 0..2 {
                let ex = ids_v[t * 2 + e] as usize;
                for r in 0..n {
                    let wr = &wd[(ex * n + r) * k..(ex * n + r + 1) * k];
                    let want: f64 = wr
                        .iter()
                        .zip(&xv[t * k..(t + 1) * k])
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum();
                    scale = scale.max(want.abs());
                    err = err.max((got[(t * 2 + e) * n + r] as f64 - want).abs());
                }
            }
        }
        if err > 0.02 * scale {
            failures.push(format!("{dt} mul_mat_id: error {err:.3e} of {scale:.3e}"));
        }
        println!("{dt}: mul_mat_id error {:.2e} of the largest", err / scale);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn nccl_takes_one_rank_per_gpu_and_names_a_gpu_given_twice() {
    use metashard::cuda::nccl::nccl_device_list;
    assert_eq!(nccl_device_list(&[0, 1, 3]).unwrap(), vec![0, 1, 3]);
    let e = nccl_device_list(&[1, 0, 1]).unwrap_err().to_string();
    assert!(e.contains("cuda1") && e.contains("twice"), "{e}");
    assert!(nccl_device_list(&[]).is_err());
}

#[test]
fn nccl_gather_plans_fill_the_full_tensor_as_the_layout_says() {
    // What the NCCL communicator does without a GPU: for each layout, every rank's slice
    // placed by NCCL's all-gather (Direct: slices concatenated in rank order) or by the staged
    // broadcasts (Staged: slice q at `at[q]` of the staging block) and then `staged_copies`,
    // must equal the full tensor the layout's own runs assemble. Layouts: an even split of the
    // outermost axis (Direct), uneven extents, an inner axis (outer > 1), fused segments, zero
    // extents, one rank, equal slices out of rank order.
    use metashard::collectives::SliceLayout;
    use metashard::cuda::nccl::{GatherPlan, gather_plan, staged_copies};
    let cases: Vec<(SliceLayout, bool)> = vec![
        (SliceLayout::single(1, 8, &[3, 3, 3]).unwrap(), true),
        (SliceLayout::single(1, 8, &[3, 2, 4]).unwrap(), false),
        (SliceLayout::single(5, 4, &[2, 2]).unwrap(), false),
        (SliceLayout::new(1, 4, &[[2, 2], [3, 3]]).unwrap(), false),
        (SliceLayout::single(3, 2, &[0, 5, 1]).unwrap(), false),
        (SliceLayout::single(1, 16, &[0, 0]).unwrap(), true),
        (SliceLayout::single(4, 2, &[7]).unwrap(), true),
        // One run per rank of equal size, but rank 1's before rank 0's: not NCCL's order.
        (SliceLayout::new(1, 4, &[[0, 2], [2, 0]]).unwrap(), false),
    ];
    for (i, (layout, direct)) in cases.iter().enumerate() {
        let world = layout.world();
        let locals: Vec<Vec<u8>> = (0..world)
            .map(|r| random_bytes(layout.local_bytes(r), (i * 16 + r) as u64 + 1))
            .collect();
        let mut want = vec![0u8; layout.full_bytes()];
        for (r, l) in locals.iter().enumerate() {
            layout.gather_into(l, r, &mut want).unwrap();
        }
        let got = match gather_plan(layout) {
            GatherPlan::Direct { bytes } => {
                assert!(*direct, "case {i}: {} planned Direct", layout.describe());
                assert!(locals.iter().all(|l| l.len() == bytes), "case {i}");
                locals.concat()
            }
            GatherPlan::Staged { at, total } => {
                assert!(!direct, "case {i}: {} planned Staged", layout.describe());
                let mut staging = vec![0xa5u8; total];
                for (q, l) in locals.iter().enumerate() {
                    staging[at[q]..at[q] + l.len()].copy_from_slice(l);
                }
                let mut full = vec![0u8; layout.full_bytes()];
                for (src, dst, len) in staged_copies(layout, &at) {
                    full[dst..dst + len].copy_from_slice(&staging[src..src + len]);
                }
                full
            }
        };
        assert_eq!(got, want, "case {i}: {}", layout.describe());
    }
}
