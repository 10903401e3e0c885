//! The next step's images, decoded while this step computes.
//!
//! Decoding and resizing a step's images runs on the CPU (256 PNGs of 448x448: 2.6 s of a
//! 13.9 s step of the Qwen2.5-VL-7B shape on one H200, where the host's update of the
//! previous step takes the same cores at the same moment). The launcher names, with each
//! step, the images the worker's next step will read (`ToWorker::Step::next_images`); a
//! thread decodes them meanwhile, and the next step takes its pixels from it when its
//! images are those, in that order (else it decodes them itself, as without this).

use std::thread::JoinHandle;

use anyhow::{Result, anyhow};
use mt::data::{BatchImage, ImageProcessor, MicroBatch};

use super::pixels::pixel_rows;

/// One step's images being decoded in the background.
pub struct Prefetch {
    /// The images, in the order of the step's micro-batches and their tokens.
    images: Vec<BatchImage>,
    thread: JoinHandle<Result<Vec<Vec<f32>>>>,
}

impl Prefetch {
    /// Starts decoding `images` (None when there are none).
    pub fn start(px: ImageProcessor, images: Vec<BatchImage>) -> Option<Prefetch> {
        if images.is_empty() {
            return None;
        }
        let list = images.clone();
        let thread = std::thread::Builder::new()
            .name("mt-images".into())
            .spawn(move || pixel_rows(&px, &list))
            .ok()?;
        Some(Prefetch { images, thread })
    }

    /// The pixel rows of each of `micro`'s micro-batches, when this prefetch holds their
    /// images in that order; None otherwise (the caller decodes). A decoding error is the
    /// step's.
    pub fn take(self, micro: &[MicroBatch]) -> Result<Option<Vec<Vec<Vec<f32>>>>> {
        let same = self.images.iter().map(|im| (&im.path, im.grid)).eq(micro
            .iter()
            .flat_map(|m| &m.images)
            .map(|im| (&im.path, im.grid)));
        let joined = self.thread.join();
        if !same {
            return Ok(None);
        }
        let rows = joined.map_err(|_| anyhow!("the image decoding thread panicked"))??;
        let mut rows = rows.into_iter();
        Ok(Some(
            micro
                .iter()
                .map(|m| rows.by_ref().take(m.images.len()).collect())
                .collect(),
        ))
    }
}
