// SPDX-License-Identifier: Apache-2.0
// The KDA per-channel forget gate and beta (families/kda/reference.py is the spec), shared by the (K, V) kernels
// (kda.cuh, kda_spec.cuh) and the (V, K) conventional step (kda_vk.cuh). Included after the generated prelude:
// KDA_LOWER_BOUND 1 with kLowerBound < 0 selects GLM-5 Next's gate bounded below.
#pragma once

#ifndef KDA_LOWER_BOUND
#define KDA_LOWER_BOUND 0
#endif

namespace kda_gate {

__device__ __forceinline__ float softplus(float v) { return v > 20.f ? v : log1pf(expf(v)); }  // torch's threshold
__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }
// g of one channel: -exp(A_log) softplus(f + dt_bias) (Kimi), or lb sigmoid(exp(A_log) (f + dt_bias)) (GLM-5 Next)
__device__ __forceinline__ float gate(float f, float dtb, float A) {  // A = exp(A_log)
#if KDA_LOWER_BOUND
  return kLowerBound * sigmoid(A * (f + dtb));
#else
  return -A * softplus(f + dtb);
#endif
}

}  // namespace kda_gate
