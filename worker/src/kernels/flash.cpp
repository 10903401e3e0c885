// torch's FlashAttention-2 forward and backward (at::_flash_attention_forward and
// at::_flash_attention_backward), called as SDPA's flash path calls them but with what SDPA
// does not give: the rows' log-sum-exp out of the forward, a sliding window, and the
// backward's `out` chosen by the caller. tch 0.24 binds no forward. worker/src/kernels/
// cuda/flash.rs is the Rust side; worker/src/kernels/sinks.rs says what it is for.
// Compiled by worker/build.rs against the libtorch the worker links.

#include <ATen/ATen.h>

#include <cstring>
#include <exception>

namespace {

char* error_text(const std::exception& e) { return strdup(e.what()); }

std::optional<int64_t> window(int64_t left) {
  return left < 0 ? std::nullopt : std::optional<int64_t>(left);
}

}  // namespace

// Causal attention of q (B, T, N, D) over k, v (B, T, K, D) (K dividing N; last dims
// contiguous), each query seeing keys at most `window_left` positions back (-1: all):
// out (B, T, N, D), lse (B, N, T) f32 (natural log of the scaled scores' sum of exps), and
// the two tensors the backward takes back (the dropout's seed and offset). Returns null, or
// the error's text (malloc'd: the caller frees it).
extern "C" char* mt_flash_fwd(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v,
                              double scale, int64_t window_left, at::Tensor** out,
                              at::Tensor** lse, at::Tensor** seed, at::Tensor** offset) {
  try {
    const int64_t t = q->size(1);
    auto r = at::_flash_attention_forward(*q, *k, *v, std::nullopt, std::nullopt, t, t, 0.0,
                                          /*is_causal=*/true, /*return_debug_mask=*/false,
                                          scale, window(window_left),
                                          window_left < 0 ? std::nullopt
                                                          : std::optional<int64_t>(0));
    *out = new at::Tensor(std::get<0>(r));
    *lse = new at::Tensor(std::get<1>(r));
    *seed = new at::Tensor(std::get<2>(r));
    *offset = new at::Tensor(std::get<3>(r));
    return nullptr;
  } catch (const std::exception& e) {
    return error_text(e);
  }
}

// The backward of `mt_flash_fwd` given the output gradient `dout` (B, T, N, D) and the
// forward's lse, seed and offset: dq, dk, dv. `out` enters only through the rows' sums
// D = sum_d dout * out, which the kernel subtracts from each score's gradient: the caller
// may pass another tensor there to move those sums (worker/src/kernels/sinks.rs does).
extern "C" char* mt_flash_bwd(const at::Tensor* dout, const at::Tensor* q, const at::Tensor* k,
                              const at::Tensor* v, const at::Tensor* out, const at::Tensor* lse,
                              const at::Tensor* seed, const at::Tensor* offset, double scale,
                              int64_t window_left, at::Tensor** dq, at::Tensor** dk,
                              at::Tensor** dv) {
  try {
    const int64_t t = q->size(1);
    auto r = at::_flash_attention_backward(
        *dout, *q, *k, *v, *out, *lse, at::Tensor(), at::Tensor(), t, t, 0.0,
        /*is_causal=*/true, *seed, *offset, scale, window(window_left),
        window_left < 0 ? std::nullopt : std::optional<int64_t>(0));
    *dq = new at::Tensor(std::get<0>(r));
    *dk = new at::Tensor(std::get<1>(r));
    *dv = new at::Tensor(std::get<2>(r));
    return nullptr;
  } catch (const std::exception& e) {
    return error_text(e);
  }
}
