//! GGUF files written by llama.cpp before the experts' 3-D tensors (Mixtral files of early
//! 2024) hold each expert as its own 2-D tensor: `blk.N.ffn_gate.E.weight`,
//! `blk.N.ffn_down.E.weight`, `blk.N.ffn_up.E.weight` (llama.cpp's `LLM_TENSOR_FFN_GATE_EXP`,
//! `_DOWN_EXP`, `_UP_EXP`: `"blk.%d.ffn_gate.%d"`, `src/llama-arch.cpp`). llama.cpp's loader
//! still takes them: when `ffn_gate_exps` is absent it makes the 3-D tensor and loads expert
//! `x` into its view at `nb[2] * x` ("merge split expert into a single tensor for
//! compatibility with older models", `src/llama-model.cpp`, which also requires each role's
//! experts to share a type). [`open_gguf`] does the same: each layer's experts of a role are
//! stacked into the role's 3-D tensor (`GgufFile::stack_tensors`, which refuses experts of
//! different types or shapes naming the tensor), so everything after it sees one layout.

use super::arch::{Naming, Tensor};
use super::hparams::MAX_EXPERTS;
use crate::io::GgufFile;
use crate::{Error, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The experts' 3-D roles, each stored per expert in older files.
const EXPERT_ROLES: [Tensor; 3] = [Tensor::FfnGateExps, Tensor::FfnDownExps, Tensor::FfnUpExps];

/// A GGUF file with each layer's per-expert tensors stacked into the 3-D ones.
pub fn open_gguf(path: impl AsRef<Path>) -> Result<GgufFile> {
    let mut g = GgufFile::open(path)?;
    stack_legacy_experts(&mut g)?;
    Ok(g)
}

/// Stack the per-expert tensors of `g` (none in a current file) into the 3-D expert tensors:
/// experts `0..=max` of each layer and role, in order; a missing one, or one of another type
/// or shape than expert 0, is an error naming it.
pub fn stack_legacy_experts(g: &mut GgufFile) -> Result<()> {
    let mut groups: BTreeMap<(usize, Tensor), BTreeSet<usize>> = BTreeMap::new();
    for t in g.tensors() {
        if let Some((role, layer, expert)) = parse_legacy(&t.name) {
            groups.entry((layer, role)).or_default().insert(expert);
        }
    }
    for ((layer, role), experts) in groups {
        let n = experts.last().map_or(0, |e| e + 1);
        // The expert number in a name sizes the list of parts: bounded before it is built.
        if n > MAX_EXPERTS {
            return Err(Error::format(
                g.path(),
                format!("tensor '{}'", legacy_name(role, layer, n - 1)),
                format!("expert {}: at most {MAX_EXPERTS} experts are taken", n - 1),
            ));
        }
        let parts: Vec<String> = (0..n).map(|e| legacy_name(role, layer, e)).collect();
        let name = Naming::Gguf
            .name(role, layer)
            .expect("the expert roles have GGUF names");
        g.stack_tensors(&name, &parts)?;
    }
    Ok(())
}

/// `ffn_gate` for the role whose 3-D tensor is `ffn_gate_exps.weight`.
fn legacy_base(role: Tensor) -> &'static str {
    let gguf = role.info().gguf;
    gguf.strip_suffix("_exps.weight").unwrap_or(gguf)
}

/// The name of expert `expert` of `role` in layer `layer` in the old layout.
pub fn legacy_name(role: Tensor, layer: usize, expert: usize) -> String {
    format!("blk.{layer}.{}.{expert}.weight", legacy_base(role))
}

/// The role, layer and expert of an old per-expert name (`blk.3.ffn_up.7.weight`).
fn parse_legacy(name: &str) -> Option<(Tensor, usize, usize)> {
    let rest = name.strip_prefix("blk.")?.strip_suffix(".weight")?;
    let (layer, rest) = rest.split_once('.')?;
    let (base, expert) = rest.rsplit_once('.')?;
    let number = |s: &str| {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    let role = EXPERT_ROLES.into_iter().find(|&r| legacy_base(r) == base)?;
    Some((role, number(layer)?, number(expert)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_expert_names_are_parsed_and_others_are_not() {
        assert_eq!(
            parse_legacy("blk.3.ffn_up.7.weight"),
            Some((Tensor::FfnUpExps, 3, 7))
        );
        assert_eq!(
            parse_legacy("blk.0.ffn_gate.0.weight"),
            Some((Tensor::FfnGateExps, 0, 0))
        );
        for n in [
            "blk.0.ffn_gate.weight",
            "blk.0.ffn_gate_exps.weight",
            "blk.0.ffn_gate.x.weight",
            "blk.0.ffn_norm.1.weight",
            "blk.0.ffn_down.1.bias",
        ] {
            assert_eq!(parse_legacy(n), None, "{n}");
        }
        assert_eq!(
            legacy_name(Tensor::FfnDownExps, 2, 5),
            "blk.2.ffn_down.5.weight"
        );
    }

    #[test]
    fn an_expert_number_past_the_bound_is_refused_before_anything_is_sized_by_it() {
        use crate::DType;
        use crate::io::GgufWriter;
        let mut w = GgufWriter::new();
        let name = "blk.0.ffn_gate.4000000000.weight";
        w.add_tensor(name, DType::F32, &[2, 2], vec![0; 16])
            .unwrap();
        let mut g = GgufFile::from_bytes("old.gguf", w.to_bytes()).unwrap();
        let e = stack_legacy_experts(&mut g).unwrap_err().to_string();
        assert!(e.contains(name) && e.contains("4096"), "{e}");
    }
}
