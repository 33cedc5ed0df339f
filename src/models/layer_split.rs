//! Layer split (llama.cpp's `-sm layer`) and hybrid split of a decoder, run by the scheduler
//! (`crate::sched`): whole layers on each backend, in proportion to the `--tensor-split`
//! shares, with the residual stream copied between backends where the layers change hands.
//! Hybrid: the devices in contiguous groups, each group a meta device (tensor parallelism with
//! the built-in Megatron split inside), and the layers split across the groups.
//!
//! Placement is by tensor name through the scheduler's buffer type: `blk.N.*` and the caches
//! `cache_k_lN` / `cache_v_lN` go to layer N's backend, `token_embd` to the first layer's,
//! `output_norm` and `output` to the last layer's.

use super::decoder::DecoderConfig;
use super::split::{SplitOptions, megatron};
use crate::backend::{Backend, Device};
use crate::meta::{MetaDevice, MetaOptions};
use crate::sched::{PlaceFn, Sched};
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

/// The layers of each of `shares.len()` parts, contiguous and in order, in proportion to the
/// shares (rounded at the cumulative boundaries, as llama.cpp assigns layers to GPUs); a part
/// with share 0 gets none. Shares must be finite, non-negative and not all zero.
pub fn layer_ranges(n_layer: usize, shares: &[f64]) -> Result<Vec<Range<usize>>> {
    let total: f64 = shares.iter().sum();
    if shares.is_empty() || shares.iter().any(|s| !s.is_finite() || *s < 0.0) || total <= 0.0 {
        return Err(Error::invalid_argument(
            "--tensor-split",
            format!("{shares:?}"),
            "shares must be finite, non-negative and not all zero",
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

/// The layer a decoder tensor belongs to: `blk.N.*`, `cache_k_lN`, `cache_v_lN`.
pub fn layer_of(name: &str) -> Option<usize> {
    if let Some(r) = name.strip_prefix("blk.") {
        return r.split('.').next()?.parse().ok();
    }
    let r = name
        .strip_prefix("cache_k_l")
        .or_else(|| name.strip_prefix("cache_v_l"))?;
    r.parse().ok()
}

/// The placement of a decoder's tensors when part `i` holds the layers `ranges[i]`.
pub fn placement(ranges: &[Range<usize>]) -> PlaceFn {
    let n_layer = ranges.last().map_or(0, |r| r.end);
    let ranges = ranges.to_vec();
    let part = move |l: usize| ranges.iter().position(|r| r.contains(&l));
    let first = part(0).unwrap_or(0);
    let last = n_layer.checked_sub(1).and_then(&part).unwrap_or(0);
    Arc::new(move |name: &str| match layer_of(name) {
        Some(l) => part(l).unwrap_or(last),
        None if name.starts_with("token_embd") => first,
        None => last,
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

/// What [`open`] builds: the scheduler, its buffer type, and the devices each backend covers.
pub struct Layered {
    pub sched: Arc<Sched>,
    pub buffer_type: Arc<dyn crate::buffer::BufferType>,
    /// Device indices per backend of the scheduler.
    pub groups: Vec<Range<usize>>,
    /// Layers per backend.
    pub layers: Vec<Range<usize>>,
}

/// The scheduler for `mode` (layer or hybrid) over `devices` for a decoder of `cfg`: one
/// backend per device (layer), or one per group of `groups` (hybrid; a group of one device is
/// that device, a larger one a meta device with the Megatron split and the group's shares).
pub fn open(
    cfg: &DecoderConfig,
    devices: &[Arc<dyn Device>],
    mode: SplitMode,
    shares: Option<&[f64]>,
    groups: usize,
    meta: MetaOptions,
) -> Result<Layered> {
    let n = devices.len();
    let shares: Vec<f64> = match shares {
        Some(s) if s.len() == n => s.to_vec(),
        Some(s) => {
            return Err(Error::invalid_argument(
                "--tensor-split",
                format!("{s:?}"),
                format!("give one share per device ({n})"),
            ));
        }
        None => vec![1.0; n],
    };
    let groups = match mode {
        SplitMode::Layer => device_groups(n, n)?,
        SplitMode::Hybrid => device_groups(n, groups)?,
        SplitMode::Tensor => {
            return Err(Error::invalid_argument(
                "--split-mode",
                "tensor",
                "runs on the meta device, not the scheduler",
            ));
        }
    };
    let mut backends: Vec<Arc<dyn Backend>> = Vec::with_capacity(groups.len());
    let mut group_shares = Vec::with_capacity(groups.len());
    for g in &groups {
        let s = &shares[g.clone()];
        group_shares.push(s.iter().sum::<f64>());
        if g.len() == 1 {
            backends.push(devices[g.start].init_backend()?);
        } else {
            let split = megatron(
                cfg,
                SplitOptions {
                    ratios: Some(s.to_vec()),
                    mirror_attention: false,
                },
            );
            let m = MetaDevice::with_options(devices[g.clone()].to_vec(), split, meta)?;
            backends.push(m.init_backend()?);
        }
    }
    let layers = layer_ranges(cfg.n_layer, &group_shares)?;
    let sched = Sched::new(backends)?;
    let buffer_type = sched.buffer_type(placement(&layers));
    Ok(Layered {
        sched,
        buffer_type,
        groups,
        layers,
    })
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
        assert_eq!(layer_of("cache_k_l12"), Some(12));
        assert_eq!(layer_of("blk.x.attn"), None);
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
