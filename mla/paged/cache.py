"""PagedLatentCache: the latent cache in fixed-size pages, with a block allocator and block tables.

The naive and absorbed tiers give every sequence a contiguous (t_max, c + r) buffer, sized for
the longest sequence it might become. The paged tier, as vLLM does, cuts one big tensor into
pages (blocks) of n tokens and hands them to sequences as they grow, so memory follows the
tokens actually cached and a finished sequence's pages go straight to the next one:

    kv_cache     (num_blocks, n, c + r)   one row a token: kv_c_normed (c) then k_pe (r)
    block_table  (b, max_blocks) int32    block_table[i, j]: the page holding tokens
                                          j·n ... (j+1)·n - 1 of sequence i; -1 where unused
    seq_lens     (b,) int64, CPU          tokens cached per sequence

Token `pos` of sequence i lives in page p = block_table[i, pos // n] at row pos % n; its *slot*,
the index into kv_cache viewed as (num_blocks·n, c + r), is

    slot = block_table[i, pos // n] · n + pos % n            (-1: padding, written nowhere)

The allocator is a free list of page indices. A sequence takes pages only when its next token
does not fit (lazily), and `free(i)` gives them all back. Every call that changes the cache is
all-or-nothing: it checks that the free list holds enough pages for *every* sequence of the call
before it takes one, so "out of blocks" leaves the tensor, the tables, seq_lens and the free list
as they were.

The block table lives twice: `block_table` on the cache's device (what the decode kernel reads)
and `block_table_cpu`, the allocator's own copy, from which slot mappings are built on the host.

A row need not be c + r values of the weights' dtype: `kv_cache_dtype` picks one of the layouts of
`mla.kernels.fp8`. "auto" stores the values as they are; "fp8_e4m3" stores each value in one
byte of float8_e4m3fn with one float32 scale for the whole cache (`kv_scale`: given, or
calibrated from the first write that holds a non-zero value, then fixed); "fp8_ds_mla" stores
FlashMLA's 656-byte token, the latent in e4m3 with a scale per 128 values computed as the row is
written, the rope part in bf16. Every reader dequantises what it reads (`dequantize_rows`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from ..base import check_int
from ..cache import check_cache_fits
from ..kernels import concat_and_cache, concat_and_cache_reference, fp8
from ..kernels.extension import extension_available

UNUSED = -1  # block-table entry that holds no page


class OutOfBlocksError(RuntimeError):
    """The free list cannot hold what a call needs; nothing was allocated or written."""


# The dtypes a cache's values can have (its `dtype`, the weights'): what its kernels take and
# what its readers get back, whatever the layout stores (kv_cache_dtype).
VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# An fp8_e4m3 cache calibrated from its first tokens maps their largest |value| to
# E4M3_MAX / CALIBRATION_HEADROOM = 224: later tokens up to twice as large are stored without
# clipping. e4m3's relative step is the same in every binade, so the headroom costs the normal
# values nothing; only values below 2^-6 / 224 = 2^-13.8 of the calibration's largest reach
# the subnormals.
CALIBRATION_HEADROOM = 2.0


def as_int(name: str, value) -> int:
    """`value` as a Python int: an int, a numpy integer or a 0-d integer tensor. Bools and floats
    are refused (TypeError naming `name`): True is not row 1 and 1.9 is not row 1."""
    return check_int(name, value)


def as_int_tensor(name: str, values) -> torch.Tensor:
    """`values` (a sequence, numpy array or tensor of integers, or one integer) as a (n,) CPU
    int64 tensor. Bool and floating-point values are refused (TypeError naming `name`), not
    converted; more than one dimension is a ValueError."""
    if not isinstance(values, torch.Tensor):
        try:
            values = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"{name} must be a sequence or tensor of integers, got {values!r}") \
                from err
        if values.numel() == 0:
            values = values.to(torch.int64)   # [] is float32 to torch
    if _non_integer(values.dtype):
        raise TypeError(f"{name} must hold integers, got dtype {values.dtype}"
                        f" ({values.flatten()[:4].tolist()}...)")
    if values.dim() > 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(values.shape)}")
    return values.to("cpu", torch.int64).reshape(-1)


def _non_integer(dtype: torch.dtype) -> bool:
    return dtype == torch.bool or dtype.is_floating_point or dtype.is_complex


def check_kv_cache_dtype(kv_cache_dtype, kv_lora_rank: int) -> str:
    """The layout's canonical name ("auto", "fp8_e4m3", "fp8_ds_mla"); a ValueError naming
    kv_cache_dtype for another value or a latent width fp8_ds_mla cannot group, a RuntimeError
    where this torch has no float8_e4m3fn."""
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype must be a str, one of {fp8.KV_CACHE_DTYPES}, got "
                        f"{kv_cache_dtype!r}")
    kind = fp8.canonical_kv_cache_dtype(kv_cache_dtype)
    if kind != "auto":
        fp8.require_fp8(kv_cache_dtype)
    if kind == "fp8_ds_mla":
        fp8.ds_mla_layout(kv_lora_rank, 1)     # c a multiple of 128, else a ValueError naming c
    return kind


def check_kv_scale(kind: str, kv_scale, device: torch.device, *,
                   fn: str = "PagedLatentCache") -> torch.Tensor | None:
    """kv_scale as a (1,) float32 tensor on `device` for an fp8_e4m3 cache (None: calibrate
    later), checked by `fp8.check_e4m3_scale` under the name `fn`; must be None for the other
    layouts. Reads a tensor's value (once, at construction)."""
    if kv_scale is None:
        return None
    if kind != "fp8_e4m3":
        raise ValueError(f"{fn}: kv_scale is for kv_cache_dtype='fp8_e4m3' only; it must be None "
                         f"for {kind!r}")
    return fp8.check_e4m3_scale(fn, "kv_scale", kv_scale, device, read_value=True)


def positive_int(name: str, value) -> int:
    """`value` as a Python int >= 1 (an int, numpy integer or 0-d integer tensor); else a
    ValueError naming `name`. Bools and floats are refused, not converted."""
    try:
        number = as_int(name, value)
    except TypeError:
        number = 0
    if number <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return number


class PagedLatentCache:
    """Paged latent cache for `batch_size` sequences (rows) of up to `max_seq_len` tokens.

    Args:
        batch_size: sequences (rows) b; a row is reused for a new sequence after `free(i)`.
        max_seq_len: the longest a sequence may grow; sets the block table's width,
            max_blocks = ceil(max_seq_len / block_size).
        kv_lora_rank: c.  rope_dim: r (both >= 1).
        block_size: tokens a page (n), any int >= 1.
        num_blocks: pages in the pool; None = enough for every row at max_seq_len,
            batch_size · max_blocks (fewer is the point of paging: rows rarely all grow long).
        dtype, device: the values' dtype (the weights': what readers get back, one of
            VALUE_DTYPES: float32, float16, bfloat16) and the cache's device.
        kv_cache_dtype: how a row is stored (`mla.kernels.fp8`): "auto" (c + r values of
            `dtype`), "fp8_e4m3" (alias "fp8": c + r bytes of float8_e4m3fn and one scale) or
            "fp8_ds_mla" (c + 4·c/128 + 2·r bytes of uint8, FlashMLA's token; c a multiple of
            128).
        kv_scale: "fp8_e4m3" only: the cache's scale, a float or 1-element float32 tensor (on
            `device` or the CPU), finite and at least 2^-126 (`fp8.check_e4m3_scale`); None =
            calibrated from the first tokens written (`calibrate`), then fixed. Must be None for
            the other layouts.
        shuffle: None hands pages out in order 0, 1, 2, ...; an int seeds a random order of the
            free list, so block tables are non-contiguous (tests use it to catch code that
            assumes page j of a sequence sits next to page j + 1).

    Attributes:
        kv_cache: (num_blocks, block_size, width) on `device`: width c + r of `dtype` ("auto"),
            c + r of float8_e4m3fn ("fp8_e4m3") or c + 4·c/128 + 2·r of uint8 ("fp8_ds_mla").
        kv_cache_dtype: the layout's canonical name: "auto", "fp8_e4m3" or "fp8_ds_mla".
        kv_scale: "fp8_e4m3": a (1,) float32 tensor on `device`, or None until calibrated;
            None for the other layouts. `kernel_scale` is what the kernels are given.
        block_table: (b, max_blocks) int32 on `device`; UNUSED (-1) past a row's pages.
        block_table_cpu: the same on the CPU (the allocator's copy).
        seq_lens: (b,) int64 on the CPU.
        free_blocks: the free list (a Python list of page indices; the next page is the last).
    """

    def __init__(self, batch_size: int, max_seq_len: int, kv_lora_rank: int, rope_dim: int, *,
                 block_size: int = 64, num_blocks: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kv_cache_dtype: str = "auto", kv_scale: float | torch.Tensor | None = None,
                 shuffle: int | None = None):
        batch_size = positive_int("batch_size", batch_size)
        max_seq_len = positive_int("max_seq_len", max_seq_len)
        kv_lora_rank = positive_int("kv_lora_rank", kv_lora_rank)
        rope_dim = positive_int("rope_dim", rope_dim)
        block_size = positive_int("block_size", block_size)
        if dtype not in VALUE_DTYPES:
            raise TypeError(f"dtype must be one of {', '.join(map(str, VALUE_DTYPES))} (what the "
                            f"cache's kernels read and write), got {dtype!r}")
        device = torch.device(device)
        kind = check_kv_cache_dtype(kv_cache_dtype, kv_lora_rank)
        self.kv_cache_dtype = kind
        self.kv_scale = check_kv_scale(kind, kv_scale, device)
        # the scale an uncalibrated fp8_e4m3 cache writes and reads with (see kernel_scale)
        self._unit_scale = torch.ones(1, device=device) if kind == "fp8_e4m3" else None
        self._dtype = dtype
        self.kv_lora_rank, self.rope_dim, self.block_size = kv_lora_rank, rope_dim, block_size
        self._max_seq_len = max_seq_len
        max_blocks = math.ceil(max_seq_len / block_size)
        if num_blocks is None:
            num_blocks = batch_size * max_blocks
        num_blocks = positive_int("num_blocks", num_blocks)
        storage, width = fp8.cache_row(kind, kv_lora_rank, rope_dim, dtype)
        self.kv_cache = torch.zeros(num_blocks, block_size, width, dtype=storage, device=device)
        self.block_table_cpu = torch.full((batch_size, max_blocks), UNUSED, dtype=torch.int32)
        self.block_table = self.block_table_cpu.to(device, copy=True)
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int64)
        if shuffle is None:
            order = list(range(num_blocks))
        else:
            gen = torch.Generator().manual_seed(as_int("shuffle", shuffle))
            order = torch.randperm(num_blocks, generator=gen).tolist()
        self.free_blocks: list[int] = order[::-1]  # pop() from the end hands out order[0] first
        self._num_pages = [0] * batch_size  # pages held by each row

    # ---- the sizes the common call checks (same names as mla.cache.LatentCache) ---------
    @property
    def batch_size(self) -> int:
        return self.block_table_cpu.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_table_cpu.shape[1]

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device

    @property
    def dtype(self) -> torch.dtype:
        """The values' dtype: the weights' dtype, what `gather` returns (kv_cache.dtype is the
        storage's, which differs for the fp8 layouts)."""
        return self._dtype

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token takes: 1152 (bf16), 576 (fp8_e4m3), 656 (fp8_ds_mla) for
        DeepSeek-V3's c + r = 512 + 64."""
        return self.kv_cache.shape[2] * self.kv_cache.element_size()

    @property
    def needs_scale(self) -> bool:
        """True for an fp8_e4m3 cache not yet calibrated: a write calibrates it (`calibrate`)."""
        return self.kv_cache_dtype == "fp8_e4m3" and self.kv_scale is None

    @property
    def kernel_scale(self) -> torch.Tensor | None:
        """The (1,) float32 scale the kernels write and read this cache with: `kv_scale`, or 1
        while an fp8_e4m3 cache is uncalibrated; None for the other layouts. An uncalibrated
        cache holds only tokens with no finite non-zero value (see `calibrate`), whose bytes
        (zeros, NaN) read back the same under any scale."""
        return self.kv_scale if self.kv_scale is not None else self._unit_scale

    def calibrate(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Fix an uncalibrated fp8_e4m3 cache's scale from the rows about to be written, kv_c
        (T, c) and k_pe (T, r) on the cache's device: their largest finite |value| maps to
        E4M3_MAX / CALIBRATION_HEADROOM (224). Rows with no finite non-zero value leave the
        cache uncalibrated: a scale from them would be 2^-126 and every later value would clip.
        Reads one number on the host. Anything else (a scale already set, another layout, rows
        of other widths) raises."""
        if not self.needs_scale:
            raise RuntimeError(f"calibrate() is for an fp8_e4m3 cache without a scale; this cache "
                               f"is {self.kv_cache_dtype!r} with kv_scale={self.kv_scale}")
        for name, t, width in (("kv_c", kv_c, self.kv_lora_rank), ("k_pe", k_pe, self.rope_dim)):
            if (not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != width
                    or t.device != self.device):
                got = (f"{tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise ValueError(f"calibrate: {name} must be (T, {width}) on {self.device}, "
                                 f"got {got}")
        if kv_c.shape[0] != k_pe.shape[0]:
            raise ValueError(f"calibrate: kv_c and k_pe must have one row a token, got "
                             f"{kv_c.shape[0]} and {k_pe.shape[0]}")
        scale = fp8.calibrate_e4m3_scale(kv_c, k_pe, headroom=CALIBRATION_HEADROOM)
        if float(scale) > fp8.MIN_SCALE:
            self.kv_scale = scale

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows (..., width) of this cache -> (..., c + r) values in `dtype`."""
        return fp8.dequantize_rows(rows, self.kv_cache_dtype, self.kv_lora_rank, self.rope_dim,
                                   self.kernel_scale, self.dtype)

    def check_fits(self, *, batch_size: int, kv_lora_rank: int, rope_dim: int,
                   dtype: torch.dtype, device: torch.device | str) -> None:
        """Raise unless this cache can take a layer's latents (kv_lora_rank, rope width, the
        weights' dtype and device) for a call of `batch_size` rows; as
        `mla.cache.LatentCache.check_fits`. Writes nothing."""
        check_cache_fits(self, batch_size=batch_size, kv_lora_rank=kv_lora_rank,
                         rope_dim=rope_dim, dtype=dtype, device=device)

    def blocks_of(self, i: int) -> list[int]:
        """The pages row i holds, in token order."""
        return self.block_table_cpu[i, : self._num_pages[i]].tolist()

    # ---- the allocator ------------------------------------------------------------------
    def blocks_needed(self, seq_ids: torch.Tensor, new_lens: torch.Tensor) -> torch.Tensor:
        """(n,) int64: pages each listed row must take to hold new_lens more tokens."""
        return torch.tensor(self._pages_needed(seq_ids.tolist(), new_lens.tolist()),
                            dtype=torch.int64)

    def _pages_needed(self, rows: list[int], lens: list[int]) -> list[int]:
        """`blocks_needed` on host ints: rows and lens as lists, one entry a row."""
        n, held = self.block_size, self.seq_lens.tolist()
        return [max(0, -(-(held[i] + new_len) // n) - self._num_pages[i])
                for i, new_len in zip(rows, lens)]

    def allocate(self, seq_ids: Sequence[int] | torch.Tensor,
                 new_lens: Sequence[int] | torch.Tensor) -> None:
        """Give rows seq_ids room for new_lens more tokens each (pages from the free list).

        All-or-nothing: raises ValueError past max_seq_len and OutOfBlocksError when the free list
        is short, before taking any page. Does not change seq_lens (see `append`).
        """
        seq_ids, new_lens = self.check_rows(seq_ids, new_lens)
        if self.allocate_on_host(seq_ids, new_lens):
            self.block_table.copy_(self.block_table_cpu)

    def allocate_on_host(self, seq_ids: torch.Tensor | list[int],
                         new_lens: torch.Tensor | list[int]) -> list[int]:
        """`allocate`'s host half, for checked rows (`check_rows`; tensors or lists of host
        ints): takes the pages and writes them into `block_table_cpu` only. Returns the rows
        whose table grew, a list; the caller copies `block_table_cpu[grown]` into
        `block_table` (one transfer it may pack with others). All-or-nothing, as `allocate`.
        """
        rows = seq_ids.tolist() if isinstance(seq_ids, torch.Tensor) else list(seq_ids)
        lens = new_lens.tolist() if isinstance(new_lens, torch.Tensor) else list(new_lens)
        needed = self._pages_needed(rows, lens)
        total = sum(needed)
        if total > len(self.free_blocks):
            raise OutOfBlocksError(
                f"out of cache blocks: this call needs {total} more blocks of {self.block_size} "
                f"tokens but only {len(self.free_blocks)} of {self.num_blocks} are free; free "
                f"finished sequences (cache.free(i)) or make the cache with more num_blocks")
        grown = []
        for i, k in zip(rows, needed):
            if k:
                start = self._num_pages[i]
                pages = [self.free_blocks.pop() for _ in range(k)]
                self.block_table_cpu[i, start:start + k] = torch.tensor(pages, dtype=torch.int32)
                self._num_pages[i] = start + k
                grown.append(i)
        return grown

    def free(self, i: int) -> None:
        """End sequence i: its pages go back to the free list, its row is empty (seq_len 0).

        The pages' contents are left as they are; the next owner overwrites them.
        """
        i = self._row_index("free(i)", i)
        pages = self.blocks_of(i)
        self.free_blocks.extend(reversed(pages))  # the most recently freed page goes out first
        self.block_table_cpu[i] = UNUSED
        self.block_table[i] = UNUSED
        self._num_pages[i] = 0
        self.seq_lens[i] = 0

    # ---- slot mappings --------------------------------------------------------------------
    def slot_mapping(self, token_seq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(T,) int64 slots of tokens at `positions` (T,) of rows `token_seq` (T,), on the CPU.

        slot = block_table[i, pos // n] · n + pos % n; -1 where token_seq < 0 (padding). The
        pages must be allocated (`allocate`); a position without a page is an error.
        """
        token_seq = as_int_tensor("slot_mapping: token_seq", token_seq)
        positions = as_int_tensor("slot_mapping: positions", positions)
        if positions.shape != token_seq.shape:
            raise ValueError(f"slot_mapping: token_seq and positions must be (T,) tensors of one "
                             f"length, got {tuple(token_seq.shape)} and {tuple(positions.shape)}")
        real = token_seq >= 0
        if bool((token_seq >= self.batch_size).any()):
            raise ValueError(f"slot_mapping: token_seq must lie in [0, batch_size="
                             f"{self.batch_size}) (or be -1 for padding), got "
                             f"{token_seq[token_seq >= self.batch_size].unique().tolist()}")
        if bool((real & (positions < 0)).any()):
            raise ValueError(f"slot_mapping: positions of real tokens must be >= 0, got "
                             f"{positions[real & (positions < 0)].unique().tolist()}")
        rows, pos = token_seq.clamp_min(0), positions.clamp_min(0)
        n = self.block_size
        pages = self.block_table_cpu[rows, (pos // n).clamp_max(self.max_blocks_per_seq - 1)]
        if bool((real & ((pos // n >= self.max_blocks_per_seq) | (pages < 0))).any()):
            raise ValueError("slot_mapping: a token has no page; allocate() its room first")
        slots = pages.to(torch.int64) * n + pos % n
        return torch.where(real, slots, -1)

    def slot_mapping_padded(self, lengths: Sequence[int] | torch.Tensor, s: int) -> torch.Tensor:
        """(b, s) int64 slots of the next tokens of each row, as the common call lays them out:
        token j of row i goes to position seq_lens[i] + j; -1 for j >= lengths[i] (padding).

        Rows must have room allocated for lengths[i] more tokens.
        """
        lengths = as_int_tensor("lengths", lengths)
        if lengths.shape != (self.batch_size,):
            raise ValueError(f"lengths must have shape ({self.batch_size},), "
                             f"got {tuple(lengths.shape)}")
        j = torch.arange(s)
        real = j[None, :] < lengths[:, None]                            # (b, s)
        token_seq = torch.where(real, torch.arange(self.batch_size)[:, None], -1)
        positions = self.seq_lens[:, None] + j[None, :]                 # (b, s)
        return self.slot_mapping(token_seq.flatten(), positions.flatten()).view(-1, s)

    # ---- writing --------------------------------------------------------------------------
    def append(self, kv_c: torch.Tensor, k_pe: torch.Tensor, seq_ids: Sequence[int] | torch.Tensor,
               new_lens: Sequence[int] | torch.Tensor, **concat_options) -> torch.Tensor:
        """Append new tokens of rows seq_ids: allocate pages, write the rows, bump seq_lens.

        kv_c (T, c) and k_pe (T, r) hold the tokens row after row: new_lens[0] of seq_ids[0],
        then new_lens[1] of seq_ids[1], ...; rows past sum(new_lens) are padding and skipped.
        Either may be a row-strided view (e.g. slices of one (T, c + r) tensor). Token j of row i
        lands at position seq_lens[i] + j, stored in the cache's layout (an uncalibrated
        fp8_e4m3 cache first takes its scale from these tokens). `concat_options` go to
        `mla.kernels.concat_and_cache`. All-or-nothing: on any error the cache is as before
        (its scale included). Returns the slot mapping (T,) int64 on the cache's device.
        """
        seq_ids, new_lens = self.check_rows(seq_ids, new_lens)
        c, r = self.kv_lora_rank, self.rope_dim
        # concat_and_cache checks c + r against the page width only; check each part here, so
        # that kv_c and k_pe of other widths with the same sum are not split at the wrong place
        if kv_c.dim() != 2 or kv_c.shape[1] != c:
            raise ValueError(f"append: kv_c must have shape (T, c={c}), got {tuple(kv_c.shape)}")
        T = kv_c.shape[0]
        if tuple(k_pe.shape) != (T, r):
            raise ValueError(f"append: k_pe must have shape (T={T}, r={r}), "
                             f"got {tuple(k_pe.shape)}")
        real = int(new_lens.sum())
        if real > T:
            raise ValueError(f"append: new_lens add up to {real} tokens but kv_c holds {T}")
        token_seq, offsets = ragged_index(new_lens)
        positions = self.seq_lens[seq_ids][token_seq] + offsets
        token_row = torch.full((T,), -1, dtype=torch.int64)
        token_row[:real] = seq_ids[token_seq]
        token_pos = torch.zeros(T, dtype=torch.int64)
        token_pos[:real] = positions

        snapshot = (self.block_table_cpu.clone(), list(self.free_blocks), list(self._num_pages),
                    self.kv_scale)
        self.allocate(seq_ids, new_lens)
        try:
            slots = self.slot_mapping(token_row, token_pos).to(self.device)
            if self.needs_scale and real:
                self.calibrate(kv_c[:real], k_pe[:real])
            concat_and_cache(kv_c, k_pe, self.kv_cache, slots,
                             kv_cache_dtype=self.kv_cache_dtype, scale=self.kernel_scale,
                             **concat_options)
        except Exception:
            # the write was refused (checks run before it writes): give the pages back
            self.block_table_cpu.copy_(snapshot[0])
            self.block_table.copy_(snapshot[0])
            self.free_blocks[:], self._num_pages[:] = snapshot[1], snapshot[2]
            self.kv_scale = snapshot[3]
            raise
        self.seq_lens.index_add_(0, seq_ids, new_lens)
        return slots

    # ---- reading back -----------------------------------------------------------------------
    def gather(self, i: int, *, stored: bool = False):
        """Sequence i's cached latent, pages put back in order: kv_c (t, c), k_pe (t, r) in
        `dtype` (dequantised from an fp8 layout). stored=True returns the stored rows
        (t, width) in kv_cache's dtype instead, as `append_stored` takes them."""
        i = self._row_index("gather(i)", i)
        t = int(self.seq_lens[i])
        pages = self.block_table_cpu[i, : math.ceil(t / self.block_size)].to(self.device,
                                                                              torch.int64)
        rows = self.kv_cache[pages].flatten(0, 1)[:t]           # (t, width)
        if stored:
            return rows
        rows = self.dequantize(rows)                            # (t, c + r)
        return rows[:, : self.kv_lora_rank], rows[:, self.kv_lora_rank:]

    def append_stored(self, rows: torch.Tensor, i: int, *,
                      kv_scale: float | torch.Tensor | None = None) -> None:
        """Append stored rows (t, width) of a cache of the same layout (`gather(j,
        stored=True)` of it) to row i, bytes as they are: a sequence moves between caches
        without being quantised twice.

        kv_scale: fp8_e4m3 only, the scale the rows were stored with (the other cache's
        `kv_scale`; None for rows of an uncalibrated cache, which read the same under any
        scale). An uncalibrated cache takes it as its own; a calibrated one must have the same.
        All-or-nothing, as `append`.
        """
        i = self._row_index("append_stored(i)", i)
        scale = check_kv_scale(self.kv_cache_dtype, kv_scale, self.device, fn="append_stored")
        if scale is not None and self.kv_scale is not None and not torch.equal(scale,
                                                                                self.kv_scale):
            raise ValueError(f"append_stored: kv_scale {float(scale)} differs from this cache's "
                             f"{float(self.kv_scale)}: the rows would read back rescaled")
        if (not isinstance(rows, torch.Tensor) or rows.dim() != 2
                or rows.shape[1] != self.kv_cache.shape[2] or rows.dtype != self.kv_cache.dtype
                or rows.device != self.device):
            got = (f"{rows.dtype} {tuple(rows.shape)} on {rows.device}"
                   if isinstance(rows, torch.Tensor) else type(rows).__name__)
            raise ValueError(f"append_stored: rows must be (t, {self.kv_cache.shape[2]}) "
                             f"{self.kv_cache.dtype} on {self.device}, got {got}")
        seq_ids, new_lens = self.check_rows([i], [rows.shape[0]])
        positions = self.seq_lens[i] + torch.arange(rows.shape[0])
        self.allocate(seq_ids, new_lens)
        if scale is not None and self.kv_scale is None and rows.shape[0]:
            self.kv_scale = scale
        slots = self.slot_mapping(torch.full_like(positions, i), positions).to(self.device)
        self.kv_cache.view(-1, self.kv_cache.shape[2])[slots] = rows
        self.seq_lens[i] += rows.shape[0]

    def gather_padded(self, seq_ids: Sequence[int] | torch.Tensor, t: int) -> torch.Tensor:
        """(n, t, c + r) in `dtype`: the first t cached tokens of each listed row, dequantised;
        zeros past its seq_len (see `gather_pages`)."""
        seq_ids = as_int_tensor("gather_padded: seq_ids", seq_ids)
        if bool(((seq_ids < 0) | (seq_ids >= self.batch_size)).any()):
            raise ValueError(f"gather_padded: seq_ids must lie in [0, batch_size="
                             f"{self.batch_size}), got {seq_ids.tolist()}")
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ValueError(f"gather_padded: t must be an int >= 0, got {t!r}")
        if math.ceil(t / self.block_size) > self.max_blocks_per_seq:
            raise ValueError(f"gather_padded: t={t} is longer than max_seq_len={self.max_seq_len}")
        rows = seq_ids.to(self.device)
        return gather_pages(self, self.block_table[rows], self.seq_lens[seq_ids].to(self.device),
                            int(t))

    # ---- checks -------------------------------------------------------------------------------
    def check_rows(self, seq_ids, new_lens) -> tuple[torch.Tensor, torch.Tensor]:
        """seq_ids and new_lens, one entry a sequence, as CPU int64 (n,) tensors, checked: rows
        in range and distinct, counts >= 0 and within max_seq_len. Integers only (bools and
        floats raise a TypeError naming the argument). Reads and writes nothing else."""
        seq_ids = as_int_tensor("seq_ids", seq_ids)
        new_lens = as_int_tensor("new_lens", new_lens)
        if seq_ids.shape != new_lens.shape:
            raise ValueError(f"seq_ids and new_lens must have one entry per sequence, got "
                             f"{tuple(seq_ids.shape)} and {tuple(new_lens.shape)}")
        if seq_ids.numel() and bool(((seq_ids < 0) | (seq_ids >= self.batch_size)).any()):
            raise ValueError(f"seq_ids must lie in [0, {self.batch_size}), got {seq_ids.tolist()}")
        if seq_ids.unique().numel() != seq_ids.numel():
            raise ValueError(f"seq_ids must not repeat a row, got {seq_ids.tolist()}")
        if bool((new_lens < 0).any()):
            raise ValueError(f"new token counts must be >= 0, got {new_lens.tolist()}")
        over = torch.nonzero(self.seq_lens[seq_ids] + new_lens > self.max_seq_len).flatten()
        if over.numel():
            k = int(over[0])
            i = int(seq_ids[k])
            raise ValueError(
                f"appending {int(new_lens[k])} tokens to row {i} (holding {int(self.seq_lens[i])})"
                f" would pass max_seq_len={self.max_seq_len}")
        return seq_ids, new_lens

    def _row_index(self, what: str, i) -> int:
        try:
            i = as_int(what, i)
        except TypeError as err:
            raise TypeError(f"{what} needs an integer row index in [0, batch_size="
                            f"{self.batch_size}), got {i!r}") from err
        if not 0 <= i < self.batch_size:
            raise ValueError(f"{what} needs a row index i in [0, batch_size={self.batch_size}), "
                             f"got {i}")
        return i

    def __repr__(self) -> str:
        return (f"PagedLatentCache(batch_size={self.batch_size}, max_seq_len={self.max_seq_len}, "
                f"block_size={self.block_size}, num_blocks={self.num_blocks}, "
                f"free={self.num_free_blocks}, dtype={self.dtype}, "
                f"kv_cache_dtype={self.kv_cache_dtype!r}, device={self.device})")


# ---- device-side helpers the layer shares ------------------------------------------------------
def ragged_index(new_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For tokens laid out sequence after sequence: each token's sequence k and offset j (int64)."""
    token_seq = torch.repeat_interleave(torch.arange(new_lens.numel()), new_lens,
                                        output_size=int(new_lens.sum()))
    starts = torch.cumsum(new_lens, 0) - new_lens
    offsets = torch.arange(token_seq.numel()) - starts[token_seq]
    return token_seq, offsets


def slots_of(cache: PagedLatentCache, rows: torch.Tensor, positions: torch.Tensor
             ) -> torch.Tensor:
    """(T,) int64 slots, block_table[row, pos // n] · n + pos % n, of tokens at `positions` (T,)
    of `rows` (T,), CPU int64, on the host. `slot_mapping` without its checks: for a host plan
    whose rows and positions come from the allocator, every one with its page."""
    return slots_at(cache, rows * (cache.max_blocks_per_seq * cache.block_size) + positions)


def slots_at(cache: PagedLatentCache, table_index: torch.Tensor) -> torch.Tensor:
    """(T,) int64 slots of tokens at `table_index` (T,) = row · max_blocks · n + pos, CPU
    int64: with the block table's rows laid end to end, n slots a page, table_index // n is the
    token's entry of the flattened table and table_index % n (= pos % n) its row in that page.
    `slots_of` for callers that fold the row into the index themselves."""
    n = cache.block_size
    return (table_index % n).add_(cache.block_table_cpu.view(-1)[table_index // n], alpha=n)


def gather_pages(cache: PagedLatentCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 t: int) -> torch.Tensor:
    """(m, t, c + r) in cache.dtype: the first t cached rows of m sequences, pages put back in
    order and dequantised, zeros past each sequence's seq_len. block_table (m, max_blocks) int32
    and seq_lens (m,) on the cache's device; reads nothing on the host.

    Zeros, not whatever the pages hold: padding keys must stay finite, because a masked score
    times a NaN value is still NaN.
    """
    kv_cache = cache.kv_cache
    n_pages = math.ceil(t / kv_cache.shape[1])
    table = block_table[:, :n_pages].to(torch.int64).clamp_min(0)          # (m, pages)
    rows = cache.dequantize(kv_cache[table].flatten(1, 2)[:, :t])          # (m, t, c + r)
    valid = torch.arange(t, device=kv_cache.device)[None, :] < seq_lens[:, None]  # (m, t)
    return torch.where(valid[..., None], rows, torch.zeros((), dtype=rows.dtype,
                                                            device=rows.device))


def write_slots(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: PagedLatentCache,
                slot_mapping: torch.Tensor) -> None:
    """Write each token's [kv_c | k_pe] row into its slot of `cache`, in its layout, trusting
    the arguments: no checks and no host sync (slot -1 skips a token). The compiled op where
    the extension serves the cache's device (capturable in a CUDA graph); else the torch
    reference, which checks the slot range (a sync). Callers build the slots from the allocator
    and calibrate an fp8_e4m3 cache first; `append` is the checked write.
    """
    if extension_available(cache.device):
        torch.ops.mla.concat_and_cache_mla(kv_c, k_pe, cache.kv_cache, slot_mapping,
                                           cache.kv_cache_dtype, cache.kernel_scale)
    else:
        concat_and_cache_reference(kv_c, k_pe, cache.kv_cache, slot_mapping,
                                   kv_cache_dtype=cache.kv_cache_dtype, scale=cache.kernel_scale)
