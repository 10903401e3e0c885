// bf16 as raw 16-bit words, shared by the kernels here: worker/src/kernels/cuda.rs puts this
// text before each .cu file it compiles (NVRTC has no include path to this folder).

typedef unsigned short u16;

__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((unsigned int)h) << 16); }

// Round to nearest even, as torch casts; NaN stays NaN with the quiet bit set
// (src/elem/bits.rs `round_bf16`).
__device__ __forceinline__ u16 round_bits(unsigned int u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
  return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ u16 f2bf(float f) { return round_bits(__float_as_uint(f)); }
