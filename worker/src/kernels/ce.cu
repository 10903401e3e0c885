// The token cross-entropy of a chunk of logits and its gradient in one kernel: row r of
// logits (C, V) bf16 against target t_r (-100: ignored), weighted by w_r (f32):
//   loss_r = lse_r - x_{r,t}                      (0 where ignored)
//   dx_{r,j} = w_r (exp(x_{r,j} - lse_r) - [j = t_r])   (bf16, rounded once; 0 where ignored)
// the gradient of sum_r w_r loss_r. All in f32 from the bf16 logits, as transformers upcasts
// them; where torch makes an f32 copy of the logits, their log-softmax, its backward and a
// cast back (five passes over C x V f32), this reads the logits twice and writes dx once.
// A target outside [0, V) other than -100 gives a NaN loss.
//
// One block of CE_THREADS per row: an online max and sum of exponentials per thread, merged
// across the block, then the gradient pass.

typedef long long i64;
#define CE_THREADS 512
#define NEG_INF __int_as_float(0xff800000)
#define QNAN __int_as_float(0x7fc00000)

struct __align__(16) Bf8 {
  u16 v[8];
};

// Merges (m2, s2) into (m, s): the running max and the sum of exp(x - max).
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == NEG_INF) return;  // both empty
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}

__device__ __forceinline__ void add(float& m, float& s, float a) {
  if (a > m) {
    s = s * expf(m - a) + 1.0f;
    m = a;
  } else {
    s += expf(a - m);  // NaN stays NaN
  }
}

extern "C" __global__ void __launch_bounds__(CE_THREADS)
    cross_entropy(const u16* __restrict__ logits, const i64* __restrict__ targets,
                  const float* __restrict__ weights, i64 v, float* __restrict__ loss,
                  u16* __restrict__ dlogits) {
  __shared__ float sm[CE_THREADS / 32], ss[CE_THREADS / 32];
  __shared__ float row_lse;
  const i64 row = blockIdx.x;
  const u16* x = logits + row * v;
  u16* dx = dlogits + row * v;
  const bool packed = v % 8 == 0;
  float m = NEG_INF, s = 0.0f;
  if (packed) {
    const Bf8* x8 = (const Bf8*)x;
    for (i64 i = threadIdx.x; i < v / 8; i += CE_THREADS) {
      const Bf8 p = x8[i];
#pragma unroll
      for (int e = 0; e < 8; e++) add(m, s, bf2f(p.v[e]));
    }
  } else {
    for (i64 j = threadIdx.x; j < v; j += CE_THREADS) add(m, s, bf2f(x[j]));
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    merge(m, s, m2, s2);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float bm = sm[0], bs = ss[0];
    for (int i = 1; i < CE_THREADS / 32; i++) merge(bm, bs, sm[i], ss[i]);
    row_lse = bm + logf(bs);
  }
  __syncthreads();
  const float lse = row_lse;
  const i64 t = targets[row];
  const bool ignored = t == -100;
  const float w = ignored ? 0.0f : weights[row];
  if (threadIdx.x == 0) {
    loss[row] = ignored ? 0.0f : (t < 0 || t >= v) ? QNAN : lse - bf2f(x[t]);
  }
  if (packed) {
    const Bf8* x8 = (const Bf8*)x;
    Bf8* d8 = (Bf8*)dx;
    for (i64 i = threadIdx.x; i < v / 8; i += CE_THREADS) {
      const Bf8 p = x8[i];
      Bf8 q;
#pragma unroll
      for (int e = 0; e < 8; e++) {
        const float hit = (8 * i + e == t) ? 1.0f : 0.0f;
        q.v[e] = f2bf(w * (expf(bf2f(p.v[e]) - lse) - hit));
      }
      d8[i] = q;
    }
  } else {
    for (i64 j = threadIdx.x; j < v; j += CE_THREADS) {
      const float hit = (j == t) ? 1.0f : 0.0f;
      dx[j] = f2bf(w * (expf(bf2f(x[j]) - lse) - hit));
    }
  }
}
