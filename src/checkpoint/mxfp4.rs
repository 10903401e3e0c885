//! GPT-OSS expert weights as OpenAI publishes them: MXFP4 (OCP microscaling: 4-bit e2m1
//! elements, each run of 32 along the input dim sharing one e8m0 power-of-two scale),
//! dequantized on load into the master as transformers' `convert_moe_packed_tensors`
//! (integrations/mxfp4.py) dequantizes them.
//!
//! For a layout tensor `X` of shape (E, C, R) in x·W form (`mlp.experts.gate_up_proj`
//! (E, H, 2I), `mlp.experts.down_proj` (E, I, H)) the checkpoint holds, per expert, the
//! rows of the (R, C) nn.Linear weight:
//!
//! - `X_blocks` (E, R, C/32, 16) uint8: two e2m1 codes per byte, element 2j of a run of 32
//!   in the low nibble of byte j, element 2j+1 in the high one;
//! - `X_scales` (E, R, C/32) uint8: the run's scale 2^(s - 127).
//!
//! so `X[e, c, r] = FP4[code(e, r, c)] * 2^(scales[e, r, c / 32] - 127)`, with FP4 the
//! e2m1 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and, for codes 8..15, their negatives. Every such
//! product is exact in f32 (and in bf16, transformers' dtype for it), so the master holds
//! transformers' values bit for bit. A scale of 255 (e8m0's NaN) is refused.
//!
//! One expert's packed bytes are held at a time (8.8 MB for GPT-OSS-20B and -120B) and
//! dequantized into the master a piece at a time ([`MasterMut::try_fill`]).

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::ops::Range;
use std::path::PathBuf;

use safetensors::Dtype;
use safetensors::tensor::TensorInfo;

use super::MasterMut;
use super::pieces::Reader;
use crate::error::{Error, Result};

pub const BLOCKS: &str = "_blocks";
pub const SCALES: &str = "_scales";
/// Elements that share one scale.
const RUN: usize = 32;
/// Bytes of packed codes per run.
const RUN_BYTES: usize = RUN / 2;
/// e8m0's exponent bias.
const BIAS: i32 = 127;
/// The e2m1 value of each 4-bit code (bit 3 the sign).
const FP4: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The layout tensors still to load: HF name -> (master range, shape).
pub type Wanted = HashMap<String, (Range<usize>, Vec<usize>)>;

/// One packed tensor: the file it is in and its header entry.
struct Packed<'a> {
    reader: &'a Reader,
    info: TensorInfo,
}

/// Dequantizes every MXFP4 pair in the checkpoint (`readers`, one per file) into `master`:
/// `X_blocks` with `X_scales` fill layout tensor `X`, which leaves `want` (and is recorded
/// in `loaded` with its file). Returns the names of the packed tensors, for the caller to
/// skip.
pub fn load(
    readers: &[Reader],
    want: &mut Wanted,
    loaded: &mut HashMap<String, PathBuf>,
    master: &mut MasterMut,
) -> Result<HashSet<String>> {
    let mut packed: HashMap<String, Packed> = HashMap::new();
    for reader in readers {
        for (name, info) in reader.tensors() {
            if !(name.ends_with(BLOCKS) || name.ends_with(SCALES)) {
                continue;
            }
            if let Some(first) = packed.get(&name) {
                return Err(Error::Tensor {
                    path: reader.path().into(),
                    tensor: name,
                    expected: format!(
                        "one copy (already read from {})",
                        first.reader.path().display()
                    ),
                    got: "a second one".into(),
                });
            }
            packed.insert(name, Packed { reader, info });
        }
    }
    let mut names: Vec<&String> = packed.keys().collect();
    names.sort();
    for name in &names {
        let Some(target) = name.strip_suffix(BLOCKS) else {
            let target = name.strip_suffix(SCALES).expect("a packed name");
            if !packed.contains_key(&format!("{target}{BLOCKS}")) {
                let p = &packed[*name];
                return Err(Error::Tensor {
                    path: p.reader.path().into(),
                    tensor: name.to_string(),
                    expected: format!(
                        "`{target}{BLOCKS}` beside it (MXFP4 codes and scales come in pairs)"
                    ),
                    got: "no such tensor in the checkpoint".into(),
                });
            }
            continue;
        };
        let blocks = &packed[*name];
        let Some(scales) = packed.get(&format!("{target}{SCALES}")) else {
            return Err(Error::Tensor {
                path: blocks.reader.path().into(),
                tensor: name.to_string(),
                expected: format!(
                    "`{target}{SCALES}` beside it (MXFP4 codes and scales come in pairs)"
                ),
                got: "no such tensor in the checkpoint".into(),
            });
        };
        let Some((range, shape)) = want.remove(target) else {
            let expected = match loaded.get(target) {
                Some(first) => format!("`{target}` once (already read from {})", first.display()),
                None => format!(
                    "the MXFP4 codes of a tensor this architecture has (`{target}` is not one)"
                ),
            };
            return Err(Error::Tensor {
                path: blocks.reader.path().into(),
                tensor: name.to_string(),
                expected,
                got: format!("a tensor of shape {:?}", blocks.info.shape),
            });
        };
        loaded.insert(target.to_string(), blocks.reader.path().into());
        dequantize_tensor(target, blocks, scales, range, &shape, master)?;
    }
    Ok(names.into_iter().cloned().collect())
}

/// Fills `range` of the master, layout tensor `target` of `shape` (E, C, R), from its
/// packed codes and scales, one expert at a time.
fn dequantize_tensor(
    target: &str,
    blocks: &Packed,
    scales: &Packed,
    range: Range<usize>,
    shape: &[usize],
    master: &mut MasterMut,
) -> Result<()> {
    let bad = |p: &Packed, suffix: &str, expected: String| Error::Tensor {
        path: p.reader.path().into(),
        tensor: format!("{target}{suffix}"),
        expected,
        got: format!("{:?} {:?}", p.info.dtype, p.info.shape),
    };
    let &[experts, c, r] = shape else {
        return Err(bad(
            blocks,
            BLOCKS,
            format!("no MXFP4 codes: `{target}` is {shape:?}, not a stack of expert matrices"),
        ));
    };
    if !c.is_multiple_of(RUN) {
        return Err(bad(
            blocks,
            BLOCKS,
            format!("no MXFP4 codes: `{target}` has {c} inputs, not a multiple of {RUN}"),
        ));
    }
    let runs = c / RUN;
    let want_blocks = [experts, r, runs, RUN_BYTES];
    if blocks.info.dtype != Dtype::U8 || blocks.info.shape != want_blocks {
        return Err(bad(
            blocks,
            BLOCKS,
            format!("U8 {want_blocks:?} for `{target}` {shape:?}"),
        ));
    }
    let want_scales = [experts, r, runs];
    if scales.info.dtype != Dtype::U8 || scales.info.shape != want_scales {
        return Err(bad(
            scales,
            SCALES,
            format!("U8 {want_scales:?} for `{target}` {shape:?}"),
        ));
    }
    let (expert_codes, expert_scales) = (r * runs * RUN_BYTES, r * runs);
    let mut codes = vec![0u8; expert_codes];
    let mut exps = vec![0u8; expert_scales];
    for e in 0..experts {
        blocks.reader.read_bytes(
            &blocks.info,
            e * expert_codes..(e + 1) * expert_codes,
            &mut codes,
        )?;
        scales.reader.read_bytes(
            &scales.info,
            e * expert_scales..(e + 1) * expert_scales,
            &mut exps,
        )?;
        if let Some(at) = exps.iter().position(|&s| s == 255) {
            return Err(Error::Tensor {
                path: scales.reader.path().into(),
                tensor: format!("{target}{SCALES}"),
                expected: "e8m0 scales below 255 (255 encodes NaN)".into(),
                got: format!("255 at [{e}, {}, {}]", at / runs, at % runs),
            });
        }
        let start = range.start + e * c * r;
        let filled = master.try_fill(start..start + c * r, |first, out| {
            dequantize(&codes, &exps, r, first - start, out);
            Ok::<(), Infallible>(())
        });
        let Ok(()) = filled;
    }
    Ok(())
}

/// Elements `at..at + out.len()` of one expert's (C, R) matrix from its packed (R, C)
/// codes (`codes`, R x C/2 bytes) and scales (`exps`, R x C/32).
fn dequantize(codes: &[u8], exps: &[u8], r: usize, at: usize, out: &mut [f32]) {
    let runs = exps.len() / r;
    let (mut ci, mut ri) = (at / r, at % r);
    for o in out {
        let byte = codes[ri * runs * RUN_BYTES + ci / 2];
        let code = if ci % 2 == 0 { byte & 0x0f } else { byte >> 4 };
        let exp = exps[ri * runs + ci / RUN] as i32 - BIAS;
        *o = FP4[code as usize] * pow2(exp);
        ri += 1;
        if ri == r {
            (ci, ri) = (ci + 1, 0);
        }
    }
}

/// 2^k exactly, for k in -127..=127 (2^-127 is subnormal in f32).
fn pow2(k: i32) -> f32 {
    debug_assert!((-127..=127).contains(&k));
    match k {
        -127 => f32::from_bits(1 << 22),
        _ => f32::from_bits(((k + 127) as u32) << 23),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use safetensors::tensor::TensorView;

    use super::*;
    use crate::checkpoint::{init_random, load_pretrained};
    use crate::config::hf::{HfConfig, ModelSpec};
    use crate::layout::Layout;

    /// (dtype, shape, bytes) by tensor name.
    type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

    fn gpt_oss() -> (ModelSpec, Layout) {
        let json = r#"{"model_type":"gpt_oss","vocab_size":37,"hidden_size":64,"intermediate_size":32,
            "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,
            "num_local_experts":3,"num_experts_per_tok":2}"#;
        let hf: HfConfig = serde_json::from_str(json).unwrap();
        let spec = ModelSpec::from_hf(&hf, Path::new("config.json")).unwrap();
        let layout = Layout::new(&spec);
        (spec, layout)
    }

    /// Every layout tensor in f32, the experts' weights MXFP4-packed (every code and scale
    /// byte `b`).
    fn checkpoint(spec: &ModelSpec, layout: &Layout, b: u8) -> Tensors {
        let mut master = vec![0.0f32; layout.total];
        init_random(layout, spec, 1, &mut MasterMut::F32(&mut master));
        let mut out = Tensors::new();
        for (blk, t) in layout.tensors() {
            let name = blk.hf_name(t);
            if let (true, &[e, c, r]) = (name.ends_with("_proj"), t.shape.as_slice()) {
                let blocks = vec![e, r, c / RUN, RUN_BYTES];
                out.insert(
                    format!("{name}{BLOCKS}"),
                    (Dtype::U8, blocks, vec![b; e * r * c / 2]),
                );
                out.insert(
                    format!("{name}{SCALES}"),
                    (Dtype::U8, vec![e, r, c / RUN], vec![b; e * r * c / RUN]),
                );
                continue;
            }
            let bytes = master[Layout::global_range(blk, t)]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            out.insert(name, (Dtype::F32, t.shape.clone(), bytes));
        }
        out
    }

    /// Writes `tensors` as the model dir `dir` and loads it; the error message if any.
    fn load(dir: &Path, layout: &Layout, tensors: &Tensors) -> Option<String> {
        std::fs::create_dir_all(dir).unwrap();
        let views = tensors
            .iter()
            .map(|(n, (d, s, b))| (n.as_str(), TensorView::new(*d, s.clone(), b).unwrap()));
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        let mut master = vec![0.0f32; layout.total];
        load_pretrained(dir, layout, &mut MasterMut::F32(&mut master))
            .err()
            .map(|e| e.to_string())
    }

    #[test]
    fn packed_experts_load_and_bad_ones_are_named() {
        let dir = std::env::temp_dir().join(format!("mt-mxfp4-{}", std::process::id()));
        let (spec, layout) = gpt_oss();
        let good = checkpoint(&spec, &layout, 0x3a);
        assert_eq!(load(&dir, &layout, &good), None);

        let gate_up = "model.layers.0.mlp.experts.gate_up_proj";
        let mut t = good.clone();
        t.remove(&format!("{gate_up}{SCALES}"));
        let e = load(&dir, &layout, &t).unwrap();
        assert!(e.contains(&format!("`{gate_up}{SCALES}` beside it")), "{e}");

        let mut t = good.clone();
        t.remove(&format!("{gate_up}{BLOCKS}"));
        let e = load(&dir, &layout, &t).unwrap();
        assert!(e.contains(&format!("`{gate_up}{BLOCKS}` beside it")), "{e}");

        let mut t = good.clone();
        t.get_mut(&format!("{gate_up}{SCALES}")).unwrap().2[7] = 255;
        let e = load(&dir, &layout, &t).unwrap();
        assert!(
            e.contains("255 encodes NaN") && e.contains("[0, 3, 1]"),
            "{e}"
        );

        let mut t = good.clone();
        t.get_mut(&format!("{gate_up}{BLOCKS}")).unwrap().1 = vec![3, 64, 4, 8];
        let e = load(&dir, &layout, &t).unwrap();
        assert!(e.contains("U8 [3, 64, 2, 16]"), "{e}");

        // The dequantized tensor beside its packed form: two copies.
        let mut t = good.clone();
        t.insert(
            gate_up.into(),
            (Dtype::F32, vec![3, 64, 64], vec![0; 4 * 3 * 64 * 64]),
        );
        let e = load(&dir, &layout, &t).unwrap();
        assert!(
            e.contains(gate_up) && e.contains("already read from"),
            "{e}"
        );

        // Packed codes of a tensor the architecture lacks.
        let mut t = good.clone();
        let codes = t[&format!("{gate_up}{BLOCKS}")].clone();
        let exps = t[&format!("{gate_up}{SCALES}")].clone();
        t.insert(format!("model.layers.0.mlp.extra{BLOCKS}"), codes);
        t.insert(format!("model.layers.0.mlp.extra{SCALES}"), exps);
        let e = load(&dir, &layout, &t).unwrap();
        assert!(e.contains("`model.layers.0.mlp.extra` is not one"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
