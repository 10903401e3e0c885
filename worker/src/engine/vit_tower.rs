//! A trained SigLIP (Gemma 3) or CLIP (LLaVA-NeXT) tower (`vlm.freeze_vision_encoder:
//! false`) over one micro-batch's images, designed as Qwen2.5-VL's ([`super::tower`]): its
//! trained weights are the embedding block's, the forward runs the patch embedding and every
//! encoder layer that reaches the features without grad and keeps each layer's input, and
//! the embedding's backward recomputes the head (SigLIP's `post_layernorm` and projector;
//! CLIP's class token dropped, the projector and the packing with `image_newline`) over a
//! leaf of the last layer's output, then each layer from the last on a leaf of its kept
//! input, then the patch embedding, each backpropagating the gradient of its output into
//! the embedding block's leaves.
//!
//! Tensors that do not train (the projector under `vlm.freeze_projector: true`; CLIP's
//! layers after the one `vision_feature_layer` reads and its `post_layernorm`, which do
//! not reach the features) come from the frozen tower the worker copied from the region.
//!
//! Shapes: B images (Gemma 3) or tiles (LLaVA-NeXT), N tokens each, E the tower's width,
//! M image tokens, H the language model's width.

use anyhow::{Context as _, Result, bail};
use mt::config::TowerTraining;
use mt::config::vision::TowerSpec;
use tch::Tensor;

use crate::kernels::tape::backward_with_grads;
use crate::model::{
    BlockWeights, ClipWeights, SiglipWeights, gemma3_embed, gemma3_head, gemma3_layer,
    llava_next_embed, llava_next_head, llava_next_layer,
};

/// The tower's frozen tensors, of its family.
enum Frozen {
    Siglip(SiglipWeights),
    /// With the images' sizes (height, width), which set how the tiles are packed.
    Clip(ClipWeights, Vec<[u32; 2]>),
}

/// The tower's weights, frozen and trained together.
enum Weights {
    Siglip(SiglipWeights),
    Clip(ClipWeights),
}

/// One micro-batch's pass through a trained SigLIP or CLIP tower.
pub struct VitPass {
    frozen: Frozen,
    training: TowerTraining,
    /// The trained tensors' names in the embedding block are under
    /// `vision_tower.vision_model.` ([`TowerSpec::layout_name`]).
    nested: bool,
    /// (B, C, S, S): the images (Gemma 3) or tiles (LLaVA-NeXT), in the compute dtype, on
    /// the device.
    pixels_bcss: Tensor,
    /// Each layer's input (B, N, E), layer 0's first, kept by the forward for the backward.
    inputs: Vec<Tensor>,
    /// The last layer's output (the head's input), after [`VitPass::forward`]: a leaf that
    /// requires grad, where the head's recompute hands its gradient.
    last_bne: Option<Tensor>,
}

impl std::fmt::Debug for VitPass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VitPass")
            .field("training", &self.training)
            .field("pixels_bcss", &self.pixels_bcss.size())
            .field("inputs", &self.inputs.len())
            .finish_non_exhaustive()
    }
}

impl VitPass {
    /// Gemma 3's pass over its images `pixels_bcss` (B, C, S, S), the frozen tensors
    /// `frozen` (the region's), what trains `training` (the encoder at least), the trained
    /// tensors' names `nested` or not ([`TowerSpec::layout_name`]).
    pub fn siglip(
        frozen: &SiglipWeights,
        training: TowerTraining,
        nested: bool,
        pixels_bcss: Tensor,
    ) -> VitPass {
        let frozen = Frozen::Siglip(frozen.with(Vec::new()));
        VitPass::new(frozen, training, nested, pixels_bcss)
    }

    /// LLaVA-NeXT's pass over the tiles `tiles_tcss` (Tt, C, S, S) of images of `sizes`.
    pub fn clip(
        frozen: &ClipWeights,
        training: TowerTraining,
        nested: bool,
        tiles_tcss: Tensor,
        sizes: Vec<[u32; 2]>,
    ) -> VitPass {
        let frozen = Frozen::Clip(frozen.with(Vec::new()), sizes);
        VitPass::new(frozen, training, nested, tiles_tcss)
    }

    fn new(frozen: Frozen, training: TowerTraining, nested: bool, pixels_bcss: Tensor) -> VitPass {
        assert!(training.encoder(), "a pass of a trained encoder");
        VitPass {
            frozen,
            training,
            nested,
            pixels_bcss,
            inputs: Vec::new(),
            last_bne: None,
        }
    }

    /// The tower's spec.
    fn spec(&self) -> TowerSpec {
        match &self.frozen {
            Frozen::Siglip(w) => TowerSpec::Siglip(w.spec.clone()),
            Frozen::Clip(w, _) => TowerSpec::Clip(w.spec.clone()),
        }
    }

    /// The encoder layers that reach the features (all of SigLIP's; CLIP's up to the one
    /// `vision_feature_layer` reads).
    fn layers(&self) -> usize {
        match &self.frozen {
            Frozen::Siglip(w) => w.spec.depth,
            Frozen::Clip(w, _) => w.spec.layers_run(),
        }
    }

    /// The tower's weights: the trained ones from `embed_w` (the embedding block's views,
    /// or its leaves in the backward: `vision_tower.encoder.layers.0.mlp.fc1.weight`), the
    /// rest frozen.
    fn weights(&self, embed_w: &BlockWeights) -> Weights {
        let spec = self.spec();
        let trained: Vec<(String, Tensor)> = (spec.tensors().into_iter())
            .filter(|(name, _)| spec.trains(self.training, name))
            .map(|(name, _)| {
                let t = embed_w
                    .get(&spec.layout_name(&name, self.nested))
                    .shallow_clone();
                (name, t)
            })
            .collect();
        match &self.frozen {
            Frozen::Siglip(w) => Weights::Siglip(w.with(trained)),
            Frozen::Clip(w, _) => Weights::Clip(w.with(trained)),
        }
    }

    fn embed(&self, w: &Weights) -> Tensor {
        match w {
            Weights::Siglip(w) => gemma3_embed(w, &self.pixels_bcss),
            Weights::Clip(w) => llava_next_embed(w, &self.pixels_bcss),
        }
    }

    fn layer(w: &Weights, l: usize, x_bne: &Tensor) -> Tensor {
        match w {
            Weights::Siglip(w) => gemma3_layer(w, l, x_bne),
            Weights::Clip(w) => llava_next_layer(w, l, x_bne),
        }
    }

    /// The tower's forward from `embed_w`'s views (no grad mode is set here: the engine's
    /// forward has none), each layer's input kept where `keep` (a training step; not an
    /// evaluation).
    pub fn forward(&mut self, embed_w: &BlockWeights, keep: bool) {
        let w = self.weights(embed_w);
        self.inputs.clear();
        let mut x_bne = self.embed(&w);
        for l in 0..self.layers() {
            let y_bne = VitPass::layer(&w, l, &x_bne);
            let x = std::mem::replace(&mut x_bne, y_bne);
            if keep {
                self.inputs.push(x);
            }
        }
        // A leaf: the head recomputed with grad in the backward leaves its gradient here.
        self.last_bne = Some(match keep {
            true => x_bne.detach().set_requires_grad(true),
            false => x_bne,
        });
    }

    /// The head over the last layer's output (M, H), with `embed_w`'s weights where they
    /// train: with grad where those are leaves and grad mode is on (the embedding's
    /// backward), and into the last layer's output either way.
    pub fn features_mh(&self, embed_w: &BlockWeights) -> Tensor {
        let x_bne = (self.last_bne.as_ref()).expect("the tower runs before its features are read");
        match (self.weights(embed_w), &self.frozen) {
            (Weights::Siglip(w), _) => gemma3_head(&w, x_bne),
            (Weights::Clip(w), Frozen::Clip(_, sizes)) => llava_next_head(&w, x_bne, sizes),
            (Weights::Clip(_), Frozen::Siglip(_)) => unreachable!("weights of the pass's family"),
        }
    }

    /// After the embedding's backward has passed through the head: the layers, last to
    /// first, recomputed with grad on `embed_w`'s leaves and on a leaf of each layer's kept
    /// input, backpropagated from the gradient of its output; then the patch embedding. Each
    /// kept input is released once its layer is done. Without a gradient at the last
    /// layer's output (no image token reached the loss) nothing flows and the leaves keep
    /// none (their gradient is written as zeros).
    pub fn backward(&mut self, embed_w: &BlockWeights) -> Result<()> {
        let last = (self.last_bne.take()).context("the tower's backward before its forward")?;
        let layers = self.layers();
        if self.inputs.len() != layers {
            bail!(
                "the tower kept {} layer inputs for its {layers} layers",
                self.inputs.len()
            );
        }
        let mut dy_bne = last.grad();
        if !dy_bne.defined() {
            return Ok(());
        }
        let w = self.weights(embed_w);
        for l in (0..layers).rev() {
            let x_bne = self.inputs.pop().expect("checked above");
            let x_bne = x_bne.detach().set_requires_grad(true);
            let y_bne = VitPass::layer(&w, l, &x_bne);
            backward_with_grads(vec![(y_bne, dy_bne)]);
            dy_bne = x_bne.grad();
        }
        let y_bne = self.embed(&w);
        backward_with_grads(vec![(y_bne, dy_bne)]);
        Ok(())
    }
}
