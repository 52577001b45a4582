// SPDX-License-Identifier: Apache-2.0
// ReplaySSM Mamba-2 decode: device math shared by every entry point.
//
// The generated prelude (trtllm_replayssm/compile.py) defines, before this header:
//   state_t, act_t                 storage types of the checkpoint and of the activations
//   kH, kP, kN, kG, kL             nheads, headdim, dstate, ngroups, replay buffer length
//   kRows, kWarps                  rows of one head handled by one block, warps per block
//   kHasZ                          whether the output is gated by silu(z)
//   shadow_t, RSSM_SHADOW          low-precision shadow of the checkpoint: 0 none (shadow_t =
//                                  state_t, unused), 1 bf16, 2 fp8-e4m3 with one fp32 scale per row
//   RSSM_CKPT8                     (8-bit checkpoint modules only) the checkpoint itself is e4m3 with one
//                                  fp32 scale per row and no fp32 copy (state_t = shadow_t = e4m3): see
//                                  "8-bit checkpoint" below
// and, from the spec's config.Variant, only those that are not at their defaults:
//   RSSM_PERSISTENT or RSSM_STAGED the decode kernel (kind; neither: one-shot)
//   RSSM_MIN_BLOCKS                resident blocks per SM of __launch_bounds__ (min_blocks)
//   RSSM_FLUSH_ROWS                rows of a thread the flush folds at a time (flush_rows)
//   RSSM_BULK                      the staged kernel's item by bulk copies on an mbarrier (copy="bulk")
// and from KernelSpec.row_order:
//   RSSM_ROW_ORDER                 0: block row blockIdx.y, its slot sbi[row], its cursor cursor[slot]; 1 (the
//                                  one-shot and staged decode kernels): sbi points to (row, slot, cursor, 0) int4
//                                  rows in flush-first order (cursor.flush_order), one load a block
//
// Math (docs/DESIGN.md §1). Per (slot, head): checkpoint S0 (P x N), buffer entries j = 1..k (k = now),
// c_j = A * sum_{i<=j} dt_i, w_j = dt_j * exp(c_k - c_j):
//   y_k = exp(c_k) (S0 C_k) + sum_j w_j (B_j . C_k) x_j + D x_k          (output form, no state write)
//   S_k = exp(c_k) S0 + sum_j w_j x_j B_j^T                              (state form, used by flush)
// In fp32 the exponent c_k - c_j is formed as A * sum_{j<i<=k} dt_i, a suffix sum (suffix_after), never as
// the difference of two prefix sums (which loses ~ulp(sum dt) after a dt spike).
//
// Work split: one block per (batch row, head, chunk of kRows rows). Each thread owns kRT rows x
// kVPL 16-byte vectors of the state, so a warp load covers whole contiguous rows. The state loads
// are issued first; the buffer part (dt scan, B.C dots, x tile) runs while they are in flight.
#pragma once
#ifndef RSSM_PERSISTENT
#define RSSM_PERSISTENT 0
#endif
#ifndef RSSM_CKPT8
#define RSSM_CKPT8 0
#endif
#if RSSM_CKPT8  // the 8-bit checkpoint is read and staged as the fp8 shadow is (RSSM_SHADOW 2 paths)
#undef RSSM_SHADOW
#define RSSM_SHADOW 2
#endif
#ifndef RSSM_SHADOW
#define RSSM_SHADOW 0
#endif
// RSSM_STAGED: one-shot blocks that stage the buffer tiles by cp.async (the persistent kernel's
// stage, one item per block) instead of holding them in registers; RSSM_FLUSH_ROWS: rows of a
// thread folded at a time by the flush (default: all kRT at once).
#ifndef RSSM_STAGED
#define RSSM_STAGED 0
#endif
#ifndef RSSM_BULK
#define RSSM_BULK 0
#endif
#ifndef RSSM_ROW_ORDER
#define RSSM_ROW_ORDER 0
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#if RSSM_SHADOW == 2
#include <cuda_fp8.h>
#endif

#include "common/convert.cuh"
#include "common/cp_async.cuh"
#include "common/scan.cuh"

namespace rssm {
#if RSSM_CKPT8
// Inside the kernels the rows keep the fp32 checkpoint's layout (4-element vectors of e4m3 are the fp8
// shadow's); the e4m3 checkpoint pointers are the shadow's (shadow_t), the fp32 ones unused.
using state_t = float;
#endif

// ---- dtype helpers ---------------------------------------------------------------------------
using rssm_common::from_f;  // common/convert.cuh
using rssm_common::to_f;

// n contiguous elements moved as one aligned vector access (up to 16 bytes, else several).
// Alignment: the largest power of two dividing the vector's bytes, at most 16 (so a vector of
// n elements at an offset that is a multiple of n elements is always aligned).
__host__ __device__ constexpr int vec_align(int bytes) {
  return bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : bytes % 4 == 0 ? 4 : bytes % 2 == 0 ? 2 : 1;
}
template <typename T, int n>
struct alignas(vec_align(sizeof(T) * n)) Vec {
  T v[n];
};
template <typename T, int n>
__device__ __forceinline__ void store_f(T* p, const float (&in)[n]) {
  Vec<T, n> t;
#pragma unroll
  for (int i = 0; i < n; ++i) t.v[i] = from_f<T>(in[i]);
  *reinterpret_cast<Vec<T, n>*>(p) = t;
}

template <typename T, int n>
__device__ __forceinline__ void load_f(const T* p, float (&out)[n]) {
  Vec<T, n> t = *reinterpret_cast<const Vec<T, n>*>(p);
#pragma unroll
  for (int i = 0; i < n; ++i) out[i] = to_f(t.v[i]);
}
#if RSSM_SHADOW == 2
// Four e4m3 values (one fp8 shadow vector) by two packed conversions each way: e4m3x2 <-> f16x2 is
// exact, f16 -> f32 too, and cvt.rn.satfinite.e4m3x2.f32 rounds as __nv_fp8_e4m3(float) does, so the
// values are those of the element-wise path in half the conversion instructions (the fp8 step is
// issue-bound: NOTES "fp8 shadow: packed conversions").
template <>
__device__ __forceinline__ void load_f<__nv_fp8_e4m3, 4>(const __nv_fp8_e4m3* p, float (&out)[4]) {
  const unsigned w = *reinterpret_cast<const unsigned*>(p);  // byte i = element i
  const __half2 lo = __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3));
  const __half2 hi = __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3));
  const float2 a = __half22float2(lo), b = __half22float2(hi);
  out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
}
template <>
__device__ __forceinline__ void store_f<__nv_fp8_e4m3, 4>(__nv_fp8_e4m3* p, const float (&in)[4]) {
  const unsigned lo = __nv_cvt_float2_to_fp8x2(make_float2(in[0], in[1]), __NV_SATFINITE, __NV_E4M3);
  const unsigned hi = __nv_cvt_float2_to_fp8x2(make_float2(in[2], in[3]), __NV_SATFINITE, __NV_E4M3);
  *reinterpret_cast<unsigned*>(p) = lo | (hi << 16);
}
#endif
// Streaming (evict-first) load for data read once: the checkpoint.
template <typename T, int n>
__device__ __forceinline__ void load_stream_f(const T* p, float (&out)[n]) {
  static_assert(sizeof(T) * n == 16, "state vectors are 16 bytes");
  float4 raw = __ldcs(reinterpret_cast<const float4*>(p));
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < n; ++i) out[i] = to_f(e[i]);
}
// The same for vectors of 4 or 8 bytes (a bf16 or fp8 shadow of 4 state elements) or 16.
template <typename T, int n>
__device__ __forceinline__ void load_stream_small_f(const T* p, float (&out)[n]) {
  constexpr int kBytes = sizeof(T) * n;
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "streamed vectors are 4, 8 or 16 bytes");
  if constexpr (kBytes == 16) {
    load_stream_f<T, n>(p, out);
  } else if constexpr (kBytes == 8) {
    const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(p));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < n; ++i) out[i] = to_f(e[i]);
  } else {
    const unsigned raw = __ldcs(reinterpret_cast<const unsigned*>(p));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < n; ++i) out[i] = to_f(e[i]);
  }
}
template <typename T, int n>
__device__ __forceinline__ void store_stream_f(T* p, const float (&in)[n]) {
  static_assert(sizeof(T) * n == 16, "state vectors are 16 bytes");
  float4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < n; ++i) e[i] = from_f<T>(in[i]);
  __stcs(reinterpret_cast<float4*>(p), raw);
}

__device__ __forceinline__ float softplus(float v) {  // torch's threshold: 20
  return v > 20.f ? v : log1pf(expf(v));
}
__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

// ---- geometry ---------------------------------------------------------------------------------
constexpr int kThreads = kWarps * 32;
constexpr int kEPV = 16 / sizeof(state_t);           // state elements per 16-byte vector
constexpr int kVecPerRow = kN / kEPV;
constexpr int kLPR = kVecPerRow < 32 ? kVecPerRow : 32;  // lanes sharing one row
constexpr int kVPL = kVecPerRow / kLPR;              // vectors per lane per row
constexpr int kRPW = 32 / kLPR;                      // rows covered by one warp-wide load
constexpr int kRT = kRows / (kRPW * kWarps);         // rows per thread
constexpr int kChunks = kP / kRows;
constexpr int kHPG = kH / kG;                        // heads per group
static_assert(kN % (kEPV * kLPR) == 0, "dstate must fill whole 16-byte vectors per lane");
static_assert(kRows % (kRPW * kWarps) == 0, "rows per block must split evenly over warps");
static_assert(kP % kRows == 0, "rows per block must divide headdim");
static_assert(kH % kG == 0, "ngroups must divide nheads");
static_assert(kL >= 1 && kL <= 32, "replay buffer length is 1..32 (one warp scans it)");

static_assert(kRT <= kLPR, "the lanes of a row group finalize one row each");

// Each thread owns kRT consecutive rows (row-major inside its row group) so that a thread's rows
// of an smem tile are one vector read; a warp-wide state load still covers whole rows.
struct Coords {
  int b, h, g, chunk, row0;
};
__device__ __forceinline__ Coords block_coords(int b = blockIdx.y) {  // b: the block's batch row
  Coords c;
  c.b = b;
  c.h = blockIdx.x / kChunks;
  c.chunk = blockIdx.x % kChunks;
  c.row0 = c.chunk * kRows;
  c.g = c.h / kHPG;
  return c;
}
#if RSSM_ROW_ORDER
// The block's (row, slot, cursor, 0) of the flush-first order (a.sbi in a row-order module; replayssm_flush_order).
__device__ __forceinline__ int4 ordered_row(const int* sbi) { return reinterpret_cast<const int4*>(sbi)[blockIdx.y]; }
#endif
__device__ __forceinline__ int row_base() {  // first of this thread's kRT rows, within the chunk
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  return (warp * kRPW + lane / kLPR) * kRT;
}
__device__ __forceinline__ int my_col(int v) {
  const int lane = threadIdx.x % 32;
  return (v * kLPR + lane % kLPR) * kEPV;
}
template <int kLanes>
__device__ __forceinline__ float group_sum(float v) {  // xor stays inside aligned lane groups
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
using rssm_common::suffix_after;  // common/scan.cuh

template <int R>
struct RowRegs {
  float s[R][kVPL][kEPV];
};
using StateRegs = RowRegs<kRT>;
// Rows [r0, r0 + R) of this thread's kRT rows.
template <int R>
__device__ __forceinline__ void load_state(RowRegs<R>& st, const state_t* base, int r0 = 0) {
  const int rb = row_base() + r0;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int v = 0; v < kVPL; ++v)
      load_stream_f<state_t, kEPV>(base + (size_t)(rb + r) * kN + my_col(v), st.s[r][v]);
}
template <int R>
__device__ __forceinline__ void store_state(const RowRegs<R>& st, state_t* base, int r0 = 0) {
  const int rb = row_base() + r0;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int v = 0; v < kVPL; ++v)
      store_stream_f<state_t, kEPV>(base + (size_t)(rb + r) * kN + my_col(v), st.s[r][v]);
}
struct ColRegs {
  float c[kVPL][kEPV];
};
__device__ __forceinline__ void load_cols(ColRegs& cr, const act_t* vec) {
#pragma unroll
  for (int v = 0; v < kVPL; ++v) load_f<act_t, kEPV>(vec + my_col(v), cr.c[v]);
}
// Sums kRT per-row partials over the kLPR lanes of a row group; lane l gets the total of row
// l % kRT. With kRT a power of two, a transposing butterfly: at offset o < kRT each lane keeps the
// rows whose bit o matches its own and sends the others, halving its rows, so kRT - 1 + log2(kLPR /
// kRT) shuffles replace kRT * log2(kLPR) (bs256 main geometry: 9 instead of 40 per thread and item).
// acc[i] holds row i*o + (lane mod o): pair rows 2m and 2m+1 of that list (one step of level o).
__device__ __forceinline__ void butterfly_pair(float (&acc)[kRT], bool up, int o, int m) {
  const float keep = up ? acc[2 * m + 1] : acc[2 * m];
  const float send = up ? acc[2 * m] : acc[2 * m + 1];
  acc[m] = keep + __shfl_xor_sync(0xffffffffu, send, o);
}
// The levels as template instances, so that each level's trip count is a constant: as one loop over o,
// NVRTC leaves the inner loop rolled at kRT = 16 (64-row items of 4 warps) and acc[] goes to local
// memory (NOTES "Next for the shadow steps").
template <int o>
__device__ __forceinline__ void rows_butterfly(float (&acc)[kRT], int lane) {
  if constexpr (o < kRT) {
#pragma unroll
    for (int m = 0; m < kRT / (2 * o); ++m) butterfly_pair(acc, lane & o, o, m);
    rows_butterfly<2 * o>(acc, lane);
  }
}
__device__ __forceinline__ float rows_reduce(float (&acc)[kRT]) {
  const int lane = threadIdx.x % 32;
  if constexpr ((kRT & (kRT - 1)) == 0) {
    if constexpr (kRT > 8) {
      rows_butterfly<1>(acc, lane);
    } else {  // kRT <= 8: the loop form, whose PTX the shipped plans were measured with
#pragma unroll
      for (int o = 1; o < kRT; o <<= 1) {
        const bool up = lane & o;
#pragma unroll
        for (int m = 0; m < kRT / (2 * o); ++m) butterfly_pair(acc, up, o, m);
      }
    }
    float v = acc[0];  // row lane % kRT, summed over the lanes that share those low bits
#pragma unroll
    for (int o = kRT; o < kLPR; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  } else {
    const int l = lane % kLPR;
    float mine = 0.f;
#pragma unroll
    for (int r = 0; r < kRT; ++r) {
      const float t = group_sum<kLPR>(acc[r]);
      if (r == l % kRT) mine = t;
    }
    return mine;
  }
}

// Dots of the thread's rows with C, summed over the row group; lane l of the group returns the
// dot of row (row_base + l) for l < kRT.
__device__ __forceinline__ float state_dot_mine(const StateRegs& st, const ColRegs& cc) {
  float acc[kRT];
#pragma unroll
  for (int r = 0; r < kRT; ++r) {
    acc[r] = 0.f;
#pragma unroll
    for (int v = 0; v < kVPL; ++v)
#pragma unroll
      for (int e = 0; e < kEPV; ++e) acc[r] = fmaf(st.s[r][v][e], cc.c[v][e], acc[r]);
  }
  return rows_reduce(acc);
}

// Row dots of checkpoint rows held in shared memory (same layout as global) with C. T is the
// checkpoint's type or the shadow's (same element layout, fewer bytes); fp8 rows carry a scale.
template <typename T>
__device__ __forceinline__ float state_dot_smem(const T* Ss, const ColRegs& cc, const float* scale = nullptr) {
  const int rb = row_base(), l = threadIdx.x % kLPR;
  float acc[kRT];
#pragma unroll
  for (int r = 0; r < kRT; ++r) {
    acc[r] = 0.f;
#pragma unroll
    for (int v = 0; v < kVPL; ++v) {
      float sv[kEPV];
      load_f<T, kEPV>(Ss + (rb + r) * kN + my_col(v), sv);
#pragma unroll
      for (int e = 0; e < kEPV; ++e) acc[r] = fmaf(sv[e], cc.c[v][e], acc[r]);
    }
  }
  const float mine = rows_reduce(acc);
  return scale ? mine * scale[rb + l % kRT] : mine;
}

template <int kLanes>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The shadow of freshly flushed checkpoint rows, from the fp32 values just stored (docs/DESIGN.md §1):
// bf16: one rounding; fp8-e4m3: q = S * (1 / scale), scale = max|S[row]| / 448 (1 for a zero row): one
// IEEE reciprocal per row and a product per value (a division per value cost the flush its spills).
constexpr int kShadow = RSSM_SHADOW;
// The fp8 scale of one row held by the kLPR lanes of a row group (every lane gets it) and its reciprocal.
__device__ __forceinline__ float fp8_row_scale(const float (&row)[kVPL][kEPV], float& inv) {
  float m = 0.f;
#pragma unroll
  for (int v = 0; v < kVPL; ++v)
#pragma unroll
    for (int e = 0; e < kEPV; ++e) m = fmaxf(m, fabsf(row[v][e]));
  m = group_max<kLPR>(m);
  const float scale = m > 0.f ? m / 448.f : 1.f;
  inv = __frcp_rn(scale);
  return scale;
}
template <int R>
__device__ __forceinline__ void store_shadow(const RowRegs<R>& st, shadow_t* base, float* scales, int r0 = 0) {
  const int rb = row_base() + r0, l = threadIdx.x % kLPR;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float scale = 1.f, inv = 1.f;
    if constexpr (kShadow == 2) {  // fp8_row_scale, written out: the shipped modules' PTX was measured so
      float m = 0.f;
#pragma unroll
      for (int v = 0; v < kVPL; ++v)
#pragma unroll
        for (int e = 0; e < kEPV; ++e) m = fmaxf(m, fabsf(st.s[r][v][e]));
      m = group_max<kLPR>(m);
      scale = m > 0.f ? m / 448.f : 1.f;
      inv = __frcp_rn(scale);
      if (l == r0 + r) scales[rb + r] = scale;
    }
#pragma unroll
    for (int v = 0; v < kVPL; ++v) {
      float q[kEPV];
#pragma unroll
      for (int e = 0; e < kEPV; ++e) q[e] = kShadow == 2 ? st.s[r][v][e] * inv : st.s[r][v][e];
      store_f<shadow_t, kEPV>(base + (size_t)(rb + r) * kN + my_col(v), q);
    }
  }
}

// The shadow of this thread's checkpoint rows into registers, in the layout load_state gives:
// bf16 widened; fp8 times its row scale (one fp32 product, the value Shadow.read gives).
__device__ __forceinline__ void load_shadow(StateRegs& st, const shadow_t* base, const float* scales) {
  const int rb = row_base();  // kShadow != 0 only, so state_t is float and kEPV = 4
#pragma unroll
  for (int r = 0; r < kRT; ++r) {
#pragma unroll
    for (int v = 0; v < kVPL; ++v)
      load_stream_small_f<shadow_t, kEPV>(base + (size_t)(rb + r) * kN + my_col(v), st.s[r][v]);
    if constexpr (kShadow == 2) {
      const float scale = scales[rb + r];
#pragma unroll
      for (int v = 0; v < kVPL; ++v)
#pragma unroll
        for (int e = 0; e < kEPV; ++e) st.s[r][v][e] *= scale;
    }
  }
}

// State form of the flush for this thread's elements, from tiles in shared memory:
// st = exp(c_k) S0 + sum_j (w_j x_j) B_j^T. Bt is [kL][kN]; xt is [kL][kRows] (float or act_t).
// Ss: the checkpoint rows in shared memory, or in global memory (generic pointer) with a shadow.
// fold_ring: the sum over the ring onto st (the thread's rows [rb, rb + R) of the block), entry by entry.
template <typename XT, int R>
__device__ __forceinline__ void fold_ring(RowRegs<R>& st, const float* w, const act_t (*Bt)[kN], const XT (*xt)[kRows],
                                          int rb);
template <typename XT, int R>
__device__ __forceinline__ void flush_rows(RowRegs<R>& st, const state_t* Ss, float decay, const float* w,
                                           const act_t (*Bt)[kN], const XT (*xt)[kRows], int r0 = 0) {
  const int rb = row_base() + r0;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int v = 0; v < kVPL; ++v) {
      load_f<state_t, kEPV>(Ss + (rb + r) * kN + my_col(v), st.s[r][v]);
#pragma unroll
      for (int e = 0; e < kEPV; ++e) st.s[r][v][e] *= decay;
    }
  fold_ring(st, w, Bt, xt, rb);
}
template <typename XT, int R>
__device__ __forceinline__ void fold_ring(RowRegs<R>& st, const float* w, const act_t (*Bt)[kN], const XT (*xt)[kRows],
                                          int rb) {
#pragma unroll 4
  for (int j = 0; j < kL; ++j) {
    const float wj = w[j];
    float bj[kVPL][kEPV];
#pragma unroll
    for (int v = 0; v < kVPL; ++v) load_f<act_t, kEPV>(&Bt[j][my_col(v)], bj[v]);
    float xw[R];
    load_f<XT, R>(&xt[j][rb], xw);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float sc = wj * xw[r];
#pragma unroll
      for (int v = 0; v < kVPL; ++v)
#pragma unroll
        for (int e = 0; e < kEPV; ++e) st.s[r][v][e] = fmaf(sc, bj[v][e], st.s[r][v][e]);
    }
  }
}

// The whole flush of this thread's rows: fold, store the checkpoint (and its shadow), and return
// this lane's row dot with C (as state_dot_mine). Rows go kFR at a time, so only kFR rows of state
// are live in registers (RSSM_FLUSH_ROWS; kFR = kRT is the one-pass flush).
__host__ __device__ constexpr int largest_divisor_upto(int n, int cap) {
  return cap <= 1 ? 1 : (n % cap == 0 ? cap : largest_divisor_upto(n, cap - 1));
}
#ifdef RSSM_FLUSH_ROWS
constexpr int kFR = largest_divisor_upto(kRT, RSSM_FLUSH_ROWS);
#else
constexpr int kFR = kRT;
#endif
template <typename XT>
__device__ __forceinline__ float flush_store_dot(const state_t* Ss, float decay, const float* w,
                                                 const act_t (*Bt)[kN], const XT (*xt)[kRows], state_t* out,
                                                 shadow_t* sh, float* sc, const ColRegs& cc) {
  float acc[kRT];
#pragma unroll
  for (int r0 = 0; r0 < kRT; r0 += kFR) {
    RowRegs<kFR> st;
    flush_rows(st, Ss, decay, w, Bt, xt, r0);
    store_state(st, out, r0);
    if constexpr (kShadow != 0) store_shadow(st, sh, sc, r0);
#pragma unroll
    for (int r = 0; r < kFR; ++r) {
      acc[r0 + r] = 0.f;
#pragma unroll
      for (int v = 0; v < kVPL; ++v)
#pragma unroll
        for (int e = 0; e < kEPV; ++e) acc[r0 + r] = fmaf(st.s[r][v][e], cc.c[v][e], acc[r0 + r]);
    }
  }
  return rows_reduce(acc);
}

// ---- buffer tiles: loaded as 16-byte vectors (fewer bytes where rows are short), all at once --
constexpr int kBV = 16 / sizeof(act_t);                // B elements per vector
constexpr int kBVecRow = kN / kBV;                     // vectors per B row
constexpr int kBLanes = kBVecRow < 32 ? kBVecRow : 32; // lanes sharing one B row (dot reduce)
constexpr int kBVPL = kBVecRow / kBLanes;              // vectors per lane per B row
constexpr int kBRowsPerPass = kThreads / kBLanes;
constexpr int kBPasses = (kL + kBRowsPerPass - 1) / kBRowsPerPass;
static_assert(kThreads % kBLanes == 0, "B rows map to whole lane groups");
constexpr int kXV0 = 16 / sizeof(act_t);
constexpr int kXV = (kRows % kXV0 == 0) ? kXV0 : (kRows % (kXV0 / 2) == 0) ? kXV0 / 2 : (kRows % 2 == 0 ? 2 : 1);
constexpr int kXVecRow = kRows / kXV;
constexpr int kXPasses = (kL * kXVecRow + kThreads - 1) / kThreads;

using rssm_common::cp_async16;  // common/cp_async.cuh
using rssm_common::cp_async_commit;
using rssm_common::cp_async_wait_all;

// Resident blocks asked of the register allocator: 64 registers a thread for blocks of >= 256
// threads (state lives in shared memory, so that is enough); small blocks are left free.
#ifdef RSSM_MIN_BLOCKS
// Never below 64 registers a thread (past that the one-pass flush's state registers spill), except
// for the staged kernel (RSSM_STAGED), which holds no tiles in registers: down to 32.
constexpr int kMaxMinBlocks = (RSSM_STAGED ? 2048 : 1024) / kThreads > 0 ? (RSSM_STAGED ? 2048 : 1024) / kThreads : 1;
constexpr int kMinBlocks = RSSM_MIN_BLOCKS < kMaxMinBlocks ? RSSM_MIN_BLOCKS : kMaxMinBlocks;
#else
constexpr int kMinBlocks = kThreads >= 256 ? 1024 / kThreads : 1;
#endif
// The conventional kernel (one-shot) is left to the compiler (64 registers, no spills, ~91% of the
// copy ceiling).
constexpr int kConvMinBlocks = 1;
constexpr int kStateVecs = kRows * kN * (int)sizeof(state_t) / 16;
constexpr int kShadowVecs = kRows * kN * (int)sizeof(shadow_t) / 16;
constexpr int kScaleVecs = kShadow == 2 ? kRows / 4 : 0;  // fp8 row scales, after the shadow rows
// (the decode entry file asserts kRows % 4 == 0 for them; the verify kernel reads scales one by one)
// Rows staged in shared memory: the checkpoint's, or with a shadow only the shadow's (+ scales);
// flush steps then read the f32 rows straight from global memory into registers. Half (bf16) or
// a quarter (fp8) of the bytes per row lets an item cover twice or four times the rows.
constexpr int kStageVecs = kShadow ? kShadowVecs + kScaleVecs : kStateVecs;

#if RSSM_CKPT8
// ---- 8-bit checkpoint (issue 38; reference.Checkpoint8 is the spec, mirrored bit for bit) ---------------------
// The checkpoint is e4m3 with one fp32 scale per (slot, head, row) and no fp32 copy. Every step stages its rows
// and scales as the fp8 shadow's; the flush folds the ring onto the dequantised rows (q * scale, then * exp(c_k))
// and stores the result quantised again: scale = max |S[row]| / 448, q = SR(S * (1 / scale)) with stochastic
// rounding whose uint32 words come from a counter-based hash of (seed, flush count, slot, head, row, n)
// (reference.ckpt8_random_bits), so any flush of any element is reproducible from its coordinates.
__device__ __forceinline__ unsigned mix32(unsigned x) {  // reference.mix32 (lowbias32)
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
// |v| rounded down or up to e4m3 (reference.stochastic_round_e4m3): the low d bits of |v| below its e4m3 quantum
// 2^max(e - 3, -9) are dropped, and the quantum added when r < (dropped bits) * 2^(32 - d); below 2^-9 the
// candidates are 0 and 2^-9. Saturates at 448; NaN stays NaN. The result is an e4m3 value, converted exactly.
__device__ __forceinline__ float sr_e4m3(float v, unsigned r) {
  const unsigned bits = __float_as_uint(v), mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return v;
  const unsigned a = min(mag, 0x43e00000u);
  const int e = (int)(a >> 23) - 127;
  const int d = e >= -6 ? 20 : 14 - e;
  unsigned out;
  if (d <= 23) {
    const unsigned mask = (1u << d) - 1u;
    out = (a & ~mask) + (r < ((a & mask) << (32 - d)) ? mask + 1u : 0u);
  } else {
    const int sh = d - 24;
    const unsigned thr = sh < 32 ? (((a & 0x7fffffu) | 0x800000u) << 8) >> sh : 0u;
    out = r < thr ? 0x3b000000u : 0u;
  }
  return __uint_as_float(out | (bits & 0x80000000u));
}
// The flush of this thread's rows from the staged 8-bit rows S (e4m3 rows, then the fp32 row scales): fold,
// store e4m3 rows and scales (out, sc: this block's first row), return this lane's row dot with C (as
// flush_store_dot). key: mix32(mix32(mix32(mix32(seed) + flush) + slot) + head); row0: the block's first row.
template <typename XT>
__device__ __forceinline__ float flush_ckpt8(const float4* S, float decay, const float* w, const act_t (*Bt)[kN],
                                             const XT (*xt)[kRows], shadow_t* out, float* sc, unsigned key, int row0,
                                             const ColRegs& cc) {
  const shadow_t* Q = reinterpret_cast<const shadow_t*>(S);
  const float* Qs = reinterpret_cast<const float*>(S + kShadowVecs);
  const int l = threadIdx.x % kLPR;
  float acc[kRT];
#pragma unroll
  for (int r0 = 0; r0 < kRT; r0 += kFR) {
    const int rb = row_base() + r0;
    RowRegs<kFR> st;
#pragma unroll
    for (int r = 0; r < kFR; ++r) {
      const float qs = Qs[rb + r];
#pragma unroll
      for (int v = 0; v < kVPL; ++v) {
        load_f<shadow_t, kEPV>(Q + (rb + r) * kN + my_col(v), st.s[r][v]);
#pragma unroll
        for (int e = 0; e < kEPV; ++e) st.s[r][v][e] = st.s[r][v][e] * qs * decay;  // (q * scale) * exp(c_k)
      }
    }
    fold_ring(st, w, Bt, xt, rb);
#pragma unroll
    for (int r = 0; r < kFR; ++r) {
      float inv;
      const float scale = fp8_row_scale(st.s[r], inv);
      if (l == r0 + r) sc[rb + r] = scale;
      const unsigned rk = mix32(key + (unsigned)(row0 + rb + r));
#pragma unroll
      for (int v = 0; v < kVPL; ++v) {
        float q[kEPV];
#pragma unroll
        for (int e = 0; e < kEPV; ++e) q[e] = sr_e4m3(st.s[r][v][e] * inv, mix32(rk + (unsigned)(my_col(v) + e) * 0x9e3779b9u));
        store_f<shadow_t, kEPV>(out + (size_t)(rb + r) * kN + my_col(v), q);
      }
      acc[r0 + r] = 0.f;
#pragma unroll
      for (int v = 0; v < kVPL; ++v)
#pragma unroll
        for (int e = 0; e < kEPV; ++e) acc[r0 + r] = fmaf(st.s[r][v][e], cc.c[v][e], acc[r0 + r]);
    }
  }
  return rows_reduce(acc);
}
#endif

struct alignas(16) ReplaySmem {
  float4 S[kStageVecs];  // checkpoint rows of this block (or their shadow), same layout as in global memory
  act_t Bt[kL][kN];      // B_1..B_k, needed by the flush only
  float xt[kL][kRows];   // x_1..x_k for this block's rows
  float w[kL];           // w_j
  float bc[kL];          // B_j . C_k
  float decay;           // exp(c_k)
};

struct ReplayArgs {
  const act_t* x;             // (batch, H, P)
  const act_t* B;             // (batch, G, N)
  const act_t* C;             // (batch, G, N)
  const act_t* dt;            // (batch, H) raw dt
  const float* dt_bias;       // (H,)
  const float* A;             // (H,)  A = -exp(A_log)
  const float* D;             // (H,)
  const act_t* z;             // (batch, H, P) or null
  const int* sbi;             // (batch,) slot per row, -1 = padding
  const int* cursor;          // (slots,) entries in the buffer before this step, 0..L-1
  const state_t* state_in;    // (slots, H, P, N)
  const act_t* xc_in;         // (slots, H, L, P)
  const act_t* Bc_in;         // (slots, G, L, N)
  const float* dtc_in;        // (slots, H, L)
  int batch, nslots;
  act_t* y;                   // (batch, H, P)
  state_t* state_out;         // aliases state_in
  act_t* xc_out;              // aliases xc_in
  act_t* Bc_out;              // aliases Bc_in
  float* dtc_out;             // aliases dtc_in
  const shadow_t* sh_in;      // (slots, H, P, N) shadow of the checkpoint, or null
  const float* sc_in;         // (slots, H, P) fp8 row scales, or null
  shadow_t* sh_out;           // aliases sh_in (written on flush)
  float* sc_out;              // aliases sc_in
#if RSSM_CKPT8  // 8-bit checkpoint: sh_* / sc_* are the checkpoint and its scales, state_* unused
  const int* flushes;         // (slots,) flushes each slot has completed (read)
  unsigned seed;              // the layer's seed
#endif
};

// ---- layout of the decode tensors: element offsets -------------------------------------------------
// RSSM_LAYOUT 0 (default): the contiguous shapes above. RSSM_LAYOUT 1 (vLLM's paged Mamba state,
// serve/trtllm_replayssm_vllm/): the checkpoint and the rings are (slots, ...) views whose slot stride is a
// page (kSlot*), the activations, y and the slot indices are row-strided views (kRow*), the cursor is
// one entry per batch row (vLLM's write_pos) instead of per slot, and slot kNullSlot is padding (vLLM's
// null block 0). Only leading strides change; every row of P or N elements stays contiguous. The
// prelude (compile.py) defines the strides, in elements, from config.Layout. No shadow in this layout.
#ifndef RSSM_LAYOUT
#define RSSM_LAYOUT 0
#endif
#if RSSM_LAYOUT
static_assert(RSSM_SHADOW == 0, "the strided (vLLM) layout has no shadow");
__device__ __forceinline__ size_t state_off(int slot, int h, int row) { return (size_t)slot * kSlotState + ((size_t)h * kP + row) * kN; }
__device__ __forceinline__ size_t xc_off(int slot, int h) { return (size_t)slot * kSlotX + (size_t)h * kL * kP; }
__device__ __forceinline__ size_t bc_off(int slot, int g) { return (size_t)slot * kSlotB + (size_t)g * kL * kN; }
__device__ __forceinline__ size_t dtc_off(int slot, int h) { return (size_t)slot * kSlotDt + (size_t)h * kL; }
__device__ __forceinline__ size_t xc_entry(int slot, int h, int pos) { return xc_off(slot, h) + (size_t)pos * kP; }
__device__ __forceinline__ size_t bc_entry(int slot, int g, int pos) { return bc_off(slot, g) + (size_t)pos * kN; }
__device__ __forceinline__ size_t x_off(int b, int h) { return (size_t)b * kRowX + (size_t)h * kP; }
__device__ __forceinline__ size_t z_off(int b, int h) { return (size_t)b * kRowZ + (size_t)h * kP; }
__device__ __forceinline__ size_t y_off(int b, int h) { return (size_t)b * kRowY + (size_t)h * kP; }
__device__ __forceinline__ size_t bn_off(int b, int g) { return (size_t)b * kRowB + (size_t)g * kN; }
__device__ __forceinline__ size_t cn_off(int b, int g) { return (size_t)b * kRowC + (size_t)g * kN; }
__device__ __forceinline__ size_t dt_off(int b, int h) { return (size_t)b * kRowDt + h; }
__device__ __forceinline__ int slot_of_row(const int* sbi, int b) { return sbi[(size_t)b * kRowSbi]; }
// (macros: a bool-returning function reordered the dense kernels' predicate code)
#define RSSM_SLOT_OK(slot, nslots) ((slot) >= 0 && (slot) < (nslots) && (slot) != kNullSlot)
#define RSSM_SLOT_BAD(slot, nslots) ((slot) < 0 || (slot) >= (nslots) || (slot) == kNullSlot)
__device__ __forceinline__ int cursor_at(const int* cursor, int b, int /*slot*/) { return cursor[b]; }
#else
__device__ __forceinline__ size_t state_off(int slot, int h, int row) { return (((size_t)slot * kH + h) * kP + row) * kN; }
__device__ __forceinline__ size_t xc_off(int slot, int h) { return ((size_t)slot * kH + h) * kL * kP; }
__device__ __forceinline__ size_t bc_off(int slot, int g) { return ((size_t)slot * kG + g) * kL * kN; }
__device__ __forceinline__ size_t dtc_off(int slot, int h) { return ((size_t)slot * kH + h) * kL; }
__device__ __forceinline__ size_t xc_entry(int slot, int h, int pos) { return (((size_t)slot * kH + h) * kL + pos) * kP; }
__device__ __forceinline__ size_t bc_entry(int slot, int g, int pos) { return (((size_t)slot * kG + g) * kL + pos) * kN; }
__device__ __forceinline__ size_t x_off(int b, int h) { return ((size_t)b * kH + h) * kP; }
__device__ __forceinline__ size_t z_off(int b, int h) { return ((size_t)b * kH + h) * kP; }
__device__ __forceinline__ size_t y_off(int b, int h) { return ((size_t)b * kH + h) * kP; }
__device__ __forceinline__ size_t bn_off(int b, int g) { return ((size_t)b * kG + g) * kN; }
__device__ __forceinline__ size_t cn_off(int b, int g) { return ((size_t)b * kG + g) * kN; }
__device__ __forceinline__ size_t dt_off(int b, int h) { return (size_t)b * kH + h; }
__device__ __forceinline__ int slot_of_row(const int* sbi, int b) { return sbi[b]; }
#define RSSM_SLOT_OK(slot, nslots) ((slot) >= 0 && (slot) < (nslots))
#define RSSM_SLOT_BAD(slot, nslots) ((slot) < 0 || (slot) >= (nslots))
__device__ __forceinline__ int cursor_at(const int* cursor, int /*b*/, int slot) { return cursor[slot]; }
#endif

// Copy rows [row0, row0 + kRows) of head h of the checkpoint into shared memory: without a
// shadow the full-precision rows; with one its rows and scales, and nothing on flush steps.
__device__ __forceinline__ void issue_rows(float4* S, const ReplayArgs& a, int slot, int h, int row0, bool flush) {
  const int t = threadIdx.x;
  const size_t base = state_off(slot, h, row0);
  if (kShadow) {
    if (flush && !RSSM_CKPT8) return;  // a shadow's flush folds the fp32 rows; an 8-bit checkpoint's, these
    const float4* src = reinterpret_cast<const float4*>(a.sh_in + base);
#pragma unroll
    for (int u = 0; u < (kShadowVecs + kThreads - 1) / kThreads; ++u) {
      const int i = t + u * kThreads;
      if (kShadowVecs % kThreads == 0 || i < kShadowVecs) cp_async16(&S[i], src + i);
    }
    if constexpr (kShadow == 2) {
      const float4* sc = reinterpret_cast<const float4*>(a.sc_in + ((size_t)slot * kH + h) * kP + row0);
      for (int i = t; i < kScaleVecs; i += kThreads) cp_async16(&S[kShadowVecs + i], sc + i);
    }
    return;
  }
  const float4* src = reinterpret_cast<const float4*>(a.state_in + base);
#pragma unroll
  for (int u = 0; u < (kStateVecs + kThreads - 1) / kThreads; ++u) {
    const int i = t + u * kThreads;
    if (kStateVecs % kThreads == 0 || i < kStateVecs) cp_async16(&S[i], src + i);
  }
}

// Output-form dot of this thread's rows with C, from the checkpoint or its shadow in smem.
__device__ __forceinline__ float checkpoint_dot(const float4* S, const ColRegs& cc) {
  if constexpr (kShadow != 0) {
    return state_dot_smem(reinterpret_cast<const shadow_t*>(S), cc,
                          kShadow == 2 ? reinterpret_cast<const float*>(S + kShadowVecs) : nullptr);
  } else {
    return state_dot_smem(reinterpret_cast<const state_t*>(S), cc);
  }
}

template <typename T, int n>
__device__ __forceinline__ void copy_vec(T* dst, const T* src) {
  *reinterpret_cast<Vec<T, n>*>(dst) = *reinterpret_cast<const Vec<T, n>*>(src);
}

// Lanes of a row group that share one row's buffer sum: kLPR / kRT where both are powers of two.
constexpr bool kPow2Rows = (kLPR & (kLPR - 1)) == 0 && (kRT & (kRT - 1)) == 0 && kLPR % kRT == 0;
constexpr int kYS = kPow2Rows ? kLPR / kRT : 1;

// Buffer part of the output of row `row` (= row_base + l % kRT): sum_{j<k} w_j (B_j.C_k) x_j[row],
// its entries split over the kYS lanes of the row group that share the row (lane l takes j = l / kRT
// mod kYS), so a k-long chain on kRT of kLPR lanes becomes k / kYS steps on all of them and
// log2(kYS) shuffles. Every lane of the group returns its row's total; call it with the whole warp.
template <typename XT>
__device__ __forceinline__ float buffer_sum(const float* w, const float* bc, const XT (*xt)[kRows], int row, int k) {
  const int part = kYS > 1 ? (threadIdx.x % kLPR) / kRT : 0;
  float acc = 0.f;
#pragma unroll
  for (int u = 0; u < (kL + kYS - 1) / kYS; ++u) {
    const int j = part + u * kYS;
    if (j < k) acc = fmaf(w[j] * bc[j], to_f(xt[j][row]), acc);
  }
#pragma unroll
  for (int o = kRT; o < kLPR && kYS > 1; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}

__device__ __forceinline__ void replay_decode(const ReplayArgs& a) {
  __shared__ ReplaySmem sm;
#if RSSM_ROW_ORDER  // a.sbi holds (row, slot, cursor, 0) in flush-first order (replayssm_flush_order): one load
  const int4 ro = ordered_row(a.sbi);
  const Coords c = block_coords(ro.x);
  const int slot = ro.y;
#else
  const Coords c = block_coords();
  const int slot = slot_of_row(a.sbi, c.b);
#endif
  if (RSSM_SLOT_BAD(slot, a.nslots)) return;  // padding row (or out of range): touch nothing
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const int rb = row_base(), l = t % kLPR;
#if RSSM_ROW_ORDER
  const int pos = ro.z;  // the slot's cursor, read by the order kernel
  const size_t sbase = state_off(slot, c.h, c.row0);
  issue_rows(sm.S, a, slot, c.h, c.row0, pos == kL - 1);
  cp_async_commit();
#else
  // With a shadow the cursor decides which copy of the checkpoint to read, so it comes first.
  constexpr bool kCursorFirst = kShadow != 0;
  int pos = kCursorFirst ? cursor_at(a.cursor, c.b, slot) : 0;
  // 0. The checkpoint rows (the bulk of the bytes) go first, straight to shared memory.
  const size_t sbase = state_off(slot, c.h, c.row0);
  issue_rows(sm.S, a, slot, c.h, c.row0, pos == kL - 1);
  cp_async_commit();
  if (!kCursorFirst) pos = cursor_at(a.cursor, c.b, slot);
#endif
  const size_t yo = y_off(c.b, c.h) + c.row0 + rb + l;  // the row this lane finalizes
  if (pos < 0 || pos >= kL) {  // corrupt cursor: make it loud in y, leave every state alone
    if (l < kRT) a.y[yo] = from_f<act_t>(__int_as_float(0x7fc00000));
    cp_async_wait_all();
    return;
  }
  const int k = pos + 1;
  const bool flush = (k == kL);
  // Entries loaded: only those in use (loading all kL so that the loads need not wait for the cursor
  // gained nothing, bench/NOTES.md variants table; the switch was removed, issue 15).

  // 1. Issue every load before using any: C, buffer tiles, dt, z (the checkpoint is in flight).
  const act_t* Cg = a.C + cn_off(c.b, c.g);
  ColRegs cc;
  load_cols(cc, Cg);

  const act_t* Bc = a.Bc_in + bc_off(slot, c.g);
  const act_t* Bnow = a.B + bn_off(c.b, c.g);
  const int bj0 = t / kBLanes, bl = t % kBLanes;
  float bv[kBPasses][kBVPL][kBV];
  float cb[kBVPL][kBV];
#pragma unroll
  for (int v = 0; v < kBVPL; ++v) load_f<act_t, kBV>(Cg + (v * kBLanes + bl) * kBV, cb[v]);
#pragma unroll
  for (int u = 0; u < kBPasses; ++u) {
    const int j = bj0 + u * kBRowsPerPass;
    if (j < k) {
      const act_t* row = j == pos ? Bnow : Bc + (size_t)j * kN;
#pragma unroll
      for (int v = 0; v < kBVPL; ++v) load_f<act_t, kBV>(row + (v * kBLanes + bl) * kBV, bv[u][v]);
    }
  }
  const act_t* xc = a.xc_in + xc_off(slot, c.h) + c.row0;
  const act_t* xnow = a.x + x_off(c.b, c.h) + c.row0;
  float xv[kXPasses][kXV];
#pragma unroll
  for (int u = 0; u < kXPasses; ++u) {
    const int i = t + u * kThreads, j = i / kXVecRow, p = (i % kXVecRow) * kXV;
    if (j < k) load_f<act_t, kXV>(j == pos ? xnow + p : xc + (size_t)j * kP + p, xv[u]);
  }
  float dtj = 0.f;
  if (warp == 0 && lane < k)
    dtj = lane == pos ? softplus(to_f(a.dt[dt_off(c.b, c.h)]) + a.dt_bias[c.h])
                      : a.dtc_in[dtc_off(slot, c.h) + lane];
  float zv = 0.f;
  if constexpr (kHasZ) {
    if (l < kRT) zv = to_f(a.z[z_off(c.b, c.h) + c.row0 + rb + l]);
  }

  // 2. Buffer part, from registers: B_j . C_k per entry, x tile (and B tile on flush) to smem,
  //    the dt scan in warp 0; this step's entry is appended unless the step flushes.
#pragma unroll
  for (int u = 0; u < kBPasses; ++u) {
    const int j = bj0 + u * kBRowsPerPass;
    float acc = 0.f;
    if (j < k) {
#pragma unroll
      for (int v = 0; v < kBVPL; ++v)
#pragma unroll
        for (int e = 0; e < kBV; ++e) acc = fmaf(bv[u][v][e], cb[v][e], acc);
    }
    acc = group_sum<kBLanes>(acc);  // every lane takes part: the shuffles need the full warp
    if (j < k) {
      if (bl == 0) sm.bc[j] = acc;
      if (flush) {
#pragma unroll
        for (int v = 0; v < kBVPL; ++v) store_f<act_t, kBV>(&sm.Bt[j][(v * kBLanes + bl) * kBV], bv[u][v]);
      } else if (j == pos && c.chunk == 0 && c.h % kHPG == 0) {
        act_t* Bo = a.Bc_out + bc_entry(slot, c.g, pos);
#pragma unroll
        for (int v = 0; v < kBVPL; ++v) store_f<act_t, kBV>(Bo + (v * kBLanes + bl) * kBV, bv[u][v]);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kXPasses; ++u) {
    const int i = t + u * kThreads, j = i / kXVecRow, p = (i % kXVecRow) * kXV;
    if (j < k) {
#pragma unroll
      for (int e = 0; e < kXV; ++e) sm.xt[j][p + e] = xv[u][e];
      if (j == pos && !flush) {
        act_t* xo = a.xc_out + xc_entry(slot, c.h, pos) + c.row0 + p;
        store_f<act_t, kXV>(xo, xv[u]);
      }
    }
  }
  if (warp == 0) {  // w_j = dt_j exp(A sum_{j<i<k} dt_i), exp(c_k) = exp(A sum_i dt_i): suffix sums (suffix_after)
    const float A = a.A[c.h];
    const float after = suffix_after(dtj);  // dtj = 0 on lanes >= k
    if (lane < k) sm.w[lane] = dtj * expf(A * after);
    if (lane == 0) sm.decay = expf(A * (dtj + after));
    if (lane == pos && !flush && c.chunk == 0) a.dtc_out[dtc_off(slot, c.h) + pos] = dtj;
  }
  const float D = a.D[c.h];
  cp_async_wait_all();
  __syncthreads();

  float val;
  const state_t* Ss = reinterpret_cast<const state_t*>(sm.S);
  if (!flush) {
    // 3. Output form: exp(c_k) S0.C_k + sum_j w_j (B_j.C_k) x_j + D x_k; no state write.
    const float sdot = checkpoint_dot(sm.S, cc);
    const float bsum = buffer_sum(sm.w, sm.bc, sm.xt, rb + l % kRT, k);
    if (l >= kRT) return;
    val = sm.decay * sdot + D * sm.xt[pos][rb + l] + bsum;
  } else {
    // 3'. Flush: S_k = exp(c_k) S0 + sum_j (w_j x_j) B_j^T becomes the checkpoint; y = S_k C_k + D x_k.
    const float sdot = flush_store_dot(kShadow ? a.state_in + sbase : Ss, sm.decay, sm.w, sm.Bt, sm.xt,
                                       a.state_out + sbase, a.sh_out + sbase, a.sc_out + sbase / kN, cc);
    if (l >= kRT) return;
    val = sdot + D * sm.xt[pos][rb + l];
  }
  if constexpr (kHasZ) val *= silu(zv);
  a.y[yo] = from_f<act_t>(val);
}

// ---- v4: persistent blocks, two-stage cp.async pipeline over work items -----------------------
// A work item is (batch row, head, chunk of kRows rows). Each block walks items i, i + G, ...
// (G = gridDim.x). While it computes item i from one shared-memory stage, every byte item i + G
// needs (checkpoint rows, B and x tiles, history dt, C) is already in flight into the other stage,
// so the memory pipe never waits for a block's buffer arithmetic. The slot and cursor of an item
// are read two iterations before use, so their latency is hidden as well.
template <int kBytes>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
  } else {
    static_assert(kBytes == 8 || kBytes == 4, "cp.async moves 4, 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(gmem), "n"(kBytes));
  }
}
template <int n>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory"); }

static_assert(kXV * sizeof(act_t) >= 4, "x tile vectors must be at least 4 bytes for cp.async");
constexpr int kItemsPerRow = kH * kChunks;

struct alignas(16) Stage {
  float4 S[kStageVecs];  // checkpoint rows (or their shadow + scales on non-flush items)
  act_t Bt[kL][kN];      // B_1..B_k
  act_t xt[kL][kRows];   // x_1..x_k (this item's rows)
  // C is copied and read as 16-byte vectors: aligned even where the x tile is not a multiple of 16 bytes
  // (L * rows * sizeof(act) % 16 != 0, e.g. headdim 80 in 20-row items at odd L; a misaligned access otherwise)
  alignas(16) act_t C[kN];
  float dt[kL];          // processed dt_1..dt_{k-1} (dt_k is computed from the raw input)
};
struct alignas(16) PipeSmem {
  Stage st[2];
  float w[kL];
  float bc[kL];
  float decay;
};

struct Item {
  int b, h, g, chunk, row0;
};
__device__ __forceinline__ Item item_coords(int i) {
  Item it;
  it.b = i / kItemsPerRow;
  const int r = i % kItemsPerRow;
  it.h = r / kChunks;
  it.chunk = r % kChunks;
  it.row0 = it.chunk * kRows;
  it.g = it.h / kHPG;
  return it;
}

// Issue every copy item `it` (slot, pos already known and valid) needs into stage `sg`.
// ``rows``: false where the caller issued the checkpoint rows already (replay_decode_staged, kRowsBeforeCursor).
__device__ __forceinline__ void issue_item(Stage& sg, const ReplayArgs& a, const Item& it, int slot, int pos,
                                           bool rows = true) {
  const int t = threadIdx.x, k = pos + 1;
  if (rows) issue_rows(sg.S, a, slot, it.h, it.row0, k == kL);
  const act_t* Bc = a.Bc_in + bc_off(slot, it.g);
  const act_t* Bnow = a.B + bn_off(it.b, it.g);
  constexpr int kBVecs = kL * kBVecRow;
#pragma unroll
  for (int u = 0; u < (kBVecs + kThreads - 1) / kThreads; ++u) {
    const int i = t + u * kThreads, j = i / kBVecRow, n = (i % kBVecRow) * kBV;
    if (j < k) cp_async<16>(&sg.Bt[j][n], j == pos ? Bnow + n : Bc + (size_t)j * kN + n);
  }
  const act_t* xc = a.xc_in + xc_off(slot, it.h) + it.row0;
  const act_t* xnow = a.x + x_off(it.b, it.h) + it.row0;
  constexpr int kXVecs = kL * kXVecRow;
#pragma unroll
  for (int u = 0; u < (kXVecs + kThreads - 1) / kThreads; ++u) {
    const int i = t + u * kThreads, j = i / kXVecRow, p = (i % kXVecRow) * kXV;
    if (j < k) cp_async<kXV * sizeof(act_t)>(&sg.xt[j][p], j == pos ? xnow + p : xc + (size_t)j * kP + p);
  }
  const act_t* Cg = a.C + cn_off(it.b, it.g);
  for (int n = t * kBV; n < kN; n += kThreads * kBV) cp_async<16>(&sg.C[n], Cg + n);
  const float* dtc = a.dtc_in + dtc_off(slot, it.h);
  if (t < pos) cp_async<4>(&sg.dt[t], dtc + t);
}

// Scalars of an item, read into registers one iteration ahead of its computation.
struct ItemScalars {
  float dt_raw, dt_bias, A, D, z;
};
__device__ __forceinline__ ItemScalars load_scalars(const ReplayArgs& a, const Item& it) {
  ItemScalars s;
  s.dt_raw = to_f(a.dt[dt_off(it.b, it.h)]);
  s.dt_bias = a.dt_bias[it.h];
  s.A = a.A[it.h];
  s.D = a.D[it.h];
  s.z = 0.f;
  if constexpr (kHasZ) {
    const int l = threadIdx.x % kLPR;
    if (l < kRT) s.z = to_f(a.z[z_off(it.b, it.h) + it.row0 + row_base() + l]);
  }
  return s;
}

// B_j . C_k of the staged item: kDL lanes (a power of two dividing the B row's vectors) per entry,
// as many as let every entry's dot run in one pass (kDEntries >= kL) where the block is big enough;
// one warp per entry looped over k serialized a dot per kWarps entries (the k-staircase, NOTES).
__host__ __device__ constexpr int pow2_floor(int v) { return v >= 2 ? 2 * pow2_floor(v / 2) : 1; }
constexpr int kDL = pow2_floor(kThreads / kL) < kBLanes ? pow2_floor(kThreads / kL) : kBLanes;
constexpr int kDVPL = kBVecRow / kDL;
constexpr int kDEntries = kThreads / kDL;
constexpr int kDPasses = (kL + kDEntries - 1) / kDEntries;
static_assert(kBVecRow % kDL == 0 && kDL <= 32, "a B row splits evenly over the lanes of its dot");

template <typename Smem>  // PipeSmem or StagedSmem: w, bc, decay
__device__ __forceinline__ void compute_item(Smem& sm, const Stage& sg, const ReplayArgs& a, const Item& it,
                                             int slot, int pos, const ItemScalars& sc) {
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const int rb = row_base(), l = t % kLPR;
  const size_t yo = y_off(it.b, it.h) + it.row0 + rb + l;
  const int k = pos + 1;
  const bool flush = (k == kL);
  const float dt_now = softplus(sc.dt_raw + sc.dt_bias);

  // Buffer weights (warp 0) and B_j . C_k (all entries at once), from the stage.
  if (warp == 0) {  // exponents from suffix sums (suffix_after), as replay_decode
    const float dtj = lane < pos ? sg.dt[lane] : (lane == pos ? dt_now : 0.f);
    const float after = suffix_after(dtj);
    if (lane < k) sm.w[lane] = dtj * expf(sc.A * after);
    if (lane == 0) sm.decay = expf(sc.A * (dtj + after));
  }
  if (!flush) {  // all k dots at once: kDL lanes per entry, kDVPL 16-byte vectors per lane
    const int dl = t % kDL;
#pragma unroll
    for (int u = 0; u < kDPasses; ++u) {
      const int j = t / kDL + u * kDEntries;
      float acc = 0.f;
      if (j < k) {
#pragma unroll
        for (int v = 0; v < kDVPL; ++v) {
          const int n = (v * kDL + dl) * kBV;
          float bj[kBV], cn[kBV];
          load_f<act_t, kBV>(&sg.Bt[j][n], bj);
          load_f<act_t, kBV>(&sg.C[n], cn);
#pragma unroll
          for (int e = 0; e < kBV; ++e) acc = fmaf(bj[e], cn[e], acc);
        }
      }
      acc = group_sum<kDL>(acc);  // every lane takes part: the shuffles need the full warp
      if (j < k && dl == 0) sm.bc[j] = acc;
    }
  }
  ColRegs cc;
#pragma unroll
  for (int v = 0; v < kVPL; ++v) load_f<act_t, kEPV>(&sg.C[my_col(v)], cc.c[v]);
  __syncthreads();

  const state_t* Ss = reinterpret_cast<const state_t*>(sg.S);
  float val;
  if (!flush) {
    const float sdot = checkpoint_dot(sg.S, cc);
    // Append entry k: x rows of this item, B once per group, dt once per head.
    act_t* xo = a.xc_out + xc_entry(slot, it.h, pos) + it.row0;
    for (int p = t * kXV; p < kRows; p += kThreads * kXV)
      *reinterpret_cast<Vec<act_t, kXV>*>(xo + p) = *reinterpret_cast<const Vec<act_t, kXV>*>(&sg.xt[pos][p]);
    if (it.chunk == 0) {
      if (it.h % kHPG == 0) {
        act_t* Bo = a.Bc_out + bc_entry(slot, it.g, pos);
        for (int n = t * kBV; n < kN; n += kThreads * kBV)
          *reinterpret_cast<Vec<act_t, kBV>*>(Bo + n) = *reinterpret_cast<const Vec<act_t, kBV>*>(&sg.Bt[pos][n]);
      }
      if (t == 0) a.dtc_out[dtc_off(slot, it.h) + pos] = dt_now;
    }
    const float bsum = buffer_sum(sm.w, sm.bc, sg.xt, rb + l % kRT, k);
    if (l < kRT) val = sm.decay * sdot + sc.D * to_f(sg.xt[pos][rb + l]) + bsum;
  } else {
    const size_t sbase = state_off(slot, it.h, it.row0);
#if RSSM_CKPT8
    const unsigned key = mix32(mix32(mix32(mix32(a.seed) + (unsigned)a.flushes[slot]) + (unsigned)slot) + (unsigned)it.h);
    const float sdot = flush_ckpt8(sg.S, sm.decay, sm.w, sg.Bt, sg.xt, a.sh_out + sbase, a.sc_out + sbase / kN, key,
                                   it.row0, cc);
#else
    const float sdot = flush_store_dot(kShadow ? a.state_in + sbase : Ss, sm.decay, sm.w, sg.Bt, sg.xt,
                                       a.state_out + sbase, a.sh_out + sbase, a.sc_out + sbase / kN, cc);
#endif
    if (l < kRT) val = sdot + sc.D * to_f(sg.xt[pos][rb + l]);
  }
  if (l < kRT) {
    if constexpr (kHasZ) val *= silu(sc.z);
    a.y[yo] = from_f<act_t>(val);
  }
}

__device__ __forceinline__ void replay_decode_persistent(const ReplayArgs& a) {
  __shared__ PipeSmem sm;
  const int G = gridDim.x, nitems = a.batch * kItemsPerRow;
  int i = blockIdx.x;
  if (i >= nitems) return;
  // Meta pipeline: (slot, pos) of items i and i + G, slot of item i + 2G.
  auto slot_of = [&](int item) { return item < nitems ? slot_of_row(a.sbi, item / kItemsPerRow) : -1; };
  auto valid = [&](int slot) { return RSSM_SLOT_OK(slot, a.nslots); };
  auto pos_of = [&](int item, int slot) { return valid(slot) ? cursor_at(a.cursor, item / kItemsPerRow, slot) : -1; };
  auto usable = [&](int slot, int pos) { return valid(slot) && pos >= 0 && pos < kL; };
  int slot0 = slot_of(i), pos0 = pos_of(i, slot0);
  int slot1 = slot_of(i + G), pos1 = pos_of(i + G, slot1);
  int slot2 = slot_of(i + 2 * G);
  Item it0 = item_coords(i);
  ItemScalars sc0 = load_scalars(a, it0);
  if (usable(slot0, pos0)) issue_item(sm.st[0], a, it0, slot0, pos0);
  cp_async_commit();
  for (int n = 0; i < nitems; ++n, i += G) {
    const int s = n & 1;
    // Prefetch item i + G into the other stage; read the cursor of i + 2G and the slot of i + 3G.
    const int inext = i + G;
    Item it1 = item_coords(inext < nitems ? inext : i);
    ItemScalars sc1 = sc0;
    if (inext < nitems) {
      sc1 = load_scalars(a, it1);
      if (usable(slot1, pos1)) issue_item(sm.st[s ^ 1], a, it1, slot1, pos1);
    }
    cp_async_commit();
    const int pos2 = pos_of(i + 2 * G, slot2);
    const int slot3 = slot_of(i + 3 * G);
    cp_async_wait<1>();
    __syncthreads();
    if (valid(slot0)) {
      if (pos0 < 0 || pos0 >= kL) {  // corrupt cursor: loud y, no state touched
        const int l = threadIdx.x % kLPR;
        if (l < kRT) a.y[y_off(it0.b, it0.h) + it0.row0 + row_base() + l] = from_f<act_t>(__int_as_float(0x7fc00000));
      } else {
        compute_item(sm, sm.st[s], a, it0, slot0, pos0, sc0);
      }
    }
    __syncthreads();
    it0 = it1;
    sc0 = sc1;
    slot0 = slot1;
    pos0 = pos1;
    slot1 = slot2;
    pos1 = pos2;
    slot2 = slot3;
  }
  cp_async_wait<0>();
}

// ---- v5 (RSSM_STAGED): one-shot blocks staging the whole item by cp.async ----------------------
// One item per block, in the persistent kernel's stage: checkpoint rows (or shadow), B and x tiles,
// C and the history dt all go to shared memory by cp.async, so across the wait a thread holds only
// addresses and a few scalars instead of the buffer tiles the one-shot kernel loads into registers
// (~62 registers, NOTES "Register budget"). With the flush folded kFR rows at a time
// (RSSM_FLUSH_ROWS) the block fits a smaller register budget: more resident blocks per SM for the
// same per-block latency chain (sbi -> cursor -> copies -> barrier -> dots -> barrier -> y).
struct alignas(16) StagedSmem {
  Stage st;
  float w[kL];
  float bc[kL];
  float decay;
#if RSSM_BULK
  unsigned long long bar;  // the item's bulk copies complete on it (one phase: one item per block)
#endif
};

#if RSSM_BULK
// ---- bulk copies (RSSM_BULK; sm_90+): one thread stages the item's contiguous pieces ------------------
// The staged kernel's prologue issued ~5 cp.async per thread with 64-bit address arithmetic and
// predicates each (ncu, fp8 k = 1: ~150 of a warp's ~510 instructions an item come before the first
// barrier, and the step is issue-bound). Here thread 0 issues one cp.async.bulk per contiguous piece
// (checkpoint or shadow rows, fp8 scales, the B history, the x history, this step's B and x, C: 7 where
// an item is a whole head; where rows < headdim the x history goes one entry at a time, 6 + pos copies
// issued one after another) that complete on an mbarrier; the other threads only wait. The history dt
// (4-byte entries, not a 16-byte multiple) keeps one cp.async per entry.
static_assert(RSSM_STAGED, "bulk copies stage the staged kernel's item (kind=staged)");
static_assert(kRows * sizeof(act_t) % 16 == 0 && kP * sizeof(act_t) % 16 == 0 && kN * sizeof(act_t) % 16 == 0,
              "bulk copies move 16-byte multiples: the x rows of an item and of a head, a B or C row");
__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival (the barrier's only one) that also expects `bytes` of transactions in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(dst)), "l"(static_cast<unsigned long long>(__cvta_generic_to_global(src))), "r"(bytes),
               "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

// The copies of item `it` (slot, pos known and valid) into stage `sg`, as issue_item's, by bulk copies.
// The mbarrier is initialised here by thread 0; other threads may wait on it only after a block barrier.
__device__ __forceinline__ void issue_item_bulk(Stage& sg, unsigned bar, const ReplayArgs& a, const Item& it, int slot,
                                                int pos) {
  const int t = threadIdx.x;
  const float* dtc = a.dtc_in + dtc_off(slot, it.h);
  if (t < pos) cp_async<4>(&sg.dt[t], dtc + t);
  if (t != 0) return;
  constexpr unsigned kA = sizeof(act_t);
  constexpr unsigned kRowBytes = (kShadow ? kShadowVecs : kStateVecs) * 16u;
  constexpr unsigned kScaleBytes = kShadow == 2 ? kRows * 4u : 0u;
  const bool rows = !(kShadow && !RSSM_CKPT8 && pos == kL - 1);  // a shadow's flush reads the f32 rows from global memory
  const unsigned bytes = (rows ? kRowBytes + kScaleBytes : 0u) + (pos + 1) * (kN + kRows) * kA + kN * kA;
  mbar_init(bar, 1);
  mbar_arrive_expect_tx(bar, bytes);
  const size_t base = state_off(slot, it.h, it.row0);
  if (rows) {
    if constexpr (kShadow != 0) {
      bulk_copy(sg.S, a.sh_in + base, kRowBytes, bar);
      if constexpr (kShadow == 2)
        bulk_copy(&sg.S[kShadowVecs], a.sc_in + ((size_t)slot * kH + it.h) * kP + it.row0, kScaleBytes, bar);
    } else {
      bulk_copy(sg.S, a.state_in + base, kRowBytes, bar);
    }
  }
  if (pos > 0) {  // the history: ring entries 0 .. pos-1, contiguous per (slot, group) and (slot, head)
    bulk_copy(&sg.Bt[0][0], a.Bc_in + bc_off(slot, it.g), pos * kN * kA, bar);
    if constexpr (kRows == kP) {
      bulk_copy(&sg.xt[0][0], a.xc_in + xc_off(slot, it.h), pos * kP * kA, bar);
    } else {
      for (int j = 0; j < pos; ++j) bulk_copy(&sg.xt[j][0], a.xc_in + xc_entry(slot, it.h, j) + it.row0, kRows * kA, bar);
    }
  }
  bulk_copy(&sg.Bt[pos][0], a.B + bn_off(it.b, it.g), kN * kA, bar);
  bulk_copy(&sg.xt[pos][0], a.x + x_off(it.b, it.h) + it.row0, kRows * kA, bar);
  bulk_copy(&sg.C[0], a.C + cn_off(it.b, it.g), kN * kA, bar);
}
#endif

// Where the staged rows do not depend on the buffer position (an fp32 checkpoint: the flush folds the rows the
// other steps dot; an 8-bit checkpoint: staged at every position), they are issued before the cursor is read, so
// the cursor's dependent load overlaps their DRAM trip instead of preceding it (issue 40: at batch 1 a step is a
// few such trips). A shadow's flush reads the fp32 rows from global memory instead: its rows wait for the cursor.
constexpr bool kRowsBeforeCursor = (kShadow == 0 || RSSM_CKPT8) && !RSSM_BULK;

__device__ __forceinline__ void replay_decode_staged(const ReplayArgs& a) {
  __shared__ StagedSmem sm;
#if RSSM_ROW_ORDER  // a.sbi holds (row, slot, cursor, 0) in flush-first order (replayssm_flush_order): one load
  const int4 ro = ordered_row(a.sbi);
  const Coords c = block_coords(ro.x);
  const int slot = ro.y;
  if (RSSM_SLOT_BAD(slot, a.nslots)) return;  // padding row (or out of range): touch nothing
  if constexpr (kRowsBeforeCursor) issue_rows(sm.st.S, a, slot, c.h, c.row0, false);
  const int pos = ro.z;  // the slot's cursor, read by the order kernel
#else
  const Coords c = block_coords();
  const int slot = slot_of_row(a.sbi, c.b);
  if (RSSM_SLOT_BAD(slot, a.nslots)) return;  // padding row (or out of range): touch nothing
  if constexpr (kRowsBeforeCursor) issue_rows(sm.st.S, a, slot, c.h, c.row0, false);
  const int pos = cursor_at(a.cursor, c.b, slot);
#endif
  const Item it{c.b, c.h, c.g, c.chunk, c.row0};
  if (pos < 0 || pos >= kL) {  // corrupt cursor: make it loud in y, leave every state alone
    if constexpr (kRowsBeforeCursor) cp_async_wait_all();  // no copy in flight into a finished block's smem
    const int l = threadIdx.x % kLPR;
    if (l < kRT) a.y[y_off(c.b, c.h) + c.row0 + row_base() + l] = from_f<act_t>(__int_as_float(0x7fc00000));
    return;
  }
#if RSSM_BULK
  const unsigned bar = smem_u32(&sm.bar);
  issue_item_bulk(sm.st, bar, a, it, slot, pos);
  cp_async_commit();
  const ItemScalars sc = load_scalars(a, it);
  cp_async_wait_all();
  __syncthreads();    // the mbarrier's initialisation is visible to every thread from here on
  mbar_wait(bar, 0);  // and each thread acquires the bulk copies' writes by its own wait
#else
  issue_item(sm.st, a, it, slot, pos, !kRowsBeforeCursor);
  cp_async_commit();
  const ItemScalars sc = load_scalars(a, it);
  cp_async_wait_all();
  __syncthreads();
#endif
  compute_item(sm, sm.st, a, it, slot, pos, sc);
}

// ---- conventional step (baseline): reads and writes the whole state every step ----------------
struct ConvArgs {
  const act_t* x;
  const act_t* B;
  const act_t* C;
  const act_t* dt;
  const float* dt_bias;
  const float* A;
  const float* D;
  const act_t* z;
  const int* sbi;
  const state_t* state_in;
  int batch, nslots;
  act_t* y;
  state_t* state_out;
};

__device__ __forceinline__ void conventional_step(const ConvArgs& a) {
  const Coords c = block_coords();
  const int slot = a.sbi[c.b];
  if (slot < 0 || slot >= a.nslots) return;
  const int rb = row_base(), l = threadIdx.x % kLPR;
  const size_t sbase = (((size_t)slot * kH + c.h) * kP + c.row0) * kN;
  StateRegs st;
  load_state(st, a.state_in + sbase);
  ColRegs bb, cc;
  load_cols(bb, a.B + ((size_t)c.b * kG + c.g) * kN);
  load_cols(cc, a.C + ((size_t)c.b * kG + c.g) * kN);
  const size_t xo = ((size_t)c.b * kH + c.h) * kP + c.row0 + rb;
  float xr[kRT];
  load_f<act_t, kRT>(a.x + xo, xr);
  float zv = 0.f;
  if constexpr (kHasZ) {
    if (l < kRT) zv = to_f(a.z[xo + l]);
  }
  const float dt = softplus(to_f(a.dt[(size_t)c.b * kH + c.h]) + a.dt_bias[c.h]);
  const float decay = expf(a.A[c.h] * dt);
  const float D = a.D[c.h];
#pragma unroll
  for (int r = 0; r < kRT; ++r) {
    const float xd = dt * xr[r];
#pragma unroll
    for (int v = 0; v < kVPL; ++v)
#pragma unroll
      for (int e = 0; e < kEPV; ++e) st.s[r][v][e] = fmaf(decay, st.s[r][v][e], xd * bb.c[v][e]);
  }
  store_state(st, a.state_out + sbase);
  const float sdot = state_dot_mine(st, cc);
  if (l >= kRT) return;
  float xm = 0.f;
#pragma unroll
  for (int r = 0; r < kRT; ++r)
    if (r == l) xm = xr[r];
  float val = sdot + D * xm;
  if constexpr (kHasZ) val *= silu(zv);
  a.y[xo + l] = from_f<act_t>(val);
}

}  // namespace rssm
