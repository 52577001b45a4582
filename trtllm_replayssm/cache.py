# SPDX-License-Identifier: Apache-2.0
"""ReplayStateCache: the decode state of every recurrent layer of one model (any family), per request slot.

The layers of each family live in a :class:`~.layer_group.LayerGroup` (``families/<name>/layers.py``): the
family's state table allocated once per tensor for all its layers, its conv windows and its step. A cache is
made of ``layers={family: (n, geometry)}`` (or ``(n, geometry, conv_dim)``; the family's ``Family.geometry``
order), its layers numbered group by group in that order, e.g.
``ReplayStateCache(num_slots=8, buffer_len=16, layers={"mamba2": (2, (H, P, N, G)), "gdn": (2, (HV, Hk, V, K))})``;
:meth:`ReplayStateCache.for_family` makes a cache of one family
(``for_family("gdn", layers, slots, (HV, Hk, V, K), L, ...)``), and the positional form
``ReplayStateCache(num_layers, num_slots, nheads, headdim, dstate, ngroups, buffer_len, ...)`` is
``layers={POSITIONAL_FAMILY: (num_layers, (nheads, headdim, dstate, ngroups), conv_dim)}`` (the models that came
first). The cache has one method for each call, whatever the layer's family: :meth:`~ReplayStateCache.layer`,
:meth:`~ReplayStateCache.load_prefill`, :meth:`~ReplayStateCache.verify` (the family's step inputs),
:meth:`~ReplayStateCache.conv_update`, :meth:`~ReplayStateCache.committed_state`; the step bookkeeping (flush,
commit), slots and snapshots are the family's business nowhere, and it never branches on a family's name (what
differs is the group's: :meth:`group` gives it, its ``t`` dict the family's tensors by state-table name).

Tensors, per family (the family's state table, :mod:`.contract`), each with a leading ``layers`` dim: e.g. for
``n`` Mamba-2 layers and ``num_slots`` request slots (H heads, P headdim, N dstate, G groups, L ring capacity,
K conv width, T_max = 1 + num_draft, W = K - 1 + num_draft):

=============  =============================  =================  ===============================================
tensor         shape                          dtype              meaning
=============  =============================  =================  ===============================================
state          (layers, slots, H, P, N)       state_dtype (f32)  checkpoint S0, written on prefill hand-off and flush
shadow         (layers, slots, H, P, N)       shadow_dtype       optional low-precision copy of S0 (None if off),
shadow_scale   (layers, slots, H, P)          f32                written with S0; scales only for fp8 (amax / 448)
x_cache        (layers, slots, H, L, P)       act_dtype          ring of x_j
B_cache        (layers, slots, G, L, N)       act_dtype          ring of B_j
dt_cache       (layers, slots, H, L)          dt_dtype (f32)     ring of processed dt_j (f64 only in tests)
cursor         (slots, 2)                     int32              [s, 0] = ring start, [s, 1] = committed count;
                                                                 shared by all layers (cursor.py docstring);
               (slots,) with cursor="standard"                   entries since the checkpoint (cursor.py)
conv           (layers, slots, conv_dim, W)   act_dtype          conv1d window, newest input in column W-1 (a view
                                                                 of (layers, slots + 1, ...): one scratch slot)
=============  =============================  =================  ===============================================

A group offers some of its tensors as the cache's attributes (:meth:`.LayerGroup.cache_attributes`: the Mamba-2
group the names above, ``nheads`` ... ``conv_dim`` and ``num_layers``, as callers have read them); every other
family's tensors are read through :meth:`group` (``cache.group("gdn").t["u_cache"]``, ``.conv``) or per layer
through :meth:`layer`. ``layer(l)`` gives per-layer views in the layouts of :mod:`.contract` (the kernels' state
contract, written once there).

Per step: :meth:`verify` and :meth:`conv_update` for every layer of every family between :meth:`flush` and
:meth:`commit`.

Slot lifecycle: :meth:`allocate` returns the lowest free slot, already reset; :meth:`free` returns it.
:meth:`reset` zeroes everything the slot owns in every layer (checkpoint, shadow, rings, conv window,
cursor start and count), so a recycled slot reads exactly what a fresh one reads: zeros, never a stale
cursor, stale history or a poison value. :meth:`load_prefill` hands off a prefill: its final SSM state
becomes the checkpoint (and its shadow), the ring is empty (start = count = 0), its conv state fills
the last K-1 columns of the window.

Flush phases (``flush_phases=True``): requests admitted together would otherwise fold their checkpoints at the same
step, every L tokens, and that step costs a flush for every row (the kernels' lockstep flush). With phases the n-th
:meth:`allocate` gives its slot the phase c = n mod :attr:`phase_span`: :meth:`reset` and :meth:`load_prefill` start
its count at c over zeroed ring entries, so its first flush comes after L - c tokens and the batch's flushes spread
over the steps (the kernel benchmarks' "mixed" launch). A zeroed entry is an exact identity in every family: its
decay is exp(0) = 1 (Mamba-2's stored dt = 0, GDN's and KDA's log-decay g = 0) and it adds nothing (Mamba-2's x = 0
and dt = 0; the delta rule's beta = 0, so its u = 0 and k u^T = 0), so outputs are those of the unphased request up
to the rounding of the shifted fold points. The cost is one earlier flush a request. Measured (H100, bench/NOTES.md
"Twenty-fourth session"): a launch whose rows sit at spread positions (what phases make of a static batch, and what
continuous batching makes anyway) is slower than the lockstep cycle's mean where the flush is long (the bf16-shadow
KDA and GDN steps, 1.1-1.2x at bs 128-256), level without a shadow: phases flatten the latency spike of the lockstep
flush step, they do not add throughput, so they stay opt-in.

Row order (``row_order``, standard cursor, the kernel executor; the KDA and GDN decode kernels, ``KDASpec.row_order``,
``GDNSpec.row_order``, and Mamba-2's one-shot and staged kernels, ``KernelSpec.row_order``, which a shadow or an 8-bit
checkpoint always runs: :attr:`LayerGroup.reads_row_order`): the decode grids walk the batch rows in order, and a
flushing row's blocks are several times longer than the others' (the shadow modules' ~6x), so a launch whose flushing
rows are spread through the batch ends with a partial wave of long blocks. With the order, the first layer a step runs
launches :func:`.cursor_ops.flush_order` once (the rows as (row, slot, cursor), flushing rows first;
:func:`.cursor.flush_order` is its spec) and every layer of the step reads its rows from it; outputs are bit for bit
those without it. ``True`` / ``False`` force it; ``None`` orders where it was measured to pay
(:meth:`LayerGroup.row_order_pays`: KDA and GDN layers with a bf16 shadow, Mamba-2 layers with an fp8 shadow or a bf16 one
up to batch 64), the default.

One speculative step (T <= T_max tokens, rows ``state_batch_indices``, -1 = padding row), the same
sequence on every device:
    cache.flush(sbi, T, A_by_layer)          # the flush rule on the pre-step cursors (see below)
    y_l = cache.verify(l, x, B, C, dt, dt_bias, A, D, z, sbi)   # every layer; ring append
    u_l = cache.conv_update(l, u, weight, bias, sbi)             # every layer
    cache.commit(sbi, n_accepted, T)         # count += n; conv windows drop the T - n rejected inputs

One path runs that sequence; only the arithmetic comes from the executor, chosen once at construction
(:mod:`.backend`: the float64 reference for CPU tensors, the kernels for CUDA ones; each family's steps for
either in its folder, ``families/<name>/steps.py``):

=========  ==============================================================================================
call       what happens (both executors)
=========  ==============================================================================================
flush      opens the step: T and the rows checked; nothing written (returns the slots that will fold on
           the reference, None on the kernels)
verify     the family's ``replay_verify`` with the layer's shadow: where count + 2T > L on the pre-step
           cursor the layer's checkpoint is folded first (and its shadow rewritten), then the window's
           outputs; the window is appended to the ring, the cursor is read only
conv       :func:`conv_update_rows`: gathered rows, fp32 math (float64 for float64 tensors), scattered back
commit     the executor's ``spec_commit`` (start += count, count = 0 where the layers folded; count += n),
           once for all layers, then every conv window drops the T - n rejected inputs
=========  ==============================================================================================
Between flush() and commit() the verified layers already hold the folded checkpoint while the cursor still
counts the folded entries: read :meth:`committed_state` between steps only. A step needs every layer
verified, with the same T, between flush() and commit() (checked on the host: a layer left out would have
its history dropped by the cursor move). ``tests/test_cache.py`` runs the kernel executor on CPU tensors
with launchers emulated from their contracts and checks every tensor bit-identical to the reference
executor's after each step. The kernel path is graph-safe: no host reads of device values unless
``check_values`` (default: when not capturing a CUDA graph) asks for the host checks of slots, cursors and
n_accepted. Eager serving without syncs: ``check_values=False``.
Standard decode is T = 1 of the same sequence: on the ring (num_draft = 0) it runs the verify kernel with
T = 1; with ``cursor="standard"`` (num_draft = 0) the cache keeps the (slots,) cursor of
the tuned standard decode kernel, verify runs the family's ``replay_decode`` (the step that fills the ring
folds it, L >= 1; a family whose standard step always reads its shadow says so: ``LayerGroup.standard_reads_shadow``)
and commit the executor's ``advance_cursor`` (n_accepted may be None: every row accepts its token).
Snapshots (:meth:`ReplayStateCache.snapshot` -> :class:`Snapshot`, :meth:`~ReplayStateCache.restore`): the state of
some slots after their last committed token, between steps: every tensor above that the slot owns (checkpoint,
shadow and scales, rings, conv window, cursor), copied as stored, so a slot restored anywhere (another slot,
another cache of the same configuration, another process through :meth:`Snapshot.to_bytes` /
:meth:`Snapshot.from_bytes`) continues bit-identically to one that never stopped (:meth:`snapshot` says why
not the checkpoint folded with the ring). Preemption: :meth:`~ReplayStateCache.swap_out` (snapshot to pinned host
memory, asynchronous on CUDA, then free) and :meth:`~ReplayStateCache.swap_in` (take free slots, restore).
``tests/test_state_lifecycle.py`` checks it under random schedules against a twin that never stopped.
Moving live slots in place (a serving cache manager that relocates requests, a beam reorder):
:meth:`~ReplayStateCache.move_slots` (every tensor a slot owns, sources read before destinations are written).

``conv_dim=0`` holds no conv windows (a caller that keeps its own, e.g. builders/model_step.py's
channels-innermost ones, skips conv_update).

:func:`.costs.cache_bytes` models what the constructor allocates (per slot and in all; tests/test_costs.py checks
it against the tensors) and :func:`.costs.memory_per_request` the bytes one request holds (ReplaySSM spec vs
native spec); the latter is re-exported here under its old import path.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import struct
import zlib

import torch

from . import backend, families
from . import cursor as cursors
from . import launch as _launch
from .costs import memory_per_request  # noqa: F401  (re-exported: the memory model's home is .costs)
from .layer_group import LayerGroup, group_class
from .shadow import Shadow

# The family of the positional form ReplayStateCache(num_layers, num_slots, nheads, headdim, dstate, ngroups,
# buffer_len, ...): its geometry is that family's (H, P, N, G). Every other cache names its families in ``layers=``.
POSITIONAL_FAMILY = "mamba2"


# ---- snapshots: the state of some slots, portable (ReplayStateCache.snapshot / restore, to_bytes / from_bytes) -------
SNAPSHOT_MAGIC = b"RSSMSNAP"
SNAPSHOT_VERSION = 1  # the byte format (Snapshot.to_bytes); bump on any change of the prefix, header or tensor names
SNAPSHOT_FORMAT = "replayssm-state"


_PER_SLOT = ("cursor", "ckpt_flushes")  # snapshot tensors of one row per slot and no layer dim


def _snapshot_names(family: str) -> dict[str, str]:
    """{table name: snapshot name} of a family's tensors (checkpoint under "state")."""
    return group_class(family).snapshot_names()
_PREFIX = struct.Struct("<8sII")  # magic, format version, header length
_PAYLOAD = struct.Struct("<QI")  # payload length, its crc32


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 (same bytes): index_copy_ has no fp8 kernel on the CPU."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def move_rows(t: torch.Tensor, dim: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Rows ``dst[i]`` of ``t`` along ``dim`` take rows ``src[i]``, bits as stored (fp8 as bytes): the gather is
    materialized before the scatter, so overlapping moves (a swap, a cycle) read every source before any is
    overwritten; rows that are no destination keep their values. ``src``, ``dst``: int64 on ``t``'s device, ``dst``
    distinct. The slot move of :meth:`ReplayStateCache.move_slots` and of caches kept outside one (the
    trtllm-serve module's Mamba-2 rings)."""
    r = _raw(t)
    r.index_copy_(dim, dst, r.index_select(dim, src))


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError as e:  # pragma: no cover - safetensors comes with the builder extra
        raise ImportError("Snapshot.to_bytes / from_bytes need safetensors (pip install safetensors, or the "
                          "project's [builder] extra)") from e
    return st


@dataclasses.dataclass(eq=False)
class Snapshot:
    """The state of ``num_slots`` slots after their last committed token, as :class:`ReplayStateCache` stores it.

    ``tensors``: for every tensor a slot owns (module docstring: checkpoint, shadow and fp8 scales, rings, conv
    window; named by each family's group, :meth:`.LayerGroup.snapshot_names`), its slice
    (layers, num_slots, ...) in the cache's dtype, bit for bit; ``cursor`` (num_slots,) or (num_slots, 2), the
    cache's cursor form. Row i of every tensor is the i-th slot given to :meth:`ReplayStateCache.snapshot`.
    ``header``: what a cache must match to take it (JSON-able: format, version, num_slots, cursor form, layers
    per family, geometry, tensor-parallel shard, name -> dtype and shape of every tensor).

    Copies made asynchronously (a CUDA cache into pinned host memory) are ordered on the stream that made
    them: a restore, free or reset on that stream is safe at once; a host read of the values needs
    :meth:`synchronize` (:meth:`to_bytes` and :meth:`to` call it).

    Bytes (:meth:`to_bytes`, :meth:`from_bytes`), little-endian::

        b"RSSMSNAP" | u32 format version | u32 header length h | header (JSON, UTF-8, h bytes)
                    | u64 payload length p | u32 crc32 of the payload | payload (safetensors, p bytes)

    The payload is safetensors rather than ``torch.save``: no pickle at all (a snapshot crosses process and
    machine boundaries in a prefill/decode hand-off; ``weights_only`` loading restricts pickle but still runs
    it), a plain documented layout that non-Python engines read (a C++ or Rust runtime can take the hand-off),
    fp8 and bf16 kept bit-exact, and a header of its own that names every tensor's dtype, shape and byte range
    (a short or overlapping payload is refused). The prefix's magic and version are checked before anything is
    parsed, the crc32 catches corruption, and every tensor is checked against the header.
    """

    header: dict
    tensors: dict
    _ready: object = dataclasses.field(default=None, repr=False)  # CUDA event after the async copies (None: ready)

    def __repr__(self) -> str:
        h = self.header
        return (f"Snapshot(num_slots={h.get('num_slots')}, cursor={h.get('cursor')!r}, layers={h.get('layers')}, "
                f"nbytes={self.nbytes}, device={self.device})")

    @property
    def num_slots(self) -> int:
        return int(self.header["num_slots"])

    @property
    def cursor_form(self) -> str:
        return self.header["cursor"]

    @property
    def device(self) -> torch.device:
        return self.tensors["cursor"].device

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors (num_slots x ReplayStateCache.bytes_per_slot())."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def synchronize(self) -> Snapshot:
        """Wait for the asynchronous copies that made this snapshot (a host read of its values needs it)."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self

    def to(self, device, *, pin_memory: bool = False) -> Snapshot:
        """A copy on ``device`` (host copies pinned if asked; copies to CUDA from pinned memory are asynchronous)."""
        device = torch.device(device)
        if device.type == "cpu":
            self.synchronize()
            tensors = {k: (t.to("cpu") if t.device.type != "cpu" else t.clone()) for k, t in self.tensors.items()}
            if pin_memory:
                tensors = {k: t.pin_memory() for k, t in tensors.items()}
            return Snapshot(copy.deepcopy(self.header), tensors)
        tensors = {k: t.to(device, non_blocking=t.device.type == "cpu" and t.is_pinned(), copy=True)
                   for k, t in self.tensors.items()}
        return Snapshot(copy.deepcopy(self.header), tensors)

    # ---- bytes ------------------------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The versioned byte form (class docstring); waits for the copies, reads the values on the host."""
        st = _safetensors()
        self.synchronize()
        self.validate("to_bytes")
        payload = st.save({k: t.detach().to("cpu").contiguous() for k, t in self.tensors.items()})
        head = json.dumps(self.header, sort_keys=True).encode()
        return b"".join((_PREFIX.pack(SNAPSHOT_MAGIC, SNAPSHOT_VERSION, len(head)), head,
                         _PAYLOAD.pack(len(payload), zlib.crc32(payload)), payload))

    export = to_bytes

    @classmethod
    def from_bytes(cls, data) -> Snapshot:
        """A snapshot (host tensors) from :meth:`to_bytes`'s bytes. Raises ValueError naming what is wrong: magic,
        format version, a truncated or overlong payload, a crc mismatch, a header that does not match the tensors.
        Whether it fits a cache is checked by :meth:`ReplayStateCache.restore`."""
        data = bytes(data)
        what = "snapshot bytes"
        if len(data) < _PREFIX.size:
            raise ValueError(f"{what}: truncated: {len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix")
        magic, version, hlen = _PREFIX.unpack_from(data)
        if magic != SNAPSHOT_MAGIC:
            raise ValueError(f"{what}: wrong magic {magic!r}, expected {SNAPSHOT_MAGIC!r} (not a ReplayStateCache "
                             "snapshot)")
        if version != SNAPSHOT_VERSION:
            raise ValueError(f"{what}: format version {version}, this build reads version {SNAPSHOT_VERSION} only")
        end = _PREFIX.size + hlen
        if len(data) < end + _PAYLOAD.size:
            raise ValueError(f"{what}: truncated: {len(data)} bytes, the header alone needs {end + _PAYLOAD.size}")
        try:
            header = json.loads(data[_PREFIX.size:end].decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{what}: the header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{what}: the header is not a JSON object")
        plen, crc = _PAYLOAD.unpack_from(data, end)
        payload = data[end + _PAYLOAD.size:]
        if len(payload) < plen:
            raise ValueError(f"{what}: truncated payload: {len(payload)} of {plen} bytes")
        if len(payload) > plen:
            raise ValueError(f"{what}: {len(payload) - plen} bytes after the {plen}-byte payload")
        if zlib.crc32(payload) != crc:
            raise ValueError(f"{what}: payload crc32 {zlib.crc32(payload):#010x}, the header says {crc:#010x} "
                             "(corrupted)")
        st = _safetensors()
        try:
            tensors = st.load(payload)
        except Exception as e:  # safetensors' own error type
            raise ValueError(f"{what}: the payload is not a valid safetensors blob ({e})") from None
        snap = cls(header, tensors)
        snap.validate("from_bytes")
        return snap

    import_ = from_bytes

    def validate(self, what: str = "snapshot") -> None:
        """The header well formed and every tensor as it says (dtype, shape, one row per slot, the cursor's
        form); raises ValueError naming the first thing that differs."""
        h = self.header
        for key in ("format", "version", "num_slots", "cursor", "layers", "geometry", "shard", "tensors"):
            if key not in h:
                raise ValueError(f"{what}: the header has no {key!r}")
        if h["format"] != SNAPSHOT_FORMAT or h["version"] != SNAPSHOT_VERSION:
            raise ValueError(f"{what}: header format {h['format']!r} version {h['version']}, expected "
                             f"{SNAPSHOT_FORMAT!r} version {SNAPSHOT_VERSION}")
        n = h["num_slots"]
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{what}: num_slots: expected an int >= 1, got {n!r}")
        if h["cursor"] not in ("ring", "standard"):
            raise ValueError(f"{what}: cursor: expected 'ring' or 'standard', got {h['cursor']!r}")
        layers = h["layers"]
        if not isinstance(layers, dict) or not set(layers) <= set(families.names()) \
                or not all(isinstance(v, int) and v >= 0 for v in layers.values()) or not any(layers.values()):
            raise ValueError(f"{what}: layers: expected {{family: layers}} over {families.names()} with at least one "
                             f"layer, got {layers!r}")
        owner = {}  # snapshot name -> family
        for fam, count in layers.items():
            if count:
                owner.update({name: fam for name in _snapshot_names(fam).values()})
        want = {"cursor"} | set(owner) | ({"ckpt_flushes"} if "ckpt_scale" in self.tensors else set())
        names, spec = set(self.tensors), h["tensors"]
        checkpoints = {_snapshot_names(fam)["state"] for fam, count in layers.items() if count}
        for bad, msg in ((names - want, "unknown tensors"), (set(spec) ^ names, "tensors and header differ on"),
                         (({"cursor"} | checkpoints) - names, "missing tensors")):
            if bad:
                raise ValueError(f"{what}: {msg} {sorted(bad)}")
        cursor_shape = [n] if h["cursor"] == "standard" else [n, 2]
        for name, t in self.tensors.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{what}: {name}: expected a tensor, got {type(t).__name__}")
            s = spec[name]
            got = (_dtype_name(t.dtype), list(t.shape))
            if got != (s.get("dtype"), s.get("shape")):
                raise ValueError(f"{what}: {name}: {got[0]} {tuple(got[1])}, the header says {s.get('dtype')} "
                                 f"{tuple(s.get('shape') or ())}")
            if name == "ckpt_flushes":
                if got != ("int32", [n]):
                    raise ValueError(f"{what}: ckpt_flushes: expected int32 ({n},), got {got[0]} {tuple(got[1])}")
            elif name == "cursor":
                if got != ("int32", cursor_shape):
                    raise ValueError(f"{what}: cursor: expected int32 {tuple(cursor_shape)} (the {h['cursor']} form), "
                                     f"got {got[0]} {tuple(got[1])}")
            elif t.dim() < 2 or t.shape[:2] != (layers[owner[name]], n):
                raise ValueError(f"{what}: {name}: expected (layers, num_slots={n}, ...), got {tuple(t.shape)}")


class ReplayStateCache:
    """See the module docstring. ``check_values`` (CUDA path): None = host checks unless capturing a CUDA
    graph, False = never (no device->host reads), True = always. ``read_shadow`` (CPU path): the output
    form reads the shadow as the kernels do (a CUDA cache with a shadow always reads it). On CUDA, headdim and
    dstate must be geometries the kernels support (config.SUPPORTED_*) and buffer_len <= 32, checked here."""

    def __init__(self, num_layers: int | None = None, num_slots: int | None = None, nheads: int | None = None,
                 headdim: int | None = None, dstate: int | None = None, ngroups: int | None = None,
                 buffer_len: int | None = None, num_draft: int = 0, conv_kernel: int = 4, conv_dim: int | None = None,
                 state_dtype=torch.float32, act_dtype=torch.bfloat16, shadow_dtype=None, dt_dtype=torch.float32,
                 device="cpu", check_values: bool | None = None, read_shadow: bool = False, *, cursor: str = "ring",
                 executor=None, layers=None, ckpt_seed: int = 0, flush_phases: bool = False,
                 row_order: bool | None = None):
        positional = dict(num_layers=num_layers, nheads=nheads, headdim=headdim, dstate=dstate, ngroups=ngroups)
        if layers is None:  # the positional form: one family's geometry (POSITIONAL_FAMILY)
            missing = [k for k, v in positional.items() if v is None]
            if missing:
                raise TypeError(f"{', '.join(missing)}: expected the positional form's sizes (num_layers, num_slots, "
                                f"nheads, headdim, dstate, ngroups, buffer_len) or layers={{family: (n, geometry)}}")
            layers = {POSITIONAL_FAMILY: (num_layers, (nheads, headdim, dstate, ngroups), conv_dim)}
        else:
            given = [k for k, v in (*positional.items(), ("conv_dim", conv_dim)) if v is not None]
            if given:
                raise TypeError(f"{', '.join(given)}: the positional form's sizes; with layers= each family's layers, "
                                f"geometry and conv_dim go there, (n, geometry[, conv_dim])")
        for name, v in (("num_slots", num_slots), ("buffer_len", buffer_len)):
            if v is None:
                raise TypeError(f"{name}: expected an int, got None")
        specs = []  # (family, layers, geometry, conv_dim) in the cache's layer order
        for fam, spec in dict(layers).items():
            if fam not in families.names():
                raise ValueError(f"layers: expected families among {families.names()}, got {fam!r}")
            try:
                n, geometry, *cd = spec
            except (TypeError, ValueError):
                raise ValueError(f"layers[{fam!r}]: expected (layers, geometry) or (layers, geometry, conv_dim), got "
                                 f"{spec!r}") from None
            if len(cd) > 1 or not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"layers[{fam!r}]: expected (layers >= 0, geometry[, conv_dim]), got {spec!r}")
            if n:
                specs.append((fam, n, tuple(geometry), cd[0] if cd else None))
        if not specs:
            raise ValueError(f"layers: expected at least one layer, got {dict(layers)!r}")
        for name, v in (("num_slots", num_slots), ("conv_kernel", conv_kernel)):
            if v < 1:
                raise ValueError(f"{name}: expected >= 1, got {v}")
        if num_draft < 0:
            raise ValueError(f"num_draft: expected >= 0, got {num_draft}")
        if cursor not in ("ring", "standard"):
            raise ValueError(f"cursor: expected 'ring' or 'standard', got {cursor!r}")
        if cursor == "standard" and num_draft:
            raise ValueError(f"cursor: 'standard' (the (slots,) cursor of the standard decode kernels) needs num_draft "
                             f"= 0, got num_draft={num_draft}")
        cuda = torch.device(device).type == "cuda"
        classes = [group_class(fam) for fam, *_ in specs]
        if cursor == "standard" and shadow_dtype is not None and not read_shadow and not cuda:
            for cls in classes:
                if cls.standard_reads_shadow:
                    raise ValueError(f"read_shadow: a standard-cursor {families.get(cls.family).label} cache reads "
                                     "the shadow it keeps (as the kernel does); pass read_shadow=True or no "
                                     "shadow_dtype")
        if cursor == "standard" and buffer_len < 1:
            raise ValueError(f"buffer_len: expected >= 1, got {buffer_len}")
        if cursor == "ring" and buffer_len < 2 * (num_draft + 1):
            raise ValueError(f"buffer_len: expected >= 2 * (num_draft + 1) = {2 * (num_draft + 1)} (flush one window "
                             f"early), got {buffer_len}")
        if shadow_dtype not in (None, torch.bfloat16, torch.float8_e4m3fn):  # the shadows a kernel reads
            raise ValueError(f"shadow_dtype: expected None, bfloat16 or float8_e4m3fn, got {shadow_dtype}")
        # Each group checks its geometry, then allocates from its family's table.
        for cls, (_, _, geometry, _) in zip(classes, specs):
            cls.check_geometry(geometry, cuda, shadow_dtype, state_dtype)
        if cuda and buffer_len > 32:
            raise ValueError(f"buffer_len: expected <= 32 on CUDA (the kernels' rings), got {buffer_len}")
        ckpt8 = state_dtype == torch.float8_e4m3fn
        if ckpt8 and (cursor != "standard" or not all(cls.ckpt8 for cls in classes)):
            keep = " and ".join(families.get(f).label for f in families.names()
                                if families.get(f).layer_group and group_class(f).ckpt8)
            raise ValueError(f"state_dtype: an 8-bit checkpoint (float8_e4m3fn) is for {keep} layers on the standard "
                             f"cursor (its kernel is the standard decode step); got cursor={cursor!r}, layers="
                             f"{[fam for fam, *_ in specs]}")
        total = sum(n for _, n, _, _ in specs)
        if isinstance(ckpt_seed, bool) or not isinstance(ckpt_seed, int) or not 0 <= ckpt_seed < 2 ** 31 - total:
            raise TypeError(f"ckpt_seed: expected an int in [0, 2^31 - num_layers) (layer l draws with seed + l), got "
                            f"{ckpt_seed!r}")
        self.num_slots, self.buffer_len, self.num_draft, self.conv_kernel = num_slots, buffer_len, num_draft, conv_kernel
        self.conv_width = conv_kernel - 1 + num_draft
        self.check_values, self.read_shadow = check_values, read_shadow
        # The executor of every step, chosen once (backend.py): the float64 reference for CPU tensors, the
        # kernels for CUDA ones. ``executor`` overrides it (tests run the kernel backend on CPU tensors with
        # emulated launchers).
        self.x = backend.for_device(device) if executor is None else executor
        # An 8-bit checkpoint's flush counts, one per slot for every layer (the rounding stream's counter), and seed.
        self.ckpt_seed = ckpt_seed
        self.ckpt_flushes = torch.zeros(num_slots, dtype=torch.int32, device=device) if ckpt8 else None
        self.groups: list[LayerGroup] = []
        for cls, (_, n, geometry, cd) in zip(classes, specs):
            dts, optional = cls.roles(state_dtype, act_dtype, dt_dtype, shadow_dtype)
            g = cls(n, num_slots, geometry, buffer_len, self.conv_width, cd, dts, optional, device, act_dtype)
            g.ckpt_flushes, g.ckpt_seed = self.ckpt_flushes, ckpt_seed
            self.groups.append(g)
        self._by_family = {g.family: g for g in self.groups}
        # global layer index -> (group, layer within the group): the groups' layers in order
        self._where = [(g, l) for g in self.groups for l in range(g.num_layers)]
        self.standard = cursor == "standard"
        self.cursor = torch.zeros((num_slots,) if self.standard else (num_slots, 2), dtype=torch.int32, device=device)
        for g in self.groups:  # the names callers read from the cache (LayerGroup.cache_attributes)
            for name, value in g.cache_attributes().items():
                if hasattr(self, name):
                    raise AssertionError(f"cache attribute {name!r} offered twice")  # pragma: no cover - a family bug
                setattr(self, name, value)
        if not isinstance(flush_phases, bool):
            raise TypeError(f"flush_phases: expected a bool, got {flush_phases!r}")
        self.flush_phases = flush_phases
        if row_order is not None and not isinstance(row_order, bool):
            raise TypeError(f"row_order: expected a bool or None (where it was measured to pay), got {row_order!r}")
        if row_order and (not self.standard or not any(g.reads_row_order for g in self.groups)):
            raise ValueError("row_order: the flush-first row order is read by the standard decode kernels "
                             "(cursor='standard') of " + ", ".join(
                                 group_class(f).row_order_layers for f in families.names()
                                 if families.get(f).layer_group and group_class(f).row_order_layers)
                             + f"; got cursor={cursor!r}, layers={[g.family for g in self.groups]}")
        self.row_order = row_order
        # batch -> the (batch, 4) buffer of the flush-first order (one a batch size, kept: a captured graph writes and
        # reads it on every replay); batch -> the rows (sbi's data_ptr) whose order this step has launched there
        self._orders: dict = {}
        self._ordered: dict = {}
        # The phase of each slot's first flush (:meth:`allocate`): its cursor starts at this count over zeroed ring
        # entries, which are exact identity entries in every family (module docstring, "Flush phases").
        self._phase = [0] * num_slots
        self._admitted = 0
        self._free = list(range(num_slots))
        self._live: set[int] = set()
        self._step: tuple[int, set] | None = None  # (T, layers verified) since flush()

    @classmethod
    def for_family(cls, family: str, num_layers: int, num_slots: int, geometry, buffer_len: int, *,
                   conv_dim: int | None = None, **kw) -> ReplayStateCache:
        """A cache of ``num_layers`` layers of one family (``families.names()``; ``geometry`` in the order of the
        family's ``Family.geometry``), e.g. ``for_family("kda", 21, 8, (32, 128, 128), 16, cursor="standard")``."""
        return cls(num_slots=num_slots, buffer_len=buffer_len, layers={family: (num_layers, tuple(geometry), conv_dim)},
                   **kw)

    @classmethod
    def for_rank(cls, rank: int, tp: int, num_layers: int, num_slots: int, nheads: int, headdim: int, dstate: int,
                 ngroups: int, buffer_len: int, **kw) -> ReplayStateCache:
        """The cache of tensor-parallel rank ``rank`` of ``tp`` (:func:`.tp.shard_plan`): the checkpoint, shadow,
        x / dt rings of its heads, the B ring of the groups they read, conv windows of its channels
        (:func:`.tp.mixer_channels` order: x of its heads, B and C of its groups). Cursors are per slot,
        identical on every rank. ``shard`` records the heads and groups held."""
        from . import tp as tpmod

        if not 0 <= rank < tp:
            raise ValueError(f"rank: expected 0 <= rank < tp={tp}, got {rank}")
        shard = tpmod.shard_plan(nheads, ngroups, tp)[rank]
        cache = cls(num_layers, num_slots, shard.nheads, headdim, dstate, shard.ngroups, buffer_len, **kw)
        cache.shard = shard
        return cache

    @property
    def uses_kernels(self) -> bool:
        """True when the step's executor is the kernels (CUDA tensors), False for the float64 reference."""
        return self.x.name == "kernels"

    def _checking(self) -> bool:
        return self.check_values if self.check_values is not None else not _launch.capturing()

    # ---- views ----------------------------------------------------------------------------------------
    @property
    def total_layers(self) -> int:
        """Layers of every family; the cache numbers them group by group (in the order of ``layers=``)."""
        return len(self._where)

    def _locate(self, l: int) -> tuple[LayerGroup, int]:
        if not isinstance(l, int) or not 0 <= l < len(self._where):
            raise IndexError(f"layer: expected 0 <= layer < {len(self._where)}, got {l}")
        return self._where[l]

    def layer(self, l: int):
        """Views of layer ``l``'s tensors (no copies) in its family's per-layer form (its group's ``view``, e.g.
        ``families/mamba2/layers.py``'s ``LayerState``)."""
        g, i = self._locate(l)
        return g.view(i)

    def layer_family(self, l: int) -> str:
        return self._locate(l)[0].family

    def first_layer(self, family: str) -> int:
        """The cache's index of ``family``'s first layer (its layers are consecutive)."""
        for i, (g, _) in enumerate(self._where):
            if g.family == family:
                return i
        raise ValueError(f"family: the cache holds no {family!r} layers (it holds "
                         f"{sorted({g.family for g, _ in self._where})})")

    def group(self, family: str) -> LayerGroup:
        """The :class:`~.layer_group.LayerGroup` of ``family``'s layers: its tensors by state-table name (``t``),
        its conv windows (``conv``), geometry and layer count."""
        g = self._by_family.get(family)
        if g is None:
            raise ValueError(f"family: the cache holds no {family!r} layers (it holds {sorted(self._by_family)})")
        return g

    def _tensors(self):
        return [t for g in self.groups for _, t in g.tensors()]

    # ---- slot lifecycle ----------------------------------------------------------------------------------
    @property
    def live_slots(self) -> list[int]:
        return sorted(self._live)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def phase_span(self) -> int:
        """How many flush phases :meth:`allocate` deals out with ``flush_phases``: L on the standard cursor (a slot
        whose count starts at c flushes after L - c tokens), L - 2 T_max + 1 on the ring cursor (a count above
        L - 2 T_max folds at the next step, cursor.needs_flush)."""
        return self.buffer_len if self.standard else self.buffer_len - 2 * (self.num_draft + 1) + 1

    def phase(self, slot: int) -> int:
        """The committed count ``slot`` starts from after :meth:`reset` and :meth:`load_prefill` (0 without
        ``flush_phases``)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot: expected 0 <= slot < {self.num_slots}, got {slot}")
        return self._phase[slot]

    def allocate(self) -> int:
        """Take the lowest free slot, reset. With ``flush_phases`` the slot gets the next phase in turn (the n-th
        allocation n mod :attr:`phase_span`), so requests admitted together flush at different steps. Raises
        RuntimeError when every slot is live."""
        if not self._free:
            raise RuntimeError(f"allocate: all {self.num_slots} slots are live")
        self._free.sort()
        slot = self._free.pop(0)
        if self.flush_phases:
            self._phase[slot] = self._admitted % self.phase_span
            self._admitted += 1
        self.reset(slot)
        self._live.add(slot)
        return slot

    def free(self, slot: int) -> None:
        self._check_live(slot, "free")
        self._live.remove(slot)
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        """Zero everything ``slot`` owns in every layer and its cursor (start = 0, count = the slot's
        :meth:`phase`, 0 without ``flush_phases``)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot: expected 0 <= slot < {self.num_slots}, got {slot}")
        for g in self.groups:
            g.reset_slot(slot)
        self._start_cursor(slot)
        if self.ckpt_flushes is not None:
            self.ckpt_flushes[slot] = 0

    def _start_cursor(self, slot: int) -> None:
        """start = 0, count = the slot's phase: entries 0 .. phase - 1 are the zeroed ring's (identity entries)."""
        self.cursor[slot].zero_()
        if self._phase[slot]:
            if self.standard:
                self.cursor[slot] = self._phase[slot]
            else:
                self.cursor[slot, cursors.COUNT] = self._phase[slot]

    def gather_slots(self, src: torch.Tensor) -> None:
        """Slot s takes what slot ``src[s]`` held, in every layer and its cursor (src (num_slots,) int, repeats
        allowed): the reorder a beam search applies to its cache (every beam continues one parent). Between
        steps only; no host read of ``src``'s values (a graph-safe gather). :meth:`move_slots` onto every slot."""
        if not isinstance(src, torch.Tensor) or src.dtype not in (torch.int32, torch.int64) \
                or tuple(src.shape) != (self.num_slots,):
            raise ValueError(f"src: expected a ({self.num_slots},) integer tensor, got "
                             f"{tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__}")
        self.move_slots(src, torch.arange(self.num_slots, device=src.device), "gather_slots")

    def move_slots(self, src, dst, what: str = "move_slots") -> None:
        """Slot ``dst[i]`` takes what slot ``src[i]`` held: every tensor a slot owns (checkpoint, shadow and
        scales, rings, conv window, cursor; :meth:`snapshot`'s list), copied as stored, so a moved slot continues
        bit-identically. All sources are read before any destination is written (a swap or a cycle moves whole
        slots); slots that are no destination keep what they held, a source included. ``src``, ``dst``: equal-length
        1-D integer tensors (not read on the host) or host lists of ints (range-checked; through pinned memory on
        CUDA), ``dst`` distinct. Between steps only; slot lifecycle (live / free) is the caller's. The one slot move
        (:func:`move_rows` per tensor): :meth:`gather_slots` (beam reorder) and the trtllm-serve module's relocation
        (serve/trtllm_replayssm_module/install.py) use it."""
        if self._step is not None:
            raise RuntimeError(f"{what}: a step is open (flush() without commit())")
        idx = []
        for name, t in (("src", src), ("dst", dst)):
            if isinstance(t, (list, tuple)) and all(isinstance(v, int) for v in t):
                bad = [v for v in t if not 0 <= v < self.num_slots]
                if bad:
                    raise IndexError(f"{what}: {name}: expected slots in 0..{self.num_slots - 1}, got {bad}")
                t = self._slot_index(list(t))
            if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
                raise ValueError(f"{what}: {name}: expected a 1-D integer tensor or a list of ints, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            idx.append(t.to(device=self.cursor.device, dtype=torch.long))
        s, d = idx
        if s.shape != d.shape:
            raise ValueError(f"{what}: src and dst: expected equal lengths, got {s.shape[0]} and {d.shape[0]}")
        for name, t in self._snapshot_tensors():
            move_rows(t, 0 if name in _PER_SLOT else 1, s, d)

    # ---- snapshot / restore / preemption -------------------------------------------------------------------------
    def _snapshot_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of everything a slot owns: the groups with layers, their shadows if kept, the cursor."""
        out = [(n, t) for g in self.groups if g.num_layers for n, t in g.tensors()]
        out += [] if self.ckpt_flushes is None else [("ckpt_flushes", self.ckpt_flushes)]
        return out + [("cursor", self.cursor)]

    def snapshot_header(self, num_slots: int) -> dict:
        """The header of a snapshot of ``num_slots`` slots of this cache (:class:`Snapshot`): what a cache must
        match to take it."""
        geometry = dict(buffer_len=self.buffer_len, num_draft=self.num_draft, conv_kernel=self.conv_kernel,
                        conv_width=self.conv_width)
        if self.ckpt_flushes is not None:
            geometry["ckpt_seed"] = self.ckpt_seed  # the 8-bit checkpoint's rounding stream
        for g in self.groups:
            if g.num_layers:
                geometry.update(g.geometry_header())
        shard = getattr(self, "shard", None)
        tensors = {}
        for name, t in self._snapshot_tensors():
            shape = [num_slots, *t.shape[1:]] if name in _PER_SLOT else [t.shape[0], num_slots, *t.shape[2:]]
            tensors[name] = dict(dtype=_dtype_name(t.dtype), shape=shape)
        layers = {g.family: g.num_layers for g in self.groups}
        return dict(format=SNAPSHOT_FORMAT, version=SNAPSHOT_VERSION, num_slots=num_slots,
                    cursor="standard" if self.standard else "ring", layers=layers, geometry=geometry,
                    shard=None if shard is None else dataclasses.asdict(shard), tensors=tensors)

    def _snapshot_slots(self, slots, what: str, n: int | None = None, live: bool = True) -> list[int]:
        """Host ints, distinct, in range, live (or free with live=False), ``n`` of them if given; no open step."""
        if self._step is not None:
            raise RuntimeError(f"{what}: a step is open (flush() without commit()); the committed state is there "
                               "between steps only")
        try:
            slots = [int(s) for s in slots]
        except TypeError:
            raise TypeError(f"{what}: slots: expected a sequence of ints, got {type(slots).__name__}") from None
        if not slots:
            raise ValueError(f"{what}: slots: expected at least one slot")
        if n is not None and len(slots) != n:
            raise ValueError(f"{what}: the snapshot holds {n} slots, got {len(slots)} slots {slots}")
        if len(set(slots)) != len(slots):
            raise ValueError(f"{what}: slots: expected distinct slots, got {slots}")
        for s in slots:
            if not 0 <= s < self.num_slots:
                raise IndexError(f"{what}: slot: expected 0 <= slot < {self.num_slots}, got {s}")
            if live:
                self._check_live(s, what)
            elif s in self._live:
                raise ValueError(f"{what}: slot {s} is live (expected a free slot; free slots: {sorted(self._free)})")
        return slots

    def _slot_index(self, slots: list[int]) -> torch.Tensor:
        """``slots`` as an int64 index on the cache's device; on CUDA through pinned memory (no host sync)."""
        dev = self.cursor.device
        if dev.type != "cuda":
            return torch.tensor(slots, dtype=torch.long, device=dev)
        return torch.tensor(slots, dtype=torch.long, pin_memory=True).to(dev, non_blocking=True)

    def snapshot(self, slots, device="cpu", *, pin_memory: bool | None = None) -> Snapshot:
        """The state of ``slots`` (live, between steps) after their last committed token, copied to ``device``.

        What is copied: the checkpoint, its shadow (and fp8 scales), every ring, the conv window and the cursor,
        exactly as stored (bits), for every layer of every family; row i of the snapshot is ``slots[i]``. A
        slot restored from it (:meth:`restore`, any slot, any cache of the same configuration, this process or
        another through :meth:`Snapshot.to_bytes`) then runs the same arithmetic on the same bits as the slot
        that never stopped: its outputs and states continue bit-identically (same executor; fp32 checkpoint).

        Why as stored, not the checkpoint folded with the ring (the form a conventional cache would carry): a
        fold is arithmetic the slot that never stopped does not do at that token (it folds later, at its own
        flush, over a longer ring, and its fp32/bf16/fp8 rounding lands elsewhere), so a folded restore drifts
        from it in the last bits and every later flush compounds that; the fold also needs the model's A of
        each Mamba-2 layer, which the cache does not hold, and costs a full state read and write per layer at
        every snapshot. The ring it would save is small next to the checkpoint (per layer at L = 16:
        Nemotron-H-8B's x, B and dt rings 296 KiB next to a 4 MiB fp32 checkpoint, 7%; Qwen3-Next's GDN rings
        516 KiB next to 2 MiB, 25%); the whole ring is carried, dead entries included, so a snapshot is one
        gather per tensor and the restored slot's bytes equal the twin's. ``tests/test_state_lifecycle.py``
        measures the folded alternative: close (1e-7 relative) but not bit-identical.

        ``device``: where the copies go (default host memory). A CUDA cache copies to the host into pinned
        memory asynchronously on the current stream (``pin_memory`` None or True; False: pageable, synchronous)
        and records an event: nothing waits for the device here (no host sync); :meth:`Snapshot.synchronize`
        before reading the values on the host (:meth:`Snapshot.to_bytes` does). Work queued later on the same
        stream (a :meth:`free` + :meth:`allocate` that resets the slot, a restore) is ordered after the copies.
        """
        slots = self._snapshot_slots(slots, "snapshot")
        target = torch.device(device)
        src = self.cursor.device
        pinned = src.type == "cuda" and target.type == "cpu" and pin_memory is not False
        idx = self._slot_index(slots)
        tensors = {}
        for name, t in self._snapshot_tensors():
            g = _raw(t).index_select(0 if name in _PER_SLOT else 1, idx)  # a fresh copy on the cache's device
            if g.device.type != target.type or (target.index is not None and g.device.index != target.index):
                if pinned:
                    host = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                    g = host.copy_(g, non_blocking=True)
                else:
                    g = g.to(target)
            tensors[name] = g.view(t.dtype)
        snap = Snapshot(self.snapshot_header(len(slots)), tensors)
        if pinned:
            snap._ready = torch.cuda.Event()
            snap._ready.record()
        return snap

    def snapshot_mismatch(self, snapshot: Snapshot) -> list[str]:
        """What keeps ``snapshot`` out of this cache, one line per difference (empty: it fits)."""
        if not isinstance(snapshot, Snapshot):
            return [f"expected a Snapshot, got {type(snapshot).__name__}"]
        try:
            snapshot.validate()
        except ValueError as e:
            return [str(e)]
        got, want = snapshot.header, self.snapshot_header(snapshot.num_slots)
        diffs = []
        g_layers = {f: n for f, n in got["layers"].items() if n}
        w_layers = {f: n for f, n in want["layers"].items() if n}
        if g_layers != w_layers:
            order = list(dict.fromkeys([*g_layers, *w_layers]))
            held = " and ".join(f"{g_layers.get(f, 0)} {families.get(f).label}" for f in order)
            kept = " and ".join(str(w_layers.get(f, 0)) for f in order)
            diffs.append(f"layers: the snapshot holds {held} layers, the cache {kept}")
        if got["cursor"] != want["cursor"]:
            diffs.append(f"cursor form: {got['cursor']!r} in the snapshot, {want['cursor']!r} in the cache")
        for key in sorted(set(got["geometry"]) | set(want["geometry"])):
            g, w = got["geometry"].get(key), want["geometry"].get(key)
            if g != w and g is not None and w is not None:  # a family's geometry only where both hold it
                diffs.append(f"{key}: {g} in the snapshot, {w} in the cache")
        if got["shard"] != want["shard"]:
            diffs.append(f"tensor-parallel shard: {got['shard']} in the snapshot, {want['shard']} in the cache")
        if diffs:  # the tensors would differ too; name the cause only
            return diffs
        for name in sorted(set(got["tensors"]) | set(want["tensors"])):
            g, w = got["tensors"].get(name), want["tensors"].get(name)
            if g is None or w is None:
                diffs.append(f"{name}: " + (f"the snapshot has none, the cache keeps {w['dtype']}" if g is None else
                                            f"the snapshot holds {g['dtype']}, the cache keeps none"))
            elif g["dtype"] != w["dtype"]:
                diffs.append(f"{name} dtype: {g['dtype']} in the snapshot, {w['dtype']} in the cache")
            elif g["shape"] != w["shape"]:
                diffs.append(f"{name} shape: {tuple(g['shape'])} in the snapshot, {tuple(w['shape'])} in the cache")
        return diffs

    def _check_snapshot(self, snapshot: Snapshot, what: str) -> None:
        diffs = self.snapshot_mismatch(snapshot)
        if diffs:
            raise ValueError(f"{what}: the snapshot does not fit this cache (nothing was written): " + "; ".join(diffs))

    def restore(self, slots, snapshot: Snapshot) -> None:
        """Write ``snapshot`` into the live ``slots`` (row i into ``slots[i]``; any slots, not necessarily the
        ones it was taken from), between steps. Everything is checked first (the snapshot's header and tensors
        against this cache: layers per family, cursor form, geometry, buffer_len, dtypes, shadow, shard; the
        slots: as many as the snapshot holds, distinct, live): a ValueError names what differs and nothing is
        written. Host copies in pinned memory go to a CUDA cache asynchronously (no host sync)."""
        self._check_snapshot(snapshot, "restore")
        slots = self._snapshot_slots(slots, "restore", snapshot.num_slots)
        self._write_slots(slots, snapshot)

    def _write_slots(self, slots: list[int], snapshot: Snapshot) -> None:
        idx = self._slot_index(slots)
        dev = self.cursor.device
        for name, t in self._snapshot_tensors():
            src = snapshot.tensors[name]
            if src.device != dev:
                src = src.to(dev, non_blocking=dev.type == "cuda" and src.is_pinned())
            _raw(t).index_copy_(0 if name in _PER_SLOT else 1, idx, _raw(src))

    def swap_out(self, slots) -> Snapshot:
        """Preemption: :meth:`snapshot` of ``slots`` to host memory (pinned, asynchronous on CUDA), then
        :meth:`free` them. The slots may be allocated again at once: the reset that allocate() does is queued
        behind the copies on the same stream."""
        slots = list(slots)
        snap = self.snapshot(slots, "cpu")
        for s in slots:
            self.free(int(s))
        return snap

    def swap_in(self, slots, snapshot: Snapshot) -> list[int]:
        """Preemption's way back: take free slots (``slots``, or the lowest free ones when None) and
        :meth:`restore` ``snapshot`` into them; returns the slots. Checked before any slot is taken (the
        snapshot against the cache as in :meth:`restore`, the slots free, enough of them): on an error the
        pool is as it was."""
        self._check_snapshot(snapshot, "swap_in")
        n = snapshot.num_slots
        if slots is None:
            if self._step is not None:
                raise RuntimeError("swap_in: a step is open (flush() without commit())")
            if len(self._free) < n:
                raise RuntimeError(f"swap_in: the snapshot holds {n} slots, {len(self._free)} are free")
            slots = sorted(self._free)[:n]
        slots = self._snapshot_slots(slots, "swap_in", n, live=False)
        for s in slots:  # no reset: the restore writes everything the slot owns
            self._free.remove(s)
            self._live.add(s)
        self._write_slots(slots, snapshot)
        return slots

    def _check_live(self, slot: int, what: str) -> None:
        if slot not in self._live:
            raise ValueError(f"{what}: slot {slot} is not allocated (live slots: {self.live_slots})")

    def _rows(self, state_batch_indices, what: str) -> list[int]:
        if not isinstance(state_batch_indices, torch.Tensor) or state_batch_indices.dtype != torch.int32:
            raise TypeError(f"state_batch_indices: expected an int32 tensor, got {state_batch_indices!r}")
        sbi = cursors.rows(state_batch_indices, state_batch_indices.shape[0], self.num_slots)
        for s in sbi:
            if s >= 0:
                self._check_live(s, what)
        return sbi

    def _check_T(self, T: int) -> None:
        if not 1 <= T <= self.num_draft + 1:
            raise ValueError(f"num_tokens: expected 1 <= T <= num_draft + 1 = {self.num_draft + 1}, got {T}")

    def _step_T(self, T: int, what: str) -> set[int]:
        """The layers verified in the step flush() opened, after checking T against it."""
        if self._step is None:
            raise RuntimeError(f"{what}: call flush() first (a step is flush, verify of every layer, commit)")
        if T != self._step[0]:
            raise ValueError(f"{what}: num_tokens T={T} differs from the step's T={self._step[0]} (given to flush)")
        return self._step[1]

    def _dst(self, state_batch_indices) -> torch.Tensor:
        """Slot per row for the gathered conv updates; padding (and out-of-range) rows -> the scratch slot."""
        sbi = state_batch_indices
        return torch.where((sbi >= 0) & (sbi < self.num_slots), sbi, self.num_slots).long()

    # ---- prefill hand-off ------------------------------------------------------------------------------------
    def load_prefill(self, slot: int, layer: int, state: torch.Tensor, conv_state: torch.Tensor | None = None) -> None:
        """Prefill hand-off of layer ``layer``: its final recurrent state (the checkpoint's shape per slot: Mamba-2
        (H, P, N), GDN (HV, V, K), KDA (H, K, V)) becomes the checkpoint (and its shadow), the rings are emptied,
        ``conv_state`` (conv_dim, K - 1) fills the conv window's last columns, the cursor starts again (start = 0,
        count = the slot's :meth:`phase`). Everything is checked before anything is written."""
        self._check_live(slot, "load_prefill")
        g, i = self._locate(layer)
        g.load_state(i, slot, state, conv_state, self.conv_kernel, self.conv_width)
        self._start_cursor(slot)

    def _refresh_shadow(self, layer: int, slot: int) -> None:
        """The shadow of the stored checkpoint, rounded as the kernels' store_shadow (shadow.quantize_shadow)."""
        g, i = self._locate(layer)
        g.refresh_shadow(i, slot)

    def _shadow_view(self, layer: int) -> Shadow | None:
        g, i = self._locate(layer)
        return g.shadow(i)

    # ---- speculative step ----------------------------------------------------------------------------------------
    def flush(self, state_batch_indices, num_tokens: int, A_by_layer=None) -> list[int] | None:
        """Open a step of T tokens: checks T, the rows' slots (unless check_values is off) and, if given, that
        ``A_by_layer`` has one tensor per layer whose step takes an ``A`` (kept for the callers that pass it; each
        verify takes its layer's A). Nothing is written: each layer's verify folds its own checkpoint on the pre-step cursor
        (module docstring) and commit moves the cursor once.

        Returns the slots whose checkpoints this step folds (count + 2T > L) when the executor is the float64
        reference, which reads the host anyway; None on the kernels (nothing is read back from the device).
        """
        self._check_T(num_tokens)
        if A_by_layer is not None:
            n = sum(g.num_layers for g in self.groups if "A" in g.input_names())
            if len(A_by_layer) != n:
                raise ValueError(f"A_by_layer: expected {n} tensors (one per layer whose step takes A), got "
                                 f"{len(A_by_layer)}")
        if self._step is not None and self._step[1]:
            # Those layers already folded their checkpoints and appended the window on the pre-step cursor (or
            # shifted their conv windows): a new step would do it again. Finish the step (commit) or reset the
            # slots it touched.
            raise RuntimeError(f"flush: the open step already verified layers {sorted(self._step[1], key=str)} "
                               "(their checkpoints hold this step's fold, their conv windows its inputs); commit "
                               "it, or abort_step() and reset its slots, before opening another")
        rows = self._rows(state_batch_indices, "flush") if self._checking() else None
        self._step = (num_tokens, set())
        self._ordered.clear()
        if self.uses_kernels:
            return None
        rows = self._rows(state_batch_indices, "flush") if rows is None else rows
        if self.standard:  # the step that fills the ring folds it
            return [s for s in rows if s >= 0 and int(self.cursor[s]) == self.buffer_len - 1]
        return [s for s in rows if s >= 0 and cursors.needs_flush(self.cursor, s, num_tokens, self.buffer_len)]

    def abort_step(self) -> list:
        """Close an open step without committing it (a layer's verify raised). Returns the layers it verified
        (and ``("conv", l)`` for the conv windows it shifted): their checkpoints may hold the
        step's fold, their rings and windows its inputs while the cursor does not count them, so the step's slots
        must be reset (or prefilled again) before they decode."""
        verified = [] if self._step is None else sorted(self._step[1], key=str)
        self._step = None
        self._ordered.clear()
        return verified

    def _open(self, T: int, state_batch_indices, what: str, key) -> tuple[set, bool]:
        self._check_T(T)
        check = self._checking()
        if check:
            self._rows(state_batch_indices, what)
        done = self._step_T(T, what)
        self._once(done, key, what)
        return done, check

    @staticmethod
    def _once(done: set, key, what: str) -> None:
        """A layer runs once per step: a second verify would fold its checkpoint again on the unmoved cursor (a
        second conv update would shift its window twice)."""
        if key in done:
            raise RuntimeError(f"{what}: layer {key} already ran in this step (again, it would fold its checkpoint "
                               f"or shift its conv window a second time); commit the step first")

    def verify(self, layer: int, *args, **kwargs) -> torch.Tensor:
        """Outputs (batch, T, ...) of the T window tokens of layer ``layer``; appends the window to its rings.

        The arguments are the layer family's step inputs, then ``state_batch_indices``, ``out`` and the family's
        options (:meth:`LayerGroup.signature`): Mamba-2 ``(x, B, C, dt, dt_bias, A, D, z=None, ...)``, GDN
        ``(q, k, v, a, b, A_log, dt_bias, ..., use_qk_l2norm=True, scale=None)``, KDA ``(q, k, v, f, b, A_log,
        dt_bias, ..., use_qk_l2norm=True, scale=None, lower_bound=None)``. Where count + 2T > L on the pre-step
        cursor (standard cursor: the step that fills the ring) the layer's checkpoint (and shadow) is folded first.
        Outputs in the activation dtype (padding rows NaN on the reference), or written into ``out`` (rows with
        a slot)."""
        g, i = self._locate(layer)
        bound = g.bind(args, kwargs, "verify")
        verified, check = self._open(g.window(bound), bound.state_batch_indices, "verify", layer)
        order = self._row_order(g, bound.state_batch_indices, check)
        y = g.step(self.x, g.view(i), self.cursor, bound, standard=self.standard, check=check,
                   read_shadow=self._reads_shadow(), **({} if order is None else {"row_order": order}))
        verified.add(layer)
        return y

    def _row_order(self, g, sbi, check: bool):
        """This step's flush-first row order for group ``g``'s kernels, or None (module docstring, "Row order"):
        launched once a step for the rows ``sbi`` (the first layer that reads it; the cursor does not move before
        commit), kept for the step's other layers."""
        if not (self.uses_kernels and self.standard and g.reads_row_order):
            return None
        batch = sbi.shape[0]
        if not (self.row_order or (self.row_order is None and g.row_order_pays(batch))):
            return None
        if batch not in self._orders:
            self._orders[batch] = torch.empty((batch, cursors.ORDER_COLUMNS), dtype=torch.int32, device=sbi.device)
        if self._ordered.get(batch) != sbi.data_ptr():  # the step's first layer on these rows
            from . import cursor_ops  # cuda.core only where the kernels run

            cursor_ops.flush_order(self.cursor, sbi, self.buffer_len, out=self._orders[batch], check_values=check)
            self._ordered[batch] = sbi.data_ptr()
        return self._orders[batch]

    def _reads_shadow(self) -> bool:
        return self.uses_kernels or self.read_shadow

    def conv_update(self, layer: int, u, weight, bias=None, state_batch_indices=None, activation="silu") -> torch.Tensor:
        """Causal conv of the T window inputs u (batch, T, conv_dim) of layer ``layer`` (any family); shifts them
        into its window.

        Gathered rows (:func:`conv_update_rows`), math in fp32 (float64 for float64 tensors), outputs in u's
        dtype; padding rows NaN and no slot touched. ``conv_window.conv_window_update`` is its spec.
        """
        g, i = self._locate(layer)  # the index checked (a negative one would wrap to another layer's window)
        return self._conv_update(g._conv[i], g.conv_dim, u, weight, bias, state_batch_indices, activation,
                                 ("conv", layer))

    def _conv_update(self, conv_scratch, conv_dim, u, weight, bias, state_batch_indices, activation, key):
        T = u.shape[1]
        self._check_T(T)
        done = None
        if self._step is not None:
            done = self._step_T(T, "conv_update")
            self._once(done, key, "conv_update")
        if self._checking():
            self._rows(state_batch_indices, "conv_update")
        batch, K = state_batch_indices.shape[0], self.conv_kernel
        cursors.check_shape(u, "u", (batch, T, conv_dim))
        cursors.check_shape(weight, "weight", (conv_dim, K))
        if bias is not None:
            cursors.check_shape(bias, "bias", (conv_dim,))
        if activation not in (None, "silu"):
            raise ValueError(f"activation: expected None or 'silu', got {activation!r}")
        out = conv_update_rows(conv_scratch, u, weight, bias, self._dst(state_batch_indices), K, activation)
        if done is not None:  # the step shifted this window: abort_step reports it, flush() refuses to reopen
            done.add(key)
        return torch.where((state_batch_indices >= 0)[:, None, None], out, float("nan"))

    def commit(self, state_batch_indices, n_accepted, num_tokens: int) -> None:
        """Accept n of T tokens per row: count += n (cursor move), conv windows drop T - n inputs (all layers)."""
        self._check_T(num_tokens)
        want = set(range(self.total_layers))
        missing = sorted(want - self._step_T(num_tokens, "commit"), key=str)
        if missing:
            raise RuntimeError(f"commit: layers {missing} were not verified since flush(); their history would be "
                               f"dropped by the cursor move")
        check = self._checking()
        if n_accepted is None and not self.standard:
            raise TypeError("n_accepted: expected a (batch,) int32 tensor (None only with cursor='standard')")
        if n_accepted is not None:  # metadata only (no host read): both executors take the same tensors
            batch = state_batch_indices.shape[0]
            if not isinstance(n_accepted, torch.Tensor) or n_accepted.dtype != torch.int32:
                raise TypeError(f"n_accepted: expected a ({batch},) int32 tensor, got "
                                f"{n_accepted.dtype if isinstance(n_accepted, torch.Tensor) else type(n_accepted).__name__}")
            if tuple(n_accepted.shape) != (batch,) or n_accepted.device != self.cursor.device:
                raise ValueError(f"n_accepted: expected shape ({batch},) on {self.cursor.device}, got "
                                 f"{tuple(n_accepted.shape)} on {n_accepted.device}")
        if check and n_accepted is not None:
            self._rows(state_batch_indices, "commit")
            # validate every row before mutating anything, so a bad n leaves the cache as it was
            nacc = n_accepted.cpu().tolist()
            for b, s in enumerate(state_batch_indices.cpu().tolist()):
                if s >= 0 and not num_tokens - self.num_draft <= nacc[b] <= num_tokens:
                    raise ValueError(f"n_accepted[{b}]: expected {max(0, num_tokens - self.num_draft)} <= n <= "
                                     f"T={num_tokens} (conv window keeps K-1 inputs), got {nacc[b]}")
        elif check:
            self._rows(state_batch_indices, "commit")
        if self.standard:  # every row accepts its one token: the cursor advances, no conv input is rejected
            flushes = {} if self.ckpt_flushes is None else {"flushes": self.ckpt_flushes}  # counted where it wraps
            self.x.advance_cursor(self.cursor, state_batch_indices, self.buffer_len, check_values=check, **flushes)
            self._step = None
            self._ordered.clear()
            return
        self.x.spec_commit(self.cursor, n_accepted, state_batch_indices, num_tokens, self.buffer_len,
                           check_values=check)
        windows = [w for g in self.groups if g.conv_dim for w in g._conv]
        if windows:  # none with conv_dim=0 (the caller keeps them): no launches on empty tensors
            dst = self._dst(state_batch_indices)
            for conv in windows:  # one layer at a time: the gathered windows stay small
                conv_rollback_rows(conv, n_accepted, num_tokens, dst)
        self._step = None
        self._ordered.clear()

    def committed_state(self, layer: int, slot: int, *args, **kwargs) -> torch.Tensor:
        """Layer ``layer``'s recurrent state after the committed tokens of ``slot``, float64 (the checkpoint's shape),
        e.g. for prefix caching or migration. Between steps only (module docstring). A Mamba-2 layer takes its A
        (the cache does not hold it): ``committed_state(layer, slot, A)``; a KDA layer ``use_qk_l2norm``."""
        g, i = self._locate(layer)
        return g.committed_state(g.view(i), self.cursor, slot, self.standard, *args, **kwargs)

    def bytes_per_slot(self) -> int:
        """Bytes one slot holds across all layers (allocated tensors, cursor included): ``costs.cache_bytes(...)["slot"]``."""
        return sum(t[:, 0].numel() * t.element_size() for t in self._tensors()) + self.cursor[0].numel() * 4


# ---- gathered conv window updates (both executors; device-agnostic torch, no host reads) -----------------------------
def conv_update_rows(conv, u, weight, bias, dst, conv_kernel: int, activation) -> torch.Tensor:
    """``conv_window.conv_window_update`` for all rows at once: gather the rows' windows, compute, scatter.

    conv (slots + 1, conv_dim, W) of one layer, mutated; dst (batch,) int64 slot per row (the scratch
    slot for padding rows); u (batch, T, conv_dim). Returns a contiguous (batch, T, conv_dim) in u's dtype, math in
    fp32 (float64 if any operand is float64).
    """
    W, K, T = conv.shape[2], conv_kernel, u.shape[1]
    ct = torch.promote_types(torch.promote_types(conv.dtype, u.dtype), torch.float32)
    win = conv.index_select(0, dst)  # (batch, conv_dim, W)
    new = u.transpose(1, 2)  # (batch, conv_dim, T)
    seq = torch.cat([win[:, :, W - (K - 1):].to(ct), new.to(ct)], dim=2)  # last K-1 committed inputs, then the window
    o = (seq.unfold(2, K, 1) * weight.to(ct)[None, :, None, :]).sum(-1)  # (batch, conv_dim, T)
    if bias is not None:
        o = o + bias.to(ct)[None, :, None]
    if activation == "silu":
        o = o * torch.sigmoid(o)
    conv.index_copy_(0, dst, torch.cat([win, new.to(conv.dtype)], dim=2)[:, :, T:])
    # contiguous (batch, T, conv_dim) in u's dtype, one copy: callers slice q | k | v or x | B | C from it
    return torch.empty(u.shape, dtype=u.dtype, device=u.device).copy_(o.transpose(1, 2))


def conv_rollback_rows(conv, n_accepted, num_tokens: int, dst) -> None:
    """``conv_window.conv_window_rollback`` for all rows at once: shift each row's window right by T - n
    (n clamped to [0, T]), zero-fill the front. conv (slots + 1, conv_dim, W) of one layer, mutated."""
    W = conv.shape[2]
    r = (num_tokens - n_accepted.clamp(0, num_tokens)).long()  # (batch,)
    win = conv.index_select(0, dst)  # (batch, conv_dim, W)
    src = torch.arange(W, device=conv.device)[None, :] - r[:, None]  # (batch, W): column j takes column j - r
    moved = win.gather(2, src.clamp_min(0)[:, None, :].expand_as(win))
    conv.index_copy_(0, dst, torch.where((src >= 0)[:, None, :], moved, torch.zeros((), dtype=conv.dtype,
                                                                                      device=conv.device)))
