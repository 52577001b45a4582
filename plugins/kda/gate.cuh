// SPDX-License-Identifier: Apache-2.0
// The KDA per-channel forget gate, beta and the q / k l2 norm (families/kda/reference.py is the spec), shared by the
// (K, V) kernels (kda.cuh, kda_spec.cuh) and the (V, K) ones (kda_vk.cuh). Included after the generated prelude:
// KDA_LOWER_BOUND 1 with kLowerBound < 0 selects GLM-5 Next's gate bounded below; kL2Norm off makes rnorm 1.
#pragma once

#ifndef KDA_LOWER_BOUND
#define KDA_LOWER_BOUND 0
#endif

namespace kda_gate {

__device__ __forceinline__ float softplus(float v) { return v > 20.f ? v : log1pf(expf(v)); }  // torch's threshold
__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }
constexpr float kL2Eps = 1e-6f;  // families/kda/reference.L2NORM_EPS
// 1 / |x| from |x|^2 (the l2 norm's reciprocal with transformers' eps), or 1 without the norm
__device__ __forceinline__ float rnorm(float ss) { return kL2Norm ? rsqrtf(ss + kL2Eps) : 1.f; }
// g of one channel: -exp(A_log) softplus(f + dt_bias) (Kimi), or lb sigmoid(exp(A_log) (f + dt_bias)) (GLM-5 Next)
__device__ __forceinline__ float gate(float f, float dtb, float A) {  // A = exp(A_log)
#if KDA_LOWER_BOUND
  return kLowerBound * sigmoid(A * (f + dtb));
#else
  return -A * softplus(f + dtb);
#endif
}

}  // namespace kda_gate
