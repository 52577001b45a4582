# SPDX-License-Identifier: Apache-2.0
"""The state contract: every tensor that persists between decode steps, its layout, and who writes it.

This docstring is the one home of the contract. The launchers (:mod:`.families.mamba2.ops`, :mod:`.families.gdn.ops`,
...) list the per-step inputs next to the checks that enforce them, :class:`~.cache.ReplayStateCache` allocates
these tensors for every layer of a model (a leading ``layers`` dim), the builders export them as engine
I/O (``builders/decode_step.py``, ``qwen_export.py``, and ``spec_step.py``'s commit graph: ``<name>_<layer>`` in,
``<name>_<layer>_out`` out, aliased in TensorRT), and the float64 specs (:mod:`.families.mamba2.reference`,
:mod:`.families.mamba2.spec_reference`, :mod:`.families.gdn.reference`, ...; the cursor rules all share: :mod:`.cursor`)
define what each step computes. The layouts are
vLLM's (>= PR #48018) and FlashInfer's (>= 0.7.0 ring API), so users can swap kernels.

Sizes: S slots (one per live request, plus padding), H heads, P headdim, N dstate, G groups (Mamba-2);
HV value heads, Hk key heads, V value dim, K key dim (Gated DeltaNet; Kimi Delta Attention: H heads, K, V);
L ring capacity (buffer length, 1..32); T = 1 + num_draft tokens per step; W conv window; act = the activation dtype.

Mamba-2 layer (``families/mamba2/reference.py`` math; DESIGN.md §1):

=============  ====================  ==================  ===================================================
tensor         shape                 dtype               written by
=============  ====================  ==================  ===================================================
state          (S, H, P, N)          f32 (bf16/f16/fp8)  the checkpoint S0: prefill hand-off; a flush
                                                         (replay_decode when the buffer fills, k = L;
                                                         replay_verify when count + 2T > L); every step
                                                         of the conventional baseline
shadow         (S, H, P, N)          bf16 / fp8-e4m3fn   optional, with an f32 state: rewritten from the
shadow_scale   (S, H, P)             f32 (fp8 only)      f32 checkpoint whenever it is written
                                                         (:func:`.shadow.quantize_shadow`); read
                                                         instead of state by the steps that do not flush
ckpt_scale     (S, H, P)             f32 (8-bit state)   with an 8-bit checkpoint (state fp8-e4m3, no shadow;
                                                         standard decode): its row scales, rewritten with it at
                                                         each flush (stochastic rounding, :class:`.shadow.
                                                         Checkpoint8`; the cache's (S,) flush counts seed it)
x_cache        (S, H, L, P)          act                 ring of x_j, one entry appended per token
B_cache        (S, G, L, N)          act                 ring of B_j (C is never cached)
dt_cache       (S, H, L)             f32                 ring of processed dt_j = softplus(dt + dt_bias)
conv           (S, conv_dim, W)      act                 conv1d inputs, newest in column W - 1:
                                                         W = K_conv (standard), K_conv - 1 + num_draft
                                                         (speculative: rejected inputs drop by a shift)
=============  ====================  ==================  ===================================================

Gated DeltaNet layer (Qwen3-Next / Qwen3.5; ``families/gdn/reference.py``): the ring holds the corrected update
u_j = beta_j (v_j - S_{j-1} k_j), not v_j, so the state is linear in the ring.

=============  ====================  ==================  ===================================================
tensor         shape                 dtype               written by
=============  ====================  ==================  ===================================================
state          (S, HV, V, K)         f32                 checkpoint S0: prefill hand-off; the exact fold
                                                         of the ring at a flush (as above)
shadow         (S, HV, V, K)         bf16                optional; rewritten with the checkpoint
u_cache        (S, HV, L, V)         f32                 ring of u_j
v_cache        (S, HV, L, V)         act                 ring of v_j (the fold replays from them)
k_cache        (S, Hk, L, K)         f32                 ring of l2-normalised k_j
g_cache        (S, HV, L)            f32                 ring of log decays g_j
beta_cache     (S, HV, L)            f32                 ring of beta_j
conv           (S, conv_dim, W)      act                 conv1d over q | k | v, as Mamba-2's
=============  ====================  ==================  ===================================================

Kimi Delta Attention layer (Kimi-K3, Kimi-Linear, GLM-5.3-Flash; ``families/kda/reference.py``): Gated DeltaNet
with a per-key-channel decay; the state is (K, V) per head (the transformers / fla layout), the ring keeps the raw
k_j (both paths normalise it again) and the K-wide log decays.

=============  ====================  ==================  ===================================================
tensor         shape                 dtype               written by
=============  ====================  ==================  ===================================================
state          (S, H, K, V)          f32                 checkpoint S0: prefill hand-off; the exact fold
                                                         of the ring at a flush
shadow         (S, H, K, V)          bf16                optional; rewritten with the checkpoint
k_cache        (S, H, L, K)          act                 ring of raw k_j (before the l2 norm)
u_cache        (S, H, L, V)          f32 / bf16 (ring)   ring of corrected updates u_j (the output path; the
                                                         fp32 flush's u-sum); bf16 beside a shadow
g_cache        (S, H, L, K)          f32                 ring of per-channel log decays g_j
v_cache        (S, H, L, V)          act                 ring of v_j (the exact fold only)
beta_cache     (S, H, L)             f32                 ring of beta_j (the exact fold only)
conv           (S, conv_dim, W)      act                 conv1d over q | k | v, as Mamba-2's
=============  ====================  ==================  ===================================================

Each family's folder (:mod:`.families`) declares the same table as :class:`~.families.StateTensor` rows (what the
cache allocates from); tests/test_families.py checks every family's rows against the tables above (names, shapes,
default dtypes; ``conv`` is the cache's, not the family's).

Cursor, shared by every layer of a model (Mamba-2 and GDN alike), moved once per model step after all
layers ran (never by a layer's kernel):

- standard decode, (S,) int32: entries in the buffer since the checkpoint, 0..L-1; entry j sits at ring
  index j. ``advance_cursor``: (c + 1) % L (the k = L step flushed and emptied the buffer). This is the
  form the tuned decode kernels and the exported decode step use.
- speculative decoding, (S, 2) int32: (start, count); entry j sits at ring index (start + j) % L.
  ``spec_commit``: where count + 2T > L (the verify kernels folded the committed entries into the
  checkpoint, "flush one window early") start += count, count = 0; then count += n_accepted. Rejected
  drafts are a cursor move: their ring entries lie beyond count and are overwritten later.
- the standard form is the ring form with start = 0 (``decode_step.ring_cursor_and_windows`` converts a
  standard buffer into a ring); :class:`~.cache.ReplayStateCache` keeps either: the ring form (T = 1 is then
  standard decode on the ring, through the verify kernel) or, with ``cursor="standard"``, the standard form
  and the standard decode kernels.

state_batch_indices (batch,) int32: the slot of each batch row; -1 is a padding row (its output is left
untouched and no slot is read or written). A slot appears in at most one row.

Slot lifecycle (:class:`~.cache.ReplayStateCache`): an allocated slot, fresh or recycled, reads zeros everywhere
(state, shadow, rings, conv, cursor): ``allocate()`` resets it (``free()`` only returns it to the pool, its
tensors as they were); prefill hand-off writes the checkpoint (and shadow) from the prefill's final
SSM state, empties the ring and fills the conv window's last K_conv - 1 columns.

Snapshots (:class:`~.cache.Snapshot`; ``ReplayStateCache.snapshot`` / ``restore``, ``swap_out`` / ``swap_in``,
``Snapshot.to_bytes`` / ``from_bytes``) carry exactly the tensors of this contract that a slot owns, in these
layouts and dtypes with a leading ``layers`` dim and one row per snapshotted slot (Mamba-2: state, shadow,
shadow_scale, x_cache, B_cache, dt_cache, conv; GDN: the same under ``gdn_`` names, u / v / k / g / beta for
the rings), plus the cursor rows in the cache's form (standard (n,) or speculative (n, 2)). Nothing is folded:
the checkpoint, the ring entries (dead ones beyond the count included) and the cursor are the bits the
kernels left, so the state after the last committed token is the contract's fold of them (S_count) and a
restored slot continues bit-identically. The byte form's header names the format version, the layers per
family, the geometry (sizes above, L, num_draft, conv width), every tensor's dtype and shape and the cursor
form; a cache takes only a snapshot that matches all of them.
"""
