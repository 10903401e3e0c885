//! Gemma 3's vision tower (SigLIP's vision encoder) and multimodal projector: the math of
//! transformers' `Gemma3Model.get_image_features`, whose output (`pooler_output`) the model
//! places at the image tokens. Frozen, the whole runs forward only ([`gemma3_vision`]); a
//! trained projector runs apart over the tower's kept output ([`gemma3_encoder`],
//! [`gemma3_projected`]), differentiable in its weights; a trained tower runs in pieces
//! ([`gemma3_embed`], [`gemma3_layer`], [`gemma3_head`]) which the worker recomputes with
//! grad one at a time.
//!
//! ```text
//! pixels (B, C, S, S) -> patch embed (a Conv2d whose stride is its kernel: one matmul)
//!   + a learned position per patch
//!   -> depth x [x + attn(layer_norm1(x)); x + mlp(layer_norm2(x))]   bidirectional, per image
//!   -> post_layernorm
//!   -> projector: average-pool the G x G patch grid to g x g tokens, Gemma's RMSNorm
//!      (`1 + w`), times `mm_input_projection_weight`
//! ```
//!
//! Shapes: B images, C channels, S image side, p patch side, G = S / p patches per side,
//! N = G² patches, E tower width, NH heads, D head dim, I MLP width, T image tokens per image
//! (g² with g = G / k, k the pooling window), O the text model's hidden size.

use std::collections::HashMap;

use mt::config::hf::Activation;
use mt::config::vision::siglip::SiglipSpec;
use tch::{Kind, Tensor};

use super::common::rms_norm_plus_one;
use super::vit::{VitWeights, encoder_layer};

/// The tower's and projector's tensors, by their names in the layout
/// (`encoder.layers.0.mlp.fc1.weight`, `multi_modal_projector.mm_input_projection_weight`),
/// on the compute device, in the compute dtype.
pub struct SiglipWeights {
    pub spec: SiglipSpec,
    tensors: HashMap<String, Tensor>,
}

impl SiglipWeights {
    /// Each of `tensors` must be one of `spec.tensors()`, of its shape: all of them for
    /// [`gemma3_vision`]; the tower's for [`gemma3_encoder`]; the projector's for
    /// [`gemma3_projected`] (a trained projector's, from the embedding block).
    pub fn new(spec: SiglipSpec, tensors: HashMap<String, Tensor>) -> SiglipWeights {
        let shapes: HashMap<String, Vec<usize>> = spec.tensors().into_iter().collect();
        for (name, t) in &tensors {
            let shape = shapes
                .get(name)
                .unwrap_or_else(|| panic!("`{name}` is not a Gemma 3 vision tensor"));
            let want: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
            assert_eq!(t.size(), want, "shape of vision tensor `{name}`");
        }
        SiglipWeights { spec, tensors }
    }

    fn get(&self, name: &str) -> &Tensor {
        self.tensors
            .get(name)
            .unwrap_or_else(|| panic!("vision weights hold no tensor `{name}`"))
    }

    /// These weights (shallow copies) with `trained`'s tensors added or replaced (a
    /// trained part's, from the embedding block).
    pub fn with(&self, trained: Vec<(String, Tensor)>) -> SiglipWeights {
        let mut tensors: HashMap<String, Tensor> = (self.tensors.iter())
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        tensors.extend(trained);
        SiglipWeights::new(self.spec.clone(), tensors)
    }

    /// `x W^T + b` with `{name}.weight` and `{name}.bias`.
    fn linear(&self, x: &Tensor, name: &str) -> Tensor {
        let b = self.get(&format!("{name}.bias"));
        x.linear(self.get(&format!("{name}.weight")), Some(b))
    }

    /// LayerNorm with `{name}.weight` and `{name}.bias`.
    fn layer_norm(&self, x: &Tensor, name: &str) -> Tensor {
        let e = self.spec.hidden_size as i64;
        x.layer_norm(
            [e],
            Some(self.get(&format!("{name}.weight"))),
            Some(self.get(&format!("{name}.bias"))),
            self.spec.layer_norm_eps,
            true,
        )
    }

    /// The compute dtype.
    pub fn kind(&self) -> Kind {
        self.get("embeddings.patch_embedding.weight").kind()
    }
}

impl VitWeights for SiglipWeights {
    fn linear(&self, x: &Tensor, name: &str) -> Tensor {
        SiglipWeights::linear(self, x, name)
    }
    fn layer_norm(&self, x: &Tensor, name: &str) -> Tensor {
        SiglipWeights::layer_norm(self, x, name)
    }
    fn heads(&self) -> (i64, i64) {
        (self.spec.num_heads as i64, self.spec.head_dim() as i64)
    }
    fn hidden_act(&self) -> Activation {
        self.spec.hidden_act
    }
}

/// The image tokens' features of `pixels_bcss` (B, C, S, S), image after image: (B T, O).
/// Forward only, without gradient.
pub fn gemma3_vision(w: &SiglipWeights, pixels_bcss: &Tensor) -> Tensor {
    let _no_grad = tch::no_grad_guard();
    gemma3_projected(w, &gemma3_encoder(w, pixels_bcss))
}

/// The projector's input (B, N, E) of `pixels_bcss` (B, C, S, S): the tower's output after
/// `post_layernorm`, computed without gradient (a trained projector keeps it for its
/// recompute in the embedding's backward).
pub fn gemma3_encoder(w: &SiglipWeights, pixels_bcss: &Tensor) -> Tensor {
    let _no_grad = tch::no_grad_guard();
    let mut x_bne = gemma3_embed(w, pixels_bcss);
    for l in 0..w.spec.depth {
        x_bne = gemma3_layer(w, l, &x_bne);
    }
    w.layer_norm(&x_bne, "post_layernorm")
}

/// The patch embedding (B, N, E) of `pixels_bcss` (B, C, S, S) with the learned positions:
/// encoder layer 0's input.
pub fn gemma3_embed(w: &SiglipWeights, pixels_bcss: &Tensor) -> Tensor {
    let s = &w.spec;
    let (c, side, p) = (
        s.in_channels as i64,
        s.image_size as i64,
        s.patch_size as i64,
    );
    let b = pixels_bcss.size()[0];
    assert_eq!(
        pixels_bcss.size(),
        [b, c, side, side],
        "pixels of {b} images"
    );
    let (g, e) = (side / p, s.hidden_size as i64);
    // Each patch's (C, p, p) values in the conv weight's order, patches in raster order.
    let patches_bnp = pixels_bcss
        .to_kind(w.kind())
        .reshape([b, c, g, p, g, p])
        .permute([0, 2, 4, 1, 3, 5])
        .reshape([b, g * g, c * p * p]);
    let w_pe = w.get("embeddings.patch_embedding.weight").reshape([e, -1]);
    patches_bnp.linear(&w_pe, Some(w.get("embeddings.patch_embedding.bias")))
        + w.get("embeddings.position_embedding.weight")
}

/// Encoder layer `l`: (B, N, E) -> (B, N, E).
pub fn gemma3_layer(w: &SiglipWeights, l: usize, x_bne: &Tensor) -> Tensor {
    encoder_layer(w, l, x_bne)
}

/// The image tokens' features (B T, O) from the last encoder layer's output `x_bne`
/// (B, N, E): `post_layernorm`, then the projector (a trained encoder's head, recomputed
/// with grad in the embedding's backward).
pub fn gemma3_head(w: &SiglipWeights, x_bne: &Tensor) -> Tensor {
    gemma3_projected(w, &w.layer_norm(x_bne, "post_layernorm"))
}

/// The image tokens' features (B T, O) from the projector's input `enc_bne` (B, N, E). With
/// `w`'s projector tensors as leaves and grad mode on, differentiable in them and in
/// `enc_bne` (a trained projector).
pub fn gemma3_projected(w: &SiglipWeights, enc_bne: &Tensor) -> Tensor {
    projector(w, enc_bne).reshape([-1, w.spec.out_hidden_size as i64])
}

/// Gemma3MultiModalProjector: (B, N, E) -> (B, T, O).
fn projector(w: &SiglipWeights, x_bne: &Tensor) -> Tensor {
    let s = &w.spec;
    let (b, e) = (x_bne.size()[0], s.hidden_size as i64);
    let (g, k) = (s.patches_per_side() as i64, s.pool() as i64);
    let grid_begg = x_bne.transpose(1, 2).reshape([b, e, g, g]);
    let pooled_bte = grid_begg
        .avg_pool2d([k, k], [k, k], [0, 0], false, true, None::<i64>)
        .flatten(2, -1)
        .transpose(1, 2);
    let normed_bte = rms_norm_plus_one(
        &pooled_bte,
        w.get("multi_modal_projector.mm_soft_emb_norm.weight"),
        s.layer_norm_eps,
    );
    normed_bte.matmul(w.get("multi_modal_projector.mm_input_projection_weight"))
}

#[cfg(test)]
mod tests;
