// SPDX-License-Identifier: Apache-2.0
// Entry points, ordered as TensorRT's AOT plugins pass them: inputs, int32 scalars, outputs.
// Aliased outputs (the checkpoint and the buffers) receive the same pointers as their inputs.
#include "replayssm.cuh"

// issue_rows stages the fp8 row scales of a block as 16-byte vectors.
static_assert(rssm::kShadow != 2 || kRows % 4 == 0, "fp8 row scales move as 16-byte vectors");

#include "replayssm_params.cuh"

#if RSSM_CKPT8
// ReplaySSM decode step on an 8-bit checkpoint (replayssm.cuh "8-bit checkpoint"; staged kernel only):
// state_in / state_out are the e4m3 checkpoint (slots, H, P, N), scale_in / scale_out its fp32 row scales
// (slots, H, P), both written on flush; flushes (slots,) the flushes each slot has completed, read on flush
// (replayssm_advance_cursor moves it); seed the layer's seed. grid (nheads * headdim / kRows, batch).
static_assert(RSSM_STAGED && !RSSM_PERSISTENT, "an 8-bit checkpoint runs the staged kernel (kind=staged)");
extern "C" __global__ void __launch_bounds__(rssm::kThreads, rssm::kMinBlocks) replayssm_decode(
    const act_t* __restrict__ x, const act_t* __restrict__ B, const act_t* __restrict__ C,
    const act_t* __restrict__ dt, const float* __restrict__ dt_bias, const float* __restrict__ A,
    const float* __restrict__ D, RSSM_Z_PARAM const int* __restrict__ sbi,
    const int* __restrict__ cursor, const state_t* state_in, const act_t* xc_in,
    const act_t* Bc_in, const float* dtc_in, const float* scale_in, const int* __restrict__ flushes, int batch,
    int nslots, int seed, act_t* __restrict__ y, state_t* state_out, act_t* xc_out, act_t* Bc_out, float* dtc_out,
    float* scale_out) {
  rssm::ReplayArgs a{x,       B,       C,      dt,     dt_bias, A,         D,       RSSM_Z_ARG,
                     sbi,     cursor,  nullptr, xc_in, Bc_in,   dtc_in,    batch,   nslots,
                     y,       nullptr, xc_out, Bc_out, dtc_out, state_in,  scale_in, state_out,
                     scale_out, flushes, static_cast<unsigned>(seed)};
  rssm::replay_decode_staged(a);
}

// An 8-bit checkpoint has no conventional step (ops refuses it); the entry exists because every standard
// decode module carries the same three kernels.
extern "C" __global__ void replayssm_conventional() {}
#else
// ReplaySSM decode step: output from checkpoint + buffer, append, flush when the buffer fills.
// grid (nheads * headdim / kRows, batch), block (kWarps * 32).
extern "C" __global__ void __launch_bounds__(rssm::kThreads, rssm::kMinBlocks) replayssm_decode(
    const act_t* __restrict__ x, const act_t* __restrict__ B, const act_t* __restrict__ C,
    const act_t* __restrict__ dt, const float* __restrict__ dt_bias, const float* __restrict__ A,
    const float* __restrict__ D, RSSM_Z_PARAM const int* __restrict__ sbi,
    const int* __restrict__ cursor, const state_t* state_in, const act_t* xc_in,
    const act_t* Bc_in, const float* dtc_in RSSM_SHADOW_IN, int batch, int nslots, act_t* __restrict__ y,
    state_t* state_out, act_t* xc_out, act_t* Bc_out, float* dtc_out RSSM_SHADOW_OUT) {
  rssm::ReplayArgs a{x,       B,     C,      dt,    dt_bias, A,         D,      RSSM_Z_ARG,
                     sbi,     cursor, state_in, xc_in, Bc_in, dtc_in,    batch,  nslots,
                     y,       state_out, xc_out, Bc_out, dtc_out, RSSM_SHADOW_ARGS};
#if RSSM_PERSISTENT
  static_assert(!RSSM_ROW_ORDER, "the persistent kernel walks items, not rows: no row order (KernelSpec.row_order)");
  rssm::replay_decode_persistent(a);
#elif RSSM_STAGED
  rssm::replay_decode_staged(a);
#else
  rssm::replay_decode(a);
#endif
}

// Conventional Mamba-2 step (the baseline): S <- exp(A dt) S + dt x B^T, y = S C + D x.
extern "C" __global__ void __launch_bounds__(rssm::kThreads, rssm::kConvMinBlocks) replayssm_conventional(
    const act_t* __restrict__ x, const act_t* __restrict__ B, const act_t* __restrict__ C,
    const act_t* __restrict__ dt, const float* __restrict__ dt_bias, const float* __restrict__ A,
    const float* __restrict__ D, RSSM_Z_PARAM const int* __restrict__ sbi,
    const state_t* state_in, int batch, int nslots, act_t* __restrict__ y, state_t* state_out) {
  rssm::ConvArgs a{x, B, C, dt, dt_bias, A, D, RSSM_Z_ARG, sbi, state_in, batch, nslots, y,
                   state_out};
  rssm::conventional_step(a);
}
#endif

// Advance every valid row's cursor by one entry, wrapping at the buffer length (a flush empties
// the buffer). One launch per decode step for all layers, which share the cursor. Unchecked values
// (cursor_ops.py check_values=False, graph capture) write nothing but the row's own cursor: an out-of-range
// slot is skipped, and a cursor outside [0, L) is left as it is, so the decode kernels keep writing
// NaN for that row instead of a silent wrap making it look valid. In an 8-bit checkpoint module it also
// counts the flush of every slot whose cursor wraps (flushes, (slots,) int32, aliased in and out).
extern "C" __global__ void replayssm_advance_cursor(const int* __restrict__ sbi, int batch,
                                                    int nslots, int* cursor
#if RSSM_CKPT8
                                                    , int* flushes
#endif
) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const int slot = sbi[b];
  if (slot < 0 || slot >= nslots) return;
  const int pos = cursor[slot];
  if (pos < 0 || pos >= kL) return;
  cursor[slot] = pos + 1 == kL ? 0 : pos + 1;
#if RSSM_CKPT8
  if (pos + 1 == kL) flushes[slot] += 1;
#endif
}

// The standard cursor's flush-first row order (cursor.flush_order is the spec, bit for bit): order[i] = (row, slot,
// cursor, 0) of the i-th row of a stable three-way partition: the rows that flush in this step (slot in [0,
// nslots), cursor kL - 1), then the other rows with a slot, then the rest (padding, out-of-range slots; cursor 0),
// each class in row order. A decode module built with a row order (KDA_ROW_ORDER, GDN_ROW_ORDER, RSSM_ROW_ORDER)
// reads its block's row, slot and cursor here in one 16-byte load instead of sbi[blockIdx.y] then cursor[slot], so
// its long (flushing) blocks run in the first waves. One block of kOrderThreads threads walks the rows in tiles: a
// count pass, then a placing pass (ranks by warp ballot within a tile, warp offsets in shared memory). Launch: grid
// (1), block (kOrderThreads); once per model step, after the previous step's cursor move. Parameters in TensorRT's
// order (inputs, int32 batch and slots, output: replayssm::flush_order).
constexpr int kOrderThreads = 1024;
struct OrderRow {
  int slot, pos, cls;  // cls 0: flushes, 1: another row with a slot, 2: the rest, 3: past the batch
};
__device__ __forceinline__ OrderRow order_row(const int* sbi, const int* cursor, int r, int batch, int nslots) {
  if (r >= batch) return {0, 0, 3};
  const int slot = sbi[r];
  if (slot < 0 || slot >= nslots) return {slot, 0, 2};
  const int pos = cursor[slot];
  return {slot, pos, pos == kL - 1 ? 0 : 1};
}
extern "C" __global__ void __launch_bounds__(kOrderThreads) replayssm_flush_order(const int* __restrict__ sbi,
                                                                                 const int* __restrict__ cursor,
                                                                                 int batch, int nslots,
                                                                                 int4* __restrict__ order) {
  __shared__ int warp_count[3][kOrderThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int base[3] = {0, 0, 0};
  for (int t = 0; t < batch; t += kOrderThreads) {  // count pass: the flushing rows, the other rows with a slot
    const int c = order_row(sbi, cursor, t + threadIdx.x, batch, nslots).cls;
    base[1] += __syncthreads_count(c == 0);
    base[2] += __syncthreads_count(c == 1);
  }
  base[2] += base[1];
  for (int t = 0; t < batch; t += kOrderThreads) {  // placing pass, tile by tile (rows in order within a class)
    const int r = t + threadIdx.x;
    const OrderRow o = order_row(sbi, cursor, r, batch, nslots);
    unsigned mine = 0;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const unsigned m = __ballot_sync(0xffffffffu, o.cls == k);
      if (lane == 0) warp_count[k][warp] = __popc(m);
      if (o.cls == k) mine = m;
    }
    __syncthreads();
    if (o.cls < 3) {
      int at = base[o.cls] + __popc(mine & ((1u << lane) - 1u));
      for (int w = 0; w < warp; ++w) at += warp_count[o.cls][w];
      order[at] = make_int4(r, o.slot, o.pos, 0);
    }
#pragma unroll
    for (int k = 0; k < 3; ++k)
      for (int w = 0; w < kOrderThreads / 32; ++w) base[k] += warp_count[k][w];
    __syncthreads();
  }
}
