//! `run --dump NODE_PATTERN`: the scheduler's eval callback printing, for each computed node
//! whose name matches, its min, max, mean and NaN count (and an I32 node's values, row by
//! row: a mixture of experts' chosen expert ids per token), one line per node to stderr. A
//! view computes nothing and is never evaluated itself: a matching view (the router's choice
//! `l{i}.moe.chosen_by_router`, the first `n_expert_used` ids of each token's argsort) is
//! shown from the values of the node it views, when that node is evaluated ([`Views`]).

use super::run::name_matches;
use metashard::{DType, Graph, TensorId};
use std::collections::HashMap;

/// The views of computed nodes whose names match a pattern, by the node they view: rebuilt
/// for each graph (the scheduler asks about a graph's nodes in rising order).
#[derive(Default)]
pub struct Views {
    of: HashMap<TensorId, Vec<TensorId>>,
    last_asked: Option<TensorId>,
}

impl Views {
    /// Called from `EvalCallback::ask` for every computed node `id` of `g`: whether a view
    /// matching `pattern` reads it.
    pub fn ask(&mut self, pattern: &str, g: &Graph, id: TensorId) -> bool {
        if self.last_asked.is_none_or(|l| id <= l) {
            self.of.clear();
            for v in g.ids() {
                let n = g.node(v);
                if let Some(root) = n.view_src
                    && n.op.is_view()
                    && name_matches(pattern, &n.name)
                {
                    self.of.entry(root).or_default().push(v);
                }
            }
        }
        self.last_asked = Some(id);
        self.of.contains_key(&id)
    }

    /// The matching views of `root` with their values, from `root`'s.
    pub fn values(
        &self,
        g: &Graph,
        root: TensorId,
        root_values: &[f32],
    ) -> Vec<(TensorId, Vec<f32>)> {
        let views = self.of.get(&root).map_or(&[][..], Vec::as_slice);
        views
            .iter()
            .filter_map(|&v| Some((v, view_values(g, v, root, root_values)?)))
            .collect()
    }
}

/// The elements of view `v` in logical order, read from the values of its contiguous root
/// (`None` for a root that is not contiguous or of a block type, or a view of another type).
pub fn view_values(
    g: &Graph,
    v: TensorId,
    root: TensorId,
    root_values: &[f32],
) -> Option<Vec<f32>> {
    let rl = g.layout(root);
    let n = g.node(v);
    let vl = n.layout;
    if !rl.is_contiguous() || rl.dtype.block_size() != 1 || vl.dtype != rl.dtype {
        return None;
    }
    let es = rl.dtype.type_size();
    let [ne0, ne1, ne2, ne3] = vl.ne;
    let mut out = Vec::with_capacity(vl.nelements());
    for i3 in 0..ne3 {
        for i2 in 0..ne2 {
            for i1 in 0..ne1 {
                for i0 in 0..ne0 {
                    let off =
                        n.view_offs + i0 * vl.nb[0] + i1 * vl.nb[1] + i2 * vl.nb[2] + i3 * vl.nb[3];
                    if !off.is_multiple_of(es) {
                        return None;
                    }
                    out.push(*root_values.get(off / es)?);
                }
            }
        }
    }
    Some(out)
}

/// The `--dump` eval callback.
pub struct Dump {
    pub pattern: String,
    step: usize,
    last: Option<TensorId>,
    views: Views,
}

impl Dump {
    pub fn new(pattern: String) -> Dump {
        Dump {
            pattern,
            step: 0,
            last: None,
            views: Views::default(),
        }
    }

    /// One node's line: statistics, and an I32 node's values by rows of `ne[0]`.
    fn print(&self, g: &Graph, id: TensorId, backend: &str, values: &[f32], view: bool) {
        let nan = values.iter().filter(|v| v.is_nan()).count();
        let finite = values.iter().copied().filter(|v| !v.is_nan());
        let (mut min, mut max, mut sum, mut n) = (f32::INFINITY, f32::NEG_INFINITY, 0f64, 0usize);
        for v in finite {
            min = min.min(v);
            max = max.max(v);
            sum += v as f64;
            n += 1;
        }
        let mean = if n > 0 { sum / n as f64 } else { f64::NAN };
        let node = g.node(id);
        let op = if view { "view" } else { node.op.name() };
        let mut line = format!(
            "dump step {} #{} `{}` {op} {} on {backend}: min {min:.6} max {max:.6} mean {mean:.6} \
             nan {nan}",
            self.step,
            id.index(),
            node.name,
            node.layout.shape()
        );
        if node.layout.dtype == DType::I32 {
            let row = node.layout.ne[0].max(1);
            let rows: Vec<String> = values
                .chunks(row)
                .map(|r| {
                    let ids: Vec<String> = r.iter().map(|v| (*v as i64).to_string()).collect();
                    format!("[{}]", ids.join(" "))
                })
                .collect();
            line.push_str(&format!(" ids (rows of {row}): {}", rows.join(" ")));
        }
        eprintln!("{line}");
    }
}

impl metashard::sched::EvalCallback for Dump {
    fn ask(&mut self, g: &Graph, id: TensorId) -> bool {
        // Every node is asked about, so the views are rebuilt for each graph.
        let viewed = self.views.ask(&self.pattern, g, id);
        viewed || name_matches(&self.pattern, g.name(id))
    }

    fn eval(&mut self, g: &Graph, id: TensorId, backend: &str, values: &[f32]) -> bool {
        // Node ids rise within a graph: a lower one starts the next step's graph.
        if self.last.is_some_and(|l| id <= l) {
            self.step += 1;
        }
        self.last = Some(id);
        if name_matches(&self.pattern, g.name(id)) {
            self.print(g, id, backend, values, false);
        }
        for (v, vals) in self.views.values(g, id, values) {
            self.print(g, v, backend, &vals, true);
        }
        true
    }
}
