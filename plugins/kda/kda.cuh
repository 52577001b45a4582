// SPDX-License-Identifier: Apache-2.0
// Kimi Delta Attention (Kimi-K3, Kimi-Linear, GLM-5.3-Flash) decode: device math of the conventional step and
// of the fused ReplaySSM standard decode step. The spec is trtllm_replayssm/families/kda/reference.py (float64).
//
// The generated prelude (trtllm_replayssm/families/kda/config.py, KDASpec) defines, before this header:
//   act_t                      activations: q, k, v, f, b, y, and the k / v rings
//   ring_t                     the u ring: fp32 without a shadow (the flush sums it), bf16 with one
//   KDA_SHADOW                 0: none; 1: bf16 shadow of the checkpoint (read on non-flush steps, rewritten at the flush)
//   KDA_STAGED                 0: the non-flush step loads the ring to registers per entry; 1: stages it in shared
//                              memory by cp.async (stage_ring_kg / stage_ring_u; many-wave grids, KDASpec.staged)
//   KDA_PASSES                 1: one block a chunk of kCols value columns; 2 (staged decode modules): a block walks two
//                              chunks of its head under one channel stage, the second chunk's rows staged in shared
//                              memory by cp.async while the first is reduced (KDASpec.passes)
//   KDA_ROW_ORDER              0: block row blockIdx.y, its slot sbi[row], its cursor cursor[slot]; 1 (decode module):
//                              sbi points to (row, slot, cursor, 0) int4 rows in flush-first order (cursor.flush_order),
//                              so the flushing rows' long blocks run in the first waves (KDASpec.row_order)
//   KDA_LOWER_BOUND, kLowerBound  0: Kimi's gate; 1: GLM-5 Next's gate bounded below by kLowerBound
//   kH, kK, kV, kL             heads, key dim, value dim, ring length (2..16)
//   kCVL, kWarps, kMinBlocks   lanes across a state row's block columns (4 columns each), warps, resident blocks
//   kL2Norm, kScale            l2-normalise q and k; q scale
//
// Math per (slot, head), state S (K x V) fp32, the transformers / fla layout:
//   g = -exp(A_log) softplus(f + dt_bias)  (Kimi)  or  lb sigmoid(exp(A_log) (f + dt_bias))  (GLM-5 Next), per channel
//   beta = sigmoid(b); q, k l2-normalised, q *= scale
//   conventional: S <- Diag(exp g) S; u = beta (v - S^T k); y = S^T q + (k . q) u; S <- S + k u^T
// ReplaySSM at position m (entries j < m since the checkpoint S0; this token is entry m, D_{t,j} the decay from
// entry j to now, its exponent the per-channel suffix sum g_t + sum_{j<i<m} g_i, never a difference):
//   S_m^T D k = S0^T (D_{t,0} k) + sum_j (k_j . D_{t,j} k) u_j    (same with q)
//   u = beta (v - that),  y = (that for q) + (k . q) u
// so a non-flush step reads S0 (or its bf16 shadow) once for two vectors and appends (k raw, u, g, v, beta). The
// flush (entry L - 1 would be the L-th) brings the fp32 checkpoint to S_m, then steps this token and stores (and
// rewrites the shadow). With a bf16 shadow (bf16 u ring, whose u_j also carry the shadow's rounding) it refolds
// the L - 1 buffered (k_j, v_j, g_j, beta_j) by the exact recurrence (regrouped in chunks of kC entries:
// fold_step). Without one the u ring is fp32 and its u_j were computed from this same checkpoint, so S_m is
// their u-sum, S_m = Diag(P_m) S0 + sum_j n_j Diag(P_m / P_j) k_j u_j^T (P_j the product of exp g over entries
// <= j, per channel, formed as exp of the suffix sum): one FMA per state value and entry (usum_channel,
// usum_apply).
//
// Work split: one block per (batch row, head, chunk of kCols value columns); a warp owns 4 kCVL columns over all K
// rows, so every reduction over K stays in the warp (transposing butterflies over the kRG row groups, no block
// barrier inside the fold). A lane holds 4 consecutive columns of kRT rows (rows rg, rg + kRG, ...); a warp-wide
// load covers kRG rows x 16 kCVL contiguous bytes. Per-channel work (the gate, the K-wide decay-weighted products
// k_j . D_{t,j} k and k_j . D_{t,j} q of every buffered entry, the norms of the raw ring k) is spread over the
// block's threads by channel (thread i owns channel i: its suffix over the entries is a register loop), reduced
// once per block by transposing butterflies, and handed to the state lanes through shared memory with one
// barrier. Every chunk of a head repeats that per-channel work (no DRAM cost: L2 hits; the K exponentials per
// entry are the price of the per-channel gate).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/convert.cuh"
#include "common/cp_async.cuh"
#include "common/scan.cuh"
#include "common/warp.cuh"
#include "kda/gate.cuh"

#ifndef KDA_STAGED
#define KDA_STAGED 0
#endif
#ifndef KDA_SHADOW
#define KDA_SHADOW 0
#endif
#ifndef KDA_PASSES
#define KDA_PASSES 1
#endif
#ifndef KDA_ROW_ORDER
#define KDA_ROW_ORDER 0
#endif
#ifndef KDA_BULK
#define KDA_BULK 0  // 1: the module also holds kda_conventional_bulk and kda_replay_bulk (KDASpec.bulk)
#endif
#ifndef KDA_BULK_FLUSH
#define KDA_BULK_FLUSH 0  // 1: kda_replay_bulk folds its flush items in a dynamic shared-memory tile (KDASpec.bulk_flush)
#endif
#ifndef KDA_TOKENS
#define KDA_TOKENS 0  // 0: the decode module; T >= 1: the verify module (kda_spec.cuh), window of T tokens
#endif

namespace kda {

using rssm_common::from_f;
using rssm_common::to_f;
using rssm_common::transpose_reduce;
using rssm_common::cp_async16;
using rssm_common::cp_async8;
using rssm_common::cp_async_wait_all;
using rssm_common::cp_async_commit;
using rssm_common::cp_async_wait_group;

using rssm_common::pow2_at_least;

constexpr int kThreads = kWarps * 32;
constexpr bool kStaged = KDA_STAGED;  // KDASpec.staged: the non-flush step's ring through shared memory
constexpr int kRG = 32 / kCVL;               // row groups of a warp
constexpr int kRT = kK / kRG;                // rows per lane
constexpr int kWCols = 4 * kCVL;             // columns of a warp
constexpr int kCols = kWCols * kWarps;       // columns of a block
constexpr int kChunks = kV / kCols;
constexpr int kPasses = KDA_PASSES;          // chunks a block walks (its first: Coords::chunk)
constexpr int kE = kL - 1;                   // buffered entries at most (the flush step has kE)
constexpr int kEA = kE > 0 ? kE : 1;         // array extent
constexpr int kH1 = pow2_at_least(kE + 1);   // non-flush reduce: [0, kH1) k-side, [kH1, 2 kH1) q-side
constexpr int kN1 = 2 * kH1;
constexpr int kN2 = kH1;                     // entry norms, then k . q last
// Most entries one fold reads: the decode flush kE; a verify window of KDA_TOKENS = T folds at most L - T.
constexpr int kFE = KDA_TOKENS > 0 ? kL - KDA_TOKENS : kE;
constexpr int kFEA = kFE > 0 ? kFE : 1;
constexpr int kC = 4;                        // flush: entries folded per chunk
constexpr int kNC = (kFEA + kC - 1) / kC;    // chunks
constexpr int kGW = 16;                      // Gram slots a chunk: (j, i <= j) at gslot(j, i), k.k q.q k.q at kTS
constexpr int kTS = 10;
__host__ __device__ constexpr int gslot(int j, int i) { return j * (j + 1) / 2 + i; }
constexpr int kCPT = (kK + kThreads - 1) / kThreads;  // channels per thread
static_assert(kCVL == 2 || kCVL == 4, "kCVL: 2 or 4 lanes across a row (8 dot values per row group)");
static_assert(kK % kRG == 0 && kRT >= 1, "K must be a multiple of the row groups");
static_assert(kV % kCols == 0, "the block's columns must divide V");
static_assert(kPasses == 1 || (kPasses == 2 && kChunks % 2 == 0 && kStaged && KDA_TOKENS == 0),
              "KDA_PASSES 2: staged decode modules with an even number of chunks a head");
static_assert(kL >= 2 && kL <= 16, "ring length 2..16 (one warp butterfly holds 2 L values)");
static_assert(kN1 <= 32, "reduce width");
static_assert(gslot(kC - 1, kC - 1) < kTS && kTS + 3 <= kGW, "Gram slots");

using kda_gate::gate;  // gate.cuh
using kda_gate::rnorm;
using kda_gate::sigmoid;

// ---- state rows: 4 columns of kRT rows per lane, streamed once (evict-first) ----------------------------
using Rows = float[kRT][4];
__device__ __forceinline__ void load4(const float* p, float (&o)[4]) {
  const float4 t = __ldcs(reinterpret_cast<const float4*>(p));
  o[0] = t.x, o[1] = t.y, o[2] = t.z, o[3] = t.w;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&o)[4]) {
  const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(p));
  const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
  const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
  o[0] = __low2float(lo), o[1] = __high2float(lo), o[2] = __low2float(hi), o[3] = __high2float(hi);
}
__device__ __forceinline__ void store4(float* p, const float (&i)[4]) {
  __stcs(reinterpret_cast<float4*>(p), make_float4(i[0], i[1], i[2], i[3]));
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, const float (&i)[4]) {
  uint2 raw;
  *reinterpret_cast<__nv_bfloat162*>(&raw.x) = __floats2bfloat162_rn(i[0], i[1]);
  *reinterpret_cast<__nv_bfloat162*>(&raw.y) = __floats2bfloat162_rn(i[2], i[3]);
  __stcs(reinterpret_cast<uint2*>(p), raw);
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

struct Coords {
  int b, h, warp, lane, cv, rg;
  int chunk;  // the chunk of kCols value columns this pass covers
  int col;    // first of this lane's 4 columns
  __device__ int row(int r) const { return r * kRG + rg; }
};
__device__ __forceinline__ Coords coords() {
  Coords c;
  c.b = blockIdx.y;
  c.h = blockIdx.x / (kChunks / kPasses);
  c.warp = threadIdx.x / 32;
  c.lane = threadIdx.x % 32;
  c.cv = c.lane % kCVL;
  c.rg = c.lane / kCVL;
  c.chunk = (blockIdx.x % (kChunks / kPasses)) * kPasses;
  c.col = c.chunk * kCols + c.warp * kWCols + c.cv * 4;
  return c;
}
__device__ __forceinline__ Coords pass_coords(Coords c, int p) {  // the block's pass p (its chunk c.chunk + p)
  c.chunk += p;
  c.col += p * kCols;
  return c;
}
template <typename T>
__device__ __forceinline__ void load_rows(Rows& st, const T* base, const Coords& c) {  // base: (slot, h) of (K, V)
#pragma unroll
  for (int r = 0; r < kRT; ++r) load4(base + (size_t)c.row(r) * kV + c.col, st[r]);
}
template <typename T>
__device__ __forceinline__ void store_rows(const Rows& st, T* base, const Coords& c) {
#pragma unroll
  for (int r = 0; r < kRT; ++r) store4(base + (size_t)c.row(r) * kV + c.col, st[r]);
}

// The lane's two dots of its rows with two per-channel vectors xk, xq (K floats each, shared memory), reduced over the
// warp's row groups (the checkpoint's dots of every step): lane rg then holds column out_col, side out_kind.
__device__ __forceinline__ float row_dots(const Rows& st, const Coords& c, const float* xk, const float* xq) {
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
#pragma unroll
  for (int r = 0; r < kRT; ++r) {
    const int i = c.row(r);
    const float dk = xk[i], dq = xq[i];
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[2 * e] = fmaf(st[r][e], dk, acc[2 * e]), acc[2 * e + 1] = fmaf(st[r][e], dq, acc[2 * e + 1]);
  }
  return transpose_reduce<8, kCVL>(acc);
}

// After a transposing reduce of 8 values (column e, kind: 0 the k-side, 1 the q-side, index 2 e + kind) a lane
// holds index rg % 8; lanes rg < 8 are the first copies and write.
__device__ __forceinline__ int out_col(const Coords& c) { return c.col + (c.rg % 8) / 2; }
__device__ __forceinline__ int out_kind(const Coords& c) { return c.rg & 1; }
__device__ __forceinline__ bool first_copy(const Coords& c) { return c.rg < 8; }
// u of column e back to every lane of the column group: it lives on lane rg = 2 e (kind 0) of the same cv.
__device__ __forceinline__ void gather_u(float u, float (&ue)[4], const Coords& c) {
#pragma unroll
  for (int e = 0; e < 4; ++e) ue[e] = __shfl_sync(0xffffffffu, u, 2 * e * kCVL + c.cv);
}

// ---- arguments ------------------------------------------------------------------------------------------
struct Args {
  const act_t *q, *k, *v, *f, *b;  // (batch, H, K) x2, (batch, H, V), (batch, H, K), (batch, H)
  const float *A_log, *dt_bias;    // (H,), (H, K)
  const int* sbi;                  // (batch,) slot per row, -1 = padding
  const int* cursor;               // (slots,) entries since the checkpoint (replay only)
  const float* state_in;           // (slots, H, K, V) fp32 checkpoint
  const act_t* kc_in;              // (slots, H, L, K) raw k_j
  const ring_t* uc_in;             // (slots, H, L, V) u_j
  const float* gc_in;              // (slots, H, L, K) g_j
  const act_t* vc_in;              // (slots, H, L, V) v_j
  const float* bc_in;              // (slots, H, L) beta_j
  const __nv_bfloat16* sh_in;      // (slots, H, K, V) bf16 shadow, or null
  int batch, nslots;
  act_t* y;                        // (batch, H, V)
  float* state_out;                // the outputs alias the inputs of the same name
  act_t* kc_out;
  ring_t* uc_out;
  float* gc_out;
  act_t* vc_out;
  float* bc_out;
  __nv_bfloat16* sh_out;
};

// The rows a replay step reads (the non-flush step, a verify window without a fold): the fp32 checkpoint's, or
// with a shadow the shadow's.
#if KDA_SHADOW
using step_t = __nv_bfloat16;
__device__ __forceinline__ const __nv_bfloat16* step_rows(const Args& a, size_t hs) { return a.sh_in + hs * kK * kV; }
#else
using step_t = float;
__device__ __forceinline__ const float* step_rows(const Args& a, size_t hs) { return a.state_in + hs * kK * kV; }
#endif

// Shared memory. The token tile: per channel exp(g) k, exp(g) q (raw, the norms enter after the reduce), exp(g),
// k raw. The fold tile (flush) adds, per channel and chunk of kC entries, the decayed keys of the chunk's dots and of
// its rank-kC update (float4: one load a row for the chunk), the chunk's decay, the block's v_j columns, beta_j, the
// warp's dots S^T w_j and the Gram entries k_i . D k_j of each chunk (block partials, then totals).
struct alignas(16) TokenSmem {
  float ak[kK], aq[kK], al[kK], kr[kK];
};
struct alignas(16) FoldSmem {
  static constexpr bool kUsum = false;
  TokenSmem tok;
  float4 wk[kK][kNC];          // pass 1: exp(g_j); then (prod_{s0 <= l <= j} exp g_l) k_j raw, j = s0 + component
  float4 dk[kK][kNC];          // pass 1: k_j raw; then (prod_{j < l < s0 + kC} exp g_l) k_j raw
  float pc[kNC][kK];           // prod over the chunk of exp g_l
  float v[kFEA][kCols];        // v_j of the block's columns
  float beta[kFEA];
  // S^T w_j of the warp's columns (k_j raw: times 1 / ||k_j|| in the solve). 16-byte aligned: a lane reads its 4
  // columns as one vector; behind beta[kFEA] unaligned (kFEA % 4 != 0), ptxas widened that read to the aligned
  // vector below plus a word, i.e. the previous warp's last column, which compute-sanitizer's racecheck reported as
  // a cross-warp hazard (K = 256, L = 2: bench/NOTES.md "The fold tile's alignment"; the extra word was unused).
  alignas(16) float bs[kWarps][kFEA][kWCols];
  float red[kWarps][kNC * kGW];
  float gram[kNC * kGW];
};
struct alignas(16) ReplaySmem {
  float e0k[kK], e0q[kK];   // D_{t,0} k, D_{t,0} q (raw)
  float red1[kWarps][kN1], red2[kWarps][kN2];
};
// KDA_STAGED: the buffered entries j < m, staged by cp.async: g_j, raw k_j per channel, u_j of the block's columns
// (every pass's). KDA_PASSES 2: the second pass's rows, each lane's 4 columns of its kRT rows where the lane reads
// them back (row r of thread t at rows[r][t]: the copies and the reads are the lane's own, no barrier).
struct alignas(16) StagedSmem : ReplaySmem {
  alignas(16) float g[kEA][kK];
  alignas(16) act_t kr[kEA][kK];
  alignas(16) ring_t u[kEA][kCols * kPasses];
  alignas(16) step_t rows[kPasses > 1 ? kRT : 1][kPasses > 1 ? kThreads : 1][4];
};
static_assert(!kStaged || (kK * sizeof(act_t) % 16 == 0 && kCols * sizeof(ring_t) % 16 == 0 &&
                           kV * sizeof(ring_t) % 16 == 0), "the ring's rows must be whole 16-byte vectors (cp.async)");
// The u-sum flush (no shadow): per channel the coefficient of every entry (raw k_j times its decay to the end, the
// row stride padded so the 8 rows a warp reads at once hit distinct banks), the whole decay, the block's fp32 u_j
// columns, the per-entry norms' partials with the token's three sums.
constexpr int kCS4 = (kEA + 3) / 4 * 4;
constexpr int kCS = kCS4 % 8 == 0 ? kCS4 + 4 : kCS4;
constexpr int kNU = pow2_at_least(kH1 + 3);   // [0, kE) entry norms, kH1 .. kH1 + 2 the token's k.k, q.q, k.q
struct alignas(16) UsumSmem {
  static constexpr bool kUsum = true;
  TokenSmem tok;
  float cf[kK][kCS];
  float dall[kK];
  float u[kEA][kCols];
  float red[kWarps][kNU];
};
constexpr size_t kFoldBytes = sizeof(FoldSmem) > sizeof(UsumSmem) ? sizeof(FoldSmem) : sizeof(UsumSmem);
constexpr size_t kReplayBytes = kStaged ? sizeof(StagedSmem) : sizeof(ReplaySmem);
constexpr size_t kSmemBytes = kFoldBytes > kReplayBytes ? kFoldBytes : kReplayBytes;

__device__ __forceinline__ float comp(const float4& x, int i) { return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w; }

// ---- the exact fold of m ring entries (the decode flush; a verify window's flush) -----------------------------
// S <- the exact recurrence over entries j < m at ring indices (start + j) % L, in chunks of kC (the WY / chunked
// form of the delta rule, exact in real arithmetic): with S the state before the chunk,
// P_j = prod_{s0 <= l <= j} Diag(exp g_l), n_j = 1 / ||k_j||,
//   b_j = n_j S^T (P_j k_j),   A_ji = n_i n_j k_i . (P_j / P_i) k_j  (i < j; the ratio as the product over i < l <= j)
//   u_j = beta_j (v_j - b_j - sum_{i<j} A_ji u_i)        (forward substitution, per column, in registers)
//   S <- P_end S + sum_j n_j (P_end / P_j) k_j u_j^T      (one rank-kC update)
// which is the entry-by-entry recurrence u_j = beta_j (v_j - (Diag(exp g_j) S_{j-1})^T k_j), S_j = ... + k_j u_j^T
// regrouped: the chunk's dots and its update each become one pass over the state registers, and the dependent
// chain of reductions goes from one per entry to one per chunk. Three stages around the caller's channel loop and
// barrier: fold_channel (per channel, in the caller's channel loop), fold_gram (after it), fold_apply (after a
// barrier). m and start are block-uniform; the decode flush passes the constants kE and 0.
__device__ __forceinline__ int ring_at(int start, int j) {  // start in [0, L), j < L
  const int r = start + j;
  return r < kL ? r : r - kL;
}

// Pass 1 for channel i: every entry's loads in flight together; the same thread reads them back in fold_gram.
__device__ __forceinline__ void fold_channel(const Args& a, size_t hs, int i, int m, int start, FoldSmem& sm) {
#pragma unroll
  for (int q = 0; q < kNC; ++q) {
    float e[kC], kr[kC];
#pragma unroll
    for (int jj = 0; jj < kC; ++jj) {
      const int j = q * kC + jj;
      const size_t at = (hs * kL + ring_at(start, j < m ? j : 0)) * kK + i;
      e[jj] = j < m ? expf(__ldg(a.gc_in + at)) : 0.f;
      kr[jj] = j < m ? to_f(a.kc_in[at]) : 0.f;
    }
    sm.wk[i][q] = make_float4(e[0], e[1], e[2], e[3]);
    sm.dk[i][q] = make_float4(kr[0], kr[1], kr[2], kr[3]);
  }
}

// Pass 2, per chunk: v_j of the block's columns, beta_j, the decayed keys and the Gram partials (slot gslot(j, i),
// i <= j), reduced over each warp into sm.red; the caller's token partials (k.k, q.q, k.q) ride in chunk 0's kTS.
__device__ __forceinline__ void fold_gram(const Args& a, const Coords& c, size_t hs, int m, int start,
                                          const float (&tk)[3], FoldSmem& sm) {
  const int chunk0 = c.chunk * kCols;
  for (int i = threadIdx.x; i < m * kCols; i += kThreads) {
    const int j = i / kCols, cc = i % kCols;
    sm.v[j][cc] = to_f(a.vc_in[(hs * kL + ring_at(start, j)) * kV + chunk0 + cc]);
  }
  if (threadIdx.x < m) sm.beta[threadIdx.x] = __ldg(a.bc_in + hs * kL + ring_at(start, threadIdx.x));
#pragma unroll
  for (int q = 0; q < kNC; ++q) {
    float gr[kGW];
#pragma unroll
    for (int s = 0; s < kGW; ++s) gr[s] = 0.f;
    if (q == 0) gr[kTS] = tk[0], gr[kTS + 1] = tk[1], gr[kTS + 2] = tk[2];
#pragma unroll
    for (int n = 0; n < kCPT; ++n) {
      const int i = threadIdx.x + n * kThreads;
      if (kK % kThreads == 0 || i < kK) {
        const float4 e4 = sm.wk[i][q], k4 = sm.dk[i][q];
        float e[kC], kr[kC], w[kC], d[kC];
#pragma unroll
        for (int jj = 0; jj < kC; ++jj) e[jj] = comp(e4, jj), kr[jj] = comp(k4, jj);
        float p = 1.f;
#pragma unroll
        for (int jj = 0; jj < kC; ++jj) p *= (q * kC + jj < m ? e[jj] : 1.f), w[jj] = p * kr[jj];
        float sfx = 1.f;
#pragma unroll
        for (int jj = kC - 1; jj >= 0; --jj) d[jj] = sfx * kr[jj], sfx *= (q * kC + jj < m ? e[jj] : 1.f);
        sm.wk[i][q] = make_float4(w[0], w[1], w[2], w[3]);
        sm.dk[i][q] = make_float4(d[0], d[1], d[2], d[3]);
        sm.pc[q][i] = p;
#pragma unroll
        for (int ii = 0; ii < kC; ++ii) {
          gr[gslot(ii, ii)] = fmaf(kr[ii], kr[ii], gr[gslot(ii, ii)]);
          float run = kr[ii];
#pragma unroll
          for (int jj = ii + 1; jj < kC; ++jj) run *= e[jj], gr[gslot(jj, ii)] = fmaf(run, kr[jj], gr[gslot(jj, ii)]);
        }
      }
    }
    const float r = transpose_reduce<kGW, 1>(gr);
    if (c.lane < kGW) sm.red[c.warp][q * kGW + c.lane] = r;
  }
}

// After a barrier: the Gram totals (one more barrier), then per chunk the dots S^T w_j, the forward substitution
// and the rank-kC update of the state registers. sm.gram[kTS ..] then holds the caller's token sums.
__device__ __forceinline__ void fold_chunks(const Coords& c, Rows& st, int m, FoldSmem& sm);
__device__ __forceinline__ void fold_apply(const Coords& c, Rows& st, int m, FoldSmem& sm) {
  for (int t = threadIdx.x; t < kNC * kGW; t += kThreads) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += sm.red[w][t];
    sm.gram[t] = s;
  }
  __syncthreads();
  fold_chunks(c, st, m, sm);
}
// The fold's chunks on this lane's rows and columns (the Gram totals in sm.gram): per chunk the dots S^T w_j, the
// forward substitution and the rank-kC update.
__device__ __forceinline__ void fold_chunks(const Coords& c, Rows& st, int m, FoldSmem& sm) {
  const int bcol = c.col - c.chunk * kCols;  // block column of this lane's first column
#pragma unroll
  for (int q = 0; q < kNC; ++q) {
    if (q * kC >= m) break;  // block-uniform
    const int cs = m - q * kC < kC ? m - q * kC : kC;
    float acc[kC][4];
#pragma unroll
    for (int jj = 0; jj < kC; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[jj][e] = 0.f;
#pragma unroll
    for (int r = 0; r < kRT; ++r) {
      const float4 w4 = sm.wk[c.row(r)][q];
#pragma unroll
      for (int jj = 0; jj < kC; ++jj) {
        if (jj < cs) {
          const float w = comp(w4, jj);
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[jj][e] = fmaf(st[r][e], w, acc[jj][e]);
        }
      }
    }
#pragma unroll
    for (int jj = 0; jj < kC; jj += 2) {
      if (jj < cs) {
        float t8[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) t8[e] = acc[jj][e], t8[4 + e] = jj + 1 < cs ? acc[jj + 1][e] : 0.f;
        const float r8 = transpose_reduce<8, kCVL>(t8);  // lane rg: entry jj + (rg % 8) / 4, column cv 4 + rg % 4
        const int jw = jj + (c.rg % 8) / 4;
        if (c.rg < 8 && jw < cs) sm.bs[c.warp][q * kC + jw][c.cv * 4 + c.rg % 4] = r8;
      }
    }
    __syncwarp();
    // Forward substitution for the lane's 4 columns; uu = u_j n_j (the update multiplies raw k_j).
    float uu[kC][4], nrm[kC];
#pragma unroll
    for (int jj = 0; jj < kC; ++jj) {
      if (jj < cs) {
        const int j = q * kC + jj;
        nrm[jj] = rnorm(sm.gram[q * kGW + gslot(jj, jj)]);
        const float bj = sm.beta[j];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          // n_j (b_raw + sum_i gram_ji n_i u_i): A_ji u_i = gram_ji n_j (n_i u_i)
          float t = sm.bs[c.warp][j][c.cv * 4 + e];
#pragma unroll
          for (int ii = 0; ii < jj; ++ii) t = fmaf(sm.gram[q * kGW + gslot(jj, ii)], uu[ii][e], t);
          uu[jj][e] = bj * (sm.v[j][bcol + e] - nrm[jj] * t) * nrm[jj];
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRT; ++r) {
      const float p = sm.pc[q][c.row(r)];
      const float4 d4 = sm.dk[c.row(r)][q];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float s = st[r][e] * p;
#pragma unroll
        for (int jj = 0; jj < kC; ++jj)
          if (jj < cs) s = fmaf(comp(d4, jj), uu[jj][e], s);
        st[r][e] = s;
      }
    }
  }
}

// ---- the u-sum of kE entries (the no-shadow decode flush: fp32 u ring) ---------------------------------------
// Channel i: entry j's coefficient exp(sum_{j<l<kE} g_l[i]) k_j[i] (raw; the norm n_j enters in usum_apply), the whole
// decay exp(sum_l g_l[i]), and |k_j|^2 partials into r (slots [0, kE)).
__device__ __forceinline__ void usum_channel(const Args& a, size_t hs, int i, float (&r)[kNU], UsumSmem& sm) {
  float kr[kEA], g[kEA];
#pragma unroll
  for (int j = 0; j < kE; ++j) {
    const size_t at = (hs * kL + j) * kK + i;
    kr[j] = to_f(a.kc_in[at]), g[j] = __ldg(a.gc_in + at);
  }
  float run = 0.f;
#pragma unroll
  for (int j = kE - 1; j >= 0; --j) {
    sm.cf[i][j] = expf(run) * kr[j];
    r[j] = fmaf(kr[j], kr[j], r[j]);
    run += g[j];
  }
  sm.dall[i] = expf(run);
}

// The block's u_j columns (fp32) into shared memory by cp.async (waited for before the barrier).
__device__ __forceinline__ void usum_stage_u(const Args& a, size_t hs, int chunk, UsumSmem& sm) {
  const int chunk0 = chunk * kCols;
  constexpr int kQ = kCols / 4;
  for (int t = threadIdx.x; t < kE * kQ; t += kThreads) {
    const int j = t / kQ, q = t % kQ;
    cp_async16(&sm.u[j][q * 4], a.uc_in + (hs * kL + j) * kV + chunk0 + q * 4);
  }
}

// After the barrier: S <- Diag(P) S + sum_j n_j c_j u_j^T on this lane's rows and 4 columns.
__device__ __forceinline__ void usum_apply(const Coords& c, Rows& st, UsumSmem& sm) {
  const int bcol = c.col - c.chunk * kCols;
#pragma unroll
  for (int r = 0; r < kRT; ++r) {
    const float p = sm.dall[c.row(r)];
#pragma unroll
    for (int e = 0; e < 4; ++e) st[r][e] *= p;
  }
#pragma unroll
  for (int j0 = 0; j0 < kE; j0 += 4) {
    float un[4][4];  // n_j u_j of this lane's columns, entries j0 .. j0 + 3
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      if (j0 + jj < kE) {
        float ss = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) ss += sm.red[w][j0 + jj];
        const float n = rnorm(ss);
        const float4 u4 = *reinterpret_cast<const float4*>(&sm.u[j0 + jj][bcol]);
        un[jj][0] = n * u4.x, un[jj][1] = n * u4.y, un[jj][2] = n * u4.z, un[jj][3] = n * u4.w;
      }
    }
#pragma unroll
    for (int r = 0; r < kRT; ++r) {
      const float4 c4 = *reinterpret_cast<const float4*>(&sm.cf[c.row(r)][j0]);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        if (j0 + jj < kE) {
          const float cj = comp(c4, jj);
#pragma unroll
          for (int e = 0; e < 4; ++e) st[r][e] = fmaf(cj, un[jj][e], st[r][e]);
        }
      }
    }
  }
}

// Channel i of this token: its tile entries (exp(g) k, exp(g) q, exp(g), raw k) and its k.k, q.q, k.q partials.
__device__ __forceinline__ void token_channel(int i, float kt, float qt, float al, TokenSmem& tok, float (&tk)[3]) {
  tok.ak[i] = al * kt, tok.aq[i] = al * qt, tok.al[i] = al, tok.kr[i] = kt;
  tk[0] += kt * kt, tk[1] += qt * qt, tk[2] += kt * qt;
}

// ---- the fold + token step: the conventional step (kFlush false) and the flush (kE buffered entries) ---------
// S <- the exact fold of the kE buffered entries (ring indices 0 .. kE - 1), then this token; y written; S stored
// (and the shadow).
// Smem: FoldSmem (the conventional step; the flush by the exact refold) or UsumSmem (the flush by the u-sum).
__device__ __forceinline__ void token_tail(const Args& a, const Coords& c, size_t hs, Rows& st, float beta,
                                           float v_now, float kk, float qq, float kqr, bool write_shadow,
                                           const TokenSmem& tok);
template <bool kFlush, typename Smem>
__device__ __forceinline__ void fold_step(const Args& a, const Coords& c, int slot, bool write_shadow, Smem& sm) {
  constexpr bool kUsum = kFlush && Smem::kUsum;
  const size_t hs = (size_t)slot * kH + c.h;
  Rows st;
  load_rows(st, a.state_in + hs * kK * kV, c);  // issued first: the stream flies while the channels are prepared
  if constexpr (kUsum) usum_stage_u(a, hs, c.chunk, sm);
  const float A = expf(__ldg(a.A_log + c.h));
  const size_t in = (size_t)c.b * kH + c.h;
  // The u-sum flush issues v and beta with the rows (they would otherwise go out after its cp.async wait); the
  // refold and the conventional step keep them after the channel stage (registers across the fold).
  act_t v_raw, b_raw;
  if constexpr (kUsum) v_raw = a.v[in * kV + out_col(c)], b_raw = a.b[in];
  float tk[3] = {0.f, 0.f, 0.f};  // k.k, q.q, k.q partials
  float ru[kUsum ? kNU : 1];      // the u-sum's entry norm partials
#pragma unroll
  for (int t = 0; t < (kUsum ? kNU : 1); ++t) ru[t] = 0.f;
#pragma unroll
  for (int n = 0; n < kCPT; ++n) {
    const int i = threadIdx.x + n * kThreads;
    if (kK % kThreads == 0 || i < kK) {
      const float kt = to_f(a.k[in * kK + i]), qt = to_f(a.q[in * kK + i]);
      const float al = expf(gate(to_f(a.f[in * kK + i]), __ldg(a.dt_bias + (size_t)c.h * kK + i), A));
      token_channel(i, kt, qt, al, sm.tok, tk);
      if constexpr (kUsum) usum_channel(a, hs, i, ru, sm);
      else if constexpr (kFlush) fold_channel(a, hs, i, kE, 0, sm);
    }
  }
  if constexpr (kUsum) {
    ru[kH1] = tk[0], ru[kH1 + 1] = tk[1], ru[kH1 + 2] = tk[2];
    const float r = transpose_reduce<kNU, 1>(ru);
    if (c.lane < kNU) sm.red[c.warp][c.lane] = r;
    cp_async_wait_all();
  } else if constexpr (kFlush) {
    fold_gram(a, c, hs, kE, 0, tk, sm);
  } else {
    float t4[4] = {tk[0], tk[1], tk[2], 0.f};
    const float r = transpose_reduce<4, 1>(t4);
    if (c.lane < 3) sm.red[c.warp][kTS + c.lane] = r;
  }
  if constexpr (!kUsum) v_raw = a.v[in * kV + out_col(c)], b_raw = a.b[in];
  const float beta = sigmoid(to_f(b_raw));
  const float v_now = to_f(v_raw);
  __syncthreads();
  float kk = 0.f, qq = 0.f, kqr = 0.f;
  if constexpr (kUsum) {
    usum_apply(c, st, sm);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) kk += sm.red[w][kH1], qq += sm.red[w][kH1 + 1], kqr += sm.red[w][kH1 + 2];
  } else if constexpr (kFlush) {
    fold_apply(c, st, kE, sm);
    kk = sm.gram[kTS], qq = sm.gram[kTS + 1], kqr = sm.gram[kTS + 2];
  } else {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) kk += sm.red[w][kTS], qq += sm.red[w][kTS + 1], kqr += sm.red[w][kTS + 2];
  }
  token_tail(a, c, hs, st, beta, v_now, kk, qq, kqr, write_shadow, sm.tok);
}

// This token on the folded rows (the flush) or the checkpoint's (the conventional step): the two dots of
// Diag(exp g) S, then u, y, the rank-1 update of the rows in registers. kk, qq, kqr: the token's k.k, q.q, k.q.
__device__ __forceinline__ void token_update(const Args& a, const Coords& c, Rows& st, float beta, float v_now,
                                             float kk, float qq, float kqr, const TokenSmem& tok) {
  const size_t in = (size_t)c.b * kH + c.h;
  const float rk = rnorm(kk), rq = rnorm(qq) * kScale;
  const float d = row_dots(st, c, tok.ak, tok.aq);
  const int kind = out_kind(c);
  const float u0 = beta * (v_now - d * rk);  // meaningful on kind 0 lanes
  const float u = __shfl_xor_sync(0xffffffffu, u0, kCVL);  // kind 1 lanes: their column's u
  if (first_copy(c) && kind) a.y[in * kV + out_col(c)] = from_f<act_t>(d * rq + kqr * rk * rq * u);
  float ue[4];
  gather_u(u0, ue, c);
#pragma unroll
  for (int r = 0; r < kRT; ++r) {
    const int i = c.row(r);
    const float al = tok.al[i], kn = tok.kr[i] * rk;
#pragma unroll
    for (int e = 0; e < 4; ++e) st[r][e] = fmaf(al, st[r][e], kn * ue[e]);
  }
}
// token_update, then the rows stored (and the shadow).
__device__ __forceinline__ void token_tail(const Args& a, const Coords& c, size_t hs, Rows& st, float beta,
                                           float v_now, float kk, float qq, float kqr, bool write_shadow,
                                           const TokenSmem& tok) {
  token_update(a, c, st, beta, v_now, kk, qq, kqr, tok);
  store_rows(st, a.state_out + hs * kK * kV, c);
  if constexpr (KDA_SHADOW) {
    if (write_shadow) store_rows(st, a.sh_out + hs * kK * kV, c);
  }
}

// KDA_PASSES 2 with a shadow: the flush's second pass. The fold's per-channel tiles (the decayed keys, the chunk
// decays, the Gram totals, the token's tile and sums) belong to the head and stay from the first pass (fold_step);
// this pass loads its chunk's fp32 rows and v_j columns, applies the fold and steps the token.
__device__ __forceinline__ void fold_step_next(const Args& a, const Coords& c, int slot, FoldSmem& sm) {
  const size_t hs = (size_t)slot * kH + c.h;
  Rows st;
  load_rows(st, a.state_in + hs * kK * kV, c);
  const size_t in = (size_t)c.b * kH + c.h;
  const act_t v_raw = a.v[in * kV + out_col(c)], b_raw = a.b[in];
  __syncthreads();  // the first pass has read sm.v and sm.bs
  const int chunk0 = c.chunk * kCols;
  for (int i = threadIdx.x; i < kE * kCols; i += kThreads) {
    const int j = i / kCols, cc = i % kCols;
    sm.v[j][cc] = to_f(a.vc_in[(hs * kL + j) * kV + chunk0 + cc]);
  }
  __syncthreads();
  fold_chunks(c, st, kE, sm);
  token_tail(a, c, hs, st, sigmoid(to_f(b_raw)), to_f(v_raw), sm.gram[kTS], sm.gram[kTS + 1], sm.gram[kTS + 2], true,
             sm.tok);
}

// ---- the non-flush ReplaySSM step at position m (entries j < m) ---------------------------------------------
template <int N>
__device__ __forceinline__ void zero(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) r[i] = 0.f;
}
// The warp's channel-stage partials (entry dots and norms) into shared memory, one lane a value.
__device__ __forceinline__ void store_partials(float (&r1)[kN1], float (&r2)[kN2], const Coords& c, ReplaySmem& sm) {
  const float t1 = transpose_reduce<kN1, 1>(r1);
  const float t2 = transpose_reduce<kN2, 1>(r2);
  if (c.lane < kN1) sm.red1[c.warp][c.lane] = t1;
  if (c.lane < kN2) sm.red2[c.warp][c.lane] = t2;
}

// The non-flush step after its barrier (both ring paths): the norms and entry weights from the warps' partials, the
// checkpoint's two dots, the buffered entries' term (uterm: d + sum_{j<m} coef_j u_j on the lane's side), u, y and the
// appended entry.
template <typename UTerm>
__device__ __forceinline__ void nonflush_out(const Args& a, const Coords& c, size_t hs, int m, const Rows& st,
                                             const ReplaySmem& sm, act_t v_raw, float beta, int ocol, int kind,
                                             bool writer, UTerm uterm) {
  const size_t in = (size_t)c.b * kH + c.h;
  float t1 = 0.f, t2 = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t1 += sm.red1[w][c.lane % kN1], t2 += sm.red2[w][c.lane % kN2];
  const float rk = rnorm(__shfl_sync(0xffffffffu, t1, kH1 - 1));
  const float rq = rnorm(__shfl_sync(0xffffffffu, t1, kN1 - 1)) * kScale;
  const float kq = __shfl_sync(0xffffffffu, t2, kN2 - 1) * rk * rq;
  // lane l < kN1: the weight of entry l % kH1 on its side (k . D k_t or k . D q_t, every norm applied)
  const float rj = rnorm(__shfl_sync(0xffffffffu, t2, c.lane % kH1));
  const float coef = t1 * rj * (c.lane < kH1 ? rk : rq);
  float d = row_dots(st, c, sm.e0k, sm.e0q) * (kind ? rq : rk);
  d = uterm(d, coef, kind);
  const float u0 = beta * (to_f(v_raw) - d);
  const float u = __shfl_xor_sync(0xffffffffu, u0, kCVL);
  if (first_copy(c)) {
    if (kind) {
      a.y[in * kV + ocol] = from_f<act_t>(d + kq * u);
    } else {
      a.uc_out[(hs * kL + m) * kV + ocol] = from_f<ring_t>(u0);
      a.vc_out[(hs * kL + m) * kV + ocol] = v_raw;
    }
  }
  if (writer && threadIdx.x == 0) a.bc_out[hs * kL + m] = beta;
}

__device__ __forceinline__ void replay_nonflush(const Args& a, const Coords& c, int slot, int m, ReplaySmem& sm) {
  const size_t hs = (size_t)slot * kH + c.h;
  Rows st;
  load_rows(st, step_rows(a, hs), c);
  const int ocol = out_col(c), kind = out_kind(c);
  float uh[kEA];  // u_j of this lane's output column
#pragma unroll
  for (int j = 0; j < kEA; ++j) uh[j] = j < m ? to_f(a.uc_in[(hs * kL + j) * kV + ocol]) : 0.f;
  const size_t in = (size_t)c.b * kH + c.h;
  // v and beta are first used after the barrier. Without a shadow they are issued now, their DRAM trip with the
  // rows' (at small batch a load issued after the channel stage was a second serial trip). The shadow step measured
  // slower with them early (H100, 2026-12-07, bs256 k1 +2-4%), so it issues them after its channel stage.
  act_t v_raw, b_raw;
  if constexpr (!KDA_SHADOW) v_raw = a.v[in * kV + ocol], b_raw = a.b[in];
  const float A = expf(__ldg(a.A_log + c.h));
  const bool writer = c.chunk == 0;  // the head's first chunk appends the per-channel entry
  float r1[kN1], r2[kN2];
  zero(r1), zero(r2);
#pragma unroll
  for (int n = 0; n < kCPT; ++n) {
    const int i = threadIdx.x + n * kThreads;
    if (kK % kThreads == 0 || i < kK) {
      const act_t k_raw = a.k[in * kK + i];
      const float kt = to_f(k_raw), qt = to_f(a.q[in * kK + i]);
      const float gt = gate(to_f(a.f[in * kK + i]), __ldg(a.dt_bias + (size_t)c.h * kK + i), A);
      float kj[kEA], gj[kEA];
#pragma unroll
      for (int j = 0; j < kEA; ++j) {
        kj[j] = j < m ? to_f(a.kc_in[(hs * kL + j) * kK + i]) : 0.f;
        gj[j] = j < m ? __ldg(a.gc_in + (hs * kL + j) * kK + i) : 0.f;
      }
      // Suffix over the entries, newest first: the exponent entry j sees is g_t + sum_{j<i<m} g_i.
      float run = gt;
#pragma unroll
      for (int j = kE - 1; j >= 0; --j) {
        if (j < m) {
          const float w = expf(run) * kj[j];
          r1[j] = fmaf(w, kt, r1[j]), r1[kH1 + j] = fmaf(w, qt, r1[kH1 + j]), r2[j] = fmaf(kj[j], kj[j], r2[j]);
          run += gj[j];
        }
      }
      const float e0 = expf(run);
      sm.e0k[i] = e0 * kt, sm.e0q[i] = e0 * qt;
      r1[kH1 - 1] += kt * kt, r1[kN1 - 1] += qt * qt, r2[kN2 - 1] += kt * qt;
      if (writer) {
        a.kc_out[(hs * kL + m) * kK + i] = k_raw;
        a.gc_out[(hs * kL + m) * kK + i] = gt;
      }
    }
  }
  store_partials(r1, r2, c, sm);
  if constexpr (KDA_SHADOW) v_raw = a.v[in * kV + ocol], b_raw = a.b[in];
  const float beta = sigmoid(to_f(b_raw));
  __syncthreads();
  nonflush_out(a, c, hs, m, st, sm, v_raw, beta, ocol, kind, writer, [&](float d, float coef, int kind) {
#pragma unroll
    for (int j = 0; j < kE; ++j) {
      if (j < m) d = fmaf(__shfl_sync(0xffffffffu, coef, kind * kH1 + j), uh[j], d);
    }
    return d;
  });
}

// The m buffered entries a non-flush step reads into shared memory by cp.async: k_j and g_j of every channel (entries
// j < m are contiguous: one flat copy each), u_j of the block's columns. One runtime loop a tensor: no per-entry
// predicate, address or register (as predicated register loads, every entry and tensor cost ~8 SASS instructions
// and 2 registers of address, issued ahead of the rows, at k = 1 too: ncu SASS, Kimi-K3 TP8 shadow, 7bcd800).
// Issue order is part of the design: k_j / g_j (the channel stage's inputs) go out before the rows, in their own
// group, so the channel stage runs while the rows stream; u_j (read last, by the output stage) after the rows. With
// the whole ring issued after the rows, the channel stage waited for rows + ring and the ring's bytes came at half
// the rate of main's predicated loads (H100, 8a5e653d7c, Kimi-K3 TP8 bs32 fp32 1.32x -> 1.24x; bench/NOTES.md).
__device__ __forceinline__ void stage_ring_kg(const Args& a, size_t hs, int m, StagedSmem& sm) {
  constexpr int kKQ = kK * (int)sizeof(act_t) / 16, kGQ = kK * 4 / 16;
  const char* kb = reinterpret_cast<const char*>(a.kc_in + hs * kL * kK);
  const char* gb = reinterpret_cast<const char*>(a.gc_in + hs * kL * kK);
  for (int t = threadIdx.x; t < m * kKQ; t += kThreads) cp_async16(reinterpret_cast<char*>(&sm.kr[0][0]) + t * 16, kb + t * 16);
  for (int t = threadIdx.x; t < m * kGQ; t += kThreads) cp_async16(reinterpret_cast<char*>(&sm.g[0][0]) + t * 16, gb + t * 16);
  cp_async_commit();
}
__device__ __forceinline__ void stage_ring_u(const Args& a, size_t hs, int m, int chunk, StagedSmem& sm) {
  constexpr int kUQ = kCols * kPasses * (int)sizeof(ring_t) / 16;
  const char* ub = reinterpret_cast<const char*>(a.uc_in + hs * kL * kV + chunk * kCols);
  for (int t = threadIdx.x; t < m * kUQ; t += kThreads) {
    const int j = t / kUQ, q = t % kUQ;
    cp_async16(reinterpret_cast<char*>(&sm.u[j][0]) + q * 16, ub + (size_t)j * kV * sizeof(ring_t) + q * 16);
  }
  cp_async_commit();
}

// KDA_PASSES 2: pass p's rows into sm.rows (one group, issued last: read after the first pass's output).
__device__ __forceinline__ void stage_pass_rows(const step_t* base, const Coords& c, StagedSmem& sm) {
#pragma unroll
  for (int r = 0; r < kRT; ++r) {
    const step_t* src = base + (size_t)c.row(r) * kV + c.col;
    if constexpr (sizeof(step_t) == 4) cp_async16(&sm.rows[r][threadIdx.x][0], src);
    else cp_async8(&sm.rows[r][threadIdx.x][0], src);
  }
  cp_async_commit();
}
__device__ __forceinline__ void load_pass_rows(Rows& st, const StagedSmem& sm) {
#pragma unroll
  for (int r = 0; r < kRT; ++r) {
#pragma unroll
    for (int e = 0; e < 4; ++e) st[r][e] = to_f(sm.rows[r][threadIdx.x][e]);
  }
}

// Channel i of a non-flush step whose ring entries j < m sit in shared memory (kr[j][i], g[j][i]): the suffix decays
// and the entry products into r1 / r2 (entry dots, then norms), this token's e0 vectors, and its entry appended
// (the head's first chunk: writer).
__device__ __forceinline__ void staged_channel(const Args& a, size_t hs, int m, int i, act_t k_raw, float kt, float qt,
                                               float gt, const act_t (&kr)[kEA][kK], const float (&g)[kEA][kK],
                                               float (&r1)[kN1], float (&r2)[kN2], ReplaySmem& sm, bool writer) {
  // Suffix over the entries, newest first: the exponent entry j sees is g_t + sum_{j<i<m} g_i.
  float run = gt;
#pragma unroll
  for (int j = kE - 1; j >= 0; --j) {
    if (j < m) {
      const float kj = to_f(kr[j][i]);
      const float w = expf(run) * kj;
      r1[j] = fmaf(w, kt, r1[j]), r1[kH1 + j] = fmaf(w, qt, r1[kH1 + j]), r2[j] = fmaf(kj, kj, r2[j]);
      run += g[j][i];
    }
  }
  const float e0 = expf(run);
  sm.e0k[i] = e0 * kt, sm.e0q[i] = e0 * qt;
  r1[kH1 - 1] += kt * kt, r1[kN1 - 1] += qt * qt, r2[kN2 - 1] += kt * qt;
  if (writer) {
    a.kc_out[(hs * kL + m) * kK + i] = k_raw;
    a.gc_out[(hs * kL + m) * kK + i] = gt;
  }
}

// The non-flush step with the ring staged (KDA_STAGED): the same arithmetic in the same order as replay_nonflush;
// with KDA_PASSES 2 the channel stage serves both of the block's chunks.
__device__ __forceinline__ void replay_nonflush_staged(const Args& a, const Coords& c, int slot, int m, StagedSmem& sm) {
  const size_t hs = (size_t)slot * kH + c.h;
  stage_ring_kg(a, hs, m, sm);  // first: the channel stage waits for these, the rows are used after it
  Rows st;
  load_rows(st, step_rows(a, hs), c);
  stage_ring_u(a, hs, m, c.chunk, sm);
  if constexpr (kPasses > 1) stage_pass_rows(step_rows(a, hs), pass_coords(c, 1), sm);
  const int ocol = out_col(c), kind = out_kind(c);
  const size_t in = (size_t)c.b * kH + c.h;
  act_t v_raw, b_raw, v_raw1;  // as replay_nonflush; v_raw1: the second pass's column
  if constexpr (!KDA_SHADOW) {
    v_raw = a.v[in * kV + ocol], b_raw = a.b[in];
    if constexpr (kPasses > 1) v_raw1 = a.v[in * kV + ocol + kCols];
  }
  const float A = expf(__ldg(a.A_log + c.h));
  const bool writer = c.chunk == 0;
  float r1[kN1], r2[kN2];
  zero(r1), zero(r2);
  // This token's per-channel inputs go out with the rows and the staged ring; the channel stage reads the ring
  // after the barrier.
  act_t k_raw[kCPT];
  float kt[kCPT], qt[kCPT], gt[kCPT];
#pragma unroll
  for (int n = 0; n < kCPT; ++n) {
    const int i = threadIdx.x + n * kThreads;
    if (kK % kThreads == 0 || i < kK) {
      k_raw[n] = a.k[in * kK + i];
      kt[n] = to_f(k_raw[n]), qt[n] = to_f(a.q[in * kK + i]);
      gt[n] = gate(to_f(a.f[in * kK + i]), __ldg(a.dt_bias + (size_t)c.h * kK + i), A);
    }
  }
  cp_async_wait_group<kPasses>();  // k_j, g_j (u_j and a second pass's rows may still fly)
  __syncthreads();
#pragma unroll
  for (int n = 0; n < kCPT; ++n) {
    const int i = threadIdx.x + n * kThreads;
    if (kK % kThreads == 0 || i < kK)
      staged_channel(a, hs, m, i, k_raw[n], kt[n], qt[n], gt[n], sm.kr, sm.g, r1, r2, sm, writer);
  }
  store_partials(r1, r2, c, sm);
  if constexpr (KDA_SHADOW) {
    v_raw = a.v[in * kV + ocol], b_raw = a.b[in];
    if constexpr (kPasses > 1) v_raw1 = a.v[in * kV + ocol + kCols];
  }
  const float beta = sigmoid(to_f(b_raw));
  if constexpr (kPasses > 1) cp_async_wait_group<1>();  // the u_j columns (the second pass's rows may still fly)
  else cp_async_wait_all();                             // the u_j columns
  __syncthreads();
  int bcol = ocol - c.chunk * kCols;  // the lane's output column in the u tile (the second pass: kCols further)
  const auto uterm = [&](float d, float coef, int kind) {
    for (int j = 0; j < m; ++j) d = fmaf(__shfl_sync(0xffffffffu, coef, kind * kH1 + j), to_f(sm.u[j][bcol]), d);
    return d;
  };
  nonflush_out(a, c, hs, m, st, sm, v_raw, beta, ocol, kind, writer, uterm);
  if constexpr (kPasses > 1) {  // the same coefficients and checkpoint vectors on the block's second chunk
    cp_async_wait_all();
    load_pass_rows(st, sm);
    bcol += kCols;
    nonflush_out(a, pass_coords(c, 1), hs, m, st, sm, v_raw1, beta, ocol + kCols, kind, false, uterm);
  }
}

__device__ __forceinline__ void conventional(const Args& a) {
  __shared__ FoldSmem sm;
  const Coords c = coords();
  const int slot = a.sbi[c.b];
  if (slot < 0 || slot >= a.nslots) return;  // padding (or an unchecked bad slot): nothing touched
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {  // (a KDA_PASSES module: its chunks in turn; the shared tiles between them)
    if (p) __syncthreads();
    fold_step<false>(a, pass_coords(c, p), slot, false, sm);
  }
}

__device__ __forceinline__ void replay_decode(const Args& a) {
  __shared__ alignas(16) unsigned char smem[kSmemBytes];
#if KDA_ROW_ORDER  // a.sbi holds (row, slot, cursor, 0) in flush-first order (replayssm_flush_order): one load
  Coords c = coords();
  const int4 rs = reinterpret_cast<const int4*>(a.sbi)[blockIdx.y];
  c.b = rs.x;
  const int slot = rs.y;
  if (slot < 0 || slot >= a.nslots) return;
  const int pos = rs.z;  // the slot's cursor, read by the order kernel (no second dependent load)
#else
  const Coords c = coords();
  const int slot = a.sbi[c.b];
  if (slot < 0 || slot >= a.nslots) return;
  const int pos = a.cursor[slot];
#endif
  if (pos < 0 || pos >= kL) {  // unchecked bad cursor: NaN outputs, nothing else written
    for (int i = threadIdx.x; i < kCols * kPasses; i += kThreads)
      a.y[((size_t)c.b * kH + c.h) * kV + c.chunk * kCols + i] = from_f<act_t>(__int_as_float(0x7fc00000));
    return;
  }
#if KDA_SHADOW
  using FlushSmem = FoldSmem;
#else
  using FlushSmem = UsumSmem;
#endif
  if (pos + 1 == kL) {
    if constexpr (kPasses > 1) {  // the second chunk's fp32 rows toward L2 while the first is folded
      const Coords c1 = pass_coords(c, 1);
      const float* base = a.state_in + ((size_t)slot * kH + c.h) * kK * kV;
#pragma unroll
      for (int r = 0; r < kRT; ++r) prefetch_l2(base + (size_t)c1.row(r) * kV + c1.col);
    }
    fold_step<true>(a, c, slot, true, *reinterpret_cast<FlushSmem*>(smem));
    if constexpr (kPasses > 1) {  // the second chunk: with a shadow on the first pass's fold tiles, else its u-sum
#if KDA_SHADOW
      fold_step_next(a, pass_coords(c, 1), slot, *reinterpret_cast<FoldSmem*>(smem));
#else
      __syncthreads();
      fold_step<true>(a, pass_coords(c, 1), slot, true, *reinterpret_cast<FlushSmem*>(smem));
#endif
    }
  } else if constexpr (kStaged) replay_nonflush_staged(a, c, slot, pos, *reinterpret_cast<StagedSmem*>(smem));
  else replay_nonflush(a, c, slot, pos, *reinterpret_cast<ReplaySmem*>(smem));
}

#if KDA_BULK
// ---- the conventional step as a persistent stream (KDA_BULK; KDASpec.bulk, an experiment beside kda_conventional) --
// The one-shot conventional step runs at 84-89% of the copy ceiling at TP8 (bench/NOTES.md): each block loads its
// rows, waits, computes, stores and exits, so every block pays its chain (slot, rows, inputs, channel stage, reduce)
// once, and only the other resident blocks cover it. Here a block walks items (batch row, head, chunk of kCols
// columns) with stride gridDim.x and stages the next item's rows and per-channel inputs in shared memory by cp.async
// (two stages) while it computes the current one from the other stage; the next item's slot, v column, beta logit,
// A_log and dt_bias come one item ahead in registers. So the DRAM stream runs across items, and a block's chain
// overlaps its own next loads, and the updated rows go back through the stage and out as whole lines. The arithmetic is
// kda_conventional's in the same order (fold_step<false>, token_channel, token_update), so at the same launch shape
// both give the same bits.
static_assert(kPasses == 1 && KDA_TOKENS == 0, "KDA_BULK: the conventional step of a one-pass decode module");
static_assert(kK * (int)sizeof(act_t) % 16 == 0 && kCols % 4 == 0, "KDA_BULK: 16-byte copies of k, q, f and the rows");
// Elements of a staged row of T: the block's columns padded so that a row's byte stride is an odd multiple of one row
// group's bytes (kCVL lanes of 4 T), so the row groups of one shared-memory wavefront (128 bytes) fall on distinct
// banks: a quarter warp's float4 reads, a half warp's 8-byte reads.
template <typename T>
__host__ __device__ constexpr int row_pad() {
  constexpr int g = kCVL * 4 * (int)sizeof(T), rb = kCols * (int)sizeof(T);
  return kCols + ((g - rb % (2 * g)) % (2 * g) + 2 * g) % (2 * g) / (int)sizeof(T);
}
constexpr int kRowPad = row_pad<float>();
constexpr int kRowVecs = kCols / 4;
constexpr int kInVecs = kK * (int)sizeof(act_t) / 16;
// A lane's 4 staged values (one 16-byte or 8-byte shared-memory read).
__device__ __forceinline__ void lds4(const float* p, float (&o)[4]) {
  const float4 t = *reinterpret_cast<const float4*>(p);
  o[0] = t.x, o[1] = t.y, o[2] = t.z, o[3] = t.w;
}
__device__ __forceinline__ void lds4(const __nv_bfloat16* p, float (&o)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
  const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
  o[0] = __low2float(lo), o[1] = __high2float(lo), o[2] = __low2float(hi), o[3] = __high2float(hi);
}

struct alignas(16) BulkStage {
  float rows[kK][kRowPad];  // the item's rows, its kCols columns
  act_t kin[3][kK];         // its k, q, f (raw)
};
struct alignas(16) BulkSmem {
  BulkStage stage[2];
  TokenSmem tok;
  float red[kWarps][4];  // the warps' k.k, q.q, k.q
};

__device__ __forceinline__ Coords item_coords(int item) {
  Coords c;
  const int per_row = kH * kChunks;
  c.b = item / per_row;
  const int rem = item - c.b * per_row;
  c.h = rem / kChunks;
  c.chunk = rem - c.h * kChunks;
  c.warp = threadIdx.x / 32;
  c.lane = threadIdx.x % 32;
  c.cv = c.lane % kCVL;
  c.rg = c.lane / kCVL;
  c.col = c.chunk * kCols + c.warp * kWCols + c.cv * 4;
  return c;
}

// An item's kCols columns of its K rows (src: the first column of row 0, rows kV apart) into a staged tile, 16 bytes a
// copy, consecutive threads along a row (whole 128-byte lines); this thread's share.
template <typename T, int kPad>
__device__ __forceinline__ void stage_rows(const T* src, T (&rows)[kK][kPad]) {
  constexpr int kVecs = kCols * (int)sizeof(T) / 16;
  for (int t = threadIdx.x; t < kK * kVecs; t += kThreads) {
    const int r = t / kVecs, q = t - r * kVecs;
    cp_async16(reinterpret_cast<char*>(&rows[r][0]) + q * 16, reinterpret_cast<const char*>(src + (size_t)r * kV) + q * 16);
  }
}
// The item's token inputs k, q, f (raw) into kin.
__device__ __forceinline__ void stage_token(const Args& a, const Coords& c, act_t (&kin)[3][kK]) {
  const size_t in = ((size_t)c.b * kH + c.h) * kK;
  for (int t = threadIdx.x; t < 3 * kInVecs; t += kThreads) {
    const int w = t / kInVecs, q = t - w * kInVecs;
    const act_t* base = (w == 0 ? a.k : w == 1 ? a.q : a.f) + in;
    cp_async16(reinterpret_cast<char*>(&kin[w][0]) + q * 16, reinterpret_cast<const char*>(base) + q * 16);
  }
}
// One item's copies (this thread's share), committed by the caller as one group.
__device__ __forceinline__ void stage_item(const Args& a, const Coords& c, int slot, BulkStage& s) {
  stage_rows(a.state_in + ((size_t)slot * kH + c.h) * kK * kV + c.chunk * kCols, s.rows);
  stage_token(a, c, s.kin);
}

// What an item reads beside its staged tiles, loaded one item ahead.
struct ItemIn {
  int slot;
  act_t v_raw, b_raw;
  float A;  // exp(A_log[h])
  float dtb[kCPT];
};
__device__ __forceinline__ ItemIn item_inputs(const Args& a, const Coords& c, bool exists) {
  ItemIn x;
  x.slot = -1;
  if (!exists) return x;
  x.slot = a.sbi[c.b];
  const size_t in = (size_t)c.b * kH + c.h;
  x.v_raw = a.v[in * kV + out_col(c)], x.b_raw = a.b[in];
  x.A = expf(__ldg(a.A_log + c.h));
#pragma unroll
  for (int n = 0; n < kCPT; ++n) {
    const int i = threadIdx.x + n * kThreads;
    x.dtb[n] = kK % kThreads == 0 || i < kK ? __ldg(a.dt_bias + (size_t)c.h * kK + i) : 0.f;
  }
  return x;
}
__device__ __forceinline__ bool live(const Args& a, const ItemIn& x) { return x.slot >= 0 && x.slot < a.nslots; }

// The conventional step of one staged item (fold_step<false>'s arithmetic; rows and k, q, f from the stage).
__device__ __forceinline__ void conventional_item(const Args& a, const Coords& c, const ItemIn& x, BulkStage& s,
                                                  BulkSmem& sm) {
  const int bcol = c.col - c.chunk * kCols;
  Rows st;
#pragma unroll
  for (int r = 0; r < kRT; ++r) lds4(&s.rows[c.row(r)][bcol], st[r]);
  float tk[3] = {0.f, 0.f, 0.f};
#pragma unroll
  for (int n = 0; n < kCPT; ++n) {
    const int i = threadIdx.x + n * kThreads;
    if (kK % kThreads == 0 || i < kK) {
      const float kt = to_f(s.kin[0][i]), qt = to_f(s.kin[1][i]);
      const float al = expf(gate(to_f(s.kin[2][i]), x.dtb[n], x.A));
      token_channel(i, kt, qt, al, sm.tok, tk);
    }
  }
  float t4[4] = {tk[0], tk[1], tk[2], 0.f};
  const float r = transpose_reduce<4, 1>(t4);
  if (c.lane < 3) sm.red[c.warp][c.lane] = r;
  const float beta = sigmoid(to_f(x.b_raw));
  const float v_now = to_f(x.v_raw);
  __syncthreads();
  float kk = 0.f, qq = 0.f, kqr = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) kk += sm.red[w][0], qq += sm.red[w][1], kqr += sm.red[w][2];
  token_update(a, c, st, beta, v_now, kk, qq, kqr, sm.tok);
  // The rows back through the stage (each lane over its own staged values: no barrier before), then stored as whole
  // 128-byte lines of consecutive threads, where a warp of the one-shot step writes 16 rows x 32 bytes.
#pragma unroll
  for (int r = 0; r < kRT; ++r)
    *reinterpret_cast<float4*>(&s.rows[c.row(r)][bcol]) = make_float4(st[r][0], st[r][1], st[r][2], st[r][3]);
  __syncthreads();
  float* dst = a.state_out + ((size_t)x.slot * kH + c.h) * kK * kV + c.chunk * kCols;
  for (int t = threadIdx.x; t < kK * kRowVecs; t += kThreads) {
    const int r = t / kRowVecs, q = t - r * kRowVecs;
    __stcs(reinterpret_cast<float4*>(dst + (size_t)r * kV + q * 4), *reinterpret_cast<const float4*>(&s.rows[r][q * 4]));
  }
}

__device__ __forceinline__ void conventional_bulk(const Args& a) {
  __shared__ BulkSmem sm;
  const int total = a.batch * kH * kChunks;
  int item = blockIdx.x;
  if (item >= total) return;
  Coords c = item_coords(item);
  ItemIn x = item_inputs(a, c, true);
  if (live(a, x)) stage_item(a, c, x.slot, sm.stage[0]);
  cp_async_commit();
  int next = item + gridDim.x;
  Coords cn = item_coords(next);
  ItemIn xn = item_inputs(a, cn, next < total);
  for (int n = 0; item < total; ++n) {
    const int s = n & 1;
    // The next item into the other stage: its last reader (item n - 1) finished before the barrier that ended the
    // previous iteration.
    if (live(a, xn)) stage_item(a, cn, xn.slot, sm.stage[s ^ 1]);
    cp_async_commit();
    const int after = next + gridDim.x;
    const Coords ca = item_coords(after);
    const ItemIn xa = item_inputs(a, ca, after < total);  // in flight across this item
    if (live(a, x)) {
      cp_async_wait_group<1>();  // this item's group (the next one's may still fly)
      __syncthreads();
      conventional_item(a, c, x, sm.stage[s], sm);
    }
    __syncthreads();  // the stage and the token tile are read: the next iteration may overwrite them
    item = next, c = cn, x = xn;
    next = after, cn = ca, xn = xa;
  }
  cp_async_wait_all();
}

// ---- the non-flush replay step as a persistent stream (KDA_BULK with a ring: kda_replay_bulk; an experiment) ------
// conventional_bulk's stream for the standard decode's non-flush steps: a block walks items with stride gridDim.x and
// stages the next item's rows (the shadow's with KDA_SHADOW), ring entries j < m (k_j and g_j of every channel, u_j of
// its columns) and k, q, f by cp.async while it computes the current one; slots, cursors and the per-item scalars
// come in registers one to three items ahead. The arithmetic is replay_nonflush_staged's (staged_channel,
// nonflush_out) in the same order. A flush item (cursor L - 1) does not fit beside two stages in the static shared
// memory: without KDA_BULK_FLUSH this kernel refuses it as a bad cursor (NaN y, nothing written), so it times and tests
// the non-flush steps only; with it the launch adds a dynamic shared-memory tile (at least kFoldBytes, checked) where
// the item runs the one-shot kernel's flush (fold_step<true>, from global memory, while the next item's copies fly)
// (bench/NOTES.md "The non-flush replay step as a persistent stream").
static_assert(kCols * (int)sizeof(ring_t) % 16 == 0, "KDA_BULK: 16-byte copies of a u_j's columns");
constexpr int kStepPad = row_pad<step_t>();
struct alignas(16) ReplayStage {
  step_t rows[kK][kStepPad];   // the item's rows (fp32 checkpoint or bf16 shadow), its kCols columns
  alignas(16) act_t kr[kEA][kK];  // k_j raw, entries j < m
  alignas(16) float g[kEA][kK];   // g_j
  alignas(16) ring_t u[kEA][kCols];  // u_j of the item's columns
  alignas(16) act_t kin[3][kK];   // this token's k, q, f (raw)
};
struct alignas(16) BulkReplaySmem {
  ReplayStage stage[2];
  ReplaySmem rs;
};

__device__ __forceinline__ void stage_replay_item(const Args& a, const Coords& c, int slot, int m, ReplayStage& s) {
  const size_t hs = (size_t)slot * kH + c.h;
  stage_rows(step_rows(a, hs) + c.chunk * kCols, s.rows);
  constexpr int kKQ = kK * (int)sizeof(act_t) / 16, kGQ = kK * 4 / 16, kUQ = kCols * (int)sizeof(ring_t) / 16;
  const char* kb = reinterpret_cast<const char*>(a.kc_in + hs * kL * kK);
  const char* gb = reinterpret_cast<const char*>(a.gc_in + hs * kL * kK);
  for (int t = threadIdx.x; t < m * kKQ; t += kThreads) cp_async16(reinterpret_cast<char*>(&s.kr[0][0]) + t * 16, kb + t * 16);
  for (int t = threadIdx.x; t < m * kGQ; t += kThreads) cp_async16(reinterpret_cast<char*>(&s.g[0][0]) + t * 16, gb + t * 16);
  const char* ub = reinterpret_cast<const char*>(a.uc_in + hs * kL * kV + c.chunk * kCols);
  for (int t = threadIdx.x; t < m * kUQ; t += kThreads) {
    const int j = t / kUQ, q = t - j * kUQ;
    cp_async16(reinterpret_cast<char*>(&s.u[j][0]) + q * 16, ub + (size_t)j * kV * sizeof(ring_t) + q * 16);
  }
  stage_token(a, c, s.kin);
}

// An item's slot and cursor (-1: none, or a padding row), and whether the stream computes it.
struct Pos {
  int slot, pos;
};
__device__ __forceinline__ int slot_of(const Args& a, int item, int total) {
  return item < total ? a.sbi[item / (kH * kChunks)] : -1;
}
__device__ __forceinline__ int cursor_of(const Args& a, int slot) {
  return slot >= 0 && slot < a.nslots ? a.cursor[slot] : -1;
}
__device__ __forceinline__ bool streamed(const Args& a, const Pos& p) {
  return p.slot >= 0 && p.slot < a.nslots && p.pos >= 0 && p.pos < kL - 1;
}

__device__ __forceinline__ void replay_item(const Args& a, const Coords& c, const ItemIn& x, int m, ReplayStage& s,
                                            BulkReplaySmem& sm) {
  const size_t hs = (size_t)x.slot * kH + c.h;
  const int bcol = c.col - c.chunk * kCols;
  Rows st;
#pragma unroll
  for (int r = 0; r < kRT; ++r) lds4(&s.rows[c.row(r)][bcol], st[r]);
  const int ocol = out_col(c), kind = out_kind(c);
  const bool writer = c.chunk == 0;
  float r1[kN1], r2[kN2];
  zero(r1), zero(r2);
#pragma unroll
  for (int n = 0; n < kCPT; ++n) {
    const int i = threadIdx.x + n * kThreads;
    if (kK % kThreads == 0 || i < kK) {
      const act_t k_raw = s.kin[0][i];
      const float kt = to_f(k_raw), qt = to_f(s.kin[1][i]);
      const float gt = gate(to_f(s.kin[2][i]), x.dtb[n], x.A);
      staged_channel(a, hs, m, i, k_raw, kt, qt, gt, s.kr, s.g, r1, r2, sm.rs, writer);
    }
  }
  store_partials(r1, r2, c, sm.rs);
  const float beta = sigmoid(to_f(x.b_raw));
  __syncthreads();
  const auto uterm = [&](float d, float coef, int kind) {
    for (int j = 0; j < m; ++j) d = fmaf(__shfl_sync(0xffffffffu, coef, kind * kH1 + j), to_f(s.u[j][bcol]), d);
    return d;
  };
  nonflush_out(a, c, hs, m, st, sm.rs, x.v_raw, beta, ocol, kind, writer, uterm);
}

#if KDA_BULK_FLUSH
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
  unsigned n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}
#endif

__device__ __forceinline__ void replay_bulk(const Args& a) {
  __shared__ BulkReplaySmem sm;
#if KDA_BULK_FLUSH
  extern __shared__ __align__(16) unsigned char flush_tile[];  // the flush's FoldSmem / UsumSmem
  const bool can_flush = dynamic_smem_bytes() >= kFoldBytes;
#else
  constexpr bool can_flush = false;
#endif
  const int total = a.batch * kH * kChunks;
  const int G = gridDim.x;
  int item = blockIdx.x;
  if (item >= total) return;
  // item n: its Pos and scalars; n + 1: Pos (its copies go out at the top of the loop); n + 2: slot.
  Pos p{slot_of(a, item, total), 0};
  p.pos = cursor_of(a, p.slot);
  Coords c = item_coords(item);
  ItemIn x = item_inputs(a, c, true);
  if (streamed(a, p)) stage_replay_item(a, c, p.slot, p.pos, sm.stage[0]);
  cp_async_commit();
  Pos pn{slot_of(a, item + G, total), 0};
  pn.pos = cursor_of(a, pn.slot);
  int slot2 = slot_of(a, item + 2 * G, total);
  for (int n = 0; item < total; ++n) {
    const int sg = n & 1;
    const int next = item + G;
    const Coords cn = item_coords(next);
    if (streamed(a, pn)) stage_replay_item(a, cn, pn.slot, pn.pos, sm.stage[sg ^ 1]);
    cp_async_commit();
    const ItemIn xn = item_inputs(a, cn, next < total);  // this item's successor's scalars, in flight across it
    const Pos p2{slot2, cursor_of(a, slot2)};             // two items on: its cursor (its slot came a loop ago)
    const int slot3 = slot_of(a, item + 3 * G, total);
    if (streamed(a, p)) {
      cp_async_wait_group<1>();  // this item's group (the next one's may still fly)
      __syncthreads();
      replay_item(a, c, x, p.pos, sm.stage[sg], sm);
    } else if (can_flush && p.slot >= 0 && p.slot < a.nslots && p.pos == kL - 1) {
#if KDA_BULK_FLUSH
#if KDA_SHADOW
      fold_step<true>(a, c, p.slot, true, *reinterpret_cast<FoldSmem*>(flush_tile));
#else
      fold_step<true>(a, c, p.slot, true, *reinterpret_cast<UsumSmem*>(flush_tile));
#endif
#endif
    } else if (p.slot >= 0 && p.slot < a.nslots) {  // a flush it cannot fold, or a bad cursor: NaN y, nothing else
      for (int i = threadIdx.x; i < kCols; i += kThreads)
        a.y[((size_t)c.b * kH + c.h) * kV + c.chunk * kCols + i] = from_f<act_t>(__int_as_float(0x7fc00000));
    }
    __syncthreads();  // the stage and the reduce tiles are read: the next iteration may overwrite them
    item = next, c = cn, x = xn, p = pn, pn = p2, slot2 = slot3;
  }
  cp_async_wait_all();
}
#endif

}  // namespace kda
