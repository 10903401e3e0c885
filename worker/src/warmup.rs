//! Start-up warm-up of a CUDA worker, so that the first step runs at the speed of the
//! others.
//!
//! The first step of a 7B run at batch 16 took 6.2 s against 2.9 s for the next ones on an
//! H200 (its backward 3.2 s against 1.4 s): CUDA loads kernels on first use, cuBLAS picks
//! and caches its algorithms per shape, and torch's caching allocator grows a segment at a
//! time. Here one layer of each layer group (its no-grad forward, then its backward with the
//! recompute), and the head's loss, run once on random weights at the run's micro-batch shape
//! before the worker reports ready: the same kernels and shapes as a step, none of its data.
//! Start-up pays instead, and the launcher's log shows it. Without the no-grad forward the
//! first step's forward of Qwen2.5-7B at batch 16 took 1.01 s in the first process on a fresh
//! 2xH100 host against 0.29 s in the next one (the forward's kernels loaded on first use, on a
//! fresh host most likely from a cold page cache).

use anyhow::Result;
use mt::config::hf::ModelSpec;
use mt::fault::Phase;
use mt::layout::Layout;
use tch::{Device, Kind, Tensor};

use crate::fault::enter;
use crate::layer;
use crate::model::{self, BlockWeights, RouterAux};

/// Runs the warm-up on `device` for micro-batches of `rows` x `seq_len` tokens, layers'
/// MLP halves in tiles of `tile` tokens (`layer.rs`) and loss chunks of `ce_chunk` tokens,
/// with each layer's `buffers` (not trained, not random); returns its seconds (device work
/// included).
pub fn warm_up(
    spec: &ModelSpec,
    layout: &Layout,
    buffers: &[Vec<(String, Tensor)>],
    (kind, device): (Kind, Device),
    ce_chunk: usize,
    (rows, seq_len): (usize, usize),
    tile: Option<usize>,
) -> Result<f64> {
    let start = std::time::Instant::now();
    crate::fault::micro_batch(rows, seq_len, false);
    enter(Phase::WarmUp, None);
    let (b, t, h) = (rows as i64, seq_len as i64, spec.hidden_size as i64);
    let opts = (kind, device);
    let mut ctx = model::Context::new(spec, seq_len, None, kind, device);
    ctx.router_aux = RouterAux::new(spec, &vec![seq_len; rows], seq_len, 1.0, device);
    for group in &layout.layer_groups {
        let l = group.layers[0];
        enter(Phase::WarmUp, Some(l));
        let block = &layout.blocks[layout.layer_block(l)];
        let flat = Tensor::randn([block.len as i64], opts) * 0.02;
        let w = BlockWeights::leaves(&flat, block).with(&buffers[l]);
        let x_bth = Tensor::randn([b, t, h], opts);
        // The step's forward runs without grad, which picks kernels of its own (attention
        // that saves no softmax statistics, ...): they load on first use too.
        let _y_bth = tch::no_grad(|| layer::forward(spec, l, &w, &x_bth, &ctx, tile));
        let dy_bth = Tensor::ones([b, t, h], opts);
        let _dx_bth = layer::backward(spec, l, &w, x_bth, dy_bth, &ctx, tile);
    }
    // The head: final norm and one loss chunk, against the real vocabulary.
    enter(Phase::WarmUp, None);
    let head = &layout.blocks[layout.head_block()];
    let head_flat = Tensor::randn([head.len as i64], opts) * 0.02;
    let head_w = BlockWeights::leaves(&head_flat, head);
    let lm_head = match head_w.opt("lm_head.weight") {
        Some(w) => w.shallow_clone(),
        None => (Tensor::randn([spec.vocab_size as i64, h], opts) * 0.02).set_requires_grad(true),
    };
    let m = (b * t).min(ce_chunk as i64);
    let x_mh = Tensor::randn([m, h], opts).set_requires_grad(true);
    let hn_mh = model::final_norm(spec, &head_w, &x_mh);
    let targets = Tensor::zeros([m], (Kind::Int64, device));
    // The path the step's head takes (head/ce.rs): the fused cross-entropy where it runs.
    // autograd's log-softmax over an f32 copy of the chunk's logits would hold three times
    // the step's memory, which the caching allocator then keeps reserved for the whole run.
    if crate::kernels::cross_entropy_enabled(kind, device) {
        let logits_mv = model::compute_logits(spec, &hn_mh, &lm_head);
        let weights_m = Tensor::ones([m], (Kind::Float, device));
        let (_loss_m, dlogits_mv) = crate::kernels::cross_entropy(&logits_mv, &targets, &weights_m);
        crate::kernels::tape::backward_with_grads(vec![(logits_mv, dlogits_mv)]);
    } else {
        model::chunk_loss_sum(spec, &hn_mh, &lm_head, &targets).backward();
    }
    crate::kernels::tape::backward();
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
    Ok(start.elapsed().as_secs_f64())
}
