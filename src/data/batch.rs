//! Rows to step inputs: packing samples into rows, the seeded sampler of global batches,
//! and the split of a global batch into per-rank, per-micro-batch right-padded batches
//! ([`MicroBatch`], what a `ToWorker::Step` of `crate::protocol` carries to a worker).

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{Dataset, Example, IGNORE_INDEX};

/// A right-padded micro-batch: `rows` x `seq_len`, row-major.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MicroBatch {
    pub rows: usize,
    pub seq_len: usize,
    pub input_ids: Vec<i32>,
    /// Aligned with `input_ids` (HF convention, shifted inside the worker); -100 = ignored.
    pub labels: Vec<i32>,
    /// Real (unpadded) length of each row: the attention mask, which the MoE router
    /// load-balancing loss reads.
    pub row_lens: Vec<usize>,
    /// Packed rows: each token's position, restarting at 0 where a sample starts; a token
    /// attends only to earlier tokens of its own sample. Empty: positions 0..seq_len and
    /// plain causal attention.
    #[serde(default)]
    pub position_ids: Vec<i32>,
    /// `dpo`: each row's reference log-probability (the initial model's summed
    /// log-probability of its label tokens); rows 2i and 2i + 1 are a pair, chosen first.
    /// Empty otherwise.
    #[serde(default)]
    pub ref_logps: Vec<f64>,
    /// `grpo`: each row's advantage. Empty otherwise.
    #[serde(default)]
    pub advantages: Vec<f64>,
    /// `grpo` past a batch's first step: each completion token's log-probability under the
    /// policy of the batch's first step, row after row. Empty: the batch's first step (the
    /// ratio is 1, and the worker sends these values back when `num_iterations` > 1).
    #[serde(default)]
    pub old_logps: Vec<f32>,
    /// `grpo` with `grpo.beta` > 0: each completion token's log-probability under the
    /// reference model (the run's initial one), row after row. Empty otherwise.
    #[serde(default)]
    pub ref_token_logps: Vec<f32>,
    /// The images of a vision-language batch, in the order their tokens appear: row by
    /// row, left to right within a row. Empty for text.
    #[serde(default)]
    pub images: Vec<BatchImage>,
}

/// An image of a micro-batch: the row holding its tokens, its file, and its patch grid
/// (`image_grid_thw`: temporal, height, width patches).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchImage {
    pub row: usize,
    pub path: PathBuf,
    pub grid: [u32; 3],
}

/// Greedily concatenates samples, in order, into rows of at most `max_len` tokens.
pub fn pack(docs: Vec<Example>, max_len: usize) -> Vec<Example> {
    let mut rows = Vec::new();
    let mut cur = Example::default();
    for d in docs {
        if !cur.input_ids.is_empty() && cur.input_ids.len() + d.input_ids.len() > max_len {
            rows.push(std::mem::take(&mut cur));
        }
        cur.position_ids.extend(0..d.input_ids.len() as i32);
        cur.input_ids.extend(&d.input_ids);
        cur.labels.push(IGNORE_INDEX);
        cur.labels.extend(&d.labels[1..]);
        cur.images.extend(d.images);
    }
    if !cur.input_ids.is_empty() {
        rows.push(cur);
    }
    rows
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
    /// Preference pairs in the global batch (`dpo`); 0 otherwise.
    pub pairs: u64,
    /// `grpo`: the rewards of the batch's completions; empty otherwise.
    pub rewards: Vec<f64>,
}

impl StepPlan {
    /// What the step's loss is a mean over: its preference pairs under `dpo`, else its
    /// label tokens.
    pub fn loss_units(&self) -> u64 {
        match self.pairs {
            0 => self.tokens,
            n => n,
        }
    }
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
    let real_tokens = rows
        .iter()
        .map(|&i| ds.rows[i].input_ids.len() as u64)
        .sum();
    let causal_pairs = rows
        .iter()
        .flat_map(|&i| ds.rows[i].doc_lens())
        .map(|t| (t * (t + 1) / 2) as u64)
        .sum();
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
        pairs: 0,
        rewards: Vec::new(),
    }
}

/// Splits a global batch of preference pairs (of a `dpo` dataset, [`Dataset::pairs`]) over
/// ranks and micro-batches as [`plan_step`] splits rows: pair p is rows 2p and 2p + 1, side
/// by side in one micro-batch (a rank's share and a micro-batch hold whole pairs, as the
/// batch of pairs divides by world x accum). Each row carries its reference
/// log-probability, `refs[row]`.
pub fn plan_pairs(
    ds: &Dataset,
    pairs: &[usize],
    world: usize,
    accum: usize,
    pad_id: i32,
    refs: &[f64],
) -> StepPlan {
    assert!(ds.pairs && refs.len() == ds.rows.len());
    assert!(
        pairs.len().is_multiple_of(world * accum),
        "pairs not divisible by world x accum"
    );
    let rows: Vec<usize> = pairs.iter().flat_map(|&p| [2 * p, 2 * p + 1]).collect();
    let mut plan = plan_step(ds, &rows, world, accum, pad_id);
    let mut next = rows.iter();
    for mb in plan.per_rank.iter_mut().flatten() {
        mb.ref_logps = next.by_ref().take(mb.rows).map(|&r| refs[r]).collect();
    }
    plan.pairs = pairs.len() as u64;
    plan
}

/// What a GRPO step's rows carry besides their tokens.
#[derive(Debug, Clone, Copy)]
pub struct RolloutTerms<'a> {
    /// Every dataset row's advantage.
    pub advantages: &'a [f64],
    /// Past the batch's first step, the batch's old log-probabilities, row after row (the
    /// order the micro-batches keep), whatever the worker count.
    pub old: Option<&'a [f32]>,
    /// With `grpo.beta` > 0, every dataset row's completion tokens' reference
    /// log-probabilities.
    pub refs: Option<&'a [Vec<f32>]>,
}

/// Splits a global batch of completions (of a `grpo` dataset) over ranks and
/// micro-batches as [`plan_step`] does, each row with its advantage, and each completion
/// token, past the batch's first step, with its old log-probability and, with a KL term,
/// its reference one.
pub fn plan_rollouts(
    ds: &Dataset,
    rows: &[usize],
    world: usize,
    accum: usize,
    pad_id: i32,
    terms: RolloutTerms,
) -> StepPlan {
    let RolloutTerms {
        advantages,
        old,
        refs,
    } = terms;
    assert!(advantages.len() == ds.rows.len() && refs.is_none_or(|r| r.len() == ds.rows.len()));
    let mut plan = plan_step(ds, rows, world, accum, pad_id);
    let (mut next, mut token) = (rows.iter(), 0);
    for mb in plan.per_rank.iter_mut().flatten() {
        let mine: Vec<usize> = next.by_ref().take(mb.rows).copied().collect();
        mb.advantages = mine.iter().map(|&r| advantages[r]).collect();
        if let Some(refs) = refs {
            mb.ref_token_logps = mine.iter().flat_map(|&r| refs[r].iter().copied()).collect();
        }
        if let Some(old) = old {
            let n: usize = mine.iter().map(|&r| ds.rows[r].label_tokens()).sum();
            mb.old_logps = old[token..token + n].to_vec();
            token += n;
        }
    }
    if let Some(old) = old {
        assert_eq!(
            token,
            old.len(),
            "one old log-probability per completion token"
        );
    }
    if let Some(r) = &ds.rollouts {
        plan.rewards = rows.iter().map(|&i| r.rewards[i]).collect();
    }
    plan
}

/// Right-pads rows to the longest one; padded labels are ignored. When a row is packed,
/// every row gets position ids (padding continues its row's last sample).
pub fn pad_batch(rows: &[&Example], pad_id: i32) -> MicroBatch {
    let seq_len = rows.iter().map(|r| r.input_ids.len()).max().unwrap_or(0);
    let packed = rows.iter().any(|r| !r.position_ids.is_empty());
    let mut input_ids = Vec::with_capacity(rows.len() * seq_len);
    let mut labels = Vec::with_capacity(rows.len() * seq_len);
    let mut position_ids = Vec::with_capacity(if packed { rows.len() * seq_len } else { 0 });
    for r in rows {
        let (len, pad) = (r.input_ids.len(), seq_len - r.input_ids.len());
        input_ids.extend_from_slice(&r.input_ids);
        input_ids.extend(std::iter::repeat_n(pad_id, pad));
        labels.extend_from_slice(&r.labels);
        labels.extend(std::iter::repeat_n(IGNORE_INDEX, pad));
        if packed {
            let first = match r.position_ids.last() {
                Some(&last) => {
                    position_ids.extend_from_slice(&r.position_ids);
                    last + 1
                }
                None => {
                    position_ids.extend(0..len as i32);
                    len as i32
                }
            };
            position_ids.extend(first..first + pad as i32);
        }
    }
    MicroBatch {
        rows: rows.len(),
        seq_len,
        input_ids,
        labels,
        position_ids,
        row_lens: rows.iter().map(|r| r.input_ids.len()).collect(),
        ref_logps: Vec::new(),
        advantages: Vec::new(),
        old_logps: Vec::new(),
        ref_token_logps: Vec::new(),
        images: rows
            .iter()
            .enumerate()
            .flat_map(|(row, r)| {
                r.images.iter().map(move |im| BatchImage {
                    row,
                    path: im.path.clone(),
                    grid: im.grid,
                })
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::Skipped;
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
            position_ids: Vec::new(),
            images: Vec::new(),
        }
    }

    #[test]
    fn split_is_contiguous_and_padded() {
        let ds = Dataset {
            files: vec![],
            rows: (1..=8).map(|n| ex(n, 0)).collect(),
            samples: 8,
            skipped: Skipped::default(),
            eval: vec![],
            eval_source: String::new(),
            blocks: None,
            pairs: false,
            rollouts: None,
            eval_rollouts: None,
            template_note: None,
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
    fn pairs_stay_side_by_side_with_their_references() {
        let ds = Dataset {
            rows: (1..=8).map(|n| ex(n, 1)).collect(),
            samples: 4,
            pairs: true,
            ..Dataset::default()
        };
        let refs: Vec<f64> = (0..8).map(|r| -(r as f64)).collect();
        let plan = plan_pairs(&ds, &[3, 0, 2, 1], 2, 1, 0, &refs);
        assert_eq!((plan.pairs, plan.loss_units()), (4, 4));
        // Rank 0: pairs 3 and 0 (rows 6, 7, 0, 1); rank 1: pairs 2 and 1.
        let m = &plan.per_rank[0][0];
        assert_eq!(m.row_lens, [7, 8, 1, 2]);
        assert_eq!(m.ref_logps, [-6.0, -7.0, -0.0, -1.0]);
        assert_eq!(plan.per_rank[1][0].ref_logps, [-4.0, -5.0, -2.0, -3.0]);
        let plan = plan_pairs(&ds, &[3, 0, 2, 1], 1, 2, 0, &refs);
        assert_eq!(plan.per_rank[0][1].row_lens, [5, 6, 3, 4]);
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
    fn packing_keeps_each_sample_apart() {
        let docs = vec![ex(3, 1), ex(2, 0), ex(4, 0), ex(1, 0)];
        let rows = pack(docs.clone(), 6);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].input_ids, [0, 1, 2, 0, 1]);
        assert_eq!(rows[0].position_ids, [0, 1, 2, 0, 1]);
        assert_eq!(rows[0].labels, [IGNORE_INDEX, 1, 2, IGNORE_INDEX, 1]);
        assert_eq!(rows[1].doc_lens(), [4, 1]);
        // A packed row yields exactly its samples' loss terms.
        let per_doc: usize = docs.iter().map(Example::label_tokens).sum();
        assert_eq!(
            rows.iter().map(Example::label_tokens).sum::<usize>(),
            per_doc
        );
        // Padding continues the last sample; unpacked rows in the batch get 0..len.
        let m = pad_batch(&[&rows[1], &ex(2, 0)], 0);
        assert_eq!(m.position_ids, [0, 1, 2, 3, 0, 0, 1, 2, 3, 4]);
        assert!(pad_batch(&[&ex(2, 0)], 0).position_ids.is_empty());
    }
}
