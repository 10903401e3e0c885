//! The worker supervisor: spawns one `mt-worker` per rank in its own process group, passes
//! it the shared-memory fds, bootstraps its channel, forwards its stderr prefixed by rank,
//! and turns everything a worker can do (send a message, close its channel, exit, hang)
//! into one ordered stream of events. Nothing waits forever: every wait has a timeout and
//! checks that the children are alive.

use std::io::{BufRead, BufReader};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, unbounded};
use ipc_channel::ipc::{IpcOneShotServer, IpcSender};
use mt::protocol::{ENV_BOOTSTRAP, ENV_RANK, FromWorker, Init, ToWorker};

use crate::torch::Worker;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// How long a worker may take to connect and to report ready (loading CUDA can be slow).
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// Grace period between SIGTERM and SIGKILL.
const GRACE: Duration = Duration::from_secs(3);
/// How often liveness is checked while waiting.
const TICK: Duration = Duration::from_millis(100);

pub enum Event {
    Msg(usize, FromWorker),
    /// The worker's channel closed (it exited or crashed).
    Closed(usize),
}

struct WorkerProc {
    child: Child,
    tx: IpcSender<ToWorker>,
}

pub struct Supervisor {
    workers: Vec<WorkerProc>,
    /// The slowest worker's host registration and warm-up at start (seconds).
    pub register_s: f64,
    pub warm_up_s: f64,
    events: Receiver<Event>,
    /// When each worker last sent a message (its start before that).
    last_heard: Vec<Instant>,
    /// The kernel's OOM-kill count when the workers started, and the host plan's total:
    /// a worker killed by SIGKILL after the count moved is reported as out of memory.
    oom_kills_at_start: Option<u64>,
    host_plan_bytes: u64,
    /// Until every worker is ready, a SIGINT / SIGTERM ends the wait at once
    /// ([`crate::unix::check_stop`]); after, the step loop stops at a step boundary.
    starting: bool,
}

impl Supervisor {
    /// Starts `inits.len()` workers and waits until each reports `Ready`. `host_plan_bytes`
    /// (the host plan's total) is named if a worker is killed for want of memory.
    pub fn start(worker: &Worker, inits: Vec<Init>, host_plan_bytes: u64) -> Result<Supervisor> {
        let (ev_tx, events) = unbounded();
        let mut sup = Supervisor {
            workers: Vec::new(),
            events,
            last_heard: Vec::new(),
            oom_kills_at_start: mt::sysmem::oom_kills(),
            host_plan_bytes,
            register_s: 0.0,
            warm_up_s: 0.0,
            starting: true,
        };
        for init in inits {
            let w = spawn_one(worker, init, &ev_tx)?;
            sup.workers.push(w);
            sup.last_heard.push(Instant::now());
        }
        drop(ev_tx);
        let mut ready = vec![false; sup.workers.len()];
        while ready.iter().any(|r| !r) {
            match sup.next_event(START_TIMEOUT, &|r| !ready[r])? {
                Event::Msg(
                    r,
                    FromWorker::Ready {
                        device,
                        register_s,
                        warm_up_s,
                    },
                ) => {
                    tracing::debug!(rank = r, %device, register_s, warm_up_s, "worker ready");
                    sup.register_s = sup.register_s.max(register_s);
                    sup.warm_up_s = sup.warm_up_s.max(warm_up_s);
                    ready[r] = true;
                }
                Event::Msg(r, FromWorker::Fatal { msg }) => return Err(fatal(r, &msg)),
                Event::Msg(r, other) => bail!("worker rank {r} sent {other:?} before Ready"),
                Event::Closed(r) => return Err(sup.death(r)),
            }
        }
        sup.starting = false;
        Ok(sup)
    }

    pub fn world(&self) -> usize {
        self.workers.len()
    }

    /// Sends `msg` to worker `rank`; if it cannot be reached, says why it stopped: its own
    /// report if it sent one (the broken pipe then adds nothing), else how it died.
    pub fn send(&mut self, rank: usize, msg: ToWorker) -> Result<()> {
        match self.workers[rank].tx.send(msg) {
            Ok(()) => Ok(()),
            Err(e) => Err(match self.reported_failure(rank) {
                Some(report) => report,
                None => self
                    .death(rank)
                    .context(format!("cannot reach worker rank {rank} ({e:?})")),
            }),
        }
    }

    /// Sends a message built by `msg` to every worker.
    pub fn broadcast(&mut self, msg: impl Fn() -> ToWorker) -> Result<()> {
        (0..self.workers.len()).try_for_each(|r| self.send(r, msg()))
    }

    /// The next event if one is already waiting (a worker's death is reported by the next
    /// [`Supervisor::next_event`]).
    pub fn try_event(&mut self) -> Option<Event> {
        let ev = self.events.try_recv().ok()?;
        if let Event::Msg(r, _) = &ev {
            self.last_heard[*r] = Instant::now();
        }
        Some(ev)
    }

    /// The next event. Fails if a worker died, or if `timeout` passes without any event
    /// while the caller waits on the ranks for which `waiting` holds: a hung worker is
    /// treated like a crashed one. The one blamed is the waited-on worker heard from least
    /// recently.
    pub fn next_event(
        &mut self,
        timeout: Duration,
        waiting: &dyn Fn(usize) -> bool,
    ) -> Result<Event> {
        // A timeout too large to add is no timeout.
        let deadline = Instant::now().checked_add(timeout);
        loop {
            match self.events.recv_timeout(TICK) {
                Ok(ev) => {
                    if let Event::Msg(r, _) = &ev {
                        self.last_heard[*r] = Instant::now();
                    }
                    return Ok(ev);
                }
                Err(RecvTimeoutError::Disconnected) => bail!("all worker channels closed"),
                Err(RecvTimeoutError::Timeout) => {}
            }
            if self.starting {
                crate::unix::check_stop("worker start-up")?;
            }
            for r in 0..self.workers.len() {
                if let Ok(Some(_)) = self.workers[r].child.try_wait() {
                    return Err(self.exit_report(r));
                }
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                let silent = (0..self.workers.len())
                    .filter(|&r| waiting(r))
                    .min_by_key(|&r| self.last_heard[r]);
                let Some(r) = silent else {
                    bail!(
                        "timed out after {} s waiting for the workers",
                        timeout.as_secs()
                    );
                };
                bail!(
                    "worker rank {r} (pid {}) timed out after {} s without a message; treated as a crash",
                    self.workers[r].child.id(),
                    timeout.as_secs()
                );
            }
        }
    }

    /// Why worker `rank`, found exited (or unreachable) before its channel was seen to
    /// close, stopped: the `Fatal` it sent just before, if it is still on its way (a worker
    /// that fails reports, then exits), else how it died.
    fn exit_report(&mut self, rank: usize) -> anyhow::Error {
        self.reported_failure(rank)
            .unwrap_or_else(|| self.death(rank))
    }

    /// The `Fatal` worker `rank` sent before it stopped, waiting up to a second for it to
    /// arrive; `None` if its channel closed without one.
    fn reported_failure(&mut self, rank: usize) -> Option<anyhow::Error> {
        let deadline = Instant::now() + Duration::from_secs(1);
        while let Ok(ev) = self.events.recv_deadline(deadline) {
            match ev {
                Event::Msg(r, FromWorker::Fatal { msg }) if r == rank => {
                    return Some(fatal(rank, &msg));
                }
                Event::Closed(r) if r == rank => break,
                _ => {}
            }
        }
        None
    }

    /// Describes how worker `rank` died (waiting briefly for its exit status).
    pub fn death(&mut self, rank: usize) -> anyhow::Error {
        let w = &mut self.workers[rank];
        let pid = w.child.id();
        let deadline = Instant::now() + Duration::from_secs(2);
        let status = loop {
            match w.child.try_wait() {
                Ok(Some(s)) => break Some(s),
                _ if Instant::now() >= deadline => break None,
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let how = match status {
            Some(s) => match (s.code(), s.signal()) {
                (_, Some(sig)) if sig == Signal::SIGKILL as i32 => {
                    format!("was killed by signal SIGKILL{}", self.oom_note())
                }
                (_, Some(sig)) => format!(
                    "was killed by signal {}",
                    Signal::try_from(sig).map(|s| s.as_str()).unwrap_or("?")
                ),
                (Some(c), _) => format!("exited with status {c}"),
                _ => "exited".into(),
            },
            None => "closed its channel".into(),
        };
        anyhow!("worker rank {rank} (pid {pid}) {how}")
    }

    /// Why a SIGKILL was likely the kernel's OOM killer, if its kill count moved since the
    /// workers started; empty otherwise.
    fn oom_note(&self) -> String {
        let (Some(before), Some(now)) = (self.oom_kills_at_start, mt::sysmem::oom_kills()) else {
            return String::new();
        };
        if now <= before {
            return String::new();
        }
        let gb = |b: u64| b as f64 / 1e9;
        let avail = mt::sysmem::available_host_bytes()
            .map_or("unknown".into(), |a| format!("{:.2} GB", gb(a)));
        format!(
            ": the host ran out of memory (the kernel's OOM killer ran {} time(s) during this run: \
             oom_kill in /proc/vmstat went from {before} to {now}). The launcher's plan holds \
             {:.2} GB (`mt-launch plan`), plus each worker's own memory; MemAvailable is {avail} \
             now. Free host memory, or lower the bytes per parameter (memory.grad_dtype: bfloat16 with \
             memory.master_weights: split for 14, or bfloat16 for 12)",
            now - before,
            gb(self.host_plan_bytes)
        )
    }

    /// Asks every worker to stop, then makes sure they do.
    pub fn shutdown(mut self) {
        self.stop();
    }

    /// [`Supervisor::shutdown`] where the supervisor is still needed after (a worker was
    /// lost, and the launcher writes a checkpoint before it fails).
    pub fn stop(&mut self) {
        for w in &self.workers {
            let _ = w.tx.send(ToWorker::Shutdown);
        }
        self.reap(GRACE);
    }

    /// Test hook: `MT_TEST_KILL_WORKER=<rank>:<step>` kills worker `rank` with SIGKILL as
    /// the launcher sends it step `step` (counted from 1), as the kernel's OOM killer or a
    /// failing GPU would (launcher/tests/keep.rs).
    pub fn kill_hook(&mut self, step: u64) {
        let at = mt::switches::testing::kill_worker_at(step);
        if let Some(rank) = at.filter(|&r| r < self.workers.len()) {
            let pid = Pid::from_raw(self.workers[rank].child.id() as i32);
            tracing::debug!(rank, step, "MT_TEST_KILL_WORKER: SIGKILL");
            let _ = kill(pid, Signal::SIGKILL);
        }
    }

    /// Waits up to `grace` for every worker, then SIGTERMs, waits again, and SIGKILLs.
    fn reap(&mut self, grace: Duration) {
        let wait_all = |ws: &mut Vec<WorkerProc>, d: Duration| {
            let deadline = Instant::now() + d;
            while ws
                .iter_mut()
                .any(|w| matches!(w.child.try_wait(), Ok(None)))
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        wait_all(&mut self.workers, grace);
        for sig in [Signal::SIGTERM, Signal::SIGKILL] {
            let alive: Vec<u32> = self
                .workers
                .iter_mut()
                .filter_map(|w| matches!(w.child.try_wait(), Ok(None)).then(|| w.child.id()))
                .collect();
            if alive.is_empty() {
                return;
            }
            for pid in alive {
                let _ = kill(Pid::from_raw(pid as i32), sig);
            }
            wait_all(&mut self.workers, GRACE);
        }
        for w in &mut self.workers {
            let _ = w.child.wait();
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.reap(Duration::ZERO);
    }
}

/// The error for a worker's `Fatal`: its line, said once.
pub fn fatal(rank: usize, msg: &str) -> anyhow::Error {
    anyhow!("worker rank {rank} failed: {msg}")
}

/// torch's CUDA allocator settings (read once, when the worker first touches CUDA).
const ENV_TORCH_ALLOC: &str = "PYTORCH_CUDA_ALLOC_CONF";

fn spawn_one(worker: &Worker, init: Init, events: &Sender<Event>) -> Result<WorkerProc> {
    let bin = &worker.bin;
    let rank = init.rank;
    let (server, name) =
        IpcOneShotServer::<FromWorker>::new().context("create bootstrap server")?;
    let mut cmd = Command::new(bin);
    cmd.env(ENV_BOOTSTRAP, &name)
        .env(ENV_RANK, rank.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    if let Some(path) = worker.library_path() {
        cmd.env("LD_LIBRARY_PATH", path);
    }
    if std::env::var_os("RUST_LOG").is_none()
        && tracing::level_filters::LevelFilter::current() >= tracing::Level::DEBUG
    {
        // `--log-level debug` reaches the workers: libtorch's full messages, panics.
        cmd.env(
            "RUST_LOG",
            tracing::level_filters::LevelFilter::current().to_string(),
        );
    }
    if std::env::var_os(ENV_TORCH_ALLOC).is_none() {
        // The worker's allocations change size with every block it streams; expandable
        // segments keep torch's cache from fragmenting into more memory than it holds.
        cmd.env(ENV_TORCH_ALLOC, "expandable_segments:True");
    }
    let mut fds = vec![init.store.fd, init.slab.fd];
    if let Some(r) = &init.resident {
        fds.extend([r.grad.fd, r.transfer.fd]);
    }
    fds.extend(init.vision.as_ref().map(|v| v.region.fd));
    mt::shm::keep_fds_across_exec(&mut cmd, fds);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("start worker rank {rank} ({})", bin.display()))?;
    for pipe in [
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
        child.stderr.take().map(|p| Box::new(p) as _),
    ]
    .into_iter()
    .flatten()
    {
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                crate::progress::err(&format!("[rank {rank}] {line}"));
            }
        });
    }

    // accept() blocks; run it on a thread and wait with a timeout while watching the child.
    let (acc_tx, acc_rx) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        let _ = acc_tx.send(server.accept());
    });
    let deadline = Instant::now() + START_TIMEOUT;
    let (rx, hello) = loop {
        match acc_rx.recv_timeout(TICK) {
            Ok(r) => break r.map_err(|e| anyhow!("worker rank {rank} bootstrap failed: {e:?}"))?,
            Err(_) if Instant::now() >= deadline => {
                bail!("worker rank {rank} did not connect within {START_TIMEOUT:?}")
            }
            Err(_) => {
                if let Some(status) = child.try_wait()? {
                    bail!("worker rank {rank} exited during start-up ({status})");
                }
                if let Err(stop) = crate::unix::check_stop("worker start-up") {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(stop);
                }
            }
        }
    };
    let tx = match hello {
        FromWorker::Hello { commands, .. } => commands,
        other => bail!("worker rank {rank} sent {other:?} instead of Hello"),
    };
    tx.send(ToWorker::Init(Box::new(init)))
        .map_err(|e| anyhow!("send Init to rank {rank}: {e:?}"))?;
    let events = events.clone();
    std::thread::spawn(move || {
        while let Ok(msg) = rx.recv() {
            if events.send(Event::Msg(rank, msg)).is_err() {
                return;
            }
        }
        let _ = events.send(Event::Closed(rank));
    });
    Ok(WorkerProc { child, tx })
}
