//! LLaVA-NeXT images in the text and their pixels, as transformers 5's `LlavaNextProcessor`
//! and `LlavaNextImageProcessorPil` make them (written from their rules,
//! `models/llava_next/`; the PIL class is what `AutoImageProcessor` picks for `llava_next`
//! where torchvision is absent; with torchvision it picks `LlavaNextImageProcessor`, whose
//! resize runs in torch, not measured here):
//!
//! - Text: LlamaFactory's `<image>` is the model's own image token (llava-hf's tokenizers
//!   have `<image>`; a processor naming another `image_token` gets that one). The
//!   conversation is rendered with the chat template, then, as the processor does to the
//!   rendered text, each image token becomes as many image tokens as the image has features
//!   ([`ClipSpec::image_tokens`]: the base tile's, then the unpadded tiles' rows, each with
//!   its newline), so every image of another size has another count.
//! - Pixels: the image (8-bit RGB) resized with Pillow's bicubic filter keeping its aspect
//!   into the pinpoint [`ClipSpec::best_resolution`] picks (`get_patch_output_size`: the
//!   limiting side exact, the other `ceil`ed), pasted at the centre of a black canvas of the
//!   pinpoint (the left / top margin the smaller half), cut into S x S tiles row by row; the
//!   whole image resized to S x S (bicubic, aspect not kept) goes first. Each tile is then
//!   rescaled and normalised per channel: (tiles, 3, S, S) channel-first. The processor's
//!   per-tile resize to `size` and centre crop to `crop_size` leave an S x S tile as it is,
//!   which is why both must be the tower's `image_size` (else refused, naming the key).

use std::path::Path;

use serde_json::Value;

use super::chat::RenderError;
use super::image::{Rgb8, resample};
use super::qwen_vl::{IMAGE_PLACEHOLDER, config_flag, config_triple};
use super::records::Conversation;
use super::{ChatTokenizer, Example, RowImage};
use crate::config::vision::TowerSpec;
use crate::config::vision::clip::{ClipSpec, pinpoints};

/// transformers' `OPENAI_CLIP_MEAN` / `_STD`, `LlavaNextImageProcessorPil`'s defaults
/// (Python floats, made f32 as numpy rounds them).
const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// A LLaVA-NeXT model's image settings: its tower and tiling (config.json) and
/// `preprocessor_config.json`'s pixel keys.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LlavaNextImages {
    pub spec: ClipSpec,
    /// The processor's image token (`image_token`, `<image>`), whose id is the model's
    /// `image_token_index`.
    pub image_token: String,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
}

impl LlavaNextImages {
    /// The settings of `dir`: its `preprocessor_config.json` and, where present,
    /// `processor_config.json`, against the tower of its config.json (`spec`).
    pub fn load(dir: &Path, spec: &ClipSpec) -> crate::error::Result<LlavaNextImages> {
        let read = |name: &str, what: &'static str| -> crate::error::Result<Option<Value>> {
            let path = dir.join(name);
            if !path.is_file() && name == "processor_config.json" {
                return Ok(None);
            }
            let text = crate::bounded::read_text(&path, crate::bounded::SMALL_JSON, what)?;
            serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| crate::error::Error::Config {
                    path,
                    msg: e.to_string(),
                })
        };
        let err = |name: &str| {
            let path = dir.join(name);
            move |msg: String| crate::error::Error::Config { path, msg }
        };
        let pre = read("preprocessor_config.json", "image processor config")?.unwrap_or_default();
        let mut s =
            LlavaNextImages::from_config(&pre, spec).map_err(err("preprocessor_config.json"))?;
        if let Some(proc) = read("processor_config.json", "processor config")? {
            s.image_token = processor_token(&proc, spec).map_err(err("processor_config.json"))?;
        }
        Ok(s)
    }

    /// The settings of a `preprocessor_config.json` object for the tower `spec`; settings
    /// we do not reproduce, or that would give the model other tiles than its own, are
    /// errors naming the key.
    pub fn from_config(cfg: &Value, spec: &ClipSpec) -> Result<LlavaNextImages, String> {
        let side = spec.image_size as u64;
        if let Some(r) = cfg.get("resample").filter(|v| !v.is_null())
            && r.as_u64() != Some(3)
        {
            return Err(format!(
                "`resample`: {r} is not supported (expected 3, bicubic)"
            ));
        }
        // The base tile's resize and each tile's resize and crop keep an S x S tile as it
        // is only where `size` and `crop_size` are the tower's S.
        let size = cfg.get("size").filter(|v| !v.is_null());
        let sides = |v: Option<&Value>, keys: &[&str], default: u64| -> Vec<Option<u64>> {
            keys.iter()
                .map(|k| match v {
                    None => Some(default),
                    Some(v) => v.get(k).and_then(Value::as_u64),
                })
                .collect()
        };
        let size_ok = match size.and_then(|s| s.get("shortest_edge")) {
            Some(e) => e.as_u64() == Some(side),
            None => sides(size, &["height", "width"], 224) == [Some(side); 2],
        };
        if !size_ok {
            return Err(format!(
                "`size` is {}, but the vision tower's tiles are {side} x {side} (expected {{\"shortest_edge\": {side}}})",
                size.map_or("absent (224)".into(), Value::to_string)
            ));
        }
        let crop = cfg.get("crop_size").filter(|v| !v.is_null());
        if sides(crop, &["height", "width"], 224) != [Some(side); 2] {
            return Err(format!(
                "`crop_size` is {}, but the vision tower's tiles are {side} x {side}",
                crop.map_or("absent (224)".into(), Value::to_string)
            ));
        }
        // The processor tiles at its own pinpoints, the model unpads at config.json's.
        if let Some(p) = cfg.get("image_grid_pinpoints").filter(|v| !v.is_null()) {
            let p = pinpoints(p).map_err(|m| format!("`image_grid_pinpoints`: {m}"))?;
            if p != spec.pinpoints {
                return Err(format!(
                    "`image_grid_pinpoints` is {p:?}, but config.json's is {:?} (the model would unpad other tiles than the processor cut)",
                    spec.pinpoints
                ));
            }
        }
        let rescale_factor = match cfg.get("rescale_factor").filter(|v| !v.is_null()) {
            Some(f) => f
                .as_f64()
                .ok_or_else(|| format!("`rescale_factor`: expected a number, found {f}"))?,
            None => 1.0 / 255.0,
        };
        let image_std = config_triple(cfg, "image_std", CLIP_STD.map(|x| x as f32))?;
        if image_std.contains(&0.0) {
            return Err("`image_std`: a zero would divide by zero".into());
        }
        Ok(LlavaNextImages {
            spec: spec.clone(),
            image_token: IMAGE_PLACEHOLDER.into(),
            do_rescale: config_flag(cfg, "do_rescale", true)?,
            rescale_factor,
            do_normalize: config_flag(cfg, "do_normalize", true)?,
            image_mean: config_triple(cfg, "image_mean", CLIP_MEAN.map(|x| x as f32))?,
            image_std,
        })
    }

    /// The settings of a model directory whose config.json has a LLaVA-NeXT tower; None
    /// for any other model.
    pub fn of_model(dir: &Path) -> crate::error::Result<Option<LlavaNextImages>> {
        match TowerSpec::from_model_dir(dir)? {
            Some(TowerSpec::Clip(spec)) => LlavaNextImages::load(dir, &spec).map(Some),
            _ => Ok(None),
        }
    }

    /// The batch's record of an image of `height` x `width` pixels: its size, from which
    /// the tiles, the unpadding and the token count follow ((1, height, width)).
    pub fn grid(height: u32, width: u32) -> [u32; 3] {
        [1, height, width]
    }

    /// The row of a conversation with images: rendered with `chat` (`<image>` as the
    /// processor's image token), each image token of the text expanded to its image's
    /// count, tokenized, labels on the answers (everywhere with `train_on_prompt`); its
    /// images, in order, with their sizes.
    pub fn example(
        &self,
        chat: &ChatTokenizer,
        conv: &Conversation,
        train_on_prompt: bool,
    ) -> Result<Example, RenderError> {
        let mut conv = conv.clone();
        let token = self.image_token.as_str();
        if token != IMAGE_PLACEHOLDER {
            for m in &mut conv.messages {
                m.content = m.content.replace(IMAGE_PLACEHOLDER, token);
            }
        }
        let (text, spans) = chat.answer_spans(&conv)?;
        let counts: Vec<usize> = (conv.images.iter())
            .map(|im| self.spec.image_tokens(im.size.height, im.size.width))
            .collect();
        let found = text.matches(token).count();
        if found != counts.len() {
            return Err(RenderError::Bad(format!(
                "the rendered conversation holds {found} `{token}` for {} images (the chat template may add or drop `{token}`)",
                counts.len()
            )));
        }
        let (text, spans) = expand(&text, &spans, token, &counts);
        let ex = chat.labelled(&text, &spans, train_on_prompt)?;
        let id = self.spec.image_token_id;
        let tokens = (ex.input_ids.iter())
            .filter(|&&t| i64::from(t) == id)
            .count();
        let want: usize = counts.iter().sum();
        if tokens != want {
            return Err(RenderError::Bad(format!(
                "{tokens} tokens of id {id} (`image_token_index`) where the images have {want} features: the tokenizer does not encode `{token}` as that id"
            )));
        }
        let images = (conv.images.iter())
            .map(|im| RowImage {
                path: im.path.clone(),
                grid: LlavaNextImages::grid(im.size.height, im.size.width),
            })
            .collect();
        Ok(Example { images, ..ex })
    }

    /// The image's pixels, (tiles, 3, S, S) channel-first, the base tile first: exactly
    /// `LlavaNextImageProcessorPil`'s for the same RGB image (up to the resize's rounding;
    /// see the fixtures' test).
    pub fn pixel_values(&self, img: &Rgb8) -> Vec<f32> {
        let s = self.spec.image_size as u32;
        let [bh, bw] = self.spec.best_resolution(img.height, img.width);
        let (nh, nw) = patch_output_size(img.height, img.width, bh, bw);
        let resized = resample::bicubic_resize(img, nw, nh);
        // The resized image at the centre of a black bh x bw canvas.
        let (top, left) = ((bh - nh) / 2, (bw - nw) / 2);
        let mut canvas = vec![0u8; (bh * bw * 3) as usize];
        for (y, row) in resized.data.chunks_exact(nw as usize * 3).enumerate() {
            let at = (((top as usize + y) * bw as usize) + left as usize) * 3;
            canvas[at..at + row.len()].copy_from_slice(row);
        }
        let base = resample::bicubic_resize(img, s, s);
        let (rows, cols) = (bh / s, bw / s);
        let plane = (s * s) as usize;
        let mut out = Vec::with_capacity((1 + rows * cols) as usize * 3 * plane);
        self.push_tile(&mut out, &base.data, s, 0, 0);
        for r in 0..rows {
            for c in 0..cols {
                self.push_tile(&mut out, &canvas, bw, r * s, c * s);
            }
        }
        out
    }

    /// The S x S tile at (`y0`, `x0`) of an 8-bit RGB image `width` pixels wide, rescaled
    /// and normalised in the processor's order (f64 rescale to f32, then f32 normalise),
    /// channel-first, appended to `out`.
    fn push_tile(&self, out: &mut Vec<f32>, rgb: &[u8], width: u32, y0: u32, x0: u32) {
        let s = self.spec.image_size;
        for c in 0..3 {
            for y in 0..s {
                let at = ((y0 as usize + y) * width as usize + x0 as usize) * 3 + c;
                out.extend(rgb[at..].iter().step_by(3).take(s).map(|&u| {
                    let mut x = match self.do_rescale {
                        true => (f64::from(u) * self.rescale_factor) as f32,
                        false => f32::from(u),
                    };
                    if self.do_normalize {
                        x = (x - self.image_mean[c]) / self.image_std[c];
                    }
                    x
                }));
            }
        }
    }
}

/// The processor's image token from `processor_config.json`, its keys checked against the
/// model (`spec`): the patch size and feature strategy the processor counts tokens with, and
/// `num_additional_image_tokens` (the class token the `default` strategy drops: 1 for
/// CLIP), so that its counts are the model's features.
fn processor_token(cfg: &Value, spec: &ClipSpec) -> Result<String, String> {
    if let Some(p) = cfg.get("patch_size").filter(|v| !v.is_null())
        && p.as_u64() != Some(spec.patch_size as u64)
    {
        return Err(format!(
            "`patch_size` is {p}, but the vision tower's is {} (the processor would count other image tokens than the model's features)",
            spec.patch_size
        ));
    }
    if let Some(s) = cfg
        .get("vision_feature_select_strategy")
        .filter(|v| !v.is_null())
        && s.as_str() != Some("default")
    {
        return Err(format!(
            "`vision_feature_select_strategy` is {s}, but config.json's is `default`"
        ));
    }
    match cfg.get("num_additional_image_tokens") {
        None | Some(Value::Null) => {}
        Some(n) if n.as_u64() == Some(1) => {}
        Some(n) => {
            return Err(format!(
                "`num_additional_image_tokens` is {n}: the processor would count {} image tokens per image the model does not have (expected 1, CLIP's class token)",
                if n.as_u64() == Some(0) {
                    "one fewer"
                } else {
                    "other"
                }
            ));
        }
    }
    match cfg.get("image_token") {
        None | Some(Value::Null) => Ok(IMAGE_PLACEHOLDER.into()),
        Some(Value::String(t)) if !t.is_empty() => Ok(t.clone()),
        Some(x) => Err(format!("`image_token`: expected a token, found {x}")),
    }
}

/// transformers' `get_patch_output_size`: an image of `height` x `width` scaled to fit
/// `target_h` x `target_w`, its aspect kept: the limiting side exact, the other rounded up
/// (at most the target).
fn patch_output_size(height: u32, width: u32, target_h: u32, target_w: u32) -> (u32, u32) {
    let (oh, ow) = (f64::from(height), f64::from(width));
    let scale_w = f64::from(target_w) / ow;
    let scale_h = f64::from(target_h) / oh;
    if scale_w < scale_h {
        (
            (oh * scale_w).ceil().min(f64::from(target_h)) as u32,
            target_w,
        )
    } else {
        (
            target_h,
            (ow * scale_h).ceil().min(f64::from(target_w)) as u32,
        )
    }
}

/// `text` with its i-th `token` replaced by `counts[i]` of them, and `spans` (byte ranges of
/// `text`) moved to where their bytes are then (a span holding a token grows with it).
fn expand(
    text: &str,
    spans: &[std::ops::Range<usize>],
    token: &str,
    counts: &[usize],
) -> (String, Vec<std::ops::Range<usize>>) {
    let ends: Vec<usize> = (text.match_indices(token))
        .map(|(i, _)| i + token.len())
        .collect();
    let moved = |p: usize| {
        p + (ends.iter().zip(counts))
            .filter(|&(&e, _)| e <= p)
            .map(|(_, &n)| token.len() * (n - 1))
            .sum::<usize>()
    };
    let spans = spans.iter().map(|s| moved(s.start)..moved(s.end)).collect();
    let mut out = String::with_capacity(text.len() + token.len() * counts.iter().sum::<usize>());
    let mut parts = text.split(token);
    out.push_str(parts.next().unwrap_or_default());
    for (part, &n) in parts.zip(counts) {
        out.push_str(&token.repeat(n));
        out.push_str(part);
    }
    (out, spans)
}

#[cfg(test)]
mod fixtures;

#[cfg(test)]
mod tests;
