//! Backward passes written by hand, for the fused ops autograd cannot see.
//!
//! tch has no custom autograd functions. A fused op (`super::conv_qkv`) therefore runs
//! outside the graph: its outputs are fresh leaves, and when its input needs a gradient it
//! records here how to turn its outputs' gradients into its inputs'. The caller that
//! backpropagates through the op's consumers then calls [`backward`], which, last op
//! first, reads each op's leaf gradients, runs its backward and hands each input's
//! gradient to the graph that made the input ([`backward_with_grads`]: autograd's backward
//! from given gradients, through a small C++ shim), so the gradient reaches the layer input
//! and the weights as if autograd had run the op.
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
use std::ffi::{c_char, c_int, c_void};

use tch::Tensor;

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

/// Records an op of one output: `out` becomes a leaf that requires grad (returned), and
/// `backward` turns its gradient into (input, gradient) pairs; it does not run where no
/// gradient reached `out`.
pub fn record_one(
    out: Tensor,
    backward: impl FnOnce(&Tensor) -> Vec<(Tensor, Tensor)> + 'static,
) -> Tensor {
    let out = out.set_requires_grad(true);
    record(
        &[out.shallow_clone()],
        Box::new(move |grads| match grads {
            [g] if g.defined() => backward(g),
            _ => Vec::new(),
        }),
    );
    out
}

unsafe extern "C" {
    /// worker/src/kernels/backward.cpp: autograd's backward from `grads` at `outputs` (tch's
    /// tensors: at::Tensor pointers), each output released (left undefined) before the pass
    /// runs; null, or the error's text (malloc'd).
    fn mt_backward_with_grads(
        outputs: *const *mut c_void,
        grads: *const *mut c_void,
        n: c_int,
    ) -> *mut c_char;
}

/// Autograd's backward from each `output` with its gradient, into the graphs that made them
/// (their leaves' gradients accumulate), as `output.backward(grad)` would in Python: no
/// scalar objective, so no pass over the outputs beyond autograd's own. The outputs are
/// consumed: their memory is released before the pass (a layer's output is not needed for
/// its backward), unless another tensor holds it.
pub fn backward_with_grads(mut pairs: Vec<(Tensor, Tensor)>) {
    let outputs: Vec<*mut c_void> = pairs
        .iter_mut()
        .map(|(o, _)| o.as_mut_ptr().cast())
        .collect();
    let grads: Vec<*mut c_void> = pairs
        .iter_mut()
        .map(|(_, g)| g.as_mut_ptr().cast())
        .collect();
    // SAFETY: `pairs` holds valid tch tensors (at::Tensor pointers) for the call's length;
    // the C++ side resets each output in place (tch frees the undefined tensor on drop) and
    // returns an owned C string or null.
    let err =
        unsafe { mt_backward_with_grads(outputs.as_ptr(), grads.as_ptr(), pairs.len() as c_int) };
    drop(pairs);
    if let Err(e) = crate::cxx::checked(err) {
        panic!("autograd's backward from given gradients: {e}");
    }
}

/// How many ops the tape holds: a mark for [`backward_to`].
pub fn depth() -> usize {
    TAPE.with(|t| t.borrow().len())
}

/// Runs every recorded op's backward, last first, once the backward through their
/// consumers has left its gradients in their output leaves.
pub fn backward() {
    backward_to(0);
}

/// [`backward`] for the ops recorded since the tape held `depth` ([`depth`]): a part of a
/// layer backpropagated on its own (the MLP half from a leaf) runs its ops and leaves
/// those of the part before it (the attention half's), whose outputs have no gradient yet.
pub fn backward_to(depth: usize) {
    while let Some(entry) = TAPE.with(|t| {
        let mut t = t.borrow_mut();
        (t.len() > depth).then(|| t.pop()).flatten()
    }) {
        let grads: Vec<Tensor> = entry.outputs.iter().map(Tensor::grad).collect();
        drop(entry.outputs);
        let pairs = (entry.backward)(&grads);
        drop(grads);
        let pairs: Vec<_> = pairs.into_iter().filter(|(_, g)| g.defined()).collect();
        if !pairs.is_empty() {
            backward_with_grads(pairs);
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

/// An op's (input, gradient) pairs for its inputs that require grad, each gradient cast to
/// its input's dtype (an op may compute them wider).
pub fn input_grads<const N: usize>(
    inputs: [Tensor; N],
    grads: [Tensor; N],
) -> Vec<(Tensor, Tensor)> {
    inputs
        .into_iter()
        .zip(grads)
        .filter(|(input, _)| input.requires_grad())
        .map(|(input, g)| {
            let g = g.to_kind(input.kind());
            (input, g)
        })
        .collect()
}

/// A mirror's backward by autograd over a recompute: the gradients of `objective` (a
/// scalar: the mirror's outputs dotted with their gradients) at `inputs`, taken as leaves.
pub fn vjp<const N: usize>(
    inputs: [&Tensor; N],
    objective: impl FnOnce(&[Tensor; N]) -> Tensor,
) -> [Tensor; N] {
    let leaves = inputs.map(|x| x.detach().set_requires_grad(true));
    let o = objective(&leaves);
    let grads = Tensor::run_backward(&[o], &leaves.each_ref(), false, false);
    std::array::from_fn(|i| grads[i].shallow_clone())
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::*;

    /// Backpropagating outputs from given gradients (one of them a leaf) equals
    /// backpropagating the objective sum(output * gradient), exactly (the same products in
    /// the same dtype); a gradient of the wrong shape is refused, naming both shapes.
    #[test]
    fn backward_from_given_gradients_is_the_objectives() {
        let opts = (Kind::Double, Device::Cpu);
        let x0 = Tensor::linspace(-1.0, 1.0, 6, opts);
        let w0 = Tensor::linspace(0.5, 2.0, 6, opts);
        let (g1, g2) = (
            Tensor::linspace(3.0, -2.0, 6, opts),
            Tensor::linspace(1.0, 2.0, 6, opts),
        );
        let run = |given: bool| {
            let (x, w) = (
                x0.detach().set_requires_grad(true),
                w0.detach().set_requires_grad(true),
            );
            let y = (&x * &w).sin();
            match given {
                true => backward_with_grads(vec![
                    (y, g1.shallow_clone()),
                    (w.shallow_clone(), g2.shallow_clone()),
                ]),
                false => ((y * &g1).sum(Kind::Double) + (&w * &g2).sum(Kind::Double)).backward(),
            }
            (x.grad(), w.grad())
        };
        let ((gx, gw), (ox, ow)) = (run(true), run(false));
        assert!(
            gx.equal(&ox) && gw.equal(&ow),
            "{gx:?} {gw:?} vs {ox:?} {ow:?}"
        );

        let x = x0.detach().set_requires_grad(true);
        let y = &x * 2.0;
        let short = Tensor::ones([5], opts);
        let err = std::panic::catch_unwind(|| backward_with_grads(vec![(y, short)]))
            .expect_err("a gradient of the wrong shape");
        let msg = err.downcast_ref::<String>().expect("a panic message");
        assert!(msg.contains("[6]") && msg.contains("[5]"), "{msg}");
    }

    /// y = sum(c * square(h) + h), h = x * w, with the square as a hand-run op on the tape
    /// behind a boundary at h (so both of h's consumers share x's graph upstream, as the
    /// mixer's projections share its normed input): x's and w's gradients equal autograd's
    /// over the same function, and the second pass does not re-enter freed nodes.
    #[test]
    fn a_recorded_op_backpropagates_as_autograd_would() {
        let opts = (Kind::Double, Device::Cpu);
        let x0 = Tensor::linspace(-1.0, 1.0, 6, opts);
        let w0 = Tensor::linspace(0.5, 2.0, 6, opts);
        let c = Tensor::linspace(3.0, -2.0, 6, opts);
        let leaves = || {
            (
                x0.detach().set_requires_grad(true),
                w0.detach().set_requires_grad(true),
            )
        };

        let (x, w) = leaves();
        let h = &x * &w;
        (&c * h.square() + &h).sum(Kind::Double).backward();
        let (want_x, want_w) = (x.grad(), w.grad());

        let (x, w) = leaves();
        // The product saves x and w: a second pass through it would fail.
        let h = boundary(&(&x * &w));
        let (plain, input) = (h.detach(), h.shallow_clone());
        let sq = plain.square().set_requires_grad(true);
        record(
            &[sq.shallow_clone()],
            Box::new(move |grads| vec![(input, &grads[0] * 2.0 * &plain)]),
        );
        (&c * &sq + &h).sum(Kind::Double).backward();
        backward();
        for (got, want, name) in [(x.grad(), want_x, "x"), (w.grad(), want_w, "w")] {
            let d = (&got - &want).abs().max().double_value(&[]);
            assert!(d < 1e-12, "{name}: off by {d:e}: {got:?} vs {want:?}");
        }
    }
}
