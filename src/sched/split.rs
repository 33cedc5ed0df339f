//! Pass (e) of the scheduler: cut the assigned graph into splits (maximal runs of consecutive
//! computed nodes on one backend, also ended after every node the eval callback asked for) and
//! build each split's own graph, which its backend computes with `Backend::graph_compute`:
//!
//! - the split's nodes, cloned with their sources remapped;
//! - views, re-created over whatever their root became in this split (views compute nothing,
//!   so they belong to no split: each split that reads one makes its own);
//! - leaves with inline data (user inputs), with the same bytes;
//! - leaves with bound storage the backend can use, bound to the same bytes (a tensor placed
//!   through the scheduler's buffer type is bound to its real allocation);
//! - input copies: a root computed by an earlier split, or a leaf in a buffer the backend
//!   cannot use, becomes a leaf of this split filled with the source's bytes before it runs.
//!
//! A node that writes into bound bytes (`set_rows` into a cache) and is read by a later split is
//! read there as a view of those bytes: splits run in order, so it has been written.

use super::passes::{Assignment, Ctx};
use crate::graph::{Flags, Graph, Node, TensorId};
use crate::op::Op;
use crate::tensor::Layout;
use crate::{Error, Result};
use smallvec::SmallVec;
use std::fmt::Write as _;

/// Where an input copy's bytes come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyFrom {
    /// A root computed by an earlier split (by index).
    Split(usize),
    /// A leaf whose buffer the split's backend cannot use (read from it before every run).
    Leaf,
}

/// One input copy of a split.
#[derive(Clone, Debug)]
pub struct CopyIn {
    /// The copied tensor in the user's graph (a root).
    pub src: TensorId,
    /// Its leaf in the split's graph.
    pub(crate) local: TensorId,
    pub from: CopyFrom,
    pub bytes: usize,
}

/// A run of nodes on one backend.
#[derive(Clone, Debug)]
pub struct Split {
    pub backend: usize,
    /// The computed nodes (user ids), in order.
    pub nodes: Vec<TensorId>,
    /// Their ids in the split's graph.
    pub(crate) node_locals: Vec<TensorId>,
    /// User leaves with inline data this split uploads: (user id, local id).
    pub inputs: Vec<(TensorId, TensorId)>,
    pub copies: Vec<CopyIn>,
    /// The split's own graph (inline data of inputs and copies is filled in before each run).
    pub(crate) graph: Graph,
    /// Roots later splits copy: (user id, local id), read out after the split runs.
    pub(crate) captures: Vec<(TensorId, TensorId)>,
    /// The user's output roots computed here: (user id, local id).
    pub(crate) outputs: Vec<(TensorId, TensorId)>,
    /// The nodes the eval callback asked for, in order: (user id, local id). Only the last node
    /// unless the backend computes a split as one program (a meta device).
    pub(crate) asked: Vec<(TensorId, TensorId)>,
}

/// The splits of a graph.
#[derive(Clone, Debug)]
pub struct Splits {
    pub splits: Vec<Split>,
}

impl Splits {
    pub fn n_copies(&self) -> usize {
        self.splits.iter().map(|s| s.copies.len()).sum()
    }

    pub fn copied_bytes(&self) -> usize {
        self.splits
            .iter()
            .flat_map(|s| &s.copies)
            .map(|c| c.bytes)
            .sum()
    }
}

/// Builds one split's graph.
struct Builder<'c, 'g> {
    ctx: &'c Ctx<'g>,
    /// Split index computing each user root (computed nodes only).
    computed_in: &'c [Option<usize>],
    backend: usize,
    lg: Graph,
    /// Local id of each user node already in this split's graph.
    local: Vec<Option<TensorId>>,
    inputs: Vec<(TensorId, TensorId)>,
    copies: Vec<CopyIn>,
}

impl Builder<'_, '_> {
    fn push(&mut self, u: TensorId, node: Node) -> TensorId {
        let l = self.lg.push(node);
        self.local[u.index()] = Some(l);
        l
    }

    /// A leaf of this split holding a copy of user root `u`.
    fn copy_leaf(&mut self, u: TensorId, from: CopyFrom) -> TensorId {
        let n = self.ctx.g.node(u);
        let layout = Layout::contiguous(n.layout.dtype, n.layout.ne);
        let bytes = layout.nbytes();
        let l = self.push(
            u,
            Node {
                layout,
                op: Op::Leaf,
                src: SmallVec::new(),
                view_src: None,
                view_offs: 0,
                name: n.name.clone(),
                flags: Flags::INPUT,
                storage: None,
                // Replaced by the copied bytes before every run; shared zeros keep the template
                // a valid graph (a leaf needs storage or data) at no cost.
                data: Some(crate::graph::zero_bytes(bytes)),
            },
        );
        self.copies.push(CopyIn {
            src: u,
            local: l,
            from,
            bytes,
        });
        l
    }

    /// User node `u` as this split sees it (see the module doc).
    fn import(&mut self, u: TensorId) -> Result<TensorId> {
        if let Some(l) = self.local[u.index()] {
            return Ok(l);
        }
        let g = self.ctx.g;
        let n = g.node(u);
        if n.op.is_view() {
            let p = self.import(n.src[0])?;
            let root = self.lg.root(p);
            let mut node = n.clone();
            node.src = SmallVec::from_slice(&[p]);
            node.view_src = Some(root);
            node.flags = Flags::default();
            return Ok(self.push(u, node));
        }
        if n.is_leaf() {
            return self.leaf(u);
        }
        let r = g.root(u);
        if r != u {
            // Written in place by an earlier split: read it where it was written.
            return match self.ctx.home(r)? {
                Some(_) => {
                    let lr = self.import(r)?;
                    let node = Node {
                        layout: n.layout,
                        op: Op::View {
                            offset: n.view_offs,
                        },
                        src: SmallVec::from_slice(&[lr]),
                        view_src: Some(lr),
                        view_offs: n.view_offs,
                        name: n.name.clone(),
                        flags: Flags::default(),
                        storage: None,
                        data: None,
                    };
                    Ok(self.push(u, node))
                }
                None => Err(Error::SchedPlacement {
                    node: n.name.clone(),
                    backend: self.ctx.slots[self.backend].name.clone(),
                    reason: format!(
                        "it writes into `{}`, a computed tensor, and is read by a later split; \
                         only writes into bound storage (caches) cross splits",
                        g.name(r)
                    ),
                }),
            };
        }
        let j = self.computed_in[u.index()].ok_or_else(|| Error::Internal {
            component: "sched",
            reason: format!("node `{}` read before any split computed it", n.name),
        })?;
        Ok(self.copy_leaf(u, CopyFrom::Split(j)))
    }

    /// A user leaf: inline data is uploaded; bound storage is used where it lies when the
    /// backend can, else copied.
    fn leaf(&mut self, u: TensorId) -> Result<TensorId> {
        let n = self.ctx.g.node(u);
        match self.ctx.home(u)? {
            None => {
                if n.data.is_none() {
                    return Err(Error::NoStorage {
                        tensor: n.name.clone(),
                        reason: "a leaf needs bound storage (Graph::bind) or inline data".into(),
                    });
                }
                let l = self.push(u, n.clone());
                self.inputs.push((u, l));
                Ok(l)
            }
            Some(home) if self.ctx.usable(&home, self.backend) => {
                let mut node = n.clone();
                node.storage = Some(home.storage().clone());
                Ok(self.push(u, node))
            }
            Some(_) => Ok(self.copy_leaf(u, CopyFrom::Leaf)),
        }
    }

    /// Add computed node `u` of the split.
    fn node(&mut self, u: TensorId) -> Result<()> {
        let g = self.ctx.g;
        let n = g.node(u);
        let src = n
            .src
            .iter()
            .map(|&s| self.import(s))
            .collect::<Result<SmallVec<[TensorId; 4]>>>()?;
        let mut node = n.clone();
        if let Some(vr) = n.view_src {
            // It writes into a source: its root here is that source's root here.
            let i = n.src.iter().position(|&s| g.root(s) == vr);
            let lr = match i {
                Some(i) => self.lg.root(src[i]),
                None => self.import(vr)?,
            };
            if let Some(home) = self.ctx.home(vr)?
                && !self.ctx.usable(&home, self.backend)
            {
                return Err(Error::SchedPlacement {
                    node: n.name.clone(),
                    backend: self.ctx.slots[self.backend].name.clone(),
                    reason: format!(
                        "it writes into `{}`, whose buffer ({}) this backend cannot use",
                        g.name(vr),
                        home.storage().buffer.buffer_type().name()
                    ),
                });
            }
            node.view_src = Some(lr);
        }
        node.src = src;
        self.push(u, node);
        Ok(())
    }
}

/// Pass (e): cut `a` into splits, ending one also after each node in `asked` on a backend that
/// is cut there (`cut_at_asked`; a meta device's split is one sharded program, and cutting it
/// would change its sharding, so its asked nodes are read after the split), and build each
/// split's graph with its inputs and copies.
pub(crate) fn build_splits(
    ctx: &Ctx,
    a: &Assignment,
    asked: &[bool],
    cut_at_asked: &[bool],
) -> Result<Splits> {
    let is_asked = |id: TensorId| asked.get(id.index()).copied().unwrap_or(false);
    let g = ctx.g;
    // Computed nodes (not leaves, not views) in order, cut where the backend changes.
    let mut runs: Vec<(usize, Vec<TensorId>)> = Vec::new();
    let mut cut = true;
    for id in g.ids() {
        let n = g.node(id);
        if n.is_leaf() || n.op.is_view() {
            continue;
        }
        let b = a.backend[id.index()].ok_or_else(|| Error::Internal {
            component: "sched",
            reason: format!("node `{}` has no backend after the passes", n.name),
        })?;
        match runs.last_mut() {
            Some((rb, nodes)) if *rb == b && !cut => nodes.push(id),
            _ => runs.push((b, vec![id])),
        }
        cut = is_asked(id) && cut_at_asked[b];
    }
    let mut computed_in = vec![None; g.len()];
    for (i, (_, nodes)) in runs.iter().enumerate() {
        for &id in nodes {
            computed_in[id.index()] = Some(i);
        }
    }
    // Roots the user reads after the compute.
    let mut out_root = vec![false; g.len()];
    for id in g.ids() {
        if g.node(id).flags.contains(Flags::OUTPUT) {
            let r = g.root(id);
            let rn = g.node(r);
            if !rn.is_leaf() && rn.storage.is_none() {
                out_root[r.index()] = true;
            }
        }
    }
    let mut splits = Vec::with_capacity(runs.len());
    for (backend, nodes) in runs {
        let mut b = Builder {
            ctx,
            computed_in: &computed_in,
            backend,
            lg: Graph::new(),
            local: vec![None; g.len()],
            inputs: Vec::new(),
            copies: Vec::new(),
        };
        for &u in &nodes {
            b.node(u)?;
        }
        let mut outputs = Vec::new();
        for &u in &nodes {
            if out_root[u.index()] {
                let l = b.local[u.index()].expect("added above");
                b.lg.set_output(l);
                outputs.push((u, l));
            }
        }
        let mut asked_here = Vec::new();
        for &u in nodes.iter().filter(|&&u| is_asked(u)) {
            let l = b.local[u.index()].expect("added above");
            b.lg.set_output(l);
            asked_here.push((u, l));
        }
        let node_locals = nodes
            .iter()
            .map(|&u| b.local[u.index()].expect("added above"))
            .collect();
        splits.push(Split {
            backend,
            nodes,
            node_locals,
            inputs: b.inputs,
            copies: b.copies,
            graph: b.lg,
            captures: Vec::new(),
            outputs,
            asked: asked_here,
        });
    }
    // What later splits copy is read out of the split computing it (kept alive as an output).
    let mut wanted: Vec<(usize, TensorId)> = splits
        .iter()
        .flat_map(|s| &s.copies)
        .filter_map(|c| match c.from {
            CopyFrom::Split(j) => Some((j, c.src)),
            CopyFrom::Leaf => None,
        })
        .collect();
    wanted.sort();
    wanted.dedup();
    for (j, u) in wanted {
        let s = &mut splits[j];
        let l = s
            .nodes
            .iter()
            .position(|&x| x == u)
            .map(|i| s.node_locals[i])
            .ok_or_else(|| Error::Internal {
                component: "sched",
                reason: format!("copied node `{}` not found in split {j}", g.name(u)),
            })?;
        s.graph.set_output(l);
        s.captures.push((u, l));
    }
    Ok(Splits { splits })
}

/// The assignment and the splits in words: one line per computed node or view (its backend
/// and the pass that chose it), then one line per split with its inputs and copies.
pub(crate) fn describe(g: &Graph, names: &[String], a: &Assignment, s: &Splits) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "backends (priority order): {}", names.join(", "));
    for id in g.ids() {
        let n = g.node(id);
        let (Some(b), Some(c)) = (a.backend[id.index()], a.cause[id.index()]) else {
            continue;
        };
        let _ = writeln!(
            out,
            "  #{:<3} {:<22} {:<10} -> {} ({})",
            id.index(),
            format!("`{}`", n.name),
            n.op.name(),
            names[b],
            c.name()
        );
    }
    for (i, sp) in s.splits.iter().enumerate() {
        let first = g.name(sp.nodes[0]);
        let last = g.name(*sp.nodes.last().expect("a split has nodes"));
        let _ = write!(
            out,
            "split {i} on {}: {} nodes `{first}` .. `{last}`",
            names[sp.backend],
            sp.nodes.len()
        );
        if !sp.inputs.is_empty() {
            let ins: Vec<&str> = sp.inputs.iter().map(|&(u, _)| g.name(u)).collect();
            let _ = write!(out, "; inputs {}", ins.join(", "));
        }
        for c in &sp.copies {
            let from = match c.from {
                CopyFrom::Split(j) => format!("split {j} ({})", names[s.splits[j].backend]),
                CopyFrom::Leaf => "its buffer".to_string(),
            };
            let _ = write!(
                out,
                "; copy `{}` {} ({} bytes) from {from}",
                g.name(c.src),
                g.layout(c.src).shape(),
                c.bytes
            );
        }
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "{} splits, {} copies, {} bytes copied",
        s.splits.len(),
        s.n_copies(),
        s.copied_bytes()
    );
    out
}
