//! A step's gradients as the workers deliver them: each part of a block reduced over the
//! workers' slabs once every worker has sent it, its slots freed at once, and across nodes
//! exchanged as soon as it is final here ([`super::nodes`]); then the workers' loss sums
//! (and their objective's sums) added in rank order; and the update of a block, which on
//! several nodes gives every node the block's updated weights.

use std::collections::HashMap;
use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use mt::objective::ObjectiveSums;
use mt::optim::AdamWStep;
use mt::protocol::{FromWorker, ToWorker, WorkerTimings};

use super::{Trainer, nodes};
use crate::supervisor::{Event, fatal};
use mt::host::IdleWork;
use mt::layout::Layout;

/// What the workers and the reduce reported for one step.
pub(super) struct StepOutcome {
    pub(super) loss_sum: f64,
    pub(super) slowest: WorkerTimings,
    pub(super) reduce_s: f64,
    /// Seconds in exchanges with the other nodes (the gradient's, the norm's, the loss's),
    /// and of those, the seconds spent waiting for the other nodes to reach them.
    pub(super) exchange_s: f64,
    pub(super) exchange_wait_s: f64,
    /// Seconds of the previous update's moments pass run during this step.
    pub(super) moments_s: f64,
    /// Σ g² over every parameter.
    pub(super) grad_sum_sq: f64,
    /// The update was skipped (non-finite loss or norm).
    pub(super) skipped: bool,
    /// Under DPO the pairs' sums over every worker, under GRPO the completions'; and under
    /// GRPO on a batch's first step the completion tokens' log-probabilities, rank after
    /// rank.
    pub(super) sums: ObjectiveSums,
    pub(super) token_logps: Vec<f32>,
}

/// Each of `s`'s timings and peaks raised to `t`'s where `t`'s is larger.
fn slowest(s: &mut WorkerTimings, t: &WorkerTimings) {
    s.forward_s = s.forward_s.max(t.forward_s);
    s.backward_s = s.backward_s.max(t.backward_s);
    s.slot_wait_s = s.slot_wait_s.max(t.slot_wait_s);
    s.update_wait_s = s.update_wait_s.max(t.update_wait_s);
    s.images_s = s.images_s.max(t.images_s);
    s.kept_layers = s.kept_layers.max(t.kept_layers);
    s.h2d_wait_s = s.h2d_wait_s.max(t.h2d_wait_s);
    s.d2h_s = s.d2h_s.max(t.d2h_s);
    s.peak_device_bytes = s.peak_device_bytes.max(t.peak_device_bytes);
    s.context_device_bytes = s.context_device_bytes.max(t.context_device_bytes);
}

impl StepOutcome {
    /// Adds a later pass over the same step's gradient (a server's `train_step`s before
    /// one update): loss sums and times added (each pass's slowest worker's), the device
    /// peaks the larger, the objective's sums added, the norm the later one's (of the
    /// gradient as it stands).
    pub(super) fn absorb(&mut self, o: StepOutcome) {
        self.loss_sum += o.loss_sum;
        let (s, t) = (&mut self.slowest, &o.slowest);
        s.forward_s += t.forward_s;
        s.backward_s += t.backward_s;
        s.slot_wait_s += t.slot_wait_s;
        s.update_wait_s += t.update_wait_s;
        s.images_s += t.images_s;
        s.kept_layers = s.kept_layers.max(t.kept_layers);
        s.h2d_wait_s += t.h2d_wait_s;
        s.d2h_s += t.d2h_s;
        s.peak_device_bytes = s.peak_device_bytes.max(t.peak_device_bytes);
        s.context_device_bytes = s.context_device_bytes.max(t.context_device_bytes);
        self.reduce_s += o.reduce_s;
        self.exchange_s += o.exchange_s;
        self.exchange_wait_s += o.exchange_wait_s;
        self.moments_s += o.moments_s;
        self.grad_sum_sq = o.grad_sum_sq;
        let same = self.sums.add(&o.sums);
        debug_assert!(same, "a server's calls share its objective");
    }

    pub(super) fn new() -> StepOutcome {
        StepOutcome {
            loss_sum: 0.0,
            slowest: WorkerTimings::default(),
            reduce_s: 0.0,
            exchange_s: 0.0,
            exchange_wait_s: 0.0,
            moments_s: 0.0,
            grad_sum_sq: 0.0,
            skipped: false,
            sums: ObjectiveSums::Lm,
            token_logps: Vec::new(),
        }
    }
}

impl Trainer {
    /// Applies update `hp` to block `block` (this node's pieces, where sharded) and gives
    /// every node the updated weights of the block (on one node, nothing to give).
    pub(super) fn update_block(&mut self, block: usize, hp: &AdamWStep) -> Result<()> {
        self.host.update_block(block, hp, self.moments)?;
        let (t, waited) = (Instant::now(), self.peers.waited());
        self.host.gather_store(block)?;
        self.update_exchange_s += t.elapsed().as_secs_f64();
        self.update_exchange_wait_s += (self.peers.waited() - waited).as_secs_f64();
        Ok(())
    }

    /// Forward, backward and the reduce: sums each gradient part over the workers' slabs
    /// as soon as every worker has delivered it ([`Pending`]), until every worker reports
    /// the step done ([`Reports`]); then the norm's and the loss's sums. Each worker runs
    /// `accum` micro-batches; `fresh`: the first overwrites the gradient (else it adds to
    /// the one accumulated so far: a server's `train_step`s before one update). The norm is
    /// of the gradient as it stands after this call.
    pub(super) fn collect_gradients(&mut self, accum: usize, fresh: bool) -> Result<StepOutcome> {
        let world = self.sup.world();
        let slot_len = self.host.slabs.slot_len();
        let mut pending = Pending::new(&self.host.layout, slot_len, world, accum);
        // Across nodes, each block's gradient once final here ([`nodes`]).
        let mut exchange = self.nodes().map(|_| nodes::Exchange::new(&pending.parts));
        let mut reports = Reports::new(world);
        let mut out = StepOutcome::new();
        let timeout = Duration::from_secs(self.cfg.training.worker_timeout_s);
        let waited_before = self.peers.waited();
        while !(reports.all_in() && pending.all_in()) {
            let Some(event) = self.next_event(&reports, timeout, &mut out)? else {
                continue;
            };
            match event {
                Event::Msg(
                    rank,
                    FromWorker::LayerGrads {
                        micro,
                        block,
                        part,
                        slot,
                    },
                ) => {
                    if let Some((range, slots)) = pending.arrive(rank, micro, block, part, slot)? {
                        let (first, last) = (fresh && micro == 0, micro + 1 == accum);
                        let exchange = exchange.as_mut();
                        self.reduce_part(block, range, &slots, (first, last), exchange, &mut out)?;
                    }
                }
                Event::Msg(
                    rank,
                    FromWorker::StepDone {
                        loss_sum,
                        timings,
                        sums,
                        token_logps,
                        ..
                    },
                ) => reports.arrive(rank, (loss_sum, sums, token_logps), &timings),
                Event::Msg(rank, FromWorker::Fatal { msg }) => return Err(fatal(rank, &msg)),
                Event::Msg(rank, other) => bail!("worker rank {rank} sent {other:?} mid-step"),
                Event::Closed(rank) => return Err(self.sup.death(rank)),
            }
        }
        let t = Instant::now();
        self.host.settle_moments();
        out.moments_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        if let Some(x) = exchange {
            out.grad_sum_sq = x.sum_sq(self.peers)?;
        }
        out.slowest = reports.slowest;
        let losses: Vec<f64> = reports.by_rank.iter().flatten().map(|d| d.0).collect();
        out.loss_sum = self.global_loss(&losses)?;
        out.exchange_s += t.elapsed().as_secs_f64();
        out.exchange_wait_s = (self.peers.waited() - waited_before).as_secs_f64();
        for (rank, (_, sums, token_logps)) in reports.by_rank.into_iter().flatten().enumerate() {
            if !out.sums.add(&sums) {
                bail!("worker rank {rank} sent the sums of another objective than the run's");
            }
            out.token_logps.extend(token_logps);
        }
        Ok(out)
    }

    /// The workers' next message; while there is none, the last update's moments pass and
    /// then copies for the checkpoint in flight fill the time the launcher would wait
    /// (`None`: some of that work was done, look again).
    fn next_event(
        &mut self,
        reports: &Reports,
        timeout: Duration,
        out: &mut StepOutcome,
    ) -> Result<Option<Event>> {
        if let Some(event) = self.sup.try_event() {
            return Ok(Some(event));
        }
        let t = Instant::now();
        match self.host.idle_work() {
            Some(IdleWork::Moments) => {
                out.moments_s += t.elapsed().as_secs_f64();
                Ok(None)
            }
            Some(IdleWork::Staged) => Ok(None),
            None => (self.sup)
                .next_event(timeout, &|r| reports.waiting(r))
                .map(Some),
        }
    }

    /// Reduces part `range` of block `block`, which every worker has delivered in `slots`,
    /// and frees the slots; `(first, last)`: whether this is the step's first micro-batch
    /// (which overwrites the gradient) and its last (which makes the part final: its share
    /// of the norm comes from the same pass, while the GPUs still work). Across nodes the
    /// norm is of the sum over the nodes: a final block is exchanged instead.
    fn reduce_part(
        &mut self,
        block: usize,
        range: Range<usize>,
        slots: &[usize],
        (first, last): (bool, bool),
        exchange: Option<&mut nodes::Exchange>,
        out: &mut StepOutcome,
    ) -> Result<()> {
        let t = Instant::now();
        self.host.settle_moments_down_to(block);
        out.moments_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let sum_sq = self.host.reduce_part(block, range, slots, first, last);
        for (r, &s) in slots.iter().enumerate() {
            self.sup.send(r, ToWorker::SlotFree { slot: s })?;
        }
        let mut exchanged = Duration::ZERO;
        match exchange {
            Some(x) => {
                if last {
                    x.part_final(block);
                }
                let t = Instant::now();
                x.run_due(&mut self.host, self.peers)?;
                exchanged = t.elapsed();
            }
            None => out.grad_sum_sq += sum_sq,
        }
        out.exchange_s += exchanged.as_secs_f64();
        out.reduce_s += (t.elapsed() - exchanged).as_secs_f64();
        Ok(())
    }
}

/// The gradient parts of a step not yet reduced: for each (micro-batch, block, part), the
/// slot each worker sent it in, until every worker has.
struct Pending {
    /// The element ranges each block's gradient travels in, by block.
    parts: Vec<Vec<Range<usize>>>,
    world: usize,
    waiting: HashMap<(usize, usize, usize), Vec<Option<usize>>>,
    /// Parts every worker has sent, of the step's `expected`.
    complete: usize,
    expected: usize,
}

impl Pending {
    fn new(layout: &Layout, slot_len: usize, world: usize, accum: usize) -> Pending {
        let parts: Vec<Vec<Range<usize>>> = (0..layout.blocks.len())
            .map(|b| layout.grad_parts(b, slot_len).collect())
            .collect();
        let expected = accum * parts.iter().map(Vec::len).sum::<usize>();
        Pending {
            parts,
            world,
            waiting: HashMap::new(),
            complete: 0,
            expected,
        }
    }

    /// Worker `rank` sent part `part` of block `block` of micro-batch `micro` in `slot`:
    /// once every worker has, the part's element range and the slots, rank by rank.
    fn arrive(
        &mut self,
        rank: usize,
        micro: usize,
        block: usize,
        part: usize,
        slot: usize,
    ) -> Result<Option<(Range<usize>, Vec<usize>)>> {
        let Some(range) = self.parts.get(block).and_then(|p| p.get(part)) else {
            bail!(
                "worker rank {rank} sent part {part} of block {block}; the layout has {} blocks, in {:?} parts",
                self.parts.len(),
                self.parts.iter().map(Vec::len).collect::<Vec<_>>()
            );
        };
        let key = (micro, block, part);
        let slots = (self.waiting.entry(key)).or_insert_with(|| vec![None; self.world]);
        if slots[rank].replace(slot).is_some() {
            bail!(
                "worker rank {rank} sent part {part} of block {block} of micro-batch {micro} twice"
            );
        }
        if !slots.iter().all(Option::is_some) {
            return Ok(None);
        }
        let slots = self.waiting.remove(&key).into_iter().flatten().flatten();
        self.complete += 1;
        Ok(Some((range.clone(), slots.collect())))
    }

    fn all_in(&self) -> bool {
        self.complete >= self.expected
    }
}

/// What each worker reported at the end of its step: its loss sum, its objective's sums and
/// (GRPO) its completion tokens' log-probabilities, kept by rank so that they are added in
/// rank order whichever worker finished first; and the slowest worker's timings.
struct Reports {
    by_rank: Vec<Option<(f64, ObjectiveSums, Vec<f32>)>>,
    slowest: WorkerTimings,
}

impl Reports {
    fn new(world: usize) -> Reports {
        Reports {
            by_rank: vec![None; world],
            slowest: WorkerTimings::default(),
        }
    }

    fn arrive(&mut self, rank: usize, done: (f64, ObjectiveSums, Vec<f32>), t: &WorkerTimings) {
        self.by_rank[rank] = Some(done);
        slowest(&mut self.slowest, t);
    }

    /// Whether rank `rank` has yet to report (the supervisor's timeout watches those).
    fn waiting(&self, rank: usize) -> bool {
        self.by_rank[rank].is_none()
    }

    fn all_in(&self) -> bool {
        self.by_rank.iter().all(Option::is_some)
    }
}
