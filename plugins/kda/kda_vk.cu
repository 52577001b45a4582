// SPDX-License-Identifier: Apache-2.0
// The conventional KDA step on a (V, K) state (device math in kda_vk.cuh), in kda_conventional's parameter order
// (TensorRT's AOT plugins: inputs, int32 scalars, outputs; the state output aliases its input).
//
// kda_conventional_vk: grid (H * V / kRows, batch), block (kWarps * 32)
//   inputs   1 q (batch, H, K) act   2 k (batch, H, K) act (raw)   3 v (batch, H, V) act   4 f (batch, H, K) act
//            5 b (batch, H) act      6 A_log (H,) f32              7 dt_bias (H, K) f32
//            8 state_batch_indices (batch,) i32, -1 = padding      9 state (slots, H, V, K) f32
//   scalars  batch, nslots (int32)
//   outputs  y (batch, H, V) act (padding rows untouched), state (aliased)
#include "kda_vk.cuh"

extern "C" __global__ void __launch_bounds__(gdn::kThreads, kMinBlocks) kda_conventional_vk(
    const act_t* __restrict__ q, const act_t* __restrict__ k, const act_t* __restrict__ v,
    const act_t* __restrict__ f, const act_t* __restrict__ b, const float* __restrict__ A_log,
    const float* __restrict__ dt_bias, const int* __restrict__ sbi, const float* state_in, int batch, int nslots,
    act_t* __restrict__ y, float* state_out) {
  const kda_vk::Args args{q, k, v, f, b, A_log, dt_bias, sbi, state_in, batch, nslots, y, state_out};
  kda_vk::conventional(args);
}
