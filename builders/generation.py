# SPDX-License-Identifier: Apache-2.0
"""A generation engine over the captured model step: prompt in, tokens out, in-flight batching on the SSM state.

Route (one engine thread owns the model, the step and every slot; clients only queue and read):

  submit(Request)      checked at once (prompt ids in the vocabulary, max_tokens >= 1, prompt + max_tokens within
                       the KV capacity, sampling parameters in range): a bad request raises :class:`RequestError`
                       before any work; a good one waits in a FIFO queue (more requests than slots wait there).
      |
  admission            between two decode steps (up to ``prefill_chunk`` prompt tokens each time, at least one
                       request), queued requests take the lowest free slots and are prefilled together by the
                       model's own forward (transformers; one batch of at most ``prefill_chunk`` padded tokens,
                       left-padded with an attention mask and positions counted from each prompt's first token,
                       so every prompt ends at the last position; a prompt longer than that alone, in chunks on
                       one cache): each row's K/V, last K-1 conv inputs and final SSM states are handed to its
                       slot (the step's ``load_prefill_row``; ReplaySSM: the checkpoint with an empty ring,
                       ``ReplayStateCache.load_prefill``); its last logits give the first
                       token (streamed at once: the time to first token is one prefill).
      |
  decode step          the model kind's step (:data:`STEPS`, by ``config.model_type``, from the registry of
                       builders/models.py; rows = slots): Nemotron-H / Nemotron 3
                       :class:`~builders.model_step.DecodeStep`, the step every benchmark times; Qwen3-Next / Qwen3.5
                       :class:`~builders.qwen_step.QwenStep`; Kimi-Linear :class:`~builders.kimi_step.KimiStep`. The
                       smallest prefix of rows
                       that holds every live slot (``step.rows``; one CUDA graph per prefix of 1, 2, 4, ... rows,
                       captured at start, where the step is ``capturable``; else eager) runs one token for all of
                       them; rows of free slots are padding rows (``sbi = -1``: no SSM state touched). Greedy rows
                       take the step's argmax; sampled rows (temperature > 0) are drawn on the device from the
                       step's logits (:func:`sample`: top-k, top-p, Gumbel noise from a counter-based hash of
                       (seed, position), so a seeded request gives the same tokens whatever else is batched).
      |
  outputs              one device-to-host copy of the new tokens per step; each request's callback gets its
                       tokens, then a final output with the finish reason ("stop": a stop token, "length":
                       max_tokens, "cancelled", "error"); a finished, cancelled or failed request frees its slot
                       before the next step, so sequences join and leave between steps.

Prefix cache (opt-in, ``prefix_cache_tokens`` > 0; off by default, the route above unchanged): an LRU of snapshots
of transformers' cache (every layer's conv window, SSM / GDN recurrent state and attention K/V, a deep copy of the
``DynamicCache`` on the engine's device) after a block-aligned prefix of a prompt (``prefix_block`` tokens a
block), with that prefix's last logits, keyed by a chain hash of the prefix's blocks (a block's key hashes its
parent's key and its tokens, so a prompt finds its longest cached prefix block by block; the tokens are compared on
a hit). With the cache on, each request is prefilled alone: the longest cached prefix is copied into a fresh cache
and only the rest is computed (a prompt equal to a cached prefix computes nothing: the entry's logits give the first
token); snapshots are taken at the prompt's longest block-aligned prefix and at the deepest block boundary an
earlier prompt passed too (where prompts branch: a shared system prompt). The budget is in cached prefix tokens
(the sum of the entries' prefix lengths; least recently used entries go first; a prefix longer than the budget is
not kept). Entries stay on the engine's device; an entry's bytes (counted on the snapshot, ``stats``) are per SSM
layer its state (Mamba-2: ``costs.mamba2_state_bytes``; GDN: ``costs.gdn_state_bytes``, in the cache's dtype) plus
the K last conv inputs (transformers keeps K), per attention layer 2 x kv_heads x head_dim x the prefix length in
the cache's dtype, and the prefix's last logits (tests/test_prefix_cache.py checks this for Nemotron-H).
``engine.stats``: prefill_tokens_computed / prefill_tokens_reused, prefix_hits / prefix_misses, prefix_entries,
prefix_cached_tokens, prefix_cache_bytes, prefix_evictions.

Preemption (opt-in, ``preempt=True``; off by default: requests beyond the slots wait in the queue): the engine's slots
have a fixed K/V capacity (``max_seq_len``), so a running request never needs more room; preemption is for admission.
Waiting requests (queued, and swapped out) stand in one line by ticket (taken at submit and again at each swap-out),
and free slots go to the line in order. Before admission, when requests wait and no slot is free, running requests
that have decoded at least ``preempt_quantum`` steps since they last took a slot are swapped out, the longest holder
first, one per waiting request: time-sliced round robin, so a new request's time to first token is bounded by about
one quantum of steps and nobody starves; ``max_swapped_bytes`` (None: no limit) caps the host memory the swapped-out
requests hold (a swap that would pass it is not done: the request waits for a slot freed by a finish). A swap-out is
the step's ``save_slot``: the row's next input, conv windows, the K/V of its ``length`` positions and the SSM mode's
state (ReplaySSM: the cache's ``swap_out``: checkpoint, shadow, rings and cursor as stored, then the cache slot taken
back at once; conventional: the fp32 state) copied to host memory, pinned and asynchronous on CUDA (ordered on the
stream before anything that reuses the slot); the sampling parameters stay on the request and the seeded noise is
keyed by (seed, position), so a swapped request resumes into any free slot (``load_saved``: asynchronous copies back,
K/V past its length zeroed) and continues bit-identically (tests/test_preemption.py: tokens equal a run with enough
slots, greedy and sampled, Nemotron-H and Qwen3.5). Cancelling a swapped-out request drops its host copy at the next
step. ``engine.stats``: preemptions, resumes, swapped_requests, swapped_bytes (now), swapped_bytes_peak,
swap_out_bytes (total); :meth:`Engine.saved_nbytes` is a slot's swap size (the step's ``saved_spec`` + the cache's
``bytes_per_slot``).

Prefill/decode hand-off: ``Request(export=True)`` ends after its prefill (the first token streamed), or
:meth:`Engine.export_request` at the next step boundary (a decoding or swapped-out request), with finish_reason
"exported" and ``Output.state``: the same saved slot as bytes (:func:`export_state`: a versioned, crc-checked frame
with a JSON header of the step's ``slot_geometry`` (family, layer stack, sizes, dtype, SSM mode) and the request
(prompt, tokens generated, length, sampling parameters), the step's tensors as safetensors, the ReplayStateCache
snapshot's own versioned bytes). ``Request(resume_from=state)`` in another engine (another process, other slot counts
and K/V capacity) is checked at submit (the geometry, every tensor's dtype and shape, the snapshot against the cache:
ring length, shadow, cursor form; a RequestError names each difference, nothing is queued), waits in the line like a
swapped-out request and is loaded without a prefill; tokens equal one engine doing both (tests/test_handoff.py, two
processes). The weights are not fingerprinted: a state imported into a model of the same geometry but other weights
decodes without complaint.

Faults: :meth:`Engine.cancel` (or a request's ``is_cancelled`` callable, polled every ``poll_s`` seconds: a
client that went away) frees the slot at the next step; an exception in a step fails the requests of that step
with the error and resets their slots (the engine keeps serving); :meth:`Engine.shutdown` ends every open and
queued request with an error and joins the thread, so a server never hangs on open streams.

SSM modes (``mode``): "conventional" (state read and written every step), "replay" (ReplaySSM, fp32
checkpoint), "replay_bf16" / "replay_fp8" (ReplaySSM with a bf16 / fp8 shadow of the checkpoint that non-flush
steps read; no fp8 shadow for Gated DeltaNet). Nemotron-H and Nemotron 3 (transformers' ``NemotronHForCausalLM``),
Qwen3-Next, Qwen3.5 and Qwen3.5 MoE (``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``);
CPU (eager, the float64 reference for the SSM) or CUDA (kernels; graphs where the step is capturable).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import heapq
import json
import math
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable

import torch

from . import models
from .model_step import Conventional, DecodeStep, Replay
from .models import MODES

FINISH_REASONS = ("stop", "length", "cancelled", "error", "exported")


class RequestError(ValueError):
    """A request that cannot be served; raised by :meth:`Engine.submit` before any work, message for the client."""


def make_ssm(mode: str, buffer_len: int = 16):
    if mode == "conventional":
        return Conventional()
    if mode in ("replay", "replay_bf16", "replay_fp8"):
        return Replay(buffer_len, shadow=None if mode == "replay" else mode.split("_")[1])
    if mode == "replay_ckpt8":  # the 8-bit (fp8-e4m3) checkpoint, stochastic rounding at each flush (issue 38)
        return Replay(buffer_len, checkpoint="fp8")
    raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


# ---- the family's decode step ------------------------------------------------------------------------------------
class NemotronStep(DecodeStep):
    """:class:`~builders.model_step.DecodeStep` (Nemotron-H, Nemotron 3) as the engine takes it: built from the
    engine's mode, capturable in CUDA graphs, and handed row r of transformers' cache after a prefill."""

    capturable = True

    @classmethod
    def for_engine(cls, model, batch: int, kv_len: int, mode: str, buffer_len: int, fuse: bool | None = None):
        return cls(model, batch, kv_len, make_ssm(mode, buffer_len), fuse=fuse)

    def load_prefill_row(self, cache, r: int, row: int, m: int, n: int) -> None:
        """Row ``r`` of transformers' cache after a prefill of ``m`` (left-padded) positions whose last ``n`` are the
        prompt, into row ``row``: the last K-1 conv inputs (transformers keeps the last K, zeros before the first
        input: padding is masked to zero), the prompt's K/V, the final SSM states."""
        conv = {i: cache.get_conv_state(i)[r, :, 1:].transpose(0, 1) for i in self.mamba}  # (K-1, conv_dim)
        k = {i: cache.layers[i].keys[r, :, m - n:] for i in self.attn}
        v = {i: cache.layers[i].values[r, :, m - n:] for i in self.attn}
        ssm = {i: cache.get_recurrent_state(i)[r].float() for i in self.mamba}
        self.load_slot(row, n, conv, k, v, ssm)


# config.model_type -> the step factory (model, batch, kv_len, mode, buffer_len, fuse) of its kind: the registry's
# streaming steps (builders/models.py; this module's NemotronStep, builders/qwen_step.py, builders/kimi_step.py)
STEPS = {t: kind.streaming for kind in models.kinds(streaming=True) for t in kind.model_types}


def make_step(model, batch: int, kv_len: int, mode: str = "replay", buffer_len: int = 16, fuse: bool | None = None):
    """The decode step of ``model``'s kind (:data:`STEPS`, by ``config.model_type``) for ``batch`` slots of
    ``kv_len`` positions in SSM ``mode``; ValueError naming the model type where no step serves it, or the mode where
    the kind's family keeps no such state (``ModelKind.refusal``: no fp8 shadow for Gated DeltaNet, ...)."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in STEPS:
        raise ValueError(f"model: no generation step for model_type {kind!r} (served: {sorted(STEPS)})")
    why = models.by_model_type(kind).refusal(mode)
    if why:
        raise ValueError(f"mode: {mode!r}: {why}")
    return STEPS[kind](model, batch, kv_len, mode, buffer_len, fuse)


@dataclasses.dataclass
class Output:
    """What a request's callback receives: ``token_ids`` new since the last output; ``finished`` on the last one,
    with ``finish_reason`` (one of FINISH_REASONS) and, for "error", ``error``; for "exported", ``state``: the
    request's state as bytes (:func:`export_state`'s form), which ``Request(resume_from=state)`` continues."""

    request_id: str
    token_ids: list
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    state: bytes | None = None


@dataclasses.dataclass
class Request:
    """One generation. ``prompt`` token ids; ``max_tokens`` new tokens at most; ``temperature`` 0 is greedy;
    ``top_k`` 0 and ``top_p`` 1 keep every token; ``seed`` None draws one; generation ends at any of
    ``stop_token_ids`` (the stop token is emitted). ``on_output(Output)`` is called from the engine thread;
    ``is_cancelled()`` (optional) is polled: True ends the request with "cancelled".

    Prefill/decode hand-off (module docstring): ``export`` True ends the request right after its prefill (its first
    token emitted; unless that token already ends it) with finish_reason "exported" and ``Output.state``, the bytes
    of its state; ``resume_from`` (those bytes) continues such a request in this engine, without a prefill: its
    ``prompt`` may be left empty (the state's prompt is taken; a given one must equal it), ``max_tokens`` counts the
    tokens generated before the export too (the output's ``completion_tokens`` is the total), ``seed`` None takes
    the state's seed (so a sampled request continues its own draw); the other sampling parameters and the stop ids
    are this request's."""

    prompt: list
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple = ()
    on_output: Callable[[Output], None] | None = None
    is_cancelled: Callable[[], bool] | None = None
    request_id: str = ""
    export: bool = False
    resume_from: bytes | None = None


@dataclasses.dataclass
class _Saved:
    """A slot's state in host memory (the step's ``save_slot``): ``length`` tokens, the step's tensors, the SSM
    cache's snapshot (ReplaySSM) or None, their bytes."""

    length: int
    tensors: dict
    snapshot: object
    nbytes: int


@dataclasses.dataclass
class _Live:
    req: Request
    slot: int
    generated: int = 0
    cancelled: bool = False
    t_submit: float = 0.0
    ticket: int = 0  # place in the line for a slot: taken at submit and again at each swap-out (round robin)
    length: int = 0  # tokens in the slot's K/V (= the position of its next input)
    entered: int = 0  # engine step at which it last took a slot
    saved: _Saved | None = None  # swapped out (preemption) or imported (resume_from), until it takes a slot
    swapped: bool = False
    export: bool = False


# ---- sampling ---------------------------------------------------------------------------------------------
_M64 = (1 << 64) - 1


def _to_i64(v: int) -> int:
    v &= _M64
    return v - (1 << 64) if v >> 63 else v


_GOLDEN, _MIX1, _MIX2 = _to_i64(0x9E3779B97F4A7C15), _to_i64(0xBF58476D1CE4E5B9), _to_i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) uniforms in (0, 1) from splitmix64 of (seed, position, token): the same on every device
    and batch composition (int64 products wrap, as splitmix64's do)."""
    idx = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    x = seed[:, None] * _GOLDEN + position[:, None] * _MIX1 + (idx[None, :] + 1) * _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    return (_shr(x, 40).to(torch.float64) + 0.5) / float(1 << 24)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Next tokens (rows,) int64 from ``logits`` (rows, vocab): argmax where ``temperature`` <= 0, else the Gumbel-max
    draw from softmax(logits / temperature) restricted to the ``top_k`` largest (0: all) and to the smallest set
    whose probability reaches ``top_p`` (at least one token). Parameters are per row; ``position`` (the token's
    index in its sequence) and ``seed`` key the noise."""
    lg = logits.float()
    greedy = lg.argmax(-1)
    hot = temperature > 0
    if not bool(hot.any()):
        return greedy
    x = lg / temperature.clamp_min(1e-6)[:, None]
    vocab = x.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if bool((k < vocab).any()) or bool((top_p < 1).any()):
        srt, order = x.sort(-1, descending=True)
        rank = torch.arange(vocab, device=x.device)[None, :]
        drop = rank >= k[:, None]
        probs = torch.softmax(srt, -1)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above
        drop |= (before >= top_p[:, None]) & (rank > 0)
        x = x.scatter(1, order, srt.masked_fill(drop, float("-inf")))
    gumbel = -torch.log(-torch.log(uniform_noise(seed, position, vocab))).to(x.dtype)
    drawn = (x + gumbel).argmax(-1)
    return torch.where(hot, drawn, greedy)


# ---- a request's state as bytes (the prefill/decode hand-off) --------------------------------------------------
STATE_MAGIC = b"RSSMREQS"
STATE_FORMAT, STATE_VERSION = "replayssm-request-state", 1
_STATE_PREFIX = struct.Struct("<8sII")  # magic, format version, header length
_STATE_PAYLOAD = struct.Struct("<QIQ")  # step payload length, its crc32, cache snapshot length


def export_state(geometry: dict, request: dict, saved: _Saved) -> bytes:
    """A request's state as bytes, little-endian::

        b"RSSMREQS" | u32 version | u32 header length h | header (JSON, h bytes)
                    | u64 payload length p | u32 crc32 of the payload | u64 snapshot length q
                    | payload (safetensors of the step's tensors, p bytes) | snapshot (ReplayStateCache bytes, q bytes)

    The header: format, version, ``geometry`` (the step's ``slot_geometry``: family, layer stack, sizes, dtype, SSM
    mode), ``request`` (prompt, generated, length, sampling parameters), ``tensors`` (name -> dtype, shape). The
    snapshot is :meth:`~trtllm_replayssm.cache.Snapshot.to_bytes`'s (its own versioned header and crc; absent, q = 0,
    in the conventional mode). safetensors, not pickle, for the reason the snapshot gives: the bytes cross process
    and machine boundaries. A CUDA slot's host copies are waited for here."""
    from trtllm_replayssm.cache import _safetensors

    if any(t.is_pinned() for t in saved.tensors.values()):
        torch.cuda.synchronize()  # the asynchronous copies of save_slot
    tensors = {k: t.contiguous() for k, t in saved.tensors.items()}
    payload = _safetensors().save(tensors)
    snap = b"" if saved.snapshot is None else saved.snapshot.to_bytes()
    head = dict(format=STATE_FORMAT, version=STATE_VERSION, geometry=geometry, request=request,
                tensors={k: dict(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
                         for k, t in tensors.items()})
    hb = json.dumps(head, sort_keys=True).encode()
    return b"".join((_STATE_PREFIX.pack(STATE_MAGIC, STATE_VERSION, len(hb)), hb,
                     _STATE_PAYLOAD.pack(len(payload), zlib.crc32(payload), len(snap)), payload, snap))


def import_state(data) -> tuple:
    """(header, tensors, snapshot or None) from :func:`export_state`'s bytes; ValueError naming what is wrong (magic,
    version, truncation, crc, header, the snapshot's own checks). Whether it fits an engine is the engine's check."""
    from trtllm_replayssm.cache import Snapshot, _safetensors

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"expected bytes (Output.state of an exported request), got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _STATE_PREFIX.size:
        raise ValueError(f"truncated: {len(data)} bytes, shorter than the {_STATE_PREFIX.size}-byte prefix")
    magic, version, hlen = _STATE_PREFIX.unpack_from(data)
    if magic != STATE_MAGIC:
        raise ValueError(f"wrong magic {magic!r}, expected {STATE_MAGIC!r} (not an exported request state)")
    if version != STATE_VERSION:
        raise ValueError(f"format version {version}, this build reads version {STATE_VERSION} only")
    end = _STATE_PREFIX.size + hlen
    if len(data) < end + _STATE_PAYLOAD.size:
        raise ValueError(f"truncated: {len(data)} bytes, the header alone needs {end + _STATE_PAYLOAD.size}")
    try:
        head = json.loads(data[_STATE_PREFIX.size:end].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the header is not valid JSON ({e})") from None
    if not isinstance(head, dict) or head.get("format") != STATE_FORMAT or head.get("version") != STATE_VERSION:
        raise ValueError(f"header: expected format {STATE_FORMAT!r} version {STATE_VERSION}")
    for key in ("geometry", "request", "tensors"):
        if not isinstance(head.get(key), dict):
            raise ValueError(f"header: no {key!r} object")
    plen, crc, qlen = _STATE_PAYLOAD.unpack_from(data, end)
    body = data[end + _STATE_PAYLOAD.size:]
    if len(body) != plen + qlen:
        raise ValueError(f"{'truncated' if len(body) < plen + qlen else 'overlong'}: {len(body)} bytes after the "
                         f"header, expected {plen} + {qlen}")
    payload, snap = body[:plen], body[plen:]
    if zlib.crc32(payload) != crc:
        raise ValueError(f"payload crc32 {zlib.crc32(payload):#010x}, the header says {crc:#010x} (corrupted)")
    try:
        tensors = _safetensors().load(payload)
    except Exception as e:  # safetensors' own error type
        raise ValueError(f"the payload is not a valid safetensors blob ({e})") from None
    for k, t in tensors.items():
        want = head["tensors"].get(k)
        got = dict(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
        if want != got:
            raise ValueError(f"tensor {k}: {got}, the header says {want}")
    if set(head["tensors"]) != set(tensors):
        raise ValueError(f"tensors: the header names {sorted(head['tensors'])}, the payload holds {sorted(tensors)}")
    return head, tensors, (Snapshot.from_bytes(snap) if qlen else None)


# ---- the engine ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _PrefixEntry:
    tokens: tuple  # the prefix's token ids (checked on a hit: the key is a hash)
    cache: object  # transformers' DynamicCache after the prefix (one row), never run on: hits copy it
    logits: torch.Tensor  # (1, vocab) the prefix's last logits (a prompt equal to the prefix computes nothing)
    nbytes: int


def _nbytes(obj, seen=None) -> int:
    """Bytes of the tensors reachable from ``obj`` through attributes, lists, tuples and dicts (each counted once)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(_nbytes(v, seen) for v in vars(obj).values())
    return 0


def block_keys(prompt, block: int) -> list:
    """Chain keys of the full ``block``-token blocks of ``prompt``: key j hashes key j-1 and block j's tokens."""
    keys, key = [], 0
    for a in range(0, len(prompt) - block + 1, block):
        key = hash((key, tuple(prompt[a:a + block])))
        keys.append(key)
    return keys


def _buckets(n: int) -> list[int]:
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= 2
    return out + [n]


class Engine:
    """In-flight batching over one decode step of ``max_slots`` rows (module docstring).

    ``model``: a loaded model of a family in :data:`STEPS` (its device and dtype are the engine's; the step is
    :func:`make_step`'s); ``max_seq_len``: K/V positions per slot (prompt + max_tokens must fit); ``mode`` one of
    MODES (the step refuses one it cannot run); ``cuda_graphs`` (default: on CUDA) captures one graph per row prefix
    at start, where the step is capturable (``step.capturable``; otherwise it runs eagerly); ``start()`` runs the
    engine thread (``step_once()`` drives it by hand, e.g. in tests). ``prefix_cache_tokens`` > 0 turns the prefix
    cache on with that budget in cached prefix tokens, snapshots at multiples of ``prefix_block`` (module docstring).
    ``preempt`` True lets waiting requests take the slot of one that has decoded ``preempt_quantum`` steps since it
    took it, swapped out to host memory (at most ``max_swapped_bytes`` held, None: no limit; module docstring)."""

    def __init__(self, model, max_slots: int = 8, max_seq_len: int = 1024, mode: str = "replay",
                 buffer_len: int = 16, cuda_graphs: bool | None = None, prefill_chunk: int = 2048,
                 poll_s: float = 0.05, fuse: bool | None = None, prefix_cache_tokens: int = 0,
                 prefix_block: int = 16, preempt: bool = False, preempt_quantum: int = 16,
                 max_swapped_bytes: int | None = None):
        for name, v, lo in (("max_slots", max_slots, 1), ("max_seq_len", max_seq_len, 2), ("prefill_chunk", prefill_chunk, 1),
                            ("prefix_cache_tokens", prefix_cache_tokens, 0), ("prefix_block", prefix_block, 1),
                            ("preempt_quantum", preempt_quantum, 1),
                            *((("max_swapped_bytes", max_swapped_bytes, 0),) if max_swapped_bytes is not None else ())):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
        if not isinstance(preempt, bool):
            raise ValueError(f"preempt: expected True or False, got {preempt!r}")
        self.model, self.mode = model, mode
        self.cfg = model.config
        # a composite (vision-language) config keeps the vocabulary in its text config (GLM-5 Next, Qwen3.5 wrappers)
        self.vocab = self.cfg.get_text_config().vocab_size if hasattr(self.cfg, "get_text_config") else \
            self.cfg.vocab_size
        self.max_slots, self.max_seq_len, self.prefill_chunk, self.poll_s = max_slots, max_seq_len, prefill_chunk, poll_s
        self.step = make_step(model, max_slots, max_seq_len, mode, buffer_len, fuse)
        self.device = self.step.device
        cuda = self.device.type == "cuda"
        self.cuda_graphs = cuda if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not cuda:
            raise ValueError(f"cuda_graphs: the model is on {self.device}, graphs need CUDA")
        self.cuda_graphs = self.cuda_graphs and self.step.capturable  # a step that cannot be captured runs eagerly
        dev = self.device
        # per-slot sampling parameters, read by sample() for the rows of a step
        self.temperature = torch.zeros(max_slots, device=dev)
        self.top_k = torch.zeros(max_slots, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(max_slots, device=dev)
        self.seed = torch.zeros(max_slots, dtype=torch.int64, device=dev)
        self.step.sbi.fill_(-1)  # every row a padding row until a request takes its slot
        self.views = {n: self.step.rows(n) for n in _buckets(max_slots)}
        self.graphs = {}
        if self.cuda_graphs:
            self._capture()
        self.free = list(range(max_slots))  # a heap: the lowest free slot first, so live rows stay a short prefix
        self.live: dict[int, _Live] = {}
        self.queue: collections.deque = collections.deque()
        self.open: dict[str, _Live] = {}  # request id -> every request not yet finished (under ``lock``)
        self.lock = threading.RLock()  # _emit (final) takes it, also under step_once's hold
        self.wake = threading.Condition(self.lock)
        self.thread = None
        self.closed = False
        self.failed: str | None = None
        self.steps = 0
        self._next_id = 0
        self._last_poll = 0.0
        self.prefix_cache_tokens, self.prefix_block = prefix_cache_tokens, prefix_block
        self._prefix: collections.OrderedDict = collections.OrderedDict()  # chain key -> _PrefixEntry, LRU first
        self._seen: collections.OrderedDict = collections.OrderedDict()  # chain keys prompts passed (branch points)
        self.preempt, self.preempt_quantum, self.max_swapped_bytes = preempt, preempt_quantum, max_swapped_bytes
        self.swapped: collections.deque = collections.deque()  # swapped-out requests, in line order (tickets)
        self._tickets = 0
        self.stats = dict(prefill_tokens_computed=0, prefill_tokens_reused=0, prefix_hits=0, prefix_misses=0,
                          prefix_entries=0, prefix_cached_tokens=0, prefix_cache_bytes=0, prefix_evictions=0,
                          preemptions=0, resumes=0, swapped_requests=0, swapped_bytes=0, swapped_bytes_peak=0,
                          swap_out_bytes=0, exports=0, export_bytes=0, imports=0)

    # ---- graphs ---------------------------------------------------------------------------------------
    def _capture(self) -> None:
        from trtllm_replayssm import timing

        step = self.step
        for n, view in self.views.items():  # every row padding: the warm-up and the capture touch no SSM state
            self.graphs[n] = timing.capture(view, lambda: None, True)
        step.lengths.zero_()  # the warm-up steps advanced every row's length
        step.ids.zero_()

    def _run_step(self, n: int) -> None:
        if self.cuda_graphs:
            self.graphs[n][0]()
        else:
            self.views[n]()

    # ---- client side (any thread) -----------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Raise :class:`RequestError` naming the field if ``req`` cannot be served."""
        p = req.prompt
        if not isinstance(p, (list, tuple)) or not p:
            raise RequestError("prompt: expected a non-empty list of token ids")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab for t in p):
            bad = next(t for t in p if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab)
            raise RequestError(f"prompt: token ids must be ints in 0..{self.vocab - 1}, got {bad!r}")
        if isinstance(req.max_tokens, bool) or not isinstance(req.max_tokens, int) or req.max_tokens < 1:
            raise RequestError(f"max_tokens: expected an int >= 1, got {req.max_tokens!r}")
        if len(p) + req.max_tokens > self.max_seq_len:
            raise RequestError(f"prompt + max_tokens: {len(p)} + {req.max_tokens} = {len(p) + req.max_tokens} tokens "
                               f"exceed the KV capacity of {self.max_seq_len} per sequence")
        if not (isinstance(req.temperature, (int, float)) and 0 <= req.temperature < float("inf")):
            raise RequestError(f"temperature: expected a finite number >= 0, got {req.temperature!r}")
        if isinstance(req.top_k, bool) or not isinstance(req.top_k, int) or req.top_k < 0:
            raise RequestError(f"top_k: expected an int >= 0 (0: no limit), got {req.top_k!r}")
        if not (isinstance(req.top_p, (int, float)) and 0 < req.top_p <= 1):
            raise RequestError(f"top_p: expected a number in (0, 1], got {req.top_p!r}")
        if req.seed is not None and (isinstance(req.seed, bool) or not isinstance(req.seed, int)):
            raise RequestError(f"seed: expected an int or None, got {req.seed!r}")
        for t in req.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise RequestError(f"stop_token_ids: expected ints, got {t!r}")
        if not isinstance(req.export, bool):
            raise RequestError(f"export: expected True or False, got {req.export!r}")

    def _import(self, req: Request) -> tuple:
        """``req.resume_from`` checked against this engine (the state's bytes, its geometry against the step's, its
        tensors against the step's ``saved_spec``, its cache snapshot against the cache; the request against the
        state); fills an empty prompt and a None seed from the state. RequestError naming every difference."""
        try:
            head, tensors, snap = import_state(req.resume_from)
        except ValueError as e:
            raise RequestError(f"resume_from: {e}") from None
        geo, got = self.step.slot_geometry(), head["geometry"]
        diffs = [f"{k}: {got.get(k)!r} in the state, {geo.get(k)!r} in this engine" for k in sorted(set(geo) | set(got))
                 if got.get(k) != geo.get(k)]
        if diffs:
            raise RequestError("resume_from: the state does not fit this engine (" + "; ".join(diffs) + ")")
        r = head["request"]
        try:
            length, generated, prompt = int(r["length"]), int(r["generated"]), list(r["prompt"])
        except (KeyError, TypeError, ValueError) as e:
            raise RequestError(f"resume_from: the header's request is incomplete ({e})") from None
        want = {k: (str(d).removeprefix("torch."), list(sh)) for k, (d, sh) in self.step.saved_spec(length).items()}
        have = {k: (str(t.dtype).removeprefix("torch."), list(t.shape)) for k, t in tensors.items()}
        diffs = [f"{k}: {have.get(k)} in the state, {want.get(k)} expected" for k in sorted(set(want) | set(have))
                 if have.get(k) != want.get(k)]
        diffs += self.step.ssm.snapshot_mismatch(snap)
        if diffs:
            raise RequestError("resume_from: the state does not fit this engine (" + "; ".join(diffs) + ")")
        if not req.prompt:
            req.prompt = prompt
        elif list(req.prompt) != prompt:
            raise RequestError(f"prompt: differs from the exported request's prompt ({len(prompt)} tokens); leave it "
                               "empty to take the state's")
        if isinstance(req.max_tokens, int) and not isinstance(req.max_tokens, bool) and req.max_tokens <= generated:
            raise RequestError(f"max_tokens: {req.max_tokens}, but the exported request has generated {generated} "
                               "tokens already (max_tokens counts them)")
        if length != len(prompt) + generated - 1:
            raise RequestError(f"resume_from: length {length} != prompt {len(prompt)} + generated {generated} - 1")
        if req.seed is None and r.get("seed") is not None:
            req.seed = int(r["seed"])
        nbytes = sum(t.nelement() * t.element_size() for t in tensors.values()) + (0 if snap is None else snap.nbytes)
        return _Saved(length, tensors, snap, nbytes), generated

    def submit(self, req: Request) -> str:
        """Check ``req`` and queue it; returns its request id. Raises :class:`RequestError` (nothing queued)."""
        saved, generated = self._import(req) if req.resume_from is not None else (None, 0)
        self.check(req)
        with self.lock:
            if self.closed:
                raise RequestError("the engine is shutting down")
            if self.failed is not None:
                raise RequestError(f"the engine failed: {self.failed}")
            if not req.request_id:
                self._next_id += 1
                req.request_id = f"req-{self._next_id}"
            if req.seed is None:
                req.seed = int.from_bytes(os.urandom(7), "little")
            if req.request_id in self.open:
                raise RequestError(f"request_id: {req.request_id!r} is already open")
            self._tickets += 1
            live = _Live(req, -1, generated=generated, t_submit=time.perf_counter(), ticket=self._tickets,
                         saved=saved, export=bool(req.export))
            self.open[req.request_id] = live
            self.queue.append(live)
            self.wake.notify()
        return req.request_id

    def cancel(self, request_id: str) -> bool:
        """Mark a queued or live request cancelled (it ends, its slot freed, at the next step); False if unknown."""
        with self.lock:
            live = self.open.get(request_id)
            if live is None:
                return False
            live.cancelled = True
            self.wake.notify()
            return True

    def export_request(self, request_id: str) -> bool:
        """Export an open request at the next step boundary (a live or swapped-out one at once, a queued one after
        its prefill): it ends with finish_reason "exported" and ``Output.state`` (the bytes ``Request(resume_from=)``
        continues, here or in another process). False if unknown."""
        with self.lock:
            live = self.open.get(request_id)
            if live is None:
                return False
            live.export = True
            self.wake.notify()
            return True

    def pending(self) -> int:
        with self.lock:
            return len(self.live) + len(self.queue) + len(self.swapped)

    # ---- engine side ----------------------------------------------------------------------------------
    def _emit(self, live: _Live, tokens: list, reason: str | None = None, error: str | None = None,
              state: bytes | None = None) -> None:
        if reason is not None:
            with self.lock:
                self.open.pop(live.req.request_id, None)
        cb = live.req.on_output
        if cb is None:
            return
        try:
            cb(Output(live.req.request_id, tokens, reason is not None, reason, len(live.req.prompt), live.generated,
                      error, state))
        except Exception:  # a client callback must never take the engine down
            live.cancelled = True

    def _finish(self, live: _Live, tokens: list, reason: str, error: str | None = None,
                state: bytes | None = None) -> None:
        self._emit(live, tokens, reason, error, state)
        if live.swapped:
            self._unswap(live)
        if live.slot >= 0:
            self.step.sbi[live.slot] = -1
            self.live.pop(live.slot, None)
            heapq.heappush(self.free, live.slot)
            live.slot = -1

    def _poll_cancelled(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last_poll < self.poll_s:
            return
        self._last_poll = now
        for live in list(self.live.values()) + list(self.queue) + list(self.swapped):
            if not live.cancelled and live.req.is_cancelled is not None:
                try:
                    live.cancelled = bool(live.req.is_cancelled())
                except Exception:
                    live.cancelled = True

    def _reap_cancelled(self) -> None:
        for live in [v for v in self.live.values() if v.cancelled]:
            self._finish(live, [], "cancelled")
        for live in [v for v in self.swapped if v.cancelled]:  # its host copy is dropped
            self._finish(live, [], "cancelled")
        for live in [v for v in (*self.live.values(), *self.swapped) if v.export]:
            self._export(live)
        kept = collections.deque()
        for live in self.queue:
            if live.cancelled:
                self._emit(live, [], "cancelled")
            else:
                kept.append(live)
        self.queue = kept

    @torch.no_grad()
    def _prefill(self, lives: list) -> list:
        """The model's own forward over the prompts of ``lives`` (one batch, left-padded with an attention mask, so
        every prompt ends at the last position; a lone prompt longer than ``prefill_chunk`` in chunks on one cache),
        each handed to its slot; returns the first tokens."""
        from transformers import DynamicCache

        dev = self.device
        lens = [len(v.req.prompt) for v in lives]
        m, b = max(lens), len(lives)
        if self.prefix_cache_tokens:  # one request a group (_admit)
            cache, logits = self._prefill_cached(list(lives[0].req.prompt))
            return self._hand_off(lives, lens, m, cache, logits)
        self.stats["prefill_tokens_computed"] += sum(lens)
        ids = torch.zeros(b, m, dtype=torch.int64)
        mask = torch.zeros(b, m, dtype=torch.int64)
        for r, v in enumerate(lives):
            ids[r, m - lens[r]:] = torch.tensor(v.req.prompt)
            mask[r, m - lens[r]:] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        cache = DynamicCache(config=self.cfg)
        logits = None
        for a in range(0, m, self.prefill_chunk):  # b > 1 only when b * m <= prefill_chunk: one pass
            # left padding: positions count the prompt's own tokens (what generate passes; RoPE models need it)
            kw = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)) if b > 1 else {}
            logits = self.model(input_ids=ids[:, a:a + self.prefill_chunk], cache=cache, use_cache=True,
                                logits_to_keep=1, **kw).logits[:, -1]
        return self._hand_off(lives, lens, m, cache, logits)

    def _hand_off(self, lives: list, lens: list, m: int, cache, logits: torch.Tensor) -> list:
        """Each row of ``cache`` to its request's slot, the sampling parameters set; returns the first tokens."""
        step, dev = self.step, self.device
        slots = torch.tensor([v.slot for v in lives], device=dev)
        for r, (v, n) in enumerate(zip(lives, lens)):
            step.load_prefill_row(cache, r, v.slot, m, n)  # the family's hand-off (its step class)
            self._set_sampling(v.slot, v.req)
        first = sample(logits, self.temperature[slots], self.top_k[slots], self.top_p[slots], self.seed[slots],
                       torch.tensor(lens, device=dev))
        step.ids[slots] = first
        step.sbi[slots] = slots.to(step.sbi.dtype)
        return first.tolist()

    def _set_sampling(self, slot: int, req: Request) -> None:
        self.temperature[slot] = float(req.temperature)
        self.top_k[slot] = req.top_k
        self.top_p[slot] = float(req.top_p)
        self.seed[slot] = _to_i64(req.seed)

    # ---- preemption and the hand-off (module docstring) -------------------------------------------------------
    def _save(self, live: _Live) -> _Saved:
        """The live request's slot in host memory (the step's ``save_slot``); the slot freed (a padding row)."""
        slot = live.slot
        tensors, snap = self.step.save_slot(slot, live.length)
        nbytes = sum(t.nelement() * t.element_size() for t in tensors.values()) + (0 if snap is None else snap.nbytes)
        self.step.sbi[slot] = -1
        self.live.pop(slot, None)
        heapq.heappush(self.free, slot)
        live.slot = -1
        return _Saved(live.length, tensors, snap, nbytes)

    def saved_nbytes(self, length: int) -> int:
        """Host bytes of a slot of ``length`` tokens swapped out or exported (the tensors of the step's ``saved_spec``
        and the SSM cache's snapshot, ``ReplayStateCache.bytes_per_slot``)."""
        n = sum(torch.empty((), dtype=dt).element_size() * math.prod(sh)
                for dt, sh in self.step.saved_spec(length).values())
        return n + self.step.ssm.snapshot_nbytes()

    def _swap_out(self, live: _Live) -> None:
        st = self.stats
        live.saved = self._save(live)
        live.swapped = True
        with self.lock:
            self._tickets += 1
            live.ticket = self._tickets  # the back of the line
        self.swapped.append(live)
        st["preemptions"] += 1
        st["swapped_requests"] += 1
        st["swapped_bytes"] += live.saved.nbytes
        st["swap_out_bytes"] += live.saved.nbytes
        st["swapped_bytes_peak"] = max(st["swapped_bytes_peak"], st["swapped_bytes"])

    def _unswap(self, live: _Live) -> None:
        """A swapped-out request leaves the swapped set (resumed, cancelled, exported, failed): its host copy goes."""
        st = self.stats
        self.swapped.remove(live)
        st["swapped_requests"] -= 1
        st["swapped_bytes"] -= live.saved.nbytes
        live.swapped = False
        live.saved = None

    def _swap_in(self, live: _Live, slot: int) -> None:
        """A swapped-out or imported request into the free ``slot`` (taken off the heap by the caller)."""
        saved, swapped = live.saved, live.swapped
        try:
            self.step.load_saved(slot, saved.length, saved.tensors, saved.snapshot)
        except BaseException:
            heapq.heappush(self.free, slot)
            raise
        if swapped:
            self._unswap(live)
            self.stats["resumes"] += 1
        else:
            self.stats["imports"] += 1
        live.saved = None
        self._set_sampling(slot, live.req)
        self.step.sbi[slot] = slot
        live.slot, live.length, live.entered = slot, saved.length, self.steps
        self.live[slot] = live

    def _export(self, live: _Live) -> None:
        """End ``live`` (live or swapped out) with "exported" and its state's bytes (:func:`export_state`)."""
        try:
            saved = live.saved if live.slot < 0 else self._save(live)
            req = live.req
            meta = dict(prompt=list(req.prompt), generated=live.generated, length=saved.length,
                        temperature=float(req.temperature), top_k=req.top_k, top_p=float(req.top_p), seed=req.seed,
                        request_id=req.request_id)
            data = export_state(self.step.slot_geometry(), meta, saved)
        except Exception as e:  # the request fails, the engine goes on
            self._finish(live, [], "error", f"export failed: {type(e).__name__}: {e}")
            return
        self.stats["exports"] += 1
        self.stats["export_bytes"] += len(data)
        self._finish(live, [], "exported", state=data)

    def _preempt(self) -> None:
        """Swap out as many running requests as there are waiting ones without a free slot: those that have decoded at
        least ``preempt_quantum`` steps since they took their slot, the longest holder first, while the host copies
        stay within ``max_swapped_bytes``."""
        with self.lock:
            waiting = sum(1 for v in self.queue if not v.cancelled)
        need = waiting + len(self.swapped) - len(self.free)
        if need <= 0:
            return
        ripe = sorted((v for v in self.live.values() if not v.cancelled and not v.export
                       and self.steps - v.entered >= self.preempt_quantum), key=lambda v: (v.entered, -v.slot))
        for v in ripe[:need]:
            if (self.max_swapped_bytes is not None
                    and self.stats["swapped_bytes"] + self.saved_nbytes(v.length) > self.max_swapped_bytes):
                return
            self._swap_out(v)

    # ---- the prefix cache (module docstring) ------------------------------------------------------------------
    def _prefill_cached(self, prompt: list):
        """One prompt's prefill through the prefix cache: (transformers' cache after the prompt, last logits (1, vocab)).
        Copies the longest cached prefix, computes the rest (chunks of ``prefill_chunk``, cut at the snapshot points),
        keeps the snapshots."""
        from transformers import DynamicCache

        n, blk, st = len(prompt), self.prefix_block, self.stats
        keys = block_keys(prompt, blk)
        hit = 0
        for j in range(len(keys), 0, -1):
            e = self._prefix.get(keys[j - 1])
            if e is not None and e.tokens == tuple(prompt[:j * blk]):
                hit = j
                break
        if hit:
            e = self._prefix[keys[hit - 1]]
            self._prefix.move_to_end(keys[hit - 1])
            cache, logits = copy.deepcopy(e.cache), e.logits
            st["prefix_hits"] += 1
        else:
            cache, logits = DynamicCache(config=self.cfg), None
            st["prefix_misses"] += 1
        st["prefill_tokens_reused"] += hit * blk
        st["prefill_tokens_computed"] += n - hit * blk
        # snapshots: the longest block-aligned prefix, and the deepest boundary an earlier prompt passed (a branch)
        snaps = {len(keys)}
        snaps |= {next((j for j in range(len(keys), hit, -1) if keys[j - 1] in self._seen), 0)}
        snaps = {j for j in snaps if j > hit and j * blk <= self.prefix_cache_tokens}
        for k in keys:
            self._seen[k] = None
            self._seen.move_to_end(k)
        while len(self._seen) > 1 << 16:
            self._seen.popitem(last=False)
        cuts = sorted({j * blk for j in snaps} | set(range(hit * blk, n, self.prefill_chunk)) | {n})
        ids = torch.tensor([prompt], dtype=torch.int64, device=self.device)
        a = hit * blk
        for b in cuts:
            if b <= a:
                continue
            logits = self.model(input_ids=ids[:, a:b], cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            a = b
            if b % blk == 0 and b // blk in snaps:
                self._store(keys[b // blk - 1], tuple(prompt[:b]), cache, logits)
        return cache, logits

    def _store(self, key, tokens: tuple, cache, logits: torch.Tensor) -> None:
        st = self.stats
        if key in self._prefix:
            self._prefix.move_to_end(key)
            return
        snap = copy.deepcopy(cache)
        e = _PrefixEntry(tokens, snap, logits.clone(), _nbytes(snap) + logits.nelement() * logits.element_size())
        self._prefix[key] = e
        st["prefix_entries"] += 1
        st["prefix_cached_tokens"] += len(tokens)
        st["prefix_cache_bytes"] += e.nbytes
        while st["prefix_cached_tokens"] > self.prefix_cache_tokens:
            _, old = self._prefix.popitem(last=False)
            st["prefix_entries"] -= 1
            st["prefix_cached_tokens"] -= len(old.tokens)
            st["prefix_cache_bytes"] -= old.nbytes
            st["prefix_evictions"] += 1

    def _admit(self) -> None:
        """Give free slots to waiting requests in line order (tickets: submit, or the last swap-out): a swapped-out
        or imported request is loaded back (no compute); queued ones are prefilled in batches of at most
        ``prefill_chunk`` (padded) prompt tokens, up to ``prefill_chunk`` prompt tokens per decode step (at least one
        request), so streams already decoding keep their pace while many join. With ``preempt``, running requests
        make room first (:meth:`_preempt`)."""
        if self.preempt:
            self._preempt()
        budget = self.prefill_chunk
        while self.free:
            sw = self.swapped[0] if self.swapped else None
            with self.lock:
                head = self.queue[0] if self.queue else None
                if head is not None and head.saved is not None and (sw is None or head.ticket < sw.ticket):
                    self.queue.popleft()  # an imported request: loaded, not prefilled
                    sw = head
            if sw is not None and (head is None or sw is head or sw.ticket < head.ticket):
                if sw.cancelled:
                    self._finish(sw, [], "cancelled")
                    continue
                try:
                    self._swap_in(sw, heapq.heappop(self.free))
                except Exception as e:  # this request fails; the slot is free again, the engine goes on
                    self._finish(sw, [], "error", f"resume failed: {type(e).__name__}: {e}")
                continue
            if budget <= 0:
                return
            group: list = []
            with self.lock:
                while self.queue and len(group) < len(self.free) and budget > 0:
                    nxt = self.queue[0]
                    if nxt.saved is not None or (sw is not None and sw.ticket < nxt.ticket):
                        break
                    m = max([len(nxt.req.prompt)] + [len(v.req.prompt) for v in group])
                    if group and ((len(group) + 1) * m > self.prefill_chunk or self.prefix_cache_tokens):
                        break  # with the prefix cache on, each request is prefilled alone
                    self.queue.popleft()
                    budget -= len(nxt.req.prompt)
                    group.append(nxt)
            if not group:
                return
            live = [v for v in group if not v.cancelled]
            for v in group:
                if v.cancelled:
                    self._emit(v, [], "cancelled")
            for v in live:
                v.slot = heapq.heappop(self.free)
                self.live[v.slot] = v
            if not live:
                continue
            try:
                toks = self._prefill(live)
            except Exception as e:  # these requests fail; their slots are free again, the engine goes on
                for v in live:
                    self._finish(v, [], "error", f"prefill failed: {type(e).__name__}: {e}")
                continue
            for v, tok in zip(live, toks):
                v.length, v.entered = len(v.req.prompt), self.steps
                self._deliver(v, tok)
                if v.slot >= 0 and v.export:
                    self._export(v)

    def _deliver(self, live: _Live, tok: int) -> None:
        live.generated += 1
        req = live.req
        if tok in req.stop_token_ids:
            self._finish(live, [tok], "stop")
        elif live.generated >= req.max_tokens:
            self._finish(live, [tok], "length")
        elif live.cancelled:
            self._finish(live, [tok], "cancelled")
        else:
            self._emit(live, [tok])

    @torch.no_grad()
    def step_once(self) -> bool:
        """Admit what fits, then one decode step for every live slot; False when there was nothing to do."""
        self._poll_cancelled()
        with self.lock:
            self._reap_cancelled()
        self._admit()
        if not self.live:
            return False
        n = next(b for b in self.views if b > max(self.live))
        view = self.views[n]
        try:
            self._run_step(n)
            rows = sorted(self.live)
            if bool((self.temperature[:n] > 0).any()):
                toks = sample(view.logits, self.temperature[:n], self.top_k[:n], self.top_p[:n], self.seed[:n],
                              view.lengths)
                toks = torch.where(view.sbi >= 0, toks, view.ids)
                view.ids.copy_(toks)
            out = view.ids.tolist()
        except Exception as e:  # the step's requests fail, their slots are reset; the engine keeps serving
            msg = f"decode step failed: {type(e).__name__}: {e}"
            for live in list(self.live.values()):
                self._finish(live, [], "error", msg)
            return True
        self.steps += 1
        for r in rows:
            self.live[r].length += 1
            self._deliver(self.live[r], out[r])
        return True

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.closed and not self.live and not self.queue and not self.swapped:
                    self.wake.wait(self.poll_s)
                    if self.queue or self.closed:
                        break
                    self._poll_cancelled(force=True)
                if self.closed:
                    return
            try:
                self.step_once()
            except Exception as e:  # an engine bug: fail everything open, refuse new work, never hang
                self._fail_all(f"engine error: {type(e).__name__}: {e}")
                with self.lock:
                    self.failed = str(e)
                return

    def _fail_all(self, msg: str) -> None:
        with self.lock:
            queued, self.queue = list(self.queue), collections.deque()
        for live in list(self.live.values()) + list(self.swapped):
            self._finish(live, [], "error", msg)
        for live in queued:
            self._emit(live, [], "error", msg)

    def start(self) -> Engine:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="replayssm-engine", daemon=True)
            self.thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine: every open or queued request ends with an error, the thread is joined."""
        with self.lock:
            self.closed = True
            self.wake.notify_all()
        if self.thread is not None:
            self.thread.join(timeout)
        self._fail_all("the server is shutting down")

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Drive the engine on this thread until nothing is queued or live (tests, the in-process benchmark)."""
        for _ in range(max_steps):
            if not self.step_once() and not self.queue and not self.swapped:
                return
        raise RuntimeError(f"run_until_idle: still busy after {max_steps} steps")
