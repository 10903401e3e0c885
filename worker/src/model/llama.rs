//! The Llama family (Llama 1/2/3 and config-compatible models), as transformers'
//! `modeling_llama.py` computes it.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, N attention heads, K key/value
//! heads, D head dim, I intermediate size. Suffixes name a tensor's shape (`x_bth`).

use mt::config::hf::ModelSpec;
use tch::{Device, Kind, Tensor};

use super::BlockWeights;

/// Rotary tables for positions 0..T, already in the compute dtype: (1, 1, T, D).
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    pub fn new(spec: &ModelSpec, seq_len: usize, kind: Kind, device: Device) -> Rope {
        let d = spec.head_dim as i64;
        // inv_freq = 1 / theta^(2i/D), computed in f32 as transformers does.
        let exponent = Tensor::arange_start_step(0, d, 2, (Kind::Int64, device))
            .to_kind(Kind::Float)
            / d as f64;
        let inv_freq = Tensor::scalar_tensor(spec.rope_theta, (Kind::Float, device))
            .pow(&exponent)
            .reciprocal();
        let pos_t = Tensor::arange(seq_len as i64, (Kind::Float, device));
        let freqs_td2 = pos_t.unsqueeze(1) * inv_freq.unsqueeze(0);
        let emb_td = Tensor::cat(&[&freqs_td2, &freqs_td2], -1);
        let shape = [1, 1, seq_len as i64, d];
        Rope {
            cos: emb_td.cos().to_kind(kind).view(shape),
            sin: emb_td.sin().to_kind(kind).view(shape),
        }
    }

    fn apply(&self, x_bntd: &Tensor) -> Tensor {
        x_bntd * &self.cos + rotate_half(x_bntd) * &self.sin
    }
}

fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size().last().copied().unwrap_or(0) / 2;
    let x1 = x.narrow(-1, 0, half);
    let x2 = x.narrow(-1, half, half);
    Tensor::cat(&[&x2.neg(), &x1], -1)
}

/// RMSNorm with the variance in f32: `w * (x / sqrt(mean(x²) + eps)).to(dtype)`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let xf = x.to_kind(Kind::Float);
    let var = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    w * (xf * (var + eps).rsqrt()).to_kind(x.kind())
}

fn linear(x: &Tensor, w: &BlockWeights, name: &str) -> Tensor {
    let bias = w.opt(&format!("{name}.bias"));
    x.linear(w.get(&format!("{name}.weight")), bias)
}

/// Token embedding: ids (B, T) -> (B, T, H).
pub fn embed(w: &BlockWeights, ids_bt: &Tensor) -> Tensor {
    Tensor::embedding(w.get("model.embed_tokens.weight"), ids_bt, -1, false, false)
}

/// One decoder layer: `h = x + attn(norm1(x)); out = h + mlp(norm2(h))`.
pub fn decoder_layer(w: &BlockWeights, spec: &ModelSpec, x_bth: &Tensor, rope: &Rope) -> Tensor {
    let eps = spec.rms_norm_eps;
    let h_bth = x_bth
        + attention(
            w,
            spec,
            &rms_norm(x_bth, w.get("input_layernorm.weight"), eps),
            rope,
        );
    let mlp_bth = mlp(
        w,
        &rms_norm(&h_bth, w.get("post_attention_layernorm.weight"), eps),
    );
    h_bth + mlp_bth
}

fn attention(w: &BlockWeights, spec: &ModelSpec, x_bth: &Tensor, rope: &Rope) -> Tensor {
    let (b, t) = (x_bth.size()[0], x_bth.size()[1]);
    let (n, k, d) = (
        spec.num_heads as i64,
        spec.num_kv_heads as i64,
        spec.head_dim as i64,
    );
    let q_bntd = linear(x_bth, w, "self_attn.q_proj")
        .view([b, t, n, d])
        .transpose(1, 2);
    let k_bktd = linear(x_bth, w, "self_attn.k_proj")
        .view([b, t, k, d])
        .transpose(1, 2);
    let v_bktd = linear(x_bth, w, "self_attn.v_proj")
        .view([b, t, k, d])
        .transpose(1, 2);
    let (q_bntd, k_bktd) = (rope.apply(&q_bntd), rope.apply(&k_bktd));
    let scale = (d as f64).powf(-0.5);
    let o_bntd = Tensor::scaled_dot_product_attention(
        &q_bntd,
        &k_bktd,
        &v_bktd,
        None::<Tensor>,
        0.0,
        true,
        scale,
        k != n,
    );
    let o_bth = o_bntd.transpose(1, 2).reshape([b, t, n * d]);
    linear(&o_bth, w, "self_attn.o_proj")
}

fn mlp(w: &BlockWeights, x_bth: &Tensor) -> Tensor {
    let gate_bti = linear(x_bth, w, "mlp.gate_proj").silu();
    let up_bti = linear(x_bth, w, "mlp.up_proj");
    linear(&(gate_bti * up_bti), w, "mlp.down_proj")
}

/// Final norm of selected hidden states (M, H) -> (M, H).
pub fn final_norm(head: &BlockWeights, spec: &ModelSpec, h_mh: &Tensor) -> Tensor {
    rms_norm(h_mh, head.get("model.norm.weight"), spec.rms_norm_eps)
}

/// Summed token cross-entropy of one chunk: logits = h W^T in the compute dtype, the loss
/// in f32 (as transformers upcasts logits), -100 ignored.
pub fn chunk_loss_sum(h_ch: &Tensor, lm_head_vh: &Tensor, targets_c: &Tensor) -> Tensor {
    let logits_cv = h_ch.linear(lm_head_vh, None::<Tensor>);
    logits_cv.to_kind(Kind::Float).cross_entropy_loss(
        targets_c,
        None::<Tensor>,
        tch::Reduction::Sum,
        -100,
        0.0,
    )
}
