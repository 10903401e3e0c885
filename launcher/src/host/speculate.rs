//! A speculative update (issue #18): the host's AdamW made during the backward that
//! produces its gradients, so that the next forward does not wait for it.
//!
//! The update of a block needs the step's clip coefficient, which needs the gradient norm of
//! every block, known only once the backward is over; so today's update runs after it, and
//! the next forward waits for it block by block. Where the master is fp32 and separate from
//! the store, the update can be made before: as soon as a block's gradient is final, its
//! *store pass* ([`Speculative::Store`]) writes the weights the update would give with a
//! coefficient of 1 into the store (which no worker reads again this step), leaving the
//! master, m and v as they were. Once the norm is known:
//!
//! - the coefficient is 1 (clipping does not bind, the norm is finite): the store already
//!   holds the update's weights and the next forward reads them at once;
//! - it is not: the store pass runs again with the true coefficient, from the unchanged
//!   master and moments (today's schedule); a skipped update (non-finite) rewrites the
//!   store from the master.
//!
//! Either way the master, m and v change later, in a *commit* pass ([`Speculative::Commit`])
//! that takes the place of the deferred moments pass ([`HostState::defer_moments`]): during
//! the next backward, before the reduce overwrites the block's gradient. The store and
//! commit passes give the bits of one update, so a run's losses, checkpoints and weights are
//! the same with or without speculation (launcher/tests/speculative_update.rs).
//!
//! It needs an fp32 master, fp32 moments and the state on one node; a step after which a
//! checkpoint starts updates as before (the checkpoint reads a master its update has
//! written). It is opt-in (`MT_SPECULATE`, `launcher/src/train`): the store and commit
//! passes move 8 bytes per parameter more than the weights and moments passes, and on the
//! hosts measured so far that traffic, not the forward's wait, bounds the step.

use std::collections::VecDeque;

use mt::optim::{AdamWStep, Speculative, adamw_speculative};

use super::passes::{Place, Run};
use super::{AdamMoments, Grad, HostState, Master};

/// The speculative update of the step in flight.
pub(super) struct Speculation {
    /// The update's scalars with a clip coefficient of 1.
    hp: AdamWStep,
    /// Blocks whose gradient is final and whose store pass is still to run, in the order
    /// they became final.
    queue: VecDeque<usize>,
    /// By block: its store pass has run with `hp`.
    stored: Vec<bool>,
}

impl HostState {
    /// Whether updates can be made speculatively: an fp32 master apart from the store,
    /// fp32 moments, the whole state on this node.
    pub fn can_speculate(&self) -> bool {
        matches!(self.master, Master::F32(_))
            && matches!(self.moments, AdamMoments::F32 { .. })
            && self.shards.is_none()
    }

    /// Starts the speculative update of the step in flight, `hp` being its scalars with a
    /// clip coefficient of 1 ([`HostState::update_scalars`]).
    pub fn speculate(&mut self, hp: AdamWStep) {
        assert!(self.can_speculate() && hp.grad_scale == 1.0);
        assert!(
            self.speculation.is_none(),
            "one speculative update at a time"
        );
        self.speculation = Some(Speculation {
            hp,
            queue: VecDeque::new(),
            stored: vec![false; self.layout.blocks.len()],
        });
    }

    /// Block `block`'s gradient is final for this step (its last micro-batch reduced on
    /// every worker): its store pass may run.
    pub fn gradient_final(&mut self, block: usize) {
        if let Some(s) = &mut self.speculation {
            s.queue.push_back(block);
        }
    }

    /// Runs the store pass of the oldest block whose gradient is final; false if none is
    /// waiting.
    pub(super) fn store_next(&mut self) -> bool {
        let Some(block) = self.speculation.as_mut().and_then(|s| s.queue.pop_front()) else {
            return false;
        };
        let hp = self.speculation.as_ref().expect("checked above").hp;
        self.store_pass(block, &hp);
        self.speculation.as_mut().expect("checked above").stored[block] = true;
        true
    }

    /// Once the norm is known: makes block `block`'s store hold update `hp` (None: the
    /// update is skipped, the store holds the master): nothing to do where its store pass
    /// ran with the same scalars.
    pub fn settle_speculation(&mut self, block: usize, hp: Option<&AdamWStep>) {
        let s = self.speculation.as_ref().expect("a speculative update");
        let stored = s.stored[block];
        match hp {
            Some(hp) if stored && *hp == s.hp => {}
            Some(hp) => self.store_pass(block, hp),
            None if stored => {
                let Master::F32(p) = &self.master else {
                    unreachable!("speculation needs an fp32 master")
                };
                let r = self.layout.blocks[block].range();
                self.store.write_range(r.start, &p.as_slice()[r]);
            }
            None => {}
        }
    }

    /// Ends the speculative update once every block's store is settled: its commit pass is
    /// due as a deferred pass, block by block, where update `hp` ran (not skipped).
    pub fn end_speculation(&mut self, hp: Option<AdamWStep>) {
        assert!(self.speculation.take().is_some(), "a speculative update");
        if let Some(hp) = hp {
            self.defer(hp, true);
        }
    }

    /// The store pass of update `hp` on block `block`: the store takes the update's weights,
    /// the master and moments keep theirs.
    fn store_pass(&mut self, block: usize, hp: &AdamWStep) {
        // The last update's commit reads the same gradient and writes what this one reads.
        self.settle_moments_down_to(block);
        self.speculative_pass(block, hp, Speculative::Store);
    }

    /// Pass `pass` of update `hp` over every run of block `block`.
    pub(super) fn speculative_pass(&mut self, block: usize, hp: &AdamWStep, pass: Speculative) {
        let runs = self.runs(block);
        let (Master::F32(p), AdamMoments::F32 { m, v }) = (&mut self.master, &mut self.moments)
        else {
            unreachable!("speculation needs an fp32 master and fp32 moments")
        };
        for Run {
            range: r,
            local,
            decay,
        } in runs
        {
            let at = Place {
                global: r.start,
                local,
            };
            let l = at.local..at.local + r.len();
            let (p, m, v) = (
                p.range_mut(l.clone()),
                m.range_mut(l.clone()),
                v.range_mut(l),
            );
            let store = self.store.out_mut(r.clone());
            match &self.grad {
                Grad::F32(g) => adamw_speculative(p, &g[r], m, v, store, hp, decay, pass),
                Grad::Bf16(g) => adamw_speculative(p, &g[r], m, v, store, hp, decay, pass),
            }
        }
    }
}
