// SPDX-License-Identifier: Apache-2.0
// KDA's conventional decode step in GDN's row layout (issue 37; bench/NOTES.md "KDA in GDN's row layout"): the
// state is (slots, H, V, K), K contiguous, the transpose of kda.cuh's (K, V). KDA is Gated DeltaNet with a
// per-key-channel decay, so this is GDN's conventional step (gdn.cuh: a block = (batch row, head, chunk of value
// rows), a row's K columns across a row group of lanes, both dots of a row in one butterfly, no shared memory, no
// barrier) with the decay a per-lane vector over the lane's own columns:
//   S <- S Diag(exp g); u = beta (v - S k); y = S q + (k . q) u; S <- S + u k^T
// on the old S:  u = beta (v - S (exp(g) . k)),  y = S (exp(g) . q) + (k . q) u,  S <- exp(g) . S + u k^T.
// Each lane computes the gate of its own columns (K / lanes per row exponentials; every row group and chunk repeats
// them: no DRAM cost).
//
// The generated prelude (families/kda/vk.py, KDAVKSpec) is GDNSpec's (kHV = kHK = H, no shadow, one GDN_PASSES)
// plus KDA_LOWER_BOUND / kLowerBound of the gate.
//
// Below the conventional step: the ReplaySSM standard decode step on the (V, K) state, fp32 checkpoint without a
// shadow, on kda.cuh's ring (k raw, u fp32, g per channel, v, beta), in two kernels (kda_vk_prologue, then
// kda_replay_rows_vk).
#pragma once
#include "common/cp_async.cuh"
#include "common/warp.cuh"
#include "gdn/gdn.cuh"
#include "kda/gate.cuh"

namespace kda_vk {

using gdn::Cols;
using rssm_common::from_f;
using rssm_common::to_f;
using gdn::Lane;
using gdn::Rows;

struct Args {
  const act_t *q, *k, *v, *f, *b;  // (batch, H, K) x2, (batch, H, V), (batch, H, K), (batch, H)
  const float *A_log, *dt_bias;    // (H,), (H, K)
  const int* sbi;                  // (batch,) slot per row, -1 = padding
  const float* state_in;           // (slots, H, V, K) fp32
  int batch, nslots;
  act_t* y;                        // (batch, H, V)
  float* state_out;                // aliases state_in
};

__device__ __forceinline__ void conventional(const Args& a) {
  const gdn::Coords p = gdn::block_coords();  // p.hv: the head (kHV = kHK = H)
  const Lane c = gdn::lane_coords();
  const int slot = a.sbi[p.b];
  if (slot < 0 || slot >= a.nslots) return;  // padding (or an unchecked bad slot): nothing touched
  const size_t sh = ((size_t)slot * kHV + p.hv) * kV + p.row0;
  Rows st;
  gdn::load_rows(st, a.state_in + sh * kK, c);  // issued first: the loads fly while the inputs are prepared
  const size_t bh = (size_t)p.b * kHV + p.hv;
  gdn::StepIn in;  // in.k, in.q: exp(g) . k', exp(g) . q' (the dots); eg 1: the decay is in them
  gdn::load_qk(in, c, a.q, a.k, p.b, p.hv);
  Cols kn, eg;  // k' (the update) and exp(g) of this lane's columns
  const act_t* fh = a.f + bh * kK;
  const float* dtb = a.dt_bias + (size_t)p.hv * kK;
  const float A = expf(__ldg(a.A_log + p.hv));
#pragma unroll
  for (int v = 0; v < gdn::kVPL; ++v) {
    float fv[4], dt[4];
    gdn::load4(fh + c.col(v), fv);
    gdn::load4(dtb + c.col(v), dt);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      eg[v][e] = expf(kda_gate::gate(fv[e], dt[e], A));
      kn[v][e] = in.k[v][e];
      in.k[v][e] *= eg[v][e];
      in.q[v][e] *= eg[v][e];
    }
  }
  in.g = 0.f, in.eg = 1.f;
  in.beta = kda_gate::sigmoid(to_f(a.b[bh]));
  const size_t yrow = bh * kV + p.row0;
#pragma unroll
  for (int ps = 0; ps < gdn::kPasses; ++ps) {
    const Lane cp = gdn::in_pass(c, ps);
    if (ps > 0) gdn::load_rows(st, a.state_in + sh * kK, cp);
    const float v_row = to_f(a.v[yrow + gdn::dot_row(cp)]);
    float dots[2 * gdn::kRT];
#pragma unroll
    for (int r = 0; r < gdn::kRT; ++r) dots[r] = gdn::dot_cols(st[r], in.k), dots[gdn::kRT + r] = gdn::dot_cols(st[r], in.q);
    float y;
    const float u = gdn::output_step(gdn::group_reduce<2 * gdn::kRT>(dots), in, v_row, &y);
#pragma unroll
    for (int r = 0; r < gdn::kRT; ++r) {
      const float ur = gdn::from_group_lane(u, r);
#pragma unroll
      for (int v = 0; v < gdn::kVPL; ++v)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[r][v][e] = fmaf(ur, kn[v][e], eg[v][e] * st[r][v][e]);
    }
    gdn::store_rows(st, a.state_out + sh * kK, cp);
    if (gdn::holds_y(cp)) a.y[yrow + gdn::dot_row(cp)] = from_f<act_t>(y);
  }
}

// ---- ReplaySSM standard decode (fp32 checkpoint, no shadow) --------------------------------------------------------
// Position m = cursor (ring entries j < m since the checkpoint S0). Per channel i, with the exponent formed as a suffix
// sum, never a difference: run_j[i] = g_t[i] + sum_{j<l<m} g_l[i], w_j[i] = exp(run_j[i]) k_j[i] (k_j raw, n_j = 1 /
// |k_j|), D[i] = exp(g_t[i] + sum_{l<m} g_l[i]); k_t, q_t raw here, their norms applied after the reductions:
//   (S_m Diag(exp g_t)) k_t = S0 (D . k_t) + sum_j n_j (w_j . k_t) u_j       (q_t the same)
//   u = beta (v - that),  y = (that for q_t) + (k_t . q_t) u
// Non-flush (m < L - 1): y, and the entry (k raw, u, g, v, beta) appended at index m. Flush (m = L - 1): the same u
// and y, then the new checkpoint in the same pass over the rows, the u-sum with this token folded in:
//   S <- S0 Diag(D) + sum_j n_j u_j w_j^T + u (rk k_t)^T
// (the stored fp32 u_j were computed from this same checkpoint: the exact recurrence's state, as kda.cuh's u-sum
// flush); the ring is not written.
using rssm_common::pow2_at_least;
constexpr int kE = kL > 1 ? kL - 1 : 0;          // entries a flush reads (kL 1: a conventional-only module)
constexpr int kEA = kE > 0 ? kE : 1;
constexpr int kH1 = pow2_at_least(kE + 1);        // r1: [0, kH1) the k side (kH1 - 1: k.k), [kH1, 2 kH1) the q side
constexpr int kN1 = 2 * kH1;
constexpr int kN2 = kH1;                          // r2: |k_j|^2, kN2 - 1: k.q
static_assert(kN1 <= 32, "ring length <= 16 (one warp's transposing reduce)");
static_assert(gdn::kPasses == 1, "the (V, K) replay step runs in one pass");

using kda_gate::rnorm;

// ---- the same step in two kernels: the per-head channel stage once, then GDN's row stream -----------------------------
// A fused form (kda.cuh's channel stage in every block of a head, its rows behind it; removed) measured 0.61-0.71x
// the (K, V) replay (H100, e38abc0a01; bench/NOTES.md "KDA (V, K) replay"). Here
// kda_vk_prologue does the per-channel work once per (batch row, head) (block of kK threads, thread i channel i) and
// writes the products the rows need to a scratch record; kda_replay_rows_vk is GDN's row stream on them: the rows'
// loads issued first, the record (1 KB) through shared memory behind one barrier, no per-channel work.
// Record of (batch row, head), floats (kScr = kScrHead + kE kK):
//   ek[kK] = D . k_t rk, eq[kK] = D . q_t rq, coef[2][16] (k side, q side: n_j (w_j . k_t) rk, n_j (w_j . q_t) rq),
//   kq, beta, 2 pad; the flush adds dall[kK] = D, kn[kK] = rk k_t, cfn[kE][kK] = n_j w_j.
constexpr int kCoef = 16;
constexpr int kScrHead = 2 * kK + 2 * kCoef + 4;  // the non-flush record, a multiple of 4 floats
constexpr int kScr = kScrHead + 2 * kK + kE * kK;
static_assert(kE < kCoef, "ring length <= 16");

struct ProArgs {
  const act_t *q, *k, *f, *b;
  const float *A_log, *dt_bias;
  const int *sbi, *cursor;
  const act_t* kc_in;
  const float* gc_in;
  int batch, nslots;
  float* scr;                      // (batch, H, kScr)
  act_t* kc_out;
  float* gc_out;
  float* bc_out;
};

// grid (H, batch), block kK threads: the record of (blockIdx.y, blockIdx.x), and the ring entry (k raw, g, beta) of a
// non-flush step. Padding rows and bad cursors: nothing (the rows kernel skips them too).
__device__ __forceinline__ void prologue(const ProArgs& a) {
  constexpr int kPW = kK / 32;  // warps
  __shared__ float red1[kPW][kN1], red2[kPW][kN2];
  __shared__ float tot[kN1 + kN2];
  // kda_replay_rows_vk (launched as a programmatic dependent) may start its loads now; it waits for this grid
  // before reading the records.
  asm volatile("griddepcontrol.launch_dependents;");
  const int h = blockIdx.x, brow = blockIdx.y, i = threadIdx.x, lane = i % 32, warp = i / 32;
  const int slot = a.sbi[brow];
  if (slot < 0 || slot >= a.nslots) return;
  const int m = a.cursor[slot];
  if (m < 0 || m >= kL) return;
  const bool flush = m + 1 == kL;
  const size_t hs = (size_t)slot * kHV + h, in = (size_t)brow * kHV + h;
  const float A = expf(__ldg(a.A_log + h));
  const act_t k_raw = a.k[in * kK + i];
  const float kt = to_f(k_raw), qt = to_f(a.q[in * kK + i]);
  const float gt = kda_gate::gate(to_f(a.f[in * kK + i]), __ldg(a.dt_bias + (size_t)h * kK + i), A);
  float kj[kEA], gj[kEA], w[kEA];
#pragma unroll
  for (int j = 0; j < kEA; ++j) {
    kj[j] = j < m ? to_f(a.kc_in[(hs * kL + j) * kK + i]) : 0.f;
    gj[j] = j < m ? __ldg(a.gc_in + (hs * kL + j) * kK + i) : 0.f;
  }
  float r1[kN1], r2[kN2];
#pragma unroll
  for (int t = 0; t < kN1; ++t) r1[t] = 0.f;
#pragma unroll
  for (int t = 0; t < kN2; ++t) r2[t] = 0.f;
  float run = gt;
#pragma unroll
  for (int j = kE - 1; j >= 0; --j) {
    w[j] = 0.f;
    if (j < m) {
      w[j] = expf(run) * kj[j];
      r1[j] = w[j] * kt, r1[kH1 + j] = w[j] * qt, r2[j] = kj[j] * kj[j];
      run += gj[j];
    }
  }
  const float e0 = expf(run);
  r1[kH1 - 1] = kt * kt, r1[kN1 - 1] = qt * qt, r2[kN2 - 1] = kt * qt;
  if (!flush) {  // the entry (the head's one block: no other block writes it)
    a.kc_out[(hs * kL + m) * kK + i] = k_raw;
    a.gc_out[(hs * kL + m) * kK + i] = gt;
  }
  {
    const float t1 = rssm_common::transpose_reduce<kN1, 1>(r1);
    const float t2 = rssm_common::transpose_reduce<kN2, 1>(r2);
    if (lane < kN1) red1[warp][lane] = t1;
    if (lane < kN2) red2[warp][lane] = t2;
  }
  __syncthreads();
  if (i < kN1 + kN2) {
    float t = 0.f;
#pragma unroll
    for (int w2 = 0; w2 < kPW; ++w2) t += i < kN1 ? red1[w2][i] : red2[w2][i - kN1];
    tot[i] = t;
  }
  __syncthreads();
  const float rk = rnorm(tot[kH1 - 1]), rq = rnorm(tot[kN1 - 1]) * kScale;
  float* rec = a.scr + in * kScr;
  rec[i] = e0 * kt * rk;
  rec[kK + i] = e0 * qt * rq;
  if (i < 2 * kCoef) {  // coef[side][j]: n_j (w_j . x) times x's norm
    const int side = i / kCoef, j = i % kCoef;
    rec[2 * kK + i] = j < m ? tot[side * kH1 + j] * rnorm(tot[kN1 + j]) * (side ? rq : rk) : 0.f;
  }
  const float beta = kda_gate::sigmoid(to_f(a.b[in]));
  if (i == 0) {
    rec[2 * kK + 2 * kCoef] = tot[kN1 + kN2 - 1] * rk * rq;
    rec[2 * kK + 2 * kCoef + 1] = beta;
    if (!flush) a.bc_out[hs * kL + m] = beta;
  }
  if (flush) {
    rec[kScrHead + i] = e0;
    rec[kScrHead + kK + i] = kt * rk;
#pragma unroll
    for (int j = 0; j < kE; ++j) rec[kScrHead + 2 * kK + j * kK + i] = w[j] * rnorm(tot[kN1 + j]);
  }
}

struct RowsArgs {
  const act_t* v;
  const int *sbi, *cursor;
  const float* state_in;  // (slots, H, V, K)
  const float* uc_in;     // (slots, H, L, V)
  const float* scr;       // (batch, H, kScr): kda_vk_prologue's records
  int batch, nslots;
  act_t* y;
  float* state_out;
  float* uc_out;
  act_t* vc_out;
};

struct alignas(16) RecSmem {
  float rec[kScrHead];
  float fl[2 * kK + kEA * kK];  // the flush's part of the record: dall, kn, cfn
  float u[kEA][kRows];          // the flush's u_j of the block's rows
};

// grid (H * V / kRows, batch), block kWarps * 32: GDN's row stream on the record.
__device__ __forceinline__ void replay_rows(const RowsArgs& a) {
  __shared__ RecSmem sm;
  const gdn::Coords p = gdn::block_coords();
  const Lane c = gdn::lane_coords();
  const int slot = a.sbi[p.b];
  if (slot < 0 || slot >= a.nslots) return;
  const int m = a.cursor[slot];
  const size_t in = (size_t)p.b * kHV + p.hv;
  if (m < 0 || m >= kL) {  // unchecked bad cursor: NaN outputs, nothing else written
    for (int r = threadIdx.x; r < kRows; r += gdn::kThreads) a.y[in * kV + p.row0 + r] = from_f<act_t>(__int_as_float(0x7fc00000));
    return;
  }
  const size_t hs = (size_t)slot * kHV + p.hv, sh = hs * kV + p.row0;
  const bool flush = m + 1 == kL;  // block-uniform
  // What does not depend on kda_vk_prologue first: the rows, this lane's u_j, v (and the flush's u tile).
  Rows st;
  gdn::load_rows(st, a.state_in + sh * kK, c);
  const int row = gdn::dot_row(c);
  float uh[kEA];  // u_j of this lane's dot row
  const float* ucol = a.uc_in + hs * kL * kV + p.row0 + row;
#pragma unroll
  for (int j = 0; j < kEA; ++j) uh[j] = j < m ? __ldg(ucol + (size_t)j * kV) : 0.f;
  const act_t v_raw = a.v[in * kV + p.row0 + row];
  if (flush) {
    constexpr int kUVecRow = kRows / 4;
    const float* uh0 = a.uc_in + hs * kL * kV + p.row0;
    for (int t = threadIdx.x; t < kE * kUVecRow; t += gdn::kThreads)
      rssm_common::cp_async16(&sm.u[t / kUVecRow][(t % kUVecRow) * 4], uh0 + (size_t)(t / kUVecRow) * kV + (t % kUVecRow) * 4);
  }
  // The record: written by kda_vk_prologue, which this kernel may overlap (programmatic dependent launch).
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const float* rec = a.scr + in * kScr;
  for (int t = threadIdx.x; t < kScrHead / 4; t += gdn::kThreads) rssm_common::cp_async16(&sm.rec[4 * t], rec + 4 * t);
  if (flush)
    for (int t = threadIdx.x; t < (2 + kE) * kK / 4; t += gdn::kThreads)
      rssm_common::cp_async16(&sm.fl[4 * t], rec + kScrHead + 4 * t);
  rssm_common::cp_async_wait_all();
  __syncthreads();
  Cols ek, eq;
  gdn::smem_cols(ek, sm.rec, c);
  gdn::smem_cols(eq, sm.rec + kK, c);
  float acc[2 * gdn::kRT];
#pragma unroll
  for (int r = 0; r < gdn::kRT; ++r) acc[r] = gdn::dot_cols(st[r], ek), acc[gdn::kRT + r] = gdn::dot_cols(st[r], eq);
  const int is_q = c.l % (2 * gdn::kRT) >= gdn::kRT;
  float mine = gdn::group_reduce<2 * gdn::kRT>(acc);
  const float* coef = sm.rec + 2 * kK + is_q * kCoef;
#pragma unroll
  for (int j = 0; j < kE; ++j)
    if (j < m) mine = fmaf(coef[j], uh[j], mine);
  gdn::StepIn in_;
  in_.kq = sm.rec[2 * kK + 2 * kCoef];
  in_.beta = sm.rec[2 * kK + 2 * kCoef + 1];
  in_.eg = 1.f;
  float y;
  const float u = gdn::output_step(mine, in_, to_f(v_raw), &y);
  if (gdn::holds_y(c)) a.y[in * kV + p.row0 + row] = from_f<act_t>(y);
  if (!flush) {
    const size_t e = hs * kL + m;
    if (gdn::holds_u(c)) {
      a.uc_out[e * kV + p.row0 + row] = u;
      a.vc_out[e * kV + p.row0 + row] = v_raw;
    }
    return;
  }
  // flush: S <- S0 Diag(D) + sum_j u_j cfn_j^T + u kn^T
  Cols dc;
  gdn::smem_cols(dc, sm.fl, c);
#pragma unroll
  for (int r = 0; r < gdn::kRT; ++r)
#pragma unroll
    for (int v = 0; v < gdn::kVPL; ++v)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[r][v][e] *= dc[v][e];
#pragma unroll 3
  for (int j = 0; j < kE; ++j) {
    Cols wj;
    gdn::smem_cols(wj, sm.fl + 2 * kK + j * kK, c);
#pragma unroll
    for (int r = 0; r < gdn::kRT; ++r) {
      const float uj = sm.u[j][c.rb + r];
#pragma unroll
      for (int v = 0; v < gdn::kVPL; ++v)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[r][v][e] = fmaf(wj[v][e], uj, st[r][v][e]);
    }
  }
  Cols kn;
  gdn::smem_cols(kn, sm.fl + kK, c);
  gdn::rank1_add(st, u, kn);
  gdn::store_rows(st, a.state_out + sh * kK, c);
}

}  // namespace kda_vk
