// SPDX-License-Identifier: Apache-2.0
// Parameter-list macros shared by the entry files (replayssm_decode.cu, replayssm_spec.cu), so that
// every kernel orders its optional parameters the same way (TensorRT's AOT order: inputs, int32
// scalars, outputs; aliased outputs receive the same pointers as their inputs).
#pragma once

// The z gate (RSSM_HAS_Z) comes after D.
#if RSSM_HAS_Z
#define RSSM_Z_PARAM const act_t* __restrict__ z,
#define RSSM_Z_ARG z
#else
#define RSSM_Z_PARAM
#define RSSM_Z_ARG nullptr
#endif

// The shadow (RSSM_SHADOW 1: bf16, 2: fp8-e4m3) and its fp32 row scales come after the buffers, in
// both the inputs and the aliased outputs. A bf16 shadow has no scales: the two scale pointers are
// never read or written (null from families/mamba2/ops.py, a 1-element placeholder in a TensorRT engine), so both
// kinds share one parameter list and one plugin.
#if RSSM_SHADOW
#define RSSM_SHADOW_IN , const shadow_t* shadow_in, const float* scale_in
#define RSSM_SHADOW_OUT , shadow_t* shadow_out, float* scale_out
#define RSSM_SHADOW_ARGS shadow_in, scale_in, shadow_out, scale_out
#else
#define RSSM_SHADOW_IN
#define RSSM_SHADOW_OUT
#define RSSM_SHADOW_ARGS nullptr, nullptr, nullptr, nullptr
#endif
