//! W&B and MLflow (`logging.report_to: wandb, mlflow`), through their own Python clients in a
//! side process fed by the metrics stream. TensorBoard is written natively
//! (`mt::metrics::tensorboard`); these two have no file format worth writing ourselves.
//!
//! Before anything starts, [`resolve`] finds the interpreter (`logging.python`, else
//! `MT_PYTHON`, else `python3` on PATH) and checks that it has each package named: a missing
//! one is an error naming the interpreter and the pip command. `all` takes the ones found
//! and says which. [`Side::start`] then runs `trackers.py` (embedded in this binary) with
//! the resolved config and the plan's figures; [`Side::wait_ready`], just before the workers
//! spawn, waits (bounded) for it to have started its runs, so that a bad tracking URI or a
//! W&B login that is missing fails the launch then, in one line.
//!
//! Each step's scalars (the same tags TensorBoard gets) go to it as a JSON line through a
//! thread that owns its stdin: training never waits on it, and a side process that dies
//! is warned of once and training goes on. At the end [`Side::finish`] sends the final
//! figures and the run's status and closes the stream; the side process finishes (flushes)
//! its runs and exits, waited for at most [`FINISH_WAIT`]. Dropped without `finish` (a failed
//! run), the stream closes without a status and the runs finish as failed. The side process
//! is in its own process group (Ctrl-C stops the launcher, which ends the runs) and dies
//! with the launcher (PR_SET_PDEATHSIG, set by the script itself).

use std::io::{BufRead, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use crossbeam_channel::{Receiver, Sender};
use mt::config::{LoggingSection, ReportTo, Tracker};
use mt::metrics::StepMetrics;
use mt::metrics::tensorboard::step_scalars;
use serde_json::{Value, json};

/// The side process's source (see its docstring for the protocol).
const SCRIPT: &str = include_str!("trackers.py");

/// The longest the package check may take (an interpreter's start).
const CHECK_WAIT: Duration = Duration::from_secs(60);
/// The longest the runs may take to start (`wandb.init` waits 90 s for its service).
const READY_WAIT: Duration = Duration::from_secs(120);
/// The longest the runs may take to finish and flush at the end.
const FINISH_WAIT: Duration = Duration::from_secs(120);
/// Lines queued for a side process that is behind; beyond it steps are dropped (warned).
const QUEUE: usize = 100_000;

/// The trackers that need the side process, and the interpreter that has their packages.
#[derive(Debug)]
pub struct Resolved {
    python: PathBuf,
    trackers: Vec<Tracker>,
}

/// The interpreter, and the words that say where it came from.
fn interpreter(logging: &LoggingSection) -> (PathBuf, &'static str) {
    if let Some(p) = &logging.python {
        return (p.clone(), "logging.python");
    }
    match &mt::switches::get().python {
        Some(p) => (p.clone(), "MT_PYTHON"),
        None => ("python3".into(), "python3 on PATH"),
    }
}

/// W&B and MLflow among `report_to`, checked: None when neither is named (nor found, with
/// `all`). Prints which `all` uses.
pub fn resolve(logging: &LoggingSection) -> Result<Option<Resolved>> {
    let (python, from) = interpreter(logging);
    let named: Vec<Tracker> = match &logging.report_to {
        ReportTo::None => return Ok(None),
        ReportTo::These(v) => v.iter().copied().filter(|t| t.module().is_some()).collect(),
        ReportTo::All => Tracker::ALL
            .into_iter()
            .filter(|t| t.module().is_some())
            .collect(),
    };
    if named.is_empty() {
        return Ok(None);
    }
    let modules: Vec<&str> = named.iter().filter_map(|t| t.module()).collect();
    let missing = missing_modules(&python, &modules);
    let all = logging.report_to == ReportTo::All;
    let missing = match (missing, all) {
        (Ok(m), _) => m,
        (Err(why), true) => {
            println!(
                "report_to: all = tensorboard (wandb and mlflow need Python: {} ({from}) {why})",
                python.display()
            );
            return Ok(None);
        }
        (Err(why), false) => {
            let names: Vec<&str> = named.iter().map(|t| t.name()).collect();
            let (needs, package) = match modules.len() {
                1 => ("needs", "package"),
                _ => ("need", "packages"),
            };
            bail!(
                "logging.report_to: {} {needs} Python with the {} {package}: {} ({from}) {why}; name an interpreter with logging.python or MT_PYTHON",
                names.join(", "),
                modules.join(", "),
                python.display()
            )
        }
    };
    if let Some(t) = named.iter().find(|t| !all && missing.contains(&t.module())) {
        bail!(
            "logging.report_to: {} needs the {} package in {} ({from}): {}, or name another interpreter with logging.python or MT_PYTHON",
            t.name(),
            t.module().unwrap_or_default(),
            python.display(),
            t.pip()
        );
    }
    let found: Vec<Tracker> = named
        .into_iter()
        .filter(|t| !missing.contains(&t.module()))
        .collect();
    if all {
        let used = std::iter::once("tensorboard").chain(found.iter().map(|t| t.name()));
        let left: Vec<&str> = missing.iter().flatten().copied().collect();
        let left = match left.is_empty() {
            true => String::new(),
            false => format!(
                " ({} not installed in {})",
                left.join(", "),
                python.display()
            ),
        };
        println!(
            "report_to: all = {}{left}",
            used.collect::<Vec<_>>().join(", ")
        );
    }
    Ok((!found.is_empty()).then_some(Resolved {
        python,
        trackers: found,
    }))
}

/// The modules `python` cannot import (found by `importlib.util.find_spec`, which imports
/// nothing); Err: the interpreter could not be run, in words.
fn missing_modules(
    python: &std::path::Path,
    modules: &[&'static str],
) -> std::result::Result<Vec<Option<&'static str>>, String> {
    const CHECK: &str = "import importlib.util as u, sys\n\
        print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))";
    let mut child = Command::new(python)
        .args(["-c", CHECK])
        .args(modules)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not be run ({e})"))?;
    let status = match wait_bounded(&mut child, CHECK_WAIT) {
        Some(status) => status,
        None => return Err(format!("did not answer in {} s", CHECK_WAIT.as_secs())),
    };
    let mut out = String::new();
    let mut err = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = std::io::Read::read_to_string(&mut o, &mut out);
    }
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut err);
    }
    if !status.success() {
        let last = err.lines().last().unwrap_or("").trim().to_string();
        return Err(format!("failed ({status}: {last})"));
    }
    let missing: Vec<&str> = out.split_whitespace().collect();
    Ok(modules
        .iter()
        .map(|m| missing.contains(m).then_some(*m))
        .collect())
}

/// Waits for `child` at most `limit`; None if it is still running.
fn wait_bounded(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let until = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
            _ => return None,
        }
    }
}

/// The run's figures the side process records from the start (W&B config `plan`, MLflow
/// parameters `plan.*`).
pub struct PlanFigures {
    pub host_ram_total_bytes: u64,
    pub host_bytes_per_param: f64,
    pub host_ram_available_bytes: Option<u64>,
    pub params: u64,
    pub world_size: usize,
    pub workers: usize,
    pub gpus: usize,
    pub nodes: usize,
}

/// The side process, running.
pub struct Side {
    child: Child,
    /// Lines for its stdin; dropping it closes the stream (after the queue drains).
    lines: Option<Sender<String>>,
    writer: Option<std::thread::JoinHandle<()>>,
    /// Its one answer on stdout (None: it closed stdout without one).
    answer: Receiver<Option<String>>,
    names: String,
    started: Instant,
    /// For the summary: the last loss and eval loss, the tokens and seconds of the steps.
    last_loss: Option<f64>,
    last_eval_loss: Option<f64>,
    last_step: u64,
    tokens: u64,
    step_s: f64,
    dropped: bool,
}

impl Side {
    /// Starts the side process and sends it the run's description: the config as resolved
    /// (`cfg` serialized) and the plan's figures.
    pub fn start(
        r: Resolved,
        cfg: &mt::config::RunConfig,
        plan: &PlanFigures,
        started: Instant,
    ) -> Result<Side> {
        let names = r
            .trackers
            .iter()
            .map(|t| t.name())
            .collect::<Vec<_>>()
            .join(", ");
        let config = serde_json::to_value(cfg)?;
        let start = json!({"start": {
            "trackers": r.trackers.iter().map(|t| t.name()).collect::<Vec<_>>(),
            "run_name": cfg.logging.run_name.clone().unwrap_or_else(|| "megatrain".into()),
            "config": config,
            "plan": {
                "host_ram_total_bytes": plan.host_ram_total_bytes,
                "host_ram_total_gb": plan.host_ram_total_bytes as f64 / 1e9,
                "host_bytes_per_param": plan.host_bytes_per_param,
                "host_ram_available_gb": plan.host_ram_available_bytes.map(|b| b as f64 / 1e9),
                "params": plan.params,
                "world_size": plan.world_size,
                "workers": plan.workers,
                "gpus": plan.gpus,
                "nodes": plan.nodes,
            },
        }});
        let mut child = Command::new(&r.python)
            .args(["-c", SCRIPT])
            .arg(std::process::id().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .spawn()
            .map_err(|e| {
                anyhow!(
                    "logging.report_to: {names}: could not run {} ({e})",
                    r.python.display()
                )
            })?;
        let stdin = child.stdin.take().expect("piped above");
        let stdout = child.stdout.take().expect("piped above");
        let (answer_tx, answer) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            let mut line = String::new();
            let got = std::io::BufReader::new(stdout).read_line(&mut line);
            let _ = answer_tx.send(got.ok().filter(|n| *n > 0).map(|_| line));
        });
        let (lines, rx) = crossbeam_channel::bounded(QUEUE);
        let who = names.clone();
        let writer = std::thread::spawn(move || feed(stdin, rx, &who));
        lines
            .send(start.to_string())
            .map_err(|_| anyhow!("the report_to writer thread ended"))?;
        Ok(Side {
            child,
            lines: Some(lines),
            writer: Some(writer),
            answer,
            names,
            started,
            last_loss: None,
            last_eval_loss: None,
            last_step: 0,
            tokens: 0,
            step_s: 0.0,
            dropped: false,
        })
    }

    /// Waits (at most [`READY_WAIT`]) until the side process has started its runs; its
    /// error otherwise, in one line.
    pub fn wait_ready(&mut self) -> Result<()> {
        let line = match self.answer.recv_timeout(READY_WAIT) {
            Ok(Some(line)) => line,
            Ok(None) | Err(crossbeam_channel::RecvTimeoutError::Disconnected) => bail!(
                "logging.report_to: {}: the side process ended before starting its runs (its messages are above)",
                self.names
            ),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => bail!(
                "logging.report_to: {}: the runs did not start within {} s",
                self.names,
                READY_WAIT.as_secs()
            ),
        };
        let v: Value = serde_json::from_str(&line)
            .map_err(|e| anyhow!("logging.report_to: unexpected answer {line:?} ({e})"))?;
        if let Some(e) = v.get("error").and_then(Value::as_str) {
            bail!("logging.report_to: {e}");
        }
        if let Some(ready) = v.get("ready").and_then(Value::as_object) {
            for (t, at) in ready {
                println!("report_to {t}: {}", at.as_str().unwrap_or_default());
            }
        }
        Ok(())
    }

    /// Queues one step's scalars (training never waits for the side process).
    pub fn step(&mut self, m: &StepMetrics) {
        self.last_step = m.step;
        self.last_loss = Some(m.loss);
        self.tokens += m.tokens;
        self.step_s += m.step_time_s;
        if let Some(e) = &m.eval {
            self.last_eval_loss = Some(e.eval_loss);
        }
        let metrics: serde_json::Map<String, Value> = step_scalars(m)
            .into_iter()
            .map(|(tag, v)| (tag.to_string(), json!(v)))
            .collect();
        self.send(json!({"step": m.step, "metrics": metrics}));
    }

    fn send(&mut self, v: Value) {
        let Some(lines) = &self.lines else { return };
        let full = matches!(
            lines.try_send(v.to_string()),
            Err(crossbeam_channel::TrySendError::Full(_))
        );
        if full && !std::mem::replace(&mut self.dropped, true) {
            tracing::warn!(
                "report_to {}: the side process is {QUEUE} lines behind: steps are left out of it until it catches up",
                self.names
            );
        }
    }

    /// Sends the final figures and `status` (`finished`, `killed`), closes the stream and
    /// waits for the runs to be finished.
    pub fn finish(mut self, status: &str, launcher_peak_rss_bytes: u64) {
        let mut summary = serde_json::Map::new();
        let mut put = |k: &str, v: Value| {
            summary.insert(k.into(), v);
        };
        if let Some(l) = self.last_loss {
            put("final_train_loss", json!(l));
        }
        if let Some(l) = self.last_eval_loss {
            put("final_eval_loss", json!(l));
        }
        put("global_step", json!(self.last_step));
        put("train_runtime", json!(self.started.elapsed().as_secs_f64()));
        if self.step_s > 0.0 {
            put(
                "train_tokens_per_second",
                json!(self.tokens as f64 / self.step_s),
            );
        }
        put(
            "launcher_peak_rss_gb",
            json!(launcher_peak_rss_bytes as f64 / 1e9),
        );
        self.send(json!({ "summary": summary }));
        self.send(json!({ "end": status }));
        // Drop closes the stream and waits.
    }
}

/// Writes the queued lines to the side process's stdin until the queue closes; a write
/// that fails (the side process died) is warned of once and ends the feed.
fn feed(mut stdin: ChildStdin, rx: Receiver<String>, names: &str) {
    for line in rx.iter() {
        let sent = stdin
            .write_all(line.as_bytes())
            .and_then(|_| stdin.write_all(b"\n"))
            .and_then(|_| stdin.flush());
        if let Err(e) = sent {
            tracing::warn!(
                "report_to {names}: the side process stopped taking metrics ({e}): training goes on without it"
            );
            return;
        }
    }
}

impl Drop for Side {
    fn drop(&mut self) {
        // The writer drains the queue, then its end of the pipe closes: end of input.
        self.lines = None;
        if wait_bounded(&mut self.child, FINISH_WAIT).is_none() {
            tracing::warn!(
                "report_to {}: the side process did not finish its runs within {} s: stopped",
                self.names,
                FINISH_WAIT.as_secs()
            );
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}
