//! Split states: how one tensor is spread over the N devices of a meta device.
//!
//! `Axis(k)`: device d holds a slice of extent `e[d]` along dimension k (uneven and zero extents
//! allowed). With segments, a fused tensor (QKV, gate|up) is cut into consecutive segments along
//! k and each segment is split on its own, so every device gets its share of each; extents are
//! listed segment-major and a device's local tensor is the concatenation of its pieces.
//! `Mirrored`: every device holds the whole tensor. `Partial`: every device holds a tensor of
//! the full shape and the value is their sum. `Routed`: a Partial whose rows are each held by
//! one device: the output of an expert product (`mul_mat_id`) whose experts are split whole
//! over the devices (expert parallelism). Device d holds the rows `(slot, token)` (dimensions
//! 1 and 2) whose expert id, in the ids tensor the state names, lies in d's share of the
//! experts (the state's extents, one per device), and zeros in every other row. Element-wise
//! maps that keep zero at zero keep it, so the experts' activation runs per device between
//! their products without a reduction; anything else takes it as the Partial it also is.
//!
//! Experts over groups of devices, tensor parallel inside each group (`--experts both`):
//! `ExpertGroups(k)` places an expert tensor `[K, N, n_expert]`: the devices form consecutive
//! groups, group g holds consecutive experts (axis 2, `experts[g]` of them, uneven or zero) and
//! inside the group each device holds a slice of axis k (0 or 1) of each of them (its `inner`
//! extent; a group's inner extents add up to the axis). `GroupRouted` is the output of the
//! column product of such experts: device d holds its group's slice of axis 0 (columns) of the
//! rows routed to its group's experts, and zeros in every other row; element-wise maps that
//! keep zero keep it, and it becomes a Partial by padding each slice with zeros (the row
//! product of `ExpertGroups(0)` experts over it gives Partial sums directly).
//!
//! This module owns the type, its validation and constructors (`build.rs`), the per-op rules
//! (`rules/`, one function per op family) and the derivation of view states (`view.rs`). It knows nothing of devices.

mod build;
pub mod rules;
pub mod view;

pub use build::{Granularity, split_even, split_ratios};

use crate::tensor::Layout;
use crate::{Error, Result};
use smallvec::SmallVec;

/// Where a tensor's data lies across devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SplitAxis {
    /// Sliced along dimension 0..=3.
    Axis(u8),
    Mirrored,
    Partial,
    /// Partial with each row on one device, chosen by the expert ids of node `ids` (an index
    /// into the graph being sharded); the extents are the experts per device.
    Routed {
        ids: u32,
    },
    /// Expert weights: experts (axis 2) over groups of devices, axis `k` (0 or 1) split inside
    /// each group (see the module doc).
    ExpertGroups(u8),
    /// The columns product of `ExpertGroups(1)` experts: axis 0 split inside each group, the
    /// rows routed by the ids of node `ids` to a group's experts held by its devices, zeros
    /// elsewhere.
    GroupRouted {
        ids: u32,
    },
}

/// One group of an expert-group split: its devices and its experts (both consecutive).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertGroup {
    pub devices: std::ops::Range<usize>,
    pub experts: std::ops::Range<usize>,
}

/// A tensor's split over `n` devices.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SplitState {
    pub axis: SplitAxis,
    /// Devices in the group.
    n: usize,
    /// For `Axis`: extents along the axis, segment-major: `extents[s * n + d]`. For `Routed`:
    /// experts per device. For `ExpertGroups` and `GroupRouted`: the inner extent of each
    /// device (n), then the experts of each group (G), then the devices of each group (G).
    /// Empty otherwise.
    extents: SmallVec<[usize; 16]>,
}

impl SplitState {
    pub fn mirrored(n: usize) -> Self {
        SplitState {
            axis: SplitAxis::Mirrored,
            n,
            extents: SmallVec::new(),
        }
    }

    pub fn partial(n: usize) -> Self {
        SplitState {
            axis: SplitAxis::Partial,
            n,
            extents: SmallVec::new(),
        }
    }

    /// The output of an expert product routed by the ids of node `ids` (its index in the
    /// graph), with `experts[d]` consecutive experts on device d.
    pub fn routed(ids: usize, experts: &[usize]) -> Self {
        SplitState {
            axis: SplitAxis::Routed {
                ids: u32::try_from(ids).unwrap_or(u32::MAX),
            },
            n: experts.len(),
            extents: experts.iter().copied().collect(),
        }
    }

    /// Experts over groups of devices with axis `axis` (0 or 1) split inside each group:
    /// `groups[g] = (experts, inner extents of the group's devices)`, groups of consecutive
    /// devices and experts in order. [`SplitState::validate`] checks it against the tensor.
    pub fn expert_groups(axis: usize, groups: &[(usize, Vec<usize>)]) -> Self {
        let mut extents: SmallVec<[usize; 16]> =
            groups.iter().flat_map(|(_, v)| v.iter().copied()).collect();
        extents.extend(groups.iter().map(|(e, _)| *e));
        extents.extend(groups.iter().map(|(_, v)| v.len()));
        SplitState {
            axis: SplitAxis::ExpertGroups(stored_axis(axis)),
            n: groups.iter().map(|(_, v)| v.len()).sum(),
            extents,
        }
    }

    /// The output of a columns product of experts in `experts` (an `ExpertGroups(1)` state),
    /// routed by the ids of node `ids`: axis 0 split as the experts' axis 1, inside each group.
    pub fn group_routed(ids: usize, experts: &SplitState) -> Self {
        SplitState {
            axis: SplitAxis::GroupRouted {
                ids: u32::try_from(ids).unwrap_or(u32::MAX),
            },
            n: experts.n,
            extents: experts.extents.clone(),
        }
    }

    /// Whether the state is an expert-group split (`ExpertGroups` or `GroupRouted`).
    pub fn is_grouped(&self) -> bool {
        matches!(
            self.axis,
            SplitAxis::ExpertGroups(_) | SplitAxis::GroupRouted { .. }
        )
    }

    /// Whether the value is an expert-group product's rows (`GroupRouted`).
    pub fn is_group_routed(&self) -> bool {
        matches!(self.axis, SplitAxis::GroupRouted { .. })
    }

    /// The groups of an expert-group state (empty for any other state).
    pub fn groups(&self) -> Vec<ExpertGroup> {
        if !self.is_grouped() || self.extents.len() < self.n {
            return Vec::new();
        }
        let g = (self.extents.len() - self.n) / 2;
        let (experts, sizes) = self.extents[self.n..].split_at(g);
        let (mut d, mut e) = (0, 0);
        experts
            .iter()
            .zip(sizes)
            .map(|(&x, &s)| {
                let grp = ExpertGroup {
                    devices: d..d + s,
                    experts: e..e + x,
                };
                (d, e) = (d + s, e + x);
                grp
            })
            .collect()
    }

    /// Device `d`'s group in an expert-group state.
    pub fn group_of(&self, d: usize) -> Option<ExpertGroup> {
        self.groups().into_iter().find(|g| g.devices.contains(&d))
    }

    /// Device `d`'s slice of the inner axis of an expert-group state: where it starts within
    /// the axis, and its extent (the devices of a group tile the axis in order).
    pub fn inner_slice(&self, d: usize) -> std::ops::Range<usize> {
        let Some(g) = self.group_of(d) else {
            return 0..0;
        };
        let start: usize = self.extents[g.devices.start..d].iter().sum();
        start..start + self.extents[d]
    }

    /// Split along `axis` with one extent per device. An axis above 3 gives a state that
    /// [`SplitState::validate`] rejects (it is never wrapped into 0..=3); [`SplitState::try_axis`]
    /// rejects it at once.
    pub fn axis(axis: usize, extents: &[usize]) -> Self {
        SplitState {
            axis: SplitAxis::Axis(stored_axis(axis)),
            n: extents.len(),
            extents: extents.iter().copied().collect(),
        }
    }

    /// Split along `axis` in segments, each with one extent per device (`segments[s][d]`). An
    /// axis above 3 or segments of different lengths give a state that
    /// [`SplitState::validate`] rejects; [`SplitState::try_segmented`] rejects them at once.
    pub fn segmented(axis: usize, segments: &[Vec<usize>]) -> Self {
        let n = segments.first().map_or(0, |s| s.len());
        SplitState {
            axis: SplitAxis::Axis(stored_axis(axis)),
            n,
            extents: segments.iter().flatten().copied().collect(),
        }
    }

    /// [`SplitState::axis`], with an error for an axis outside 0..=3, no devices, or extents
    /// whose sum overflows.
    pub fn try_axis(axis: usize, extents: &[usize]) -> Result<Self> {
        Self::try_segmented(axis, &[extents.to_vec()])
    }

    /// [`SplitState::segmented`], with an error for an axis outside 0..=3, no segments or
    /// devices, segments of different lengths, or extents whose sum overflows.
    pub fn try_segmented(axis: usize, segments: &[Vec<usize>]) -> Result<Self> {
        let bad = |reason: String| Error::invalid_argument("split axis", axis, reason);
        if axis > 3 {
            return Err(bad("a tensor has dimensions 0..=3".into()));
        }
        let n = segments.first().map_or(0, |s| s.len());
        if n == 0 {
            return Err(bad(
                "an axis split needs at least one device and segment".into()
            ));
        }
        if let Some((i, s)) = segments.iter().enumerate().find(|(_, s)| s.len() != n) {
            return Err(bad(format!(
                "segment {i} has {} extents but segment 0 has {n} (one per device)",
                s.len()
            )));
        }
        checked_sum(segments.iter().flatten().copied())
            .ok_or_else(|| bad(format!("extents {segments:?} sum past usize::MAX")))?;
        Ok(Self::segmented(axis, segments))
    }

    pub fn n_devices(&self) -> usize {
        self.n
    }

    pub fn is_mirrored(&self) -> bool {
        self.axis == SplitAxis::Mirrored
    }

    pub fn is_partial(&self) -> bool {
        self.axis == SplitAxis::Partial
    }

    /// Whether the value is the sum of the devices' tensors (Partial or Routed).
    pub fn is_sum(&self) -> bool {
        matches!(self.axis, SplitAxis::Partial | SplitAxis::Routed { .. })
    }

    /// Whether the value is routed (`SplitAxis::Routed`).
    pub fn is_routed(&self) -> bool {
        matches!(self.axis, SplitAxis::Routed { .. })
    }

    /// The split dimension, if any.
    pub fn split_dim(&self) -> Option<usize> {
        match self.axis {
            SplitAxis::Axis(k) => Some(k as usize),
            _ => None,
        }
    }

    /// Segments of an axis split (1 for `Routed`, 0 for states without extents per segment).
    pub fn n_segments(&self) -> usize {
        if self.is_grouped() {
            return 0;
        }
        self.extents.len().checked_div(self.n).unwrap_or(0)
    }

    /// Extent of segment `s` on device `d`.
    pub fn extent(&self, s: usize, d: usize) -> usize {
        self.extents[s * self.n + d]
    }

    /// All extents, segment-major.
    pub fn extents(&self) -> &[usize] {
        &self.extents
    }

    /// Extents as `[segment][device]`.
    pub fn segments(&self) -> Vec<Vec<usize>> {
        self.extents
            .chunks(self.n.max(1))
            .map(|c| c.to_vec())
            .collect()
    }

    /// Full size of segment `s` along the axis.
    pub fn segment_size(&self, s: usize) -> usize {
        (0..self.n).map(|d| self.extent(s, d)).sum()
    }

    /// Start of segment `s` along the axis, in the full tensor.
    pub fn segment_start(&self, s: usize) -> usize {
        (0..s).map(|t| self.segment_size(t)).sum()
    }

    /// Device `d`'s total extent along the axis (sum over segments).
    pub fn local_extent(&self, d: usize) -> usize {
        (0..self.n_segments()).map(|s| self.extent(s, d)).sum()
    }

    /// Where device `d`'s piece of segment `s` starts in the full tensor, along the axis.
    pub fn full_start(&self, s: usize, d: usize) -> usize {
        self.segment_start(s) + (0..d).map(|e| self.extent(s, e)).sum::<usize>()
    }

    /// Where device `d`'s piece of segment `s` starts in its local tensor, along the axis.
    pub fn local_start(&self, s: usize, d: usize) -> usize {
        (0..s).map(|t| self.extent(t, d)).sum()
    }

    /// Device `d`'s shape for a tensor of full shape `ne`.
    pub fn local_ne(&self, ne: [usize; 4], d: usize) -> [usize; 4] {
        let mut l = ne;
        match self.axis {
            SplitAxis::Axis(k) => l[k as usize] = self.local_extent(d),
            SplitAxis::ExpertGroups(k) => {
                l[(k as usize).min(3)] = self.inner_slice(d).len();
                l[2] = self.group_of(d).map_or(0, |g| g.experts.len());
            }
            SplitAxis::GroupRouted { .. } => l[0] = self.inner_slice(d).len(),
            _ => {}
        }
        l
    }

    /// Same placement of data: equal axis and extents (segments included).
    pub fn same_as(&self, o: &SplitState) -> bool {
        self == o
    }

    /// The same split with every extent multiplied by `num` and divided by `den` (exactly), for
    /// reshapes that merge or split the split dimension. `None` if a division is inexact.
    pub fn rescaled(&self, axis: usize, num: usize, den: usize) -> Option<SplitState> {
        if axis > 3 {
            return None;
        }
        let mut extents = SmallVec::new();
        for &e in &self.extents {
            let x = e.checked_mul(num)?;
            if den == 0 || !x.is_multiple_of(den) {
                return None;
            }
            extents.push(x / den);
        }
        Some(SplitState {
            axis: SplitAxis::Axis(stored_axis(axis)),
            n: self.n,
            extents,
        })
    }

    /// Check the state against the tensor it describes. Errors name the tensor and say what is
    /// wrong: extents that do not add up, a quantized axis-0 slice that is not whole blocks, a
    /// device count that does not match, a partial tensor of a type that is not float.
    pub fn validate(&self, tensor: &str, layout: &Layout, n_devices: usize) -> Result<()> {
        let err = |reason: String| Error::InvalidSplit {
            tensor: tensor.to_string(),
            reason,
        };
        if self.n != n_devices {
            return Err(err(format!(
                "{self} is for {} devices but the meta device has {n_devices}",
                self.n
            )));
        }
        if self.is_sum() && !layout.dtype.is_float() {
            return Err(err(format!(
                "a {} tensor cannot be {self}: partial sums are of float types",
                layout.dtype
            )));
        }
        if self.is_routed() || self.is_group_routed() {
            return Err(err(format!(
                "{self} is the output of an expert product split by experts: it is derived, \
                 never placed or hinted"
            )));
        }
        if let SplitAxis::ExpertGroups(k) = self.axis {
            return self.validate_groups(k as usize, layout).map_err(err);
        }
        let SplitAxis::Axis(k) = self.axis else {
            return Ok(());
        };
        let k = k as usize;
        if k > 3 {
            let k = if k == u8::MAX as usize {
                format!("{k} or more")
            } else {
                k.to_string()
            };
            return Err(err(format!(
                "axis {k} is not in 0..=3 (a tensor has 4 dimensions)"
            )));
        }
        if self.extents.is_empty() || !self.extents.len().is_multiple_of(self.n) {
            return Err(err(format!(
                "{} extents cannot be {} devices x whole segments",
                self.extents.len(),
                self.n
            )));
        }
        let Some(total) = checked_sum(self.extents.iter().copied()) else {
            return Err(err(format!(
                "extents {:?} sum past usize::MAX but dimension {k} of {} is {}",
                self.segments(),
                layout.shape(),
                layout.ne[k]
            )));
        };
        if total != layout.ne[k] {
            return Err(err(format!(
                "extents {:?} sum to {total} but dimension {k} of {} is {}",
                self.segments(),
                layout.shape(),
                layout.ne[k]
            )));
        }
        let bs = Granularity::of_axis(layout.dtype, k).0;
        if bs > 1
            && let Some(e) = self.extents.iter().find(|&&e| e % bs != 0)
        {
            return Err(err(format!(
                "{} rows are split in whole blocks of {bs}, but an extent is {e}",
                layout.dtype
            )));
        }
        Ok(())
    }
}

impl SplitState {
    /// [`SplitState::validate`] of an `ExpertGroups(k)` state: groups that cover the devices,
    /// experts that add up to axis 2, each group's inner extents adding up to axis k (in whole
    /// blocks on axis 0).
    fn validate_groups(&self, k: usize, layout: &Layout) -> std::result::Result<(), String> {
        if k > 1 {
            return Err(format!(
                "experts over groups split axis 0 or 1 inside a group, not axis {k}"
            ));
        }
        if layout.ne[3] != 1 {
            return Err(format!(
                "{} is not expert weights [K, N, n_expert, 1]",
                layout.shape()
            ));
        }
        let g = self.extents.len().saturating_sub(self.n) / 2;
        let groups = self.groups();
        let sizes: usize = groups.iter().map(|x| x.devices.len()).sum();
        if g == 0 || self.extents.len() != self.n + 2 * g || sizes != self.n {
            return Err(format!(
                "{self}: groups must cover the {} devices, each with at least one",
                self.n
            ));
        }
        if let Some(x) = groups.iter().position(|x| x.devices.is_empty()) {
            return Err(format!("{self}: group {x} has no device"));
        }
        let experts = groups.last().map_or(0, |x| x.experts.end);
        if experts != layout.ne[2] {
            return Err(format!(
                "{self}: the groups hold {experts} experts but {} has {}",
                layout.shape(),
                layout.ne[2]
            ));
        }
        for (x, grp) in groups.iter().enumerate() {
            let inner = checked_sum(self.extents[grp.devices.clone()].iter().copied());
            if inner != Some(layout.ne[k]) {
                return Err(format!(
                    "{self}: group {x}'s extents {:?} do not add up to dimension {k} of {} ({})",
                    &self.extents[grp.devices.clone()],
                    layout.shape(),
                    layout.ne[k]
                ));
            }
        }
        let bs = Granularity::of_axis(layout.dtype, k).0;
        if bs > 1
            && let Some(e) = self.extents[..self.n].iter().find(|&&e| e % bs != 0)
        {
            return Err(format!(
                "{} rows are split in whole blocks of {bs}, but an extent is {e}",
                layout.dtype
            ));
        }
        Ok(())
    }
}

/// The axis as stored: values above `u8::MAX` become `u8::MAX`, which `validate` rejects like
/// any axis above 3 (a plain `as u8` would wrap 256 into axis 0).
fn stored_axis(axis: usize) -> u8 {
    u8::try_from(axis).unwrap_or(u8::MAX)
}

/// The sum of `v`, or `None` when it overflows.
fn checked_sum(v: impl IntoIterator<Item = usize>) -> Option<usize> {
    v.into_iter().try_fold(0usize, |a, x| a.checked_add(x))
}

impl std::fmt::Display for SplitState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.axis {
            SplitAxis::Mirrored => f.write_str("Mirrored"),
            SplitAxis::Partial => f.write_str("Partial"),
            SplitAxis::Routed { ids } => write!(f, "Routed(#{ids}){:?}", self.extents),
            SplitAxis::ExpertGroups(_) | SplitAxis::GroupRouted { .. } => {
                match self.axis {
                    SplitAxis::ExpertGroups(k) => write!(f, "ExpertGroups{k}")?,
                    SplitAxis::GroupRouted { ids } => write!(f, "GroupRouted(#{ids})")?,
                    _ => {}
                }
                let groups: Vec<String> = self
                    .groups()
                    .iter()
                    .map(|g| {
                        let inner = &self.extents[g.devices.clone()];
                        match inner {
                            [a, b, ..] if inner.iter().all(|x| x == a) && a == b => {
                                format!("{}x[{a} x{}]", g.experts.len(), inner.len())
                            }
                            _ => format!("{}x{inner:?}", g.experts.len()),
                        }
                    })
                    .collect();
                write!(f, "[{}]", groups.join(", "))
            }
            SplitAxis::Axis(k) => {
                write!(f, "Axis{k}")?;
                let segs = self.segments();
                if segs.len() == 1 {
                    write!(f, "{:?}", segs[0])
                } else {
                    write!(f, "{segs:?}")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn local_shapes_and_offsets_with_segments() {
        // Fused QKV of 9 + 3 + 3 heads (head 64) on 2 devices: q [384, 192], k/v [128, 64].
        let s = SplitState::segmented(1, &[vec![384, 192], vec![128, 64], vec![128, 64]]);
        let l = Layout::contiguous(DType::F32, [576, 960, 1, 1]);
        s.validate("blk.0.attn_qkv.weight", &l, 2).unwrap();
        assert_eq!(s.local_ne(l.ne, 0), [576, 640, 1, 1]);
        assert_eq!(s.local_ne(l.ne, 1), [576, 320, 1, 1]);
        assert_eq!(s.full_start(1, 1), 576 + 128);
        assert_eq!(s.local_start(2, 1), 192 + 64);
        assert_eq!(s.to_string(), "Axis1[[384, 192], [128, 64], [128, 64]]");
    }

    #[test]
    fn invalid_states_name_the_tensor() {
        let l = Layout::contiguous(DType::Q4_0, [64, 8, 1, 1]);
        let e = SplitState::axis(1, &[3, 4])
            .validate("w", &l, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`w`") && e.contains("sum to 7"), "{e}");
        let e = SplitState::axis(0, &[16, 48])
            .validate("w", &l, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("whole blocks of 32"), "{e}");
        let e = SplitState::axis(1, &[8])
            .validate("w", &l, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("for 1 devices"), "{e}");
        // Zero extents are fine.
        SplitState::axis(1, &[0, 8]).validate("w", &l, 2).unwrap();
    }

    #[test]
    fn expert_groups_shapes_and_checks() {
        // 5 experts over groups of 2 and 1 devices (3 + 2 experts), columns 24 = 16 + 8 | 24.
        let s = SplitState::expert_groups(1, &[(3, vec![16, 8]), (2, vec![24])]);
        let l = Layout::contiguous(DType::F32, [64, 24, 5, 1]);
        s.validate("blk.0.ffn_gate_exps.weight", &l, 3).unwrap();
        assert_eq!(s.local_ne(l.ne, 0), [64, 16, 3, 1]);
        assert_eq!(s.local_ne(l.ne, 1), [64, 8, 3, 1]);
        assert_eq!(s.local_ne(l.ne, 2), [64, 24, 2, 1]);
        assert_eq!(s.inner_slice(1), 16..24);
        assert_eq!(s.group_of(2).unwrap().experts, 3..5);
        assert_eq!(s.to_string(), "ExpertGroups1[3x[16, 8], 2x[24]]");
        let even = SplitState::expert_groups(0, &[(3, vec![8, 8, 8]), (2, vec![24])]);
        assert_eq!(even.to_string(), "ExpertGroups0[3x[8 x3], 2x[24]]");
        let r = SplitState::group_routed(7, &s);
        assert_eq!(r.local_ne([24, 2, 4, 1], 1), [8, 2, 4, 1]);
        assert!(
            r.validate("y", &Layout::contiguous(DType::F32, [24, 2, 4, 1]), 3)
                .is_err()
        );
        // A group whose extents miss the axis, experts that miss axis 2, a device count off.
        let bad = SplitState::expert_groups(1, &[(3, vec![16, 4]), (2, vec![24])]);
        let e = bad.validate("w", &l, 3).unwrap_err().to_string();
        assert!(e.contains("`w`") && e.contains("group 0"), "{e}");
        let bad = SplitState::expert_groups(1, &[(3, vec![16, 8]), (3, vec![24])]);
        let e = bad.validate("w", &l, 3).unwrap_err().to_string();
        assert!(e.contains("6 experts"), "{e}");
        assert!(s.validate("w", &l, 4).is_err());
        // Axis 0 inside a group keeps whole blocks.
        let q = Layout::contiguous(DType::Q4_0, [64, 24, 5, 1]);
        let e = SplitState::expert_groups(0, &[(5, vec![16, 48])])
            .validate("w", &q, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("whole blocks of 32"), "{e}");
        // Zero experts in a group and zero extents are fine.
        SplitState::expert_groups(1, &[(0, vec![24]), (5, vec![0, 24])])
            .validate("w", &l, 3)
            .unwrap();
    }

    #[test]
    fn whole_blocks_are_the_dtype_s_blocks() {
        // The test builds' fake type has blocks of 16: [16, 48] is whole blocks for it, not for
        // Q4_0 (blocks of 32, above); [8, 56] is not, and the error names the type and its block.
        let l = Layout::contiguous(DType::FakeQ4x16, [64, 8, 1, 1]);
        SplitState::axis(0, &[16, 48]).validate("w", &l, 2).unwrap();
        let e = SplitState::axis(0, &[8, 56])
            .validate("w", &l, 2)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("fake_q4x16 rows") && e.contains("whole blocks of 16"),
            "{e}"
        );
    }
}
