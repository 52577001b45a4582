// SPDX-License-Identifier: Apache-2.0
// ReplaySSM speculative decoding: verify a window of kT = 1 + num_draft tokens from the checkpoint
// and the committed ring history, commit by cursor move; plus the native-spec baseline.
//
// The prelude adds kT (tokens per window) to the constants of replayssm.cuh. The spec, in float64,
// is trtllm_replayssm/families/mamba2/spec_reference.py (spec_step = maybe_flush + verify, native_spec_*;
// commit: trtllm_replayssm/cursor.py).
//
// Math, per (slot, head). Checkpoint S0, committed entries e = 0..m-1 (m = count, ring index
// (start + e) % L), window entries e = m..m+T-1 (inputs, written to ring index (start + e) % L).
// dt_e processed, c_e = A * sum_{base <= i <= e} dt_i (the scan restarts at `base`):
//   y_t = exp(c_{m+t}) (S C_t) + sum_{base <= e <= m+t} dt_e exp(c_{m+t} - c_e) (B_e . C_t) x_e
//         + D x_t,  t = 0..T-1                      (y_t <- y_t silu(z_t) with a gate)
//   no flush (count + 2T <= L): S = S0, base = 0: the T x (m+T) causal weights W[t][e] include
//     the committed history.
//   flush (count + 2T > L): S = S_m = exp(c_{m-1}) S0 + sum_{e<m} dt_e exp(c_{m-1} - c_e) x_e B_e^T
//     (scan from 0) is stored as the new checkpoint, rounded to state_t, and the window is computed
//     from it with base = m. The cursor is not moved here: replayssm_spec_commit repeats the flush
//     decision (start += count, count = 0) and adds the accepted tokens, once for all layers.
//   fp32 exponents: every c_a - c_e (a > e) is A * sum_{e<i<=a} dt_i formed as a sum of like-signed terms
//     (the history's suffix sums from suffix_after, then the window's dt one by one), never as the
//     difference of two prefix sums, which loses ~ulp(sum dt) after a dt spike (replayssm.cuh suffix_after).
//   shadow (RSSM_SHADOW 1: bf16, 2: fp8-e4m3 with fp32 row scales; f32 checkpoint only): a
//     non-flush step reads S = S0 from the shadow (fp8 values times their row scale) instead of
//     the f32 checkpoint; a flush step reads the f32 checkpoint, folds, stores f32 and rewrites the
//     shadow from the stored values (store_shadow, as the decode flush), and its window outputs use
//     the f32 S_m it holds in registers. spec_reference.verify(shadow=, flushed=) is the spec.
//
// Work split (verify and native): one block per (batch row, head, chunk of kRows rows); the
// checkpoint rows are streamed into registers (StateRegs, 16-byte evict-first loads) first; the
// tiles (B and x of m+T entries, C and z of the window) go to shared memory by cp.async while
// warp 0 loads dt and scans it. Barrier; B_e.C_t dots for the causal pairs -> W; barrier. Then per
// window position t: kRT row dots with C_t from registers, plus this lane's share of the history
// sum (entries e = l, l + kLPR, ... of the row group), summed over the row group by halving
// shuffles (row_group_sum: kRT/2 + kRT/4 + ... shuffles instead of kRT log2(kLPR)).
//
// Bytes per (batch row, head), state_t s bytes, act a bytes, P rows, N columns, H/G heads per group
// (B and C are read from DRAM once per group; the other heads hit L2):
//   verify, no flush: read S0 s*P*N, history m*(P*a + 4 + N*a*G/H), window T*(P*a + a + 2*N*a*G/H);
//     write the window to the rings T*(P*a + 4 + N*a*G/H) and y T*P*a.
//   verify, flush: the same plus the new checkpoint s*P*N.
//   with a shadow (q bytes, + 4*P of row scales for fp8): no flush reads q*P*N (+ 4P) instead of
//     s*P*N; a flush reads s*P*N and writes s*P*N + q*P*N (+ 4P).
//   native verify: read S s*P*N and the window; write T snapshots T*s*P*N and y.
//   native commit: read one snapshot s*P*N, write S s*P*N (rows with n >= 1).
// Geometry (128,64,128,8), fp32 state (4 MiB per row), bf16 act, T = 4, L = 16, batch 256:
//   verify 1.131 GB at count 0, 1.170 GB at count 8, 2.263 GB with a flush (count 12); at full
//   acceptance the counts run 4, 8, 12 in steady state (after a fold the count is the step's n, not 0):
//   1.528 GB per step = 0.382 GB per token (costs.spec_count_distribution gives the counts at any
//   acceptance).
//   native verify 5.407 GB + native commit 2.147 GB = 7.554 GB per step (1.889 GB per token at full
//   acceptance). Standard ReplaySSM, one token per step: 1.088 GB (k=1) .. 2.230 GB (flush),
//   1.191 GB per token amortized over L.
//   With a bf16 shadow: verify 0.594 GB at count 0, 0.633 GB at count 8, 2.800 GB with a flush;
//   1.349 GB per step (0.337 GB per token) at full acceptance. fp8: 0.334 / 0.373 / 2.540 GB,
//   1.089 GB per step (0.272 GB per token).
// Credits: ReplaySSM (Dao AI Lab + NVIDIA, 2026); ring cursor after FlashInfer checkpointing_ssu
// (>= 0.6.16); the native baseline is the per-draft-position state cache of vLLM / TensorRT-LLM.
#pragma once
#include "replayssm.cuh"

namespace rssm {

static_assert(kT >= 1 && 2 * kT <= kL, "tokens per window: 1 <= T and L >= 2T (flush one window early)");

// ---- row-group reduction -------------------------------------------------------------------------
__host__ __device__ constexpr int log2_floor(int v) { return v <= 1 ? 0 : 1 + log2_floor(v / 2); }
__host__ __device__ constexpr int twos(int v) { return v % 2 ? 0 : 1 + twos(v / 2); }  // v > 0
constexpr int kHalve = twos(kRT) < log2_floor(kLPR) ? twos(kRT) : log2_floor(kLPR);
constexpr int kRem = kRT >> kHalve;   // rows a lane still holds after the halving steps
constexpr int kSub = kLPR >> kHalve;  // lanes that end up holding the same kRem sums

// Sums v[r] (this thread's kRT rows) over the kLPR lanes of the row group. A halving step keeps
// half of the values (the upper half if the lane's bit o is set) and adds the partner's copy of
// that half; then plain butterflies over the low kSub lanes. Lane q = lane % kSub < kRem returns
// the sum of row own_row(); other lanes return a sum they must not use.
__device__ __forceinline__ float row_group_sum(float (&v)[kRT]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int s = 0; s < kHalve; ++s) {
    const int half = kRT >> (s + 1), o = kLPR >> (s + 1);
    const bool up = lane & o;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = up ? v[i] : v[i + half];
      const float keep = up ? v[i + half] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
  }
#pragma unroll
  for (int o = kSub / 2; o > 0; o >>= 1)
#pragma unroll
    for (int i = 0; i < kRem; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
  const int q = lane % kSub;
  float mine = 0.f;
#pragma unroll
  for (int i = 0; i < kRem; ++i)
    if (i == q) mine = v[i];
  return mine;
}
__device__ __forceinline__ bool owns_row() { return threadIdx.x % kSub < kRem; }
__device__ __forceinline__ int own_row() {  // within the chunk; meaningful where owns_row()
  const int lane = threadIdx.x % 32;
  int off = 0;
#pragma unroll
  for (int s = 0; s < kHalve; ++s)
    if (lane & (kLPR >> (s + 1))) off += kRT >> (s + 1);
  return row_base() + off + lane % kSub;
}

// Rows r of the thread's state dotted with C (columns in registers), scaled: v[r] = scale * S[r].C.
__device__ __forceinline__ void state_dots(float (&v)[kRT], const StateRegs& st, const act_t* Crow, float scale) {
  ColRegs cc;
#pragma unroll
  for (int u = 0; u < kVPL; ++u) load_f<act_t, kEPV>(Crow + my_col(u), cc.c[u]);
#pragma unroll
  for (int r = 0; r < kRT; ++r) {
    float acc = 0.f;
#pragma unroll
    for (int u = 0; u < kVPL; ++u)
#pragma unroll
      for (int e = 0; e < kEPV; ++e) acc = fmaf(st.s[r][u][e], cc.c[u][e], acc);
    v[r] = scale * acc;
  }
}

// Async copy of n contiguous act_t rows of `len` elements (src rows `stride` apart) into dst rows.
template <int kLen, int kV>
__device__ __forceinline__ void cp_rows(act_t (*dst)[kLen], const act_t* src, size_t stride, int n) {
  constexpr int kVecs = kLen / kV;
  for (int i = threadIdx.x; i < n * kVecs; i += kThreads) {
    const int j = i / kVecs, p = (i % kVecs) * kV;
    cp_async<kV * sizeof(act_t)>(&dst[j][p], src + j * stride + p);
  }
}

// ---- verify -----------------------------------------------------------------------------------------
struct SpecArgs {
  const act_t* x;           // (batch, T, H, P)
  const act_t* B;           // (batch, T, G, N)
  const act_t* C;           // (batch, T, G, N)
  const act_t* dt;          // (batch, T, H) raw dt
  const float* dt_bias;     // (H,)
  const float* A;           // (H,)
  const float* D;           // (H,)
  const act_t* z;           // (batch, T, H, P) or null
  const int* sbi;           // (batch,) slot per row, -1 = padding
  const int* cursor;        // (slots, 2): ring start, committed count; read only
  const state_t* state_in;  // (slots, H, P, N)
  const act_t* xc_in;       // (slots, H, L, P)
  const act_t* Bc_in;       // (slots, G, L, N)
  const float* dtc_in;      // (slots, H, L)
  int batch, nslots;
  act_t* y;                 // (batch, T, H, P)
  state_t* state_out;       // aliases state_in (written on flush)
  act_t* xc_out;            // aliases xc_in (window appended)
  act_t* Bc_out;            // aliases Bc_in
  float* dtc_out;           // aliases dtc_in
  const shadow_t* sh_in;    // (slots, H, P, N) shadow of the checkpoint, or null (RSSM_SHADOW 0)
  const float* sc_in;       // (slots, H, P) fp8 row scales, or null
  shadow_t* sh_out;         // aliases sh_in (rewritten on flush)
  float* sc_out;            // aliases sc_in
};

struct alignas(16) SpecSmem {
  act_t Bt[kL][kN];            // B of entries 0..m+T-1: committed history, then the window
  act_t Ct[kT][kN];            // C of the window
  act_t xt[kL][kRows];         // x of entries 0..m+T-1, this block's rows
  act_t zt[kHasZ ? kT : 1][kRows];
  float W[kT][kL];             // dt_e exp(c_{m+t} - c_e) (B_e . C_t) for base <= e <= m+t
  float c[kL];                 // exponent terms: A sum_{e<i<m} dt_i for history e < m, A dt_e for window e >= m
  float dte[kL];               // processed dt
  float wf[kL];                // flush: dt_e exp(c_{m-1} - c_e) = dt_e exp(A sum_{e<i<m} dt_i), e < m
  float decay[kT];             // exp(c_{m+t})
  float decay_f;               // flush: exp(c_{m-1})
};

constexpr int kJPL = (kL + kLPR - 1) / kLPR;  // entries per lane in the history sum of a row group
constexpr unsigned kNaN = 0x7fc00000u;

__device__ __forceinline__ void spec_verify(const SpecArgs& a) {
  __shared__ SpecSmem sm;
  const Coords c = block_coords();
  const int slot = a.sbi[c.b];
  if (slot < 0 || slot >= a.nslots) return;  // padding row (or out of range): touch nothing
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int rb = row_base(), l = tid % kLPR;
  // 0. The checkpoint rows (the bulk of the bytes) go first, into registers. With a shadow the
  //    cursor decides which copy to read (the f32 rows to fold on a flush, else the shadow), so it
  //    is read first.
  const size_t sbase = (((size_t)slot * kH + c.h) * kP + c.row0) * kN;
  StateRegs st;
  if constexpr (kShadow == 0) load_state(st, a.state_in + sbase);
  const int start = a.cursor[2 * slot], m = a.cursor[2 * slot + 1];
  if (start < 0 || start >= kL || m < 0 || m > kL - kT) {  // corrupt cursor: loud y, nothing written
    if (owns_row())
      for (int t = 0; t < kT; ++t)
        a.y[(((size_t)c.b * kT + t) * kH + c.h) * kP + c.row0 + own_row()] = from_f<act_t>(__uint_as_float(kNaN));
    return;
  }
  const bool flush = m + 2 * kT > kL;
  if constexpr (kShadow != 0) {
    if (flush) load_state(st, a.state_in + sbase);
    else load_shadow(st, a.sh_in + sbase, a.sc_in + sbase / kN);
  }
  const int base = flush ? m : 0;  // first entry the window outputs see (after S)
  const int n = m + kT;            // entries loaded

  // 1. Tiles by cp.async: history entries from the ring (they may wrap), window from the inputs.
  {
    const int h1 = min(m, kL - start);  // history entries before the ring wraps
    const act_t* Bc = a.Bc_in + ((size_t)slot * kG + c.g) * kL * kN;
    cp_rows<kN, kBV>(sm.Bt, Bc + (size_t)start * kN, kN, h1);
    cp_rows<kN, kBV>(sm.Bt + h1, Bc, kN, m - h1);
    cp_rows<kN, kBV>(sm.Bt + m, a.B + ((size_t)c.b * kT * kG + c.g) * kN, (size_t)kG * kN, kT);
    cp_rows<kN, kBV>(sm.Ct, a.C + ((size_t)c.b * kT * kG + c.g) * kN, (size_t)kG * kN, kT);
    const act_t* xc = a.xc_in + ((size_t)slot * kH + c.h) * kL * kP + c.row0;
    cp_rows<kRows, kXV>(sm.xt, xc + (size_t)start * kP, kP, h1);
    cp_rows<kRows, kXV>(sm.xt + h1, xc, kP, m - h1);
    const size_t wo = ((size_t)c.b * kT * kH + c.h) * kP + c.row0;  // window row t is kH*kP further
    cp_rows<kRows, kXV>(sm.xt + m, a.x + wo, (size_t)kH * kP, kT);
    if constexpr (kHasZ) cp_rows<kRows, kXV>(sm.zt, a.z + wo, (size_t)kH * kP, kT);
    cp_async_commit();
  }
  // dt of every entry and the segmented scan in warp 0 (n <= L <= 32 entries, one per lane).
  if (warp == 0) {
    const float* dtc = a.dtc_in + ((size_t)slot * kH + c.h) * kL;
    float dte = 0.f;
    if (lane < m) dte = dtc[(start + lane) % kL];
    else if (lane < n) dte = softplus(to_f(a.dt[((size_t)c.b * kT + lane - m) * kH + c.h]) + a.dt_bias[c.h]);
    const float A = a.A[c.h];
    const int seg = lane >= base ? base : 0;
    float cum = dte;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float u = __shfl_up_sync(0xffffffffu, cum, o);
      if (lane - o >= seg) cum += u;
    }
    const float cl = A * cum;  // the decays exp(c) need only these sums; no exponent is a difference of them
    const float c_prev = __shfl_sync(0xffffffffu, cl, m > 0 ? m - 1 : 0);  // c_{m-1} of the history scan
    const float c_win = __shfl_sync(0xffffffffu, cl, min(m + lane, 31));  // c_{m+t}, t = lane
    const float hist_after = suffix_after(lane < m ? dte : 0.f);          // sum_{lane<i<m} dt_i (history)
    if (lane < n) {
      sm.dte[lane] = dte;
      sm.c[lane] = A * (lane < m ? hist_after : dte);
    }
    if (lane < kT) sm.decay[lane] = expf(c_win);
    if (flush) {
      if (lane < m) sm.wf[lane] = dte * expf(A * hist_after);
      if (lane == 0) sm.decay_f = expf(c_prev);
    }
    if (c.chunk == 0 && lane >= m && lane < n) a.dtc_out[((size_t)slot * kH + c.h) * kL + (start + lane) % kL] = dte;
  }
  cp_async_wait_all();
  __syncthreads();

  // 2. W[t][e] for the causal pairs (t, base <= e <= m+t): one B_e . C_t dot per kBLanes lanes.
  //    The window entries go to the ring from the tiles (B once per group, x per block).
  {
    const int span = n - base, pairs = kT * span;
    const int grp = tid / kBLanes, bl = tid % kBLanes;
    for (int p0 = 0; p0 < pairs; p0 += kBRowsPerPass) {  // trip count uniform over the block
      const int p = p0 + grp, t = p / span, e = base + p % span;
      const bool live = p < pairs && e <= m + t;
      float acc = 0.f;
      if (live) {
#pragma unroll
        for (int u = 0; u < kBVPL; ++u) {
          float bv[kBV], cv[kBV];
          load_f<act_t, kBV>(&sm.Bt[e][(u * kBLanes + bl) * kBV], bv);
          load_f<act_t, kBV>(&sm.Ct[t][(u * kBLanes + bl) * kBV], cv);
#pragma unroll
          for (int i = 0; i < kBV; ++i) acc = fmaf(bv[i], cv[i], acc);
        }
      }
      acc = group_sum<kBLanes>(acc);
      if (live && bl == 0) {  // c_{m+t} - c_e = A sum_{e<i<=m+t} dt_i as a sum of like-signed terms (sm.c)
        float ex = e < m ? sm.c[e] : 0.f;
#pragma unroll
        for (int i = 0; i < kT; ++i)
          if (i <= t && m + i > e) ex += sm.c[m + i];
        sm.W[t][e] = sm.dte[e] * expf(ex) * acc;
      }
    }
    act_t* xo = a.xc_out + ((size_t)slot * kH + c.h) * kL * kP + c.row0;
    for (int i = tid; i < kT * kXVecRow; i += kThreads) {
      const int t = i / kXVecRow, p = (i % kXVecRow) * kXV;
      copy_vec<act_t, kXV>(xo + (size_t)((start + m + t) % kL) * kP + p, &sm.xt[m + t][p]);
    }
    if (c.chunk == 0 && c.h % kHPG == 0) {
      act_t* Bo = a.Bc_out + ((size_t)slot * kG + c.g) * kL * kN;
      for (int i = tid; i < kT * kBVecRow; i += kThreads) {
        const int t = i / kBVecRow, p = (i % kBVecRow) * kBV;
        copy_vec<act_t, kBV>(Bo + (size_t)((start + m + t) % kL) * kN + p, &sm.Bt[m + t][p]);
      }
    }
  }
  __syncthreads();

  // 3'. Flush: S_m = exp(c_{m-1}) S0 + sum_{e<m} (wf_e x_e) B_e^T, stored (rounded) as the checkpoint;
  //     with a shadow, the shadow is rewritten from the stored values (store_shadow, as the decode flush).
  if (flush) {
    const float df = sm.decay_f;
#pragma unroll
    for (int r = 0; r < kRT; ++r)
#pragma unroll
      for (int u = 0; u < kVPL; ++u)
#pragma unroll
        for (int i = 0; i < kEPV; ++i) st.s[r][u][i] *= df;
#pragma unroll 4
    for (int e = 0; e < m; ++e) {
      const float we = sm.wf[e];
      float bj[kVPL][kEPV], xr[kRT];
#pragma unroll
      for (int u = 0; u < kVPL; ++u) load_f<act_t, kEPV>(&sm.Bt[e][my_col(u)], bj[u]);
      load_f<act_t, kRT>(&sm.xt[e][rb], xr);
#pragma unroll
      for (int r = 0; r < kRT; ++r) {
        const float sc = we * xr[r];
#pragma unroll
        for (int u = 0; u < kVPL; ++u)
#pragma unroll
          for (int i = 0; i < kEPV; ++i) st.s[r][u][i] = fmaf(sc, bj[u][i], st.s[r][u][i]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRT; ++r)
#pragma unroll
      for (int u = 0; u < kVPL; ++u)
#pragma unroll
        for (int i = 0; i < kEPV; ++i) st.s[r][u][i] = to_f(from_f<state_t>(st.s[r][u][i]));  // as stored
    store_state(st, a.state_out + sbase);
    if constexpr (kShadow != 0) store_shadow(st, a.sh_out + sbase, a.sc_out + sbase / kN);
  }

  // 3. Window outputs: y_t = exp(c_{m+t}) S.C_t + sum_{base <= e <= m+t} W[t][e] x_e + D x_t
  //    (S: the shadow's values on a non-flush step with a shadow, else the f32 rows in registers).
  const float D = a.D[c.h];
#pragma unroll
  for (int t = 0; t < kT; ++t) {
    float v[kRT];
    state_dots(v, st, sm.Ct[t], sm.decay[t]);
#pragma unroll
    for (int i = 0; i < kJPL; ++i) {
      const int e = base + l + i * kLPR;
      if (e <= m + t) {
        const float w = sm.W[t][e];
        float xr[kRT];
        load_f<act_t, kRT>(&sm.xt[e][rb], xr);
#pragma unroll
        for (int r = 0; r < kRT; ++r) v[r] = fmaf(w, xr[r], v[r]);
      }
    }
    const float s = row_group_sum(v);
    if (owns_row()) {
      const int row = own_row();
      float val = s + D * to_f(sm.xt[m + t][row]);
      if constexpr (kHasZ) val *= silu(to_f(sm.zt[t][row]));
      a.y[(((size_t)c.b * kT + t) * kH + c.h) * kP + c.row0 + row] = from_f<act_t>(val);
    }
  }
}

// Once per model step after sampling, for all layers: the flush the verify kernels did
// (count + 2T > L: start += count, count = 0), then count += n (n clamped to [0, T]).
// A corrupt cursor is left as it is (the verify kernels then write NaN outputs).
__device__ __forceinline__ void spec_commit(const int* sbi, const int* n_accepted, int batch, int nslots, int* cursor) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const int slot = sbi[b];
  if (slot < 0 || slot >= nslots) return;
  int start = cursor[2 * slot], count = cursor[2 * slot + 1];
  if (start < 0 || start >= kL || count < 0 || count > kL - kT) return;
  if (count + 2 * kT > kL) {
    start = (start + count) % kL;
    count = 0;
  }
  cursor[2 * slot] = start;
  cursor[2 * slot + 1] = count + min(max(n_accepted[b], 0), kT);
}

// ---- native-spec baseline: the conventional recurrence over the window, one snapshot per token ----
struct NativeArgs {
  const act_t* x;           // (batch, T, H, P)
  const act_t* B;           // (batch, T, G, N)
  const act_t* C;           // (batch, T, G, N)
  const act_t* dt;          // (batch, T, H) raw
  const float* dt_bias;
  const float* A;
  const float* D;
  const act_t* z;           // (batch, T, H, P) or null
  const int* sbi;
  const state_t* state_in;  // (slots, H, P, N), read only
  int batch, nslots;
  act_t* y;                 // (batch, T, H, P)
  state_t* snapshots;       // (slots, T, H, P, N): state after window token t
};

struct alignas(16) NativeSmem {
  act_t B[kT][kN];
  act_t C[kT][kN];
  act_t x[kT][kRows];
  act_t z[kHasZ ? kT : 1][kRows];
  float dt[kT];
  float decay[kT];
};

__device__ __forceinline__ void native_verify(const NativeArgs& a) {
  __shared__ NativeSmem sm;
  const Coords c = block_coords();
  const int slot = a.sbi[c.b];
  if (slot < 0 || slot >= a.nslots) return;
  const int tid = threadIdx.x, rb = row_base();
  StateRegs st;
  load_state(st, a.state_in + (((size_t)slot * kH + c.h) * kP + c.row0) * kN);
  const size_t wo = ((size_t)c.b * kT * kH + c.h) * kP + c.row0;
  cp_rows<kN, kBV>(sm.B, a.B + ((size_t)c.b * kT * kG + c.g) * kN, (size_t)kG * kN, kT);
  cp_rows<kN, kBV>(sm.C, a.C + ((size_t)c.b * kT * kG + c.g) * kN, (size_t)kG * kN, kT);
  cp_rows<kRows, kXV>(sm.x, a.x + wo, (size_t)kH * kP, kT);
  if constexpr (kHasZ) cp_rows<kRows, kXV>(sm.z, a.z + wo, (size_t)kH * kP, kT);
  cp_async_commit();
  if (tid < kT) {
    const float dt = softplus(to_f(a.dt[((size_t)c.b * kT + tid) * kH + c.h]) + a.dt_bias[c.h]);
    sm.dt[tid] = dt;
    sm.decay[tid] = expf(a.A[c.h] * dt);
  }
  const float D = a.D[c.h];
  cp_async_wait_all();
  __syncthreads();
  state_t* snap = a.snapshots + (((size_t)slot * kT * kH + c.h) * kP + c.row0) * kN;
#pragma unroll 1
  for (int t = 0; t < kT; ++t) {
    const float dt = sm.dt[t], decay = sm.decay[t];
    ColRegs bb;
#pragma unroll
    for (int u = 0; u < kVPL; ++u) load_f<act_t, kEPV>(&sm.B[t][my_col(u)], bb.c[u]);
    float xr[kRT];
    load_f<act_t, kRT>(&sm.x[t][rb], xr);
#pragma unroll
    for (int r = 0; r < kRT; ++r) {
      const float xd = dt * xr[r];
#pragma unroll
      for (int u = 0; u < kVPL; ++u)
#pragma unroll
        for (int i = 0; i < kEPV; ++i) st.s[r][u][i] = fmaf(decay, st.s[r][u][i], xd * bb.c[u][i]);
    }
    store_state(st, snap + (size_t)t * kH * kP * kN);
    float v[kRT];
    state_dots(v, st, sm.C[t], 1.f);
    const float s = row_group_sum(v);
    if (owns_row()) {
      const int row = own_row();
      float val = s + D * to_f(sm.x[t][row]);
      if constexpr (kHasZ) val *= silu(to_f(sm.z[t][row]));
      a.y[(((size_t)c.b * kT + t) * kH + c.h) * kP + c.row0 + row] = from_f<act_t>(val);
    }
  }
}

// state[slot] <- snapshots[slot, n-1] for n >= 1 (n clamped to [0, T]); n = 0 leaves the state.
__device__ __forceinline__ void native_commit(const int* sbi, const int* n_accepted, int nslots,
                                              const state_t* snapshots, state_t* state) {
  const Coords c = block_coords();
  const int slot = sbi[c.b];
  if (slot < 0 || slot >= nslots) return;
  const int n = min(n_accepted[c.b], kT);
  if (n <= 0) return;
  const float4* src = reinterpret_cast<const float4*>(
      snapshots + ((((size_t)slot * kT + n - 1) * kH + c.h) * kP + c.row0) * kN);
  float4* dst = reinterpret_cast<float4*>(state + (((size_t)slot * kH + c.h) * kP + c.row0) * kN);
  constexpr int kIters = (kStateVecs + kThreads - 1) / kThreads;
  float4 buf[kIters];
#pragma unroll
  for (int u = 0; u < kIters; ++u) {
    const int i = threadIdx.x + u * kThreads;
    if (kStateVecs % kThreads == 0 || i < kStateVecs) buf[u] = __ldcs(src + i);
  }
#pragma unroll
  for (int u = 0; u < kIters; ++u) {
    const int i = threadIdx.x + u * kThreads;
    if (kStateVecs % kThreads == 0 || i < kStateVecs) __stcs(dst + i, buf[u]);
  }
}

}  // namespace rssm
