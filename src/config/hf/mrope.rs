//! Qwen2.5-VL's, Qwen3-VL's and Qwen3.5's multimodal rotary embedding (mrope), as
//! `Qwen2_5_VLTextConfig` / `Qwen3VLTextConfig` / `Qwen3_5TextConfig` and their rotary
//! embeddings read it: a RoPE
//! (`rope_type: mrope` is standardized to `default`) whose R/2 frequencies are each turned by
//! one of a token's temporal, height and width positions, `mrope_section` saying how many of
//! each (e.g. [16, 24, 24] for Qwen2.5-VL's head_dim 128, [24, 20, 20] for Qwen3-VL's, [11, 11,
//! 10] for the 64 rotary dims of Qwen3.5's partial RoPE), and the
//! wrapper's keys that say where images sit in the token ids (`image_token_id`,
//! `vision_config.spatial_merge_size`), from which `crate::mrope` computes those positions.
//!
//! The layout of the sections over the pairs differs: Qwen2.5-VL's are consecutive
//! (`apply_multimodal_rotary_pos_emb`: pairs 0..16 temporal, the next 24 height, the last 24
//! width); Qwen3-VL's interleave (`Qwen3VLTextRotaryEmbedding.recomposition_frequencies`:
//! pair i is height's where i % 3 == 1 and i < 3 x section[1], width's where i % 3 == 2 and
//! i < 3 x section[2], temporal's otherwise). Qwen3.5's interleave the same way
//! (`Qwen3_5TextRotaryEmbedding.recomposition_frequencies`), over all R/2 pairs whatever the
//! sections sum to: its config class does not check them (`mrope_section` is ignored at its
//! rope validation), and a text-only config may keep the default [11, 11, 10] beside a
//! smaller RoPE, where only the pairs that exist are assigned.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::HfConfig;
use crate::error::{Error, Result};

/// `Qwen2_5_VLRotaryEmbedding`'s section when the RoPE dict names none.
const DEFAULT_SECTION: [usize; 3] = [16, 24, 24];
/// `Qwen3VLTextRotaryEmbedding`'s.
const DEFAULT_SECTION_INTERLEAVED: [usize; 3] = [24, 20, 20];
/// `Qwen3_5TextRotaryEmbedding`'s.
const DEFAULT_SECTION_QWEN3_5: [usize; 3] = [11, 11, 10];
/// `Qwen2_5_VLConfig.image_token_id`'s default (and `Qwen3VLConfig`'s).
const DEFAULT_IMAGE_TOKEN_ID: i64 = 151_655;
/// `Qwen3_5Config.image_token_id`'s default.
const DEFAULT_IMAGE_TOKEN_ID_QWEN3_5: i64 = 248_056;
/// `Qwen2_5_VLVisionConfig.spatial_merge_size`'s default.
const DEFAULT_SPATIAL_MERGE: usize = 2;

/// Which text model's mrope: its defaults and how strictly its sections are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MropeKind {
    /// Qwen2.5-VL: consecutive sections summing to R/2.
    Qwen2_5Vl,
    /// Qwen3-VL: interleaved sections summing to R/2.
    Qwen3Vl,
    /// Qwen3.5: interleaved sections over however many pairs the (partial) RoPE has.
    Qwen3_5,
}

/// The multimodal RoPE of a Qwen2.5-VL, Qwen3-VL or Qwen3.5 text model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mrope {
    /// Rotary pairs turned by the temporal, height and width positions, in that order
    /// (`mrope_section`); they sum to [`Mrope::pairs`] but for Qwen3.5's.
    pub section: [usize; 3],
    /// The sections interleave over the pairs (Qwen3-VL, Qwen3.5) rather than follow each
    /// other (Qwen2.5-VL); [`Mrope::pair_axes`].
    pub interleaved: bool,
    /// The RoPE's rotary pairs, R/2.
    pub pairs: usize,
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
    /// The mrope of text config `hf` (model_type `qwen2_5_vl_text`, `qwen3_vl_text` or
    /// `qwen3_5_text`, as `kind` says) whose RoPE turns `rotary_dim` dims, with the image
    /// keys `hf` holds (a flat hub config keeps them beside the text keys; a wrapper's own
    /// keys override them, [`Mrope::place_images`]).
    pub(super) fn of_text(
        hf: &HfConfig,
        rotary_dim: usize,
        kind: MropeKind,
        err: &dyn Fn(String) -> Error,
    ) -> Result<Mrope> {
        let section = match rope_dict(hf).and_then(|m| m.get("mrope_section")) {
            None | Some(Value::Null) => match kind {
                MropeKind::Qwen2_5Vl => DEFAULT_SECTION,
                MropeKind::Qwen3Vl => DEFAULT_SECTION_INTERLEAVED,
                MropeKind::Qwen3_5 => DEFAULT_SECTION_QWEN3_5,
            },
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
        if kind != MropeKind::Qwen3_5 && section.iter().sum::<usize>() != rotary_dim / 2 {
            return Err(err(format!(
                "`rope_parameters.mrope_section` {section:?} must sum to head_dim / 2 = {}",
                rotary_dim / 2
            )));
        }
        let mut m = Mrope {
            section,
            interleaved: kind != MropeKind::Qwen2_5Vl,
            pairs: rotary_dim / 2,
            image_token_id: match kind {
                MropeKind::Qwen3_5 => DEFAULT_IMAGE_TOKEN_ID_QWEN3_5,
                _ => DEFAULT_IMAGE_TOKEN_ID,
            },
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
        (0..self.pairs)
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
            pairs: section.iter().sum(),
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
        // Qwen3.5's [11, 11, 10] over its 32 pairs (64 rotary dims of head_dim 256): height
        // at 1, 4, ..., 31, width at 2, 5, ..., 29 (slice(2, 30, 3)), temporal at the rest.
        let a = mrope([11, 11, 10], true).pair_axes();
        assert_eq!(&a[27..], [0, 1, 2, 0, 1]);
        let count = |axis| a.iter().filter(|&&x| x == axis).count();
        assert_eq!([count(0), count(1), count(2)], [11, 11, 10]);
        // Sections that do not sum to the pairs (a text-only Qwen3.5 config keeping the
        // default beside a 2-pair RoPE; the slices stop at the last pair): only what exists.
        let small = Mrope {
            pairs: 2,
            ..mrope([11, 11, 10], true)
        };
        assert_eq!(small.pair_axes(), [0, 1]);
        let tail = Mrope {
            pairs: 8,
            ..mrope([2, 2, 2], true)
        };
        assert_eq!(tail.pair_axes(), [0, 1, 2, 0, 1, 2, 0, 0]);
    }
}
