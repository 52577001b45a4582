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

// The ReplaySSM standard decode step in two launches (kda_vk.cuh "the same step in two kernels"), in this order on
// one stream:
// kda_vk_prologue: grid (H, batch), block (kK); kda_replay_rows_vk: grid (H * V / kRows, batch), block (kWarps * 32).
// scratch: (batch, H, kScr) f32, written by the first, read by the second.
extern "C" __global__ void __launch_bounds__(kK) kda_vk_prologue(
    const act_t* __restrict__ q, const act_t* __restrict__ k, const act_t* __restrict__ f,
    const act_t* __restrict__ b, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
    const int* __restrict__ sbi, const int* __restrict__ cursor, const act_t* kc_in, const float* gc_in, int batch,
    int nslots, float* __restrict__ scr, act_t* kc_out, float* gc_out, float* bc_out) {
  const kda_vk::ProArgs args{q, k, f, b, A_log, dt_bias, sbi, cursor, kc_in, gc_in, batch, nslots, scr, kc_out,
                             gc_out, bc_out};
  kda_vk::prologue(args);
}

extern "C" __global__ void __launch_bounds__(gdn::kThreads, kMinBlocks) kda_replay_rows_vk(
    const act_t* __restrict__ v, const int* __restrict__ sbi, const int* __restrict__ cursor, const float* state_in,
    const float* uc_in, const float* __restrict__ scr, int batch, int nslots, act_t* __restrict__ y, float* state_out,
    float* uc_out, act_t* vc_out) {
  const kda_vk::RowsArgs args{v, sbi, cursor, state_in, uc_in, scr, batch, nslots, y, state_out, uc_out, vc_out};
  kda_vk::replay_rows(args);
}
