// SPDX-License-Identifier: Apache-2.0
// The ReplaySSM GDN kernels' parameter list, shared by the entry files (gdn_decode.cu: gdn_replay_decode;
// gdn_spec.cu: gdn_verify), so that both keep TensorRT's AOT order (inputs, int32 scalars, outputs; aliased
// outputs receive the same pointers as their inputs) and one ReplayArgs layout.
#pragma once

// The bf16 shadow of the checkpoint (GDN_SHADOW 1) comes last among the inputs and among the outputs.
#if GDN_SHADOW
#define GDN_SHADOW_IN , const shadow_t* sh_in
#define GDN_SHADOW_OUT , shadow_t* sh_out
#define GDN_SHADOW_IN_ARG sh_in
#define GDN_SHADOW_OUT_ARG sh_out
#else
#define GDN_SHADOW_IN
#define GDN_SHADOW_OUT
#define GDN_SHADOW_IN_ARG nullptr
#define GDN_SHADOW_OUT_ARG nullptr
#endif

#define GDN_REPLAY_PARAMS                                                                                     \
  const act_t *__restrict__ q, const act_t *__restrict__ k, const act_t *__restrict__ v,                      \
      const act_t *__restrict__ a, const act_t *__restrict__ b, const float *__restrict__ A_log,              \
      const float *__restrict__ dt_bias, const int *__restrict__ sbi, const int *__restrict__ cursor,         \
      const float *state_in, const float *uc_in, const act_t *vc_in, const float *kc_in, const float *gc_in,  \
      const float *bc_in GDN_SHADOW_IN, int batch, int nslots, act_t *__restrict__ y, float *state_out,       \
      float *uc_out, act_t *vc_out, float *kc_out, float *gc_out, float *bc_out GDN_SHADOW_OUT

#define GDN_REPLAY_ARGS                                                                                       \
  gdn::ReplayArgs {                                                                                           \
    q, k, v, a, b, A_log, dt_bias, sbi, cursor, state_in, uc_in, vc_in, kc_in, gc_in, bc_in,                  \
        GDN_SHADOW_IN_ARG, batch, nslots, y, state_out, uc_out, vc_out, kc_out, gc_out, bc_out,               \
        GDN_SHADOW_OUT_ARG                                                                                    \
  }
