//! The tower against transformers' on scripts/make_vlm_model_fixtures.py's tiny
//! Qwen2.5-VL (`$MT_GOLDEN_DIR/vision/qwen2_5_vl`), in f32 on the CPU: from the
//! checkpoint's tensors directly, and through the launcher's shared region as a worker
//! receives it.
//!
//! The bound, 1e-4 of the output's largest magnitude: both sides run the same f32 ops but
//! for the summation order of three reductions (the patch embedding as a matmul over
//! P = 1176 values where transformers runs a Conv3d; attention over padded, masked
//! segments where transformers runs one SDPA per segment; the merger's 192-wide matmul
//! unchanged). A reordered f32 sum of K terms of similar size differs by about
//! sqrt(K) * 2^-24 of its magnitude, 2e-6 for K = 1176, and the three blocks and the merger
//! (weights of std 0.15, gains near 1) carry such differences through without growing them
//! by more than a small factor: 1e-4 leaves a margin of ~10x over what they can produce,
//! while any wrong index (a window, a position, the merge order) moves whole rows by O(1).
//! Measured: see the assertion messages (printed with --nocapture).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mt::checkpoint::carried::{Carried, CarriedTensor};
use mt::checkpoint::vision::VisionRegion;
use mt::config::DType;
use mt::config::vision::VisionSpec;
use mt::protocol::VisionInit;
use tch::{Device, Kind, Tensor};

use super::{Order, VisionWeights, qwen2_5_vl_vision};

const BOUND: f64 = 1e-4;

fn fixture() -> PathBuf {
    let dir = std::env::var_os("MT_GOLDEN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/golden"))
        .join("vision/qwen2_5_vl");
    assert!(
        dir.join("io.safetensors").is_file(),
        "no vision fixtures in {}: run `.venv/bin/python scripts/make_vlm_model_fixtures.py --out target/golden`",
        dir.display()
    );
    dir
}

/// The checkpoint's tensors (`model/model.safetensors`) and the inputs and output.
struct Fixture {
    dir: PathBuf,
    spec: VisionSpec,
    checkpoint: Vec<(String, Tensor)>,
    pixel_values: Tensor,
    grids: Vec<[u32; 3]>,
    merged: Tensor,
}

fn load() -> Fixture {
    let dir = fixture();
    let spec = VisionSpec::from_model_dir(&dir.join("model"))
        .unwrap()
        .expect("a qwen2_5_vl config");
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
        pixel_values: io["pixel_values"].shallow_clone(),
        grids,
        merged: io["merged"].shallow_clone(),
    }
}

/// max |got - want| / max |want|.
fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.size(), want.size());
    let diff = (got - want).abs().max().double_value(&[]);
    diff / want.abs().max().double_value(&[])
}

#[test]
fn tower_equals_transformers() {
    let f = load();
    let tensors = (f.checkpoint.iter())
        .filter_map(|(n, t)| Some((n.strip_prefix("visual.")?.to_string(), t.shallow_clone())))
        .collect();
    let w = VisionWeights::new(f.spec.clone(), tensors);
    let got = qwen2_5_vl_vision(&w, &f.pixel_values, &f.grids);
    let err = rel_err(&got, &f.merged);
    assert!(err <= BOUND, "relative error {err:e} > {BOUND:e}");
    eprintln!("qwen2.5-vl tower vs transformers: relative error {err:e}");
    // The bound is tight enough to see the window order: raster order instead moves the
    // output by O(1).
    let n = f.pixel_values.size()[0];
    let shuffled = f
        .pixel_values
        .index_select(0, &Tensor::arange(n, (Kind::Int64, Device::Cpu)).flip(0));
    let off = rel_err(&qwen2_5_vl_vision(&w, &shuffled, &f.grids), &f.merged);
    assert!(
        off > 100.0 * BOUND,
        "a permuted input still matches ({off:e})"
    );
}

#[test]
fn tower_through_the_shared_region_equals_transformers() {
    let f = load();
    // What the launcher carries: the checkpoint's tensors under their own names.
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
    let carried = Carried { tensors };
    let region = VisionRegion::build(
        "mt-test-vision",
        &mt::config::vision::TowerSpec::Qwen(f.spec.clone()),
        mt::config::TowerTraining::Frozen,
        &carried,
        DType::Float32,
        &f.dir.join("model"),
    )
    .unwrap();
    assert_eq!(region.layout.prefix, "visual.");
    // The worker inherits its own fd of the region.
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
    let got = qwen2_5_vl_vision(&w, &f.pixel_values, &f.grids);
    let err = rel_err(&got, &f.merged);
    assert!(err <= BOUND, "relative error {err:e} > {BOUND:e}");
}

/// transformers' `get_vision_window_index` on a 1 x 6 x 8 grid with 2 x 2-block windows
/// (merged grid 3 x 4: windows of 4, 4, 2, 2 blocks), worked by hand.
#[test]
fn window_order_of_a_grid() {
    let cfg = serde_json::json!({"model_type": "qwen2_5_vl", "vision_config": {
        "depth": 1, "hidden_size": 8, "num_heads": 2, "window_size": 56}});
    let spec = VisionSpec::from_json(&cfg, Path::new("c"))
        .unwrap()
        .unwrap();
    let o = Order::new(&spec, &[[1, 6, 8], [1, 2, 2]]);
    // Merged blocks of the first image, raster: row 0 = 0..4, row 1 = 4..8, row 2 = 8..12.
    let blocks: Vec<i64> = o.patches.iter().step_by(4).map(|p| p / 4).collect();
    assert_eq!(blocks, [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 10, 11, 12]);
    assert_eq!(o.window_lens, [16, 16, 8, 8, 4]);
    assert_eq!(o.frame_lens, [48, 4]);
    // Patch 4 * 2 + 1 (block 2's second patch) sits at row 0, column 5.
    let slot = o.patches.iter().position(|&p| p == 9).unwrap();
    assert_eq!(o.positions[slot], [0, 5]);
    assert_eq!(o.merged_back[2], 4);
}
