//! Placing inputs on a meta device: a [`Place`] per input (inline data, a split state, or a
//! partial sum with given per-device pieces), the [`Space`] of states an input may take, and
//! random places in it ([`random_place`]: uneven and zero extents, segments, whole blocks or
//! heads, partial pieces that sum exactly).

use super::case::{Case, Fill, Input, Placement};
use super::rng::Rng;
use metashard::DType;
use metashard::dtype::{bytes_to_f32, f32_to_bytes};
use metashard::split_state::SplitState;

/// How an input reaches the meta device.
#[derive(Clone, Debug)]
pub enum Place {
    /// Inline input data (mirrored, uploaded every run).
    Inline,
    /// Placed in the meta buffer in this state (written through the buffer: a Partial state
    /// gives device 0 the value and the others zeros).
    State(SplitState),
    /// Placed in the meta buffer as Partial with these per-device pieces (bytes of the dtype).
    Partial(Vec<Vec<u8>>),
}

impl Place {
    pub fn state(&self, n: usize) -> SplitState {
        match self {
            Place::Inline => SplitState::mirrored(n),
            Place::State(s) => s.clone(),
            Place::Partial(_) => SplitState::partial(n),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Place::Inline => "Inline".into(),
            Place::State(s) => s.to_string(),
            Place::Partial(_) => "Partial".into(),
        }
    }
}

/// Random extents of `total` (a multiple of `gran`) over `n` devices, in whole `gran` units:
/// even, all on one device, or random cuts (zeros included).
pub fn random_extents(rng: &mut Rng, total: usize, gran: usize, n: usize) -> Vec<usize> {
    let g = gran.max(1);
    assert_eq!(total % g, 0, "total {total} in units of {g}");
    let units = total / g;
    let mut e = vec![0usize; n];
    match rng.below(4) {
        0 => {
            for (d, x) in e.iter_mut().enumerate() {
                *x = units / n + usize::from(d < units % n);
            }
        }
        1 => e[rng.below(n)] = units,
        _ => {
            for _ in 0..units {
                e[rng.below(n)] += 1;
            }
        }
    }
    e.into_iter().map(|x| x * g).collect()
}

/// A random split of dimension `axis` of `ne`, maybe in segments (each a whole number of
/// `gran` units).
pub fn random_split(
    rng: &mut Rng,
    axis: usize,
    ne: [usize; 4],
    gran: usize,
    n: usize,
    segments: bool,
) -> SplitState {
    let g = gran.max(1);
    let units = ne[axis] / g;
    if segments && units >= 2 && rng.chance(1, 3) {
        let nseg = 2 + rng.below(2.min(units - 1));
        // Cut points inside 1..units, distinct and sorted: segments of at least one unit.
        let mut cuts: Vec<usize> = rng.perm(units - 1).into_iter().map(|c| c + 1).collect();
        cuts.truncate(nseg - 1);
        cuts.sort_unstable();
        let mut segs = Vec::new();
        let mut prev = 0;
        for c in cuts.into_iter().chain([units]) {
            segs.push(random_extents(rng, (c - prev) * g, g, n));
            prev = c;
        }
        return SplitState::segmented(axis, &segs);
    }
    SplitState::axis(axis, &random_extents(rng, ne[axis], g, n))
}

/// The states an input may take on a meta device.
#[derive(Clone, Debug)]
pub struct Space {
    pub inline: bool,
    pub mirrored: bool,
    pub partial: bool,
    /// Axes that may be split.
    pub axes: Vec<usize>,
    /// Granularity of extents per axis.
    pub gran: [usize; 4],
    pub segments: bool,
    /// Extra states to choose among (e.g. whole-head or fused-segment splits), taken half the
    /// time when present.
    pub extra: Vec<SplitState>,
}

impl Space {
    /// Everything the input's dtype allows (see [`Space::of`]).
    pub fn any(input: &Input) -> Space {
        Space::of(input.dtype)
    }

    /// Everything a dtype allows: partial for float types, every axis, quantized axis-0
    /// extents in whole blocks, segments.
    pub fn of(dtype: DType) -> Space {
        Space {
            inline: true,
            mirrored: true,
            partial: dtype.is_float(),
            axes: vec![0, 1, 2, 3],
            gran: [dtype.block_size(), 1, 1, 1],
            segments: true,
            extra: Vec::new(),
        }
    }

    pub fn no_partial(mut self) -> Space {
        self.partial = false;
        self
    }

    pub fn axes(mut self, axes: &[usize]) -> Space {
        self.axes = axes.to_vec();
        self
    }

    pub fn gran(mut self, axis: usize, g: usize) -> Space {
        self.gran[axis] = g;
        self
    }

    pub fn extra(mut self, s: SplitState) -> Space {
        self.extra.push(s);
        self
    }
}

/// Per-device pieces of a partial input: random grid values on devices 1.., and device 0 holds
/// the rest. The input's value becomes the sum of the pieces (as rounded to its dtype), which
/// is exact for the grid values used.
pub fn partial_pieces(rng: &mut Rng, input: &mut Input, n: usize) -> Vec<Vec<u8>> {
    let v = input.values();
    let mut pieces: Vec<Vec<f32>> = vec![vec![0.0; v.len()]; n];
    for p in pieces.iter_mut().skip(1) {
        p.iter_mut().for_each(|x| *x = rng.grid());
    }
    for (i, &x) in v.iter().enumerate() {
        let rest: f32 = pieces[1..].iter().map(|p| p[i]).sum();
        pieces[0][i] = x - rest;
    }
    let bytes: Vec<Vec<u8>> = pieces
        .iter()
        .map(|p| f32_to_bytes(input.dtype, p).expect("float piece"))
        .collect();
    // The value is what the pieces sum to after rounding to the dtype.
    let rounded: Vec<Vec<f32>> = bytes
        .iter()
        .map(|b| bytes_to_f32(input.dtype, b, v.len()).expect("piece"))
        .collect();
    let sum: Vec<f32> = (0..v.len())
        .map(|i| rounded.iter().map(|p| p[i]).sum())
        .collect();
    input.fill = Fill::Bytes(f32_to_bytes(input.dtype, &sum).expect("float input"));
    pieces_check(&rounded, &sum);
    bytes
}

fn pieces_check(rounded: &[Vec<f32>], sum: &[f32]) {
    for (i, &s) in sum.iter().enumerate() {
        let again: f32 = rounded.iter().rev().map(|p| p[i]).sum();
        assert_eq!(again, s, "partial pieces must sum exactly in any order");
    }
}

/// A random place in the input's space (partial places rewrite its value to their sum).
pub fn random_place(rng: &mut Rng, input: &mut Input, n: usize) -> Place {
    let space = input.space.clone();
    let mut opts: Vec<u8> = Vec::new();
    if space.inline {
        opts.push(0);
    }
    if space.mirrored {
        opts.push(1);
    }
    if space.partial {
        opts.push(2);
    }
    let axes: Vec<usize> = space
        .axes
        .iter()
        .copied()
        .filter(|&k| input.ne[k].is_multiple_of(space.gran[k].max(1)))
        .collect();
    // Splits are the interesting case: weight them up.
    if !axes.is_empty() {
        opts.extend([3, 3, 3]);
    }
    if !space.extra.is_empty() && (opts.is_empty() || rng.chance(1, 2)) {
        return Place::State(rng.pick(&space.extra));
    }
    match rng.pick(&opts) {
        0 => Place::Inline,
        1 => Place::State(SplitState::mirrored(n)),
        2 => Place::Partial(partial_pieces(rng, input, n)),
        _ => {
            let k = rng.pick(&axes);
            Place::State(random_split(
                rng,
                k,
                input.ne,
                space.gran[k],
                n,
                space.segments,
            ))
        }
    }
}

impl Case {
    /// The case on a meta device of `n` devices, each input in a random place of its space
    /// (inputs must have fixed values: see [`Case::materialized`]).
    pub fn placed_randomly(&self, rng: &mut Rng, n: usize) -> Case {
        let mut c = self.clone();
        let places = c
            .inputs
            .iter_mut()
            .map(|inp| random_place(rng, inp, n))
            .collect();
        c.placement = Some(Placement { n, places });
        c
    }

    /// The case on a meta device of `n` devices with every input mirrored.
    pub fn mirrored(&self, n: usize) -> Case {
        let places = vec![Place::State(SplitState::mirrored(n)); self.inputs.len()];
        self.clone().placed(n, places)
    }
}
