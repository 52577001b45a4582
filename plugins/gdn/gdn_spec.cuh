// SPDX-License-Identifier: Apache-2.0
// Gated DeltaNet speculative decoding: verify a window of kT = 1 + num_draft tokens from the fp32
// checkpoint (or its bf16 shadow) and the committed ring history, commit by cursor move (the Mamba-2
// replayssm_spec_commit kernel, shared by all layers); plus the native-spec baseline (conventional
// recurrence over the window, one state snapshot per position). The spec, in float64, is
// trtllm_replayssm/families/gdn/reference.py (flush_checkpoint + spec_reference.flush_cursor + verify, then
// spec_reference.commit; native_spec_verify + spec_reference.native_spec_commit).
//
// The prelude adds kT to the constants of gdn.cuh. Per (slot, value head hv), cursor (start, m = count),
// committed entry j < m at ring index (start + j) % L, window token t at (start + m + t) % L:
//   flush (m + 2T > L, decided on the cursor before the step, as replayssm_spec_commit repeats it):
//     S0 <- the exact fold of the m committed (v_j, k_j, g_j, beta_j) from the fp32 checkpoint
//     (reference._fold, lazy decay as in gdn.cuh's replay_flush), stored (+ shadow rewritten);
//     the window then sees S_m = that fold and no history (cursor (start + m, 0) for the rest).
//   no flush: S_m = exp(G_m) S0 + sum_j exp(G_m - G_j) u_j k_j^T, never formed: only its products
//     S_m x = exp(G_m) (S0 x) + sum_j exp(G_m - G_j) (k_j . x) u_j with the window's x = k_t, q_t.
//   Window (triangular form, reference.verify_triangular), Γ_t = sum_{i<=t} g_i (in fp32 every exponent
//   Γ_t - Γ_s and G_m - G_j is summed over its own range, never a difference of two prefix sums):
//     u_t = beta_t (v_t - exp(Γ_t) S_m k_t - sum_{s<t} exp(Γ_t - Γ_s) (k_s . k_t) u_s)
//     y_t = exp(Γ_t) S_m q_t + sum_{s<=t} exp(Γ_t - Γ_s) (k_s . q_t) u_s
//   so each state element costs 2T FMAs (the 2T row dots) and nothing is updated in registers; the
//   T x T weights are per (row, head) scalars shared by the block's rows, and the forward
//   substitution runs per row on the lane that holds the row's dots. The window entries
//   (u_t, v_t, k_t normalised, g_t, beta_t) are appended to the ring; the cursor is read only.
//
// Work split: one block per (batch row, value head, chunk of kRows rows), the lane layout of gdn.cuh
// (a row's K columns across kLPR lanes, kRT rows per thread). Order: cursor; checkpoint rows (or the
// shadow) into registers; cp.async of the history u tile (no flush) or of the fold's k_j, v_j tiles
// (flush); q_t, k_t of the window normalised into shared memory, one warp per token; barrier; the T x T
// window dots and (no flush) the m x T history dots k_j . k_t, k_j . q_t, one row group per pair;
// barrier; flush fold; then per token one transposing butterfly of the 2 kRT row dots.
//
// Bytes per (batch row, layer), Qwen3-Next geometry (HV 32, H 16, V = K = 128), bf16 act, fp32 state:
//   verify, no flush: read S0 2 MiB (shadow 1 MiB), history m x 24.6 KB (u, k, g), window in T x 24.7 KB;
//     write T entries x 32.9 KB and y. flush: read S0 and m x 16.6 KB (v, k, g, beta), write S0 (+ shadow).
//   native verify: read S 2 MiB, write T snapshots T x 2 MiB; native commit: copy one snapshot (2 x 2 MiB).
// Credits: ReplaySSM (Dao AI Lab + NVIDIA, 2026); the corrected-update ("delta") replay of ROCm/ATOM
// #1883; ring cursor after FlashInfer checkpointing_ssu; the native baseline is the per-draft-position
// state cache of vLLM / TensorRT-LLM.
#pragma once
#include "gdn.cuh"

namespace gdn {

static_assert(kT >= 1 && 2 * kT <= kL, "tokens per window: 1 <= T and L >= 2T (flush one window early)");
static_assert(kK % 32 == 0, "the window prep spreads a K row over one warp");

constexpr int kGroups = kWarps * kRPW;                   // row groups of a block
constexpr int kHE = kL - 2 * kT > 0 ? kL - 2 * kT : 1;   // most committed entries of a non-flush step
constexpr int kFE2 = kL - kT;                            // most committed entries of a flush step
constexpr unsigned kNaN = 0x7fc00000u;

struct alignas(16) WinSmem {
  float q[kT][kK];    // q_t / |q_t| * scale
  float k[kT][kK];    // k_t / |k_t|
  float kk[kT][kT];   // [t][s]: exp(Γ_t - Γ_s) (k_s . k_t) for s < t, else 0
  float kq[kT][kT];   // [t][s]: exp(Γ_t - Γ_s) (k_s . q_t) for s <= t, else 0
  float eG[kT];       // exp(Γ_t)
  float g[kT], beta[kT];
};
struct alignas(16) HistSmem {
  float u[kHE * kRows];   // u_j of the block's rows, [j][row]
  float w[32];            // exp(G_m - G_j)
  float kd[kHE][kT][2];   // (k_j . k_t, k_j . q_t)
  float eGm;              // exp(G_m)
};
struct alignas(16) FoldSmem {
  float k[kFE2][kK];      // k_j of the committed entries, in entry order
  act_t v[kFE2][kRows];   // v_j of the block's rows
  float g[32], beta[32];
};
struct alignas(16) VerifySmem {
  WinSmem win;
  alignas(16) unsigned char rest[sizeof(HistSmem) > sizeof(FoldSmem) ? sizeof(HistSmem) : sizeof(FoldSmem)];
};
static_assert(sizeof(VerifySmem) <= 48 * 1024, "verify tiles exceed static shared memory (config.gdn_spec_smem_bytes)");

// Window tokens: q_t, k_t l2-normalised (q_t scaled) into shared memory, one warp per token; gates.
__device__ __forceinline__ void prep_window(WinSmem& w, const act_t* q, const act_t* k, const act_t* a,
                                            const act_t* b, const float* A_log, const float* dt_bias, int brow,
                                            int h, int hv) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kE = kK / 32;
  for (int t = warp; t < kT; t += kWarps) {
    const size_t off = (((size_t)brow * kT + t) * kHK + h) * kK + lane;
    float qv[kE], kv[kE], qq = 0.f, kk = 0.f;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      qv[e] = to_f(q[off + 32 * e]);
      kv[e] = to_f(k[off + 32 * e]);
      qq = fmaf(qv[e], qv[e], qq);
      kk = fmaf(kv[e], kv[e], kk);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      qq += __shfl_xor_sync(0xffffffffu, qq, o);
      kk += __shfl_xor_sync(0xffffffffu, kk, o);
    }
    const float sq = (kL2Norm ? rsqrtf(qq + kL2Eps) : 1.f) * kScale, rk = kL2Norm ? rsqrtf(kk + kL2Eps) : 1.f;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      w.q[t][lane + 32 * e] = qv[e] * sq;
      w.k[t][lane + 32 * e] = kv[e] * rk;
    }
  }
  if (threadIdx.x < kT) {
    const size_t bh = ((size_t)brow * kT + threadIdx.x) * kHV + hv;
    w.g[threadIdx.x] = -expf(__ldg(A_log + hv)) * softplus(to_f(a[bh]) + __ldg(dt_bias + hv));
    w.beta[threadIdx.x] = 1.f / (1.f + expf(-to_f(b[bh])));
  }
}

// The T x T window weights (after prep_window and a barrier): one row group per pair (t, s).
__device__ __forceinline__ void window_pairs(WinSmem& w, const Lane& c) {
  const int grp = (threadIdx.x / 32) * kRPW + c.lane / kLPR;
  constexpr int kPairs = kT * kT;
#pragma unroll 1
  for (int p0 = 0; p0 < kPairs; p0 += kGroups) {  // uniform trip count: the reduce needs every lane
    const int p = p0 + grp;
    const bool live = p < kPairs;
    const int t = live ? p / kT : 0, s = live ? p % kT : 0;
    Cols kt, ks, qt;
    smem_cols(kt, w.k[t], c);
    smem_cols(ks, w.k[s], c);
    smem_cols(qt, w.q[t], c);
    float acc[2] = {dot_cols(ks, kt), dot_cols(ks, qt)};
    const float d = group_reduce<2>(acc);
    if (live && c.l < 2) {  // Γ_t - Γ_s = sum_{s<i<=t} g_i summed directly (no difference of two prefix sums)
      float Gst = 0.f;
#pragma unroll
      for (int i = 0; i < kT; ++i)
        if (i > s && i <= t) Gst += w.g[i];
      const float dec = expf(Gst);
      if (c.l == 0) w.kk[t][s] = s < t ? dec * d : 0.f;
      else w.kq[t][s] = s <= t ? dec * d : 0.f;
    }
  }
  if (threadIdx.x < kT) {
    float G = 0.f;
#pragma unroll
    for (int i = 0; i < kT; ++i)
      if (i <= (int)threadIdx.x) G += w.g[i];
    w.eG[threadIdx.x] = expf(G);
  }
}

// ---- verify (cursor (slots, 2) = (start, count), read only) --------------------------------------------
__device__ __forceinline__ void spec_verify(const ReplayArgs& a) {
  __shared__ VerifySmem sm;
  WinSmem& w = sm.win;
  HistSmem& hs = *reinterpret_cast<HistSmem*>(sm.rest);
  FoldSmem& fs = *reinterpret_cast<FoldSmem*>(sm.rest);
  const Coords p = block_coords();
  const Lane c = lane_coords();
  const int slot = a.sbi[p.b];
  if (slot < 0 || slot >= a.nslots) return;  // padding (or an unchecked bad slot): nothing touched
  const int tid = threadIdx.x, warp = tid / 32;
  const int start = a.cursor[2 * slot], m = a.cursor[2 * slot + 1];
  const int row = dot_row(c);
  if (start < 0 || start >= kL || m < 0 || m > kL - kT) {  // corrupt cursor: NaN outputs, nothing written
    for (int i = tid; i < kT * kRows; i += kThreads)
      a.y[(((size_t)p.b * kT + i / kRows) * kHV + p.hv) * kV + p.row0 + i % kRows] = from_f<act_t>(__uint_as_float(kNaN));
    return;
  }
  const bool flush = m + 2 * kT > kL;  // block-uniform
  const size_t sh = ((size_t)slot * kHV + p.hv) * kV + p.row0;
  const size_t eh = ((size_t)slot * kHV + p.hv) * kL;  // entry 0 of this head's ring
  const float* kch = a.kc_in + ((size_t)slot * kHK + p.h) * kL * kK;
  Rows st;
  constexpr int kIters = (kHE + kGroups - 1) / kGroups;
  float kj[kIters][kVPL][4];
  float gl = 0.f;
  if (flush) {
    // The fold's entries by cp.async (they may wrap the ring), then the fp32 checkpoint rows.
    constexpr int kKVec = kK / 4;
    for (int i = tid; i < m * kKVec; i += kThreads) {
      const int j = i / kKVec, e = i % kKVec;
      cp_async16(&fs.k[j][e * 4], kch + (size_t)((start + j) % kL) * kK + e * 4);
    }
    if constexpr (kVVectors) {
      constexpr int kVVec = kRows * (int)sizeof(act_t) / 16;
      for (int i = tid; i < m * kVVec; i += kThreads) {
        const int j = i / kVVec, q = i % kVVec;
        cp_async16(reinterpret_cast<char*>(&fs.v[j][0]) + q * 16,
                   reinterpret_cast<const char*>(a.vc_in + (eh + (start + j) % kL) * kV + p.row0) + q * 16);
      }
    } else {
      for (int i = tid; i < m * kRows; i += kThreads)
        fs.v[i / kRows][i % kRows] = a.vc_in[(eh + (start + i / kRows) % kL) * kV + p.row0 + i % kRows];
    }
    for (int i = tid; i < 2 * m; i += kThreads) {
      if (i < m) fs.g[i] = __ldg(a.gc_in + eh + (start + i) % kL);
      else fs.beta[i - m] = __ldg(a.bc_in + eh + (start + i - m) % kL);
    }
    load_rows(st, a.state_in + sh * kK, c);
#pragma unroll
    for (int it = 0; it < kIters; ++it)
#pragma unroll
      for (int v = 0; v < kVPL; ++v) kj[it][v][0] = kj[it][v][1] = kj[it][v][2] = kj[it][v][3] = 0.f;
  } else {
    // The u tile of the history (cp.async holds no registers), the checkpoint (or shadow) rows, the k_j
    // this row group dots, g_j: all in flight while the window is prepared.
    const float* uh = a.uc_in + eh * kV + p.row0;
    constexpr int kUVecRow = kRows / 4;
    for (int i = tid; i < m * kUVecRow; i += kThreads) {
      const int j = i / kUVecRow, r4 = i % kUVecRow;
      cp_async16(&hs.u[j * kRows + r4 * 4], uh + (size_t)((start + j) % kL) * kV + r4 * 4);
    }
    if constexpr (kShadow) load_rows(st, a.sh_in + sh * kK, c);
    else load_rows(st, a.state_in + sh * kK, c);
    const int grp = warp * kRPW + c.lane / kLPR;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int j = it * kGroups + grp;
#pragma unroll
      for (int v = 0; v < kVPL; ++v) {
        if (j < m) load4(kch + (size_t)((start + j) % kL) * kK + c.col(v), kj[it][v]);
        else kj[it][v][0] = kj[it][v][1] = kj[it][v][2] = kj[it][v][3] = 0.f;
      }
    }
    if (warp == 0 && c.lane < m) gl = __ldg(a.gc_in + eh + (start + c.lane) % kL);
  }
  act_t v_raw[kT];
#pragma unroll
  for (int t = 0; t < kT; ++t) v_raw[t] = a.v[(((size_t)p.b * kT + t) * kHV + p.hv) * kV + p.row0 + row];
  prep_window(w, a.q, a.k, a.a, a.b, a.A_log, a.dt_bias, p.b, p.h, p.hv);
  if (!flush && warp == 0) {  // the history's w_j = exp(sum_{j<i<m} g_i) by a suffix scan (suffix_after), exp(G_m)
    const float after = suffix_after(gl);  // gl = 0 on lanes >= m
    if (c.lane < m) hs.w[c.lane] = expf(after);
    if (c.lane == 0) hs.eGm = expf(gl + after);
  }
  __syncthreads();
  window_pairs(w, c);
  if (!flush) {
    const int grp = warp * kRPW + c.lane / kLPR;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      if (it * kGroups >= m) break;  // block-uniform
      const int j = it * kGroups + grp;
#pragma unroll
      for (int t = 0; t < kT; ++t) {
        Cols kt, qt;
        smem_cols(kt, w.k[t], c);
        smem_cols(qt, w.q[t], c);
        float acc[2] = {dot_cols(kj[it], kt), dot_cols(kj[it], qt)};
        const float d = group_reduce<2>(acc);
        if (j < m && c.l < 2) hs.kd[j][t][c.l] = d;
      }
    }
  }
  cp_async_wait_all();
  __syncthreads();
  if (flush) {
    fold_rows(st, fs, c, m);
    store_rows(st, a.state_out + sh * kK, c);
    if constexpr (kShadow) store_shadow_rows(st, a.sh_out + sh * kK, c);
  }
  // Per token: this lane's dot (row `row`, k or q) of S_m with the token's k_t / q_t, then its pair.
  const bool is_q = c.l % (2 * kRT) >= kRT;
  float pk[kT], pq[kT];
#pragma unroll
  for (int t = 0; t < kT; ++t) {
    Cols kt, qt;
    smem_cols(kt, w.k[t], c);
    smem_cols(qt, w.q[t], c);
    float acc[2 * kRT];
#pragma unroll
    for (int r = 0; r < kRT; ++r) acc[r] = dot_cols(st[r], kt), acc[kRT + r] = dot_cols(st[r], qt);
    float mine = group_reduce<2 * kRT>(acc);
    if (!flush) {
      float hb = 0.f;
#pragma unroll 4
      for (int j = 0; j < m; ++j) hb = fmaf(hs.w[j] * hs.kd[j][t][is_q], hs.u[j * kRows + row], hb);
      mine = fmaf(hs.eGm, mine, hb);
    }
    const float other = __shfl_xor_sync(0xffffffffu, mine, kRT);
    pk[t] = is_q ? other : mine;
    pq[t] = is_q ? mine : other;
  }
  // Forward substitution over the window (per row), outputs, and the T window entries.
  float u[kT];
#pragma unroll
  for (int t = 0; t < kT; ++t) {
    float r = fmaf(-w.eG[t], pk[t], to_f(v_raw[t]));
#pragma unroll
    for (int s = 0; s < t; ++s) r = fmaf(-w.kk[t][s], u[s], r);
    u[t] = w.beta[t] * r;
    float yt = w.eG[t] * pq[t];
#pragma unroll
    for (int s = 0; s <= t; ++s) yt = fmaf(w.kq[t][s], u[s], yt);
    const size_t ring = eh + (start + m + t) % kL;
    if (holds_u(c)) {
      a.uc_out[ring * kV + p.row0 + row] = u[t];
      a.vc_out[ring * kV + p.row0 + row] = v_raw[t];
    }
    if (holds_y(c)) a.y[(((size_t)p.b * kT + t) * kHV + p.hv) * kV + p.row0 + row] = from_f<act_t>(yt);
  }
  if (p.row0 == 0 && p.hv % kHPK == 0) {  // k_t per key head: its first value head's first chunk
    float* kc = a.kc_out + ((size_t)slot * kHK + p.h) * kL * kK;
    constexpr int kKVec = kK / 4;
    for (int i = tid; i < kT * kKVec; i += kThreads) {
      const int t = i / kKVec, e = i % kKVec;
      *reinterpret_cast<float4*>(kc + (size_t)((start + m + t) % kL) * kK + e * 4) =
          *reinterpret_cast<const float4*>(&w.k[t][e * 4]);
    }
  }
  if (p.row0 == 0 && tid < kT) {
    const size_t ring = eh + (start + m + tid) % kL;
    a.gc_out[ring] = w.g[tid];
    a.bc_out[ring] = w.beta[tid];
  }
}

// ---- native-spec baseline: the conventional recurrence over the window, one snapshot per token -------
struct NativeArgs {
  const act_t *q, *k, *v, *a, *b;  // (batch, T, H, K) x2, (batch, T, HV, V), (batch, T, HV) x2
  const float *A_log, *dt_bias;    // (HV,)
  const int* sbi;                  // (batch,)
  const float* state_in;           // (slots, HV, V, K), read only
  int batch, nslots;
  act_t* y;                        // (batch, T, HV, V)
  float* snapshots;                // (slots, T, HV, V, K): state after window token t
};

__device__ __forceinline__ void native_verify(const NativeArgs& a) {
  __shared__ WinSmem w;
  const Coords p = block_coords();
  const Lane c = lane_coords();
  const int slot = a.sbi[p.b];
  if (slot < 0 || slot >= a.nslots) return;
  const size_t sh = ((size_t)slot * kHV + p.hv) * kV + p.row0;
  Rows st;
  load_rows(st, a.state_in + sh * kK, c);  // issued first: the loads fly while the window is prepared
  const int row = dot_row(c);
  act_t v_raw[kT];
#pragma unroll
  for (int t = 0; t < kT; ++t) v_raw[t] = a.v[(((size_t)p.b * kT + t) * kHV + p.hv) * kV + p.row0 + row];
  prep_window(w, a.q, a.k, a.a, a.b, a.A_log, a.dt_bias, p.b, p.h, p.hv);
  __syncthreads();
  window_pairs(w, c);  // only the diagonal k_t . q_t is used here
  __syncthreads();
  float* snap = a.snapshots + (((size_t)slot * kT * kHV + p.hv) * kV + p.row0) * kK;
#pragma unroll
  for (int t = 0; t < kT; ++t) {
    StepIn in;
    smem_cols(in.q, w.q[t], c);
    smem_cols(in.k, w.k[t], c);
    in.kq = w.kq[t][t];
    in.g = w.g[t];
    in.eg = expf(in.g);
    in.beta = w.beta[t];
    float yt;
    conventional_rows(st, in, to_f(v_raw[t]), &yt);
    store_rows(st, snap + (size_t)t * kHV * kV * kK, c);
    if (holds_y(c)) a.y[(((size_t)p.b * kT + t) * kHV + p.hv) * kV + p.row0 + row] = from_f<act_t>(yt);
  }
}

}  // namespace gdn
