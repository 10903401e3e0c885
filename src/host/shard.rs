//! The host state across nodes: the gradient exchange, and with `nodes.shard_state` the
//! master weights and moments held as this node's pieces of every block
//! ([`crate::layout::shards`]).
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
//! moments) block by block, each block in windows of at most [`GATHER_WINDOW`] elements
//! (`$MT_GATHER_WINDOW` in tests), and writes each window at its offsets before gathering
//! the next ([`HostState::gather_blocks`]), in the format one node writes, so a checkpoint
//! of a sharded run resumes on any number of nodes (each node reads its pieces of the whole
//! state: [`HostState::restore_sharded`]). Node 0 holds one window of the master and
//! moments beyond its share (0.2 GB in float32), never a whole block: the largest blocks
//! (a 27B model's embedding: 1.27e9 elements, 15 GB at 12 bytes) would otherwise set its
//! peak.

use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use crate::checkpoint::state::{BlockValues, Field, Saved, Tensors, TrainState};
use crate::checkpoint::{MasterMut, MasterRef};
use crate::elem::GradElem;
use crate::elem::bits;
use crate::layout::Layout;
use crate::layout::shards::{GATHER_WINDOW, Shards, piece, windows};
use crate::optim::StoreOut;
use crate::shm::huge::zeroed;
use half::bf16;

use super::{AdamMoments, Grad, HostState, Master, store_bf16, sum_sq};
use crate::Result;

use super::peers::{Elems, Peers};

/// One window of a block of the master or a moment, gathered on node 0 (the largest
/// window's size, reused window after window; empty on the other nodes).
enum Whole {
    F32(Vec<f32>),
    U16(Vec<u16>),
    Bf16(Vec<bf16>),
}

/// A node's local buffer of pieces (the master or a moment), by dtype.
enum Local<'a> {
    F32(&'a [f32]),
    U16(&'a [u16]),
    Bf16(&'a [bf16]),
}

impl Whole {
    /// A buffer of `n` elements of `local`'s dtype.
    fn like(local: &Local, n: usize) -> Whole {
        match local {
            Local::F32(_) => Whole::F32(zeroed(n)),
            Local::U16(_) => Whole::U16(zeroed(n)),
            Local::Bf16(_) => Whole::Bf16(zeroed(n)),
        }
    }

    /// Gathers each rank's part of a window (this rank's: elements `l` of `local`; `parts`
    /// within the window) into the first `keep` elements (the window on node 0, none
    /// elsewhere).
    fn gather(
        &mut self,
        peers: &dyn Peers,
        what: &str,
        local: &Local,
        l: Range<usize>,
        keep: usize,
        parts: &[Range<usize>],
    ) -> Result<()> {
        match (local, self) {
            (Local::F32(x), Whole::F32(a)) => {
                peers.gather_pieces(what, (&x[l]).into(), (&mut a[..keep]).into(), parts)
            }
            (Local::U16(x), Whole::U16(a)) => {
                peers.gather_pieces(what, (&x[l]).into(), (&mut a[..keep]).into(), parts)
            }
            (Local::Bf16(x), Whole::Bf16(a)) => {
                peers.gather_pieces(what, (&x[l]).into(), (&mut a[..keep]).into(), parts)
            }
            _ => unreachable!("a gathered block has its pieces' dtype"),
        }
    }

    /// The first `n` elements, as a checkpoint reads a moment.
    fn moment(&self, n: usize) -> MasterRef<'_> {
        match self {
            Whole::F32(x) => MasterRef::F32(&x[..n]),
            Whole::Bf16(x) => MasterRef::Bf16(&x[..n]),
            Whole::U16(_) => unreachable!("moments are f32 or bf16"),
        }
    }
}

/// Where [`HostState::gather_blocks`] hands node 0 each window's values: the block, the
/// window's elements within it, and their values (element 0 is the window's first).
pub type WriteWindow<'a> =
    &'a mut dyn FnMut(usize, Range<usize>, &dyn BlockValues) -> crate::Result<()>;

/// Elements node 0 gathers at a time: [`GATHER_WINDOW`], or `$MT_GATHER_WINDOW` where a
/// test sets a shorter one (the test models' blocks are far below 2^24 elements, so only
/// this makes their blocks gather in several windows). Every rank must read the same.
/// (Checked at start by `mt::switches`.)
fn gather_window() -> Result<usize> {
    Ok(crate::switches::get()
        .gather_window
        .unwrap_or(GATHER_WINDOW))
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
    pub fn exchange_block(&mut self, block: usize, peers: &dyn Peers) -> Result<Vec<f64>> {
        let pieces = self.pieces(block, peers.size());
        let r = self.layout.blocks[block].range();
        let what = format!("the gradient exchange of block {block}");
        let sharded = self.shards.is_some();
        match &mut self.grad {
            Grad::F32(g) => exchange(peers, &what, &mut g[r], &pieces, sharded),
            Grad::Bf16(g) => exchange(peers, &what, &mut g[r], &pieces, sharded),
        }
    }

    /// Gives every node the store pieces of block `block` the others updated.
    pub fn gather_store(&mut self, block: usize) -> Result<()> {
        let Some((_, peers)) = &self.shards else {
            return Ok(());
        };
        let peers: &dyn Peers = *peers;
        let pieces = self.pieces(block, peers.size());
        let what = format!("the weights exchange of block {block}");
        match self.store.out_mut(self.layout.blocks[block].range()) {
            StoreOut::F32(s) => peers.allgather_pieces(&what, s.into(), &pieces),
            StoreOut::Bf16(s) => peers.allgather_pieces(&what, s.into(), &pieces),
        }
    }

    /// [`HostState::init_master`] of a sharded master: `fill` makes the whole master a
    /// piece at a time ([`MasterMut::Sink`]); each piece goes into the store, and its
    /// elements in this node's pieces of the blocks into the node's master (a split one's
    /// low halves). No whole copy is held, so the start-up peak is the plan's.
    pub(super) fn init_master_sharded(
        &mut self,
        fill: impl FnOnce(&Layout, &mut MasterMut) -> crate::Result<()>,
    ) -> Result<()> {
        let n = self.layout.total;
        let rounded = AtomicU64::new(0);
        let shards = &self.shards.as_ref().expect("sharded").0;
        match &mut self.master {
            Master::F32(local) => {
                let local = Striped::new(local.as_mut_slice());
                let store = match self.store.out_mut(0..n) {
                    StoreOut::F32(s) => Store::F32(Striped::new(s)),
                    StoreOut::Bf16(s) => Store::Bf16(Striped::new(s)),
                };
                let put = |first: usize, x: &[f32]| match &store {
                    Store::F32(s) => put_piece(shards, first, x, (s, |v| v), (&local, |v| v)),
                    Store::Bf16(s) => {
                        put_piece(shards, first, x, (s, bf16::from_f32), (&local, |v| v))
                    }
                };
                fill(&self.layout, &mut MasterMut::Sink { len: n, put: &put })?;
            }
            Master::Split(local) => {
                let local = Striped::new(local.as_mut_slice());
                let hi = Striped::new(store_bf16(&mut self.store, 0..n));
                let put = |first: usize, x: &[f32]| {
                    let hi = (&hi, |v| bits::split(v).0);
                    put_piece(shards, first, x, hi, (&local, |v| bits::split(v).1))
                };
                fill(&self.layout, &mut MasterMut::Sink { len: n, put: &put })?;
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
        let (shards, peers) = self.shards.clone().expect("sharded");
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
                peers.rank()
            );
        }
        self.updates = saved.state.updates;
        Ok(saved.state)
    }

    /// The longest window [`HostState::gather_blocks`] gathers: the gather window, or the
    /// largest block where that is shorter.
    pub fn gather_window_len(&self) -> Result<usize> {
        if let Some(d) = &self.drives {
            return Ok(self.layout.max_block_len().min(d.window()));
        }
        Ok(self.layout.max_block_len().min(gather_window()?))
    }

    /// Gathers every block's master (and with `moments`, m and v) on node 0, block after
    /// block in layout order, each in windows of at most [`gather_window`] elements into
    /// buffers of that size, and hands each window's values to `write` there before the
    /// next window is gathered (`None` on the other nodes, which send their parts). Every
    /// node makes every window's gathers whatever `write` returns: after its first error
    /// node 0 only gathers, so no node waits in a gather node 0 skipped. The outer error is
    /// a failed gather (every node fails); the inner one `write`'s first.
    pub fn gather_blocks(
        &mut self,
        moments: bool,
        mut write: Option<WriteWindow>,
    ) -> Result<crate::Result<()>> {
        self.settle_moments();
        if self.drives.is_some() {
            return self.read_blocks(moments, write);
        }
        let window = gather_window()?;
        let (shards, peers) = self.shards.as_ref().expect("sharded");
        let (peers, rank): (&dyn Peers, usize) = (*peers, peers.rank());
        let lead = rank == 0;
        let n = if lead {
            self.layout.max_block_len().min(window)
        } else {
            0
        };
        let store = self.store.bf16();
        let master = match &self.master {
            Master::F32(x) => Some(Local::F32(x.as_slice())),
            Master::Split(lo) => Some(Local::U16(lo.as_slice())),
            Master::Bf16 { .. } => None,
        };
        let (m, v) = match &self.moments {
            _ if !moments => (None, None),
            AdamMoments::F32 { m, v } => (
                Some(Local::F32(m.as_slice())),
                Some(Local::F32(v.as_slice())),
            ),
            AdamMoments::Bf16 { m, v, .. } => (
                Some(Local::Bf16(m.as_slice())),
                Some(Local::Bf16(v.as_slice())),
            ),
        };
        let fields: Vec<Local> = [master, m, v].into_iter().flatten().collect();
        let mut bufs: Vec<Whole> = fields.iter().map(|f| Whole::like(f, n)).collect();
        let mut written = Ok(());
        for b in 0..self.layout.blocks.len() {
            let (pieces, l) = (self.pieces(b, peers.size()), shards.local_range(b));
            let at = self.layout.blocks[b].offset;
            for w in windows(&pieces, window) {
                // Each rank's part within the window, and this rank's in its local buffers.
                let parts: Vec<Range<usize>> = w
                    .parts
                    .iter()
                    .map(|p| p.start - w.range.start..p.end - w.range.start)
                    .collect();
                let mine = w.within(rank, &pieces[rank]);
                let local = l.start + mine.start..l.start + mine.end;
                let (len, keep) = (w.range.len(), if lead { w.range.len() } else { 0 });
                let what = format!(
                    "the state gather of block {b} (elements {}..{})",
                    w.range.start, w.range.end
                );
                for (f, buf) in fields.iter().zip(&mut bufs) {
                    buf.gather(peers, &what, f, local.clone(), keep, &parts)?;
                }
                let Some(write) = write.as_mut().filter(|_| written.is_ok()) else {
                    continue;
                };
                let mut got = bufs.iter();
                let global = at + w.range.start..at + w.range.end;
                let hi =
                    || &store.expect("a split or bf16 master has a bf16 store")[global.clone()];
                let master = match &self.master {
                    Master::F32(_) => match got.next() {
                        Some(Whole::F32(x)) => MasterRef::F32(&x[..len]),
                        _ => unreachable!("an fp32 master is gathered in fp32"),
                    },
                    Master::Split(_) => match got.next() {
                        Some(Whole::U16(lo)) => MasterRef::Split {
                            hi: hi(),
                            lo: &lo[..len],
                        },
                        _ => unreachable!("a split master's low halves are gathered"),
                    },
                    Master::Bf16 { .. } => MasterRef::Bf16(hi()),
                };
                let values = match (got.next(), got.next()) {
                    (Some(m), Some(v)) => Tensors {
                        master,
                        m: m.moment(len),
                        v: v.moment(len),
                    },
                    _ => Tensors::master_only(master),
                };
                written = write(b, w.range.clone(), &values);
            }
        }
        Ok(written)
    }
}

/// Where the elements of global range `r` that this node keeps go: (range of the node's
/// local buffers, range within `r`), one pair per block whose piece `r` meets.
fn kept(shards: &Shards, r: Range<usize>) -> impl Iterator<Item = (Range<usize>, Range<usize>)> {
    // The first block whose piece ends past r.start (the pieces run in block order).
    let (mut first, mut past) = (0, shards.blocks());
    while first < past {
        let mid = (first + past) / 2;
        match shards.mine(mid).end <= r.start {
            true => first = mid + 1,
            false => past = mid,
        }
    }
    (first..shards.blocks())
        .map(move |b| (b, shards.mine(b)))
        .take_while(move |(_, mine)| mine.start < r.end)
        .filter_map(move |(b, mine)| {
            let (lo, hi) = (mine.start.max(r.start), mine.end.min(r.end));
            (lo < hi).then(|| {
                let at = shards.local(b, lo);
                (at..at + (hi - lo), lo - r.start..hi - r.start)
            })
        })
}

/// Piece `x` of a fresh master (elements `first..`) written into the store whole and into
/// the node's master where this node keeps it, each value converted by the pair's function.
fn put_piece<S, L>(
    shards: &Shards,
    first: usize,
    x: &[f32],
    (store, to_store): (&Striped<S>, impl Fn(f32) -> S),
    (local, to_local): (&Striped<L>, impl Fn(f32) -> L),
) {
    fn convert<T>(d: &mut [T], x: &[f32], f: &impl Fn(f32) -> T) {
        d.iter_mut().zip(x).for_each(|(d, x)| *d = f(*x))
    }
    let r = first..first + x.len();
    store.write(r.clone(), |d, i| convert(d, &x[i], &to_store));
    for (to, from) in kept(shards, r) {
        let x = &x[from];
        local.write(to, |d, i| convert(d, &x[i], &to_local));
    }
}

/// Elements per lock of a [`Striped`] slice: a piece of the fill ([`crate::checkpoint::master::PIECE`]
/// elements) meets at most two stripes.
const STRIPE: usize = crate::checkpoint::master::PIECE;

/// A slice written from several threads at once, each element by one of them, through one
/// lock per stripe of [`STRIPE`] elements (uncontended but at a shared stripe's edge).
pub(super) struct Striped<'a, T> {
    stripes: Vec<Mutex<&'a mut [T]>>,
}

impl<'a, T> Striped<'a, T> {
    pub(super) fn new(x: &'a mut [T]) -> Self {
        Striped {
            stripes: x.chunks_mut(STRIPE).map(Mutex::new).collect(),
        }
    }

    /// Writes elements `r`: `f(dst, within)` for each stripe's share, `dst` its elements and
    /// `within` their place in `r` (from 0).
    pub(super) fn write(&self, r: Range<usize>, mut f: impl FnMut(&mut [T], Range<usize>)) {
        let mut at = r.start;
        while at < r.end {
            let (s, off) = (at / STRIPE, at % STRIPE);
            let n = (STRIPE - off).min(r.end - at);
            let mut stripe = self.stripes[s].lock().expect("a writer panicked");
            f(&mut stripe[off..off + n], at - r.start..at - r.start + n);
            at += n;
        }
    }
}

/// The store as [`HostState::init_master_sharded`] writes it.
pub(super) enum Store<'a> {
    F32(Striped<'a, f32>),
    Bf16(Striped<'a, bf16>),
}

/// [`HostState::exchange_block`] on the block's gradient `g`.
fn exchange<G: GradElem + Sync>(
    peers: &dyn Peers,
    what: &str,
    g: &mut [G],
    pieces: &[Range<usize>],
    sharded: bool,
) -> Result<Vec<f64>>
where
    for<'a> &'a mut [G]: Into<Elems<'a>>,
{
    let mine = pieces[peers.rank()].clone();
    peers.reduce_scatter_pieces(what, (&mut *g).into(), pieces)?;
    if sharded {
        return Ok(vec![sum_sq(&g[mine])]);
    }
    peers.allgather_pieces(what, (&mut *g).into(), pieces)?;
    Ok(pieces.iter().map(|p| sum_sq(&g[p.clone()])).collect())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::hf::{HfConfig, ModelSpec};

    use super::*;

    /// [`kept`] sends each element of any range that this node keeps to the place
    /// [`Shards`] gives it, once, and no other: the whole layout cut into ranges of many
    /// lengths (one element, odd lengths that straddle pieces and blocks, all of it), on
    /// every rank of three, fills the local buffer as copying each block's piece does.
    #[test]
    fn kept_routes_each_kept_element_to_its_local_place_once() {
        let hf: HfConfig = serde_json::from_str(
            r#"{"model_type":"llama","vocab_size":37,"hidden_size":24,"intermediate_size":40,
            "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2}"#,
        )
        .unwrap();
        let layout = Layout::new(&ModelSpec::from_hf(&hf, Path::new("config.json")).unwrap());
        let n = layout.total;
        for rank in 0..3 {
            let shards = Shards::new(&layout, 3, rank);
            let mut want = vec![usize::MAX; shards.len];
            for b in 0..shards.blocks() {
                want[shards.local_range(b)]
                    .iter_mut()
                    .zip(shards.mine(b))
                    .for_each(|(w, g)| *w = g);
            }
            for len in [1, 7, 1000, 4099, n] {
                let mut got = vec![usize::MAX; shards.len];
                for start in (0..n).step_by(len) {
                    let r = start..(start + len).min(n);
                    for (to, from) in kept(&shards, r.clone()) {
                        assert_eq!(to.len(), from.len());
                        for (t, f) in to.zip(from) {
                            assert_eq!(got[t], usize::MAX, "local {t} written twice");
                            got[t] = r.start + f;
                        }
                    }
                }
                assert!(got == want, "rank {rank}, ranges of {len}");
            }
        }
    }
}
