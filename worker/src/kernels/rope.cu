// Rotary position embedding of attention heads as one pass: x (B, N, T, D) bf16, read
// through its strides (the head dim contiguous), written contiguous. Each pair of the first
// R dims turns by its angle: the halves (i, i + R/2) as Llama's rotate_half pairs them, or
// adjacent dims (2i, 2i + 1) where `interleaved`; the other D - R dims pass unchanged. In f32
// from the bf16 inputs, rounded once (torch's ops round each product and the sum). `sign`
// -1 turns the other way: the rotation's transpose, the backward. cos and sin are bf16,
// (B or 1, 1, T, R) or, interleaved, (.., R/2): entry i of a position is pair i's (the halves
// repeat), at b * cb + t * ct.
//
// Block: D/2 threads along x (one per pair or pair of passing dims) by ROWS_PER_BLOCK rows
// along y; a grid-stride loop over the B N T rows.

typedef long long i64;

extern "C" __global__ void __launch_bounds__(256)
    rope(const u16* __restrict__ x, i64 sb, i64 sn, i64 st, const u16* __restrict__ cos,
         const u16* __restrict__ sin, i64 cb, i64 ct, u16* __restrict__ y, int n, int t, int d,
         int r, int interleaved, float sign, i64 rows) {
  const int j = threadIdx.x, half = r / 2;
  for (i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y; row < rows;
       row += (i64)gridDim.x * blockDim.y) {
    const i64 ti = row % t, bn = row / t, ni = bn % n, bi = bn / n;
    const u16* xr = x + bi * sb + ni * sn + ti * st;
    u16* yr = y + row * d;
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
}
