//! The host's side of resident blocks (`memory.resident_blocks`): blocks `..resident` are
//! updated by the workers, each on its own copy; the host keeps reducing their gradients
//! (into an accumulator the workers read back) and holds a copy of their state that
//! [`HostState::pull_resident`] brings up to date for a checkpoint or the export.
//!
//! Their state moves through the transfer buffer a piece at a time (`ToWorker::ResidentCopy`,
//! at most one gradient slot of f32 values): [`HostState::stage_resident`] writes a piece
//! for the workers to load, [`HostState::take_resident`] reads one a worker saved.

use crate::checkpoint::staging::Part;
use crate::elem::bits;
use crate::protocol::{ResidentInit, ResidentPart};
use half::bf16;
use rayon::prelude::*;

use super::{AdamMoments, Grad, HostState, Master, store_bf16};

impl HostState {
    /// Blocks `..n` are updated by the workers.
    pub fn resident_blocks(&self) -> usize {
        self.resident
    }

    /// What a worker needs to hold the resident blocks (`None` without any).
    pub fn resident_init(&self, split: bool) -> Option<ResidentInit> {
        let transfer = self.transfer.as_ref()?;
        let (grad, grad_dtype) = match &self.grad {
            Grad::F32(super::Acc::Shared(g)) => (g.handle(), crate::config::DType::Float32),
            Grad::Bf16(super::Acc::Shared(g)) => (g.handle(), crate::config::DType::Bfloat16),
            _ => unreachable!("resident blocks come with a shared accumulator"),
        };
        Some(ResidentInit {
            blocks: self.resident,
            grad,
            grad_dtype,
            transfer: transfer.handle(),
            split,
        })
    }

    /// The pieces resident block `block`'s state travels in: ranges of its elements of at
    /// most one transfer buffer each.
    pub fn resident_pieces(&self, block: usize) -> Vec<std::ops::Range<usize>> {
        let cap = self.transfer.as_ref().map_or(0, |t| t.len());
        self.layout.grad_parts(block, cap).collect()
    }

    /// Writes `part` of block `block`'s elements `range` (f32) into the transfer buffer,
    /// for the workers to load.
    pub fn stage_resident(
        &mut self,
        block: usize,
        range: std::ops::Range<usize>,
        part: ResidentPart,
    ) {
        let r = self.layout.blocks[block].offset + range.start
            ..self.layout.blocks[block].offset + range.end;
        let mut transfer = self.transfer.take().expect("resident blocks");
        let out = &mut transfer[..r.len()];
        match part {
            ResidentPart::Master => self.master().slice(r).read_into(out),
            ResidentPart::M | ResidentPart::V => {
                let AdamMoments::F32 { m, v } = &self.moments else {
                    unreachable!("validated: fp32 moments")
                };
                let src = if part == ResidentPart::M { m } else { v };
                copy(out, &src.as_slice()[r]);
            }
        }
        self.transfer = Some(transfer);
    }

    /// Reads `part` of block `block`'s elements `range` from the transfer buffer, where a
    /// worker saved it, into the host's state (a checkpoint in flight keeps what it has not
    /// written yet first).
    pub fn take_resident(
        &mut self,
        block: usize,
        range: std::ops::Range<usize>,
        part: ResidentPart,
    ) {
        self.before_block_changes(
            block,
            match part {
                ResidentPart::Master => Part::Weights,
                _ => Part::Moments,
            },
        );
        let r = self.layout.blocks[block].offset + range.start
            ..self.layout.blocks[block].offset + range.end;
        let from = &self.transfer.as_ref().expect("resident blocks")[..r.len()];
        match part {
            ResidentPart::Master => match &mut self.master {
                Master::F32(x) => {
                    copy(&mut x.as_mut_slice()[r.clone()], from);
                    self.store.write_range(r.start, from);
                }
                Master::Split(lo) => {
                    let lo = &mut lo.as_mut_slice()[r.clone()];
                    let hi: &mut [bf16] = store_bf16(&mut self.store, r);
                    bits::split_slice(from, hi, lo);
                }
                Master::Bf16 { .. } => unreachable!("validated: no resident blocks"),
            },
            ResidentPart::M | ResidentPart::V => {
                let AdamMoments::F32 { m, v } = &mut self.moments else {
                    unreachable!("validated: fp32 moments")
                };
                let dst = if part == ResidentPart::M { m } else { v };
                copy(&mut dst.as_mut_slice()[r], from);
            }
        }
    }
}

/// Elements per parallel task of the copies (4 MB of f32).
const CHUNK: usize = 1 << 20;

/// `dst = src`, in parallel: a piece is a gigabyte at the 7B shape.
fn copy(dst: &mut [f32], src: &[f32]) {
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| d.copy_from_slice(s));
}
