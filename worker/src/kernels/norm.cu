// The `1 + w` RMSNorm (Gemma, Qwen3-Next, Qwen3.5) of bf16 rows as one pass each way, as
// transformers computes it: in f32 from the bf16 x, xhat = x rsqrt(mean(x^2) + eps), then
// y = xhat (1 + w) with the f32 weight, rounded once. torch 2.11 takes its fused kernel for
// this only on an f32 copy of x (worker/src/model/common.rs), which costs a cast each way
// and keeps that copy for the backward; here the backward reads x itself and the rows'
// rstd.
//
// Rows of H = 8 * packs channels, contiguous, 16-byte aligned (8 bf16 per load). A row is
// one group of TPR threads (32, 64, 128 or 256: `tpr`), THREADS / TPR groups per block, and
// thread l of a group holds packs l, l + TPR, ... (at most MAXV of them: H <= 8 MAXV TPR).
// Blocks stride over the rows, so the backward's weight-gradient partial sums stay in
// registers across rows: one row of partials per group, summed by the caller.

typedef long long i64;

#define THREADS 256
#define MAXV 4

// The sum of v over the `tpr` threads of the caller's group (a power of two: aligned lanes
// of a warp, or aligned warps), in each of them. Every thread of the block calls it
// together (it synchronizes when tpr > 32).
__device__ __forceinline__ float group_sum(float v, float* smem, int tpr) {
  for (int o = (tpr < 32 ? tpr : 32) / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (tpr <= 32) return v;
  const int warp = threadIdx.x / 32, per = tpr / 32, first = warp - warp % per;
  __syncthreads();
  if (threadIdx.x % 32 == 0) smem[warp] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < per; i++) s += smem[first + i];
  return s;
}

__device__ __forceinline__ void load8(const u16* p, float* out) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
  for (int i = 0; i < 4; i++) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ void store8(u16* p, const float* v) {
  uint4 u;
  unsigned int* w = reinterpret_cast<unsigned int*>(&u);
  for (int i = 0; i < 4; i++) w[i] = (unsigned int)f2bf(v[2 * i]) | ((unsigned int)f2bf(v[2 * i + 1]) << 16);
  *reinterpret_cast<uint4*>(p) = u;
}

// y = bf16(x rstd (1 + w)), w1 = 1 + w in f32; rstd (rows) f32 is written where not null.
extern "C" __global__ void __launch_bounds__(THREADS)
    norm_plus_one_fwd(const u16* __restrict__ x, const float* __restrict__ w1,
                      u16* __restrict__ y, float* __restrict__ rstd, i64 rows, int packs,
                      int tpr, float eps) {
  __shared__ float smem[THREADS / 32];
  const int groups = THREADS / tpr, g = threadIdx.x / tpr, l = threadIdx.x % tpr;
  const int h = 8 * packs;
  for (i64 first = (i64)blockIdx.x * groups; first < rows; first += (i64)gridDim.x * groups) {
    const i64 r = first + g;
    const bool live = r < rows;
    float v[MAXV][8];
    float ss = 0.f;
    for (int k = 0; k < MAXV; k++) {
      const int j = l + k * tpr;
      if (live && j < packs) {
        load8(x + r * h + 8 * j, v[k]);
        for (int i = 0; i < 8; i++) ss += v[k][i] * v[k][i];
      }
    }
    ss = group_sum(ss, smem, tpr);
    const float rs = rsqrtf(ss / (float)h + eps);
    if (!live) continue;
    if (rstd != nullptr && l == 0) rstd[r] = rs;
    for (int k = 0; k < MAXV; k++) {
      const int j = l + k * tpr;
      if (j < packs) {
        float o[8];
        for (int i = 0; i < 8; i++) o[i] = (v[k][i] * rs) * w1[8 * j + i];
        store8(y + r * h + 8 * j, o);
      }
    }
  }
}

// From dy: dx = rstd (g - xhat mean(g xhat)) with g = dy (1 + w), xhat = x rstd; and the
// weight's gradient sum over rows of dy xhat, as one row of partial sums per group:
// dw_part (gridDim.x * groups, H) f32.
extern "C" __global__ void __launch_bounds__(THREADS)
    norm_plus_one_bwd(const u16* __restrict__ x, const u16* __restrict__ dy,
                      const float* __restrict__ w1, const float* __restrict__ rstd,
                      u16* __restrict__ dx, float* __restrict__ dw_part, i64 rows, int packs,
                      int tpr) {
  __shared__ float smem[THREADS / 32];
  const int groups = THREADS / tpr, g = threadIdx.x / tpr, l = threadIdx.x % tpr;
  const int h = 8 * packs;
  float dw[MAXV][8];
  for (int k = 0; k < MAXV; k++)
    for (int i = 0; i < 8; i++) dw[k][i] = 0.f;
  for (i64 first = (i64)blockIdx.x * groups; first < rows; first += (i64)gridDim.x * groups) {
    const i64 r = first + g;
    const bool live = r < rows;
    const float rs = live ? rstd[r] : 0.f;
    float xh[MAXV][8], gr[MAXV][8];
    float dot = 0.f;
    for (int k = 0; k < MAXV; k++) {
      const int j = l + k * tpr;
      if (live && j < packs) {
        float d[8];
        load8(x + r * h + 8 * j, xh[k]);
        load8(dy + r * h + 8 * j, d);
        for (int i = 0; i < 8; i++) {
          xh[k][i] *= rs;
          gr[k][i] = d[i] * w1[8 * j + i];
          dot += gr[k][i] * xh[k][i];
          dw[k][i] += d[i] * xh[k][i];
        }
      }
    }
    dot = group_sum(dot, smem, tpr) / (float)h;
    if (!live) continue;
    for (int k = 0; k < MAXV; k++) {
      const int j = l + k * tpr;
      if (j < packs) {
        float o[8];
        for (int i = 0; i < 8; i++) o[i] = rs * (gr[k][i] - xh[k][i] * dot);
        store8(dx + r * h + 8 * j, o);
      }
    }
  }
  float* part = dw_part + ((i64)blockIdx.x * groups + g) * h;
  for (int k = 0; k < MAXV; k++) {
    const int j = l + k * tpr;
    if (j < packs)
      for (int i = 0; i < 8; i++) part[8 * j + i] = dw[k][i];
  }
}

// The Gated DeltaNet's gated RMSNorm per value head (Qwen3-Next, Qwen3.5), fused with its
// gate and the move to out_proj's layout: y[b, t, v] = bf16(norm(o[b, v, t]) w silu(z[b, t,
// v])) in f32, rounded once, where transformers rounds norm(o), its product by w and the
// gated product each (bf16 in, f32 inside). o (B, V, P, Dv) contiguous (P >= T: the rule's
// padded chunks, not read past T), z (B, T, V, Dv) through its strides zs_b, zs_t (the view
// of the projection's output it is), w (Dv) f32, y (B, T, V Dv). One group of tpr = Dv / 8
// threads per (b, t, v) row, one pack each.

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + __expf(-x)); }

struct GatedShape {
  i64 zs_b, zs_t;
  int t, v, p;
};

__device__ __forceinline__ void gated_rows(i64 r, const GatedShape& s, int dv, i64* o_off,
                                           i64* z_off) {
  const i64 vi = r % s.v, ti = (r / s.v) % s.t, bi = r / ((i64)s.v * s.t);
  *o_off = ((bi * s.v + vi) * s.p + ti) * dv;
  *z_off = bi * s.zs_b + ti * s.zs_t + vi * dv;
}

extern "C" __global__ void __launch_bounds__(THREADS)
    gated_norm_fwd(const u16* __restrict__ o, const u16* __restrict__ z,
                   const float* __restrict__ w, u16* __restrict__ y, float* __restrict__ rstd,
                   GatedShape s, i64 rows, int tpr, float eps) {
  __shared__ float smem[THREADS / 32];
  const int groups = THREADS / tpr, g = threadIdx.x / tpr, l = threadIdx.x % tpr;
  const int dv = 8 * tpr;
  for (i64 first = (i64)blockIdx.x * groups; first < rows; first += (i64)gridDim.x * groups) {
    const i64 r = first + g;
    const bool live = r < rows;
    i64 oo = 0, zo = 0;
    float x[8], ss = 0.f;
    if (live) {
      gated_rows(r, s, dv, &oo, &zo);
      load8(o + oo + 8 * l, x);
      for (int i = 0; i < 8; i++) ss += x[i] * x[i];
    }
    ss = group_sum(ss, smem, tpr);
    const float rs = rsqrtf(ss / (float)dv + eps);
    if (!live) continue;
    if (rstd != nullptr && l == 0) rstd[r] = rs;
    float zv[8], out[8];
    load8(z + zo + 8 * l, zv);
    for (int i = 0; i < 8; i++)
      out[i] = (x[i] * rs) * w[8 * l + i] * (zv[i] * sigmoidf(zv[i]));
    store8(y + r * dv + 8 * l, out);
  }
}

// From dy (B, T, V Dv): do in o's layout (rows past T untouched: the caller zeroes them),
// dz (B, T, V, Dv) contiguous, and w's gradient as one row of partial sums per group:
// dw_part (gridDim.x * groups, Dv) f32. With xh = o rstd, n = xh w, s = silu(z):
// dz = dy n silu'(z), g = dy s w, do = rstd (g - xh mean(g xh)), dw = sum dy s xh.
extern "C" __global__ void __launch_bounds__(THREADS)
    gated_norm_bwd(const u16* __restrict__ o, const u16* __restrict__ z,
                   const float* __restrict__ w, const float* __restrict__ rstd,
                   const u16* __restrict__ dy, u16* __restrict__ d_o, u16* __restrict__ dz,
                   float* __restrict__ dw_part, GatedShape s, i64 rows, int tpr) {
  __shared__ float smem[THREADS / 32];
  const int groups = THREADS / tpr, g = threadIdx.x / tpr, l = threadIdx.x % tpr;
  const int dv = 8 * tpr;
  float dw[8];
  for (int i = 0; i < 8; i++) dw[i] = 0.f;
  for (i64 first = (i64)blockIdx.x * groups; first < rows; first += (i64)gridDim.x * groups) {
    const i64 r = first + g;
    const bool live = r < rows;
    i64 oo = 0, zo = 0;
    float xh[8], gr[8], dot = 0.f;
    const float rs = live ? rstd[r] : 0.f;
    if (live) {
      gated_rows(r, s, dv, &oo, &zo);
      float zv[8], d[8], dzv[8];
      load8(o + oo + 8 * l, xh);
      load8(z + zo + 8 * l, zv);
      load8(dy + r * dv + 8 * l, d);
      for (int i = 0; i < 8; i++) {
        const float wi = w[8 * l + i], sg = sigmoidf(zv[i]), sl = zv[i] * sg;
        xh[i] *= rs;
        dzv[i] = d[i] * xh[i] * wi * sg * (1.f + zv[i] * (1.f - sg));
        const float dn = d[i] * sl;
        dw[i] += dn * xh[i];
        gr[i] = dn * wi;
        dot += gr[i] * xh[i];
      }
      store8(dz + r * dv + 8 * l, dzv);
    }
    dot = group_sum(dot, smem, tpr) / (float)dv;
    if (!live) continue;
    float out[8];
    for (int i = 0; i < 8; i++) out[i] = rs * (gr[i] - xh[i] * dot);
    store8(d_o + oo + 8 * l, out);
  }
  float* part = dw_part + ((i64)blockIdx.x * groups + g) * dv;
  for (int i = 0; i < 8; i++) part[8 * l + i] = dw[i];
}
