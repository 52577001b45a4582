# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet kernel specializations and launch geometry (plugins/gdn/): :class:`GDNSpec` names everything
compiled into one module, :func:`gdn_plan` (:func:`gdn_geometry`, :func:`override`) / :func:`gdn_passes` the
planner, :func:`gdn_spec` the spec of a call.
The dtype tables and the limits every family shares stay in :mod:`trtllm_replayssm.config`."""

from __future__ import annotations

import dataclasses
import functools

from ...config import CUDA_TYPES, ITEMSIZE, SHADOW_CUDA_TYPES, SMEM_LIMIT, SMS, SUPPORTED_NUM_TOKENS, pinned, tail_resident

GDN_ENTRY_FILE = "gdn/gdn_decode.cu"
GDN_KERNEL_NAMES = ("gdn_replay_decode", "gdn_conventional")
GDN_SPEC_ENTRY_FILE = "gdn/gdn_spec.cu"
GDN_SPEC_KERNEL_NAMES = ("gdn_verify", "gdn_native_verify")


# ---- Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention; plugins/gdn/gdn_decode.cu) -------------------------
GDN_SUPPORTED_DIMS = (64, 128, 256)  # V and K
GDN_SHADOW_KINDS = ("none", "bf16")
GDN_MAX_WARPS = 16
# Replay blocks: 8 warps, built for 3 resident blocks (~80 registers: the flush holds the rows, k_j and
# the step inputs; 4 blocks would spill). One 16-warp block per SM left no overlap between blocks.
GDN_REPLAY_WARPS = 8
GDN_RESIDENT_THREADS = 768
# The one-pass bf16-shadow standard-decode modules' other register budget (4 blocks of 8 warps, 64 registers: 36
# bytes of spill at R64, ptxas sm_90), planned where it fills the last wave better (config.tail_resident). Measured
# (H100, bench/NOTES.md "The wave tail, measured"): shadow bs8 / 16 / 32 1.43x / 1.69x / 1.88x -> 1.64x / 1.81x /
# 2.00x; the fp32 modules lose at 1024 at every batch (72 bytes of spill: bs8 1.29x -> 1.24x, bs32 1.52x -> 1.47x)
# and the two-pass shadow modules are level, so both keep GDN_RESIDENT_THREADS.
GDN_TAIL_RESIDENT = 1024
# State elements a thread keeps in registers at large batch (8 rows of K=128): enough loads in flight.
GDN_STATE_REGS = 32
# Warps below which rows per thread are halved (small batches): one full wave of the H200, 132 SMs x 64.
GDN_FULL_WAVE_WARPS = SMS * 64
# Standard-decode replay modules halve rows per thread only below one block per SM (issue 40, H100 sweep at bs 1-32:
# 4 rows per thread won at every batch with >= 2 blocks per SM; the per-thread prologue and the fold's per-entry
# overhead, not the grid, bound the small batches; bench/NOTES.md "Issue 40").
GDN_SMS = SMS


def gdn_layout(K: int, lanes: int = 32) -> tuple[int, int, int]:
    """(lanes per row, rows per warp load, 16-byte vectors per lane) of a K-column fp32 row (gdn.cuh);
    ``lanes`` is capped at K / 4 (one 16-byte vector per lane)."""
    if K % 4 or K < 16:
        raise ValueError(f"K={K}: expected a multiple of 4, >= 16")
    lpr = min(lanes, K // 4)
    if lpr < 4 or 32 % lpr or (K // 4) % lpr:
        raise ValueError(f"K={K}, lanes={lanes}: rows do not map to whole warps (lanes per row 4..32, dividing K / 4)")
    return lpr, 32 // lpr, K // 4 // lpr


@dataclasses.dataclass(frozen=True)
class GDNSpec:
    """One Gated DeltaNet module (both kernels of ``plugins/gdn/gdn_decode.cu``): fp32 state, fp32 buffers
    except v_cache (act). ``scale`` None is K^-1/2 (the key omits it); ``l2norm``: q, k l2-normalised."""

    act: str  # "f32" | "bf16" | "f16"
    heads_v: int  # HV
    heads_k: int  # H
    V: int
    K: int
    buffer_len: int
    rows: int  # value rows of one head per block
    warps: int
    lanes: int = 32  # lanes sharing one state row (capped at K / 4)
    shadow: str = "none"  # "none" | "bf16"
    l2norm: bool = True
    scale: float | None = None
    arch: int = 90
    # 0: the standard decode module (plugins/gdn/gdn_decode.cu); T >= 1: the speculative module
    # (plugins/gdn/gdn_spec.cu: gdn_verify, gdn_native_verify over windows of T tokens).
    num_tokens: int = 0
    # standard decode only: the block's rows in ``passes`` passes under one prologue (gdn.cuh, GDN_PASSES)
    passes: int = 1
    # threads per SM the kernels are built for (``__launch_bounds__`` min blocks = resident / threads: caps the
    # registers); grids under one block per SM can afford fewer resident threads and more registers (gdn_plan)
    resident: int = GDN_RESIDENT_THREADS
    # standard decode only: input 8 is the flush-first order (cursor.flush_order), not the slots (gdn.cuh GDN_ROW_ORDER)
    row_order: bool = False

    def __post_init__(self):
        if self.act not in CUDA_TYPES:
            raise ValueError(f"GDNSpec.act: expected one of {sorted(CUDA_TYPES)}, got {self.act!r}")
        if self.shadow not in GDN_SHADOW_KINDS:
            raise ValueError(f"GDNSpec.shadow: expected one of {GDN_SHADOW_KINDS}, got {self.shadow!r}")
        if self.heads_k < 1 or self.heads_v % self.heads_k:
            raise ValueError(f"GDNSpec: key heads ({self.heads_k}) must divide value heads ({self.heads_v})")
        for name in ("V", "K"):
            if getattr(self, name) not in GDN_SUPPORTED_DIMS:
                raise ValueError(f"GDNSpec.{name}: expected one of {GDN_SUPPORTED_DIMS}, got {getattr(self, name)}")
        if not 1 <= self.buffer_len <= 32:
            raise ValueError(f"GDNSpec.buffer_len must be in 1..32, got {self.buffer_len}")
        lpr, rpw, _ = gdn_layout(self.K, self.lanes)
        if self.passes not in (1, 2) or isinstance(self.passes, bool):
            raise ValueError(f"GDNSpec.passes: expected 1 or 2, got {self.passes!r}")
        if not isinstance(self.row_order, bool):
            raise TypeError(f"GDNSpec.row_order: expected a bool, got {type(self.row_order).__name__}")
        if self.row_order and self.num_tokens:
            raise ValueError(f"GDNSpec.row_order: the standard decode module's option (num_tokens 0), got "
                             f"num_tokens={self.num_tokens}")
        if self.passes > 1 and self.num_tokens:
            raise ValueError("GDNSpec.passes: the speculative module runs in one pass (passes=1)")
        per_pass = self.rows // self.passes
        rt = per_pass // (rpw * self.warps) if self.warps >= 1 else 0
        if (not 1 <= self.warps <= GDN_MAX_WARPS or self.V % self.rows or self.rows % self.passes or rt < 1
                or per_pass % (rpw * self.warps) or rt & (rt - 1) or 2 * rt > lpr):
            raise ValueError(f"GDNSpec rows={self.rows}, warps={self.warps}, passes={self.passes}: rows must divide "
                             f"V={self.V}, be passes*warps*{rpw}*rt with rt a power of two <= {lpr // 2}, warps in "
                             f"1..{GDN_MAX_WARPS}")
        if self.rows % 4:
            raise ValueError(f"GDNSpec rows={self.rows}: expected a multiple of 4 (a block's u_j rows move as 16-byte "
                             f"vectors)")
        if isinstance(self.resident, bool) or not isinstance(self.resident, int) or self.resident < self.threads:
            raise ValueError(f"GDNSpec.resident: expected an int >= threads per block ({self.threads}), "
                             f"got {self.resident!r}")
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int):
            raise TypeError(f"GDNSpec.num_tokens: expected an int, got {type(self.num_tokens).__name__}")
        if self.num_tokens:
            T, L = self.num_tokens, self.buffer_len
            if T not in SUPPORTED_NUM_TOKENS:
                raise ValueError(f"GDNSpec.num_tokens: expected 0 (standard decode) or one of {SUPPORTED_NUM_TOKENS}, got {T}")
            if L < 2 * T:
                raise ValueError(f"GDNSpec.buffer_len={L}: expected >= 2 * num_tokens = {2 * T} (flush one window early)")
            smem = gdn_spec_smem_bytes(self.act, self.rows, self.K, L, T)
            if smem > SMEM_LIMIT:
                raise ValueError(f"GDNSpec rows={self.rows}: verify needs {smem} bytes of static shared memory, "
                                 f"limit {SMEM_LIMIT}")

    @property
    def scale_f32(self) -> float:
        import numpy as np

        return float(np.float32(self.K ** -0.5 if self.scale is None else self.scale))

    @property
    def key(self) -> str:
        """Readable cache key, e.g. ``gdn_a-bf16_HV32_H16_V128_K128_L16_R128_W16_n1_sm90``."""
        return (f"gdn_a-{self.act}_HV{self.heads_v}_H{self.heads_k}_V{self.V}_K{self.K}_L{self.buffer_len}"
                f"_R{self.rows}_W{self.warps}_P{gdn_layout(self.K, self.lanes)[0]}_n{int(self.l2norm)}"
                + (f"_sh-{self.shadow}" if self.shadow != "none" else "")
                + ("" if self.scale is None else f"_sc{self.scale_f32.hex()}") + f"_sm{self.arch}"
                + (f"_T{self.num_tokens}" if self.num_tokens else "") + (f"_x{self.passes}" if self.passes > 1 else "")
                + (f"_r{self.resident}" if self.resident != GDN_RESIDENT_THREADS else "")
                + ("_ro" if self.row_order else ""))

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def min_blocks(self) -> int:
        """Resident blocks per SM the kernels are built for (``__launch_bounds__``; caps registers)."""
        return max(1, self.resident // self.threads)

    @property
    def entry_file(self) -> str:
        """The module's entry file under plugins/ (compile.py)."""
        return GDN_SPEC_ENTRY_FILE if self.num_tokens else GDN_ENTRY_FILE

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return GDN_SPEC_KERNEL_NAMES if self.num_tokens else GDN_KERNEL_NAMES

    def prelude(self) -> str:
        """The generated lines compile.py puts before the entry file."""
        return "\n".join(
            [
                f"// generated for {self.key}",
                "#include <cuda_bf16.h>",
                "#include <cuda_fp16.h>",
                f"using act_t = {CUDA_TYPES[self.act]};",
                f"using shadow_t = {SHADOW_CUDA_TYPES[self.shadow] if self.shadow != 'none' else 'float'};",
                f"#define GDN_SHADOW {('none', 'bf16').index(self.shadow)}",
                f"constexpr int kHV = {self.heads_v};",
                f"constexpr int kHK = {self.heads_k};",
                f"constexpr int kV = {self.V};",
                f"constexpr int kK = {self.K};",
                f"constexpr int kL = {self.buffer_len};",
                f"constexpr int kRows = {self.rows};",
                f"constexpr int kWarps = {self.warps};",
                f"constexpr int kMinBlocks = {self.min_blocks};",
                f"constexpr int kLanes = {min(self.lanes, self.K // 4)};",
                f"constexpr bool kL2Norm = {'true' if self.l2norm else 'false'};",
                f"constexpr float kScale = {self.scale_f32.hex()}f;  // {self.scale_f32!r}",
                *([f"constexpr int kT = {self.num_tokens};"] if self.num_tokens else []),
                *([f"#define GDN_PASSES {self.passes}"] if self.passes > 1 else []),
                *(["#define GDN_ROW_ORDER 1"] if self.row_order else []),
                "",
            ]
        )

    def grid(self, batch: int) -> tuple[int, int, int]:
        return (self.heads_v * (self.V // self.rows), batch, 1)


def gdn_spec_smem_bytes(act: str, rows: int, K: int, L: int, T: int) -> int:
    """Upper bound of ``VerifySmem`` in plugins/gdn/gdn_spec.cuh: the window tile (q, k of T tokens, T x T
    weights, scalars) plus the larger of the history tile (u of L - 2T entries) and the fold tile
    (k, v of L - T entries)."""
    win = 4 * (2 * T * K + 2 * T * T + 3 * T)
    he = max(1, L - 2 * T)
    hist = 4 * (he * rows + 32 + 2 * he * T + 4)
    fold = 4 * (L - T) * K + ITEMSIZE[act] * (L - T) * rows + 4 * 64
    return (win + 15) // 16 * 16 + (max(hist, fold) + 15) // 16 * 16


@functools.lru_cache(maxsize=1024)
def gdn_geometry(V: int, K: int, HV: int, batch: int, replay: bool, num_tokens: int = 0) -> tuple[int, int, int]:
    """(rows per block, warps, lanes per row) of the GDN kernels for this geometry and batch.

    Large batches: 32 state elements per thread, so ~128 bytes per thread are in flight and a row's dots
    reduce in one butterfly. Conventional: a row across up to 32 lanes (8 rows of K=128 per thread; 87-89%
    of the copy ceiling measured). Replay: a row across max(16, K / 8) lanes (4 rows of K=128 per thread;
    8 lanes spilled under the 3-blocks register cap), so the flush's serial fold, one butterfly and one
    broadcast per entry, costs 5 + 4 shuffles per entry instead of 9 + 8 (bench/NOTES.md "GDN kernels").
    Rows per thread halve while the grid has under one full wave of warps (small batches: latency-bound,
    more threads each with shorter serial chains); the standard-decode replay module (``num_tokens`` 0) only
    while its grid has fewer blocks than SMs: at bs 2-32 its 8-warp blocks hold 24-32 warps per SM, so halving
    multiplied the fixed per-thread work (issue 40: bs8 flush 33.2 -> 24.8 us, amortized 0.95x -> 1.29x at 4
    rows per thread, H100). Replay blocks have 8 warps (the buffer dots k_j . k,
    k_j . q are computed once per block, so fewer, larger blocks
    share them), conventional blocks 4 warps (nothing shared across rows)."""
    lpr, rpw, vpl = gdn_layout(K, max(16, K // 8) if replay else 32)
    rt = max(1, min(GDN_STATE_REGS // (4 * vpl), lpr // 2))
    total_rows = batch * HV * V
    if replay and not num_tokens:
        while rt > 1 and total_rows // min(V, rpw * rt * GDN_REPLAY_WARPS) < GDN_SMS:
            rt //= 2
    else:
        while rt > 1 and total_rows // (rpw * rt) < GDN_FULL_WAVE_WARPS:
            rt //= 2
    rows = min(V, rpw * rt * GDN_REPLAY_WARPS) if replay else min(V, rpw * rt * 4)
    while rows // (rpw * rt) > GDN_MAX_WARPS:
        rows //= 2
    return rows, rows // (rpw * rt), lpr


_OVERRIDE: dict = {}


def override(lanes: int | None = None, rt: int | None = None, warps: int | None = None, resident: int | None = None):
    """Pin the replay modules' launch shape inside the block (benchmark sweeps; tests of shapes the planner does not
    pick for their batch): ``lanes`` per row, ``rt`` state rows per thread, ``warps`` per block (rows per block =
    rows one warp load covers x rt x warps, capped at V) and ``resident`` threads per SM (GDNSpec.resident); None
    keeps the planner's. Conventional modules are not affected."""
    return pinned(_OVERRIDE, lanes=lanes, rt=rt, warps=warps, resident=resident)


def gdn_plan(V: int, K: int, HV: int, batch: int, replay: bool, num_tokens: int = 0) -> tuple[int, int, int, int]:
    """(rows per block, warps, lanes per row, resident threads per SM): :func:`gdn_geometry` and the register
    budget, with :func:`override`'s pins applied to replay modules."""
    rows, warps, lanes = gdn_geometry(V, K, HV, batch, replay, num_tokens)
    resident = GDN_RESIDENT_THREADS
    if replay and _OVERRIDE:
        lanes, rpw, _ = gdn_layout(K, _OVERRIDE.get("lanes", lanes))
        rt = _OVERRIDE.get("rt") or max(1, rows // (rpw * warps))
        rows = min(V, rpw * rt * _OVERRIDE.get("warps", GDN_REPLAY_WARPS))
        warps = rows // (rpw * rt)
        resident = _OVERRIDE.get("resident", resident)
    return rows, warps, lanes, resident


def gdn_passes(V: int, K: int, HV: int, batch: int, replay: bool, shadow: str, num_tokens: int = 0) -> int:
    """Passes per block of the standard decode module: 2 for a replay module with a shadow where the grid
    keeps a full wave of warps with blocks of twice the rows (bench/NOTES.md, "Shadow modules in two passes
    per block": the shadow's non-flush step is bound by each thread's fixed prologue, which two passes
    share); 1 otherwise (fp32 modules are bound by their DRAM stream; small batches by latency)."""
    if not replay or shadow == "none" or num_tokens:
        return 1
    rows, warps, lanes, _ = gdn_plan(V, K, HV, batch, replay)
    _, rpw, _ = gdn_layout(K, lanes)
    rt = rows // (rpw * warps)
    if V % (2 * rows) or batch * HV * V // (rpw * rt * 2) < GDN_FULL_WAVE_WARPS:
        return 1
    return 2


def gdn_spec(act: str, HV: int, H: int, V: int, K: int, L: int, batch: int, replay: bool, shadow: str = "none",
             l2norm: bool = True, scale: float | None = None, arch: int = 90, num_tokens: int = 0,
             row_order: bool = False) -> GDNSpec:
    """The module for this geometry and batch. ``num_tokens`` = T >= 1: the speculative module, with the
    replay geometry for ``gdn_verify`` (``replay``) or the conventional one for ``gdn_native_verify``;
    ``row_order``: the standard replay module that reads its rows from a flush-first order (GDNSpec.row_order)."""
    if row_order:
        return dataclasses.replace(gdn_spec(act, HV, H, V, K, L, batch, replay, shadow, l2norm, scale, arch,
                                            num_tokens), row_order=True)
    rows, warps, lanes, resident = gdn_plan(V, K, HV, batch, replay, num_tokens)
    passes = gdn_passes(V, K, HV, batch, replay, shadow, num_tokens)
    if replay and not num_tokens and shadow != "none" and passes == 1 and "resident" not in _OVERRIDE:
        # one-pass shadow modules: 4 blocks an SM where 3 leave a partial last wave (GDN_TAIL_RESIDENT)
        resident = tail_resident(batch * HV * (V // rows), 32 * warps, (resident, GDN_TAIL_RESIDENT), GDN_SMS)
    return GDNSpec(act, HV, H, V, K, L, rows * passes, warps, lanes, shadow, l2norm, scale, arch, num_tokens, passes,
                   resident)
