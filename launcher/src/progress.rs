//! Step reporting: a progress bar (step, loss, lr, tokens/s, TFLOPS, ETA) when stdout is a
//! terminal, plain log lines every `logging.log_every` steps otherwise (files, pipes, CI).
//! A step after which the eval set was evaluated always gets a line with its eval loss.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};
use mt::metrics::StepMetrics;

pub enum Progress {
    Bar(ProgressBar),
    Lines { every: u64 },
}

impl Progress {
    /// A bar over steps `first..total` on a terminal, else lines every `every` steps.
    pub fn new(first: u64, total: u64, every: u64) -> Progress {
        if !std::io::stdout().is_terminal() {
            return Progress::Lines {
                every: every.max(1),
            };
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
        Progress::Bar(bar)
    }

    pub fn step(&self, m: &StepMetrics, total: u64) {
        let eval = m.eval.map(|e| {
            format!(
                "  eval_loss {:.4} ({} tokens, {:.2}s)",
                e.eval_loss, e.eval_tokens, e.eval_time_s
            )
        });
        match self {
            Progress::Bar(bar) => {
                if let Some(eval) = &eval {
                    bar.println(format!("step {}/{total}{eval}", m.step));
                }
                bar.set_message(format!(
                    "loss {:.4} lr {:.2e} {:.0} tok/s {:.1} TFLOPS/dev{}",
                    m.loss,
                    m.lr,
                    m.tokens_per_s,
                    m.tflops_megatrain,
                    if m.skipped { "  (skipped)" } else { "" }
                ));
                bar.set_position(m.step);
            }
            Progress::Lines { every } => {
                if m.step.is_multiple_of(*every) || m.step == total || eval.is_some() {
                    println!(
                        "step {:>4}/{}  loss {:.4}  lr {:.2e}  grad_norm {:.3}  tokens {}  {:.2}s  {:.0} tok/s  {:.1} TFLOPS/dev{}",
                        m.step,
                        total,
                        m.loss,
                        m.lr,
                        m.grad_norm,
                        m.tokens,
                        m.step_time_s,
                        m.tokens_per_s,
                        m.tflops_megatrain,
                        eval.unwrap_or_default()
                    );
                }
            }
        }
    }

    /// Prints a line without breaking the bar.
    pub fn println(&self, line: &str) {
        match self {
            Progress::Bar(bar) => bar.println(line),
            Progress::Lines { .. } => println!("{line}"),
        }
    }

    pub fn finish(&self) {
        if let Progress::Bar(bar) = self {
            bar.finish();
        }
    }
}
