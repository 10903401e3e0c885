//! `MT_TORCH_PROFILE`: each worker writes torch's profile of the chosen step, with the
//! engine's phases as named ranges (worker/src/profile.rs), and nothing for the others.

mod common;

use common::*;

fn layers(case: &std::path::Path) -> u64 {
    let config = json(&case.join("model/config.json"));
    config["num_hidden_layers"]
        .as_u64()
        .expect("num_hidden_layers")
}

#[test]
fn the_chosen_step_is_profiled_with_the_engines_phases() {
    let case = golden_dir().join("llama");
    let dir = scratch("torch-profile");
    let traces = dir.join("traces");
    let env = [
        ("MT_TORCH_PROFILE", path_str(&traces)),
        ("MT_TORCH_PROFILE_STEP", "2"),
    ];
    let args = ["--set", "training.num_steps=3"];
    run_cpu_env_ok(&case.join("run.yaml"), 2, &dir.join("m.jsonl"), &args, &env);

    let mut files: Vec<String> = std::fs::read_dir(&traces)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["worker0_step2.json", "worker1_step2.json"]);

    let trace = json(&traces.join("worker0_step2.json"));
    let events = trace["traceEvents"].as_array().expect("a Chrome trace");
    let named = |cat: &str| -> Vec<(String, f64)> {
        events
            .iter()
            .filter(|e| e["cat"] == cat)
            .map(|e| {
                (
                    e["name"].as_str().unwrap().to_string(),
                    e["ts"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    let ranges = named("user_annotation");
    let at = |name: &str| {
        ranges
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no range `{name}` in {ranges:?}"))
            .1
    };
    let last = layers(&case) - 1;
    // Every layer forward, the head, every layer backward, in the engine's order.
    let order = [
        "forward 0".to_string(),
        format!("forward {last}"),
        "head".to_string(),
        format!("backward {last}"),
        "backward 0".to_string(),
    ];
    let times: Vec<f64> = order.iter().map(|n| at(n)).collect();
    assert!(
        times.windows(2).all(|w| w[0] < w[1]),
        "{order:?} at {times:?}: out of order"
    );
    assert!(
        named("cpu_op")
            .iter()
            .any(|(n, _)| n == "aten::mm" || n == "aten::addmm"),
        "the trace holds the step's aten ops"
    );
}

#[test]
fn a_bad_profile_step_is_refused_naming_the_variable() {
    let case = golden_dir().join("llama");
    let dir = scratch("torch-profile-bad");
    let env = [
        ("MT_TORCH_PROFILE", path_str(&dir)),
        ("MT_TORCH_PROFILE_STEP", "0"),
    ];
    let (out, _) = run_cpu_env(&case.join("run.yaml"), 1, &dir.join("m.jsonl"), &[], &env);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "step 0 does not exist");
    assert!(
        err.contains("MT_TORCH_PROFILE_STEP=\"0\": expected a step number from 1"),
        "{err}"
    );
}

/// scripts/trace_summary.py puts a kernel in the innermost range open on the engine's
/// thread at its launch, also when the launch comes from another thread (autograd's device
/// thread in the backward) and a range nested in that one (a layer's `h2d` inside its
/// `backward`) has already ended.
#[test]
fn the_trace_summary_finds_the_range_around_a_nested_one() {
    let dir = scratch("trace-summary");
    let trace = dir.join("trace.json");
    let event = |cat: &str, name: &str, tid: u64, ts: u64, dur: u64, corr: Option<u64>| {
        let mut e = serde_json::json!({"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur});
        if let Some(c) = corr {
            e["args"] = serde_json::json!({"correlation": c, "stream": 7});
        }
        e
    };
    let events = [
        event("user_annotation", "backward 1", 1, 0, 100, None),
        event("user_annotation", "h2d", 1, 10, 5, None),
        event("cuda_runtime", "cudaLaunchKernel", 2, 50, 1, Some(7)),
        event("kernel", "k", 9, 60, 10, Some(7)),
        event("cuda_runtime", "cudaLaunchKernel", 2, 120, 1, Some(8)),
        event("kernel", "k", 9, 130, 10, Some(8)),
    ];
    std::fs::write(
        &trace,
        serde_json::json!({ "traceEvents": events }).to_string(),
    )
    .unwrap();
    let out = venv_script("trace_summary.py", &trace);
    let text = String::from_utf8_lossy(&out);
    let layer = text
        .split("GPU time by phase and layer")
        .nth(1)
        .expect("the table by layer");
    assert!(layer.contains("50.0%  backward 1"), "{text}");
    assert!(layer.contains("50.0%  (no phase range)"), "{text}");
}
