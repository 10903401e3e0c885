//! A vision-language model's tower as the device plan counts it.

use super::Parts;
use crate::plan::acts::F32;

/// A vision-language model's tower as the device plan counts it: its frozen part, and
/// what of it trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VisionDevice {
    /// Its frozen parameters, held on the device in the compute dtype for the whole run.
    pub params: u64,
    /// The width of its blocks and of their MLP.
    pub hidden: u64,
    pub intermediate: u64,
    /// Values per patch (channels x temporal patch x patch x patch) and patches per image
    /// token (the merge size squared).
    pub patch_values: u64,
    pub patches_per_token: u64,
    /// The width of its output (the language model's hidden size).
    pub out_hidden: u64,
    /// The projector (the merger, and Qwen3-VL's deepstack mergers) trains
    /// (`vlm.freeze_projector: false`): its input (and each deepstack merger's, a tapped
    /// block's output) is kept from the tower's forward and it is recomputed with grad in
    /// the embedding's backward. Its weights are the embedding block's.
    pub projector_trained: bool,
    /// The encoder (the patch embedding and the blocks; Gemma 3's and LLaVA-NeXT's whole
    /// tower) trains (`vlm.freeze_vision_encoder: false`): each block's input and the
    /// encoder's output are kept from the tower's forward, and the merger (the head) and the
    /// blocks, last to first, are recomputed with grad in the embedding's backward. Its weights are the embedding
    /// block's, on the device through the tower's forward too.
    pub encoder_trained: bool,
    /// Its blocks that run (LLaVA-NeXT's up to the one `vision_feature_layer` reads).
    pub depth: u64,
    /// Feature sets it hands the language model per image token: the merged features and
    /// each deepstack feature (Qwen3-VL).
    pub feature_sets: u64,
    /// Bytes per patch of Qwen3-VL's learned positions as they are resampled (four taps of
    /// width E in f32 and their weighted copy), before the blocks run; 0 for Qwen2.5-VL.
    pub position_taps: u64,
    /// Each image's tokens attend to each other both ways (Gemma 3): a micro-batch with
    /// images builds its attention masks per row.
    pub image_blocks: bool,
    /// Values per patch the projector holds at once where it is wider than the tower
    /// (LLaVA-NeXT's: its first Linear's output, the GELU's and the second's, each of the
    /// text model's width, over every tile's patches); 0 where the tower's forward bounds it.
    pub projector_values: u64,
    /// The most image tokens a row of the run's data holds (its images' counts summed), so
    /// a micro-batch of B rows holds at most B times that; None where the rows are not
    /// known (`mt-launch plan` without the model's tokenizer, a server): every token of the
    /// micro-batch an image's, the bound.
    pub row_tokens: Option<u64>,
}

impl VisionDevice {
    /// The tower of `spec`, `params` frozen parameters, `training` what of it trains.
    pub fn of(
        spec: &crate::config::vision::TowerSpec,
        params: usize,
        training: crate::config::TowerTraining,
    ) -> VisionDevice {
        use crate::config::vision::TowerSpec;
        let (projector_trained, encoder_trained) = (training.projector(), training.encoder());
        match spec {
            TowerSpec::Qwen(spec) => VisionDevice {
                projector_trained,
                encoder_trained,
                depth: spec.depth as u64,
                params: params as u64,
                hidden: spec.hidden_size as u64,
                intermediate: spec.intermediate_size as u64,
                patch_values: (spec.in_channels * spec.temporal_patch_size * spec.patch_size.pow(2))
                    as u64,
                patches_per_token: spec.spatial_merge_size.pow(2) as u64,
                out_hidden: spec.out_hidden_size as u64,
                feature_sets: 1 + spec.deepstack_taps().len() as u64,
                position_taps: match spec.num_position_embeddings {
                    0 => 0,
                    _ => 2 * 4 * spec.hidden_size as u64 * 4,
                },
                image_blocks: false,
                projector_values: 0,
                row_tokens: None,
            },
            // Gemma 3: every image is the fixed grid, pooled `pool`² patches to a token.
            TowerSpec::Siglip(spec) => VisionDevice {
                projector_trained,
                encoder_trained,
                depth: spec.depth as u64,
                params: params as u64,
                hidden: spec.hidden_size as u64,
                intermediate: spec.intermediate_size as u64,
                patch_values: spec.patch_len() as u64,
                patches_per_token: spec.pool().pow(2) as u64,
                out_hidden: spec.out_hidden_size as u64,
                feature_sets: 1,
                position_taps: 0,
                image_blocks: true,
                projector_values: 0,
                row_tokens: None,
            },
            // LLaVA-NeXT: every image has at least a tile's G² tokens (the base tile's) and
            // at most `max_tiles` tiles of G² + 1 patches (the class token too), so the tower
            // runs at most that many patches per token (rounded up). A trained tower keeps
            // the inputs of the layers that run (up to the one `vision_feature_layer` reads).
            TowerSpec::Clip(spec) => {
                let n = spec.tile_features() as u64;
                VisionDevice {
                    projector_trained,
                    encoder_trained,
                    depth: spec.layers_run() as u64,
                    params: params as u64,
                    hidden: spec.hidden_size as u64,
                    intermediate: spec.intermediate_size as u64,
                    patch_values: spec.patch_len() as u64,
                    patches_per_token: (spec.max_tiles() as u64 * (n + 1)).div_ceil(n),
                    out_hidden: spec.out_hidden_size as u64,
                    feature_sets: 1,
                    position_taps: 0,
                    image_blocks: false,
                    projector_values: 3 * spec.out_hidden_size as u64,
                    row_tokens: None,
                }
            }
        }
    }
}

impl VisionDevice {
    /// The image tokens of a micro-batch of `rows` rows and `m` tokens: at most `rows`
    /// times the most a row of the data holds, never more than its tokens.
    pub fn image_tokens(&self, rows: u64, m: u64) -> u64 {
        self.row_tokens.map_or(m, |r| (rows * r).min(m))
    }

    /// What the tower holds through a micro-batch of `m` image tokens, `s` bytes per value: its frozen weights, the image features
    /// placed at the image tokens (with Qwen3-VL's deepstack features kept for the first
    /// layers), and what a trained part's backward reads.
    pub(super) fn fixed(&self, m: u64, s: u64) -> Parts {
        let mut parts: Parts = vec![
            ("vision tower (frozen)", self.params * s),
            (
                "image features",
                m * self.out_hidden * s * self.feature_sets,
            ),
        ];
        let patches = m * self.patches_per_token;
        let deepstack = self.feature_sets - 1;
        if self.encoder_trained {
            // Its pixels (for the patch embedding's recompute), each block's input and
            // the encoder's output (the merger's input); the deepstack mergers' inputs are
            // the tapped blocks' outputs, kept already.
            let per_patch = self.patch_values + (self.depth + 1) * self.hidden;
            parts.push((
                "the tower's pixels and block inputs, kept",
                patches * per_patch * s,
            ));
        } else if self.projector_trained {
            // The merger's input and each deepstack merger's.
            parts.push((
                "the projector's input, kept",
                patches * self.hidden * s * (1 + deepstack),
            ));
        }
        if (self.encoder_trained || self.projector_trained) && deepstack > 0 {
            // Each deepstack feature's gradient at the image tokens, gathered in the
            // decoder's backward for the embedding's.
            parts.push((
                "the deepstack features' gradients",
                m * self.out_hidden * s * deepstack,
            ));
        }
        parts
    }

    /// What a trained part adds to the embedding's backward over `m` image tokens. A
    /// trained projector recomputed with grad over every image token: per token its normed input and the two
    /// widths after the first Linear and the GELU (merge^2 x E each), its output, each
    /// with its gradient (Qwen3-VL: each deepstack merger's too, in the same pass); LLaVA-NeXT's holds its wider values (`projector_values`) per
    /// patch instead, and its packed output. A trained encoder: the merger as above (with grad into its
    /// input, trained or not), then each block, last to first, recomputed with grad over
    /// every patch, one at a time: the larger of the two. A block's graph per patch: the
    /// attention half's norm, q k v, their padded copies, the rotated q and k, the
    /// attention's output and projection, the residual (16 widths E in the compute dtype,
    /// with 6 of f32 for the rotation) and the MLP half's gate, up, activation and product
    /// (4 of I), each with its gradient; beside them the block's dx and dy. SigLIP's and
    /// CLIP's layers (Gemma 3, LLaVA-NeXT: no rotation, an ungated MLP) hold less, within the
    /// same bound; their head (Gemma 3's `post_layernorm` and projector, LLaVA-NeXT's
    /// projector) is counted as the merger.
    pub(super) fn embedding_backward(&self, m: u64, s: u64) -> Parts {
        let merged = self.patches_per_token * self.hidden;
        let per_token = match self.projector_values {
            0 => 3 * merged + self.out_hidden,
            wide => self.patches_per_token * (self.hidden + wide) + self.out_hidden,
        };
        let merger = 2 * m * per_token * s * self.feature_sets;
        match (self.encoder_trained, self.projector_trained) {
            (false, false) => Vec::new(),
            (false, true) => vec![("the projector's recompute graph + gradients", merger)],
            (true, _) => {
                let (e, i) = (self.hidden, self.intermediate);
                let patches = m * self.patches_per_token;
                let graph = s * (16 * e + 4 * i) + F32 * 6 * e;
                let block = patches * (2 * e * s + 2 * graph);
                vec![(
                    "the tower's recompute graph + gradients (the merger's or one block's)",
                    merger.max(block),
                )]
            }
        }
    }

    /// The tower's forward over a micro-batch's `m` image tokens (no grad, before the
    /// layers): per patch its pixels (f32, then the compute
    /// dtype) and the larger of a block's attention half (x, norm, q k v, rotated q k,
    /// output: 8 widths), its MLP half (x, residual, norm: 3 widths; gate, up, act: 3 MLP
    /// widths) and a projector wider than the tower (LLaVA-NeXT's). A trained encoder's weights are the embedding block's (`embed` bytes
    /// on the device), there for it.
    pub(super) fn forward(&self, m: u64, s: u64, embed: u64) -> Parts {
        let patches = m * self.patches_per_token;
        let per_patch = self.patch_values * (4 + s)
            + (s * (8 * self.hidden)
                .max(3 * self.hidden + 3 * self.intermediate)
                .max(self.projector_values))
            .max(self.position_taps);
        let mut parts: Parts = vec![(
            "the tower's forward over the micro-batch's images",
            patches * per_patch,
        )];
        if self.encoder_trained {
            parts.push(("embedding block (the trained tower in it)", embed));
        }
        parts
    }
}
