//! The tensor graph: an arena of nodes in creation order (which is a topological order), each
//! with a layout, a typed `Op`, its sources, a name, flags, and optionally bound storage or
//! inline input bytes. Builder methods (in `build.rs`) check shapes and dtypes and return an
//! error naming the op and both shapes.
//!
//! Views (`reshape`, `view`, `permute`, `transpose`) and the ops that write into an existing
//! tensor (`cpy`, `set_rows`) record `view_src`, the root node that owns the bytes, and
//! `view_offs`, the byte offset into it; only roots are allocated.

mod build;

use crate::buffer::Storage;
use crate::op::Op;
use crate::tensor::Layout;
use crate::{DType, Error, Result};
use smallvec::SmallVec;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// `len` zero bytes, shared while any graph holds them. The most recently used sizes (at most
/// [`ZERO_KEEP_BYTES`] in all) also stay alive between graphs:
/// a planner building thousands of graphs would otherwise free and re-zero the same buffers
/// each time (measured: 15% of an 80-layer plan's solve time in `memset`).
pub fn zero_bytes(len: usize) -> Arc<[u8]> {
    struct Pool {
        weak: Vec<(usize, std::sync::Weak<[u8]>)>,
        keep: std::collections::VecDeque<Arc<[u8]>>,
    }
    static POOL: parking_lot::Mutex<Pool> = parking_lot::Mutex::new(Pool {
        weak: Vec::new(),
        keep: std::collections::VecDeque::new(),
    });
    let mut pool = POOL.lock();
    pool.weak.retain(|(_, w)| w.strong_count() > 0);
    let found = pool
        .weak
        .iter()
        .find(|(l, _)| *l == len)
        .and_then(|(_, w)| w.upgrade());
    let a = match found {
        Some(a) => a,
        None => {
            // Allocated zeroed in place (the pages stay untouched until read), not copied from
            // a vector.
            // SAFETY: all-zero bytes are valid `u8`s.
            let a: Arc<[u8]> = unsafe { Arc::<[u8]>::new_zeroed_slice(len).assume_init() };
            pool.weak.push((len, Arc::downgrade(&a)));
            a
        }
    };
    if len <= ZERO_KEEP_BYTES && !pool.keep.iter().any(|k| Arc::ptr_eq(k, &a)) {
        let mut kept: usize = pool.keep.iter().map(|k| k.len()).sum();
        while kept + len > ZERO_KEEP_BYTES {
            kept -= pool.keep.pop_front().map_or(0, |k| k.len());
        }
        pool.keep.push_back(a.clone());
    }
    a
}

/// Bytes of zero buffers kept alive between graphs, oldest dropped first.
pub const ZERO_KEEP_BYTES: usize = 128 << 20;

/// Index of a node in its graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(pub u32);

impl TensorId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Node flags.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Flags(u8);

impl Flags {
    pub const INPUT: Flags = Flags(1);
    pub const OUTPUT: Flags = Flags(2);
    pub const WEIGHT: Flags = Flags(4);

    pub fn contains(self, f: Flags) -> bool {
        self.0 & f.0 == f.0
    }
}

impl std::ops::BitOr for Flags {
    type Output = Flags;
    fn bitor(self, o: Flags) -> Flags {
        Flags(self.0 | o.0)
    }
}

/// One tensor of a graph.
#[derive(Clone, Debug)]
pub struct Node {
    pub layout: Layout,
    pub op: Op,
    pub src: SmallVec<[TensorId; 4]>,
    /// The root whose bytes this node uses (views, and ops writing into a source).
    pub view_src: Option<TensorId>,
    /// Byte offset of this node's first element inside the root's bytes.
    pub view_offs: usize,
    pub name: String,
    pub flags: Flags,
    /// Where a root's bytes are: bound by the user (weights, caches, inputs) or by an allocator.
    pub storage: Option<Storage>,
    /// Inline bytes for a leaf, copied into its storage before the graph runs.
    pub data: Option<Arc<[u8]>>,
}

impl Node {
    pub fn dtype(&self) -> DType {
        self.layout.dtype
    }
    pub fn ne(&self) -> [usize; 4] {
        self.layout.ne
    }
    pub fn is_leaf(&self) -> bool {
        matches!(self.op, Op::Leaf)
    }
}

/// An arena of nodes. Node `i`'s sources all have indices below `i`.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    nodes: Vec<Node>,
    /// Nodes get no names ([`Graph::unnamed`]).
    unnamed: bool,
}

impl Graph {
    pub fn new() -> Self {
        Graph::default()
    }

    /// A graph whose nodes get no names (every name is empty, `set_name` does nothing), with
    /// room for `capacity` nodes: for programs that are only measured and costed, never run or
    /// shown (the planner's per-device programs), where formatting a name per node and device
    /// is a large share of the work.
    pub fn unnamed(capacity: usize) -> Self {
        Graph {
            nodes: Vec::with_capacity(capacity),
            unnamed: true,
        }
    }

    /// Whether nodes get names (see [`Graph::unnamed`]).
    pub fn is_named(&self) -> bool {
        !self.unnamed
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The distinct buffers this graph's storage is bound to, held weakly: a cached plan for the
    /// graph is valid while every one of them is alive (the meta backend and the scheduler drop
    /// plans whose buffers were freed).
    pub fn bound_buffers(&self) -> Vec<std::sync::Weak<dyn crate::buffer::Buffer>> {
        let mut bound: Vec<std::sync::Weak<dyn crate::buffer::Buffer>> = Vec::new();
        for n in self.nodes() {
            if let Some(st) = &n.storage
                && !bound
                    .iter()
                    .any(|w| std::ptr::addr_eq(w.as_ptr(), Arc::as_ptr(&st.buffer)))
            {
                bound.push(Arc::downgrade(&st.buffer));
            }
        }
        bound
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn ids(&self) -> impl Iterator<Item = TensorId> + use<> {
        (0..self.nodes.len() as u32).map(TensorId)
    }

    pub fn node(&self, id: TensorId) -> &Node {
        &self.nodes[id.index()]
    }

    pub fn node_mut(&mut self, id: TensorId) -> &mut Node {
        &mut self.nodes[id.index()]
    }

    /// A node by id, or an error if the id is not from this graph.
    pub fn get(&self, id: TensorId) -> Result<&Node> {
        self.nodes.get(id.index()).ok_or(Error::UnknownTensor {
            id: id.index(),
            len: self.nodes.len(),
        })
    }

    pub fn layout(&self, id: TensorId) -> &Layout {
        &self.nodes[id.index()].layout
    }

    pub fn name(&self, id: TensorId) -> &str {
        &self.nodes[id.index()].name
    }

    /// The first node with this name.
    pub fn find(&self, name: &str) -> Option<TensorId> {
        self.nodes
            .iter()
            .position(|n| n.name == name)
            .map(|i| TensorId(i as u32))
    }

    /// Push a node; sources must already exist.
    pub(crate) fn push(&mut self, node: Node) -> TensorId {
        let id = TensorId(self.nodes.len() as u32);
        self.nodes.push(node);
        id
    }

    /// Set a node's name (returns the id, for chaining).
    pub fn set_name(&mut self, id: TensorId, name: impl Into<String>) -> TensorId {
        if !self.unnamed {
            self.nodes[id.index()].name = name.into();
        }
        id
    }

    pub fn set_flags(&mut self, id: TensorId, flags: Flags) {
        let n = &mut self.nodes[id.index()];
        n.flags = n.flags | flags;
    }

    /// Mark a node as an output: its bytes survive the computation and can be read after.
    pub fn set_output(&mut self, id: TensorId) {
        self.set_flags(id, Flags::OUTPUT);
    }

    /// The root node owning `id`'s bytes (itself unless it is a view).
    pub fn root(&self, id: TensorId) -> TensorId {
        self.nodes[id.index()].view_src.unwrap_or(id)
    }

    /// Bind storage to a root node (a weight, a cache, a pre-allocated input or output).
    pub fn bind(&mut self, id: TensorId, storage: Storage) -> Result<()> {
        let n = self.get(id)?;
        if n.view_src.is_some() {
            return Err(Error::BindToView {
                tensor: n.name.clone(),
                root: self.nodes[self.root(id).index()].name.clone(),
            });
        }
        // Kernels read f32/i32 through aligned pointers, halves and blocks (f16 scales) by
        // 2-byte units; buffers themselves are aligned far beyond this.
        let align = match n.layout.dtype {
            DType::F32 | DType::I32 => 4,
            _ => 2,
        };
        if !storage.offset.is_multiple_of(align) {
            return Err(Error::MisalignedBinding {
                tensor: n.name.clone(),
                offset: storage.offset,
                dtype: n.layout.dtype.name(),
                align,
            });
        }
        let span = n.layout.nbytes();
        let size = storage.buffer.size();
        if storage.offset.checked_add(span).is_none_or(|e| e > size) {
            return Err(Error::BufferTooSmall {
                what: format!("binding `{}` at offset {}", n.name, storage.offset),
                needed: storage.offset.saturating_add(span),
                available: size,
            });
        }
        storage
            .buffer
            .init_tensor(&n.name, &n.layout, storage.offset)?;
        self.nodes[id.index()].storage = Some(storage);
        Ok(())
    }

    /// Attach inline bytes to a leaf; they are copied into its storage before compute.
    pub fn set_data(&mut self, id: TensorId, bytes: impl Into<Arc<[u8]>>) -> Result<()> {
        let bytes = bytes.into();
        let n = self.get(id)?;
        if !n.is_leaf() {
            return Err(Error::NotALeaf {
                action: "set_data",
                tensor: n.name.clone(),
                op: n.op.name(),
            });
        }
        if !n.layout.is_contiguous() || bytes.len() != n.layout.nbytes() {
            return Err(Error::BufferTooSmall {
                what: format!("inline data for `{}` {}", n.name, n.layout.shape()),
                needed: n.layout.nbytes(),
                available: bytes.len(),
            });
        }
        self.nodes[id.index()].data = Some(bytes);
        Ok(())
    }

    /// Attach `len` zero bytes to a leaf, shared with every other zero leaf of that size in the
    /// process (the meta rewrite's zero tensors: a prefill graph of a large model has many of
    /// one size, and materializing each cost gigabytes and most of the planning time).
    pub fn set_zeros(&mut self, id: TensorId) -> Result<()> {
        let len = self.get(id)?.layout.nbytes();
        self.set_data(id, zero_bytes(len))
    }

    /// Attach f32 values to an F32 leaf.
    pub fn set_f32(&mut self, id: TensorId, v: &[f32]) -> Result<()> {
        self.check_dtype(id, DType::F32, "set_f32")?;
        self.set_data(id, crate::dtype::as_bytes(v).to_vec())
    }

    /// Attach i32 values to an I32 leaf.
    pub fn set_i32(&mut self, id: TensorId, v: &[i32]) -> Result<()> {
        self.check_dtype(id, DType::I32, "set_i32")?;
        self.set_data(id, crate::dtype::as_bytes(v).to_vec())
    }

    fn check_dtype(&self, id: TensorId, dt: DType, what: &'static str) -> Result<()> {
        let n = self.get(id)?;
        if n.dtype() != dt {
            return Err(Error::DTypeMismatch {
                op: what,
                operand: n.name.clone(),
                expected: dt.to_string(),
                got: n.dtype().to_string(),
            });
        }
        Ok(())
    }

    /// Storage of `id`'s first byte: its root's storage plus the view offset.
    pub fn storage(&self, id: TensorId) -> Option<Storage> {
        let n = &self.nodes[id.index()];
        let root = &self.nodes[self.root(id).index()];
        root.storage
            .as_ref()
            .map(|s| Storage::new(s.buffer.clone(), s.offset + n.view_offs))
    }

    /// The span of `id`'s bytes (nbytes from its first element).
    pub fn read_bytes(&self, id: TensorId) -> Result<Vec<u8>> {
        let (layout, st) = self.stored(id)?;
        let mut out = vec![0u8; layout.nbytes()];
        st.get(&layout, &mut out)?;
        Ok(out)
    }

    /// `id`'s layout and storage, or an error naming it if it has none.
    fn stored(&self, id: TensorId) -> Result<(Layout, Storage)> {
        let n = self.get(id)?;
        let st = self.storage(id).ok_or_else(|| Error::NoStorage {
            tensor: n.name.clone(),
            reason: "it has not been computed or allocated".into(),
        })?;
        Ok((n.layout, st))
    }

    /// `id`'s elements in logical order (ne[0] fastest) as f32, whatever the dtype and strides.
    pub fn read_f32(&self, id: TensorId) -> Result<Vec<f32>> {
        let (layout, st) = self.stored(id)?;
        if layout.dtype == DType::F32 && layout.is_contiguous() && layout.nelements() > 0 {
            // Packed f32 (a decoder's logits): its bytes are the result, read in one copy.
            let mut out = vec![0f32; layout.nelements()];
            st.get(&layout, crate::dtype::as_bytes_mut(&mut out))?;
            return Ok(out);
        }
        let mut bytes = vec![0u8; layout.nbytes()];
        st.get(&layout, &mut bytes)?;
        layout_to_f32(&layout, &bytes)
    }

    /// `id`'s elements as i32 (I32 tensors).
    pub fn read_i32(&self, id: TensorId) -> Result<Vec<i32>> {
        self.check_dtype(id, DType::I32, "read_i32")?;
        Ok(self.read_f32(id)?.into_iter().map(|v| v as i32).collect())
    }

    /// Everything that decides how the graph is planned and allocated, as a [`Signature`]: ops
    /// and their parameters, layouts, sources, views, flags, and the identity of bound storage;
    /// not the inline data. Two steps of a decode loop with the same shapes have equal
    /// signatures. Plan caches compare whole signatures, so two graphs share a plan only when
    /// they are the same structure, never because two digests collide.
    pub fn signature(&self) -> Signature {
        // Every node writes about 30 words; one allocation for the whole graph.
        let mut w = SignatureWriter {
            words: Vec::with_capacity(32 * self.nodes.len() + 1),
        };
        self.nodes.len().hash(&mut w);
        for n in &self.nodes {
            n.layout.hash(&mut w);
            n.op.hash(&mut w);
            n.src.hash(&mut w);
            n.view_src.hash(&mut w);
            n.view_offs.hash(&mut w);
            n.flags.hash(&mut w);
            n.data.is_some().hash(&mut w);
            match &n.storage {
                Some(s) => (s.buffer_id(), s.offset).hash(&mut w),
                None => 0usize.hash(&mut w),
            }
        }
        Signature::new(w.words)
    }

    /// The digest of the graph's [`Signature`].
    pub fn structure_hash(&self) -> u64 {
        self.signature().digest()
    }
}

/// A graph's structure as words ([`Graph::signature`]): equal signatures are equal
/// structures (the words are the `Hash` writes of every node's fields, each value in a word of
/// its own or its bytes packed, lengths first, so no two structures write the same words).
/// Compared whole (two different structures usually differ within the first few hundred
/// words); building one costs about a nanosecond per word (SipHash over the same writes, the
/// earlier cache key, took 0.15 ms per decoding step of a 30-layer model on the Zen 2 host).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signature {
    words: Vec<u64>,
}

impl Signature {
    fn new(words: Vec<u64>) -> Signature {
        Signature { words }
    }

    /// A 64-bit digest of the words (FxHash's multiply-rotate step, as rustc's hasher): for
    /// logs and tests; caches compare whole signatures.
    pub fn digest(&self) -> u64 {
        self.words.iter().fold(self.words.len() as u64, |h, &w| {
            (h.rotate_left(5) ^ w).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95)
        })
    }
}

/// A `Hasher` that records what is written instead of mixing it: every integer a word of its
/// own (`Hash` for tuples, enums and slices writes a length or discriminant before the
/// fields), byte slices packed eight to a word after their length.
struct SignatureWriter {
    words: Vec<u64>,
}

impl Hasher for SignatureWriter {
    fn finish(&self) -> u64 {
        unreachable!("a signature is read through Graph::signature, not finished")
    }
    fn write(&mut self, bytes: &[u8]) {
        self.words.push(bytes.len() as u64);
        for c in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            self.words.push(u64::from_le_bytes(b));
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.words.push(i.into());
    }
    fn write_u16(&mut self, i: u16) {
        self.words.push(i.into());
    }
    fn write_u32(&mut self, i: u32) {
        self.words.push(i.into());
    }
    fn write_u64(&mut self, i: u64) {
        self.words.push(i);
    }
    fn write_usize(&mut self, i: usize) {
        self.words.push(i as u64);
    }
    fn write_i8(&mut self, i: i8) {
        self.words.push(i as u64);
    }
    fn write_i16(&mut self, i: i16) {
        self.words.push(i as u64);
    }
    fn write_i32(&mut self, i: i32) {
        self.words.push(i as u64);
    }
    fn write_i64(&mut self, i: i64) {
        self.words.push(i as u64);
    }
    fn write_isize(&mut self, i: isize) {
        self.words.push(i as u64);
    }
}

/// Elements of a tensor in logical order from the bytes of its span.
pub fn layout_to_f32(layout: &Layout, span: &[u8]) -> Result<Vec<f32>> {
    let [ne0, ne1, ne2, ne3] = layout.ne;
    let mut out = vec![0f32; layout.nelements()];
    if out.is_empty() {
        return Ok(out);
    }
    let row_bytes = layout.row_size();
    let mut row = vec![0u8; row_bytes];
    let mut o = 0;
    for i3 in 0..ne3 {
        for i2 in 0..ne2 {
            for i1 in 0..ne1 {
                let base = i1 * layout.nb[1] + i2 * layout.nb[2] + i3 * layout.nb[3];
                if layout.rows_contiguous() {
                    crate::dtype::row_to_f32(
                        layout.dtype,
                        &span[base..base + row_bytes],
                        &mut out[o..o + ne0],
                    )?;
                } else {
                    let ts = layout.dtype.type_size();
                    for i0 in 0..ne0 {
                        let p = base + i0 * layout.nb[0];
                        row[i0 * ts..(i0 + 1) * ts].copy_from_slice(&span[p..p + ts]);
                    }
                    crate::dtype::row_to_f32(layout.dtype, &row, &mut out[o..o + ne0])?;
                }
                o += ne0;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{RopeMode, RopeParams};

    /// x -> rope -> scale -> rms_norm, with the parameters given.
    fn graph(freq_base: f32, scale: f32, eps: f32) -> Graph {
        let mut g = Graph::new();
        let x = g.input("x", DType::F32, [8, 2, 3, 1]).unwrap();
        let pos = g.input("pos", DType::I32, [3, 1, 1, 1]).unwrap();
        let params = RopeParams {
            mode: RopeMode::Normal,
            n_dims: 8,
            freq_base,
            freq_scale: 1.0,
        };
        let r = g.rope(x, pos, params).unwrap();
        let s = g.scale(r, scale).unwrap();
        let n = g.rms_norm(s, eps).unwrap();
        g.set_output(n);
        g
    }

    /// Signatures see structure, not inline data: a graph with other input values has the
    /// same signature (and digest); another shape or op parameter gives another.
    #[test]
    fn signatures_see_structure_not_data() {
        let (mut a, mut b) = (graph(1e4, 0.5, 1e-6), graph(1e4, 0.5, 1e-6));
        let pos = b.find("pos").unwrap();
        a.set_i32(pos, &[0, 1, 2]).unwrap();
        b.set_i32(pos, &[3, 4, 5]).unwrap();
        assert_eq!(a.signature(), b.signature());
        assert_eq!(a.structure_hash(), b.structure_hash());
        let mut c = Graph::new();
        let x = c.input("x", DType::F32, [8, 2, 3, 1]).unwrap();
        let _ = c.scale(x, 0.5).unwrap();
        let mut d = Graph::new();
        let y = d.input("x", DType::F32, [8, 3, 2, 1]).unwrap();
        let _ = d.scale(y, 0.5).unwrap();
        assert_ne!(c.signature(), d.signature());
        assert_ne!(a.signature(), c.signature());
    }

    #[test]
    fn the_structure_hash_sees_op_parameters() {
        let h = graph(1e4, 0.5, 1e-6).structure_hash();
        assert_eq!(graph(1e4, 0.5, 1e-6).structure_hash(), h);
        for other in [
            graph(5e5, 0.5, 1e-6),
            graph(1e4, 0.25, 1e-6),
            graph(1e4, 0.5, 1e-5),
        ] {
            assert_ne!(other.structure_hash(), h);
        }
    }
}
