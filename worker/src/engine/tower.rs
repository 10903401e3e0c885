//! A trained vision encoder (`vlm.freeze_vision_encoder: false`: Qwen2.5-VL's, Qwen3-VL's and
//! Qwen3.5's) over one
//! micro-batch's images, designed as the decoder is: its weights are the embedding block's
//! (streamed from the store with it, `mt::layout::Layout::with_tower`), the forward runs
//! every block without grad and keeps only each block's input, and the embedding's
//! backward recomputes the merger, then each block from the last, with grad on leaves of
//! the block's weights and of its kept input, handing each block's input gradient to the
//! block before; the gradients land in the embedding block's leaves, which leave for the
//! host with the embedding's.
//!
//! Tensors that do not train (the merger under `vlm.freeze_projector: true`) come from the
//! frozen tower the worker copied from the region; the gradient passes through them.
//!
//! Shapes: N patches (in the window order), P values per patch, E the tower's width, M
//! image tokens, H the language model's width.

use anyhow::{Context as _, Result, bail};
use mt::config::TowerTraining;
use mt::config::hf::TOWER;
use tch::Tensor;

use crate::kernels::tape::backward_with_grads;
use crate::model::{BlockWeights, Encoded, Geometry, VisionWeights, vision_merger};

/// One micro-batch's pass through a trained encoder.
pub struct EncoderPass {
    /// The tower's frozen tensors (the merger's where it does not train; none else).
    frozen: VisionWeights,
    training: TowerTraining,
    /// (N, P): the images' patch rows, in the compute dtype, on the device.
    pixels_np: Tensor,
    geo: Geometry,
    /// Each block's input (N, E), block 0's first, kept by the forward for the backward.
    inputs: Vec<Tensor>,
    /// The deepstack mergers' inputs (N, E) each (Qwen3-VL's tapped blocks' outputs, in
    /// the order of [`crate::model::qwen3_vl_deepstack`]), leaves that require grad in a
    /// training step; empty without deepstack.
    taps: Vec<Tensor>,
    /// The encoder's output (the merger's input), after [`EncoderPass::forward`]: a leaf
    /// that requires grad, where the merger's recompute hands its gradient.
    encoded: Option<Encoded>,
}

impl std::fmt::Debug for EncoderPass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncoderPass")
            .field("training", &self.training)
            .field("pixels_np", &self.pixels_np.size())
            .field("inputs", &self.inputs.len())
            .finish_non_exhaustive()
    }
}

impl EncoderPass {
    /// The pass over `pixels_np` (N, P) of images of patch grids `grids`, the frozen
    /// tensors `frozen` (the region's), what trains `training` (the encoder at least).
    pub fn new(
        frozen: &VisionWeights,
        training: TowerTraining,
        pixels_np: Tensor,
        grids: &[[u32; 3]],
    ) -> EncoderPass {
        assert!(training.encoder(), "a pass of a trained encoder");
        let geo = Geometry::new(&frozen.spec, grids, pixels_np.device());
        EncoderPass {
            frozen: frozen.with(Vec::new()),
            training,
            pixels_np,
            geo,
            inputs: Vec::new(),
            taps: Vec::new(),
            encoded: None,
        }
    }

    /// The tower's weights: the trained ones from `embed_w` (the embedding block's views,
    /// or its leaves in the backward: `visual.blocks.0.attn.qkv.weight`), the rest frozen.
    pub fn weights(&self, embed_w: &BlockWeights) -> VisionWeights {
        let trained = (self.frozen.spec.tensors().into_iter())
            .filter(|(name, _)| self.training.trains(name))
            .map(|(name, _)| {
                let t = embed_w.get(&format!("{TOWER}{name}")).shallow_clone();
                (name, t)
            })
            .collect();
        self.frozen.with(trained)
    }

    /// The encoder's forward from `embed_w`'s views (no grad mode is set here: the
    /// engine's forward has none), each block's input kept where `keep` (a training step;
    /// not an evaluation), and the deepstack mergers' inputs.
    pub fn forward(&mut self, embed_w: &BlockWeights, keep: bool) {
        let w = self.weights(embed_w);
        self.inputs.clear();
        self.taps.clear();
        // A leaf where `keep`: what is recomputed with grad over it in the backward leaves
        // its gradient there.
        let leaf = |x: &Tensor| match keep {
            true => x.detach().set_requires_grad(true),
            false => x.shallow_clone(),
        };
        let tapped: Vec<usize> = w.spec.deepstack_taps().iter().map(|&(b, _)| b).collect();
        let mut x_ne = self.geo.patch_embed(&w, &self.pixels_np);
        for b in 0..w.spec.depth {
            let y_ne = self.geo.block(&w, b, &x_ne);
            if tapped.contains(&b) {
                self.taps.push(leaf(&y_ne));
            }
            let x = std::mem::replace(&mut x_ne, y_ne);
            if keep {
                self.inputs.push(x);
            }
        }
        self.encoded = Some(self.geo.encoded(leaf(&x_ne)));
    }

    /// Whether the tower has deepstack mergers (Qwen3-VL's).
    pub fn deepstack(&self) -> bool {
        !self.frozen.spec.deepstack_taps().is_empty()
    }

    /// The deepstack mergers' inputs the forward kept (leaves in a training step).
    pub fn taps(&self) -> &[Tensor] {
        &self.taps
    }

    /// The merger over the encoder's output (M, H), with `embed_w`'s weights where the
    /// merger trains: with grad where those are leaves and grad mode is on (the
    /// embedding's backward), and into the encoder's output either way.
    pub fn features_mh(&self, embed_w: &BlockWeights) -> Tensor {
        let enc = (self.encoded.as_ref()).expect("the encoder runs before its features are read");
        vision_merger(&self.weights(embed_w), enc)
    }

    /// After the embedding's backward has passed through the merger (and the deepstack
    /// mergers, into the taps): the blocks, last to first, recomputed with grad on
    /// `embed_w`'s leaves and on a leaf of each block's kept input, backpropagated from the
    /// gradient of its output (a tapped block's: plus its tap's); then the patch embedding.
    /// Each kept input is released once its block is done. Where no gradient reached the
    /// encoder's output or a tap (no image token reached the loss) nothing flows and the
    /// leaves keep none (their gradient is written as zeros).
    pub fn backward(&mut self, embed_w: &BlockWeights) -> Result<()> {
        let enc = (self.encoded.take()).context("the encoder's backward before its forward")?;
        let depth = self.frozen.spec.depth;
        if self.inputs.len() != depth {
            bail!(
                "the encoder kept {} block inputs for its {depth} blocks",
                self.inputs.len()
            );
        }
        let defined = |t: Tensor| t.defined().then_some(t);
        let mut taps: Vec<(usize, Option<Tensor>)> = (self.frozen.spec.deepstack_taps().iter())
            .zip(std::mem::take(&mut self.taps))
            .map(|(&(b, _), t)| (b, defined(t.grad())))
            .collect();
        let mut dy_ne = defined(enc.x_ne.grad());
        let w = self.weights(embed_w);
        for b in (0..depth).rev() {
            let x_ne = self.inputs.pop().expect("checked above");
            if let Some(at) = taps.iter().position(|&(t, _)| t == b) {
                dy_ne = match (dy_ne, taps.remove(at).1) {
                    (Some(d), Some(t)) => Some(d + t),
                    (d, t) => d.or(t),
                };
            }
            let Some(dy) = dy_ne else {
                continue;
            };
            let x_ne = x_ne.detach().set_requires_grad(true);
            let y_ne = self.geo.block(&w, b, &x_ne);
            backward_with_grads(vec![(y_ne, dy)]);
            dy_ne = defined(x_ne.grad());
        }
        if let Some(dy) = dy_ne {
            let y_ne = self.geo.patch_embed(&w, &self.pixels_np);
            backward_with_grads(vec![(y_ne, dy)]);
        }
        Ok(())
    }
}
