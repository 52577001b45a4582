# SPDX-License-Identifier: Apache-2.0
"""The cursor rules every family shares: row checks, the standard cursor's move, the ring cursor's flush and commit.

Host-side bookkeeping in plain torch (ints, any device), the spec the cursor kernels (:mod:`.cursor_ops`) and every
family's reference (``families/<name>/reference.py``, ``spec_reference.py``) follow; the forms themselves are
described once in :mod:`.contract`.

Rows: ``state_batch_indices`` (batch,) int32, the slot of each row, -1 a padding row (never touched); no slot
twice (:func:`rows`).

Standard cursor (one token per step): ``cursor`` (S,) int32, the number of entries already in the ring
(0..L-1); the step does not move it, :func:`advance_cursor` does, once per model step for all layers:
c <- (c + 1) mod L (the step that sees c = L - 1 flushes the ring into the checkpoint).

Ring cursor (speculative decoding, T = 1 + num_draft tokens a window; :mod:`.families.mamba2.spec_reference`'s
docstring has the full account): ``cursor`` (S, 2) int32, [s, START] the ring index of committed entry 1,
[s, COUNT] the committed entries since the checkpoint. Entry j (1..count) lives at (start + j - 1) % L
(:func:`ring_indices`). Per model step: the flush rule count + 2T > L (:func:`needs_flush`; the layers fold their
checkpoints, then :func:`flush_cursor` once: start <- (start + count) % L, count <- 0), the verify of every layer,
then :func:`commit` once: count += n_accepted (0 <= n <= T, checked by :func:`check_n_accepted`). Needs L >= 2T
(:func:`check_window`). The native-spec baseline commits by a copy instead (:func:`native_spec_commit`).
"""

from __future__ import annotations

import torch

START, COUNT = 0, 1  # columns of the ring ``cursor``


# ---- validation -------------------------------------------------------------------------------------
def check_shape(t, name: str, shape) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def rows(state_batch_indices, batch: int, nslots: int) -> list[int]:
    """The slot of each batch row (-1 padding) after the shared checks: int32 (batch,), values in [-1, nslots),
    no slot twice; None means rows 0..batch-1 (batch <= nslots)."""
    if state_batch_indices is None:
        if batch > nslots:
            raise ValueError(f"state_batch_indices: None needs batch <= slots, got batch={batch}, slots={nslots}")
        return list(range(batch))
    check_shape(state_batch_indices, "state_batch_indices", (batch,))
    if state_batch_indices.dtype != torch.int32:
        raise TypeError(f"state_batch_indices: expected dtype int32, got {state_batch_indices.dtype}")
    sbi = [int(s) for s in state_batch_indices.cpu().tolist()]
    bad = [s for s in sbi if not -1 <= s < nslots]
    if bad:
        raise ValueError(f"state_batch_indices: expected values in [-1, {nslots}), got {bad[:8]}")
    used = [s for s in sbi if s >= 0]
    if len(set(used)) != len(used):
        raise ValueError(f"state_batch_indices: a slot appears in more than one row, got {sbi}")
    return sbi


def check_ring_cursor(cursor, nslots: int) -> None:
    """The speculative cursor: (nslots, 2) int32 (start, count)."""
    check_shape(cursor, "cursor", (nslots, 2))
    if cursor.dtype != torch.int32:
        raise TypeError(f"cursor: expected dtype int32, got {cursor.dtype}")


def check_window(num_tokens: int, L: int) -> None:
    """A window of T = num_tokens tokens on a ring of L: T >= 1 and L >= 2T (flush one window early)."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens: expected >= 1, got {num_tokens}")
    if L < 2 * num_tokens:
        raise ValueError(f"buffer_len: expected >= 2 * num_tokens = {2 * num_tokens} (one window early), got {L}")


def check_standard_cursor(cursor, nslots: int, slots: list[int], L: int) -> None:
    """The standard cursor: (nslots,) with every used slot's entry count in [0, L)."""
    if tuple(cursor.shape) != (nslots,):
        raise ValueError(f"cursor: expected shape ({nslots},), got {tuple(cursor.shape)}")
    for s in slots:
        if s >= 0 and not 0 <= int(cursor[s]) < L:
            raise ValueError(f"cursor[{s}] = {int(cursor[s])} is outside [0, {L})")



# ---- the standard cursor's move ------------------------------------------------------------------------------
def advance_cursor(cursor, state_batch_indices, buffer_len: int, flushes=None):
    """cursor[slot] <- (cursor[slot] + 1) mod L for every row with a slot (in place); with ``flushes``
    (an 8-bit checkpoint's flush counts, :class:`.shadow.Checkpoint8`) flushes[slot] += 1 where the cursor wraps."""
    for s in state_batch_indices.long().cpu().tolist():
        if s >= 0:
            if flushes is not None and int(cursor[s]) == buffer_len - 1:
                flushes[s] = int(flushes[s]) + 1
            cursor[s] = (int(cursor[s]) + 1) % buffer_len
    return cursor


ORDER_COLUMNS = 4  # a flush-first order's row: (row, slot, cursor, 0), one 16-byte load for a kernel's block


def flush_order(cursor, state_batch_indices, buffer_len: int):
    """The standard cursor's row order for one decode step, flushing rows first: (batch, 4) int32 rows of
    (row, slot, cursor, 0), a stable three-way partition of the rows: those that flush in this step (slot in
    [0, S), cursor L - 1), then the other rows with a slot in [0, S), then the rest (padding, out-of-range slots),
    each class in row order. ``cursor`` is the slot's cursor (0 for the rest).

    The decode kernels' grids walk the rows in order, and a flushing row's blocks are several times longer than the
    others': a launch whose flushing rows lead packs its long blocks into the first waves instead of ending with one
    (bench/NOTES.md "Twenty-fourth session"). A module built with a row order reads its block's row, slot and
    cursor from this in one load, in place of ``state_batch_indices`` and the cursor (``row_order``); every row is
    computed exactly as without it."""
    sbi = state_batch_indices.long().cpu().tolist()
    cur = cursor.long().cpu().tolist()
    S = len(cur)
    cls = []
    for s in sbi:
        cls.append(2 if not 0 <= s < S else (0 if cur[s] == buffer_len - 1 else 1))
    order = [(r, sbi[r], cur[sbi[r]] if cls[r] < 2 else 0, 0) for c in (0, 1, 2) for r in range(len(sbi))
             if cls[r] == c]
    return torch.tensor(order, dtype=torch.int32).reshape(len(sbi), ORDER_COLUMNS)


def split_rows(rows):
    """A step's rows input as (state_batch_indices (batch,), row_order or None): (batch,) slots as they are, or a
    flush-first order (batch, 4) (the ``replayssm::flush_order`` output a graph's decode nodes may take) with the
    slots it carries put back in row order (torch ops on the order's device, graph-safe; a row the order misses
    stays padding, -1: :func:`check_row_order` names it where values are checked)."""
    if rows.dim() == 1:
        return rows, None
    if rows.dim() != 2 or rows.shape[1] != ORDER_COLUMNS:
        raise ValueError(f"state_batch_indices: expected (batch,) slots or a flush-first order (batch, {ORDER_COLUMNS}), "
                         f"got shape {tuple(rows.shape)}")
    sbi = torch.full((rows.shape[0],), -1, dtype=rows.dtype, device=rows.device)
    sbi[rows[:, 0].long().clamp(0, max(rows.shape[0] - 1, 0))] = rows[:, 1]
    return sbi, rows


def check_row_order(row_order, state_batch_indices, cursor) -> None:
    """``row_order`` (batch, 4) int32 is a permutation of the rows, each with its own slot and that slot's cursor:
    column 0 holds every row 0..batch-1 once, column 1 the row's slot state_batch_indices[row], column 2 the
    slot's cursor (0 for a row without a slot in range), column 3 zero (what :func:`flush_order` gives)."""
    sbi = state_batch_indices.long().cpu()
    ro = row_order.long().cpu()
    batch = sbi.shape[0]
    if tuple(ro.shape) != (batch, ORDER_COLUMNS):
        raise ValueError(f"row_order: expected shape ({batch}, {ORDER_COLUMNS}) (row, slot, cursor, 0) for the {batch} "
                         f"rows, got {tuple(ro.shape)}")
    if sorted(ro[:, 0].tolist()) != list(range(batch)):
        raise ValueError(f"row_order: column 0 must hold each row 0..{batch - 1} once, got {ro[:, 0].tolist()}")
    cur, S = cursor.long().cpu(), cursor.shape[0]
    bad = [r for r, s, *_ in ro.tolist() if s != int(sbi[r])]
    if bad:
        raise ValueError(f"row_order: column 1 must be each row's slot (state_batch_indices[row]); rows {bad[:8]} "
                         "differ")
    bad = [r for r, s, c, z in ro.tolist() if c != (int(cur[s]) if 0 <= s < S else 0) or z]
    if bad:
        raise ValueError(f"row_order: columns 2, 3 must be the slot's cursor (0 without a slot) and 0; rows {bad[:8]} "
                         "differ (an order made before the cursor moved?)")


# ---- the ring cursor: (start, count) ---------------------------------------------------------------------------
def start_count(cursor, s: int) -> tuple[int, int]:
    """(start, count) of slot ``s`` on the ring cursor, as ints."""
    return int(cursor[s, START]), int(cursor[s, COUNT])


def ring_indices(start: int, first: int, n: int, L: int, device=None) -> torch.Tensor:
    """Ring indices of entries first+1 .. first+n after the checkpoint (entry j at (start + j - 1) % L)."""
    return (start + first + torch.arange(n, device=device)) % L


def needs_flush(cursor, slot: int, num_tokens: int, buffer_len: int) -> bool:
    """The flush rule: count + 2T > L (flush one window early)."""
    return int(cursor[slot, COUNT]) + 2 * num_tokens > buffer_len


def flush_cursor(cursor, num_tokens: int, buffer_len: int, state_batch_indices=None):
    """The cursor part of the flush (once per model step): start <- (start + count) % L, count <- 0."""
    check_ring_cursor(cursor, cursor.shape[0])
    check_window(num_tokens, buffer_len)
    batch = cursor.shape[0] if state_batch_indices is None else state_batch_indices.shape[0]
    flushed = []
    for s in rows(state_batch_indices, batch, cursor.shape[0]):
        if s >= 0 and needs_flush(cursor, s, num_tokens, buffer_len):
            start, count = start_count(cursor, s)
            cursor[s, START] = (start + count) % buffer_len
            cursor[s, COUNT] = 0
            flushed.append(s)
    return flushed


def check_n_accepted(n_accepted, batch: int | None = None) -> list[int]:
    """n_accepted as ints, after checking it is an integer (batch,) tensor (batch None: any length); a float
    would be truncated here and rounded elsewhere, so the cursor and the conv window would disagree. The
    values are checked by the callers."""
    if not isinstance(n_accepted, torch.Tensor):
        raise TypeError(f"n_accepted: expected a torch.Tensor, got {type(n_accepted).__name__}")
    if n_accepted.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"n_accepted: expected dtype int32 (or int64), got {n_accepted.dtype}")
    if n_accepted.dim() != 1:
        raise ValueError(f"n_accepted: expected shape (batch,), got {tuple(n_accepted.shape)}")
    if batch is not None:
        check_shape(n_accepted, "n_accepted", (batch,))
    return [int(v) for v in n_accepted.cpu().tolist()]


def commit(cursor, n_accepted, num_tokens: int, buffer_len: int, state_batch_indices=None):
    """count += n_accepted[row] for every row with a slot (in place): a cursor move, no state copy.

    n_accepted (batch,) int: accepted tokens of the window including the first one, 0 <= n <= T.
    All rows are validated before any cursor moves.
    """
    check_ring_cursor(cursor, cursor.shape[0])
    nacc = check_n_accepted(n_accepted, None if state_batch_indices is None else state_batch_indices.shape[0])
    batch = len(nacc)
    live = [(b, s) for b, s in enumerate(rows(state_batch_indices, batch, cursor.shape[0])) if s >= 0]
    for b, s in live:
        n, count = nacc[b], int(cursor[s, COUNT])
        if not 0 <= n <= num_tokens:
            raise ValueError(f"n_accepted[{b}]: expected 0 <= n <= T={num_tokens}, got {n}")
        if count + n > buffer_len:
            raise ValueError(f"cursor[{s}]: count + n_accepted = {count} + {n} exceeds L={buffer_len}")
    for b, s in live:
        cursor[s, COUNT] = int(cursor[s, COUNT]) + nacc[b]
    return cursor



# ---- native-spec baseline: the commit copy (any state shape) --------------------------------------------
def native_spec_commit(state, snapshots, n_accepted, state_batch_indices):
    """state[s] <- snapshots[s, n-1] for n >= 1 (n = 0: unchanged): the copy native spec pays per step."""
    batch = state_batch_indices.shape[0]
    nacc = check_n_accepted(n_accepted, batch)
    for b, s in enumerate(rows(state_batch_indices, batch, state.shape[0])):
        n = nacc[b]
        if s < 0:
            continue
        if not 0 <= n <= snapshots.shape[1]:
            raise ValueError(f"n_accepted[{b}]: expected 0 <= n <= {snapshots.shape[1]}, got {n}")
        if n:
            state[s] = snapshots[s, n - 1].to(state.dtype)
    return state
