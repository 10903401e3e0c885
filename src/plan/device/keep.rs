//! `memory.recompute` in the device plan: the decoder layers that keep their MLP half's
//! activations from the forward for the backward (worker/src/layer.rs), so their backward
//! recomputes the attention half only, not the gate and up projections (two thirds of a
//! dense layer's matrix work). A layer keeps, per token, the attention half's output and
//! the gate and up projections' outputs: (H + 2 I) elements, 10.9 GB a layer for
//! Qwen2.5-7B at 128 x 1024 tokens, against 297 of the layer's 473 MFLOP of forward per
//! token not recomputed.
//!
//! The kept layers are the last ones: their backward comes first, so what they keep is
//! alive from their forward until their own backward. The forward's end and the head hold
//! all of it; the backward of layer l holds what the kept layers at or below l keep (the
//! ones above have freed theirs), so in a mixed stack (Qwen3.5: a full-attention layer every
//! fourth) the heaviest layer backward may hold only part of it; the embedding's backward
//! and the vision tower's forward hold none.

use super::{DeviceOpts, DevicePlan, EMBED_BACKWARD, LAYER_BACKWARD, MLP_TILES, VISION_FORWARD};
use crate::config::Recompute;
use crate::config::hf::{AttentionKind, Family, ModelSpec};

/// The share of the GPU's free memory (as the launcher read it before the workers
/// started) that `auto` fills with the step and the kept layers: the plan is within 6% of
/// the measured peak on the rows of benches/results it was compared with, and it leaves
/// out the allocator's slack and fragmentation.
pub const KEEP_FIT: f64 = 0.85;

/// Whether layer `layer` can keep its MLP activations: a dense MLP half
/// `h + down(act(gate(n)) * up(n))` with `n = norm(h)` and nothing after the down
/// projection but the residual (Llama, Mistral, Qwen2, Qwen3 and DeepSeek-V3's dense
/// layers, and Qwen3.5's full-attention layers, whose norm is `1 + w`; not Phi-3's fused
/// gate_up, nor the families with a norm after the MLP, nor a mixture of experts). Qwen3.5's
/// Gated DeltaNet layers recompute whole: in tiles their rule runs in segments
/// (worker/src/segments.rs), which the kept path does not.
pub fn keeps_mlp(spec: &ModelSpec, layer: usize) -> bool {
    let dense = !(spec.moe.is_some() && spec.is_sparse(layer));
    dense
        && match spec.family {
            Family::Llama | Family::Qwen3 | Family::DeepseekV3 => true,
            Family::Qwen3Next => spec.layer_types[layer] != AttentionKind::Linear,
            _ => false,
        }
}

/// Which layers keep their MLP activations when `keep` of them do: the last `keep` of
/// those that can ([`keeps_mlp`]).
pub fn kept_layers(spec: &ModelSpec, keep: usize) -> Vec<bool> {
    let mut left = keep;
    let mut kept = vec![false; spec.num_layers];
    for l in (0..spec.num_layers).rev() {
        if left > 0 && keeps_mlp(spec, l) {
            kept[l] = true;
            left -= 1;
        }
    }
    kept
}

/// Bytes one layer keeps over `m` tokens of `s` bytes per element.
pub fn kept_bytes(spec: &ModelSpec, m: u64, s: u64) -> u64 {
    m * (spec.hidden_size as u64 + 2 * spec.intermediate_size as u64) * s
}

impl DevicePlan {
    /// The plan with the kept layers `o.recompute` resolves to: none for `full`; the given
    /// number (at most the layers that can); for `auto`, as many as keep the plan's total
    /// within [`KEEP_FIT`] of the GPU's free memory (none on CPU workers, or where the free
    /// memory is not known).
    pub(super) fn resolve_keep(self, spec: &ModelSpec, o: DeviceOpts) -> DevicePlan {
        let can = (0..spec.num_layers).filter(|&l| keeps_mlp(spec, l)).count();
        let per_layer = kept_bytes(
            spec,
            (self.rows * self.seq_len) as u64,
            o.dtype.size() as u64,
        );
        let keep = match o.recompute {
            Recompute::Full => 0,
            Recompute::Layers(n) => n.min(can),
            // The most layers whose plan fits (one more layer adds at most `per_layer`, and
            // less where the heaviest phase is a layer backward below some kept layers).
            Recompute::Auto => match o.device_free.filter(|_| !o.cpu) {
                None => 0,
                Some(free) => {
                    let room = (KEEP_FIT * free as f64) as u64;
                    (0..=can)
                        .rev()
                        .find(|&k| self.clone().keeping(spec, k, per_layer).total() <= room)
                        .unwrap_or(0)
                }
            },
        };
        self.keeping(spec, keep, per_layer)
    }

    /// The plan with `keep` layers keeping `per_layer` bytes each (module doc): every phase
    /// but the embedding's backward and the vision tower's forward holds all of it, except
    /// the layer backwards, which hold the part the kept layers at or below the layer keep,
    /// beside that layer's own graph.
    fn keeping(mut self, spec: &ModelSpec, keep: usize, per_layer: u64) -> DevicePlan {
        self.keep = keep;
        if keep == 0 {
            return self;
        }
        let kept = kept_layers(spec, keep);
        // Over the layers a phase runs (`graphs[l]` Some), the most its kept part adds to
        // the heaviest layer's graph, which the phase already counts.
        let beside = |graphs: &mut dyn Iterator<Item = Option<u64>>| {
            let (mut held, mut worst, mut with_kept) = (0, 0, 0);
            for (l, graph) in graphs.enumerate() {
                held += kept[l] as u64 * per_layer;
                if let Some(g) = graph {
                    worst = worst.max(g);
                    with_kept = with_kept.max(g + held);
                }
            }
            with_kept - worst
        };
        let layer_backward = beside(&mut self.graphs.iter().map(|&g| Some(g)));
        let tiles = beside(&mut self.tile_graphs.iter().copied());
        for phase in &mut self.phases {
            let bytes = match phase.name {
                EMBED_BACKWARD | VISION_FORWARD => continue,
                LAYER_BACKWARD => layer_backward,
                MLP_TILES => tiles,
                _ => keep as u64 * per_layer,
            };
            phase
                .parts
                .push(("MLP activations kept by the last layers", bytes));
        }
        self
    }
}
