//! What a checkpoint holds besides the trained tensors: the vision tower, projector and
//! extra heads of a multimodal wrapper (`model.visual.*`, `vision_tower.*`,
//! `multi_modal_projector.*`, `mtp.*`), the multi-token-prediction layers GLM-4.5 and
//! DeepSeek-V3 number after their decoder layers, and buffers the text model reads but
//! does not train (the routers' `e_score_correction_bias`). These are carried: kept on the
//! host as read (not in the shared store, not in the optimizer) and written back by every
//! export under their own names, dtypes and shapes, byte for byte, so the exported
//! directory loads wherever the input did. Workers get the buffers in f32 at start-up.
//!
//! [`resolve`] also settles, from the weight files' names, what config.json leaves open:
//! which name layout a wrapper's checkpoint uses, and whether a head the config ties is in
//! fact stored with values of its own (transformers then leaves it untied too).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::Dtype;

use super::{pieces, weight_files};
use crate::config::hf::{ModelSpec, TextNames};
use crate::error::{Error, Result};
use crate::layout::{CarryRule, Layout};
use crate::protocol::LayerBuffer;

/// One carried tensor, its bytes exactly as read.
#[derive(Debug, Clone, PartialEq)]
pub struct CarriedTensor {
    /// The checkpoint's name.
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl CarriedTensor {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The little-endian bytes of elements `elems`.
    pub fn element_bytes(&self, elems: std::ops::Range<usize>) -> &[u8] {
        let bits = self.dtype.bitsize();
        &self.bytes[elems.start * bits / 8..elems.end * bits / 8]
    }
}

/// Every carried tensor of a run, in checkpoint order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Carried {
    pub tensors: Vec<CarriedTensor>,
}

impl Carried {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.bytes.len() as u64).sum()
    }

    /// Reads every tensor of `dir`'s weight files that `layout` carries, a piece at a time.
    pub fn read(dir: &Path, layout: &Layout) -> Result<Carried> {
        let mut tensors = Vec::new();
        for file in weight_files(dir)? {
            let reader = pieces::Reader::open(&file)?;
            for (name, info) in reader.tensors() {
                if !layout.carry.carries(&name) {
                    continue;
                }
                let len = info.data_offsets.1 - info.data_offsets.0;
                let mut bytes = vec![0u8; len];
                for (i, chunk) in bytes.chunks_mut(4 * pieces::PIECE).enumerate() {
                    let at = i * 4 * pieces::PIECE;
                    reader.read_bytes(&info, at..at + chunk.len(), chunk)?;
                }
                tensors.push(CarriedTensor {
                    name,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    bytes,
                });
            }
        }
        Ok(Carried { tensors })
    }

    /// What a random init carries: the buffers, zero in f32 (transformers' init).
    pub fn init(layout: &Layout) -> Carried {
        let rule = &layout.carry;
        let tensors = rule
            .buffers
            .iter()
            .map(|(l, name, shape)| CarriedTensor {
                name: rule.buffer_name(*l, name),
                dtype: Dtype::F32,
                shape: shape.clone(),
                bytes: vec![0; 4 * shape.iter().product::<usize>()],
            })
            .collect();
        Carried { tensors }
    }

    /// The layers' buffers in f32, for the workers; `dir` names the checkpoint in errors.
    pub fn buffers(&self, layout: &Layout, dir: &Path) -> Result<Vec<LayerBuffer>> {
        let rule = &layout.carry;
        let by_name: HashMap<&str, &CarriedTensor> =
            self.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        rule.buffers
            .iter()
            .map(|(layer, name, shape)| {
                let hf = rule.buffer_name(*layer, name);
                let t = by_name.get(hf.as_str()).ok_or_else(|| Error::Tensor {
                    path: dir.into(),
                    tensor: hf.clone(),
                    expected: "present in the checkpoint".into(),
                    got: "missing".into(),
                })?;
                let bad = |got: String| Error::Tensor {
                    path: dir.into(),
                    tensor: hf.clone(),
                    expected: format!("a float tensor of shape {shape:?}"),
                    got,
                };
                if &t.shape != shape {
                    return Err(bad(format!("shape {:?}", t.shape)));
                }
                if pieces::float_width(t.dtype).is_none() {
                    return Err(bad(format!("dtype {:?}", t.dtype)));
                }
                let mut values = vec![0.0f32; t.numel()];
                pieces::convert(t.dtype, &t.bytes, &mut values);
                Ok(LayerBuffer {
                    layer: *layer,
                    name: name.clone(),
                    values,
                })
            })
            .collect()
    }
}

/// Shared, read-only carried tensors (exports on any thread read them).
pub type SharedCarried = Arc<Carried>;

/// The names of every tensor in `dir`'s weight files, with the file holding each; empty
/// when the directory has no weights (a config to plan or to initialize at random).
fn tensor_files(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let Ok(files) = weight_files(dir) else {
        return Ok(Vec::new());
    };
    let mut names = Vec::new();
    for file in files {
        let reader = pieces::Reader::open(&file)?;
        names.extend(reader.tensors().into_iter().map(|(n, _)| (n, file.clone())));
    }
    Ok(names)
}

/// Settles from `dir`'s weight files what config.json leaves open: a wrapper's name layout
/// (current or legacy names; the class's default when the directory has no weights), and
/// the tying: a head the config ties but the checkpoint stores with values of its own is
/// untied, as transformers' `tie_weights` leaves it. Returns the bytes the checkpoint
/// carries (0 without weights), for the host plan.
pub fn resolve(dir: &Path, spec: &mut ModelSpec) -> Result<u64> {
    let names = tensor_files(dir)?;
    if spec.wrapper.is_some()
        && let Some(found) = TextNames::detect(names.iter().map(|(n, _)| n.as_str()))
    {
        spec.names = found;
    }
    let head = spec.names.hf("lm_head.weight").into_owned();
    if spec.tie_word_embeddings
        && let Some((_, head_file)) = names.iter().find(|(n, _)| *n == head)
    {
        let embed = spec.names.hf("model.embed_tokens.weight").into_owned();
        let embed_file = names.iter().find(|(n, _)| *n == embed).map(|(_, f)| f);
        if let Some(embed_file) = embed_file
            && !same_values(head_file, &head, embed_file, &embed)?
        {
            spec.tie_word_embeddings = false;
        }
    }
    let rule = CarryRule::new(spec);
    let mut bytes = 0;
    let mut files: Vec<&PathBuf> = names.iter().map(|(_, f)| f).collect();
    files.dedup();
    for file in files {
        let reader = pieces::Reader::open(file)?;
        for (name, info) in reader.tensors() {
            if rule.carries(&name) {
                bytes += (info.data_offsets.1 - info.data_offsets.0) as u64;
            }
        }
    }
    Ok(bytes)
}

/// Whether tensors `a` (in file `fa`) and `b` (in `fb`) hold the same values, compared a
/// piece at a time in f32.
fn same_values(fa: &Path, a: &str, fb: &Path, b: &str) -> Result<bool> {
    let (ra, rb) = (pieces::Reader::open(fa)?, pieces::Reader::open(fb)?);
    let (Some(ia), Some(ib)) = (ra.tensor(a), rb.tensor(b)) else {
        return Ok(false);
    };
    if ia.shape != ib.shape
        || pieces::float_width(ia.dtype).is_none()
        || pieces::float_width(ib.dtype).is_none()
    {
        return Ok(false);
    }
    let n: usize = ia.shape.iter().product();
    let (mut xa, mut xb) = (vec![0.0f32; pieces::PIECE], vec![0.0f32; pieces::PIECE]);
    for lo in (0..n).step_by(pieces::PIECE) {
        let hi = (lo + pieces::PIECE).min(n);
        let (pa, pb) = (&mut xa[..hi - lo], &mut xb[..hi - lo]);
        ra.read_f32(ia, lo..hi, pa)?;
        rb.read_f32(ib, lo..hi, pb)?;
        if pa != pb {
            return Ok(false);
        }
    }
    Ok(true)
}
