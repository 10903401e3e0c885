//! A micro-batch's images as the model's image processor makes them, on the CPU (each file
//! decoded and resized, the images in parallel: [`pixel_rows`], which the prefetch thread
//! runs ahead of the step) and on the device (each image's pixels uploaded by itself and
//! joined there: no host copy of the whole batch's f32 pixels).

use anyhow::{Result, bail};
use mt::data::{BatchImage, Gemma3Images, ImageProcessor, LlavaNextImages, QwenVlImages, image};
use rayon::prelude::*;
use tch::{Device, Kind, Tensor};

/// Qwen2.5-VL's pixel rows of all images (N, P): one row per patch, channels x temporal
/// patch x patch x patch. Each image's rows go up by themselves and are joined on the
/// device: no host copy of the whole batch's f32 pixels (1.2 GB for 256 images of 448x448).
pub(super) fn qwen_pixels(
    px: &QwenVlImages,
    per_image: &[Vec<f32>],
    kind: Kind,
    device: Device,
) -> Result<Tensor> {
    let patch = 3 * i64::from(px.temporal_patch_size) * i64::from(px.patch_size).pow(2);
    let pixels_np = per_image
        .iter()
        .map(|rows| {
            Tensor::f_from_slice(rows)?
                .f_view([rows.len() as i64 / patch, patch])?
                .f_to_device(device)?
                .f_to_kind(kind)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Tensor::f_cat(&pixels_np, 0)?)
}

/// Gemma 3's images (I, 3, S, S), each uploaded by itself.
pub(super) fn gemma3_pixels(
    px: &Gemma3Images,
    per_image: &[Vec<f32>],
    kind: Kind,
    device: Device,
) -> Result<Tensor> {
    let (h, w) = (i64::from(px.height), i64::from(px.width));
    let pixels = per_image
        .iter()
        .map(|p| {
            Tensor::f_from_slice(p)?
                .f_view([3, h, w])?
                .f_to_device(device)?
                .f_to_kind(kind)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Tensor::f_stack(&pixels, 0)?)
}

/// LLaVA-NeXT's tiles of all images (Tt, 3, S, S), each image's uploaded by itself.
pub(super) fn llava_next_tiles(
    px: &LlavaNextImages,
    per_image: &[Vec<f32>],
    kind: Kind,
    device: Device,
) -> Result<Tensor> {
    let s = px.spec.image_size as i64;
    let tiles = per_image
        .iter()
        .map(|p| {
            Tensor::f_from_slice(p)?
                .f_view([-1, 3, s, s])?
                .f_to_device(device)?
                .f_to_kind(kind)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Tensor::f_cat(&tiles, 0)?)
}

/// Each image's pixels as the model's image processor makes them (Qwen's patch rows,
/// patches x values; Gemma 3's (3, S, S) image; LLaVA-NeXT's (tiles, 3, S, S)), the file
/// decoded and resized on the CPU,
/// the images in parallel; a file whose grid is not the one the batch was built for
/// (changed since the data was read) is an error naming it.
pub fn pixel_rows(px: &ImageProcessor, images: &[BatchImage]) -> Result<Vec<Vec<f32>>> {
    images
        .par_iter()
        .map(|im| match px {
            ImageProcessor::Qwen(px) => qwen_rows(px, im),
            ImageProcessor::Gemma3(px) => gemma3_image(px, im),
            ImageProcessor::LlavaNext(px) => llava_next_image(px, im),
        })
        .collect()
}

fn llava_next_image(px: &LlavaNextImages, im: &BatchImage) -> Result<Vec<f32>> {
    let rgb = image::decode(&im.path)?;
    let grid = LlavaNextImages::grid(rgb.height, rgb.width);
    if grid != im.grid {
        bail!(
            "{}: decoded to {} x {} pixels, the batch was built for {} x {} (the file changed since the data was read?)",
            im.path.display(),
            rgb.height,
            rgb.width,
            im.grid[1],
            im.grid[2]
        );
    }
    Ok(px.pixel_values(&rgb))
}

fn qwen_rows(px: &QwenVlImages, im: &BatchImage) -> Result<Vec<f32>> {
    let rgb = image::decode(&im.path)?;
    px.resize(rgb.height, rgb.width)
        .map_err(|e| anyhow::anyhow!("{}: {e}", im.path.display()))?;
    let (g, rows) = px.pixel_values(&rgb);
    if [g.t, g.h, g.w] != im.grid {
        bail!(
            "{}: decoded to a {:?} patch grid, the batch was built for {:?} (the file changed since the data was read?)",
            im.path.display(),
            [g.t, g.h, g.w],
            im.grid
        );
    }
    Ok(rows)
}

fn gemma3_image(px: &Gemma3Images, im: &BatchImage) -> Result<Vec<f32>> {
    if im.grid != px.grid() {
        bail!(
            "{}: the batch was built for a {:?} patch grid, the processor makes {:?}",
            im.path.display(),
            im.grid,
            px.grid()
        );
    }
    Ok(px.pixel_values(&image::decode(&im.path)?))
}
