//! Passes (a) to (d) of the scheduler: give every computed node of a graph a backend. Each pass
//! is one function; [`assign`] runs them in order. Leaves get no backend: a leaf is either bound
//! storage (read where it lies, or copied when the backend cannot use its buffer) or inline data
//! (uploaded to every split that reads it).

use super::Slot;
use super::buffer::SchedBuffer;
use crate::buffer::{BufferUsage, Storage};
use crate::graph::{Graph, TensorId};
use crate::{Error, Result};

/// Why a node got its backend (the pass that decided).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// (a) its own bytes, or a source's, live in that backend's buffers.
    Pinned,
    /// (b) a neighbour in graph order runs there.
    Expanded,
    /// (c) moved from a lower-priority backend computing in the same buffer type.
    Upgraded,
    /// (d) the highest-priority backend that supports the op.
    Supported,
}

impl Cause {
    pub fn name(self) -> &'static str {
        match self {
            Cause::Pinned => "pinned",
            Cause::Expanded => "expanded",
            Cause::Upgraded => "upgraded",
            Cause::Supported => "supported",
        }
    }
}

/// Each node's backend (an index in priority order) and the pass that chose it; `None` for
/// leaves.
#[derive(Clone, Debug)]
pub struct Assignment {
    pub backend: Vec<Option<usize>>,
    pub cause: Vec<Option<Cause>>,
}

/// Where a bound root's bytes are.
#[derive(Clone)]
pub(crate) enum Home {
    /// Placed on a backend through the scheduler's buffer type: the real storage there.
    Placed { backend: usize, storage: Storage },
    /// A buffer of some backend's type, owned by none in particular.
    Plain(Storage),
}

impl Home {
    pub(crate) fn storage(&self) -> &Storage {
        match self {
            Home::Placed { storage, .. } | Home::Plain(storage) => storage,
        }
    }
}

/// What the passes read: the graph, the backends, and which backend supports which node.
pub(crate) struct Ctx<'a> {
    pub g: &'a Graph,
    pub slots: &'a [Slot],
    pub sched_id: u64,
    /// Per node and backend: `None` if supported, else the backend's reason (leaves: empty).
    unsupported: Vec<Vec<Option<String>>>,
}

impl<'a> Ctx<'a> {
    pub(crate) fn new(g: &'a Graph, slots: &'a [Slot], sched_id: u64) -> Self {
        let unsupported = g
            .ids()
            .map(|id| {
                if g.node(id).is_leaf() {
                    return Vec::new();
                }
                slots
                    .iter()
                    .map(|s| s.device.supports_op(g, id).err())
                    .collect()
            })
            .collect();
        Ctx {
            g,
            slots,
            sched_id,
            unsupported,
        }
    }

    pub(crate) fn supports(&self, id: TensorId, b: usize) -> bool {
        self.unsupported[id.index()]
            .get(b)
            .is_some_and(|r| r.is_none())
    }

    /// Where root `r`'s bytes are, if it has bound storage; a buffer of another scheduler is an
    /// error naming the tensor.
    pub(crate) fn home(&self, r: TensorId) -> Result<Option<Home>> {
        let n = self.g.node(r);
        let Some(st) = &n.storage else {
            return Ok(None);
        };
        let Some(sb) = st.buffer.as_any().downcast_ref::<SchedBuffer>() else {
            return Ok(Some(Home::Plain(st.clone())));
        };
        let bad = |reason: &str| Error::NoStorage {
            tensor: n.name.clone(),
            reason: reason.to_string(),
        };
        if sb.sched_id() != self.sched_id {
            return Err(bad(
                "bound in the buffer of another scheduler (a scheduler does not run inside \
                 another: compute on that scheduler, or give this one its backends)",
            ));
        }
        let (p, inside) = sb
            .resolve(st.offset)
            .ok_or_else(|| bad("bound where no tensor was placed in a scheduler buffer"))?;
        Ok(Some(Home::Placed {
            backend: p.backend,
            storage: Storage::new(p.storage.buffer, p.storage.offset + inside),
        }))
    }

    /// Whether backend `b`'s kernels can use the bytes at `home` directly.
    pub(crate) fn usable(&self, home: &Home, b: usize) -> bool {
        match home {
            Home::Placed { backend, .. } if *backend == b => true,
            h => self.slots[b]
                .device
                .supports_buffer_type(h.storage().buffer.buffer_type().as_ref()),
        }
    }

    /// The backend that owns `home` for node `id`: its placement when that backend supports
    /// the node, else (a plain buffer) the first backend that can use it and supports the node.
    fn owner(&self, home: &Home, id: TensorId) -> Option<usize> {
        match home {
            Home::Placed { backend, .. } => self.supports(id, *backend).then_some(*backend),
            Home::Plain(_) => {
                (0..self.slots.len()).find(|&b| self.usable(home, b) && self.supports(id, b))
            }
        }
    }
}

/// Run passes (a) to (d).
pub(crate) fn assign(ctx: &Ctx) -> Result<Assignment> {
    let n = ctx.g.len();
    let mut a = Assignment {
        backend: vec![None; n],
        cause: vec![None; n],
    };
    pin_to_buffers(ctx, &mut a)?;
    expand_to_neighbours(ctx, &mut a);
    upgrade_to_priority(ctx, &mut a)?;
    assign_by_support(ctx, &mut a)?;
    Ok(a)
}

fn set(a: &mut Assignment, id: TensorId, b: usize, cause: Cause) {
    a.backend[id.index()] = Some(b);
    a.cause[id.index()] = Some(cause);
}

/// Pass (a): a node whose own bytes are bound (a write into a cache, a view of a weight) runs on
/// the backend owning them; else a node reading bound storage runs where that storage lives,
/// weights first (ggml: "operations with weights are preferably run on the same backend as the
/// weights").
fn pin_to_buffers(ctx: &Ctx, a: &mut Assignment) -> Result<()> {
    let g = ctx.g;
    for id in g.ids() {
        let node = g.node(id);
        if node.is_leaf() {
            continue;
        }
        if let Some(home) = ctx.home(g.root(id))? {
            if let Some(b) = ctx.owner(&home, id) {
                set(a, id, b, Cause::Pinned);
            }
            continue;
        }
        let mut homes = Vec::new();
        for &s in &node.src {
            if let Some(h) = ctx.home(g.root(s))? {
                let weight = h.storage().buffer.usage() == BufferUsage::Weights;
                homes.push((!weight, h));
            }
        }
        // Weights first, then other bound sources, each in source order.
        homes.sort_by_key(|(not_weight, _)| *not_weight);
        if let Some(b) = homes.iter().find_map(|(_, h)| ctx.owner(h, id)) {
            set(a, id, b, Cause::Pinned);
        }
    }
    Ok(())
}

/// Pass (b): spread assignments along graph order, as ggml does: first the backends other
/// than the lowest-priority one (the usual CPU fallback) down then up, so they claim the
/// unassigned nodes around them; then every backend down then up. A node only takes a
/// neighbour's backend that supports it.
fn expand_to_neighbours(ctx: &Ctx, a: &mut Assignment) {
    let g = ctx.g;
    let last = ctx.slots.len() - 1;
    let order: Vec<TensorId> = g.ids().filter(|&id| !g.node(id).is_leaf()).collect();
    for skip_last in [true, false] {
        for reverse in [false, true] {
            let mut cur: Option<usize> = None;
            let mut step = |id: TensorId, a: &mut Assignment| match a.backend[id.index()] {
                Some(b) => cur = (!(skip_last && b == last)).then_some(b),
                None => {
                    if let Some(c) = cur
                        && ctx.supports(id, c)
                    {
                        set(a, id, c, Cause::Expanded);
                    }
                }
            };
            if reverse {
                order.iter().rev().for_each(|&id| step(id, a));
            } else {
                order.iter().for_each(|&id| step(id, a));
            }
        }
    }
}

/// Pass (c): move a node to the highest-priority backend that computes in the very same buffer
/// type as its current one (ggml compares buffer type pointers; so does this scheduler, with
/// the buffer types it was given), supports the op, and can use every bound source of the
/// node and its own bound bytes. Backends that were given distinct buffer types never trade
/// nodes here.
fn upgrade_to_priority(ctx: &Ctx, a: &mut Assignment) -> Result<()> {
    let g = ctx.g;
    for id in g.ids() {
        let Some(cur) = a.backend[id.index()] else {
            continue;
        };
        let node = g.node(id);
        let mut homes = Vec::new();
        for r in std::iter::once(g.root(id)).chain(node.src.iter().map(|&s| g.root(s))) {
            if let Some(h) = ctx.home(r)? {
                homes.push(h);
            }
        }
        let better = (0..cur).find(|&b| {
            std::sync::Arc::ptr_eq(&ctx.slots[b].bt, &ctx.slots[cur].bt)
                && ctx.supports(id, b)
                && homes.iter().all(|h| ctx.usable(h, b))
        });
        if let Some(b) = better {
            set(a, id, b, Cause::Upgraded);
        }
    }
    Ok(())
}

/// Pass (d): every node still without a backend runs on the highest-priority backend that
/// supports it; a node no backend supports is an error listing each backend's reason.
fn assign_by_support(ctx: &Ctx, a: &mut Assignment) -> Result<()> {
    let g = ctx.g;
    for id in g.ids() {
        if g.node(id).is_leaf() || a.backend[id.index()].is_some() {
            continue;
        }
        match (0..ctx.slots.len()).find(|&b| ctx.supports(id, b)) {
            Some(b) => set(a, id, b, Cause::Supported),
            None => {
                let reasons = ctx.unsupported[id.index()]
                    .iter()
                    .zip(ctx.slots)
                    .map(|(r, s)| format!("{}: {}", s.name, r.as_deref().unwrap_or("?")))
                    .collect::<Vec<_>>()
                    .join("; ");
                let n = g.node(id);
                return Err(Error::NoBackendFor {
                    node: n.name.clone(),
                    op: n.op.name(),
                    reasons,
                });
            }
        }
    }
    Ok(())
}
