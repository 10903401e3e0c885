//! The step across nodes (`mpirun -np N mt-launch …`): node n runs the n-th contiguous
//! slice of the global batch's ranks on its own workers; each block's gradient, once final
//! on the node (its workers' slabs reduced as on one node), is summed over the nodes as the
//! backward goes on; the loss sums of every worker are gathered and added in global rank
//! order. Every node then holds the same gradient bits and runs the same update, so the
//! replicas of the host state stay identical (the update is deterministic).
//!
//! N nodes of W workers train as one node of N x W workers does, up to the order of the
//! gradient additions (`(s0 + s1) + (s2 + s3)` instead of `((s0 + s1) + s2) + s3`).
//!
//! With `nodes.shard_state` (the default) each node holds and updates its pieces of the
//! master and moments only, and the updated store is gathered block by block before the
//! next forward reads it ([`mt::host`]'s `shard`); replicated or sharded, the gradient,
//! its norm and so the training are the same bits.

use std::ops::Range;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use mt::checkpoint::export::ExportFiles;
use mt::checkpoint::fed::Feed;
use mt::checkpoint::state::BlockValues;
use mt::config::{CheckpointContents, RunConfig, Stage};
use mt::data::StepPlan;
use mt::layout::Layout;
use mt::layout::shards::Shards;

use super::Trainer;
use crate::mpi::Mpi;
use crate::prepare::Prepared;
use mt::host::{HostState, Peers};

/// Which blocks are final on this node, and the next one to exchange. Blocks are exchanged
/// in one fixed order on every node (collectives must match): from the last block down,
/// the order in which the backward finishes them.
pub(super) struct Exchange {
    /// Parts of each block's last micro-batch not yet reduced on this node.
    parts_left: Vec<usize>,
    /// The next block to exchange (counting down); `None` once all are.
    next: Option<usize>,
    /// By block, Σ g² of each piece this node holds summed over the nodes (every piece,
    /// or sharded, its own).
    sums: Vec<Vec<f64>>,
}

impl Exchange {
    pub(super) fn new(parts: &[Vec<std::ops::Range<usize>>]) -> Exchange {
        Exchange {
            parts_left: parts.iter().map(Vec::len).collect(),
            next: parts.len().checked_sub(1),
            sums: vec![Vec::new(); parts.len()],
        }
    }

    /// Exchanges every block now final on this node.
    pub(super) fn run_due(&mut self, host: &mut HostState, peers: &dyn Peers) -> Result<()> {
        while let Some(b) = self.due() {
            self.sums[b] = host.exchange_block(b, peers)?;
        }
        Ok(())
    }

    /// Σ g² over every parameter: each block's pieces in rank order, block after block
    /// from the last (sharded, every node's own pieces gathered first). The same bits on
    /// every node, replicated or sharded.
    pub(super) fn sum_sq(self, peers: &dyn Peers) -> Result<f64> {
        assert!(self.next.is_none(), "every block is exchanged");
        let (blocks, nodes) = (self.sums.len(), peers.size());
        let mut sums = self.sums;
        if sums.iter().all(|s| s.len() == 1) && nodes > 1 {
            let mine: Vec<f64> = sums.iter().map(|s| s[0]).collect();
            let all = peers.allgather_f64("the gradient norm gather", &mine)?;
            for (b, s) in sums.iter_mut().enumerate() {
                *s = (0..nodes).map(|r| all[r * blocks + b]).collect();
            }
        }
        Ok(sums.iter().rev().flatten().fold(0.0, |a, b| a + b))
    }

    /// Records that one part of `block`'s last micro-batch is reduced.
    pub(super) fn part_final(&mut self, block: usize) {
        self.parts_left[block] -= 1;
    }

    /// The next block to exchange, if it is final on this node.
    pub(super) fn due(&mut self) -> Option<usize> {
        let b = self.next?;
        if self.parts_left[b] > 0 {
            return None;
        }
        self.next = b.checked_sub(1);
        Some(b)
    }
}

impl Trainer {
    /// This launcher's MPI job, when there are several nodes.
    pub(super) fn nodes(&self) -> Option<&'static Mpi> {
        self.mpi
    }

    /// Whether this launcher writes the run's files (metrics, checkpoints, the model):
    /// node 0, or the only one.
    pub(super) fn lead(&self) -> bool {
        self.peers.rank() == 0
    }

    /// Workers over every node.
    pub(super) fn global_world(&self) -> usize {
        self.sup.world() * self.peers.size()
    }

    /// This node's ranks of the global `plan`: the n-th contiguous slice of them (on one
    /// node, all of them).
    pub(super) fn node_slice(&self, mut plan: StepPlan) -> StepPlan {
        let (w, rank) = (self.sup.world(), self.peers.rank());
        plan.per_rank = plan.per_rank.drain(rank * w..(rank + 1) * w).collect();
        plan
    }

    /// The sum of every worker's loss over all nodes, added in global rank order (as one
    /// node adds its workers'): the same bits as one node of all the workers.
    pub(super) fn global_loss(&self, local: &[f64]) -> Result<f64> {
        let all = self.peers.allgather_f64("the loss gather", local)?;
        Ok(all.iter().fold(0.0, |a, b| a + b))
    }

    /// [`Trainer::checkpoint`] of a sharded state: node 0 gathers the master (and moments) a
    /// window of a block at a time, the other nodes send their parts. A periodic checkpoint
    /// whose windows fit node 0's staging area is written from there in the background
    /// ([`Trainer::checkpoint_in_background`]); the last one (or any, without a staging
    /// area) is written window by window before the step loop goes on, the files one node
    /// would write. Every node runs every window's gather, even where node 0 could not
    /// create or write the files (it reports that after).
    pub(super) fn checkpoint_sharded(
        &mut self,
        done: u64,
        last: bool,
        due: Option<CheckpointContents>,
    ) -> Result<()> {
        let Some(contents) = due else {
            // Node 0: a background write completed (or failed) meanwhile.
            let Some(writer) = self.writer.as_mut() else {
                return Ok(());
            };
            let root = writer.root().display().to_string();
            let written = writer.poll().with_context(|| failed(&root))?;
            return self.report_written(written.into_iter().collect());
        };
        let moments = contents == CheckpointContents::Full;
        let Some(writer) = self.writer.as_mut() else {
            return self.host.gather_blocks(moments, None)?.map_err(Into::into);
        };
        if !last && writer.can_feed(self.host.gather_window_len()?, moments) {
            return self.checkpoint_in_background(done, contents);
        }
        let root = writer.root().display().to_string();
        let state = self
            .host
            .train_state(done, self.nan_run, self.schedule.clone());
        let host = &mut self.host;
        // A failed gather, and whether the files were created (else the gathers still run).
        let (mut gather_err, mut gathered) = (None, false);
        let written = writer.write_now(&state, contents, |files| {
            gathered = true;
            let mut write =
                |b: usize, w: Range<usize>, v: &dyn BlockValues| files.write_window(b, w, v);
            host.gather_blocks(moments, Some(&mut write))
                .unwrap_or_else(|e| {
                    let msg = format!("{e:#}");
                    gather_err = Some(anyhow::Error::from(e));
                    Err(mt::Error::Other(msg))
                })
        });
        if let Some(e) = gather_err {
            return Err(e);
        }
        if !gathered {
            host.gather_blocks(moments, None)??;
        }
        let written = written.with_context(|| failed(&root))?;
        let waited: f64 = written.iter().map(|w| w.stall_s).sum();
        self.checkpoint_wait_s += waited;
        self.report_written(written)
    }

    /// [`Trainer::checkpoint_sharded`] in the background (node 0): every window is gathered
    /// into the writer's staging area (waiting for the writer only while it is full), and
    /// the writer thread writes them while training goes on. The step loop waits for the
    /// gathers, which every node must make before any block changes, not for the disk.
    fn checkpoint_in_background(&mut self, done: u64, contents: CheckpointContents) -> Result<()> {
        let moments = contents == CheckpointContents::Full;
        let state = self
            .host
            .train_state(done, self.nan_run, self.schedule.clone());
        let writer = self.writer.as_mut().expect("node 0 writes checkpoints");
        let root = writer.root().display().to_string();
        let (waited, written, feed) = match writer.start_fed(state, contents) {
            Ok(started) => started,
            Err(e) => {
                // The other nodes gather every window all the same.
                self.host.gather_blocks(moments, None)??;
                return Err(anyhow::Error::from(e).context(failed(&root)));
            }
        };
        let mut ending = Ending {
            feed: &feed,
            since: Instant::now(),
            complete: false,
        };
        let mut stage = |b: usize, w: Range<usize>, v: &dyn BlockValues| feed.stage(b, w, v);
        let staged = self.host.gather_blocks(moments, Some(&mut stage))?;
        ending.complete = staged.is_ok();
        let spent = ending.since.elapsed().as_secs_f64();
        drop(ending);
        if let Err(e) = staged {
            // The writer stopped: its own error says why.
            writer.finish().with_context(|| failed(&root))?;
            return Err(anyhow::Error::from(e).context(failed(&root)));
        }
        self.checkpoint_wait_s += waited + spent;
        self.progress.println(&format!(
            "checkpoint of step {done}: gathered in {spent:.3}s, writing in the background"
        ));
        self.report_written(written)
    }

    /// The stop signal any node received (all stop at the same step boundary).
    pub(super) fn stop_requested(&self) -> Result<Option<nix::sys::signal::Signal>> {
        let mine = crate::unix::stop_requested();
        let any = self
            .peers
            .max_i64("the stop check", mine.map_or(0, |s| s as i64))?;
        Ok(nix::sys::signal::Signal::try_from(any as i32).ok())
    }
}

/// Ends a checkpoint's feed when the step loop is done with it, however it is: complete
/// only where every window was staged, else the writer fails the checkpoint.
struct Ending<'a> {
    feed: &'a Feed,
    since: Instant,
    complete: bool,
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        let spent = self.since.elapsed().as_secs_f64();
        self.feed.end(self.complete, spent);
    }
}

/// What a failed checkpoint under `root` says.
fn failed(root: &str) -> String {
    format!("checkpoint under {root} failed (complete checkpoints there are kept)")
}

/// Refuses what several nodes do not support yet: DPO and GRPO; `--dump-grads` with the
/// state sharded, where each node ends the step with the summed gradient of its own pieces
/// only (node 0 would write a gradient that is partly its own workers' alone).
pub(super) fn check_supported(mpi: Option<&Mpi>, cfg: &RunConfig, dump_grads: bool) -> Result<()> {
    let Some(m) = mpi else {
        return Ok(());
    };
    let stage = cfg.training.stage;
    if matches!(stage, Stage::Dpo | Stage::Grpo) {
        bail!(
            "training.stage: {} is not supported on several nodes yet (run it on one node)",
            stage.as_str()
        );
    }
    if dump_grads && cfg.nodes.shard_state {
        bail!(
            "--dump-grads is not supported on several nodes ({} under mpirun) with the state sharded (nodes.shard_state: true, the default): each node holds the summed gradient of its own pieces only; pass --set nodes.shard_state=false, or run on one node",
            m.size
        );
    }
    Ok(())
}

/// This node's pieces of the master and moments, when they are sharded: under mpirun with
/// `nodes.shard_state` (the default).
pub(super) fn shards(
    cfg: &RunConfig,
    mpi: Option<&'static Mpi>,
    layout: &Layout,
) -> Option<(Shards, &'static dyn Peers)> {
    let m = mpi.filter(|_| cfg.nodes.shard_state)?;
    Some((Shards::new(layout, m.size, m.rank), m))
}

/// The host plan of one node of a multi-node run: the MPI shim's ring buffers; with the
/// state sharded, 1/N of the master and moments, and on node 0 its buffers to gather a
/// window of a block of them for a checkpoint or the export and the staging area background
/// checkpoints are gathered into (the other nodes only send, and hold neither). A run
/// that writes nothing (`training.save_model: false`, no `checkpoint.dir`) gathers nothing.
pub(crate) fn shard_plan(prepared: &mut Prepared, cfg: &RunConfig, mpi: Option<&'static Mpi>) {
    if mpi.is_some() {
        prepared.plan = prepared.plan.on_nodes();
    }
    if let Some(m) = mpi.filter(|_| cfg.nodes.shard_state) {
        let sharded = prepared.plan.sharded(&prepared.layout, m.size);
        let writes = cfg.training.save_model || cfg.checkpoint.dir.is_some();
        prepared.plan = match m.rank {
            0 if writes => sharded,
            _ => mt::plan::HostPlan {
                gather: 0,
                ..sharded.without_staging()
            },
        };
    }
}

/// Writes the trained model to `training.output_dir` (node 0); a sharded master is gathered
/// on node 0 a window of a block at a time, each written before the next, every node
/// sending its parts of every window (even where node 0 could not create or write the
/// files).
pub(super) fn export(
    cfg: &RunConfig,
    host: &mut HostState,
    export: &mt::checkpoint::ExportOptions,
    lead: bool,
) -> Result<()> {
    let Some(out) = cfg.export_dir() else {
        return Ok(());
    };
    write_model(out, host, export, lead)
}

/// [`export`] into `out`: from the master in RAM, or a window of a block at a time where it
/// is sharded (gathered on node 0) or on the drives.
pub(super) fn write_model(
    out: &std::path::Path,
    host: &mut HostState,
    export: &mt::checkpoint::ExportOptions,
    lead: bool,
) -> Result<()> {
    if !host.windowed() {
        if lead {
            mt::checkpoint::save_hf(out, &host.layout, host.master(), export)?;
            println!("model written to {}", out.display());
        }
        return Ok(());
    }
    if !lead {
        return host.gather_blocks(false, None)?.map_err(Into::into);
    }
    let layout = host.layout.clone();
    let files = ExportFiles::create(out, &layout, export);
    let mut write = |b: usize, w: Range<usize>, v: &dyn BlockValues| match &files {
        Ok(f) => f.write_window(b, w, v),
        // Reported below; the gathers go on.
        Err(_) => Ok(()),
    };
    host.gather_blocks(false, Some(&mut write))??;
    files?.finish()?;
    println!("model written to {}", out.display());
    Ok(())
}
