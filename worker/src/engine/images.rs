//! A micro-batch's images as the language model reads them: the vision tower's features,
//! which replace the embeddings of the image tokens ([`crate::model::place_image_features`]),
//! Qwen3-VL's deepstack features, which the first layers' outputs take at the image tokens
//! ([`MicroImages::after_layer`]), and what the attention reads of them: the Qwen models' 3-D
//! positions of every token (`mt::mrope`), from which the rotary tables are built
//! ([`crate::model::Context::with_positions_3d`]), or Gemma 3's image blocks, each image's
//! tokens attending to each other both ways ([`crate::model::Context::with_image_blocks`]);
//! LLaVA-NeXT's features change nothing else (1-D positions, causal attention).
//!
//! The frozen part of the tower runs once per micro-batch, without grad, from the weights
//! the worker copied from the read-only region. A trained projector
//! (`vlm.freeze_projector: false`, Qwen2.5-VL's or Qwen3.5's merger, Gemma 3's projector,
//! LLaVA-NeXT's projector and newline) runs where the embedding does, from the embedding
//! block's weights: without grad in the forward, recomputed with grad on its leaves in the
//! embedding's backward, where the gradient at the image tokens' rows flows into it. Its input (the encoder's output,
//! N x E) is kept for that. A trained encoder (`vlm.freeze_vision_encoder: false`,
//! Qwen2.5-VL's, Qwen3-VL's or Qwen3.5's; Gemma 3's and LLaVA-NeXT's tower) runs where the
//! embedding does too, block by block ([`super::tower`], [`super::vit_tower`]).
//!
//! Qwen3-VL's deepstack features, where the tower trains in any part, are computed in the
//! forward from their mergers' kept inputs (the tapped blocks' outputs) with the embedding
//! block's weights; the decoder's backward gathers the gradient at the image tokens of each
//! layer's output that took one ([`MicroImages::gather_deepstack`]), and the embedding's
//! backward recomputes the deepstack mergers with grad from it
//! ([`MicroImages::deepstack_outputs`]).
//!
//! Shapes: B rows, T padded length, M image tokens, H hidden size, N patches, E the
//! tower's width, I images, S the side of Gemma 3's images and of LLaVA-NeXT's tiles, Tt
//! LLaVA-NeXT's tiles of all images.

use anyhow::{Context as _, Result, bail};
use mt::config::TowerTraining;
use mt::config::hf::{ModelSpec, TOWER};
use mt::config::vision::clip::ClipSpec;
use mt::config::vision::siglip::SiglipSpec;
use mt::config::vision::{VisionFamily, VisionSpec};
use mt::data::{ImageProcessor, MicroBatch};
use mt::mrope::{ImageTokens, rope_index};
use tch::{Device, Kind, Tensor};

use super::pixels::{gemma3_pixels, llava_next_tiles, pixel_rows, qwen_pixels};
use super::tower::EncoderPass;
use super::vit_tower::VitPass;
use crate::model::{
    BlockWeights, ClipWeights, Encoded, SiglipWeights, TowerWeights, VisionWeights,
    add_at_image_tokens, gemma3_encoder, gemma3_projected, gemma3_vision, llava_next_encoder,
    llava_next_projected, llava_next_vision, qwen2_5_vl_vision, qwen3_vl_deepstack,
    qwen3_vl_vision, vision_encoder, vision_merger,
};

/// The worker's vision tower (its frozen tensors) and how it reads an image file.
pub struct Tower {
    pub weights: TowerWeights,
    /// What of it trains (those tensors are the embedding block's).
    pub training: TowerTraining,
    /// The image processor's settings (`preprocessor_config.json`); None where the model
    /// directory has none, and then no batch carries images (the data load refuses them).
    pub pixels: Option<ImageProcessor>,
}

impl Tower {
    /// What `mb`'s images bring to the language model, on `device`: the frozen tower's
    /// output for them, in the order their tokens appear, each file decoded and resized as
    /// the model's image processor does ([`pixel_rows`], unless `decoded` holds them
    /// already: [`super::prefetch`]), all images in one batch through the tower without
    /// grad; and what the attention reads of them.
    pub fn micro_images(
        &self,
        spec: &ModelSpec,
        mb: &MicroBatch,
        decoded: Option<Vec<Vec<f32>>>,
        kind: Kind,
        device: Device,
    ) -> Result<MicroImages> {
        let Some(px) = &self.pixels else {
            bail!("the micro-batch has images but the model has no image processor settings");
        };
        let per_image = match decoded {
            Some(rows) => rows,
            None => pixel_rows(px, &mb.images)?,
        };
        let _no_grad = tch::no_grad_guard();
        match (&self.weights, px) {
            (TowerWeights::Qwen(w), ImageProcessor::Qwen(px)) => {
                let grids: Vec<[u32; 3]> = mb.images.iter().map(|im| im.grid).collect();
                let pixels_np = qwen_pixels(px, &per_image, kind, device)?;
                let (features, deepstack_mh) = match (w.spec.family, self.training) {
                    (VisionFamily::Qwen2_5Vl, TowerTraining::Frozen) => (
                        Features::Frozen(qwen2_5_vl_vision(w, &pixels_np, &grids)),
                        Vec::new(),
                    ),
                    (VisionFamily::Qwen3Vl, TowerTraining::Frozen) => {
                        let f = qwen3_vl_vision(w, &pixels_np, &grids);
                        (Features::Frozen(f.merged_mo), f.deepstack_mo)
                    }
                    (_, TowerTraining::Projector) => {
                        let (enc, taps) = vision_encoder(w, &pixels_np, &grids);
                        let spec = w.spec.clone();
                        (Features::Merger { enc, spec, taps }, Vec::new())
                    }
                    (_, t) => {
                        let pass = EncoderPass::new(w, t, pixels_np, &grids);
                        (Features::Encoder(Box::new(pass)), Vec::new())
                    }
                };
                MicroImages::new(spec, mb, &grids, features, deepstack_mh, device)
            }
            (TowerWeights::Siglip(w), ImageProcessor::Gemma3(px)) => {
                let pixels = gemma3_pixels(px, &per_image, kind, device)?;
                let features = match self.training {
                    TowerTraining::Frozen => {
                        Features::Frozen(gemma3_vision(w, &pixels).f_to_device(device)?)
                    }
                    TowerTraining::Projector => Features::Pooled {
                        enc_bne: gemma3_encoder(w, &pixels),
                        spec: w.spec.clone(),
                    },
                    t => Features::Vit(Box::new(VitPass::siglip(w, t, spec.tower_nested, pixels))),
                };
                MicroImages::image_blocks(mb, w.spec.image_token_id, features, device)
            }
            (TowerWeights::Clip(w), ImageProcessor::LlavaNext(px)) => {
                let sizes: Vec<[u32; 2]> = mb
                    .images
                    .iter()
                    .map(|im| [im.grid[1], im.grid[2]])
                    .collect();
                let tiles = llava_next_tiles(px, &per_image, kind, device)?;
                let features = match self.training {
                    TowerTraining::Frozen => {
                        Features::Frozen(llava_next_vision(w, &tiles, &sizes).f_to_device(device)?)
                    }
                    TowerTraining::Projector => Features::Projector {
                        enc_tne: llava_next_encoder(w, &tiles, &sizes),
                        sizes,
                        spec: w.spec.clone(),
                    },
                    t => Features::Vit(Box::new(VitPass::clip(
                        w,
                        t,
                        spec.tower_nested,
                        tiles,
                        sizes,
                    ))),
                };
                Ok(MicroImages::placed(w.spec.image_token_id, features))
            }
            _ => bail!("the image processor's settings are not for this model's vision tower"),
        }
    }
}

/// What the frozen part of the tower gave for a micro-batch's images.
#[derive(Debug)]
pub enum Features {
    /// The tower's output (M, H) (the projector frozen).
    Frozen(Tensor),
    /// The projector's input, and Qwen3-VL's deepstack mergers' inputs (N, E) each (the
    /// frozen encoder's tapped blocks' outputs); its weights are the embedding block's.
    Merger {
        enc: Encoded,
        spec: VisionSpec,
        taps: Vec<Tensor>,
    },
    /// Gemma 3's projector's input, the tower's output (I, N, E) after `post_layernorm`; the
    /// projector's weights are the embedding block's.
    Pooled { enc_bne: Tensor, spec: SiglipSpec },
    /// LLaVA-NeXT's projector's input, the tower's patch features (Tt, N, E) of images of
    /// `sizes` (height, width); the projector's weights and the newline are the embedding
    /// block's.
    Projector {
        enc_tne: Tensor,
        sizes: Vec<[u32; 2]>,
        spec: ClipSpec,
    },
    /// Nothing yet: the encoder trains, and runs from the embedding block's weights.
    Encoder(Box<EncoderPass>),
    /// Nothing yet: Gemma 3's SigLIP or LLaVA-NeXT's CLIP tower trains, and runs from the
    /// embedding block's weights.
    Vit(Box<VitPass>),
}

impl Features {
    /// The Qwen tower's weights where part of it trains: the trained ones from `embed_w`
    /// (views, or leaves in the backward), the rest the frozen tower's; and Qwen3-VL's
    /// deepstack mergers' inputs. None for a frozen tower and the SigLIP and CLIP towers' parts.
    fn trained_qwen(&self, embed_w: &BlockWeights) -> Option<(VisionWeights, &[Tensor])> {
        match self {
            Features::Merger { spec, taps, .. } => {
                let trained = spec
                    .tensors()
                    .into_iter()
                    .filter(|(name, _)| TowerTraining::Projector.trains(name))
                    .map(|(name, _)| {
                        let t = embed_w.get(&format!("{TOWER}{name}")).shallow_clone();
                        (name, t)
                    })
                    .collect();
                Some((VisionWeights::new(spec.clone(), trained), taps))
            }
            Features::Encoder(pass) => Some((pass.weights(embed_w), pass.taps())),
            Features::Frozen(_)
            | Features::Projector { .. }
            | Features::Pooled { .. }
            | Features::Vit(_) => None,
        }
    }

    /// Whether Qwen3-VL's deepstack features come from a tower that trains in some part:
    /// their gradient is then gathered and carried into it.
    fn trained_deepstack(&self) -> bool {
        match self {
            Features::Merger { spec, .. } => !spec.deepstack_taps().is_empty(),
            Features::Encoder(pass) => pass.deepstack(),
            Features::Frozen(_)
            | Features::Projector { .. }
            | Features::Pooled { .. }
            | Features::Vit(_) => false,
        }
    }
}

/// What a micro-batch's images bring to the language model.
#[derive(Debug)]
pub struct MicroImages {
    /// The tower's output, or the trained projector's input.
    pub features: Features,
    /// The id of the image tokens, whose embeddings the features replace.
    pub image_token_id: i64,
    /// Every token's temporal, height and width position (3, B, T), on the device
    /// (Qwen2.5-VL, Qwen3-VL, Qwen3.5).
    pub pos_3bt: Option<Tensor>,
    /// Each token's image block (B, T): the run of image tokens it is in, counted from 0
    /// in its row, or -1 for text (Gemma 3: a block attends to itself both ways).
    pub block_bt: Option<Tensor>,
    /// Qwen3-VL's deepstack features (M, H) each, layer i's output taking the i-th at the
    /// image tokens; empty otherwise.
    pub deepstack_mh: Vec<Tensor>,
    /// (M,): the image tokens' rows in the flattened (B T) micro-batch, in order; set where
    /// there are deepstack features.
    pub rows_m: Option<Tensor>,
    /// Where the deepstack features' tower trains: the gradient (M, H) of each at the image
    /// tokens, gathered by the decoder's backward, in the features' order.
    deepstack_dy: Vec<Option<Tensor>>,
}

impl MicroImages {
    /// `mb`'s images: their grids (patches, (t, h, w)) in the order their tokens appear and
    /// the tower's features and deepstack features for them, which must make one row per
    /// image token.
    pub fn new(
        spec: &ModelSpec,
        mb: &MicroBatch,
        grids: &[[u32; 3]],
        features: Features,
        deepstack_mh: Vec<Tensor>,
        device: Device,
    ) -> Result<MicroImages> {
        let Some(m) = &spec.mrope else {
            bail!(
                "`{}` is a text-only model: it takes no images",
                spec.wrapper.as_deref().unwrap_or(&spec.model_type)
            );
        };
        if !mb.position_ids.is_empty() {
            bail!(
                "images in packed rows: each sample's 3-D positions would restart inside a row (set `data.packing: false`)"
            );
        }
        let tokens = ImageTokens {
            image_token_id: m.image_token_id,
            spatial_merge_size: m.spatial_merge_size,
        };
        let p = rope_index(&mb.input_ids, &mb.row_lens, mb.seq_len, grids, tokens)
            .context("3-D positions of the micro-batch's images")?;
        let (b, t) = (mb.rows as i64, mb.seq_len as i64);
        let pos_3bt = Tensor::f_from_slice(&p.pos_3bt)?
            .f_view([3, b, t])?
            .f_to_device(device)?;
        let rows: Vec<i64> = (mb.input_ids.iter().enumerate())
            .filter(|&(_, &id)| i64::from(id) == m.image_token_id)
            .map(|(i, _)| i as i64)
            .collect();
        for (i, f) in deepstack_mh.iter().enumerate() {
            if f.size()[0] != rows.len() as i64 {
                bail!(
                    "deepstack feature {i} has {} rows for {} image tokens",
                    f.size()[0],
                    rows.len()
                );
            }
        }
        let rows_m = match deepstack_mh.is_empty() && !features.trained_deepstack() {
            true => None,
            false => Some(Tensor::f_from_slice(&rows)?.f_to_device(device)?),
        };
        Ok(MicroImages {
            features,
            image_token_id: m.image_token_id,
            pos_3bt: Some(pos_3bt),
            block_bt: None,
            deepstack_mh: (deepstack_mh.into_iter())
                .map(|f| f.f_to_device(device))
                .collect::<Result<_, _>>()?,
            rows_m,
            deepstack_dy: Vec::new(),
        })
    }

    /// Features (M, H) that replace the embeddings of the tokens of id `image_token_id`, in
    /// order, and change nothing else the attention reads (LLaVA-NeXT's).
    pub fn placed(image_token_id: i64, features: Features) -> MicroImages {
        MicroImages {
            features,
            image_token_id,
            pos_3bt: None,
            block_bt: None,
            deepstack_mh: Vec::new(),
            rows_m: None,
            deepstack_dy: Vec::new(),
        }
    }

    /// Gemma 3's images of `mb`: the features of its tokens of id `image_token_id` (M, H, or
    /// a trained projector's input), and each token's image block, as transformers'
    /// `get_block_sequence_ids_for_mask` numbers them from `token_type_ids` (1 exactly at the
    /// image tokens).
    pub fn image_blocks(
        mb: &MicroBatch,
        image_token_id: i64,
        features: Features,
        device: Device,
    ) -> Result<MicroImages> {
        if !mb.position_ids.is_empty() {
            bail!(
                "images in packed rows: an image's block would be matched across samples (set `data.packing: false`)"
            );
        }
        let blocks = image_block_ids(&mb.input_ids, mb.seq_len, image_token_id);
        let block_bt = Tensor::f_from_slice(&blocks)?
            .f_view([mb.rows as i64, mb.seq_len as i64])?
            .f_to_device(device)?;
        Ok(MicroImages {
            features,
            image_token_id,
            pos_3bt: None,
            block_bt: Some(block_bt),
            deepstack_mh: Vec::new(),
            rows_m: None,
            deepstack_dy: Vec::new(),
        })
    }

    /// The features (M, H) placed at the image tokens, one row per token in the order the
    /// tokens appear (row by row, left to right): the frozen tower's, or a trained
    /// projector's over its kept input with `embed_w`'s `visual.merger.*` (Qwen2.5-VL's or
    /// Qwen3.5's; Gemma 3's `multi_modal_projector.*`; LLaVA-NeXT's `multi_modal_projector.*`
    /// and `image_newline`; views or
    /// leaves: with grad where they are leaves and grad mode is on).
    pub fn features_mh(&self, embed_w: &BlockWeights) -> Tensor {
        match &self.features {
            Features::Frozen(f_mh) => f_mh.shallow_clone(),
            Features::Merger { enc, .. } => {
                let (w, _) = (self.features.trained_qwen(embed_w)).expect("a trained merger");
                vision_merger(&w, enc)
            }
            Features::Projector {
                enc_tne,
                sizes,
                spec,
            } => {
                let projector = spec
                    .tensors()
                    .into_iter()
                    .filter(|(name, _)| TowerTraining::Projector.trains(name))
                    .map(|(name, _)| {
                        let t = embed_w.get(&name).shallow_clone();
                        (name, t)
                    })
                    .collect();
                llava_next_projected(&ClipWeights::new(spec.clone(), projector), enc_tne, sizes)
            }
            Features::Pooled { enc_bne, spec } => {
                let projector = spec
                    .tensors()
                    .into_iter()
                    .filter(|(name, _)| TowerTraining::Projector.trains(name))
                    .map(|(name, _)| {
                        let t = embed_w.get(&name).shallow_clone();
                        (name, t)
                    })
                    .collect();
                gemma3_projected(&SiglipWeights::new(spec.clone(), projector), enc_bne)
            }
            Features::Encoder(pass) => pass.features_mh(embed_w),
            Features::Vit(pass) => pass.features_mh(embed_w),
        }
    }

    /// Runs a trained encoder over the images from `embed_w`'s views (the forward's: no
    /// grad), each block's input kept where `keep` (a training step), before
    /// [`Self::features_mh`] reads its output; nothing for a frozen one, which ran when
    /// the images were read. Where the deepstack features' tower trains, they are
    /// computed here, from `embed_w`'s weights, for [`Self::after_layer`].
    pub fn encode(&mut self, embed_w: &BlockWeights, keep: bool) {
        match &mut self.features {
            Features::Encoder(pass) => pass.forward(embed_w, keep),
            Features::Vit(pass) => pass.forward(embed_w, keep),
            _ => {}
        }
        if self.features.trained_deepstack() {
            let (w, taps) = (self.features.trained_qwen(embed_w)).expect("a trained tower");
            self.deepstack_mh = qwen3_vl_deepstack(&w, taps);
            self.deepstack_dy = self.deepstack_mh.iter().map(|_| None).collect();
        }
    }

    /// In the decoder's backward, before layer `layer`'s: `dy_bth` (B, T, H) is the gradient
    /// of that layer's output; where it took a deepstack feature of a tower that trains,
    /// its rows at the image tokens are that feature's gradient, kept for
    /// [`Self::deepstack_outputs`].
    pub fn gather_deepstack(&mut self, layer: usize, dy_bth: &Tensor) {
        let (Some(slot), Some(rows_m)) = (self.deepstack_dy.get_mut(layer), &self.rows_m) else {
            return;
        };
        let h = *dy_bth.size().last().expect("(B, T, H)");
        *slot = Some(dy_bth.reshape([-1, h]).index_select(0, rows_m));
    }

    /// In the embedding's backward, with `embed_w`'s leaves and grad mode on: each deepstack
    /// feature of a tower that trains, recomputed with grad (into the deepstack mergers'
    /// leaves, and a trained encoder's taps), paired with its gathered gradient, for one
    /// backward with the embedding's; none otherwise.
    pub fn deepstack_outputs(&mut self, embed_w: &BlockWeights) -> Result<Vec<(Tensor, Tensor)>> {
        if self.deepstack_dy.is_empty() {
            return Ok(Vec::new());
        }
        let dy = std::mem::take(&mut self.deepstack_dy);
        let (w, taps) = (self.features.trained_qwen(embed_w)).context("a trained tower")?;
        let features = qwen3_vl_deepstack(&w, taps);
        (features.into_iter().zip(dy).enumerate())
            .map(|(i, (f_mh, dy_mh))| {
                let dy_mh = dy_mh.with_context(|| {
                    format!("deepstack feature {i}: its layer's backward gave no gradient")
                })?;
                let dy_mh = dy_mh.to_kind(f_mh.kind());
                Ok((f_mh, dy_mh))
            })
            .collect()
    }

    /// After the embedding's backward (which reached the features through
    /// [`Self::features_mh`] with `embed_w`'s leaves): a trained encoder's blocks
    /// recomputed and backpropagated into those leaves; nothing otherwise.
    pub fn encoder_backward(&mut self, embed_w: &BlockWeights) -> Result<()> {
        match &mut self.features {
            Features::Encoder(pass) => pass.backward(embed_w),
            Features::Vit(pass) => pass.backward(embed_w),
            _ => Ok(()),
        }
    }

    /// Decoder layer `layer`'s output `y_bth` (B, T, H) as the next layer reads it: with
    /// the layer-th deepstack feature added at the image tokens where there is one
    /// (Qwen3-VL's first layers), else unchanged. The stash of layer `layer + 1` is this
    /// sum; the backward passes the gradient through unchanged (and, where the tower
    /// trains, gathers the feature's: [`Self::gather_deepstack`]).
    pub fn after_layer(&self, layer: usize, y_bth: Tensor) -> Tensor {
        match (self.deepstack_mh.get(layer), &self.rows_m) {
            (Some(f_mh), Some(rows_m)) => add_at_image_tokens(&y_bth, rows_m, f_mh),
            _ => y_bth,
        }
    }

    /// `ctx` with what the images change in it: the rotary tables of the 3-D positions, or
    /// the image blocks' bidirectional attention.
    pub fn context(
        &self,
        ctx: crate::model::Context,
        spec: &ModelSpec,
        kind: Kind,
        device: Device,
    ) -> crate::model::Context {
        let ctx = match &self.pos_3bt {
            Some(p) => ctx.with_positions_3d(spec, p, kind, device),
            None => ctx,
        };
        match &self.block_bt {
            Some(b) => ctx.with_image_blocks(spec, b),
            None => ctx,
        }
    }
}

/// Per token of the rows (`seq_len` each) of `ids`: the index, within its row, of the run of
/// `image_token_id` it is in, or -1 for any other token.
fn image_block_ids(ids: &[i32], seq_len: usize, image_token_id: i64) -> Vec<i64> {
    let mut out = Vec::with_capacity(ids.len());
    for row in ids.chunks(seq_len.max(1)) {
        let (mut next, mut prev_image) = (0, false);
        for &id in row {
            let image = i64::from(id) == image_token_id;
            out.push(match (image, prev_image) {
                (false, _) => -1,
                (true, true) => next - 1,
                (true, false) => {
                    next += 1;
                    next - 1
                }
            });
            prev_image = image;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-layer model of `model_type`, head_dim 128 (mrope's default sections); a
    /// `qwen3_vl` wraps it in `text_config`.
    fn spec(model_type: &str) -> ModelSpec {
        let mut hf = mt::config::hf::HfConfig {
            model_type: Some(model_type.into()),
            vocab_size: Some(16),
            hidden_size: Some(128),
            intermediate_size: Some(8),
            num_hidden_layers: Some(1),
            num_attention_heads: Some(1),
            image_token_id: Some(9),
            ..Default::default()
        };
        if model_type == "qwen3_vl" {
            hf.text_config = Some(serde_json::json!({"vocab_size": 16, "hidden_size": 128,
                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}));
        }
        ModelSpec::from_hf(&hf, std::path::Path::new("config.json")).unwrap()
    }

    #[test]
    fn positions_of_a_micro_batch_and_its_refusals() {
        let vl = spec("qwen2_5_vl");
        let mut mb = MicroBatch {
            rows: 1,
            seq_len: 4,
            input_ids: vec![1, 9, 2, 0],
            labels: vec![-100; 4],
            row_lens: vec![3],
            position_ids: vec![],
            ref_logps: vec![],
            advantages: vec![],
            old_logps: vec![],
            ref_token_logps: vec![],
            images: vec![],
        };
        let f = Tensor::zeros([1, 128], (tch::Kind::Float, Device::Cpu));
        let new = |s: &ModelSpec, mb: &MicroBatch, grids: &[[u32; 3]], deep: Vec<Tensor>| {
            MicroImages::new(s, mb, grids, Features::Frozen(f.copy()), deep, Device::Cpu)
        };
        let i = new(&vl, &mb, &[[1, 2, 2]], vec![]).unwrap();
        assert_eq!(i.pos_3bt.as_ref().map(Tensor::size), Some(vec![3, 1, 4]));
        let y = Tensor::ones([1, 4, 128], (tch::Kind::Float, Device::Cpu));
        assert!(
            i.after_layer(0, y.copy()).equal(&y),
            "no deepstack: unchanged"
        );
        let e = new(&vl, &mb, &[], vec![]).unwrap_err();
        assert!(format!("{e:#}").contains("grids are placed"), "{e:#}");
        // Qwen3-VL: layer 0's output takes the first deepstack feature at the image token
        // (position 1), layer 1's the second, layer 2's none.
        let deep = vec![f.copy() + 2.0, f.copy() + 5.0];
        let i = new(&spec("qwen3_vl"), &mb, &[[1, 2, 2]], deep).unwrap();
        for (layer, add) in [(0, 2.0), (1, 5.0), (2, 0.0)] {
            let got = i.after_layer(layer, y.copy());
            assert!(
                got.get(0).get(1).equal(&(y.get(0).get(1) + add)),
                "layer {layer}"
            );
            for t in [0, 2, 3] {
                assert!(
                    got.get(0).get(t).equal(&y.get(0).get(t)),
                    "layer {layer}: text {t}"
                );
            }
        }
        let e = new(
            &spec("qwen3_vl"),
            &mb,
            &[[1, 2, 2]],
            vec![f.narrow(0, 0, 0)],
        )
        .unwrap_err();
        assert!(e.to_string().contains("deepstack feature 0"), "{e}");
        let text = spec("qwen2");
        let e = new(&text, &mb, &[[1, 2, 2]], vec![]).unwrap_err();
        assert!(e.to_string().contains("text-only model"), "{e}");
        mb.position_ids = vec![0, 1, 2, 0];
        let e = new(&vl, &mb, &[[1, 2, 2]], vec![]).unwrap_err();
        assert!(e.to_string().contains("packed rows"), "{e}");
        let e =
            MicroImages::image_blocks(&mb, 9, Features::Frozen(f.copy()), Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("packed rows"), "{e}");
    }

    #[test]
    fn image_blocks_are_numbered_per_row() {
        let ids = [5, 9, 9, 5, 9, 5, 9, 9, 9, 5, 5, 0];
        assert_eq!(
            image_block_ids(&ids, 6, 9),
            [-1, 0, 0, -1, 1, -1, 0, 0, 0, -1, -1, -1]
        );
    }
}
