//! `compare_graph_backend` (ggml's `ggml_backend_compare_graph_backend`): the same graph on two
//! backends, node by node, through the scheduler's eval callback. The first backend's run
//! records every computed node; the second's compares each node as it completes and the
//! first node whose NMSE exceeds the bound is reported by name.
//!
//! The two graphs are given separately (each backend reads weights placed in its own buffers)
//! and must have the same structure: the same ops on the same node indices.

use super::{EvalCallback, Sched};
use crate::backend::Backend;
use crate::graph::{Graph, TensorId};
use crate::{Error, Result};
use parking_lot::Mutex;
use std::sync::Arc;

/// One node's comparison.
#[derive(Clone, Debug, serde::Serialize)]
pub struct NodeDiff {
    pub index: usize,
    pub name: String,
    pub op: String,
    /// Where it ran on the second backend.
    pub backend: String,
    pub nmse: f64,
    pub max_abs: f32,
}

/// Every computed node's comparison, in graph order, and the first over the bound.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GraphComparison {
    pub nodes: Vec<NodeDiff>,
    pub first_over: Option<NodeDiff>,
}

type Values = Arc<Mutex<Vec<Option<Vec<f32>>>>>;

/// Records every computed node's values.
struct Record {
    values: Values,
}

impl EvalCallback for Record {
    fn ask(&mut self, _g: &Graph, _id: TensorId) -> bool {
        true
    }
    fn eval(&mut self, _g: &Graph, id: TensorId, _backend: &str, values: &[f32]) -> bool {
        if let Some(v) = self.values.lock().get_mut(id.index()) {
            *v = Some(values.to_vec());
        }
        true
    }
}

/// Compares each node with the recorded values.
struct Check {
    reference: Vec<Option<Vec<f32>>>,
    bound: f64,
    out: Arc<Mutex<GraphComparison>>,
}

impl EvalCallback for Check {
    fn ask(&mut self, _g: &Graph, id: TensorId) -> bool {
        self.reference.get(id.index()).is_some_and(|v| v.is_some())
    }
    fn eval(&mut self, g: &Graph, id: TensorId, backend: &str, values: &[f32]) -> bool {
        let Some(Some(r)) = self.reference.get(id.index()) else {
            return true;
        };
        let n = g.node(id);
        let (nmse, max_abs) = if r.len() == values.len() {
            (
                crate::metrics::nmse(values, r),
                crate::metrics::max_abs(values, r),
            )
        } else {
            (f64::INFINITY, f32::INFINITY)
        };
        let d = NodeDiff {
            index: id.index(),
            name: n.name.clone(),
            op: n.op.name().to_string(),
            backend: backend.to_string(),
            nmse,
            max_abs,
        };
        let mut out = self.out.lock();
        // NaN is never within the bound.
        if out.first_over.is_none() && (nmse.is_nan() || nmse > self.bound) {
            out.first_over = Some(d.clone());
        }
        out.nodes.push(d);
        true
    }
}

/// Run `ga` on `a` and `gb` on `b` (graphs of one structure) and compare every computed node;
/// `bound` is the NMSE above which a node counts as divergent (NaN always does).
/// A backend that is itself a scheduler (a layer split) is compared through
/// [`compare_graph_sched`] on it instead: a scheduler does not run inside another.
pub fn compare_graph_backend(
    a: Arc<dyn Backend>,
    ga: &mut Graph,
    b: Arc<dyn Backend>,
    gb: &mut Graph,
    bound: f64,
) -> Result<GraphComparison> {
    let (sa, sb) = (Sched::new(vec![a])?, Sched::new(vec![b])?);
    compare_graph_sched(&sa, ga, &sb, gb, bound)
}

/// As [`compare_graph_backend`] on two schedulers (a layer split's own, whose buffers hold the
/// graph's weights); their eval callbacks are set aside for the comparison and put back.
pub fn compare_graph_sched(
    sa: &Sched,
    ga: &mut Graph,
    sb: &Sched,
    gb: &mut Graph,
    bound: f64,
) -> Result<GraphComparison> {
    check_structure(ga, gb)?;
    let (keep_a, keep_b) = (sa.take_eval_callback(), sb.take_eval_callback());
    let r = compare_inner(sa, ga, sb, gb, bound);
    sa.set_eval_callback(keep_a);
    sb.set_eval_callback(keep_b);
    r
}

fn compare_inner(
    sa: &Sched,
    ga: &mut Graph,
    sb: &Sched,
    gb: &mut Graph,
    bound: f64,
) -> Result<GraphComparison> {
    let values: Values = Arc::new(Mutex::new(vec![None; ga.len()]));
    sa.set_eval_callback(Some(Box::new(Record {
        values: values.clone(),
    })));
    sa.graph_compute(ga)?;
    let reference = std::mem::take(&mut *values.lock());
    let out = Arc::new(Mutex::new(GraphComparison {
        nodes: Vec::new(),
        first_over: None,
    }));
    sb.set_eval_callback(Some(Box::new(Check {
        reference,
        bound,
        out: out.clone(),
    })));
    sb.graph_compute(gb)?;
    let r = std::mem::replace(
        &mut *out.lock(),
        GraphComparison {
            nodes: Vec::new(),
            first_over: None,
        },
    );
    Ok(r)
}

/// The same ops and shapes on the same node indices, else an error saying where they differ.
fn check_structure(ga: &Graph, gb: &Graph) -> Result<()> {
    let differs = |id: TensorId| {
        gb.get(id).map_or(true, |n| {
            let m = ga.node(id);
            n.op != m.op || n.layout.ne != m.layout.ne || n.layout.dtype != m.layout.dtype
        })
    };
    if ga.len() != gb.len() || ga.ids().any(differs) {
        let at = ga
            .ids()
            .find(|&id| differs(id))
            .map_or(ga.len().min(gb.len()), |id| id.index());
        return Err(Error::invalid_input(
            "compare_graph_backend",
            "second graph",
            format!(
                "the first graph's structure ({} nodes, ops and shapes)",
                ga.len()
            ),
            format!("{} nodes, differing at node {at}", gb.len()),
        ));
    }
    Ok(())
}
