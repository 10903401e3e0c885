//! Backward passes written by hand, for the fused ops autograd cannot see.
//!
//! tch has no custom autograd functions. A fused op (`super::conv_qkv`) therefore runs
//! outside the graph: its outputs are fresh leaves, and when its input needs a gradient it
//! records here how to turn its outputs' gradients into its inputs'. The caller that
//! backpropagates through the op's consumers then calls [`backward`], which, last op
//! first, reads each op's leaf gradients, runs its backward and backpropagates
//! `sum(input * d_input)` into the graph that made the input (so the gradient reaches the
//! layer input and the weights as if autograd had run the op).
//!
//! A second backward into a graph must not pass nodes the first one already ran (their
//! saved tensors are gone): where the op's input and autograd's own path share a graph
//! upstream (the mixer's projections read one normed input), the caller cuts it with a
//! [`boundary`] before the op. The first backward then stops at the boundary's leaf, the
//! op's backward adds to that leaf's gradient, and the boundary, recorded earlier and so
//! run later, carries the sum on into the graph above once.
//!
//! The tape is per thread: the engine runs one layer's backward at a time on its thread.

use std::cell::RefCell;

use tch::{Kind, Tensor};

/// An op's backward: from its outputs' gradients (undefined where none flowed) to pairs
/// (input, gradient of that input), each input part of a graph or a weight leaf; a pair
/// whose gradient is undefined is skipped.
type Backward = Box<dyn FnOnce(&[Tensor]) -> Vec<(Tensor, Tensor)>>;

struct Entry {
    outputs: Vec<Tensor>,
    backward: Backward,
}

thread_local! {
    static TAPE: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

/// Records an op whose `outputs` are leaves that require grad.
pub fn record(outputs: &[Tensor], backward: Backward) {
    let outputs = outputs.iter().map(Tensor::shallow_clone).collect();
    TAPE.with(|t| t.borrow_mut().push(Entry { outputs, backward }));
}

/// Runs every recorded op's backward, last first, once the backward through their
/// consumers has left its gradients in their output leaves.
pub fn backward() {
    while let Some(entry) = TAPE.with(|t| t.borrow_mut().pop()) {
        let grads: Vec<Tensor> = entry.outputs.iter().map(Tensor::grad).collect();
        drop(entry.outputs);
        let pairs = (entry.backward)(&grads);
        drop(grads);
        let mut objective: Option<Tensor> = None;
        for (input, grad) in pairs.into_iter().filter(|(_, g)| g.defined()) {
            let term = (input * grad).sum(Kind::Float);
            objective = Some(match objective {
                Some(o) => o + term,
                None => term,
            });
        }
        if let Some(o) = objective {
            o.backward();
        }
    }
}

/// `x` as a leaf where it requires grad, its gradient carried into `x`'s graph by
/// [`backward`] once every op recorded after it has run; `x` itself otherwise.
pub fn boundary(x: &Tensor) -> Tensor {
    if !x.requires_grad() {
        return x.shallow_clone();
    }
    let leaf = x.detach().set_requires_grad(true);
    let input = x.shallow_clone();
    record(
        &[leaf.shallow_clone()],
        Box::new(move |grads| vec![(input, grads[0].shallow_clone())]),
    );
    leaf
}
