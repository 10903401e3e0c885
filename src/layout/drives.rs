//! Where the optimizer's state lies on the drives (`memory.optimizer_offload: nvme`): each
//! field (master, m, v) one sequence of positions, block `b` from [`block_starts`]`[b]` on,
//! the blocks' lengths rounded up to [`PAD`] elements, so every block (and every window,
//! [`WINDOW`] elements from its start) starts on a page of every field and no two share
//! one; the positions striped over the drives in [`STRIPE`]s (stripe `k` on drive
//! `k mod D`, at stripe `k / D` of its file). The host state streams through it
//! (`crate::host::nvme`); the memory plan sizes the files and the windows from it.

use crate::config::{DType, MasterWeights};

use super::Layout;

/// Elements a block's positions are rounded up to: 4 KiB of a 2-byte field, 8 KiB of a
/// 4-byte one.
pub const PAD: usize = 2048;
/// Elements per stripe of a field on one drive (4 MiB of fp32).
pub const STRIPE: usize = 1 << 20;
/// Elements per window a pass streams (a multiple of [`PAD`]): 48 MiB of an fp32 master and
/// moments.
pub const WINDOW: usize = 1 << 22;
/// Windows an update reads ahead of the one it computes, across the boundaries of blocks
/// (the next blocks' first windows are read while a block's last one is computed).
pub const READ_AHEAD: usize = 2;
/// Windows in flight: [`READ_AHEAD`] read ahead, one computed, one written behind.
pub const BUFFERS: usize = READ_AHEAD + 2;

/// The fields on the drives and their element sizes: an fp32 master 4 bytes, a split
/// master's low halves 2, a bf16 master none (the store is the master); m and v 4 or 2
/// each.
pub fn field_sizes(master: MasterWeights, moments: DType) -> Vec<(Field, usize)> {
    let p = match master {
        MasterWeights::Float32 => Some(4),
        MasterWeights::Split => Some(2),
        MasterWeights::Bfloat16 => None,
    };
    let m = moments.size();
    let master = p.map(|e| (Field::Master, e));
    master
        .into_iter()
        .chain([(Field::M, m), (Field::V, m)])
        .collect()
}

/// A field of the state on the drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Master,
    M,
    V,
}

impl Field {
    pub fn name(self) -> &'static str {
        match self {
            Field::Master => "master",
            Field::M => "m",
            Field::V => "v",
        }
    }
}

/// Each block's first position, then the end of the last one.
pub fn block_starts(layout: &Layout) -> Vec<usize> {
    let mut starts = vec![0];
    for b in &layout.blocks {
        let last = *starts.last().expect("starts at 0");
        starts.push(last + b.len.next_multiple_of(PAD));
    }
    starts
}

/// Bytes each drive's file of a field of `elem_size`-byte elements takes for `positions`:
/// whole stripes, as many on every drive.
pub fn file_len(positions: usize, drives: usize, elem_size: usize) -> u64 {
    let stripes = positions.div_ceil(STRIPE);
    (stripes.div_ceil(drives.max(1)) * STRIPE * elem_size) as u64
}

/// Bytes on each drive (every drive takes as many) for `layout`'s state held as `master`
/// and `moments` over `drives` drives.
pub fn drive_bytes(layout: &Layout, master: MasterWeights, moments: DType, drives: usize) -> u64 {
    let n = *block_starts(layout).last().expect("starts at 0");
    field_sizes(master, moments)
        .iter()
        .map(|&(_, e)| file_len(n, drives, e))
        .sum()
}

/// Bytes one update reads from the drives, and as many it writes back: every field on the
/// drives at every block's positions (a block's windows are transferred whole pages at a
/// time, [`PAD`] elements, so its length rounded up to them), whatever the gradient or the
/// frozen parameters.
pub fn update_bytes(layout: &Layout, master: MasterWeights, moments: DType) -> u64 {
    let n = *block_starts(layout).last().expect("starts at 0");
    let per: usize = field_sizes(master, moments).iter().map(|&(_, e)| e).sum();
    (n * per) as u64
}

/// Elements per window for `layout`: [`WINDOW`], or the largest block rounded up to
/// [`PAD`] where that is shorter.
pub fn window_len(layout: &Layout) -> usize {
    WINDOW.min(layout.max_block_len().next_multiple_of(PAD))
}

/// Host bytes of the windows' buffers ([`BUFFERS`] of [`window_len`] elements of every
/// field).
pub fn window_bytes(layout: &Layout, master: MasterWeights, moments: DType) -> u64 {
    let per: usize = field_sizes(master, moments).iter().map(|&(_, e)| e).sum();
    (BUFFERS * window_len(layout) * per) as u64
}
