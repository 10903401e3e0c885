//! Host-resident training state: fp32 master weights, fp32 Adam moments, the fp32 gradient,
//! the shared compute-dtype store and the workers' gradient slabs, all indexed by the one
//! `Layout`.

use anyhow::{Context, Result};
use mt::checkpoint::state::{self, Schedule, Tensors, TrainState};
use mt::config::{OptimizerSection, RunConfig};
use mt::layout::Layout;
use mt::optim::{AdamWStep, adamw_update};
use mt::shm::host::{GradSlabs, Store};

pub struct HostState {
    pub layout: Layout,
    pub master: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    grad: Vec<f32>,
    pub store: Store,
    pub slabs: GradSlabs,
    /// Optimizer updates applied so far.
    updates: u64,
}

impl HostState {
    pub fn new(
        cfg: &RunConfig,
        layout: Layout,
        master: Vec<f32>,
        workers: usize,
    ) -> Result<HostState> {
        let n = layout.total;
        let tag = format!("mt-{}", std::process::id());
        let mut store = Store::create(&format!("{tag}-store"), n, cfg.model.dtype)?;
        store.write_all(&master);
        let slabs = GradSlabs::create(
            &format!("{tag}-slab"),
            workers,
            cfg.memory.num_grad_slabs,
            layout.grad_slot_len(),
            cfg.model.dtype,
        )?;
        Ok(HostState {
            layout,
            master,
            m: vec![0.0; n],
            v: vec![0.0; n],
            grad: vec![0.0; n],
            store,
            slabs,
            updates: 0,
        })
    }

    /// Reduces `part` (a range of block `block`'s elements, `Layout::grad_parts`) of every
    /// worker's slab slot (`slots[r]`) into the fp32 gradient: overwrites it for the
    /// step's `first` micro-batch, adds after. For the `last` micro-batch the part is
    /// final, and its Σ g² (for the global norm) comes from the same pass.
    pub fn reduce_part(
        &mut self,
        block: usize,
        part: std::ops::Range<usize>,
        slots: &[usize],
        first: bool,
        last: bool,
    ) -> f64 {
        let b = &self.layout.blocks[block];
        b.part_tensors(part.clone())
            .map(|(t, within)| {
                let start = b.offset + t.offset + within.start;
                let dst = &mut self.grad[start..start + within.len()];
                let in_slot = t.offset + within.start - part.start;
                self.slabs.reduce_into(dst, slots, in_slot, first, last)
            })
            .sum()
    }

    /// Writes the fp32 gradient of every tensor to a safetensors file (HF names).
    pub fn dump_grads(&self, path: &std::path::Path) -> Result<()> {
        let tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = self
            .layout
            .tensors()
            .map(|(b, t)| {
                let g = &self.grad[Layout::global_range(b, t)];
                let bytes: &[u8] = mt::shm::f32_bytes(g);
                let view = safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    t.shape.clone(),
                    bytes,
                )
                .expect("shape matches data");
                (b.hf_name(t), view)
            })
            .collect();
        safetensors::serialize_to_file(tensors, None, path)
            .with_context(|| format!("write gradients to {}", path.display()))
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
        }
    }

    /// The tensors a checkpoint holds.
    pub fn tensors(&self) -> Tensors<'_> {
        Tensors {
            master: &self.master,
            m: &self.m,
            v: &self.v,
        }
    }

    /// Loads a checkpoint's weights and Adam state and rewrites the store from them.
    pub fn restore(&mut self, dir: &std::path::Path) -> Result<TrainState> {
        let st = state::load(
            dir,
            &self.layout,
            &mut self.master,
            &mut self.m,
            &mut self.v,
        )?;
        self.updates = st.updates;
        self.store.write_all(&self.master);
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

    /// Applies the update to every tensor of block `block` (master, moments and store).
    pub fn update_block(&mut self, block: usize, hp: &AdamWStep) {
        let b = &self.layout.blocks[block];
        for t in &b.tensors {
            let r = Layout::global_range(b, t);
            adamw_update(
                &mut self.master[r.clone()],
                &self.grad[r.clone()],
                &mut self.m[r.clone()],
                &mut self.v[r.clone()],
                self.store.out_mut(r),
                hp,
                t.decays(),
            );
        }
    }
}
