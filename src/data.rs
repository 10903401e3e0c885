//! Training data: datasets (tokenized JSONL, or alpaca / sharegpt text rendered with the
//! model's chat template, from JSON, JSONL or Parquet files, `save_to_disk` directories,
//! the `dataset_info.json` registry or the HF cache), plain-text documents for continued
//! pretraining (`training.stage: pt`: [`pretrain`]), the eval set (held out or separate),
//! packing, the deterministic sampler, and the split of a global batch into per-rank,
//! per-micro-batch right-padded batches.
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
//! the data position stays the step count and resume is exact. Under `pt`, packing is
//! instead LlamaFactory's: the documents concatenated in order and cut into blocks
//! ([`pretrain::blocks`]).

mod batch;
mod chat;
mod files;
mod gemma3_vl;
mod hub;
pub mod image;
mod llava_next;
mod pairs;
mod pretrain;
mod pyjson;
mod qwen_vl;
mod read;
mod records;
mod registry;
mod rollouts;
mod sources;
mod split;
mod table;
mod tokenized;
mod tools;

use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

pub use batch::{
    BatchImage, MicroBatch, RolloutTerms, Sampler, StepPlan, pack, pad_batch, plan_pairs,
    plan_rollouts, plan_step,
};
pub use chat::{ChatTokenizer, Origin as TemplateOrigin};
pub use gemma3_vl::Gemma3Images;
pub use image::ImageSize;
pub use llava_next::LlavaNextImages;
pub use qwen_vl::{Grid, QwenVlImages};
pub use records::{BadRecord, Conversation, Image, Message, Role};
pub use rollouts::Rollouts;
pub use sources::{needs_tokenizer, training_files};
pub use split::held_out;

use crate::config::{DatasetSection, Stage};
use crate::error::{Error, Result};
pub use read::{ImageProcessor, Images};
use read::{Read, Reader, read_all};
use sources::{Source, check_tools, train_and_eval_sources};

pub const IGNORE_INDEX: i32 = -100;

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Example {
    pub input_ids: Vec<i32>,
    pub labels: Vec<i32>,
    /// Per-token positions of a packed row (restarting at 0 for each sample); empty for a
    /// single sample (positions 0..len).
    pub position_ids: Vec<i32>,
    /// The images whose tokens the row holds, in the order of their tokens (a
    /// vision-language model's rows); empty for text.
    pub images: Vec<RowImage>,
}

/// An image of a row: its file and its patch grid (`image_grid_thw`: temporal, height,
/// width patches), which sets how many image tokens it has in the row; for LLaVA-NeXT,
/// whose tiles and tokens follow from the image's size, (1, height, width) in pixels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowImage {
    pub path: PathBuf,
    pub grid: [u32; 3],
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

#[derive(Debug, Default)]
pub struct Dataset {
    /// The files it was read from.
    pub files: Vec<PathBuf>,
    pub rows: Vec<Example>,
    /// Training samples before packing.
    pub samples: usize,
    pub skipped: Skipped,
    /// The eval set: samples held out by `dataset.val_size` or read from
    /// `dataset.eval_name` / `eval_path` (never packed); empty without one.
    pub eval: Vec<Example>,
    /// Where the eval set came from, for the log.
    pub eval_source: String,
    /// `pt` packing: the block length and the tokens dropped after the last full block.
    pub blocks: Option<(usize, usize)>,
    /// `dpo`: the rows are preference pairs, rows 2i (prompt + chosen) and 2i + 1 (prompt
    /// + rejected) of sample i.
    pub pairs: bool,
    /// `grpo`: the rows are completions, with their rewards and groups ([`rollouts`]).
    pub rollouts: Option<Rollouts>,
    /// `grpo` with an eval set: the eval completions' rewards and groups.
    pub eval_rollouts: Option<Rollouts>,
    /// Which template rendered the conversations, when `dataset.chat_template` chose it.
    pub template_note: Option<String>,
}

impl Dataset {
    /// Reads every source of the `dataset` section for `stage`, training and eval,
    /// tokenizing text with the tokenizer and chat template of `model_dir`; bad records are
    /// skipped and counted, or errors with `dataset.strict`. Holds out `val_size` samples
    /// (seeded by `seed`), then packs the training rows when asked (shuffled first, seeded
    /// by `seed`; under `pt`, documents in order are cut into blocks, the eval set too).
    pub fn load(
        ds: &DatasetSection,
        stage: Stage,
        model_dir: &Path,
        vocab: usize,
        seed: u64,
    ) -> Result<Dataset> {
        if stage == Stage::Grpo {
            let Some(path) = &ds.path else {
                return Err(crate::config::grpo_needs_rollouts());
            };
            return rollouts_and_eval(ds, path, model_dir, vocab, seed);
        }
        ds.require_source()?;
        let (train, eval) = train_and_eval_sources(ds, stage)?;
        let chat = match train.iter().chain(&eval).any(|s| s.schema.is_some()) {
            true => Some(ChatTokenizer::load(
                model_dir,
                ds.chat_template.as_deref(),
                stage != Stage::Pt,
            )?),
            false => None,
        };
        if let Some(chat) = &chat {
            check_tools(train.iter().chain(&eval), chat, stage)?;
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(ds.num_workers)
            .build()
            .map_err(|e| Error::invalid("dataset.num_workers", e.to_string()))?;
        let images = match chat {
            Some(_) => Images::of_model(model_dir)?,
            None => Images::TextOnly,
        };
        let reader = Reader {
            ds,
            stage,
            chat: chat.as_ref(),
            vocab,
            images: &images,
        };
        let read = |srcs: &[Source]| pool.install(|| read_all(srcs, &reader));
        let Read {
            files,
            mut rows,
            skipped,
        } = read(&train)?;
        let (eval, eval_source) = match ds.val_size()? {
            // A pair's two rows are held out together.
            Some(size) if stage == Stage::Dpo => {
                let pair: Vec<usize> = (0..rows.len()).map(|i| i / 2).collect();
                let held = split::held_rows(&pair, size, seed, "preference pairs")?;
                let (train, held) = split::partition(std::mem::take(&mut rows), &held);
                rows = train;
                let from = format!(
                    "held out of the training pairs (dataset.val_size: {})",
                    ds.val_size.unwrap_or_default()
                );
                (held, from)
            }
            Some(size) => {
                let held = split::hold_out(&mut rows, size, seed)?;
                let from = format!(
                    "held out of the training samples (dataset.val_size: {})",
                    ds.val_size.unwrap_or_default()
                );
                (held, from)
            }
            None if eval.is_empty() => (Vec::new(), String::new()),
            None => {
                let e = read(&eval)?;
                let mut from = format!("from {}", list(&e.files));
                if e.skipped.count > 0 {
                    from += &format!("; {}", e.skipped);
                }
                (e.rows, from)
            }
        };
        let pairs = stage == Stage::Dpo;
        let mut data = Dataset {
            files,
            samples: if pairs { rows.len() / 2 } else { rows.len() },
            rows,
            skipped,
            eval,
            eval_source,
            blocks: None,
            pairs,
            rollouts: None,
            eval_rollouts: None,
            template_note: chat.as_ref().and_then(ChatTokenizer::note),
        };
        match (ds.packing, ds.max_seq_len) {
            (true, Some(len)) if reader.pt_blocks() => {
                let bos = chat.as_ref().and_then(|c| c.bos()).map(|(id, _)| id);
                let (rows, dropped) = pretrain::blocks(&data.rows, len, bos);
                if rows.is_empty() {
                    return Err(Error::DatasetFile {
                        path: data.files.first().cloned().unwrap_or_default(),
                        msg: format!(
                            "{} documents hold {dropped} tokens, fewer than one block of dataset.max_seq_len ({len}) tokens",
                            data.samples
                        ),
                    });
                }
                data.rows = rows;
                data.blocks = Some((len, dropped));
                if !data.eval.is_empty() {
                    let (eval, dropped) = pretrain::blocks(&data.eval, len, bos);
                    if eval.is_empty() {
                        return Err(Error::invalid(
                            "dataset.max_seq_len",
                            format!(
                                "the eval documents ({}) hold {dropped} tokens, fewer than one block of {len} tokens",
                                data.eval_source
                            ),
                        ));
                    }
                    data.eval = eval;
                }
            }
            (true, Some(max)) => {
                let mut docs = std::mem::take(&mut data.rows);
                if ds.shuffle {
                    docs.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
                }
                data.rows = pack(docs, max);
            }
            _ => {}
        }
        Ok(data)
    }

    /// What one epoch passes over, as the sampler draws it: the pairs under DPO, else the
    /// training rows (packed rows or pretraining blocks where the documents were joined),
    /// with their name for the log.
    pub fn epoch_len(&self) -> (usize, &'static str) {
        match (self.pairs, self.blocks.is_some()) {
            (true, _) => (self.samples, "pairs"),
            (false, true) => (self.rows.len(), "blocks"),
            (false, false) if self.rows.len() != self.samples => (self.rows.len(), "packed rows"),
            (false, false) => (self.rows.len(), "samples"),
        }
    }

    /// Lines for the log: rows, sources, skipped records and the first reasons, the eval set.
    pub fn summary(&self) -> String {
        let what = match (self.pairs, &self.rollouts) {
            (true, _) => format!(
                "{} preference pairs ({} rows)",
                self.samples,
                self.rows.len()
            ),
            (false, Some(r)) => format!(
                "{} completions in {} groups, mean reward {:.4}",
                self.samples,
                r.groups.iter().max().map_or(0, |g| g + 1),
                r.rewards.iter().sum::<f64>() / r.rewards.len().max(1) as f64
            ),
            (false, None) => format!("{} samples", self.samples),
        };
        let mut s = format!("dataset: {what} from {}", list(&self.files));
        match self.blocks {
            Some((len, dropped)) => {
                s += &format!(
                    ", concatenated into {} blocks of {len} tokens ({dropped} tokens after the last full block dropped)",
                    self.rows.len()
                )
            }
            None if !self.pairs && self.rows.len() != self.samples => {
                s += &format!(", packed into {} rows", self.rows.len())
            }
            None => {}
        }
        if self.skipped.count > 0 {
            s += &format!("; {}", self.skipped);
        }
        if let Some(note) = &self.template_note {
            s += &format!("\n{note}");
        }
        if !self.eval.is_empty() {
            let what = match (self.pairs, &self.eval_rollouts) {
                (true, _) => format!("{} preference pairs", self.eval.len() / 2),
                (false, Some(_)) => format!("{} completions", self.eval.len()),
                (false, None) => format!("{} samples", self.eval.len()),
            };
            s += &format!("\neval set: {what} {}", self.eval_source);
        }
        s
    }
}

/// A `grpo` dataset: the rollouts file `path`, and the eval rollouts: whole groups held
/// out by `dataset.val_size` (seeded by `seed`), or the rollouts file `dataset.eval_path`.
fn rollouts_and_eval(
    ds: &DatasetSection,
    path: &Path,
    model_dir: &Path,
    vocab: usize,
    seed: u64,
) -> Result<Dataset> {
    let template = ds.chat_template.as_deref();
    let (mut rows, mut r, template_note) = rollouts::read(path, model_dir, template, vocab)?;
    let (mut eval, mut eval_r, mut eval_source) = (Vec::new(), None, String::new());
    if let Some(size) = ds.val_size()? {
        let held = split::held_rows(&r.groups, size, seed, "groups of completions")?;
        let (train, held_rows) = split::partition(std::mem::take(&mut rows), &held);
        let (train_r, held_r) = r.split(&held);
        (rows, r, eval, eval_r) = (train, train_r, held_rows, Some(held_r));
        eval_source = format!(
            "held out of the training groups (dataset.val_size: {})",
            ds.val_size.unwrap_or_default()
        );
    } else if let Some(eval_path) = &ds.eval_path {
        let (e, er, _) = rollouts::read(eval_path, model_dir, template, vocab)?;
        (eval, eval_r) = (e, Some(er));
        eval_source = format!("from {}", eval_path.display());
    }
    Ok(Dataset {
        files: vec![path.to_path_buf()],
        samples: rows.len(),
        rows,
        rollouts: Some(r),
        eval,
        eval_source,
        eval_rollouts: eval_r,
        template_note,
        ..Dataset::default()
    })
}

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} records skipped (dataset.strict: true makes them errors), first: {}",
            self.count,
            self.first.join("; ")
        )
    }
}

fn list(files: &[PathBuf]) -> String {
    let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    names.join(", ")
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
            images: Vec::new(),
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
    fn bad_rows_name_file_and_line_when_strict_and_are_counted_otherwise() {
        let p = tmp(
            "bad.jsonl",
            "{\"input_ids\": [1, 2]}\n{\"input_ids\": [1, 99]}\n{\"input_ids\": [1, 2], \"labels\": [1]}\n",
        );
        let yaml = format!("{{format: tokenized, path: {}, strict: true}}", p.display());
        let e = Dataset::load(&section(&yaml), Stage::Sft, Path::new("."), 50, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2") && e.contains("entry 1 is 99"), "{e}");
        assert!(
            e.contains("bad.jsonl") && e.contains("field `input_ids`"),
            "{e}"
        );
        let yaml = format!("{{format: tokenized, path: {}}}", p.display());
        let d = Dataset::load(&section(&yaml), Stage::Sft, Path::new("."), 50, 0).unwrap();
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
        let d = Dataset::load(&section(&yaml), Stage::Sft, Path::new("."), 50, 0).unwrap();
        assert_eq!(d.rows[0].input_ids, [1, 2, 3]);
        let d = Dataset::load(
            &section(&format!("{{{}, overlong: skip}}", &yaml[1..yaml.len() - 1])),
            Stage::Sft,
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
            Dataset::load(&section(&yaml), Stage::Sft, Path::new("."), 50, seed)
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
        let d = Dataset::load(&section(&unshuffled), Stage::Sft, Path::new("."), 50, 1).unwrap();
        assert_eq!(
            d.rows[0].doc_lens()[..2],
            [3, 4],
            "file order without shuffle"
        );
    }
}
