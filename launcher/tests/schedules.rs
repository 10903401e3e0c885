//! The learning-rate schedules against transformers' own (`get_scheduler`, as HF Trainer
//! builds it), through the HF Trainer keys a user writes (`lr_scheduler_type`,
//! `lr_scheduler_kwargs`, `warmup_steps`, `max_steps`): the rate of the update after each
//! number of completed steps, past the end too (scripts/make_golden.py writes them).

mod common;

use common::*;

#[test]
fn schedules_match_transformers() {
    let fixture = golden_dir().join("schedules/schedules.json");
    let text = std::fs::read_to_string(&fixture).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (scripts/make_golden.py writes it)",
            fixture.display()
        )
    });
    let golden: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = golden["cases"].as_array().unwrap();
    assert!(cases.len() >= 9, "{} cases", cases.len());
    let dir = scratch("schedules");
    for (i, case) in cases.iter().enumerate() {
        let keys = &case["config"];
        // The flat keys of a LlamaFactory or HF Trainer YAML (JSON is YAML).
        let mut yaml = format!(
            "model: {{path: m}}\ndataset: {{format: tokenized, path: d.jsonl}}\n{}\n",
            keys.as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| format!("{k}: {v}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        yaml.push('\n');
        let path = dir.join(format!("{i}.yaml"));
        std::fs::write(&path, &yaml).unwrap();
        let cfg = mt::config::RunConfig::load(&path, &[])
            .unwrap_or_else(|e| panic!("case {i} ({yaml}): {e}"));
        let peak = keys["learning_rate"].as_f64().unwrap();
        for (done, want) in case["lrs"].as_array().unwrap().iter().enumerate() {
            let want = want.as_f64().unwrap();
            let got = mt::optim::lr_at(&cfg.training, done as u64);
            // The same f64 operations in the same order; cos and sqrt of two libms may
            // differ in the last bit, which the multiply by the peak keeps within a few ulp
            // of it.
            assert!(
                (got - want).abs() <= 4.0 * f64::EPSILON * peak,
                "case {i} {keys}: after {done} steps lr {got:e}, transformers {want:e}"
            );
        }
    }
}

/// What a schedule needs and what it does not read are errors naming the key.
#[test]
fn scheduler_kwargs_are_checked() {
    let dir = scratch("schedule-errors");
    let load = |extra: &str| {
        let path = dir.join("c.yaml");
        std::fs::write(
            &path,
            format!("model: {{path: m}}\ndataset: {{format: tokenized, path: d.jsonl}}\n{extra}\n"),
        )
        .unwrap();
        mt::config::RunConfig::load(&path, &[])
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let e = load("lr_scheduler_type: cosine_with_min_lr");
    assert!(
        e.contains("lr_scheduler_kwargs.min_lr_rate") && e.contains("min_lr"),
        "{e}"
    );
    let e = load("lr_scheduler_type: warmup_stable_decay");
    assert!(e.contains("lr_scheduler_kwargs.num_decay_steps"), "{e}");
    let e = load("lr_scheduler_type: linear\nlr_scheduler_kwargs: {min_lr_rate: 0.1}");
    assert!(
        e.contains("lr_scheduler_kwargs.min_lr_rate") && e.contains("linear"),
        "{e}"
    );
    let e = load("training: {lr_scheduler: cosine, lr_scheduler_kwargs: {decay_type: cubic}}");
    assert!(e.contains("decay_type") || e.contains("cubic"), "{e}");
}
