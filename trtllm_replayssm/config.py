# SPDX-License-Identifier: Apache-2.0
"""Kernel specializations and launch geometry, in one table.

A :class:`KernelSpec` names everything that is compiled into one kernel module (dtypes, sizes,
buffer length, rows per block, warps, gate, target arch, kernel :class:`Variant`). :func:`plan` picks
the variant, :func:`choose_geometry` rows per block and warps from the state geometry and the batch;
:func:`override_variant` and :func:`override_geometry` pin them for tests and sweeps. Every entry
point of ``plugins/mamba2/replayssm_decode.cu`` shares one spec per module.
Speculative-decoding modules (``num_tokens`` = T >= 1, ``plugins/mamba2/replayssm_spec.cu``) take their
geometry from :func:`plan_spec`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import threading

import torch

DTYPE_CODES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
CUDA_TYPES = {"f32": "float", "bf16": "__nv_bfloat16", "f16": "__half"}
ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2}
# The 8-bit checkpoint (KernelSpec.state "fp8"; issue 38): e4m3 with one fp32 scale per (slot, head, row), no
# full-precision copy. Its module reads and writes the rows as the fp8 shadow's (4-element vectors of the fp32
# row layout), on the staged kernel only, standard decode only.
CKPT8 = "fp8"
CKPT8_DTYPE = torch.float8_e4m3fn
STATE_CUDA_TYPES = {**CUDA_TYPES, CKPT8: "__nv_fp8_e4m3"}
# Low-precision shadow of the checkpoint (read by the output form, written at each flush).
SHADOW_KINDS = ("none", "bf16", "fp8")
SHADOW_CUDA_TYPES = {"bf16": "__nv_bfloat16", "fp8": "__nv_fp8_e4m3"}
SHADOW_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
SHADOW_ITEMSIZE = {"none": 0, "bf16": 2, "fp8": 1}

SUPPORTED_HEADDIM = (64, 80, 128)
SUPPORTED_DSTATE = (64, 128, 256)
SUPPORTED_BUFFER_LEN = (4, 8, 16, 32)
SUPPORTED_NUM_TOKENS = (1, 2, 4, 6, 8)  # T = 1 + num_draft; T = 1 (standard decode on the ring) for tests
MAX_THREADS = 512
SMS = 132  # multiprocessors of an H100 SXM and of an H200 (the cards the planners are measured on)
# Waves worth of blocks below which a head is split into row chunks (small batches).
MIN_BLOCKS = 2 * SMS


@dataclasses.dataclass(frozen=True)
class Layout:
    """Strided layout of the standard decode kernel's tensors (RSSM_LAYOUT 1; None on a KernelSpec is the
    contiguous one of families/mamba2/ops.py). Strides are in elements of each tensor's own dtype, compile-time constants
    of the module (a serving engine's strides are fixed per model, so one module serves every step):

    - ``slot_state``, ``slot_x``, ``slot_B``, ``slot_dt``: stride of dim 0 (the slot) of the checkpoint and
      of the x / B / dt rings (vLLM: its page size over the itemsize; every other dim stays contiguous);
    - ``row_x``, ``row_B``, ``row_C``, ``row_dt``, ``row_z``, ``row_y``, ``row_sbi``: stride of dim 0 (the
      batch row) of x, B, C, dt, z, the output and the slot indices (views into a projection's output);
    - the cursor is read per batch row (vLLM's ``write_pos``), not per slot; ``null_slot`` is a padding slot
      (vLLM's null block 0) besides the negative ones.
    The layout has no shadow (vLLM keeps none). the vLLM adapter (``trtllm_replayssm_vllm``, serve/) builds it from the tensors.
    """

    slot_state: int
    slot_x: int
    slot_B: int
    slot_dt: int
    row_x: int
    row_B: int
    row_C: int
    row_dt: int
    row_z: int
    row_y: int
    row_sbi: int = 1
    null_slot: int = 0

    # stride field -> the prelude's constant (plugins/mamba2/replayssm.cuh); the order is the key's
    CONSTANTS = {"slot_state": "kSlotState", "slot_x": "kSlotX", "slot_B": "kSlotB", "slot_dt": "kSlotDt",
                 "row_x": "kRowX", "row_B": "kRowB", "row_C": "kRowC", "row_dt": "kRowDt", "row_z": "kRowZ",
                 "row_y": "kRowY", "row_sbi": "kRowSbi"}

    def __post_init__(self):
        for name in self.CONSTANTS:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"Layout.{name}: expected a non-negative int stride (elements), got {v!r}")
        if not isinstance(self.null_slot, int):
            raise ValueError(f"Layout.null_slot: expected an int, got {self.null_slot!r}")

    @property
    def key(self) -> str:
        return "_lay" + ".".join(str(getattr(self, n)) for n in self.CONSTANTS) + f"n{self.null_slot}"

    def prelude(self) -> list[str]:
        return ["#define RSSM_LAYOUT 1",
                *(f"constexpr size_t {c} = {getattr(self, n)};" for n, c in self.CONSTANTS.items()),
                f"constexpr int kNullSlot = {self.null_slot};"]


VARIANT_KINDS = ("one_shot", "persistent", "staged")
VARIANT_COPIES = ("async", "bulk")
# Upper bounds of Variant's ints (typos fail at once): resident blocks per SM of sm_90 / sm_100, and rows
# a thread folds at a time (a thread holds fewer; the kernel rounds down to a divisor of its rows).
VARIANT_INT_MAX = {"min_blocks": 32, "flush_rows": 32}
VARIANT_ENV = "TRTLLM_REPLAYSSM_VARIANT"


@dataclasses.dataclass(frozen=True)
class Variant:
    """Which replay decode kernel a standard decode module compiles, and its register budget (the
    ``RSSM_*`` definitions of the prelude, plugins/mamba2/replayssm.cuh):

    - ``kind``: ``"one_shot"`` (one block per work item, buffer tiles in registers), ``"persistent"``
      (blocks walk the items through a two-stage cp.async pipeline; RSSM_PERSISTENT) or ``"staged"``
      (one-shot blocks that stage every tile by cp.async; RSSM_STAGED);
    - ``min_blocks``: resident blocks per SM asked of the register allocator (``__launch_bounds__``;
      RSSM_MIN_BLOCKS, capped by the kernel at 1024 threads per SM, 2048 for ``staged``); None: the
      kernel's default (1024 threads per SM for blocks of >= 256 threads);
    - ``flush_rows``: rows of a thread the flush folds at a time (RSSM_FLUSH_ROWS, rounded down to a
      divisor of the thread's rows); None: all of them at once;
    - ``copy``: how the staged kernel stages an item: ``"async"`` (every thread issues cp.async of 16 bytes)
      or ``"bulk"`` (one thread issues a cp.async.bulk per contiguous piece, completing on an mbarrier;
      RSSM_BULK; ``kind="staged"`` only, sm_90+).

    The conventional kernel of the module is one-shot whatever the kind. :func:`plan` chooses it;
    :func:`override_variant` or ``TRTLLM_REPLAYSSM_VARIANT`` pin it.
    """

    kind: str = "one_shot"
    min_blocks: int | None = None
    flush_rows: int | None = None
    copy: str = "async"

    FIELDS = ("kind", "min_blocks", "flush_rows", "copy")

    def __post_init__(self):
        if self.kind not in VARIANT_KINDS:
            raise ValueError(f"Variant.kind: expected one of {VARIANT_KINDS}, got {self.kind!r}")
        if self.copy not in VARIANT_COPIES:
            raise ValueError(f"Variant.copy: expected one of {VARIANT_COPIES}, got {self.copy!r}")
        if self.copy == "bulk" and self.kind != "staged":
            raise ValueError(f"Variant.copy='bulk' stages the staged kernel's item: expected kind='staged', got {self.kind!r}")
        for name, hi in VARIANT_INT_MAX.items():
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi):
                raise ValueError(f"Variant.{name}: expected None or an int in 1..{hi}, got {v!r}")

    def _defines(self) -> list[tuple[str, int]]:
        # This order (kernel switch, MIN_BLOCKS, FLUSH_ROWS) is the one of the cache keys written before the
        # variant was typed: keys name the cached modules and appear in committed results.
        return ([(self.kind.upper(), 1)] if self.kind != "one_shot" else []) + [
            (name.upper(), getattr(self, name)) for name in ("min_blocks", "flush_rows") if getattr(self, name) is not None
        ] + ([("BULK", 1)] if self.copy == "bulk" else [])

    @property
    def key(self) -> str:
        """Part of :attr:`KernelSpec.key`, e.g. ``_PERSISTENT1_MIN_BLOCKS5``; empty for ``Variant()``."""
        return "".join(f"_{k}{v}" for k, v in self._defines())

    def prelude(self) -> list[str]:
        return [f"#define RSSM_{k} {v}" for k, v in self._defines()]


@functools.lru_cache(maxsize=16)  # read on every plan (each eager launch)
def parse_variant(text: str, what: str = VARIANT_ENV) -> Variant | None:
    """``"kind=staged,min_blocks=6,flush_rows=2"`` -> that :class:`Variant` (fields not named keep their
    defaults); an empty string -> None (the shipped plan). Errors name ``what`` and the field."""
    fields: dict = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = (x.strip() for x in part.partition("="))
        if not sep or name not in Variant.FIELDS:
            raise ValueError(f"{what}: expected comma-separated name=value with names {Variant.FIELDS}, got {part!r}")
        if name in fields:
            raise ValueError(f"{what}: {name} given twice")
        if name in ("kind", "copy"):
            fields[name] = value
            continue
        try:
            fields[name] = int(value)
        except ValueError:
            raise ValueError(f"{what}: {name}: expected an int, got {value!r}") from None
    if not fields:
        return None
    try:
        return Variant(**fields)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


# The modules of plugins/mamba2/ and plugins/gdn/ (entry file under plugins/, kernel names), named by their specs.
ENTRY_FILE = "mamba2/replayssm_decode.cu"
KERNEL_NAMES = ("replayssm_decode", "replayssm_conventional", "replayssm_advance_cursor", "replayssm_flush_order")
SPEC_ENTRY_FILE = "mamba2/replayssm_spec.cu"
SPEC_KERNEL_NAMES = ("replayssm_verify", "replayssm_spec_commit", "replayssm_native_verify", "replayssm_native_commit")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    state: str  # "f32" | "bf16" | "f16"
    act: str  # "f32" | "bf16" | "f16"
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    buffer_len: int
    rows: int  # rows of one head per block
    warps: int
    has_z: bool = False
    arch: int = 90
    # The decode kernel compiled (and its register budget); part of the key. Standard decode modules only.
    variant: Variant = Variant()
    shadow: str = "none"  # "none" | "bf16" | "fp8" (needs an f32 checkpoint)
    # 0: the standard decode module; T >= 1: the speculative module (verify T tokens per step).
    num_tokens: int = 0
    # Strided tensors of the standard decode kernel (vLLM's paged state); None: contiguous (families/mamba2/ops.py).
    layout: Layout | None = None
    # The standard decode module whose one-shot or staged kernel reads its blocks' (row, slot, cursor) from a
    # flush-first order (cursor.flush_order, RSSM_ROW_ORDER) in place of state_batch_indices and the cursor.
    row_order: bool = False

    def __post_init__(self):
        for name, types in (("state", STATE_CUDA_TYPES), ("act", CUDA_TYPES)):
            if getattr(self, name) not in types:
                raise ValueError(f"KernelSpec.{name}: expected one of {sorted(types)}, got {getattr(self, name)!r}")
        if self.state == CKPT8:
            self._check_ckpt8()
        if self.shadow not in SHADOW_KINDS:
            raise ValueError(f"KernelSpec.shadow: expected one of {SHADOW_KINDS}, got {self.shadow!r}")
        if self.shadow != "none" and self.state != "f32":
            raise ValueError(f"KernelSpec.shadow={self.shadow!r} needs an f32 checkpoint, got state={self.state!r}")
        if self.nheads % self.ngroups:
            raise ValueError(f"ngroups ({self.ngroups}) must divide nheads ({self.nheads})")
        if not 1 <= self.buffer_len <= 32:
            raise ValueError(f"buffer_len must be in 1..32, got {self.buffer_len}")
        lay = vector_layout(self.layout_state, self.dstate)
        if self.headdim % self.rows or self.rows % (lay.rows_per_warp_load * self.warps):
            raise ValueError(
                f"rows={self.rows}, warps={self.warps}: rows must divide headdim={self.headdim} and be a "
                f"multiple of warps*{lay.rows_per_warp_load}"
            )
        if self.rows > self.warps * 32 or self.warps * 32 > MAX_THREADS:
            raise ValueError(f"rows={self.rows}, warps={self.warps}: need rows <= threads <= {MAX_THREADS}")
        if (self.shadow == "fp8" or self.state == CKPT8) and not self.num_tokens and self.rows % 4:
            raise ValueError(f"rows={self.rows}: the fp8 shadow's row scales move as 16-byte vectors of 4 rows "
                             "(replayssm_decode.cu): rows must be a multiple of 4")
        if not isinstance(self.variant, Variant):
            raise TypeError(f"KernelSpec.variant: expected a config.Variant (kind, min_blocks, flush_rows, copy), got "
                            f"{type(self.variant).__name__} {self.variant!r}")
        if self.variant.copy == "bulk":
            a = ITEMSIZE[self.act]
            if self.rows * a % 16 or self.headdim * a % 16 or self.dstate * a % 16:
                raise ValueError(f"KernelSpec.variant.copy='bulk': bulk copies move 16-byte multiples; x rows of a block "
                                 f"({self.rows} x {a} B), of a head ({self.headdim} x {a} B) and a B row ({self.dstate} x "
                                 f"{a} B) must each be one")
            if self.layout is not None or self.num_tokens:
                raise ValueError("KernelSpec.variant.copy='bulk': the contiguous standard decode module only")
            if self.arch < 90:
                raise ValueError(f"KernelSpec.variant.copy='bulk': cp.async.bulk needs sm_90 or newer, got arch={self.arch}")
        if self.num_tokens:
            self._check_spec()
        if self.layout is not None and (self.num_tokens or self.shadow != "none"):
            raise ValueError("KernelSpec.layout: the strided layout is for the standard decode module without a "
                             f"shadow, got num_tokens={self.num_tokens}, shadow={self.shadow!r}")
        if not isinstance(self.row_order, bool):
            raise TypeError(f"KernelSpec.row_order: expected a bool, got {type(self.row_order).__name__}")
        if self.row_order and (self.num_tokens or self.layout is not None or self.persistent):
            raise ValueError("KernelSpec.row_order: the contiguous standard decode module's one-shot or staged kernel "
                             "(the persistent kernel walks items, not rows), got "
                             f"num_tokens={self.num_tokens}, layout={self.layout!r}, variant.kind={self.variant.kind!r}")

    def _check_ckpt8(self):
        if self.shadow != "none":
            raise ValueError(f"KernelSpec.shadow={self.shadow!r}: an 8-bit checkpoint (state='fp8') is its own fp8 read copy; "
                             "expected shadow='none'")
        if self.num_tokens or self.layout is not None:
            raise ValueError("KernelSpec.state='fp8': the contiguous standard decode module only, got "
                             f"num_tokens={self.num_tokens}, layout={self.layout!r}")
        if self.variant.kind != "staged":
            raise ValueError(f"KernelSpec.state='fp8': the staged kernel only (the flush folds the staged 8-bit rows), "
                             f"got variant.kind={self.variant.kind!r}")

    @property
    def layout_state(self) -> str:
        """The state dtype whose row layout the module uses: an 8-bit checkpoint's rows are laid out as an fp32
        checkpoint's (4-element vectors), as the fp8 shadow's."""
        return "f32" if self.state == CKPT8 else self.state

    def _check_spec(self):
        T, L = self.num_tokens, self.buffer_len
        if T not in SUPPORTED_NUM_TOKENS:
            raise ValueError(f"num_tokens: expected 0 (standard decode) or one of {SUPPORTED_NUM_TOKENS}, got {T}")
        if L < 2 * T:
            raise ValueError(f"buffer_len={L}: expected >= 2 * num_tokens = {2 * T} (flush one window early)")
        if self.variant.kind != "one_shot":
            raise ValueError(f"KernelSpec.variant: the speculative module (num_tokens={T}) has one-shot kernels only, "
                             f"got kind={self.variant.kind!r}")
        if self.rows * ITEMSIZE[self.act] % 4:
            raise ValueError(f"rows={self.rows}: x rows of a block must be a multiple of 4 bytes (cp.async)")
        smem = spec_smem_bytes(self.act, self.rows, self.dstate, L, T, self.has_z)
        if smem > SMEM_LIMIT:
            raise ValueError(f"rows={self.rows}: verify needs {smem} bytes of static shared memory, limit {SMEM_LIMIT}")

    @property
    def key(self) -> str:
        """Readable cache key, e.g. ``replayssm_s-f32_a-bf16_H128_P64_N128_G8_L16_R64_W8_z0_sm90``."""
        return (
            f"replayssm_s-{self.state}_a-{self.act}_H{self.nheads}_P{self.headdim}_N{self.dstate}"
            f"_G{self.ngroups}_L{self.buffer_len}_R{self.rows}_W{self.warps}_z{int(self.has_z)}"
            + (f"_sh-{self.shadow}" if self.shadow != "none" else "") + f"_sm{self.arch}"
            + (f"_T{self.num_tokens}" if self.num_tokens else "")
            + self.variant.key
            + (self.layout.key if self.layout is not None else "")
            + ("_ro" if self.row_order else "")
        )

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def persistent(self) -> bool:
        return self.variant.kind == "persistent"

    @property
    def blocks_per_sm(self) -> int:
        """Resident blocks the kernel is built for (mirror of kMinBlocks in replayssm.cuh)."""
        if self.variant.min_blocks is None:  # the kernel's default: 1024 threads per SM for blocks of >= 256
            return 1024 // self.threads if self.threads >= 256 else 1
        threads_per_sm = 2048 if self.variant.kind == "staged" else 1024
        return max(1, min(self.variant.min_blocks, threads_per_sm // self.threads))

    @classmethod
    def from_dict(cls, d: dict) -> KernelSpec:
        """The spec of ``dataclasses.asdict(spec)`` (compile.spec_from_json): its variant and layout rebuilt."""
        d = dict(d, variant=Variant(**d["variant"]))
        d["layout"] = None if d.get("layout") is None else Layout(**d["layout"])
        return cls(**d)

    @property
    def entry_file(self) -> str:
        """The module's entry file under plugins/ (compile.py)."""
        return SPEC_ENTRY_FILE if self.num_tokens else ENTRY_FILE

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return SPEC_KERNEL_NAMES if self.num_tokens else KERNEL_NAMES

    def prelude(self) -> str:
        """The generated lines compile.py puts before the entry file (dtypes, sizes as constexpr, the variant)."""
        return "\n".join(
            [
                f"// generated for {self.key}",
                "#include <cuda_bf16.h>",
                "#include <cuda_fp16.h>",
                *(["#include <cuda_fp8.h>"] if self.shadow == "fp8" or self.state == "fp8" else []),
                *(["#define RSSM_CKPT8 1"] if self.state == "fp8" else []),  # 8-bit checkpoint (replayssm.cuh)
                f"using state_t = {STATE_CUDA_TYPES[self.state]};",
                f"using act_t = {CUDA_TYPES[self.act]};",
                f"using shadow_t = {SHADOW_CUDA_TYPES.get(self.shadow, 'state_t')};",
                f"#define RSSM_SHADOW {('none', 'bf16', 'fp8').index(self.shadow)}",
                f"constexpr int kH = {self.nheads};",
                f"constexpr int kP = {self.headdim};",
                f"constexpr int kN = {self.dstate};",
                f"constexpr int kG = {self.ngroups};",
                f"constexpr int kL = {self.buffer_len};",
                *([f"constexpr int kT = {self.num_tokens};"] if self.num_tokens else []),
                f"constexpr int kRows = {self.rows};",
                f"constexpr int kWarps = {self.warps};",
                f"constexpr bool kHasZ = {'true' if self.has_z else 'false'};",
                f"#define RSSM_HAS_Z {int(self.has_z)}",
                *self.variant.prelude(),
                *(self.layout.prelude() if self.layout is not None else []),
                *(["#define RSSM_ROW_ORDER 1"] if self.row_order else []),
                "",
            ]
        )

    def grid(self, batch: int, sm_count: int = SMS, kernel: str = "replayssm_decode") -> tuple[int, int, int]:
        items_per_row = self.nheads * (self.headdim // self.rows)
        # Persistent replay blocks walk the items (batch is a kernel arg); the conventional kernel is one-shot.
        if self.persistent and kernel != "replayssm_conventional":
            return (max(1, min(batch * items_per_row, sm_count * self.blocks_per_sm)), 1, 1)
        return (items_per_row, batch, 1)


@dataclasses.dataclass(frozen=True)
class VectorLayout:
    elems_per_vec: int  # state elements in one 16-byte vector
    lanes_per_row: int
    vecs_per_lane: int
    rows_per_warp_load: int


def vector_layout(state: str, dstate: int) -> VectorLayout:
    """Mirror of the constexpr layout in plugins/mamba2/replayssm.cuh (kEPV, kLPR, kVPL, kRPW)."""
    epv = 16 // ITEMSIZE[state]
    if dstate % epv:
        raise ValueError(f"dstate={dstate} must be a multiple of {epv} for a {state} state")
    vec_per_row = dstate // epv
    lpr = min(32, vec_per_row)
    if 32 % lpr or vec_per_row % lpr:
        raise ValueError(f"dstate={dstate} does not map to whole warps for a {state} state")
    return VectorLayout(epv, lpr, vec_per_row // lpr, 32 // lpr)


_local = threading.local()


def wave_tail_bound(blocks: int, slots: int) -> float:
    """waves / ceil(waves) for a grid of ``blocks`` equal blocks over ``slots`` resident blocks (SMs x blocks an SM):
    how full the grid keeps the machine when its last round is partial (bench/NOTES.md "Issue 40: the wave tail":
    the GDN and KDA steps' share of the copy ceiling at bs 8-256 follows it). Below one wave it is the share of
    slots used."""
    w = blocks / slots
    return w / math.ceil(w) if w >= 1 else w


def tail_resident(blocks: int, threads: int, options: tuple[int, ...], sms: int = SMS, margin: float = 0.02) -> int:
    """The resident threads an SM (a module's register budget: ``__launch_bounds__`` min blocks = resident / threads)
    among ``options``, the first the default, whose grid ends with the fullest last wave; another option only where
    its bound beats the best so far by more than ``margin`` (more blocks an SM cost registers, and spills)."""
    best = options[0]
    bound = wave_tail_bound(blocks, sms * max(1, best // threads))
    for o in options[1:]:
        b = wave_tail_bound(blocks, sms * max(1, o // threads))
        if b > bound + margin:
            best, bound = o, b
    return best


@contextlib.contextmanager
def pinned(table: dict, **pins):
    """Inside the block ``table`` (a family planner's launch-shape pins, read by its planner) also holds the ``pins``
    that are not None; what it held before is restored after (the GDN and KDA ``override``)."""
    old = dict(table)
    table.update({k: v for k, v in pins.items() if v is not None})
    try:
        yield
    finally:
        table.clear()
        table.update(old)

# State elements each thread keeps in registers: 32 fp32 values keeps ~4 blocks of 256 threads
# resident per SM with enough bytes in flight (docs/DESIGN.md §3: 32 KB/SM covers the latency).
STATE_REGS_PER_THREAD = 32
SMALL_BATCH = 4
# The staged shadow step above SMALL_BATCH: twice the rows a thread (R64 W4 on the main geometry instead of
# R64 W8), so the per-warp fixed part of an item (prologue, scalars, B.C) is paid by half the warps; H100,
# same-run A/B at bs256 (bench/NOTES.md "Fewer warps per item: outcome"): fp8 k1 142.8 -> 119.1 us, amortized
# 3.54x -> 4.10x the conventional step; bf16 (with 8 resident blocks) 258.8 -> 254.0 us.
SHADOW_REGS_PER_THREAD = 2 * STATE_REGS_PER_THREAD
# The staged fp32 step at batch <= SMALL_BATCH: the small-batch plan's rows a block in half its warps (twice the rows
# a thread: R16 W4 at bs1, R32 W8 at bs2-4 on the main geometry instead of R16 W8 / R32 W16), so half the warps pay
# each item's fixed part (prologue, scalars, B.C). H100, same run (bench/NOTES.md "Issue 40, third pass"): amortized
# x conventional bs1 0.97 -> 1.04, bs2 1.01 -> 1.13, bs4 1.12 -> 1.19 (fewer rows a block instead, R8 W4: 0.70-0.76).
STAGED_SMALL_ROWS_FACTOR = 2


SMEM_LIMIT = 48 * 1024  # static shared memory of one block


def replay_smem_bytes(state: str, act: str, rows: int, dstate: int, buffer_len: int, persistent: bool = False,
                      shadow: str = "none", staged: bool = False, bulk: bool = False) -> int:
    """Mirror of ``ReplaySmem`` / ``PipeSmem`` / ``StagedSmem`` in plugins/mamba2/replayssm.cuh (state, B, x
    tiles, scalars). choose_geometry sizes a block by the kernel that runs it: the one-shot tiles hold an fp32 x
    tile, the staged stage x in the activation dtype plus C and the history dt, so with f32 activations the
    staged block is the larger (by 4 N + 4 L bytes)."""
    # Staged rows: the checkpoint's, or only the shadow's + fp8 row scales (flushes read global memory).
    rows_bytes = rows * dstate * ITEMSIZE[state] if shadow == "none" else (
        rows * dstate * SHADOW_ITEMSIZE[shadow] + (rows * 4 if shadow == "fp8" else 0))
    def r16(v: int) -> int:
        return (v + 15) // 16 * 16

    L = buffer_len
    if persistent or staged:  # two stages (one if staged) of: rows, B tile, x tile (act), C (16-aligned), history dt
        tiles = rows_bytes + L * dstate * ITEMSIZE[act] + L * rows * ITEMSIZE[act]
        stage = r16(r16(tiles) + dstate * ITEMSIZE[act] + L * 4)  # Stage is alignas(16)
        end = (1 if staged else 2) * stage + 2 * L * 4 + 4  # w, bc, decay
        if bulk:
            end = (end + 7) // 8 * 8 + 8  # the 8-byte mbarrier
        return r16(end)
    tiles = rows_bytes + L * dstate * ITEMSIZE[act] + L * rows * 4
    return r16(tiles + 2 * L * 4 + 4)  # w, bc, decay; ReplaySmem is alignas(16)


def spec_smem_bytes(act: str, rows: int, dstate: int, buffer_len: int, num_tokens: int, has_z: bool) -> int:
    """Mirror of ``SpecSmem`` in plugins/mamba2/replayssm_spec.cuh (the verify kernel; native verify needs less)."""
    a, L, T = ITEMSIZE[act], buffer_len, num_tokens
    tiles = (L + T) * dstate * a + (L + (T if has_z else 1)) * rows * a  # B, C; x, z
    scalars = 4 * (T * L + 3 * L + T + 1)  # W, c, dte, wf, decay, decay_f
    return (tiles + scalars + 15) // 16 * 16


def choose_geometry(state: str, headdim: int, dstate: int, nheads: int, batch: int, act: str = "bf16",
                    buffer_len: int = 16, persistent: bool = False, shadow: str = "none",
                    staged: bool = False) -> tuple[int, int]:
    """(rows per block, warps) for this geometry and batch; the block's static shared memory is the kernel's it
    runs (persistent, staged or one-shot: with f32 activations the staged stage outgrows the one-shot tiles)."""
    forced = getattr(_local, "override", None)
    if forced is not None:
        return forced
    lay = vector_layout(state, dstate)
    per_row = lay.vecs_per_lane * lay.elems_per_vec  # state elements per thread per row
    # Small batches are latency-bound: fewer rows per thread shortens each thread's serial work
    # (the flush's rank-L update above all) and puts more warps on the few blocks there are.
    regs = STATE_REGS_PER_THREAD if batch > SMALL_BATCH else STATE_REGS_PER_THREAD // 4
    if shadow != "none" and staged and batch > SMALL_BATCH:
        regs = SHADOW_REGS_PER_THREAD
    rows_per_thread = max(1, regs // per_row)
    def warps_for(rows: int, rows_per_thread: int = rows_per_thread) -> int:
        w = max(1, rows // (lay.rows_per_warp_load * rows_per_thread))
        while rows % (lay.rows_per_warp_load * w):
            w -= 1
        if 32 * w < rows:  # rounding down left a row without a thread (headdim 80, dstate 64 at 64 registers):
            # the next warp count that divides the rows (the kernels need rows <= threads)
            w = next((x for x in range(-(-rows // 32), rows // lay.rows_per_warp_load + 1)
                      if rows % (lay.rows_per_warp_load * x) == 0), w)
        return w

    def can_halve(rows: int) -> bool:
        half = rows // 2
        # fp8 row scales move as 16-byte vectors of 4 rows (replayssm_decode.cu).
        return rows % 2 == 0 and half >= 8 and half % lay.rows_per_warp_load == 0 and (shadow != "fp8" or half % 4 == 0)

    rows = headdim
    # Split heads into row chunks while a block would need too many threads, or while the grid
    # would leave the GPU under two waves of blocks (small batches).
    while can_halve(rows) and (
        warps_for(rows) * 32 > MAX_THREADS
        or replay_smem_bytes(state, act, rows, dstate, buffer_len, persistent, shadow, staged) > SMEM_LIMIT
        or (batch * nheads * (headdim // rows) < MIN_BLOCKS and rows // 2 >= 16)
    ):
        rows //= 2
    warps = warps_for(rows)
    if shadow == "none" and staged and batch <= SMALL_BATCH:  # the same rows in half the warps
        warps = warps_for(rows, STAGED_SMALL_ROWS_FACTOR * rows_per_thread)
    if warps * 32 > MAX_THREADS:  # rows could not be split further (fp8 scales): more rows per thread
        warps = MAX_THREADS // 32
        while rows % (lay.rows_per_warp_load * warps):
            warps -= 1
    if warps * 32 > MAX_THREADS or \
            replay_smem_bytes(state, act, rows, dstate, buffer_len, persistent, shadow, staged) > SMEM_LIMIT:
        raise ValueError(f"no launch geometry for headdim={headdim}, dstate={dstate}, state={state}")
    return rows, warps


# The shipped variants (bench/NOTES.md says why). Without a shadow: persistent blocks where they pay,
# else one-shot, both built for 5 resident blocks (the kernel caps that at 1024 threads per SM); at batch
# <= SMALL_BATCH the staged one-shot kernel (rows and history staged together by cp.async: H100, same-run
# A/B, amortized bs1 5.6 -> 5.1 us, bs4 13.4 -> 12.3 us; bench/NOTES.md "Batch 1 with an fp32 checkpoint").
SHIPPED_MIN_BLOCKS = 5
DEFAULT_VARIANT = Variant("persistent", SHIPPED_MIN_BLOCKS)
SMALL_BATCH_VARIANT = Variant("staged", SHIPPED_MIN_BLOCKS, 2)
# With a shadow: the staged one-shot kernel, flush 2 rows at a time, with the resident blocks that were
# the best of 5 / 6 / 8 at bs256 on the main geometry (bench/NOTES.md "Staged one-shot shadow step"; with
# batch <= SMALL_BATCH). Above SMALL_BATCH (SHADOW_REGS_PER_THREAD) the blocks that leave a thread 64
# registers: 1024 threads per SM (8 blocks of R64 W4 on the main geometry, measured best for both shadows).
SHADOW_STAGED_BLOCKS = {"bf16": 5, "fp8": 8}
SHADOW_THREADS_PER_SM = 1024
SHADOW_FLUSH_ROWS = 2
SHADOW_VARIANTS = {sh: Variant("staged", n, SHADOW_FLUSH_ROWS) for sh, n in SHADOW_STAGED_BLOCKS.items()}


def plan(state: str, act: str, nheads: int, headdim: int, dstate: int, buffer_len: int, batch: int,
         conventional: bool = False, shadow: str = "none") -> tuple[int, int, Variant]:
    # The pinned variant and the geometry override are part of the key: _plan and choose_geometry read them.
    return _plan(state, act, nheads, headdim, dstate, buffer_len, batch, conventional, current_variant(),
                 getattr(_local, "override", None), shadow)


@functools.lru_cache(maxsize=4096)  # called on every eager launch: keep the geometry search off the hot path
def _plan(state: str, act: str, nheads: int, headdim: int, dstate: int, buffer_len: int, batch: int,
          conventional: bool, pinned: Variant | None, _override, shadow: str = "none") -> tuple[int, int, Variant]:
    """(rows, warps, variant) of the standard decode module to launch: the one place that decides.

    The shipped plan (``pinned`` None): the persistent pipelined replay kernel copies each item's B
    tile next to its state rows; it is used where the state rows outweigh the B tile at least 4:1
    (else the tile traffic and the small items it forces cost more than the pipeline saves:
    measured, bench/NOTES.md v4) and where two stages fit in static shared memory, else the
    one-shot kernel; an fp32 checkpoint at batch <= SMALL_BATCH takes the staged kernel (SMALL_BATCH_VARIANT).
    With a shadow the staged one-shot kernel (one-shot measured as fast or faster than persistent: bs256
    2.03x vs 1.98x, bench/NOTES.md "Shadow reads"; staged faster still), above SMALL_BATCH with 64 state
    registers a thread and the blocks that leave them (SHADOW_REGS_PER_THREAD, SHADOW_THREADS_PER_SM).
    The conventional module is one-shot.

    A pinned variant (:func:`override_variant`, ``TRTLLM_REPLAYSSM_VARIANT``; tests and sweeps) is used
    as given, with or without a shadow; a persistent one wherever two stages fit (else one-shot with
    the same register budget), and one-shot in the conventional module (that kernel has no persistent form).
    """
    if state == CKPT8:  # the fp8 shadow's plan and geometry: same staged rows (e4m3 + row scales) on every step
        if conventional:
            raise ValueError("state='fp8': an 8-bit checkpoint has no conventional module")
        rows, warps, variant = _plan("f32", act, nheads, headdim, dstate, buffer_len, batch, False, pinned, _override, "fp8")
        if variant.kind != "staged":
            raise ValueError(f"state='fp8': the 8-bit checkpoint runs the staged kernel only, got a pinned {variant!r}")
        return rows, warps, variant
    if pinned is None:
        if conventional:
            variant = Variant("one_shot", SHIPPED_MIN_BLOCKS)
        elif shadow != "none":
            variant = SHADOW_VARIANTS[shadow]
        elif batch <= SMALL_BATCH and state == "f32":  # measured for an fp32 checkpoint only
            variant = SMALL_BATCH_VARIANT
        else:
            variant = DEFAULT_VARIANT
    else:
        variant = pinned
        if conventional and variant.kind == "persistent":
            variant = dataclasses.replace(variant, kind="one_shot")
    if variant.kind == "persistent":
        try:
            rows, warps = choose_geometry(state, headdim, dstate, nheads, batch, act, buffer_len, True, shadow)
            if pinned is not None or rows * ITEMSIZE[state] >= 4 * buffer_len * ITEMSIZE[act]:
                return rows, warps, variant
        except ValueError:  # two stages do not fit
            pass
        variant = dataclasses.replace(variant, kind="one_shot")
    rows, warps = choose_geometry(state, headdim, dstate, nheads, batch, act, buffer_len, False, shadow,
                                  variant.kind == "staged")
    if pinned is None and variant.kind == "staged" and shadow != "none" and batch > SMALL_BATCH:  # 64 registers
        variant = dataclasses.replace(variant, min_blocks=max(1, SHADOW_THREADS_PER_SM // (32 * warps)))
    return rows, warps, variant


def plan_spec(state: str, act: str, nheads: int, headdim: int, dstate: int, buffer_len: int, num_tokens: int,
              batch: int, has_z: bool) -> tuple[int, int]:
    """(rows, warps) of the speculative kernels (verify, native verify and commit; one-shot blocks).

    The standard one-shot geometry (the state in registers needs the same rows per thread), with
    rows halved while the verify tiles overflow static shared memory or x rows are not whole 4 bytes.
    """
    return _plan_spec(state, act, nheads, headdim, dstate, buffer_len, num_tokens, batch, has_z,
                      getattr(_local, "override", None))


@functools.lru_cache(maxsize=4096)
def _plan_spec(state, act, nheads, headdim, dstate, buffer_len, num_tokens, batch, has_z, _override):
    rows, warps = choose_geometry(state, headdim, dstate, nheads, batch, act, buffer_len)
    rpw = vector_layout(state, dstate).rows_per_warp_load
    while spec_smem_bytes(act, rows, dstate, buffer_len, num_tokens, has_z) > SMEM_LIMIT or rows * ITEMSIZE[act] % 4:
        if _override is not None or rows % 2 or (rows // 2) % rpw or rows // 2 < 8:
            raise ValueError(f"no speculative launch geometry for headdim={headdim}, dstate={dstate}, act={act}, "
                             f"buffer_len={buffer_len}, num_tokens={num_tokens} (rows={rows})")
        rows //= 2
        warps = max(1, warps // 2)
        while rows % (rpw * warps):
            warps -= 1
    return rows, warps


def verify_spec(state: str, act: str, nheads: int, headdim: int, dstate: int, ngroups: int, buffer_len: int,
                num_tokens: int, batch: int, has_z: bool, arch: int, shadow: str = "none") -> KernelSpec:
    """The speculative module (verify / native kernels) for this geometry, planned for ``batch`` rows
    (ops launches it; the TensorRT plugin plans it for each tactic's batch)."""
    rows, warps = plan_spec(state, act, nheads, headdim, dstate, buffer_len, num_tokens, batch, has_z)
    return KernelSpec(state, act, nheads, headdim, dstate, ngroups, buffer_len, rows, warps, has_z, arch,
                      shadow=shadow, num_tokens=num_tokens)


def spec_grid(spec: KernelSpec, batch: int) -> tuple[int, int, int]:
    """One-shot grid of the speculative verify / native kernels: (heads * row chunks, batch)."""
    return (spec.nheads * (spec.headdim // spec.rows), batch, 1)


COMMIT_THREADS = 256  # replayssm_spec_commit: one thread per batch row


def commit_spec(num_tokens: int, buffer_len: int, arch: int) -> KernelSpec:
    """The module ``replayssm_spec_commit`` is launched from: the kernel depends only on (T, L), so any
    speculative spec with them carries it; this is the smallest valid one (ops and the TensorRT plugin)."""
    return KernelSpec("f32", "f32", 1, 8, 128, 1, buffer_len, 8, 1, False, arch, num_tokens=num_tokens)


def cursor_spec(buffer_len: int, arch: int, ckpt8: bool = False) -> KernelSpec:
    """The module the standard cursor's kernels (``replayssm_advance_cursor``, ``replayssm_flush_order``) are launched
    from: they depend only on L (and an 8-bit checkpoint's flush counts), so any standard decode module with this L
    carries them; this is the smallest valid one (cursor_ops and the TensorRT plugin)."""
    if ckpt8:
        return KernelSpec(CKPT8, "f32", 1, 8, 128, 1, buffer_len, 8, 1, False, arch, variant=Variant("staged"))
    return KernelSpec("f32", "f32", 1, 8, 128, 1, buffer_len, 8, 1, False, arch)


ORDER_THREADS = 1024  # replayssm_flush_order's block (kOrderThreads): one block walks the rows


def commit_grid(batch):
    """Grid of ``replayssm_spec_commit``; ``batch`` may be an int or a symbolic TensorRT expression."""
    return ((batch + (COMMIT_THREADS - 1)) // COMMIT_THREADS, 1, 1)


_UNSET = object()


def current_variant() -> Variant | None:
    """The pinned kernel variant: :func:`override_variant`'s, else ``TRTLLM_REPLAYSSM_VARIANT``'s
    (e.g. ``"kind=persistent,min_blocks=4"``); None: the shipped plan (:func:`plan`)."""
    pinned = getattr(_local, "variant", _UNSET)
    if pinned is not _UNSET:
        return pinned
    if os.environ.get("TRTLLM_REPLAYSSM_DEFINES"):  # an experiment setting that would otherwise do nothing
        raise ValueError(f"TRTLLM_REPLAYSSM_DEFINES: replaced by {VARIANT_ENV} (typed fields, e.g. "
                         f"'kind=staged,min_blocks=6,flush_rows=2'); unset it")
    return parse_variant(os.environ.get(VARIANT_ENV, ""))


@contextlib.contextmanager
def override_variant(variant: Variant | None = None, /, **fields):
    """Pin the kernel variant of every standard decode module planned inside the block (tests, sweeps):
    ``override_variant(kind="staged", min_blocks=6, flush_rows=2)`` or ``override_variant(Variant(...))``;
    ``override_variant(None)`` pins the shipped plan (``TRTLLM_REPLAYSSM_VARIANT`` is then ignored)."""
    if fields:
        unknown = sorted(set(fields) - set(Variant.FIELDS))
        if unknown:
            raise ValueError(f"override_variant: unknown field {unknown[0]!r}, expected some of {Variant.FIELDS}")
        if variant is not None:
            raise ValueError("override_variant: expected a Variant or its fields, got both")
        variant = Variant(**fields)
    elif variant is not None and not isinstance(variant, Variant):
        raise TypeError(f"override_variant: expected a config.Variant or None, got {type(variant).__name__}")
    prev = getattr(_local, "variant", _UNSET)
    _local.variant = variant
    try:
        yield
    finally:
        if prev is _UNSET:
            del _local.variant
        else:
            _local.variant = prev


@contextlib.contextmanager
def override_geometry(rows: int, warps: int):
    """Pin (rows per block, warps) for every launch inside the block (benchmark sweeps)."""
    prev = getattr(_local, "override", None)
    _local.override = (rows, warps)
    try:
        yield
    finally:
        _local.override = prev
