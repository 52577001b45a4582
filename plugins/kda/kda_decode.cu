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
extern "C" __global__ void __launch_bounds__(kda::kThreads, kMinBlocks) kda_conventional(KDA_CONV_PARAMS) {
  const kda::Args args = KDA_CONV_ARGS;
  kda::conventional(args);
}

#if KDA_BULK
// The conventional step as a persistent stream (KDASpec.bulk; kda.cuh conventional_bulk): kda_conventional's
// parameters; grid (min(batch * H * V / kCols, resident blocks), 1), block (kWarps * 32).
extern "C" __global__ void __launch_bounds__(kda::kThreads, kMinBlocks) kda_conventional_bulk(KDA_CONV_PARAMS) {
  const kda::Args args = KDA_CONV_ARGS;
  kda::conventional_bulk(args);
}

// The standard decode's non-flush steps as a persistent stream (KDASpec.bulk; kda.cuh replay_bulk, an experiment: a
// flush row gets NaN y and nothing else): kda_replay_decode's parameters, kda_conventional_bulk's grid.
extern "C" __global__ void __launch_bounds__(kda::kThreads, kMinBlocks) kda_replay_bulk(KDA_REPLAY_PARAMS) {
  const kda::Args args = KDA_REPLAY_ARGS;
  kda::replay_bulk(args);
}
#endif
