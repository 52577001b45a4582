# SPDX-License-Identifier: Apache-2.0
"""The one bytes model and the one memory model: what every benchmark divides its times by and what every
memory table, batch budget and run plan adds up (issue 15). Nothing here runs a kernel; every function is
integer (or float, where a mean or an acceptance enters) arithmetic on the geometry.

Symbols. Mamba-2 layer: H heads, P headdim, N dstate, G groups; Gated DeltaNet (GDN) layer: HV value heads,
Hk key heads (``H`` in the GDN functions, as :mod:`.families.gdn.reference` names them), V value dim, Kd key dim.
L ring (buffer) length, T = 1 + num_draft tokens of a step, m entries committed before a step (the
cursor's count), k = m + 1 the buffer position of a standard decode step, K conv kernel, W conv window
columns. Bytes per element: s state (fp32 4), a activations (bf16 2), f ring floats (fp32 4; 8 in the
float64 test caches), q shadow (bf16 2, fp8 1; an fp8 shadow also keeps r = 4 bytes of fp32 scale per
state row, bf16 r = 0). ``shadow`` arguments take None / "none", "bf16", "fp8" or q as a number
(0 = none; a number below 2 carries the fp8 row scales). s = 1 is an 8-bit checkpoint (fp8-e4m3 with one fp32 scale
per state row, no full-precision copy; issue 38): S below then counts its scales, S = H P (N + 4) (GDN: HV V (Kd + 4)),
and it is its own read copy (no shadow). b batch rows, M Mamba-2 / A attention layers of
a model, kvh KV heads of hd, V_voc vocabulary, W_w weight bytes.

Per (batch row, Mamba-2 layer), one launch (:func:`mamba2_bytes_per_position`, :func:`mamba2_verify_bytes`,
:func:`mamba2_native_spec_bytes`; plugins/mamba2/replayssm_spec.cuh states the same per head):
    S   = H P N s                                  checkpoint
    R   = H P (N q + r)                            shadow read instead of S (R = S without a shadow)
    io  = x H P a + B, C 2 G N a + dt H a + y H P a   per token, in and out
    E   = H P a + G N a + 4 H                      one ring entry (x, B, processed dt), read or written
    conventional            2 S + io
    verify, m + 2T <= L     R + T io + m E + T E                     (no fold: history read, window appended)
    verify, m + 2T > L      2 S + R_w + T io + m E + T E             (fold: read S, write S; R_w = R with a
                                                                     shadow (rewritten), else 0)
    standard decode at k    the verify of T = 1 at m = k - 1: R + io + k E for k < L; the flush k = L folds
                            and writes no entry (the ring restarts empty): 2 S + R_w + io + (L - 1) E
    native verify           S + T io + T S  (T snapshots written);   native commit 2 S
Per (batch row, GDN layer), the same forms (:func:`gdn_bytes_per_position`, :func:`gdn_verify_bytes`,
:func:`gdn_native_spec_bytes`; :mod:`.families.gdn.reference` re-exports the first two under its old names):
    S   = HV V Kd s,  R = HV V (Kd q + r)
    io  = q, k 2 Hk Kd a + v HV V a + a, b 2 HV a + y HV V a
    E_r = u HV V 4 + k Hk Kd 4 + g HV 4           entry read by the output path
    E_f = v HV V a + k Hk Kd 4 + g, beta 2 HV 4    entry read by the exact fold
    E_w = u HV V 4 + v HV V a + k Hk Kd 4 + g, beta 2 HV 4   entry written
    verify, no fold  R + T io + m E_r + T E_w;  fold  2 S + R_w + T io + m E_f + T E_w
    standard decode at k < L: R + io + (k - 1) E_r + E_w;  flush: 2 S + R_w + io + (L - 1) E_f
    native verify S + T S + T io;  native commit 2 S
Per (batch row, Kimi Delta Attention (KDA) layer), the same forms (:func:`kda_bytes_per_position`,
:func:`kda_verify_bytes`, :func:`kda_native_spec_bytes`; H heads, K key dim, V value dim; ring u bytes u
(bf16 2), per-channel log-decay bytes g (fp32 4); :mod:`.families.kda.reference`'s ring):
    S   = H K V s,  R = H K (V q + r)
    io  = q, k, raw forget gate f 3 H K a + v H V a + raw beta H a + y H V a
    E_r = k H K a + u H V u + g H K g               entry read by the output path
    E_f = k H K a + v H V a + g H K g + beta H 4    entry read by the exact fold
    E_w = k H K a + u H V u + g H K g + v H V a + beta H 4   entry written (:func:`kda_ring_entry_bytes`)
    then exactly the GDN forms above with these S, R, io, E_r, E_f, E_w.
Amortized over a flush cycle (:func:`mamba2_bytes_per_step`, :func:`gdn_bytes_per_step`,
:func:`kda_bytes_per_step`): the mean over k = 1..L; ratio = conventional / that mean. :func:`ring_sweep`: the
best L and the L past which the amortized ratio falls below 1, for any family.

Per (batch row, Mamba-2 layer), one step of the end-to-end model (:func:`decode_step_bytes`,
:func:`spec_step_bytes`; the layer's io is not counted there, and the standard replay step charges an
entry write on all L steps, flush included: the convention of bench/NOTES.md's end-to-end tables):
    conventional, mamba_ssm  2 S;   noop 0
    replay                   S (1 + 1/L) + (L - 1)/2 E + E
    replay_bf16, replay_fp8  2 S / L + R + (L - 1)/2 E + E      (shadow read on L - 1 steps and rewritten by
                                                                the flush, which reads and writes S)
    replay_spec              sum_m p(m) [S (1 + [m + 2T > L]) + (m + T) E + T E], p the stationary distribution
                             of the committed count m before a step (:func:`spec_count_distribution`: fold where
                             m + 2T > L, then count = n; n = 1 + consecutive accepted drafts, each accepted with
                             the probability that gives the mean n accepted per step; full acceptance when not
                             given: counts T, 2T, ... in steady state)
    native_spec              S (1 + T) + 2 S;   spec_noop 0;   standard = replay
with S = H P N 4 (the end-to-end models keep an fp32 checkpoint). The step adds, for the whole model:
    decode  W_w + M b 2 cd K a (conv windows) + A b 2 kvh fill hd a (K and V of the ``fill`` positions read)
    spec    W_w + A b 2 kvh fill hd a + M b cd 4 (K - 2 + T) a (conv windows, as the e2e spec step has
            always counted them) + b T V_voc (2 + 4 + 4) (logits: bf16, fp32, fp32)
    total   int(that + M b ssm)
with cd = H P + 2 G N the conv channels (x | B | C).

Memory per request slot (:func:`mamba2_layer_memory`, :func:`gdn_layer_memory`, :func:`cache_bytes`,
which adds up exactly what :class:`.cache.ReplayStateCache` allocates; tests/test_costs.py checks it):
    Mamba-2 layer  state H P N s + shadow H P N q + H P r + ring L (H P + G N) a + dt ring H L f
                   + conv window cd W a,  W = K - 1 + num_draft
    GDN layer      state HV V Kd s + shadow HV V Kd q + HV V r + rings u HV L V f + v HV L V a
                   + k Hk L Kd f + g, beta 2 HV L f + conv window (2 Hk Kd + HV V) W a
    KDA layer      state H K V s + shadow H K V q + H K r + ring L E_w + conv window (2 H K + H V) W a
                   (:func:`kda_layer_memory`)
    slot           Mamba-2 layers + GDN layers + cursor 8;  cache = slots x slot + one scratch conv window
                   per layer (the padding rows' destination)
    native spec    (1 + num_draft) (S + cd (K - 1) a) per layer (vLLM / TensorRT-LLM keep a state and a
                   conv state per draft position; :func:`memory_per_request`)
Serving memory of a model (:func:`serving_memory`): W_w + ssm + conv + kv + scratch with
    ssm      standard, replay_spec: M b (state + ring);  native_spec M b S (1 + T) (the ``ops.native_spec_*``
             API keeps the state and T snapshots: one more than :func:`memory_per_request`, which counts an
             engine that remaps the accepted snapshot's slot);  spec_noop 0
    conv     M b cd W a,  W = K (standard) or K - 2 + T (spec);   kv  A 2 b kvh kv_len hd a
    scratch  t (V_voc (a + 4 + 4) + wide a 4) + 3 b heads t' kv_len 4 + 1 GiB,  t = b (standard) or b T
             tokens, t' = 1 or T, wide = max(2 H P + 2 G N + H, intermediate)
:func:`max_batch` is the largest b whose total fits a budget (:func:`max_batch_within` for any total).
The benchmarks' run plans (:func:`decode_run_plan`, :func:`spec_run_plan`) add the post-prompt snapshot
(state, conv, kv) that every mode restores; the e2e standard step's plan has its own scratch estimate, written there.
Weights: :func:`model_weight_bytes` (a built model's parameters) and :func:`config_weight_bytes` (a
config's parameter count times the dtype's itemsize, without allocating).
"""

from __future__ import annotations

GiB = 1 << 30
FP8_SCALE_BYTES = 4  # one fp32 scale per state row of an fp8 shadow (and of an 8-bit checkpoint)
CKPT8_BYTES = 1  # state_bytes of an 8-bit checkpoint: e4m3 + FP8_SCALE_BYTES per row
DECODE_MODES = ("conventional", "replay", "replay_bf16", "replay_fp8", "mamba_ssm", "noop")
SPEC_MODES = ("standard", "replay_spec", "native_spec", "spec_noop")
_SHADOW_NAMES = {"none": None, "bf16": (2, 0), "fp8": (1, FP8_SCALE_BYTES)}
_DECODE_SHADOW = {"replay_bf16": "bf16", "replay_fp8": "fp8"}


def shadow_sizes(shadow) -> tuple | None:
    """(q, r): bytes per shadow element and per state row of scales; None without a shadow (docstring)."""
    if shadow is None or isinstance(shadow, str):
        if shadow is not None and shadow not in _SHADOW_NAMES:
            raise ValueError(f"shadow: expected None, one of {tuple(_SHADOW_NAMES)} or bytes per element, got {shadow!r}")
        return _SHADOW_NAMES[shadow or "none"]
    if shadow == 0:
        return None
    return shadow, (FP8_SCALE_BYTES if shadow < 2 else 0)


def _itemsize(dtype_or_bytes) -> int:
    return getattr(dtype_or_bytes, "itemsize", dtype_or_bytes)


# ---- bytes of one launch: the shared forms ---------------------------------------------------------------------
def _window(state: int, read, write_shadow, io, hist, fold_hist, entry, L: int, T: int, m: int):
    """One verify of T tokens at committed count m: the flush rule m + 2T > L chooses the fold."""
    if m + 2 * T <= L:
        return read + T * io + m * hist + T * entry
    return 2 * state + write_shadow + T * io + m * fold_hist + T * entry


def _per_position(state: int, read, write_shadow, io, hist, fold_hist, entry, L: int):
    """(conventional, {k: standard replay step at k}): the verify of T = 1 at m = k - 1, the flush writing no entry."""
    per_k = {k: _window(state, read, write_shadow, io, hist, fold_hist, entry, L, 1, k - 1) for k in range(1, L)}
    per_k[L] = 2 * state + write_shadow + io + (L - 1) * fold_hist
    return 2 * state + io, per_k


def _per_step(conv, per_k: dict, L: int) -> dict:
    replay = sum(per_k.values()) / L
    nonflush = sum(per_k[k] for k in range(1, L)) / max(1, L - 1)
    return {"conventional": conv, "replay": replay, "ratio": conv / replay, "nonflush": nonflush, "flush": per_k[L]}


# ---- Mamba-2: one launch per (batch row, layer) -----------------------------------------------------------------
def mamba2_state_bytes(H: int, P: int, N: int, state_bytes: int = 4) -> int:
    """S = H P N s: one row's checkpoint in one layer (an 8-bit one, s = 1, with its fp32 row scales: H P (N + 4))."""
    return H * P * N * state_bytes + (H * P * FP8_SCALE_BYTES if state_bytes == CKPT8_BYTES else 0)


def _mamba2_parts(H, P, N, G, state_bytes, act_bytes, shadow):
    a = act_bytes
    state = mamba2_state_bytes(H, P, N, state_bytes)
    sh = shadow_sizes(shadow)
    read = state if sh is None else H * P * (N * sh[0] + sh[1])
    io = H * P * a + 2 * G * N * a + H * a + H * P * a  # x, B, C, dt in; y out
    entry = H * P * a + G * N * a + 4 * H
    return state, read, (0 if sh is None else read), io, entry


def mamba2_bytes_per_position(H: int, P: int, N: int, G: int, L: int, state_bytes: int = 4, act_bytes: int = 2,
                              shadow=None) -> tuple[int, dict[int, int]]:
    """(conventional step, {k: ReplaySSM standard decode step at buffer position k = 1..L}) per (row, layer)."""
    state, read, wsh, io, entry = _mamba2_parts(H, P, N, G, state_bytes, act_bytes, shadow)
    return _per_position(state, read, wsh, io, entry, entry, entry, L)


def mamba2_bytes_per_step(H: int, P: int, N: int, G: int, L: int, state_bytes: int = 4, act_bytes: int = 2,
                          shadow=None) -> dict:
    """:func:`mamba2_bytes_per_position` over a flush cycle: conventional, replay (mean over k), ratio, nonflush, flush."""
    conv, per_k = mamba2_bytes_per_position(H, P, N, G, L, state_bytes, act_bytes, shadow)
    return _per_step(conv, per_k, L)


def mamba2_verify_bytes(H: int, P: int, N: int, G: int, L: int, T: int, m: int, state_bytes: int = 4,
                        act_bytes: int = 2, shadow=None) -> int:
    """One ReplaySSM speculative verify of T tokens at committed count m (folding where m + 2T > L)."""
    state, read, wsh, io, entry = _mamba2_parts(H, P, N, G, state_bytes, act_bytes, shadow)
    return _window(state, read, wsh, io, entry, entry, entry, L, T, m)


def mamba2_native_spec_bytes(H: int, P: int, N: int, G: int, T: int, state_bytes: int = 4,
                             act_bytes: int = 2) -> tuple[int, int]:
    """(native verify: S + T io + T snapshots, native commit: one snapshot read, S written)."""
    state, _, _, io, _ = _mamba2_parts(H, P, N, G, state_bytes, act_bytes, None)
    return state + T * io + T * state, 2 * state


# ---- Gated DeltaNet: one launch per (batch row, layer) -----------------------------------------------------------
def gdn_state_bytes(HV: int, V: int, K: int, state_bytes: int = 4) -> int:
    """S = HV V Kd s: one row's checkpoint in one GDN layer (8-bit, s = 1: with a scale per (head, row v))."""
    return HV * V * K * state_bytes + (HV * V * FP8_SCALE_BYTES if state_bytes == CKPT8_BYTES else 0)


def _gdn_parts(HV, H, V, K, act_bytes, state_bytes, shadow):
    a = act_bytes
    state = gdn_state_bytes(HV, V, K, state_bytes)
    sh = shadow_sizes(shadow)
    read = state if sh is None else HV * V * K * sh[0] + HV * V * sh[1]
    io = (2 * H * K + HV * V + 2 * HV) * a + HV * V * a
    hist = HV * V * 4 + H * K * 4 + HV * 4  # u, k, g of one entry read by the output
    fold = HV * V * a + H * K * 4 + 2 * HV * 4  # v, k, g, beta of one entry read by the fold
    entry = HV * V * 4 + HV * V * a + H * K * 4 + 2 * HV * 4  # u, v, k, g, beta written
    return state, read, (0 if sh is None else read), io, hist, fold, entry


def gdn_bytes_per_position(HV: int, H: int, V: int, K: int, L: int, act_bytes: int = 2, state_bytes: int = 4,
                           shadow_bytes: float | None = None) -> tuple[float, dict[int, float]]:
    """The GDN bytes model per (slot, layer): (conventional step, {k: ReplaySSM step at buffer position k}).

    Conventional: read + write the state. ReplaySSM at k < L: read S0 (or its shadow) once, the k - 1
    buffered entries the output needs (u, k, g), write one entry (u, v, k, g, beta); at k = L (the flush):
    read S0 and the L - 1 entries, write S0 (+ the shadow): without a shadow the u-sum's (u, k, g), with one the
    exact refold's (v, k, g, beta) (plugins/gdn/gdn.cuh ``replay_flush``). Inputs q, k, v, a, b and the output y
    are the same for both and counted in both (what scripts/bench_gdn.py divides its times by)."""
    state, read, wsh, io, hist, fold, entry = _gdn_parts(HV, H, V, K, act_bytes, state_bytes, shadow_bytes)
    return _per_position(state, read, wsh, io, hist, fold if wsh else hist, entry, L)


def gdn_bytes_per_step(HV: int, H: int, V: int, K: int, L: int, act_bytes: int = 2, state_bytes: int = 4,
                       shadow_bytes: float | None = None) -> dict[str, float]:
    """:func:`gdn_bytes_per_position` amortized over a flush cycle of L steps: conventional, replay (the mean over
    k), their ratio, the mean non-flush step and the flush step."""
    conv, per_k = gdn_bytes_per_position(HV, H, V, K, L, act_bytes, state_bytes, shadow_bytes)
    return _per_step(conv, per_k, L)


def gdn_verify_bytes(HV: int, H: int, V: int, K: int, L: int, T: int, m: int, act_bytes: int = 2,
                     state_bytes: int = 4, shadow_bytes: float | None = None) -> int:
    """One GDN ReplaySSM verify of T tokens at committed count m (the exact fold of the m entries where m + 2T > L)."""
    state, read, wsh, io, hist, fold, entry = _gdn_parts(HV, H, V, K, act_bytes, state_bytes, shadow_bytes)
    return _window(state, read, wsh, io, hist, fold, entry, L, T, m)


def gdn_native_spec_bytes(HV: int, H: int, V: int, K: int, T: int, act_bytes: int = 2,
                          state_bytes: int = 4) -> tuple[int, int]:
    """(native verify: S + T snapshots + T io, native commit: 2 S) per (row, layer)."""
    state, _, _, io, *_ = _gdn_parts(HV, H, V, K, act_bytes, state_bytes, None)
    return state + T * state + T * io, 2 * state


# ---- Kimi Delta Attention: one launch per (batch row, layer) ----------------------------------------------------
def kda_state_bytes(H: int, K: int, V: int, state_bytes: int = 4) -> int:
    """S = H K V s: one row's checkpoint in one KDA layer."""
    return H * K * V * state_bytes


def kda_ring_entry_bytes(H: int, K: int, V: int, act_bytes: int = 2, u_bytes: int = 2, g_bytes: int = 4) -> dict:
    """Bytes of one ring entry of one row's KDA layer (families/kda/reference.py's ring): ``read`` by the output
    path (k, u, g), read by the exact ``fold`` (k, v, g, beta), ``write`` (all five), and ``hold`` (what the slot
    keeps: = write)."""
    a = act_bytes
    write = H * (K * a + V * u_bytes + K * g_bytes + V * a + 4)
    return {"read": H * (K * a + V * u_bytes + K * g_bytes), "fold": H * (K * a + V * a + K * g_bytes + 4),
            "write": write, "hold": write}


def kda_u_bytes(shadow) -> int:
    """Bytes of one u ring value: families/kda/config.RING_TYPES (fp32 without a shadow, the shadow's ring with one)."""
    from .config import ITEMSIZE  # here: the family package imports this module
    from .families.kda.config import RING_TYPES

    return ITEMSIZE[RING_TYPES["none" if shadow_sizes(shadow) is None else "bf16"]]


def _kda_parts(H, K, V, act_bytes, state_bytes, shadow, u_bytes, g_bytes):
    a = act_bytes
    state = kda_state_bytes(H, K, V, state_bytes)
    sh = shadow_sizes(shadow)
    u_bytes = kda_u_bytes(shadow) if u_bytes is None else u_bytes
    read = state if sh is None else H * K * V * sh[0] + H * K * sh[1]  # fp8 scales: one per (head, key row)
    io = (3 * H * K + H * V + H) * a + H * V * a  # q, k, raw forget gate f, v, raw beta b in; y out
    e = kda_ring_entry_bytes(H, K, V, act_bytes, u_bytes, g_bytes)
    return state, read, (0 if sh is None else read), io, e["read"], e["fold"], e["write"]


def kda_bytes_per_position(H: int, K: int, V: int, L: int, act_bytes: int = 2, state_bytes: int = 4, shadow=None,
                           u_bytes: int | None = None, g_bytes: int = 4) -> tuple[int, dict[int, int]]:
    """The KDA bytes model per (row, layer): (conventional step, {k: ReplaySSM standard decode step at buffer
    position k = 1..L}). Conventional: read + write S. ReplaySSM at k < L: S0 (or its shadow) once, the k - 1
    entries the output needs (k, u, g), one entry written; k = L (the flush): S0 and the L - 1 entries read, S0
    (+ the shadow) written, no entry: without a shadow the u-sum's (k, u, g), with one the exact refold's (k, v,
    g, beta) (plugins/kda/kda.cuh). io is counted in both. ``u_bytes`` None: the u ring's (:func:`kda_u_bytes`)."""
    state, read, wsh, io, hist, fold, entry = _kda_parts(H, K, V, act_bytes, state_bytes, shadow, u_bytes, g_bytes)
    return _per_position(state, read, wsh, io, hist, fold if wsh else hist, entry, L)


def kda_bytes_per_step(H: int, K: int, V: int, L: int, act_bytes: int = 2, state_bytes: int = 4, shadow=None,
                       u_bytes: int | None = None, g_bytes: int = 4) -> dict:
    """:func:`kda_bytes_per_position` over a flush cycle: conventional, replay (mean over k), ratio, nonflush, flush."""
    conv, per_k = kda_bytes_per_position(H, K, V, L, act_bytes, state_bytes, shadow, u_bytes, g_bytes)
    return _per_step(conv, per_k, L)


def kda_verify_bytes(H: int, K: int, V: int, L: int, T: int, m: int, act_bytes: int = 2, state_bytes: int = 4,
                     shadow=None, u_bytes: int | None = None, g_bytes: int = 4) -> int:
    """One KDA ReplaySSM verify of T tokens at committed count m (the exact fold of the m entries where m + 2T > L)."""
    state, read, wsh, io, hist, fold, entry = _kda_parts(H, K, V, act_bytes, state_bytes, shadow, u_bytes, g_bytes)
    return _window(state, read, wsh, io, hist, fold, entry, L, T, m)


def kda_native_spec_bytes(H: int, K: int, V: int, T: int, act_bytes: int = 2, state_bytes: int = 4) -> tuple[int, int]:
    """(native verify: S + T snapshots + T io, native commit: 2 S) per (row, layer)."""
    state, _, _, io, *_ = _kda_parts(H, K, V, act_bytes, state_bytes, None, 2, 4)
    return state + T * state + T * io, 2 * state


def ring_sweep(bytes_per_step, *geometry, L_max: int = 1024, **kw) -> dict:
    """Any family's ``*_bytes_per_step`` over L = 1..L_max: {"best_L", "best_ratio", "break_even_L"} with
    break_even_L the smallest L > 1 whose amortized ratio is below 1 (None if none up to L_max): the ring past
    which replay moves more bytes than the conventional step."""
    best_L, best, even = 1, 0.0, None
    for L in range(1, L_max + 1):
        r = bytes_per_step(*geometry, L, **kw)["ratio"]
        if r > best:
            best_L, best = L, r
        if L > 1 and r < 1 and even is None:
            even = L
            break
    return {"best_L": best_L, "best_ratio": best, "break_even_L": even}


# ---- the end-to-end model step (scripts/bench_e2e.py: standard and spec) -----------------------------------------------
def _model_geometry(config) -> dict:
    """A NemotronHConfig's Mamba-2 shape and layer counts (M Mamba-2, A attention)."""
    c = config
    kinds = list(c.layers_block_type)
    return dict(H=c.mamba_num_heads, P=c.mamba_head_dim, N=c.ssm_state_size, G=c.n_groups, K=c.conv_kernel,
                M=kinds.count("linear_attention"), A=kinds.count("full_attention"),
                conv_dim=c.mamba_num_heads * c.mamba_head_dim + 2 * c.n_groups * c.ssm_state_size)


def mamba2_decode_step_ssm(H: int, P: int, N: int, G: int, L: int, mode: str, act_bytes: int = 2) -> float:
    """SSM bytes per (row, Mamba-2 layer) of one standard decode step of the end-to-end model (docstring)."""
    if mode not in DECODE_MODES:
        raise ValueError(f"mode: expected one of {DECODE_MODES}, got {mode!r}")
    a = act_bytes
    state = mamba2_state_bytes(H, P, N)
    entry = H * P * a + G * N * a + 4 * H
    buf = (L - 1) / 2 * entry + entry
    if mode in ("conventional", "mamba_ssm"):
        return 2 * state
    if mode == "noop":
        return 0
    if mode == "replay":
        return state * (1 + 1 / L) + buf
    # shadow: non-flush steps read the shadow (L-1 of L), the flush reads and writes the fp32
    # checkpoint and writes the shadow (fp8: + its fp32 row scales): 2 state / L + 1 shadow per step
    sq, sr = shadow_sizes(_DECODE_SHADOW[mode])
    return 2 * state / L + H * P * (N * sq + sr) + buf


def spec_count_distribution(T: int, L: int, accepted: float | None = None) -> dict[int, float]:
    """Stationary distribution {m: p} of the committed count m a speculative step of T tokens starts from, L the
    ring: the step folds where m + 2T > L (the count then restarts from 0) and commits n = 1 + the consecutive
    accepted drafts, each accepted independently with the probability alpha whose mean n is ``accepted``
    (sum_{k<T} alpha^k; None: every draft, n = T). Exact (power iteration on the L + 1 counts), not sampled."""
    if T < 1 or L < 2 * T:
        raise ValueError(f"T, L: expected T >= 1 and L >= 2T, got T={T}, L={L}")
    acc = float(T) if accepted is None else min(max(float(accepted), 1.0), float(T))
    lo, hi = 0.0, 1.0  # alpha by bisection: sum_{k<T} alpha^k is increasing in alpha
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** k for k in range(T)) < acc else (lo, mid)
    alpha = 1.0 if acc >= T else (lo + hi) / 2
    import numpy as np

    pn = [alpha ** (n - 1) * ((1 - alpha) if n < T else 1.0) for n in range(1, T + 1)]  # P(n = 1..T)
    P = np.zeros((L + 1, L + 1))  # P[m, m']: count m before a step -> m' after it
    for m in range(L + 1):
        base = 0 if m + 2 * T > L else m
        for n, w in enumerate(pn, start=1):
            if base + n <= L:
                P[m, base + n] += w
    # p P = p, sum p = 1 (the chain may be periodic, e.g. T, 2T, 3T at full acceptance: solve, do not iterate)
    A = np.vstack([P.T - np.eye(L + 1), np.ones(L + 1)])
    b = np.zeros(L + 2)
    b[-1] = 1.0
    p = np.linalg.lstsq(A, b, rcond=None)[0]
    return {m: float(v) for m, v in enumerate(p) if v > 1e-12}


def mamba2_spec_step_ssm(H: int, P: int, N: int, G: int, T: int, L: int, mode: str, accepted: float | None = None,
                         act_bytes: int = 2) -> float:
    """SSM bytes per (row, Mamba-2 layer) of one speculative step of the end-to-end model (not "standard")."""
    a = act_bytes
    state = mamba2_state_bytes(H, P, N)
    entry = H * P * a + G * N * a + 4 * H
    if mode == "replay_spec":
        return sum(p * (state * (1 + (m + 2 * T > L)) + (m + T) * entry + T * entry)
                   for m, p in spec_count_distribution(T, L, accepted).items())
    if mode == "native_spec":
        return state * (1 + T) + 2 * state
    if mode == "spec_noop":
        return 0
    raise ValueError(f"mode: expected one of {SPEC_MODES[1:]}, got {mode!r}")


def decode_step_bytes(config, batch: int, kv_fill: float, L: int, mode: str, weight_bytes: int,
                      act_bytes: int = 2) -> int:
    """Bytes of one standard decode step of the whole model in ``mode`` (:data:`DECODE_MODES`); ``kv_fill``: KV
    positions read per attention layer."""
    g, c, a = _model_geometry(config), config, act_bytes
    M, K = g["M"], g["K"]
    common = (weight_bytes + M * batch * 2 * g["conv_dim"] * K * a
              + g["A"] * batch * 2 * c.num_key_value_heads * kv_fill * c.head_dim * a)
    ssm = mamba2_decode_step_ssm(g["H"], g["P"], g["N"], g["G"], L, mode, a)
    return int(common + M * batch * ssm)


def spec_step_bytes(config, batch: int, kv_fill: float, T: int, L: int, mode: str, weight_bytes: int,
                    accepted: float | None = None, act_bytes: int = 2) -> int:
    """Bytes of one speculative step of T tokens of the whole model in ``mode`` (:data:`SPEC_MODES`; "standard" is
    :func:`decode_step_bytes`' replay); ``accepted``: mean tokens accepted per step."""
    if mode == "standard":
        return decode_step_bytes(config, batch, kv_fill, L, "replay", weight_bytes, act_bytes)
    g, c, a, b = _model_geometry(config), config, act_bytes, batch
    M, W = g["M"], g["K"] - 2 + T
    common = (weight_bytes + g["A"] * b * 2 * c.num_key_value_heads * kv_fill * c.head_dim * a
              + M * b * g["conv_dim"] * 4 * W * a + b * T * c.vocab_size * (2 + 4 + 4))
    ssm = mamba2_spec_step_ssm(g["H"], g["P"], g["N"], g["G"], T, L, mode, accepted, a)
    return int(common + M * b * ssm)


# ---- memory: one request slot ----------------------------------------------------------------------------------
def mamba2_layer_memory(H: int, P: int, N: int, G: int, L: int, conv_width: int, state_bytes: int = 4,
                        act_bytes: int = 2, shadow=None, conv_dim: int | None = None, dt_bytes: int = 4) -> dict:
    """Bytes one slot holds in one Mamba-2 layer: {state, shadow, ring (x, B, dt), conv (``conv_width`` columns)}."""
    cd = H * P + 2 * G * N if conv_dim is None else conv_dim
    sh = shadow_sizes(shadow)
    return {"state": mamba2_state_bytes(H, P, N, state_bytes),
            "shadow": 0 if sh is None else H * P * N * sh[0] + H * P * sh[1],
            "ring": L * (H * P + G * N) * act_bytes + H * L * dt_bytes,
            "conv": cd * conv_width * act_bytes}


def gdn_layer_memory(HV: int, Hk: int, V: int, Kd: int, L: int, conv_width: int, state_bytes: int = 4,
                     act_bytes: int = 2, shadow=None, conv_dim: int | None = None, ring_bytes: int = 4) -> dict:
    """Bytes one slot holds in one GDN layer: {state, shadow, ring (u, v, k, g, beta), conv}."""
    cd = 2 * Hk * Kd + HV * V if conv_dim is None else conv_dim
    sh = shadow_sizes(shadow)
    f = ring_bytes
    return {"state": gdn_state_bytes(HV, V, Kd, state_bytes),
            "shadow": 0 if sh is None else HV * V * Kd * sh[0] + HV * V * sh[1],
            "ring": HV * L * V * f + HV * L * V * act_bytes + Hk * L * Kd * f + 2 * HV * L * f,
            "conv": cd * conv_width * act_bytes}


def kda_layer_memory(H: int, K: int, V: int, L: int, conv_width: int = 0, state_bytes: int = 4, act_bytes: int = 2,
                     shadow=None, u_bytes: int | None = None, g_bytes: int = 4) -> dict:
    """Bytes one slot holds in one KDA layer: {state, shadow, ring (k, u, g, v, beta), conv} (conv over q | k | v,
    3 H K channels with K = V as Kimi / GLM; ``conv_width`` 0 leaves it to the cache)."""
    sh = shadow_sizes(shadow)
    return {"state": kda_state_bytes(H, K, V, state_bytes),
            "shadow": 0 if sh is None else H * K * V * sh[0] + H * K * sh[1],
            "ring": L * kda_ring_entry_bytes(H, K, V, act_bytes, kda_u_bytes(shadow) if u_bytes is None else u_bytes,
                                             g_bytes)["hold"],
            "conv": (2 * H * K + H * V) * conv_width * act_bytes}


def _kda_cache_layer(H, K, V, L, W, s, a, shadow, conv_dim, dt):
    if conv_dim is not None or s == 8:
        raise ValueError("layers: the KDA memory model keeps the default conv (q | k | v) and an fp32 beta ring")
    return kda_layer_memory(H, K, V, L, W, s, a, shadow, g_bytes=4)


# Bytes one slot holds in one layer of a family, from the cache's arguments (geometry, L, conv width W, state /
# activation / dt bytes, shadow, conv_dim); the fp32 rings follow a float64 test state, as LayerGroup.roles
# allocates them.
CACHE_LAYER_MEMORY = {
    "mamba2": lambda g, L, W, s, a, sh, cd, dt: mamba2_layer_memory(*g, L, W, s, a, sh, cd, dt),
    "gdn": lambda g, L, W, s, a, sh, cd, dt: gdn_layer_memory(*g, L, W, s, a, sh, cd, 8 if s == 8 else 4),
    "kda": lambda g, L, W, s, a, sh, cd, dt: _kda_cache_layer(*g, L, W, s, a, sh, cd, dt),
}


def cache_bytes(num_layers: int | None = None, num_slots: int | None = None, nheads: int | None = None,
                headdim: int | None = None, dstate: int | None = None, ngroups: int | None = None,
                buffer_len: int | None = None, num_draft: int = 0, conv_kernel: int = 4, conv_dim: int | None = None,
                state_dtype=4, act_dtype=2, shadow_dtype=None, dt_dtype=4, *, cursor: str = "ring", layers=None,
                **_) -> dict:
    """What :class:`.cache.ReplayStateCache` of these arguments allocates (its constructor's signature: the
    positional Mamba-2 form or ``layers={family: (n, geometry[, conv_dim])}``; dtypes or bytes per element; other
    keywords ignored): {"slot": bytes per slot, cursor included, "total": all tensors, the scratch conv slot
    included, "layer": {family: the per-layer dict of one slot}}."""
    if layers is None:
        layers = {"mamba2": (num_layers, (nheads, headdim, dstate, ngroups), conv_dim)}
    s, a, dt = _itemsize(state_dtype), _itemsize(act_dtype), _itemsize(dt_dtype)
    shadow = None if shadow_dtype is None else _itemsize(shadow_dtype)
    W = conv_kernel - 1 + num_draft
    cur = 4 if cursor == "standard" else 2 * 4  # cursor: (slots,) or (start, count)
    per, slot, scratch = {}, cur, 0
    for fam, (n, geometry, *cd) in layers.items():
        if fam not in CACHE_LAYER_MEMORY:
            raise ValueError(f"layers: expected families among {sorted(CACHE_LAYER_MEMORY)}, got {fam!r}")
        per[fam] = m = CACHE_LAYER_MEMORY[fam](tuple(geometry), buffer_len, W, s, a, shadow, cd[0] if cd else None, dt)
        slot += n * sum(m.values())
        scratch += n * m["conv"]  # the conv windows' scratch slot (padding rows)
    return {"slot": slot, "total": num_slots * slot + scratch, "layer": per}


def memory_per_request(nheads: int, headdim: int, dstate: int, ngroups: int, num_layers: int, buffer_len: int,
                       num_draft: int, state_bytes: int = 4, act_bytes: int = 2, conv_kernel: int = 4,
                       conv_dim: int | None = None, shadow_bytes: int = 0) -> dict:
    """Bytes of decode state one request holds, ReplaySSM spec vs native spec (all Mamba layers).

    Per layer:
      ReplaySSM: :func:`mamba2_layer_memory` with a conv window of K - 1 + num_draft columns; plus one
                 cursor (8 bytes): what ReplayStateCache allocates per slot.
      native:    (1 + num_draft) snapshots of the state H P N s and of the conv state conv_dim (K - 1) a
                 (vLLM / TensorRT-LLM keep a state per draft position for both).
    conv_dim defaults to Mamba-2's H P + 2 G N (the conv runs over x | B | C).
    """
    H, P, N, G = nheads, headdim, dstate, ngroups
    cd = H * P + 2 * G * N if conv_dim is None else conv_dim
    replay_layer = mamba2_layer_memory(H, P, N, G, buffer_len, conv_kernel - 1 + num_draft, state_bytes, act_bytes,
                                       shadow_bytes, cd)
    native_layer = {"state": (1 + num_draft) * replay_layer["state"],
                    "conv": (1 + num_draft) * cd * (conv_kernel - 1) * act_bytes}
    replay = num_layers * sum(replay_layer.values()) + 8
    native = num_layers * sum(native_layer.values())
    return {"replay": replay, "native": native, "ratio": native / replay,
            "replay_layer": replay_layer, "native_layer": native_layer}


# ---- memory: a served model ------------------------------------------------------------------------------------
def serving_memory(config, batch: int, kv_len: int, T: int, L: int, mode: str, weight_bytes: int,
                   act_bytes: int = 2) -> dict:
    """Bytes one mode (:data:`SPEC_MODES`) needs on the GPU to serve ``batch`` rows of ``kv_len`` positions (fp32
    SSM state): {weights, ssm, conv, kv, scratch, total} (module docstring). ssm: state (+ L-entry rings for
    ReplaySSM, + T fp32 snapshots per layer for native spec); conv: K columns (standard) or K-1+num_draft (spec);
    kv: dense K and V caches; scratch: the step's largest live activations (logits in bf16 and fp32 twice, the
    widest projection, attention scores) for b (standard) or b*T (spec) tokens, plus 1 GiB of workspace."""
    if mode not in SPEC_MODES:
        raise ValueError(f"mode: expected one of {SPEC_MODES}, got {mode!r}")
    g, c, a, b = _model_geometry(config), config, act_bytes, batch
    H, P, N, G, M = g["H"], g["P"], g["N"], g["G"], g["M"]
    spec = mode != "standard"
    lay = mamba2_layer_memory(H, P, N, G, L, (g["K"] - 2 + T) if spec else g["K"], 4, a)
    state, rings = M * b * lay["state"], M * b * lay["ring"]
    ssm = {"standard": state + rings, "replay_spec": state + rings, "native_spec": state * (1 + T),
           "spec_noop": 0}[mode]
    conv = M * b * lay["conv"]
    kv = g["A"] * 2 * b * c.num_key_value_heads * kv_len * c.head_dim * a
    tokens = b * (T if spec else 1)
    widest = max(2 * H * P + 2 * G * N + H, c.intermediate_size)
    scratch = (tokens * (c.vocab_size * (a + 4 + 4) + widest * a * 4)
               + 3 * b * c.num_attention_heads * (T if spec else 1) * kv_len * 4 + GiB)
    total = weight_bytes + ssm + conv + kv + scratch
    return dict(weights=weight_bytes, ssm=ssm, conv=conv, kv=kv, scratch=scratch, total=total)


def max_batch_within(total_of, budget_bytes: int, limit: int = 1 << 20) -> int:
    """Largest batch b >= 1 with ``total_of(b) <= budget_bytes`` (0 if none, at most ``limit`` - 1; ``total_of``
    non-decreasing in b): doubling, then bisection, so the answer is exact."""
    def fits(b):
        return total_of(b) <= budget_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def max_batch(config, budget_bytes: int, kv_len: int, T: int, L: int, mode: str, weight_bytes: int,
              act_bytes: int = 2, limit: int = 1 << 20) -> int:
    """Largest batch whose :func:`serving_memory` total fits ``budget_bytes`` (0 if none)."""
    return max_batch_within(
        lambda b: serving_memory(config, b, kv_len, T, L, mode, weight_bytes, act_bytes)["total"], budget_bytes, limit)


def spec_run_plan(config, batch: int, kv_len: int, T: int, L: int, mode: str, act_bytes: int = 2) -> dict:
    """The e2e spec step's bytes besides the resident weights for one (batch, mode) on the GPU: the post-prompt
    snapshot (conventional state, K-wide conv, KV) + the larger of the prompt's conventional step and the mode's
    step. ``gpu_snapshot``: snapshot on the GPU; ``cpu_snapshot``: in host memory (restores then cross PCIe)."""
    g, a = _model_geometry(config), act_bytes
    feed = serving_memory(config, batch, kv_len, T, L, "standard", 0, a)
    state = g["M"] * batch * mamba2_state_bytes(g["H"], g["P"], g["N"])
    snapshot = state + feed["conv"] + feed["kv"]
    step = serving_memory(config, batch, kv_len, T, L, mode, 0, a)["total"]
    live = max(step, feed["total"])
    return dict(gpu_snapshot=live + snapshot, cpu_snapshot=live, snapshot_bytes=snapshot)


def decode_run_plan(config, batch: int, kv_len: int, L: int, weight_bytes: int, act_bytes: int = 2,
                    shadow_bytes: int = 0) -> dict:
    """The e2e standard step's bytes for the run of one batch on the GPU (peak: model state + snapshot + one backend;
    ``shadow_bytes`` per state element of the largest shadow backend, fp8 with its row scales). Its scratch:
    b (V_voc 4 4 + wide 4 8 + heads kv_len 4 4) + 2 GiB, wide = max(2 H P + 2 G N + H, intermediate, hidden)."""
    g, c, a = _model_geometry(config), config, act_bytes
    H, P, N, G, M = g["H"], g["P"], g["N"], g["G"], g["M"]
    lay = mamba2_layer_memory(H, P, N, G, L, g["K"], 4, a, shadow_bytes)
    ssm = M * batch * lay["state"]
    buffers = M * batch * lay["ring"] + M * batch * lay["shadow"]
    conv = M * batch * lay["conv"]
    kv = g["A"] * 2 * batch * c.num_key_value_heads * kv_len * c.head_dim * a
    widest = max(2 * H * P + 2 * G * N + H, c.intermediate_size, c.hidden_size)
    scratch = batch * (c.vocab_size * 4 * 4 + widest * 4 * 8 + c.num_attention_heads * kv_len * 4 * 4) + 2 * GiB
    live = weight_bytes + conv + kv + ssm + buffers + scratch
    return dict(gpu_snapshot=live + ssm + conv + kv, cpu_snapshot=live, snapshot_bytes=ssm + conv + kv)


# ---- weights ------------------------------------------------------------------------------------------------
def model_weight_bytes(model) -> int:
    """Bytes of a built model's parameters (each in its own dtype: an fp32 MoE router beside bf16 weights)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def weights_read_bytes(model, tokens: int) -> int:
    """Bytes of parameters one step of ``tokens`` tokens reads: all of them, except the input embedding table, of
    which only the gathered rows are read (unless the table is also the output head, which reads all of it).
    (Counting the whole table inflated the end-to-end TB/s by 1.5-3.7% at bs256 on the 8B, 6.6% at bs1.)"""
    total = model_weight_bytes(model)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is None or (head is not None and head.weight is emb.weight):
        return total
    w = emb.weight
    return total - w.numel() * w.element_size() + min(tokens, w.shape[0]) * w.shape[1] * w.element_size()


def config_weight_bytes(config, dtype) -> int:
    """Parameter count of a ``NemotronHConfig``'s model (built on the meta device: nothing allocated) times
    ``dtype``'s itemsize."""
    import torch
    from transformers import NemotronHForCausalLM

    with torch.device("meta"):
        m = NemotronHForCausalLM(config)
    return sum(p.numel() for p in m.parameters()) * dtype.itemsize


__all__ = ["GiB", "FP8_SCALE_BYTES", "DECODE_MODES", "SPEC_MODES", "shadow_sizes", "mamba2_state_bytes",
           "mamba2_bytes_per_position", "mamba2_bytes_per_step", "mamba2_verify_bytes", "mamba2_native_spec_bytes",
           "gdn_state_bytes", "gdn_bytes_per_position", "gdn_bytes_per_step", "gdn_verify_bytes", "gdn_native_spec_bytes",
           "kda_state_bytes", "kda_ring_entry_bytes", "kda_bytes_per_position", "kda_bytes_per_step", "kda_verify_bytes",
           "kda_native_spec_bytes", "kda_layer_memory", "ring_sweep",
           "mamba2_decode_step_ssm", "mamba2_spec_step_ssm", "decode_step_bytes", "spec_step_bytes",
           "mamba2_layer_memory", "gdn_layer_memory", "cache_bytes", "memory_per_request", "serving_memory",
           "max_batch_within", "max_batch", "spec_run_plan", "decode_run_plan", "model_weight_bytes",
           "config_weight_bytes"]
