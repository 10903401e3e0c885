//! The host state across nodes: the gradient exchange, and with `nodes.shard_state` the
//! master weights and moments held as this node's pieces of every block
//! ([`mt::layout::shards`]).
//!
//! Each block's gradient, once final on the node, is summed over the nodes by a
//! reduce-scatter over the block's pieces: node r gets the sum of piece r, each piece summed
//! once, by one rank. Replicated, an all-gather then gives every node the whole sum; sharded,
//! node r updates piece r only and the updated store pieces are all-gathered into every
//! node's store, block by block, before the next forward reads the block. Both use the same
//! pieces and the same collectives, so both hold the same gradient bits and compute the
//! same norm: Σ g² of each piece, added block after block (from the last, in exchange
//! order), piece after piece in rank order.
//!
//! A checkpoint or the exported model needs the whole master: node 0 gathers it (and the
//! moments) block by block into a whole copy, written in the format one node writes, so a
//! checkpoint of a sharded run resumes on any number of nodes (each node reads its pieces of
//! the whole state: [`HostState::restore_sharded`]).

use std::ops::Range;
use std::sync::atomic::AtomicU64;

use anyhow::Result;
use half::bf16;
use mt::checkpoint::state::{Field, Saved, TrainState};
use mt::checkpoint::writer::{LentMaster, LentTensors};
use mt::checkpoint::{MasterMut, MasterRef};
use mt::layout::Layout;
use mt::layout::shards::{Shards, piece};
use mt::optim::StoreOut;
use mt::reduce::GradElem;
use mt::shm::huge::zeroed;
use mt::shm::lent::Buf;

use super::{AdamMoments, Grad, HostState, Master, store_bf16, sum_sq};
use crate::mpi::{Elem, Mpi};

/// Node 0's whole copy of a sharded master and moments ([`HostState::gather_state`]).
pub struct Gathered {
    /// The fp32 master, or a split master's low halves; none for a bf16 master (the store).
    master: Option<Whole>,
    /// Empty where not gathered (a model-only checkpoint, the export).
    m: Whole,
    v: Whole,
}

enum Whole {
    F32(Buf<f32>),
    U16(Buf<u16>),
    Bf16(Buf<bf16>),
}

impl HostState {
    /// Whether the master and moments hold this node's pieces only.
    pub fn sharded(&self) -> bool {
        self.shards.is_some()
    }

    /// Every rank's piece of block `block` (within the block) on `nodes` nodes.
    fn pieces(&self, block: usize, nodes: usize) -> Vec<Range<usize>> {
        let len = self.layout.blocks[block].len;
        (0..nodes).map(|r| piece(len, nodes, r)).collect()
    }

    /// Sums block `block`'s gradient, final on this node, over every node (a reduce-scatter
    /// of its pieces, each summed by one rank: the same bits on every node; replicated, then
    /// an all-gather) and returns Σ g² of each piece this node holds summed: every piece,
    /// or sharded, its own. The block's gaps are zero on every node and stay so.
    pub fn exchange_block(&mut self, block: usize, mpi: &Mpi) -> Result<Vec<f64>> {
        let pieces = self.pieces(block, mpi.size);
        let r = self.layout.blocks[block].range();
        let what = format!("the gradient exchange of block {block}");
        let sharded = self.shards.is_some();
        match &mut self.grad {
            Grad::F32(g) => exchange(mpi, &what, &mut g[r], &pieces, sharded),
            Grad::Bf16(g) => exchange(mpi, &what, &mut g[r], &pieces, sharded),
        }
    }

    /// Gives every node the store pieces of block `block` the others updated.
    pub fn gather_store(&mut self, block: usize) -> Result<()> {
        let Some((_, mpi)) = &self.shards else {
            return Ok(());
        };
        let mpi: &Mpi = mpi;
        let pieces = self.pieces(block, mpi.size);
        let what = format!("the weights exchange of block {block}");
        match self.store.out_mut(self.layout.blocks[block].range()) {
            StoreOut::F32(s) => mpi.allgather_pieces(&what, s, &pieces),
            StoreOut::Bf16(s) => mpi.allgather_pieces(&what, s, &pieces),
        }
    }

    /// [`HostState::init_master`] of a sharded master: `fill` writes a whole master (and
    /// the store from it), of which this node keeps its pieces. The whole fp32 master (or
    /// a split one's low halves) is held only meanwhile, at start-up.
    pub(super) fn init_master_sharded(
        &mut self,
        fill: impl FnOnce(&Layout, &mut MasterMut) -> mt::Result<()>,
    ) -> Result<()> {
        let n = self.layout.total;
        let rounded = AtomicU64::new(0);
        let shards = &self.shards.as_ref().expect("sharded").0;
        match &mut self.master {
            Master::F32(local) => {
                let mut whole: Vec<f32> = zeroed(n);
                fill(&self.layout, &mut MasterMut::F32(&mut whole))?;
                self.store.write_all(&whole);
                keep_pieces(shards, &whole, local.as_mut_slice());
            }
            Master::Split(local) => {
                let mut lo: Vec<u16> = zeroed(n);
                let hi = store_bf16(&mut self.store, 0..n);
                fill(&self.layout, &mut MasterMut::Split { hi, lo: &mut lo })?;
                keep_pieces(shards, &lo, local.as_mut_slice());
            }
            Master::Bf16 { .. } => {
                let p = store_bf16(&mut self.store, 0..n);
                fill(
                    &self.layout,
                    &mut MasterMut::Bf16 {
                        p,
                        rounded: &rounded,
                    },
                )?;
            }
        }
        Ok(())
    }

    /// [`HostState::restore`] of a sharded state: this node reads its pieces of the
    /// checkpoint's whole master and moments (written by any number of nodes), writes its
    /// pieces of the store, and gathers the others'.
    pub(super) fn restore_sharded(&mut self, dir: &std::path::Path) -> Result<TrainState> {
        let saved = Saved::open(dir, &self.layout)?;
        let (shards, mpi) = self.shards.clone().expect("sharded");
        let (rounded, moments_rounded) = (AtomicU64::new(0), AtomicU64::new(0));
        for b in 0..self.layout.blocks.len() {
            let (g, l) = (shards.mine(b), shards.local_range(b));
            let mut master = match &mut self.master {
                Master::F32(x) => MasterMut::F32(x.range_mut(l.clone())),
                Master::Split(lo) => MasterMut::Split {
                    hi: store_bf16(&mut self.store, g.clone()),
                    lo: lo.range_mut(l.clone()),
                },
                Master::Bf16 { .. } => MasterMut::Bf16 {
                    p: store_bf16(&mut self.store, g.clone()),
                    rounded: &rounded,
                },
            };
            saved.read(Field::Master, g.start, &mut master)?;
            if let Master::F32(x) = &self.master {
                let x = &x.as_slice()[l.clone()];
                match self.store.out_mut(g.clone()) {
                    StoreOut::F32(s) => s.copy_from_slice(x),
                    StoreOut::Bf16(s) => s.iter_mut().zip(x).for_each(|(d, x)| {
                        *d = bf16::from_f32(*x);
                    }),
                }
            }
            let (mut m, mut v) = match &mut self.moments {
                AdamMoments::F32 { m, v } => (
                    MasterMut::F32(m.range_mut(l.clone())),
                    MasterMut::F32(v.range_mut(l)),
                ),
                AdamMoments::Bf16 { m, v, .. } => (
                    MasterMut::Bf16 {
                        p: m.range_mut(l.clone()),
                        rounded: &moments_rounded,
                    },
                    MasterMut::Bf16 {
                        p: v.range_mut(l),
                        rounded: &moments_rounded,
                    },
                ),
            };
            saved.read(Field::M, g.start, &mut m)?;
            saved.read(Field::V, g.start, &mut v)?;
        }
        for b in 0..self.layout.blocks.len() {
            self.gather_store(b)?;
        }
        let rounded = (rounded.into_inner(), moments_rounded.into_inner());
        if rounded != (0, 0) {
            tracing::warn!(
                master = rounded.0,
                moments = rounded.1,
                "{}: values of the checkpoint (rank {}) are not bf16 values and were rounded to nearest even for the bfloat16 master or moments: the run does not continue exactly as the saved one would have",
                dir.display(),
                mpi.rank
            );
        }
        self.updates = saved.state.updates;
        Ok(saved.state)
    }

    /// Gathers the sharded master (and with `moments`, the moments) into a whole copy on
    /// node 0, block by block; `None` on the other nodes, and without a sharded state.
    pub fn gather_state(&mut self, moments: bool) -> Result<Option<Gathered>> {
        let Some((shards, mpi)) = self.shards.clone() else {
            return Ok(None);
        };
        self.settle_moments();
        let n = match mpi.rank {
            0 => self.layout.total,
            _ => 0,
        };
        let mut out = Gathered {
            master: match &self.master {
                Master::F32(_) => Some(Whole::F32(Buf::zeroed(n))),
                Master::Split(_) => Some(Whole::U16(Buf::zeroed(n))),
                Master::Bf16 { .. } => None,
            },
            m: Whole::F32(Buf::zeroed(0)),
            v: Whole::F32(Buf::zeroed(0)),
        };
        let moments_n = if moments { n } else { 0 };
        if moments {
            (out.m, out.v) = match &self.moments {
                AdamMoments::F32 { .. } => (
                    Whole::F32(Buf::zeroed(moments_n)),
                    Whole::F32(Buf::zeroed(moments_n)),
                ),
                AdamMoments::Bf16 { .. } => (
                    Whole::Bf16(Buf::zeroed(moments_n)),
                    Whole::Bf16(Buf::zeroed(moments_n)),
                ),
            };
        }
        for b in 0..self.layout.blocks.len() {
            let pieces = self.pieces(b, mpi.size);
            let (l, whole) = (shards.local_range(b), self.layout.blocks[b].range());
            let whole = if mpi.rank == 0 { whole } else { 0..0 };
            let what = format!("the state gather of block {b}");
            let gather = |mine: Whole2, all: &mut Whole| -> Result<()> {
                match (mine, all) {
                    (Whole2::F32(x), Whole::F32(a)) => {
                        mpi.gather_pieces(&what, &x[l.clone()], a.range_mut(whole.clone()), &pieces)
                    }
                    (Whole2::U16(x), Whole::U16(a)) => {
                        mpi.gather_pieces(&what, &x[l.clone()], a.range_mut(whole.clone()), &pieces)
                    }
                    (Whole2::Bf16(x), Whole::Bf16(a)) => {
                        mpi.gather_pieces(&what, &x[l.clone()], a.range_mut(whole.clone()), &pieces)
                    }
                    _ => unreachable!("a whole copy has its piece's dtype"),
                }
            };
            match (&self.master, &mut out.master) {
                (Master::F32(x), Some(all)) => gather(Whole2::F32(x.as_slice()), all)?,
                (Master::Split(x), Some(all)) => gather(Whole2::U16(x.as_slice()), all)?,
                _ => {}
            }
            if moments {
                match &self.moments {
                    AdamMoments::F32 { m, v } => {
                        gather(Whole2::F32(m.as_slice()), &mut out.m)?;
                        gather(Whole2::F32(v.as_slice()), &mut out.v)?;
                    }
                    AdamMoments::Bf16 { m, v, .. } => {
                        gather(Whole2::Bf16(m.as_slice()), &mut out.m)?;
                        gather(Whole2::Bf16(v.as_slice()), &mut out.v)?;
                    }
                }
            }
        }
        Ok((mpi.rank == 0).then_some(out))
    }

    /// The whole master of `g` (node 0's gathered copy), as the export reads it.
    pub fn gathered_master<'a>(&'a self, g: &'a Gathered) -> MasterRef<'a> {
        let store = || {
            self.store
                .bf16()
                .expect("a split or bf16 master has a bf16 store")
        };
        match &g.master {
            Some(Whole::F32(x)) => MasterRef::F32(x.as_slice()),
            Some(Whole::U16(lo)) => MasterRef::Split {
                hi: store(),
                lo: lo.as_slice(),
            },
            _ => MasterRef::Bf16(store()),
        }
    }

    /// `g` lent to the checkpoint writer (which must finish before the store changes).
    pub fn lend_gathered(&self, g: &Gathered) -> LentTensors {
        let store = || {
            self.store
                .lend_bf16()
                .expect("a split or bf16 master has a bf16 store")
        };
        let lend = |w: &Whole| match w {
            Whole::F32(x) => LentMaster::F32(x.lend()),
            Whole::Bf16(x) => LentMaster::Bf16(x.lend()),
            Whole::U16(_) => unreachable!("moments are f32 or bf16"),
        };
        LentTensors {
            master: match &g.master {
                Some(Whole::F32(x)) => LentMaster::F32(x.lend()),
                Some(Whole::U16(lo)) => LentMaster::Split {
                    hi: store(),
                    lo: lo.lend(),
                },
                _ => LentMaster::Bf16(store()),
            },
            m: lend(&g.m),
            v: lend(&g.v),
        }
    }
}

/// Copies this node's pieces of `whole` into `local`.
fn keep_pieces<T: Copy>(shards: &Shards, whole: &[T], local: &mut [T]) {
    for b in 0..shards.blocks() {
        local[shards.local_range(b)].copy_from_slice(&whole[shards.mine(b)]);
    }
}

/// A node's local piece buffer, by dtype.
enum Whole2<'a> {
    F32(&'a [f32]),
    U16(&'a [u16]),
    Bf16(&'a [bf16]),
}

/// [`HostState::exchange_block`] on the block's gradient `g`.
fn exchange<G: Elem + GradElem + Sync>(
    mpi: &Mpi,
    what: &str,
    g: &mut [G],
    pieces: &[Range<usize>],
    sharded: bool,
) -> Result<Vec<f64>> {
    let mine = pieces[mpi.rank].clone();
    let mut sum = g[mine.clone()].to_vec();
    mpi.reduce_scatter_pieces(what, g, pieces, &mut sum)?;
    g[mine.clone()].copy_from_slice(&sum);
    if sharded {
        return Ok(vec![sum_sq(&g[mine])]);
    }
    mpi.allgather_pieces(what, g, pieces)?;
    Ok(pieces.iter().map(|p| sum_sq(&g[p.clone()])).collect())
}
