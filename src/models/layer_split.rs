//! Layer split (llama.cpp's `-sm layer`) and hybrid split of a decoder, as data: which layers
//! each backend of the scheduler runs (in proportion to the `--tensor-split` shares), which
//! devices form each group of a hybrid split, and where each tensor is placed. The runtime
//! (`crate::runtime`) builds the scheduler from them.
//!
//! Placement is by tensor role (the architecture's names): a layer's tensors and its KV cache
//! go to that layer's backend, the token embedding to the first layer's, the final norm and
//! the output projection to the last layer's.

use super::arch::{Naming, Tensor};
use crate::{Error, Result};
use std::ops::Range;
use std::sync::Arc;

/// How a decoder is spread over several devices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SplitMode {
    /// Tensor parallelism: every layer on every device (the meta device).
    #[default]
    Tensor,
    /// Whole layers per device, in proportion to the shares (the scheduler).
    Layer,
    /// Groups of devices, each a meta device; whole layers per group (the scheduler over meta
    /// devices).
    Hybrid,
}

impl SplitMode {
    pub const ALL: [SplitMode; 3] = [SplitMode::Tensor, SplitMode::Layer, SplitMode::Hybrid];

    pub fn name(self) -> &'static str {
        match self {
            SplitMode::Tensor => "tensor",
            SplitMode::Layer => "layer",
            SplitMode::Hybrid => "hybrid",
        }
    }

    /// `tensor`, `layer` or `hybrid`; anything else is an error naming `--split-mode`.
    pub fn parse(s: &str) -> Result<SplitMode> {
        SplitMode::ALL
            .into_iter()
            .find(|m| m.name() == s.trim())
            .ok_or_else(|| {
                Error::invalid_argument("--split-mode", s, "must be tensor, layer or hybrid")
            })
    }
}

impl std::fmt::Display for SplitMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which part (backend of the scheduler) a tensor name goes to: the shape of the scheduler's
/// placement callback (`sched::PlaceFn`), which takes it as it is.
pub type Placement = Arc<dyn Fn(&str) -> usize + Send + Sync>;

/// The layers of each of `shares.len()` parts, contiguous and in order, in proportion to the
/// shares (rounded at the cumulative boundaries, as llama.cpp assigns layers to GPUs); a part
/// with share 0 gets none. Shares must be finite, non-negative and not all zero.
pub fn layer_ranges(n_layer: usize, shares: &[f64]) -> Result<Vec<Range<usize>>> {
    let total: f64 = shares.iter().sum();
    // A sum overflowing to infinity would put every layer on the last device (NaN ends).
    if shares.is_empty()
        || shares.iter().any(|s| !s.is_finite() || *s < 0.0)
        || !total.is_finite()
        || total <= 0.0
    {
        return Err(Error::invalid_argument(
            "--tensor-split",
            format!("{shares:?}"),
            "shares must be finite, non-negative and not all zero, with a finite sum",
        ));
    }
    let mut out = Vec::with_capacity(shares.len());
    let (mut acc, mut start) = (0.0, 0usize);
    for (i, s) in shares.iter().enumerate() {
        acc += s;
        let end = if i + 1 == shares.len() {
            n_layer
        } else {
            ((acc / total) * n_layer as f64).round() as usize
        }
        .clamp(start, n_layer);
        out.push(start..end);
        start = end;
    }
    Ok(out)
}

/// The placement of a decoder's tensors when part `i` holds the layers `ranges[i]`.
pub fn placement(ranges: &[Range<usize>]) -> Placement {
    let n_layer = ranges.last().map_or(0, |r| r.end);
    let ranges = ranges.to_vec();
    let part = move |l: usize| ranges.iter().position(|r| r.contains(&l));
    let first = part(0).unwrap_or(0);
    let last = n_layer.checked_sub(1).and_then(&part).unwrap_or(0);
    Arc::new(move |name: &str| match Naming::Gguf.parse(name) {
        Some((_, Some(l))) => part(l).unwrap_or(last),
        Some((Tensor::TokenEmbd, None)) => first,
        _ => last,
    })
}

/// `n` devices in `groups` contiguous groups, as even as possible (the first groups larger).
pub fn device_groups(n: usize, groups: usize) -> Result<Vec<Range<usize>>> {
    if groups == 0 || groups > n {
        return Err(Error::invalid_argument(
            "--groups",
            groups,
            format!("must be in 1..={n} (the devices to group)"),
        ));
    }
    let (base, extra) = (n / groups, n % groups);
    let mut start = 0;
    Ok((0..groups)
        .map(|g| {
            let len = base + usize::from(g < extra);
            start += len;
            start - len..start
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_follow_the_shares() {
        let r = |n, s: &[f64]| layer_ranges(n, s).unwrap();
        assert_eq!(r(30, &[1.0, 1.0]), vec![0..15, 15..30]);
        assert_eq!(r(30, &[1.0; 4]), vec![0..8, 8..15, 15..23, 23..30]);
        assert_eq!(r(30, &[3.0, 1.0]), vec![0..23, 23..30]);
        assert_eq!(r(4, &[1.0, 0.0, 1.0]), vec![0..2, 2..2, 2..4]);
        assert!(layer_ranges(4, &[0.0, 0.0]).is_err());
        assert!(layer_ranges(4, &[f64::NAN]).is_err());
    }

    #[test]
    fn tensors_go_to_their_layers_part() {
        let p = placement(&[0..2, 2..2, 2..4]);
        assert_eq!(p("token_embd.weight"), 0);
        assert_eq!(p("blk.1.attn_q.weight"), 0);
        assert_eq!(p("blk.2.ffn_up.weight"), 2);
        assert_eq!(p("cache_v_l3"), 2);
        assert_eq!(p("output.weight"), 2);
        assert_eq!(p("output_norm.weight"), 2);
    }

    #[test]
    fn device_groups_are_contiguous_and_even() {
        assert_eq!(device_groups(4, 2).unwrap(), vec![0..2, 2..4]);
        assert_eq!(device_groups(5, 2).unwrap(), vec![0..3, 3..5]);
        assert!(device_groups(2, 3).is_err());
        assert!(SplitMode::parse("rows").is_err());
        assert_eq!(SplitMode::parse("hybrid").unwrap(), SplitMode::Hybrid);
    }
}
