//! The frozen vision tower's weights, from the read-only region the launcher filled
//! (`mt::checkpoint::vision`): mapped once at start-up, every tensor copied to the compute
//! device, the mapping dropped. No gradient, no optimizer state: these are not trained (a
//! trained projector's tensors are the embedding block's, not the region's).

use std::collections::HashMap;

use anyhow::{Result, bail};
use mt::config::DType;
use mt::protocol::VisionInit;
use mt::shm::Region;
use tch::{Device, Tensor};

use super::{kind_of, region_view};
use mt::config::vision::TowerSpec;

use crate::model::{ClipWeights, SiglipWeights, TowerWeights, VisionWeights};

/// Adopts the tower's region named in `init` (an fd this process inherited, taken over
/// once), copies its tensors, in `dtype`, to `device`.
pub fn load(init: &VisionInit, dtype: DType, device: Device) -> Result<TowerWeights> {
    // SAFETY: the launcher cleared close-on-exec on this fd for this process alone, and
    // nothing else in the worker uses it; the region takes it over.
    let region = unsafe { Region::from_inherited_fd(&init.region) }?;
    let layout = &init.layout;
    let need = layout.total * dtype.size();
    if region.payload_len() < need {
        bail!(
            "vision region `{}` holds {} bytes, its layout needs {need}",
            region.name(),
            region.payload_len()
        );
    }
    let kind = kind_of(dtype);
    let mut tensors = HashMap::new();
    for t in &layout.tensors {
        let shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
        // SAFETY: inside the payload (checked above against the layout's end); the
        // launcher wrote the region before this worker started and never writes it
        // again; the view is copied before the region is unmapped, at the end of `load`.
        let view = unsafe { region_view(&region, t.offset, t.numel(), kind) };
        let mut on_device = Tensor::empty(shape.as_slice(), (kind, device));
        on_device.copy_(&view.view(shape.as_slice()));
        tensors.insert(t.name.clone(), on_device);
    }
    Ok(match &layout.spec {
        TowerSpec::Qwen(spec) => TowerWeights::Qwen(VisionWeights::new(spec.clone(), tensors)),
        TowerSpec::Siglip(spec) => TowerWeights::Siglip(SiglipWeights::new(spec.clone(), tensors)),
        TowerSpec::Clip(spec) => TowerWeights::Clip(ClipWeights::new(spec.clone(), tensors)),
    })
}
