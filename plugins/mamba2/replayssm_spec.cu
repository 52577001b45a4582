// SPDX-License-Identifier: Apache-2.0
// Speculative-decoding entry points (kT window tokens), ordered as TensorRT's AOT plugins pass them:
// inputs, int32 scalars, outputs. Aliased outputs receive the same pointers as their inputs.
//   replayssm_verify        grid (nheads * headdim / kRows, batch), block kThreads; every layer
//   replayssm_spec_commit   grid (ceil(batch / 256)), block 256; once per model step, all layers
//   replayssm_native_verify grid (nheads * headdim / kRows, batch), block kThreads (baseline)
//   replayssm_native_commit grid (nheads * headdim / kRows, batch), block kThreads (baseline)
#include "replayssm_spec.cuh"

#include "replayssm_params.cuh"

// Verify kT tokens: y (batch, kT, H, P) from checkpoint + committed history + the causal window,
// window appended to the rings; when count + 2 kT > L the history is folded into the checkpoint first
// (and the shadow rewritten; non-flush steps read the shadow instead of the checkpoint).
extern "C" __global__ void __launch_bounds__(rssm::kThreads, rssm::kMinBlocks) replayssm_verify(
    const act_t* __restrict__ x, const act_t* __restrict__ B, const act_t* __restrict__ C,
    const act_t* __restrict__ dt, const float* __restrict__ dt_bias, const float* __restrict__ A,
    const float* __restrict__ D, RSSM_Z_PARAM const int* __restrict__ sbi,
    const int* __restrict__ cursor, const state_t* state_in, const act_t* xc_in,
    const act_t* Bc_in, const float* dtc_in RSSM_SHADOW_IN, int batch, int nslots, act_t* __restrict__ y,
    state_t* state_out, act_t* xc_out, act_t* Bc_out, float* dtc_out RSSM_SHADOW_OUT) {
  rssm::SpecArgs a{x,       B,      C,        dt,    dt_bias, A,      D,      RSSM_Z_ARG,
                   sbi,     cursor, state_in, xc_in, Bc_in,   dtc_in, batch,  nslots,
                   y,       state_out, xc_out, Bc_out, dtc_out, RSSM_SHADOW_ARGS};
  rssm::spec_verify(a);
}

// cursor (slots, 2) = (start, count): flush as the verify kernels did, then count += n_accepted.
// cursor_in is the input the in-place cursor output aliases (TensorRT passes both pointers; they are
// the same memory): read and written through `cursor` only.
extern "C" __global__ void replayssm_spec_commit(const int* __restrict__ sbi, const int* __restrict__ n_accepted,
                                                 const int* cursor_in, int batch, int nslots, int* cursor) {
  rssm::spec_commit(sbi, n_accepted, batch, nslots, cursor);
}

// Native spec (baseline): the conventional recurrence over the window, snapshots[slot, t] = state
// after token t, y for every position; state_in is not written.
extern "C" __global__ void __launch_bounds__(rssm::kThreads, rssm::kMinBlocks) replayssm_native_verify(
    const act_t* __restrict__ x, const act_t* __restrict__ B, const act_t* __restrict__ C,
    const act_t* __restrict__ dt, const float* __restrict__ dt_bias, const float* __restrict__ A,
    const float* __restrict__ D, RSSM_Z_PARAM const int* __restrict__ sbi,
    const state_t* __restrict__ state_in, int batch, int nslots, act_t* __restrict__ y,
    state_t* __restrict__ snapshots) {
  rssm::NativeArgs a{x, B, C, dt, dt_bias, A, D, RSSM_Z_ARG, sbi, state_in, batch, nslots, y, snapshots};
  rssm::native_verify(a);
}

// Native commit (baseline): state[slot] = snapshots[slot, n - 1] for n >= 1.
extern "C" __global__ void __launch_bounds__(rssm::kThreads) replayssm_native_commit(
    const int* __restrict__ sbi, const int* __restrict__ n_accepted, int batch, int nslots,
    const state_t* __restrict__ snapshots, state_t* __restrict__ state) {
  rssm::native_commit(sbi, n_accepted, nslots, snapshots, state);
}
