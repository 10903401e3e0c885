//! The pre-LayerNorm encoder layer that CLIP's and SigLIP's vision towers share
//! (transformers' `CLIPEncoderLayer` and `SiglipEncoderLayer` compute the same):
//! `h = x + attn(layer_norm1(x))`, `out = h + mlp(layer_norm2(h))`, the attention
//! bidirectional over each image's (or tile's) tokens, scaled by D^-1/2, every Linear with
//! its bias.
//!
//! Shapes: B images or tiles, N tokens each, E width, NH heads, D head dim, I MLP width.

use mt::config::hf::Activation;
use tch::Tensor;

use super::common::activation;

/// A tower's weights as its encoder layers read them, by their checkpoint names
/// (`encoder.layers.0.self_attn.q_proj`).
pub(super) trait VitWeights {
    /// `x W^T + b` with `{name}.weight` and `{name}.bias`.
    fn linear(&self, x: &Tensor, name: &str) -> Tensor;
    /// LayerNorm over E with `{name}.weight` and `{name}.bias`.
    fn layer_norm(&self, x: &Tensor, name: &str) -> Tensor;
    /// Heads and head dim.
    fn heads(&self) -> (i64, i64);
    /// The MLP's activation.
    fn hidden_act(&self) -> Activation;
}

/// Encoder layer `l`: (B, N, E) -> (B, N, E).
pub(super) fn encoder_layer(w: &impl VitWeights, l: usize, x_bne: &Tensor) -> Tensor {
    let p = format!("encoder.layers.{l}");
    let h_bne = x_bne + attention(w, &p, &w.layer_norm(x_bne, &format!("{p}.layer_norm1")));
    let m_bne = w.layer_norm(&h_bne, &format!("{p}.layer_norm2"));
    let fc1_bni = w.linear(&m_bne, &format!("{p}.mlp.fc1"));
    let mlp_bne = w.linear(
        &activation(&fc1_bni, w.hidden_act()),
        &format!("{p}.mlp.fc2"),
    );
    h_bne + mlp_bne
}

/// Bidirectional attention over each row's tokens: (B, N, E) -> (B, N, E).
fn attention(w: &impl VitWeights, p: &str, x_bne: &Tensor) -> Tensor {
    let (b, n) = (x_bne.size()[0], x_bne.size()[1]);
    let (nh, d) = w.heads();
    let heads = |name: &str| {
        w.linear(x_bne, &format!("{p}.self_attn.{name}"))
            .view([b, n, nh, d])
            .transpose(1, 2) // (B, NH, N, D)
    };
    let o_bhnd = Tensor::scaled_dot_product_attention(
        &heads("q_proj"),
        &heads("k_proj"),
        &heads("v_proj"),
        None::<Tensor>,
        0.0,
        false,
        None,
        false,
    );
    let o_bne = o_bhnd.transpose(1, 2).reshape([b, n, nh * d]);
    w.linear(&o_bne, &format!("{p}.self_attn.out_proj"))
}
