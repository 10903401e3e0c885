//! THE parameter layout. One function ([`Layout::new`]) owns every offset: the shared bf16
//! (or f32) store, the gradient slabs, the fp32 master weights, the Adam moments and the
//! checkpoints all index through it.
//!
//! The parameters form one flat array of blocks. Block 0 is the embedding, blocks
//! 1..=L the decoder layers, block L+1 the head (final norm, and lm_head unless the
//! embeddings are tied, in which case lm_head reads block 0). Each block is contiguous, so
//! one layer is one host-to-device copy and one device-to-host copy. Tensors inside a block
//! and blocks themselves start at aligned element offsets; the gaps are zero everywhere.
//!
//! Layers need not share one structure: hybrid stacks mix Gated DeltaNet and attention
//! layers, MoE stacks may keep dense MLPs in some layers. Layers with the same tensor list
//! (names and shapes) form a [`LayerGroup`]; each group has its own block length, so
//! buffers can be sized per kind of layer.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::config::hf::{AttentionKind, ExpertNames, Family, ModelSpec};

/// Tensor start alignment inside a block, in elements (256 B for f32).
const TENSOR_ALIGN: usize = 64;
/// Block start alignment, in elements (8 KiB for f32, 4 KiB for bf16).
const BLOCK_ALIGN: usize = 2048;

/// A tensor name inside its block and its shape, before offsets are assigned.
type NamedShape = (String, Vec<usize>);

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

    /// The tensors that overlap `part` (a range of the block's elements, see
    /// [`Layout::grad_parts`]), each with the range of its own flat elements inside the
    /// part; the gaps between tensors belong to no tensor.
    pub fn part_tensors(
        &self,
        part: Range<usize>,
    ) -> impl Iterator<Item = (&TensorSpec, Range<usize>)> {
        self.tensors.iter().filter_map(move |t| {
            let start = t.offset.max(part.start);
            let end = (t.offset + t.numel()).min(part.end);
            (start < end).then(|| (t, start - t.offset..end - t.offset))
        })
    }
}

/// Decoder layers with one structure: the same tensors at the same offsets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerGroup {
    /// The structure in words (`linear_attention+moe`, `attention+mlp`).
    pub name: String,
    /// 0-based layer indices, ascending.
    pub layers: Vec<usize>,
    /// Elements of each of its blocks, gaps included.
    pub block_len: usize,
}

/// The whole parameter layout of a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    pub blocks: Vec<Block>,
    /// Total elements, gaps included.
    pub total: usize,
    pub tied_embeddings: bool,
    /// The decoder layers grouped by structure, in order of first appearance.
    pub layer_groups: Vec<LayerGroup>,
    /// Parameters of the experts a token is not routed to, over all sparse layers: what
    /// `num_params` counts but one token's forward pass never multiplies by.
    pub unrouted_params: usize,
}

impl Layout {
    pub fn new(spec: &ModelSpec) -> Layout {
        let (h, v) = (spec.hidden_size, spec.vocab_size);
        let mut defs: Vec<(BlockKind, String, Vec<NamedShape>)> = Vec::new();
        defs.push((
            BlockKind::Embed,
            String::new(),
            vec![("model.embed_tokens.weight".into(), vec![v, h])],
        ));
        for l in 0..spec.num_layers {
            defs.push((
                BlockKind::Layer(l),
                format!("model.layers.{l}."),
                layer_tensors(spec, l),
            ));
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
        let layer_groups = group_layers(spec, &blocks);
        Layout {
            blocks,
            total: offset,
            tied_embeddings: spec.tie_word_embeddings,
            layer_groups,
            unrouted_params: unrouted_params(spec),
        }
    }

    /// Largest decoder-layer block, in elements: sizes the buffers layers stream through.
    pub fn max_layer_len(&self) -> usize {
        self.layer_groups
            .iter()
            .map(|g| g.block_len)
            .max()
            .unwrap_or(0)
    }

    /// Index into `layer_groups` of layer `layer`'s structure.
    pub fn layer_group(&self, layer: usize) -> usize {
        self.layer_groups
            .iter()
            .position(|g| g.layers.binary_search(&layer).is_ok())
            .expect("every layer belongs to a group")
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

    /// Largest block, in elements.
    pub fn max_block_len(&self) -> usize {
        self.blocks.iter().map(|b| b.len).max().unwrap_or(0)
    }

    /// Elements of one gradient slab slot: the largest decoder layer (the largest block
    /// when there are no layers). Blocks larger than a slot (the embedding and lm_head)
    /// travel in several parts, see [`Layout::grad_parts`].
    pub fn grad_slot_len(&self) -> usize {
        match self.max_layer_len() {
            0 => self.max_block_len(),
            n => n,
        }
    }

    /// The parts block `block`'s gradient is sent in through slots of `slot_len`
    /// elements: part p is the block's element range `p*slot_len .. min((p+1)*slot_len,
    /// len)`. Workers and the launcher both derive the parts from here.
    pub fn grad_parts(
        &self,
        block: usize,
        slot_len: usize,
    ) -> impl ExactSizeIterator<Item = Range<usize>> + use<> {
        assert!(slot_len > 0, "slots hold at least one element");
        let len = self.blocks[block].len;
        (0..len.div_ceil(slot_len)).map(move |p| p * slot_len..len.min((p + 1) * slot_len))
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

/// The tensors of decoder layer `layer`, in the order of the family's modeling code, named
/// as in its checkpoints (without the `model.layers.N.` prefix).
fn layer_tensors(spec: &ModelSpec, layer: usize) -> Vec<NamedShape> {
    let (h, i, d) = (spec.hidden_size, spec.intermediate_size, spec.head_dim);
    let q = spec.num_heads * d;
    let kv = spec.num_kv_heads * d;
    let mut t: Vec<NamedShape> = Vec::new();
    let mut push = |name: &str, shape: Vec<usize>| t.push((name.to_string(), shape));
    let linear = |push: &mut dyn FnMut(&str, Vec<usize>), name: &str, out, inp, bias| {
        push(&format!("{name}.weight"), vec![out, inp]);
        if bias {
            push(&format!("{name}.bias"), vec![out]);
        }
    };
    push("input_layernorm.weight", vec![h]);
    if spec.layer_types[layer] == AttentionKind::Linear {
        linear_attn_tensors(spec, &mut push);
    } else if spec.family == Family::Phi3 {
        linear(&mut push, "self_attn.qkv_proj", q + 2 * kv, h, false);
        linear(&mut push, "self_attn.o_proj", h, q, false);
    } else {
        // With an output gate, q_proj yields [query; gate] per head.
        let q_out = if spec.attn_output_gate { 2 * q } else { q };
        linear(&mut push, "self_attn.q_proj", q_out, h, spec.qkv_bias);
        linear(&mut push, "self_attn.k_proj", kv, h, spec.qkv_bias);
        linear(&mut push, "self_attn.v_proj", kv, h, spec.qkv_bias);
        linear(&mut push, "self_attn.o_proj", h, q, spec.o_bias);
        if spec.attn_sinks {
            push("self_attn.sinks", vec![spec.num_heads]);
        }
    }
    if spec.qk_norm && spec.layer_types[layer] != AttentionKind::Linear {
        push("self_attn.q_norm.weight", vec![d]);
        push("self_attn.k_norm.weight", vec![d]);
    }
    push("post_attention_layernorm.weight", vec![h]);
    if spec.family == Family::Gemma {
        push("pre_feedforward_layernorm.weight", vec![h]);
        push("post_feedforward_layernorm.weight", vec![h]);
    }
    if spec.is_sparse(layer) {
        moe_tensors(spec, &mut push);
    } else if spec.family == Family::Phi3 {
        linear(&mut push, "mlp.gate_up_proj", 2 * i, h, false);
        linear(&mut push, "mlp.down_proj", h, i, false);
    } else {
        linear(&mut push, "mlp.gate_proj", i, h, spec.mlp_bias);
        linear(&mut push, "mlp.up_proj", i, h, spec.mlp_bias);
        linear(&mut push, "mlp.down_proj", h, i, spec.mlp_bias);
    }
    t
}

/// Gated DeltaNet (`linear_attn.*`), Qwen3-Next's fused or Qwen3.5's split projections.
fn linear_attn_tensors(spec: &ModelSpec, push: &mut dyn FnMut(&str, Vec<usize>)) {
    let la = spec
        .linear_attn
        .as_ref()
        .expect("linear layers have a spec");
    let (h, nv) = (spec.hidden_size, la.num_v_heads);
    let (kd, vd) = (la.key_dim(), la.value_dim());
    if la.fused_qkvz {
        push("linear_attn.in_proj_qkvz.weight", vec![2 * kd + 2 * vd, h]);
        push("linear_attn.in_proj_ba.weight", vec![2 * nv, h]);
    } else {
        push("linear_attn.in_proj_qkv.weight", vec![2 * kd + vd, h]);
        push("linear_attn.in_proj_z.weight", vec![vd, h]);
        push("linear_attn.in_proj_b.weight", vec![nv, h]);
        push("linear_attn.in_proj_a.weight", vec![nv, h]);
    }
    push(
        "linear_attn.conv1d.weight",
        vec![la.conv_dim(), 1, la.conv_kernel],
    );
    push("linear_attn.dt_bias", vec![nv]);
    push("linear_attn.A_log", vec![nv]);
    push("linear_attn.norm.weight", vec![la.v_head_dim]);
    push("linear_attn.out_proj.weight", vec![h, vd]);
}

/// A sparse MLP block: router, experts (one tensor set per expert, or GPT-OSS's fused 3-D
/// tensors), and the shared expert where the family has one.
fn moe_tensors(spec: &ModelSpec, push: &mut dyn FnMut(&str, Vec<usize>)) {
    let m = spec.moe.as_ref().expect("sparse layers have a spec");
    let (h, e, i) = (spec.hidden_size, m.num_experts, m.expert_intermediate_size);
    match m.names {
        ExpertNames::Mixtral => {
            push("block_sparse_moe.gate.weight", vec![e, h]);
            for x in 0..e {
                let p = format!("block_sparse_moe.experts.{x}");
                push(&format!("{p}.w1.weight"), vec![i, h]);
                push(&format!("{p}.w2.weight"), vec![h, i]);
                push(&format!("{p}.w3.weight"), vec![i, h]);
            }
        }
        ExpertNames::Qwen => {
            push("mlp.gate.weight", vec![e, h]);
            for x in 0..e {
                let p = format!("mlp.experts.{x}");
                push(&format!("{p}.gate_proj.weight"), vec![i, h]);
                push(&format!("{p}.up_proj.weight"), vec![i, h]);
                push(&format!("{p}.down_proj.weight"), vec![h, i]);
            }
            if let Some(s) = m.shared_expert_intermediate_size {
                push("mlp.shared_expert.gate_proj.weight", vec![s, h]);
                push("mlp.shared_expert.up_proj.weight", vec![s, h]);
                push("mlp.shared_expert.down_proj.weight", vec![h, s]);
                push("mlp.shared_expert_gate.weight", vec![1, h]);
            }
        }
        ExpertNames::GptOssFused => {
            push("mlp.router.weight", vec![e, h]);
            push("mlp.router.bias", vec![e]);
            push("mlp.experts.gate_up_proj", vec![e, h, 2 * i]);
            push("mlp.experts.gate_up_proj_bias", vec![e, 2 * i]);
            push("mlp.experts.down_proj", vec![e, i, h]);
            push("mlp.experts.down_proj_bias", vec![e, h]);
        }
    }
}

/// (E - K) experts' parameters per sparse layer (see `Layout::unrouted_params`).
fn unrouted_params(spec: &ModelSpec) -> usize {
    let Some(m) = &spec.moe else {
        return 0;
    };
    let (h, i) = (spec.hidden_size, m.expert_intermediate_size);
    let per_expert = match m.names {
        ExpertNames::Mixtral | ExpertNames::Qwen => 3 * h * i,
        ExpertNames::GptOssFused => 3 * h * i + 2 * i + h,
    };
    let sparse = m.sparse_layers.iter().filter(|&&s| s).count();
    sparse * (m.num_experts - m.top_k) * per_expert
}

/// Groups the decoder layers by structure (equal tensor lists).
fn group_layers(spec: &ModelSpec, blocks: &[Block]) -> Vec<LayerGroup> {
    let mut groups: Vec<(LayerGroup, &[TensorSpec])> = Vec::new();
    for b in blocks {
        let BlockKind::Layer(l) = b.kind else {
            continue;
        };
        match groups.iter_mut().find(|(_, t)| *t == b.tensors.as_slice()) {
            Some((g, _)) => g.layers.push(l),
            None => {
                let mixer = match spec.layer_types[l] {
                    AttentionKind::Linear => "linear_attention",
                    AttentionKind::Full | AttentionKind::Sliding => "attention",
                };
                let mlp = if spec.is_sparse(l) { "moe" } else { "mlp" };
                let group = LayerGroup {
                    name: format!("{mixer}+{mlp}"),
                    layers: vec![l],
                    block_len: b.len,
                };
                groups.push((group, b.tensors.as_slice()));
            }
        }
    }
    groups.into_iter().map(|(g, _)| g).collect()
}

fn align(n: usize, a: usize) -> usize {
    n.div_ceil(a) * a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(model_type: &str, extra: &str) -> ModelSpec {
        let json = format!(
            r#"{{"model_type":"{model_type}","vocab_size":67,"hidden_size":48,
            "intermediate_size":88,"num_hidden_layers":3,"num_attention_heads":6,
            "num_key_value_heads":2{extra}}}"#
        );
        let hf: crate::config::hf::HfConfig = serde_json::from_str(&json).unwrap();
        ModelSpec::from_hf(&hf, std::path::Path::new("config.json")).unwrap()
    }

    pub(crate) fn tiny_spec(tied: bool) -> ModelSpec {
        spec(
            "llama",
            &format!(r#","tie_word_embeddings":{tied},"attention_bias":true"#),
        )
    }

    fn layer_names(s: &ModelSpec) -> Vec<String> {
        let l = Layout::new(s);
        l.blocks[l.layer_block(0)]
            .tensors
            .iter()
            .map(|t| format!("{}{:?}", t.name, t.shape))
            .collect()
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
    fn gradient_parts_cover_each_block_in_slot_sized_pieces() {
        // An embedding and lm_head about 3.6 layers large: 4 parts each.
        let mut s = tiny_spec(false);
        s.vocab_size = 1531;
        let l = Layout::new(&s);
        let slot = l.grad_slot_len();
        assert_eq!(slot, l.max_layer_len());
        assert!(slot < l.max_block_len());
        for (i, b) in l.blocks.iter().enumerate() {
            let parts: Vec<_> = l.grad_parts(i, slot).collect();
            assert_eq!(parts.len(), b.len.div_ceil(slot), "block {i}");
            let mut end = 0;
            for (p, r) in parts.iter().enumerate() {
                assert_eq!(r.start, end);
                assert!(r.len() == slot || (p + 1 == parts.len() && r.len() <= slot));
                end = r.end;
            }
            assert_eq!(end, b.len);
            // Every element of every tensor lies in exactly one part, in order, at a slot
            // offset inside the part.
            let mut seen = vec![0; b.tensors.len()];
            for r in &parts {
                for (t, within) in b.part_tensors(r.clone()) {
                    let ti = b.tensors.iter().position(|x| x.name == t.name).unwrap();
                    assert_eq!(within.start, seen[ti], "{} in block {i}", t.name);
                    seen[ti] = within.end;
                    let at = t.offset + within.start - r.start;
                    assert!(at + within.len() <= r.len());
                }
            }
            let numels: Vec<usize> = b.tensors.iter().map(TensorSpec::numel).collect();
            assert_eq!(seen, numels, "block {i}");
        }
        assert_eq!(l.grad_parts(Layout::EMBED, slot).len(), 4);
        assert_eq!(l.grad_parts(l.head_block(), slot).len(), 4);
        assert_eq!(l.grad_parts(l.layer_block(1), slot).len(), 1);
        // A slot as large as the largest block: one part per block, as before.
        let whole = l.max_block_len();
        assert!((0..l.blocks.len()).all(|i| l.grad_parts(i, whole).len() == 1));
    }

    #[test]
    fn tied_head_has_no_lm_head() {
        let l = Layout::new(&tiny_spec(true));
        let head = &l.blocks[l.head_block()];
        assert!(head.tensor("lm_head.weight").is_none());
        assert!(l.tied_embeddings);
    }

    #[test]
    fn family_layers_hold_their_checkpoint_tensors() {
        let names = layer_names(&spec("qwen2", ""));
        assert!(names.contains(&"self_attn.k_proj.bias[16]".to_string()));
        assert!(!names.iter().any(|n| n.starts_with("self_attn.o_proj.bias")));

        let names = layer_names(&spec("qwen3", r#","head_dim":10"#));
        assert!(names.contains(&"self_attn.q_proj.weight[60, 48]".to_string()));
        assert!(names.contains(&"self_attn.o_proj.weight[48, 60]".to_string()));
        assert!(names.contains(&"self_attn.q_norm.weight[10]".to_string()));
        assert!(names.contains(&"self_attn.k_norm.weight[10]".to_string()));

        let gemma2 = spec("gemma2", r#","head_dim":10"#);
        let names = layer_names(&gemma2);
        for n in [
            "pre_feedforward_layernorm.weight[48]",
            "post_feedforward_layernorm.weight[48]",
            "mlp.gate_proj.weight[88, 48]",
        ] {
            assert!(names.contains(&n.to_string()), "{names:?}");
        }
        assert!(!names.iter().any(|n| n.contains("q_norm")));
        assert!(
            Layout::new(&gemma2).tied_embeddings,
            "gemma ties by default"
        );
        let names = layer_names(&spec("gemma3_text", r#","head_dim":10"#));
        assert!(names.contains(&"self_attn.k_norm.weight[10]".to_string()));
        assert_eq!(names.len(), 13);

        let names = layer_names(&spec("phi3", ""));
        assert_eq!(
            names,
            [
                "input_layernorm.weight[48]",
                "self_attn.qkv_proj.weight[80, 48]",
                "self_attn.o_proj.weight[48, 48]",
                "post_attention_layernorm.weight[48]",
                "mlp.gate_up_proj.weight[176, 48]",
                "mlp.down_proj.weight[48, 88]",
            ]
        );

        let names = layer_names(&spec("llama", r#","mlp_bias":true"#));
        assert!(names.contains(&"mlp.down_proj.bias[48]".to_string()));
        assert!(names.contains(&"mlp.gate_proj.bias[88]".to_string()));
    }

    #[test]
    fn moe_layers_hold_router_and_per_expert_tensors() {
        let mixtral = spec(
            "mixtral",
            r#","num_local_experts":3,"num_experts_per_tok":2"#,
        );
        let names = layer_names(&mixtral);
        assert!(names.contains(&"block_sparse_moe.gate.weight[3, 48]".to_string()));
        assert!(names.contains(&"block_sparse_moe.experts.2.w2.weight[48, 88]".to_string()));
        assert!(!names.iter().any(|n| n.starts_with("mlp.")));
        // A token passes through 2 of the 3 experts: one expert's tensors per layer unused.
        let l = Layout::new(&mixtral);
        let one_expert: usize = l
            .tensors()
            .filter(|(_, t)| t.name.starts_with("block_sparse_moe.experts.0."))
            .map(|(_, t)| t.numel())
            .sum();
        assert_eq!(l.unrouted_params, one_expert);

        let gpt = spec(
            "gpt_oss",
            r#","num_local_experts":4,"num_experts_per_tok":2,"head_dim":8"#,
        );
        let names = layer_names(&gpt);
        for n in [
            "self_attn.sinks[6]",
            "self_attn.o_proj.bias[48]",
            "mlp.router.bias[4]",
            "mlp.experts.gate_up_proj[4, 48, 176]",
            "mlp.experts.down_proj[4, 88, 48]",
            "mlp.experts.down_proj_bias[4, 48]",
        ] {
            assert!(names.contains(&n.to_string()), "{n} in {names:?}");
        }
        // 2 of 4 experts unused: half of the fused expert tensors, over 3 layers.
        let l = Layout::new(&gpt);
        let experts: usize = l
            .tensors()
            .filter(|(_, t)| t.name.starts_with("mlp.experts."))
            .map(|(_, t)| t.numel())
            .sum();
        assert_eq!(l.unrouted_params, experts / 2);
        assert_eq!(Layout::new(&gpt).layer_groups.len(), 1);
    }

    #[test]
    fn mixed_layers_group_by_structure_with_their_own_lengths() {
        // Layers 0 and 2 linear (0 sparse, 2 dense), 1 full attention, sparse.
        let s = spec(
            "qwen3_next",
            r#","head_dim":8,"num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":20,
            "shared_expert_intermediate_size":24,"mlp_only_layers":[2],"linear_num_key_heads":2,
            "linear_num_value_heads":4,"linear_key_head_dim":8,"linear_value_head_dim":6,
            "layer_types":["linear_attention","full_attention","linear_attention"]"#,
        );
        let l = Layout::new(&s);
        let groups: Vec<(&str, &[usize])> = l
            .layer_groups
            .iter()
            .map(|g| (g.name.as_str(), g.layers.as_slice()))
            .collect();
        assert_eq!(
            groups,
            [
                ("linear_attention+moe", &[0][..]),
                ("attention+moe", &[1][..]),
                ("linear_attention+mlp", &[2][..]),
            ]
        );
        for (gi, g) in l.layer_groups.iter().enumerate() {
            for &layer in &g.layers {
                assert_eq!(l.blocks[l.layer_block(layer)].len, g.block_len);
                assert_eq!(l.layer_group(layer), gi);
            }
        }
        assert_ne!(l.layer_groups[0].block_len, l.layer_groups[2].block_len);
        assert_eq!(
            l.max_layer_len(),
            l.layer_groups.iter().map(|g| g.block_len).max().unwrap()
        );
        let names = |layer| -> Vec<String> {
            l.blocks[l.layer_block(layer)]
                .tensors
                .iter()
                .map(|t| format!("{}{:?}", t.name, t.shape))
                .collect()
        };
        let linear = names(0);
        for n in [
            "linear_attn.in_proj_qkvz.weight[80, 48]",
            "linear_attn.in_proj_ba.weight[8, 48]",
            "linear_attn.conv1d.weight[56, 1, 4]",
            "linear_attn.norm.weight[6]",
            "mlp.shared_expert_gate.weight[1, 48]",
            "mlp.experts.3.down_proj.weight[48, 20]",
        ] {
            assert!(linear.contains(&n.to_string()), "{n} in {linear:?}");
        }
        assert!(!linear.iter().any(|n| n.starts_with("self_attn.")));
        let full = names(1);
        assert!(full.contains(&"self_attn.q_proj.weight[96, 48]".to_string()));
        assert!(full.contains(&"self_attn.q_norm.weight[8]".to_string()));
        assert!(names(2).contains(&"mlp.down_proj.weight[48, 88]".to_string()));
    }

    #[test]
    fn public_moe_configs_have_their_transformers_parameter_counts() {
        // Counted by transformers 5.17: AutoModelForCausalLM.from_config on the meta device.
        let configs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        for (dir, params) in [
            ("mixtral-8x7b", 46_702_792_704),
            ("qwen3-30b-a3b", 30_532_122_624),
            ("qwen3-next-80b-a3b", 79_674_391_296),
            ("gpt-oss-20b", 20_914_757_184),
        ] {
            let spec = ModelSpec::from_model_dir(&configs.join(dir)).unwrap();
            assert_eq!(Layout::new(&spec).num_params(), params, "{dir}");
        }
    }
}
