use metashard::Graph;
use metashard::cpu::{CpuOptions, Precision, parse_cpu_spec_with};
use metashard::dtype::{self, BlockQ8_1, DType};
use metashard::io::gguf::GgufFile;
fn nmse(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f64>()
        / b.iter().map(|y| y * y).sum::<f64>()
}
fn main() {
    let g = GgufFile::open("models-cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
    for name in ["blk.0.attn_k.weight", "blk.0.attn_v.weight"] {
        let t = g.tensor(name).unwrap();
        let (k, n) = (t.ne[0], t.ne[1]);
        let wbytes = g.tensor_data(t).unwrap().to_vec();
        let w = dtype::bytes_to_f32(DType::Q4_1, &wbytes, k * n).unwrap();
        // A realistic activation: rms-normed embedding row of token 1 times the attn norm.
        let emb = g.tensor("token_embd.weight").unwrap();
        let e = dtype::bytes_to_f32(
            DType::Q8_0,
            &g.tensor_data(emb).unwrap()[..DType::Q8_0.row_size(k) * 40],
            k * 40,
        )
        .unwrap();
        let norm = dtype::bytes_to_f32(
            DType::F32,
            g.tensor_data(g.tensor("blk.0.attn_norm.weight").unwrap())
                .unwrap(),
            k,
        )
        .unwrap();
        let mut x: Vec<f32> = e[k * 9..k * 10].to_vec();
        let ms = (x.iter().map(|v| v * v).sum::<f32>() / k as f32 + 1e-5).sqrt();
        for (i, v) in x.iter_mut().enumerate() {
            *v = *v / ms * norm[i];
        }
        // Emulation: quantize x to q8_1 (reference), exact dot.
        let mut q = vec![BlockQ8_1::default(); k / 32];
        dtype::quantize_q8_1(&x, &mut q);
        let xq: Vec<f32> = q
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&v| v as f32 * b.d.to_f32()))
            .collect();
        let exact: Vec<f64> = (0..n)
            .map(|j| (0..k).map(|i| w[j * k + i] as f64 * x[i] as f64).sum())
            .collect();
        let emul: Vec<f64> = (0..n)
            .map(|j| (0..k).map(|i| w[j * k + i] as f64 * xq[i] as f64).sum())
            .collect();
        let mut ours = vec![];
        for precision in [Precision::Q8, Precision::Exact] {
            let d = &parse_cpu_spec_with("cpu:1x1", CpuOptions { precision }).unwrap()[0];
            let be = d.init_backend().unwrap();
            let mut gr = Graph::new();
            let wi = gr.input("w", DType::Q4_1, [k, n, 1, 1]).unwrap();
            gr.set_data(wi, wbytes.clone()).unwrap();
            let xi = gr.input_f32("x", [k, 1, 1, 1], &x).unwrap();
            let y = gr.mul_mat(wi, xi).unwrap();
            be.graph_compute(&mut gr).unwrap();
            ours.push(
                gr.read_f32(y)
                    .unwrap()
                    .iter()
                    .map(|&v| v as f64)
                    .collect::<Vec<f64>>(),
            );
        }
        println!(
            "{name}: emulated-q8 vs exact {:.2e} | kernel default vs exact {:.2e} | kernel default vs emulated {:.2e} | kernel exact vs exact {:.2e}",
            nmse(&emul, &exact),
            nmse(&ours[0], &exact),
            nmse(&ours[0], &emul),
            nmse(&ours[1], &exact)
        );
    }
}
