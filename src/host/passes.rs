//! The host's passes over a block's elements: the gradient reduce over stretches of adjacent
//! tensors, and AdamW's weights and moments passes over runs of them ([`Block::runs`]), each
//! dispatched to mt's kernel for the way the master, moments and gradient are held.

use crate::elem::{GradAcc, GradElem};
use crate::layout::Block;
use crate::layout::shards::Shards;
use crate::optim::{
    AdamWStep, Moments, WeightsMut, adamw_moments, adamw_moments_bf16, adamw_update,
    adamw_update_bf16_master, adamw_update_bf16_moments, adamw_update_split,
};
use crate::shm::host::{GradSlabs, Store};
use half::bf16;

use super::{AdamMoments, HostState, Master, store_bf16};

impl HostState {
    /// The runs of block `block` ([`Block::runs`]) as far as this node owns them. AdamW
    /// is elementwise (a bf16 master or moments round by layout index), so a run gives the
    /// bits its tensors give one by one, in one parallel pass instead of one per tensor.
    pub(super) fn runs(&self, block: usize) -> Vec<Run> {
        let shards = self.shards.as_ref().map(|s| &s.0);
        let runs = self.layout.blocks[block].runs();
        runs.into_iter()
            .filter_map(|(r, decay)| {
                let (range, local) = owned(shards, block, r)?;
                Some(Run {
                    range,
                    local,
                    decay,
                })
            })
            .collect()
    }
}

/// Adjacent elements of a block that one AdamW call updates ([`HostState::runs`]).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Run {
    /// Layout indices.
    pub(super) range: std::ops::Range<usize>,
    /// Where they start in the master and moments.
    pub(super) local: usize,
    pub(super) decay: bool,
}

/// Reduces every tensor range of block `b` in `part` into `grad` (the whole model's
/// accumulator): adjacent tensors in one parallel pass each, with the bits of one pass per
/// tensor ([`GradSlabs::reduce_segments_into`]). Returns Σ g² over them, tensor by tensor
/// in layout order.
pub(super) fn reduce_tensors<D: GradAcc>(
    slabs: &GradSlabs,
    b: &Block,
    part: std::ops::Range<usize>,
    grad: &mut [D],
    slots: &[usize],
    first: bool,
    last: bool,
) -> f64 {
    // (elements of the block, tensor lengths) of each stretch of adjacent tensors.
    let mut runs: Vec<(std::ops::Range<usize>, Vec<usize>)> = Vec::new();
    for (t, within) in b.part_tensors(part.clone()) {
        let r = t.offset + within.start..t.offset + within.end;
        match runs.last_mut() {
            Some((run, lens)) if run.end == r.start => {
                run.end = r.end;
                lens.push(r.len());
            }
            _ => runs.push((r.clone(), vec![r.len()])),
        }
    }
    let sums: Vec<f64> = runs
        .into_iter()
        .flat_map(|(run, lens)| {
            let dst = &mut grad[b.offset + run.start..b.offset + run.end];
            let in_slot = run.start - part.start;
            slabs.reduce_segments_into(dst, slots, in_slot, &lens, first, last)
        })
        .collect();
    sums.iter().sum()
}

/// Where a run of elements is: its layout index (the store, the gradient, the bits of
/// stochastic rounding) and its index in the master and moments (the same, unless they
/// hold this node's pieces only).
#[derive(Clone, Copy)]
pub(super) struct Place {
    pub(super) global: usize,
    pub(super) local: usize,
}

/// Layout range `r` of block `block` as far as this node updates it, and where that
/// starts in the master and moments; `None` where this node owns none of it.
pub(super) fn owned(
    shards: Option<&Shards>,
    block: usize,
    r: std::ops::Range<usize>,
) -> Option<(std::ops::Range<usize>, usize)> {
    let Some(s) = shards else {
        return Some((r.clone(), r.start));
    };
    let mine = s.mine(block);
    let r = r.start.max(mine.start)..r.end.min(mine.end);
    (r.start < r.end).then(|| (r.clone(), s.local(block, r.start)))
}

/// A stretch of the master weights as one AdamW call updates it: its fp32 values, a split
/// master's low halves (the high halves are the store's), or a bf16 master's seed (the
/// store is the master).
pub(super) enum MasterSlice<'a> {
    F32(&'a mut [f32]),
    Split(&'a mut [u16]),
    Bf16 { seed: u64 },
}

/// The same stretch of Adam's m and v.
pub(super) enum MomentSlices<'a> {
    F32 {
        m: &'a mut [f32],
        v: &'a mut [f32],
    },
    Bf16 {
        m: &'a mut [bf16],
        v: &'a mut [bf16],
        seed: u64,
    },
}

/// AdamW on `g.len()` elements at `at` of the master, the store and the moments.
#[allow(clippy::too_many_arguments)]
pub(super) fn update<G: GradElem>(
    master: &mut Master,
    store: &mut Store,
    adam: &mut AdamMoments,
    g: &[G],
    at: Place,
    hp: &AdamWStep,
    decay: bool,
    moments: Moments,
) {
    let l = at.local..at.local + g.len();
    let p = match master {
        Master::F32(p) => MasterSlice::F32(p.range_mut(l.clone())),
        Master::Split(lo) => MasterSlice::Split(lo.range_mut(l.clone())),
        Master::Bf16 { seed } => MasterSlice::Bf16 { seed: *seed },
    };
    let adam = match adam {
        AdamMoments::F32 { m, v } => MomentSlices::F32 {
            m: m.range_mut(l.clone()),
            v: v.range_mut(l),
        },
        AdamMoments::Bf16 { m, v, seed } => MomentSlices::Bf16 {
            m: m.range_mut(l.clone()),
            v: v.range_mut(l),
            seed: *seed,
        },
    };
    update_slices(p, store, adam, g, at.global, hp, decay, moments)
}

/// AdamW on `g.len()` elements: the master's and moments' stretches `p` and `adam` (held
/// in RAM or read from the drives), the store's and the gradient's at layout index `start`
/// (also the element index of stochastic rounding's bits).
#[allow(clippy::too_many_arguments)]
pub(super) fn update_slices<G: GradElem>(
    p: MasterSlice,
    store: &mut Store,
    adam: MomentSlices,
    g: &[G],
    start: usize,
    hp: &AdamWStep,
    decay: bool,
    moments: Moments,
) {
    let r = start..start + g.len();
    let (m, v, seed) = match adam {
        MomentSlices::F32 { m, v } => {
            return match p {
                MasterSlice::F32(p) => {
                    let s = store.out_mut(r);
                    adamw_update(p, g, m, v, s, hp, decay, moments)
                }
                MasterSlice::Split(lo) => {
                    let hi = store_bf16(store, r);
                    adamw_update_split(hi, lo, g, m, v, hp, decay, moments)
                }
                MasterSlice::Bf16 { seed } => {
                    let p = store_bf16(store, r);
                    let at = start as u64;
                    adamw_update_bf16_master(p, g, m, v, hp, decay, seed, at, moments)
                }
            };
        }
        MomentSlices::Bf16 { m, v, seed } => (m, v, seed),
    };
    let w = match p {
        MasterSlice::F32(p) => WeightsMut::F32 {
            p,
            store: store.out_mut(r),
        },
        MasterSlice::Split(lo) => WeightsMut::Split {
            hi: store_bf16(store, r),
            lo,
        },
        MasterSlice::Bf16 { seed } => WeightsMut::Bf16 {
            p: store_bf16(store, r),
            seed,
        },
    };
    adamw_update_bf16_moments(w, g, m, v, hp, decay, seed, start as u64, moments)
}

/// The moments pass of update `hp` on `g.len()` elements at `at`.
pub(super) fn moments_pass<G: GradElem>(
    adam: &mut AdamMoments,
    g: &[G],
    at: Place,
    hp: &AdamWStep,
) {
    let (start, r) = (at.global, at.local..at.local + g.len());
    match adam {
        AdamMoments::F32 { m, v } => adamw_moments(g, m.range_mut(r.clone()), v.range_mut(r), hp),
        AdamMoments::Bf16 { m, v, seed } => {
            let (m, v) = (m.range_mut(r.clone()), v.range_mut(r));
            adamw_moments_bf16(g, m, v, hp, *seed, start as u64)
        }
    }
}
