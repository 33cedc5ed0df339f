//! Criterion benchmarks of the CPU `mul_mat` kernels, one group per weight dtype: the decode
//! shapes K = N = 4096 with M = 1 and 32 at 1 and 2 threads (throughput in weight bytes), plus
//! the F32 GEMM 1024^3 in the f32 group. The timed region is one `ThreadPool::run`, which
//! returns only when every thread has finished (so it synchronizes inside the measurement).
//!
//! Unlike `metashard::bench::ops`, inputs are not rotated: the quantized weights of the decode
//! shapes (9-18 MB) may stay in the 32 MB L3 between iterations. Use `bench::ops` for numbers
//! that include DRAM traffic.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use metashard::DType;
use metashard::cpu::matmul;
use metashard::cpu::{ComputeParams, TensorView, ThreadPool};
use metashard::dtype::row_from_f32;

/// A 64-byte aligned buffer.
struct Buf(Vec<[u64; 8]>);

impl Buf {
    fn new(len: usize) -> Buf {
        Buf(vec![[0u64; 8]; len.div_ceil(64).max(1)])
    }
    fn ptr(&self) -> *mut u8 {
        self.0.as_ptr().cast_mut().cast()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.0.len() * 64;
        // SAFETY: the vector owns `len` initialized bytes, borrowed exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast(), len) }
    }
}

struct Setup {
    _bufs: [Buf; 3],
    work: Buf,
    w: TensorView,
    x: TensorView,
    d: TensorView,
    weight_bytes: usize,
}

fn setup(dtype: DType, m: usize, n: usize, k: usize, max_threads: usize) -> Setup {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let row = dtype.row_size(k);
    let mut wb = Buf::new(row * n);
    let mut vals = vec![0f32; k];
    for r in 0..n {
        vals.iter_mut().for_each(|v| *v = rand());
        row_from_f32(dtype, &vals, &mut wb.bytes_mut()[r * row..(r + 1) * row]).unwrap();
    }
    let mut xb = Buf::new(4 * m * k);
    for c in xb.bytes_mut()[..4 * m * k].chunks_exact_mut(4) {
        c.copy_from_slice(&rand().to_le_bytes());
    }
    let db = Buf::new(4 * m * n);
    let w = TensorView {
        data: wb.ptr(),
        dtype,
        ne: [k, n, 1, 1],
        nb: [dtype.type_size(), row, row * n, row * n],
    };
    let x = TensorView {
        data: xb.ptr(),
        dtype: DType::F32,
        ne: [k, m, 1, 1],
        nb: [4, 4 * k, 4 * k * m, 4 * k * m],
    };
    let d = TensorView {
        data: db.ptr(),
        dtype: DType::F32,
        ne: [n, m, 1, 1],
        nb: [4, 4 * n, 4 * n * m, 4 * n * m],
    };
    let work = Buf::new(matmul::work_size(
        &w,
        &x,
        &d,
        max_threads,
        metashard::cpu::Precision::Exact,
    ));
    Setup {
        _bufs: [wb, xb, db],
        work,
        w,
        x,
        d,
        weight_bytes: row * n,
    }
}

fn run(pool: &ThreadPool, s: &Setup) {
    let (w, x, d) = (s.w, s.x, s.d);
    let wdata = s.work.ptr() as usize;
    let wsize = s.work.0.len() * 64;
    let nth = pool.nth();
    pool.run(&|ith, barrier| {
        let p = ComputeParams {
            ith,
            nth,
            wdata: wdata as *mut u8,
            wsize,
            tdata: std::ptr::null_mut(),
            tsize: 0,
            barrier,
            precision: metashard::cpu::Precision::Exact,
            items: None,
        };
        matmul::forward(&p, &w, &x, &d);
    })
    .expect("mul_mat does not panic");
}

fn bench_dtype(c: &mut Criterion, dtype: DType) {
    let pools: Vec<ThreadPool> = [1, 2]
        .iter()
        .map(|&t| ThreadPool::new(t, "crit").unwrap())
        .collect();
    let mut g = c.benchmark_group(dtype.name());
    g.sample_size(20);
    let mut shapes = vec![(1, 4096, 4096), (32, 4096, 4096)];
    if dtype == DType::F32 {
        shapes.push((1024, 1024, 1024));
    }
    for (m, n, k) in shapes {
        let s = setup(dtype, m, n, k, 2);
        g.throughput(Throughput::Bytes(s.weight_bytes as u64));
        for pool in &pools {
            let id = BenchmarkId::new(format!("m{m}_n{n}_k{k}"), format!("t{}", pool.nth()));
            g.bench_function(id, |b| b.iter(|| run(pool, &s)));
        }
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    for &dtype in DType::WEIGHT_TYPES {
        bench_dtype(c, dtype);
    }
}

criterion_group!(matmul_benches, benches);
criterion_main!(matmul_benches);
