//! `mt-launch serve`: the trainer kept alive, driven by a client's commands over a local
//! socket (docs/serve.md) instead of by the config's dataset. One client at a time; each
//! request is answered before the next is read. A refused command leaves the server as it
//! was; a fatal one (a worker lost) is answered and ends the server with the error, as it
//! would end a run. SIGINT / SIGTERM end it between commands.

mod batch;
mod wire;

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Result, anyhow};
use serde_json::{Value, json};

use crate::train::{Failure, Trainer};
use batch::Limits;
use wire::{Conn, Listener, Received};

/// How often the waits for a client or a request look at the stop signals.
const TICK: Duration = Duration::from_millis(200);

/// Serves `trainer` on `socket` (or the default path) until `shutdown` or a stop signal.
pub fn serve(mut trainer: Trainer, socket: Option<&Path>) -> Result<()> {
    trainer.start_serving()?;
    let path = socket.map_or_else(default_socket, Path::to_path_buf);
    let listener = Listener::bind(&path)?;
    crate::progress::out(&format!("serving on {}", listener.path().display()));
    loop {
        crate::unix::check_stop("serving")?;
        if !listener.wait(TICK)? {
            continue;
        }
        let mut conn = listener.accept()?;
        tracing::info!("client connected");
        match session(&mut trainer, &listener, &mut conn) {
            Ok(Next::Client) => tracing::info!("client disconnected"),
            Ok(Next::Shutdown) => break,
            Err(e) => return Err(e),
        }
    }
    drop(listener);
    trainer.stop_serving()?;
    crate::progress::out("server stopped");
    Ok(())
}

/// What follows a client's connection.
enum Next {
    /// It disconnected: wait for the next.
    Client,
    Shutdown,
}

/// One client's requests, answered in order until it disconnects (or `shutdown`). Another
/// client connecting meanwhile is told the server is busy and closed: two clients never
/// interleave. A client gone before its answer ends its session, not the server.
fn session(trainer: &mut Trainer, listener: &Listener, conn: &mut Conn) -> Result<Next> {
    loop {
        crate::unix::check_stop("serving")?;
        if listener.wait(Duration::ZERO)? {
            let mut other = listener.accept()?;
            let busy = "busy: another client is connected to this server (one at a time)";
            let _ = other.send(&json!({"ok": false, "error": busy}));
        }
        if !conn.wait(TICK)? {
            continue;
        }
        let req = match conn.recv() {
            Ok(Received::Request(req)) => req,
            Ok(Received::Malformed(why)) => match conn.send(&json!({"ok": false, "error": why})) {
                Ok(()) => continue,
                Err(_) => return Ok(Next::Client),
            },
            Ok(Received::Closed) => return Ok(Next::Client),
            Err(e) => {
                tracing::warn!("closing the client's connection: {e:#}");
                return Ok(Next::Client);
            }
        };
        let cmd = req
            .get("cmd")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if cmd == "weights" {
            match trainer.weights() {
                Ok(w) => {
                    let tensors: Vec<Value> = (w.tensors.iter())
                        .map(|(name, shape, offset, nbytes)| {
                            json!({"name": name, "shape": shape, "offset": offset, "nbytes": nbytes})
                        })
                        .collect();
                    let answer = json!({
                        "ok": true,
                        "version": w.version,
                        "dtype": trainer.state()["dtype"],
                        "size": w.size,
                        "tensors": tensors,
                    });
                    let fds = [w.store.as_fd(), w.version_page.as_fd()];
                    if conn.send_with_fds(&answer, &fds).is_err() {
                        return Ok(Next::Client);
                    }
                }
                Err(f) => {
                    if answer_failure(conn, &cmd, f)?.is_err() {
                        return Ok(Next::Client);
                    }
                }
            }
            continue;
        }
        let sent = match dispatch(trainer, &cmd, &req) {
            Ok(mut answer) => {
                answer["ok"] = json!(true);
                let sent = conn.send(&answer);
                if cmd == "shutdown" {
                    return Ok(Next::Shutdown);
                }
                sent
            }
            Err(f) => answer_failure(conn, &cmd, f)?,
        };
        if let Err(e) = sent {
            tracing::warn!("{cmd}: the client was gone before its answer ({e:#})");
            return Ok(Next::Client);
        }
    }
}

/// Answers a failed command: a refused one with its error (the server goes on; the result
/// of sending the answer); a fatal one with its error, then returns it to end the server.
fn answer_failure(conn: &mut Conn, cmd: &str, f: Failure) -> Result<Result<()>> {
    match f {
        Failure::Refused(e) => {
            tracing::info!("{cmd}: refused: {e:#}");
            Ok(conn.send(&json!({"ok": false, "error": format!("{e:#}")})))
        }
        Failure::Fatal(e) => {
            let _ = conn.send(&json!({"ok": false, "error": format!("{e:#}"), "fatal": true}));
            Err(e)
        }
    }
}

/// The keys each command takes besides `cmd` (docs/serve.md).
fn request_keys(cmd: &str) -> Option<&'static [&'static str]> {
    Some(match cmd {
        "train_step" => &["cmd", "rows", "pairs", "rollouts", "loss_units"],
        "forward" => &["cmd", "rows", "entropy", "sum"],
        "optimizer_step" | "set_lr" => &["cmd", "lr"],
        "save" | "export" => &["cmd", "dir"],
        "info" | "sleep" | "wake" | "weights" | "shutdown" => &["cmd"],
        _ => return None,
    })
}

fn dispatch(trainer: &mut Trainer, cmd: &str, req: &Value) -> Result<Value, Failure> {
    let bad = |e: anyhow::Error| Failure::Refused(e);
    if let Some(keys) = request_keys(cmd) {
        batch::known_keys(req, cmd, keys).map_err(bad)?;
    }
    match cmd {
        "info" => {
            let mut state = trainer.state();
            state["protocol"] = json!(1);
            Ok(state)
        }
        "train_step" => {
            let b = batch::train(req, trainer.objective(), &limits(trainer)).map_err(bad)?;
            let units = match req.get("loss_units") {
                None | Some(Value::Null) => None,
                Some(v) => match v.as_u64() {
                    Some(n) if n > 0 => Some(n),
                    _ => {
                        return Err(bad(anyhow!(
                            "train_step: `loss_units`: {v} is not a count > 0 (what the loss is a mean over)"
                        )));
                    }
                },
            };
            let t = trainer.train_batch(&b.plan, b.accum, units)?;
            let mut metrics = json!({});
            if let Some(d) = t.dpo {
                metrics = serde_json::to_value(d).map_err(|e| bad(e.into()))?;
            }
            if let Some(g) = t.grpo {
                metrics = serde_json::to_value(g).map_err(|e| bad(e.into()))?;
            }
            Ok(json!({"loss": t.loss, "units": t.units, "tokens": t.tokens, "metrics": metrics}))
        }
        "forward" => {
            let rows = batch::forward(req, &limits(trainer)).map_err(bad)?;
            let flag = |key: &str| req.get(key).and_then(Value::as_bool).unwrap_or(false);
            if flag("sum") {
                return Ok(json!({ "logprobs": trainer.forward_sums(&rows)? }));
            }
            let entropy = flag("entropy");
            let out = trainer.forward_logprobs(&rows, entropy)?;
            let (logps, entropies): (Vec<_>, Vec<_>) = out.into_iter().unzip();
            match entropy {
                true => Ok(json!({ "logprobs": logps, "entropy": entropies })),
                false => Ok(json!({ "logprobs": logps })),
            }
        }
        "optimizer_step" => {
            let lr = optional_number(req, "lr").map_err(bad)?;
            let a = trainer.apply_update(lr)?;
            Ok(json!({
                "step": a.step,
                "grad_norm": a.grad_norm,
                "lr": a.lr,
                "skipped": a.skipped,
                "train_steps": a.calls,
            }))
        }
        "set_lr" => {
            if req.get("lr").is_none() {
                return Err(bad(anyhow!(
                    "set_lr: `lr` is missing (a number, or null for the schedule's)"
                )));
            }
            let lr = optional_number(req, "lr").map_err(bad)?;
            Ok(json!({ "lr": trainer.set_lr(lr)? }))
        }
        "save" => {
            if req.get("dir").is_some_and(|d| !d.is_null()) {
                return Err(bad(anyhow!(
                    "save: `dir` is not taken: checkpoints go under checkpoint.dir (set it in the config or with --set checkpoint.dir=DIR)"
                )));
            }
            Ok(json!({ "dir": trainer.save()? }))
        }
        "export" => {
            let dir = req.get("dir").and_then(Value::as_str).ok_or_else(|| {
                bad(anyhow!(
                    "export: `dir` is missing (the HF model directory to write)"
                ))
            })?;
            Ok(json!({ "dir": trainer.export_to(Path::new(dir))? }))
        }
        "sleep" => trainer.sleep().map(|()| json!({})),
        "wake" => trainer.wake().map(|()| json!({})),
        "shutdown" => Ok(json!({})),
        "" => Err(bad(anyhow!("a request names its command in `cmd`"))),
        other => Err(bad(anyhow!(
            "unknown command `{other}` (info, train_step, forward, optimizer_step, set_lr, save, export, sleep, wake, weights, shutdown)"
        ))),
    }
}

fn limits(trainer: &Trainer) -> Limits {
    Limits {
        vocab: trainer.vocab_size(),
        max_seq_len: trainer.max_seq_len(),
        world: trainer.world(),
        rows_per_micro: trainer.rows_per_micro(),
        pad: trainer.pad_id(),
        images: trainer.image_input(),
    }
}

/// `req[key]` as a positive finite number, or `None` where absent or null.
fn optional_number(req: &Value, key: &str) -> Result<Option<f64>> {
    match req.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && x >= 0.0 => Ok(Some(x)),
            _ => Err(anyhow!("`{key}`: {v} is not a finite number >= 0")),
        },
    }
}

/// `mt-serve-<pid>.sock` in `$XDG_RUNTIME_DIR` (private to the user), else the temporary
/// directory.
fn default_socket() -> PathBuf {
    let dir = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|d| d.is_dir())
        .unwrap_or_else(std::env::temp_dir);
    dir.join(format!("mt-serve-{}.sock", std::process::id()))
}
