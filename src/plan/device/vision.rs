//! A vision-language model's tower as the device plan counts it.

/// A vision-language model's tower as the device plan counts it: its frozen part, and
/// whether its projector trains.
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
    /// The projector (the merger) trains (`vlm.freeze_projector: false`): its input is
    /// kept from the tower's forward and it is recomputed with grad in the embedding's
    /// backward. Its weights are the embedding block's.
    pub projector_trained: bool,
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
}

impl VisionDevice {
    /// The tower of `spec`, `params` frozen parameters, `training` what of it trains.
    pub fn of(
        spec: &crate::config::vision::TowerSpec,
        params: usize,
        training: crate::config::TowerTraining,
    ) -> VisionDevice {
        use crate::config::vision::TowerSpec;
        let projector_trained = training != crate::config::TowerTraining::Frozen;
        match spec {
            TowerSpec::Qwen(spec) => VisionDevice {
                projector_trained,
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
            },
            // Gemma 3: every image is the fixed grid, pooled `pool`² patches to a token.
            TowerSpec::Siglip(spec) => VisionDevice {
                projector_trained,
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
            },
            // LLaVA-NeXT: every image has at least a tile's G² tokens (the base tile's) and
            // at most `max_tiles` tiles of G² + 1 patches (the class token too), so the tower
            // runs at most that many patches per token (rounded up).
            TowerSpec::Clip(spec) => {
                let n = spec.tile_features() as u64;
                VisionDevice {
                    projector_trained,
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
                }
            }
        }
    }
}
