// SPDX-License-Identifier: Apache-2.0
// Storage-type conversions every family's kernels share: to_f widens a stored value to fp32, from_f<T> narrows
// fp32 to the storage type T by round-to-nearest-even (fp8-e4m3: nearest even, saturating to +-448; the values a
// kernel stores there are |v| <= 448 by construction of its scale). The fp8 pair exists where the generated
// prelude included <cuda_fp8.h> (an fp8 spec). No torch, no family sizes.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace rssm_common {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
#ifdef __CUDA_FP8_TYPES_EXIST__
__device__ __forceinline__ float to_f(__nv_fp8_e4m3 v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ __nv_fp8_e4m3 from_f<__nv_fp8_e4m3>(float v) { return __nv_fp8_e4m3(v); }
#endif

}  // namespace rssm_common
