//! Step reporting: a progress bar (step, loss, lr, tokens/s, TFLOPS, epoch, memory,
//! elapsed, ETA) when stdout and stderr are terminals, plain log lines every
//! `logging.log_every` steps otherwise (files, pipes, CI, mpirun), and HF Trainer-style
//! summaries at the start and the end of the run.
//! A step after which the eval set was evaluated always gets a line with its eval loss.
//!
//! Every line the launcher prints while a bar is drawn goes through [`out`] or [`err`]
//! (the workers' output and the log's records too, [`LogWriter`]), which print it above
//! the bar instead of into it.

use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use mt::metrics::{Bound, StepMetrics};

/// The bar being drawn, if any: lines printed meanwhile suspend it.
static BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// Runs `print` with the bar, if one is drawn, cleared and redrawn after.
fn above_bar(print: impl FnOnce()) {
    let bar = BAR.lock().unwrap_or_else(|e| e.into_inner()).clone();
    match bar {
        Some(bar) => bar.suspend(print),
        None => print(),
    }
}

/// Prints `line` to stdout (above the bar where one is drawn).
pub fn out(line: &str) {
    above_bar(|| {
        let mut o = std::io::stdout().lock();
        let _ = o.write_all(format!("{line}\n").as_bytes());
        let _ = o.flush();
    });
}

/// Prints `line` to stderr in one write (above the bar where one is drawn): ranks under
/// mpirun share one output, and a line written in pieces can be cut by another's.
pub fn err(line: &str) {
    above_bar(|| {
        let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
    });
}

/// The log's (tracing's) writer: each record is printed whole through [`err`].
pub struct LogWriter;

/// One record's bytes, printed when tracing drops the writer.
pub struct LogRecord(Vec<u8>);

impl Write for LogRecord {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogRecord {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            let text = String::from_utf8_lossy(&self.0);
            err(text.trim_end_matches('\n'));
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogRecord;
    fn make_writer(&'a self) -> LogRecord {
        LogRecord(Vec::new())
    }
}

/// What the start's summary says of a run (HF Trainer's "Running training" block).
pub struct RunFacts<'a> {
    /// Training samples as one epoch passes over them, and their name (samples, packed
    /// rows, blocks, pairs).
    pub examples: (usize, &'a str),
    /// Samples per optimizer step, all workers.
    pub global_batch: usize,
    pub world: usize,
    pub accumulation: usize,
    pub steps: u64,
    /// The step this launch starts from (a resume's).
    pub first: u64,
    pub params: u64,
    /// Where the model goes (None: not written).
    pub model: Option<&'a std::path::Path>,
}

/// `1,234,567`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The start's summary, in HF Trainer's words.
pub fn start_summary(f: &RunFacts, per_epoch: u64) -> String {
    let (n, noun) = f.examples;
    let per_device = f.global_batch / (f.world * f.accumulation).max(1);
    let mut s = String::from("***** Running training *****\n");
    s += &format!("  Num examples = {} ({noun})\n", thousands(n as u64));
    s += &format!(
        "  Num Epochs = {:.2}\n",
        f.steps as f64 / per_epoch.max(1) as f64
    );
    s += &format!("  Instantaneous batch size per device = {per_device}\n");
    s += &format!(
        "  Total train batch size (w. parallel, distributed & accumulation) = {} ({per_device} x {} worker(s) x {} accumulation step(s))\n",
        f.global_batch, f.world, f.accumulation
    );
    s += &format!("  Gradient Accumulation steps = {}\n", f.accumulation);
    s += &format!("  Total optimization steps = {}", thousands(f.steps));
    if f.first > 0 {
        s += &format!(" (resuming after step {})", f.first);
    }
    s += &format!(
        "\n  Number of trainable parameters = {}\n",
        thousands(f.params)
    );
    s += &match f.model {
        Some(dir) => format!("  Model goes to = {}", dir.display()),
        None => "  Model goes to = nowhere (training.save_model: false)".into(),
    };
    s
}

/// `h:mm:ss`.
pub fn hms(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

/// `  optimizer-bound (42% waiting)` when a wait bounded the step, else nothing.
fn bound_note(m: &StepMetrics) -> String {
    let wait = match m.bound {
        Bound::Compute => return String::new(),
        Bound::Optimizer => m.update_wait_s,
        Bound::H2d => m.h2d_wait_s,
        Bound::Reduce => m.slot_wait_s,
        Bound::Exchange => m.update_wait_s.max(m.slot_wait_s),
    };
    format!(
        "  {}-bound ({:.0}% waiting)",
        m.bound.name(),
        100.0 * wait / m.step_time_s.max(1e-9)
    )
}

/// What to change when a step after the first is bounded by the host or PCIe (printed
/// once per run).
fn bound_hint(m: &StepMetrics) -> Option<String> {
    let drives;
    let what = match m.bound {
        Bound::Compute => return None,
        // With the state on the drives, the update mostly waits for them.
        Bound::Optimizer
            if m.drives
                .is_some_and(|d| 2.0 * d.drive_wait_s > m.update_wait_s) =>
        {
            let d = m.drives.expect("checked");
            drives = format!(
                "the workers waited for the host's AdamW, which waited {:.1} s for the drives \
                 (memory.nvme_path: {:.2} GB/s read, {:.2} GB/s write); more drives (striped) \
                 shorten that",
                d.drive_wait_s, d.drive_read_gb_s, d.drive_write_gb_s
            );
            &drives
        }
        Bound::Optimizer => {
            "the workers waited for the host's AdamW, which updates every parameter once per step"
        }
        Bound::H2d => "the workers waited for layer weights to cross PCIe",
        Bound::Reduce => "the workers waited for free gradient slab slots",
        Bound::Exchange => {
            "the workers waited while their launcher exchanged gradients and weights with the other nodes (exchange_s), longer than it reduced and updated"
        }
    };
    Some(format!(
        "note: step {} was {}-bound: {what}; a larger per-GPU batch (or gradient_accumulation_steps) spreads that over more tokens{}",
        m.step,
        m.bound.name(),
        match m.bound {
            Bound::Reduce => ", as does a larger memory.num_grad_slabs",
            Bound::Exchange => ", as does a faster link between the nodes",
            _ => "",
        }
    ))
}

/// Whether the progress bar can be seen: its lines go to stdout, the bar itself to stderr
/// (indicatif draws nothing where stderr is not a terminal). Under mpirun a rank's stdout
/// may be a terminal while its stderr is a pipe: there the bar showed nothing at all.
fn draws_bar(stdout_terminal: bool, stderr_terminal: bool) -> bool {
    stdout_terminal && stderr_terminal
}

pub struct Progress {
    kind: Kind,
    /// Whether the bound hint was printed.
    hinted: std::cell::Cell<bool>,
    /// Optimizer steps per epoch (the sampler's pass over the training set).
    per_epoch: u64,
    /// Workers on GPUs: their peak device memory is shown.
    on_gpu: bool,
    first: u64,
    started: Instant,
    totals: std::cell::Cell<Totals>,
}

/// What this launch's steps added up to, for the end's summary.
#[derive(Debug, Clone, Copy, Default)]
pub struct Totals {
    pub steps: u64,
    pub loss_sum: f64,
    pub last_loss: f64,
    pub tokens: u64,
    pub eval_loss: Option<f64>,
    pub peak_gpu_bytes: u64,
    /// With the optimizer's state on the drives: the steps' bytes read and written, the
    /// seconds their transfers took, the update's wait for them, and the steps' time.
    pub drives: Option<DriveTotals>,
}

/// [`Totals`] of the drives (`memory.optimizer_offload: nvme`).
#[derive(Debug, Clone, Copy, Default)]
pub struct DriveTotals {
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_s: f64,
    pub write_s: f64,
    pub wait_s: f64,
    pub step_s: f64,
}

impl DriveTotals {
    /// `1.00 GB/s read, 0.90 GB/s write (45.70 / 45.70 GB a step), waited 40.8 s (73%)`
    /// over `steps` steps.
    fn summary(&self, steps: u64) -> String {
        let gb = |b: u64| b as f64 / 1e9;
        format!(
            "{:.2} GB/s read, {:.2} GB/s write ({:.2} / {:.2} GB a step); the update waited for \
             them {:.1} s ({:.0}% of the steps' time)",
            gb(self.read_bytes) / self.read_s.max(1e-9),
            gb(self.write_bytes) / self.write_s.max(1e-9),
            gb(self.read_bytes) / steps.max(1) as f64,
            gb(self.write_bytes) / steps.max(1) as f64,
            self.wait_s,
            100.0 * self.wait_s / self.step_s.max(1e-9)
        )
    }
}

enum Kind {
    Bar(ProgressBar),
    Lines { every: u64 },
}

impl Progress {
    /// A bar over steps `first..total` on a terminal, else lines every `every` steps;
    /// `per_epoch` optimizer steps make an epoch.
    pub fn new(first: u64, total: u64, every: u64, per_epoch: u64, on_gpu: bool) -> Progress {
        let progress = |kind| Progress {
            kind,
            hinted: std::cell::Cell::new(false),
            per_epoch: per_epoch.max(1),
            on_gpu,
            first,
            started: Instant::now(),
            totals: std::cell::Cell::new(Totals::default()),
        };
        if !draws_bar(
            std::io::stdout().is_terminal(),
            std::io::stderr().is_terminal(),
        ) {
            return progress(Kind::Lines {
                every: every.max(1),
            });
        }
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template(
                "{pos}/{len} {bar:20.cyan/blue} {elapsed_precise} eta {eta_precise} {wide_msg}",
            )
            .expect("static template"),
        );
        bar.set_position(first);
        bar.reset_eta();
        *BAR.lock().unwrap_or_else(|e| e.into_inner()) = Some(bar.clone());
        progress(Kind::Bar(bar))
    }

    /// Epochs done after `step` optimizer steps (HF Trainer's fractional `epoch`).
    pub fn epoch(&self, step: u64) -> f64 {
        step as f64 / self.per_epoch as f64
    }

    /// This launch's steps so far.
    pub fn totals(&self) -> Totals {
        self.totals.get()
    }

    /// Seconds since the first step was sent.
    pub fn elapsed_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// `epoch 0.50  gpu 1.2 GB  host 3.4 GB  elapsed 0:00:02  eta 0:00:02`.
    fn whereabouts(&self, m: &StepMetrics, total: u64) -> String {
        let elapsed = self.elapsed_s();
        let done = m.step.saturating_sub(self.first).max(1);
        let eta = elapsed / done as f64 * total.saturating_sub(m.step) as f64;
        let gpu = match (self.on_gpu, m.peak_gpu_bytes) {
            (true, b) if b > 0 => format!("  gpu {:.1} GB", b as f64 / 1e9),
            _ => String::new(),
        };
        format!(
            "epoch {:.2}{gpu}  host {:.1} GB  elapsed {}  eta {}",
            self.epoch(m.step),
            m.launcher_peak_rss_bytes as f64 / 1e9,
            hms(elapsed),
            hms(eta)
        )
    }

    pub fn step(&self, m: &StepMetrics, total: u64) {
        let mut t = self.totals.get();
        t.steps += 1;
        t.loss_sum += m.loss;
        t.last_loss = m.loss;
        t.tokens += m.tokens;
        t.eval_loss = m.eval.map(|e| e.eval_loss).or(t.eval_loss);
        t.peak_gpu_bytes = t.peak_gpu_bytes.max(m.peak_gpu_bytes);
        if let Some(d) = &m.drives {
            let mut all = t.drives.unwrap_or_default();
            let secs = |b: u64, gb_s: f64| b as f64 / 1e9 / gb_s.max(1e-9);
            all.read_bytes += d.drive_read_bytes;
            all.write_bytes += d.drive_write_bytes;
            all.read_s += secs(d.drive_read_bytes, d.drive_read_gb_s);
            all.write_s += secs(d.drive_write_bytes, d.drive_write_gb_s);
            all.wait_s += d.drive_wait_s;
            all.step_s += m.step_time_s;
            t.drives = Some(all);
        }
        self.totals.set(t);
        // The first step starts with no update to wait for: judge from the second on.
        if m.step >= 2
            && !self.hinted.get()
            && let Some(hint) = bound_hint(m)
        {
            self.hinted.set(true);
            self.println(&hint);
        }
        // The objective's metrics (a step has DPO's or GRPO's or neither).
        let dpo = m.dpo.map(|d| {
            format!(
                "  rewards: accuracy {:.2} margin {:.4}",
                d.accuracies, d.margins
            )
        });
        let grpo = m.grpo.map(|g| {
            format!(
                "  reward {:.4} (std {:.4})  clipped {:.3}{}",
                g.reward,
                g.reward_std,
                g.clip_ratio_low + g.clip_ratio_high,
                g.kl.map_or(String::new(), |kl| format!("  kl {kl:.4}"))
            )
        });
        let dpo = dpo.or(grpo).unwrap_or_default();
        let eval = m.eval.map(|e| {
            let dpo = e.dpo.map(|d| {
                format!(
                    "  eval rewards: accuracy {:.2} margin {:.4}",
                    d.accuracies, d.margins
                )
            });
            let grpo = e.grpo.map(|g| {
                format!(
                    "  eval reward {:.4}{}",
                    g.eval_reward,
                    g.eval_kl
                        .map_or(String::new(), |kl| format!("  eval kl {kl:.4}"))
                )
            });
            let stage = dpo.or(grpo).unwrap_or_default();
            format!(
                "  eval_loss {:.4} ({} tokens, {:.2}s){stage}",
                e.eval_loss, e.eval_tokens, e.eval_time_s
            )
        });
        match &self.kind {
            Kind::Bar(bar) => {
                if let Some(eval) = &eval {
                    bar.println(format!("step {}/{total}{eval}", m.step));
                }
                let gpu = match (self.on_gpu, m.peak_gpu_bytes) {
                    (true, b) if b > 0 => format!(" gpu {:.1} GB", b as f64 / 1e9),
                    _ => String::new(),
                };
                let drives = m.drives.map_or(String::new(), |d| {
                    format!(
                        " drives {:.2}/{:.2} GB/s ({:.0}% waiting)",
                        d.drive_read_gb_s,
                        d.drive_write_gb_s,
                        100.0 * d.drive_wait_s / m.step_time_s.max(1e-9)
                    )
                });
                bar.set_message(format!(
                    "epoch {:.2} loss {:.4}{dpo} lr {:.2e} {:.0} tok/s {:.1} TFLOPS/dev{gpu} host {:.1} GB{drives}{}{}",
                    self.epoch(m.step),
                    m.loss,
                    m.lr,
                    m.tokens_per_s,
                    m.tflops_megatrain,
                    m.launcher_peak_rss_bytes as f64 / 1e9,
                    bound_note(m),
                    if m.skipped { "  (skipped)" } else { "" }
                ));
                bar.set_position(m.step);
            }
            Kind::Lines { every } => {
                if m.step.is_multiple_of(*every) || m.step == total || eval.is_some() {
                    // Under mpirun: how much of the step went to the exchanges between nodes.
                    let exchange = match (m.exchange_s, m.exchange_wait_s) {
                        (Some(x), Some(w)) => format!("  exchange {x:.2}s (waiting {w:.2}s)"),
                        (Some(x), None) => format!("  exchange {x:.2}s"),
                        _ => String::new(),
                    };
                    // With the optimizer's state on the drives: their rates and the wait.
                    let exchange = match &m.drives {
                        Some(d) => format!(
                            "{exchange}  drives r {:.2} w {:.2} GB/s (waited {:.2}s, {:.0}%)",
                            d.drive_read_gb_s,
                            d.drive_write_gb_s,
                            d.drive_wait_s,
                            100.0 * d.drive_wait_s / m.step_time_s.max(1e-9)
                        ),
                        None => exchange,
                    };
                    println!(
                        "step {:>4}/{}  loss {:.4}{dpo}  lr {:.2e}  grad_norm {:.3}  tokens {}  {:.2}s{exchange}  {:.0} tok/s  {:.1} TFLOPS/dev  {}{}{}",
                        m.step,
                        total,
                        m.loss,
                        m.lr,
                        m.grad_norm,
                        m.tokens,
                        m.step_time_s,
                        m.tokens_per_s,
                        m.tflops_megatrain,
                        self.whereabouts(m, total),
                        bound_note(m),
                        eval.unwrap_or_default()
                    );
                }
            }
        }
    }

    /// The end's summary (HF Trainer's train metrics): runtime, throughput, the mean loss
    /// of this launch's steps and the last one, the last eval loss, peak memory, the model.
    pub fn end_summary(&self, samples_per_step: usize, model: Option<&std::path::Path>) -> String {
        let t = self.totals();
        let runtime = self.elapsed_s();
        let per_s = |x: f64| x / runtime.max(1e-9);
        let mut s = String::from("***** Training finished *****\n");
        s += &format!("  train_runtime = {} ({runtime:.1} s)\n", hms(runtime));
        s += &format!(
            "  train_loss = {:.4} (mean of {} step(s); last {:.4})\n",
            t.loss_sum / t.steps.max(1) as f64,
            t.steps,
            t.last_loss
        );
        if let Some(e) = t.eval_loss {
            s += &format!("  eval_loss = {e:.4}\n");
        }
        s += &format!(
            "  train_samples_per_second = {:.3}\n  train_steps_per_second = {:.3}\n  train_tokens_per_second = {:.0}\n",
            per_s((t.steps as usize * samples_per_step) as f64),
            per_s(t.steps as f64),
            per_s(t.tokens as f64)
        );
        s += &format!("  epoch = {:.2}\n", self.epoch(self.first + t.steps));
        if let Some(d) = &t.drives {
            s += &format!("  drives = {}\n", d.summary(t.steps));
        }
        if self.on_gpu && t.peak_gpu_bytes > 0 {
            s += &format!(
                "  peak GPU memory = {:.2} GB\n",
                t.peak_gpu_bytes as f64 / 1e9
            );
        }
        s += &match model {
            Some(dir) => format!("  model = {}", dir.display()),
            None => "  model = not written (training.save_model: false)".into(),
        };
        s
    }

    /// Prints a line without breaking the bar.
    pub fn println(&self, line: &str) {
        out(line);
    }

    /// Leaves the bar as it ended on its own line (once: later calls do nothing).
    pub fn finish(&self) {
        let drawn = BAR.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let (Kind::Bar(bar), Some(_)) = (&self.kind, drawn) {
            bar.finish();
            let _ = std::io::stderr().write_all(b"\n");
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines unless both streams are terminals (mpirun: stdout a terminal, stderr a pipe).
    #[test]
    fn thousands_are_grouped() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(7_615_616_512), "7,615,616,512");
    }

    #[test]
    fn hours_minutes_seconds() {
        assert_eq!(hms(0.4), "0:00:00");
        assert_eq!(hms(83.0), "0:01:23");
        assert_eq!(hms(3.0 * 3600.0 + 61.0), "3:01:01");
    }

    #[test]
    fn bar_only_where_both_streams_are_terminals() {
        assert!(draws_bar(true, true));
        assert!(!draws_bar(true, false));
        assert!(!draws_bar(false, true));
        assert!(!draws_bar(false, false));
    }
}
