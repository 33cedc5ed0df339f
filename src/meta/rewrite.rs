//! Pass 2 of the meta backend: rewrite a sharded graph into one program per device. Each user
//! node becomes a node of each device's local graph with the device's shapes (the builders
//! re-check them); a `get_rows` from a table split by rows, or a `set_rows` into a destination
//! split by rows, becomes one windowed op per segment piece the device holds (`RowWindow`:
//! the piece's ids at their local rows; the lookups summed); a `mul_mat_id` whose experts are
//! split whole becomes windowed the same way (each device's rows routed to its experts), and
//! one whose experts lie over groups of devices takes one window, its group's experts (over
//! Mirrored activations, the row product first slices the device's columns of them). Each
//! conversion becomes local nodes (slices: view + cont, concatenated per segment; to-partial:
//! zeros on devices other than 0; pad-to-partial: each slice padded with zeros to the full
//! shape, a group-routed value's columns too, before any reduction of it; as-partial: the
//! same tensors, read as a partial sum) or a collective node; views become local views with
//! the layouts `split_state::view` derived. Stages cut each program at its collectives.
//! `rewrite_unnamed` builds the same programs without node names, for the planner, which only
//! measures and costs them (formatting a name per node and device took 9% of a search's time).

use super::buffer::{MetaBuffer, MetaTensor, slice_layout};
use super::sharding::{ConversionKind, Sharding, conversion_kind};
use crate::backend::Device;
use crate::collectives::SliceLayout;
use crate::graph::{Flags, Graph, Node, TensorId};
use crate::op::{CollectiveKind, Op, RowWindow};
use crate::split_state::{SplitAxis, SplitState};
use crate::tensor::Layout;
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::Arc;

/// A step of a device program.
#[derive(Clone, Debug)]
pub enum Stage {
    /// Compute local nodes with indices in the range.
    Compute(std::ops::Range<usize>),
    /// Fill local node `dst` from local node `src` by a collective.
    Collective {
        kind: CollectiveKind,
        src: TensorId,
        dst: TensorId,
        layout: Option<SliceLayout>,
        dtype: crate::DType,
    },
}

/// What must be written into a local leaf before every run.
#[derive(Clone, Debug)]
pub enum Upload {
    /// The user leaf's inline data (mirrored on every device).
    User(TensorId),
    /// Zeros (the non-zero devices of a to-partial conversion).
    Zeros,
}

/// One device's program.
pub struct DeviceProgram {
    pub graph: Graph,
    pub stages: Vec<Stage>,
    /// Local leaves to fill before each run.
    pub uploads: Vec<(TensorId, Upload)>,
}

/// All devices' programs, and where each user node's value lives on each device.
pub struct Rewritten {
    pub programs: Vec<DeviceProgram>,
    /// Local id per device of each user node in its own state (for the roots of
    /// `mirrored_outputs`, of their mirrored copies).
    pub local: Vec<Vec<TensorId>>,
    /// Output roots converted to mirrored at the end of every program, because some device
    /// belongs to another process (`Device::is_remote`): each process then reads the outputs
    /// from its own device.
    pub mirrored_outputs: Vec<TensorId>,
}

struct Rewriter<'a> {
    g: &'a Graph,
    sharding: &'a Sharding,
    n: usize,
    graphs: Vec<Graph>,
    uploads: Vec<Vec<(TensorId, Upload)>>,
    /// Per user node: (state, local id per device) of each state it was made in (one or two:
    /// a list searched by equality costs less than hashing a state).
    made: Vec<Vec<(SplitState, Vec<TensorId>)>>,
    /// Whether the local graphs' nodes get names (see [`rewrite_unnamed`]).
    named: bool,
    /// Per user node: true if every consumer takes it in one state (so an all-reduce may run
    /// in place) and it is not an output.
    inplace_ok: Vec<bool>,
    /// Per device: the slice layout of each gather and scatter node.
    layouts: Vec<HashMap<TensorId, SliceLayout>>,
}

fn internal(what: String) -> Error {
    Error::Internal {
        component: "meta rewrite",
        reason: what,
    }
}

impl Rewriter<'_> {
    fn packed(&self, u: TensorId) -> Layout {
        let l = self.g.layout(u);
        Layout::contiguous(l.dtype, l.ne)
    }

    /// The local ids of user node `u` made in state `state`.
    fn made(&self, u: TensorId, state: &SplitState) -> Option<&Vec<TensorId>> {
        self.made[u.index()]
            .iter()
            .find(|(s, _)| s == state)
            .map(|(_, ids)| ids)
    }

    /// Record the local ids of user node `u` in state `state` (replacing any).
    fn insert(&mut self, u: TensorId, state: SplitState, ids: Vec<TensorId>) {
        let made = &mut self.made[u.index()];
        match made.iter_mut().find(|(s, _)| *s == state) {
            Some((_, v)) => *v = ids,
            None => made.push((state, ids)),
        }
    }

    /// The local ids of user node `u` in state `want`, converting if needed.
    fn get(&mut self, u: TensorId, want: &SplitState) -> Result<Vec<TensorId>> {
        if let Some(v) = self.made(u, want) {
            return Ok(v.clone());
        }
        let have = self.sharding.states[u.index()].clone();
        let base = self
            .made(u, &have)
            .cloned()
            .ok_or_else(|| internal(format!("`{}` used before it was made", self.g.name(u))))?;
        let kind = conversion_kind(&have, want).ok_or_else(|| {
            internal(format!(
                "no conversion {have} -> {want} for `{}`",
                self.g.name(u)
            ))
        })?;
        // On one device every state holds the whole value: conversions are identities.
        if self.n == 1 {
            self.insert(u, want.clone(), base.clone());
            return Ok(base);
        }
        let full = self.packed(u);
        // A group-routed value is padded into a Partial, which is then reduced: the
        // conversion starts from that Partial.
        let (have, base) = if have.is_group_routed() && kind != ConversionKind::PadToPartial {
            let partial = SplitState::partial(self.n);
            let base = self.get(u, &partial)?;
            (partial, base)
        } else {
            (have, base)
        };
        let ids = self.reduce(u, &have, base, &full, kind, want)?;
        self.insert(u, want.clone(), ids.clone());
        Ok(ids)
    }

    /// The local ids of `u` in state `have` (`base`) converted by `kind`, named after the
    /// conversion.
    fn reduce(
        &mut self,
        u: TensorId,
        have: &SplitState,
        base: Vec<TensorId>,
        full: &Layout,
        kind: ConversionKind,
        want: &SplitState,
    ) -> Result<Vec<TensorId>> {
        let full = *full;
        let ids = match kind {
            // The same local tensors, now read as a partial sum.
            ConversionKind::AsPartial => {
                self.insert(u, want.clone(), base.clone());
                return Ok(base);
            }
            ConversionKind::Slice => self.slice(&base, want)?,
            ConversionKind::ToPartial => {
                let mut v = vec![base[0]];
                for d in 1..self.n {
                    let lg = &mut self.graphs[d];
                    let z = lg.input(&format!("{}.zeros", self.g.name(u)), full.dtype, full.ne)?;
                    lg.set_zeros(z)?;
                    self.uploads[d].push((z, Upload::Zeros));
                    v.push(z);
                }
                v
            }
            ConversionKind::PadToPartial => self.pad(&base, &full, have)?,
            ConversionKind::AllReduce => {
                let inplace = self.inplace_ok[u.index()];
                let mut v = Vec::new();
                for (d, lg) in self.graphs.iter_mut().enumerate() {
                    let mut src = base[d];
                    if !inplace || !lg.layout(src).is_contiguous() {
                        src = lg.cont(src)?;
                    }
                    v.push(lg.collective(CollectiveKind::AllReduce, src, full.ne)?);
                }
                v
            }
            ConversionKind::ReduceScatter => {
                let axis = want.split_dim().unwrap_or(0) as u8;
                let sl = slice_layout(&full, want)?;
                let mut v = Vec::new();
                for (d, lg) in self.graphs.iter_mut().enumerate() {
                    let mut src = base[d];
                    if !lg.layout(src).is_contiguous() {
                        src = lg.cont(src)?;
                    }
                    let id = lg.collective(
                        CollectiveKind::ReduceScatter { axis },
                        src,
                        want.local_ne(full.ne, d),
                    )?;
                    self.layouts[d].insert(id, sl.clone());
                    v.push(id);
                }
                v
            }
            ConversionKind::AllGather => self.gather(&base, &full, have)?,
            ConversionKind::AllToAll => {
                let m = SplitState::mirrored(self.n);
                let gathered = self.gather(&base, &full, have)?;
                self.insert(u, m, gathered.clone());
                self.slice(&gathered, want)?
            }
        };
        if self.named {
            for (d, &id) in ids.iter().enumerate() {
                let name = format!("{}.{}", self.g.name(u), kind.name());
                self.graphs[d].set_name(id, name);
            }
        }
        Ok(ids)
    }

    fn gather(
        &mut self,
        base: &[TensorId],
        full: &Layout,
        have: &SplitState,
    ) -> Result<Vec<TensorId>> {
        let axis = have.split_dim().unwrap_or(0) as u8;
        let sl = slice_layout(full, have)?;
        let mut v = Vec::new();
        for (d, lg) in self.graphs.iter_mut().enumerate() {
            let mut src = base[d];
            if !lg.layout(src).is_contiguous() {
                src = lg.cont(src)?;
            }
            let id = lg.collective(CollectiveKind::AllGather { axis }, src, full.ne)?;
            self.layouts[d].insert(id, sl.clone());
            v.push(id);
        }
        Ok(v)
    }

    /// Partial sums from a split: each device's slice in zeros of the full shape, joined along
    /// the axis (runs of other devices' pieces are one zero tensor each, re-zeroed every run).
    fn pad(
        &mut self,
        base: &[TensorId],
        full: &Layout,
        have: &SplitState,
    ) -> Result<Vec<TensorId>> {
        let k = match have.split_dim() {
            Some(k) => k,
            None if have.is_group_routed() => 0,
            None => return Err(internal("pad from a non-axis state".into())),
        };
        let mut v = Vec::new();
        for (d, lg) in self.graphs.iter_mut().enumerate() {
            let src = base[d];
            let sl = *lg.layout(src);
            // Runs along k in full order: Some(local start) for this device's pieces, None
            // for zeros; adjacent zero runs merged.
            let mut runs: Vec<(Option<usize>, usize)> = Vec::new();
            if have.is_group_routed() {
                // Its columns of its group's rows (the other rows are zeros already).
                let cols = have.inner_slice(d);
                let rest = full.ne[0] - cols.end;
                runs.extend(
                    [(None, cols.start), (Some(0), cols.len()), (None, rest)]
                        .into_iter()
                        .filter(|r| r.1 > 0),
                );
            }
            for s in 0..have.n_segments() {
                for e in 0..self.n {
                    let len = have.extent(s, e);
                    if len == 0 {
                        continue;
                    }
                    match (e == d, runs.last_mut()) {
                        (true, _) => runs.push((Some(have.local_start(s, d)), len)),
                        (false, Some((None, l))) => *l += len,
                        (false, _) => runs.push((None, len)),
                    }
                }
            }
            if runs.is_empty() || matches!(runs[..], [(Some(_), _)]) {
                v.push(src);
                continue;
            }
            let mut acc: Option<TensorId> = None;
            for (start, len) in runs {
                let mut ne = full.ne;
                ne[k] = len;
                let piece = match start {
                    Some(at) => lg.view(src, ne, sl.nb, at * sl.nb[k])?,
                    None => {
                        let z = Layout::contiguous(full.dtype, ne);
                        let id = lg.input(&format!("{}.zeros", lg.name(src)), z.dtype, ne)?;
                        lg.set_zeros(id)?;
                        self.uploads[d].push((id, Upload::Zeros));
                        id
                    }
                };
                acc = Some(match acc {
                    None => piece,
                    Some(a) => lg.concat(a, piece, k)?,
                });
            }
            v.push(acc.ok_or_else(|| internal("padding an empty tensor".into()))?);
        }
        Ok(v)
    }

    /// Each device's slice of a mirrored tensor: a view per segment piece, made packed, and
    /// joined along the axis when there are several segments.
    fn slice(&mut self, base: &[TensorId], want: &SplitState) -> Result<Vec<TensorId>> {
        let k = want
            .split_dim()
            .ok_or_else(|| internal("slice to a non-axis state".into()))?;
        let mut v = Vec::new();
        for (d, lg) in self.graphs.iter_mut().enumerate() {
            let src = base[d];
            let sl = *lg.layout(src);
            if sl.dtype.is_quantized() && want.n_segments() > 1 {
                v.push(slice_by_copies(lg, src, want, d)?);
                continue;
            }
            let mut acc: Option<TensorId> = None;
            for s in 0..want.n_segments() {
                let mut ne = sl.ne;
                ne[k] = want.extent(s, d);
                let start = want.full_start(s, d);
                let offset = if k == 0 {
                    start / sl.dtype.block_size() * sl.nb[0]
                } else {
                    start * sl.nb[k]
                };
                let piece = lg.view(src, ne, sl.nb, if ne[k] == 0 { 0 } else { offset })?;
                let piece = lg.cont(piece)?;
                acc = Some(match acc {
                    None => piece,
                    Some(a) => lg.concat(a, piece, k)?,
                });
            }
            v.push(acc.ok_or_else(|| internal("a split with no segments".into()))?);
        }
        Ok(v)
    }

    fn leaf(
        &mut self,
        u: TensorId,
        node: &Node,
        devices: &[Arc<dyn Device>],
    ) -> Result<Vec<TensorId>> {
        let mut v = Vec::new();
        let meta = node.storage.as_ref().and_then(|st| {
            st.buffer
                .as_any()
                .downcast_ref::<MetaBuffer>()
                .map(|mb| (mb, st.offset))
        });
        for (d, lg) in self.graphs.iter_mut().enumerate() {
            let id = match (&node.storage, meta) {
                (Some(_), Some((mb, off))) => {
                    let t: Arc<MetaTensor> = mb.tensor_at(off).ok_or_else(|| Error::NoStorage {
                        tensor: node.name.clone(),
                        reason: "bound into a meta buffer where no tensor was placed".into(),
                    })?;
                    let (st, ll) = &t.local[d];
                    let id = lg.new_tensor(&node.name, ll.dtype, ll.ne)?;
                    lg.bind(id, st.clone())?;
                    id
                }
                (Some(st), None) => {
                    if !devices[d].supports_buffer_type(st.buffer.buffer_type().as_ref()) {
                        return Err(Error::IncompatibleBuffer {
                            backend: devices[d].name(),
                            tensor: node.name.clone(),
                            buffer_type: st.buffer.buffer_type().name(),
                        });
                    }
                    let id = lg.new_tensor(&node.name, node.layout.dtype, node.layout.ne)?;
                    lg.bind(id, st.clone())?;
                    id
                }
                (None, _) => {
                    if node.data.is_none() {
                        return Err(Error::NoStorage {
                            tensor: node.name.clone(),
                            reason: "a leaf needs bound storage or inline data".into(),
                        });
                    }
                    let id = lg.input(&node.name, node.layout.dtype, node.layout.ne)?;
                    if let Some(data) = &node.data {
                        lg.set_data(id, data.clone())?;
                    }
                    self.uploads[d].push((id, Upload::User(u)));
                    id
                }
            };
            v.push(id);
        }
        Ok(v)
    }
}

/// Device `d`'s segmented slice of the mirrored local tensor `src`, for types `concat` does not
/// take (quantized): each segment's piece is copied into its place in a new local tensor, and a
/// view of the whole follows the copies (a local graph runs in node order). The pieces cover
/// the tensor, so its bytes need no initial value.
fn slice_by_copies(lg: &mut Graph, src: TensorId, want: &SplitState, d: usize) -> Result<TensorId> {
    let k = want
        .split_dim()
        .ok_or_else(|| internal("slice to a non-axis state".into()))?;
    let sl = *lg.layout(src);
    let local = Layout::contiguous(sl.dtype, want.local_ne(sl.ne, d));
    let name = format!("{}.slice", lg.name(src));
    let dst = lg.input(&name, local.dtype, local.ne)?;
    lg.set_zeros(dst)?;
    let at = |l: &Layout, pos: usize| {
        if k == 0 {
            pos / l.dtype.block_size() * l.nb[0]
        } else {
            pos * l.nb[k]
        }
    };
    for s in 0..want.n_segments() {
        let mut ne = sl.ne;
        ne[k] = want.extent(s, d);
        if ne[k] == 0 {
            continue;
        }
        let piece = lg.view(src, ne, sl.nb, at(&sl, want.full_start(s, d)))?;
        let place = lg.view(dst, ne, local.nb, at(&local, want.local_start(s, d)))?;
        lg.cpy(piece, place)?;
    }
    lg.view(dst, local.ne, local.nb, 0)
}

/// Device `d`'s windows of an operand split by rows in `state` (one per segment piece it
/// holds), within `user` (the op's own window, `None` for every row of an operand of `rows`
/// rows). Never empty: a device holding none of the ids gets one empty window, so its op
/// still checks the ids (and `get_rows` writes zeros).
fn row_windows(
    state: &SplitState,
    d: usize,
    user: Option<RowWindow>,
    rows: usize,
) -> Vec<RowWindow> {
    let base = user.unwrap_or(RowWindow::whole(rows));
    let mut v: Vec<RowWindow> = (0..state.n_segments())
        .map(|s| {
            let lo = state.full_start(s, d);
            base.restrict(lo..lo + state.extent(s, d), state.local_start(s, d))
        })
        .filter(|w| !w.is_empty())
        .collect();
    if v.is_empty() {
        v.push(base.restrict(0..0, 0));
    }
    v
}

/// The sum of one windowed op per window (`row_windows` gives at least one).
fn summed(
    lg: &mut Graph,
    windows: Vec<RowWindow>,
    mut one: impl FnMut(&mut Graph, RowWindow) -> Result<TensorId>,
) -> Result<TensorId> {
    let mut acc: Option<TensorId> = None;
    for w in windows {
        let r = one(lg, w)?;
        acc = Some(match acc {
            None => r,
            Some(a) => lg.add(a, r)?,
        });
    }
    acc.ok_or_else(|| internal("a windowed op with no window".into()))
}

/// Rebuild one op on device `d`'s local graph from local sources, the sources consumed in the
/// states `req` (the user graph `g` gives their full shapes): a table split by rows is looked
/// up per window and the pieces summed (a partial sum), a destination split by rows is written
/// per window; every other op is [`rebuild`].
fn rebuild_on(
    lg: &mut Graph,
    g: &Graph,
    node: &Node,
    s: &[TensorId],
    req: &[SplitState],
    d: usize,
) -> Result<TensorId> {
    let by_rows = req.first().is_some_and(|r| r.split_dim() == Some(1));
    match node.op {
        Op::GetRows { window } if by_rows => {
            let rows = g.layout(node.src[0]).ne[1];
            summed(lg, row_windows(&req[0], d, window, rows), |lg, w| {
                lg.get_rows_windowed(s[0], s[1], w)
            })
        }
        // Experts split whole: each device multiplies the rows routed to its experts.
        Op::MulMatId { window } if req[0].split_dim() == Some(2) => {
            let experts = g.layout(node.src[0]).ne[2];
            summed(lg, row_windows(&req[0], d, window, experts), |lg, w| {
                lg.mul_mat_id_windowed(s[0], s[1], s[2], w)
            })
        }
        // Experts over groups: each device multiplies its slice of its group's experts for
        // the rows routed to them (one window; an empty one on a group without experts).
        Op::MulMatId { window } if req[0].is_grouped() => {
            let experts = g.layout(node.src[0]).ne[2];
            let mine = req[0].group_of(d).map_or(0..0, |grp| grp.experts);
            let w = window
                .unwrap_or(RowWindow::whole(experts))
                .restrict(mine, 0);
            let mut b = s[1];
            // Rows inside a group over Mirrored activations: this device's slice of them.
            if req[1].is_mirrored() && req[0].axis == SplitAxis::ExpertGroups(0) {
                let cols = req[0].inner_slice(d);
                let l = *lg.layout(b);
                let mut ne = l.ne;
                ne[0] = cols.len();
                let at = if ne[0] == 0 { 0 } else { cols.start * l.nb[0] };
                let v = lg.view(b, ne, l.nb, at)?;
                b = lg.cont(v)?;
            }
            lg.mul_mat_id_windowed(s[0], b, s[2], w)
        }
        Op::SetRows { window } if by_rows => {
            let rows = g.layout(node.src[0]).ne[1];
            let mut dst = s[0];
            for w in row_windows(&req[0], d, window, rows) {
                dst = lg.set_rows_windowed(dst, s[1], s[2], w)?;
            }
            Ok(dst)
        }
        _ => rebuild(lg, node, s),
    }
}

/// Rebuild one op on a local graph from local sources (views and leaves are handled apart).
fn rebuild(lg: &mut Graph, node: &Node, s: &[TensorId]) -> Result<TensorId> {
    match node.op {
        Op::MulMat => lg.mul_mat(s[0], s[1]),
        Op::MulMatId { window: None } => lg.mul_mat_id(s[0], s[1], s[2]),
        Op::MulMatId { window: Some(w) } => lg.mul_mat_id_windowed(s[0], s[1], s[2], w),
        Op::Binary(b) => lg.binary(b, s[0], s[1]),
        Op::Scale { scale, bias } => lg.scale_bias(s[0], scale, bias),
        Op::Clamp { min, max } => lg.clamp(s[0], min, max),
        Op::Unary(u) => lg.unary(u, s[0]),
        Op::Swiglu if s.len() == 2 => lg.swiglu(s[0], s[1]),
        Op::Swiglu => lg.swiglu_fused(s[0]),
        Op::RmsNorm { eps } => lg.rms_norm(s[0], eps),
        Op::Norm { eps } => lg.norm(s[0], eps),
        Op::SoftMax { scale } => lg.soft_max(s[0], s.get(1).copied(), scale),
        Op::Rope(p) => lg.rope_ext(s[0], s[1], s.get(2).copied(), p),
        Op::SumRows => lg.sum_rows(s[0]),
        Op::SumSqrRows => lg.sum_sqr_rows(s[0]),
        Op::RmsNormSums { eps, width } => lg.rms_norm_sums(s[0], s[1], s[2], eps, width),
        Op::Mean => lg.mean(s[0]),
        Op::Argmax => lg.argmax(s[0]),
        Op::Argsort { descending } => lg.argsort(s[0], descending),
        Op::FlashAttn { scale } => lg.flash_attn(s[0], s[1], s[2], s.get(3).copied(), scale),
        Op::GetRows { window: None } => lg.get_rows(s[0], s[1]),
        Op::GetRows { window: Some(w) } => lg.get_rows_windowed(s[0], s[1], w),
        Op::SetRows { window: None } => lg.set_rows(s[0], s[1], s[2]),
        Op::SetRows { window: Some(w) } => lg.set_rows_windowed(s[0], s[1], s[2], w),
        Op::Cpy => lg.cpy(s[0], s[1]),
        Op::Cont => lg.cast(s[0], node.layout.dtype),
        Op::Concat { dim } => lg.concat(s[0], s[1], dim),
        Op::Leaf | Op::Reshape | Op::View { .. } | Op::Permute { .. } | Op::Collective(_) => {
            Err(internal(format!("rebuild of {}", node.op.name())))
        }
    }
}

/// Build every device's program for the planned graph `g`.
pub fn rewrite(g: &Graph, sharding: &Sharding, devices: &[Arc<dyn Device>]) -> Result<Rewritten> {
    rewrite_with(g, sharding, devices, true)
}

/// As [`rewrite`], the local graphs' nodes without names ([`Graph::unnamed`]): the same
/// programs, for a caller that only measures and costs them (the planner) and never runs or
/// shows them. Errors still name the user graph's nodes.
pub fn rewrite_unnamed(
    g: &Graph,
    sharding: &Sharding,
    devices: &[Arc<dyn Device>],
) -> Result<Rewritten> {
    rewrite_with(g, sharding, devices, false)
}

fn rewrite_with(
    g: &Graph,
    sharding: &Sharding,
    devices: &[Arc<dyn Device>],
    named: bool,
) -> Result<Rewritten> {
    let n = sharding.n;
    let mut rw = Rewriter {
        g,
        sharding,
        n,
        // A local graph has about as many nodes as the user graph, and some more for the
        // conversions.
        graphs: (0..n)
            .map(|_| match named {
                true => Graph::new(),
                false => Graph::unnamed(g.len() + g.len() / 2),
            })
            .collect(),
        uploads: vec![Vec::new(); n],
        made: vec![Vec::new(); g.len()],
        named,
        inplace_ok: inplace_candidates(g, sharding),
        layouts: vec![HashMap::new(); n],
    };
    let mut local = vec![Vec::with_capacity(g.len()); n];
    for id in g.ids() {
        let node = g.node(id);
        let state = sharding.states[id.index()].clone();
        let ids = if node.is_leaf() {
            rw.leaf(id, node, devices)?
        } else if node.op.is_view() {
            rw.view_node(id, node)?
        } else {
            rw.compute_node(id, node, &state)?
        };
        for (d, &lid) in ids.iter().enumerate() {
            if named {
                rw.graphs[d].set_name(lid, node.name.clone());
            }
            if node.flags.contains(Flags::OUTPUT) {
                rw.graphs[d].set_output(lid);
            }
            local[d].push(lid);
        }
        rw.insert(id, state, ids);
    }
    let mirrored_outputs = if n > 1 && devices.iter().any(|d| d.is_remote()) {
        rw.mirror_outputs(&mut local)?
    } else {
        Vec::new()
    };
    let programs = rw
        .graphs
        .into_iter()
        .zip(rw.uploads)
        .zip(rw.layouts)
        .map(|((graph, uploads), layouts)| {
            let stages = stages(&graph, &layouts)?;
            Ok(DeviceProgram {
                graph,
                stages,
                uploads,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Rewritten {
        programs,
        local,
        mirrored_outputs,
    })
}

/// Per user node: whether its all-reduce may run in place, i.e. all its consumers want the same
/// state and the user does not read it. Never a leaf's, nor a view's (whose bytes are its
/// root's): a leaf's bytes are the user's, and a partial weight placed in a meta buffer would
/// hold the sum on every device after the first step.
fn inplace_candidates(g: &Graph, sharding: &Sharding) -> Vec<bool> {
    let mut wants: Vec<Option<SplitState>> = vec![None; g.len()];
    let mut inplace_ok: Vec<bool> = g
        .nodes()
        .iter()
        .map(|n| !n.is_leaf() && n.view_src.is_none())
        .collect();
    for id in g.ids() {
        let node = g.node(id);
        let srcs: Vec<TensorId> = if node.op.is_view() {
            vec![g.root(id)]
        } else {
            node.src.to_vec()
        };
        for (s, want) in srcs.iter().zip(&sharding.required[id.index()]) {
            let slot = &mut wants[s.index()];
            match slot {
                None => *slot = Some(want.clone()),
                Some(w) if w != want => inplace_ok[s.index()] = false,
                _ => {}
            }
        }
        if node.flags.contains(Flags::OUTPUT) {
            inplace_ok[g.root(id).index()] = false;
            inplace_ok[id.index()] = false;
        }
    }
    inplace_ok
}

/// With several devices, a node that writes into a source (`cpy`, `set_rows`) must find its
/// destination in the meta device's buffer: a destination bound to a plain buffer shared by
/// all devices (a host buffer) would be written by each device at once.
fn check_unshared_destination(g: &Graph, node: &Node) -> Result<()> {
    let dst = g.root(node.src[if node.op == Op::Cpy { 1 } else { 0 }]);
    let dn = g.node(dst);
    let shared = dn
        .storage
        .as_ref()
        .is_some_and(|st| !st.buffer.as_any().is::<MetaBuffer>());
    if shared {
        return Err(Error::MetaPlacement {
            tensor: dn.name.clone(),
            reason: format!(
                "`{}` writes into it, but it is bound to a plain buffer shared by all devices \
                 (each would write it at once); place it in the meta device's buffer instead",
                node.name
            ),
        });
    }
    Ok(())
}

impl Rewriter<'_> {
    /// A view node: a local view of its root on every device, with the derived layouts.
    fn view_node(&mut self, id: TensorId, node: &Node) -> Result<Vec<TensorId>> {
        let root = self.g.root(id);
        let roots = self.get(root, &self.sharding.required[id.index()][0])?;
        let vs = self.sharding.views[id.index()]
            .as_ref()
            .ok_or_else(|| internal(format!("view `{}` without layouts", node.name)))?;
        let mut v = Vec::new();
        for (d, lg) in self.graphs.iter_mut().enumerate() {
            let lv = &vs.local[d];
            v.push(lg.view(roots[d], lv.ne, lv.nb, lv.offset)?);
        }
        Ok(v)
    }

    /// A computed node: its sources in the states it requires, then the op rebuilt on every
    /// device with the device's local shapes (checked against `state`).
    fn compute_node(
        &mut self,
        id: TensorId,
        node: &Node,
        state: &SplitState,
    ) -> Result<Vec<TensorId>> {
        if self.n > 1 && node.op.writes_into_source() {
            check_unshared_destination(self.g, node)?;
        }
        let req = &self.sharding.required[id.index()];
        let mut srcs: Vec<Vec<TensorId>> = Vec::new();
        for (&s, want) in node.src.iter().zip(req) {
            srcs.push(self.get(s, want)?);
        }
        let mut v = Vec::new();
        for (d, lg) in self.graphs.iter_mut().enumerate() {
            let s: Vec<TensorId> = srcs.iter().map(|x| x[d]).collect();
            let expect = state.local_ne(node.layout.ne, d);
            // A device whose slice of the output is empty computes nothing: it holds an
            // empty placeholder, so no builder or kernel sees the op on empty operands.
            let lid = if expect.contains(&0) {
                let id = lg.input(&node.name, node.layout.dtype, expect)?;
                lg.set_data(id, Vec::<u8>::new())?;
                id
            } else {
                rebuild_on(lg, self.g, node, &s, req, d)?
            };
            if lg.layout(lid).ne != expect {
                return Err(internal(format!(
                    "`{}` on device {d}: local shape {} but the state {state} gives {}",
                    node.name,
                    lg.layout(lid).shape(),
                    crate::Shape(expect)
                )));
            }
            v.push(lid);
        }
        Ok(v)
    }

    /// Outputs another process's device holds part of: converted to mirrored at the end of
    /// every program (and `local` pointed at the copies), so each process reads them from its
    /// own device. Returns the user roots so converted.
    fn mirror_outputs(&mut self, local: &mut [Vec<TensorId>]) -> Result<Vec<TensorId>> {
        let (g, sharding) = (self.g, self.sharding);
        let m = SplitState::mirrored(self.n);
        let mut mirrored_outputs = Vec::new();
        for id in g.ids() {
            let r = g.root(id);
            let placed_leaf = g.node(r).is_leaf() && g.node(r).storage.is_some();
            if !g.node(id).flags.contains(Flags::OUTPUT)
                || placed_leaf
                || mirrored_outputs.contains(&r)
                || sharding.states[r.index()] == m
            {
                continue;
            }
            let ids = self.get(r, &m)?;
            for (d, &lid) in ids.iter().enumerate() {
                self.graphs[d].set_output(lid);
                local[d][r.index()] = lid;
            }
            mirrored_outputs.push(r);
        }
        Ok(mirrored_outputs)
    }
}

/// Cut a local graph into compute ranges and collectives.
fn stages(lg: &Graph, layouts: &HashMap<TensorId, SliceLayout>) -> Result<Vec<Stage>> {
    let mut out = Vec::new();
    let mut start = 0;
    for id in lg.ids() {
        let node = lg.node(id);
        let Op::Collective(kind) = node.op else {
            continue;
        };
        if start < id.index() {
            out.push(Stage::Compute(start..id.index()));
        }
        let src = node.src[0];
        let layout =
            match kind {
                CollectiveKind::AllReduce => None,
                _ => Some(layouts.get(&id).cloned().ok_or_else(|| {
                    internal(format!("collective `{}` without a layout", node.name))
                })?),
            };
        out.push(Stage::Collective {
            kind,
            src,
            dst: id,
            layout,
            dtype: node.layout.dtype,
        });
        start = id.index() + 1;
    }
    if start < lg.len() {
        out.push(Stage::Compute(start..lg.len()));
    }
    Ok(out)
}
