// SPDX-License-Identifier: Apache-2.0
// Kimi Delta Attention speculative entry point (device math in kda_spec.cuh), ordered as TensorRT's AOT plugins pass
// them: inputs, int32 scalars, outputs. Aliased outputs receive the same pointers as their inputs. The commit is the
// shared replayssm_spec_commit kernel (plugins/mamba2/replayssm_spec.cu), one cursor for every layer.
//
// kda_verify: grid (H * V / kCols, batch), block (kWarps * 32)
//   inputs   1 q (batch, T, H, K) act           2 k (batch, T, H, K) act (raw)    3 v (batch, T, H, V) act
//            4 f (batch, T, H, K) act (raw forget-gate projection)                 5 b (batch, T, H) act (raw beta logit)
//            6 A_log (H,) f32                   7 dt_bias (H, K) f32               8 state_batch_indices (batch,) i32
//            9 cursor (slots, 2) i32 (start, count), read only
//            10 state (slots, H, K, V) f32
//            11 k_cache (slots, H, L, K) act (raw k)    12 u_cache (slots, H, L, V) bf16
//            13 g_cache (slots, H, L, K) f32            14 v_cache (slots, H, L, V) act
//            15 beta_cache (slots, H, L) f32            [16 shadow (slots, H, K, V) bf16, KDA_SHADOW 1]
//   scalars  batch, nslots (int32)
//   outputs  y (batch, T, H, V) act (padding rows untouched), then the aliases of 10-15 [, 16]
//            (state and shadow written where count + 2T > L; the window appended to the rings)
#include "kda_spec.cuh"

#include "kda_params.cuh"

extern "C" __global__ void __launch_bounds__(kda::kThreads, kMinBlocks) kda_verify(KDA_REPLAY_PARAMS) {
  const kda::Args args = KDA_REPLAY_ARGS;
  kda::spec_verify(args);
}
