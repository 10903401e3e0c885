//! THE parameter layout. One function (`Layout::build`) owns every offset: the shared bf16
//! (or f32) store, the gradient slabs, the fp32 master weights, the Adam moments and the
//! checkpoints all index through it.
//!
//! The parameters form one flat array of blocks. Block 0 is the embedding (with a
//! vision-language model's trained tower tensors, see [`Layout::with_tower`]), blocks
//! 1..=L the decoder layers, block L+1 the head (final norm, and lm_head unless the
//! embeddings are tied, in which case lm_head reads block 0). Each block is contiguous, so
//! one layer is one host-to-device copy and one device-to-host copy. Tensors inside a block
//! and blocks themselves start at aligned element offsets; the gaps are zero everywhere.
//!
//! Layers need not share one structure: hybrid stacks mix Gated DeltaNet and attention
//! layers, MoE stacks may keep dense MLPs in some layers. Layers with the same tensor list
//! (names and shapes) form a [`LayerGroup`]; each group has its own block length, so
//! buffers can be sized per kind of layer.
//!
//! Tensor names are the text-only class's (`model.layers.3.mlp.up_proj.weight`), which the
//! model code looks up; [`Block::hf_name`] maps them to the checkpoint's, where a
//! multimodal wrapper keeps the text model under a prefix (`TextNames`).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::config::TowerTraining;
use crate::config::hf::{AttentionKind, ModelSpec, TextNames};
use crate::config::vision::TowerSpec;

mod carry;
pub mod drives;
pub mod shards;
mod tensors;
pub mod vision;
pub use carry::CarryRule;
use tensors::{layer_tensors, unrouted_params};

/// Tensor start alignment inside a block, in elements (256 B for f32).
const TENSOR_ALIGN: usize = 64;
/// Block start alignment, in elements (8 KiB for f32, 4 KiB for bf16).
const BLOCK_ALIGN: usize = 2048;

/// A tensor name inside its block and its shape, before offsets are assigned.
type NamedShape = (String, Vec<usize>);

/// One named tensor inside a block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Name inside the block (`self_attn.q_proj.weight`); the text-only class's key is
    /// `prefix + name` ([`Block::hf_name`] gives the checkpoint's).
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
    /// Prefix of every text-only key in the block (`model.layers.3.`; empty for embed and
    /// head).
    pub prefix: String,
    /// Where the checkpoint keeps the text model's tensors.
    pub names: TextNames,
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

    /// The checkpoint name of tensor `t`.
    pub fn hf_name(&self, t: &TensorSpec) -> String {
        self.names
            .hf(&format!("{}{}", self.prefix, t.name))
            .into_owned()
    }

    /// Every per-expert tensor of the block (`mlp.experts.{e}.gate_proj.weight`, e in 0..E)
    /// as one [`ExpertStack`], in order of first appearance; empty for a block without
    /// per-expert tensors (dense layers, GPT-OSS's fused experts).
    pub fn expert_stacks(&self) -> Vec<ExpertStack> {
        let mut stacks: Vec<ExpertStack> = Vec::new();
        for t in &self.tensors {
            let Some((name, e)) = expert_copy(&t.name) else {
                continue;
            };
            match stacks.iter_mut().find(|s| s.name == name) {
                None => {
                    assert_eq!(e, 0, "the layout lists expert 0's `{name}` first");
                    stacks.push(ExpertStack {
                        name,
                        offset: t.offset,
                        stride: 0,
                        experts: 1,
                        shape: t.shape.clone(),
                    });
                }
                Some(s) => {
                    if e == 1 {
                        s.stride = t.offset - s.offset;
                    }
                    assert!(
                        e == s.experts && t.offset == s.offset + e * s.stride && t.shape == s.shape,
                        "the layout places the experts' `{name}` in order at one stride"
                    );
                    s.experts += 1;
                }
            }
        }
        stacks
    }

    /// The block's tensors as maximal runs of adjacent tensors (no gap between them) that
    /// share their weight decay, in layout order: each run's layout range and whether it
    /// decays. The host's AdamW passes take a run in one parallel call: a MoE layer's
    /// 3 x E expert tensors form one run, where one call per tensor (1.5M elements, 24
    /// chunks, at Qwen3-30B-A3B's shape) left most threads waiting at each tensor's join.
    pub fn runs(&self) -> Vec<(Range<usize>, bool)> {
        let mut runs: Vec<(Range<usize>, bool)> = Vec::new();
        for t in &self.tensors {
            let r = Layout::global_range(self, t);
            match runs.last_mut() {
                Some((last, decay)) if *decay == t.decays() && last.end == r.start => {
                    last.end = r.end
                }
                _ => runs.push((r, t.decays())),
            }
        }
        runs
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

/// One tensor of every expert of a sparse block, `{head}.experts.{e}.{tail}` for e in
/// 0..E. [`Layout::new`] lays the experts out one after another, each with the same tensor
/// list, so the copies sit at a constant stride and read as one (E, ..shape) tensor
/// without moving: what a grouped GEMM over all experts takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertStack {
    /// The name without the expert index: `{head}.experts.{tail}`
    /// (`mlp.experts.gate_proj.weight`).
    pub name: String,
    /// Element offset of expert 0's copy in the block.
    pub offset: usize,
    /// Elements from one expert's copy to the next.
    pub stride: usize,
    pub experts: usize,
    /// One expert's shape.
    pub shape: Vec<usize>,
}

impl ExpertStack {
    /// The name of expert `e`'s copy.
    pub fn member(&self, e: usize) -> String {
        let (head, tail) = self
            .name
            .split_once(".experts.")
            .expect("a stack name holds `.experts.`");
        format!("{head}.experts.{e}.{tail}")
    }
}

/// `{head}.experts.{e}.{tail}` -> (`{head}.experts.{tail}`, e).
fn expert_copy(name: &str) -> Option<(String, usize)> {
    let (head, rest) = name.split_once(".experts.")?;
    let (e, tail) = rest.split_once('.')?;
    let e = e.parse().ok()?;
    Some((format!("{head}.experts.{tail}"), e))
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
    /// Which other tensors of a checkpoint are carried (not trained).
    pub carry: CarryRule,
}

/// The most parameters a layout may hold: 2^44 (17.6 trillion), ten times the largest
/// published models; the host state alone would take 16 bytes each (281 TB).
pub const MAX_PARAMS: u64 = 1 << 44;
/// The most tensors a layout may list: 2^20, twenty times the largest MoE models'
/// (DeepSeek-V3: 61 layers x 256 experts x 3 = 47k).
pub const MAX_TENSORS: usize = 1 << 20;

impl Layout {
    /// [`Layout::new`] once the parameters and tensors `spec` makes are counted with
    /// checked arithmetic and found within [`MAX_PARAMS`] and [`MAX_TENSORS`], layer by
    /// layer (so no more than one layer's list is built past a bound). `config` names the
    /// model's config.json in the error. A config whose values pass their own bounds
    /// (`config::hf::sizes`) can still multiply past these.
    pub fn checked(spec: &ModelSpec, config: &std::path::Path) -> crate::Result<Layout> {
        let err = |msg: String| crate::Error::ModelConfig {
            path: config.into(),
            msg,
        };
        let too_many = || {
            err(format!(
                "its sizes make more than {MAX_PARAMS} parameters (2^44; vocab_size {}, hidden_size {}, intermediate_size {}, num_hidden_layers {})",
                spec.vocab_size, spec.hidden_size, spec.intermediate_size, spec.num_layers
            ))
        };
        let numel = |shape: &[usize]| {
            shape
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
                .ok_or_else(too_many)
        };
        let (h, v) = (spec.hidden_size, spec.vocab_size);
        let heads = if spec.tie_word_embeddings { 1 } else { 2 };
        let mut params = numel(&[v, h])?
            .checked_mul(heads)
            .and_then(|n| n.checked_add(h as u64))
            .ok_or_else(too_many)?;
        let mut tensors = 3;
        for l in 0..spec.num_layers {
            for (_, shape) in layer_tensors(spec, l) {
                params = params.checked_add(numel(&shape)?).ok_or_else(too_many)?;
                tensors += 1;
            }
            if params > MAX_PARAMS {
                return Err(too_many());
            }
            if tensors > MAX_TENSORS {
                return Err(err(format!(
                    "its sizes make more than {MAX_TENSORS} tensors (2^20; num_hidden_layers {}, experts {})",
                    spec.num_layers,
                    spec.moe.as_ref().map_or(0, |m| m.num_experts)
                )));
            }
        }
        if params > MAX_PARAMS {
            return Err(too_many());
        }
        Ok(Layout::new(spec))
    }

    pub fn new(spec: &ModelSpec) -> Layout {
        Layout::build(spec, Vec::new())
    }

    /// The layout of `spec` with the vision tower's tensors that `training` trains, under
    /// their hub names (`visual.merger.ln_q.weight`, `multi_modal_projector.linear_1.weight`,
    /// [`TowerSpec::trained_tensors`]), after the token embedding in the embedding block:
    /// the image features enter the language model there, so the embedding's backward is
    /// where their gradient arrives, and the tensors ride the block's copies, reduce, update
    /// and checkpoints. The rest of the tower stays carried.
    ///
    /// A trained encoder (Qwen2.5-VL-7B's: 0.68B parameters, beside a 0.55B token
    /// embedding) joins the same block rather than one block per tower layer: the tower
    /// runs where the embedding does, at the start of the forward and the end of the
    /// backward, so the block's one copy each way brings it. One block per tower layer
    /// would hold one layer's weights and gradient on the device at a time instead of the
    /// whole tower's (1.35 GB each in bf16 at 7B, a few percent of a GPU's memory), at the
    /// cost of a new kind of block in every index the layout serves (store, slabs,
    /// reduce, checkpoints, node shards, the workers' streaming).
    pub fn with_tower(spec: &ModelSpec, vision: &TowerSpec, training: TowerTraining) -> Layout {
        let tower: Vec<NamedShape> = vision.trained_tensors(training, spec.tower_nested);
        let mut layout = Layout::build(spec, tower.clone());
        layout.carry.tower = tower.into_iter().map(|(name, _)| name).collect();
        layout
    }

    /// The one owner of the offsets: the embedding block (the token embedding, then
    /// `tower`), the decoder layers, the head.
    fn build(spec: &ModelSpec, tower: Vec<NamedShape>) -> Layout {
        let (h, v) = (spec.hidden_size, spec.vocab_size);
        let mut defs: Vec<(BlockKind, String, Vec<NamedShape>)> = Vec::new();
        let mut embed = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
        embed.extend(tower);
        defs.push((BlockKind::Embed, String::new(), embed));
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
                names: spec.names,
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
            carry: CarryRule::new(spec),
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

    /// The checkpoint name of a text-only class's tensor (`lm_head.weight`).
    pub fn hf(&self, canonical: &str) -> String {
        self.blocks[Self::EMBED].names.hf(canonical).into_owned()
    }

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
                    AttentionKind::Full | AttentionKind::Sliding | AttentionKind::Chunked => {
                        "attention"
                    }
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
mod tests;
