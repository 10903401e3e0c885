// AdamW on a resident block's own copy (memory.resident_blocks): the operations of the
// host's update (src/optim/adamw.rs, `adam1` and `moments1`), one element per thread, in
// the same order on the same f32 constants. Compiled with --fmad=false: no multiply-add is
// contracted, and sqrt and division are IEEE-rounded (NVRTC's defaults), so every element
// gets the host's bits. Compiled at run time by NVRTC (worker/src/kernels/cuda.rs).
//
//   p  f32 master (a split master joined)    g  reduced gradient, f32 or bf16 (G_BF16)
//   m, v  f32 moments                         w  compute copy, bf16 or f32 (W_BF16)
//   k  [decay_mul, 1 - b1, b2, 1 - b2, step_size, 1 / sqrt(bc2), eps, grad_scale]
//   split: leave p as the split master holds it (a tie in its low half nudged away from
//   even, src/elem/bits.rs `split`), w its high half.

struct K {
  float v[8];
};

template <bool G_BF16, bool W_BF16>
__device__ __forceinline__ void adamw_body(float* __restrict__ p, const void* __restrict__ g,
                                           float* __restrict__ m, float* __restrict__ v,
                                           void* __restrict__ w, long long n,
                                           const K& k, int split) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long stride = (long long)gridDim.x * blockDim.x;
  const float decay_mul = k.v[0], one_minus_b1 = k.v[1], b2 = k.v[2], one_minus_b2 = k.v[3];
  const float step_size = k.v[4], inv_bc2_sqrt = k.v[5], eps = k.v[6], grad_scale = k.v[7];
  for (; i < n; i += stride) {
    float gv = G_BF16 ? bf2f(((const u16*)g)[i]) : ((const float*)g)[i];
    float gi = gv * grad_scale;
    float mo = m[i], vo = v[i];
    float mi = mo + one_minus_b1 * (gi - mo);
    float vi = vo * b2 + one_minus_b2 * gi * gi;
    float pi = p[i] * decay_mul;
    float denom = sqrtf(vi) * inv_bc2_sqrt + eps;
    float pn = pi - step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    unsigned int b = __float_as_uint(pn);
    if (split && (b & 0xffffu) == 0x8000u) b = ((b >> 16) & 1u) ? b + 1u : b - 1u;
    p[i] = __uint_as_float(b);
    if (W_BF16) {
      ((u16*)w)[i] = round_bits(b);
    } else {
      ((float*)w)[i] = __uint_as_float(b);
    }
  }
}

extern "C" __global__ void adamw_g32_w16(float* p, const void* g, float* m, float* v, void* w,
                                         long long n, K k, int split) {
  adamw_body<false, true>(p, g, m, v, w, n, k, split);
}
extern "C" __global__ void adamw_g16_w16(float* p, const void* g, float* m, float* v, void* w,
                                         long long n, K k, int split) {
  adamw_body<true, true>(p, g, m, v, w, n, k, split);
}
extern "C" __global__ void adamw_g32_w32(float* p, const void* g, float* m, float* v, void* w,
                                         long long n, K k, int split) {
  adamw_body<false, false>(p, g, m, v, w, n, k, split);
}
extern "C" __global__ void adamw_g16_w32(float* p, const void* g, float* m, float* v, void* w,
                                         long long n, K k, int split) {
  adamw_body<true, false>(p, g, m, v, w, n, k, split);
}
