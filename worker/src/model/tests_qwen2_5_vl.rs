//! Qwen2.5-VL's language model with images: the features placed at the image tokens (and no
//! embedding gradient there), and the whole text model on 3-D positions against
//! transformers (`$MT_GOLDEN_DIR/mrope`, scripts/make_golden.py's `mrope` stage: the tiny
//! `qwen2_5_vl_wrapper` model, rows with four images of different grids, random features in
//! place of its vision tower's output).

use std::collections::HashMap;
use std::path::PathBuf;

use mt::config::hf::ModelSpec;
use mt::layout::Layout;
use mt::mrope::{ImageTokens, rope_index};
use tch::{Device, Kind, Tensor};

use super::{
    BlockWeights, Context, decoder_layer, embed, final_norm, logits, place_image_features,
};

#[test]
fn features_replace_the_image_rows_in_order_and_stop_their_embedding_gradient() {
    tch::manual_seed(3);
    let (v, h, img) = (7i64, 5i64, 6i64);
    let w_vh = Tensor::randn([v, h], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let ids_bt = Tensor::from_slice(&[1i64, 6, 6, 2, 6, 3, 1, 0]).view([2, 4]);
    let e_bth = w_vh.index_select(0, &ids_bt.view([-1])).view([2, 4, h]);
    let f_mh = Tensor::randn([3, h], (Kind::Float, Device::Cpu));
    let x_bth = place_image_features(&ids_bt, e_bth.shallow_clone(), Some(&f_mh), img).unwrap();
    // Image tokens at (0, 1), (0, 2), (1, 0): features 0, 1, 2.
    for (k, (r, t)) in [(0, 1), (0, 2), (1, 0)].into_iter().enumerate() {
        assert!(
            x_bth.get(r).get(t).equal(&f_mh.get(k as i64)),
            "feature {k}"
        );
    }
    for (r, t) in [(0, 0), (0, 3), (1, 1), (1, 2), (1, 3)] {
        assert!(
            x_bth.get(r).get(t).equal(&e_bth.get(r).get(t)),
            "text ({r}, {t})"
        );
    }
    let dy_bth = Tensor::randn([2, 4, h], (Kind::Float, Device::Cpu));
    (&x_bth * &dy_bth).sum(Kind::Float).backward();
    let g_vh = w_vh.grad();
    assert_eq!(g_vh.get(img).abs().max().double_value(&[]), 0.0);
    // Token 1's row collects the gradient of both of its positions.
    let want = dy_bth.get(0).get(0) + dy_bth.get(1).get(2);
    assert!(g_vh.get(1).allclose(&want, 1e-6, 1e-6, false));

    assert!(
        place_image_features(&ids_bt, e_bth.detach(), None, img)
            .unwrap()
            .equal(&e_bth)
    );
    let e = place_image_features(&ids_bt, e_bth.detach(), Some(&f_mh.narrow(0, 0, 2)), img)
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 image tokens"), "{e}");
}

/// The step-0 logits of the fixture rows (features placed, 3-D positions from
/// `mt::mrope::rope_index`) against transformers' full forward, ‖ours − torch‖ / ‖torch‖
/// over the real positions. Both compute in f32 on one libtorch in the same op order up to
/// the attention kernel, so the error is f32 rounding (measured: 0, bit for bit); 1e-4 is the
/// golden bound, which a wrong axis or section misses by orders of magnitude (the image
/// rows' positions differ per axis by up to 3).
#[test]
fn language_model_on_3d_positions_with_features_matches_transformers() {
    let Some(dir) = std::env::var_os("MT_GOLDEN_DIR").map(|d| PathBuf::from(d).join("mrope"))
    else {
        eprintln!("no golden fixtures (MT_GOLDEN_DIR): skipped");
        return;
    };
    let fx: HashMap<String, Tensor> = Tensor::read_safetensors(dir.join("lm.safetensors"))
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (scripts/make_golden.py --cases mrope)",
                dir.display()
            )
        })
        .into_iter()
        .collect();
    let model_dir = dir.join("model");
    let mut spec = ModelSpec::from_model_dir(&model_dir).unwrap();
    mt::checkpoint::carried::resolve(&model_dir, &mut spec).unwrap();
    let layout = Layout::new(&spec);
    let m = spec.mrope.clone().unwrap();

    let ids_bt = &fx["input_ids"];
    let (b, t) = ids_bt.size2().unwrap();
    let ids: Vec<i32> = Vec::<i64>::try_from(ids_bt.reshape([-1]))
        .unwrap()
        .iter()
        .map(|&x| x as i32)
        .collect();
    let row_lens: Vec<usize> = Vec::<i64>::try_from(&fx["row_lens"])
        .unwrap()
        .iter()
        .map(|&x| x as usize)
        .collect();
    let grids: Vec<[u32; 3]> = Vec::<i64>::try_from(fx["grids"].reshape([-1]))
        .unwrap()
        .chunks(3)
        .map(|g| [g[0] as u32, g[1] as u32, g[2] as u32])
        .collect();
    let tokens = ImageTokens {
        image_token_id: m.image_token_id,
        spatial_merge_size: m.spatial_merge_size,
    };
    let p = rope_index(&ids, &row_lens, t as usize, &grids, tokens).unwrap();
    let pos_3bt = Tensor::from_slice(&p.pos_3bt).view([3, b, t]);
    assert!(
        pos_3bt.equal(&fx["position_ids"]),
        "positions as transformers'"
    );

    // Every block's tensors from the checkpoint, by their checkpoint names.
    let weights: HashMap<String, Tensor> = mt::checkpoint::weight_files(&model_dir)
        .unwrap()
        .iter()
        .flat_map(|f| Tensor::read_safetensors(f).unwrap())
        .collect();
    let flats: Vec<Tensor> = layout
        .blocks
        .iter()
        .map(|block| {
            let flat = Tensor::zeros([block.len as i64], (Kind::Float, Device::Cpu));
            for ts in &block.tensors {
                let src = &weights[&block.hf_name(ts)];
                flat.narrow(0, ts.offset as i64, ts.numel() as i64)
                    .copy_(&src.reshape([-1]));
            }
            flat
        })
        .collect();
    let w = |i: usize| BlockWeights::views(&flats[i], &layout.blocks[i]);

    let _guard = tch::no_grad_guard();
    let e_bth = embed(&spec, &w(Layout::EMBED), ids_bt);
    let mut x_bth =
        place_image_features(ids_bt, e_bth, Some(&fx["features"]), m.image_token_id).unwrap();
    let ctx = Context::new(&spec, t as usize, None, Kind::Float, Device::Cpu).with_positions_3d(
        &spec,
        &pos_3bt,
        Kind::Float,
        Device::Cpu,
    );
    for l in 0..layout.num_layers() {
        x_bth = decoder_layer(&spec, l, &w(layout.layer_block(l)), &x_bth, &ctx);
    }
    let head = w(layout.head_block());
    let embed_w = w(Layout::EMBED);
    let lm_head = match layout.tied_embeddings {
        true => embed_w.get("model.embed_tokens.weight"),
        false => head.get("lm_head.weight"),
    };
    let h = x_bth.size()[2];
    let ours = logits(
        &spec,
        &final_norm(&spec, &head, &x_bth.reshape([b * t, h])),
        lm_head,
    )
    .reshape([b, t, -1]);
    let torch = &fx["logits"];
    let (mut diff, mut norm) = (0.0, 0.0);
    for (r, &len) in row_lens.iter().enumerate() {
        let (o, w) = (
            ours.get(r as i64).narrow(0, 0, len as i64),
            torch.get(r as i64).narrow(0, 0, len as i64),
        );
        diff += (&o - &w).square().sum(Kind::Double).double_value(&[]);
        norm += w.square().sum(Kind::Double).double_value(&[]);
    }
    let e = (diff / norm).sqrt();
    eprintln!("qwen2.5-vl logits with images: rel error {e:.2e}");
    assert!(e < 1e-4, "rel error {e:.2e}");
}
