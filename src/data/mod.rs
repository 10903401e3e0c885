//! Training data: datasets (tokenized JSONL, or alpaca / sharegpt text rendered with the
//! model's chat template, from a file or the `dataset_info.json` registry), packing, the
//! deterministic sampler, and the split of a global batch into per-rank, per-micro-batch
//! right-padded batches.
//!
//! Semantics (DESIGN.md "Numerics"): rank r takes the contiguous r-th 1/W slice of each
//! global batch and splits it into `gradient_accumulation_steps` contiguous micro-batches;
//! each micro-batch is right-padded to its longest row (pad labels -100). Labels follow
//! the HF convention (aligned with input_ids, shifted inside the model), so a row
//! contributes one loss term per position t >= 1 whose label is not -100.
//!
//! Packing (`dataset.packing`) concatenates samples, in a seeded order, into rows of at
//! most `max_seq_len` tokens once at load time. Each sample keeps its own positions
//! (restarting at 0, which is also how the worker finds sample boundaries for its
//! attention mask) and the first label of each sample is ignored, so a packed row yields
//! exactly the loss terms of its samples. Packed rows are then sampled like any rows, so
//! the data position stays the step count and resume is exact.

mod chat;
mod records;
mod registry;
mod tokenized;

use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

pub use chat::ChatTokenizer;
pub use records::{BadRecord, Message, Role};

use crate::config::{DatasetFormat, DatasetSection, Overlong};
use crate::error::{Error, Result};
use crate::protocol::MicroBatch;
use records::{RawRecord, Schema};
use registry::Columns;

pub const IGNORE_INDEX: i32 = -100;

/// Reasons of the first skipped records kept for the report.
const REPORTED_SKIPS: usize = 5;

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Example {
    pub input_ids: Vec<i32>,
    pub labels: Vec<i32>,
    /// Per-token positions of a packed row (restarting at 0 for each sample); empty for a
    /// single sample (positions 0..len).
    pub position_ids: Vec<i32>,
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

    /// Lengths of the samples in this row (one unless packed).
    pub fn doc_lens(&self) -> Vec<usize> {
        if self.position_ids.is_empty() {
            return vec![self.input_ids.len()];
        }
        let starts: Vec<usize> = (0..self.position_ids.len())
            .filter(|&i| self.position_ids[i] == 0)
            .chain([self.position_ids.len()])
            .collect();
        starts.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

/// Records left out of a dataset and why (the first few).
#[derive(Debug, Default)]
pub struct Skipped {
    pub count: usize,
    pub first: Vec<String>,
}

#[derive(Debug)]
pub struct Dataset {
    /// The files it was read from.
    pub files: Vec<PathBuf>,
    pub rows: Vec<Example>,
    /// Samples before packing.
    pub samples: usize,
    pub skipped: Skipped,
}

/// One file to read and how.
struct Source {
    file: PathBuf,
    /// None: tokenized.
    schema: Option<Schema>,
    limit: Option<usize>,
}

impl Dataset {
    /// Reads every file of the `dataset` section, tokenizing text with the tokenizer and
    /// chat template of `model_dir`; bad records are skipped and counted, or errors with
    /// `dataset.strict`. Packs rows when asked (shuffled first, seeded by `seed`).
    pub fn load(ds: &DatasetSection, model_dir: &Path, vocab: usize, seed: u64) -> Result<Dataset> {
        let sources = sources(ds)?;
        let chat = match sources.iter().any(|s| s.schema.is_some()) {
            true => Some(ChatTokenizer::from_model_dir(model_dir)?),
            false => None,
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(ds.num_workers)
            .build()
            .map_err(|e| Error::invalid("dataset.num_workers", e.to_string()))?;
        let mut data = Dataset {
            files: Vec::new(),
            rows: Vec::new(),
            samples: 0,
            skipped: Skipped::default(),
        };
        for src in &sources {
            let text = std::fs::read_to_string(&src.file).map_err(|e| Error::io(&src.file, e))?;
            let mut recs = records::split_records(&src.file, &text)?;
            recs.truncate(src.limit.unwrap_or(usize::MAX));
            let rows: Vec<std::result::Result<Example, BadRecord>> = pool.install(|| {
                recs.par_iter()
                    .map(|rec| row(src, rec, chat.as_ref(), ds, vocab))
                    .collect()
            });
            for r in rows {
                match r {
                    Ok(ex) => data.rows.push(ex),
                    Err(bad) if ds.strict => return Err(bad.into_error(&src.file)),
                    Err(bad) => {
                        let s = &mut data.skipped;
                        s.count += 1;
                        if s.first.len() < REPORTED_SKIPS {
                            s.first.push(format!(
                                "{}:{}: field `{}`: {}",
                                src.file.display(),
                                bad.line,
                                bad.field,
                                bad.reason
                            ));
                        }
                    }
                }
            }
            data.files.push(src.file.clone());
        }
        if data.rows.is_empty() {
            return Err(Error::Dataset {
                path: data.files.first().cloned().unwrap_or_default(),
                line: 0,
                msg: format!(
                    "no usable records ({} skipped; first: {})",
                    data.skipped.count,
                    data.skipped.first.join("; ")
                ),
            });
        }
        data.samples = data.rows.len();
        if let (true, Some(max)) = (ds.packing, ds.max_seq_len) {
            let mut docs = std::mem::take(&mut data.rows);
            if ds.shuffle {
                docs.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
            }
            data.rows = pack(docs, max);
        }
        Ok(data)
    }

    /// One line for the log: rows, sources, skipped records and the first reasons.
    pub fn summary(&self) -> String {
        let files: Vec<String> = self.files.iter().map(|f| f.display().to_string()).collect();
        let mut s = format!(
            "dataset: {} samples from {}",
            self.samples,
            files.join(", ")
        );
        if self.rows.len() != self.samples {
            s += &format!(", packed into {} rows", self.rows.len());
        }
        if self.skipped.count > 0 {
            s += &format!(
                "; {} records skipped (dataset.strict: true makes them errors), first: {}",
                self.skipped.count,
                self.skipped.first.join("; ")
            );
        }
        s
    }
}

/// The files of a `dataset` section with their schemas.
fn sources(ds: &DatasetSection) -> Result<Vec<Source>> {
    let text_schema = |format, columns, tags| match format {
        DatasetFormat::Tokenized => None,
        _ => Some(Schema {
            format,
            columns,
            tags,
            default_system: ds.system_prompt.clone(),
        }),
    };
    if let Some(path) = &ds.path {
        let format = ds.format.unwrap_or(DatasetFormat::Alpaca);
        let mut columns = Columns::defaults(format);
        if let Some(q) = &ds.query_field {
            columns.prompt = q.clone();
        }
        if let Some(r) = &ds.response_field {
            columns.response = r.clone();
        }
        return Ok(vec![Source {
            file: path.clone(),
            schema: text_schema(format, columns, Default::default()),
            limit: None,
        }]);
    }
    let names = ds.name.as_deref().unwrap_or_default();
    names
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| {
            let r = registry::lookup(&ds.dataset_dir, n)?;
            Ok(Source {
                file: r.file,
                schema: text_schema(r.format, r.columns, r.tags),
                limit: r.num_samples,
            })
        })
        .collect()
}

/// One record to a row, with `max_seq_len` applied.
fn row(
    src: &Source,
    rec: &RawRecord,
    chat: Option<&ChatTokenizer>,
    ds: &DatasetSection,
    vocab: usize,
) -> std::result::Result<Example, BadRecord> {
    let mut ex = match (&src.schema, chat) {
        (Some(schema), Some(chat)) => {
            let msgs = schema.conversation(rec)?;
            let ex = chat
                .example(&msgs, ds.train_on_prompt)
                .map_err(|m| BadRecord::new(rec.line, "", m))?;
            if let Some(&bad) = ex.input_ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(BadRecord::new(
                    rec.line,
                    "",
                    format!("token id {bad} is outside the model's vocabulary 0..{vocab}"),
                ));
            }
            ex
        }
        _ => tokenized::example(rec, vocab)?,
    };
    let len = ex.input_ids.len();
    match ds.max_seq_len {
        Some(max) if len > max && ds.overlong == Overlong::Skip => {
            return Err(BadRecord::new(
                rec.line,
                "",
                format!("{len} tokens, longer than dataset.max_seq_len ({max})"),
            ));
        }
        Some(max) if len > max => {
            ex.input_ids.truncate(max);
            ex.labels.truncate(max);
            if ex.label_tokens() == 0 {
                return Err(BadRecord::new(
                    rec.line,
                    "",
                    format!(
                        "{len} tokens: no trained token left within dataset.max_seq_len ({max})"
                    ),
                ));
            }
        }
        _ => {}
    }
    if src.schema.is_some() && ex.label_tokens() == 0 {
        return Err(BadRecord::new(rec.line, "", "no trained token"));
    }
    Ok(ex)
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
    }
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
            position_ids: Vec::new(),
        }
    }

    fn section(yaml: &str) -> DatasetSection {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    fn tmp(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("mt-data-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn label_tokens_follow_the_shift() {
        assert_eq!(ex(5, 0).label_tokens(), 4);
        assert_eq!(ex(5, 3).label_tokens(), 2);
    }

    #[test]
    fn split_is_contiguous_and_padded() {
        let ds = Dataset {
            files: vec![],
            rows: (1..=8).map(|n| ex(n, 0)).collect(),
            samples: 8,
            skipped: Skipped::default(),
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
    fn bad_rows_name_file_and_line_when_strict_and_are_counted_otherwise() {
        let p = tmp(
            "bad.jsonl",
            "{\"input_ids\": [1, 2]}\n{\"input_ids\": [1, 99]}\n{\"input_ids\": [1, 2], \"labels\": [1]}\n",
        );
        let yaml = format!("{{format: tokenized, path: {}, strict: true}}", p.display());
        let e = Dataset::load(&section(&yaml), Path::new("."), 50, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2") && e.contains("entry 1 is 99"), "{e}");
        assert!(
            e.contains("bad.jsonl") && e.contains("field `input_ids`"),
            "{e}"
        );
        let yaml = format!("{{format: tokenized, path: {}}}", p.display());
        let d = Dataset::load(&section(&yaml), Path::new("."), 50, 0).unwrap();
        assert_eq!((d.rows.len(), d.skipped.count), (1, 2));
        assert!(
            d.skipped.first[1].contains(":3: field `labels`: has 1 entries"),
            "{:?}",
            d.skipped
        );
        assert!(d.summary().contains("2 records skipped"), "{}", d.summary());
    }

    #[test]
    fn overlong_rows_truncate_or_skip() {
        let p = tmp(
            "long.jsonl",
            "{\"input_ids\": [1, 2, 3, 4]}\n{\"input_ids\": [1, 2]}\n",
        );
        let yaml = format!(
            "{{format: tokenized, path: {}, max_seq_len: 3}}",
            p.display()
        );
        let d = Dataset::load(&section(&yaml), Path::new("."), 50, 0).unwrap();
        assert_eq!(d.rows[0].input_ids, [1, 2, 3]);
        let d = Dataset::load(
            &section(&format!("{{{}, overlong: skip}}", &yaml[1..yaml.len() - 1])),
            Path::new("."),
            50,
            0,
        )
        .unwrap();
        assert_eq!((d.rows.len(), d.skipped.count), (1, 1));
        assert!(d.skipped.first[0].contains("longer than dataset.max_seq_len (3)"));
    }

    #[test]
    fn packed_order_is_a_function_of_the_seed() {
        let text: String = (1..=30)
            .map(|n| {
                format!(
                    "{{\"input_ids\": {:?}}}\n",
                    (0..n % 7 + 2).collect::<Vec<_>>()
                )
            })
            .collect();
        let p = tmp("seeded.jsonl", &text);
        let yaml = format!(
            "{{format: tokenized, path: {}, max_seq_len: 16, packing: true}}",
            p.display()
        );
        let load = |seed| {
            Dataset::load(&section(&yaml), Path::new("."), 50, seed)
                .unwrap()
                .rows
        };
        let (a, b, c) = (load(1), load(1), load(2));
        assert_eq!(a, b);
        assert_ne!(a, c);
        let docs = |rows: &[Example]| rows.iter().map(|r| r.doc_lens().len()).sum::<usize>();
        assert_eq!((docs(&a), docs(&c)), (30, 30));
        assert!(a.iter().all(|r| r.input_ids.len() <= 16));
        let unshuffled = format!("{{{}, shuffle: false}}", &yaml[1..yaml.len() - 1]);
        let d = Dataset::load(&section(&unshuffled), Path::new("."), 50, 1).unwrap();
        assert_eq!(
            d.rows[0].doc_lens()[..2],
            [3, 4],
            "file order without shuffle"
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
