// SPDX-License-Identifier: Apache-2.0
// Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) decode: device math of the conventional
// step and of the ReplaySSM step. The spec is trtllm_replayssm/families/gdn/reference.py (float64).
//
// The generated prelude (trtllm_replayssm/compile.py, GDNSpec) defines, before this header:
//   act_t                      activations: q, k, v, a, b, y and v_cache
//   shadow_t, GDN_SHADOW       0: none (shadow_t = float, unused); 1: bf16 shadow of the checkpoint
//   kHV, kHK, kV, kK, kL       value heads, key heads, value dim, key dim, buffer length
//   kRows, kWarps, kMinBlocks  value rows of one head per block, warps per block, resident blocks
//   GDN_PASSES                 1 (default) or 2: the block's rows in passes of kRows / GDN_PASSES under one
//                              prologue (standard decode modules only; see replay_nonflush)
//   GDN_ROW_ORDER              0: block row blockIdx.y, its slot sbi[row], its cursor cursor[slot]; 1 (standard decode
//                              modules): sbi points to (row, slot, cursor, 0) int4 rows in flush-first order
//                              (cursor.flush_order; GDNSpec.row_order)
//   kLanes                     lanes sharing one state row (4..32; fewer: shorter butterflies)
//   kL2Norm, kScale            l2-normalise q and k; q scale (K^-1/2 unless given)
//
// Math, per (slot, value head hv), key head h = hv / (HV / H), state S (V x K) fp32:
//   g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), q, k l2-normalised, q *= scale
//   conventional: S <- exp(g) S; u = beta (v - S k); S <- S + u k^T; y = S q
// ReplaySSM (checkpoint S0, entries j < m of the buffer, G_j = sum_{i<=j} g_i, w_j = exp(G_m - G_j), whose
// exponent is formed in fp32 as the suffix sum sum_{j<i<=m} g_i, never as a difference: suffix_after):
//   S_m k = exp(G_m) S0 k + sum_j w_j (k_j . k) u_j       (same with q)
//   u = beta (v - exp(g) S_m k),  y = exp(g) S_m q + (k . q) u
// so a non-flush step reads S0 once (two dots per row) and appends (u, v, k, g, beta). The flush
// (the L-th entry) brings the fp32 checkpoint to S_m, then runs the conventional step for the current
// token and stores the checkpoint. Without a shadow, S_m = exp(G_m) S0 + sum_j w_j u_j k_j^T from the
// stored fp32 u_j (the u-sum): the non-flush steps computed those u_j from this same checkpoint, so this
// is the recurrence's S_m (reference.py says so), one FMA per state value and entry and no chain between
// entries. With a bf16 shadow the stored u_j carry the shadow's rounding, so the flush refolds the
// buffered (v_j, k_j, g_j, beta_j) by the exact recurrence from the fp32 checkpoint.
//
// Work split: one block per (batch row, value head, chunk of kRows rows). A row's K columns lie
// across kLPR lanes (16-byte vectors), kRT consecutive rows per thread, so a warp-wide load covers
// whole contiguous rows. Every row is independent: the two dots per row are summed by one
// transposing butterfly over the row group, and u comes back to the row's lanes by shuffles.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/convert.cuh"
#include "common/cp_async.cuh"
#include "common/scan.cuh"

#ifndef GDN_SHADOW
#define GDN_SHADOW 0
#endif
#ifndef GDN_ROW_ORDER
#define GDN_ROW_ORDER 0
#endif
#ifndef GDN_PASSES
#define GDN_PASSES 1
#endif

namespace gdn {

// ---- dtype helpers ---------------------------------------------------------------------------
using rssm_common::from_f;  // common/convert.cuh
using rssm_common::to_f;

// Four contiguous elements (8 bytes of bf16/fp16, 16 of fp32) through the read-only path, widened.
template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&out)[4]) {
  static_assert(sizeof(T) == 2, "16-bit activations");
  const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = to_f(e[i]);
}
template <>
__device__ __forceinline__ void load4<float>(const float* p, float (&out)[4]) {
  const float4 t = __ldg(reinterpret_cast<const float4*>(p));
  out[0] = t.x, out[1] = t.y, out[2] = t.z, out[3] = t.w;
}
// The checkpoint streams through once per step: evict-first loads and stores.
__device__ __forceinline__ void load_state4(const float* p, float (&out)[4]) {
  const float4 t = __ldcs(reinterpret_cast<const float4*>(p));
  out[0] = t.x, out[1] = t.y, out[2] = t.z, out[3] = t.w;
}
__device__ __forceinline__ void store_state4(float* p, const float (&in)[4]) {
  __stcs(reinterpret_cast<float4*>(p), make_float4(in[0], in[1], in[2], in[3]));
}
__device__ __forceinline__ void load_shadow4(const __nv_bfloat16* p, float (&out)[4]) {
  const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(p));
  const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
  const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
  out[0] = __low2float(lo), out[1] = __high2float(lo), out[2] = __low2float(hi), out[3] = __high2float(hi);
}
__device__ __forceinline__ void store_shadow4(__nv_bfloat16* p, const float (&in)[4]) {
  uint2 raw;
  *reinterpret_cast<__nv_bfloat162*>(&raw.x) = __floats2bfloat162_rn(in[0], in[1]);
  *reinterpret_cast<__nv_bfloat162*>(&raw.y) = __floats2bfloat162_rn(in[2], in[3]);
  __stcs(reinterpret_cast<uint2*>(p), raw);
}

__device__ __forceinline__ float softplus(float v) { return v > 20.f ? v : log1pf(expf(v)); }  // torch's threshold
constexpr float kL2Eps = 1e-6f;  // reference.L2NORM_EPS (transformers' Qwen3-Next l2norm)
// Below this the fold's lazy decay is applied to the rows (fp32 keeps ~2^-126; 2^-30 leaves room for u / D).
constexpr float kRenorm = 9.3132257e-10f;  // 2^-30

using rssm_common::suffix_after;  // common/scan.cuh

using rssm_common::cp_async16;  // common/cp_async.cuh
using rssm_common::cp_async_wait_all;

// ---- geometry ---------------------------------------------------------------------------------
constexpr int kThreads = kWarps * 32;
constexpr int kLPR = kLanes;                     // lanes sharing one row
constexpr int kVPL = kK / 4 / kLPR;              // 16-byte vectors per lane per row
constexpr int kRPW = 32 / kLPR;                  // rows covered by one warp-wide load
constexpr int kPasses = GDN_PASSES;              // passes over the block's rows, one prologue
constexpr int kRowsPass = kRows / kPasses;       // rows of one pass
constexpr int kRT = kRowsPass / (kRPW * kWarps); // rows per thread per pass
constexpr int kChunks = kV / kRows;
constexpr int kHPK = kHV / kHK;                  // value heads per key head
constexpr int kShadow = GDN_SHADOW;
static_assert(kK % (4 * kLPR) == 0 && 32 % kLPR == 0 && kLPR >= 4, "K must fill whole 16-byte vectors per lane");
static_assert((kPasses == 1 || kPasses == 2) && kRows % kPasses == 0, "GDN_PASSES: 1 or 2");
static_assert(kRowsPass % (kRPW * kWarps) == 0 && kRT >= 1, "rows per pass must split evenly over warps");
static_assert((kRT & (kRT - 1)) == 0 && 2 * kRT <= kLPR, "rows per thread: a power of two, 2 kRT <= lanes per row");
static_assert(kV % kRows == 0, "rows per block must divide V");
static_assert(kHV % kHK == 0, "key heads must divide value heads");
static_assert(kL >= 1 && kL <= 32, "buffer length is 1..32 (one warp scans it)");
static_assert(kShadow == 0 || kShadow == 1, "GDN shadow: none or bf16");
static_assert(kRows % 4 == 0, "rows per block: a multiple of 4 (u rows move as 16-byte vectors)");

struct Lane {
  int lane, l;   // lane in the warp, lane in its row group
  int rb;        // first of this thread's kRT rows, within the block's chunk
  __device__ int col(int v) const { return (v * kLPR + l) * 4; }
};
// The same lane in pass p: its rows move down by p passes (every row function reads rows from rb).
__device__ __forceinline__ Lane in_pass(Lane c, int p) {
  c.rb += p * kRowsPass;
  return c;
}
__device__ __forceinline__ Lane lane_coords() {
  Lane c;
  c.lane = threadIdx.x % 32;
  c.l = c.lane % kLPR;
  c.rb = ((threadIdx.x / 32) * kRPW + c.lane / kLPR) * kRT;
  return c;
}

__device__ __forceinline__ float fsel(bool c, float a, float b) {
  float r;
  asm("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %3, 0;\n\tselp.f32 %0, %1, %2, p;\n\t}" : "=f"(r) : "f"(a), "f"(b), "r"((int)c));
  return r;
}

// Transposing butterfly: on lane l, the sum over its row group of acc[l % n] (n a power of two <= kLPR).
// n - 1 + log2(kLPR / n) shuffles instead of n log2(kLPR).
// One butterfly stage at offset o: acc[i] for i < n / o holds value index i * o + (lane mod o).
template <int n, int o>
__device__ __forceinline__ void butterfly_stage(float (&acc)[n], int lane) {
  if constexpr (o < n) {
    const bool up = lane & o;
#pragma unroll
    for (int m = 0; m < n / (2 * o); ++m) {
      // Select values, not addresses: a select of acc[] elements can become a run-time index (local memory).
      const float x0 = acc[2 * m], x1 = acc[2 * m + 1];
      const float keep = fsel(up, x1, x0), send = fsel(up, x0, x1);
      acc[m] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
    butterfly_stage<n, 2 * o>(acc, lane);
  }
}
template <int n>
__device__ __forceinline__ float group_reduce(float (&acc)[n]) {
  const int lane = threadIdx.x % 32;
  butterfly_stage<n, 1>(acc, lane);
  float v = acc[0];
#pragma unroll
  for (int o = n; o < kLPR; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float from_group_lane(float v, int src) {  // lane src of the caller's row group
  return __shfl_sync(0xffffffffu, v, (threadIdx.x % 32) / kLPR * kLPR + src);
}

using Cols = float[kVPL][4];  // one row's K columns held by this lane
using Rows = float[kRT][kVPL][4];

__device__ __forceinline__ float dot_cols(const float (&s)[kVPL][4], const Cols& c) {
  float acc = 0.f;
#pragma unroll
  for (int v = 0; v < kVPL; ++v)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc = fmaf(s[v][e], c[v][e], acc);
  return acc;
}

// ---- per-step inputs ---------------------------------------------------------------------------
struct StepIn {
  Cols q, k;      // q' = q / |q| * scale, k' = k / |k| (this lane's columns)
  float kq;       // k' . q'
  float g, eg, beta;
};

// q, k of key head h, batch row brow for this lane's columns: l2-normalised, q scaled, k' . q' in in.kq.
template <typename A>
__device__ __forceinline__ void load_qk(StepIn& in, const Lane& c, const A* q, const A* k, int brow, int h) {
  const A* qh = q + ((size_t)brow * kHK + h) * kK;
  const A* kh = k + ((size_t)brow * kHK + h) * kK;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};  // |q|^2, |k|^2, q . k
#pragma unroll
  for (int v = 0; v < kVPL; ++v) {
    load4(qh + c.col(v), in.q[v]);
    load4(kh + c.col(v), in.k[v]);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc[0] = fmaf(in.q[v][e], in.q[v][e], acc[0]);
      acc[1] = fmaf(in.k[v][e], in.k[v][e], acc[1]);
      acc[2] = fmaf(in.q[v][e], in.k[v][e], acc[2]);
    }
  }
  const float mine = group_reduce<4>(acc);
  const float qq = from_group_lane(mine, 0), kk = from_group_lane(mine, 1), qk = from_group_lane(mine, 2);
  const float rq = kL2Norm ? rsqrtf(qq + kL2Eps) : 1.f, rk = kL2Norm ? rsqrtf(kk + kL2Eps) : 1.f;
  const float sq = rq * kScale;
#pragma unroll
  for (int v = 0; v < kVPL; ++v)
#pragma unroll
    for (int e = 0; e < 4; ++e) in.q[v][e] *= sq, in.k[v][e] *= rk;
  in.kq = qk * sq * rk;
}

// q, k of key head h, batch row brow (normalised), gates of value head hv.
template <typename A>
__device__ __forceinline__ void load_step(StepIn& in, const Lane& c, const A* q, const A* k, const A* a,
                                          const A* b, const float* A_log, const float* dt_bias, int brow,
                                          int h, int hv) {
  load_qk(in, c, q, k, brow, h);
  const size_t bh = (size_t)brow * kHV + hv;
  in.g = -expf(__ldg(A_log + hv)) * softplus(to_f(a[bh]) + __ldg(dt_bias + hv));
  in.eg = expf(in.g);
  in.beta = 1.f / (1.f + expf(-to_f(b[bh])));
}

// The output step for this thread's rows from per-row products P k and P q (P: the state before the
// token's decay, S0 or S_m), which the lane of dot index idx = l % (2 kRT) holds after the butterfly
// (idx < kRT: row idx's P k; else row idx - kRT's P q) and ``extra`` adds to (the buffer terms).
// Returns u of row (idx % kRT) on every lane; y of that row in *y.
__device__ __forceinline__ float output_step(float mine, const StepIn& in, float v_row, float* y) {
  const float other = __shfl_xor_sync(0xffffffffu, mine, kRT);
  const bool is_q = (threadIdx.x % kLPR) % (2 * kRT) >= kRT;
  const float pk = is_q ? other : mine, pq = is_q ? mine : other;
  const float u = in.beta * (v_row - in.eg * pk);
  *y = in.eg * pq + in.kq * u;
  return u;
}

// S <- exp(g) S + u k^T for this thread's rows; u of row r sits on lane r of the row group.
__device__ __forceinline__ void rank1_update(Rows& st, float u_mine, float eg, const Cols& k) {
#pragma unroll
  for (int r = 0; r < kRT; ++r) {
    const float u = from_group_lane(u_mine, r);
#pragma unroll
    for (int v = 0; v < kVPL; ++v)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[r][v][e] = fmaf(u, k[v][e], eg * st[r][v][e]);
  }
}
// S <- S + u k^T (no decay: the fold's lazy form).
__device__ __forceinline__ void rank1_add(Rows& st, float u_mine, const Cols& k) {
#pragma unroll
  for (int r = 0; r < kRT; ++r) {
    const float u = from_group_lane(u_mine, r);
#pragma unroll
    for (int v = 0; v < kVPL; ++v)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[r][v][e] = fmaf(u, k[v][e], st[r][v][e]);
  }
}

// The conventional step on registers: dots, u, y, update. Returns u of this lane's dot row.
__device__ __forceinline__ float conventional_rows(Rows& st, const StepIn& in, float v_row, float* y) {
  float acc[2 * kRT];
#pragma unroll
  for (int r = 0; r < kRT; ++r) acc[r] = dot_cols(st[r], in.k), acc[kRT + r] = dot_cols(st[r], in.q);
  const float u = output_step(group_reduce<2 * kRT>(acc), in, v_row, y);
  rank1_update(st, u, in.eg, in.k);
  return u;
}

template <typename T>
__device__ __forceinline__ void load_rows(Rows& st, const T* base, const Lane& c);
template <>
__device__ __forceinline__ void load_rows<float>(Rows& st, const float* base, const Lane& c) {
#pragma unroll
  for (int r = 0; r < kRT; ++r)
#pragma unroll
    for (int v = 0; v < kVPL; ++v) load_state4(base + (size_t)(c.rb + r) * kK + c.col(v), st[r][v]);
}
template <>
__device__ __forceinline__ void load_rows<__nv_bfloat16>(Rows& st, const __nv_bfloat16* base, const Lane& c) {
#pragma unroll
  for (int r = 0; r < kRT; ++r)
#pragma unroll
    for (int v = 0; v < kVPL; ++v) load_shadow4(base + (size_t)(c.rb + r) * kK + c.col(v), st[r][v]);
}
__device__ __forceinline__ void store_rows(const Rows& st, float* base, const Lane& c) {
#pragma unroll
  for (int r = 0; r < kRT; ++r)
#pragma unroll
    for (int v = 0; v < kVPL; ++v) store_state4(base + (size_t)(c.rb + r) * kK + c.col(v), st[r][v]);
}
__device__ __forceinline__ void store_shadow_rows(const Rows&, float*, const Lane&) {}  // no shadow (shadow_t = float)
__device__ __forceinline__ void store_shadow_rows(const Rows& st, __nv_bfloat16* base, const Lane& c) {
#pragma unroll
  for (int r = 0; r < kRT; ++r)
#pragma unroll
    for (int v = 0; v < kVPL; ++v) store_shadow4(base + (size_t)(c.rb + r) * kK + c.col(v), st[r][v]);
}

// The first copy of each dot index in a row group writes (lanes l < 2 kRT); duplicates stay silent.
__device__ __forceinline__ bool first_copy() { return (threadIdx.x % kLPR) < 2 * kRT; }
__device__ __forceinline__ int dot_row(const Lane& c) { return c.rb + c.l % kRT; }  // row of this lane's dot
__device__ __forceinline__ bool holds_y(const Lane& c) { return first_copy() && c.l % (2 * kRT) >= kRT; }
__device__ __forceinline__ bool holds_u(const Lane& c) { return first_copy() && c.l % (2 * kRT) < kRT; }

struct Coords {
  int b, hv, h, row0;
};
__device__ __forceinline__ Coords block_coords() {
  Coords p;
  p.b = blockIdx.y;
  p.hv = blockIdx.x / kChunks;
  p.row0 = (blockIdx.x % kChunks) * kRows;
  p.h = p.hv / kHPK;
  return p;
}

// ---- conventional ------------------------------------------------------------------------------
struct ConvArgs {
  const act_t *q, *k, *v, *a, *b;  // (batch, H, K) x2, (batch, HV, V), (batch, HV) x2
  const float *A_log, *dt_bias;    // (HV,)
  const int* sbi;                  // (batch,) slot per row, -1 = padding
  const float* state_in;           // (slots, HV, V, K)
  int batch, nslots;
  act_t* y;                        // (batch, HV, V)
  float* state_out;                // aliases state_in
};

__device__ __forceinline__ void conventional_step(const ConvArgs& a) {
  const Coords p = block_coords();
  const Lane c = lane_coords();
  const int slot = a.sbi[p.b];
  if (slot < 0 || slot >= a.nslots) return;  // padding (or an unchecked bad slot): nothing touched
  const size_t sh = ((size_t)slot * kHV + p.hv) * kV + p.row0;
  Rows st;
  load_rows(st, a.state_in + sh * kK, c);  // issued first: the loads fly while the inputs are prepared
  StepIn in;
  load_step(in, c, a.q, a.k, a.a, a.b, a.A_log, a.dt_bias, p.b, p.h, p.hv);
  const size_t yrow = ((size_t)p.b * kHV + p.hv) * kV + p.row0;
#pragma unroll
  for (int ps = 0; ps < kPasses; ++ps) {
    const Lane cp = in_pass(c, ps);
    if (ps > 0) load_rows(st, a.state_in + sh * kK, cp);
    const float v_row = to_f(a.v[yrow + dot_row(cp)]);
    float y;
    conventional_rows(st, in, v_row, &y);
    store_rows(st, a.state_out + sh * kK, cp);
    if (holds_y(cp)) a.y[yrow + dot_row(cp)] = from_f<act_t>(y);
  }
}

// ---- ReplaySSM ---------------------------------------------------------------------------------
struct ReplayArgs {
  const act_t *q, *k, *v, *a, *b;
  const float *A_log, *dt_bias;
  const int* sbi;              // (batch,)
  const int* cursor;           // (slots,) entries since the checkpoint, 0..L-1
  const float* state_in;       // (slots, HV, V, K) fp32 checkpoint
  const float* uc_in;          // (slots, HV, L, V) u_j
  const act_t* vc_in;          // (slots, HV, L, V) v_j
  const float* kc_in;          // (slots, H, L, K) k_j (normalised)
  const float* gc_in;          // (slots, HV, L) g_j
  const float* bc_in;          // (slots, HV, L) beta_j
  const shadow_t* sh_in;       // (slots, HV, V, K) bf16 shadow of the checkpoint, or null
  int batch, nslots;
  act_t* y;
  float* state_out;            // the outputs alias the inputs of the same name
  float* uc_out;
  act_t* vc_out;
  float* kc_out;
  float* gc_out;
  float* bc_out;
  shadow_t* sh_out;
};

constexpr int kUTile = (kL > 1 ? kL - 1 : 1) * kRows;  // u_j of the block's rows, j < L - 1
struct alignas(16) ReplaySmem {
  float u[kUTile];  // [j][row]
  float w[32];      // exp(G_m - G_j)
  float kd[32][2];  // (k_j . k', k_j . q') interleaved: a lane reads one of the pair, no bank conflict
  float eGm;        // exp(G_m)
};
// The flush's entries j < L - 1, staged by cp.async with the checkpoint loads, so the fold reads shared
// memory instead of waiting on a DRAM round trip per entry.
constexpr int kFE = kL > 1 ? kL - 1 : 1;
#if GDN_SHADOW
struct alignas(16) FlushSmem {  // the exact refold (fold_rows)
  float k[kFE][kK];      // k_j
  act_t v[kFE][kRows];   // v_j of the block's rows
  float g[32], beta[32];
};
#else
struct alignas(16) FlushSmem {  // the u-sum (usum_rows)
  float k[kFE][kK];      // k_j
  float u[kFE][kRows];   // u_j of the block's rows
  float w[32];           // exp(G_m - G_j)
  float eGm;             // exp(G_m)
};
#endif
// v rows of a block move as 16-byte vectors where they are whole vectors (small blocks: element-wise).
constexpr bool kVVectors = kRows * sizeof(act_t) % 16 == 0;
constexpr size_t kSmemBytes = sizeof(ReplaySmem) > sizeof(FlushSmem) ? sizeof(ReplaySmem) : sizeof(FlushSmem);

// Non-flush step at buffer position m = cursor (entries j < m buffered).
__device__ __forceinline__ void replay_nonflush(const ReplayArgs& a, const Coords& p, const Lane& c, int slot,
                                                int m, ReplaySmem& sm) {
  // The u tile first (cp.async holds no registers), then the checkpoint rows: both stream while the
  // inputs are prepared and the buffer scalars computed.
  const float* uh = a.uc_in + ((size_t)slot * kHV + p.hv) * kL * kV + p.row0;
  constexpr int kUVecRow = kRows / 4;
  for (int i = threadIdx.x; i < m * kUVecRow; i += kThreads) {
    const int j = i / kUVecRow, r4 = i % kUVecRow;
    cp_async16(&sm.u[j * kRows + r4 * 4], uh + (size_t)j * kV + r4 * 4);
  }
  const size_t sh = ((size_t)slot * kHV + p.hv) * kV + p.row0;
  Rows st;
  if constexpr (kShadow) load_rows(st, a.sh_in + sh * kK, c);
  else load_rows(st, a.state_in + sh * kK, c);
  // k_j of the entries this row group dots (all loads issued before the first use).
  constexpr int kGroups = kWarps * kRPW;
  constexpr int kIters = (kL - 1 + kGroups - 1) / kGroups;
  const int warp = threadIdx.x / 32;
  const int grp = warp * kRPW + c.lane / kLPR;
  const float* kch = a.kc_in + ((size_t)slot * kHK + p.h) * kL * kK;
  float kj[kIters > 0 ? kIters : 1][kVPL][4];
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int j = it * kGroups + grp;
#pragma unroll
    for (int v = 0; v < kVPL; ++v) {
      if (j < m) load4(kch + (size_t)j * kK + c.col(v), kj[it][v]);
      else kj[it][v][0] = kj[it][v][1] = kj[it][v][2] = kj[it][v][3] = 0.f;
    }
  }
  const float* gh = a.gc_in + ((size_t)slot * kHV + p.hv) * kL;
  const float gl = warp == 0 && c.lane < m ? __ldg(gh + c.lane) : 0.f;
  StepIn in;
  load_step(in, c, a.q, a.k, a.a, a.b, a.A_log, a.dt_bias, p.b, p.h, p.hv);
  const size_t yrow = ((size_t)p.b * kHV + p.hv) * kV + p.row0;
  const int row = dot_row(c);
  const act_t v_raw = a.v[yrow + row];
  if (warp == 0) {  // w_j = exp(G_m - G_j) = exp(sum_{j<i<m} g_i) by a suffix scan, exp(G_m)
    const float after = suffix_after(gl);  // gl = 0 on lanes >= m
    if (c.lane < m) sm.w[c.lane] = expf(after);
    if (c.lane == 0) sm.eGm = expf(gl + after);
  }
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int j = it * kGroups + grp;
    if (it * kGroups >= m) break;  // warp-uniform: the reduce needs every lane
    float acc[2] = {dot_cols(kj[it], in.k), dot_cols(kj[it], in.q)};
    const float d = group_reduce<2>(acc);
    if (j < m && c.l < 2) sm.kd[j][c.l] = d;
  }
  cp_async_wait_all();
  __syncthreads();
  // This lane's dot (row dot_row, k or q): exp(G_m) S0 x + sum_j w_j (k_j . x) u_j[row]. Pass 0 is the
  // one-pass module's code unchanged (its PTX is byte-identical to the GPU-validated one-pass kernel); a
  // second pass loads its checkpoint rows as soon as pass 0's dots have read theirs.
  const int is_q = c.l % (2 * kRT) >= kRT;
  float buf = 0.f;
#pragma unroll 4
  for (int j = 0; j < m; ++j) buf = fmaf(sm.w[j] * sm.kd[j][is_q], sm.u[j * kRows + row], buf);
  float acc[2 * kRT];
#pragma unroll
  for (int r = 0; r < kRT; ++r) acc[r] = dot_cols(st[r], in.k), acc[kRT + r] = dot_cols(st[r], in.q);
  if constexpr (kPasses > 1) {
    if constexpr (kShadow) load_rows(st, a.sh_in + sh * kK, in_pass(c, 1));
    else load_rows(st, a.state_in + sh * kK, in_pass(c, 1));
  }
  const float mine = fmaf(sm.eGm, group_reduce<2 * kRT>(acc), buf);
  float y;
  const float u = output_step(mine, in, to_f(v_raw), &y);
  // Append entry m: u, v per row; k per key head (its first value head's first chunk); g, beta per head.
  const size_t e = ((size_t)slot * kHV + p.hv) * kL + m;
  if (holds_u(c)) {
    a.uc_out[e * kV + p.row0 + row] = u;
    a.vc_out[e * kV + p.row0 + row] = v_raw;
  }
  if (holds_y(c)) a.y[yrow + row] = from_f<act_t>(y);
  if constexpr (kPasses > 1) {  // pass 1: the same dots for the rows kRowsPass further down
    const Lane c1 = in_pass(c, 1);
    const int row1 = dot_row(c1);
    const act_t v1 = a.v[yrow + row1];
    float buf1 = 0.f;
#pragma unroll 4
    for (int j = 0; j < m; ++j) buf1 = fmaf(sm.w[j] * sm.kd[j][is_q], sm.u[j * kRows + row1], buf1);
    float acc1[2 * kRT];
#pragma unroll
    for (int r = 0; r < kRT; ++r) acc1[r] = dot_cols(st[r], in.k), acc1[kRT + r] = dot_cols(st[r], in.q);
    float y1;
    const float u1 = output_step(fmaf(sm.eGm, group_reduce<2 * kRT>(acc1), buf1), in, to_f(v1), &y1);
    if (holds_u(c1)) {
      a.uc_out[e * kV + p.row0 + row1] = u1;
      a.vc_out[e * kV + p.row0 + row1] = v1;
    }
    if (holds_y(c1)) a.y[yrow + row1] = from_f<act_t>(y1);
  }
  if (p.row0 == 0 && p.hv % kHPK == 0 && warp == 0 && c.lane < kLPR) {
    float* kd = a.kc_out + (((size_t)slot * kHK + p.h) * kL + m) * kK;
#pragma unroll
    for (int v = 0; v < kVPL; ++v)
      *reinterpret_cast<float4*>(kd + c.col(v)) = make_float4(in.k[v][0], in.k[v][1], in.k[v][2], in.k[v][3]);
  }
  if (p.row0 == 0 && threadIdx.x == 0) a.gc_out[e] = in.g, a.bc_out[e] = in.beta;
}

// One row's columns of this lane from a shared-memory row of K floats.
__device__ __forceinline__ void smem_cols(Cols& out, const float* row, const Lane& c) {
#pragma unroll
  for (int v = 0; v < kVPL; ++v) {
    const float4 t = *reinterpret_cast<const float4*>(row + c.col(v));
    out[v][0] = t.x, out[v][1] = t.y, out[v][2] = t.z, out[v][3] = t.w;
  }
}

// Exact fold of m staged entries (fs.k[j], fs.v[j][row], fs.g[j], fs.beta[j]; FlushSmem here, the
// speculative module's FoldSmem) into this thread's rows: S <- exp(g_j) S + u_j k_j^T with
// u_j = beta_j (v_j - exp(g_j) S k_j). Lazy decay: the rows hold T with S_j = D_j T, so each entry costs
// one FMA per element for the dot and one for the update (T += (u / D_j) k_j); T is rescaled (and D reset)
// when D_j falls below kRenorm. D_j is per (slot, head), so the branch is block-uniform.
template <typename Smem>
__device__ __forceinline__ void fold_rows(Rows& st, const Smem& fs, const Lane& c, int m) {
  const int fold_row = c.rb + c.l % kRT;  // after a kRT-value butterfly, lane l holds row l % kRT
  float D = 1.f;
#pragma unroll 2
  for (int j = 0; j < m; ++j) {
    Cols kj;
    smem_cols(kj, fs.k[j], c);
    const float vj = to_f(fs.v[j][fold_row]);
    float acc[kRT];
#pragma unroll
    for (int r = 0; r < kRT; ++r) acc[r] = dot_cols(st[r], kj);
    const float Dj = D * expf(fs.g[j]);
    const float u = fs.beta[j] * (vj - Dj * group_reduce<kRT>(acc));
    if (Dj < kRenorm) {
#pragma unroll
      for (int r = 0; r < kRT; ++r)
#pragma unroll
        for (int v = 0; v < kVPL; ++v)
#pragma unroll
          for (int e = 0; e < 4; ++e) st[r][v][e] *= Dj;
      D = 1.f;
    } else {
      D = Dj;
    }
    rank1_add(st, u / D, kj);
  }
  if (D != 1.f) {
#pragma unroll
    for (int r = 0; r < kRT; ++r)
#pragma unroll
      for (int v = 0; v < kVPL; ++v)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[r][v][e] *= D;
  }
}

// S_m = exp(G_m) S0 + sum_j w_j u_j k_j^T for this thread's rows from the staged u_j (FlushSmem without a
// shadow): every entry is one FMA per element, and no entry waits on another.
template <typename Smem>
__device__ __forceinline__ void usum_rows(Rows& st, const Smem& fs, const Lane& c, int m) {
#pragma unroll
  for (int r = 0; r < kRT; ++r)
#pragma unroll
    for (int v = 0; v < kVPL; ++v)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[r][v][e] *= fs.eGm;
#pragma unroll 2
  for (int j = 0; j < m; ++j) {
    Cols kj;
    smem_cols(kj, fs.k[j], c);
    const float wj = fs.w[j];
#pragma unroll
    for (int r = 0; r < kRT; ++r) {
      const float u = wj * fs.u[j][c.rb + r];
#pragma unroll
      for (int v = 0; v < kVPL; ++v)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[r][v][e] = fmaf(u, kj[v][e], st[r][v][e]);
    }
  }
}

// Flush step (m = L - 1 entries buffered): the u-sum (no shadow) or the exact refold (bf16 shadow) from
// the fp32 checkpoint, then this token.
__device__ __forceinline__ void replay_flush(const ReplayArgs& a, const Coords& p, const Lane& c, int slot,
                                             FlushSmem& sm) {
  const size_t eh = ((size_t)slot * kHV + p.hv) * kL;
  const float* kch = a.kc_in + ((size_t)slot * kHK + p.h) * kL * kK;
  constexpr int kKVec = kK / 4, kVVec = kRows * (int)sizeof(act_t) / 16;
  if constexpr (kL > 1) {
    for (int i = threadIdx.x; i < (kL - 1) * kKVec; i += kThreads) cp_async16(&sm.k[0][0] + i * 4, kch + i * 4);
#if !GDN_SHADOW
    const float* uh = a.uc_in + eh * kV + p.row0;
    constexpr int kUVecRow = kRows / 4;
    for (int i = threadIdx.x; i < (kL - 1) * kUVecRow; i += kThreads) {
      const int j = i / kUVecRow, r4 = i % kUVecRow;
      cp_async16(&sm.u[j][r4 * 4], uh + (size_t)j * kV + r4 * 4);
    }
#else
    if constexpr (kVVectors) {
      for (int i = threadIdx.x; i < (kL - 1) * kVVec; i += kThreads) {
        const int j = i / kVVec, q = i % kVVec;
        cp_async16(reinterpret_cast<char*>(&sm.v[j][0]) + q * 16,
                   reinterpret_cast<const char*>(a.vc_in + (eh + j) * kV + p.row0) + q * 16);
      }
    } else {
      for (int i = threadIdx.x; i < (kL - 1) * kRows; i += kThreads)
        sm.v[i / kRows][i % kRows] = a.vc_in[(eh + i / kRows) * kV + p.row0 + i % kRows];
    }
    if (threadIdx.x < kL - 1) sm.g[threadIdx.x] = __ldg(a.gc_in + eh + threadIdx.x);
    else if (threadIdx.x >= 32 && threadIdx.x < 32 + kL - 1) sm.beta[threadIdx.x - 32] = __ldg(a.bc_in + eh + threadIdx.x - 32);
#endif
  }
  const size_t sh = ((size_t)slot * kHV + p.hv) * kV + p.row0;
  Rows st;
  load_rows(st, a.state_in + sh * kK, c);
  const size_t yrow = ((size_t)p.b * kHV + p.hv) * kV + p.row0;
#if !GDN_SHADOW
  // This token's inputs (the same for every pass) and pass 0's v go out with the ring and the rows, before any
  // wait: at small batch their DRAM trip after the barrier was the flush's second serial trip (ncu, bs1).
  const float gl = kL > 1 && threadIdx.x < kL - 1 ? __ldg(a.gc_in + eh + threadIdx.x) : 0.f;
  StepIn in;
  load_step(in, c, a.q, a.k, a.a, a.b, a.A_log, a.dt_bias, p.b, p.h, p.hv);
  const act_t v_raw0 = a.v[yrow + dot_row(c)];
  if (kL > 1 && threadIdx.x < 32) {  // w_j = exp(sum_{j<i<m} g_i) by a suffix scan, exp(G_m), as a non-flush step
    const float after = suffix_after(gl);
    if (threadIdx.x < kL - 1) sm.w[threadIdx.x] = expf(after);
    if (threadIdx.x == 0) sm.eGm = expf(gl + after);
  }
#endif
  cp_async_wait_all();
  __syncthreads();
  // The staged entries serve every pass; each pass folds, steps and stores its own rows.
#pragma unroll
  for (int ps = 0; ps < kPasses; ++ps) {
    const Lane cp = in_pass(c, ps);
    if (ps > 0) load_rows(st, a.state_in + sh * kK, cp);
#if GDN_SHADOW
    fold_rows(st, sm, cp, kL - 1);
    // This token's inputs after the fold: held across it they cost 40 bytes of spill (ptxas, 80 registers).
    StepIn in;
    load_step(in, cp, a.q, a.k, a.a, a.b, a.A_log, a.dt_bias, p.b, p.h, p.hv);
    const float v_now = to_f(a.v[yrow + dot_row(cp)]);
#else
    // The u-sum holds fewer registers than the refold: this token's inputs were loaded before the wait.
    const float v_now = to_f(ps == 0 ? v_raw0 : a.v[yrow + dot_row(cp)]);
    if constexpr (kL > 1) usum_rows(st, sm, cp, kL - 1);
#endif
    float y;
    conventional_rows(st, in, v_now, &y);
    store_rows(st, a.state_out + sh * kK, cp);
    if constexpr (kShadow) store_shadow_rows(st, a.sh_out + sh * kK, cp);
    if (holds_y(cp)) a.y[yrow + dot_row(cp)] = from_f<act_t>(y);
  }
}

__device__ __forceinline__ void replay_decode(const ReplayArgs& a) {
  __shared__ alignas(16) unsigned char smem[kSmemBytes];
#if GDN_ROW_ORDER  // a.sbi holds (row, slot, cursor, 0) in flush-first order (replayssm_flush_order): one load
  Coords p = block_coords();
  const int4 rs = reinterpret_cast<const int4*>(a.sbi)[blockIdx.y];
  p.b = rs.x;
  const int slot = rs.y;
  const Lane c = lane_coords();
  if (slot < 0 || slot >= a.nslots) return;
  const int pos = rs.z;  // the slot's cursor, read by the order kernel (no second dependent load)
#else
  const Coords p = block_coords();
  const Lane c = lane_coords();
  const int slot = a.sbi[p.b];
  if (slot < 0 || slot >= a.nslots) return;
  const int pos = a.cursor[slot];
#endif
  if (pos < 0 || pos >= kL) {  // unchecked bad cursor: NaN outputs, nothing else written
    for (int r = threadIdx.x; r < kRows; r += kThreads)
      a.y[((size_t)p.b * kHV + p.hv) * kV + p.row0 + r] = from_f<act_t>(__int_as_float(0x7fc00000));
    return;
  }
  if (pos + 1 == kL) replay_flush(a, p, c, slot, *reinterpret_cast<FlushSmem*>(smem));
  else replay_nonflush(a, p, c, slot, pos, *reinterpret_cast<ReplaySmem*>(smem));
}

}  // namespace gdn
