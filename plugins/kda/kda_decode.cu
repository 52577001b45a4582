// SPDX-License-Identifier: Apache-2.0
// Kimi Delta Attention entry points (device math in kda.cuh), ordered as TensorRT's AOT plugins pass them:
// inputs, int32 scalars, outputs. Aliased outputs (checkpoint, rings, shadow) receive the same pointers as their
// inputs.
//
// kda_replay_decode: grid (H * V / kCols, batch), block (kWarps * 32)
//   inputs   1 q (batch, H, K) act           2 k (batch, H, K) act (raw)     3 v (batch, H, V) act
//            4 f (batch, H, K) act (raw forget-gate projection)              5 b (batch, H) act (raw beta logit)
//            6 A_log (H,) f32                7 dt_bias (H, K) f32            8 state_batch_indices (batch,) i32, -1 = padding
//            9 cursor (slots,) i32           10 state (slots, H, K, V) f32
//            11 k_cache (slots, H, L, K) act (raw k)    12 u_cache (slots, H, L, V) bf16
//            13 g_cache (slots, H, L, K) f32            14 v_cache (slots, H, L, V) act
//            15 beta_cache (slots, H, L) f32            [16 shadow (slots, H, K, V) bf16, KDA_SHADOW 1]
//   scalars  batch, nslots (int32)
//   outputs  y (batch, H, V) act (padding rows untouched), then the aliases of 10-15 [, 16]
// kda_conventional: grid (H * V / kCols, batch)
//   inputs 1-8 as above, 9 state; scalars batch, nslots; outputs y, state (aliased)
#include "kda.cuh"

#include "kda_params.cuh"

extern "C" __global__ void __launch_bounds__(kda::kThreads, kMinBlocks) kda_replay_decode(KDA_REPLAY_PARAMS) {
  const kda::Args args = KDA_REPLAY_ARGS;
  kda::replay_decode(args);
}

// Conventional KDA step (the baseline): reads and writes the whole state.
extern "C" __global__ void __launch_bounds__(kda::kThreads, kMinBlocks) kda_conventional(
    const act_t* __restrict__ q, const act_t* __restrict__ k, const act_t* __restrict__ v,
    const act_t* __restrict__ f, const act_t* __restrict__ b, const float* __restrict__ A_log,
    const float* __restrict__ dt_bias, const int* __restrict__ sbi, const float* state_in, int batch, int nslots,
    act_t* __restrict__ y, float* state_out) {
  const kda::Args args{q, k, v, f, b, A_log, dt_bias, sbi, nullptr, state_in, nullptr, nullptr, nullptr, nullptr,
                       nullptr, nullptr, batch, nslots, y, state_out, nullptr, nullptr, nullptr, nullptr, nullptr,
                       nullptr};
  kda::conventional(args);
}
