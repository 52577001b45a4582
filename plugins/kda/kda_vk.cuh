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
#pragma once
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

}  // namespace kda_vk
