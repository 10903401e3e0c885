//! THE parameter layout. One function ([`Layout::new`]) owns every offset: the shared bf16
//! (or f32) store, the gradient slabs, the fp32 master weights, the Adam moments and the
//! checkpoints all index through it.
//!
//! The parameters form one flat array of blocks. Block 0 is the embedding, blocks
//! 1..=L the decoder layers, block L+1 the head (final norm, and lm_head unless the
//! embeddings are tied, in which case lm_head reads block 0). Each block is contiguous, so
//! one layer is one host-to-device copy and one device-to-host copy. Tensors inside a block
//! and blocks themselves start at aligned element offsets; the gaps are zero everywhere.

use serde::{Deserialize, Serialize};

use crate::config::hf::ModelSpec;

/// Tensor start alignment inside a block, in elements (256 B for f32).
const TENSOR_ALIGN: usize = 64;
/// Block start alignment, in elements (8 KiB for f32, 4 KiB for bf16).
const BLOCK_ALIGN: usize = 2048;

/// One named tensor inside a block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Name inside the block (`self_attn.q_proj.weight`); the HF key is `prefix + name`.
    pub name: String,
    pub shape: Vec<usize>,
    /// Element offset from the start of the block.
    pub offset: usize,
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.numel()
    }

    /// Whether AdamW applies weight decay to it (tensors with >= 2 dims).
    pub fn decays(&self) -> bool {
        self.shape.len() >= 2
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockKind {
    Embed,
    Layer(usize),
    Head,
}

/// One contiguous block of parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Block {
    pub kind: BlockKind,
    /// Prefix of every HF key in the block (`model.layers.3.`; empty for embed and head).
    pub prefix: String,
    /// Element offset of the block in the flat parameter array.
    pub offset: usize,
    /// Elements in the block, gaps included (a multiple of the block alignment).
    pub len: usize,
    pub tensors: Vec<TensorSpec>,
}

impl Block {
    pub fn tensor(&self, name: &str) -> Option<&TensorSpec> {
        self.tensors.iter().find(|t| t.name == name)
    }

    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }

    pub fn hf_name(&self, t: &TensorSpec) -> String {
        format!("{}{}", self.prefix, t.name)
    }
}

/// The whole parameter layout of a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    pub blocks: Vec<Block>,
    /// Total elements, gaps included.
    pub total: usize,
    pub tied_embeddings: bool,
}

impl Layout {
    pub fn new(spec: &ModelSpec) -> Layout {
        let (h, i, v) = (spec.hidden_size, spec.intermediate_size, spec.vocab_size);
        let q = spec.num_heads * spec.head_dim;
        let kv = spec.num_kv_heads * spec.head_dim;

        let mut defs: Vec<(BlockKind, String, Vec<(String, Vec<usize>)>)> = Vec::new();
        defs.push((
            BlockKind::Embed,
            String::new(),
            vec![("model.embed_tokens.weight".into(), vec![v, h])],
        ));
        for l in 0..spec.num_layers {
            let mut t: Vec<(String, Vec<usize>)> = vec![("input_layernorm.weight".into(), vec![h])];
            for (name, out) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                t.push((format!("self_attn.{name}.weight"), vec![out, h]));
                if spec.attention_bias {
                    t.push((format!("self_attn.{name}.bias"), vec![out]));
                }
            }
            t.push(("self_attn.o_proj.weight".into(), vec![h, q]));
            if spec.attention_bias {
                t.push(("self_attn.o_proj.bias".into(), vec![h]));
            }
            t.push(("post_attention_layernorm.weight".into(), vec![h]));
            for (name, shape, bias) in [
                ("gate_proj", vec![i, h], i),
                ("up_proj", vec![i, h], i),
                ("down_proj", vec![h, i], h),
            ] {
                t.push((format!("mlp.{name}.weight"), shape));
                if spec.mlp_bias {
                    t.push((format!("mlp.{name}.bias"), vec![bias]));
                }
            }
            defs.push((BlockKind::Layer(l), format!("model.layers.{l}."), t));
        }
        let mut head = vec![("model.norm.weight".to_string(), vec![h])];
        if !spec.tie_word_embeddings {
            head.push(("lm_head.weight".into(), vec![v, h]));
        }
        defs.push((BlockKind::Head, String::new(), head));

        let mut blocks = Vec::with_capacity(defs.len());
        let mut offset = 0;
        for (kind, prefix, tensors) in defs {
            let mut inner = 0;
            let tensors = tensors
                .into_iter()
                .map(|(name, shape)| {
                    let t = TensorSpec {
                        name,
                        shape,
                        offset: inner,
                    };
                    inner = align(inner + t.numel(), TENSOR_ALIGN);
                    t
                })
                .collect();
            let len = align(inner, BLOCK_ALIGN);
            blocks.push(Block {
                kind,
                prefix,
                offset,
                len,
                tensors,
            });
            offset += len;
        }
        Layout {
            blocks,
            total: offset,
            tied_embeddings: spec.tie_word_embeddings,
        }
    }

    pub const EMBED: usize = 0;

    pub fn layer_block(&self, layer: usize) -> usize {
        1 + layer
    }

    pub fn head_block(&self) -> usize {
        self.blocks.len() - 1
    }

    pub fn num_layers(&self) -> usize {
        self.blocks.len() - 2
    }

    /// Largest block, in elements: sizes GPU layer buffers and slab slots.
    pub fn max_block_len(&self) -> usize {
        self.blocks.iter().map(|b| b.len).max().unwrap_or(0)
    }

    /// Parameters without gaps.
    pub fn num_params(&self) -> usize {
        self.tensors().map(|(_, t)| t.numel()).sum()
    }

    /// Every tensor with its block, in layout order.
    pub fn tensors(&self) -> impl Iterator<Item = (&Block, &TensorSpec)> {
        self.blocks
            .iter()
            .flat_map(|b| b.tensors.iter().map(move |t| (b, t)))
    }

    /// Global element range of a tensor.
    pub fn global_range(b: &Block, t: &TensorSpec) -> std::ops::Range<usize> {
        b.offset + t.offset..b.offset + t.offset + t.numel()
    }

    /// The order in which the backward pass delivers blocks: head, last layer … first,
    /// embedding.
    pub fn backward_order(&self) -> impl Iterator<Item = usize> {
        (0..self.blocks.len()).rev()
    }
}

fn align(n: usize, a: usize) -> usize {
    n.div_ceil(a) * a
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn tiny_spec(tied: bool) -> ModelSpec {
        ModelSpec {
            model_type: "llama".into(),
            vocab_size: 67,
            hidden_size: 48,
            intermediate_size: 88,
            num_layers: 3,
            num_heads: 6,
            num_kv_heads: 2,
            head_dim: 8,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            tie_word_embeddings: tied,
            attention_bias: true,
            mlp_bias: false,
            initializer_range: 0.02,
            pad_token_id: 0,
        }
    }

    #[test]
    fn blocks_are_aligned_disjoint_and_hold_every_tensor() {
        let l = Layout::new(&tiny_spec(false));
        assert_eq!(l.blocks.len(), 3 + 2);
        let mut end = 0;
        for b in &l.blocks {
            assert_eq!(b.offset, end);
            assert_eq!(b.offset % BLOCK_ALIGN, 0);
            let mut prev = 0;
            for t in &b.tensors {
                assert!(t.offset >= prev && t.offset % TENSOR_ALIGN == 0);
                prev = t.offset + t.numel();
            }
            assert!(prev <= b.len);
            end = b.offset + b.len;
        }
        assert_eq!(end, l.total);
        // 67*48 embed + 48 norm + 67*48 lm_head + 3 layers.
        let layer = 48 + (48 * 48 + 48) + 2 * (16 * 48 + 16) + (48 * 48 + 48) + 48 + 3 * 88 * 48;
        assert_eq!(l.num_params(), 2 * 67 * 48 + 48 + 3 * layer);
        let b = &l.blocks[l.layer_block(2)];
        assert_eq!(
            b.hf_name(b.tensor("mlp.up_proj.weight").unwrap()),
            "model.layers.2.mlp.up_proj.weight"
        );
    }

    #[test]
    fn tied_head_has_no_lm_head() {
        let l = Layout::new(&tiny_spec(true));
        let head = &l.blocks[l.head_block()];
        assert!(head.tensor("lm_head.weight").is_none());
        assert!(l.tied_embeddings);
    }
}
