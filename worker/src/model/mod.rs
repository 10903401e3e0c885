//! Model math. One architecture family per file, pure functions of (weights, input); the
//! weights are views into a flat block buffer, looked up by their checkpoint names, so no
//! module objects are built and loading needs no renaming table.

pub mod llama;

use std::collections::HashMap;

use mt::config::hf::ModelSpec;
use mt::layout::Block;
use tch::{Device, Kind, Tensor};

/// Per-sequence-length tables a family precomputes once per micro-batch (rotary cos/sin).
pub struct Context {
    rope: llama::Rope,
}

impl Context {
    pub fn new(spec: &ModelSpec, seq_len: usize, kind: Kind, device: Device) -> Context {
        Context {
            rope: llama::Rope::new(spec, seq_len, kind, device),
        }
    }
}

// The family dispatch: the engine calls only these. Each family file provides the same
// functions; `spec.model_type` picks one (ModelSpec::from_hf rejects unknown types).

/// Token embedding: ids (B, T) -> (B, T, H).
pub fn embed(spec: &ModelSpec, w: &BlockWeights, ids_bt: &Tensor) -> Tensor {
    match spec.model_type.as_str() {
        _ => llama::embed(w, ids_bt),
    }
}

/// Decoder layer `layer` (0-based; families with per-layer attention kinds need it):
/// (B, T, H) -> (B, T, H).
pub fn decoder_layer(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    x_bth: &Tensor,
    ctx: &Context,
) -> Tensor {
    let _ = layer;
    match spec.model_type.as_str() {
        _ => llama::decoder_layer(w, spec, x_bth, &ctx.rope),
    }
}

/// Final norm of selected hidden states (M, H) -> (M, H).
pub fn final_norm(spec: &ModelSpec, head: &BlockWeights, h_mh: &Tensor) -> Tensor {
    match spec.model_type.as_str() {
        _ => llama::final_norm(head, spec, h_mh),
    }
}

/// Summed token cross-entropy of one chunk of normed hidden states (C, H) against targets.
pub fn chunk_loss_sum(
    spec: &ModelSpec,
    h_ch: &Tensor,
    lm_head_vh: &Tensor,
    targets_c: &Tensor,
) -> Tensor {
    match spec.model_type.as_str() {
        _ => llama::chunk_loss_sum(h_ch, lm_head_vh, targets_c),
    }
}

/// The tensors of one layout block, as views into its flat buffer.
pub struct BlockWeights {
    tensors: HashMap<String, Tensor>,
}

impl BlockWeights {
    /// Plain views (forward without grad).
    pub fn views(flat: &Tensor, block: &Block) -> BlockWeights {
        Self::build(flat, block, false)
    }

    /// Each view detached into its own leaf that requires grad (recompute + backward).
    pub fn leaves(flat: &Tensor, block: &Block) -> BlockWeights {
        Self::build(flat, block, true)
    }

    fn build(flat: &Tensor, block: &Block, grad: bool) -> BlockWeights {
        let tensors = block
            .tensors
            .iter()
            .map(|t| {
                let shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
                let v = flat
                    .narrow(0, t.offset as i64, t.numel() as i64)
                    .view(shape.as_slice());
                let v = if grad {
                    v.detach().set_requires_grad(true)
                } else {
                    v
                };
                (t.name.clone(), v)
            })
            .collect();
        BlockWeights { tensors }
    }

    /// The tensor named `name`; the layout guarantees it exists for this family.
    pub fn get(&self, name: &str) -> &Tensor {
        self.tensors
            .get(name)
            .unwrap_or_else(|| panic!("layout block has no tensor `{name}`"))
    }

    pub fn opt(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// Copies every leaf's gradient into `out` (the block's flat slab slot) at its offset;
    /// a leaf that received no gradient is written as zeros.
    pub fn write_grads(&self, block: &Block, out: &Tensor) {
        for t in &block.tensors {
            let mut dst = out.narrow(0, t.offset as i64, t.numel() as i64);
            let g = self.get(&t.name).grad();
            if g.defined() {
                dst.copy_(&g.reshape([-1]));
            } else {
                let _ = dst.zero_();
            }
        }
    }
}
