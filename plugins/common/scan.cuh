// SPDX-License-Identifier: Apache-2.0
// Warp scans every family's kernels share (mamba2/, gdn/, ...); no torch, no family sizes. Included by the family
// headers (as "common/scan.cuh": the compiler's include path is plugins/); each brings the names it uses into its
// own namespace.
#pragma once

namespace rssm_common {

// Lane i of a full warp gets the sum of v over lanes i+1 .. 31 (0 on lane 31): the decay exponents of a replay
// step are such suffix sums (sum over the entries after j), never the difference of two prefix sums, which after
// a spike (softplus past its threshold: dt or |g| sums of 24..100) loses ~ulp(total) and leaves every surviving
// weight a relative error of ~|A| ulp(total); a suffix of like-signed terms is exact to a few ulp of itself
// (bench/NOTES.md "fp32 exponents after a dt spike"). Six shuffles, as the prefix scan and its broadcast.
__device__ __forceinline__ float suffix_after(float v) {
  const int lane = threadIdx.x % 32;
  float s = __shfl_down_sync(0xffffffffu, v, 1);
  if (lane == 31) s = 0.f;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float u = __shfl_down_sync(0xffffffffu, s, o);
    if (lane + o < 32) s += u;
  }
  return s;
}

}  // namespace rssm_common
