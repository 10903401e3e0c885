//! The host state sharded across N nodes: which elements of each block node r owns.
//!
//! Each block's flat range is cut into N contiguous pieces, piece r for node r, each a
//! multiple of [`ALIGN`] elements long except the last non-empty one, so that the SIMD
//! kernels of AdamW and a bf16 piece start on whole vectors. Node r keeps the master weights
//! and Adam moments of its pieces only, one after the other in block order (its *local*
//! buffers); the gradient reduce-scatter and the store all-gather use the same pieces as
//! their per-rank counts, on every node. A collective over a block longer than one MPI call
//! may count (a C int) runs over [`windows`] of the block, the same on every node.

use std::ops::Range;

use super::Layout;

/// Elements a piece is a multiple of (64 f32 = 256 bytes, 64 bf16 = 128 bytes).
pub const ALIGN: usize = 64;

/// Elements of a block node 0 gathers at a time for a checkpoint or the export of a sharded
/// state (master and moments: 12 bytes each in float32, 0.2 GB): its gather buffers are
/// this long whatever the block (Qwen3.5-27B's embedding has 1.27e9 elements, 15 GB at 12
/// bytes), and each window is written at its offsets before the next is gathered.
/// (`MT_GATHER_WINDOW` may shorten it: the switchboard keeps the bound it checks.)
pub const GATHER_WINDOW: usize = crate::switches::GATHER_WINDOW;

/// The pieces of every block for N nodes, and where node `rank`'s pieces sit in its local
/// buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shards {
    pub nodes: usize,
    pub rank: usize,
    /// By block, every rank's piece as a range of the block (0-based within the block).
    pieces: Vec<Vec<Range<usize>>>,
    /// By block, the global offset of the block.
    offsets: Vec<usize>,
    /// By block, where this rank's piece starts in its local buffers.
    local: Vec<usize>,
    /// Elements this rank owns.
    pub len: usize,
}

/// Piece `rank` of `len` elements over `nodes`: `ceil(len / nodes)` rounded up to [`ALIGN`]
/// elements per piece, the last ones shorter or empty.
pub fn piece(len: usize, nodes: usize, rank: usize) -> Range<usize> {
    let per = len.div_ceil(nodes).div_ceil(ALIGN) * ALIGN;
    (rank * per).min(len)..((rank + 1) * per).min(len)
}

impl Shards {
    pub fn new(layout: &Layout, nodes: usize, rank: usize) -> Shards {
        assert!(nodes >= 1 && rank < nodes, "rank {rank} of {nodes}");
        let pieces: Vec<Vec<Range<usize>>> = layout
            .blocks
            .iter()
            .map(|b| (0..nodes).map(|r| piece(b.len, nodes, r)).collect())
            .collect();
        let mut local = Vec::with_capacity(pieces.len());
        let mut len = 0;
        for p in &pieces {
            local.push(len);
            len += p[rank].len();
        }
        Shards {
            nodes,
            rank,
            pieces,
            offsets: layout.blocks.iter().map(|b| b.offset).collect(),
            local,
            len,
        }
    }

    /// Blocks of the layout.
    pub fn blocks(&self) -> usize {
        self.pieces.len()
    }

    /// Every rank's piece of block `block`, within the block.
    pub fn pieces(&self, block: usize) -> &[Range<usize>] {
        &self.pieces[block]
    }

    /// This rank's piece of block `block`, as global layout indices.
    pub fn mine(&self, block: usize) -> Range<usize> {
        let (p, at) = (&self.pieces[block][self.rank], self.offsets[block]);
        at + p.start..at + p.end
    }

    /// Where global index `at`, in this rank's piece of `block`, sits in the local buffers.
    pub fn local(&self, block: usize, at: usize) -> usize {
        let mine = self.mine(block);
        assert!(
            mine.contains(&at),
            "{at} is not in this rank's piece {mine:?}"
        );
        self.local[block] + at - mine.start
    }

    /// This rank's local range of block `block`'s piece.
    pub fn local_range(&self, block: usize) -> Range<usize> {
        let n = self.pieces[block][self.rank].len();
        self.local[block]..self.local[block] + n
    }

    /// The most elements any rank owns (rank 0, whose pieces are rounded up).
    pub fn most(layout: &Layout, nodes: usize) -> usize {
        (0..nodes)
            .map(|r| Shards::new(layout, nodes, r).len)
            .max()
            .unwrap_or(0)
    }
}

/// One MPI call's share of a collective over pieces: elements `range` of the buffer, and
/// each rank's part of them (its piece within `range`, maybe empty), in buffer indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    pub range: Range<usize>,
    pub parts: Vec<Range<usize>>,
}

impl Window {
    /// Rank `rank`'s part as a range of its piece `piece` (empty where the part is).
    pub fn within(&self, rank: usize, piece: &Range<usize>) -> Range<usize> {
        let part = &self.parts[rank];
        match part.is_empty() {
            true => 0..0,
            false => part.start - piece.start..part.end - piece.start,
        }
    }
}

/// `pieces` (contiguous, in rank order, from 0) cut into windows of at most `max` elements,
/// in order: the windows tile the pieces' span, and within each window the parts tile it in
/// rank order, so one collective per window with the parts' lengths as counts moves every
/// piece once. Depends on the pieces and `max` only, so every rank makes the same calls.
pub fn windows(pieces: &[Range<usize>], max: usize) -> Vec<Window> {
    assert!(max > 0, "a window holds an element");
    let len = pieces.last().map_or(0, |p| p.end);
    (0..len)
        .step_by(max)
        .map(|at| {
            let range = at..(at + max).min(len);
            let clip = |x: usize| x.clamp(range.start, range.end);
            let parts = pieces.iter().map(|p| clip(p.start)..clip(p.end)).collect();
            Window { range, parts }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Windows tile the pieces in order, each within `max`, their parts tiling the window in
    /// rank order; every element of piece r lies in exactly one window's part r.
    #[test]
    fn windows_cover_every_piece_once_in_order() {
        for len in [0, 1, 63, 1000, 4096, 100_003] {
            for nodes in 1..=4 {
                let ps: Vec<_> = (0..nodes).map(|r| piece(len, nodes, r)).collect();
                for max in [1, 7, 64, 1000, 1 << 30] {
                    let ws = windows(&ps, max);
                    assert_eq!(ws.len(), len.div_ceil(max), "{len} by {max}");
                    let mut at = 0;
                    let mut seen = vec![0; nodes];
                    for w in &ws {
                        assert_eq!(w.range.start, at);
                        assert!(!w.range.is_empty() && w.range.len() <= max);
                        let mut p = w.range.start;
                        for (r, part) in w.parts.iter().enumerate() {
                            assert_eq!(part.start, p, "parts tile the window in rank order");
                            let within = w.within(r, &ps[r]);
                            assert_eq!(within.len(), part.len());
                            assert!(within.end <= ps[r].len());
                            assert!(part.is_empty() || ps[r].start <= part.start);
                            assert!(part.end <= ps[r].end.max(part.start));
                            seen[r] += part.len();
                            p = part.end;
                        }
                        assert_eq!(p, w.range.end);
                        at = w.range.end;
                    }
                    assert_eq!(at, len);
                    let lens: Vec<_> = ps.iter().map(|p| p.len()).collect();
                    assert_eq!(seen, lens, "{len} over {nodes} by {max}");
                }
            }
        }
        // 1000 over 3 (0..384, 384..768, 768..1000) by 500: rank 1 straddles the windows.
        let ws = windows(&[0..384, 384..768, 768..1000], 500);
        assert_eq!(ws[0].parts, [0..384, 384..500, 500..500]);
        assert_eq!(ws[1].parts, [500..500, 500..768, 768..1000]);
        assert_eq!(ws[0].within(2, &(768..1000)), 0..0);
        assert_eq!(ws[1].within(1, &(384..768)), 116..384);
    }

    #[test]
    fn pieces_cover_a_block_once_in_aligned_runs() {
        for len in [0, 1, 63, 64, 65, 1000, 4096, 100_003] {
            for nodes in 1..=5 {
                let ps: Vec<_> = (0..nodes).map(|r| piece(len, nodes, r)).collect();
                assert_eq!(ps[0].start, 0);
                assert_eq!(ps[nodes - 1].end, len, "{len} over {nodes}");
                for w in ps.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                for p in &ps {
                    assert!(p.start % ALIGN == 0 || p.is_empty(), "{p:?}");
                    assert!(p.len() % ALIGN == 0 || p.end == len, "{p:?} of {len}");
                }
            }
        }
        // The shares are even up to the alignment: 1000 over 3 is 384, 384, 232.
        assert_eq!(piece(1000, 3, 0), 0..384);
        assert_eq!(piece(1000, 3, 2), 768..1000);
    }
}
