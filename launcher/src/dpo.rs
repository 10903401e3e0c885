//! `training.stage: dpo` in the launcher: the reference log-probabilities and the pairs'
//! metrics. The loss itself is the workers' ([`mt::objective::dpo`], worker/src/head/).
//!
//! The reference model is the initial weights, so no second copy of the model is kept:
//! before the first step, one forward-only pass over the training set (the eval path,
//! [`crate::eval::forward_only`], cut into micro-batches of the training micro-batch's rows
//! in dataset order, worker r taking r, r + W, …, so the values do not depend on the
//! worker count) gives every row's summed label log-probability. They stay in host RAM (8
//! bytes per row, two rows per pair), travel with each micro-batch to the worker that
//! computes it, and go into every checkpoint ([`mt::checkpoint::reference`]); a resume
//! reads them from there. The eval pairs' ([`crate::eval`]) are computed the same way right
//! after, and kept the same way.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use mt::checkpoint::reference::{self, Reference};
use mt::data::{Dataset, Example};

use crate::eval::{ForwardCut, row_logps};
use crate::supervisor::Supervisor;

/// A DPO run's reference log-probabilities (its settings go to the workers in `Init`).
pub struct Preference {
    /// The reference log-probability of every training row.
    pub refs: Vec<f64>,
    /// `dpo_reference.safetensors`, as every checkpoint holds it.
    pub file: Arc<Vec<u8>>,
    /// With an eval set: its rows' reference log-probabilities and
    /// `dpo_eval_reference.safetensors`.
    pub eval: Option<(Vec<f64>, Arc<Vec<u8>>)>,
}

impl Preference {
    /// A server's (`mt-launch serve`): each batch brings its pairs' reference
    /// log-probabilities, none is kept (nor written into checkpoints).
    pub fn served() -> Preference {
        Preference {
            refs: Vec::new(),
            file: Arc::new(Vec::new()),
            eval: None,
        }
    }

    /// The reference log-probabilities of `data`'s rows and of its eval rows: read from
    /// the checkpoint `resume` (which must hold them for these rows), or computed by the
    /// workers under the weights in the store (the initial ones), `rows_per_micro` rows per
    /// micro-batch (`eval_rows_per_micro` for the eval rows, as the evaluation cuts them).
    pub fn new(
        data: &Dataset,
        sup: &mut Supervisor,
        (rows_per_micro, eval_rows_per_micro): (usize, usize),
        pad_id: i32,
        timeout: Duration,
        resume: Option<&Path>,
    ) -> Result<Preference> {
        assert!(data.pairs && rows_per_micro > 0);
        let mut pass = |rows: &[Example], what: &str, eval: bool| -> Result<Reference> {
            let rows_per_micro = match eval {
                true => eval_rows_per_micro,
                false => rows_per_micro,
            };
            let fingerprint = reference::fingerprint(rows);
            let pairs = rows.len() / 2;
            if let Some(dir) = resume {
                let r = match eval {
                    true => Reference::read_eval(dir, &fingerprint)?,
                    false => Reference::read(dir, &fingerprint)?,
                };
                let file = if eval {
                    reference::EVAL_FILE
                } else {
                    reference::FILE
                };
                println!(
                    "DPO reference log-probabilities of {pairs} {what}pairs: read from {}",
                    dir.join(file).display()
                );
                return Ok(r);
            }
            let t = Instant::now();
            let cut = ForwardCut {
                rows: rows_per_micro,
                pad: pad_id,
                timeout,
            };
            let logps = row_logps(rows, sup, cut)?;
            let secs = t.elapsed().as_secs_f64();
            let tokens: usize = rows.iter().map(|r| r.input_ids.len()).sum();
            println!(
                "DPO reference pass: {pairs} {what}pairs ({} rows, {tokens} tokens) forward only in {secs:.2}s ({:.0} tokens/s)",
                rows.len(),
                tokens as f64 / secs.max(1e-9)
            );
            tracing::info!(
                pairs,
                eval,
                rows = rows.len(),
                reference_pass_s = format!("{secs:.3}"),
                "DPO reference pass"
            );
            Ok(Reference {
                logps,
                data: fingerprint,
            })
        };
        let r = pass(&data.rows, "", false)?;
        let eval = match data.eval.is_empty() {
            true => None,
            false => {
                let e = pass(&data.eval, "eval ", true)?;
                Some((e.logps.clone(), Arc::new(e.to_bytes())))
            }
        };
        Ok(Preference {
            file: Arc::new(r.to_bytes()),
            refs: r.logps,
            eval,
        })
    }
}
