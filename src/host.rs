//! Host-resident training state: the master weights (fp32, split into the store and a
//! residual, or the bf16 store itself), Adam's moments (fp32 or bf16), the gradient
//! accumulator (fp32 or bf16), the shared compute-dtype store and the workers' gradient
//! slabs, all indexed by the one `Layout`.
//!
//! On several nodes with `nodes.shard_state` the master weights and moments hold this
//! node's pieces of every block only ([`crate::layout::shards`]; [`shard`]), and the nodes
//! exchange through [`Peers`].
//!
//! With `memory.optimizer_offload: nvme` the master (a split master's low halves) and the
//! moments are files on the drives instead ([`nvme`]), streamed a window at a time by every
//! pass over them ([`offload`]).
//!
//! Library code: the launcher drives it step by step; the unit tests (`tests`) drive it
//! without any process.

mod kept;
pub mod nvme;
mod offload;
mod passes;
pub mod peers;
mod resident;
mod shard;
#[cfg(test)]
mod tests;

pub use kept::{Kept, KeptField};
pub use nvme::DriveIo;
pub use peers::{Elems, ElemsRef, Peers, SOLO, Solo};
pub use shard::WriteWindow;

use passes::{Place, Run, moments_pass, reduce_tensors, update};

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use crate::checkpoint::staging::{Gate, Part};
use crate::checkpoint::state::{self, Schedule, Tensors, TrainState};
use crate::checkpoint::writer::{LentMaster, LentTensors, Writer, Written};
use crate::checkpoint::{MasterMut, MasterRef};
use crate::config::{
    CheckpointContents, DType, MasterWeights, OptimizerOffload, OptimizerSection, RunConfig,
};
use crate::elem::GradElem;
use crate::layout::Layout;
use crate::layout::shards::Shards;
use crate::optim::{AdamWStep, Moments};
use crate::shm::RegionKind;
use crate::shm::host::{GradSlabs, SharedVec, Store};
use crate::shm::huge::zeroed;
use crate::shm::lent::Buf;
use crate::{Error, Result};
use half::bf16;

/// How the master weights are held (`memory.master_weights`).
enum Master {
    F32(Buf<f32>),
    /// The low halves; the high halves are the bf16 store.
    Split(Buf<u16>),
    /// The bf16 store is the master, rounded stochastically with bits from `seed`
    /// (`training.seed`), the update count and each element's layout index.
    Bf16 {
        seed: u64,
    },
}

/// Adam's first and second moments (`memory.moments_dtype`).
enum AdamMoments {
    F32 {
        m: Buf<f32>,
        v: Buf<f32>,
    },
    /// Rounded stochastically with bits from `seed` (`training.seed`), the update count
    /// and each element's layout index.
    Bf16 {
        m: Buf<bf16>,
        v: Buf<bf16>,
        seed: u64,
    },
}

impl AdamMoments {
    /// Read access to m and v.
    fn refs(&self) -> (MasterRef<'_>, MasterRef<'_>) {
        match self {
            AdamMoments::F32 { m, v } => {
                (MasterRef::F32(m.as_slice()), MasterRef::F32(v.as_slice()))
            }
            AdamMoments::Bf16 { m, v, .. } => {
                (MasterRef::Bf16(m.as_slice()), MasterRef::Bf16(v.as_slice()))
            }
        }
    }

    /// m and v lent to a checkpoint writer.
    fn lend(&self) -> (LentMaster, LentMaster) {
        match self {
            AdamMoments::F32 { m, v } => (LentMaster::F32(m.lend()), LentMaster::F32(v.lend())),
            AdamMoments::Bf16 { m, v, .. } => {
                (LentMaster::Bf16(m.lend()), LentMaster::Bf16(v.lend()))
            }
        }
    }

    /// Write access to m and v; bf16 moments count the values they had to round in
    /// `rounded`.
    fn muts<'a>(&'a mut self, rounded: &'a AtomicU64) -> (MasterMut<'a>, MasterMut<'a>) {
        match self {
            AdamMoments::F32 { m, v } => (
                MasterMut::F32(m.as_mut_slice()),
                MasterMut::F32(v.as_mut_slice()),
            ),
            AdamMoments::Bf16 { m, v, .. } => (
                MasterMut::Bf16 {
                    p: m.as_mut_slice(),
                    rounded,
                },
                MasterMut::Bf16 {
                    p: v.as_mut_slice(),
                    rounded,
                },
            ),
        }
    }
}

/// What [`HostState::idle_work`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleWork {
    /// A block's due moments pass.
    Moments,
    /// A block's weights copied for the checkpoint in flight.
    Staged,
}

/// The gradient accumulator (`memory.grad_dtype`).
enum Grad {
    F32(Acc<f32>),
    Bf16(Acc<bf16>),
}

/// Where the accumulator lives: private memory, or a shared region that workers holding
/// resident blocks read their reduced gradient from (`memory.resident_blocks`).
enum Acc<T> {
    Private(Vec<T>),
    Shared(SharedVec<T>),
}

impl<T: crate::elem::Pod + crate::shm::huge::Zeroable + Default> Acc<T> {
    fn new(n: usize, shared: Option<&str>) -> Result<Acc<T>> {
        Ok(match shared {
            None => Acc::Private(zeroed(n)),
            Some(name) => Acc::Shared(SharedVec::create(name, RegionKind::GradAcc, n)?),
        })
    }
}

impl<T: crate::elem::Pod> std::ops::Deref for Acc<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Acc::Private(v) => v,
            Acc::Shared(v) => v,
        }
    }
}

impl<T: crate::elem::Pod> std::ops::DerefMut for Acc<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Acc::Private(v) => v,
            Acc::Shared(v) => v,
        }
    }
}

pub struct HostState {
    pub layout: Layout,
    master: Master,
    moments: AdamMoments,
    grad: Grad,
    pub store: Store,
    pub slabs: GradSlabs,
    /// Optimizer updates applied so far.
    updates: u64,
    /// The checkpoint being written while training goes on (see
    /// [`HostState::before_block_changes`]).
    checkpoint: Option<Arc<Gate>>,
    /// Seconds spent on it since [`HostState::take_checkpoint_wait`].
    checkpoint_wait_s: f64,
    /// The moments pass of the last update where it is still due ([`HostState::defer_moments`]).
    deferred: Option<Deferred>,
    /// This node's pieces and the nodes, where the master and moments are sharded across
    /// nodes.
    shards: Option<(Shards, &'static dyn Peers)>,
    /// Blocks `..resident` are updated by the workers, which hold them
    /// (`memory.resident_blocks`); the host's copy of their master and moments is brought
    /// up to date piece by piece through [`HostState::take_resident`].
    resident: usize,
    /// Where their state travels to and from the workers ([`resident`]).
    transfer: Option<SharedVec<f32>>,
    /// The drives holding the master and moments (`memory.optimizer_offload: nvme`), whose
    /// buffers in `master` and `moments` are then empty.
    drives: Option<Arc<nvme::Drives>>,
    /// The update's transfers to and from the drives in flight between blocks.
    stream: offload::Stream,
}

/// The second pass of an update whose weights pass ran on every block: blocks
/// `..below` still lack it. It runs from the last block down, the order in which the next
/// backward delivers (and so overwrites) the gradients it reads.
struct Deferred {
    hp: AdamWStep,
    below: usize,
}

/// The bf16 store elements `r`; `memory.master_weights: split` and `bfloat16` are
/// validated to come with a bf16 store.
fn store_bf16(store: &mut Store, r: std::ops::Range<usize>) -> &mut [bf16] {
    store
        .bf16_mut(r)
        .expect("a split or bf16 master has a bf16 store")
}

impl HostState {
    /// Allocates every buffer of the host plan (all zero, their pages touched, so that a
    /// host short of memory fails here, at start-up); the master is filled in place by
    /// [`HostState::init_master`] or [`HostState::restore`], a piece at a time, so the
    /// start-up peak is the plan.
    pub fn new(
        cfg: &RunConfig,
        layout: Layout,
        workers: usize,
        shards: Option<(Shards, &'static dyn Peers)>,
        resident: usize,
    ) -> Result<HostState> {
        let n = layout.total;
        let tag = format!("mt-{}", std::process::id());
        let drives = match cfg.memory.optimizer_offload {
            OptimizerOffload::None => None,
            OptimizerOffload::Nvme => {
                assert!(
                    shards.is_none() && resident == 0,
                    "the launcher refuses the drives with a sharded state or resident blocks"
                );
                let m = &cfg.memory;
                let d = &m.nvme_path;
                let how = match kept::manifest_path(cfg) {
                    None => nvme::Files::Unlinked,
                    Some(p) if crate::checkpoint::atomic::exists(&p) => nvme::Files::Reopened,
                    Some(p) => {
                        kept::refuse_stray(&p)?;
                        nvme::Files::Kept
                    }
                };
                let (master, moments) = (m.master_weights, m.moments_dtype);
                let drives = nvme::Drives::create(d, &layout, master, moments, &tag, how)?;
                Some(Arc::new(drives))
            }
        };
        // The master and moments: this node's pieces, or every element; none in RAM with
        // the drives.
        let own = match &drives {
            Some(_) => 0,
            None => shards.as_ref().map_or(n, |s| s.0.len),
        };
        let store = Store::create(&format!("{tag}-store"), n, cfg.model.dtype)?;
        let master = match cfg.memory.master_weights {
            MasterWeights::Float32 => Master::F32(Buf::zeroed(own)),
            MasterWeights::Split => Master::Split(Buf::zeroed(own)),
            MasterWeights::Bfloat16 => Master::Bf16 {
                seed: cfg.training.seed,
            },
        };
        let slabs = GradSlabs::create(
            &format!("{tag}-slab"),
            workers,
            cfg.memory.num_grad_slabs,
            layout.grad_slot_len(),
            cfg.model.dtype,
        )?;
        let shared = (resident > 0).then(|| format!("{tag}-grad"));
        let grad = match cfg.memory.grad_dtype {
            DType::Float32 => Grad::F32(Acc::new(n, shared.as_deref())?),
            DType::Bfloat16 => Grad::Bf16(Acc::new(n, shared.as_deref())?),
        };
        let transfer = (resident > 0)
            .then(|| {
                SharedVec::create(
                    &format!("{tag}-transfer"),
                    RegionKind::Transfer,
                    layout.grad_slot_len(),
                )
            })
            .transpose()?;
        let moments = match cfg.memory.moments_dtype {
            DType::Float32 => AdamMoments::F32 {
                m: Buf::zeroed(own),
                v: Buf::zeroed(own),
            },
            DType::Bfloat16 => AdamMoments::Bf16 {
                m: Buf::zeroed(own),
                v: Buf::zeroed(own),
                seed: cfg.training.seed,
            },
        };
        Ok(HostState {
            layout,
            master,
            moments,
            grad,
            store,
            slabs,
            updates: 0,
            checkpoint: None,
            checkpoint_wait_s: 0.0,
            deferred: None,
            shards,
            resident,
            transfer,
            drives,
            stream: offload::Stream::default(),
        })
    }

    /// Sets the initial master weights with `fill` (random init or a pretrained load) and
    /// the store from them.
    pub fn init_master(
        &mut self,
        fill: impl FnOnce(&Layout, &mut MasterMut) -> crate::Result<()>,
    ) -> Result<()> {
        assert!(self.checkpoint.is_none(), "no checkpoint is being written");
        if self.shards.is_some() {
            return self.init_master_sharded(fill);
        }
        if self.drives.is_some() {
            return self.init_master_drives(fill);
        }
        let rounded = AtomicU64::new(0);
        let mut master = master_mut(
            &mut self.master,
            &mut self.store,
            self.layout.total,
            &rounded,
        );
        fill(&self.layout, &mut master)?;
        self.sync_store();
        Ok(())
    }

    /// Rewrites the store from an fp32 master (a split master's high halves are the store,
    /// a bf16 master is the store).
    fn sync_store(&mut self) {
        if let Master::F32(x) = &self.master {
            self.store.write_all(x.as_slice());
        }
    }

    /// Reduces `part` (a range of block `block`'s elements, `Layout::grad_parts`) of every
    /// worker's slab slot (`slots[r]`) into the gradient accumulator: overwrites it for
    /// the step's `first` micro-batch, adds after. For the `last` micro-batch the part is
    /// final, and its Σ g² (for the global norm, over the values as stored) comes from the
    /// same pass.
    pub fn reduce_part(
        &mut self,
        block: usize,
        part: std::ops::Range<usize>,
        slots: &[usize],
        first: bool,
        last: bool,
    ) -> f64 {
        // The accumulator is about to change: the last update's moments pass reads it.
        self.settle_moments_down_to(block);
        let b = &self.layout.blocks[block];
        match &mut self.grad {
            Grad::F32(g) => reduce_tensors(&self.slabs, b, part, &mut g[..], slots, first, last),
            Grad::Bf16(g) => reduce_tensors(&self.slabs, b, part, &mut g[..], slots, first, last),
        }
    }

    /// Writes the gradient of every tensor to a safetensors file (HF names), in f32.
    pub fn dump_grads(&self, path: &std::path::Path) -> Result<()> {
        let values: Vec<(String, Vec<usize>, std::borrow::Cow<'_, [f32]>)> = self
            .layout
            .tensors()
            .map(|(b, t)| {
                let r = Layout::global_range(b, t);
                let g = match &self.grad {
                    Grad::F32(g) => std::borrow::Cow::Borrowed(&g[r]),
                    Grad::Bf16(g) => g[r].iter().map(|x| x.to_f32()).collect(),
                };
                (b.hf_name(t), t.shape.clone(), g)
            })
            .collect();
        let tensors = values.iter().map(|(name, shape, g)| {
            let bytes: &[u8] = crate::shm::f32_bytes(g);
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .expect("shape matches data");
            (name.as_str(), view)
        });
        safetensors::serialize_to_file(tensors, None, path)
            .map_err(|e| Error::Other(format!("write gradients to {}: {e}", path.display())))
    }

    /// Where training stands after `step` steps with `nan_run` non-finite steps in a row.
    pub fn train_state(&self, step: u64, nan_run: u64, schedule: Schedule) -> TrainState {
        TrainState {
            format: state::FORMAT,
            step,
            updates: self.updates,
            nan_run,
            layout: state::fingerprint(&self.layout),
            schedule: Some(schedule),
            extra: Vec::new(),
        }
    }

    /// The master weights, whichever way they are held (all of them: not with a sharded
    /// state, see [`HostState::gather_blocks`]).
    pub fn master(&self) -> MasterRef<'_> {
        assert!(
            !self.windowed(),
            "a sharded or offloaded master is gathered first"
        );
        match &self.master {
            Master::F32(x) => MasterRef::F32(x.as_slice()),
            Master::Split(lo) => MasterRef::Split {
                hi: self.store.bf16().expect("a split master has a bf16 store"),
                lo: lo.as_slice(),
            },
            Master::Bf16 { .. } => {
                MasterRef::Bf16(self.store.bf16().expect("a bf16 master has a bf16 store"))
            }
        }
    }

    /// The live tensors (whose moments may lag a due moments pass).
    fn live(&self) -> Tensors<'_> {
        let (m, v) = self.moments.refs();
        Tensors {
            master: self.master(),
            m,
            v,
        }
    }

    /// Loads a checkpoint's weights and Adam state and rewrites the store from them. A bf16
    /// master reads a bf16-master checkpoint exactly; one saved with an fp32 master is
    /// rounded to nearest even, and the log says so.
    pub fn restore(&mut self, dir: &std::path::Path) -> Result<TrainState> {
        assert!(self.checkpoint.is_none(), "no checkpoint is being written");
        if self.shards.is_some() {
            return self.restore_sharded(dir);
        }
        if self.drives.is_some() {
            return self.restore_drives(dir);
        }
        let rounded = AtomicU64::new(0);
        let master = master_mut(
            &mut self.master,
            &mut self.store,
            self.layout.total,
            &rounded,
        );
        let moments_rounded = AtomicU64::new(0);
        let (m, v) = self.moments.muts(&moments_rounded);
        let st = state::load(dir, &self.layout, master, m, v)?;
        self.updates = st.updates;
        self.sync_store();
        let moments_rounded = moments_rounded.into_inner();
        if moments_rounded > 0 {
            tracing::warn!(
                rounded = moments_rounded,
                of = 2 * self.layout.total,
                "the checkpoint's Adam moments are not all bf16 values (saved with fp32 \
                 moments?): memory.moments_dtype: bfloat16 rounded them to nearest even, so the \
                 run does not continue exactly as the saved one would have"
            );
        }
        let rounded = rounded.into_inner();
        if rounded > 0 {
            tracing::warn!(
                rounded,
                of = self.layout.total,
                "the checkpoint's master weights are not all bf16 values (saved with an fp32 \
                 master?): memory.master_weights: bfloat16 rounded them to nearest even, so the \
                 run does not continue exactly as the saved one would have"
            );
        }
        Ok(st)
    }

    /// The scalars of the next AdamW update (counts it).
    pub fn next_update(
        &mut self,
        opt: &OptimizerSection,
        lr: f64,
        weight_decay: f64,
        grad_scale: f32,
    ) -> AdamWStep {
        self.updates += 1;
        AdamWStep {
            lr,
            beta1: opt.beta1,
            beta2: opt.beta2,
            eps: opt.eps,
            weight_decay,
            step: self.updates,
            grad_scale,
        }
    }

    /// Starts writing checkpoint `state` holding `contents` with `writer`, which reads the
    /// live state until [`HostState::before_block_changes`] stages a part of a block.
    /// Returns the seconds waited for the previous write and every write completed
    /// meanwhile. The last update's moments pass may still be due on some blocks: the
    /// writer takes their moments once it has run ([`HostState::settle_moments_down_to`]).
    pub fn start_checkpoint(
        &mut self,
        writer: &mut Writer,
        state: TrainState,
        contents: CheckpointContents,
    ) -> crate::Result<(f64, Vec<Written>)> {
        assert!(
            !self.windowed(),
            "a windowed state is checkpointed by gather_blocks"
        );
        // The writer reads a part of a block only while its gate state lets it, and every
        // change of a block's master (the store too, where it holds the master), m or v
        // goes through `update_block` or `settle_moments_down_to`, whose first step for a
        // part is `before_block_changes`: it stages the part, or waits until the writer is
        // done reading it (crate::shm::lent's protocol); the moments pass due at the start
        // makes the checkpoint's moments and tells the gate so. `restore` and
        // `init_master`, which change everything, run before any checkpoint (asserted).
        let due_below = self.deferred.as_ref().map_or(0, |d| d.below);
        let store = || {
            self.store
                .lend_bf16()
                .expect("a split or bf16 master has a bf16 store")
        };
        let (m, v) = self.moments.lend();
        let lent = LentTensors {
            master: match &self.master {
                Master::F32(x) => LentMaster::F32(x.lend()),
                Master::Split(lo) => LentMaster::Split {
                    hi: store(),
                    lo: lo.lend(),
                },
                Master::Bf16 { .. } => LentMaster::Bf16(store()),
            },
            m,
            v,
        };
        let (waited, done, gate) = writer.start(state, lent, contents, due_below)?;
        self.checkpoint = Some(gate);
        Ok((waited, done))
    }

    /// Must precede any change of `part` of block `block` (the master, the store too where
    /// it holds the master; or m and v): while a checkpoint is being written, a part it has
    /// not written yet is copied into its staging area first (or the optimizer waits for
    /// the writer, where the area is full), so that the checkpoint holds the values of its
    /// step. The weights pass (`update_block`) calls it for the weights, the moments pass
    /// (`settle_moments_down_to`) for the moments: the pass the GPUs wait for copies the
    /// master alone.
    pub fn before_block_changes(&mut self, block: usize, part: Part) {
        if let Some(gate) = &self.checkpoint {
            let s = gate.before_change(block, part, &self.live());
            self.checkpoint_wait_s += s;
        }
    }

    /// Seconds spent in [`HostState::before_block_changes`] since the last call.
    pub fn take_checkpoint_wait(&mut self) -> f64 {
        std::mem::take(&mut self.checkpoint_wait_s)
    }

    /// Makes the writer of the checkpoint in flight read nothing more from the live state
    /// (runs the moments pass it waits for, then stages or waits for every part it has not
    /// written).
    fn release_checkpoint(&mut self) {
        if self.checkpoint.is_none() {
            return;
        }
        self.settle_moments();
        for b in 0..self.layout.blocks.len() {
            self.before_block_changes(b, Part::Weights);
            self.before_block_changes(b, Part::Moments);
        }
        self.checkpoint = None;
    }

    /// Applies the update to every tensor of block `block`: master and store, and the
    /// moments with `Moments::Write`. With `Moments::Keep` the moments follow from
    /// [`HostState::defer_moments`] once every block's weights are updated. With the state
    /// on the drives, the moments are written at once either way, and an error is the
    /// drives' (naming the file).
    pub fn update_block(&mut self, block: usize, hp: &AdamWStep, moments: Moments) -> Result<()> {
        assert!(
            self.deferred.is_none(),
            "an update starts before the last one's moments are written"
        );
        if block < self.resident {
            return Ok(());
        }
        if self.drives.is_some() {
            return self.update_block_drives(block, hp);
        }
        self.before_block_changes(block, Part::Weights);
        if moments == Moments::Write {
            self.before_block_changes(block, Part::Moments);
        }
        for Run {
            range: r,
            local,
            decay,
        } in self.runs(block)
        {
            let (master, store, adam) = (&mut self.master, &mut self.store, &mut self.moments);
            let at = Place {
                global: r.start,
                local,
            };
            match &self.grad {
                Grad::F32(g) => update(master, store, adam, &g[r], at, hp, decay, moments),
                Grad::Bf16(g) => update(master, store, adam, &g[r], at, hp, decay, moments),
            }
        }
        Ok(())
    }

    /// Records that update `hp` ran with `Moments::Keep` on every block: its moments pass
    /// is due, block by block, before the accumulator or the moments are next read or
    /// changed ([`HostState::reduce_part`] and [`HostState::tensors`] see to it), and may
    /// run earlier, while the workers compute ([`HostState::settle_next_moments`]).
    pub fn defer_moments(&mut self, hp: AdamWStep) {
        if self.drives.is_some() {
            // The update wrote them (`update_block`).
            return;
        }
        let below = self.layout.blocks.len();
        self.deferred = Some(Deferred { hp, below });
    }

    /// Runs the due moments pass on the highest block still lacking it; false if none was.
    fn settle_next_moments(&mut self) -> bool {
        let Some(d) = &self.deferred else {
            return false;
        };
        self.settle_moments_down_to(d.below - 1);
        true
    }

    /// Work that fills the time the launcher would wait for its workers, a piece at a time:
    /// the due moments pass on the highest block still lacking it, else the weights of the
    /// next block the checkpoint in flight has not written, copied into its staging area
    /// ([`Gate::stage_ahead`]), so that the next weights pass, which the GPUs wait for,
    /// needs no copy there. `None` where there is none; else whether it was the moments pass.
    pub fn idle_work(&mut self) -> Option<IdleWork> {
        if self.settle_next_moments() {
            return Some(IdleWork::Moments);
        }
        let gate = self.checkpoint.as_ref()?;
        gate.stage_ahead(&self.live()).then_some(IdleWork::Staged)
    }

    /// Runs the due moments pass on every block.
    pub fn settle_moments(&mut self) {
        self.settle_moments_down_to(0);
    }

    /// Runs the due moments pass on blocks `block..` that lack it.
    pub fn settle_moments_down_to(&mut self, block: usize) {
        loop {
            let Some(d) = &mut self.deferred else {
                return;
            };
            if d.below <= block {
                return;
            }
            d.below -= 1;
            let (i, hp) = (d.below, d.hp);
            if i == 0 {
                self.deferred = None;
            }
            // The pass that makes a checkpoint's moments (one started before it) has
            // nothing to keep: the writer waits for it instead.
            let making = self.checkpoint.as_ref().is_some_and(|g| g.waiting(i));
            if i < self.resident {
                // The workers updated it; its host copy is as `pull_resident` left it.
                if let Some(gate) = self.checkpoint.as_ref().filter(|_| making) {
                    gate.ready(i);
                }
                continue;
            }
            if !making {
                self.before_block_changes(i, Part::Moments);
            }
            for Run {
                range: r, local, ..
            } in self.runs(i)
            {
                let at = Place {
                    global: r.start,
                    local,
                };
                match &self.grad {
                    Grad::F32(g) => moments_pass(&mut self.moments, &g[r], at, &hp),
                    Grad::Bf16(g) => moments_pass(&mut self.moments, &g[r], at, &hp),
                }
            }
            if let Some(gate) = self.checkpoint.as_ref().filter(|_| making) {
                gate.ready(i);
            }
        }
    }
}

impl Drop for HostState {
    fn drop(&mut self) {
        self.release_checkpoint();
        if let Some(d) = &self.drives {
            // Nothing left on the drives' threads.
            let _ = self.stream.settle(d);
        }
    }
}

/// Write access to the `n` master weights, whichever way they are held; a bf16 master counts
/// the values it had to round in `rounded`.
fn master_mut<'a>(
    master: &'a mut Master,
    store: &'a mut Store,
    n: usize,
    rounded: &'a AtomicU64,
) -> MasterMut<'a> {
    match master {
        Master::F32(x) => MasterMut::F32(x.as_mut_slice()),
        Master::Split(lo) => MasterMut::Split {
            hi: store_bf16(store, 0..n),
            lo: lo.as_mut_slice(),
        },
        Master::Bf16 { .. } => MasterMut::Bf16 {
            p: store_bf16(store, 0..n),
            rounded,
        },
    }
}

/// Σ x² in f64, over fixed chunks added in order: the same bits for any thread count.
fn sum_sq<G: GradElem + Sync>(x: &[G]) -> f64 {
    use rayon::prelude::*;
    let parts: Vec<f64> = x
        .par_chunks(1 << 16)
        .map(|c| {
            c.iter()
                .map(|&v| f64::from(v.to_f32()).powi(2))
                .sum::<f64>()
        })
        .collect();
    parts.iter().sum()
}
