//! Checking a sharded run against another: NMSE and max-abs of two result vectors (defined in
//! `metrics`, re-exported here), greedy decoding of a few steps, the independent numpy
//! reference of a GGUF decoder (`scripts/reference/smollm2_ref.py`), and a node-by-node
//! comparison of one prompt step on any two device sets (`compare_graph_backend`) that lists
//! every node's NMSE with its split state.

use crate::devices::DeviceSet;
use crate::graph::Graph;
use crate::meta::MetaDevice;
use crate::models::decoder::{SequenceStep, build_step};
use crate::models::loader::DecoderModel;
use crate::models::sampler::argmax;
use crate::models::session::Session;
use crate::sched::{Sched, compare_graph_sched};
use crate::{Error, Result};
use std::path::Path;

/// NMSE and max-abs live below the scheduler (`crate::metrics`), which compares nodes too.
pub use crate::metrics::{max_abs, nmse};

/// Prompt logits and `steps` greedy tokens. The prompt and the steps must fit the model's
/// context: an [`Error::InvalidArgument`] naming `steps` otherwise.
pub fn greedy(
    m: &DecoderModel,
    set: &DeviceSet,
    prompt: &[u32],
    steps: usize,
) -> Result<(Vec<f32>, Vec<u32>)> {
    let ctx = max_steps(m, prompt.len())
        .filter(|&max| steps <= max)
        .map(|_| prompt.len() + steps)
        .ok_or_else(|| steps_error(m, prompt.len(), "steps", steps))?;
    let mut s = Session::new(m, set.backend.clone(), set.buffer_type.as_ref(), ctx)?;
    let first = s.eval(prompt, false)?;
    let mut logits = first.clone();
    let mut toks = Vec::with_capacity(steps);
    for i in 0..steps {
        let t = argmax(&logits);
        toks.push(t);
        if i + 1 < steps {
            logits = s.eval(&[t], false)?;
        }
    }
    Ok((first, toks))
}

/// The most greedy steps after a prompt of `prompt_len` tokens in the model's context (`None`
/// when the prompt alone fills it).
pub fn max_steps(m: &DecoderModel, prompt_len: usize) -> Option<usize> {
    m.context_length
        .checked_sub(prompt_len)
        .filter(|_| prompt_len > 0)
}

/// The error for `steps` (named `name`, e.g. `--steps`) that do not fit after the prompt.
pub fn steps_error(m: &DecoderModel, prompt_len: usize, name: &str, steps: usize) -> Error {
    let reason = match max_steps(m, prompt_len) {
        Some(max) => format!(
            "the prompt ({prompt_len} tokens) and the steps must fit the model's context of {} \
             positions: at most {max} steps",
            m.context_length
        ),
        None if prompt_len == 0 => "the prompt has no tokens".to_string(),
        None => format!(
            "the prompt ({prompt_len} tokens) alone does not fit the model's context of {} \
             positions",
            m.context_length
        ),
    };
    Error::invalid_argument(name, steps, reason)
}

/// Run the numpy reference on `prompt`: its greedy tokens and last-prompt-position logits.
pub fn reference(gguf: &Path, prompt: &[u32], steps: usize) -> Result<(Vec<u32>, Vec<f32>)> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/reference/smollm2_ref.py");
    let logits_file =
        std::env::temp_dir().join(format!("metashard-ref-{}.f32", std::process::id()));
    let ids: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg("--model")
        .arg(gguf)
        .arg("--tokens")
        .arg(ids.join(","))
        .arg("--steps")
        .arg(steps.to_string())
        .arg("--logits-out")
        .arg(&logits_file)
        .output()
        .map_err(|e| Error::io(&script, e))?;
    if !out.status.success() {
        return Err(Error::ProgramFailed {
            program: script,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| Error::format(&script, "standard output", format!("not JSON: {e}")))?;
    let toks = v["generated"]
        .as_array()
        .ok_or_else(|| Error::format(&script, "standard output", "no `generated` array"))?
        .iter()
        .filter_map(|x| x.as_u64().map(|x| x as u32))
        .collect();
    let bytes = std::fs::read(&logits_file).map_err(|e| Error::io(&logits_file, e))?;
    let _ = std::fs::remove_file(&logits_file);
    let logits = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((toks, logits))
}

/// One node's comparison.
#[derive(Clone, Debug, serde::Serialize)]
pub struct NodeDiff {
    pub index: usize,
    pub name: String,
    pub op: String,
    /// Its split state on the second device set when that is a meta device, else `-`.
    pub state: String,
    /// Where it ran on the second device set.
    pub backend: String,
    pub nmse: f64,
}

/// Every computed node of one prompt step on two device sets (`a` the reference, `b` checked),
/// in graph order, through [`compare_graph_sched`] (`compare_graph_backend`); and the first node whose NMSE exceeds
/// `bound`. Any two device sets work: one device, a meta device, a layer split.
pub fn compare_nodes(
    a: (&DecoderModel, &DeviceSet),
    b: (&DecoderModel, &DeviceSet),
    prompt: &[u32],
    bound: f64,
) -> Result<(Vec<NodeDiff>, Option<NodeDiff>)> {
    // The graph holds the cache's storage, so the session may go.
    let build = |m: &DecoderModel, set: &DeviceSet| -> Result<Graph> {
        let s = Session::new(
            m,
            set.backend.clone(),
            set.buffer_type.as_ref(),
            prompt.len(),
        )?;
        let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
        let step = SequenceStep::new(&ids, 0, s.capacity());
        let inp = step.input(prompt.len() - 1..prompt.len());
        let cache = s.cache();
        let sg = build_step(&m.cfg, &m.weights, &cache, &inp)?;
        Ok(sg.graph)
    };
    let mut ga = build(a.0, a.1)?;
    let mut gb = build(b.0, b.1)?;
    let plan = match &b.1.meta {
        Some(m) => Some(MetaDevice::meta_backend(m)?.sharding(&gb)?),
        None => None,
    };
    // A layer split's own scheduler holds its weights; anything else runs on one over its
    // backend.
    let sched = |set: &DeviceSet| match &set.sched {
        Some((s, _)) => Ok(s.clone()),
        None => Sched::new(vec![set.backend.clone()]),
    };
    let (sa, sb) = (sched(a.1)?, sched(b.1)?);
    let r = compare_graph_sched(&sa, &mut ga, &sb, &mut gb, bound)?;
    let diff = |d: &crate::sched::NodeDiff| NodeDiff {
        index: d.index,
        name: d.name.clone(),
        op: d.op.clone(),
        state: plan
            .as_ref()
            .map_or("-".into(), |p| p.states[d.index].to_string()),
        backend: d.backend.clone(),
        nmse: d.nmse,
    };
    Ok((
        r.nodes.iter().map(diff).collect(),
        r.first_over.as_ref().map(diff),
    ))
}
