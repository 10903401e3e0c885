//! The tower against transformers' on scripts/make_vlm_model_fixtures.py's tiny Qwen3-VL
//! (`$MT_GOLDEN_DIR/vision/qwen3_vl`, `--family qwen3_vl`), in f32 on the CPU: the merged
//! features and both deepstack features, from the checkpoint's tensors directly and through
//! the launcher's shared region as a worker receives it; and on its tiny Qwen3.5
//! (`vision/qwen3_5`, `--family qwen3_5`: `Qwen3_5VisionModel`, the same tower without
//! deepstack mergers), whose spec lists none.
//!
//! The bound, 1e-4 of each output's largest magnitude, is Qwen2.5-VL's tower's (see its
//! tests): the same f32 ops on both sides but for the summation order of the patch embedding
//! (a matmul over P = 1536 values where transformers runs a Conv3d: about
//! sqrt(1536) x 2^-24 = 2.3e-6 relative) and of the attention over padded, masked frames
//! (one SDPA call where transformers runs one per frame); the position embeddings' taps and
//! weights are computed in the same f32 operations as transformers', and three blocks with
//! gains near 1 carry such differences through without growing them past a small factor.
//! Any wrong index (a tap, a position, a merge order, a deepstack merger) moves whole rows
//! by O(1). Measured: printed with --nocapture.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mt::checkpoint::carried::{Carried, CarriedTensor};
use mt::checkpoint::vision::VisionRegion;
use mt::config::DType;
use mt::config::vision::VisionSpec;
use mt::protocol::VisionInit;
use tch::{Device, Tensor};

use super::{Qwen3VlFeatures, VisionWeights, axis_taps, qwen3_vl_vision};

const BOUND: f64 = 1e-4;

struct Fixture {
    dir: PathBuf,
    spec: VisionSpec,
    checkpoint: Vec<(String, Tensor)>,
    io: HashMap<String, Tensor>,
    grids: Vec<[u32; 3]>,
}

/// The fixture of `family` (`qwen3_vl`, `qwen3_5`).
fn load(family: &str) -> Fixture {
    let dir = std::env::var_os("MT_GOLDEN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/golden"))
        .join("vision")
        .join(family);
    assert!(
        dir.join("io.safetensors").is_file(),
        "no vision fixtures in {}: run `.venv/bin/python scripts/make_vlm_model_fixtures.py --out target/golden --family {family}`",
        dir.display()
    );
    let spec = VisionSpec::from_model_dir(&dir.join("model"))
        .unwrap()
        .expect("a Qwen tower's config");
    let checkpoint = Tensor::read_safetensors(dir.join("model/model.safetensors")).unwrap();
    let io: HashMap<String, Tensor> = Tensor::read_safetensors(dir.join("io.safetensors"))
        .unwrap()
        .into_iter()
        .collect();
    let g = Vec::<i64>::try_from(io["grid_thw"].reshape([-1])).unwrap();
    let grids = g
        .chunks(3)
        .map(|c| [c[0] as u32, c[1] as u32, c[2] as u32])
        .collect();
    Fixture {
        dir,
        spec,
        checkpoint,
        io,
        grids,
    }
}

/// max |got - want| / max |want|.
fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.size(), want.size());
    let diff = (got - want).abs().max().double_value(&[]);
    diff / want.abs().max().double_value(&[])
}

/// The worst relative error over the merged and every deepstack feature (as many as the
/// fixture holds).
fn worst(f: &Fixture, got: &Qwen3VlFeatures) -> f64 {
    let want = (0..).take_while(|k| f.io.contains_key(&format!("deepstack.{k}")));
    assert_eq!(got.deepstack_mo.len(), want.count(), "deepstack features");
    let mut e = rel_err(&got.merged_mo, &f.io["merged"]);
    for (k, d) in got.deepstack_mo.iter().enumerate() {
        e = e.max(rel_err(d, &f.io[&format!("deepstack.{k}")]));
    }
    e
}

fn weights(f: &Fixture) -> VisionWeights {
    let tensors = (f.checkpoint.iter())
        .filter_map(|(n, t)| {
            Some((
                n.strip_prefix("model.visual.")?.to_string(),
                t.shallow_clone(),
            ))
        })
        .collect();
    VisionWeights::new(f.spec.clone(), tensors)
}

#[test]
fn tower_equals_transformers() {
    let f = load("qwen3_vl");
    assert_eq!(f.spec.deepstack_taps(), [(0, 1), (2, 0)]);
    let w = weights(&f);
    let got = qwen3_vl_vision(&w, &f.io["pixel_values"], &f.grids);
    let err = worst(&f, &got);
    assert!(err <= BOUND, "relative error {err:e} > {BOUND:e}");
    eprintln!("qwen3-vl tower vs transformers: relative error {err:e}");
    // The learned positions count: without them the output moves by O(1).
    let mut tensors: HashMap<String, Tensor> = f
        .checkpoint
        .iter()
        .filter_map(|(n, t)| Some((n.strip_prefix("model.visual.")?.to_string(), t.copy())))
        .collect();
    let _ = tensors.get_mut("pos_embed.weight").unwrap().zero_();
    let flat = VisionWeights::new(f.spec.clone(), tensors);
    let off = worst(&f, &qwen3_vl_vision(&flat, &f.io["pixel_values"], &f.grids));
    assert!(
        off > 100.0 * BOUND,
        "no position embeddings still match ({off:e})"
    );
}

/// Qwen3.5's tower is Qwen3-VL's with no deepstack merger: the merged features only.
#[test]
fn qwen3_5_tower_equals_transformers() {
    let f = load("qwen3_5");
    assert_eq!(f.spec.model_type, "qwen3_5");
    assert!(f.spec.deepstack_taps().is_empty());
    let got = qwen3_vl_vision(&weights(&f), &f.io["pixel_values"], &f.grids);
    let err = worst(&f, &got);
    eprintln!("qwen3.5 tower vs transformers: relative error {err:e}");
    assert!(err <= BOUND, "relative error {err:e} > {BOUND:e}");
}

#[test]
fn tower_through_the_shared_region_equals_transformers() {
    let f = load("qwen3_vl");
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
        .collect();
    let region = VisionRegion::build(
        "mt-test-vision3",
        &mt::config::vision::TowerSpec::Qwen(f.spec.clone()),
        mt::config::TowerTraining::Frozen,
        &Carried { tensors },
        DType::Float32,
        &f.dir.join("model"),
    )
    .unwrap();
    assert_eq!(region.layout.prefix, "model.visual.");
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
    let crate::model::TowerWeights::Qwen(w) =
        crate::stream::vision::load(&init, DType::Float32, Device::Cpu).unwrap()
    else {
        panic!("a Qwen tower");
    };
    drop(region);
    let err = worst(&f, &qwen3_vl_vision(&w, &f.io["pixel_values"], &f.grids));
    assert!(err <= BOUND, "relative error {err:e} > {BOUND:e}");
}

/// `F.interpolate(bilinear, align_corners=True)` of a 6-long table onto 4 and onto 1: the
/// source positions 0, 5/3, 10/3, 5 and 0.
#[test]
fn position_taps_align_the_corners() {
    let close = |(t, w): ([i64; 2], [f32; 2]), want_t: [i64; 2], want_w: [f32; 2]| {
        assert_eq!(t, want_t);
        assert!(
            (w[0] - want_w[0]).abs() < 1e-6 && (w[1] - want_w[1]).abs() < 1e-6,
            "{w:?}"
        );
    };
    close(axis_taps(0, 4, 6), [0, 1], [1.0, 0.0]);
    close(axis_taps(1, 4, 6), [1, 2], [1.0 / 3.0, 2.0 / 3.0]);
    close(axis_taps(2, 4, 6), [3, 4], [2.0 / 3.0, 1.0 / 3.0]);
    close(axis_taps(3, 4, 6), [5, 5], [1.0, 0.0]);
    close(axis_taps(0, 1, 6), [0, 1], [1.0, 0.0]);
}
