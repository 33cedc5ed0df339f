//! The graph allocator: a measure pass that places every unallocated root of a graph at an
//! offset in one compute buffer, reusing memory once a tensor's last consumer has run and
//! letting whitelisted element-wise ops write over their dying input (in place); then an
//! allocation pass that makes (or reuses) the buffer and binds the storage.
//!
//! Placement is best fit over a sorted free list with coalescing (the approach of ggml's
//! `ggml_dyn_tallocr`, ggml-org/ggml `src/ggml-alloc.c`). Nodes are visited in graph order,
//! which is topological, so lifetimes are intervals of node indices.

use crate::buffer::{Buffer, BufferType, Storage};
use crate::graph::{Flags, Graph, TensorId};
use crate::{Error, Result};
use std::sync::Arc;

/// Where each root goes, and the peak bytes.
#[derive(Clone, Debug, Default)]
pub struct AllocPlan {
    /// Offset per node for roots this plan allocates; `None` for views and bound roots.
    pub offsets: Vec<Option<usize>>,
    /// Bytes the compute buffer needs.
    pub peak: usize,
    /// Nodes that reuse their first source's memory.
    pub inplace: Vec<TensorId>,
}

/// Which roots of `g` need memory from the allocator: roots with no storage that are computed,
/// or leaves carrying inline data. A leaf with neither storage nor data is an error.
fn needs_alloc(g: &Graph, id: TensorId) -> Result<bool> {
    let n = g.node(id);
    if n.view_src.is_some() || n.storage.is_some() {
        return Ok(false);
    }
    if n.is_leaf() && n.data.is_none() {
        return Err(Error::NoStorage {
            tensor: n.name.clone(),
            reason: "a leaf needs bound storage (Graph::bind) or inline data (Graph::set_data)"
                .into(),
        });
    }
    Ok(true)
}

/// Pass 1: for each root, the index of the last node that reads it (directly or via a view).
/// Outputs live to the end.
fn last_uses(g: &Graph) -> Vec<usize> {
    let n = g.len();
    let mut last: Vec<usize> = (0..n).collect();
    for (i, node) in g.nodes().iter().enumerate() {
        for &s in &node.src {
            let r = g.root(s).index();
            last[r] = last[r].max(i);
        }
        if let Some(r) = node.view_src {
            last[r.index()] = last[r.index()].max(i);
        }
        if node.flags.contains(Flags::OUTPUT) {
            last[g.root(TensorId(i as u32)).index()] = usize::MAX;
        }
    }
    last
}

/// Free blocks sorted by offset.
struct FreeList {
    blocks: Vec<(usize, usize)>,
    top: usize,
    peak: usize,
}

impl FreeList {
    fn alloc(&mut self, size: usize, align: usize) -> usize {
        let size = size.max(1).next_multiple_of(align);
        // Best fit among free blocks.
        let best = self
            .blocks
            .iter()
            .enumerate()
            .filter(|(_, b)| b.1 >= size)
            .min_by_key(|(_, b)| b.1)
            .map(|(i, _)| i);
        if let Some(i) = best {
            let (off, len) = self.blocks[i];
            if len == size {
                self.blocks.remove(i);
            } else {
                self.blocks[i] = (off + size, len - size);
            }
            return off;
        }
        // Grow at the top, absorbing a free block that ends there.
        let mut off = self.top;
        if let Some(&(o, l)) = self.blocks.last()
            && o + l == self.top
        {
            self.blocks.pop();
            off = o;
        }
        self.top = off + size;
        self.peak = self.peak.max(self.top);
        off
    }

    fn free(&mut self, off: usize, size: usize, align: usize) {
        let size = size.max(1).next_multiple_of(align);
        let i = self.blocks.partition_point(|b| b.0 < off);
        self.blocks.insert(i, (off, size));
        // Coalesce with the next and the previous block.
        if i + 1 < self.blocks.len() && self.blocks[i].0 + self.blocks[i].1 == self.blocks[i + 1].0
        {
            self.blocks[i].1 += self.blocks[i + 1].1;
            self.blocks.remove(i + 1);
        }
        if i > 0 && self.blocks[i - 1].0 + self.blocks[i - 1].1 == self.blocks[i].0 {
            self.blocks[i - 1].1 += self.blocks[i].1;
            self.blocks.remove(i);
        }
    }
}

/// Pass 2 (measure): place every root that needs memory, freeing each after its last use.
pub fn measure(g: &Graph, bt: &dyn BufferType) -> Result<AllocPlan> {
    let align = bt.alignment().max(1);
    let last = last_uses(g);
    let mut plan = AllocPlan {
        offsets: vec![None; g.len()],
        ..Default::default()
    };
    let mut sizes = vec![0usize; g.len()];
    let mut fl = FreeList {
        blocks: Vec::new(),
        top: 0,
        peak: 0,
    };
    // Roots to free after node i.
    let mut dying: Vec<Vec<usize>> = vec![Vec::new(); g.len()];
    // Leaves with inline data are all written before the first node runs, so they are placed
    // first (alive from the start); computed roots follow in graph order.
    let (leaves, computed): (Vec<TensorId>, Vec<TensorId>) =
        g.ids().partition(|&id| g.node(id).is_leaf());
    for id in leaves.into_iter().chain(computed) {
        let i = id.index();
        if needs_alloc(g, id)? {
            let node = g.node(id);
            let size = bt.alloc_size(&node.layout);
            sizes[i] = size;
            // In place: the first source is an allocator-owned root, dies here, same layout.
            let inplace_src = node.op.can_inplace().then(|| node.src[0]).filter(|&s| {
                let sn = g.node(s);
                sn.view_src.is_none()
                    && plan.offsets[s.index()].is_some()
                    && last[s.index()] == i
                    && !sn.flags.contains(Flags::OUTPUT)
                    && !sn.is_leaf()
                    && sn.layout == node.layout
                    && node.src[1..].iter().all(|&o| g.root(o) != s || o == s)
            });
            if let Some(s) = inplace_src {
                plan.offsets[i] = plan.offsets[s.index()];
                // The source's block now belongs to this node. Its last use is `i`, so it is only
                // on this node's death list.
                dying[i].retain(|&r| r != s.index());
                plan.inplace.push(id);
            } else {
                plan.offsets[i] = Some(fl.alloc(size, align));
            }
            if last[i] != usize::MAX {
                dying[last[i]].push(i);
            }
        }
        // Free the roots whose last use is this node, also when the node itself needs no
        // memory (a view, a cpy/set_rows into another tensor, a bound root).
        for r in std::mem::take(&mut dying[i]) {
            if let Some(off) = plan.offsets[r] {
                fl.free(off, sizes[r], align);
            }
        }
    }
    plan.peak = fl.peak;
    Ok(plan)
}

/// A graph allocator owning one compute buffer of one buffer type, reused across graphs and
/// grown when a graph needs more.
pub struct GraphAllocator {
    bt: Arc<dyn BufferType>,
    buffer: Option<Arc<dyn Buffer>>,
}

impl GraphAllocator {
    pub fn new(bt: Arc<dyn BufferType>) -> Self {
        GraphAllocator { bt, buffer: None }
    }

    /// Bytes of the current compute buffer.
    pub fn buffer_size(&self) -> usize {
        self.buffer.as_ref().map_or(0, |b| b.size())
    }

    /// The current compute buffer, if a graph was allocated.
    pub fn buffer(&self) -> Option<&Arc<dyn Buffer>> {
        self.buffer.as_ref()
    }

    /// Make the buffer at least `size` bytes.
    pub fn reserve(&mut self, size: usize) -> Result<()> {
        if self.buffer_size() < size {
            // Drop the old buffer before allocating the larger one.
            self.buffer = None;
            let b = self.bt.alloc_buffer(size)?;
            b.set_usage(crate::buffer::BufferUsage::Compute);
            self.buffer = Some(b);
        }
        Ok(())
    }

    /// Measure, grow the buffer if needed, and bind storage to every root that needs memory.
    pub fn alloc_graph(&mut self, g: &mut Graph) -> Result<AllocPlan> {
        let plan = measure(g, self.bt.as_ref())?;
        self.reserve(plan.peak.max(1))?;
        let buf = self.buffer.clone().expect("reserved above");
        for id in g.ids() {
            if let Some(off) = plan.offsets[id.index()] {
                g.node_mut(id).storage = Some(Storage::new(buf.clone(), off));
            }
        }
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::HostBufferType;

    fn overlaps(p: &AllocPlan, g: &Graph, a: TensorId, b: TensorId) -> bool {
        let (oa, ob) = (p.offsets[a.index()].unwrap(), p.offsets[b.index()].unwrap());
        let (la, lb) = (g.layout(a).nbytes(), g.layout(b).nbytes());
        oa < ob + lb && ob < oa + la
    }

    #[test]
    fn inputs_never_share_memory_and_dead_tensors_are_reused() {
        let mut g = Graph::new();
        let x = g.input_f32("x", [16, 2, 1, 1], &[1.0; 32]).unwrap();
        let w = g.input_f32("w", [16, 4, 1, 1], &[1.0; 64]).unwrap();
        let y = g.mul_mat(w, x).unwrap();
        let b = g.input_f32("b", [4, 1, 1, 1], &[1.0; 4]).unwrap();
        let z = g.add(y, b).unwrap();
        let r = g.relu(z).unwrap();
        let t = g.scale(r, 2.0).unwrap();
        let s = g.sum_rows(t).unwrap();
        g.set_output(s);
        let p = measure(&g, &HostBufferType).unwrap();
        // Inputs are uploaded together before compute: pairwise disjoint.
        assert!(!overlaps(&p, &g, x, b) && !overlaps(&p, &g, x, w) && !overlaps(&p, &g, w, b));
        // add, relu and scale run in place over mul_mat's output.
        assert_eq!(p.inplace, vec![z, r, t]);
        assert_eq!(p.offsets[t.index()], p.offsets[y.index()]);
        // sum_rows may reuse an input's memory but never its own source's.
        assert!(!overlaps(&p, &g, s, t));
        // Peak is below the sum of all tensors (reuse happened).
        let total: usize = g
            .ids()
            .map(|i| g.layout(i).nbytes().next_multiple_of(64))
            .sum();
        assert!(p.peak < total, "peak {} total {}", p.peak, total);
    }

    #[test]
    fn a_root_whose_last_use_writes_elsewhere_is_freed() {
        // k's last use is a cpy into a bound cache (a view node, allocated nothing): its block
        // must be free for y, as for a K projection written into a KV cache.
        let mut g = Graph::new();
        let x = g.input_f32("x", [256, 1, 1, 1], &[1.0; 256]).unwrap();
        let cache = g
            .new_tensor("cache", crate::DType::F32, [256, 1, 1, 1])
            .unwrap();
        let buf = HostBufferType.alloc_buffer(1024).unwrap();
        g.bind(cache, Storage::new(buf, 0)).unwrap();
        let k = g.scale(x, 2.0).unwrap();
        let w = g.cpy(k, cache).unwrap();
        let y = g.scale(x, 3.0).unwrap();
        g.set_output(w);
        g.set_output(y);
        let p = measure(&g, &HostBufferType).unwrap();
        assert_eq!(p.offsets[y.index()], p.offsets[k.index()]);
        assert_eq!(p.peak, 2048);
    }

    #[test]
    fn a_leaf_without_storage_or_data_is_an_error() {
        let mut g = Graph::new();
        let w = g
            .weight("blk.0.w", crate::DType::F32, [4, 4, 1, 1])
            .unwrap();
        let _ = g.relu(w).unwrap();
        let e = measure(&g, &HostBufferType).unwrap_err().to_string();
        assert!(e.contains("blk.0.w"), "{e}");
    }
}
