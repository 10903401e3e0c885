//! An image's `pixel_values` rows as transformers 5's `Qwen2VLImageProcessorPil` makes them,
//! the class `AutoImageProcessor` picks for Qwen2-VL / Qwen2.5-VL where torchvision is
//! absent (with torchvision it picks the torchvision `Qwen2VLImageProcessor`, whose resize
//! is torch's antialiased bicubic on floats; see `pixel_values`):
//!
//! 1. resize to `smart_resize`'s size with Pillow's bicubic filter (antialiased when
//!    shrinking), on the 8-bit image (`crate::data::image::resample`);
//! 2. rescale: sample as f64 x `rescale_factor`, then to f32;
//! 3. normalise in f32: (x - mean) / std per channel;
//! 4. patchify: the (C, H, W) image cut into patch_size² patches, ordered by merge block
//!    (row-major), then the merge_size² patches inside a block (row-major); each row is one
//!    patch's C x temporal_patch_size x patch_size x patch_size values, the still image
//!    repeated over the temporal patch.
//!
//! Legend: p = patch_size, m = merge_size, t = temporal_patch_size, (gh, gw) = the grid.

use serde_json::Value;

use super::{Grid, QwenVlImages};
use crate::data::image::{Rgb8, resample};

/// `preprocessor_config.json`'s flag `key` (absent or null: `default`).
pub(crate) fn config_flag(cfg: &Value, key: &str, default: bool) -> Result<bool, String> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(x) => Err(format!("`{key}`: expected true or false, found {x}")),
    }
}

/// `preprocessor_config.json`'s per-channel triple `key` (absent or null: `default`).
pub(crate) fn config_triple(cfg: &Value, key: &str, default: [f32; 3]) -> Result<[f32; 3], String> {
    let Some(v) = cfg.get(key).filter(|v| !v.is_null()) else {
        return Ok(default);
    };
    let bad = || format!("`{key}`: expected three numbers (R, G, B), found {v}");
    let list = v.as_array().filter(|a| a.len() == 3).ok_or_else(bad)?;
    let mut out = [0f32; 3];
    for (o, x) in out.iter_mut().zip(list) {
        *o = x.as_f64().ok_or_else(bad)? as f32;
    }
    Ok(out)
}

/// The pixel keys of a `preprocessor_config.json` into `s`; settings we do not reproduce
/// (no resize, another filter) are errors naming the key.
pub(super) fn read_config(cfg: &Value, s: &mut QwenVlImages) -> Result<(), String> {
    let flag = |key: &str, default: bool| config_flag(cfg, key, default);
    let triple = |key: &str, default: [f32; 3]| config_triple(cfg, key, default);
    if !flag("do_resize", true)? {
        return Err("`do_resize`: false is not supported (patches need the resize)".into());
    }
    if let Some(r) = cfg.get("resample").filter(|v| !v.is_null())
        && r.as_u64() != Some(3)
    {
        return Err(format!(
            "`resample`: {r} is not supported (expected 3, bicubic)"
        ));
    }
    s.do_rescale = flag("do_rescale", s.do_rescale)?;
    s.do_normalize = flag("do_normalize", s.do_normalize)?;
    if let Some(f) = cfg.get("rescale_factor").filter(|v| !v.is_null()) {
        s.rescale_factor = f
            .as_f64()
            .ok_or_else(|| format!("`rescale_factor`: expected a number, found {f}"))?;
    }
    s.image_mean = triple("image_mean", s.image_mean)?;
    s.image_std = triple("image_std", s.image_std)?;
    if s.image_std.contains(&0.0) {
        return Err("`image_std`: a zero would divide by zero".into());
    }
    Ok(())
}

impl QwenVlImages {
    /// The image's grid and its `pixel_values` rows: (gh x gw, 3 x t x p x p), row-major,
    /// exactly `Qwen2VLImageProcessorPil`'s for the same RGB image.
    ///
    /// The image's size must be one the records' check accepted (an aspect ratio of at most
    /// 200, which [`QwenVlImages::grid`] refuses otherwise); a size it refuses panics here.
    pub fn pixel_values(&self, img: &Rgb8) -> (Grid, Vec<f32>) {
        let (h, w) = self
            .resize(img.height, img.width)
            .expect("an image size the records' check accepted");
        let resized = resample::bicubic_resize(img, w, h);
        let (p, m, t) = (
            self.patch_size as usize,
            self.merge_size as usize,
            self.temporal_patch_size as usize,
        );
        let grid = Grid {
            t: 1,
            h: h / self.patch_size,
            w: w / self.patch_size,
        };
        let (gh, gw, width) = (grid.h as usize, grid.w as usize, w as usize);
        // (H, W, C) samples to normalised f32, in the processor's order of operations.
        let norm: Vec<f32> = resized
            .data
            .iter()
            .enumerate()
            .map(|(i, &u)| {
                let c = i % 3;
                let mut x = if self.do_rescale {
                    (f64::from(u) * self.rescale_factor) as f32
                } else {
                    f32::from(u)
                };
                if self.do_normalize {
                    x = (x - self.image_mean[c]) / self.image_std[c];
                }
                x
            })
            .collect();
        let row_len = 3 * t * p * p;
        let mut out = Vec::with_capacity(gh * gw * row_len);
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                        for c in 0..3 {
                            for _ in 0..t {
                                for py in 0..p {
                                    let at = ((y0 + py) * width + x0) * 3 + c;
                                    out.extend((0..p).map(|px| norm[at + px * 3]));
                                }
                            }
                        }
                    }
                }
            }
        }
        (grid, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_follow_the_patch_order() {
        // A 56 x 56 image (no resize): grid 4 x 4, merge blocks 2 x 2. Each sample holds
        // its own coordinates so the order can be read back.
        let (w, h) = (56u32, 56u32);
        let mut data = Vec::new();
        for y in 0..h {
            for x in 0..w {
                data.extend([y as u8, x as u8, 0]);
            }
        }
        let s = QwenVlImages {
            do_rescale: false,
            do_normalize: false,
            ..QwenVlImages::default()
        };
        let (g, v) = s.pixel_values(&Rgb8 {
            width: w,
            height: h,
            data,
        });
        assert_eq!((g.t, g.h, g.w), (1, 4, 4));
        let row_len = 3 * 2 * 14 * 14;
        assert_eq!(v.len(), 16 * row_len);
        // Row 3: block (0, 0), patch (1, 1): rows 14.., columns 14..; channel R holds y,
        // G holds x; the temporal copy repeats the patch.
        let r = &v[3 * row_len..4 * row_len];
        assert_eq!((r[0], r[1]), (14.0, 14.0));
        assert_eq!(r[2 * 196], 14.0, "G: the x coordinate");
        assert_eq!(r[196 + 14], 15.0, "R again in the temporal copy, next row");
        // Row 4: the second merge block across starts at column 28; row 8, the first
        // block of the second row of blocks, at row 28.
        assert_eq!((v[4 * row_len], v[4 * row_len + 2 * 196]), (0.0, 28.0));
        assert_eq!((v[8 * row_len], v[8 * row_len + 2 * 196]), (28.0, 0.0));
    }

    #[test]
    fn config_pixel_keys() {
        let v: Value = serde_json::from_str(
            r#"{"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.25, 1], "rescale_factor": 0.5}"#,
        )
        .unwrap();
        let s = QwenVlImages::from_config(&v).unwrap();
        assert_eq!(s.image_std, [0.5, 0.25, 1.0]);
        assert_eq!(s.rescale_factor, 0.5);
        for (bad, key) in [
            (r#"{"image_mean": [0.5, 0.5]}"#, "image_mean"),
            (r#"{"resample": 2}"#, "resample"),
            (r#"{"do_resize": false}"#, "do_resize"),
            (r#"{"image_std": [1, 0, 1]}"#, "image_std"),
        ] {
            let e = QwenVlImages::from_config(&serde_json::from_str(bad).unwrap()).unwrap_err();
            assert!(e.contains(key), "{e}");
        }
    }
}
