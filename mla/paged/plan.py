"""The plan of one paged call: where each new token goes and what each attention path reads.

A call of the paged tier (mla/paged/layer.py) attends the new tokens of b sequences, packed into
the N real rows of x. Before anything runs on the device, the host, which holds the lengths,
`cache.seq_lens` and the page allocator, works out what the call needs:

    positions     (N,)   each token's place in its sequence: seq_len before the call + j
    slot_mapping  (N,)   each token's row of the pages (mla/paged/cache.py: the slot)
    token_rows    (N,)   each token's row of x, where the tokens are not x's first N rows
    block tables         the pages of the rows that grew, copied into `cache.block_table`
    decode rows          one new token: DecodeRows, one query each for mla_decode
    prefill rows         several new tokens, grouped by the path `prefill_path` picks:
                         PrefillRows, and for the "absorbed" path its pieces, queries of up
                         to MAX_QUERY_TOKENS tokens (DecodeRows again)

Everything is built on the host from the lengths (`plan_call`) and moved to the device in one
packed copy (`to_device`): one host-to-device transfer, no sync. The longest lengths and the
context chunks stay host ints in the plan, so the kernels read nothing back. The CUDA-graph
step takes a plan made of the caller's device buffers instead (`decode_step_plan`), which
`decode_step_inputs` fills outside the graph.

Shapes: b sequences (or queries) of the call, N real new tokens, T rows of x (N and padding),
m rows of several new tokens on one path, T_p their new tokens, P pieces, s_q new tokens a
query, g rows whose block table grew; the rest of the legend as in mla/naive.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from .. import absorbed
from ..kernels.constants import MAX_GRID_YZ
from ..kernels.decode import MAX_QUERY_TOKENS
from .cache import PagedLatentCache, ragged_index, slots_at, slots_of

# The two ways a row of several new tokens attends, "up-project" (MHA mode) and "absorbed" (MQA
# mode): the absorbed tier's prefill modes.
PREFILL_PATHS = absorbed.PREFILL_MODES

# The most pieces a decode row is cut into: CUDA's limit on a grid's y and z dimensions, which
# mla_decode launches the splits over.
MAX_KV_SPLITS = MAX_GRID_YZ


# ---- what one call needs on the device -----------------------------------------------------
@dataclass
class DecodeRows:
    """Rows attending in MQA mode through mla_decode: b queries of s_q new tokens each, every
    token already in its pages. A decode row is one token; a row of several new tokens is cut
    into pieces of at most MAX_QUERY_TOKENS, each piece a query of its own.

    tokens: (b,) int64, the one-token rows' tokens among the call's N; None = all N tokens, in
        order (or, for pieces, unused: their tokens are the PrefillRows' ones).
    block_table: (b, max_blocks) int32, each query's row of the cache's table (the table itself
        when the queries are the cache's rows in order).
    seq_lens: (b,) int32, cached tokens a query sees, its new tokens included (a piece: its
        row's context and new tokens up to the piece's last).
    num_kv_splits: mla_decode's split count; None lets it choose, from `max_seq_len` where
        given (no sync), else from a read of seq_lens (one host sync).
    max_seq_len: host int, the largest of seq_lens (the host plan knows it), or None.
    s_q: host int in 1..MAX_QUERY_TOKENS, tokens a query.
    query_slots: (T,) int64 for s_q > 1: token k's place in the (b · s_q) query rows. A piece of
        L < s_q tokens takes the last L places: under FlashMLA's causal convention (query j of s_q
        sees seq_len - (s_q - 1 - j) rows) its tokens then see exactly their causal prefix.
    """

    tokens: torch.Tensor | None
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    num_kv_splits: int | None
    max_seq_len: int | None = None
    s_q: int = 1
    query_slots: torch.Tensor | None = None


@dataclass
class PrefillRows:
    """m rows of a call with several new tokens each, all attending one way.

    tokens: (T_p,) int64, the rows' new tokens among the call's N, row after row; None = all
        N tokens of the call, in order (`every_token`).
    slots: (T_p,) int64, the new tokens' cache slots (MHA mode reads their latent rows there).
    query_start_loc: (m + 1,) int32, row k's tokens are tokens[query_start_loc[k]:...[k+1]].
    context_lens: (m,) int32, tokens each row held before this call (both as the kernels take
        them).
    block_table: (m, max_blocks) int32, each row's pages (the new tokens already written); the
        cache's table itself when the rows are all of its rows, in order.
    max_new_len, max_seq_len: host ints, max(new tokens) and max(context + new tokens).
    context_lens_host: context_lens as host ints (the MHA mode's chunks are planned from them).
    pieces: MQA mode's queries (path "absorbed"): the rows cut into pieces of at most
        MAX_QUERY_TOKENS new tokens; None on the "up-project" path.
    new_latent: the new tokens' kv_c (T_p, c) and k_pe (T_p, r) as the cache holds them, where
        the layer has them at hand (`PagedMLA._run` sets it); None = read back from `slots`.
    All tensors on the cache's device.
    """

    tokens: torch.Tensor | None
    slots: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    max_new_len: int
    max_seq_len: int
    context_lens_host: list[int]
    pieces: DecodeRows | None = None
    new_latent: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def every_token(self) -> bool:
        """The rows hold all N tokens of the call, in order: the layer then passes its queries
        and takes the output as they are, with no gather."""
        return self.tokens is None


@dataclass
class CallPlan:
    """One call's metadata on the device.

    positions, slot_mapping: (N,) int64 for the N real tokens, in the call's packed order.
    token_rows: (N,) int64, each real token's row of x; None = x's first N rows, in order.
    decode: the one-token rows (or None); prefill: (path, rows) for each path taken.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    token_rows: torch.Tensor | None
    decode: DecodeRows | None
    prefill: list[tuple[str, PrefillRows]] = field(default_factory=list)


# ---- the eager call's plan, built on the host ----------------------------------------------
def plan_call(cache: PagedLatentCache, seq_ids: torch.Tensor, new_lens: torch.Tensor,
              starts: torch.Tensor, *, prefill_path: Callable[[int, int], str],
              num_kv_splits: int | None) -> CallPlan:
    """The call's metadata, built on the host and moved to the device in one copy.

    seq_ids, new_lens, starts: (b,) CPU int64, checked, new_lens >= 1; sequence k's tokens are
    rows starts[k] ... starts[k] + new_lens[k] - 1 of x, appended to cache row seq_ids[k].
    prefill_path(new_len, context_len): the path of a row of several new tokens, one of
    PREFILL_PATHS (the layer's hook). num_kv_splits: mla_decode's split count, or None.

    Asks `prefill_path` for every row with several new tokens first, then takes the pages
    (all-or-nothing): an error from either leaves the cache as it was. Takes the pages and
    grows the block table; `cache.seq_lens` is the caller's to advance.

    What is per row is worked out on host ints; what is per token takes a few torch operators
    for the whole call (`ragged_plus_index`): every per-token value of the plan is a value of
    its row plus the token's place among the call's N.
    """
    rows, lens, firsts = seq_ids.tolist(), new_lens.tolist(), starts.tolist()
    held = cache.seq_lens.tolist()
    contexts = [held[i] for i in rows]                         # tokens each row held before
    by_path: dict[str, list[int]] = {}                         # path -> its rows k
    for k, (new_len, context_len) in enumerate(zip(lens, contexts)):
        if new_len > 1:
            path = prefill_path(new_len, context_len)
            if path not in PREFILL_PATHS:
                raise ValueError(f"prefill_path returned {path!r}; expected one of "
                                 f"{PREFILL_PATHS}")
            by_path.setdefault(path, []).append(k)
    decode_ks = [k for k, new_len in enumerate(lens) if new_len == 1]

    grown = cache.allocate_on_host(rows, lens)                 # rows whose table grew
    packed = list(accumulate(lens, initial=0))                 # (b + 1,) row k: packed[k] ...
    N = packed[-1]
    # token p of row k: position p + (context - packed[k]); the row's place in the flattened
    # block table, row · max_blocks · n + position (`slots_at`); its row of x where x's rows are
    # not 0 .. N - 1
    row_slots = cache.max_blocks_per_seq * cache.block_size
    offsets = [[t - p for t, p in zip(contexts, packed)],
               [i * row_slots + t - p for i, t, p in zip(rows, contexts, packed)]]
    moved = firsts != packed[:-1]
    if moved:
        offsets.append([f - p for f, p in zip(firsts, packed)])
    per_token = ragged_plus_index(offsets, lens)               # (2 or 3, N)
    host: dict[str, torch.Tensor | list[int]] = dict(
        positions=per_token[0], slot_mapping=slots_at(cache, per_token[1]))
    if moved:
        host["token_rows"] = per_token[2]                      # (N,) rows of x
    if grown:
        host["grown"] = grown
        host["grown_table"] = cache.block_table_cpu[grown]     # (g, max_blocks) int32
    if decode_ks:
        decode_rows = [rows[k] for k in decode_ks]
        host["decode_seq_lens"] = Int32(contexts[k] + 1 for k in decode_ks)
        if not every_row(cache, decode_rows):
            host["decode_rows"] = decode_rows
        if len(decode_ks) < N:
            host["decode_tokens"] = [packed[k] for k in decode_ks]
    pieces = {}
    for path, ks in by_path.items():
        path_lens, path_contexts = [lens[k] for k in ks], [contexts[k] for k in ks]
        if len(ks) < len(lens):                 # not every row: its tokens among the call's N
            qsl = list(accumulate(path_lens, initial=0))
            host[path + "/tokens"] = ragged_plus_index(
                [[packed[k] - q for k, q in zip(ks, qsl)]], path_lens)[0]
        else:
            qsl = packed
        host[path + "/query_start_loc"] = Int32(qsl)
        host[path + "/context_lens"] = Int32(path_contexts)
        path_rows = [rows[k] for k in ks]
        if not every_row(cache, path_rows):
            host[path + "/rows"] = path_rows
        if path == "absorbed":                  # MQA mode: queries of <= 8 new tokens
            s_q, piece_row, piece_seq_lens, query_slots = query_pieces(
                torch.tensor(path_lens), torch.tensor(path_contexts))
            pieces[path] = s_q
            piece_rows = torch.tensor(path_rows)[piece_row]
            if not every_row(cache, piece_rows.tolist()):
                host[path + "/piece_rows"] = piece_rows
            host[path + "/piece_seq_lens"] = piece_seq_lens.to(torch.int32)
            host[path + "/query_slots"] = query_slots

    dev = to_device(host, cache.device)
    if grown:
        cache.block_table[dev["grown"]] = dev["grown_table"]

    def block_table(key: str) -> torch.Tensor:
        """The block-table rows of host[key]'s cache rows: the table itself where the plan left
        the key out (the rows are all of the cache's, in order)."""
        return cache.block_table if key not in dev else cache.block_table[dev[key]]

    plan = CallPlan(positions=dev["positions"], slot_mapping=dev["slot_mapping"],
                    token_rows=dev.get("token_rows"), decode=None)
    if decode_ks:
        plan.decode = DecodeRows(tokens=dev.get("decode_tokens"),
                                 block_table=block_table("decode_rows"),
                                 seq_lens=dev["decode_seq_lens"],
                                 num_kv_splits=num_kv_splits,
                                 max_seq_len=max(contexts[k] for k in decode_ks) + 1)
    for path, ks in by_path.items():
        tokens = dev.get(path + "/tokens")
        prefill_rows = PrefillRows(
            tokens=tokens, slots=plan.slot_mapping if tokens is None else plan.slot_mapping[tokens],
            query_start_loc=dev[path + "/query_start_loc"],
            context_lens=dev[path + "/context_lens"],
            block_table=block_table(path + "/rows"),
            max_new_len=max(lens[k] for k in ks),
            max_seq_len=max(contexts[k] + lens[k] for k in ks),
            context_lens_host=[contexts[k] for k in ks])
        if path in pieces:
            prefill_rows.pieces = DecodeRows(
                tokens=None, block_table=block_table(path + "/piece_rows"),
                seq_lens=dev[path + "/piece_seq_lens"],
                num_kv_splits=num_kv_splits, s_q=pieces[path],
                max_seq_len=prefill_rows.max_seq_len,      # a row's last piece sees all of it
                query_slots=dev[path + "/query_slots"])
        plan.prefill.append((path, prefill_rows))
    return plan


def every_row(cache: PagedLatentCache, rows: list[int]) -> bool:
    """Whether `rows` (distinct cache rows) are all of the cache's, in order: their block
    tables are then the cache's table itself, with no gather."""
    return len(rows) == cache.batch_size and all(i == k for k, i in enumerate(rows))


def ragged_plus_index(offsets: list[list[int]], lens: list[int]) -> torch.Tensor:
    """(len(offsets), N) int64, N = sum(lens): offsets[i][k] + p for each token p of N tokens
    packed row after row, lens[k] >= 1 of them in row k. Every per-token value of a plan is a
    value of its row plus the token's place p (positions, slots' table indices, rows of x, a
    path's tokens), so one repeat over the rows spreads them all."""
    total = sum(lens)
    base = torch.tensor(offsets)                                            # (·, b)
    if total > len(lens) > 1:                   # rows of several tokens: spread each value
        base = base.repeat_interleave(torch.tensor(lens), dim=1, output_size=total)
    return base + torch.arange(total)                                       # (·, N)


def query_pieces(new_lens: torch.Tensor, context_lens: torch.Tensor
                 ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut m rows of new tokens into MQA-mode queries of at most MAX_QUERY_TOKENS tokens (host).

    new_lens, context_lens: (m,) int64 on the host. Returns s_q (tokens a query), piece_row (P,)
    each piece's row among the m, piece_seq_lens (P,) the cached tokens each piece sees (its
    row's context and new tokens up to its last one), query_slots (T_p,) each new token's place
    in the (P · s_q) query rows, its piece's tokens in the last places.
    """
    s_q = min(MAX_QUERY_TOKENS, int(new_lens.max()))
    n_pieces = (new_lens + s_q - 1) // s_q                                  # (m,)
    first_piece = torch.cumsum(n_pieces, 0) - n_pieces                      # (m,)
    piece_row, piece_k = ragged_index(n_pieces)                             # (P,) each
    piece_end = torch.minimum((piece_k + 1) * s_q, new_lens[piece_row])     # (P,) new tokens seen
    piece_len = piece_end - piece_k * s_q                                   # (P,) 1 .. s_q
    token_row, j = ragged_index(new_lens)                                   # (T_p,) each
    piece = first_piece[token_row] + j // s_q                               # (T_p,)
    query_slots = piece * s_q + (s_q - piece_len[piece]) + j % s_q          # (T_p,)
    return s_q, piece_row, context_lens[piece_row] + piece_end, query_slots


class Int32(list):
    """Host ints that `to_device` moves as int32 (a plain list of ints moves as int64): the
    kernels' lengths and offsets, which would otherwise take a cast on the device."""


def to_device(host: dict[str, torch.Tensor | list[int]], device: torch.device
              ) -> dict[str, torch.Tensor]:
    """Move a call's host-built metadata to `device` in one copy, split back into views there.

    Each value is a CPU tensor (int32 stays int32, any other integer dtype becomes int64), a
    list of host ints (int64) or an `Int32` list. Everything is packed into one int32 buffer,
    the int64 values first as pairs of int32 words (so their views stay 8-byte aligned), each
    kind's lists joined into one tensor; on a GPU the buffer is pinned, so the copy does not
    wait for the host.
    """
    tensors = {torch.int64: [], torch.int32: []}           # dtype -> [(key, tensor)]
    lists = {torch.int64: [], torch.int32: []}             # dtype -> [(key, host ints)]
    for key, value in host.items():
        if isinstance(value, torch.Tensor):
            tensors[torch.int32 if value.dtype == torch.int32 else torch.int64].append((key, value))
        else:
            lists[torch.int32 if isinstance(value, Int32) else torch.int64].append((key, value))
    words, places, size = [], {}, {}       # the buffer's parts; key -> (dtype, first, n, shape)
    for dtype in (torch.int64, torch.int32):
        at, joined = 0, []                 # a kind's lists follow its tensors, as one tensor
        for key, t in tensors[dtype]:
            words.append(t.to(dtype).reshape(-1).contiguous().view(torch.int32))
            places[key] = dtype, at, t.numel(), t.shape
            at += t.numel()
        for key, values in lists[dtype]:
            joined += values
            places[key] = dtype, at, len(values), None
            at += len(values)
        if joined:
            words.append(torch.tensor(joined, dtype=dtype).view(torch.int32))
        size[dtype] = at
    if device.type == "cuda":
        pinned = torch.empty(sum(w.numel() for w in words), dtype=torch.int32, pin_memory=True)
        flat = torch.cat(words, out=pinned).to(device, non_blocking=True)
    else:
        flat = torch.cat(words).to(device)
    wide = 2 * size[torch.int64]
    sections = {torch.int64: flat[:wide].view(torch.int64), torch.int32: flat[wide:]}
    out = {}
    for key in host:
        dtype, at, n, shape = places[key]
        view = sections[dtype][at:at + n]
        out[key] = view if shape is None or len(shape) == 1 else view.view(shape)
    return out


# ---- the CUDA-graph step's plan: the caller's device buffers --------------------------------
def decode_step_inputs(cache: PagedLatentCache, out: dict | None = None
                       ) -> dict[str, torch.Tensor]:
    """The host side of one decode step over every row of `cache` (`PagedMLA.decode_inputs`):
    takes each row's room for one token, returns slot_mapping (b,) int64, positions (b,) int64
    and seq_lens_after (b,) int32 on the cache's device (in `out`'s tensors where given), and
    advances `cache.seq_lens` by one."""
    names = ("slot_mapping", "positions", "seq_lens_after")
    check_calibrated(cache)
    if out is not None and not (isinstance(out, dict) and all(k in out for k in names)):
        raise ValueError(f"out must be a dict with the tensors {names} (an earlier "
                         f"decode_inputs' result), got {out!r}")
    b = cache.batch_size
    rows, ones = cache.check_rows(torch.arange(b), torch.ones(b, dtype=torch.int64))
    grown = cache.allocate_on_host(rows, ones)
    positions = cache.seq_lens.clone()                           # (b,) before the step
    host = dict(slot_mapping=slots_of(cache, rows, positions), positions=positions,
                seq_lens_after=(positions + 1).to(torch.int32))
    if grown:
        host.update(grown=grown, grown_table=cache.block_table_cpu[grown])
    dev = to_device(host, cache.device)
    if grown:
        cache.block_table[dev["grown"]] = dev["grown_table"]
    cache.seq_lens += 1
    values = {k: dev[k] for k in names}
    if out is None:
        return values
    for k in names:
        out[k].copy_(values[k])
    return out


def decode_step_plan(cache: PagedLatentCache, *, slot_mapping: torch.Tensor,
                     positions: torch.Tensor, seq_lens_after: torch.Tensor, num_kv_splits: int,
                     block_table: torch.Tensor | None = None) -> CallPlan:
    """The plan of a decode of every row of `cache`, made of the caller's device tensors (see
    `PagedMLA.decode_step` for each): their shapes, dtypes and devices are checked (metadata
    only, no sync), their values trusted. block_table None = cache.block_table."""
    b = cache.batch_size
    check_calibrated(cache)
    check_num_kv_splits(num_kv_splits, allow_none=False)
    table = cache.block_table if block_table is None else block_table
    for name, t, shape, dtype in (("slot_mapping", slot_mapping, (b,), torch.int64),
                                  ("positions", positions, (b,), torch.int64),
                                  ("seq_lens_after", seq_lens_after, (b,), torch.int32),
                                  ("block_table", table, (b, table.shape[-1]), torch.int32)):
        if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype
                or t.device != cache.device):
            got = (f"{t.dtype} of shape {tuple(t.shape)} on {t.device}"
                   if isinstance(t, torch.Tensor) else type(t).__name__)
            raise ValueError(f"{name} must be a {shape} {dtype} tensor on {cache.device}, "
                             f"got {got}")
    return CallPlan(positions=positions, slot_mapping=slot_mapping, token_rows=None,
                    decode=DecodeRows(tokens=None, block_table=table, seq_lens=seq_lens_after,
                                      num_kv_splits=num_kv_splits))


# ---- checks --------------------------------------------------------------------------------
def check_num_kv_splits(num_kv_splits, *, allow_none: bool) -> None:
    """num_kv_splits must be an int in [1, MAX_KV_SPLITS] (or None where `allow_none`); bools
    and floats raise a ValueError too."""
    if num_kv_splits is None and allow_none:
        return
    if (isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int)
            or not 1 <= num_kv_splits <= MAX_KV_SPLITS):
        allowed = " or None" if allow_none else ""
        raise ValueError(f"num_kv_splits must be an int in [1, {MAX_KV_SPLITS}]{allowed}, got "
                         f"{num_kv_splits!r}")


def check_calibrated(cache: PagedLatentCache) -> None:
    """The CUDA-graph step reads nothing on the host, so it cannot calibrate: an fp8_e4m3
    cache must have its scale before `decode_inputs` touches it."""
    if isinstance(cache, PagedLatentCache) and cache.needs_scale:
        raise ValueError("cache is fp8_e4m3 without a scale, and decode_inputs / decode_step do "
                         "not calibrate (the step reads nothing on the host); give the layer or "
                         "cache a kv_scale, or run an eager call (a prefill) first")
