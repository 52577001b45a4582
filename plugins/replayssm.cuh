// SPDX-License-Identifier: Apache-2.0
// ReplaySSM Mamba-2 decode: device math shared by every entry point.
//
// The generated prelude (trtllm_replayssm/compile.py) defines, before this header:
//   state_t, act_t                 storage types of the checkpoint and of the activations
//   kH, kP, kN, kG, kL             nheads, headdim, dstate, ngroups, replay buffer length
//   kRows, kWarps                  rows of one head handled by one block, warps per block
//   kHasZ                          whether the output is gated by silu(z)
//
// Math (DESIGN.md §1). Per (slot, head): checkpoint S0 (P x N), buffer entries j = 1..k (k = now),
// c_j = A * sum_{i<=j} dt_i, w_j = dt_j * exp(c_k - c_j):
//   y_k = exp(c_k) (S0 C_k) + sum_j w_j (B_j . C_k) x_j + D x_k          (output form, no state write)
//   S_k = exp(c_k) S0 + sum_j w_j x_j B_j^T                              (state form, used by flush)
//
// Work split: one block per (batch row, head, chunk of kRows rows). Each thread owns kRT rows x
// kVPL 16-byte vectors of the state, so a warp load covers whole contiguous rows. The state loads
// are issued first; the buffer part (dt scan, B.C dots, x tile) runs while they are in flight.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace rssm {

// ---- dtype helpers ---------------------------------------------------------------------------
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

// n contiguous elements moved as one aligned vector access (up to 16 bytes, else several).
template <typename T, int n>
struct alignas(sizeof(T) * n >= 16 ? 16 : sizeof(T) * n) Vec {
  T v[n];
};

template <typename T, int n>
__device__ __forceinline__ void load_f(const T* p, float (&out)[n]) {
  Vec<T, n> t = *reinterpret_cast<const Vec<T, n>*>(p);
#pragma unroll
  for (int i = 0; i < n; ++i) out[i] = to_f(t.v[i]);
}
// Streaming (evict-first) load for data read once: the checkpoint.
template <typename T, int n>
__device__ __forceinline__ void load_stream_f(const T* p, float (&out)[n]) {
  static_assert(sizeof(T) * n == 16, "state vectors are 16 bytes");
  float4 raw = __ldcs(reinterpret_cast<const float4*>(p));
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < n; ++i) out[i] = to_f(e[i]);
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
static_assert(kRows <= kThreads, "one thread finalizes each row");

struct Coords {
  int b, h, g, chunk, row0;
};
__device__ __forceinline__ Coords block_coords() {
  Coords c;
  c.b = blockIdx.y;
  c.h = blockIdx.x / kChunks;
  c.chunk = blockIdx.x % kChunks;
  c.row0 = c.chunk * kRows;
  c.g = c.h / kHPG;
  return c;
}
// Row (within the block's chunk) and first column of vector v for this thread's r-th row.
__device__ __forceinline__ int my_row(int r) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  return (warp * kRT + r) * kRPW + lane / kLPR;
}
__device__ __forceinline__ int my_col(int v) {
  const int lane = threadIdx.x % 32;
  return (v * kLPR + lane % kLPR) * kEPV;
}
// Sum over the kLPR lanes that share a row (xor stays inside the aligned lane group).
__device__ __forceinline__ float row_sum(float v) {
#pragma unroll
  for (int o = kLPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct StateRegs {
  float s[kRT][kVPL][kEPV];
};
__device__ __forceinline__ void load_state(StateRegs& st, const state_t* base) {
#pragma unroll
  for (int r = 0; r < kRT; ++r)
#pragma unroll
    for (int v = 0; v < kVPL; ++v)
      load_stream_f<state_t, kEPV>(base + (size_t)my_row(r) * kN + my_col(v), st.s[r][v]);
}
__device__ __forceinline__ void store_state(const StateRegs& st, state_t* base) {
#pragma unroll
  for (int r = 0; r < kRT; ++r)
#pragma unroll
    for (int v = 0; v < kVPL; ++v)
      store_stream_f<state_t, kEPV>(base + (size_t)my_row(r) * kN + my_col(v), st.s[r][v]);
}
struct ColRegs {
  float c[kVPL][kEPV];
};
__device__ __forceinline__ void load_cols(ColRegs& cr, const act_t* vec) {
#pragma unroll
  for (int v = 0; v < kVPL; ++v) load_f<act_t, kEPV>(vec + my_col(v), cr.c[v]);
}
// Row dots of the thread's state rows with C, reduced over the row's lanes; lane 0 of each
// row group writes the dot for its row into out[row].
__device__ __forceinline__ void state_dot_rows(const StateRegs& st, const ColRegs& cc, float* out) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < kRT; ++r) {
    float acc = 0.f;
#pragma unroll
    for (int v = 0; v < kVPL; ++v)
#pragma unroll
      for (int e = 0; e < kEPV; ++e) acc = fmaf(st.s[r][v][e], cc.c[v][e], acc);
    acc = row_sum(acc);
    if (lane % kLPR == 0) out[my_row(r)] = acc;
  }
}

// ---- shared memory of the replay kernel -------------------------------------------------------
struct alignas(16) ReplaySmem {
  act_t Bt[kL][kN];      // B_1..B_k (B_k = this step's input)
  act_t xt[kL][kRows];   // x_1..x_k for this block's rows
  float C[kN];
  float dt[kL];          // processed dt_1..dt_k
  float w[kL];           // w_j
  float bc[kL];          // B_j . C_k
  float sdot[kRows];     // S0 . C_k (or S_k . C_k on flush) per row
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
};

// y for the block's rows: y = sdot_scaled + extra, times silu(z) when gated.
__device__ __forceinline__ void write_y(const ReplayArgs& a, const Coords& c, float val, int t) {
  const size_t o = ((size_t)c.b * kH + c.h) * kP + c.row0 + t;
  if constexpr (kHasZ) val *= silu(to_f(a.z[o]));
  a.y[o] = from_f<act_t>(val);
}

__device__ __forceinline__ void replay_decode(const ReplayArgs& a) {
  __shared__ ReplaySmem sm;
  const Coords c = block_coords();
  const int slot = a.sbi[c.b];
  if (slot < 0 || slot >= a.nslots) return;  // padding row (or out of range): touch nothing
  const int pos = a.cursor[slot];
  const int t = threadIdx.x;
  if (pos < 0 || pos >= kL) {  // corrupt cursor: make it loud in y, leave every state alone
    if (t < kRows) write_y(a, c, __int_as_float(0x7fc00000), t);
    return;
  }
  const int k = pos + 1;
  const bool flush = (k == kL);

  // 1. Checkpoint rows first: they are the bulk of the bytes and need the most time in flight.
  const size_t sbase = (((size_t)slot * kH + c.h) * kP + c.row0) * kN;
  StateRegs st;
  load_state(st, a.state_in + sbase);
  ColRegs cc;
  load_cols(cc, a.C + ((size_t)c.b * kG + c.g) * kN);

  // 2. Stage the buffer (history from the caches, entry k from this step's inputs).
  const act_t* Bc = a.Bc_in + ((size_t)slot * kG + c.g) * kL * kN;
  const act_t* Bnow = a.B + ((size_t)c.b * kG + c.g) * kN;
  for (int i = t; i < k * kN; i += kThreads) {
    const int j = i / kN, n = i % kN;
    sm.Bt[j][n] = j == pos ? Bnow[n] : Bc[i];
  }
  const act_t* xc = a.xc_in + ((size_t)slot * kH + c.h) * kL * kP + c.row0;
  const act_t* xnow = a.x + ((size_t)c.b * kH + c.h) * kP + c.row0;
  for (int i = t; i < k * kRows; i += kThreads) {
    const int j = i / kRows, p = i % kRows;
    sm.xt[j][p] = j == pos ? xnow[p] : xc[(size_t)j * kP + p];
  }
  for (int n = t; n < kN; n += kThreads) sm.C[n] = to_f(a.C[((size_t)c.b * kG + c.g) * kN + n]);
  const float* dtc = a.dtc_in + ((size_t)slot * kH + c.h) * kL;
  if (t < k) {
    sm.dt[t] = t == pos ? softplus(to_f(a.dt[(size_t)c.b * kH + c.h]) + a.dt_bias[c.h]) : dtc[t];
  }
  __syncthreads();

  // 3. Append entry k unless this step flushes (the flush empties the buffer).
  if (!flush) {
    act_t* xo = a.xc_out + (((size_t)slot * kH + c.h) * kL + pos) * kP + c.row0;
    for (int p = t; p < kRows; p += kThreads) xo[p] = xnow[p];
    if (c.chunk == 0) {
      if (c.h % kHPG == 0) {
        act_t* Bo = a.Bc_out + (((size_t)slot * kG + c.g) * kL + pos) * kN;
        for (int n = t; n < kN; n += kThreads) Bo[n] = Bnow[n];
      }
      if (t == 0) a.dtc_out[((size_t)slot * kH + c.h) * kL + pos] = sm.dt[pos];
    }
  }

  // 4. Warp 0: cumulative decay over the buffer (one lane per entry).
  const int warp = t / 32, lane = t % 32;
  if (warp == 0) {
    const float A = a.A[c.h];
    const float dtj = lane < k ? sm.dt[lane] : 0.f;
    float cum = dtj;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float u = __shfl_up_sync(0xffffffffu, cum, o);
      if (lane >= o) cum += u;
    }
    const float total = __shfl_sync(0xffffffffu, cum, k - 1);
    if (lane < k) sm.w[lane] = dtj * expf(A * (total - cum));
    if (lane == 0) sm.decay = expf(A * total);
  }
  if (!flush) {
    // B_j . C_k for every entry: one warp per entry, lanes over dstate.
    for (int j = warp; j < k; j += kWarps) {
      float acc = 0.f;
      for (int n = lane; n < kN; n += 32) acc = fmaf(to_f(sm.Bt[j][n]), sm.C[n], acc);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) sm.bc[j] = acc;
    }
    state_dot_rows(st, cc, sm.sdot);
  }
  __syncthreads();

  const float D = a.D[c.h];
  if (!flush) {
    if (t < kRows) {
      float acc = sm.decay * sm.sdot[t] + D * to_f(sm.xt[pos][t]);
#pragma unroll
      for (int j = 0; j < kL; ++j)
        if (j < k) acc = fmaf(sm.w[j] * sm.bc[j], to_f(sm.xt[j][t]), acc);
      write_y(a, c, acc, t);
    }
    return;
  }

  // 5. Flush: S_k = exp(c_k) S0 + sum_j (w_j x_j) B_j^T, written as the new checkpoint.
  const float decay = sm.decay;
#pragma unroll
  for (int r = 0; r < kRT; ++r)
#pragma unroll
    for (int v = 0; v < kVPL; ++v)
#pragma unroll
      for (int e = 0; e < kEPV; ++e) st.s[r][v][e] *= decay;
#pragma unroll 4
  for (int j = 0; j < kL; ++j) {
    const float wj = sm.w[j];
    float bj[kVPL][kEPV];
#pragma unroll
    for (int v = 0; v < kVPL; ++v) load_f<act_t, kEPV>(&sm.Bt[j][my_col(v)], bj[v]);
#pragma unroll
    for (int r = 0; r < kRT; ++r) {
      const float xw = wj * to_f(sm.xt[j][my_row(r)]);
#pragma unroll
      for (int v = 0; v < kVPL; ++v)
#pragma unroll
        for (int e = 0; e < kEPV; ++e) st.s[r][v][e] = fmaf(xw, bj[v][e], st.s[r][v][e]);
    }
  }
  store_state(st, a.state_out + sbase);
  state_dot_rows(st, cc, sm.sdot);
  __syncthreads();
  if (t < kRows) write_y(a, c, sm.sdot[t] + D * to_f(sm.xt[pos][t]), t);
}

// ---- conventional step (baseline): reads and writes the whole state every step ----------------
struct ConvSmem {
  float x[kRows];
  float sdot[kRows];
};
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
  __shared__ ConvSmem sm;
  const Coords c = block_coords();
  const int slot = a.sbi[c.b];
  if (slot < 0 || slot >= a.nslots) return;
  const int t = threadIdx.x;
  const size_t sbase = (((size_t)slot * kH + c.h) * kP + c.row0) * kN;
  StateRegs st;
  load_state(st, a.state_in + sbase);
  ColRegs bb, cc;
  load_cols(bb, a.B + ((size_t)c.b * kG + c.g) * kN);
  load_cols(cc, a.C + ((size_t)c.b * kG + c.g) * kN);
  const act_t* xnow = a.x + ((size_t)c.b * kH + c.h) * kP + c.row0;
  for (int p = t; p < kRows; p += kThreads) sm.x[p] = to_f(xnow[p]);
  const float dt = softplus(to_f(a.dt[(size_t)c.b * kH + c.h]) + a.dt_bias[c.h]);
  const float decay = expf(a.A[c.h] * dt);
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kRT; ++r) {
    const float xd = dt * sm.x[my_row(r)];
#pragma unroll
    for (int v = 0; v < kVPL; ++v)
#pragma unroll
      for (int e = 0; e < kEPV; ++e) st.s[r][v][e] = fmaf(decay, st.s[r][v][e], xd * bb.c[v][e]);
  }
  store_state(st, a.state_out + sbase);
  state_dot_rows(st, cc, sm.sdot);
  __syncthreads();
  if (t < kRows) {
    float val = sm.sdot[t] + a.D[c.h] * sm.x[t];
    const size_t o = ((size_t)c.b * kH + c.h) * kP + c.row0 + t;
    if constexpr (kHasZ) val *= silu(to_f(a.z[o]));
    a.y[o] = from_f<act_t>(val);
  }
}

}  // namespace rssm
