//! A worker's libtorch failure reaches the user as one line (phase, layer, figures, what to
//! change) and the run ends clean; a micro-batch the device plan cannot fit is refused
//! before anything is loaded. CPU stand-ins for the GPU cases, both documented test hooks:
//! `MT_TEST_FAIL_ALLOC=<phase>[:<layer>]` makes each worker ask libtorch for an impossible
//! allocation (1 PiB) there, so libtorch's real error travels the real path, and
//! `MT_TEST_DEVICE_MEMORY=<bytes>` stands for the memory the CUDA driver reports.
//! scripts/check_gpu.sh (part `errors`) runs the real thing on a GPU.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::*;

/// What a finished run left: exit status, stdout, stderr.
struct Ended {
    ok: bool,
    out: String,
    err: String,
}

/// Runs the llama fixture on 2 CPU workers for 2 steps with `env` and `extra` flags, and
/// checks that it left no worker and no shared memory behind, however it ended.
fn run_llama(name: &str, env: &[(&str, &str)], extra: &[&str]) -> Ended {
    let before = shm_entries();
    let dir = scratch(name);
    let config = golden_dir().join("llama/run.yaml");
    let mut child = mt_launch()
        .args([
            "--config",
            path_str(&config),
            "--gpus",
            "0",
            "--workers",
            "2",
        ])
        .args(["--set", "training.num_steps=2"])
        .args(extra)
        // Quiet unless a case asks otherwise (cargo test may run with RUST_BACKTRACE set).
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .stdout(std::fs::File::create(dir.join("stdout.log")).unwrap())
        .stderr(std::fs::File::create(dir.join("stderr.log")).unwrap())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    // Every worker this launcher starts, seen while they live.
    let mut workers: Vec<u32> = Vec::new();
    wait_for(Duration::from_secs(60), || {
        for w in children(pid) {
            if !workers.contains(&w) {
                workers.push(w);
            }
        }
        matches!(child.try_wait(), Ok(Some(_)))
    })
    .expect("mt-launch still running after 60 s");
    let ok = child.wait().unwrap().success();
    assert_clean(pid, &workers, &before);
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    Ended {
        ok,
        out: read("stdout.log"),
        err: read("stderr.log"),
    }
}

/// The stderr lines that contain `needle`.
fn lines_with<'a>(err: &'a str, needle: &str) -> Vec<&'a str> {
    err.lines().filter(|l| l.contains(needle)).collect()
}

/// What libtorch and Rust print when nobody tidies up.
const NOISE: [&str; 6] = [
    "panicked",
    "frame #",
    "Exception raised from",
    "enforce fail",
    "RUST_BACKTRACE",
    "can't allocate memory",
];

#[test]
fn an_allocation_failure_is_one_line_and_leaves_nothing_behind() {
    // (hook, where the line says it failed, the advice it must give)
    let cases = [
        (
            "backward:1",
            "in the backward of layer 1, micro-batch 2 x",
            "training.batch_size",
        ),
        (
            "forward:0",
            "in the forward of layer 0",
            "training.batch_size",
        ),
        ("head", "in the head", "memory.ce_chunk_tokens (now 4096)"),
    ];
    for (hook, place, advice) in cases {
        let name = format!("fail-alloc-{}", hook.replace(':', "-"));
        let run = run_llama(&name, &[("MT_TEST_FAIL_ALLOC", hook)], &[]);
        assert!(!run.ok, "{hook}: the run must fail:\n{}", run.err);
        // 2^48 f32 elements, as libtorch's CPU allocator states the request.
        let lines = lines_with(&run.err, "out of memory on cpu");
        assert_eq!(lines.len(), 1, "{hook}: one error line, once:\n{}", run.err);
        let line = lines[0];
        for needle in [
            "mt-launch: error: worker rank ",
            place,
            "asked for 1125899.91 GB with ",
            "the plan puts this micro-batch at ",
            "To fit: ",
            advice,
        ] {
            assert!(
                line.contains(needle),
                "{hook}: `{needle}` missing from:\n{line}"
            );
        }
        for noise in NOISE {
            assert!(
                !run.err.contains(noise),
                "{hook}: `{noise}` in stderr:\n{}",
                run.err
            );
        }
    }
}

#[test]
fn debug_logging_shows_libtorch_in_full() {
    let run = run_llama(
        "fail-alloc-debug",
        &[("MT_TEST_FAIL_ALLOC", "backward:2")],
        &["--log-level", "debug"],
    );
    assert!(!run.ok);
    assert!(
        run.err.contains("libtorch's full message")
            && run.err.contains("can't allocate memory")
            && run.err.contains("panicked"),
        "debug output must hold libtorch's text and the panic:\n{}",
        run.err
    );
    assert_eq!(
        lines_with(&run.err, "mt-launch: error: worker rank ").len(),
        1,
        "{}",
        run.err
    );
}

/// The device plan's total for the llama fixture on 2 CPU workers, with `extra` flags.
fn plan_total(extra: &[&str]) -> u64 {
    let config = golden_dir().join("llama/run.yaml");
    let mut args = vec!["plan", "--config", path_str(&config)];
    args.extend(["--gpus", "0", "--workers", "2", "--json"]);
    args.extend(extra);
    let out = run_ok(&args);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["device"]["total"].as_u64().unwrap()
}

#[test]
fn a_micro_batch_that_cannot_fit_is_refused_before_anything_is_loaded() {
    let total = plan_total(&[]);
    let short = (total - 1).to_string();
    let run = run_llama("fit-refused", &[("MT_TEST_DEVICE_MEMORY", &short)], &[]);
    assert!(!run.ok, "a plan 1 byte over the memory must be refused");
    let line = lines_with(&run.err, "does not fit cpu");
    assert_eq!(line.len(), 1, "{}", run.err);
    for needle in [
        "the micro-batch of 2 x ",
        &format!("the plan needs {} per worker", mt::plan::human_bytes(total)),
        "MT_TEST_DEVICE_MEMORY (a test hook) gives",
        "The largest that fits is 1 x ",
        "Pass --force to launch anyway.",
    ] {
        assert!(
            line[0].contains(needle),
            "`{needle}` missing from:\n{}",
            line[0]
        );
    }
    // Refused before the data summary, the host state and the workers.
    assert_eq!(run.out, "", "nothing may run before the refusal");

    // Exactly enough memory runs, and so does too little with --force.
    let exact = total.to_string();
    let run = run_llama("fit-exact", &[("MT_TEST_DEVICE_MEMORY", &exact)], &[]);
    assert!(run.ok, "{}", run.err);
    let run = run_llama(
        "fit-forced",
        &[("MT_TEST_DEVICE_MEMORY", &short)],
        &["--force"],
    );
    assert!(run.ok, "{}", run.err);
    assert!(run.err.contains("--force: the micro-batch"), "{}", run.err);
}

#[test]
fn one_row_that_cannot_fit_gets_the_longest_sequence_that_does() {
    // batch 2 on 2 workers: one row each.
    let one_row = ["--set", "training.batch_size=2"];
    let total = plan_total(&one_row);
    let short = (total - 1).to_string();
    let run = run_llama(
        "fit-one-row",
        &[("MT_TEST_DEVICE_MEMORY", &short)],
        &one_row,
    );
    assert!(!run.ok);
    assert!(
        run.err.contains("With 1 row, sequences of up to ")
            && run.err.contains("tokens fit (dataset.max_seq_len)"),
        "{}",
        run.err
    );
}
