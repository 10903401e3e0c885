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

/// A tensor a layer reads but does not train (a buffer), in f32.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LayerBuffer {
    pub layer: usize,
    /// Name inside the layer (`mlp.gate.e_score_correction_bias`).
    pub name: String,
    pub values: Vec<f32>,
}

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
    spec.tower_nested = names
        .iter()
        .any(|(n, _)| n.contains("vision_tower.vision_model."));
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use safetensors::tensor::TensorView;

    use super::*;
    use crate::checkpoint::{ExportOptions, MasterMut, MasterRef, init_random, load_pretrained};
    use crate::config::DType;
    use crate::config::hf::HfConfig;

    fn gemma3(tie: bool) -> ModelSpec {
        let json = format!(
            r#"{{"model_type":"gemma3","tie_word_embeddings":{tie},"text_config":{{
            "vocab_size":37,"hidden_size":24,"intermediate_size":40,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":6}}}}"#
        );
        let hf: HfConfig = serde_json::from_str(&json).unwrap();
        ModelSpec::from_hf(&hf, Path::new("config.json")).unwrap()
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("mt-carried-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Writes `tensors` (name, dtype, shape, bytes) as `dir/model.safetensors`.
    fn write(dir: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: BTreeMap<&str, TensorView> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.as_str(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    }

    /// The text model's tensors of `layout` in f32 from `values`, under checkpoint names.
    fn text_tensors(layout: &Layout, values: &[f32]) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
        layout
            .tensors()
            .map(|(b, t)| {
                let bytes = values[Layout::global_range(b, t)]
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect();
                (b.hf_name(t), Dtype::F32, t.shape.clone(), bytes)
            })
            .collect()
    }

    #[test]
    fn wrapper_extras_load_around_the_text_model_and_export_byte_for_byte() {
        let dir = scratch("wrapper");
        let src = dir.join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("config.json"), r#"{"model_type":"gemma3"}"#).unwrap();
        // A checkpoint in the current names, which config.json cannot tell.
        let mut spec = gemma3(false);
        spec.names = TextNames::Current;
        let layout = Layout::new(&spec);
        let mut want = vec![0.0f32; layout.total];
        init_random(&layout, &spec, 5, &mut MasterMut::F32(&mut want));
        let mut tensors = text_tensors(&layout, &want);
        let extras = [
            (
                "model.vision_tower.patch.weight",
                Dtype::BF16,
                vec![3, 5],
                30,
            ),
            ("model.multi_modal_projector.scale", Dtype::F16, vec![7], 14),
            ("model.vision_tower.position_ids", Dtype::I64, vec![4], 32),
        ];
        for (name, dtype, shape, n) in extras {
            let bytes = (0..n).map(|i| (i * 37 % 251) as u8).collect();
            tensors.push((name.to_string(), dtype, shape, bytes));
        }
        write(&src, &tensors);

        let mut resolved = gemma3(false);
        assert_eq!(resolved.names, TextNames::Legacy, "the class's default");
        let carried_bytes = resolve(&src, &mut resolved).unwrap();
        assert_eq!(resolved.names, TextNames::Current, "read from the names");
        assert_eq!(carried_bytes, 30 + 14 + 32);
        let layout = Layout::new(&resolved);
        let mut got = vec![0.0f32; layout.total];
        load_pretrained(&src, &layout, &mut MasterMut::F32(&mut got)).unwrap();
        assert_eq!(got, want);
        let carried = Carried::read(&src, &layout).unwrap();
        assert_eq!(carried.bytes(), carried_bytes);
        assert!(carried.buffers(&layout, &src).unwrap().is_empty());

        // Exported in bf16, sharded: the text model converted, the extras as read.
        let out = dir.join("out");
        let opts = ExportOptions {
            dtype: DType::Bfloat16,
            source: src.clone(),
            max_shard_bytes: 4000,
            carried: std::sync::Arc::new(carried),
            chat_template: None,
        };
        super::super::save_hf(&out, &layout, MasterRef::F32(&got), &opts).unwrap();
        let mut exported = HashMap::new();
        for file in weight_files(&out).unwrap() {
            let r = pieces::Reader::open(&file).unwrap();
            for (name, info) in r.tensors() {
                let mut bytes = vec![0u8; info.data_offsets.1 - info.data_offsets.0];
                r.read_bytes(&info, 0..bytes.len(), &mut bytes).unwrap();
                exported.insert(name, (info.dtype, info.shape.clone(), bytes));
            }
        }
        assert_eq!(exported.len(), tensors.len(), "every input tensor, once");
        for (name, dtype, shape, bytes) in &tensors {
            let (d, s, b) = &exported[name];
            assert_eq!(s, shape, "{name}");
            if name.contains("vision") || name.contains("projector") {
                assert_eq!((d, b), (dtype, bytes), "{name} carried byte for byte");
            } else {
                assert_eq!(*d, Dtype::BF16, "{name}");
            }
        }
        // The export loads back: the same names, the extras again carried.
        let mut again = vec![0.0f32; layout.total];
        load_pretrained(&out, &layout, &mut MasterMut::F32(&mut again)).unwrap();
        assert_eq!(Carried::read(&out, &layout).unwrap(), *opts.carried);
    }

    #[test]
    fn a_tied_head_stored_with_values_of_its_own_unties() {
        let dir = scratch("tie");
        let spec = gemma3(true);
        let layout = Layout::new(&spec);
        let mut values = vec![0.0f32; layout.total];
        init_random(&layout, &spec, 9, &mut MasterMut::F32(&mut values));
        let mut tensors = text_tensors(&layout, &values);
        let embed = tensors
            .iter()
            .find(|t| t.0 == "language_model.model.embed_tokens.weight")
            .unwrap()
            .clone();
        // The same values (as torch .bin conversions store both): still tied.
        tensors.push((
            "language_model.lm_head.weight".into(),
            embed.1,
            embed.2,
            embed.3.clone(),
        ));
        write(&dir, &tensors);
        let mut s = gemma3(true);
        resolve(&dir, &mut s).unwrap();
        assert!(s.tie_word_embeddings);
        // Values of its own: untied, as transformers' tie_weights leaves it.
        tensors.last_mut().unwrap().3[0] ^= 0x40;
        write(&dir, &tensors);
        resolve(&dir, &mut s).unwrap();
        assert!(!s.tie_word_embeddings);
        assert!(
            Layout::new(&s)
                .blocks
                .last()
                .unwrap()
                .tensor("lm_head.weight")
                .is_some()
        );
        // No weights at all: the config decides.
        let empty = scratch("empty");
        let mut s = gemma3(true);
        assert_eq!(resolve(&empty, &mut s).unwrap(), 0);
        assert!(s.tie_word_embeddings && s.names == TextNames::Legacy);
    }

    #[test]
    fn buffers_come_from_the_checkpoint_or_start_at_zero() {
        let json = r#"{"model_type":"glm4_moe","vocab_size":37,"hidden_size":24,
            "intermediate_size":40,"num_hidden_layers":2,"num_attention_heads":4,
            "num_key_value_heads":2,"head_dim":8,"n_routed_experts":4,"num_experts_per_tok":2,
            "moe_intermediate_size":8}"#;
        let hf: HfConfig = serde_json::from_str(json).unwrap();
        let spec = ModelSpec::from_hf(&hf, Path::new("config.json")).unwrap();
        let layout = Layout::new(&spec);
        let init = Carried::init(&layout);
        assert_eq!(init.tensors.len(), 1);
        assert_eq!(
            init.tensors[0].name,
            "model.layers.1.mlp.gate.e_score_correction_bias"
        );
        let b = init.buffers(&layout, Path::new("x")).unwrap();
        assert_eq!((b[0].layer, b[0].values.as_slice()), (1, &[0.0f32; 4][..]));
        // From a checkpoint, in bf16; a missing one is named.
        let bias = [0.5f32, -1.25, 2.0, 0.0];
        let bytes = bias
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect();
        let read = Carried {
            tensors: vec![CarriedTensor {
                name: "model.layers.1.mlp.gate.e_score_correction_bias".into(),
                dtype: Dtype::BF16,
                shape: vec![4],
                bytes,
            }],
        };
        assert_eq!(
            read.buffers(&layout, Path::new("x")).unwrap()[0].values,
            bias
        );
        let e = Carried::default()
            .buffers(&layout, Path::new("ckpt"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("e_score_correction_bias") && e.contains("missing"),
            "{e}"
        );
    }
}
