//! Export of an HF model directory that transformers loads as is: `config.json` (its `dtype`
//! set to the exported one, any `quantization_config` dropped), the weights in the chosen dtype, and the tokenizer and
//! generation files of the source model directory copied when present.
//!
//! Weights larger than `max_shard_bytes` are split as huggingface_hub splits a state dict:
//! tensors in order (the layout's: embedding, layers, final norm, head), a new shard when
//! the next tensor would overflow the current one, a tensor larger than the limit alone;
//! shards are `model-00001-of-0000N.safetensors` listed by `model.safetensors.index.json`.
//! The files are created with their headers first and each block's tensors written at their
//! offsets, converted from the fp32 master a chunk at a time ([`ExportFiles`]): the export
//! holds no copy of the model nor of any whole tensor, and a checkpoint written while
//! training goes on writes each block from wherever its consistent copy is
//! ([`super::writer`]). Carried tensors ([`super::carried`]) follow the trained ones, byte
//! for byte as read.
//!
//! A standalone export ([`save_hf`], [`ExportFiles::create`]) is written whole into a fresh
//! temporary directory beside the output, `<parent>/.<name>.mt-tmp-<random>/`, every file
//! created exclusively ([`super::atomic`]) and fsynced, its manifest
//! ([`super::manifest::EXPORT_MARKER`], the files' sizes and CRC32C) last; only then is it
//! put in place ([`install`]): at every instant the output's name holds the previous
//! complete export or the new one, never a partial one. A value that is not finite is
//! refused as it is written, so an export never replaces a finite model with a broken
//! one. Inside a checkpoint's own temporary directory the files are written in place
//! ([`ExportFiles::create_in`]) and listed in the checkpoint's manifest instead.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::Dtype;

use super::MasterRef;
use super::atomic;
use super::carried::SharedCarried;
use super::manifest::{EXPORT_MARKER, Entry, Manifest};
use super::pieces::{self, Meta, Positioned};
use super::state::{BlockValues, Field, Tensors, WRITE_CHUNK};
use super::streams::{self, Shifted};
use crate::config::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::shm::f32_bytes;

/// Files of a model directory besides config and weights that an export carries over.
pub const COPIED_FILES: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    // A vision-language model's processor: without it, transformers' AutoProcessor (and a
    // run on the export) cannot read images.
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
];

const SINGLE: &str = "model.safetensors";
const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
const INDEX: &str = "model.safetensors.index.json";

mod install;
pub use install::{is_weight_file, recover_export};

/// What an export writes besides the tensors.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// Dtype of the written weights.
    pub dtype: DType,
    /// The model directory whose `config.json` and [`COPIED_FILES`] are carried over.
    pub source: PathBuf,
    /// Weights above this many bytes are sharded.
    pub max_shard_bytes: u64,
    /// Tensors written back as read (a wrapper's vision tower, extra heads, buffers).
    pub carried: SharedCarried,
    /// The chat template the data was rendered with when `dataset.chat_template` chose it:
    /// written as `chat_template.jinja` (which transformers reads over tokenizer_config.json's
    /// `chat_template`) in place of the source's, so the model renders as it was trained.
    pub chat_template: Option<String>,
}

/// The safetensors dtype of `dtype`.
fn st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::Float32 => Dtype::F32,
        DType::Bfloat16 => Dtype::BF16,
    }
}

/// Splits tensor sizes (in order) into shards of at most `max` bytes; a tensor larger than
/// `max` gets a shard of its own. Returns each tensor's shard index.
fn plan_shards(sizes: &[usize], max: u64) -> Vec<usize> {
    let (mut shard, mut used) = (0usize, 0u64);
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            if i > 0 && used + n as u64 > max {
                shard += 1;
                used = 0;
            }
            used += n as u64;
            shard
        })
        .collect()
}

fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
}

/// Creates `dir/name` exclusively with `bytes` and returns its manifest entry.
fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> Result<Entry> {
    let crc = atomic::write_new(&dir.join(name), bytes)?;
    Ok(Entry::new(name, bytes.len() as u64, crc))
}

/// `config.json` of the source with `dtype` (transformers 5) and `torch_dtype` (older
/// versions, if present) saying what the weights are, and no `quantization_config`.
fn exported_config(src: &Path, dtype: DType) -> Result<Vec<u8>> {
    let text = std::fs::read_to_string(src).map_err(|e| Error::io(src, e))?;
    let mut cfg: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::ModelConfig {
            path: src.into(),
            msg: format!("not a valid config.json: {e}"),
        })?;
    let obj = cfg.as_object_mut().ok_or_else(|| Error::ModelConfig {
        path: src.into(),
        msg: "not a JSON object".into(),
    })?;
    let name = match dtype {
        DType::Float32 => "float32",
        DType::Bfloat16 => "bfloat16",
    };
    obj.insert("dtype".into(), name.into());
    if obj.contains_key("torch_dtype") {
        obj.insert("torch_dtype".into(), name.into());
    }
    // The weights are written dequantized (GPT-OSS's MXFP4 experts, `mxfp4`): a
    // `quantization_config` would make transformers look for packed tensors.
    obj.remove("quantization_config");
    let mut out = serde_json::to_vec_pretty(&cfg).expect("a JSON value serializes");
    out.push(b'\n');
    Ok(out)
}

/// Writes an HF model directory to `out` from `master` and returns the files written;
/// blocks are converted and written in parallel. The whole directory is written aside and
/// then put in place ([`install`]): `out` holds the previous export until the new one is
/// complete.
pub fn save_hf(
    out: &Path,
    layout: &Layout,
    master: MasterRef<'_>,
    opts: &ExportOptions,
) -> Result<Vec<PathBuf>> {
    let files = ExportFiles::create(out, layout, opts)?;
    // One block at a time, each written by its own stream threads (`super::streams`),
    // which may compute its values on rayon's pool (a split master is joined there). Blocks
    // on the pool's threads instead would leave none free for that work once every one of
    // them waits for its streams: the export of a split master hung so (Qwen2.5-7B, 30
    // blocks, 16 threads; `a_split_master_exports_with_more_blocks_than_threads`).
    (0..layout.blocks.len()).try_for_each(|b| {
        let r = layout.blocks[b].range();
        files.write_block(b, &Tensors::master_only(master.slice(r)))
    })?;
    files.finish()
}

/// An HF model directory being written: its weight files are created with their headers
/// and the carried tensors; the trained tensors follow block by block, in any order
/// ([`ExportFiles::write_block`]); [`ExportFiles::finish`] adds the index, the config and
/// the copied files.
pub struct ExportFiles<'a> {
    /// Where the files are written.
    dir: PathBuf,
    /// The output directory `dir` is put in place as, for a standalone export (`dir` is
    /// then its temporary directory); None inside a checkpoint's directory.
    out: Option<PathBuf>,
    layout: &'a Layout,
    opts: &'a ExportOptions,
    shards: Vec<Positioned>,
    /// Each block's tensors: HF name and shard.
    names: Vec<Vec<(String, usize)>>,
    /// The shard of each tensor, trained ones (in layout order) then carried ones.
    shard_of: Vec<usize>,
    /// Bytes of the weights in all.
    total: usize,
}

impl<'a> ExportFiles<'a> {
    /// Starts a standalone export to `out`: a fresh temporary directory beside it, its
    /// weight files created, sharded as huggingface_hub shards, with the carried tensors
    /// written. `out` itself is untouched until [`ExportFiles::finish`]. A link at `out`
    /// is resolved: the export goes where it points.
    pub fn create(
        out: &Path,
        layout: &'a Layout,
        opts: &'a ExportOptions,
    ) -> Result<ExportFiles<'a>> {
        let out = install::resolve(out)?;
        let (parent, name) = install::split(&out)?;
        let tmp = atomic::temp_dir(&parent, &format!(".{name}"))?;
        let files = Self::create_in(&tmp, layout, opts).map(|mut f| {
            f.out = Some(out.clone());
            f
        });
        if files.is_err() {
            let _ = atomic::remove_ours(&tmp);
        }
        files
    }

    /// Creates the weight files in directory `dir` (which exists: a checkpoint's temporary
    /// directory), as [`ExportFiles::create`] does.
    pub fn create_in(
        dir: &Path,
        layout: &'a Layout,
        opts: &'a ExportOptions,
    ) -> Result<ExportFiles<'a>> {
        let out = dir;
        let carried = &opts.carried.tensors;
        let sizes: Vec<usize> = layout
            .tensors()
            .map(|(_, t)| t.numel() * opts.dtype.size())
            .chain(carried.iter().map(|c| c.bytes.len()))
            .collect();
        let shard_of = plan_shards(&sizes, opts.max_shard_bytes);
        let n = shard_of.last().map_or(1, |s| s + 1);
        let mut metas: Vec<Vec<Meta>> = vec![Vec::new(); n];
        let mut names: Vec<Vec<(String, usize)>> = vec![Vec::new(); layout.blocks.len()];
        let mut shards = shard_of.iter();
        for (bi, b) in layout.blocks.iter().enumerate() {
            for t in &b.tensors {
                let shard = *shards.next().expect("a shard per tensor");
                metas[shard].push(Meta {
                    name: b.hf_name(t),
                    dtype: st_dtype(opts.dtype),
                    shape: t.shape.clone(),
                });
                names[bi].push((b.hf_name(t), shard));
            }
        }
        let carried_shards: Vec<usize> = shards.copied().collect();
        for (c, &shard) in carried.iter().zip(&carried_shards) {
            metas[shard].push(Meta {
                name: c.name.clone(),
                dtype: c.dtype,
                shape: c.shape.clone(),
            });
        }
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        let shard_files = metas
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                let name = if n == 1 {
                    SINGLE.to_string()
                } else {
                    shard_name(i, n)
                };
                Positioned::create(&out.join(name), m, Some(meta.clone()))
            })
            .collect::<Result<Vec<_>>>()?;
        for (c, &shard) in carried.iter().zip(&carried_shards) {
            shard_files[shard].write(&c.name, 0, &c.bytes)?;
        }
        Ok(ExportFiles {
            dir: out.into(),
            out: None,
            layout,
            opts,
            shards: shard_files,
            names,
            total: sizes.iter().sum(),
            shard_of,
        })
    }

    /// Writes the tensors of block `b` from `values` (its master, fp32), converted to the
    /// export dtype a chunk at a time.
    pub fn write_block(&self, b: usize, values: &dyn BlockValues) -> Result<()> {
        self.write_window(b, 0..self.layout.blocks[b].len, values)
    }

    /// Writes elements `window` of block `b` (within the block) from `values`, whose
    /// element 0 is element `window.start`: each tensor's part in the window, at its
    /// offsets. Node 0 of a sharded run writes a large block this way as it gathers it, a
    /// window at a time, so that it never holds the whole block ([`super::state`]).
    pub fn write_window(
        &self,
        b: usize,
        window: Range<usize>,
        values: &dyn BlockValues,
    ) -> Result<()> {
        streams::in_streams(window.clone(), |part| {
            let by = part.start - window.start;
            self.write_range(b, part, &Shifted { values, by })
        })
    }

    /// [`ExportFiles::write_window`] on this thread alone.
    pub(super) fn write_range(
        &self,
        b: usize,
        window: Range<usize>,
        values: &dyn BlockValues,
    ) -> Result<()> {
        let block = &self.layout.blocks[b];
        assert!(window.end <= block.len, "the window lies within block {b}");
        for (t, (name, shard)) in block.tensors.iter().zip(&self.names[b]) {
            let file = &self.shards[*shard];
            // The tensor's elements in the window, within the tensor.
            let (lo, hi) = (
                window.start.max(t.offset) - t.offset,
                window
                    .end
                    .min(t.offset + t.numel())
                    .saturating_sub(t.offset),
            );
            for at in (lo..hi).step_by(WRITE_CHUNK) {
                let first = t.offset + at - window.start;
                let x = values.values(Field::Master, first..first + (hi - at).min(WRITE_CHUNK));
                check_finite(&x, file.path(), name, at)?;
                match self.opts.dtype {
                    DType::Float32 => file.write(name, 4 * at, f32_bytes(&x))?,
                    DType::Bfloat16 => pieces::with_bytes(|buf| {
                        buf.resize(2 * x.len(), 0);
                        for (d, s) in buf.chunks_exact_mut(2).zip(x.iter()) {
                            d.copy_from_slice(&bf16::from_f32(*s).to_le_bytes());
                        }
                        file.write(name, 2 * at, buf)
                    })?,
                }
                if self.out.is_some() {
                    install::pause_at("mid-tensor");
                }
            }
        }
        Ok(())
    }

    /// Finishes a standalone export: the index (when sharded), the config and the copied
    /// files, every file fsynced, the manifest last, then the directory put in place of the
    /// output ([`install`]). Returns every file of the export under the output's name.
    pub fn finish(mut self) -> Result<Vec<PathBuf>> {
        let out = self
            .out
            .take()
            .expect("a standalone export (ExportFiles::create)");
        let tmp = self.dir.clone();
        let done = self.finish_in().and_then(|entries| {
            install::pause_at("manifest");
            Manifest::new(entries.clone()).write(&tmp, EXPORT_MARKER)?;
            install::install(&tmp, &out)?;
            Ok(entries)
        });
        match done {
            Ok(entries) => Ok(entries.iter().map(|e| out.join(&e.name)).collect()),
            Err(e) => {
                if atomic::is_real_dir(&tmp) {
                    let _ = atomic::remove_ours(&tmp);
                }
                Err(e)
            }
        }
    }

    /// Writes the index (when sharded), the config and the copied files into the
    /// directory, fsyncs the weight files, and returns the manifest entries of all.
    pub fn finish_in(mut self) -> Result<Vec<Entry>> {
        let shards = std::mem::take(&mut self.shards);
        let (dir, opts) = (&self.dir, self.opts);
        let n = shards.len();
        let mut written = Vec::with_capacity(n + COPIED_FILES.len() + 2);
        let index = (n > 1).then(|| {
            let weight_map: serde_json::Map<String, serde_json::Value> = self
                .names
                .iter()
                .flatten()
                .map(|(name, _)| name)
                .chain(opts.carried.tensors.iter().map(|c| &c.name))
                .zip(&self.shard_of)
                .map(|(name, &s)| (name.clone(), shard_name(s, n).into()))
                .collect();
            serde_json::json!({
                "metadata": {"total_size": self.total},
                "weight_map": weight_map,
            })
        });
        for shard in shards {
            written.push(shard.finish()?);
            install::pause_at("between-files");
        }
        if let Some(index) = index {
            let json = serde_json::to_vec_pretty(&index).expect("JSON serializes");
            written.push(write_file(dir, INDEX, &json)?);
        }
        let cfg_src = opts.source.join("config.json");
        let cfg = exported_config(&cfg_src, opts.dtype)?;
        written.push(write_file(dir, "config.json", &cfg)?);
        if let Some(text) = &opts.chat_template {
            written.push(write_file(dir, CHAT_TEMPLATE_FILE, text.as_bytes())?);
        }
        for name in COPIED_FILES {
            let src = opts.source.join(name);
            if !src.is_file() || (*name == CHAT_TEMPLATE_FILE && opts.chat_template.is_some()) {
                continue;
            }
            let bytes = std::fs::read(&src).map_err(|e| Error::io(&src, e))?;
            written.push(write_file(dir, name, &bytes)?);
        }
        Ok(written)
    }
}

impl Drop for ExportFiles<'_> {
    /// A standalone export given up before [`ExportFiles::finish`] (a write failed) removes
    /// its temporary directory; the output keeps the previous export.
    fn drop(&mut self) {
        if self.out.is_some() && atomic::is_real_dir(&self.dir) {
            let _ = atomic::remove_ours(&self.dir);
        }
    }
}

/// Fails where `x` (elements from `at` of tensor `name`, written to `file`) holds a value
/// that is not finite: such a model is never written over a finite one.
pub(super) fn check_finite(x: &[f32], file: &Path, name: &str, at: usize) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(Error::Tensor {
            path: file.into(),
            tensor: name.into(),
            expected: "finite values (nothing written: the previous model is kept)".into(),
            got: format!("{} at element {}", x[i], at + i),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_split_like_huggingface_hub() {
        assert_eq!(plan_shards(&[4, 4, 4], 100), [0, 0, 0]);
        assert_eq!(plan_shards(&[4, 4, 4], 8), [0, 0, 1]);
        // A tensor larger than the limit sits alone.
        assert_eq!(plan_shards(&[2, 20, 2, 2], 5), [0, 1, 2, 2]);
        assert_eq!(plan_shards(&[20, 1], 5), [0, 1]);
        assert_eq!(shard_name(0, 3), "model-00001-of-00003.safetensors");
    }
}
