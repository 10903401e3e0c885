//! Gemma 3 images in the text and their pixels, as transformers 5's `Gemma3Processor` and
//! `Gemma3ImageProcessorPil` make them (written from their rules, `models/gemma3/`):
//!
//! - Text: LlamaFactory's `<image>` placeholder becomes the processor's placeholder, the
//!   begin-of-image token `<start_of_image>`; the conversation is rendered with the chat
//!   template (Gemma 3's trims each message, so the expansion must come after it); then,
//!   as the processor does to the rendered text, each `<start_of_image>` becomes its
//!   `full_image_sequence`: `"\n\n<start_of_image>"`, `mm_tokens_per_image` x
//!   `<image_soft_token>`, `"<end_of_image>\n\n"`. Every image has the same token count.
//! - Pixels: resized to the fixed `size` (the tower's `image_size`) with Pillow's bilinear
//!   filter (`resample` 2) on the 8-bit image, rescaled and normalised per channel; (3, H, W)
//!   channel-first, as the SigLIP tower's patch convolution reads them. Pan-and-scan (extra
//!   crops per image) is not done: a processor config that turns it on is refused.

use std::path::Path;

use serde_json::Value;

use super::chat::RenderError;
use super::image::{Rgb8, resample};
use super::qwen_vl::{IMAGE_PLACEHOLDER, config_flag, config_triple};
use super::records::Conversation;
use super::{ChatTokenizer, Example, RowImage};
use crate::config::vision::TowerSpec;
use crate::config::vision::siglip::SiglipSpec;

/// Gemma 3's tokenizer's `boi_token`, `image_token` and `eoi_token`.
pub const BOI: &str = "<start_of_image>";
pub const SOFT_TOKEN: &str = "<image_soft_token>";
pub const EOI: &str = "<end_of_image>";

/// `IMAGENET_STANDARD_MEAN` / `_STD`, `Gemma3ImageProcessorPil`'s defaults.
const STANDARD: [f32; 3] = [0.5, 0.5, 0.5];

/// A Gemma 3 model's image settings: `preprocessor_config.json`'s pixel keys and what
/// config.json says of the image tokens.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Gemma3Images {
    /// The size every image is resized to (`size.height`, `size.width`).
    pub height: u32,
    pub width: u32,
    /// The tower's patch side (`vision_config.patch_size`).
    pub patch_size: u32,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    /// `<image_soft_token>`s per image (`mm_tokens_per_image`).
    pub tokens_per_image: usize,
    /// Their id (`image_token_index`): each image's tokens must encode to it.
    pub image_token_id: i64,
}

impl Gemma3Images {
    /// The settings of `dir`: its `preprocessor_config.json` against the tower of its
    /// config.json (`spec`).
    pub fn load(dir: &Path, spec: &SiglipSpec) -> crate::error::Result<Gemma3Images> {
        let path = dir.join("preprocessor_config.json");
        let text =
            crate::bounded::read_text(&path, crate::bounded::SMALL_JSON, "image processor config")?;
        let err = |msg: String| crate::error::Error::Config {
            path: path.clone(),
            msg,
        };
        let v: Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        let s = Gemma3Images::from_config(&v, spec).map_err(err)?;
        // The processor's own token count, where its config names one, is the model's.
        let proc_path = dir.join("processor_config.json");
        if proc_path.is_file() {
            let text = crate::bounded::read_text(
                &proc_path,
                crate::bounded::SMALL_JSON,
                "processor config",
            )?;
            let v: Value =
                serde_json::from_str(&text).map_err(|e| crate::error::Error::Config {
                    path: proc_path.clone(),
                    msg: e.to_string(),
                })?;
            if let Some(n) = v.get("image_seq_length").and_then(Value::as_u64)
                && n as usize != s.tokens_per_image
            {
                return Err(crate::error::Error::Config {
                    path: proc_path,
                    msg: format!(
                        "`image_seq_length` is {n}, but config.json's `mm_tokens_per_image` is {} (the tower gives that many features per image)",
                        s.tokens_per_image
                    ),
                });
            }
        }
        Ok(s)
    }

    /// The settings of a `preprocessor_config.json` object for the tower `spec`; settings
    /// we do not reproduce are errors naming the key.
    pub fn from_config(cfg: &Value, spec: &SiglipSpec) -> Result<Gemma3Images, String> {
        if !config_flag(cfg, "do_resize", true)? {
            return Err("`do_resize`: false is not supported (the tower takes one size)".into());
        }
        if config_flag(cfg, "do_pan_and_scan", false)? {
            return Err(
                "`do_pan_and_scan`: true is not supported (the crops' extra image tokens); set it to false or null"
                    .into(),
            );
        }
        if let Some(r) = cfg.get("resample").filter(|v| !v.is_null())
            && r.as_u64() != Some(2)
        {
            return Err(format!(
                "`resample`: {r} is not supported (expected 2, bilinear)"
            ));
        }
        let side = |key: &str| -> Result<u32, String> {
            match cfg.get("size").and_then(|s| s.get(key)) {
                // Gemma3ImageProcessorPil's default size.
                None | Some(Value::Null) => Ok(224),
                Some(x) => x
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("`size.{key}`: expected a positive integer, found {x}")),
            }
        };
        let (height, width) = (side("height")?, side("width")?);
        if [height, width] != [spec.image_size as u32; 2] {
            return Err(format!(
                "`size` is {height} x {width}, but the vision tower's `image_size` is {} (its position embeddings are for that size)",
                spec.image_size
            ));
        }
        let rescale_factor = match cfg.get("rescale_factor").filter(|v| !v.is_null()) {
            Some(f) => f
                .as_f64()
                .ok_or_else(|| format!("`rescale_factor`: expected a number, found {f}"))?,
            None => 1.0 / 255.0,
        };
        let image_std = config_triple(cfg, "image_std", STANDARD)?;
        if image_std.contains(&0.0) {
            return Err("`image_std`: a zero would divide by zero".into());
        }
        Ok(Gemma3Images {
            height,
            width,
            patch_size: spec.patch_size as u32,
            do_rescale: config_flag(cfg, "do_rescale", true)?,
            rescale_factor,
            do_normalize: config_flag(cfg, "do_normalize", true)?,
            image_mean: config_triple(cfg, "image_mean", STANDARD)?,
            image_std,
            tokens_per_image: spec.tokens_per_image,
            image_token_id: spec.image_token_id,
        })
    }

    /// The settings of a model directory whose config.json has a Gemma 3 tower; None for
    /// any other model.
    pub fn of_model(dir: &Path) -> crate::error::Result<Option<Gemma3Images>> {
        match TowerSpec::from_model_dir(dir)? {
            Some(TowerSpec::Siglip(spec)) => Gemma3Images::load(dir, &spec).map(Some),
            _ => Ok(None),
        }
    }

    /// The processor's text for one image (`full_image_sequence`).
    pub fn image_sequence(&self) -> String {
        format!(
            "\n\n{BOI}{}{EOI}\n\n",
            SOFT_TOKEN.repeat(self.tokens_per_image)
        )
    }

    /// The patch grid an image's pixels make (one frame, the fixed size in patches).
    pub fn grid(&self) -> [u32; 3] {
        [
            1,
            self.height / self.patch_size,
            self.width / self.patch_size,
        ]
    }

    /// The row of a conversation with images: `<image>` as `<start_of_image>`, rendered
    /// with `chat`, each `<start_of_image>` of the text expanded to the image's sequence,
    /// tokenized, labels on the answers (everywhere with `train_on_prompt`); its images,
    /// in order, with their grids.
    pub fn example(
        &self,
        chat: &ChatTokenizer,
        conv: &Conversation,
        train_on_prompt: bool,
    ) -> Result<Example, RenderError> {
        let mut conv = conv.clone();
        for m in &mut conv.messages {
            m.content = m.content.replace(IMAGE_PLACEHOLDER, BOI);
        }
        let (text, spans) = chat.answer_spans(&conv)?;
        let n = conv.images.len();
        let found = text.matches(BOI).count();
        if found != n {
            return Err(RenderError::Bad(format!(
                "the rendered conversation holds {found} `{BOI}` for {n} images (the text may name `{BOI}` itself)"
            )));
        }
        let (text, spans) = expand(&text, &spans, &self.image_sequence());
        let ex = chat.labelled(&text, &spans, train_on_prompt)?;
        let tokens = ex
            .input_ids
            .iter()
            .filter(|&&id| i64::from(id) == self.image_token_id)
            .count();
        if tokens != n * self.tokens_per_image {
            return Err(RenderError::Bad(format!(
                "{tokens} tokens of id {} (`image_token_index`) for {n} images of {} `{SOFT_TOKEN}`: the tokenizer does not encode `{SOFT_TOKEN}` as that id",
                self.image_token_id, self.tokens_per_image
            )));
        }
        let images = conv
            .images
            .iter()
            .map(|im| RowImage {
                path: im.path.clone(),
                grid: self.grid(),
            })
            .collect();
        Ok(Example { images, ..ex })
    }

    /// The image's pixels, (3, H, W) channel-first, exactly `Gemma3ImageProcessorPil`'s for
    /// the same RGB image (up to the resize's rounding; see the fixtures' test).
    pub fn pixel_values(&self, img: &Rgb8) -> Vec<f32> {
        let resized = resample::bilinear_resize(img, self.width, self.height);
        let plane = (self.height * self.width) as usize;
        let mut out = vec![0f32; 3 * plane];
        for (i, &u) in resized.data.iter().enumerate() {
            let c = i % 3;
            let mut x = match self.do_rescale {
                true => (f64::from(u) * self.rescale_factor) as f32,
                false => f32::from(u),
            };
            if self.do_normalize {
                x = (x - self.image_mean[c]) / self.image_std[c];
            }
            out[c * plane + i / 3] = x;
        }
        out
    }
}

/// `text` with each `BOI` replaced by `sequence`, and `spans` (byte ranges of `text`) moved
/// to where their bytes are then (a span holding a `BOI` grows with it).
fn expand(
    text: &str,
    spans: &[std::ops::Range<usize>],
    sequence: &str,
) -> (String, Vec<std::ops::Range<usize>>) {
    let ends: Vec<usize> = text
        .match_indices(BOI)
        .map(|(i, _)| i + BOI.len())
        .collect();
    let grow = sequence.len() - BOI.len();
    let moved = |p: usize| p + grow * ends.iter().filter(|&&e| e <= p).count();
    let spans = spans.iter().map(|s| moved(s.start)..moved(s.end)).collect();
    (text.replace(BOI, sequence), spans)
}

#[cfg(test)]
mod fixtures;

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> SiglipSpec {
        let cfg = serde_json::json!({"model_type": "gemma3", "mm_tokens_per_image": 4,
            "image_token_index": 9, "vision_config": {"image_size": 28, "patch_size": 7}});
        SiglipSpec::from_json(&cfg, "gemma3", Path::new("c")).unwrap()
    }

    #[test]
    fn spans_move_with_the_expansion() {
        let text = format!("ab{BOI}cd{BOI}");
        // "cd" and the second image; "ab".
        let spans = [2 + BOI.len()..text.len(), 0..2];
        let (out, moved) = expand(&text, &spans, "<IMG>");
        assert_eq!(out, "ab<IMG>cd<IMG>");
        assert_eq!(&out[moved[0].clone()], "cd<IMG>");
        assert_eq!(&out[moved[1].clone()], "ab");
    }

    #[test]
    fn config_keys_and_refusals() {
        let s = spec();
        let v = serde_json::json!({"size": {"height": 28, "width": 28}, "resample": 2,
            "image_mean": [0.5, 0.5, 0.5], "do_pan_and_scan": null});
        let g = Gemma3Images::from_config(&v, &s).unwrap();
        assert_eq!((g.grid(), g.tokens_per_image), ([1, 4, 4], 4));
        assert!(
            g.image_sequence()
                .starts_with("\n\n<start_of_image><image_soft_token>")
        );
        for (bad, key) in [
            (
                r#"{"size": {"height": 28, "width": 28}, "do_pan_and_scan": true}"#,
                "do_pan_and_scan",
            ),
            (
                r#"{"size": {"height": 28, "width": 28}, "resample": 3}"#,
                "resample",
            ),
            (r#"{"size": {"height": 56, "width": 28}}"#, "size"),
            (
                r#"{"size": {"height": 28, "width": 28}, "do_resize": false}"#,
                "do_resize",
            ),
            (
                r#"{"size": {"height": 28, "width": 28}, "image_std": [1, 0, 1]}"#,
                "image_std",
            ),
        ] {
            let e = Gemma3Images::from_config(&serde_json::from_str(bad).unwrap(), &s).unwrap_err();
            assert!(e.contains(key), "{e}");
        }
    }

    #[test]
    fn pixels_are_channel_first_and_normalised() {
        let g = Gemma3Images::from_config(
            &serde_json::json!({"size": {"height": 28, "width": 28}}),
            &spec(),
        )
        .unwrap();
        let img = Rgb8 {
            width: 28,
            height: 28,
            data: [0u8, 255, 51].repeat(28 * 28),
        };
        let v = g.pixel_values(&img);
        assert_eq!(v.len(), 3 * 28 * 28);
        // (0 / 255 - 0.5) / 0.5, (1 - 0.5) / 0.5, (0.2 - 0.5) / 0.5.
        assert_eq!((v[0], v[28 * 28], v[2 * 28 * 28 + 5]), (-1.0, 1.0, -0.6));
    }
}
