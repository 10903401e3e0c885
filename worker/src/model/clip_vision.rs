//! LLaVA-NeXT's vision tower (CLIP's vision encoder), projector and image newline: the math
//! of transformers' `LlavaNextModel.get_image_features`, whose output (`pooler_output`, image
//! after image) the model places at the image tokens. Frozen, the whole runs forward only
//! ([`llava_next_vision`]); a trained projector runs apart over the tower's kept features; a
//! trained tower in pieces ([`llava_next_embed`], [`llava_next_layer`], [`llava_next_head`])
//! which the worker recomputes with grad one at a time.
//!
//! ```text
//! tiles (Tt, C, S, S) -> patch embed (a Conv2d without bias whose stride is its kernel: one
//!   matmul), the class embedding before the patches, + a learned position per token
//!   -> pre_layrnorm
//!   -> layers_run x [x + attn(layer_norm1(x)); x + mlp(layer_norm2(x))]  bidirectional, per tile
//!   -> drop the class token (`default`) -> projector: linear_2(gelu(linear_1(x)))
//!   -> per image: the base tile's G² features, then the other tiles' (rows x cols) grid of
//!      G x G features cropped to the image's aspect, each row followed by `image_newline`
//! ```
//!
//! The layers after the one `vision_feature_layer` reads and `post_layernorm` (applied to
//! the class token alone) do not reach the features and are not run.
//!
//! Shapes: Tt tiles of all images, C channels, S tile side, p patch side, G = S / p patches
//! per side, N = G² patches, E tower width, NH heads, D head dim, I MLP width, H the text
//! model's hidden size, M image tokens.

use std::collections::HashMap;

use mt::config::hf::Activation;
use mt::config::vision::clip::{ClipSpec, IMAGE_NEWLINE};
use tch::{Kind, Tensor};

use super::common::activation;
use super::vit::{VitWeights, encoder_layer};

/// The tower's, projector's and newline's tensors, by their names in the layout
/// (`encoder.layers.0.mlp.fc1.weight`, `multi_modal_projector.linear_1.weight`,
/// `image_newline`), on the compute device, in the compute dtype.
pub struct ClipWeights {
    pub spec: ClipSpec,
    tensors: HashMap<String, Tensor>,
}

impl ClipWeights {
    /// Each of `tensors` must be one of `spec.tensors()`, of its shape: all of them for
    /// [`llava_next_vision`]; the tower's for [`llava_next_encoder`]; the projector's and
    /// the newline for [`llava_next_projected`] (a trained projector's, from the embedding
    /// block).
    pub fn new(spec: ClipSpec, tensors: HashMap<String, Tensor>) -> ClipWeights {
        let shapes: HashMap<String, Vec<usize>> = spec.tensors().into_iter().collect();
        for (name, t) in &tensors {
            let shape = shapes
                .get(name)
                .unwrap_or_else(|| panic!("`{name}` is not a LLaVA-NeXT vision tensor"));
            let want: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
            assert_eq!(t.size(), want, "shape of vision tensor `{name}`");
        }
        ClipWeights { spec, tensors }
    }

    fn get(&self, name: &str) -> &Tensor {
        self.tensors
            .get(name)
            .unwrap_or_else(|| panic!("vision weights hold no tensor `{name}`"))
    }

    /// These weights (shallow copies) with `trained`'s tensors added or replaced (a
    /// trained part's, from the embedding block).
    pub fn with(&self, trained: Vec<(String, Tensor)>) -> ClipWeights {
        let mut tensors: HashMap<String, Tensor> = (self.tensors.iter())
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        tensors.extend(trained);
        ClipWeights::new(self.spec.clone(), tensors)
    }

    /// `x W^T + b` with `{name}.weight` and, where the checkpoint has it, `{name}.bias`.
    fn linear(&self, x: &Tensor, name: &str) -> Tensor {
        let b = self.tensors.get(&format!("{name}.bias"));
        x.linear(self.get(&format!("{name}.weight")), b)
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

impl VitWeights for ClipWeights {
    fn linear(&self, x: &Tensor, name: &str) -> Tensor {
        ClipWeights::linear(self, x, name)
    }
    fn layer_norm(&self, x: &Tensor, name: &str) -> Tensor {
        ClipWeights::layer_norm(self, x, name)
    }
    fn heads(&self) -> (i64, i64) {
        (self.spec.num_heads as i64, self.spec.head_dim() as i64)
    }
    fn hidden_act(&self) -> Activation {
        self.spec.hidden_act
    }
}

/// The image tokens' features (M, H) of images of `sizes` ((height, width) in pixels, in
/// order) whose tiles are `tiles_tcss` (Tt, C, S, S), each image's base tile first, as
/// [`ClipSpec::tiles`] counts them. Forward only, without gradient.
pub fn llava_next_vision(w: &ClipWeights, tiles_tcss: &Tensor, sizes: &[[u32; 2]]) -> Tensor {
    let _no_grad = tch::no_grad_guard();
    llava_next_projected(w, &llava_next_encoder(w, tiles_tcss, sizes), sizes)
}

/// The projector's input (Tt, N, E) for images of `sizes` whose tiles are `tiles_tcss`:
/// the tower's patch features, computed without gradient (a trained projector keeps them
/// for its recompute in the embedding's backward).
pub fn llava_next_encoder(w: &ClipWeights, tiles_tcss: &Tensor, sizes: &[[u32; 2]]) -> Tensor {
    let _no_grad = tch::no_grad_guard();
    let s = &w.spec;
    let tiles: usize = sizes.iter().map(|&[h, wd]| s.tiles(h, wd)).sum();
    let (c, side) = (s.in_channels as i64, s.image_size as i64);
    assert_eq!(
        tiles_tcss.size(),
        [tiles as i64, c, side, side],
        "tiles of {} images",
        sizes.len()
    );
    tower(w, tiles_tcss)
}

/// The image tokens' features (M, H) from the projector's input `enc_tne` (Tt, N, E) of
/// images of `sizes`: the projector, then each image's tiles packed. With `w`'s projector
/// tensors as leaves and grad mode on, differentiable in them (a trained projector).
pub fn llava_next_projected(w: &ClipWeights, enc_tne: &Tensor, sizes: &[[u32; 2]]) -> Tensor {
    let s = &w.spec;
    let counts: Vec<i64> = sizes.iter().map(|&[h, wd]| s.tiles(h, wd) as i64).collect();
    let f_tnh = projector(w, enc_tne);
    let per_image = f_tnh.split_with_sizes(counts.as_slice(), 0);
    let images: Vec<Tensor> = (per_image.iter().zip(sizes))
        .map(|(f, &[h, wd])| pack(w, f, h, wd))
        .collect();
    Tensor::cat(&images, 0)
}

/// The patch features (Tt, N, E) of tiles (Tt, C, S, S): the hidden state
/// `vision_feature_layer` names, the class token dropped.
fn tower(w: &ClipWeights, tiles_tcss: &Tensor) -> Tensor {
    let mut x_tne = llava_next_embed(w, tiles_tcss);
    for l in 0..w.spec.layers_run() {
        x_tne = llava_next_layer(w, l, &x_tne);
    }
    drop_class(w, &x_tne)
}

/// The embeddings (Tt, 1 + N, E) of tiles (Tt, C, S, S): the class embedding, then each
/// patch's, plus a learned position per token, through `pre_layrnorm`: encoder layer 0's
/// input.
pub fn llava_next_embed(w: &ClipWeights, tiles_tcss: &Tensor) -> Tensor {
    let s = &w.spec;
    let t = tiles_tcss.size()[0];
    let (c, p, g, e) = (
        s.in_channels as i64,
        s.patch_size as i64,
        s.patches_per_side() as i64,
        s.hidden_size as i64,
    );
    // Each patch's (C, p, p) values in the conv weight's order, patches in raster order.
    let patches_tnp = tiles_tcss
        .to_kind(w.kind())
        .reshape([t, c, g, p, g, p])
        .permute([0, 2, 4, 1, 3, 5])
        .reshape([t, g * g, c * p * p]);
    let w_pe = w.get("embeddings.patch_embedding.weight").reshape([e, -1]);
    let patch_tne = patches_tnp.linear(&w_pe, None::<Tensor>);
    let class_t1e = w
        .get("embeddings.class_embedding")
        .view([1, 1, e])
        .expand([t, 1, e], false);
    let x_tne =
        Tensor::cat(&[class_t1e, patch_tne], 1) + w.get("embeddings.position_embedding.weight");
    w.layer_norm(&x_tne, "pre_layrnorm")
}

/// Encoder layer `l`: (Tt, 1 + N, E) -> (Tt, 1 + N, E).
pub fn llava_next_layer(w: &ClipWeights, l: usize, x_tne: &Tensor) -> Tensor {
    encoder_layer(w, l, x_tne)
}

/// The image tokens' features (M, H) of images of `sizes` from the output `x_tne`
/// (Tt, 1 + N, E) of the last layer that runs: the class token dropped, then
/// [`llava_next_projected`] (a trained encoder's head, recomputed with grad in the
/// embedding's backward).
pub fn llava_next_head(w: &ClipWeights, x_tne: &Tensor, sizes: &[[u32; 2]]) -> Tensor {
    llava_next_projected(w, &drop_class(w, x_tne), sizes)
}

/// (Tt, 1 + N, E) -> (Tt, N, E): the class token dropped (`default`).
fn drop_class(w: &ClipWeights, x_tne: &Tensor) -> Tensor {
    let n = w.spec.tile_features() as i64;
    x_tne.narrow(1, 1, n)
}

/// LlavaNextMultiModalProjector: (Tt, N, E) -> (Tt, N, H).
fn projector(w: &ClipWeights, x_tne: &Tensor) -> Tensor {
    let h = w.linear(x_tne, "multi_modal_projector.linear_1");
    w.linear(
        &activation(&h, w.spec.projector_act),
        "multi_modal_projector.linear_2",
    )
}

/// One image's tokens (its count of [`ClipSpec::image_tokens`], H) from its tiles'
/// features `f_tnh` (1 + rows x cols, N, H): the base tile's, then the grid cropped to the
/// image's aspect ([`ClipSpec::unpadded`]), row by row, each row followed by the newline.
fn pack(w: &ClipWeights, f_tnh: &Tensor, height: u32, width: u32) -> Tensor {
    let s = &w.spec;
    let (rows, cols) = s.tile_grid(height, width);
    let (r, c, g) = (rows as i64, cols as i64, s.patches_per_side() as i64);
    let hid = f_tnh.size()[2];
    let base_nh = f_tnh.get(0);
    // (rows, cols, G, G, H) -> (rows, G, cols, G, H): the grid's rows of features.
    let grid_yxh = f_tnh
        .narrow(0, 1, r * c)
        .view([r, c, g, g, hid])
        .permute([0, 2, 1, 3, 4])
        .reshape([r * g, c * g, hid]);
    let [top, keep_rows, left, keep_cols] = s.unpadded(height, width).map(|x| x as i64);
    let crop_yxh = grid_yxh
        .narrow(0, top, keep_rows)
        .narrow(1, left, keep_cols);
    let newline_yxh = w
        .get(IMAGE_NEWLINE)
        .to_kind(crop_yxh.kind())
        .view([1, 1, hid])
        .expand([keep_rows, 1, hid], false);
    let rows_mh = Tensor::cat(&[crop_yxh, newline_yxh], 1).reshape([-1, hid]);
    Tensor::cat(&[base_nh, rows_mh], 0)
}

#[cfg(test)]
mod tests;
