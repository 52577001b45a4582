// SPDX-License-Identifier: Apache-2.0
// Kimi Delta Attention speculative verify: a window of kT = 1 + num_draft tokens from the fp32 checkpoint (or its
// bf16 shadow) and the committed ring history; the state is not written except by the fold below; commit is the
// shared cursor kernel (replayssm_spec_commit). The spec, in float64, is trtllm_replayssm/families/kda/reference.py
// (flush_checkpoint + flush_cursor + verify; verify_triangular is the route taken here).
//
// The prelude adds KDA_TOKENS = kT to the constants of kda.cuh. Per (slot, head), cursor (start, m = count),
// committed entry j < m at ring index (start + j) % L, window token t at (start + m + t) % L:
//   flush (m + 2T > L, decided on the cursor as given, as replayssm_spec_commit repeats it): S0 <- the exact fold
//     of the m committed (k_j, v_j, g_j, beta_j) from the fp32 checkpoint (kda.cuh fold_*, the decode flush's
//     chunked fold), stored (+ the bf16 shadow rewritten); the window then starts from that S_m in registers and
//     no history.
//   no flush: S_m = D_{m,0} S0 + sum_j D_{m,j} k_j u_j^T is never formed, only its products with the window's
//     vectors. With W_t = sum_{s<=t} g_s (window, per channel), A_j = sum_{j<l<m} g_l (history suffix), A = A_{-1}:
//       S_m^T (Diag(exp W_t) x) = S0^T (exp(A + W_t) x) + sum_j (k_j exp(A_j) . exp(W_t) x) u_j
//   Window (triangular form), kk_ts = k_s . exp(sum_{s<l<=t} g_l) k_t (s < t), kq_ts likewise with q_t (s <= t):
//     u_t = beta_t (v_t - S_m^T (Diag(exp W_t) k_t) - sum_{s<t} kk_ts u_s)
//     y_t = S_m^T (Diag(exp W_t) q_t) + sum_{s<=t} kq_ts u_s
//   (k, q normalised: the norms multiply the reduced sums). Every exponent is a sum over its own range (suffix,
//   prefix from the window start, or the pair's span), never a difference of two prefix sums. Token t reads
//   tokens s <= t only: a NaN in a later token never reaches an earlier output.
// So each state element costs 2T FMAs (the 2T dots) and is never updated; the window entries (k raw, u, g, v, beta)
// are appended to the ring, the cursor is read only.
//
// Work split: kda.cuh's (one block per (row, head, chunk of value columns), a warp owns 4 kCVL columns over all K
// rows). The per-channel stage (thread i = channel i): window gates, the history suffix sums, the vectors
// exp(A + W_t) k_t and exp(A + W_t) q_t into shared memory, and the kNV per-channel products of every K-wide dot
// (history x window, window x window, the norms), reduced 32 at a time by transposing butterflies; one barrier,
// the block totals, a second barrier (the fold's own when it flushes); then per token a transposing butterfly of
// the lane's 2 x 4 column dots, the history sum over the lane's u_j, and the forward substitution per column.
//
// Bytes per (row, layer): costs.kda_verify_bytes (no fold: S0 or its shadow, m x (k, u, g), T io, T entries
// written; fold: S0 read and written (+ shadow), m x (k, v, g, beta)).
// Credits: ReplaySSM (Dao AI Lab + NVIDIA, 2026); the delta-rule replay of ROCm/ATOM #1883; the ring cursor after
// FlashInfer checkpointing_ssu.
#pragma once
#include "kda.cuh"

namespace kda {

constexpr int kT = KDA_TOKENS;
static_assert(kT >= 1 && 2 * kT <= kL, "tokens per window: 1 <= T and L >= 2T (flush one window early)");
static_assert(kFE == kL - kT, "kda.cuh sizes the fold for L - T entries");
constexpr int kHE = kL - 2 * kT;          // most committed entries of a non-flush verify
constexpr int kHEA = kHE > 0 ? kHE : 1;   // array extent
// The per-channel products of the block's dots, one index each: history x window (k-side, then q-side), the
// history norms, window pairs (k_s . k_t for s < t, k_s . q_t for s <= t), the window norms.
__host__ __device__ constexpr int vHK(int j, int t) { return j * kT + t; }
__host__ __device__ constexpr int vHQ(int j, int t) { return kHE * kT + j * kT + t; }
__host__ __device__ constexpr int vHN(int j) { return 2 * kHE * kT + j; }
constexpr int kWB = 2 * kHE * kT + kHE;
__host__ __device__ constexpr int vKK(int t, int s) { return kWB + t * (t - 1) / 2 + s; }
__host__ __device__ constexpr int vKQ(int t, int s) { return kWB + kT * (kT - 1) / 2 + t * (t + 1) / 2 + s; }
__host__ __device__ constexpr int vNK(int t) { return kWB + kT * kT + t; }
__host__ __device__ constexpr int vNQ(int t) { return kWB + kT * kT + kT + t; }
constexpr int kNV = kWB + kT * kT + 2 * kT;
constexpr int kNP = (kNV + 31) / 32;  // butterflies of 32

struct alignas(16) WinSmem {
  float e0k[kT][kK], e0q[kT][kK];  // exp(A + W_t) k_t, exp(A + W_t) q_t, raw (the norms enter after the reduce)
  float red[kWarps][kNP * 32];     // warp sums of the kNV products
  float tot[kNP * 32];             // block totals
};
struct alignas(16) VerifySmem {
  FoldSmem fold;
  WinSmem win;
};
static_assert(sizeof(VerifySmem) <= 48 * 1024, "verify tiles exceed static shared memory (KDASpec.smem_bytes)");

__device__ __forceinline__ void put(float (&val)[32], int p, int idx, float x) {  // idx, p: compile-time after unrolling
  if (idx / 32 == p) val[idx % 32] += x;
}

// The per-channel stage of the window (threads by channel): gates, decays, e0k / e0q, the writer block's k and g
// entries, and the warp sums of the kNV products in w.red. mh: committed entries the window reads (0 after a fold).
__device__ __forceinline__ void window_channels(const Args& a, const Coords& c, size_t hs, int start, int m, int mh,
                                                bool writer, WinSmem& w) {
  const float A = expf(__ldg(a.A_log + c.h));
  float kt[kCPT][kT], qt[kCPT][kT], gt[kCPT][kT], ew[kCPT][kT], hd[kCPT][kHEA], kj[kCPT][kHEA];
#pragma unroll
  for (int n = 0; n < kCPT; ++n) {
    const int i = threadIdx.x + n * kThreads;
    const bool ok = kK % kThreads == 0 || i < kK;
    float gj[kHEA];
#pragma unroll
    for (int j = 0; j < kHEA; ++j) {  // history loads first: they come from L2 / DRAM
      const bool live = ok && j < mh;
      const size_t at = (hs * kL + ring_at(start, live ? j : 0)) * kK + (ok ? i : 0);
      kj[n][j] = live ? to_f(a.kc_in[at]) : 0.f;
      gj[j] = live ? __ldg(a.gc_in + at) : 0.f;
    }
#pragma unroll
    for (int t = 0; t < kT; ++t) {
      if (ok) {
        const size_t off = (((size_t)c.b * kT + t) * kH + c.h) * kK + i;
        const act_t k_raw = a.k[off];
        kt[n][t] = to_f(k_raw), qt[n][t] = to_f(a.q[off]);
        gt[n][t] = gate(to_f(a.f[off]), __ldg(a.dt_bias + (size_t)c.h * kK + i), A);
        if (writer) {
          const size_t at = (hs * kL + ring_at(start, m + t)) * kK + i;
          a.kc_out[at] = k_raw;
          a.gc_out[at] = gt[n][t];
        }
      } else {
        kt[n][t] = qt[n][t] = gt[n][t] = 0.f;
      }
    }
    // History suffix, newest first: entry j sees A_j = sum_{j<l<mh} g_l; the checkpoint sees A = the whole sum.
    float run = 0.f;
#pragma unroll
    for (int j = kHEA - 1; j >= 0; --j) {
      hd[n][j] = j < mh ? kj[n][j] * expf(run) : 0.f;
      if (j < mh) run += gj[j];
    }
    float W = 0.f;
#pragma unroll
    for (int t = 0; t < kT; ++t) {
      W += gt[n][t];
      ew[n][t] = expf(W);
      const float e0 = expf(run + W);
      if (ok) w.e0k[t][i] = e0 * kt[n][t], w.e0q[t][i] = e0 * qt[n][t];
    }
  }
#pragma unroll
  for (int p = 0; p < kNP; ++p) {
    float val[32];
#pragma unroll
    for (int v = 0; v < 32; ++v) val[v] = 0.f;
#pragma unroll
    for (int n = 0; n < kCPT; ++n) {
#pragma unroll
      for (int j = 0; j < kHE; ++j) {
#pragma unroll
        for (int t = 0; t < kT; ++t) {
          put(val, p, vHK(j, t), hd[n][j] * ew[n][t] * kt[n][t]);
          put(val, p, vHQ(j, t), hd[n][j] * ew[n][t] * qt[n][t]);
        }
        put(val, p, vHN(j), kj[n][j] * kj[n][j]);
      }
#pragma unroll
      for (int t = 0; t < kT; ++t) {
#pragma unroll
        for (int s = 0; s <= t; ++s) {
          if (vKQ(t, s) / 32 == p || (s < t && vKK(t, s) / 32 == p)) {
            float span = 0.f;  // sum_{s<l<=t} g_l
#pragma unroll
            for (int l = s + 1; l <= t; ++l) span += gt[n][l];
            const float ks = kt[n][s] * (s < t ? expf(span) : 1.f);
            if (s < t) put(val, p, vKK(t, s), ks * kt[n][t]);
            put(val, p, vKQ(t, s), ks * qt[n][t]);
          }
        }
        put(val, p, vNK(t), kt[n][t] * kt[n][t]);
        put(val, p, vNQ(t), qt[n][t] * qt[n][t]);
      }
    }
    const float r = transpose_reduce<32, 1>(val);
    w.red[c.warp][p * 32 + c.lane] = r;
  }
}

// ---- verify (cursor (slots, 2) = (start, count), read only) ------------------------------------------------------
__device__ __forceinline__ void spec_verify(const Args& a) {
  __shared__ VerifySmem sm;
  WinSmem& w = sm.win;
  const Coords c = coords();
  const int slot = a.sbi[c.b];
  if (slot < 0 || slot >= a.nslots) return;  // padding (or an unchecked bad slot): nothing touched
  const size_t hs = (size_t)slot * kH + c.h;
  Rows st;
  // The rows' loads go out before the cursor's, which would otherwise add a dependent global load to every block's
  // latency: the checkpoint, or with a shadow the shadow, which a fold drops for the fp32 rows. (H100, cafd1c0a90:
  // verify -2-7%; the same order in kda.cuh's decode step lost 0-25%, bench/NOTES.md "rows before the cursor".)
  load_rows(st, step_rows(a, hs), c);
  const int start = a.cursor[2 * slot], m = a.cursor[2 * slot + 1];
  const int ocol = out_col(c), kind = out_kind(c);
  if (start < 0 || start >= kL || m < 0 || m > kL - kT) {  // corrupt cursor: NaN outputs, nothing else written
    const int col0 = c.chunk * kCols;
    for (int i = threadIdx.x; i < kT * kCols; i += kThreads)
      a.y[(((size_t)c.b * kT + i / kCols) * kH + c.h) * kV + col0 + i % kCols] =
          from_f<act_t>(__int_as_float(0x7fc00000));
    return;
  }
  const bool flush = m + 2 * kT > kL;  // block-uniform
  const int mh = flush ? 0 : m;
  const bool writer = c.chunk == 0;  // the head's first chunk appends the per-channel entries
  if (KDA_SHADOW && flush) load_rows(st, a.state_in + hs * kK * kV, c);  // a fold starts from the fp32 rows
  if (flush) {
#pragma unroll
    for (int n = 0; n < kCPT; ++n) {
      const int i = threadIdx.x + n * kThreads;
      if (kK % kThreads == 0 || i < kK) fold_channel(a, hs, i, m, start, sm.fold);
    }
    const float tk[3] = {0.f, 0.f, 0.f};
    fold_gram(a, c, hs, m, start, tk, sm.fold);
  }
  window_channels(a, c, hs, start, m, mh, writer, w);
  // Loads the lanes need after the barrier (issued here, not first: the channel stage holds the registers).
  float uh[kHEA];  // u_j of this lane's output column
#pragma unroll
  for (int j = 0; j < kHEA; ++j) uh[j] = j < mh ? to_f(a.uc_in[(hs * kL + ring_at(start, j)) * kV + ocol]) : 0.f;
  act_t v_raw[kT];
  float beta[kT];
#pragma unroll
  for (int t = 0; t < kT; ++t) {
    const size_t bt = ((size_t)c.b * kT + t) * kH + c.h;
    v_raw[t] = a.v[bt * kV + ocol];
    beta[t] = sigmoid(to_f(a.b[bt]));
  }
  if (writer) {
#pragma unroll
    for (int t = 0; t < kT; ++t)
      if (threadIdx.x == t) a.bc_out[hs * kL + ring_at(start, m + t)] = beta[t];
  }
  __syncthreads();
  for (int t = threadIdx.x; t < kNV; t += kThreads) {
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) s += w.red[q][t];
    w.tot[t] = s;
  }
  if (flush) {  // its first barrier also publishes w.tot
    fold_apply(c, st, m, sm.fold);
    store_rows(st, a.state_out + hs * kK * kV, c);
    if constexpr (KDA_SHADOW) store_rows(st, a.sh_out + hs * kK * kV, c);
  } else {
    __syncthreads();
  }
  float rk[kT], rq[kT], rj[kHEA];
#pragma unroll
  for (int t = 0; t < kT; ++t) rk[t] = rnorm(w.tot[vNK(t)]), rq[t] = rnorm(w.tot[vNQ(t)]) * kScale;
#pragma unroll
  for (int j = 0; j < kHEA; ++j) rj[j] = j < mh ? rnorm(w.tot[vHN(j)]) : 0.f;
  // Per token: the lane's dot (its column, k- or q-side) of S_m with the token's vector, then its pair's.
  float pk[kT], pq[kT];
#pragma unroll
  for (int t = 0; t < kT; ++t) {
    float d = row_dots(st, c, w.e0k[t], w.e0q[t]);
#pragma unroll
    for (int j = 0; j < kHE; ++j)
      if (j < mh) d = fmaf(w.tot[kind ? vHQ(j, t) : vHK(j, t)] * rj[j], uh[j], d);
    d *= kind ? rq[t] : rk[t];
    const float other = __shfl_xor_sync(0xffffffffu, d, kCVL);
    pk[t] = kind ? other : d;
    pq[t] = kind ? d : other;
  }
  // Forward substitution over the window (per column, both lanes of the pair), outputs, the window entries.
  float u[kT];
#pragma unroll
  for (int t = 0; t < kT; ++t) {
    float r = to_f(v_raw[t]) - pk[t];
#pragma unroll
    for (int s = 0; s < t; ++s) r = fmaf(-w.tot[vKK(t, s)] * rk[s] * rk[t], u[s], r);
    u[t] = beta[t] * r;
    float yt = pq[t];
#pragma unroll
    for (int s = 0; s <= t; ++s) yt = fmaf(w.tot[vKQ(t, s)] * rk[s] * rq[t], u[s], yt);
    if (first_copy(c)) {
      if (kind) {
        a.y[(((size_t)c.b * kT + t) * kH + c.h) * kV + ocol] = from_f<act_t>(yt);
      } else {
        const size_t at = (hs * kL + ring_at(start, m + t)) * kV + ocol;
        a.uc_out[at] = from_f<ring_t>(u[t]);
        a.vc_out[at] = v_raw[t];
      }
    }
  }
}

}  // namespace kda
