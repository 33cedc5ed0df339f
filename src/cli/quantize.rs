//! `metashard quantize IN OUT --type T`: a GGUF file of F32, F16 or BF16 weights written again
//! with its matrices quantized by the type table's reference quantizers (`dtype/`), the
//! metadata copied (with `general.file_type` and `general.quantization_version` set as
//! llama.cpp's `llama-quantize` sets them).
//!
//! Which tensors and in which type follow llama.cpp's `src/llama-quant.cpp`
//! (`llama_model_quantize_impl`, `llama_tensor_get_type`), facts only: only 2-D tensors whose
//! name ends in `weight` and is not a norm (`_norm.weight`), the position or token-type table
//! are quantized; the output projection (the token embedding when there is none) takes Q6_K,
//! Q8_0 where its rows are not whole blocks; the `_M` / `_S` / `_L` mixes raise `attn_v` and
//! `ffn_down` in the first and last eighth of the layers and every third one between
//! (`use_more_bits`), `attn_qkv` and `attn_output` by the rules of each mix; a tensor whose rows
//! are not whole blocks of its type falls back (Q2_K/Q3_K to IQ4_NL, Q4_K to Q5_0, Q5_K to
//! Q5_1, Q6_K to Q8_0, then F16). `q2_k`, `q3_k`, `q4_k`, `q5_k` and `q6_k` name llama.cpp's
//! file types of those names (`q3_k`, `q4_k` and `q5_k` are its aliases of the `_m` mixes);
//! `--pure` puts every quantized tensor in the one type. No importance matrix.
//!
//! Mixture-of-experts files (llama.cpp's rules for `n_expert`, read from
//! `{arch}.expert_count`): the router (`ffn_gate_inp.weight`) is left as it is; the expert
//! tensors (`ffn_{gate,up,down}_exps.weight`, `[n_embd, n_ff, n_expert]`) are quantized row by
//! row like any matrix, so each expert's rows stay whole blocks in its own slice of the
//! tensor (the layout `mul_mat_id` and the expert split read), `ffn_down_exps` taking
//! `ffn_down`'s mix by the layer in its name; with exactly 8 experts (Mixtral) `attn_v` and
//! `attn_k` take Q8_0 and `attn_output` Q5_K in the Q2_K, Q3_K_S, Q3_K_M, Q4_K_S and Q4_K_M
//! mixes (and no dense `attn_output` rule).

use clap::Args;
use metashard::io::gguf::{GgufFile, GgufTensorInfo};
use metashard::io::{GgufValue, GgufWriter};
use metashard::{DType, Error, Result};
use std::path::PathBuf;

#[derive(Clone, Debug, Args)]
pub struct QuantizeArgs {
    /// The GGUF file to quantize (F32, F16 or BF16 weights).
    pub input: PathBuf,
    /// The GGUF file to write.
    pub output: PathBuf,
    /// The type: q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m,
    /// q5_k_s, q5_k_m, q6_k (q3_k, q4_k, q5_k: the _m mixes, as llama-quantize names them).
    #[arg(long = "type", value_name = "TYPE")]
    pub qtype: String,
    /// Every quantized tensor in the type's base type (no mix, no Q6_K output).
    #[arg(long)]
    pub pure: bool,
}

/// A file type of llama.cpp's `llama_ftype`: its name, its number (`general.file_type`), its
/// base type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileType {
    pub name: &'static str,
    pub id: u32,
    pub base: DType,
}

/// llama.cpp's `llama_ftype` values (`include/llama.h`) of the types metashard writes.
pub const FILE_TYPES: &[FileType] = &[
    ft("q4_0", 2, DType::Q4_0),
    ft("q4_1", 3, DType::Q4_1),
    ft("q8_0", 7, DType::Q8_0),
    ft("q5_0", 8, DType::Q5_0),
    ft("q5_1", 9, DType::Q5_1),
    ft("q2_k", 10, DType::Q2_K),
    ft("q3_k_s", 11, DType::Q3_K),
    ft("q3_k_m", 12, DType::Q3_K),
    ft("q3_k_l", 13, DType::Q3_K),
    ft("q4_k_s", 14, DType::Q4_K),
    ft("q4_k_m", 15, DType::Q4_K),
    ft("q5_k_s", 16, DType::Q5_K),
    ft("q5_k_m", 17, DType::Q5_K),
    ft("q6_k", 18, DType::Q6_K),
];

const fn ft(name: &'static str, id: u32, base: DType) -> FileType {
    FileType { name, id, base }
}

/// The file type a `--type` value names (llama-quantize's aliases `q3_k`, `q4_k`, `q5_k` for
/// the `_m` mixes), or an error naming the flag and listing the types.
pub fn file_type(name: &str) -> Result<FileType> {
    file_type_of("--type", name)
}

/// [`file_type`] given to the flag `flag` (errors name it).
pub fn file_type_of(flag: &str, name: &str) -> Result<FileType> {
    let lower = name.to_ascii_lowercase();
    let canonical = match lower.as_str() {
        "q3_k" => "q3_k_m",
        "q4_k" => "q4_k_m",
        "q5_k" => "q5_k_m",
        s => s,
    };
    FILE_TYPES
        .iter()
        .find(|f| f.name == canonical)
        .copied()
        .ok_or_else(|| {
            let names: Vec<_> = FILE_TYPES.iter().map(|f| f.name).collect();
            Error::invalid_argument(
                flag,
                name,
                format!(
                    "not a type metashard quantizes to (one of {}, or q3_k, q4_k, q5_k)",
                    names.join(", ")
                ),
            )
        })
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers and every third
/// layer between.
fn use_more_bits(i: usize, n: usize) -> bool {
    let (i, n) = (i as i64, n as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// What the mix needs to know of the model.
#[derive(Clone, Copy, Debug)]
pub struct MixContext {
    pub n_layer: usize,
    /// Query heads per KV head.
    pub n_gqa: usize,
    /// The file has an `output.weight` (else the token embedding is the output).
    pub has_output: bool,
    /// Experts per MoE layer (`{arch}.expert_count`; 1 for a dense model).
    pub n_expert: usize,
}

/// Whether llama-quantize quantizes a tensor of this name and number of dimensions (not the
/// norms, nor an MoE router: `ffn_gate_inp.weight`).
pub fn is_quantized_tensor(name: &str, n_dims: usize) -> bool {
    name.ends_with("weight")
        && n_dims >= 2
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight")
        && name != "position_embd.weight"
        && name != "token_types.weight"
}

/// The type of tensor `name` (rows of `ne0`) in file type `f` (llama.cpp's
/// `llama_tensor_get_type` for dense models without an importance matrix), with the fallback
/// of rows that are not whole blocks; an error naming the tensor where no type fits.
pub fn tensor_type(f: FileType, ctx: MixContext, name: &str, ne0: usize) -> Result<DType> {
    use DType::*;
    let layer = name
        .strip_prefix("blk.")
        .and_then(|r| r.split('.').next())
        .and_then(|l| l.parse::<usize>().ok());
    let n = ctx.n_layer;
    let is_output = name == "output.weight" || (!ctx.has_output && name == "token_embd.weight");
    let mut t = f.base;
    if is_output {
        t = if !ne0.is_multiple_of(f.base.block_size()) || f.base == Q8_0 {
            Q8_0
        } else {
            Q6_K
        };
    } else if name.contains("attn_v.weight") {
        let i = layer.unwrap_or(0);
        t = match f.name {
            "q2_k" if ctx.n_gqa >= 4 => Q4_K,
            "q2_k" => Q3_K,
            "q3_k_m" if i < 2 => Q5_K,
            "q3_k_m" => Q4_K,
            "q3_k_l" => Q5_K,
            "q4_k_m" | "q5_k_m" if use_more_bits(i, n) => Q6_K,
            "q4_k_s" if i < 4 => Q5_K,
            _ => t,
        };
        if ctx.n_expert == 8 {
            t = Q8_0;
        }
    } else if name.contains("attn_k.weight") {
        if ctx.n_expert == 8 {
            t = Q8_0;
        }
    } else if name.contains("ffn_down") {
        let i = layer.unwrap_or(0);
        t = match f.name {
            "q2_k" => Q3_K,
            "q3_k_m" if i < n / 16 => Q5_K,
            "q3_k_m" => Q4_K,
            "q3_k_l" => Q5_K,
            "q4_k_m" | "q5_k_m" if use_more_bits(i, n) => Q6_K,
            "q4_k_s" if i < n / 8 => Q5_K,
            _ => t,
        };
    } else if name.contains("attn_output.weight") {
        t = match (ctx.n_expert == 8, f.name) {
            (true, "q2_k" | "q3_k_s" | "q3_k_m" | "q4_k_s" | "q4_k_m") => Q5_K,
            (true, _) => t,
            (false, "q2_k") => Q3_K,
            (false, "q3_k_m") => Q4_K,
            (false, "q3_k_l") => Q5_K,
            _ => t,
        };
    } else if name.contains("attn_qkv.weight") {
        t = match f.name {
            "q3_k_m" | "q3_k_l" => Q4_K,
            "q4_k_m" => Q5_K,
            "q5_k_m" => Q6_K,
            _ => t,
        };
    }
    fallback(t, name, ne0)
}

/// `t`, or where rows of `ne0` are not whole blocks of it, llama.cpp's fallback
/// (`convert_incompatible_tensor`): Q2_K, Q3_K to IQ4_NL, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to
/// Q8_0, then F16 where even those do not fit; an error naming the tensor for the others.
pub fn fallback(t: DType, name: &str, ne0: usize) -> Result<DType> {
    use DType::*;
    if ne0.is_multiple_of(t.block_size()) {
        return Ok(t);
    }
    let f = match t {
        Q2_K | Q3_K | IQ4_XS => IQ4_NL,
        Q4_K => Q5_0,
        Q5_K => Q5_1,
        Q6_K => Q8_0,
        _ => {
            return Err(Error::invalid_input(
                "quantize",
                format!("tensor `{name}`"),
                format!(
                    "rows of whole {}-element blocks of {}",
                    t.block_size(),
                    t.name()
                ),
                format!("rows of {ne0}"),
            ));
        }
    };
    Ok(if ne0.is_multiple_of(f.block_size()) {
        f
    } else {
        F16
    })
}

fn meta_usize(g: &GgufFile, key: &str) -> Option<usize> {
    g.opt_u64(key).ok().flatten().map(|v| v as usize)
}

/// The mix context of a file: its layers, grouping and whether it has an output projection.
fn mix_context(g: &GgufFile) -> MixContext {
    let arch = g.architecture().unwrap_or("llama").to_string();
    let n_head = meta_usize(g, &format!("{arch}.attention.head_count")).unwrap_or(1);
    let n_kv = meta_usize(g, &format!("{arch}.attention.head_count_kv")).unwrap_or(n_head);
    MixContext {
        n_layer: meta_usize(g, &format!("{arch}.block_count")).unwrap_or(1),
        n_gqa: n_head / n_kv.max(1),
        has_output: g.tensor("output.weight").is_some(),
        n_expert: meta_usize(g, &format!("{arch}.expert_count"))
            .unwrap_or(1)
            .max(1),
    }
}

/// The values of a float tensor, or an error naming it when it is quantized already.
fn values(g: &GgufFile, t: &GgufTensorInfo) -> Result<Vec<f32>> {
    let dt = match t.dtype {
        Some(d @ (DType::F32 | DType::F16 | DType::BF16)) => d,
        _ => {
            return Err(Error::Model {
                model: g.path().display().to_string(),
                reason: format!(
                    "tensor `{}` is {} already: quantize reads F32, F16 or BF16 weights \
                     (requantizing loses accuracy twice)",
                    t.name,
                    t.type_label()
                ),
            });
        }
    };
    metashard::dtype::bytes_to_f32(dt, g.tensor_data(t)?, t.ne.iter().product())
}

/// `v` (rows of `ne0`) quantized to `t`, rows spread over the cores.
fn quantize_rows(t: DType, v: &[f32], ne0: usize) -> Result<Vec<u8>> {
    let rows = v.len() / ne0.max(1);
    let row_bytes = t.row_size(ne0);
    let mut out = vec![0u8; rows * row_bytes];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = rows.div_ceil(threads).max(1);
    std::thread::scope(|s| -> Result<()> {
        let jobs: Vec<_> = out
            .chunks_mut(per * row_bytes)
            .zip(v.chunks(per * ne0))
            .map(|(dst, src)| {
                s.spawn(move || -> Result<()> {
                    for (d, r) in dst.chunks_mut(row_bytes).zip(src.chunks(ne0)) {
                        metashard::dtype::row_from_f32(t, r, d)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for j in jobs {
            j.join()
                .map_err(|_| Error::invalid_op("quantize", "a worker thread panicked"))??;
        }
        Ok(())
    })?;
    Ok(out)
}

pub fn run(a: &QuantizeArgs) -> Result<()> {
    let f = file_type(&a.qtype)?;
    let g = GgufFile::open(&a.input)?;
    let ctx = mix_context(&g);
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        if k != "general.file_type" && k != "general.quantization_version" {
            w.add(k.clone(), v.clone());
        }
    }
    w.add("general.quantization_version", GgufValue::U32(2));
    w.add("general.file_type", GgufValue::U32(f.id));
    let n = g.tensors().len();
    let (mut before, mut after) = (0usize, 0usize);
    for (i, t) in g.tensors().iter().enumerate() {
        let dims = &t.ne[..t.n_dims];
        let (dt, bytes) = if is_quantized_tensor(&t.name, t.n_dims) {
            let v = values(&g, t)?;
            let dt = if a.pure {
                fallback(f.base, &t.name, t.ne[0])?
            } else {
                tensor_type(f, ctx, &t.name, t.ne[0])?
            };
            (dt, quantize_rows(dt, &v, t.ne[0])?)
        } else {
            let dt = t.dtype.ok_or_else(|| Error::Model {
                model: g.path().display().to_string(),
                reason: format!("tensor `{}` has type {}", t.name, t.type_label()),
            })?;
            (dt, g.tensor_data(t)?.to_vec())
        };
        eprintln!(
            "[{:>4}/{n}] {:<32} {:<24} {:>6} -> {:<6} {:>10.3} MiB -> {:>10.3} MiB",
            i + 1,
            t.name,
            format!("{dims:?}"),
            t.type_label(),
            dt.name(),
            t.nbytes as f64 / 1048576.0,
            bytes.len() as f64 / 1048576.0
        );
        before += t.nbytes;
        after += bytes.len();
        w.add_tensor(t.name.clone(), dt, dims, bytes)?;
    }
    std::fs::write(&a.output, w.to_bytes()).map_err(|e| Error::io(&a.output, e))?;
    eprintln!(
        "quantized {} to {} ({}): {:.2} MiB -> {:.2} MiB",
        a.input.display(),
        a.output.display(),
        f.name,
        before as f64 / 1048576.0,
        after as f64 / 1048576.0
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTX: MixContext = MixContext {
        n_layer: 8,
        n_gqa: 4,
        has_output: true,
        n_expert: 1,
    };

    #[test]
    fn mixes_follow_llama_quant() {
        let m = file_type("Q4_K_M").unwrap();
        assert_eq!(file_type("q4_k").unwrap(), m);
        let ty = |f: FileType, name: &str| tensor_type(f, CTX, name, 512).unwrap();
        // use_more_bits(i, 8): layers 0, 3, 6, 7.
        let more: Vec<usize> = (0..8).filter(|&i| use_more_bits(i, 8)).collect();
        assert_eq!(more, [0, 3, 6, 7]);
        for i in 0..8 {
            let want = if more.contains(&i) {
                DType::Q6_K
            } else {
                DType::Q4_K
            };
            assert_eq!(ty(m, &format!("blk.{i}.attn_v.weight")), want);
            assert_eq!(ty(m, &format!("blk.{i}.ffn_down.weight")), want);
            assert_eq!(ty(m, &format!("blk.{i}.attn_q.weight")), DType::Q4_K);
        }
        assert_eq!(ty(m, "output.weight"), DType::Q6_K);
        assert_eq!(ty(m, "token_embd.weight"), DType::Q4_K);
        assert_eq!(ty(m, "blk.0.attn_qkv.weight"), DType::Q5_K);
        let s = file_type("q4_k_s").unwrap();
        assert_eq!(ty(s, "blk.3.attn_v.weight"), DType::Q5_K);
        assert_eq!(ty(s, "blk.4.attn_v.weight"), DType::Q4_K);
        assert_eq!(ty(s, "blk.0.ffn_down.weight"), DType::Q5_K);
        assert_eq!(ty(s, "blk.1.ffn_down.weight"), DType::Q4_K);
        let q2 = file_type("q2_k").unwrap();
        assert_eq!(ty(q2, "blk.1.attn_v.weight"), DType::Q4_K);
        assert_eq!(ty(q2, "blk.1.attn_output.weight"), DType::Q3_K);
        // Tied: the embedding is the output.
        let tied = MixContext {
            has_output: false,
            ..CTX
        };
        assert_eq!(
            tensor_type(m, tied, "token_embd.weight", 512).unwrap(),
            DType::Q6_K
        );
    }

    #[test]
    fn moe_mixes_follow_llama_quant() {
        let (m, q3) = (file_type("q4_k_m").unwrap(), file_type("q3_k_l").unwrap());
        let ty = |f: FileType, ctx: MixContext, name: &str| tensor_type(f, ctx, name, 512).unwrap();
        let mixtral = MixContext { n_expert: 8, ..CTX };
        let olmoe = MixContext {
            n_expert: 64,
            ..CTX
        };
        // Eight experts: attn_v and attn_k to Q8_0 whatever the layer, attn_output Q5_K in
        // the _M mix; the dense model keeps its rules.
        for i in 0..8 {
            assert_eq!(
                ty(m, mixtral, &format!("blk.{i}.attn_v.weight")),
                DType::Q8_0
            );
            assert_eq!(
                ty(m, mixtral, &format!("blk.{i}.attn_k.weight")),
                DType::Q8_0
            );
            assert_eq!(ty(m, CTX, &format!("blk.{i}.attn_k.weight")), DType::Q4_K);
        }
        assert_eq!(ty(m, mixtral, "blk.1.attn_output.weight"), DType::Q5_K);
        assert_eq!(ty(q3, mixtral, "blk.1.attn_output.weight"), DType::Q3_K);
        assert_eq!(ty(q3, CTX, "blk.1.attn_output.weight"), DType::Q5_K);
        // Other expert counts take the dense rules; the experts' down projections the
        // ffn_down mix by the layer in their names, gate and up the base type.
        assert_eq!(ty(m, olmoe, "blk.1.attn_v.weight"), DType::Q4_K);
        assert_eq!(ty(m, olmoe, "blk.0.ffn_down_exps.weight"), DType::Q6_K);
        assert_eq!(ty(m, olmoe, "blk.1.ffn_down_exps.weight"), DType::Q4_K);
        assert_eq!(ty(m, olmoe, "blk.1.ffn_gate_exps.weight"), DType::Q4_K);
        // The router stays as it is; the shared expert's gate (a 2-D matrix) does not.
        assert!(!is_quantized_tensor("blk.0.ffn_gate_inp.weight", 2));
        assert!(is_quantized_tensor("blk.0.ffn_gate_inp_shexp.weight", 2));
        assert!(is_quantized_tensor("blk.0.ffn_up_exps.weight", 3));
    }

    #[test]
    fn rows_that_are_not_whole_blocks_fall_back_or_are_named() {
        let m = file_type("q4_k_m").unwrap();
        let ty = |name: &str, ne0| tensor_type(m, CTX, name, ne0);
        assert_eq!(ty("blk.1.attn_q.weight", 96).unwrap(), DType::Q5_0);
        assert_eq!(ty("blk.0.attn_v.weight", 96).unwrap(), DType::Q8_0);
        assert_eq!(ty("output.weight", 96).unwrap(), DType::Q8_0);
        assert_eq!(ty("blk.1.attn_q.weight", 40).unwrap(), DType::F16);
        let e = tensor_type(file_type("q4_0").unwrap(), CTX, "blk.0.attn_k.weight", 40)
            .unwrap_err()
            .to_string();
        assert!(e.contains("blk.0.attn_k.weight") && e.contains("40"), "{e}");
        let e = file_type("q4_k_x").unwrap_err().to_string();
        assert!(e.contains("--type") && e.contains("q4_k_m"), "{e}");
        assert!(is_quantized_tensor("blk.0.attn_q.weight", 2));
        assert!(!is_quantized_tensor("blk.0.attn_norm.weight", 2));
        assert!(!is_quantized_tensor("blk.0.attn_q.bias", 2));
        assert!(!is_quantized_tensor("rope_freqs.weight", 1));
    }
}
