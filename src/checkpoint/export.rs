//! Export of an HF model directory that transformers loads as is: `config.json` (its `dtype`
//! set to the exported one, any `quantization_config` dropped), the weights in the chosen dtype, and the tokenizer and
//! generation files of the source model directory copied when present.
//!
//! Weights larger than `max_shard_bytes` are split as huggingface_hub splits a state dict:
//! tensors in order (the layout's: embedding, layers, final norm, head), a new shard when
//! the next tensor would overflow the current one, a tensor larger than the limit alone;
//! shards are `model-00001-of-0000N.safetensors` listed by `model.safetensors.index.json`.
//! Each tensor is converted from the fp32 master while it is written, a piece at a time
//! ([`pieces`]), so the export holds no copy of the model nor of any whole tensor. Carried
//! tensors ([`carried`]) follow the trained ones, byte for byte as read.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::bf16;
use rayon::prelude::*;
use safetensors::Dtype;

use super::carried::SharedCarried;
use super::{MasterRef, carried, pieces};
use crate::config::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;

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
];

const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

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
}

/// The safetensors dtype of `dtype`.
fn st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::Float32 => Dtype::F32,
        DType::Bfloat16 => Dtype::BF16,
    }
}

/// Appends the bytes of `src` (fp32 master values) in `dtype` to `out`.
fn append_converted(src: MasterRef<'_>, dtype: DType, out: &mut Vec<u8>) {
    match dtype {
        DType::Float32 => super::state::append_f32(src, out),
        DType::Bfloat16 => {
            let at = out.len();
            out.resize(at + 2 * src.len(), 0);
            out[at..]
                .par_chunks_exact_mut(2)
                .zip(src.values().par_iter())
                .for_each(|(d, x)| d.copy_from_slice(&bf16::from_f32(*x).to_le_bytes()));
        }
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

/// `.NAME.tmp` beside `dst`.
fn tmp_for(dst: &Path) -> PathBuf {
    let name = dst
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    dst.with_file_name(format!(".{name}.tmp"))
}

/// Writes `bytes` to `dst` through a temporary file in the same directory.
fn write_atomic(dst: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_for(dst);
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, dst).map_err(|e| Error::io(dst, e))
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

/// Writes an HF model directory to `out` (created if needed) and returns the files written.
/// Every file is written under a temporary name and renamed; weight files of an earlier
/// export with another sharding are removed.
pub fn save_hf(
    out: &Path,
    layout: &Layout,
    master: MasterRef<'_>,
    opts: &ExportOptions,
) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    // The trained tensors (name, master range, shape) in layout order, then the carried.
    let tensors: Vec<(String, std::ops::Range<usize>, Vec<usize>)> = layout
        .tensors()
        .map(|(b, t)| (b.hf_name(t), Layout::global_range(b, t), t.shape.clone()))
        .collect();
    let carried = &opts.carried.tensors;
    let sizes: Vec<usize> = tensors
        .iter()
        .map(|(_, r, _)| r.len() * opts.dtype.size())
        .chain(carried.iter().map(|c| c.bytes.len()))
        .collect();
    let shard_of = plan_shards(&sizes, opts.max_shard_bytes);
    let n = shard_of.last().map_or(1, |s| s + 1);
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let mut written = Vec::new();
    for shard in 0..n {
        let name = if n == 1 {
            SINGLE.to_string()
        } else {
            shard_name(shard, n)
        };
        let path = out.join(&name);
        let (trained_shards, carried_shards) = shard_of.split_at(tensors.len());
        let members = tensors
            .iter()
            .zip(trained_shards)
            .filter(|(_, s)| **s == shard)
            .map(|((name, range, shape), _)| {
                let src = master.slice(range.clone());
                pieces::Entry {
                    name: name.clone(),
                    dtype: st_dtype(opts.dtype),
                    shape: shape.clone(),
                    fill: Box::new(move |r, out| append_converted(src.slice(r), opts.dtype, out)),
                }
            })
            .chain(
                carried
                    .iter()
                    .zip(carried_shards)
                    .filter(|(_, s)| **s == shard)
                    .map(|(c, _)| carried_entry(c)),
            )
            .collect();
        pieces::write(&path, members, Some(meta.clone()))?;
        written.push(path);
    }
    if n > 1 {
        let weight_map: serde_json::Map<String, serde_json::Value> = tensors
            .iter()
            .map(|(name, _, _)| name)
            .chain(carried.iter().map(|c| &c.name))
            .zip(&shard_of)
            .map(|(name, &s)| (name.clone(), shard_name(s, n).into()))
            .collect();
        let total: usize = sizes.iter().sum();
        let index = serde_json::json!({
            "metadata": {"total_size": total},
            "weight_map": weight_map,
        });
        let path = out.join(INDEX);
        write_atomic(
            &path,
            &serde_json::to_vec_pretty(&index).expect("JSON serializes"),
        )?;
        written.push(path);
    }
    remove_stale_weights(out, &written)?;

    let cfg_src = opts.source.join("config.json");
    let cfg_dst = out.join("config.json");
    write_atomic(&cfg_dst, &exported_config(&cfg_src, opts.dtype)?)?;
    written.push(cfg_dst);
    for name in COPIED_FILES {
        let src = opts.source.join(name);
        if !src.is_file() {
            continue;
        }
        let dst = out.join(name);
        let tmp = tmp_for(&dst);
        std::fs::copy(&src, &tmp).map_err(|e| Error::io(&src, e))?;
        std::fs::rename(&tmp, &dst).map_err(|e| Error::io(&dst, e))?;
        written.push(dst);
    }
    Ok(written)
}

/// A carried tensor to write: its bytes as read.
fn carried_entry(c: &carried::CarriedTensor) -> pieces::Entry<'_> {
    pieces::Entry {
        name: c.name.clone(),
        dtype: c.dtype,
        shape: c.shape.clone(),
        fill: Box::new(move |r, out| out.extend_from_slice(c.element_bytes(r))),
    }
}

/// Removes weight files in `dir` that are not in `keep` (an earlier export's shards or
/// single file), so that loaders see only this export.
fn remove_stale_weights(dir: &Path, keep: &[PathBuf]) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    for entry in entries {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let weights = name == SINGLE
            || name == INDEX
            || (name.starts_with("model-") && name.ends_with(".safetensors"));
        if weights && !keep.contains(&path) {
            std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
        }
    }
    Ok(())
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
