// SPDX-License-Identifier: Apache-2.0
// The ReplaySSM KDA kernels' parameter list, shared by the entry files (kda_decode.cu: kda_replay_decode;
// kda_spec.cu: kda_verify), so that both keep TensorRT's AOT order (inputs, int32 scalars, outputs; aliased
// outputs receive the same pointers as their inputs) and one kda::Args layout.
#pragma once

// The bf16 shadow of the checkpoint (KDA_SHADOW 1) comes last among the inputs and among the outputs.
#if KDA_SHADOW
#define KDA_SHADOW_IN , const __nv_bfloat16* sh_in
#define KDA_SHADOW_OUT , __nv_bfloat16* sh_out
#define KDA_SH_IN sh_in
#define KDA_SH_OUT sh_out
#else
#define KDA_SHADOW_IN
#define KDA_SHADOW_OUT
#define KDA_SH_IN nullptr
#define KDA_SH_OUT nullptr
#endif

#define KDA_REPLAY_PARAMS                                                                                         \
  const act_t *__restrict__ q, const act_t *__restrict__ k, const act_t *__restrict__ v,                          \
      const act_t *__restrict__ f, const act_t *__restrict__ b, const float *__restrict__ A_log,                  \
      const float *__restrict__ dt_bias, const int *__restrict__ sbi, const int *__restrict__ cursor,             \
      const float *state_in, const act_t *kc_in, const ring_t *uc_in, const float *gc_in, const act_t *vc_in,     \
      const float *bc_in KDA_SHADOW_IN, int batch, int nslots, act_t *__restrict__ y, float *state_out,           \
      act_t *kc_out, ring_t *uc_out, float *gc_out, act_t *vc_out, float *bc_out KDA_SHADOW_OUT

#define KDA_REPLAY_ARGS                                                                                           \
  kda::Args {                                                                                                     \
    q, k, v, f, b, A_log, dt_bias, sbi, cursor, state_in, kc_in, uc_in, gc_in, vc_in, bc_in, KDA_SH_IN, batch,    \
        nslots, y, state_out, kc_out, uc_out, gc_out, vc_out, bc_out, KDA_SH_OUT                                  \
  }

// The conventional step's kernels (kda_decode.cu: kda_conventional, and kda_conventional_bulk where KDA_BULK): inputs
// 1-8 as above, the state; batch, nslots; y, the state (aliased).
#define KDA_CONV_PARAMS                                                                                           \
  const act_t *__restrict__ q, const act_t *__restrict__ k, const act_t *__restrict__ v,                          \
      const act_t *__restrict__ f, const act_t *__restrict__ b, const float *__restrict__ A_log,                  \
      const float *__restrict__ dt_bias, const int *__restrict__ sbi, const float *state_in, int batch,           \
      int nslots, act_t *__restrict__ y, float *state_out

#define KDA_CONV_ARGS                                                                                             \
  kda::Args {                                                                                                     \
    q, k, v, f, b, A_log, dt_bias, sbi, nullptr, state_in, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,  \
        batch, nslots, y, state_out, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr                         \
  }
