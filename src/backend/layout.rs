//! `SliceLayout`: how a contiguous full tensor is cut into per-rank slices along one axis, with
//! segments, and the byte runs that copy between the full tensor and one rank's slice.
//!
//! The full tensor is `outer` repetitions of: for each segment `s`, for each rank `r`,
//! `extents[s][r] * unit_bytes` bytes. Rank `r`'s slice is `outer` repetitions of: for each
//! segment `s`, `extents[s][r] * unit_bytes` bytes. `unit_bytes` is the size of one index step
//! along the split axis (the product of the lower dimensions times the element size, or the
//! bytes of one quantization block when axis 0 of a quantized tensor is split); `outer` is the
//! product of the higher dimensions.

use crate::{Error, Result};

/// One contiguous copy between the full tensor and a rank's slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Byte offset in the full tensor.
    pub full: usize,
    /// Byte offset in the rank's slice.
    pub local: usize,
    /// Bytes to copy.
    pub len: usize,
}

/// A validated split of a full tensor into per-rank slices (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceLayout {
    outer: usize,
    unit_bytes: usize,
    world: usize,
    /// Extents in units, segment-major: `extents[s * world + r]`.
    extents: Vec<usize>,
    /// Bytes of one outer repetition of the full tensor.
    full_rep: usize,
    /// Bytes of one outer repetition of each rank's slice.
    local_rep: Vec<usize>,
    /// Per (segment, rank): byte offset of the piece inside one full repetition.
    full_off: Vec<usize>,
    /// Per (segment, rank): byte offset of the piece inside one local repetition.
    local_off: Vec<usize>,
    /// A hash of (outer, unit_bytes, world, extents), compared between ranks by collectives.
    fingerprint: u64,
}

fn layout_err(reason: String) -> Error {
    Error::InvalidOp {
        op: "SliceLayout::new",
        reason,
    }
}

impl SliceLayout {
    /// A layout from `segments[s][r]` = extent (in units) of rank `r` in segment `s`.
    /// Errors: no segment, no rank, segments with different rank counts, or sizes that
    /// overflow `usize`.
    pub fn new<S: AsRef<[usize]>>(outer: usize, unit_bytes: usize, segments: &[S]) -> Result<Self> {
        let Some(first) = segments.first() else {
            return Err(layout_err("at least one segment is needed".into()));
        };
        let world = first.as_ref().len();
        if world == 0 {
            return Err(layout_err("segment 0 lists no ranks".into()));
        }
        let mut extents = Vec::with_capacity(segments.len() * world);
        for (s, seg) in segments.iter().enumerate() {
            let seg = seg.as_ref();
            if seg.len() != world {
                return Err(layout_err(format!(
                    "segment {s} lists {} ranks but segment 0 lists {world}",
                    seg.len()
                )));
            }
            extents.extend_from_slice(seg);
        }
        let overflow = || {
            layout_err(format!(
                "size overflows usize: outer {outer} x unit_bytes {unit_bytes} x extents {extents:?}"
            ))
        };
        let units = extents
            .iter()
            .try_fold(0usize, |a, &e| a.checked_add(e))
            .ok_or_else(overflow)?;
        let full_rep = units.checked_mul(unit_bytes).ok_or_else(overflow)?;
        full_rep.checked_mul(outer).ok_or_else(overflow)?;
        // Every offset and local size below is at most `full_rep`, so nothing else overflows.
        // Extents are segment-major, so walking them in order walks the full repetition.
        let mut full_off = Vec::with_capacity(extents.len());
        let mut local_off = Vec::with_capacity(extents.len());
        let mut local_rep = vec![0; world];
        let mut at = 0;
        for (i, &e) in extents.iter().enumerate() {
            let bytes = e * unit_bytes;
            let rep = &mut local_rep[i % world];
            full_off.push(at);
            local_off.push(*rep);
            *rep += bytes;
            at += bytes;
        }
        let fingerprint = fingerprint(outer, unit_bytes, world, &extents);
        Ok(SliceLayout {
            outer,
            unit_bytes,
            world,
            extents,
            full_rep,
            local_rep,
            full_off,
            local_off,
            fingerprint,
        })
    }

    /// A layout with one segment: `extents[r]` units for rank `r`.
    pub fn single(outer: usize, unit_bytes: usize, extents: &[usize]) -> Result<Self> {
        Self::new(outer, unit_bytes, &[extents])
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    pub fn n_segments(&self) -> usize {
        self.extents.len() / self.world
    }

    pub fn outer(&self) -> usize {
        self.outer
    }

    pub fn unit_bytes(&self) -> usize {
        self.unit_bytes
    }

    /// Extent (in units) of `rank` in `segment`; `None` if either is out of range.
    pub fn extent(&self, segment: usize, rank: usize) -> Option<usize> {
        if rank >= self.world {
            return None;
        }
        self.extents.get(segment * self.world + rank).copied()
    }

    /// Bytes of the full tensor.
    pub fn full_bytes(&self) -> usize {
        self.full_rep * self.outer
    }

    /// Bytes of `rank`'s slice (0 for a rank out of range).
    pub fn local_bytes(&self, rank: usize) -> usize {
        self.local_rep.get(rank).map_or(0, |b| b * self.outer)
    }

    /// A 64-bit hash of the layout; equal layouts have equal fingerprints.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The copies between the full tensor and `rank`'s slice, in increasing offset order,
    /// adjacent runs merged, empty runs skipped. No runs for a rank out of range.
    pub fn runs(&self, rank: usize) -> Runs<'_> {
        Runs {
            layout: self,
            rank,
            o: 0,
            s: 0,
            pending: None,
        }
    }

    /// Copy `rank`'s slice out of `full` into `local`.
    pub fn scatter(&self, full: &[u8], rank: usize, local: &mut [u8]) -> Result<()> {
        self.check_sizes("SliceLayout::scatter", full.len(), rank, local.len())?;
        for run in self.runs(rank) {
            local[run.local..run.local + run.len]
                .copy_from_slice(&full[run.full..run.full + run.len]);
        }
        Ok(())
    }

    /// Copy `rank`'s slice from `local` into its place in `full` (other bytes untouched).
    pub fn gather_into(&self, local: &[u8], rank: usize, full: &mut [u8]) -> Result<()> {
        self.check_sizes("SliceLayout::gather_into", full.len(), rank, local.len())?;
        for run in self.runs(rank) {
            full[run.full..run.full + run.len]
                .copy_from_slice(&local[run.local..run.local + run.len]);
        }
        Ok(())
    }

    /// An error unless `full` and `local` are exactly this layout's sizes for `rank`.
    pub fn check_sizes(
        &self,
        op: &'static str,
        full: usize,
        rank: usize,
        local: usize,
    ) -> Result<()> {
        if rank >= self.world {
            return Err(Error::InvalidOp {
                op,
                reason: format!("rank {rank} out of range for a {}-rank layout", self.world),
            });
        }
        if full != self.full_bytes() || local != self.local_bytes(rank) {
            return Err(Error::InvalidOp {
                op,
                reason: format!(
                    "buffer sizes full {full} B, local {local} B; the layout needs full {} B, \
                     local {} B for rank {rank}",
                    self.full_bytes(),
                    self.local_bytes(rank)
                ),
            });
        }
        Ok(())
    }

    /// A short description for error messages.
    pub fn describe(&self) -> String {
        let segs: Vec<&[usize]> = self.extents.chunks(self.world).collect();
        format!(
            "outer {} x unit {} B, extents {:?}",
            self.outer, self.unit_bytes, segs
        )
    }
}

/// FNV-1a over the layout's defining numbers (FNV: Fowler-Noll-Vo, 64-bit offset basis and
/// prime as published by its authors).
fn fingerprint(outer: usize, unit_bytes: usize, world: usize, extents: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |v: usize| {
        for b in (v as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(outer);
    eat(unit_bytes);
    eat(world);
    eat(extents.len());
    extents.iter().for_each(|&e| eat(e));
    h
}

/// Iterator over the [`Run`]s of one rank (see [`SliceLayout::runs`]).
pub struct Runs<'a> {
    layout: &'a SliceLayout,
    rank: usize,
    o: usize,
    s: usize,
    pending: Option<Run>,
}

impl Runs<'_> {
    /// The next non-empty raw run, unmerged.
    fn raw(&mut self) -> Option<Run> {
        let l = self.layout;
        if self.rank >= l.world {
            return None;
        }
        let n_seg = l.n_segments();
        while self.o < l.outer {
            while self.s < n_seg {
                let i = self.s * l.world + self.rank;
                self.s += 1;
                let len = l.extents[i] * l.unit_bytes;
                if len > 0 {
                    return Some(Run {
                        full: self.o * l.full_rep + l.full_off[i],
                        local: self.o * l.local_rep[self.rank] + l.local_off[i],
                        len,
                    });
                }
            }
            self.s = 0;
            self.o += 1;
        }
        None
    }
}

impl Iterator for Runs<'_> {
    type Item = Run;

    fn next(&mut self) -> Option<Run> {
        let mut cur = self.pending.take().or_else(|| self.raw())?;
        while let Some(next) = self.raw() {
            if next.full == cur.full + cur.len && next.local == cur.local + cur.len {
                cur.len += next.len;
            } else {
                self.pending = Some(next);
                break;
            }
        }
        Some(cur)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_follow_the_definition() {
        // 2 outer reps, segments {Q: [2, 1], K: [1, 0]}, unit 3 bytes.
        let l = SliceLayout::new(2, 3, &[[2, 1], [1, 0]]).unwrap();
        assert_eq!(l.full_bytes(), 2 * (2 + 1 + 1) * 3);
        assert_eq!(l.local_bytes(0), 2 * 3 * 3);
        assert_eq!(l.local_bytes(1), 2 * 3);
        let r0: Vec<Run> = l.runs(0).collect();
        assert_eq!(
            r0,
            vec![
                Run {
                    full: 0,
                    local: 0,
                    len: 6
                },
                // K of repetition 0 and Q of repetition 1 are adjacent on both sides: merged.
                Run {
                    full: 9,
                    local: 6,
                    len: 9
                },
                Run {
                    full: 21,
                    local: 15,
                    len: 3
                },
            ]
        );
        let r1: Vec<Run> = l.runs(1).collect();
        assert_eq!(
            r1,
            vec![
                Run {
                    full: 6,
                    local: 0,
                    len: 3
                },
                Run {
                    full: 18,
                    local: 3,
                    len: 3
                }
            ]
        );
    }

    #[test]
    fn a_rank_holding_everything_is_one_run() {
        let l = SliceLayout::new(5, 4, &[[0, 3, 0], [0, 2, 0]]).unwrap();
        assert_eq!(
            l.runs(1).collect::<Vec<_>>(),
            vec![Run {
                full: 0,
                local: 0,
                len: 100
            }]
        );
        assert_eq!(l.runs(0).count(), 0);
        assert_eq!(l.runs(7).count(), 0);
    }

    #[test]
    fn bad_layouts_are_errors() {
        let none: [[usize; 2]; 0] = [];
        assert!(SliceLayout::new(1, 4, &none).is_err());
        let empty: [[usize; 0]; 1] = [[]];
        assert!(SliceLayout::new(1, 4, &empty).is_err());
        assert!(SliceLayout::new(1, 4, &[vec![1, 2], vec![3]]).is_err());
        assert!(SliceLayout::single(1, usize::MAX / 2, &[1, 2]).is_err());
        assert!(SliceLayout::single(usize::MAX, 2, &[1, 0]).is_err());
        assert!(SliceLayout::single(1, 1, &[usize::MAX, 1]).is_err());
        // Empty tensors are fine.
        assert_eq!(SliceLayout::single(0, 4, &[1, 2]).unwrap().full_bytes(), 0);
    }

    #[test]
    fn wrong_buffer_sizes_are_errors() {
        let l = SliceLayout::single(1, 2, &[1, 2]).unwrap();
        let full = [0u8; 6];
        let mut local = [0u8; 2];
        l.scatter(&full, 0, &mut local).unwrap();
        assert!(l.scatter(&full, 1, &mut local).is_err());
        assert!(l.scatter(&full[..5], 0, &mut local).is_err());
        assert!(l.scatter(&full, 2, &mut local).is_err());
    }

    #[test]
    fn fingerprints_tell_layouts_apart() {
        let a = SliceLayout::single(1, 4, &[1, 2]).unwrap();
        let b = SliceLayout::single(1, 4, &[2, 1]).unwrap();
        let c = SliceLayout::new(1, 4, &[[1], [2]]).unwrap();
        let d = SliceLayout::single(1, 4, &[1, 2]).unwrap();
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.fingerprint(), c.fingerprint());
        assert_eq!(a.fingerprint(), d.fingerprint());
    }
}
