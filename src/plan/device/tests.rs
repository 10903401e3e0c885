//! Unit tests of the device plan.

use super::*;
use crate::config::hf::HfConfig;

fn model(dir: &str) -> (ModelSpec, Layout) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("configs")
        .join(dir)
        .join("config.json");
    let hf: HfConfig = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let spec = ModelSpec::from_hf(&hf, &path).unwrap();
    let layout = Layout::new(&spec);
    (spec, layout)
}

const OPTS: DeviceOpts = DeviceOpts {
    dtype: DType::Bfloat16,
    ce_chunk_tokens: 8192,
    tile_tokens: TileTokens::Off,
    packed: false,
    offload_activations: false,
    cpu: false,
};

fn part(p: &Phase, name: &str) -> u64 {
    p.parts.iter().find(|x| x.0 == name).unwrap().1
}

#[test]
fn phases_follow_the_layout() {
    let (spec, layout) = model("qwen2.5-7b");
    let p = DevicePlan::new(&spec, &layout, OPTS, 64, 1024);
    let layer = layout.max_layer_len() as u64 * 2;
    assert_eq!(p.fixed[0].1, 2 * layer);
    let hidden = 64 * 1024 * 3584 * 2;
    assert_eq!(
        part(&p.phases[2], "layer inputs kept for the backward"),
        28 * hidden
    );
    assert_eq!(
        part(&p.phases[0], "layer inputs kept for the backward"),
        29 * hidden
    );
    let embed = layout.blocks[Layout::EMBED].len as u64 * 2;
    assert_eq!(
        part(&p.phases[3], "embedding block and its gradient"),
        2 * embed
    );
    // At a large batch the layer backward dominates; at batch 1 the head and its loss
    // chunk do (Qwen2.5's 152k vocabulary).
    assert_eq!(p.peak_phase().name, "layer backward");
    let p1 = DevicePlan::new(&spec, &layout, OPTS, 1, 1024);
    assert_eq!(p1.peak_phase().name, "head + loss");
    assert!(p.to_string().contains("peak phase: layer backward"));
}

#[test]
fn activations_grow_with_the_batch_and_offload_removes_the_inputs() {
    let (spec, layout) = model("qwen2.5-7b");
    let p8 = DevicePlan::new(&spec, &layout, OPTS, 8, 1024);
    let p16 = DevicePlan::new(&spec, &layout, OPTS, 16, 1024);
    let graph = |p: &DevicePlan| part(&p.phases[2], "one layer's recompute graph + gradients");
    assert_eq!(graph(&p16), 2 * graph(&p8));
    let off = DeviceOpts {
        offload_activations: true,
        ..OPTS
    };
    let q = DevicePlan::new(&spec, &layout, off, 16, 1024);
    let saved = part(&p16.phases[2], "layer inputs kept for the backward")
        - part(&q.phases[2], "layer inputs kept for the backward");
    assert_eq!(saved, (28 - 3) * 16 * 1024 * 3584 * 2);
    assert!(q.total() < p16.total());
}

#[test]
fn tied_embeddings_stay_for_the_micro_batch() {
    let (spec, layout) = model("qwen2.5-7b");
    let mut tied = spec.clone();
    tied.tie_word_embeddings = true;
    let tied_layout = Layout::new(&tied);
    let p = DevicePlan::new(&tied, &tied_layout, OPTS, 4, 1024);
    let embed = tied_layout.blocks[Layout::EMBED].len as u64 * 2;
    assert_eq!(part(&p.phases[0], "tied embedding"), embed);
    assert_eq!(
        part(&p.phases[2], "tied embedding and its gradient"),
        2 * embed
    );
    let untied = DevicePlan::new(&spec, &layout, OPTS, 4, 1024);
    assert!(untied.phases[2].parts.iter().all(|x| !x.0.contains("tied")));
}

#[test]
fn moe_layers_count_routed_slots() {
    let (spec, layout) = model("qwen3-30b-a3b");
    let moe = spec.moe.as_ref().unwrap();
    let p = DevicePlan::new(&spec, &layout, OPTS, 4, 1024);
    // The experts' MLP runs over top_k slots per token, so it outweighs a dense MLP
    // of one expert's width over the tokens.
    let graph = part(&p.phases[2], "one layer's recompute graph + gradients");
    let m = 4 * 1024u64;
    assert!(graph > 4 * m * moe.top_k as u64 * moe.expert_intermediate_size as u64 * 2);
}

#[test]
fn largest_batch_is_the_edge_of_the_budget() {
    let (spec, layout) = model("qwen2.5-7b");
    let budget = 80_000_000_000;
    let b = DevicePlan::largest_batch(&spec, &layout, OPTS, 1024, budget);
    assert!(b > 0);
    assert!(DevicePlan::new(&spec, &layout, OPTS, b, 1024).total() <= budget);
    assert!(DevicePlan::new(&spec, &layout, OPTS, b + 1, 1024).total() > budget);
    assert_eq!(DevicePlan::largest_batch(&spec, &layout, OPTS, 1024, 1), 0);
}
