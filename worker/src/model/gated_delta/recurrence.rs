//! The chunked rule's state recurrence (`chunked::state_recurrence`) with its backward
//! written out, run from the kernels' tape instead of autograd's pass through the loop.
//!
//! Per chunk n, from the state S_n (Dk, Dv) f32 at its start (S_0 given, or none: zero),
//! in the compute dtype with S_n rounded to it (S^), and u_n = T_n (beta v)_n formed here
//! chunk by chunk (so that the backward keeps T and beta v, as autograd's product would,
//! and no u):
//!
//! ```text
//! v'_n = u_n + W_n S^_n,   o_n = Q_n S^_n + P_n v'_n,   S_{n+1} = K_n^T v'_n + d_n S_n
//! ```
//!
//! (W = -w, Q and K the decayed q and k), and backwards, from dO_n and dS_{n+1} (f32):
//!
//! ```text
//! dv'_n = P_n^T dO_n + K_n dS^_{n+1}    dT_n = dv'_n (beta v)_n^T    d(beta v)_n = T_n^T dv'_n
//! dP_n = dO_n v'_n^T    dK_n = v'_n dS^_{n+1}^T    dQ_n = dO_n S^_n^T    dW_n = dv'_n S^_n^T
//! dS_n = (Q_n^T dO_n + W_n^T dv'_n) + d_n dS_{n+1},   dd_n = <dS_{n+1}, S_n>
//! ```
//!
//! with the products in the compute dtype and dS in f32, as autograd casts them through the
//! forward's ops. What autograd adds and this does not: per-chunk pieces of each input's
//! gradient stacked back from `unbind`'s backward, a bf16 copy of every chunk's state kept
//! beside the f32 one, and the bookkeeping of a graph of ~10 nodes per chunk.
//!
//! Shapes: N = B V independent heads, U chunks of C tokens, Dk / Dv head dims.

use tch::{Kind, Tensor};

use super::chunked::state_kind;
use crate::kernels::tape;

/// Whether the chunked rule's recurrence runs here under grad (the default) rather than
/// through autograd (`MT_GATED_DELTA_RECURRENCE=autograd`, a comparison hook).
pub(super) fn taped() -> bool {
    !mt::switches::get().gated_delta_autograd
}

/// The recurrence over `[t, vbeta, neg_w, q, k, p, d]`: T (N, U, C, C), beta v (N, U, C,
/// Dv), -w, q, k (N, U, C, Dk) and P (N, U, C, C) in the compute dtype, d (N, U, 1, 1) f32;
/// from `state` (N, Dk, Dv) f32 (None: zero) -> o (N, U, C, Dv) and, if `want_state`, the
/// state after the last chunk; with grad, both outputs are leaves whose backward waits on
/// the tape.
pub(super) fn on_tape(
    ins: [&Tensor; 7],
    state: Option<&Tensor>,
    want_state: bool,
) -> (Tensor, Option<Tensor>) {
    let kind = ins[2].kind();
    let inputs = ins.map(Tensor::shallow_clone);
    let [ts, vbs, ws, qs, ks, ps, ds] = ins.map(|x| x.detach().unbind(1));
    let chunks = ts.len();
    let guard = tch::no_grad_guard();
    let mut s: Option<Tensor> = state.map(Tensor::detach);
    // Each chunk's starting state (f32) and v', for the backward.
    let mut starts: Vec<Option<Tensor>> = Vec::with_capacity(chunks);
    let mut v_news = Vec::with_capacity(chunks);
    let mut outs = Vec::with_capacity(chunks);
    for n in 0..chunks {
        let u = ts[n].matmul(&vbs[n]);
        let (v_new, o) = match &s {
            None => {
                let o = ps[n].matmul(&u);
                (u, o)
            }
            Some(s) => {
                let s_hat = s.to_kind(kind);
                let v_new = u.baddbmm(&ws[n], &s_hat, 1, 1);
                let o = qs[n].matmul(&s_hat).baddbmm(&ps[n], &v_new, 1, 1);
                (v_new, o)
            }
        };
        starts.push(s.as_ref().map(Tensor::shallow_clone));
        if n + 1 < chunks || want_state {
            let kv = ks[n].transpose(-1, -2).matmul(&v_new);
            s = Some(match &s {
                None => kv.to_kind(state_kind(kind)),
                Some(s) => kv.addcmul(s, &ds[n]),
            });
        }
        v_news.push(v_new);
        outs.push(o);
    }
    let o = Tensor::stack(&outs, 1);
    let last = s.filter(|_| want_state);
    drop(guard);
    let state_in = state.map(Tensor::shallow_clone);
    let grad = inputs.iter().any(Tensor::requires_grad)
        || state_in.as_ref().is_some_and(Tensor::requires_grad);
    if !grad {
        return (o, last);
    }
    let o = o.set_requires_grad(true);
    let last = last.map(|s| s.set_requires_grad(true));
    let mut outputs = vec![o.shallow_clone()];
    outputs.extend(last.iter().map(Tensor::shallow_clone));
    let saved = Saved {
        ts,
        vbs,
        ws,
        qs,
        ks,
        ps,
        ds,
        starts,
        v_news,
    };
    tape::record(
        &outputs,
        Box::new(move |grads| {
            let d_o = &grads[0];
            let d_last = grads.get(1).filter(|g| g.defined());
            if !d_o.defined() && d_last.is_none() {
                return Vec::new();
            }
            let d_o = match d_o.defined() {
                true => d_o.shallow_clone(),
                false => Tensor::stack(&saved.v_news, 1).zeros_like(),
            };
            let (grads, d_state) = saved.backward(&d_o, d_last, kind);
            let mut pairs: Vec<(Tensor, Tensor)> = inputs.into_iter().zip(grads).collect();
            if let (Some(s), Some(g)) = (state_in, d_state) {
                pairs.push((s, g));
            }
            pairs
                .into_iter()
                .filter(|(input, _)| input.requires_grad())
                .collect()
        }),
    );
    (o, last)
}

/// What the backward reads: the inputs, per chunk, each chunk's starting state and v'.
struct Saved {
    ts: Vec<Tensor>,
    vbs: Vec<Tensor>,
    ws: Vec<Tensor>,
    qs: Vec<Tensor>,
    ks: Vec<Tensor>,
    ps: Vec<Tensor>,
    ds: Vec<Tensor>,
    starts: Vec<Option<Tensor>>,
    v_news: Vec<Tensor>,
}

impl Saved {
    /// The gradients of [t, vbeta, neg_w, q, k, p, d] from dO (N, U, C, Dv) and the last
    /// state's gradient, and the starting state's gradient (None where the recurrence
    /// started from zero).
    fn backward(
        &self,
        d_o: &Tensor,
        d_last: Option<&Tensor>,
        kind: Kind,
    ) -> ([Tensor; 7], Option<Tensor>) {
        let _guard = tch::no_grad_guard();
        let dos = d_o.unbind(1);
        let chunks = dos.len();
        // In the states' dtype (f32; the compute dtype's where that is wider, as in tests).
        let mut d_s: Option<Tensor> = d_last.map(Tensor::shallow_clone);
        let mut per: [Vec<Tensor>; 7] = Default::default();
        for n in (0..chunks).rev() {
            let zeros = |x: &Tensor| x.zeros_like();
            let d_s_hat = d_s.as_ref().map(|g| g.to_kind(kind));
            let mut dv = self.ps[n].transpose(-1, -2).matmul(&dos[n]);
            if let Some(g) = &d_s_hat {
                dv = dv.baddbmm(&self.ks[n], g, 1, 1);
            }
            let dp = dos[n].matmul(&self.v_news[n].transpose(-1, -2));
            let dk = match &d_s_hat {
                Some(g) => self.v_news[n].matmul(&g.transpose(-1, -2)),
                None => zeros(&self.ks[n]),
            };
            let (dw, dq, dd, next) = match &self.starts[n] {
                None => (
                    zeros(&self.ws[n]),
                    zeros(&self.qs[n]),
                    zeros(&self.ds[n]),
                    None,
                ),
                Some(s) => {
                    let s_hat = s.to_kind(kind);
                    let dq = dos[n].matmul(&s_hat.transpose(-1, -2));
                    let dw = dv.matmul(&s_hat.transpose(-1, -2));
                    // S^ feeds two products: their gradients meet in the compute dtype.
                    let from_products = self.qs[n]
                        .transpose(-1, -2)
                        .matmul(&dos[n])
                        .baddbmm(&self.ws[n].transpose(-1, -2), &dv, 1, 1)
                        .to_kind(s.kind());
                    let (dd, next) = match &d_s {
                        None => (zeros(&self.ds[n]), from_products),
                        Some(g) => (
                            (g * s).sum_dim_intlist([1i64, 2].as_slice(), true, self.ds[n].kind()),
                            from_products.addcmul(g, &self.ds[n]),
                        ),
                    };
                    (dw, dq, dd, Some(next))
                }
            };
            let dt = dv.matmul(&self.vbs[n].transpose(-1, -2));
            let dvb = self.ts[n].transpose(-1, -2).matmul(&dv);
            for (all, g) in per.iter_mut().zip([dt, dvb, dw, dq, dk, dp, dd]) {
                all.push(g);
            }
            d_s = next;
        }
        let grads = per.map(|mut all| {
            all.reverse();
            Tensor::stack(&all, 1)
        });
        (grads, d_s)
    }
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::on_tape;
    use crate::kernels::tape;
    use crate::model::gated_delta::chunked::state_recurrence;

    /// The written-out backward against autograd's through `state_recurrence`, in f64 (both
    /// compute the same sums in the same dtype, so they agree to rounding: 1e-12 relative;
    /// a wrong term is O(1)): every input's gradient and the starting state's, from a zero
    /// state and from a given one, with and without the last state's gradient, on 3
    /// chunks (the first, a middle and the last take different branches).
    #[test]
    fn the_written_backward_is_autograds() {
        tch::manual_seed(7);
        let opts = (Kind::Double, Device::Cpu);
        let (n, u, c, dk, dv) = (3, 3, 4, 5, 6);
        let shapes: [&[i64]; 7] = [
            &[n, u, c, c],
            &[n, u, c, dv],
            &[n, u, c, dk],
            &[n, u, c, dk],
            &[n, u, c, dk],
            &[n, u, c, c],
            &[n, u, 1, 1],
        ];
        let inputs: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, opts)).collect();
        let d_o = Tensor::randn([n, u, c, dv], opts);
        let d_last = Tensor::randn([n, dk, dv], opts);
        let s0 = Tensor::randn([n, dk, dv], opts);
        for (with_state, want_state) in [(false, false), (true, false), (false, true), (true, true)]
        {
            let run = |taped: bool| -> Vec<Tensor> {
                let leaves: Vec<Tensor> = inputs
                    .iter()
                    .map(|x| x.detach().set_requires_grad(true))
                    .collect();
                let state = with_state.then(|| s0.detach().set_requires_grad(true));
                let [t, vb, w, q, k, p, d] = leaves.as_slice() else {
                    unreachable!()
                };
                let (o, last) = match taped {
                    true => on_tape([t, vb, w, q, k, p, d], state.as_ref(), want_state),
                    false => {
                        let uu = t.matmul(vb);
                        let s = state.shallow_clone_opt();
                        state_recurrence(&uu, w, q, k, p, d, s, want_state)
                    }
                };
                let mut objective = (o * &d_o).sum(Kind::Double);
                if let Some(last) = last {
                    objective += (last * &d_last).sum(Kind::Double);
                }
                objective.backward();
                tape::backward();
                let mut grads: Vec<Tensor> = leaves.iter().map(Tensor::grad).collect();
                grads.extend(state.map(|s| s.grad()));
                grads
            };
            let (ours, autograd) = (run(true), run(false));
            for (i, (a, b)) in ours.iter().zip(&autograd).enumerate() {
                let b = match b.defined() {
                    true => b.shallow_clone(),
                    false => a.zeros_like(),
                };
                let err = (a - &b).norm().double_value(&[]) / b.norm().double_value(&[]).max(1e-30);
                assert!(
                    err < 1e-12,
                    "input {i} (state {with_state}, want_state {want_state}): relative error {err:e}"
                );
            }
        }
    }

    trait CloneOpt {
        fn shallow_clone_opt(&self) -> Option<Tensor>;
    }

    impl CloneOpt for Option<Tensor> {
        fn shallow_clone_opt(&self) -> Option<Tensor> {
            self.as_ref().map(Tensor::shallow_clone)
        }
    }
}
