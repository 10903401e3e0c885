//! Training data: the tokenized JSONL reader, the deterministic sampler, and the split of a
//! global batch into per-rank, per-micro-batch right-padded batches.
//!
//! Semantics (DESIGN.md "Numerics"): rank r takes the contiguous r-th 1/W slice of each
//! global batch and splits it into `gradient_accumulation_steps` contiguous micro-batches;
//! each micro-batch is right-padded to its longest row (pad labels -100). Labels follow
//! the HF convention (aligned with input_ids, shifted inside the model), so a row
//! contributes one loss term per position t >= 1 whose label is not -100.

use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::protocol::MicroBatch;

pub const IGNORE_INDEX: i32 = -100;

#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub input_ids: Vec<i32>,
    pub labels: Vec<i32>,
}

impl Example {
    /// Loss terms this row contributes (labels after the shift that are not ignored).
    pub fn label_tokens(&self) -> usize {
        self.labels
            .iter()
            .skip(1)
            .filter(|&&l| l != IGNORE_INDEX)
            .count()
    }
}

#[derive(Debug)]
pub struct Dataset {
    pub path: PathBuf,
    pub rows: Vec<Example>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizedRow {
    input_ids: Vec<i64>,
    #[serde(default)]
    labels: Option<Vec<i64>>,
    #[serde(default, rename = "attention_mask")]
    _attention_mask: Option<serde_json::Value>,
}

impl Dataset {
    /// Reads a tokenized JSONL file. Every id must be in `0..vocab_size`, every label too or
    /// -100; rows longer than `max_seq_len` are truncated.
    pub fn load_tokenized(
        path: &Path,
        vocab_size: usize,
        max_seq_len: Option<usize>,
    ) -> Result<Dataset> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let mut rows = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line_no = i + 1;
            if line.trim().is_empty() {
                continue;
            }
            let err = |msg: String| Error::Dataset {
                path: path.into(),
                line: line_no,
                msg,
            };
            let row: TokenizedRow = serde_json::from_str(line)
                .map_err(|e| err(format!("not a tokenized record: {e}")))?;
            if row.input_ids.is_empty() {
                return Err(err("`input_ids` is empty".into()));
            }
            let ids = check_ids(&row.input_ids, vocab_size, false)
                .map_err(|m| err(format!("`input_ids`: {m}")))?;
            let labels = match row.labels {
                None => ids.clone(),
                Some(l) if l.len() != ids.len() => {
                    return Err(err(format!(
                        "`labels` has {} entries, `input_ids` has {}",
                        l.len(),
                        ids.len()
                    )));
                }
                Some(l) => {
                    check_ids(&l, vocab_size, true).map_err(|m| err(format!("`labels`: {m}")))?
                }
            };
            let mut ex = Example {
                input_ids: ids,
                labels,
            };
            if let Some(max) = max_seq_len {
                ex.input_ids.truncate(max);
                ex.labels.truncate(max);
            }
            rows.push(ex);
        }
        if rows.is_empty() {
            return Err(Error::Dataset {
                path: path.into(),
                line: 0,
                msg: "no records".into(),
            });
        }
        Ok(Dataset {
            path: path.into(),
            rows,
        })
    }
}

fn check_ids(v: &[i64], vocab: usize, allow_ignore: bool) -> std::result::Result<Vec<i32>, String> {
    v.iter()
        .enumerate()
        .map(|(j, &x)| {
            if (0..vocab as i64).contains(&x) || (allow_ignore && x == IGNORE_INDEX as i64) {
                Ok(x as i32)
            } else {
                Err(format!(
                    "entry {j} is {x}, outside the vocabulary 0..{vocab}"
                ))
            }
        })
        .collect()
}

/// Picks the rows of each global batch: file order wrapping around, or a fresh seeded
/// permutation per epoch.
pub struct Sampler {
    n: usize,
    batch: usize,
    shuffle: bool,
    seed: u64,
    cached: Option<(u64, Vec<usize>)>,
}

impl Sampler {
    pub fn new(n: usize, batch: usize, shuffle: bool, seed: u64) -> Sampler {
        assert!(n > 0 && batch > 0);
        Sampler {
            n,
            batch,
            shuffle,
            seed,
            cached: None,
        }
    }

    /// Row indices of the global batch of optimizer step `step` (0-based).
    pub fn global_batch(&mut self, step: u64) -> Vec<usize> {
        let start = step as usize * self.batch;
        (start..start + self.batch)
            .map(|p| self.row_at(p))
            .collect()
    }

    fn row_at(&mut self, pos: usize) -> usize {
        let (epoch, i) = ((pos / self.n) as u64, pos % self.n);
        if !self.shuffle {
            return i;
        }
        if self.cached.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let mut perm: Vec<usize> = (0..self.n).collect();
            let mut rng =
                ChaCha8Rng::seed_from_u64(self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ epoch);
            perm.shuffle(&mut rng);
            self.cached = Some((epoch, perm));
        }
        self.cached.as_ref().map(|(_, p)| p[i]).unwrap_or(i)
    }
}

/// One optimizer step's data: `per_rank[r][k]` is rank r's k-th micro-batch.
#[derive(Debug)]
pub struct StepPlan {
    pub per_rank: Vec<Vec<MicroBatch>>,
    /// Unmasked label tokens in the whole global batch.
    pub tokens: u64,
    /// Tokens including padding (Σ rows x padded length over micro-batches).
    pub padded_tokens: u64,
    /// Non-padding tokens.
    pub real_tokens: u64,
    /// Σ over rows of T(T+1)/2 for each row's real length T (causal attention pairs).
    pub causal_pairs: u64,
}

/// Splits a global batch over ranks and micro-batches.
pub fn plan_step(
    ds: &Dataset,
    rows: &[usize],
    world: usize,
    accum: usize,
    pad_id: i32,
) -> StepPlan {
    assert!(
        rows.len().is_multiple_of(world * accum),
        "batch not divisible by world x accum"
    );
    let per_rank = rows.len() / world;
    let per_micro = per_rank / accum;
    let tokens = rows.iter().map(|&i| ds.rows[i].label_tokens() as u64).sum();
    let lens = || rows.iter().map(|&i| ds.rows[i].input_ids.len() as u64);
    let real_tokens = lens().sum();
    let causal_pairs = lens().map(|t| t * (t + 1) / 2).sum();
    let per_rank: Vec<Vec<MicroBatch>> = rows
        .chunks(per_rank)
        .map(|rank_rows| {
            rank_rows
                .chunks(per_micro)
                .map(|m| pad_batch(&m.iter().map(|&i| &ds.rows[i]).collect::<Vec<_>>(), pad_id))
                .collect()
        })
        .collect();
    let padded_tokens = per_rank
        .iter()
        .flatten()
        .map(|m| (m.rows * m.seq_len) as u64)
        .sum();
    StepPlan {
        per_rank,
        tokens,
        padded_tokens,
        real_tokens,
        causal_pairs,
    }
}

/// Right-pads rows to the longest one; padded labels are ignored.
pub fn pad_batch(rows: &[&Example], pad_id: i32) -> MicroBatch {
    let seq_len = rows.iter().map(|r| r.input_ids.len()).max().unwrap_or(0);
    let mut input_ids = Vec::with_capacity(rows.len() * seq_len);
    let mut labels = Vec::with_capacity(rows.len() * seq_len);
    for r in rows {
        let pad = seq_len - r.input_ids.len();
        input_ids.extend_from_slice(&r.input_ids);
        input_ids.extend(std::iter::repeat_n(pad_id, pad));
        labels.extend_from_slice(&r.labels);
        labels.extend(std::iter::repeat_n(IGNORE_INDEX, pad));
    }
    MicroBatch {
        rows: rows.len(),
        seq_len,
        input_ids,
        labels,
        row_lens: rows.iter().map(|r| r.input_ids.len()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(n: usize, masked_prefix: usize) -> Example {
        let ids: Vec<i32> = (0..n as i32).collect();
        let labels = ids
            .iter()
            .enumerate()
            .map(|(i, &x)| if i < masked_prefix { IGNORE_INDEX } else { x })
            .collect();
        Example {
            input_ids: ids,
            labels,
        }
    }

    #[test]
    fn label_tokens_follow_the_shift() {
        assert_eq!(ex(5, 0).label_tokens(), 4);
        assert_eq!(ex(5, 3).label_tokens(), 2);
    }

    #[test]
    fn split_is_contiguous_and_padded() {
        let ds = Dataset {
            path: "x".into(),
            rows: (1..=8).map(|n| ex(n, 0)).collect(),
        };
        let rows: Vec<usize> = (0..8).collect();
        let plan = plan_step(&ds, &rows, 2, 2, 0);
        assert_eq!(plan.tokens, (0..8).sum::<u64>());
        assert_eq!(plan.real_tokens, (1..=8).sum::<u64>());
        // Micro-batches of lengths (1,2) (3,4) (5,6) (7,8) pad to 2, 4, 6, 8.
        assert_eq!(plan.padded_tokens, 2 * (2 + 4 + 6 + 8));
        assert_eq!(
            plan.causal_pairs,
            (1..=8u64).map(|t| t * (t + 1) / 2).sum::<u64>()
        );
        let m = &plan.per_rank[1][0]; // rows 4, 5 = lengths 5, 6
        assert_eq!((m.rows, m.seq_len), (2, 6));
        assert_eq!(&m.input_ids[..6], &[0, 1, 2, 3, 4, 0]);
        assert_eq!(m.labels[5], IGNORE_INDEX);
    }

    #[test]
    fn sampler_orders() {
        let mut s = Sampler::new(5, 3, false, 0);
        assert_eq!(s.global_batch(1), vec![3, 4, 0]);
        let mut a = Sampler::new(100, 10, true, 7);
        let mut b = Sampler::new(100, 10, true, 7);
        let epoch: Vec<usize> = (0..10).flat_map(|k| a.global_batch(k)).collect();
        assert_eq!(
            epoch,
            (0..10).flat_map(|k| b.global_batch(k)).collect::<Vec<_>>()
        );
        let mut sorted = epoch.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_ne!(epoch, (0..100).collect::<Vec<_>>());
        assert_ne!(
            a.global_batch(10),
            epoch[..10].to_vec(),
            "each epoch reshuffles"
        );
    }

    #[test]
    fn bad_rows_name_file_and_line() {
        let p = std::env::temp_dir().join(format!("mt-data-{}.jsonl", std::process::id()));
        std::fs::write(&p, "{\"input_ids\": [1, 2]}\n{\"input_ids\": [1, 99]}\n").unwrap();
        let e = Dataset::load_tokenized(&p, 50, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2") && e.contains("entry 1 is 99"), "{e}");
        std::fs::write(&p, "{\"input_ids\": [1, 2], \"labels\": [1]}\n").unwrap();
        let e = Dataset::load_tokenized(&p, 50, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`labels` has 1 entries"), "{e}");
    }
}
