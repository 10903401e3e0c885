//! Weights in and out: HF safetensors into the fp32 master (every tensor checked by name,
//! shape and dtype), transformers-style random init, and export of an HF model directory.

pub mod area;
pub mod atomic;
pub mod carried;
pub mod direct;
pub mod export;
pub mod fed;
pub mod lock;
pub mod manifest;
pub mod master;
pub mod mxfp4;
pub mod old_logps;
pub mod owner;
pub mod ownership;
pub mod pieces;
pub mod reference;
mod schedule;
pub mod settings;
mod sidecar;
pub mod staging;
pub mod state;
pub mod streams;
pub mod vision;
pub mod writer;

pub use export::{ExportOptions, recover_export, save_hf};
pub use manifest::verify;
pub use master::{MasterMut, MasterRef};

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use crate::config::hf::ModelSpec;
use crate::error::{Error, Result};
use crate::layout::Layout;

/// Tensors HF checkpoints may carry that are buffers, not parameters.
const IGNORABLE_SUFFIXES: &[&str] = &["rotary_emb.inv_freq"];

/// The safetensors files of a model dir: `model.safetensors`, or the shards listed by
/// `model.safetensors.index.json`.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(Error::Weights {
            path: dir.into(),
            msg: "no model.safetensors or model.safetensors.index.json (use model.init: random to start from scratch)".into(),
        });
    }
    let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Weights {
        path: index.clone(),
        msg: format!("malformed index: {e}"),
    })?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::Weights {
            path: index.clone(),
            msg: "missing `weight_map` object".into(),
        })?;
    let mut files = Vec::with_capacity(map.len());
    for (tensor, file) in map {
        let file = file
            .as_str()
            .filter(|f| !f.contains('/'))
            .ok_or_else(|| Error::Tensor {
                path: index.clone(),
                tensor: tensor.clone(),
                expected: "a shard file name in the same directory".into(),
                got: file.to_string(),
            })?;
        files.push(dir.join(file));
    }
    files.sort();
    files.dedup();
    if let Some(missing) = files.iter().find(|f| !f.is_file()) {
        return Err(Error::Weights {
            path: index,
            msg: format!("lists shard {} which does not exist", missing.display()),
        });
    }
    Ok(files)
}

/// Checks, before a run starts, that `dir` (config key `key`) can be written: its nearest
/// existing ancestor is a directory in which a file can be created. Creates nothing.
pub fn check_writable(dir: &Path, key: &str) -> Result<()> {
    let fail = |msg: String| Error::invalid(key, format!("{}: {msg}", dir.display()));
    let base = dir
        .ancestors()
        .find(|a| a.exists())
        .ok_or_else(|| fail("no existing parent directory".into()))?;
    if !base.is_dir() {
        return Err(fail(format!("{} is not a directory", base.display())));
    }
    let probe = base.join(atomic::temp_name(".mt-write-probe"));
    atomic::create_new(&probe)
        .and_then(|_| std::fs::remove_file(&probe).map_err(|e| Error::io(&probe, e)))
        .map_err(|e| fail(format!("cannot write in {}: {e}", base.display())))
}

/// Loads every parameter of `layout` from the model dir into `master` (layout order),
/// reading each tensor a piece at a time ([`pieces`]): the files are never mapped whole.
/// A value that is not finite is an error naming the tensor and the file.
/// Carried tensors are skipped ([`carried::Carried::read`] holds them); MXFP4-packed expert
/// weights (GPT-OSS as published) are dequantized ([`mxfp4`]).
pub fn load_pretrained(dir: &Path, layout: &Layout, master: &mut MasterMut) -> Result<()> {
    let mut want: mxfp4::Wanted = layout
        .tensors()
        .map(|(b, t)| (b.hf_name(t), (Layout::global_range(b, t), t.shape.clone())))
        .collect();
    let mut loaded: HashMap<String, PathBuf> = HashMap::new();
    let readers = weight_files(dir)?
        .iter()
        .map(|f| pieces::Reader::open(f))
        .collect::<Result<Vec<_>>>()?;
    let packed = mxfp4::load(&readers, &mut want, &mut loaded, master)?;
    for reader in &readers {
        let file = reader.path().to_path_buf();
        for (name, info) in reader.tensors() {
            if packed.contains(&name) {
                continue;
            }
            let Some((range, shape)) = want.remove(&name) else {
                let ignorable = IGNORABLE_SUFFIXES.iter().any(|s| name.ends_with(s))
                    || (layout.tied_embeddings && name == layout.hf("lm_head.weight"))
                    || layout.carry.carries(&name);
                if ignorable {
                    continue;
                }
                let expected = match loaded.get(&name) {
                    Some(first) => format!("one copy (already read from {})", first.display()),
                    None => "no such tensor in this architecture".into(),
                };
                return Err(Error::Tensor {
                    path: file.clone(),
                    tensor: name,
                    expected,
                    got: format!("a tensor of shape {:?}", info.shape),
                });
            };
            loaded.insert(name.clone(), file.clone());
            if info.shape != shape {
                return Err(Error::Tensor {
                    path: file.clone(),
                    tensor: name,
                    expected: format!("shape {shape:?}"),
                    got: format!("shape {:?}", info.shape),
                });
            }
            if pieces::float_width(info.dtype).is_none() {
                return Err(Error::Tensor {
                    path: file.clone(),
                    tensor: name,
                    expected: "dtype F32, BF16, F16 or F64".into(),
                    got: format!("dtype {:?}", info.dtype),
                });
            }
            let start = range.start;
            master.try_fill(range, |first, out| {
                let elems = first - start..first - start + out.len();
                reader.read_f32(&info, elems.clone(), out)?;
                match out.iter().position(|v| !v.is_finite()) {
                    None => Ok(()),
                    Some(i) => Err(Error::Tensor {
                        path: file.clone(),
                        tensor: name.clone(),
                        expected: "finite values".into(),
                        got: format!("{} at element {}", out[i], elems.start + i),
                    }),
                }
            })?;
        }
    }
    if let Some(name) = want.keys().min() {
        return Err(Error::Tensor {
            path: dir.into(),
            tensor: name.clone(),
            expected: "present in the checkpoint".into(),
            got: format!("missing ({} tensors missing in all)", want.len()),
        });
    }
    Ok(())
}

/// transformers' `_init_weights` for these families: weights ~ normal(0, initializer_range),
/// norms 1 (0 where the norm multiplies by `1 + w`, as Gemma's), biases 0. Deterministic in
/// `seed`, independent of the thread count and of how the master is held.
pub fn init_random(layout: &Layout, spec: &ModelSpec, seed: u64, master: &mut MasterMut) {
    let normal = Normal::new(0.0f32, spec.initializer_range as f32).expect("finite std");
    for (ti, (b, t)) in layout.tensors().enumerate() {
        let range = Layout::global_range(b, t);
        let start = range.start;
        let constant = spec.constant_init(&t.name);
        let filled: std::result::Result<(), std::convert::Infallible> =
            master.try_fill(range, |first, piece| {
                match constant {
                    Some(v) => piece.fill(v),
                    None => {
                        let pi = (first - start) / master::PIECE;
                        let stream = ((ti as u64) << 32) | pi as u64;
                        let mut rng = ChaCha8Rng::seed_from_u64(
                            seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                        );
                        piece.iter_mut().for_each(|x| *x = normal.sample(&mut rng));
                    }
                }
                Ok(())
            });
        let Ok(()) = filled;
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::collections::BTreeMap;

    use half::bf16;
    use safetensors::{Dtype, View};

    use super::*;
    use crate::config::DType;
    use crate::config::hf::HfConfig;

    struct OwnedTensor {
        dtype: Dtype,
        shape: Vec<usize>,
        data: Vec<u8>,
    }

    impl View for &OwnedTensor {
        fn dtype(&self) -> Dtype {
            self.dtype
        }
        fn shape(&self) -> &[usize] {
            &self.shape
        }
        fn data(&self) -> Cow<'_, [u8]> {
            Cow::Borrowed(&self.data)
        }
        fn data_len(&self) -> usize {
            self.data.len()
        }
    }

    fn spec(tied: bool) -> ModelSpec {
        let json = format!(
            r#"{{"model_type":"llama","vocab_size":37,"hidden_size":24,"intermediate_size":40,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"tie_word_embeddings":{tied}}}"#
        );
        let hf: HfConfig = serde_json::from_str(&json).unwrap();
        ModelSpec::from_hf(&hf, Path::new("config.json")).unwrap()
    }

    #[test]
    fn save_then_load_round_trips_and_checks() {
        let dir = std::env::temp_dir().join(format!("mt-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = spec(true);
        let src = dir.join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("config.json"), r#"{"torch_dtype": "bfloat16"}"#).unwrap();
        std::fs::write(src.join("tokenizer.json"), "{\"tok\": 1}").unwrap();
        let layout = Layout::new(&s);
        let mut a = vec![0.0f32; layout.total];
        init_random(&layout, &s, 3, &mut MasterMut::F32(&mut a));
        let mut again = vec![0.0f32; layout.total];
        init_random(&layout, &s, 3, &mut MasterMut::F32(&mut again));
        assert_eq!(a, again, "init is deterministic");
        let norm = &layout.blocks[1].tensors[0];
        assert_eq!(norm.name, "input_layernorm.weight");
        assert!(
            a[Layout::global_range(&layout.blocks[1], norm)]
                .iter()
                .all(|&x| x == 1.0)
        );

        let out = dir.join("out");
        let mut opts = ExportOptions {
            dtype: DType::Float32,
            source: src.clone(),
            max_shard_bytes: 5_000_000_000,
            carried: Default::default(),
            chat_template: None,
        };
        save_hf(&out, &layout, MasterRef::F32(&a), &opts).unwrap();
        let mut b = vec![0.0f32; layout.total];
        load_pretrained(&out, &layout, &mut MasterMut::F32(&mut b)).unwrap();
        assert_eq!(a, b);
        // Into a split master, a piece at a time: the split of the same values, bit for bit,
        // and so is a random init.
        let n = layout.total;
        let (mut hi, mut lo) = (vec![bf16::ZERO; n], vec![0u16; n]);
        let (mut want_hi, mut want_lo) = (vec![bf16::ZERO; n], vec![0u16; n]);
        crate::elem::bits::split_slice(&a, &mut want_hi, &mut want_lo);
        let mut split = MasterMut::Split {
            hi: &mut hi,
            lo: &mut lo,
        };
        load_pretrained(&out, &layout, &mut split).unwrap();
        assert!(hi == want_hi && lo == want_lo, "split load differs");
        hi.fill(bf16::ZERO);
        lo.fill(0);
        let mut split = MasterMut::Split {
            hi: &mut hi,
            lo: &mut lo,
        };
        init_random(&layout, &s, 3, &mut split);
        assert!(hi == want_hi && lo == want_lo, "split init differs");
        let cfg = std::fs::read_to_string(out.join("config.json")).unwrap();
        assert!(cfg.contains(r#""torch_dtype": "float32""#), "{cfg}");
        assert_eq!(
            std::fs::read(out.join("tokenizer.json")).unwrap(),
            std::fs::read(src.join("tokenizer.json")).unwrap()
        );

        // Sharded, in bf16, over the same directory: the single file gives way to shards.
        opts.max_shard_bytes = 1000;
        opts.dtype = DType::Bfloat16;
        let files = save_hf(&out, &layout, MasterRef::F32(&a), &opts).unwrap();
        assert!(!out.join("model.safetensors").exists());
        let shards = weight_files(&out).unwrap();
        assert!(shards.len() > 3, "{shards:?}");
        assert!(shards.iter().all(|s| files.contains(s)));
        load_pretrained(&out, &layout, &mut MasterMut::F32(&mut b)).unwrap();
        let rounded: Vec<f32> = a.iter().map(|x| bf16::from_f32(*x).to_f32()).collect();
        assert_eq!(b, rounded);

        // The same file read by an untied layout misses lm_head.weight.
        let untied = Layout::new(&spec(false));
        let mut c = vec![0.0f32; untied.total];
        let e = load_pretrained(&out, &untied, &mut MasterMut::F32(&mut c))
            .unwrap_err()
            .to_string();
        assert!(e.contains("lm_head.weight") && e.contains("missing"), "{e}");

        // A different shape is named.
        let mut bigger = s.clone();
        bigger.vocab_size = 38;
        let l2 = Layout::new(&bigger);
        let mut d = vec![0.0f32; l2.total];
        let e = load_pretrained(&out, &l2, &mut MasterMut::F32(&mut d))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.embed_tokens.weight") && e.contains("[38, 24]"),
            "{e}"
        );
    }

    #[test]
    fn sharded_checkpoints_load_in_any_dtype_and_name_problems() {
        let dir = std::env::temp_dir().join(format!("mt-shards-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = spec(false);
        let layout = Layout::new(&s);
        let mut want = vec![0.0f32; layout.total];
        init_random(&layout, &s, 7, &mut MasterMut::F32(&mut want));
        // Round every value to bf16 so that all three dtypes carry it exactly.
        want.iter_mut()
            .for_each(|x| *x = bf16::from_f32(*x).to_f32());
        let dtypes = [Dtype::BF16, Dtype::F32, Dtype::F64];
        let mut shards: Vec<BTreeMap<String, OwnedTensor>> =
            (0..3).map(|_| BTreeMap::new()).collect();
        let mut weight_map = serde_json::Map::new();
        for (i, (b, t)) in layout.tensors().enumerate() {
            let src = &want[Layout::global_range(b, t)];
            let dtype = dtypes[i % 3];
            let data = match dtype {
                Dtype::BF16 => src
                    .iter()
                    .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
                    .collect(),
                Dtype::F32 => src.iter().flat_map(|x| x.to_le_bytes()).collect(),
                _ => src.iter().flat_map(|x| (*x as f64).to_le_bytes()).collect(),
            };
            let file = format!("model-{:05}-of-00003.safetensors", i % 3 + 1);
            weight_map.insert(b.hf_name(t), file.into());
            shards[i % 3].insert(
                b.hf_name(t),
                OwnedTensor {
                    dtype,
                    shape: t.shape.clone(),
                    data,
                },
            );
        }
        // A non-persistent buffer some exporters write: ignored.
        shards[0].insert(
            "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            OwnedTensor {
                dtype: Dtype::F32,
                shape: vec![2],
                data: vec![0; 8],
            },
        );
        for (i, shard) in shards.iter().enumerate() {
            let path = dir.join(format!("model-{:05}-of-00003.safetensors", i + 1));
            safetensors::serialize_to_file(shard.iter(), None, &path).unwrap();
        }
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        let mut got = vec![0.0f32; layout.total];
        load_pretrained(&dir, &layout, &mut MasterMut::F32(&mut got)).unwrap();
        assert_eq!(got, want);

        // A tensor in two shards is named with both files.
        let dup = dir.join("model-00003-of-00003.safetensors");
        let mut third = std::mem::take(&mut shards[2]);
        let (name, first) = shards[0].pop_first().unwrap();
        third.insert(name.clone(), first);
        safetensors::serialize_to_file(third.iter(), None, &dup).unwrap();
        let e = load_pretrained(&dir, &layout, &mut MasterMut::F32(&mut got))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&name) && e.contains("already read from"), "{e}");

        // A shard the index lists but the directory lacks.
        std::fs::remove_file(&dup).unwrap();
        let e = load_pretrained(&dir, &layout, &mut MasterMut::F32(&mut got))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model-00003-of-00003.safetensors") && e.contains("does not exist"),
            "{e}"
        );
    }
}
