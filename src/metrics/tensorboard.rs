//! TensorBoard event files (`logging.report_to: tensorboard`), written directly: a file of
//! TFRecords, each an `Event` protocol buffer holding one step's scalars as a `Summary`.
//!
//! A record is `u64 length, u32 masked CRC-32C of the length, data, u32 masked CRC-32C of
//! the data` (little-endian), the first event carries `file_version: "brain.Event:2"`, and
//! the file is named `events.out.tfevents.<seconds>.<host>.<pid>.<n>` (TensorBoard finds
//! files by that name). The protobuf fields used are few and fixed (Event: wall_time 1,
//! step 2, file_version 3, summary 5; Summary: value 1; Value: tag 1, simple_value 2), so
//! a few lines encode them instead of a protobuf dependency.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::StepMetrics;
use crate::error::{Error, Result};

/// Appends scalars to one event file.
pub struct EventWriter {
    file: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir` if needed and a new event file in it.
    pub fn create(dir: &Path) -> Result<EventWriter> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{host}.{}.0",
            now.as_secs(),
            std::process::id()
        );
        let path = dir.join(name);
        let file = std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?;
        let mut w = EventWriter {
            file: std::io::BufWriter::new(file),
            path,
        };
        let mut event = Vec::new();
        put_f64(&mut event, 1, wall_time());
        put_bytes(&mut event, 3, b"brain.Event:2");
        w.record(&event)?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `(tag, value)` scalars at `step` and flushes, so TensorBoard sees them live
    /// and a crash keeps them.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        let mut summary = Vec::new();
        for (tag, v) in values {
            let mut value = Vec::new();
            put_bytes(&mut value, 1, tag.as_bytes());
            put_f32(&mut value, 2, *v as f32);
            put_bytes(&mut summary, 1, &value);
        }
        let mut event = Vec::new();
        put_f64(&mut event, 1, wall_time());
        put_varint_field(&mut event, 2, step);
        put_bytes(&mut event, 5, &summary);
        self.record(&event)
    }

    /// The scalars of one step ([`step_scalars`]).
    pub fn step(&mut self, m: &StepMetrics) -> Result<()> {
        self.scalars(m.step, &step_scalars(m))
    }

    fn record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut rec = Vec::with_capacity(data.len() + 16);
        rec.extend_from_slice(&len);
        rec.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
        rec.extend_from_slice(data);
        rec.extend_from_slice(&masked_crc32c(data).to_le_bytes());
        self.file
            .write_all(&rec)
            .and_then(|_| self.file.flush())
            .map_err(|e| Error::io(&self.path, e))
    }
}

/// TensorBoard tags and values of a step (memory in GB; eval only after an evaluation).
/// The train and eval loss tags are HF Trainer's, DPO's rewards and GRPO's reward and clip
/// ratios TRL's under `train/` (and after an evaluation under `eval/`).
pub fn step_scalars(m: &StepMetrics) -> Vec<(&'static str, f64)> {
    let mut v = vec![
        ("train/loss", m.loss),
        ("train/learning_rate", m.lr),
        ("train/grad_norm", m.grad_norm),
        ("train/tokens_per_s", m.tokens_per_s),
        ("perf/tflops_megatrain", m.tflops_megatrain),
        ("perf/tflops_model", m.tflops_model),
        ("time/step_s", m.step_time_s),
        ("time/forward_s", m.forward_s),
        ("time/backward_s", m.backward_s),
        ("time/slot_wait_s", m.slot_wait_s),
        ("time/reduce_s", m.reduce_s),
        ("time/optimizer_s", m.optimizer_s),
        ("time/h2d_wait_s", m.h2d_wait_s),
        ("time/d2h_s", m.d2h_s),
        ("memory/peak_gpu_gb", m.peak_gpu_bytes as f64 / 1e9),
        (
            "memory/launcher_peak_rss_gb",
            m.launcher_peak_rss_bytes as f64 / 1e9,
        ),
    ];
    if let Some(x) = m.exchange_s {
        v.push(("time/exchange_s", x));
    }
    if let Some(x) = m.exchange_wait_s {
        v.push(("time/exchange_wait_s", x));
    }
    if let Some(e) = &m.eval {
        v.push(("eval/loss", e.eval_loss));
        v.push(("eval/tokens", e.eval_tokens as f64));
        if let Some(d) = &e.dpo {
            v.push(("eval/rewards/chosen", d.chosen));
            v.push(("eval/rewards/rejected", d.rejected));
            v.push(("eval/rewards/accuracies", d.accuracies));
            v.push(("eval/rewards/margins", d.margins));
            v.push(("eval/logps/chosen", d.logps_chosen));
            v.push(("eval/logps/rejected", d.logps_rejected));
        }
        if let Some(g) = &e.grpo {
            v.push(("eval/reward", g.eval_reward));
            if let Some(kl) = g.eval_kl {
                v.push(("eval/kl", kl));
            }
        }
    }
    if let Some(d) = &m.dpo {
        v.push(("train/rewards/chosen", d.chosen));
        v.push(("train/rewards/rejected", d.rejected));
        v.push(("train/rewards/accuracies", d.accuracies));
        v.push(("train/rewards/margins", d.margins));
        v.push(("train/logps/chosen", d.logps_chosen));
        v.push(("train/logps/rejected", d.logps_rejected));
    }
    if let Some(g) = &m.grpo {
        v.push(("train/reward", g.reward));
        v.push(("train/reward_std", g.reward_std));
        v.push(("train/completions/mean_length", g.mean_length));
        v.push(("train/clip_ratio/low_mean", g.clip_ratio_low));
        v.push(("train/clip_ratio/high_mean", g.clip_ratio_high));
        if let Some(kl) = g.kl {
            v.push(("train/kl", kl));
        }
    }
    v
}

fn wall_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn put_varint(out: &mut Vec<u8>, mut x: u64) {
    while x >= 0x80 {
        out.push((x as u8) | 0x80);
        x >>= 7;
    }
    out.push(x as u8);
}

/// Protobuf wire types: 0 varint, 1 fixed 64-bit, 2 length-delimited, 5 fixed 32-bit.
fn put_key(out: &mut Vec<u8>, field: u64, wire: u64) {
    put_varint(out, field << 3 | wire);
}

fn put_varint_field(out: &mut Vec<u8>, field: u64, x: u64) {
    put_key(out, field, 0);
    put_varint(out, x);
}

fn put_f64(out: &mut Vec<u8>, field: u64, x: f64) {
    put_key(out, field, 1);
    out.extend_from_slice(&x.to_le_bytes());
}

fn put_f32(out: &mut Vec<u8>, field: u64, x: f32) {
    put_key(out, field, 5);
    out.extend_from_slice(&x.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u64, b: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bytewise by table.
fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    0x82F6_3B78 ^ (c >> 1)
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    !data.iter().fold(!0u32, |c, &b| {
        TABLE[((c ^ b as u32) & 0xFF) as usize] ^ (c >> 8)
    })
}

/// TFRecord's masking of a CRC stored beside the data it covers.
fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xA282_EAD8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC catalogue's check value of CRC-32C (iSCSI): crc("123456789").
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn varints_and_keys_encode_as_protobuf_does() {
        let mut v = Vec::new();
        put_varint_field(&mut v, 2, 300);
        assert_eq!(v, [0x10, 0xAC, 0x02]);
        let mut s = Vec::new();
        put_bytes(&mut s, 1, b"ab");
        assert_eq!(s, [0x0A, 2, b'a', b'b']);
    }
}
