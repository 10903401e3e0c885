//! `mt-launch serve` (docs/serve.md) driven over its socket as a client does: a server fed
//! the batches a run's steps take trains bit for bit as that run (SFT, DPO with its
//! references from `forward`, GRPO from rewards and groups), across `sleep` / `wake`; its
//! `save` resumes as a run's checkpoint; `weights` hands over the store read-only, equal
//! to the export; bad requests are refused naming what was wrong while the server goes on;
//! the socket is owner-only and gone after `shutdown`, and a stop signal leaves nothing.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// A server spawned on a golden case's config with CPU workers, and a connection to it.
struct Server {
    child: Child,
    socket: PathBuf,
    conn: UnixStream,
    /// Every line the server printed, collected by a thread.
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Server {
    fn start(config: &Path, workers: usize, dir: &Path, extra: &[&str]) -> Server {
        let socket = dir.join("mt.sock");
        let mut child = mt_launch()
            .args(["serve", "--config", path_str(config), "--gpus", "0"])
            .args([
                "--workers",
                &workers.to_string(),
                "--socket",
                path_str(&socket),
            ])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn mt-launch serve");
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        for out in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    lines.lock().unwrap().push(line);
                }
            });
        }
        let serving = wait_for(Duration::from_secs(120), || {
            let said = lines
                .lock()
                .unwrap()
                .iter()
                .any(|l| l.starts_with("serving on"));
            said || child.try_wait().unwrap().is_some()
        });
        let said = lines.lock().unwrap().clone();
        assert!(
            serving.is_some() && child.try_wait().unwrap().is_none(),
            "the server did not start:\n{}",
            said.join("\n")
        );
        let conn = UnixStream::connect(&socket).expect("connect to the server");
        Server {
            child,
            socket,
            conn,
            lines,
        }
    }

    /// Sends one request; its answer.
    fn call(&mut self, req: Value) -> Value {
        let body = serde_json::to_vec(&req).unwrap();
        self.conn
            .write_all(&(body.len() as u64).to_le_bytes())
            .unwrap();
        self.conn.write_all(&body).unwrap();
        let mut len = [0u8; 8];
        self.conn
            .read_exact(&mut len)
            .unwrap_or_else(|e| panic!("no answer to {req}: {e}\n{}", self.output()));
        let mut body = vec![0u8; u64::from_le_bytes(len) as usize];
        self.conn.read_exact(&mut body).unwrap();
        serde_json::from_slice(&body).unwrap()
    }

    /// [`Server::call`] that must succeed.
    fn ok(&mut self, req: Value) -> Value {
        let answer = self.call(req.clone());
        assert_eq!(
            answer["ok"],
            true,
            "{req} failed: {answer}\n{}",
            self.output()
        );
        answer
    }

    /// [`Server::call`] that must be refused with an error holding `needle`; the server
    /// goes on.
    fn refused(&mut self, req: Value, needle: &str) {
        let answer = self.call(req.clone());
        assert_eq!(answer["ok"], false, "{req} was not refused: {answer}");
        let error = answer["error"].as_str().unwrap();
        assert!(error.contains(needle), "{req}: `{error}` lacks `{needle}`");
        assert!(answer.get("fatal").is_none(), "{req}: {answer}");
    }

    fn output(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// `shutdown`, then the server's exit status.
    fn shutdown(mut self) -> std::process::ExitStatus {
        self.ok(json!({"cmd": "shutdown"}));
        let done = wait_for(Duration::from_secs(60), || {
            self.child.try_wait().unwrap().is_some()
        });
        assert!(done.is_some(), "the server did not exit after shutdown");
        self.child.wait().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn bits(v: &Value) -> u64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("{v} is not a number"))
        .to_bits()
}

/// The run of `case` (its config, `extra` settings, 2 CPU workers): its metrics and the
/// exported model's tensors.
fn run(case: &Path, dir: &Path, extra: &[&str]) -> (Vec<Value>, Tensors) {
    run_on(case, dir, 2, extra)
}

/// [`run`] on `workers` workers.
fn run_on(case: &Path, dir: &Path, workers: usize, extra: &[&str]) -> (Vec<Value>, Tensors) {
    let (m, out) = (dir.join("run-metrics.jsonl"), dir.join("run-model"));
    let set = format!("training.output_dir={}", out.display());
    let mut args = vec!["--set", &set];
    args.extend(extra);
    run_cpu_ok(&case.join("run.yaml"), workers, &m, &args);
    (metrics(&m), tensors(&out.join("model.safetensors")))
}

type Tensors = std::collections::HashMap<String, Vec<f32>>;

/// Each step's loss and gradient norm from the server equal the run's, bit for bit.
fn check_step(step: usize, trained: &Value, applied: &Value, run: &[Value]) {
    let want = &run[step];
    assert_eq!(
        (bits(&trained["loss"]), bits(&applied["grad_norm"])),
        (bits(&want["loss"]), bits(&want["grad_norm"])),
        "step {}: served loss {} norm {} vs the run's {} {}",
        step + 1,
        trained["loss"],
        applied["grad_norm"],
        want["loss"],
        want["grad_norm"]
    );
    assert_eq!(applied["step"], step as u64 + 1);
    assert_eq!(bits(&applied["lr"]), bits(&want["lr"]), "step {}", step + 1);
}

/// The server's export equals the run's, bit for bit.
fn check_export(server: &mut Server, dir: &Path, run: &Tensors) {
    let out = dir.join("served-model");
    server.ok(json!({"cmd": "export", "dir": out}));
    let served = tensors(&out.join("model.safetensors"));
    assert_same_bits(&served, run, "served export vs the run's: ");
}

/// SFT: the golden llama case's three steps (4 rows each, in file order), with the
/// workers put to sleep and woken between the first and the second; the server's metrics
/// file (`--metrics-out`) holds the run's losses, norms, learning rates and token counts.
#[test]
fn sft_steps_equal_a_runs_bit_for_bit_across_sleep_and_wake() {
    let case = golden_dir().join("llama");
    let dir = scratch("serve-sft");
    let (run_metrics, run_model) = run(&case, &dir, &[]);
    let rows = lines(&case.join("data.jsonl"));
    let served_metrics = dir.join("served.jsonl");
    let args = ["--metrics-out", path_str(&served_metrics)];
    let mut server = Server::start(&case.join("run.yaml"), 2, &dir, &args);
    let info = server.ok(json!({"cmd": "info"}));
    assert_eq!(
        (info["protocol"].clone(), info["step"].clone()),
        (json!(1), json!(0))
    );
    for step in 0..3 {
        let batch = &rows[4 * step..4 * step + 4];
        let trained = server.ok(json!({"cmd": "train_step", "rows": batch}));
        let applied = server.ok(json!({"cmd": "optimizer_step"}));
        check_step(step, &trained, &applied, &run_metrics);
        if step == 0 {
            let pid = server.child.id();
            assert_eq!(children(pid).len(), 2, "two workers while awake");
            server.ok(json!({"cmd": "sleep"}));
            assert!(children(pid).is_empty(), "asleep, the workers are gone");
            server.refused(json!({"cmd": "train_step", "rows": batch}), "asleep");
            server.ok(json!({"cmd": "wake"}));
            assert_eq!(children(pid).len(), 2, "woken, two workers again");
        }
    }
    let info = server.ok(json!({"cmd": "info"}));
    assert_eq!(
        (info["step"].clone(), info["version"].clone()),
        (json!(3), json!(3))
    );
    check_export(&mut server, &dir, &run_model);
    let socket = server.socket.clone();
    assert!(server.shutdown().success());
    assert!(!socket.exists(), "the socket is removed at shutdown");
    let served = metrics(&served_metrics);
    assert_eq!(served.len(), 3, "one line per optimizer step");
    for (s, r) in served.iter().zip(&run_metrics) {
        for key in ["step", "loss", "grad_norm", "lr", "tokens"] {
            assert_eq!(bits(&s[key]), bits(&r[key]), "{key}: served {s} vs run {r}");
        }
    }
    assert!(
        served_metrics.with_extension("svg").is_file(),
        "the picture of the steps"
    );
}

/// DPO: the references of every pair from `forward` with `sum` under the initial weights
/// (before any update), then the golden case's three steps of 4 pairs.
#[test]
fn dpo_steps_with_forward_references_equal_a_runs_bit_for_bit() {
    let case = golden_dir().join("dpo").join("llama_sigmoid");
    let dir = scratch("serve-dpo");
    let (run_metrics, run_model) = run(&case, &dir, &[]);
    let pairs = lines(&case.join("pairs.jsonl"));
    let mut server = Server::start(&case.join("run.yaml"), 2, &dir, &[]);
    let rows: Vec<Value> = (pairs.iter())
        .flat_map(|p| {
            ["chosen", "rejected"].map(|s| {
                json!({"input_ids": p[format!("{s}_input_ids")], "labels": p[format!("{s}_labels")]})
            })
        })
        .collect();
    let refs = server.ok(json!({"cmd": "forward", "rows": rows, "sum": true}));
    let refs = f64_array(&refs["logprobs"]);
    assert_eq!(refs.len(), 2 * pairs.len());
    let pairs: Vec<Value> = (pairs.iter().enumerate())
        .map(|(i, p)| {
            let mut p = p.clone();
            p["ref_chosen_logps"] = json!(refs[2 * i]);
            p["ref_rejected_logps"] = json!(refs[2 * i + 1]);
            p
        })
        .collect();
    for step in 0..3 {
        let batch = &pairs[4 * step..4 * step + 4];
        let trained = server.ok(json!({"cmd": "train_step", "pairs": batch}));
        let applied = server.ok(json!({"cmd": "optimizer_step"}));
        check_step(step, &trained, &applied, &run_metrics);
        let accuracy = &trained["metrics"]["rewards/accuracies"];
        assert_eq!(
            bits(accuracy),
            bits(&run_metrics[step]["rewards/accuracies"])
        );
    }
    check_export(&mut server, &dir, &run_model);
    assert!(server.shutdown().success());
}

/// GRPO: rollouts with rewards and groups (each group within one batch of 6), their
/// group-relative advantages computed by the server as a run computes them; one
/// iteration per batch.
#[test]
fn grpo_steps_from_rewards_and_groups_equal_a_runs_bit_for_bit() {
    let case = golden_dir().join("grpo").join("llama_dapo");
    let dir = scratch("serve-grpo");
    let one = ["--set", "grpo.num_iterations=1"];
    let (run_metrics, run_model) = run(&case, &dir, &one);
    let rollouts = lines(&case.join("rollouts.jsonl"));
    let mut server = Server::start(&case.join("run.yaml"), 2, &dir, &one);
    for step in 0..4 {
        let batch = &rollouts[6 * step..6 * step + 6];
        let trained = server.ok(json!({"cmd": "train_step", "rollouts": batch}));
        let applied = server.ok(json!({"cmd": "optimizer_step"}));
        check_step(step, &trained, &applied, &run_metrics);
        let reward = &trained["metrics"]["reward"];
        assert_eq!(bits(reward), bits(&run_metrics[step]["reward"]));
    }
    check_export(&mut server, &dir, &run_model);
    assert!(server.shutdown().success());
}

/// A server's `save` after its first step is a run's checkpoint: a run resuming it ends
/// with the model of an uninterrupted run.
#[test]
fn a_saved_checkpoint_resumes_as_a_runs() {
    let case = golden_dir().join("llama");
    let dir = scratch("serve-save");
    let (_, run_model) = run(&case, &dir, &[]);
    let ck = dir.join("ck");
    let set = format!("checkpoint.dir={}", ck.display());
    let mut server = Server::start(&case.join("run.yaml"), 2, &dir, &["--set", &set]);
    let rows = lines(&case.join("data.jsonl"));
    server.ok(json!({"cmd": "train_step", "rows": rows[..4]}));
    server.ok(json!({"cmd": "optimizer_step"}));
    let saved = server.ok(json!({"cmd": "save"}));
    let saved = PathBuf::from(saved["dir"].as_str().unwrap());
    assert!(saved.ends_with("step-00000001"), "{}", saved.display());
    assert!(server.shutdown().success());
    let out = dir.join("resumed-model");
    let args = [
        "--set",
        &set,
        "--set",
        &format!("training.output_dir={}", out.display()),
        "--resume",
        "latest",
    ];
    run_cpu_ok(&case.join("run.yaml"), 2, &dir.join("resumed.jsonl"), &args);
    let resumed = tensors(&out.join("model.safetensors"));
    assert_same_bits(
        &resumed,
        &run_model,
        "resumed from a served save vs the run: ",
    );
}

/// `weights`: the store's memfd and the version page, both read-only; every tensor where
/// the table says, equal to the export of the same version.
#[test]
fn weights_hand_over_the_store_read_only_as_exported() {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let case = golden_dir().join("llama");
    let dir = scratch("serve-weights");
    let mut server = Server::start(&case.join("run.yaml"), 1, &dir, &[]);
    let rows = lines(&case.join("data.jsonl"));
    server.ok(json!({"cmd": "train_step", "rows": rows[..4]}));
    server.ok(json!({"cmd": "optimizer_step"}));
    let out = dir.join("model");
    server.ok(json!({"cmd": "export", "dir": out}));
    let body = serde_json::to_vec(&json!({"cmd": "weights"})).unwrap();
    server
        .conn
        .write_all(&(body.len() as u64).to_le_bytes())
        .unwrap();
    server.conn.write_all(&body).unwrap();
    // The length, with the descriptors beside it; then the body.
    let mut len = [0u8; 8];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 2]);
    let fds: Vec<OwnedFd> = {
        let mut iov = [std::io::IoSliceMut::new(&mut len)];
        let fd = server.conn.as_raw_fd();
        let msg = recvmsg::<()>(fd, &mut iov, Some(&mut space), MsgFlags::MSG_WAITALL).unwrap();
        assert_eq!(msg.bytes, 8);
        let mut fds = Vec::new();
        for c in msg.cmsgs().unwrap() {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: the kernel just gave this process these descriptors.
                fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
            }
        }
        fds
    };
    let mut body = vec![0u8; u64::from_le_bytes(len) as usize];
    server.conn.read_exact(&mut body).unwrap();
    let answer: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(answer["ok"], true, "{answer}");
    assert_eq!(fds.len(), 2, "the store and the version page");
    let (store, page) = (
        std::fs::File::from(fds[0].try_clone().unwrap()),
        std::fs::File::from(fds[1].try_clone().unwrap()),
    );
    let mut v = [0u8; 8];
    page.read_exact_at(&mut v, 0).unwrap();
    assert_eq!(
        (u64::from_le_bytes(v), answer["version"].clone()),
        (2, json!(1)),
        "one update: 2 x 1"
    );
    assert!(
        store.write_at(&[0], 4096).is_err(),
        "the store is handed over read-only"
    );
    assert!(page.write_at(&[0], 0).is_err(), "the version page too");
    let exported = tensors(&out.join("model.safetensors"));
    let table = answer["tensors"].as_array().unwrap();
    assert_eq!(table.len(), exported.len());
    for t in table {
        let name = t["name"].as_str().unwrap();
        let mut bytes = vec![0u8; t["nbytes"].as_u64().unwrap() as usize];
        store
            .read_exact_at(&mut bytes, t["offset"].as_u64().unwrap())
            .unwrap();
        let values: Vec<f32> = (bytes.chunks_exact(4))
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let want = &exported[name];
        let same = values
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same && values.len() == want.len(),
            "{name}: the store differs from the export"
        );
    }
    assert!(server.shutdown().success());
}

/// Bad requests are refused, each naming what was wrong, and change nothing: the step
/// after them equals a fresh server's. (`save` without a `checkpoint.dir` writes to the
/// default one, `output/<config>/checkpoints`, as a run's stop does.)
#[test]
fn bad_requests_are_refused_and_the_server_goes_on() {
    let case = golden_dir().join("llama");
    let dir = scratch("serve-refused");
    let model = case.join("model");
    let foreign = dir.join("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), b"mine").unwrap();
    let mut server = Server::start(&case.join("run.yaml"), 2, &dir, &[]);
    let rows = lines(&case.join("data.jsonl"));
    let cases = [
        (
            json!({"cmd": "train_step", "rows": rows[..3]}),
            "3 rows do not split over the 2 workers",
        ),
        (
            json!({"cmd": "train_step", "rows": [{"input_ids": [1, 2, 99]}, {"input_ids": [1]}]}),
            "rows[0].input_ids[2]: 99 is not a token id of this model",
        ),
        (
            json!({"cmd": "train_step", "rollouts": []}),
            "`rollouts` given to a server whose training.stage takes `rows`",
        ),
        (
            json!({"cmd": "train_step", "rows": [{"input_ids": [1, 2], "images": ["/a.png"]}]}),
            "rows[0].images: this model reads no images",
        ),
        (json!({"cmd": "optimizer_step"}), "no gradient to apply"),
        (json!({"cmd": "export", "dir": model}), "export: dir"),
        (
            json!({"cmd": "export", "dir": foreign}),
            "holds files this project did not write: notes.txt",
        ),
        (
            json!({"cmd": "set_lr", "lr": -1}),
            "not a finite number >= 0",
        ),
        (json!({"cmd": "retrain"}), "unknown command `retrain`"),
        (
            json!({"cmd": "train_step", "rows": rows[..4], "lossunits": 9}),
            "train_step: unknown key `lossunits` (it takes cmd, rows, pairs, rollouts, loss_units)",
        ),
        (
            json!({"cmd": "forward", "rows": [{"input_ids": [1, 2], "label": [1, 2]}]}),
            "rows[0]: unknown key `label`",
        ),
        (json!({"rows": []}), "names its command in `cmd`"),
    ];
    for (req, needle) in cases {
        server.refused(req, needle);
    }
    assert_eq!(std::fs::read(foreign.join("notes.txt")).unwrap(), b"mine");
    let trained = server.ok(json!({"cmd": "train_step", "rows": rows[..4]}));
    let applied = server.ok(json!({"cmd": "optimizer_step"}));
    let info = server.ok(json!({"cmd": "info"}));
    assert_eq!(info["step"], 1);
    let mode = std::fs::metadata(&server.socket)
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "the socket is the owner's alone");
    drop(server);
    let mut fresh = Server::start(
        &case.join("run.yaml"),
        2,
        &scratch("serve-refused-fresh"),
        &[],
    );
    let t = fresh.ok(json!({"cmd": "train_step", "rows": rows[..4]}));
    let a = fresh.ok(json!({"cmd": "optimizer_step"}));
    assert_eq!(
        (bits(&trained["loss"]), bits(&applied["grad_norm"])),
        (bits(&t["loss"]), bits(&a["grad_norm"])),
        "the refused requests changed the training"
    );
}

/// SIGTERM stops a server between commands: exit 128 + 15, no worker, no shared memory,
/// no socket left.
#[test]
fn a_stop_signal_ends_the_server_leaving_nothing() {
    let case = golden_dir().join("llama");
    let dir = scratch("serve-sigterm");
    let shm_before = shm_entries();
    let mut server = Server::start(&case.join("run.yaml"), 2, &dir, &[]);
    let pid = server.child.id();
    let workers = children(pid);
    assert_eq!(workers.len(), 2);
    signal("TERM", pid);
    let done = wait_for(Duration::from_secs(60), || {
        server.child.try_wait().unwrap().is_some()
    });
    assert!(done.is_some(), "the server did not stop on SIGTERM");
    let status = server.child.wait().unwrap();
    assert_eq!(status.code(), Some(128 + 15), "{}", server.output());
    assert!(!server.socket.exists(), "the socket is removed");
    assert_clean(pid, &workers, &shm_before);
}

/// `forward`: each label token's log-probability and entropy equal transformers' on the
/// same rows and weights (scripts/token_logps.py), within `TOL` of each value's scale.
/// Both sides compute in float32 from the same weights; they differ by the order of the
/// reductions (matmul blocking, the softmax's sum), f32 rounding ~6e-8 relative per
/// operation over a few hundred sequential ones: measured 1.1e-7 for both (AMD EPYC, this
/// box, 2026-11-28); 1e-5 leaves two orders of magnitude for another CPU's MKL blocking
/// (Intel), whose error is of the same size. A shifted position or a missing term of the
/// softmax is O(1).
#[test]
fn forward_logprobs_and_entropy_are_transformers() {
    const TOL: f64 = 1e-5;
    let case = golden_dir().join("llama");
    let dir = scratch("serve-forward");
    let rows = lines(&case.join("data.jsonl"));
    let rows = &rows[..5];
    let mut server = Server::start(&case.join("run.yaml"), 2, &dir, &[]);
    let ours = server.ok(json!({"cmd": "forward", "rows": rows, "entropy": true}));
    let req = dir.join("request.json");
    let body = json!({"model": case.join("model"), "rows": rows});
    std::fs::write(&req, body.to_string()).unwrap();
    let torch: Value = serde_json::from_slice(&venv_script("token_logps.py", &req)).unwrap();
    for key in ["logprobs", "entropy"] {
        for (i, (a, b)) in ours[key]
            .as_array()
            .unwrap()
            .iter()
            .zip(torch[key].as_array().unwrap())
            .enumerate()
        {
            let (a, b) = (f64_array(a), f64_array(b));
            assert_eq!(a.len(), b.len(), "{key} of row {i}");
            let worst = (a.iter().zip(&b))
                .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
                .fold(0.0, f64::max);
            assert!(
                worst <= TOL,
                "{key} of row {i}: {a:?} vs transformers' {b:?} ({worst:.2e})"
            );
        }
    }
    // Without `entropy`, the same log-probabilities alone.
    let plain = server.ok(json!({"cmd": "forward", "rows": rows}));
    assert_eq!(plain["logprobs"], ours["logprobs"]);
    assert!(plain.get("entropy").is_none());
    assert!(server.shutdown().success());
}

/// One worker: the golden llama case's steps equal its run's; and each step's batch of 4
/// split over two `train_step`s of 2 rows (each naming the batch's label tokens as its
/// `loss_units`) before one `optimizer_step` equals a run accumulating two micro-batches
/// of 2 (`gradient_accumulation_steps: 2`): the same norms and the same model, bit for bit.
#[test]
fn one_worker_and_accumulation_across_calls_equal_runs_bit_for_bit() {
    let case = golden_dir().join("llama");
    let rows = lines(&case.join("data.jsonl"));
    let dir = scratch("serve-one-worker");
    let (run_metrics, run_model) = run_on(&case, &dir, 1, &[]);
    let mut server = Server::start(&case.join("run.yaml"), 1, &dir, &[]);
    for step in 0..3 {
        let batch = &rows[4 * step..4 * step + 4];
        let trained = server.ok(json!({"cmd": "train_step", "rows": batch}));
        let applied = server.ok(json!({"cmd": "optimizer_step"}));
        check_step(step, &trained, &applied, &run_metrics);
    }
    check_export(&mut server, &dir, &run_model);
    assert!(server.shutdown().success());

    let dir = scratch("serve-accumulation");
    let accum = ["--set", "training.gradient_accumulation_steps=2"];
    let (run_metrics, run_model) = run_on(&case, &dir, 1, &accum);
    let mut server = Server::start(&case.join("run.yaml"), 1, &dir, &accum);
    // Label tokens after the shift (a row without labels is labelled on every token).
    let label_tokens = |rows: &[Value]| -> u64 {
        let labels = rows.iter().flat_map(|r| {
            let l = r.get("labels").unwrap_or(&r["input_ids"]);
            l.as_array().unwrap()[1..].to_vec()
        });
        labels.filter(|l| l.as_i64() != Some(-100)).count() as u64
    };
    for step in 0..3 {
        let batch = &rows[4 * step..4 * step + 4];
        let units = label_tokens(batch);
        for half in batch.chunks(2) {
            server.ok(json!({"cmd": "train_step", "rows": half, "loss_units": units}));
        }
        let info = server.ok(json!({"cmd": "info"}));
        assert_eq!(info["pending"], 2, "two micro-batches accumulated");
        let applied = server.ok(json!({"cmd": "optimizer_step"}));
        assert_eq!(applied["train_steps"], 2);
        let want = &run_metrics[step]["grad_norm"];
        assert_eq!(
            bits(&applied["grad_norm"]),
            bits(want),
            "step {}: norm",
            step + 1
        );
    }
    check_export(&mut server, &dir, &run_model);
    assert!(server.shutdown().success());
}

/// A client that disconnects without reading its answer leaves the server serving, the
/// command done; a second client while one is connected is told the server is busy; a
/// reward that is not a number (JSON's NaN written as a string) is refused by name; a
/// killed server leaves no worker and no shared memory, and its client reads the end of
/// the connection.
#[test]
fn clients_come_and_go_and_a_killed_server_leaves_nothing() {
    let case = golden_dir().join("llama");
    let dir = scratch("serve-clients");
    let shm_before = shm_entries();
    let rows = lines(&case.join("data.jsonl"));
    let mut server = Server::start(&case.join("run.yaml"), 2, &dir, &[]);
    // A second client while the first is connected: one answer, `busy`.
    let mut other = UnixStream::connect(&server.socket).unwrap();
    let mut len = [0u8; 8];
    other.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u64::from_le_bytes(len) as usize];
    other.read_exact(&mut body).unwrap();
    let busy: Value = serde_json::from_slice(&body).unwrap();
    assert!(
        busy["error"].as_str().unwrap().starts_with("busy"),
        "{busy}"
    );
    // A request whose client is gone before the answer.
    let req = serde_json::to_vec(&json!({"cmd": "train_step", "rows": rows[..4]})).unwrap();
    server
        .conn
        .write_all(&(req.len() as u64).to_le_bytes())
        .unwrap();
    server.conn.write_all(&req).unwrap();
    server.conn.shutdown(std::net::Shutdown::Both).unwrap();
    // The next client finds the server serving and the batch accumulated.
    let connected = wait_for(Duration::from_secs(30), || {
        let Ok(c) = UnixStream::connect(&server.socket) else {
            return false;
        };
        server.conn = c;
        server.call(json!({"cmd": "info"}))["pending"] == 2
    });
    assert!(
        connected.is_some(),
        "the server did not serve the next client:\n{}",
        server.output()
    );
    server.ok(json!({"cmd": "optimizer_step"}));
    // SIGKILL: the workers die with it, the memfds with them.
    let pid = server.child.id();
    let workers = children(pid);
    assert_eq!(workers.len(), 2);
    signal("KILL", pid);
    let mut len = [0u8; 8];
    assert!(
        server.conn.read_exact(&mut len).is_err(),
        "the client reads the end of the connection"
    );
    server.child.wait().unwrap();
    assert_clean(pid, &workers, &shm_before);
}

/// GRPO's inputs checked by name: a NaN reward (sent as JSON's string for it), a wrong
/// count of old log-probabilities, a missing group.
#[test]
fn bad_rollouts_are_refused_naming_the_field() {
    let case = golden_dir().join("grpo").join("llama_dapo");
    let dir = scratch("serve-bad-rollouts");
    let rollouts = lines(&case.join("rollouts.jsonl"));
    let mut server = Server::start(&case.join("run.yaml"), 2, &dir, &[]);
    let with = |i: usize, key: &str, v: Value| {
        let mut batch = rollouts[..6].to_vec();
        batch[i][key] = v;
        json!({"cmd": "train_step", "rollouts": batch})
    };
    server.refused(
        with(3, "reward", json!("NaN")),
        "rollouts[3].reward: \"NaN\" is not a finite number",
    );
    server.refused(
        with(1, "old_logps", json!([-1.0])),
        "rollouts[1].old_logps: 1 values for",
    );
    let mut batch = rollouts[..6].to_vec();
    batch[2].as_object_mut().unwrap().remove("group");
    server.refused(
        json!({"cmd": "train_step", "rollouts": batch}),
        "rollouts[2].group is missing",
    );
    server.refused(
        with(0, "completion_ids", json!([1, 2, 1000])),
        "rollouts[0].completion_ids[2]: 1000 is not a token id",
    );
    let info = server.ok(json!({"cmd": "info"}));
    assert_eq!(info["pending"], 0, "nothing was trained");
    assert!(server.shutdown().success());
}

/// A server needs no dataset, only the longest row its workers are sized for
/// (`dataset.max_seq_len`); without either it is refused naming that key, and a run with
/// no dataset still names `dataset.path`.
#[test]
fn a_server_needs_no_dataset_but_the_row_length() {
    let model = golden_dir().join("grpo").join("llama_dapo").join("model");
    let dir = scratch("serve-no-dataset");
    let yaml = |dataset: &str| {
        format!(
            "model: {{path: {}, init: pretrained, dtype: float32}}\n{dataset}training: {{stage: grpo, batch_size: 4, num_steps: 10, learning_rate: 0.01}}\n",
            model.display()
        )
    };
    let config = dir.join("serve.yaml");
    std::fs::write(&config, yaml("dataset: {max_seq_len: 24}\n")).unwrap();
    let mut server = Server::start(&config, 2, &dir, &[]);
    let info = server.ok(json!({"cmd": "info"}));
    assert_eq!(
        (info["stage"].clone(), info["max_seq_len"].clone()),
        (json!("grpo"), json!(24))
    );
    let r = |c: Vec<i32>, reward: f64| json!({"prompt_ids": [1, 2, 3], "completion_ids": c, "reward": reward, "group": 0});
    let batch = [
        r(vec![4, 5], 1.0),
        r(vec![6], 0.0),
        r(vec![7, 8, 9], 0.5),
        r(vec![10; 21], 0.0),
    ];
    server.ok(json!({"cmd": "train_step", "rollouts": batch}));
    let too_long = [r(vec![4; 22], 1.0), r(vec![6], 0.0)];
    server.refused(
        json!({"cmd": "train_step", "rollouts": too_long}),
        "rollouts[0]: 25 tokens",
    );
    server.ok(json!({"cmd": "optimizer_step"}));
    assert!(server.shutdown().success());
    let bare = dir.join("bare.yaml");
    std::fs::write(&bare, yaml("dataset: {}\n")).unwrap();
    let out = mt_launch()
        .args(["serve", "--config", path_str(&bare), "--gpus", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("dataset.max_seq_len"),
        "{err}"
    );
    let out = mt_launch()
        .args(["--config", path_str(&bare), "--gpus", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("dataset.path"),
        "{err}"
    );
}

/// Images through the server: the tiny Qwen2.5-VL's golden step (vlm/golden: the four
/// LlamaFactory records of the data fixtures, with PNG, JPEG and WebP images, one and two
/// to a row, and a text-only row) sent as rows with their ids and labels as the model's
/// AutoProcessor made them (expected_qwen2vl.jsonl, which the run's own rows equal token
/// for token: launcher/tests/data.rs) and their images' absolute paths, equals the run's
/// step bit for bit (loss, norm, export), with 1 and 2 workers. Rows whose image tokens are
/// not their images', a missing, relative or broken file are refused naming the row, and
/// the server goes on.
#[test]
fn rows_with_images_equal_a_runs_bit_for_bit() {
    let vlm = data_fixtures("vlm/golden/expected.json").join("vlm");
    let case = vlm.join("golden");
    let records = json(&vlm.join("mllm.json"));
    let ids = lines(&vlm.join("expected_qwen2vl.jsonl"));
    let images = |i: usize| -> Vec<PathBuf> {
        let paths = records[i]["images"].as_array().unwrap();
        paths
            .iter()
            .map(|p| vlm.join(p.as_str().unwrap()))
            .collect()
    };
    let rows: Vec<Value> = (0..4)
        .map(|i| json!({"input_ids": ids[i]["input_ids"], "labels": ids[i]["labels"], "images": images(i)}))
        .collect();
    assert!(images(1).len() == 2 && images(3).is_empty());
    for workers in [1, 2] {
        let dir = scratch(&format!("serve-vlm-{workers}"));
        let (run_metrics, run_model) = run_on(&case, &dir, workers, &[]);
        let mut server = Server::start(&case.join("run.yaml"), workers, &dir, &[]);
        let broken = dir.join("broken.png");
        let png = std::fs::read(&images(0)[0]).unwrap();
        std::fs::write(&broken, &png[..png.len() / 2]).unwrap();
        let with = |images: Value| {
            let mut row = rows[0].clone();
            row["images"] = images;
            let mut batch = rows.clone();
            batch[0] = row;
            json!({"cmd": "train_step", "rows": batch})
        };
        for (req, says) in [
            (with(json!(images(1))), "rows[0]: 6 image tokens at"),
            (with(json!([])), "rows[0]: 6 image tokens at"),
            (
                with(json!(["images/a.png"])),
                "rows[0].images[0]: \"images/a.png\" is a relative path",
            ),
            (with(json!([dir.join("none.png")])), "rows[0].images[0]"),
            (with(json!([broken])), "rows[0].images[0]"),
        ] {
            server.refused(req, says);
        }
        let trained = server.ok(json!({"cmd": "train_step", "rows": rows}));
        let applied = server.ok(json!({"cmd": "optimizer_step"}));
        check_step(0, &trained, &applied, &run_metrics);
        check_export(&mut server, &dir, &run_model);
        assert!(server.shutdown().success());
    }
}
