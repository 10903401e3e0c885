// The mixture of experts' fused ops around the expert GEMMs (worker/src/kernels/mlp.rs):
// the SwiGLU between them, and the combine of their outputs.
//
// The routed experts' outputs back in token order, weighted and summed over each token's K
// slots, in one pass: what the un-permutation (a gather), the product with the router
// weights and the sum over the slots compute in three (worker/src/model/experts.rs), and
// its backward, a gather of the output gradient and one dot product per (token, slot).
// Compiled at run time by NVRTC (worker/src/kernels/cuda.rs); the contract and its CPU
// mirror are in worker/src/kernels.rs.
//
// Layouts (bf16 as raw 16-bit words, row-major; W the router weights' type, float or bf16):
//   y      (S, H)  the experts' outputs, their rows sorted by expert (S = N K pairs)
//   pair   (S)     int64: the (token, slot) pair p = t K + k of each sorted row
//   unsort (S)     int64: the sorted row of each pair (pair's inverse)
//   w      (N K)   the router weights, W
//   out    (N, H)  out[t] = bf16(sum_k bf16(y[unsort[t K + k]] * w[t K + k]))
// Each term is rounded to bf16 (the product's dtype when W is bf16; torch's cast of the f32
// product when W is float), the K terms summed in f32 in slot order, and the sum rounded
// once: torch's ops, up to the order of the f32 sum.
//
// Work split: a warp per token (forward) or per sorted row (backward), 8 warps a block; a
// lane takes 8 adjacent channels (16 bytes) at a time, H a multiple of 8.
//
// The SwiGLU h = silu(gate) up over (S, I) elements, I a multiple of 8: computed in f32
// from the bf16 inputs and rounded once (torch rounds silu(gate) to bf16 first); its
// backward dgate = dh up sigmoid(gate) (1 + gate (1 - sigmoid(gate))), dup = dh silu(gate),
// each rounded once. 8 elements a thread at a time, a grid-stride loop.
//
// GPT-OSS's clamped SwiGLU over gate_up (S, 2I), gate and up interleaved (even columns
// gate, odd up): h = (clamp(up, -limit, limit) + 1) * g sigmoid(alpha g) for g =
// min(gate, limit), (S, I); its backward passes each clamp's gradient where the input lies
// within its bounds, inclusive (as torch's clamp does), into the interleaved (S, 2I)
// gradient. Computed in f32, each output rounded once (torch rounds after each op).

typedef long long i64;

#define WARPS 8

__device__ __forceinline__ float load_w(const float* w, i64 i) { return w[i]; }
__device__ __forceinline__ float load_w(const u16* w, i64 i) { return bf2f(w[i]); }
__device__ __forceinline__ void store_w(float* w, i64 i, float x) { w[i] = x; }
__device__ __forceinline__ void store_w(u16* w, i64 i, float x) { w[i] = f2bf(x); }

// 8 bf16 channels as one 16-byte load or store.
struct __align__(16) Pack8 {
  u16 v[8];
};

template <typename W>
__device__ void combine_fwd(const u16* __restrict__ y, const i64* __restrict__ unsort,
                            const W* __restrict__ w, u16* __restrict__ out, i64 n, int k,
                            int h) {
  const i64 t = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (t >= n) return;
  const Pack8* rows = (const Pack8*)y;
  Pack8* dst = (Pack8*)(out + t * h);
  const int vecs = h / 8;
  for (int j = lane; j < vecs; j += 32) {
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] = 0.0f;
    for (int s = 0; s < k; s++) {
      const i64 p = t * k + s;
      const float ws = load_w(w, p);
      const Pack8 x = rows[unsort[p] * vecs + j];
#pragma unroll
      for (int e = 0; e < 8; e++) acc[e] += bf2f(f2bf(bf2f(x.v[e]) * ws));
    }
    Pack8 o;
#pragma unroll
    for (int e = 0; e < 8; e++) o.v[e] = f2bf(acc[e]);
    dst[j] = o;
  }
}

// dy[r] = bf16(dout[t] * w[p]) and dw[p] = sum_h dout[t, h] y[r, h] (f32) for the pair
// p = pair[r] of sorted row r, t = p / K.
template <typename W>
__device__ void combine_bwd(const u16* __restrict__ dout, const u16* __restrict__ y,
                            const i64* __restrict__ pair, const W* __restrict__ w,
                            u16* __restrict__ dy, W* __restrict__ dw, i64 rows, int k,
                            int h) {
  const i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const i64 p = pair[r];
  const i64 t = p / k;
  const float ws = load_w(w, p);
  const int vecs = h / 8;
  const Pack8* g = (const Pack8*)(dout + t * h);
  const Pack8* x = (const Pack8*)(y + r * h);
  Pack8* d = (Pack8*)(dy + r * h);
  float dot = 0.0f;
  for (int j = lane; j < vecs; j += 32) {
    const Pack8 gv = g[j], xv = x[j];
    Pack8 o;
#pragma unroll
    for (int e = 0; e < 8; e++) {
      const float ge = bf2f(gv.v[e]);
      o.v[e] = f2bf(ge * ws);
      dot += ge * bf2f(xv.v[e]);
    }
    d[j] = o;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
  if (lane == 0) store_w(dw, p, dot);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
    moe_combine_fwd_w32(const u16* y, const i64* unsort, const float* w, u16* out, i64 n, int k,
                        int h) {
  combine_fwd(y, unsort, w, out, n, k, h);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
    moe_combine_fwd_w16(const u16* y, const i64* unsort, const u16* w, u16* out, i64 n, int k,
                        int h) {
  combine_fwd(y, unsort, w, out, n, k, h);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
    moe_combine_bwd_w32(const u16* dout, const u16* y, const i64* pair, const float* w, u16* dy,
                        float* dw, i64 rows, int k, int h) {
  combine_bwd(dout, y, pair, w, dy, dw, rows, k, h);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
    moe_combine_bwd_w16(const u16* dout, const u16* y, const i64* pair, const u16* w, u16* dy,
                        u16* dw, i64 rows, int k, int h) {
  combine_bwd(dout, y, pair, w, dy, dw, rows, k, h);
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

extern "C" __global__ void __launch_bounds__(WARPS * 32)
    swiglu_fwd(const u16* __restrict__ gate, const u16* __restrict__ up, u16* __restrict__ h,
               i64 packs) {
  const Pack8* g = (const Pack8*)gate;
  const Pack8* u = (const Pack8*)up;
  Pack8* o = (Pack8*)h;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < packs;
       i += (i64)gridDim.x * blockDim.x) {
    const Pack8 gv = g[i], uv = u[i];
    Pack8 hv;
#pragma unroll
    for (int e = 0; e < 8; e++) {
      const float x = bf2f(gv.v[e]);
      hv.v[e] = f2bf(x * sigmoid(x) * bf2f(uv.v[e]));
    }
    o[i] = hv;
  }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
    swiglu_bwd(const u16* __restrict__ gate, const u16* __restrict__ up,
               const u16* __restrict__ dh, u16* __restrict__ dgate, u16* __restrict__ dup,
               i64 packs) {
  const Pack8* g = (const Pack8*)gate;
  const Pack8* u = (const Pack8*)up;
  const Pack8* d = (const Pack8*)dh;
  Pack8* dg = (Pack8*)dgate;
  Pack8* du = (Pack8*)dup;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < packs;
       i += (i64)gridDim.x * blockDim.x) {
    const Pack8 gv = g[i], uv = u[i], dv = d[i];
    Pack8 a, b;
#pragma unroll
    for (int e = 0; e < 8; e++) {
      const float x = bf2f(gv.v[e]), y = bf2f(uv.v[e]), dy = bf2f(dv.v[e]);
      const float s = sigmoid(x);
      a.v[e] = f2bf(dy * y * s * (1.0f + x * (1.0f - s)));
      b.v[e] = f2bf(dy * x * s);
    }
    dg[i] = a;
    du[i] = b;
  }
}

// torch's clamps: NaN stays NaN (fminf / fmaxf would drop it).
__device__ __forceinline__ float clamp_max(float x, float hi) { return x > hi ? hi : x; }
__device__ __forceinline__ float clamp(float x, float lim) {
  return x < -lim ? -lim : (x > lim ? lim : x);
}

// 8 interleaved (gate, up) pairs: 16 bf16, 32 bytes.
struct __align__(16) Pack16 {
  u16 v[16];
};

extern "C" __global__ void __launch_bounds__(WARPS * 32)
    clamped_swiglu_fwd(const u16* __restrict__ gate_up, u16* __restrict__ h, i64 packs,
                       float alpha, float limit) {
  const Pack16* gu = (const Pack16*)gate_up;
  Pack8* o = (Pack8*)h;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < packs;
       i += (i64)gridDim.x * blockDim.x) {
    const Pack16 x = gu[i];
    Pack8 hv;
#pragma unroll
    for (int e = 0; e < 8; e++) {
      const float g = clamp_max(bf2f(x.v[2 * e]), limit);
      const float u = clamp(bf2f(x.v[2 * e + 1]), limit);
      hv.v[e] = f2bf((u + 1.0f) * (g * sigmoid(alpha * g)));
    }
    o[i] = hv;
  }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
    clamped_swiglu_bwd(const u16* __restrict__ gate_up, const u16* __restrict__ dh,
                       u16* __restrict__ dgate_up, i64 packs, float alpha, float limit) {
  const Pack16* gu = (const Pack16*)gate_up;
  const Pack8* d = (const Pack8*)dh;
  Pack16* dgu = (Pack16*)dgate_up;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < packs;
       i += (i64)gridDim.x * blockDim.x) {
    const Pack16 x = gu[i];
    const Pack8 dv = d[i];
    Pack16 out;
#pragma unroll
    for (int e = 0; e < 8; e++) {
      const float g_in = bf2f(x.v[2 * e]), u_in = bf2f(x.v[2 * e + 1]);
      const float g = clamp_max(g_in, limit);
      const float u = clamp(u_in, limit);
      const float s = sigmoid(alpha * g);
      const float dy = bf2f(dv.v[e]);
      const float dglu = dy * (u + 1.0f);
      const float dg = (g_in <= limit) ? dglu * (s + g * alpha * s * (1.0f - s)) : 0.0f;
      const float du = (u_in >= -limit && u_in <= limit) ? dy * g * s : 0.0f;
      out.v[2 * e] = f2bf(dg);
      out.v[2 * e + 1] = f2bf(du);
    }
    dgu[i] = out;
  }
}
