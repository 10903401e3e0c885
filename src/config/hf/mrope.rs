//! Qwen2.5-VL's and Qwen3-VL's multimodal rotary embedding (mrope), as
//! `Qwen2_5_VLTextConfig` / `Qwen3VLTextConfig` and their rotary embeddings read it: a RoPE
//! (`rope_type: mrope` is standardized to `default`) whose R/2 frequencies are each turned by
//! one of a token's temporal, height and width positions, `mrope_section` saying how many of
//! each (e.g. [16, 24, 24] for Qwen2.5-VL's head_dim 128, [24, 20, 20] for Qwen3-VL's), and the
//! wrapper's keys that say where images sit in the token ids (`image_token_id`,
//! `vision_config.spatial_merge_size`), from which `crate::mrope` computes those positions.
//!
//! The layout of the sections over the pairs differs: Qwen2.5-VL's are consecutive
//! (`apply_multimodal_rotary_pos_emb`: pairs 0..16 temporal, the next 24 height, the last 24
//! width); Qwen3-VL's interleave (`Qwen3VLTextRotaryEmbedding.recomposition_frequencies`:
//! pair i is height's where i % 3 == 1 and i < 3 x section[1], width's where i % 3 == 2 and
//! i < 3 x section[2], temporal's otherwise).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::HfConfig;
use crate::error::{Error, Result};

/// `Qwen2_5_VLRotaryEmbedding`'s section when the RoPE dict names none.
const DEFAULT_SECTION: [usize; 3] = [16, 24, 24];
/// `Qwen3VLTextRotaryEmbedding`'s.
const DEFAULT_SECTION_INTERLEAVED: [usize; 3] = [24, 20, 20];
/// `Qwen2_5_VLConfig.image_token_id`'s default.
const DEFAULT_IMAGE_TOKEN_ID: i64 = 151_655;
/// `Qwen2_5_VLVisionConfig.spatial_merge_size`'s default.
const DEFAULT_SPATIAL_MERGE: usize = 2;

/// The multimodal RoPE of a Qwen2.5-VL or Qwen3-VL text model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mrope {
    /// Rotary pairs turned by the temporal, height and width positions, in that order
    /// (`mrope_section`); they sum to R/2.
    pub section: [usize; 3],
    /// The sections interleave over the pairs (Qwen3-VL) rather than follow each other
    /// (Qwen2.5-VL); [`Mrope::pair_axes`].
    pub interleaved: bool,
    /// The token standing for one merged group of an image's patches.
    pub image_token_id: i64,
    /// Patches merged per side into one image token (`vision_config.spatial_merge_size`).
    pub spatial_merge_size: usize,
}

/// The rope dict of a config (`rope_scaling` first, as transformers pops it first).
fn rope_dict(hf: &HfConfig) -> Option<&serde_json::Map<String, Value>> {
    hf.rope_scaling
        .as_ref()
        .filter(|v| !v.is_null())
        .or(hf.rope_parameters.as_ref().filter(|v| !v.is_null()))
        .and_then(Value::as_object)
}

/// Whether the RoPE dict of `hf` names the `mrope` type (which transformers standardizes to
/// `default` for Qwen2.5-VL's text model).
pub(super) fn names_mrope(hf: &HfConfig) -> bool {
    rope_dict(hf).is_some_and(|m| {
        m.get("rope_type")
            .or_else(|| m.get("type"))
            .and_then(Value::as_str)
            == Some("mrope")
    })
}

impl Mrope {
    /// The mrope of text config `hf` (model_type `qwen2_5_vl_text`, or `qwen3_vl_text`
    /// with `interleaved`) whose RoPE turns `rotary_dim` dims, with the image keys `hf` holds
    /// (a flat hub config keeps them beside the text keys; a wrapper's own keys override
    /// them, [`Mrope::place_images`]).
    pub(super) fn of_text(
        hf: &HfConfig,
        rotary_dim: usize,
        interleaved: bool,
        err: &dyn Fn(String) -> Error,
    ) -> Result<Mrope> {
        let section = match rope_dict(hf).and_then(|m| m.get("mrope_section")) {
            None | Some(Value::Null) if interleaved => DEFAULT_SECTION_INTERLEAVED,
            None | Some(Value::Null) => DEFAULT_SECTION,
            Some(v) => {
                let parts: Option<Vec<usize>> = v
                    .as_array()
                    .and_then(|a| a.iter().map(|x| x.as_u64().map(|n| n as usize)).collect());
                match parts.as_deref() {
                    Some(&[t, h, w]) => [t, h, w],
                    _ => {
                        return Err(err(format!(
                            "`rope_parameters.mrope_section` must be 3 non-negative integers, got {v}"
                        )));
                    }
                }
            }
        };
        if section.iter().sum::<usize>() != rotary_dim / 2 {
            return Err(err(format!(
                "`rope_parameters.mrope_section` {section:?} must sum to head_dim / 2 = {}",
                rotary_dim / 2
            )));
        }
        let mut m = Mrope {
            section,
            interleaved,
            image_token_id: DEFAULT_IMAGE_TOKEN_ID,
            spatial_merge_size: DEFAULT_SPATIAL_MERGE,
        };
        m.place_images(hf, err)?;
        Ok(m)
    }

    /// The axis (0 temporal, 1 height, 2 width) whose position turns each of the R/2
    /// rotary pairs.
    pub fn pair_axes(&self) -> Vec<usize> {
        let [t, h, w] = self.section;
        if !self.interleaved {
            return [(0, t), (1, h), (2, w)]
                .into_iter()
                .flat_map(|(axis, n)| std::iter::repeat_n(axis, n))
                .collect();
        }
        (0..t + h + w)
            .map(|i| match i % 3 {
                1 if i < 3 * h => 1,
                2 if i < 3 * w => 2,
                _ => 0,
            })
            .collect()
    }

    /// Reads the image keys of `hf` where it has them: `image_token_id` and
    /// `vision_config.spatial_merge_size`.
    pub(super) fn place_images(
        &mut self,
        hf: &HfConfig,
        err: &dyn Fn(String) -> Error,
    ) -> Result<()> {
        if let Some(id) = hf.image_token_id {
            self.image_token_id = id;
        }
        let merge = hf
            .vision_config
            .as_ref()
            .and_then(|v| v.get("spatial_merge_size"));
        match merge {
            None | Some(Value::Null) => {}
            Some(v) => match v.as_u64().filter(|&n| n > 0 && n <= 64) {
                Some(n) => self.spatial_merge_size = n as usize,
                None => {
                    return Err(err(format!(
                        "`vision_config.spatial_merge_size` must be an integer in 1..=64, got {v}"
                    )));
                }
            },
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mrope(section: [usize; 3], interleaved: bool) -> Mrope {
        Mrope {
            section,
            interleaved,
            image_token_id: 0,
            spatial_merge_size: 2,
        }
    }

    #[test]
    fn pairs_take_their_sections_axis() {
        assert_eq!(mrope([1, 2, 3], false).pair_axes(), [0, 1, 1, 2, 2, 2]);
        // Qwen3VLTextRotaryEmbedding.recomposition_frequencies on [2, 3, 3]: height at
        // 1, 4, 7 (slice(1, 9, 3)), width at 2, 5 (slice(2, 9, 3) stops at R/2 = 8 pairs).
        assert_eq!(mrope([2, 3, 3], true).pair_axes(), [0, 1, 2, 0, 1, 2, 0, 1]);
        // Qwen3-VL's [24, 20, 20]: 20 pairs each for height and width, then temporal only.
        let a = mrope([24, 20, 20], true).pair_axes();
        assert_eq!(a.len(), 64);
        for axis in 0..3 {
            let n = a.iter().filter(|&&x| x == axis).count();
            assert_eq!(n, [24, 20, 20][axis], "axis {axis}");
        }
        assert_eq!(&a[57..], [0, 1, 2, 0, 0, 0, 0]);
    }
}
