//! Start-up is bounded and interruptible (#45): hostile input is refused before anything is
//! allocated, naming the file and key, and SIGTERM during data preparation ends the run at
//! once with exit 143 and nothing left behind.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::fixture::{Fixture, Stage, fixture};
use common::*;

/// A fixture whose model is the tiny demo (random init, its tokenizer) with `template` as
/// chat_template.jinja, and whose dataset is `records` (alpaca JSONL).
fn chat_fixture(name: &str, template: &str, records: &str) -> Fixture {
    common::fixture::tiny_chat_fixture(name, "alpaca.jsonl", records, Some(template))
}

/// `n` alpaca records, one a line.
fn alpaca(n: usize) -> String {
    (0..n)
        .map(|i| {
            format!(
                "{{\"instruction\": \"Add {i} and 3.\", \"input\": \"\", \"output\": \"{}\"}}\n",
                i + 3
            )
        })
        .collect()
}

/// The tiny demo's template, after `prefix`.
fn tiny_template(prefix: &str) -> String {
    let cfg =
        json(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny/tokenizer_config.json"));
    format!("{prefix}{}", cfg["chat_template"].as_str().unwrap())
}

/// Runs `f` with `extra` and `env`; it must fail before anything starts, naming every
/// needle, within `limit`. Returns stderr.
fn fails_within(
    f: &Fixture,
    extra: &[&str],
    env: &[(&str, &str)],
    needles: &[&str],
    limit: Duration,
) -> String {
    let mut cmd = Command::new(launcher());
    cmd.args(f.args(extra)).envs(env.iter().copied());
    let t0 = Instant::now();
    let err = f.check_failure(cmd, Stage::Start, needles);
    let took = t0.elapsed();
    assert!(took < limit, "took {took:?}, more than {limit:?}:\n{err}");
    err
}

#[test]
fn a_looping_chat_template_is_refused_naming_template_and_record() {
    let f = chat_fixture(
        "looping-template",
        &tiny_template(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        ),
        &alpaca(1),
    );
    // Skipping is no way out: every record would hit the bound.
    // The bound is 5M instructions, ~0.5 s of one core here (src/data/chat/limits.rs);
    // 15 s leaves room for a slow machine and the process start.
    fails_within(
        &f,
        &[],
        &[],
        &[
            "chat_template.jinja",
            "alpaca.jsonl, line 1",
            "template instructions",
        ],
        Duration::from_secs(15),
    );
}

#[test]
fn a_chat_template_writing_gigabytes_is_refused() {
    let f = chat_fixture(
        "huge-template",
        &tiny_template("{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}"),
        &alpaca(1),
    );
    fails_within(
        &f,
        &[],
        &[],
        &["chat_template.jinja", "alpaca.jsonl, line 1", "64 MiB"],
        Duration::from_secs(15),
    );
}

/// Linux's view of which signals `pid` catches (`SigCgt`).
fn catches_sigterm(pid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .is_some_and(|m| m & (1 << (15 - 1)) != 0)
}

#[test]
fn sigterm_during_data_preparation_ends_the_run_at_once() {
    // 3,000 records whose template first counts to 100,000 (three renders each): about a
    // minute of data preparation on 2 cores, far longer than the wait below on any machine.
    let f = chat_fixture(
        "sigterm-data",
        &tiny_template("{% for i in range(100000) %}{% endfor %}"),
        &alpaca(3000),
    );
    let shm_before = shm_entries();
    let mut child = Command::new(launcher())
        .args(f.args(&[]))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    // The handlers are installed before the config is read; then give it a second into
    // the data (config loading takes milliseconds).
    assert!(
        wait_for(Duration::from_secs(30), || catches_sigterm(pid)).is_some(),
        "mt-launch never installed its SIGTERM handler"
    );
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        child.try_wait().unwrap().is_none(),
        "finished before the signal"
    );
    signal("TERM", pid);
    let t0 = Instant::now();
    let exited = wait_for(Duration::from_secs(30), || {
        child.try_wait().unwrap().is_some()
    });
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // Each record checks the stop flag and takes milliseconds: within a second here;
    // 3 s leaves room for a loaded machine.
    let took = exited.expect("still running 30 s after SIGTERM");
    assert!(
        took < Duration::from_secs(3),
        "exited {took:?} after SIGTERM:\n{err}"
    );
    assert_eq!(out.status.code(), Some(143), "exit 128 + SIGTERM:\n{err}");
    assert!(
        err.contains("stopped by SIGTERM during data preparation"),
        "stderr:\n{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    eprintln!("exited {:.3} s after SIGTERM", t0.elapsed().as_secs_f64());
    assert_clean(pid, &[], &shm_before);
    assert!(!f.out.exists() && !f.metrics.exists(), "nothing written");
    assert!(partial_checkpoints(&f.ck).is_empty());
}

#[test]
fn special_and_huge_dataset_files_are_refused_at_once() {
    let f = fixture("dev-zero");
    let yaml = f.yaml().replace(&f.data.display().to_string(), "/dev/zero");
    f.write_config(&yaml);
    // Refused by metadata: no read. 10 s is process start and config loading.
    fails_within(
        &f,
        &[],
        &[],
        &["dataset file /dev/zero", "a character device"],
        Duration::from_secs(10),
    );

    let f = fixture("sparse-100g");
    let big = f.dir.join("big.jsonl");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(100 << 30)
        .unwrap();
    let yaml = f
        .yaml()
        .replace(&f.data.display().to_string(), &big.display().to_string());
    f.write_config(&yaml);
    // The bound is half the RAM available: the test hook says 16 GB, so it holds on any
    // machine (a real 256 GB host would read it).
    let err = fails_within(
        &f,
        &[],
        &[("MT_TEST_HOST_MEMORY", "16000000000")],
        &["big.jsonl", "107374182400 bytes", "larger than the 7.5 GiB"],
        Duration::from_secs(10),
    );
    assert!(err.contains("half the RAM available"), "{err}");
}

/// Edits config.json of a fresh fixture with `key: value`; the run and `mt-launch plan`
/// must both refuse it at once, naming config.json and `needle`.
fn refuses_config_value(name: &str, values: &[(&str, serde_json::Value)], needles: &[&str]) {
    let f = fixture(name);
    f.edit_config_json(|c| {
        for (key, value) in values {
            c.insert(key.to_string(), value.clone());
        }
    });
    let config_json = f.model.join("config.json").display().to_string();
    let mut all = vec![config_json.as_str()];
    all.extend(needles);
    // Before any allocation: a second's work, 10 s with the process start.
    fails_within(&f, &[], &[], &all, Duration::from_secs(10));
    let out = run(&["plan", "--config", path_str(&f.config), "--gpus", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "plan must refuse it");
    for n in &all {
        assert!(err.contains(n), "plan's stderr lacks {n:?}:\n{err}");
    }
}

#[test]
fn overflowing_config_json_values_are_refused_naming_the_key() {
    refuses_config_value(
        "vocab-2-62",
        &[("vocab_size", serde_json::json!(1u64 << 62))],
        &["`vocab_size` 4611686018427387904 is too large: at most 2147483648"],
    );
    refuses_config_value(
        "layers-1e9",
        &[("num_hidden_layers", serde_json::json!(1_000_000_000u64))],
        &["`num_hidden_layers` 1000000000 is too large: at most 65536"],
    );
    refuses_config_value(
        "hidden-2-40",
        &[("hidden_size", serde_json::json!(1u64 << 40))],
        &["`hidden_size` 1099511627776 is too large"],
    );
    // Each within its bound, their product past 2^44 parameters.
    refuses_config_value(
        "params-2-44",
        &[
            ("vocab_size", serde_json::json!(1u64 << 31)),
            ("hidden_size", serde_json::json!(1u64 << 31)),
        ],
        &["more than 17592186044416 parameters"],
    );
    // Past what a usize holds: the key is named by the parser.
    refuses_config_value(
        "vocab-2-70",
        &[("vocab_size", serde_json::json!(1e21))],
        &["`vocab_size`"],
    );
}

#[test]
fn a_cpu_micro_batch_too_large_for_host_ram_is_refused_with_the_plan() {
    let f = fixture("cpu-micro-batch");
    // 1 worker, 4096 rows of 8192 tokens: the device plan's activations are hundreds of GB;
    // the test hook says 16 GB of host RAM, far more than the host plan of this 3-layer
    // model, far less than the micro-batch.
    let big = [
        "--set",
        "training.batch_size=4096",
        "--set",
        "dataset.max_seq_len=8192",
        "--workers",
        "1",
    ];
    let env = [("MT_TEST_HOST_MEMORY", "16000000000")];
    let err = fails_within(
        &f,
        &big,
        &env,
        &[
            "the micro-batch of 4096 x 8192 tokens does not fit cpu",
            "host RAM left beside the host plan",
            "The largest that fits is",
            "--force",
        ],
        Duration::from_secs(20),
    );
    assert!(
        err.contains("per worker (`mt-launch plan`)"),
        "the plan's numbers:\n{err}"
    );
}
