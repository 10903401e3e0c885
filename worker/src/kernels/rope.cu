// Rotary position embedding of attention heads as one pass: x (B, N, T, D) bf16 read through
// its strides and y written through its own (the head dim contiguous in both). Each pair of
// the first R dims turns by its angle: the halves (i, i + R/2) as Llama's rotate_half pairs
// them, or adjacent dims (2i, 2i + 1) where `interleaved`; the other D - R dims pass
// unchanged. In f32 from the bf16 inputs, rounded once (torch's ops round each product and
// the sum). `sign` -1 turns the other way: the rotation's transpose, the backward. cos and
// sin are bf16, (B or 1, 1, T, R) or, interleaved, (.., R/2): entry i of a position is pair
// i's (the halves repeat), at b * cb + t * ct.
//
// Grid (T / ROWS, N, B), blocks of D/2 threads (one per pair, or per two passing dims) by
// ROWS positions: no index arithmetic beyond the block's coordinates.

typedef long long i64;

struct Strides {
  i64 b, n, t;
};

extern "C" __global__ void __launch_bounds__(256)
    rope(const u16* __restrict__ x, Strides xs, const u16* __restrict__ cos,
         const u16* __restrict__ sin, i64 cb, i64 ct, u16* __restrict__ y, Strides ys, int t,
         int r, int interleaved, float sign) {
  const int j = threadIdx.x, half = r / 2;
  const int ti = blockIdx.x * blockDim.y + threadIdx.y;
  if (ti >= t) return;
  const i64 ni = blockIdx.y, bi = blockIdx.z;
  const u16* xr = x + bi * xs.b + ni * xs.n + ti * xs.t;
  u16* yr = y + bi * ys.b + ni * ys.n + ti * ys.t;
  if (j < half) {
    const int i0 = interleaved ? 2 * j : j, i1 = interleaved ? 2 * j + 1 : j + half;
    const i64 ci = bi * cb + ti * ct + j;
    const float c = bf2f(cos[ci]), s = sign * bf2f(sin[ci]);
    const float a = bf2f(xr[i0]), b = bf2f(xr[i1]);
    yr[i0] = f2bf(a * c - b * s);
    yr[i1] = f2bf(b * c + a * s);
  } else {
    const int i = r + 2 * (j - half);
    yr[i] = xr[i];
    yr[i + 1] = xr[i + 1];
  }
}
