//! GPT-OSS as OpenAI publishes it: scripts/make_golden.py writes `gpt_oss_mxfp4`, a tiny
//! GPT-OSS whose expert weights are MXFP4 (`*_blocks`, `*_scales`), and the expert tensors
//! transformers dequantizes from that checkpoint (`dequantized.safetensors`). Loaded into
//! an fp32 master and into a split one, every expert value equals transformers' bit for
//! bit. Training from the packed checkpoint is a golden case (golden.rs); its bf16 export
//! loading in transformers is checked in export.rs.

mod common;

use common::*;
use half::bf16;
use mt::checkpoint::{MasterMut, load_pretrained};
use mt::config::hf::ModelSpec;
use mt::layout::Layout;

#[test]
fn mxfp4_experts_load_as_transformers_dequantizes_them() {
    let case = golden_dir().join("gpt_oss_mxfp4");
    let model = case.join("model");
    let spec = ModelSpec::from_model_dir(&model).unwrap();
    let layout = Layout::new(&spec);
    // transformers' values (bf16, widened to f32 exactly) by tensor name.
    let want = tensors(&case.join("dequantized.safetensors"));
    assert!(!want.is_empty());
    let n = layout.total;
    let mut f32_master = vec![0.0f32; n];
    load_pretrained(&model, &layout, &mut MasterMut::F32(&mut f32_master)).unwrap();
    let (mut hi, mut lo) = (vec![bf16::ZERO; n], vec![0u16; n]);
    let mut split = MasterMut::Split {
        hi: &mut hi,
        lo: &mut lo,
    };
    load_pretrained(&model, &layout, &mut split).unwrap();
    let mut joined = vec![0.0f32; n];
    mt::checkpoint::MasterRef::Split { hi: &hi, lo: &lo }.read_into(&mut joined);

    let mut compared = 0;
    for (b, t) in layout.tensors() {
        let Some(reference) = want.get(&b.hf_name(t)) else {
            continue;
        };
        let range = Layout::global_range(b, t);
        for (master, what) in [(&f32_master, "f32"), (&joined, "split")] {
            let ours = &master[range.clone()];
            assert_eq!(ours.len(), reference.len(), "{}", b.hf_name(t));
            let differ = ours
                .iter()
                .zip(reference)
                .position(|(a, r)| a.to_bits() != r.to_bits());
            if let Some(i) = differ {
                panic!(
                    "{} ({what} master) element {i}: ours {:e}, transformers {:e}",
                    b.hf_name(t),
                    ours[i],
                    reference[i]
                );
            }
        }
        compared += 1;
    }
    assert_eq!(
        compared,
        want.len(),
        "every dequantized tensor is in the layout"
    );
}
