//! ggml's quantized block formats (`metashard::dtype`: Q4_0 .. Q8_0, Q5_0, Q5_1, the K-quants
//! Q2_K .. Q8_K, IQ4_NL, IQ4_XS) against outside implementations: their sizes are gguf-py's
//! `GGML_QUANT_SIZES`; every dequantizer equals gguf-py's (`gguf.quants.dequantize`; numpy's
//! `d * q` for Q8_K, which gguf-py lacks) bit for bit on random blocks; the quantizers gguf-py
//! has (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) equal it byte for byte; every quantizer's round trip stays
//! within ggml's own error bounds (tests/test-quantize-fns.cpp) and re-quantizing what it
//! produced keeps it where ggml's algorithm does. The real Gemma 3 270M Q4_K_M file
//! (`quant_formats/gemma.rs`) dequantizes tensor by tensor as gguf-py does and loads; a weight of
//! a type without kernels (Q8_K) is refused by the loader with an error naming it.
//!
//! The K-quant and IQ4 quantizers were compared with ggml's C reference quantizers
//! (`quantize_row_*_ref`) outside the test suite, which has no ggml: see docs/kernels.md.
//! Python comparisons (`scripts/reference/quants_ref.py`) fail when python3 or the `gguf`
//! package is missing, unless `METASHARD_SKIP_PYREF=1` (then they are skipped with a note).

use metashard::dtype::{
    BlockIq4Nl, BlockIq4Xs, BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0,
    BlockQ5_1, BlockQ5K, BlockQ6K, BlockQ8_0, BlockQ8K, Format, formats,
};
use std::mem::offset_of;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[allow(dead_code)]
#[path = "support/rng.rs"]
mod rng;
use rng::Rng;

#[path = "quant_formats/gemma.rs"]
mod gemma;

/// Every quantized format, with the byte offsets of its f16 scales (`f32` for Q8_K's).
const TYPES: &[(&str, &[usize])] = &[
    ("q4_0", &[offset_of!(BlockQ4_0, d)]),
    (
        "q4_1",
        &[offset_of!(BlockQ4_1, d), offset_of!(BlockQ4_1, m)],
    ),
    ("q5_0", &[offset_of!(BlockQ5_0, d)]),
    (
        "q5_1",
        &[offset_of!(BlockQ5_1, d), offset_of!(BlockQ5_1, m)],
    ),
    ("q8_0", &[offset_of!(BlockQ8_0, d)]),
    (
        "q2_k",
        &[offset_of!(BlockQ2K, d), offset_of!(BlockQ2K, dmin)],
    ),
    ("q3_k", &[offset_of!(BlockQ3K, d)]),
    (
        "q4_k",
        &[offset_of!(BlockQ4K, d), offset_of!(BlockQ4K, dmin)],
    ),
    (
        "q5_k",
        &[offset_of!(BlockQ5K, d), offset_of!(BlockQ5K, dmin)],
    ),
    ("q6_k", &[offset_of!(BlockQ6K, d)]),
    ("q8_k", &[offset_of!(BlockQ8K, d)]),
    ("iq4_nl", &[offset_of!(BlockIq4Nl, d)]),
    ("iq4_xs", &[offset_of!(BlockIq4Xs, d)]),
];

fn format(name: &str) -> Format {
    formats()
        .find(|f| f.ggml.name == name)
        .unwrap_or_else(|| panic!("no format {name}"))
}

/// A scratch folder unique to this process and `name`; removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let p =
            std::env::temp_dir().join(format!("metashard-quants-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `scripts/reference/quants_ref.py` with `args`, not yet waited for.
fn quants_ref(args: &[&str]) -> std::io::Result<std::process::Child> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/reference/quants_ref.py");
    Command::new("python3")
        .arg(script)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
}

/// The script's stdout; `None` (with a note) when python3 or gguf is missing and
/// METASHARD_SKIP_PYREF=1, a failure otherwise.
fn finish(run: std::io::Result<std::process::Child>) -> Option<String> {
    let skip = |why: String| {
        if std::env::var("METASHARD_SKIP_PYREF").as_deref() != Ok("1") {
            panic!(
                "the gguf-py reference cannot run: {why}\ninstall it with \
                 `python3 -m pip install -r scripts/requirements.txt`, or set METASHARD_SKIP_PYREF=1"
            );
        }
        eprintln!("NOTE: METASHARD_SKIP_PYREF=1: skipping the comparison with gguf-py: {why}");
        None
    };
    let out: Output = match run.and_then(|c| c.wait_with_output()) {
        Ok(o) => o,
        Err(e) => return skip(format!("python3 cannot be started: {e}")),
    };
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(3) {
        return skip(err.trim().to_string());
    }
    assert!(out.status.success(), "quants_ref.py failed: {err}");
    Some(String::from_utf8(out.stdout).unwrap())
}

fn read_f32(p: &Path) -> Vec<f32> {
    std::fs::read(p)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A standard normal draw (Box-Muller).
fn normal(r: &mut Rng) -> f32 {
    let (u, v) = (r.unit().max(1e-300), r.unit());
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}

/// `n_blocks` random blocks of `f`: random bytes with sane scales (finite, of any sign, from
/// 1e-7 to 10 in magnitude, some zero, some subnormal f16).
fn random_blocks(f: &Format, scales: &[usize], n_blocks: usize, r: &mut Rng) -> Vec<u8> {
    let ts = f.ggml.type_size;
    let mut b = r.bytes(n_blocks * ts);
    for blk in b.chunks_exact_mut(ts) {
        for &o in scales {
            let v = match r.below(16) {
                0 => 0.0,
                1 => r.uniform(-6e-5, 6e-5),
                _ => normal(r) * 10f32.powf(r.uniform(-7.0, 1.0)),
            };
            if f.ggml.name == "q8_k" {
                blk[o..o + 4].copy_from_slice(&v.to_le_bytes());
            } else {
                blk[o..o + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
    }
    b
}

/// Values of every kind the quantizers meet, by 256: Gaussian, uniform at scales from
/// `10^lo` to `10^hi`, outliers, all of one sign, on a grid, Laplacian, group scales far apart;
/// no exact zeros (gguf-py and ggml disagree on the sign of a zero minimum) and no magnitudes
/// an f16 scale cannot hold.
fn mixed_values(n_blocks: usize, (lo, hi): (f32, f32), r: &mut Rng) -> Vec<f32> {
    let mut x = Vec::with_capacity(256 * n_blocks);
    for i in 0..n_blocks {
        let scale = 10f32.powf(r.uniform(lo, hi));
        let group: Vec<f32> = (0..16).map(|_| 10f32.powf(r.uniform(-3.0, 2.0))).collect();
        for j in 0..256 {
            let g = normal(r);
            let v = match i % 8 {
                0 => g,
                1 => r.uniform(-1.0, 1.0) * scale,
                2 if j % 97 == 5 => g * 50.0,
                3 => g.abs() + 1.5,
                4 => -g.abs() - 0.5,
                5 => (g * 4.0).round() / 4.0 + 1.0 / 64.0,
                6 => g * g.abs() * 0.02,
                _ => g * group[j / 16],
            };
            x.push(if v == 0.0 { 1e-3 } else { v });
        }
    }
    x
}

#[test]
fn sizes_are_gguf_py_s() {
    let names: Vec<&str> = TYPES.iter().map(|t| t.0).collect();
    let mut args = vec!["sizes"];
    args.extend(&names);
    let Some(out) = finish(quants_ref(&args)) else {
        return;
    };
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    for name in names {
        let f = format(name);
        let want = (j[name][0].as_u64(), j[name][1].as_u64());
        let got = (
            Some(f.ggml.block_size as u64),
            Some(f.ggml.type_size as u64),
        );
        assert_eq!(got, want, "{name}: block size and bytes per block");
    }
}

/// The first block whose values differ in any bit, with both blocks' values.
fn first_difference(ours: &[f32], theirs: &[f32], block: usize) -> Option<String> {
    let (ob, tb) = (ours.chunks(block), theirs.chunks(block));
    for (i, (o, t)) in ob.zip(tb).enumerate() {
        if o.iter().zip(t).any(|(a, b)| a.to_bits() != b.to_bits()) {
            return Some(format!("block {i}: ours {o:?}\n gguf-py {t:?}"));
        }
    }
    None
}

#[test]
fn dequantizers_equal_gguf_py_bit_for_bit() {
    let dir = Scratch::new("dequant");
    let mut r = Rng::new(17);
    let mut ours = Vec::new();
    for &(name, scales) in TYPES {
        let f = format(name);
        // About 256 Ki values per type.
        let blocks = random_blocks(&f, scales, (1 << 18) / f.ggml.block_size, &mut r);
        std::fs::write(dir.0.join(format!("{name}.bin")), &blocks).unwrap();
        ours.push(f.dequantize(&blocks).unwrap());
    }
    let mut args = vec!["dequant", dir.0.to_str().unwrap()];
    args.extend(TYPES.iter().map(|t| t.0));
    if finish(quants_ref(&args)).is_none() {
        return;
    }
    for (&(name, _), ours) in TYPES.iter().zip(&ours) {
        let theirs = read_f32(&dir.0.join(format!("{name}.py.f32")));
        assert_eq!(ours.len(), theirs.len(), "{name}");
        let bs = format(name).ggml.block_size;
        if let Some(d) = first_difference(ours, &theirs, bs) {
            panic!("{name}: dequantized values differ from gguf-py's: {d}");
        }
        eprintln!("{name}: {} random blocks equal", ours.len() / bs);
    }
}

#[test]
fn quantizers_equal_gguf_py_s_where_it_has_one() {
    let dir = Scratch::new("quant");
    // Scales down to 1e-6 round to f16 subnormals: both must round them alike.
    let x = mixed_values(512, (-6.0, 4.0), &mut Rng::new(5));
    std::fs::write(dir.0.join("input.f32"), f32_bytes(&x)).unwrap();
    // gguf-py quantizes these; its K-quant and IQ4 classes only dequantize.
    let names = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"];
    let mut args = vec!["quant", dir.0.to_str().unwrap()];
    args.extend(names);
    if finish(quants_ref(&args)).is_none() {
        return;
    }
    for name in names {
        let f = format(name);
        let ours = f.quantize(&x).unwrap();
        let theirs = std::fs::read(dir.0.join(format!("{name}.py.bin"))).unwrap();
        assert_eq!(ours.len(), theirs.len(), "{name}");
        let ts = f.ggml.type_size;
        let differ: Vec<usize> = (0..ours.len() / ts)
            .filter(|i| ours[i * ts..(i + 1) * ts] != theirs[i * ts..(i + 1) * ts])
            .collect();
        assert!(
            differ.is_empty(),
            "{name}: {} of {} blocks differ from gguf-py's, first {:?}",
            differ.len(),
            ours.len() / ts,
            &differ[..differ.len().min(8)]
        );
    }
}

/// How re-quantizing the dequantized values of a quantization behaves with ggml's reference
/// algorithm (measured against ggml's C quantizers, docs/kernels.md).
#[derive(Clone, Copy, Debug)]
enum Requantize {
    /// The same values (0.0 and -0.0 counted equal): the blocks of 32, whose one scale is
    /// recomputed from the same largest magnitude.
    Same,
    /// Values within `x` times the block's largest magnitude (measured, with a margin): the
    /// K-quants' scale searches need not find the representation they came from (sub-block
    /// scales on a 4-, 6- or 8-bit grid against a new largest one); Q8_K's f32 scale is
    /// recomputed with another rounding.
    Within(f32),
}

/// Half an ulp of f16 relative to the value: how far a rounded block scale may be off.
const F16_EPS: f32 = 1.0 / 2048.0;

/// Per type: ggml's bound on its total error `sqrt(sum (x - y)^2) / n` for its test data
/// `0.1 + 2 cos(i)` (test-quantize-fns.cpp: MAX_QUANTIZATION_TOTAL_ERROR and the 2- and 3-bit
/// ones); the largest error over a block's largest magnitude on mixed data (for the blocks of
/// 32 the step's bound: half a step, or a whole one where the largest magnitude's side is
/// clipped, plus the f16 rounding of d and m times the largest quant; measured, with a margin,
/// for the others, whose scales are quantized against the block's largest); and how
/// re-quantizing behaves.
const BOUNDS: &[(&str, f32, f32, Requantize)] = &[
    ("q4_0", 0.002, 1.0 / 8.0 + F16_EPS, Requantize::Same),
    ("q4_1", 0.002, 1.0 / 15.0 + 3.0 * F16_EPS, Requantize::Same),
    ("q5_0", 0.002, 1.0 / 16.0 + F16_EPS, Requantize::Same),
    ("q5_1", 0.002, 1.0 / 31.0 + 3.0 * F16_EPS, Requantize::Same),
    ("q8_0", 0.002, 1.0 / 254.0 + F16_EPS, Requantize::Same),
    ("q2_k", 0.0075, 0.40, Requantize::Within(0.08)),
    ("q3_k", 0.0040, 0.30, Requantize::Within(0.30)),
    ("q4_k", 0.002, 0.11, Requantize::Within(0.03)),
    ("q5_k", 0.002, 0.06, Requantize::Within(0.04)),
    ("q6_k", 0.002, 0.025, Requantize::Within(0.008)),
    ("q8_k", 0.002, 1.0 / 254.0 + 1e-6, Requantize::Within(1e-6)),
    ("iq4_nl", 0.002, 0.15, Requantize::Same),
    ("iq4_xs", 0.002, 0.16, Requantize::Within(0.07)),
];

/// The largest `|a - b|` over the largest `|a|` of any block.
fn worst_relative(a: &[f32], b: &[f32], block: usize) -> f32 {
    let mut worst = 0f32;
    for (a, b) in a.chunks(block).zip(b.chunks(block)) {
        let amax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e = a.iter().zip(b).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        if amax > 0.0 {
            worst = worst.max(e / amax);
        }
    }
    worst
}

#[test]
fn round_trips_stay_within_ggml_s_bounds() {
    assert_eq!(BOUNDS.len(), TYPES.len());
    let cos: Vec<f32> = (0..4096).map(|i| 0.1 + 2.0 * (i as f32).cos()).collect();
    // Scales large enough for normal f16 block scales (tiny ones lose the bounds' precision).
    let mut x = mixed_values(128, (0.0, 3.0), &mut Rng::new(9));
    // Blocks of zeros and of one value.
    x.extend([0f32; 256]);
    x.extend([-0.75f32; 256]);
    for &(name, total_bound, block_bound, requantize) in BOUNDS {
        let f = format(name);
        let bs = f.ggml.block_size;
        let y = f.dequantize(&f.quantize(&cos).unwrap()).unwrap();
        let sq: f64 = cos
            .iter()
            .zip(&y)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let total = (sq.sqrt() / cos.len() as f64) as f32;
        assert!(
            total < total_bound,
            "{name}: total error {total} (ggml's bound {total_bound})"
        );

        let y = f.dequantize(&f.quantize(&x).unwrap()).unwrap();
        let worst = worst_relative(&x, &y, bs);
        assert!(
            worst <= block_bound,
            "{name}: error {worst} of the block's amax"
        );
        assert!(
            y[y.len() - 512..y.len() - 256].iter().all(|&v| v == 0.0),
            "{name}: zeros"
        );
        let last = &y[y.len() - 256..];
        assert!(
            last.iter().all(|&v| (v + 0.75).abs() <= 0.75 * block_bound),
            "{name}"
        );

        let again = f.dequantize(&f.quantize(&y).unwrap()).unwrap();
        match requantize {
            Requantize::Same => {
                let at = y.iter().zip(&again).position(|(a, b)| a != b);
                assert_eq!(at, None, "{name}: re-quantized values differ at {at:?}");
            }
            Requantize::Within(bound) => {
                let w = worst_relative(&y, &again, bs);
                assert!(
                    w <= bound,
                    "{name}: re-quantized values move by {w} of amax"
                );
            }
        }
        eprintln!("{name}: total error {total:.5}, worst {worst:.4} of the block's amax");
    }
}

/// Q4_1's minimum keeps the sign of the first zero ggml's loop meets (`v < min` from FLT_MAX).
#[test]
fn a_zero_minimum_keeps_ggml_s_sign() {
    for (first, bits) in [(0.0f32, 0x0000u16), (-0.0, 0x8000)] {
        let mut x = vec![1.0f32; 32];
        x[3] = first;
        x[9] = -first;
        for name in ["q4_1", "q5_1"] {
            let b = format(name).quantize(&x).unwrap();
            assert_eq!(
                u16::from_le_bytes([b[2], b[3]]),
                bits,
                "{name}: m of {first:?}"
            );
        }
    }
}
