//! Per-step metrics: one JSON object per line per optimizer step, and the FLOPs accounting;
//! the same scalars as TensorBoard events ([`tensorboard`]) and as a picture ([`plot`]).

pub mod plot;
pub mod tensorboard;

use std::io::Write;
use std::path::Path;

use serde::Serialize;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    /// 1-based optimizer step.
    pub step: u64,
    /// Mean token loss over the global batch.
    pub loss: f64,
    pub lr: f64,
    /// Global gradient 2-norm before clipping.
    pub grad_norm: f64,
    /// Unmasked label tokens in the global batch.
    pub tokens: u64,
    pub step_time_s: f64,
    pub tokens_per_s: f64,
    /// Slowest worker's forward and backward time.
    pub forward_s: f64,
    pub backward_s: f64,
    /// Slowest worker's wait for a free gradient slab slot. On GPU the host runs ahead of
    /// the device, so this mostly measures waiting for the GPU to finish the layers whose
    /// gradients occupy the slots; it points at the host reduce only when reduce_s is large.
    pub slot_wait_s: f64,
    /// Launcher time in the slab reduce and in clip + AdamW.
    pub reduce_s: f64,
    pub optimizer_s: f64,
    /// Under mpirun, launcher time in the exchanges between nodes: the gradient
    /// reduce-scatter (or all-gather), the norm and loss gathers and the all-gather of the
    /// updated store; `reduce_s` and `optimizer_s` leave it out. Absent on one node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exchange_s: Option<f64>,
    /// Of `exchange_s`, the time this node waited for the others to reach the exchanges
    /// (their lateness: a slower node, or its workers); the rest is the transfer itself.
    /// Absent on one node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exchange_wait_s: Option<f64>,
    /// Slowest worker's stall on host-to-device layer copies, and its device-to-host
    /// gradient copy time (GPU only).
    pub h2d_wait_s: f64,
    pub d2h_s: f64,
    /// Slowest worker's wait for the launcher's update of the blocks it reads (the
    /// previous step's AdamW, which runs behind this step's forward).
    pub update_wait_s: f64,
    /// A vision-language step: the slowest worker's time on its micro-batches' images before
    /// their forward (files read, decoded and resized on the CPU, pixels uploaded, the
    /// tower launched); absent without images.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images_s: Option<f64>,
    /// The most decoder layers a micro-batch of the step kept its MLP activations for
    /// (`memory.recompute`), the backward recomputing only their attention half; absent
    /// where none did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_layers: Option<usize>,
    /// Launcher time spent on background checkpoints: staging the blocks the writer had
    /// not written before the optimizer changed them, waiting for it where the staging
    /// area was full, and waiting for the previous write at a checkpoint. The workers
    /// wait for it in `update_wait_s` (or, at a checkpoint, the next step starts later).
    pub checkpoint_wait_s: f64,
    /// With `memory.optimizer_offload: nvme`: the optimizer state's traffic to and from the
    /// drives in this step and the time the update waited for them.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub drives: Option<DriveMetrics>,
    /// What bounded the step ([`Bound`]): the largest of the waits above when it is at
    /// least [`Bound::SHARE`] of the step, else the workers' own compute.
    pub bound: Bound,
    /// Largest device memory in use on any worker's GPU; for CPU workers, the largest
    /// rise of a worker's resident memory within the step (what `mt-launch plan` estimates
    /// for `--gpus 0`).
    pub peak_gpu_bytes: u64,
    /// Of which the CUDA context, cuBLAS and torch's first segment, in use before the
    /// worker allocated anything (`peak_gpu_bytes` minus this is what `mt-launch plan`
    /// estimates).
    pub gpu_context_bytes: u64,
    /// The launcher's resident host memory, and its peak since start (VmHWM): what the
    /// host plan's total promises to bound.
    pub launcher_rss_bytes: u64,
    pub launcher_peak_rss_bytes: u64,
    /// Seconds from launch to the workers' readiness (the first step of a run only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub startup_s: Option<f64>,
    /// Per GPU (or CPU worker), MegaTrain's formula: 6 x all parameters x batch_size x
    /// padded sequence length / step time.
    pub tflops_megatrain: f64,
    /// Per GPU (or CPU worker), model FLOPs: 6 x matmul parameters (of MoE layers, the
    /// routed experts only) x real (non-padding) tokens, plus causal attention (QK^T and
    /// AV, forward and backward) over them in the softmax-attention layers. Gated DeltaNet
    /// layers count their projections only (in the matmul parameters), not the delta rule:
    /// its chunked form (worker/src/model/gated_delta/chunked.rs) multiplies, per token and
    /// value head, about C (Dk + Dv) + 3 Dk Dv + C Dv + 2 C Dk / r MACs forward (C = 64 the
    /// chunk, r value heads per key head), so for Qwen3.5-27B (48 value heads of 128) ~23
    /// MFLOP per token and layer forward and backward, 1% of the 2.3 GFLOP of its
    /// projections and MLP; left out as MegaTrain leaves it out, which keeps the figure
    /// comparable. A vision-language step adds its vision tower's forward over the step's
    /// images (`TowerSpec::forward_flops`: frozen, it runs forward only).
    pub tflops_model: f64,
    /// The update was skipped: the loss or the gradient norm was not finite.
    pub skipped: bool,
    /// After an evaluation (every `training.eval_steps` and after the last step): the eval
    /// set's loss under this step's updated weights (the mean token loss; under `dpo` and
    /// `grpo` the stage's loss, with its metrics), its label tokens, and the seconds it took.
    #[serde(flatten)]
    pub eval: Option<EvalMetrics>,
    /// `training.stage: dpo`: the pairs' rewards (TRL's names; `loss` is then the mean
    /// DPO loss over the step's pairs).
    #[serde(flatten)]
    pub dpo: Option<DpoMetrics>,
    /// `training.stage: grpo`: the step's completions (TRL's names; `loss` is then the
    /// step's GRPO loss).
    #[serde(flatten)]
    pub grpo: Option<GrpoMetrics>,
}

/// A step's traffic to and from the drives holding the optimizer's state: bytes, the rate
/// the transfers achieved (bytes over the time they took), and the seconds the update
/// waited for them (a read not yet complete, a buffer still being written).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DriveMetrics {
    pub drive_read_bytes: u64,
    pub drive_write_bytes: u64,
    pub drive_read_gb_s: f64,
    pub drive_write_gb_s: f64,
    pub drive_wait_s: f64,
}

/// A GRPO step's completions as TRL logs them: their rewards' mean and (unbiased) standard
/// deviation, their mean length, and the share of completion tokens whose ratio was
/// clipped (below with a negative advantage, above with a positive one).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GrpoMetrics {
    pub reward: f64,
    pub reward_std: f64,
    #[serde(rename = "completions/mean_length")]
    pub mean_length: f64,
    #[serde(rename = "clip_ratio/low_mean")]
    pub clip_ratio_low: f64,
    #[serde(rename = "clip_ratio/high_mean")]
    pub clip_ratio_high: f64,
    /// With `grpo.beta` > 0: the mean per-token KL (k3) to the reference model over the
    /// step's completion tokens (TRL's `kl`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl: Option<f64>,
}

impl GrpoMetrics {
    /// The step's metrics from its completions' sums and rewards; `kl`: whether the run has
    /// a KL term.
    pub fn of(s: &crate::objective::GrpoSums, rewards: &[f64], kl: bool) -> GrpoMetrics {
        let n = rewards.len().max(1) as f64;
        let mean = rewards.iter().sum::<f64>() / n;
        let ss: f64 = rewards.iter().map(|r| (r - mean) * (r - mean)).sum();
        let tokens = s.tokens.max(1) as f64;
        GrpoMetrics {
            reward: mean,
            reward_std: (ss / (n - 1.0).max(1.0)).sqrt(),
            mean_length: s.tokens as f64 / s.completions.max(1) as f64,
            clip_ratio_low: s.clipped_low as f64 / tokens,
            clip_ratio_high: s.clipped_high as f64 / tokens,
            kl: kl.then(|| s.kl / tokens),
        }
    }
}

/// The rewards of a DPO step's pairs, means over its pairs as TRL logs them: a response's
/// reward is β (log π − log π_ref) of its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DpoMetrics {
    #[serde(rename = "rewards/chosen")]
    pub chosen: f64,
    #[serde(rename = "rewards/rejected")]
    pub rejected: f64,
    /// Share of pairs whose chosen reward is the larger.
    #[serde(rename = "rewards/accuracies")]
    pub accuracies: f64,
    /// Mean of chosen − rejected.
    #[serde(rename = "rewards/margins")]
    pub margins: f64,
    /// Means of the policy's summed log-probabilities of the chosen and rejected responses.
    #[serde(rename = "logps/chosen")]
    pub logps_chosen: f64,
    #[serde(rename = "logps/rejected")]
    pub logps_rejected: f64,
}

impl DpoMetrics {
    /// The means of a step's sums.
    pub fn of(s: &crate::objective::DpoSums) -> DpoMetrics {
        let n = s.pairs.max(1) as f64;
        DpoMetrics {
            chosen: s.chosen_reward / n,
            rejected: s.rejected_reward / n,
            accuracies: s.accurate as f64 / n,
            margins: (s.chosen_reward - s.rejected_reward) / n,
            logps_chosen: s.chosen_logps / n,
            logps_rejected: s.rejected_logps / n,
        }
    }
}

/// An evaluation: the eval set's loss (the mean token cross-entropy; under `dpo` the mean
/// DPO loss over its pairs; under `grpo` its GRPO loss under the current policy), its label
/// tokens, the seconds it took, and the stage's metrics (HF Trainer's `eval_` prefix on
/// TRL's names).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct EvalMetrics {
    pub eval_loss: f64,
    pub eval_tokens: u64,
    pub eval_time_s: f64,
    #[serde(flatten)]
    pub dpo: Option<EvalDpoMetrics>,
    #[serde(flatten)]
    pub grpo: Option<EvalGrpoMetrics>,
}

/// [`DpoMetrics`] of the eval pairs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EvalDpoMetrics {
    #[serde(rename = "eval_rewards/chosen")]
    pub chosen: f64,
    #[serde(rename = "eval_rewards/rejected")]
    pub rejected: f64,
    #[serde(rename = "eval_rewards/accuracies")]
    pub accuracies: f64,
    #[serde(rename = "eval_rewards/margins")]
    pub margins: f64,
    #[serde(rename = "eval_logps/chosen")]
    pub logps_chosen: f64,
    #[serde(rename = "eval_logps/rejected")]
    pub logps_rejected: f64,
}

impl From<DpoMetrics> for EvalDpoMetrics {
    fn from(d: DpoMetrics) -> EvalDpoMetrics {
        EvalDpoMetrics {
            chosen: d.chosen,
            rejected: d.rejected,
            accuracies: d.accuracies,
            margins: d.margins,
            logps_chosen: d.logps_chosen,
            logps_rejected: d.logps_rejected,
        }
    }
}

/// The eval rollouts' mean reward (fixed by the file) and, with `grpo.beta` > 0, their mean
/// per-token KL to the reference under the current policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EvalGrpoMetrics {
    pub eval_reward: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_kl: Option<f64>,
}

/// What held a step back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    /// The workers computed all along: a larger batch would not raise the utilization.
    Compute,
    /// Workers waited for the host's AdamW (`update_wait_s`): the update of all
    /// parameters takes longer than the forward; a larger batch (or more accumulation)
    /// spreads it over more tokens.
    Optimizer,
    /// Workers waited for weights to cross PCIe (`h2d_wait_s`): at this batch a layer's
    /// compute is shorter than its copy; a larger batch hides the copies.
    H2d,
    /// Workers waited for the launcher to free gradient slab slots (`slot_wait_s`): the
    /// host reduce lags the backward; more `memory.num_grad_slabs` or a larger batch help.
    Reduce,
    /// Under mpirun, workers waited for the update or for slots while their launcher moved
    /// gradients and weights between nodes, and that transfer took longer than its own
    /// reduce and update ([`Bound::with_exchange`]): a faster link, or a larger batch per
    /// node, helps.
    Exchange,
}

impl Bound {
    /// The share of the step a wait must reach to be named.
    pub const SHARE: f64 = 0.10;

    /// The largest wait of a step of `step_s` seconds, if it reaches [`Bound::SHARE`].
    pub fn of(step_s: f64, update_wait_s: f64, h2d_wait_s: f64, slot_wait_s: f64) -> Bound {
        let waits = [
            (Bound::Optimizer, update_wait_s),
            (Bound::H2d, h2d_wait_s),
            (Bound::Reduce, slot_wait_s),
        ];
        let (bound, wait) = waits
            .into_iter()
            .fold((Bound::Compute, 0.0), |a, b| if b.1 > a.1 { b } else { a });
        match wait >= Bound::SHARE * step_s {
            true => bound,
            false => Bound::Compute,
        }
    }

    /// A wait for the launcher ([`Bound::Optimizer`] or [`Bound::Reduce`]) named as the
    /// exchange between nodes where the launcher spent longer moving data (`transfer_s`:
    /// `exchange_s` less its wait for the other nodes) than reducing and updating
    /// (`host_s`: `reduce_s` + `optimizer_s`, which leave the exchanges out).
    pub fn with_exchange(self, transfer_s: f64, host_s: f64) -> Bound {
        match self {
            Bound::Optimizer | Bound::Reduce if transfer_s > host_s => Bound::Exchange,
            other => other,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Bound::Compute => "compute",
            Bound::Optimizer => "optimizer",
            Bound::H2d => "h2d",
            Bound::Reduce => "reduce",
            Bound::Exchange => "exchange",
        }
    }
}

/// The FLOPs of one step, from its shape.
#[derive(Debug, Clone, Copy)]
pub struct StepFlops {
    pub megatrain: f64,
    pub model: f64,
}

/// Computes [`StepFlops`]. `params` counts every parameter; `matmul_params` excludes the
/// embedding table when it is only looked up (it is a matmul when tied to lm_head);
/// `attn_width` is heads x head dim; `causal_pairs` is Σ over rows of T(T+1)/2 for each
/// row's real length T.
pub fn step_flops(
    params: u64,
    matmul_params: u64,
    layers: u64,
    attn_width: u64,
    padded_tokens: u64,
    real_tokens: u64,
    causal_pairs: u64,
) -> StepFlops {
    let megatrain = 6.0 * params as f64 * padded_tokens as f64;
    // Forward: QK^T and AV are 2 FLOPs per (query, key, channel) pair each; backward 2x.
    let attention = 3.0 * 4.0 * (layers * attn_width) as f64 * causal_pairs as f64;
    let model = 6.0 * matmul_params as f64 * real_tokens as f64 + attention;
    StepFlops { megatrain, model }
}

/// This process's resident set size, from /proc (0 where unavailable).
pub fn rss_bytes() -> u64 {
    proc_status_bytes("VmRSS:")
}

/// This process's peak resident set size since it started (VmHWM; 0 where unavailable).
pub fn peak_rss_bytes() -> u64 {
    proc_status_bytes("VmHWM:")
}

/// A `kB` field of /proc/self/status, in bytes.
fn proc_status_bytes(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| status_field_bytes(&s, key))
        .unwrap_or(0)
}

/// A `kB` field of a /proc/PID/status text, in bytes (0 when absent).
fn status_field_bytes(status: &str, key: &str) -> u64 {
    status
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// Appends metrics as JSON lines.
pub struct MetricsWriter {
    file: std::fs::File,
    path: std::path::PathBuf,
}

impl MetricsWriter {
    /// Creates (or truncates) the metrics file, and its directory if missing.
    pub fn create(path: &Path) -> Result<MetricsWriter> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        Ok(MetricsWriter {
            file,
            path: path.into(),
        })
    }

    pub fn write(&mut self, m: &StepMetrics) -> Result<()> {
        let line = serde_json::to_string(m).map_err(|e| Error::Other(format!("metrics: {e}")))?;
        writeln!(self.file, "{line}")
            .and_then(|_| self.file.flush())
            .map_err(|e| Error::io(&self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_add_up() {
        // One row of 4 tokens: 10 causal pairs.
        let f = step_flops(100, 80, 2, 8, 6, 4, 10);
        assert_eq!(f.megatrain, 6.0 * 100.0 * 6.0);
        assert_eq!(f.model, 6.0 * 80.0 * 4.0 + 12.0 * 16.0 * 10.0);
        assert!(rss_bytes() > 0);
        // One read of the status file: two reads race other test threads'
        // allocations, while the kernel computes VmHWM >= VmRSS in one read.
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let (rss, peak) = (
            status_field_bytes(&status, "VmRSS:"),
            status_field_bytes(&status, "VmHWM:"),
        );
        assert!(rss > 0 && peak >= rss, "VmRSS {rss}, VmHWM {peak}");
    }

    #[test]
    fn the_largest_wait_names_the_bound_once_it_is_a_tenth_of_the_step() {
        assert_eq!(Bound::of(10.0, 0.5, 0.9, 0.2), Bound::Compute);
        assert_eq!(Bound::of(10.0, 4.0, 1.5, 0.2), Bound::Optimizer);
        assert_eq!(Bound::of(10.0, 0.5, 1.5, 1.0), Bound::H2d);
        assert_eq!(Bound::of(10.0, 0.0, 0.0, 1.0), Bound::Reduce);
        assert_eq!(Bound::of(10.0, 0.0, 0.0, 0.0), Bound::Compute);
        // A launcher-side wait whose launcher mostly moved data between nodes.
        let slots = Bound::of(20.0, 2.0, 0.0, 9.0);
        assert_eq!(slots.with_exchange(16.0, 4.0), Bound::Exchange);
        assert_eq!(slots.with_exchange(3.0, 4.0), Bound::Reduce);
        assert_eq!(
            Bound::of(10.0, 4.0, 1.5, 0.2).with_exchange(5.0, 1.0),
            Bound::Exchange
        );
        // Not a wait for the launcher: left as it is.
        assert_eq!(
            Bound::of(10.0, 0.5, 1.5, 1.0).with_exchange(9.0, 0.1),
            Bound::H2d
        );
        assert_eq!(
            Bound::of(10.0, 0.0, 0.0, 0.0).with_exchange(9.0, 0.1),
            Bound::Compute
        );
    }
}
