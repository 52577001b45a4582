// SPDX-License-Identifier: Apache-2.0
// Warp reductions every family's kernels may share (kda/ first); no torch, no family sizes. Included as
// "common/warp.cuh" (the compiler's include path is plugins/).
#pragma once

namespace rssm_common {

// The smallest power of two >= x (>= 1): the width of a transposing reduce over x values.
__host__ __device__ constexpr int pow2_at_least(int x) { return x <= 1 ? 1 : 2 * pow2_at_least((x + 1) / 2); }

// One stage of a transposing butterfly (below) at group offset o.
template <int n, int stride, int o>
__device__ __forceinline__ void transpose_stage(float (&acc)[n], int gi) {
  if constexpr (o < n) {
    const bool up = gi & o;
#pragma unroll
    for (int i = 0; i < n / (2 * o); ++i) {
      const float send = up ? acc[2 * i] : acc[2 * i + 1];
      const float keep = up ? acc[2 * i + 1] : acc[2 * i];
      acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, o * stride);
    }
    transpose_stage<n, stride, 2 * o>(acc, gi);
  }
}

// Transposing butterfly. The warp's lanes form 32 / stride groups of the lanes that agree in lane % stride;
// group index gi = lane / stride. Every lane holds n partial values (n a power of two <= 32 / stride); on
// return, lane gi holds the group's sum of value gi % n. n - 1 + log2(32 / (stride n)) shuffles, against
// n log2(32 / stride) for n separate reductions. acc is clobbered.
template <int n, int stride>
__device__ __forceinline__ float transpose_reduce(float (&acc)[n]) {
  constexpr int group = 32 / stride;
  static_assert((n & (n - 1)) == 0 && n >= 1 && n <= group, "n: a power of two, at most the group size");
  const int gi = (threadIdx.x % 32) / stride;
  transpose_stage<n, stride, 1>(acc, gi);
  float r = acc[0];
#pragma unroll
  for (int o = n; o < group; o <<= 1) r += __shfl_xor_sync(0xffffffffu, r, o * stride);
  return r;
}

}  // namespace rssm_common
