//! Gemma 3's tower and projector against transformers' `get_image_features` on
//! scripts/make_vlm_model_fixtures.py's tiny Gemma 3 (`$MT_GOLDEN_DIR/vision/gemma3`), in f32
//! on the CPU: from the checkpoint's tensors directly, and through the launcher's shared
//! region as a worker receives it.
//!
//! The bound, 1e-4 of the output's largest magnitude: both sides run the same f32 ops but for
//! the summation order of the patch embedding (a matmul over C p² = 588 values where
//! transformers runs a Conv2d) and of the attention kernel; a reordered f32 sum of K similar
//! terms moves by about sqrt(K) x 2^-24 of its magnitude (1.5e-6 for K = 588), which two
//! encoder layers, a LayerNorm, a 2 x 2 average and the projection (weights of std 0.15)
//! carry through without growing by more than a small factor: 1e-4 leaves a margin of ~10x,
//! while a wrong patch order or pooling window moves whole rows by O(1).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mt::checkpoint::carried::{Carried, CarriedTensor};
use mt::checkpoint::vision::VisionRegion;
use mt::config::DType;
use mt::config::vision::TowerSpec;
use mt::protocol::VisionInit;
use tch::Tensor;

use super::{SiglipWeights, gemma3_vision};
use crate::model::TowerWeights;

const BOUND: f64 = 1e-4;

fn fixture() -> PathBuf {
    let dir = std::env::var_os("MT_GOLDEN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/golden"))
        .join("vision/gemma3");
    assert!(
        dir.join("io.safetensors").is_file(),
        "no vision fixtures in {}: run `.venv/bin/python scripts/make_vlm_model_fixtures.py --out target/golden`",
        dir.display()
    );
    dir
}

struct Fixture {
    dir: PathBuf,
    spec: TowerSpec,
    checkpoint: Vec<(String, Tensor)>,
    pixel_values: Tensor,
    features: Tensor,
}

fn load() -> Fixture {
    let dir = fixture();
    let spec = TowerSpec::from_model_dir(&dir.join("model"))
        .unwrap()
        .expect("a gemma3 config");
    let checkpoint = Tensor::read_safetensors(dir.join("model/model.safetensors")).unwrap();
    let io: HashMap<String, Tensor> = Tensor::read_safetensors(dir.join("io.safetensors"))
        .unwrap()
        .into_iter()
        .collect();
    Fixture {
        dir,
        spec,
        checkpoint,
        pixel_values: io["pixel_values"].shallow_clone(),
        features: io["features"].shallow_clone(),
    }
}

/// max |got - want| / max |want|.
fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.size(), want.size());
    let diff = (got - want).abs().max().double_value(&[]);
    diff / want.abs().max().double_value(&[])
}

fn siglip(spec: &TowerSpec) -> mt::config::vision::siglip::SiglipSpec {
    match spec {
        TowerSpec::Siglip(s) => s.clone(),
        other => panic!("not a SigLIP tower: {other:?}"),
    }
}

#[test]
fn gemma3_tower_equals_transformers() {
    let f = load();
    // The checkpoint's names without the wrapper's `vision_tower.` (the projector keeps its).
    let tensors = (f.checkpoint.iter())
        .filter(|(n, _)| !n.starts_with("language_model."))
        .map(|(n, t)| {
            let inner = n.strip_prefix("vision_tower.").unwrap_or(n);
            (inner.to_string(), t.shallow_clone())
        })
        .collect();
    let w = SiglipWeights::new(siglip(&f.spec), tensors);
    let got = gemma3_vision(&w, &f.pixel_values);
    let err = rel_err(&got, &f.features);
    assert!(err <= BOUND, "relative error {err:e} > {BOUND:e}");
    eprintln!("gemma3 tower vs transformers: relative error {err:e}");
    // The bound sees the patch order: the images transposed move the output by O(1).
    let off = rel_err(
        &gemma3_vision(&w, &f.pixel_values.transpose(2, 3)),
        &f.features,
    );
    assert!(
        off > 100.0 * BOUND,
        "transposed images still match ({off:e})"
    );
}

#[test]
fn gemma3_tower_through_the_shared_region_equals_transformers() {
    let f = load();
    let tensors = (f.checkpoint.iter())
        .map(|(name, t)| {
            let values = Vec::<f32>::try_from(t.reshape([-1])).unwrap();
            CarriedTensor {
                name: name.clone(),
                dtype: safetensors::Dtype::F32,
                shape: t.size().iter().map(|&d| d as usize).collect(),
                bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            }
        })
        .filter(|t| !t.name.starts_with("language_model."))
        .collect();
    let region = VisionRegion::build(
        "mt-test-vision-g3",
        &f.spec,
        mt::config::TowerTraining::Frozen,
        &Carried { tensors },
        DType::Float32,
        &f.dir.join("model"),
    )
    .unwrap();
    assert_eq!(
        (
            region.layout.prefix.as_str(),
            region.layout.projector_prefix.as_str()
        ),
        ("vision_tower.", "")
    );
    let mut handle = region.handle();
    let own = (std::fs::OpenOptions::new().read(true).write(true))
        .open(format!("/proc/self/fd/{}", handle.fd))
        .unwrap();
    handle.fd = std::os::fd::IntoRawFd::into_raw_fd(own);
    let init = VisionInit {
        layout: region.layout.clone(),
        region: handle,
        pixels: None,
        row_image_tokens: None,
    };
    let TowerWeights::Siglip(w) =
        crate::stream::vision::load(&init, DType::Float32, tch::Device::Cpu).unwrap()
    else {
        panic!("a SigLIP tower");
    };
    drop(region);
    let err = rel_err(&gemma3_vision(&w, &f.pixel_values), &f.features);
    assert!(err <= BOUND, "relative error {err:e} > {BOUND:e}");
}
