//! Qwen2-VL / Qwen2.5-VL images in the text: how many `<|image_pad|>` tokens an image of a
//! given size takes, and LlamaFactory's `<image>` placeholders expanded to them, as
//! transformers' `Qwen2VLImageProcessor` and `Qwen2VLProcessor` do (written from their
//! rules, transformers 5.x `models/qwen2_vl/`).
//!
//! Resize (`smart_resize`): the image's height and width are rounded to multiples of
//! `factor` = patch_size x merge_size (14 x 2), half to even as Python's `round`; when the
//! product leaves [`min_pixels`, `max_pixels`] both sides are scaled by one factor
//! (`floor` down to fit below the maximum, at least one `factor`; `ceil` up above the
//! minimum). The image then covers a grid of (h / 14) x (w / 14) patches, one temporal
//! patch for a still image, and each merge_size x merge_size block of patches is one
//! token: (h / 14) * (w / 14) / 4 `<|image_pad|>` tokens, between `<|vision_start|>` and
//! `<|vision_end|>`.

use std::path::Path;

use serde_json::Value;

use super::chat::RenderError;
use super::records::Conversation;
use super::{ChatTokenizer, Example, RowImage};

/// LlamaFactory's image placeholder in record text.
pub const IMAGE_PLACEHOLDER: &str = "<image>";
pub const VISION_START: &str = "<|vision_start|>";
pub const VISION_END: &str = "<|vision_end|>";
pub const IMAGE_PAD: &str = "<|image_pad|>";

/// transformers' `OPENAI_CLIP_MEAN` and `OPENAI_CLIP_STD`, the processor's defaults (Python
/// floats, made f32 as numpy's `np.array(mean, dtype=np.float32)` rounds them).
const OPENAI_CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
const OPENAI_CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// The image processor's settings (`preprocessor_config.json`), transformers' defaults
/// where a key is absent.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct QwenVlImages {
    pub patch_size: u32,
    pub merge_size: u32,
    pub temporal_patch_size: u32,
    pub min_pixels: u64,
    pub max_pixels: u64,
    /// `do_rescale` and `rescale_factor`: samples (0..=255) are multiplied by the factor.
    pub do_rescale: bool,
    pub rescale_factor: f64,
    /// `do_normalize`, `image_mean`, `image_std`: per channel (RGB), (x - mean) / std.
    pub do_normalize: bool,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
}

impl Default for QwenVlImages {
    fn default() -> QwenVlImages {
        QwenVlImages {
            patch_size: 14,
            merge_size: 2,
            temporal_patch_size: 2,
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: true,
            image_mean: OPENAI_CLIP_MEAN.map(|x| x as f32),
            image_std: OPENAI_CLIP_STD.map(|x| x as f32),
        }
    }
}

/// The patch grid of one image: temporal, height and width patches (`image_grid_thw`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid {
    pub t: u32,
    pub h: u32,
    pub w: u32,
}

impl QwenVlImages {
    /// The settings of a `preprocessor_config.json` object: `min_pixels` / `max_pixels`
    /// win over `size.shortest_edge` / `size.longest_edge` (the processor's own rule).
    pub fn from_config(cfg: &Value) -> Result<QwenVlImages, String> {
        let mut s = QwenVlImages::default();
        let int = |v: &Value, key: &str| -> Result<Option<u64>, String> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(Some)
                    .ok_or_else(|| format!("`{key}`: expected a positive integer, found {x}")),
            }
        };
        let small = |n: u64, key: &str| {
            u32::try_from(n).map_err(|_| format!("`{key}`: {n} is out of range"))
        };
        if let Some(size) = cfg.get("size") {
            s.min_pixels = int(size, "shortest_edge")?.unwrap_or(s.min_pixels);
            s.max_pixels = int(size, "longest_edge")?.unwrap_or(s.max_pixels);
        }
        s.min_pixels = int(cfg, "min_pixels")?.unwrap_or(s.min_pixels);
        s.max_pixels = int(cfg, "max_pixels")?.unwrap_or(s.max_pixels);
        for (key, field) in [
            ("patch_size", &mut s.patch_size),
            ("merge_size", &mut s.merge_size),
            ("temporal_patch_size", &mut s.temporal_patch_size),
        ] {
            if let Some(n) = int(cfg, key)? {
                *field = small(n, key)?;
            }
        }
        pixels::read_config(cfg, &mut s)?;
        if s.min_pixels > s.max_pixels {
            return Err(format!(
                "min_pixels ({}) above max_pixels ({})",
                s.min_pixels, s.max_pixels
            ));
        }
        Ok(s)
    }

    /// The settings of `dir/preprocessor_config.json`.
    pub fn load(dir: &Path) -> crate::error::Result<QwenVlImages> {
        let path = dir.join("preprocessor_config.json");
        let text =
            crate::bounded::read_text(&path, crate::bounded::SMALL_JSON, "image processor config")?;
        let err = |msg: String| crate::error::Error::Config {
            path: path.clone(),
            msg,
        };
        let v: Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        QwenVlImages::from_config(&v).map_err(err)
    }

    /// Height and width after `smart_resize`, multiples of patch_size x merge_size.
    pub fn resize(&self, height: u32, width: u32) -> Result<(u32, u32), String> {
        smart_resize(
            height,
            width,
            self.patch_size * self.merge_size,
            self.min_pixels,
            self.max_pixels,
        )
    }

    /// The patch grid of a still image of `height` x `width` pixels.
    pub fn grid(&self, height: u32, width: u32) -> Result<Grid, String> {
        let (h, w) = self.resize(height, width)?;
        Ok(Grid {
            t: 1,
            h: h / self.patch_size,
            w: w / self.patch_size,
        })
    }

    /// `<|image_pad|>` tokens of a still image of `height` x `width` pixels.
    pub fn image_tokens(&self, height: u32, width: u32) -> Result<usize, String> {
        let g = self.grid(height, width)?;
        let merge = self.merge_size as usize * self.merge_size as usize;
        Ok(g.t as usize * g.h as usize * g.w as usize / merge)
    }
}

impl QwenVlImages {
    /// `conv` with each message's `<image>` placeholders expanded to its image's tokens
    /// (the images in order across the messages, one per placeholder: the record's check).
    pub fn expand_conversation(&self, conv: &mut Conversation) -> Result<(), String> {
        let counts = conv
            .images
            .iter()
            .map(|im| self.image_tokens(im.size.height, im.size.width))
            .collect::<Result<Vec<usize>, String>>()?;
        let mut at = 0;
        for m in &mut conv.messages {
            let n = placeholders(&m.content);
            let Some(these) = counts.get(at..at + n) else {
                return Err(format!(
                    "{} images for more `{IMAGE_PLACEHOLDER}` placeholders",
                    counts.len()
                ));
            };
            if n > 0 {
                m.content = expand(&m.content, these);
            }
            at += n;
        }
        Ok(())
    }
}

impl QwenVlImages {
    /// The row of a conversation with images for a Qwen2-VL model: its `<image>`
    /// placeholders expanded to their images' tokens, rendered with `chat`, and its images
    /// with their grids, in the order of their tokens (what the batcher carries into
    /// `MicroBatch::images`).
    pub fn example(
        &self,
        chat: &ChatTokenizer,
        conv: &Conversation,
        train_on_prompt: bool,
    ) -> Result<Example, RenderError> {
        let mut conv = conv.clone();
        self.expand_conversation(&mut conv)
            .map_err(RenderError::Bad)?;
        let images = conv
            .images
            .iter()
            .map(|im| {
                let g = self.grid(im.size.height, im.size.width)?;
                Ok(RowImage {
                    path: im.path.clone(),
                    grid: [g.t, g.h, g.w],
                })
            })
            .collect::<Result<Vec<_>, String>>()
            .map_err(RenderError::Bad)?;
        Ok(Example {
            images,
            ..chat.example(&conv, train_on_prompt)?
        })
    }
}

/// transformers' `smart_resize`: (height, width) rounded to multiples of `factor` within
/// [`min_pixels`, `max_pixels`]; an aspect ratio above 200 is an error (as there).
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32), String> {
    let (h, w, f) = (f64::from(height), f64::from(width), f64::from(factor));
    if height == 0 || width == 0 {
        return Err(format!("image of {width}x{height} pixels has no area"));
    }
    if h.max(w) / h.min(w) > 200.0 {
        return Err(format!(
            "absolute aspect ratio must be smaller than 200, got {}",
            h.max(w) / h.min(w)
        ));
    }
    let mut h_bar = (h / f).round_ties_even() * f;
    let mut w_bar = (w / f).round_ties_even() * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as u32, w_bar as u32))
}

/// `<image>` placeholders in `text`.
pub fn placeholders(text: &str) -> usize {
    text.matches(IMAGE_PLACEHOLDER).count()
}

/// `text` with its `<image>` placeholders, in order, each replaced by `<|vision_start|>`,
/// `tokens[i]` `<|image_pad|>` and `<|vision_end|>` (LlamaFactory's Qwen2-VL plugin; the
/// processor's expansion of one `<|image_pad|>` gives the same text). `tokens` holds
/// one count per placeholder, as the record's check made sure.
pub fn expand(text: &str, tokens: &[usize]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut parts = text.split(IMAGE_PLACEHOLDER);
    out.push_str(parts.next().unwrap_or_default());
    for (i, part) in parts.enumerate() {
        assert!(i < tokens.len(), "a token count for each placeholder");
        out.push_str(VISION_START);
        out.push_str(&IMAGE_PAD.repeat(tokens[i]));
        out.push_str(VISION_END);
        out.push_str(part);
    }
    out
}

mod pixels;
pub(crate) use pixels::{config_flag, config_triple};

#[cfg(test)]
mod fixtures;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_matches_transformers() {
        // Values from transformers' smart_resize (factor 28, min 56*56, max 28*28*1280).
        let d = QwenVlImages::default();
        // 42/28 = 1.5 and 70/28 = 2.5 round half to even (2 and 2).
        assert_eq!(d.resize(42, 70), Ok((56, 56)));
        assert_eq!(d.resize(100, 300), Ok((112, 308)));
        // Below min_pixels: scaled up, ceil.
        assert_eq!(d.resize(10, 20), Ok((56, 84)));
        // Above max_pixels: scaled down, floor.
        assert_eq!(d.resize(2000, 3000), Ok((812, 1204)));
        assert_eq!(d.image_tokens(448, 448), Ok(256));
        assert!(d.resize(1, 300).unwrap_err().contains("aspect ratio"));
        assert!(d.resize(0, 3).unwrap_err().contains("no area"));
    }

    #[test]
    fn config_keys_override_the_defaults() {
        let v: Value = serde_json::from_str(
            r#"{"size": {"shortest_edge": 100, "longest_edge": 5000}, "max_pixels": 401408, "merge_size": 2}"#,
        )
        .unwrap();
        let s = QwenVlImages::from_config(&v).unwrap();
        assert_eq!((s.min_pixels, s.max_pixels), (100, 401408));
        let bad: Value = serde_json::from_str(r#"{"patch_size": "14"}"#).unwrap();
        assert!(
            QwenVlImages::from_config(&bad)
                .unwrap_err()
                .contains("patch_size")
        );
    }

    #[test]
    fn placeholders_expand_in_order() {
        let text = "<image>a<image>b";
        assert_eq!(placeholders(text), 2);
        assert_eq!(
            expand(text, &[1, 2]),
            "<|vision_start|><|image_pad|><|vision_end|>a<|vision_start|><|image_pad|><|image_pad|><|vision_end|>b"
        );
        assert_eq!(expand("none", &[]), "none");
    }
}
