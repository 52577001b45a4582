# SPDX-License-Identifier: Apache-2.0
"""The KDA kernel spec (:class:`KDASpec`: one NVRTC module of ``plugins/kda/kda_decode.cu``, or with ``num_tokens``
T >= 1 of ``plugins/kda/kda_spec.cu``) and its planner.

A decode module holds both decode kernels (``kda_replay_decode``, ``kda_conventional``), a verify module the
speculative ``kda_verify`` for a window of T tokens, for one geometry (H, K, V, L), dtype, gate (Kimi's, or GLM-5
Next's lower-bounded one), q / k l2 norm, q scale, shadow and launch shape. Launch shape
(plugins/kda/kda.cuh): a warp owns 4 ``col_lanes`` value columns over all K rows (K col_lanes / 32 rows of 4
columns per lane), a block ``warps`` warps; grid (H V / columns per block, batch). :func:`kda_geometry` picks
them per batch; :func:`override` pins them for a sweep.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from ...config import CUDA_TYPES, ITEMSIZE, SMS, SUPPORTED_NUM_TOKENS, pinned, tail_resident
from ..gdn.config import GDN_RESIDENT_THREADS, GDNSpec, gdn_plan

ENTRY_FILE = "kda/kda_decode.cu"
KERNEL_NAMES = ("kda_replay_decode", "kda_conventional")
BULK_KERNEL_NAME = "kda_conventional_bulk"  # KDASpec.bulk
BULK_REPLAY_KERNEL_NAME = "kda_replay_bulk"  # KDASpec.bulk: the non-flush steps only (an experiment)
SPEC_ENTRY_FILE = "kda/kda_spec.cu"
SPEC_KERNEL_NAMES = ("kda_verify",)
VK_ENTRY_FILE = "kda/kda_vk.cu"
VK_KERNEL_NAMES = ("kda_conventional_vk", "kda_vk_prologue", "kda_replay_rows_vk")
SHADOW_KINDS = ("none", "bf16")
# The u ring's dtype by shadow kind, the one rule (the cache's ring role: layers.ring_dtype; the kernels' ring_t; the
# plugins' IO formats; the bytes model): fp32 beside an fp32 checkpoint without a shadow (its u_j were computed from
# that checkpoint to fp32, so the flush folds their u-sum, kda.cuh usum_apply); bf16 with a bf16 shadow (its u_j carry
# the shadow's rounding anyway, and the flush refolds from v_j).
RING_TYPES = {"none": "f32", "bf16": "bf16"}
MAX_WARPS = 8
SMEM_LIMIT = 48 * 1024  # static shared memory of one block
SMEM_OPTIN_LIMIT = 227 * 1024  # static and dynamic shared memory of one block, opted in (sm_90, sm_100)
RESIDENT_THREADS = 384  # __launch_bounds__ min blocks = this / threads: ~170 registers a thread
# The decode module's other budget (4 blocks of 4 warps, 128 registers: 48 bytes of spill at (4, 4) with a shadow, 84
# for the fp32 ring's u-sum module), planned where it fills the last wave better (config.tail_resident;
# GLM-5.3-Flash TP8, 16 blocks a row). Measured (H100, bench/NOTES.md "The wave tail, measured"): the shadow modules
# win wherever the tail gains (bs32 / 64 / 256 1.04x / 1.38x / 1.59x -> 1.24x / 1.52x / 1.76x); the fp32 modules only
# where it gains much (bs32, 65% -> 97% of a full last wave: 0.99x -> 1.07x; bs64, 86% -> 97%: level; bs256, 94% ->
# 97%: 1.52x -> 1.50x), so they ask for TAIL_F32_MARGIN.
TAIL_RESIDENT_THREADS = 512
TAIL_F32_MARGIN = 0.15
# The non-flush step's ring through shared memory (KDASpec.staged) where the grid runs at least this many waves of
# blocks. There the step is issue-bound and the staged ring's fewer instructions win; in short grids it is latency,
# and the staging's barrier and shared-memory hop cost (H100, 42827d5576 vs db72997, one call: bs256 fp32 / shadow
# Kimi-K3 TP8 1.58 / 1.71x -> 1.64 / 1.74x, GLM-5.3-Flash TP8 1.60 / 1.77x -> 1.65 / 1.87x; Kimi bs1-32 3-7% slower,
# GLM bs1-32 1-7% faster; bench/NOTES.md "Nineteenth session").
STAGED_MIN_WAVES = 4
# The staged modules' register budget: 4 blocks of 4 warps an SM (128 registers; the fold spills 68 bytes). Their
# steps are latency-bound (a block's fixed chain: slot, cursor, ring staging, channel stage, reduce), and a fourth
# block an SM hides more of it than the spill costs (bench/NOTES.md "Twenty-second session"; H200, one call,
# Kimi-K3 TP8 bs256 at 384 / 512 resident threads: shadow k1 50.4 / 45.1 us, flush 302.6 / 275.5 us; fp32 k1
# 62.7 / 55.5 us; H100, one call, fc06a74 / ee07fe74a2, x conv fp32 / shadow: Kimi-K3 TP8 bs256 1.64 / 2.00 ->
# 1.69 / 2.09, bs128 1.58 / 1.81 -> 1.62 / 1.84, GLM-5.3-Flash TP8 bs128-256 level; bench/NOTES.md "Twenty-fourth
# session").
STAGED_RESIDENT_THREADS = 512
# KDASpec.passes 2 (a block walks both chunks of its head under one channel stage) is planned for the staged bf16-shadow
# modules: the non-flush steps gain more than the flush loses (H100, one call, 784db056a5 / 9b2d79552c, shadow x conv
# passes 1 -> 2: Kimi-K3 TP8 bs256 1.77 -> 2.02, bs128 1.69 -> 1.84, GLM-5.3-Flash TP8 bs256 1.92 -> 1.99; the flush
# alone 307 -> 337-344 us at Kimi bs256; at bs32 the halved grid loses, 1.51 -> 1.45). fp32 modules: the second
# pass's fp32 rows tile does not fit the static shared memory beside the staged ring.
# The verify module: 384 / threads (168 registers). Its channel stage holds the window's and the history's
# per-channel values beside the 64 state registers: 201-218 registers at (4 lanes, 4 warps), T = 1..4 (ptxas) when
# planned for 256; capped at 168 it spills 48-76 bytes a thread, and is still faster: three blocks an SM hide the
# latency the spills add (H100, 91ae8da28d, T = 4, Kimi-K3 TP8, fp32 / bf16 shadow, committed count 0 / 8 / 12:
# bs256 176 / 201 / 406 -> 148 / 164 / 350 us and 178 / 200 / 437 -> 144 / 158 / 375 us; bs8 14.3 -> 10.2 us;
# bench/results/2026-12-06_kda-verify-resident_91ae8da28d.json).
VERIFY_RESIDENT_THREADS = 384
STATE_REGS = 64  # fp32 state values one lane may hold (4 K col_lanes / 32)
FULL_WAVE_BLOCKS = 2 * SMS  # two blocks per SM of an H100 (132 SMs; an H200 the same)
# KDASpec.bulk (the conventional step as a persistent stream, kda.cuh conventional_bulk): its blocks an SM by default
# (a (2, 4) module: 32 state values a lane, 116 registers, 44.6 KB of shared memory a block).
BULK_RESIDENT_THREADS = 512


def _f32(x: float) -> float:
    import numpy as np

    return float(np.float32(x))


@dataclass(frozen=True)
class KDASpec:
    """One KDA module. ``scale`` None is K^-1/2; ``lower_bound`` None is Kimi's gate, a negative float GLM-5 Next's
    g = lower_bound sigmoid(exp(A_log) (f + dt_bias)); ``l2norm``: q, k l2-normalised in the kernel."""

    act: str  # "bf16" | "f16" | "f32": q, k, v, f, b, y and the k / v rings
    H: int
    K: int
    V: int
    buffer_len: int  # L, 2..16
    col_lanes: int = 2  # lanes across a row's columns (2 or 4)
    warps: int = 4
    shadow: str = "none"  # "none" | "bf16"
    l2norm: bool = True
    scale: float | None = None
    lower_bound: float | None = None
    arch: int = 90
    num_tokens: int = 0  # 0: the decode module; T = 1 + num_draft: the verify module (2 T <= L)
    resident: int = 0  # threads an SM the register budget is planned for (0: the module's default, min_blocks)
    staged: bool = False  # decode module: the non-flush step stages its ring in shared memory (kda.cuh KDA_STAGED)
    passes: int = 1  # staged decode module: chunks of ``cols`` columns a block walks under one channel stage (1, 2)
    row_order: bool = False  # decode module: input 8 is the flush-first order (cursor.flush_order), not the slots
    bulk: bool = False  # decode module: also kda_conventional_bulk, the conventional step as a persistent stream
    bulk_flush: bool = False  # bulk module: kda_replay_bulk folds flush items in a dynamic shared-memory tile

    @property
    def entry_file(self) -> str:
        """The module's entry file under plugins/ (compile.py)."""
        return SPEC_ENTRY_FILE if self.num_tokens else ENTRY_FILE

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return SPEC_KERNEL_NAMES if self.num_tokens else KERNEL_NAMES + (
            (BULK_KERNEL_NAME, BULK_REPLAY_KERNEL_NAME) if self.bulk else ())

    def __post_init__(self):
        if self.act not in CUDA_TYPES:
            raise ValueError(f"KDASpec.act: expected one of {sorted(CUDA_TYPES)}, got {self.act!r}")
        if self.shadow not in SHADOW_KINDS:
            raise ValueError(f"KDASpec.shadow: expected one of {SHADOW_KINDS}, got {self.shadow!r}")
        for name in ("H", "K", "V", "buffer_len", "col_lanes", "warps", "arch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"KDASpec.{name}: expected a positive int, got {v!r}")
        if not 2 <= self.buffer_len <= 16:
            raise ValueError(f"KDASpec.buffer_len: expected 2..16, got {self.buffer_len}")
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 0:
            raise ValueError(f"KDASpec.num_tokens: expected an int >= 0, got {self.num_tokens!r}")
        if self.num_tokens and (self.num_tokens not in SUPPORTED_NUM_TOKENS or 2 * self.num_tokens > self.buffer_len):
            raise ValueError(f"KDASpec.num_tokens: expected 0 (decode) or one of {SUPPORTED_NUM_TOKENS} with "
                             f"2 T <= L = {self.buffer_len} (flush one window early), got {self.num_tokens}")
        if not isinstance(self.staged, bool):
            raise TypeError(f"KDASpec.staged: expected a bool, got {type(self.staged).__name__}")
        if self.staged and self.num_tokens:  # (its 16-byte rows hold for every valid K, V, cols: kda.cuh asserts)
            raise ValueError(f"KDASpec.staged: the decode module's option (num_tokens 0), got num_tokens="
                             f"{self.num_tokens}")
        if not isinstance(self.row_order, bool):
            raise TypeError(f"KDASpec.row_order: expected a bool, got {type(self.row_order).__name__}")
        if self.row_order and self.num_tokens:
            raise ValueError(f"KDASpec.row_order: the decode module's option (num_tokens 0), got num_tokens="
                             f"{self.num_tokens}")
        if not isinstance(self.bulk, bool):
            raise TypeError(f"KDASpec.bulk: expected a bool, got {type(self.bulk).__name__}")
        if self.bulk and (self.num_tokens or self.passes != 1 or self.row_order):
            raise ValueError(f"KDASpec.bulk: a one-pass decode module's option that reads the rows' slots (num_tokens "
                             f"0, passes 1, row_order False), got num_tokens={self.num_tokens}, passes={self.passes}, "
                             f"row_order={self.row_order}")
        if not isinstance(self.bulk_flush, bool):
            raise TypeError(f"KDASpec.bulk_flush: expected a bool, got {type(self.bulk_flush).__name__}")
        if self.bulk_flush and not self.bulk:
            raise ValueError("KDASpec.bulk_flush: the bulk module's option (bulk=True)")
        if isinstance(self.passes, bool) or self.passes not in (1, 2):
            raise ValueError(f"KDASpec.passes: expected 1 or 2, got {self.passes!r}")
        if self.passes > 1 and not self.staged:
            raise ValueError("KDASpec.passes: 2 passes need the staged ring (staged=True: the second pass reads its u "
                             "columns from the staged tile)")
        if isinstance(self.resident, bool) or not isinstance(self.resident, int) or self.resident < 0:
            raise ValueError(f"KDASpec.resident: expected an int >= 0 (0: the default), got {self.resident!r}")
        if self.num_tokens and self.K > 2 * 32 * self.warps:
            raise ValueError(f"KDASpec: the verify module holds at most 2 key channels a thread: K={self.K} needs "
                             f">= {(self.K + 63) // 64} warps, got {self.warps}")
        if self.col_lanes not in (2, 4):
            raise ValueError(f"KDASpec.col_lanes: expected 2 or 4, got {self.col_lanes}")
        if not 1 <= self.warps <= MAX_WARPS:
            raise ValueError(f"KDASpec.warps: expected 1..{MAX_WARPS}, got {self.warps}")
        rg = 32 // self.col_lanes
        if self.K % rg or self.K > 256:
            raise ValueError(f"KDASpec.K: expected a multiple of {rg} (the row groups of col_lanes={self.col_lanes}) "
                             f"up to 256, got {self.K}")
        if 4 * self.K * self.col_lanes // 32 > STATE_REGS:
            raise ValueError(f"KDASpec: K={self.K} with col_lanes={self.col_lanes} holds "
                             f"{4 * self.K * self.col_lanes // 32} state values a lane, at most {STATE_REGS}")
        if self.V % self.cols:
            raise ValueError(f"KDASpec.V: expected a multiple of the block's {self.cols} columns "
                             f"(4 col_lanes warps), got {self.V}")
        if (self.V // self.cols) % self.passes:
            raise ValueError(f"KDASpec.passes: {self.passes} passes of {self.cols} columns must divide V={self.V}")
        if self.scale is not None and not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"KDASpec.scale: expected a finite positive float or None, got {self.scale}")
        if self.lower_bound is not None and not (math.isfinite(self.lower_bound) and self.lower_bound < 0):
            raise ValueError(f"KDASpec.lower_bound: expected a finite negative float or None, got {self.lower_bound}")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"KDASpec: {self.smem_bytes} bytes of static shared memory, limit {SMEM_LIMIT}")
        if self.bulk_flush and self.bulk_smem_bytes + self.flush_tile_bytes > SMEM_OPTIN_LIMIT:
            raise ValueError(f"KDASpec.bulk_flush: {self.bulk_smem_bytes} bytes of stages and a {self.flush_tile_bytes}"
                             f"-byte flush tile exceed a block's {SMEM_OPTIN_LIMIT} bytes of shared memory")
        if self.bulk and self.bulk_smem_bytes > SMEM_LIMIT:
            raise ValueError(f"KDASpec.bulk: the streams' two stages ({self.K} rows x {self.cols} columns, "
                             f"{self.buffer_len - 1} ring entries) take {self.bulk_smem_bytes} bytes of static shared "
                             f"memory, limit {SMEM_LIMIT} (fewer columns a block: col_lanes x warps)")

    @property
    def cols(self) -> int:
        """Value columns of one block."""
        return 4 * self.col_lanes * self.warps

    @property
    def smem_bytes(self) -> int:
        """Upper bound of the fold tile (kda.cuh FoldSmem): the token's 4 K floats; per channel and chunk of 4
        entries two float4 (decayed keys of the dots and of the update) and the chunk decay; v_j over the block's
        columns, beta_j, each warp's dots S^T w_j over its columns, the Gram partials and totals (16 a chunk). The
        fold reads L - 1 entries at most (L - T in a verify module), which adds the window tile (kda_spec.cuh
        WinSmem): exp(A + W_t) k_t and q_t for the T tokens, the warps' sums and the totals of the window's products
        (:attr:`window_products`, in butterflies of 32)."""
        T = self.num_tokens
        e = self.buffer_len - (T if T else 1)
        nc = (e + 3) // 4
        fold = (16 * self.K + 36 * self.K * nc + 4 * e * self.cols + 4 * e + 4 * self.warps * e * 4 * self.col_lanes
                + 64 * nc * (self.warps + 1) + 64)
        if not T:
            if self.staged:  # ReplaySmem with the ring tiles (kda.cuh), when it outgrows the fold's
                ring = (e * self.K * (4 + ITEMSIZE[self.act])
                        + e * self.cols * self.passes * ITEMSIZE[RING_TYPES[self.shadow]])
                rows = (self.passes - 1) * self.K * self.cols * (2 if self.shadow != "none" else 4)  # the next pass's
                return max(fold, 8 * self.K + 8 * self.warps * 2 * (e + 1) + ring + rows + 64)
            return fold
        return fold + 8 * T * self.K + 128 * ((self.window_products + 31) // 32) * (self.warps + 1) + 16

    @property
    def bulk_smem_bytes(self) -> int:
        """The larger static shared memory of the two streams (kda.cuh): BulkSmem (kda_conventional_bulk: two
        stages of the item's K fp32 rows and its k, q, f, the token tile, the warps' three sums) and BulkReplaySmem
        (kda_replay_bulk: two stages of the item's rows (fp32, or bf16 beside a shadow), ring entries k_j, g_j of
        every channel and u_j of its columns (L - 1 of each), k, q, f; the non-flush step's reduce tiles). A staged
        row is the block's columns padded to an odd multiple of a row group's bytes (kda.cuh row_pad)."""
        def row_bytes(size):
            g, rb = 4 * self.col_lanes * size, self.cols * size
            return rb + (g - rb % (2 * g)) % (2 * g)

        def a16(n):
            return (n + 15) // 16 * 16

        act, e = ITEMSIZE[self.act], max(self.buffer_len - 1, 1)
        conv = 2 * a16(self.K * row_bytes(4) + 3 * self.K * act) + 16 * self.K + 16 * self.warps
        ring = ITEMSIZE[RING_TYPES[self.shadow]]
        step = 2 if self.shadow != "none" else 4
        stage = (a16(self.K * row_bytes(step)) + a16(e * self.K * act) + a16(e * self.K * 4) + a16(e * self.cols * ring)
                 + a16(3 * self.K * act))
        h1 = 1 << max(self.buffer_len - 1, 0).bit_length()  # kda.cuh kH1: pow2_at_least(kE + 1)
        replay = 2 * stage + 8 * self.K + 4 * self.warps * 3 * h1
        return max(conv, replay)

    @property
    def flush_tile_bytes(self) -> int:
        """Dynamic shared memory of kda_replay_bulk with ``bulk_flush`` (its flush items' FoldSmem / UsumSmem): the
        one-shot kernel's tile, :attr:`smem_bytes` (an upper bound of it; the kernel checks that it got kFoldBytes);
        0 without it."""
        return self.smem_bytes if self.bulk_flush else 0

    def bulk_grid(self, batch: int, sms: int) -> tuple[int, int, int]:
        """The streams' grid (kda_conventional_bulk, kda_replay_bulk): one block per item (batch row, head, chunk) up
        to the resident blocks of ``sms`` SMs (:attr:`min_blocks` each); each walks its items with stride gridDim.x."""
        items = batch * self.H * (self.V // self.cols)
        return (max(1, min(items, sms * self.min_blocks)), 1, 1)

    @property
    def window_products(self) -> int:
        """Per-channel products one verify block reduces (kda_spec.cuh kNV): history x window on the k and q sides
        (2 (L - 2T) T), the history norms (L - 2T), the window pairs (T^2) and norms (2T)."""
        T = self.num_tokens
        he = max(self.buffer_len - 2 * T, 0) if T else 0
        return 2 * he * T + he + T * T + 2 * T if T else 0

    @property
    def scale_f32(self) -> float:
        return _f32(self.K ** -0.5 if self.scale is None else self.scale)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def min_blocks(self) -> int:
        default = VERIFY_RESIDENT_THREADS if self.num_tokens else RESIDENT_THREADS
        return max(1, (self.resident or default) // self.threads)

    def grid(self, batch: int) -> tuple[int, int, int]:
        return (self.H * (self.V // self.cols) // self.passes, batch, 1)

    @property
    def key(self) -> str:
        """Readable cache key, e.g. ``kda_a-bf16_H12_K128_V128_L16_C2_W4_n1_sh-bf16_lb-5.0_sm90`` (a verify module:
        ``kda_T4_a-...``)."""
        return (("kda" if not self.num_tokens else f"kda_T{self.num_tokens}")
                + f"_a-{self.act}_H{self.H}_K{self.K}_V{self.V}_L{self.buffer_len}_C{self.col_lanes}_W{self.warps}"
                f"_n{int(self.l2norm)}" + (f"_sh-{self.shadow}" if self.shadow != "none" else "")
                + ("" if self.lower_bound is None else f"_lb{_f32(self.lower_bound)!r}")
                + ("" if self.scale is None else f"_sc{self.scale_f32.hex()}")
                + (f"_r{self.resident}" if self.resident else "") + ("_st" if self.staged else "")
                + (f"_p{self.passes}" if self.passes > 1 else "") + ("_ro" if self.row_order else "")
                + ("_bk" if self.bulk else "") + ("f" if self.bulk_flush else "")
                + f"_sm{self.arch}")

    def prelude(self) -> str:
        lb = self.lower_bound is not None
        return "\n".join([
            f"// generated for {self.key}",
            "#include <cuda_bf16.h>",
            "#include <cuda_fp16.h>",
            f"using act_t = {CUDA_TYPES[self.act]};",
            f"using ring_t = {CUDA_TYPES[RING_TYPES[self.shadow]]};  // the u ring (RING_TYPES)",
            f"#define KDA_SHADOW {SHADOW_KINDS.index(self.shadow)}",
            f"#define KDA_LOWER_BOUND {int(lb)}",
            *(["#define KDA_STAGED 1"] if self.staged else []),
            *([f"#define KDA_PASSES {self.passes}"] if self.passes > 1 else []),
            *(["#define KDA_ROW_ORDER 1"] if self.row_order else []),
            *(["#define KDA_BULK 1"] if self.bulk else []),
            *(["#define KDA_BULK_FLUSH 1"] if self.bulk_flush else []),
            *([f"#define KDA_TOKENS {self.num_tokens}"] if self.num_tokens else []),
            *([f"constexpr float kLowerBound = {_f32(self.lower_bound).hex()}f;  // {_f32(self.lower_bound)!r}"]
              if lb else []),
            f"constexpr int kH = {self.H};",
            f"constexpr int kK = {self.K};",
            f"constexpr int kV = {self.V};",
            f"constexpr int kL = {self.buffer_len};",
            f"constexpr int kCVL = {self.col_lanes};",
            f"constexpr int kWarps = {self.warps};",
            f"constexpr int kMinBlocks = {self.min_blocks};",
            f"constexpr bool kL2Norm = {'true' if self.l2norm else 'false'};",
            f"constexpr float kScale = {self.scale_f32.hex()}f;  // {self.scale_f32!r}",
            "",
        ])


_OVERRIDE: dict = {}


def override(col_lanes: int | None = None, warps: int | None = None, resident: int | None = None,
             staged: bool | None = None, passes: int | None = None, bulk: bool | None = None,
             bulk_flush: bool | None = None):
    """Pin the planner's launch shape inside the block (benchmark sweeps); ``resident``: the threads an SM the
    register budget of the planned modules is set for (KDASpec.resident); ``staged``, ``passes``: KDASpec.staged and
    KDASpec.passes of the decode modules (passes 2 implies staged); ``bulk``: the decode modules with KDASpec.bulk
    (the conventional step then launches kda_conventional_bulk, the standard decode kda_replay_bulk: its non-flush
    rows only, or every row with ``bulk_flush``, KDASpec.bulk_flush)."""
    return pinned(_OVERRIDE, col_lanes=col_lanes, warps=warps, resident=resident, staged=staged, passes=passes,
                  bulk=bulk, bulk_flush=bulk_flush)


def _fits(H: int, K: int, V: int, batch: int, cl: int, warps: int) -> bool:
    return V % (4 * cl * warps) == 0 and batch * H * (V // (4 * cl * warps)) >= FULL_WAVE_BLOCKS


@functools.lru_cache(maxsize=1024)
def _plan(H: int, K: int, V: int, batch: int, conventional: bool) -> tuple[int, int]:
    # Large grids (two blocks per SM or more): 4 lanes across a row (a warp load is 8 rows x 64 contiguous bytes
    # of fp32 state; 2 lanes load 16 rows x 32 B and each 128-byte line is fetched by several warps at different
    # times; H100 A/B at Kimi-K3 TP8 bs256: conventional 161 vs 192 us, fp32 replay 105 vs 136) and 4 warps. 4
    # lanes hold 4 K / 8 state values a lane: K <= 128 (STATE_REGS). Small grids: the conventional step takes
    # smaller blocks (more of them: 2 lanes, fewer warps); the replay step keeps 4 warps (one channel a thread:
    # its channel stage walks the ring per channel, 4 deep with 1 warp) and takes 2 lanes a row (twice the blocks).
    # The conventional step takes 8 warps there (H100, b811d9f6a9, Kimi-K3 TP8 bs256: (4, 8) 157 us, (4, 4) 175,
    # (2, 4) 203); the replay step 4 (its flush and non-flush steps are slower with 8: f32 k = 1 / 8 / 16 at
    # 88 / 124 / 340 us against 82 / 94 / 274).
    cl4 = 4 * K * 4 // 32 <= STATE_REGS and K % 8 == 0
    if cl4 and conventional and _fits(H, K, V, batch, 4, 8):
        return 4, 8
    if cl4 and _fits(H, K, V, batch, 4, 4):
        return 4, 4
    cl, warps = 2, 4
    if conventional:
        while warps > 1 and (V % (4 * cl * warps) or not _fits(H, K, V, batch, cl, warps)):
            warps //= 2
    while warps > 1 and V % (4 * cl * warps):
        warps //= 2
    return cl, warps


def kda_geometry(H: int, K: int, V: int, batch: int, conventional: bool = False) -> tuple[int, int]:
    """(col_lanes, warps) of the KDA kernels for this geometry and batch (:func:`override` wins); ``conventional``:
    the plan of the conventional step's module."""
    cl, w = _plan(H, K, V, batch, conventional)
    return _OVERRIDE.get("col_lanes", cl), _OVERRIDE.get("warps", w)


def kda_spec(act: str, H: int, K: int, V: int, L: int, batch: int, shadow: str = "none", l2norm: bool = True,
             scale: float | None = None, lower_bound: float | None = None, arch: int = 90,
             conventional: bool = False, num_tokens: int = 0, row_order: bool = False) -> KDASpec:
    """The module for this geometry and batch (the conventional kernel comes from a module of L = 2 planned with
    ``conventional``; ``num_tokens`` T >= 1: the verify module, planned as the replay step; ``row_order``: the
    decode module that reads its rows from a flush-first order, KDASpec.row_order)."""
    if row_order:
        return dataclasses.replace(kda_spec(act, H, K, V, L, batch, shadow, l2norm, scale, lower_bound, arch),
                                   row_order=True)
    cl, w = kda_geometry(H, K, V, batch, conventional)
    resident = 0
    if not conventional and not num_tokens:  # 4 blocks an SM where 3 leave a partial last wave (GLM-5.3-Flash)
        margin = 0.02 if shadow != "none" else TAIL_F32_MARGIN
        resident = tail_resident(batch * H * (V // (4 * cl * w)), 32 * w, (RESIDENT_THREADS, TAIL_RESIDENT_THREADS),
                                 margin=margin)
        resident = 0 if resident == RESIDENT_THREADS else resident
    if _OVERRIDE.get("bulk") and not num_tokens:  # the persistent streams (KDASpec.bulk), their own budget
        return KDASpec(act, H, K, V, L, cl, w, shadow, l2norm, scale, lower_bound, arch, num_tokens,
                       _OVERRIDE.get("resident", BULK_RESIDENT_THREADS), bulk=True,
                       bulk_flush=_OVERRIDE.get("bulk_flush", False) and not conventional)
    spec = KDASpec(act, H, K, V, L, cl, w, shadow, l2norm, scale, lower_bound, arch, num_tokens,
                   _OVERRIDE.get("resident", resident))
    if conventional or num_tokens:
        return spec
    staged = _OVERRIDE.get("staged", math.prod(spec.grid(batch)) >= STAGED_MIN_WAVES * SMS * spec.min_blocks)
    if staged and "resident" not in _OVERRIDE and spec.warps == 4:  # measured at (4, 4) alone
        spec = dataclasses.replace(spec, resident=STAGED_RESIDENT_THREADS)
    passes = _OVERRIDE.get("passes", 2 if staged and shadow != "none" else 1)  # two passes: the staged shadow modules
    if passes > 1:
        try:
            return dataclasses.replace(spec, staged=True, passes=passes)
        except ValueError:  # an odd number of chunks a head, or the second pass's rows tile over the shared memory
            if "passes" in _OVERRIDE:
                raise
    return dataclasses.replace(spec, staged=True) if staged else spec


@dataclass(frozen=True)
class KDAVKSpec:
    """One module of plugins/kda/kda_vk.cu (the (V, K) layout experiment, vk.py: ``kda_conventional_vk`` and, for a
    ring of ``L`` >= 2 entries, the two-kernel replay step ``kda_vk_prologue`` + ``kda_replay_rows_vk``): GDN's
    launch shape (``rows``, ``warps``, ``lanes``, ``resident``) for H heads of a (V, K) state, and KDA's gate
    (``lower_bound`` None: Kimi's). ``L`` 1: a conventional-only module."""

    act: str
    H: int
    K: int
    V: int
    rows: int
    warps: int
    lanes: int = 32
    l2norm: bool = True
    scale: float | None = None
    lower_bound: float | None = None
    arch: int = 90
    resident: int = GDN_RESIDENT_THREADS
    L: int = 1

    def __post_init__(self):
        if self.lower_bound is not None and not self.lower_bound < 0:
            raise ValueError(f"KDAVKSpec.lower_bound: expected a negative float or None, got {self.lower_bound}")
        if isinstance(self.L, bool) or not isinstance(self.L, int) or not 1 <= self.L <= 16:
            raise ValueError(f"KDAVKSpec.L: expected an int in 1..16 (1: conventional only), got {self.L!r}")
        _ = self.gdn  # GDNSpec validates the shape and the dtype

    @property
    def gdn(self) -> GDNSpec:
        """The GDN module whose prelude (geometry, launch shape, ring length) this one extends: one head per key
        head."""
        return GDNSpec(self.act, self.H, self.H, self.V, self.K, self.L, self.rows, self.warps, self.lanes, "none",
                       self.l2norm, self.scale, self.arch, resident=self.resident)

    entry_file = VK_ENTRY_FILE
    kernel_names = VK_KERNEL_NAMES

    @property
    def threads(self) -> int:
        return self.gdn.threads

    @property
    def key(self) -> str:
        """e.g. ``kda-vk_<the GDN module's key>_lb-5.0``."""
        return "kda-vk_" + self.gdn.key + ("" if self.lower_bound is None else f"_lb{_f32(self.lower_bound)!r}")

    def prelude(self) -> str:
        lb = self.lower_bound is not None
        return "\n".join([f"// generated for {self.key}", self.gdn.prelude(), f"#define KDA_LOWER_BOUND {int(lb)}",
                          *([f"constexpr float kLowerBound = {_f32(self.lower_bound).hex()}f;"] if lb else []), ""])

    def grid(self, batch: int) -> tuple[int, int, int]:
        return self.gdn.grid(batch)


def kda_vk_spec(act: str, H: int, K: int, V: int, batch: int, l2norm: bool = True, scale: float | None = None,
                lower_bound: float | None = None, arch: int = 90, L: int = 1) -> KDAVKSpec:
    """The module for this geometry and batch: GDN's plan for H value heads, its conventional plan for ``L`` 1, its
    standard-decode replay plan for a ring of ``L`` >= 2 entries (the rows kernel is GDN's row stream)."""
    rows, warps, lanes, resident = gdn_plan(V, K, H, batch, replay=L > 1)
    return KDAVKSpec(act, H, K, V, rows, warps, lanes, l2norm, scale, lower_bound, arch, resident, L)


def kda_vk_scratch_floats(K: int, L: int) -> int:
    """Floats of one (batch row, head) record of the two-kernel (V, K) step (plugins/kda/kda_vk.cuh kScr): the
    non-flush products 2 K + 36, the flush's 2 K + (L - 1) K."""
    return 2 * K + 2 * 16 + 4 + 2 * K + (L - 1) * K


__all__ = [
    "KDASpec",
    "KDAVKSpec",
    "kda_geometry",
    "kda_spec",
    "kda_vk_spec",
    "kda_vk_scratch_floats",
    "override",
    "ENTRY_FILE",
    "KERNEL_NAMES",
    "SPEC_ENTRY_FILE",
    "SPEC_KERNEL_NAMES",
    "VK_ENTRY_FILE",
    "VK_KERNEL_NAMES",
]
