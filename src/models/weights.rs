//! Tensors that live in buffers across steps: [`WeightRef`] (a named tensor bound to storage),
//! [`Weights`] (one scope's tensors by role: the whole model's, or one layer's),
//! [`ModelWeights`] and the [`KvCache`]; the layouts a decoder places, derived from its
//! architecture's tensor list ([`decoder_layouts`]); [`place`], which allocates named
//! tensors in any buffer type (a meta buffer type calls its split callback for each); and the
//! virtual KV heads' placement ([`repeat_kv_decl`], [`repeat_kv_rows`]: each KV head's rows of
//! K, V and their biases copied `r` times, see `DecoderConfig::with_kv_repeat`).

use super::arch::{Arch, Dim, Need, Scope, Tensor};
use super::hparams::DecoderConfig;
use crate::backend::alloc_tensors;
use crate::buffer::{Buffer, BufferType, BufferUsage, Storage};
use crate::graph::{Graph, TensorId};
use crate::tensor::Layout;
use crate::{DType, Error, Result};
use std::sync::Arc;

/// A tensor living in a buffer across steps (a weight or a cache), declared in each step graph.
#[derive(Clone, Debug)]
pub struct WeightRef {
    pub name: String,
    pub layout: Layout,
    pub storage: Storage,
}

impl WeightRef {
    /// Declare this tensor in `g` and bind its storage.
    pub fn leaf(&self, g: &mut Graph) -> Result<TensorId> {
        let id = g.weight(&self.name, self.layout.dtype, self.layout.ne)?;
        g.bind(id, self.storage.clone())?;
        Ok(id)
    }
}

/// One scope's tensors by role: the whole model's (`layer` None) or one layer's.
#[derive(Clone, Debug, Default)]
pub struct Weights {
    pub layer: Option<usize>,
    tensors: Vec<(Tensor, WeightRef)>,
}

impl Weights {
    pub fn new(layer: Option<usize>) -> Weights {
        Weights {
            layer,
            tensors: Vec::new(),
        }
    }

    pub fn insert(&mut self, tensor: Tensor, r: WeightRef) {
        self.tensors.retain(|(t, _)| *t != tensor);
        self.tensors.push((tensor, r));
    }

    /// The tensor of this role, if the model has it.
    pub fn opt(&self, tensor: Tensor) -> Option<&WeightRef> {
        self.tensors
            .iter()
            .find(|(t, _)| *t == tensor)
            .map(|(_, r)| r)
    }

    /// The tensor of this role, or an error naming the role and the layer.
    pub fn get(&self, tensor: Tensor) -> Result<&WeightRef> {
        self.opt(tensor).ok_or_else(|| Error::Model {
            model: "weights".into(),
            reason: format!(
                "no `{}` tensor{}",
                tensor.info().gguf,
                self.layer
                    .map_or(String::new(), |l| format!(" in layer {l}"))
            ),
        })
    }

    /// Every tensor, in placement order.
    pub fn iter(&self) -> impl Iterator<Item = (Tensor, &WeightRef)> {
        self.tensors.iter().map(|(t, r)| (*t, r))
    }
}

/// All weights of a model.
#[derive(Clone, Debug)]
pub struct ModelWeights {
    /// The whole model's: a decoder's embedding, final norm and output projection (the
    /// embedding's bytes when tied); an encoder's embedding tables and their norm.
    pub model: Weights,
    pub layers: Vec<Weights>,
}

impl ModelWeights {
    /// Weights by role from references in any order (named as `decls` says).
    pub fn assemble(n_layer: usize, decls: &[TensorDecl], refs: &[WeightRef]) -> ModelWeights {
        let mut model = Weights::new(None);
        let mut layers: Vec<Weights> = (0..n_layer).map(|l| Weights::new(Some(l))).collect();
        for (d, r) in decls.iter().zip(refs) {
            match d.layer {
                Some(l) if l < n_layer => layers[l].insert(d.tensor, r.clone()),
                Some(_) => {}
                None => model.insert(d.tensor, r.clone()),
            }
        }
        ModelWeights { model, layers }
    }

    /// Every weight, the model's first.
    pub fn iter(&self) -> impl Iterator<Item = (Tensor, &WeightRef)> {
        self.model
            .iter()
            .chain(self.layers.iter().flat_map(Weights::iter))
    }
}

/// The KV cache: per layer `k` and `v` of shape `[n_embd_kv, size]` (F16).
#[derive(Clone, Debug)]
pub struct KvCache {
    pub k: Vec<WeightRef>,
    pub v: Vec<WeightRef>,
    pub size: usize,
}

/// A tensor a model places: its name, role, layer and layout.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorDecl {
    pub name: String,
    pub tensor: Tensor,
    pub layer: Option<usize>,
    pub layout: Layout,
}

impl DecoderConfig {
    /// The extent of `d` for this model (`None` for dimensions a decoder does not have).
    pub fn dim(&self, d: Dim) -> Option<usize> {
        Some(match d {
            Dim::One => 1,
            Dim::Embd => self.n_embd,
            Dim::Ff => self.n_ff,
            Dim::Vocab => self.n_vocab,
            Dim::Q => self.n_embd_q(),
            Dim::Kv => self.n_embd_kv(),
            Dim::Qkv => self
                .n_embd_q()
                .saturating_add(self.n_embd_kv().saturating_mul(2)),
            Dim::Ff2 => self.n_ff.saturating_mul(2),
            Dim::HeadDim => self.head_dim,
            Dim::RopeHalf => self.rope_dims / 2,
            Dim::Expert => self.moe?.n_expert,
            Dim::FfExp => self.moe?.n_ff_exp,
            Dim::FfShexp => self.moe.filter(|m| m.n_ff_shexp > 0)?.n_ff_shexp,
            Dim::Pos | Dim::Types | Dim::Ctx => return None,
        })
    }
}

/// `[ne0, ne1, ne2, 1]` of `tensor` with the extents `dim` gives, or an error naming the role.
fn shape_of(arch: &Arch, tensor: Tensor, dim: &dyn Fn(Dim) -> Option<usize>) -> Result<[usize; 4]> {
    let info = tensor.info();
    match [info.shape[0], info.shape[1], info.ne2].map(dim) {
        [Some(a), Some(b), Some(c)] => Ok([a, b, c, 1]),
        _ => Err(Error::Model {
            model: arch.name.into(),
            reason: format!("the model has no `{}` tensor", tensor.info().gguf),
        }),
    }
}

/// The tensors a model of `arch` with `n_layer` layers places, in the architecture's order:
/// the whole model's, then each layer's. Every required tensor and every tied one (an absent
/// output projection is placed as a copy of the embedding); an optional one where
/// `optional(tensor, layer)` says the model has it. Extents come from `dim`; vectors (norms,
/// biases) are F32, the others `dtype_of(tensor, layer)`.
pub fn model_layouts(
    arch: &Arch,
    n_layer: usize,
    dim: &dyn Fn(Dim) -> Option<usize>,
    dtype_of: &dyn Fn(Tensor, Option<usize>) -> DType,
    optional: &dyn Fn(Tensor, Option<usize>) -> bool,
) -> Result<Vec<TensorDecl>> {
    let mut out = Vec::new();
    let mut push = |tensor: Tensor, need: Need, layer: Option<usize>| -> Result<()> {
        if need == Need::Optional && !optional(tensor, layer) {
            return Ok(());
        }
        let dtype = if tensor.is_vector() {
            DType::F32
        } else {
            dtype_of(tensor, layer)
        };
        out.push(TensorDecl {
            name: arch.name(tensor, layer.unwrap_or(0)),
            tensor,
            layer,
            layout: Layout::contiguous(dtype, shape_of(arch, tensor, dim)?),
        });
        Ok(())
    };
    for (t, need) in arch.model_tensors() {
        push(t, need, None)?;
    }
    for l in 0..n_layer {
        for (t, need) in arch.layer_tensors() {
            push(t, need, Some(l))?;
        }
    }
    Ok(out)
}

/// [`model_layouts`] of a decoder of `cfg`.
pub fn decoder_layouts(
    cfg: &DecoderConfig,
    dtype_of: &dyn Fn(Tensor, Option<usize>) -> DType,
    optional: &dyn Fn(Tensor, Option<usize>) -> bool,
) -> Result<Vec<TensorDecl>> {
    model_layouts(cfg.arch, cfg.n_layer, &|d| cfg.dim(d), dtype_of, optional)
}

/// The axis of a role's shape that counts KV-head features (`Dim::Kv`: K, V, their biases,
/// the cache), if it has one.
pub fn kv_axis(tensor: Tensor) -> Option<usize> {
    tensor.info().shape.iter().position(|d| *d == Dim::Kv)
}

/// Where a role's KV heads lie: the axis, and how many runs of KV heads end it (`Dim::Kv`:
/// one run, the whole axis; a fused Q | K | V (`Dim::Qkv`, Phi-3): two runs, K and V, after
/// the query heads).
fn kv_runs(tensor: Tensor) -> Option<(usize, usize)> {
    let shape = tensor.info().shape;
    kv_axis(tensor)
        .map(|a| (a, 1))
        .or_else(|| shape.iter().position(|d| *d == Dim::Qkv).map(|a| (a, 2)))
}

/// How each KV head is repeated at placement (virtual KV heads): `r` copies of each of the
/// file's `n_head_kv` heads of `head_dim` features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvRepeat {
    pub r: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

/// `d` as placed with each KV head repeated ([`KvRepeat`]): a role with KV heads (K, V, their
/// biases; a fused Q | K | V) is longer along that axis by the copies; any other is unchanged.
pub fn repeat_kv_decl(d: &TensorDecl, kv: KvRepeat) -> TensorDecl {
    let mut out = d.clone();
    if let Some((a, runs)) = kv_runs(d.tensor) {
        let mut ne = d.layout.ne;
        ne[a] += runs * (kv.r.max(1) - 1) * kv.n_head_kv * kv.head_dim;
        out.layout = Layout::contiguous(d.layout.dtype, ne);
    }
    out
}

/// The bytes of a tensor of role `tensor` (`bytes`, contiguous in `layout` as the file stores
/// it) with each KV head's `head_dim` features repeated `r` times in place along the KV-head
/// axis: heads `h0 h1` become `h0 h0 h1 h1` for `r = 2` (in a fused Q | K | V the query heads
/// stay as they are and the K and V heads are repeated). Along axis 1 (the rows of K and V)
/// whole rows are copied, so any element type works (rows are whole blocks); along axis 0
/// (a bias) a head must be whole blocks. A byte copy: the values are the file's, bit for bit.
/// An error naming the tensor when the layout does not hold whole heads.
pub fn repeat_kv_rows(
    name: &str,
    tensor: Tensor,
    layout: &Layout,
    kv: KvRepeat,
    bytes: &[u8],
) -> Result<Vec<u8>> {
    let bad = |reason: String| Error::Model {
        model: "weights".into(),
        reason: format!("cannot repeat the KV heads of `{name}`: {reason}"),
    };
    let Some((a, runs)) = kv_runs(tensor) else {
        return Err(bad("the tensor has no KV-head dimension".into()));
    };
    let (head_dim, r) = (kv.head_dim, kv.r.max(1));
    let ne = layout.ne;
    let block = layout.dtype.block_size();
    if bytes.len() != layout.nbytes()
        || head_dim == 0
        || !ne[a].is_multiple_of(head_dim)
        || (a == 0 && !head_dim.is_multiple_of(block))
        || ne[a] / head_dim < runs * kv.n_head_kv
    {
        return Err(bad(format!(
            "{} bytes of {} {} do not hold whole heads of {head_dim} features",
            bytes.len(),
            layout.dtype,
            layout.shape()
        )));
    }
    let heads = ne[a] / head_dim;
    // Heads before the KV runs (a fused tensor's query heads), copied once.
    let lead = heads - runs * kv.n_head_kv;
    // Bytes of one index of the axes above `a`: `heads` chunks of one head each.
    let outer: usize = ne[a + 1..].iter().product();
    let slab = bytes.len() / outer.max(1);
    let chunk = slab / heads.max(1);
    let mut out = Vec::with_capacity(bytes.len() * r);
    for s in bytes.chunks_exact(slab.max(1)) {
        for (i, h) in s.chunks_exact(chunk.max(1)).enumerate() {
            let copies = if i < lead { 1 } else { r };
            for _ in 0..copies {
                out.extend_from_slice(h);
            }
        }
    }
    Ok(out)
}

/// Names and layouts of the cache tensors, for allocation.
pub fn kv_cache_layouts(cfg: &DecoderConfig, size: usize) -> Vec<(String, Layout)> {
    let mut v = Vec::new();
    for l in 0..cfg.n_layer {
        for t in [Tensor::CacheK, Tensor::CacheV] {
            debug_assert_eq!(t.scope(), Scope::Cache);
            v.push((
                cfg.arch.name(t, l),
                Layout::contiguous(DType::F16, [cfg.n_embd_kv(), size, 1, 1]),
            ));
        }
    }
    v
}

/// Place named tensors in one buffer of `bt` (calling the meta split callback where `bt` is a
/// meta buffer type) and return references to them.
pub fn place(
    bt: &dyn BufferType,
    tensors: &[(String, Layout)],
    usage: BufferUsage,
) -> Result<(Arc<dyn Buffer>, Vec<WeightRef>)> {
    let layouts: Vec<Layout> = tensors.iter().map(|t| t.1).collect();
    let (buf, offs) = alloc_tensors(bt, &layouts)?;
    buf.set_usage(usage);
    let mut refs = Vec::with_capacity(tensors.len());
    for ((name, layout), off) in tensors.iter().zip(offs) {
        buf.init_tensor(name, layout, off)?;
        refs.push(WeightRef {
            name: name.clone(),
            layout: *layout,
            storage: Storage::new(buf.clone(), off),
        });
    }
    Ok((buf, refs))
}

/// Place a decoder's declared tensors in `bt`: the buffer, the references (in `decls` order)
/// and the weights by role.
pub fn place_decoder(
    cfg: &DecoderConfig,
    decls: &[TensorDecl],
    bt: &dyn BufferType,
) -> Result<(Arc<dyn Buffer>, Vec<WeightRef>, ModelWeights)> {
    place_decoder_shared(cfg, decls, bt, &[])
}

/// [`place_decoder`] with some tensors placed as other names of another's bytes: each pair
/// `(i, j)` of `shared` makes `decls[i]` a reference to the storage of `decls[j]` (same
/// layout; `j` itself placed). A tied output projection split as the embedding is (both by
/// vocabulary, or both mirrored, or one device) needs no copy of its own: the meta device
/// finds a leaf's state by its storage, so the product reads the embedding's slices.
pub fn place_decoder_shared(
    cfg: &DecoderConfig,
    decls: &[TensorDecl],
    bt: &dyn BufferType,
    shared: &[(usize, usize)],
) -> Result<(Arc<dyn Buffer>, Vec<WeightRef>, ModelWeights)> {
    if let Some(&(i, j)) = shared
        .iter()
        .find(|&&(i, j)| i.max(j) >= decls.len() || i == j)
    {
        return Err(Error::invalid_input(
            "placing a decoder",
            "shared tensors",
            format!("two of {} declared tensors", decls.len()),
            format!("({i}, {j})"),
        ));
    }
    let is_shared = |i: usize| shared.iter().any(|&(a, _)| a == i);
    let own: Vec<usize> = (0..decls.len()).filter(|&i| !is_shared(i)).collect();
    let named: Vec<(String, Layout)> = own
        .iter()
        .map(|&i| (decls[i].name.clone(), decls[i].layout))
        .collect();
    let (buf, placed) = place(bt, &named, BufferUsage::Weights)?;
    let mut refs: Vec<Option<WeightRef>> = vec![None; decls.len()];
    for (r, &i) in placed.into_iter().zip(&own) {
        refs[i] = Some(r);
    }
    for &(i, j) in shared {
        let (d, to) = (&decls[i], &decls[j]);
        let storage = match refs[j].as_ref() {
            Some(r) if d.layout == to.layout => r.storage.clone(),
            _ => {
                return Err(Error::Model {
                    model: cfg.arch.name.into(),
                    reason: format!(
                        "`{}` ({}) cannot share the bytes of `{}` ({})",
                        d.name,
                        d.layout.shape(),
                        to.name,
                        to.layout.shape()
                    ),
                });
            }
        };
        refs[i] = Some(WeightRef {
            name: d.name.clone(),
            layout: d.layout,
            storage,
        });
    }
    let refs: Vec<WeightRef> = refs.into_iter().flatten().collect();
    let w = ModelWeights::assemble(cfg.n_layer, decls, &refs);
    Ok((buf, refs, w))
}

/// The pairs of [`place_decoder_shared`] for a model whose output projection is tied to its
/// token embedding: (the output's index, the embedding's) in `decls`; none when either is
/// absent.
pub fn tied_output_pair(decls: &[TensorDecl]) -> Vec<(usize, usize)> {
    let find = |t: Tensor| decls.iter().position(|d| d.tensor == t);
    match (find(Tensor::Output), find(Tensor::TokenEmbd)) {
        (Some(o), Some(e)) => vec![(o, e)],
        _ => Vec::new(),
    }
}

/// A zeroed KV cache of `size` rows per layer placed in `bt`.
pub fn alloc_kv_cache(
    cfg: &DecoderConfig,
    size: usize,
    bt: &dyn BufferType,
) -> Result<(Arc<dyn Buffer>, KvCache)> {
    place_kv_cache(cfg, size, bt, true)
}

/// A KV cache of `size` rows per layer placed in `bt`, zeroed when `clear` (the planner's
/// virtual devices have nothing to clear, and clearing a meta buffer walks every slice).
pub fn place_kv_cache(
    cfg: &DecoderConfig,
    size: usize,
    bt: &dyn BufferType,
    clear: bool,
) -> Result<(Arc<dyn Buffer>, KvCache)> {
    let (buf, refs) = place(bt, &kv_cache_layouts(cfg, size), BufferUsage::Compute)?;
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for r in refs {
        if clear {
            r.storage
                .buffer
                .memset_tensor(&r.layout, r.storage.offset, 0, 0, r.layout.nbytes())?;
        }
        match cfg.arch.parse(&r.name) {
            Some((Tensor::CacheK, _)) => k.push(r),
            _ => v.push(r),
        }
    }
    Ok((buf, KvCache { k, v, size }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_heads_are_repeated_in_place_as_whole_rows_or_elements() {
        // K: 2 heads of 2 rows, rows of 3 f32 (12 bytes): rows 0 1 | 2 3 -> 0 1 0 1 | 2 3 2 3.
        let k = Layout::contiguous(DType::F32, [3, 4, 1, 1]);
        let bytes: Vec<u8> = (0..48).collect();
        let out = repeat_kv_rows("k", Tensor::AttnK, &k, kv(2, 2, 2), &bytes).unwrap();
        let row = |r: u8| (r * 12..r * 12 + 12).collect::<Vec<u8>>();
        let want: Vec<u8> = [0, 1, 0, 1, 2, 3, 2, 3].into_iter().flat_map(row).collect();
        assert_eq!(out, want);
        let d = TensorDecl {
            name: "blk.0.attn_k.weight".into(),
            tensor: Tensor::AttnK,
            layer: Some(0),
            layout: k,
        };
        assert_eq!(repeat_kv_decl(&d, kv(2, 2, 2)).layout.ne, [3, 8, 1, 1]);
        // A bias: elements of a head along axis 0, three copies.
        let b = Layout::contiguous(DType::F32, [4, 1, 1, 1]);
        let v: Vec<u8> = [1f32, 2., 3., 4.]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let out = repeat_kv_rows("b", Tensor::AttnKBias, &b, kv(3, 2, 2), &v).unwrap();
        let got: Vec<f32> = out
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, [1., 2., 1., 2., 1., 2., 3., 4., 3., 4., 3., 4.]);
        // No KV-head axis, or heads not whole: errors naming the tensor.
        let q = repeat_kv_rows(
            "blk.0.attn_q.weight",
            Tensor::AttnQ,
            &k,
            kv(2, 2, 2),
            &bytes,
        );
        assert!(format!("{q:?}").contains("blk.0.attn_q.weight"));
        assert!(repeat_kv_rows("k", Tensor::AttnK, &k, kv(2, 1, 3), &bytes).is_err());
    }

    fn kv(r: usize, n_head_kv: usize, head_dim: usize) -> KvRepeat {
        KvRepeat {
            r,
            n_head_kv,
            head_dim,
        }
    }

    #[test]
    fn a_fused_qkv_repeats_its_k_and_v_heads_after_the_query_heads() {
        // Q | K | V rows of Phi-3's attn_qkv: 2 query heads, 1 KV head, heads of 1 row of 2
        // f32: rows q0 q1 k v -> q0 q1 k k v v for r = 2.
        let qkv = Layout::contiguous(DType::F32, [2, 4, 1, 1]);
        let bytes: Vec<u8> = (0..32).collect();
        let out = repeat_kv_rows("qkv", Tensor::AttnQkv, &qkv, kv(2, 1, 1), &bytes).unwrap();
        let row = |r: u8| (r * 8..r * 8 + 8).collect::<Vec<u8>>();
        let want: Vec<u8> = [0, 1, 2, 2, 3, 3].into_iter().flat_map(row).collect();
        assert_eq!(out, want);
        let d = TensorDecl {
            name: "blk.0.attn_qkv.weight".into(),
            tensor: Tensor::AttnQkv,
            layer: Some(0),
            layout: qkv,
        };
        assert_eq!(repeat_kv_decl(&d, kv(2, 1, 1)).layout.ne, [2, 6, 1, 1]);
    }
}
