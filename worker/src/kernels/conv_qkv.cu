// The Gated DeltaNet mixer's token mixing before the delta rule, fused: the depthwise
// causal convolution (4 taps) over the conv channels [q; k; v], SiLU, and for q and k the
// L2 norm per head (q also scaled by Dk^-1/2), written straight into the chunked rule's
// layouts. Compiled at run time by NVRTC (worker/src/kernels/cuda.rs); the contract and its
// CPU mirror are in worker/src/kernels.rs.
//
// Layouts (bf16 as raw 16-bit words, row-major):
//   x   (B, T, F)            the input projection's output, F = NG D channels in NG = 2G + V
//                            head groups of D: G query heads, G key heads, V value heads
//   w   (F, 4)               the conv taps; output t sees x[t-3..t] through w[0..3]
//   qk  (B, G, U, 2C, D)     per key head and chunk, the chunk's C q rows then its C k rows
//   v   (B, V, U C, D)
//   P = U C >= T: positions past T are written as zeros (forward) and read as constants
//   (backward: they get no gradient).
//
// Work split: a block of 4 warps takes one (row b, head group gi) and 256 positions, each
// warp 64 of them in order, with the conv's inputs in a sliding window of registers. A
// lane holds N = D / 32 adjacent channels, so a head's norm is a warp reduction.

#define TAPS 4
#define WARPS 4
#define TILE 64
#define SPAN (WARPS * TILE)

template <int N>
struct __align__(2 * N) Pack {
  u16 v[N];
};

template <int N>
__device__ __forceinline__ void load(const u16* p, float* out) {
  Pack<N> pk = *reinterpret_cast<const Pack<N>*>(p);
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = bf2f(pk.v[j]);
}

template <int N>
__device__ __forceinline__ void store(u16* p, const float* in) {
  Pack<N> pk;
#pragma unroll
  for (int j = 0; j < N; ++j) pk.v[j] = f2bf(in[j]);
  *reinterpret_cast<Pack<N>*>(p) = pk;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Where position t of head group gi (of row b) lives in qk or v, for this lane.
struct Out {
  size_t base;   // offset of position 0's row
  int chunk;     // C
  int qk;        // 1: the qk layout, 0: v's
  int D;

  __device__ size_t at(int t, int lane, int n) const {
    if (qk) {
      // (..., U, 2C, D) with this head's part already in `base`: chunk u's rows start
      // at u 2C D, its part's at + part C D (in base).
      int u = t / chunk, c = t - u * chunk;
      return base + ((size_t)u * 2 * chunk + c) * D + lane * n;
    }
    return base + (size_t)t * D + lane * n;
  }
};

struct Job {
  int b, gi, t0, t1, warp, lane, blk;
  float scale;  // q: Dk^-1/2; k: 1; v: 0 (no norm)
  Out out;
};

// The block's (b, gi, positions) and this warp's part of them, over `len` positions.
__device__ Job job(int len, int P, int C, int G, int V, int D, float q_scale) {
  const int NG = 2 * G + V, U = P / C;
  const int nblk = (len + SPAN - 1) / SPAN;
  Job j;
  j.blk = blockIdx.x % nblk;
  j.gi = (blockIdx.x / nblk) % NG;
  j.b = blockIdx.x / (nblk * NG);
  j.warp = threadIdx.x >> 5;
  j.lane = threadIdx.x & 31;
  j.t0 = j.blk * SPAN + j.warp * TILE;
  j.t1 = min(j.t0 + TILE, len);
  j.out.chunk = C;
  j.out.D = D;
  if (j.gi < 2 * G) {
    int g = j.gi % G, part = j.gi / G;
    j.scale = part == 0 ? q_scale : 1.0f;
    j.out.qk = 1;
    j.out.base = ((size_t)(j.b * G + g) * U * 2 * C + (size_t)part * C) * D;
  } else {
    j.scale = 0.0f;
    j.out.qk = 0;
    j.out.base = (size_t)(j.b * V + (j.gi - 2 * G)) * P * D;
  }
  return j;
}

// This lane's taps: w[f0 + n][k].
template <int N>
__device__ __forceinline__ void load_taps(const u16* w, int f0, float (&wk)[N][TAPS]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int k = 0; k < TAPS; ++k) wk[n][k] = bf2f(w[(f0 + n) * TAPS + k]);
}

// The inputs before position t0, x[t0-3..t0-1] (zero before the row's start), from this
// lane's column xr of a row of T positions and F channels.
template <int N>
__device__ __forceinline__ void load_history(const u16* xr, int t0, int T, int F,
                                             float (&hist)[TAPS - 1][N]) {
#pragma unroll
  for (int k = 0; k < TAPS - 1; ++k) {
    int t = t0 - (TAPS - 1) + k;
    if (t >= 0 && t < T) load<N>(xr + (size_t)t * F, hist[k]);
    else
#pragma unroll
      for (int n = 0; n < N; ++n) hist[k][n] = 0.0f;
  }
}

template <int N>
__device__ void conv_qkv_fwd(const u16* __restrict__ x, const u16* __restrict__ w,
                             u16* __restrict__ qk, u16* __restrict__ v, int T, int P, int C,
                             int G, int V, float q_scale) {
  const int D = 32 * N, F = (2 * G + V) * D;
  const Job j = job(P, P, C, G, V, D, q_scale);
  if (j.t0 >= P) return;
  const int f0 = j.gi * D + j.lane * N;
  float wk[N][TAPS];
  load_taps<N>(w, f0, wk);
  const u16* xr = x + (size_t)j.b * T * F + f0;
  float hist[TAPS - 1][N];
  load_history<N>(xr, j.t0, T, F, hist);
  u16* dst = j.out.qk ? qk : v;
  for (int t = j.t0; t < j.t1; ++t) {
    float s[N];
    if (t < T) {  // uniform over the warp
      float cur[N];
      load<N>(xr + (size_t)t * F, cur);
      float ss = 0.0f;
#pragma unroll
      for (int n = 0; n < N; ++n) {
        float a = wk[n][0] * hist[0][n] + wk[n][1] * hist[1][n] + wk[n][2] * hist[2][n] +
                  wk[n][3] * cur[n];
        s[n] = a / (1.0f + expf(-a));
        ss += s[n] * s[n];
        hist[0][n] = hist[1][n];
        hist[1][n] = hist[2][n];
        hist[2][n] = cur[n];
      }
      if (j.scale != 0.0f) {
        float r = rsqrtf(warp_sum(ss) + 1e-6f) * j.scale;
#pragma unroll
        for (int n = 0; n < N; ++n) s[n] *= r;
      }
    } else {
#pragma unroll
      for (int n = 0; n < N; ++n) s[n] = 0.0f;
    }
    store<N>(dst + j.out.at(t, j.lane, N), s);
  }
}

// The backward: from the gradients of qk and v (positions < T) to the gradient of x and
// per block the partial gradient of w, dw_part (B nblk, F, 4) f32, nblk = ceil(T / 256),
// summed over its first dim by the caller (a fixed order: deterministic).
template <int N>
__device__ void conv_qkv_bwd(const u16* __restrict__ x, const u16* __restrict__ w,
                             const u16* __restrict__ dqk, const u16* __restrict__ dv,
                             u16* __restrict__ dx, float* __restrict__ dw_part, int T, int P,
                             int C, int G, int V, float q_scale) {
  __shared__ float red[WARPS][32 * N * TAPS];
  const int D = 32 * N, F = (2 * G + V) * D;
  const Job j = job(T, P, C, G, V, D, q_scale);
  const int f0 = j.gi * D + j.lane * N;
  float acc[N][TAPS];
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int k = 0; k < TAPS; ++k) acc[n][k] = 0.0f;

  if (j.t0 < T) {  // uniform over the warp; every warp reaches the block's reduction
    float wk[N][TAPS];
    load_taps<N>(w, f0, wk);
    const u16* xr = x + (size_t)j.b * T * F + f0;
    u16* dxr = dx + (size_t)j.b * T * F + f0;
    const u16* dy = j.out.qk ? dqk : dv;
    // x[tp-3..tp-1] and the pre-activation gradients da[tp-3..tp-1].
    float hist[TAPS - 1][N], dwin[TAPS - 1][N];
    load_history<N>(xr, j.t0, T, F, hist);
#pragma unroll
    for (int k = 0; k < TAPS - 1; ++k)
#pragma unroll
      for (int n = 0; n < N; ++n) dwin[k][n] = 0.0f;
    // da at tp for tp < t1 + 3: the last 3 are the next tile's, read for dx only.
    for (int tp = j.t0; tp < j.t1 + TAPS - 1; ++tp) {
      float cur[N], da[N];
      if (tp < T) {  // uniform over the warp
        load<N>(xr + (size_t)tp * F, cur);
        float g[N], a[N], s[N], ss = 0.0f, sg = 0.0f;
        load<N>(dy + j.out.at(tp, j.lane, N), g);
#pragma unroll
        for (int n = 0; n < N; ++n) {
          a[n] = wk[n][0] * hist[0][n] + wk[n][1] * hist[1][n] + wk[n][2] * hist[2][n] +
                 wk[n][3] * cur[n];
          s[n] = a[n] / (1.0f + expf(-a[n]));
          ss += s[n] * s[n];
          sg += s[n] * g[n];
        }
        if (j.scale != 0.0f) {
          // y = c s r, r = (|s|^2 + eps)^-1/2: ds = c r (dy - s r^2 (s . dy)).
          float r = rsqrtf(warp_sum(ss) + 1e-6f), dot = warp_sum(sg);
#pragma unroll
          for (int n = 0; n < N; ++n) g[n] = j.scale * r * (g[n] - s[n] * r * r * dot);
        }
#pragma unroll
        for (int n = 0; n < N; ++n) {
          float sig = 1.0f / (1.0f + expf(-a[n]));
          da[n] = g[n] * sig * (1.0f + a[n] * (1.0f - sig));
        }
        if (tp < j.t1) {
#pragma unroll
          for (int n = 0; n < N; ++n) {
            acc[n][0] += da[n] * hist[0][n];
            acc[n][1] += da[n] * hist[1][n];
            acc[n][2] += da[n] * hist[2][n];
            acc[n][3] += da[n] * cur[n];
          }
        }
      } else {
#pragma unroll
        for (int n = 0; n < N; ++n) cur[n] = da[n] = 0.0f;
      }
      // dx[t] = sum_k w[k] da[t + 3 - k], for t = tp - 3.
      const int t = tp - (TAPS - 1);
      if (t >= j.t0) {
        float d[N];
#pragma unroll
        for (int n = 0; n < N; ++n)
          d[n] = wk[n][0] * da[n] + wk[n][1] * dwin[2][n] + wk[n][2] * dwin[1][n] +
                 wk[n][3] * dwin[0][n];
        store<N>(dxr + (size_t)t * F, d);
      }
#pragma unroll
      for (int n = 0; n < N; ++n) {
        hist[0][n] = hist[1][n];
        hist[1][n] = hist[2][n];
        hist[2][n] = cur[n];
        dwin[0][n] = dwin[1][n];
        dwin[1][n] = dwin[2][n];
        dwin[2][n] = da[n];
      }
    }
  }
  // The block's 4 warps, in a fixed order, into its partial.
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int k = 0; k < TAPS; ++k) red[j.warp][(j.lane * N + n) * TAPS + k] = acc[n][k];
  __syncthreads();
  const int nblk = (T + SPAN - 1) / SPAN;
  float* part = dw_part + ((size_t)j.b * nblk + j.blk) * F * TAPS + (size_t)j.gi * D * TAPS;
  for (int i = threadIdx.x; i < D * TAPS; i += blockDim.x) {
    float sum = 0.0f;
#pragma unroll
    for (int wp = 0; wp < WARPS; ++wp) sum += red[wp][i];
    part[i] = sum;
  }
}

#define INSTANCE(N)                                                                         \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                  \
      conv_qkv_fwd_##N(const u16* x, const u16* w, u16* qk, u16* v, int T, int P, int C,   \
                       int G, int V, float q_scale) {                                       \
    conv_qkv_fwd<N>(x, w, qk, v, T, P, C, G, V, q_scale);                                   \
  }                                                                                         \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                  \
      conv_qkv_bwd_##N(const u16* x, const u16* w, const u16* dqk, const u16* dv, u16* dx, \
                       float* dw_part, int T, int P, int C, int G, int V, float q_scale) {  \
    conv_qkv_bwd<N>(x, w, dqk, dv, dx, dw_part, T, P, C, G, V, q_scale);                    \
  }

INSTANCE(1)
INSTANCE(2)
INSTANCE(4)
INSTANCE(8)
