// SPDX-License-Identifier: Apache-2.0
// Gated DeltaNet speculative entry points (device math in gdn_spec.cuh), ordered as TensorRT's AOT plugins
// pass them: inputs, int32 scalars, outputs. Aliased outputs receive the same pointers as their inputs.
// The commit is the Mamba-2 replayssm_spec_commit kernel (plugins/mamba2/replayssm_spec.cu), shared by all layers.
//
// gdn_verify: grid (HV * V / kRows, batch), block (kWarps * 32)
//   inputs   1 q (batch, T, H, K) act        2 k (batch, T, H, K) act     3 v (batch, T, HV, V) act
//            4 a (batch, T, HV) act (raw)     5 b (batch, T, HV) act (raw) 6 A_log (HV,) f32
//            7 dt_bias (HV,) f32              8 state_batch_indices (batch,) i32, -1 = padding
//            9 cursor (slots, 2) i32 (start, count), read only
//            10 state (slots, HV, V, K) f32   11 u_cache (slots, HV, L, V) f32
//            12 v_cache (slots, HV, L, V) act 13 k_cache (slots, H, L, K) f32
//            14 g_cache (slots, HV, L) f32    15 beta_cache (slots, HV, L) f32
//            [16 shadow (slots, HV, V, K) bf16, GDN_SHADOW 1]
//   scalars  batch, nslots (int32)
//   outputs  y (batch, T, HV, V) act (padding rows untouched), then the aliases of 10-15 [, 16]
//            (state and shadow written where count + 2T > L; the window appended to the rings)
// gdn_native_verify: grid (HV * V / kRows, batch) (the conventional geometry)
//   inputs 1-8 as above, state (read only); scalars batch, nslots;
//   outputs y, snapshots (slots, T, HV, V, K) f32 (state after window token t)
#include "gdn_spec.cuh"

#include "gdn_params.cuh"

extern "C" __global__ void __launch_bounds__(gdn::kThreads, kMinBlocks) gdn_verify(GDN_REPLAY_PARAMS) {
  const gdn::ReplayArgs args = GDN_REPLAY_ARGS;
  gdn::spec_verify(args);
}

// Native spec (baseline): snapshots[slot, t] = state after window token t; state_in is not written.
extern "C" __global__ void __launch_bounds__(gdn::kThreads, kMinBlocks) gdn_native_verify(
    const act_t* __restrict__ q, const act_t* __restrict__ k, const act_t* __restrict__ v,
    const act_t* __restrict__ a, const act_t* __restrict__ b, const float* __restrict__ A_log,
    const float* __restrict__ dt_bias, const int* __restrict__ sbi, const float* __restrict__ state_in, int batch,
    int nslots, act_t* __restrict__ y, float* __restrict__ snapshots) {
  gdn::NativeArgs args{q, k, v, a, b, A_log, dt_bias, sbi, state_in, batch, nslots, y, snapshots};
  gdn::native_verify(args);
}
