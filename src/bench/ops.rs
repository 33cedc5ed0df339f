//! The per-op kernel benchmark: a fixed list of `mul_mat` shapes (F32 GEMM 1024^3 and 2048^3,
//! decode shapes K = N = 4096 with M = 1 and 32 for every weight dtype, ggml's
//! `test-backend-ops` shape N = 4096, K = 14336, M = 1 and 2) plus a streaming-read bandwidth
//! probe, each timed through a [`ThreadPool`] calling [`matmul::forward_with`] directly.
//!
//! Weights that would fit in the last-level cache are rotated between several copies (at
//! least [`ROTATE_BYTES`] in all), so memory-bound shapes are measured from DRAM as in a real
//! decode step. The GEMM cases reuse one copy (compute-bound, as numpy's timing loop does).

use super::{Repeat, time_it};
use crate::cli::{JsonArgs, PrecisionsArgs};
use metashard::cpu::matmul::{self, Isa};
use metashard::cpu::{ComputeParams, Precision, TensorView, ThreadPool};
use metashard::dtype::row_from_f32;
use metashard::{DType, Result};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// Total bytes of weight copies that rotating cases cycle through (several times the 32 MiB
/// L3 of the machine this was tuned on).
pub const ROTATE_BYTES: usize = 128 << 20;
/// Size of the streaming-read buffer.
pub const STREAM_BYTES: usize = 256 << 20;
/// Interleaved streams per thread of the second streaming-read case.
pub const STREAMS: usize = 8;

#[derive(Clone, Debug, clap::Args)]
#[command(mut_arg("precision", |a| a.help(
    "Precisions of products with quantized weights, e.g. `exact,q8` (each quantized case runs \
     at each, side by side)"
)))]
#[command(mut_arg("json", |a| a.help("Print the results as JSON instead of a table")))]
pub struct BenchOpsArgs {
    /// Thread counts (each case runs at each).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 2])]
    pub threads: Vec<usize>,
    /// Only cases whose label contains this text, e.g. "q4_0" or "m=1 ".
    #[arg(long)]
    pub filter: Option<String>,
    #[command(flatten)]
    pub precision: PrecisionsArgs,
    /// M values of the K = N = 4096 cases (default 1,32), of the 4096 x 14336 cases
    /// (default 1,2) and of the small models' cases (SmolLM2 K = 576, Gemma 3 270M K = 640) (default 1; above 1 with its down and K/V
    /// shapes).
    #[arg(long, value_delimiter = ',')]
    pub m: Option<Vec<usize>>,
    /// Also time numpy (scripts/bench_numpy.py) in this run and print the ratios.
    #[arg(long)]
    pub numpy: bool,
    /// Keep one copy of the weights (may stay in cache, as ggml's perf mode does).
    #[arg(long)]
    pub no_rotate: bool,
    #[command(flatten)]
    pub out: JsonArgs,
}

/// `bench ops`: time every selected case (progress on stderr), with `--numpy` numpy's times
/// of the same cases beside them, and print the table or JSON.
pub fn run(a: &BenchOpsArgs) -> Result<()> {
    let opts = OpsBenchOptions {
        threads: a.threads.clone(),
        precisions: a.precision.list(),
        ms: a.m.clone(),
        filter: a.filter.clone(),
        rotate: !a.no_rotate,
        ..Default::default()
    };
    let results = measure(&opts)?;
    let refs = if a.numpy {
        numpy_refs(&a.threads, a.filter.as_deref())?
    } else {
        Vec::new()
    };
    a.out.print("bench ops results", &results, |r| {
        print!("{}", print_table(r, &refs))
    })
}

/// numpy's times of the cases (`scripts/bench_numpy.py --json`, run now at `threads`).
fn numpy_refs(threads: &[usize], filter: Option<&str>) -> Result<Vec<RefResult>> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/bench_numpy.py");
    let t: Vec<String> = threads.iter().map(|t| t.to_string()).collect();
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(&script)
        .arg("--threads")
        .arg(t.join(","))
        .arg("--json");
    if let Some(f) = filter {
        cmd.arg("--filter").arg(f);
    }
    eprintln!("timing numpy ...");
    let out = cmd.output().map_err(|e| metashard::Error::io(&script, e))?;
    if !out.status.success() {
        return Err(metashard::Error::ProgramFailed {
            program: script,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    parse_refs(
        &String::from_utf8_lossy(&out.stdout),
        "bench_numpy.py output",
    )
}

/// What to run.
#[derive(Clone, Debug)]
pub struct OpsBenchOptions {
    /// Thread counts; every case runs at each.
    pub threads: Vec<usize>,
    /// SIMD level (default: the best this CPU has).
    pub isa: Option<Isa>,
    /// Precisions of products with quantized weights; quantized cases run at each (float
    /// weights once). Empty: [`Precision::Exact`].
    pub precisions: Vec<Precision>,
    /// M values of the K = N = 4096 cases (default 1 and 32), of the N = 4096, K = 14336
    /// cases (default 1 and 2) and of the small models' shapes (SmolLM2, Gemma 3 270M; default 1).
    pub ms: Option<Vec<usize>>,
    /// Only cases whose label contains this substring (e.g. "q4_0", "m=1 ").
    pub filter: Option<String>,
    pub repeat: Repeat,
    /// Rotate weight copies for memory-bound cases (false: one copy, which may stay in cache,
    /// as ggml's `test-backend-ops perf` measures).
    pub rotate: bool,
    /// Progress lines on stderr.
    pub progress: bool,
}

impl Default for OpsBenchOptions {
    fn default() -> Self {
        OpsBenchOptions {
            threads: vec![1, 2],
            isa: None,
            precisions: vec![Precision::Exact],
            ms: None,
            filter: None,
            repeat: Repeat::default(),
            rotate: true,
            progress: true,
        }
    }
}

/// One measured case.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OpBenchResult {
    /// `mul_mat` or `stream_read` (whose `m` is the number of interleaved streams per thread).
    pub op: String,
    pub dtype: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub threads: usize,
    pub isa: String,
    /// `auto`, `q8` or `exact` (float weights: `-`).
    pub precision: String,
    /// The activations were quantized to 8 bits (what `auto` chose, for quantized weights).
    pub q8_activations: bool,
    pub median_us: f64,
    pub min_us: f64,
    pub reps: usize,
    /// `2 * m * n * k / median` (for `stream_read`: additions per second).
    pub gflops: f64,
    /// Weight + activation + output bytes per median time (`stream_read`: bytes read).
    pub gbps: f64,
}

/// A result from another implementation (numpy, ggml) for the same shape, as written by
/// `scripts/bench_numpy.py --json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RefResult {
    pub source: String,
    pub op: String,
    pub dtype: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub threads: usize,
    pub median_us: f64,
    pub gflops: f64,
    pub gbps: f64,
}

/// A benchmark case.
#[derive(Clone, Copy, Debug)]
pub struct OpCase {
    pub op: &'static str,
    pub dtype: DType,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Rotate weight copies (memory-bound shapes).
    pub rotate: bool,
}

impl OpCase {
    pub fn label(&self) -> String {
        match self.op {
            "stream_read" => stream_label(self.m),
            _ => format!(
                "{} {} m={} n={} k={}",
                self.op, self.dtype, self.m, self.n, self.k
            ),
        }
    }
}

/// The case list with the K = N = 4096 cases at `ms`, the N = 4096, K = 14336 cases at
/// `wide_ms` and the small models' shapes (SmolLM2, Gemma 3 270M) at `small_ms`.
pub fn cases_with(ms: &[usize], wide_ms: &[usize], small_ms: &[usize]) -> Vec<OpCase> {
    let mm = |dtype, m, n, k, rotate| OpCase {
        op: "mul_mat",
        dtype,
        m,
        n,
        k,
        rotate,
    };
    // Streaming reads: one sequential stream per thread, and 8 interleaved streams per thread
    // (more misses in flight, as a GEMV over 8 weight rows has).
    let stream = |m| OpCase {
        op: "stream_read",
        dtype: DType::F32,
        m,
        n: 0,
        k: 0,
        rotate: false,
    };
    let mut v = vec![stream(1), stream(STREAMS)];
    v.push(mm(DType::F32, 1024, 1024, 1024, false));
    v.push(mm(DType::F32, 2048, 2048, 2048, false));
    for &m in ms {
        for &dt in DType::WEIGHT_TYPES {
            v.push(mm(dt, m, 4096, 4096, true));
        }
    }
    // ggml test-backend-ops perf shape (its m = our N, its n = our M), and the types of
    // Q4_K_M / Q5_K_M files, Q3_K_M / Q2_K files and the IQ4 and Q5_1 uploads.
    for &m in wide_ms {
        for dt in [
            DType::F32,
            DType::F16,
            DType::Q8_0,
            DType::Q4_0,
            DType::Q5_0,
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
            DType::Q3_K,
            DType::Q2_K,
            DType::IQ4_XS,
            DType::IQ4_NL,
            DType::Q5_1,
        ] {
            v.push(mm(dt, m, 4096, 14336, true));
        }
    }
    // SmolLM2-135M's decode shapes (short rows: K = 576): the tied Q8_0 output projection and
    // the Q4_1 FFN up/gate projection (at M = 8 also its down projection, K = 1536, and its
    // K/V projection, N = 192: a batched step of `serve`).
    for &m in small_ms {
        v.push(mm(DType::Q8_0, m, 49152, 576, true));
        v.push(mm(DType::Q4_1, m, 1536, 576, true));
        if m > 1 {
            v.push(mm(DType::Q4_1, m, 576, 1536, true));
            v.push(mm(DType::Q4_1, m, 192, 576, true));
        }
        // Gemma 3 270M Q4_K_M's (K = 640: 20 Q5_0 blocks a row): the Q5_0 gate and up
        // projections and the Q6_K / Q4_K down projections.
        v.push(mm(DType::Q5_0, m, 2048, 640, true));
        v.push(mm(DType::Q6_K, m, 640, 2048, true));
        v.push(mm(DType::Q4_K, m, 640, 2048, true));
        if m == 1 {
            // Gemma 3's tied output (262,144 x 640 Q8_0, 178 MB: streamed from memory).
            v.push(mm(DType::Q8_0, m, 262144, 640, true));
        }
    }
    // The F32 MLP stack of `bench meta --graph mlp` and ggml's meta-backend comparison
    // (D = 1024, F = 4096), one token: its up and down projections.
    v.push(mm(DType::F32, 1, 4096, 1024, true));
    v.push(mm(DType::F32, 1, 1024, 4096, true));
    v
}

/// Run every selected case at every thread count.
pub fn measure(opts: &OpsBenchOptions) -> Result<Vec<OpBenchResult>> {
    let isa = opts.isa.unwrap_or_else(Isa::detect).clamp();
    let ms = opts.ms.clone().unwrap_or_else(|| vec![1, 32]);
    // The 4096 x 14336 cases: M = 1 and 2 unless M values are given.
    let wide_ms = opts.ms.clone().unwrap_or_else(|| vec![1, 2]);
    if ms.iter().any(|&m| m == 0 || m > 4096) {
        return Err(metashard::Error::invalid_input(
            "bench ops",
            "M values",
            "each in 1..=4096",
            format!("{ms:?}"),
        ));
    }
    let precisions = if opts.precisions.is_empty() {
        vec![Precision::Exact]
    } else {
        opts.precisions.clone()
    };
    // SmolLM2's shapes: M = 1 unless M values are given.
    let small_ms = opts.ms.clone().unwrap_or_else(|| vec![1]);
    let selected: Vec<OpCase> = cases_with(&ms, &wide_ms, &small_ms)
        .into_iter()
        .filter(|c| opts.filter.as_deref().is_none_or(|f| c.label().contains(f)))
        .collect();
    if opts.threads.is_empty() || opts.threads.iter().any(|&t| t == 0 || t > 256) {
        return Err(metashard::Error::invalid_input(
            "bench ops",
            "thread counts",
            "at least one, each in 1..=256",
            format!("{:?}", opts.threads),
        ));
    }
    let pools: Vec<ThreadPool> = opts
        .threads
        .iter()
        .map(|&t| ThreadPool::new(t, "bench"))
        .collect::<Result<_>>()?;
    let total = selected.len() * pools.len();
    let mut out = Vec::with_capacity(total);
    // Each pool's first measurement is preceded by half a second of the same product, untimed:
    // without it the first row of a run measured up to 3x slow for a short product (Gemma's
    // Q5_0 K = 640 GEMV, 2 threads: 246 us first, 84 us when measured again in the same run),
    // while a new worker thread settles on its core.
    let mut warmed = vec![false; pools.len()];
    let settle = OpsBenchOptions {
        repeat: Repeat {
            warmup: 0,
            min_reps: 1,
            min_time: std::time::Duration::from_millis(500),
            max_reps: usize::MAX,
        },
        ..opts.clone()
    };
    for (ci, case) in selected.iter().enumerate() {
        let max_threads = pools.iter().map(|p| p.nth()).max().unwrap_or(1);
        // Float weights and the streaming probe do not depend on the precision.
        let precs: Vec<Option<Precision>> = if case.dtype.is_quantized() && case.op == "mul_mat" {
            precisions.iter().map(|&p| Some(p)).collect()
        } else {
            vec![None]
        };
        let data = CaseData::new(case, &precisions, opts.rotate, max_threads);
        for (pi, pool) in pools.iter().enumerate() {
            for &prec in &precs {
                if opts.progress {
                    eprintln!(
                        "[{}/{}] {} threads={} isa={isa}{}",
                        ci * pools.len() + pi + 1,
                        total,
                        case.label(),
                        pool.nth(),
                        prec.map_or(String::new(), |p| format!(" precision={p}"))
                    );
                }
                if !std::mem::replace(&mut warmed[pi], true) {
                    data.measure(case, pool, isa, prec, &settle)?;
                }
                let r = data.measure(case, pool, isa, prec, opts)?;
                if opts.progress {
                    eprintln!(
                        "    {:.1} us  {:.1} GFLOP/s  {:.1} GB/s",
                        r.median_us, r.gflops, r.gbps
                    );
                }
                out.push(r);
            }
        }
    }
    Ok(out)
}

/// A 64-byte aligned byte buffer in host memory as the CPU backend allocates it (huge pages
/// from 2 MiB on Linux), so streaming cases read memory of the kind a model's weights are in.
struct Aligned {
    buf: metashard::buffer::HostBuffer,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let len = len.div_ceil(64).max(1) * 64;
        Aligned {
            buf: metashard::buffer::HostBuffer::new(len).expect("benchmark buffers fit in memory"),
            len,
        }
    }
    fn ptr(&self) -> *mut u8 {
        metashard::buffer::Buffer::host_ptr(&self.buf).expect("host memory")
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the buffer owns `len` zero-initialized bytes, borrowed exclusively here.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }
}

/// Inputs of one case, shared by its thread counts.
struct CaseData {
    weights: Vec<Aligned>,
    x: Aligned,
    d: Aligned,
    work: Aligned,
    wbytes: usize,
}

impl CaseData {
    fn new(c: &OpCase, precisions: &[Precision], rotate: bool, max_threads: usize) -> CaseData {
        if c.op == "stream_read" {
            let mut buf = Aligned::new(STREAM_BYTES);
            // Fill with 1.0f32 so the pages are really allocated.
            for ch in buf.bytes_mut().chunks_exact_mut(4) {
                ch.copy_from_slice(&1.0f32.to_le_bytes());
            }
            return CaseData {
                weights: vec![buf],
                x: Aligned::new(0),
                d: Aligned::new(0),
                work: Aligned::new(0),
                wbytes: STREAM_BYTES,
            };
        }
        let row = c.dtype.row_size(c.k);
        let wbytes = row * c.n;
        let mut first = Aligned::new(wbytes);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut vals = vec![0f32; c.k];
        for r in 0..c.n {
            vals.iter_mut().for_each(|v| *v = rand(&mut seed));
            row_from_f32(
                c.dtype,
                &vals,
                &mut first.bytes_mut()[r * row..(r + 1) * row],
            )
            .expect("row sizes follow from the case");
        }
        let copies = if c.rotate && rotate {
            ROTATE_BYTES.div_ceil(wbytes).clamp(1, 16)
        } else {
            1
        };
        let mut weights = vec![first];
        for _ in 1..copies {
            let mut w = Aligned::new(wbytes);
            w.bytes_mut()[..wbytes].copy_from_slice(&weights[0].bytes_mut()[..wbytes]);
            weights.push(w);
        }
        let mut x = Aligned::new(4 * c.k * c.m);
        for ch in x.bytes_mut()[..4 * c.k * c.m].chunks_exact_mut(4) {
            ch.copy_from_slice(&rand(&mut seed).to_le_bytes());
        }
        let d = Aligned::new(4 * c.n * c.m);
        let (wv, xv, dv) = views(c, &weights[0], &x, &d);
        let ws = precisions
            .iter()
            .map(|&p| matmul::work_size(&wv, &xv, &dv, max_threads, p))
            .max()
            .unwrap_or(0);
        CaseData {
            weights,
            x,
            d,
            work: Aligned::new(ws),
            wbytes,
        }
    }

    fn measure(
        &self,
        c: &OpCase,
        pool: &ThreadPool,
        isa: Isa,
        prec: Option<Precision>,
        opts: &OpsBenchOptions,
    ) -> Result<OpBenchResult> {
        let precision = prec.unwrap_or_default();
        let nth = pool.nth();
        let timing = if c.op == "stream_read" {
            let buf = &self.weights[0];
            let floats = STREAM_BYTES / 4;
            let base = buf.ptr() as usize;
            let sink = std::sync::atomic::AtomicU32::new(0);
            let t = time_it(&opts.repeat, |_| {
                pool.run(&|ith, _| {
                    let r = metashard::cpu::split_range(floats, ith, nth);
                    // SAFETY: the buffer holds `floats` initialized f32, 64-byte aligned, and is
                    // only read here.
                    let s = unsafe {
                        std::slice::from_raw_parts((base as *const f32).add(r.start), r.len())
                    };
                    let v = if c.m <= 1 {
                        metashard::cpu::simd::sum_f32_with(isa, s)
                    } else {
                        sum_streams(s, c.m)
                    };
                    sink.fetch_add(v.to_bits() & 1, std::sync::atomic::Ordering::Relaxed);
                })
                .expect("the streaming job does not panic");
            });
            std::hint::black_box(sink.into_inner());
            t
        } else {
            let views: Vec<_> = self
                .weights
                .iter()
                .map(|w| views(c, w, &self.x, &self.d))
                .collect();
            let wdata = self.work.ptr() as usize;
            let wsize = self.work.len;
            let mut err = None;
            let t = time_it(&opts.repeat, |i| {
                let (w, x, d) = views[i % views.len()];
                let r = pool.run(&|ith, barrier| {
                    let p = ComputeParams {
                        ith,
                        nth,
                        wdata: wdata as *mut u8,
                        wsize,
                        tdata: std::ptr::null_mut(),
                        tsize: 0,
                        barrier,
                        precision,
                        items: None,
                    };
                    matmul::forward_with(isa, &p, &w, &x, &d);
                });
                if let Err(e) = r {
                    err.get_or_insert(e);
                }
            });
            if let Some(e) = err {
                return Err(metashard::Error::Device {
                    device: format!("bench ops pool ({nth} threads)"),
                    reason: format!("{}: a kernel panicked: {e}", c.label()),
                });
            }
            t
        };
        let secs = timing.median_us * 1e-6;
        let (flops, bytes) = if c.op == "stream_read" {
            ((STREAM_BYTES / 4) as f64, STREAM_BYTES as f64)
        } else {
            let flops = 2.0 * (c.m * c.n * c.k) as f64;
            (flops, (self.wbytes + 4 * c.m * c.k + 4 * c.m * c.n) as f64)
        };
        Ok(OpBenchResult {
            op: c.op.to_string(),
            dtype: c.dtype.name().to_string(),
            m: c.m,
            n: c.n,
            k: c.k,
            threads: nth,
            isa: isa.name().to_string(),
            precision: prec.map_or("-".into(), |p| p.name().to_string()),
            q8_activations: c.op == "mul_mat" && {
                let (w, _, _) = views(c, &self.weights[0], &self.x, &self.d);
                matmul::quantizes_activations(&w, precision)
            },
            median_us: timing.median_us,
            min_us: timing.min_us,
            reps: timing.reps,
            gflops: flops / secs / 1e9,
            gbps: bytes / secs / 1e9,
        })
    }
}

fn views(
    c: &OpCase,
    w: &Aligned,
    x: &Aligned,
    d: &Aligned,
) -> (TensorView, TensorView, TensorView) {
    let row = c.dtype.row_size(c.k);
    let wv = TensorView {
        data: w.ptr(),
        dtype: c.dtype,
        ne: [c.k, c.n, 1, 1],
        nb: [c.dtype.type_size(), row, row * c.n, row * c.n],
    };
    let xv = TensorView {
        data: x.ptr(),
        dtype: DType::F32,
        ne: [c.k, c.m, 1, 1],
        nb: [4, 4 * c.k, 4 * c.k * c.m, 4 * c.k * c.m],
    };
    let dv = TensorView {
        data: d.ptr(),
        dtype: DType::F32,
        ne: [c.n, c.m, 1, 1],
        nb: [4, 4 * c.n, 4 * c.n * c.m, 4 * c.n * c.m],
    };
    (wv, xv, dv)
}

fn stream_label(streams: usize) -> String {
    format!("stream_read {} MiB x{streams}", STREAM_BYTES >> 20)
}

/// Sum of `s`, read as `streams` equal segments advanced in lockstep, 64 bytes of each per
/// step (the tail after the segments is summed separately).
fn sum_streams(s: &[f32], streams: usize) -> f32 {
    const STEP: usize = 16;
    let seg = s.len() / streams / STEP * STEP;
    let mut acc = vec![[0f32; STEP]; streams];
    let mut i = 0;
    while i < seg {
        for (j, a) in acc.iter_mut().enumerate() {
            let chunk = &s[j * seg + i..j * seg + i + STEP];
            for (x, v) in a.iter_mut().zip(chunk) {
                *x += v;
            }
        }
        i += STEP;
    }
    let tail: f32 = s[seg * streams..].iter().sum();
    acc.iter().flatten().sum::<f32>() + tail
}

/// Uniform in [-1, 1) (xorshift64).
fn rand(s: &mut u64) -> f32 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    ((*s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// The results as a table; with references (numpy, ggml), their GFLOP/s and our ratio to them
/// for the same op, dtype, shape and thread count.
pub fn print_table(results: &[OpBenchResult], refs: &[RefResult]) -> String {
    let mut s = String::new();
    let sources: Vec<&str> = {
        let mut v: Vec<&str> = refs.iter().map(|r| r.source.as_str()).collect();
        v.sort();
        v.dedup();
        v
    };
    let _ = write!(
        s,
        "{:<34} {:>3} {:>7} {:<10} {:>11} {:>9} {:>7}",
        "case", "thr", "isa", "precision", "median us", "GFLOP/s", "GB/s"
    );
    for src in &sources {
        let _ = write!(s, " {:>11} {:>6}", format!("{src} GF/s"), "ratio");
    }
    s.push('\n');
    for r in results {
        let label = if r.op == "stream_read" {
            stream_label(r.m)
        } else {
            format!("{} {} m={} n={} k={}", r.op, r.dtype, r.m, r.n, r.k)
        };
        let _ = write!(
            s,
            "{:<34} {:>3} {:>7} {:<10} {:>11.1} {:>9.1} {:>7.1}",
            label, r.threads, r.isa, r.precision, r.median_us, r.gflops, r.gbps
        );
        for src in &sources {
            let found = refs.iter().find(|x| {
                x.source == *src
                    && x.op == r.op
                    && x.dtype == r.dtype
                    && (x.m, x.n, x.k, x.threads) == (r.m, r.n, r.k, r.threads)
            });
            match found {
                Some(x) => {
                    let ratio = x.median_us / r.median_us;
                    let _ = write!(s, " {:>11.1} {:>6.2}", x.gflops, ratio);
                }
                None => {
                    let _ = write!(s, " {:>11} {:>6}", "-", "-");
                }
            }
        }
        s.push('\n');
    }
    s
}

/// Parse reference results (a JSON array of [`RefResult`]).
pub fn parse_refs(json: &str, what: &str) -> Result<Vec<RefResult>> {
    serde_json::from_str(json)
        .map_err(|e| metashard::Error::format(what, "reference results", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_small_case_runs_and_reports_consistent_numbers() {
        let opts = OpsBenchOptions {
            threads: vec![1, 2],
            filter: Some("mul_mat q4_0 m=1 n=4096 k=4096".into()),
            repeat: Repeat {
                warmup: 1,
                min_reps: 3,
                min_time: Duration::ZERO,
                max_reps: 3,
            },
            progress: false,
            ..Default::default()
        };
        let r = measure(&opts).unwrap();
        assert_eq!(r.len(), 2);
        for x in &r {
            let secs = x.median_us * 1e-6;
            assert!((x.gflops - 2.0 * 4096.0 * 4096.0 / secs / 1e9).abs() < 1e-6 * x.gflops);
            let bytes = (DType::Q4_0.row_size(4096) * 4096 + 4 * 4096 + 4 * 4096) as f64;
            assert!((x.gbps - bytes / secs / 1e9).abs() < 1e-6 * x.gbps);
        }
        let refs = parse_refs(
            r#"[{"source":"numpy","op":"mul_mat","dtype":"q4_0","m":1,"n":4096,"k":4096,
                 "threads":1,"median_us":100.0,"gflops":1.0,"gbps":1.0}]"#,
            "inline",
        )
        .unwrap();
        let table = print_table(&r, &refs);
        assert!(
            table.contains("numpy GF/s") && table.lines().count() == 3,
            "{table}"
        );
        let json = crate::cli::to_json("bench ops results", &r).unwrap();
        assert!(json.contains("\"median_us\""));
        assert!(parse_refs("{", "inline").is_err());
    }

    #[test]
    fn interleaved_stream_sum_reads_everything() {
        let v: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        for streams in [1, 3, 8] {
            assert_eq!(sum_streams(&v, streams), 499_500.0);
        }
    }

    #[test]
    fn bad_thread_counts_are_an_error() {
        let opts = OpsBenchOptions {
            threads: vec![0],
            progress: false,
            ..Default::default()
        };
        assert!(measure(&opts).is_err());
    }
}
