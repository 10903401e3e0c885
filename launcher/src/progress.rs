//! Step reporting: a progress bar (step, loss, lr, tokens/s, TFLOPS, ETA) when stdout and
//! stderr are terminals, plain log lines every `logging.log_every` steps otherwise (files,
//! pipes, CI, mpirun).
//! A step after which the eval set was evaluated always gets a line with its eval loss.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};
use mt::metrics::{Bound, StepMetrics};

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
    let what = match m.bound {
        Bound::Compute => return None,
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
}

enum Kind {
    Bar(ProgressBar),
    Lines { every: u64 },
}

impl Progress {
    /// A bar over steps `first..total` on a terminal, else lines every `every` steps.
    pub fn new(first: u64, total: u64, every: u64) -> Progress {
        let hinted = std::cell::Cell::new(false);
        if !draws_bar(
            std::io::stdout().is_terminal(),
            std::io::stderr().is_terminal(),
        ) {
            let kind = Kind::Lines {
                every: every.max(1),
            };
            return Progress { kind, hinted };
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
        Progress {
            kind: Kind::Bar(bar),
            hinted,
        }
    }

    pub fn step(&self, m: &StepMetrics, total: u64) {
        // The first step starts with no update to wait for: judge from the second on.
        if m.step >= 2
            && !self.hinted.get()
            && let Some(hint) = bound_hint(m)
        {
            self.hinted.set(true);
            self.println(&hint);
        }
        let dpo = match (m.dpo, m.grpo) {
            (Some(d), _) => format!(
                "  rewards: accuracy {:.2} margin {:.4}",
                d.accuracies, d.margins
            ),
            (_, Some(g)) => format!(
                "  reward {:.4} (std {:.4})  clipped {:.3}{}",
                g.reward,
                g.reward_std,
                g.clip_ratio_low + g.clip_ratio_high,
                g.kl.map_or(String::new(), |kl| format!("  kl {kl:.4}"))
            ),
            _ => String::new(),
        };
        let eval = m.eval.map(|e| {
            let stage = match (e.dpo, e.grpo) {
                (Some(d), _) => format!(
                    "  eval rewards: accuracy {:.2} margin {:.4}",
                    d.accuracies, d.margins
                ),
                (_, Some(g)) => format!(
                    "  eval reward {:.4}{}",
                    g.eval_reward,
                    g.eval_kl
                        .map_or(String::new(), |kl| format!("  eval kl {kl:.4}"))
                ),
                _ => String::new(),
            };
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
                bar.set_message(format!(
                    "loss {:.4}{dpo} lr {:.2e} {:.0} tok/s {:.1} TFLOPS/dev{}{}",
                    m.loss,
                    m.lr,
                    m.tokens_per_s,
                    m.tflops_megatrain,
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
                    println!(
                        "step {:>4}/{}  loss {:.4}{dpo}  lr {:.2e}  grad_norm {:.3}  tokens {}  {:.2}s{exchange}  {:.0} tok/s  {:.1} TFLOPS/dev{}{}",
                        m.step,
                        total,
                        m.loss,
                        m.lr,
                        m.grad_norm,
                        m.tokens,
                        m.step_time_s,
                        m.tokens_per_s,
                        m.tflops_megatrain,
                        bound_note(m),
                        eval.unwrap_or_default()
                    );
                }
            }
        }
    }

    /// Prints a line without breaking the bar.
    pub fn println(&self, line: &str) {
        match &self.kind {
            Kind::Bar(bar) => bar.println(line),
            Kind::Lines { .. } => println!("{line}"),
        }
    }

    pub fn finish(&self) {
        if let Kind::Bar(bar) = &self.kind {
            bar.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines unless both streams are terminals (mpirun: stdout a terminal, stderr a pipe).
    #[test]
    fn bar_only_where_both_streams_are_terminals() {
        assert!(draws_bar(true, true));
        assert!(!draws_bar(true, false));
        assert!(!draws_bar(false, true));
        assert!(!draws_bar(false, false));
    }
}
