// SPDX-License-Identifier: Apache-2.0
// Gated DeltaNet entry points (device math in gdn.cuh), ordered as TensorRT's AOT plugins pass them:
// inputs, int32 scalars, outputs. Aliased outputs (checkpoint, buffers, shadow) receive the same
// pointers as their inputs.
//
// gdn_replay_decode: grid (HV * V / kRows, batch), block (kWarps * 32)
//   inputs   1 q (batch, H, K) act          2 k (batch, H, K) act       3 v (batch, HV, V) act
//            4 a (batch, HV) act (raw)       5 b (batch, HV) act (raw)   6 A_log (HV,) f32
//            7 dt_bias (HV,) f32             8 state_batch_indices (batch,) i32, -1 = padding
//            9 cursor (slots,) i32           10 state (slots, HV, V, K) f32
//            11 u_cache (slots, HV, L, V) f32    12 v_cache (slots, HV, L, V) act
//            13 k_cache (slots, H, L, K) f32     14 g_cache (slots, HV, L) f32
//            15 beta_cache (slots, HV, L) f32    [16 shadow (slots, HV, V, K) bf16, GDN_SHADOW 1]
//   scalars  batch, nslots (int32)
//   outputs  y (batch, HV, V) act (padding rows untouched), then the aliases of 10-15 [, 16]
// gdn_conventional: grid (HV * V / kRows, batch)
//   inputs 1-8 as above, state; scalars batch, nslots; outputs y, state (aliased)
#include "gdn.cuh"

#include "gdn_params.cuh"

extern "C" __global__ void __launch_bounds__(gdn::kThreads, kMinBlocks) gdn_replay_decode(GDN_REPLAY_PARAMS) {
  const gdn::ReplayArgs args = GDN_REPLAY_ARGS;
  gdn::replay_decode(args);
}

// Conventional GDN step (the baseline): reads and writes the whole state.
extern "C" __global__ void __launch_bounds__(gdn::kThreads, kMinBlocks) gdn_conventional(
    const act_t* __restrict__ q, const act_t* __restrict__ k, const act_t* __restrict__ v,
    const act_t* __restrict__ a, const act_t* __restrict__ b, const float* __restrict__ A_log,
    const float* __restrict__ dt_bias, const int* __restrict__ sbi, const float* state_in, int batch,
    int nslots, act_t* __restrict__ y, float* state_out) {
  gdn::ConvArgs args{q, k, v, a, b, A_log, dt_bias, sbi, state_in, batch, nslots, y, state_out};
  gdn::conventional_step(args);
}
