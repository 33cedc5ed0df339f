//! Meta buffers. A `MetaBuffer` is a virtual address space of tensors: placing a tensor in it
//! (`init_tensor`) asks the split callback for the tensor's state and allocates, on each
//! device, only that device's slice (the whole tensor where mirrored or partial). Reads and
//! writes take byte ranges of the full tensor: `set_tensor` scatters them to the slices that
//! hold them (partial tensors: device 0 takes the data, the others zeros), `get_tensor`
//! gathers them (partial tensors: the sum over devices; group-routed ones: each device's
//! columns in zeros, summed). Expert-group states are cut on two axes, so their bytes are
//! found per device (`group_slice_layout`).
//!
//! The meta backend also registers its outputs here (`register`), so results are read the same
//! way as weights.

use super::{MetaShared, TensorInfo};
use crate::buffer::{Buffer, BufferType, BufferUsage, Storage};
use crate::collectives::SliceLayout;
use crate::split_state::{SplitAxis, SplitState};
use crate::tensor::Layout;
use crate::{DType, Error, Result};
use parking_lot::{Mutex, RwLock};
use std::any::Any;
use std::collections::BTreeMap;
use std::sync::Arc;

/// The buffer type of a meta device.
pub struct MetaBufferType {
    shared: Arc<MetaShared>,
}

impl MetaBufferType {
    /// Whether this buffer type is the one of the meta device sharing `shared`.
    pub(crate) fn belongs_to(&self, shared: &Arc<MetaShared>) -> bool {
        Arc::ptr_eq(&self.shared, shared)
    }

    pub fn new(shared: Arc<MetaShared>) -> Self {
        MetaBufferType { shared }
    }
}

impl BufferType for MetaBufferType {
    fn name(&self) -> String {
        format!("Meta({})", self.shared.devices.len())
    }

    /// A virtual buffer of `size` bytes; device memory is allocated per tensor as tensors are
    /// placed in it.
    fn alloc_buffer(&self, size: usize) -> Result<Arc<dyn Buffer>> {
        Ok(Arc::new(MetaBuffer::new(self.shared.clone(), size)))
    }

    fn alignment(&self) -> usize {
        64
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// One tensor of a meta buffer: its full layout, its state, and each device's slice.
#[derive(Clone, Debug)]
pub struct MetaTensor {
    pub name: String,
    pub layout: Layout,
    pub state: SplitState,
    /// Per device: where the slice lives and its (packed) local layout.
    pub local: Vec<(Storage, Layout)>,
}

impl MetaTensor {
    /// Bytes held by device `d`.
    pub fn local_bytes(&self, d: usize) -> usize {
        self.local[d].1.nbytes()
    }
}

/// The byte runs of a split tensor (see `collectives::SliceLayout`), for a packed layout.
pub fn slice_layout(layout: &Layout, state: &SplitState) -> Result<SliceLayout> {
    let k = state.split_dim().expect("slice_layout of an axis split");
    let bs = layout.dtype.block_size();
    let (unit, div) = if k == 0 {
        (layout.dtype.type_size(), bs)
    } else {
        (layout.nb[k], 1)
    };
    let outer: usize = layout.ne[k + 1..].iter().product();
    let segments: Vec<Vec<usize>> = state
        .segments()
        .into_iter()
        .map(|s| s.into_iter().map(|e| e / div).collect())
        .collect();
    SliceLayout::new(outer, unit, &segments)
}

/// Device `d`'s bytes of a packed tensor in an expert-group state, as rank 1 of a 3-rank
/// [`SliceLayout`] (rank 0: what lies before the device's slice along the inner axis, rank 2:
/// after it). `ExpertGroups(1)`: per expert, rows `[start, inner, rest]` of axis 1 where the
/// expert is the group's, the whole expert (rank 0) elsewhere; `ExpertGroups(0)`: the same per
/// row of axis 0 (in blocks); `GroupRouted`: per row, its columns of axis 0.
pub fn group_slice_layout(layout: &Layout, state: &SplitState, d: usize) -> Result<SliceLayout> {
    let [ne0, ne1, ne2, ne3] = layout.ne;
    let bs = layout.dtype.block_size().max(1);
    let inner = state.inner_slice(d);
    let (lo, len) = (inner.start, inner.len());
    let mine = |total: usize| vec![lo, len, total - (lo + len).min(total)];
    let experts = state.group_of(d).map_or(0..0, |g| g.experts);
    match state.axis {
        SplitAxis::GroupRouted { .. } => SliceLayout::new(
            ne1 * ne2 * ne3,
            layout.dtype.type_size(),
            &[vec![lo / bs, len / bs, (ne0 - lo - len) / bs]],
        ),
        SplitAxis::ExpertGroups(k) => {
            // (unit bytes, units per row of the inner axis, rows per expert)
            let (unit, row, rows) = if k == 0 {
                (layout.dtype.type_size(), ne0 / bs, ne1)
            } else {
                (layout.nb[1], ne1, 1)
            };
            let div = if k == 0 { bs } else { 1 };
            let mut segs: Vec<Vec<usize>> = Vec::new();
            for e in 0..ne2 {
                if experts.contains(&e) {
                    for _ in 0..rows {
                        let m = mine(row * div);
                        segs.push(m.into_iter().map(|x| x / div).collect());
                    }
                } else if let Some(last) = segs.last_mut().filter(|s| s[1] == 0) {
                    last[0] += row * rows;
                } else {
                    segs.push(vec![row * rows, 0, 0]);
                }
            }
            if segs.is_empty() {
                segs.push(vec![0, 0, 0]);
            }
            SliceLayout::new(ne3, unit, &segs)
        }
        _ => Err(Error::Internal {
            component: "meta buffer",
            reason: format!("group_slice_layout of {state}"),
        }),
    }
}

/// A virtual buffer whose tensors are spread over the meta device's devices.
pub struct MetaBuffer {
    shared: Arc<MetaShared>,
    size: usize,
    tensors: RwLock<BTreeMap<usize, Arc<MetaTensor>>>,
    usage: Mutex<BufferUsage>,
    /// Holds a meta backend's results (bound to the graph after a compute), not user data.
    results: bool,
}

impl MetaBuffer {
    pub fn new(shared: Arc<MetaShared>, size: usize) -> Self {
        MetaBuffer {
            shared,
            size,
            tensors: RwLock::new(BTreeMap::new()),
            usage: Mutex::new(BufferUsage::Any),
            results: false,
        }
    }

    /// A buffer in which a meta backend registers the results of a compute.
    pub fn for_results(shared: Arc<MetaShared>, size: usize) -> Self {
        MetaBuffer {
            results: true,
            ..MetaBuffer::new(shared, size)
        }
    }

    /// Whether this buffer holds a meta backend's results rather than user data.
    pub fn holds_results(&self) -> bool {
        self.results
    }

    pub fn n_devices(&self) -> usize {
        self.shared.devices.len()
    }

    /// The tensor placed at `offset`.
    pub fn tensor_at(&self, offset: usize) -> Option<Arc<MetaTensor>> {
        self.tensors.read().get(&offset).cloned()
    }

    /// Every tensor, by offset.
    pub fn tensors(&self) -> Vec<(usize, Arc<MetaTensor>)> {
        self.tensors
            .read()
            .iter()
            .map(|(&o, t)| (o, t.clone()))
            .collect()
    }

    /// Bytes allocated on each device for this buffer's tensors.
    pub fn device_bytes(&self) -> Vec<usize> {
        let mut v = vec![0; self.n_devices()];
        for t in self.tensors.read().values() {
            for (d, b) in v.iter_mut().enumerate() {
                *b += t.local_bytes(d);
            }
        }
        v
    }

    /// Place an already-split tensor (per-device storages owned elsewhere) at `offset`.
    pub fn register(&self, offset: usize, t: MetaTensor) -> Result<()> {
        if t.local.len() != self.n_devices() {
            return Err(Error::Internal {
                component: "meta buffer",
                reason: format!(
                    "register `{}`: {} slices for {} devices",
                    t.name,
                    t.local.len(),
                    self.n_devices()
                ),
            });
        }
        self.tensors.write().insert(offset, Arc::new(t));
        Ok(())
    }

    /// The registered tensor whose span contains `[offset, offset + len)`, and the position
    /// of `offset` inside it.
    fn find(&self, offset: usize, len: usize, what: &str) -> Result<(Arc<MetaTensor>, usize)> {
        let map = self.tensors.read();
        if let Some((&start, t)) = map.range(..=offset).next_back() {
            let span = t.layout.nbytes();
            if offset + len <= start + span {
                return Ok((t.clone(), offset - start));
            }
        }
        Err(Error::NoStorage {
            tensor: what.to_string(),
            reason: format!(
                "no tensor of this meta buffer spans bytes {offset}..{}",
                offset + len
            ),
        })
    }

    /// Visit, for each device, the pieces `(local_offset, range_in_request)` of the request
    /// `[pos, pos + len)` of the full tensor's bytes that the device holds.
    fn pieces(
        t: &MetaTensor,
        pos: usize,
        len: usize,
        mut f: impl FnMut(usize, usize, std::ops::Range<usize>) -> Result<()>,
    ) -> Result<()> {
        let n = t.local.len();
        match t.state.axis {
            SplitAxis::Mirrored | SplitAxis::Partial | SplitAxis::Routed { .. } => {
                for d in 0..n {
                    f(d, pos, 0..len)?;
                }
            }
            SplitAxis::ExpertGroups(_) | SplitAxis::GroupRouted { .. } => {
                for d in 0..n {
                    let sl = group_slice_layout(&t.layout, &t.state, d)?;
                    for run in sl.runs(1) {
                        let (a, b) = (run.full.max(pos), (run.full + run.len).min(pos + len));
                        if a < b {
                            f(d, run.local + (a - run.full), (a - pos)..(b - pos))?;
                        }
                    }
                }
            }
            SplitAxis::Axis(_) => {
                if !t.layout.is_contiguous() {
                    return Err(Error::MetaPlacement {
                        tensor: t.name.clone(),
                        reason: "a split tensor must be packed (contiguous)".into(),
                    });
                }
                let sl = slice_layout(&t.layout, &t.state)?;
                for d in 0..n {
                    for run in sl.runs(d) {
                        let (a, b) = (run.full.max(pos), (run.full + run.len).min(pos + len));
                        if a < b {
                            f(d, run.local + (a - run.full), (a - pos)..(b - pos))?;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// Sum the byte ranges `parts` (same length) as elements of `dtype` into `out`.
fn sum_into(dtype: DType, parts: &[Vec<u8>], out: &mut [u8]) -> Result<()> {
    let ts = dtype.type_size();
    if !dtype.is_float() || !out.len().is_multiple_of(ts) {
        return Err(Error::InvalidSplit {
            tensor: format!("a partial {dtype} tensor of {} bytes", out.len()),
            reason: "partial sums need a float dtype (F32, F16, BF16) and whole elements".into(),
        });
    }
    let n = out.len() / ts;
    let mut acc = vec![0f32; n];
    let mut tmp = vec![0f32; n];
    for p in parts {
        crate::dtype::row_to_f32(dtype, p, &mut tmp)?;
        acc.iter_mut().zip(&tmp).for_each(|(a, b)| *a += b);
    }
    crate::dtype::row_from_f32(dtype, &acc, out)
}

impl Buffer for MetaBuffer {
    fn buffer_type(&self) -> Arc<dyn BufferType> {
        Arc::new(MetaBufferType::new(self.shared.clone()))
    }

    fn size(&self) -> usize {
        self.size
    }

    /// Ask the split callback for the tensor's state and allocate each device's slice.
    /// Placing the same tensor again (same offset and layout) is a no-op.
    fn init_tensor(&self, name: &str, layout: &Layout, offset: usize) -> Result<()> {
        if let Some(t) = self.tensor_at(offset) {
            if t.layout == *layout {
                return Ok(());
            }
            return Err(Error::MetaPlacement {
                tensor: name.to_string(),
                reason: format!(
                    "{} placed at offset {offset} of a meta buffer, where `{}` {} already is",
                    layout.shape(),
                    t.name,
                    t.layout.shape()
                ),
            });
        }
        if !layout.is_contiguous() {
            return Err(Error::MetaPlacement {
                tensor: name.to_string(),
                reason: "a tensor placed in a meta buffer must be packed (contiguous)".into(),
            });
        }
        let n = self.n_devices();
        let state = (self.shared.split_fn)(&TensorInfo {
            name,
            layout,
            n_devices: n,
        })?;
        state.validate(name, layout, n)?;
        let mut local = Vec::with_capacity(n);
        for (d, dev) in self.shared.devices.iter().enumerate() {
            let ll = Layout::contiguous(layout.dtype, state.local_ne(layout.ne, d));
            let buf = dev.buffer_type().alloc_buffer(ll.nbytes())?;
            buf.set_usage(self.usage());
            local.push((Storage::new(buf, 0), ll));
        }
        self.register(
            offset,
            MetaTensor {
                name: name.to_string(),
                layout: *layout,
                state,
                local,
            },
        )
    }

    fn set_tensor(
        &self,
        layout: &Layout,
        buf_offset: usize,
        data: &[u8],
        offset: usize,
    ) -> Result<()> {
        let _ = layout;
        let (t, pos) = self.find(buf_offset + offset, data.len(), "set_tensor")?;
        let zeros = if t.state.is_sum() {
            vec![0u8; data.len()]
        } else {
            Vec::new()
        };
        Self::pieces(&t, pos, data.len(), |d, local_off, r| {
            let (st, ll) = &t.local[d];
            let src = if t.state.is_sum() && d > 0 {
                &zeros[r]
            } else {
                &data[r]
            };
            st.buffer.set_tensor(ll, st.offset, src, local_off)
        })
    }

    fn get_tensor(
        &self,
        layout: &Layout,
        buf_offset: usize,
        out: &mut [u8],
        offset: usize,
    ) -> Result<()> {
        let _ = layout;
        let (t, pos) = self.find(buf_offset + offset, out.len(), "get_tensor")?;
        match t.state.axis {
            SplitAxis::Mirrored => {
                // The first device whose memory this process holds (device 0 unless it is
                // another process's rank).
                let d = (0..t.local.len())
                    .find(|&d| !self.shared.devices[d].is_remote())
                    .unwrap_or(0);
                let (st, ll) = &t.local[d];
                st.buffer.get_tensor(ll, st.offset, out, pos)
            }
            SplitAxis::Partial | SplitAxis::Routed { .. } => {
                let mut parts = Vec::with_capacity(t.local.len());
                for (st, ll) in &t.local {
                    let mut p = vec![0u8; out.len()];
                    st.buffer.get_tensor(ll, st.offset, &mut p, pos)?;
                    parts.push(p);
                }
                sum_into(t.layout.dtype, &parts, out)
            }
            // Each device's columns in zeros, summed: a group's devices tile the columns of
            // its rows, the other rows are zeros on its devices.
            SplitAxis::GroupRouted { .. } => {
                let mut parts = vec![vec![0u8; out.len()]; t.local.len()];
                Self::pieces(&t, pos, out.len(), |d, local_off, r| {
                    let (st, ll) = &t.local[d];
                    st.buffer
                        .get_tensor(ll, st.offset, &mut parts[d][r], local_off)
                })?;
                sum_into(t.layout.dtype, &parts, out)
            }
            SplitAxis::ExpertGroups(_) | SplitAxis::Axis(_) => {
                Self::pieces(&t, pos, out.len(), |d, local_off, r| {
                    let (st, ll) = &t.local[d];
                    st.buffer.get_tensor(ll, st.offset, &mut out[r], local_off)
                })
            }
        }
    }

    fn memset_tensor(
        &self,
        layout: &Layout,
        buf_offset: usize,
        value: u8,
        offset: usize,
        size: usize,
    ) -> Result<()> {
        let _ = layout;
        let (t, pos) = self.find(buf_offset + offset, size, "memset_tensor")?;
        Self::pieces(&t, pos, size, |d, local_off, r| {
            let (st, ll) = &t.local[d];
            let v = if t.state.is_sum() && d > 0 { 0 } else { value };
            st.buffer
                .memset_tensor(ll, st.offset, v, local_off, r.len())
        })
    }

    fn clear(&self, value: u8) {
        for t in self.tensors.read().values() {
            for (d, (st, ll)) in t.local.iter().enumerate() {
                let v = if t.state.is_sum() && d > 0 { 0 } else { value };
                let _ = st.buffer.memset_tensor(ll, st.offset, v, 0, ll.nbytes());
            }
        }
    }

    fn usage(&self) -> BufferUsage {
        *self.usage.lock()
    }

    fn set_usage(&self, usage: BufferUsage) {
        *self.usage.lock() = usage;
        for t in self.tensors.read().values() {
            for (st, _) in &t.local {
                st.buffer.set_usage(usage);
            }
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
