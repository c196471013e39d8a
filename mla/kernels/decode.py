"""Split-KV paged decode for Multi-head Latent Attention: Triton, and CUDA for DeepSeek's sizes.

In the absorbed form, MLA decode is multi-query attention over the latent cache: every head of a
sequence attends to the same cached rows ``[kv_c | k_pe]`` (c + r values a token), the key is the
whole row and the value is its first c values. One decode step of one sequence, for h heads:

    scores[h, t] = softmax_scale * (q_lat[h] . kv_c[t] + q_pe[h] . k_pe[t])     (b, h, t)
    out[h]       = sum_t softmax(scores[h])[t] * kv_c[t]                         (b, h, c)
    lse[h]       = log sum_t exp(scores[h, t])                                   (b, h)

Goals, in the order they shape the code:

1. Read the cache once. Decode is memory bound at few heads (16 a GPU under tensor parallelism)
   and compute bound at many (128), so a program takes up to 64 heads (``BLOCK_H``) and reads
   each latent tile once for all of them, and the value is the nope part of that same tile: no
   second load. Heads past ``h`` (h = 1, 3, 20, ...) are padding rows, masked.
2. Fill the GPU when the batch is small. The sequence is cut into ``num_kv_splits`` pieces, each
   its own program (split-KV, "flash decoding"); a second, small kernel merges the pieces by
   log-sum-exp. The split count comes from batch, head blocks, length and SM count
   (``choose_num_kv_splits``). With one split, the Triton stage 1 writes the result directly.
3. Paged cache. Token ``pos`` of sequence ``i`` lives in page ``block_table[i, pos // page]`` at
   row ``pos % page``. When the page size is a multiple of ``BLOCK_N`` (page 64: every default)
   a tile lies inside one page: one block-table load a tile, a contiguous 2-D tile load
   (``PAGE_TILE``); otherwise the page is looked up per token, so a tile may span pages and any
   page size >= 1 works. Nothing outside a sequence's pages is read: tokens past
   ``seq_len`` and block-table entries past ``ceil(seq_len / page)`` are masked loads. Page
   offsets are int64, so caches beyond 2^31 elements work.
4. fp32 softmax statistics and accumulators whatever the input dtype (bf16, fp16, fp32).

Blocked pseudo-code of stage 1, one program per (sequence i, head block, split):

    q_nope, q_pe = q[i, heads, :c], q[i, heads, c:]                  (BLOCK_H, c), (BLOCK_H, r)
    m, l, acc = -inf, 0, 0                                           (BLOCK_H,), (BLOCK_H, c)
    for each tile of BLOCK_N positions n in this split:
        page, row = block_table[i, n // page_size], n % page_size
        kv_nope, kv_pe = cache[page, row, :c], cache[page, row, c:]  (BLOCK_N, c), (BLOCK_N, r)
        s = (q_nope @ kv_nope^T + q_pe @ kv_pe^T) * scale            (BLOCK_H, BLOCK_N)
        m_new = max(m, rowmax(s));  p = exp(s - m_new)
        l   = l * exp(m - m_new) + rowsum(p)
        acc = acc * exp(m - m_new) + p @ kv_nope                     (value = the nope part)
        m = m_new
    partial_out = acc / l ;  partial_lse = m + log(l)                (-inf for an empty split)

Stage 2, one program per (sequence, head, chunk of c): ``lse = logsumexp_s(partial_lse[s])``,
``out = sum_s exp(partial_lse[s] - lse) * partial_out[s]``.

The exponentials run in base 2 (``exp2``, the cheap instruction), with the scale folded into
``softmax_scale * log2(e)``; the lse is turned back into natural log on the way out.

Three stage-1 kernels compute this. The Triton one below serves every case (any heads, c, r,
dtype, page size; on the CPU through Triton's interpreter). For DeepSeek's sizes (c = 512,
r = 64) in bf16 or fp16 on a GPU, ``mla_decode`` runs a CUDA one instead, with the same
partials and merge:

- up to 16 heads (one GPU's share of 128 at tensor parallelism 8), pages of a multiple of 32
  rows: ``csrc/mla_decode_sm80.cu``, warp-level tensor-core instructions (sm_80 and later) with
  fragments loaded a k-step at a time, so that nothing spills and (on an H100/H200) two
  programs share an SM (``benchmarks/NOTES.md`` rows 33-40), or, when all the programs fit on
  the SMs one each (one long sequence), one program an SM keeps 3 tiles in flight (row 52);
- more heads, pages of a multiple of 64 rows, on Hopper (compute capability 9.0):
  ``csrc/mla_decode_sm90.cu``, 64 heads a program with warpgroup MMA (wgmma) on operands in
  shared memory, a 64-token tile loaded once for both products, its two warpgroups taking the
  tiles in pairs (NOTES rows 41-43).

They live in the package's compiled extension (``mla.kernels.concat_cache.load_extension``);
where that cannot be built, or the GPU lacks what a kernel needs, the Triton kernel runs.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings

import torch
import triton
import triton.language as tl

__all__ = [
    "mla_decode",
    "mla_decode_reference",
    "choose_num_kv_splits",
    "default_config",
]

_LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))
_LN2 = 0.6931471805599453  # ln(2):    log(x) = log2(x) * ln(2)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MERGE_TILE = 4096  # partial-output values one merge program reads (splits x chunk of c)
_CPU_NUM_SMS = 132  # an H100/H200's SM count, so CPU runs choose the splits a GPU would
_MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z: sequences and splits


# ---------------------------------------------------------------------------------------------
# Stage 1: one program per (sequence, head block, split)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _mla_decode_tile(
    q_nope, q_pe, m_i, l_i, acc,
    kv_ptr, block_table_row, start_n, split_end,
    kv_lora_rank, rope_dim, page_size, scale_log2,
    stride_kvp, stride_kvn, stride_btp,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAGE_TILE: tl.constexpr,  # page_size % BLOCK_N == 0: the tile lies inside one page
    MASK_N: tl.constexpr,  # the split's last, partial tile: tokens past split_end are masked
    EXACT: tl.constexpr,  # c == BLOCK_C and r == BLOCK_R: no column masks
):
    """One BLOCK_N-token step of the online softmax; returns the new (m_i, l_i, acc)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_n = offs_n < split_end
    # -- where each token of the tile lives: its page (through the block table) and row
    if PAGE_TILE:
        # one scalar block-table load for the whole tile (start_n < split_end: a real entry),
        # then BLOCK_N consecutive rows of that page: a contiguous (BLOCK_N, c + r) block
        page = tl.load(block_table_row + (start_n // page_size) * stride_btp)
        base = page.to(tl.int64) * stride_kvp + (start_n % page_size) * stride_kvn
        kv_rows = kv_ptr + base + tl.arange(0, BLOCK_N)[:, None] * stride_kvn
    else:
        # a tile may span pages: one lookup per token, masked so entries past the sequence
        # are never read
        if MASK_N:
            page = tl.load(block_table_row + (offs_n // page_size) * stride_btp, mask=mask_n, other=0)
        else:
            page = tl.load(block_table_row + (offs_n // page_size) * stride_btp)
        row = page.to(tl.int64) * stride_kvp + (offs_n % page_size) * stride_kvn  # (BLOCK_N,)
        kv_rows = kv_ptr + row[:, None]

    # -- one load of the latent tile: the nope part is both key and value
    if MASK_N:
        kv_nope = tl.load(
            kv_rows + offs_c[None, :], mask=mask_n[:, None] & (offs_c < kv_lora_rank)[None, :], other=0.0
        )
        kv_pe = tl.load(
            kv_rows + kv_lora_rank + offs_r[None, :],
            mask=mask_n[:, None] & (offs_r < rope_dim)[None, :],
            other=0.0,
        )
    elif EXACT:
        kv_nope = tl.load(kv_rows + offs_c[None, :])
        kv_pe = tl.load(kv_rows + kv_lora_rank + offs_r[None, :])
    else:
        kv_nope = tl.load(kv_rows + offs_c[None, :], mask=(offs_c < kv_lora_rank)[None, :], other=0.0)
        kv_pe = tl.load(kv_rows + kv_lora_rank + offs_r[None, :], mask=(offs_r < rope_dim)[None, :], other=0.0)

    # -- scores, (BLOCK_H, BLOCK_N), in log2 units; tokens past the split are -inf
    s = tl.dot(q_nope, tl.trans(kv_nope), input_precision=DOT_PRECISION)
    s = tl.dot(q_pe, tl.trans(kv_pe), s, input_precision=DOT_PRECISION)
    if MASK_N:
        s = tl.where(mask_n[None, :], s * scale_log2, float("-inf"))
    else:
        s = s * scale_log2

    # -- online softmax update; every tile holds >= 1 real token, so m_new is finite
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(kv_nope.dtype), kv_nope, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _mla_decode_split_kernel(
    # pointers
    q_ptr,  # (b, h, c + r)
    kv_ptr,  # (num_pages, page_size, c + r)
    block_table_ptr,  # (b, max_pages) int32
    seq_lens_ptr,  # (b,) int32
    part_out_ptr,  # (b, h, splits, c) fp32 workspace, or out (b, h, c) when splits == 1
    part_lse_ptr,  # (b, h, splits) fp32 workspace, or lse (b, h) when splits == 1
    # sizes
    num_heads,
    kv_lora_rank,  # c
    rope_dim,  # r
    page_size,
    num_splits,
    scale_log2,  # softmax_scale * log2(e)
    # strides
    stride_qb, stride_qh,
    stride_kvp, stride_kvn,  # page, token within the page (the last dim is contiguous)
    stride_btb, stride_btp,
    stride_slb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls,
    # meta-parameters
    BLOCK_H: tl.constexpr,  # heads a program
    BLOCK_N: tl.constexpr,  # tokens a step
    BLOCK_C: tl.constexpr,  # next_power_of_2(c)
    BLOCK_R: tl.constexpr,  # next_power_of_2(r), at least 16 (tl.dot's smallest K)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding), else "tf32"
    PAGE_TILE: tl.constexpr,  # page_size % BLOCK_N == 0: one block-table load a tile
    EXACT: tl.constexpr,  # c == BLOCK_C and r == BLOCK_R
    HEAD_MAJOR: tl.constexpr,  # grid (head blocks, b, splits) rather than (b, head blocks, splits)
    SPLIT_TAIL: tl.constexpr,  # whole tiles unmasked, then the partial one; else every tile masked
):
    # head blocks vary fastest (HEAD_MAJOR), so the programs that share a sequence's cache run
    # side by side and the second head block finds the tiles in L2
    if HEAD_MAJOR:
        pid_h = tl.program_id(0)
        pid_b = tl.program_id(1)
    else:
        pid_b = tl.program_id(0)
        pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)

    # ---- this split's token range: whole BLOCK_N tiles, the last split may be short or empty
    seq_len = tl.load(seq_lens_ptr + pid_b * stride_slb)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    split_start = pid_s * tiles_per_split * BLOCK_N
    split_end = tl.maximum(tl.minimum(split_start + tiles_per_split * BLOCK_N, seq_len), split_start)
    full_end = split_start + ((split_end - split_start) // BLOCK_N) * BLOCK_N  # end of whole tiles

    # ---- the query of BLOCK_H heads, as its nope (latent) part and its rope part
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = offs_h < num_heads
    mask_c = offs_c < kv_lora_rank
    mask_r = offs_r < rope_dim
    q_rows = q_ptr + pid_b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    q_pe = tl.load(
        q_rows + kv_lora_rank + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0
    )

    # ---- online softmax over the split, fp32 statistics: whole tiles unmasked, then the tail
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)  # running sum of p * value
    block_table_row = block_table_ptr + pid_b.to(tl.int64) * stride_btb
    if SPLIT_TAIL:
        for start_n in range(split_start, full_end, BLOCK_N):
            m_i, l_i, acc = _mla_decode_tile(
                q_nope, q_pe, m_i, l_i, acc, kv_ptr, block_table_row, start_n, split_end,
                kv_lora_rank, rope_dim, page_size, scale_log2, stride_kvp, stride_kvn, stride_btp,
                BLOCK_N, BLOCK_C, BLOCK_R, DOT_PRECISION, PAGE_TILE, False, EXACT,
            )
        if full_end < split_end:
            m_i, l_i, acc = _mla_decode_tile(
                q_nope, q_pe, m_i, l_i, acc, kv_ptr, block_table_row, full_end, split_end,
                kv_lora_rank, rope_dim, page_size, scale_log2, stride_kvp, stride_kvn, stride_btp,
                BLOCK_N, BLOCK_C, BLOCK_R, DOT_PRECISION, PAGE_TILE, True, EXACT,
            )
    else:
        for start_n in range(split_start, split_end, BLOCK_N):
            m_i, l_i, acc = _mla_decode_tile(
                q_nope, q_pe, m_i, l_i, acc, kv_ptr, block_table_row, start_n, split_end,
                kv_lora_rank, rope_dim, page_size, scale_log2, stride_kvp, stride_kvn, stride_btp,
                BLOCK_N, BLOCK_C, BLOCK_R, DOT_PRECISION, PAGE_TILE, True, EXACT,
            )

    # ---- normalise and write; an empty split (l = 0) writes zeros and lse = -inf
    nonempty = l_i > 0.0
    l_safe = tl.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))

    out_ptrs = (
        part_out_ptr
        + pid_b.to(tl.int64) * stride_ob
        + offs_h[:, None] * stride_oh
        + pid_s * stride_os
        + offs_c[None, :]
    )
    tl.store(out_ptrs, out.to(part_out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_c[None, :])
    lse_ptrs = part_lse_ptr + pid_b.to(tl.int64) * stride_lb + offs_h * stride_lh + pid_s * stride_ls
    tl.store(lse_ptrs, lse, mask=mask_h)


# ---------------------------------------------------------------------------------------------
# Stage 2: one program per (sequence, head, chunk of c) merges the splits by log-sum-exp
# ---------------------------------------------------------------------------------------------


@triton.jit
def _mla_decode_merge_kernel(
    # pointers
    part_out_ptr,  # (b, h, splits, c) fp32
    part_lse_ptr,  # (b, h, splits) fp32
    out_ptr,  # (b, h, c) in q's dtype
    lse_ptr,  # (b, h) fp32
    # sizes
    kv_lora_rank,
    num_splits,
    # strides
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh, stride_pls,
    stride_ob, stride_oh,
    stride_lb, stride_lh,
    # meta-parameters
    BLOCK_C: tl.constexpr,  # the chunk of c this program merges
    BLOCK_S: tl.constexpr,  # next_power_of_2(num_splits)
):
    # All splits' partials of the chunk are read in one (BLOCK_S, BLOCK_C) load, so every load is
    # in flight at once, and the chunks of c are separate programs, so even one sequence fills
    # the GPU. The loop over splits this replaced took 15 us at (1, 32768, 16 heads) with 128
    # splits against 2.6 us now (H200, benchmarks/results/h200-decode-merge-probe.json).
    pid_b = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    pid_c = tl.program_id(2)

    # ---- weights exp(lse_s - m), m the max over the splits so no exp overflows
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    lse_row = part_lse_ptr + pid_b * stride_plb + pid_h * stride_plh
    lse_parts = tl.load(lse_row + offs_s * stride_pls, mask=mask_s, other=float("-inf"))
    m = tl.max(lse_parts, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights exp(-inf) = 0, no NaN
    weights = tl.exp(lse_parts - m)  # (BLOCK_S,); 0 for empty and padding splits
    total = tl.sum(weights, 0)

    # ---- out = sum_s weight_s * out_s / total over this chunk of c
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < kv_lora_rank
    out_row = part_out_ptr + pid_b * stride_pob + pid_h * stride_poh
    parts = tl.load(
        out_row + offs_s[:, None] * stride_pos + offs_c[None, :], mask=mask_s[:, None] & mask_c[None, :], other=0.0
    )  # (BLOCK_S, BLOCK_C)
    acc = tl.sum(parts * weights[:, None], 0)

    nonempty = total > 0.0
    total_safe = tl.where(nonempty, total, 1.0)
    out = acc / total_safe
    tl.store(out_ptr + pid_b * stride_ob + pid_h * stride_oh + offs_c, out.to(out_ptr.dtype.element_ty), mask=mask_c)
    if pid_c == 0:
        lse = tl.where(nonempty, m + tl.log(total_safe), float("-inf"))
        tl.store(lse_ptr + pid_b * stride_lb + pid_h * stride_lh, lse)


# ---------------------------------------------------------------------------------------------
# Launch parameters
# ---------------------------------------------------------------------------------------------


def default_config(num_heads: int) -> dict:
    """The stage-1 launch parameters used unless ``_config=`` overrides them.

    ``BLOCK_H``: heads a program, the power of two >= ``num_heads`` between 16 (``tl.dot``'s
    smallest M) and 64 (beyond that the (BLOCK_H, c) fp32 accumulator no longer fits in
    registers at c = 512). ``BLOCK_N``: tokens a step. ``num_warps``, ``num_stages``: as in
    ``triton.Config``. ``PAGE_TILE``: when the page size is a multiple of ``BLOCK_N``, look the
    page up once a tile (one scalar load) instead of once a token. ``HEAD_MAJOR``: head blocks
    are the grid's fastest dimension, so the head blocks of one sequence run at the same time
    and share its tiles through L2. ``SPLIT_TAIL``: whole tiles run without token masks, the
    split's partial last tile separately. Chosen from the H200 runs (``benchmarks/NOTES.md``):
    16-head blocks ``BLOCK_N 64, 4 warps, 3 stages`` (20-30% faster than 8 warps at large
    batch); 64-head blocks ``BLOCK_N 64, 8 warps, 2 stages``; 32-head blocks (not measured)
    ``BLOCK_N 32, 8 warps, 2 stages``. For caches of
    more than 2 bytes a value ``mla_decode`` lowers stages and tile to fit shared memory.
    """
    block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
    if block_h >= 64:
        tile = {"BLOCK_H": block_h, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    elif block_h == 16:
        tile = {"BLOCK_H": block_h, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    else:
        tile = {"BLOCK_H": block_h, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    return dict(tile, PAGE_TILE=True, HEAD_MAJOR=True, SPLIT_TAIL=True)


_SHARED_MEMORY_BUDGET = 227 * 1024  # an H100/H200 block's most (3 x 64 x 576 bf16 tiles, 216 KiB, ran)


def _fit_shared_memory(config: dict, block_c: int, block_r: int, element_size: int) -> dict:
    """Fewer stages, then smaller tiles, until num_stages cache tiles fit the budget.

    Only the defaults are fitted (a ``_config`` override is taken as given): the defaults are
    tuned for 2-byte caches at c + r = 576, and fp32 or wider rows would not fit.
    """
    config = dict(config)
    tile_bytes = lambda cfg: cfg["num_stages"] * cfg["BLOCK_N"] * (block_c + block_r) * element_size  # noqa: E731
    while tile_bytes(config) > _SHARED_MEMORY_BUDGET and (config["num_stages"] > 2 or config["BLOCK_N"] > 16):
        if config["num_stages"] > 2:
            config["num_stages"] -= 1
        else:
            config["BLOCK_N"] //= 2
    return config


def choose_num_kv_splits(
    batch: int,
    heads: int,
    max_seq_len: int,
    num_sms: int,
    *,
    block_h: int | None = None,
    block_n: int | None = None,
    min_tiles_per_split: int = 4,
    max_splits: int = 128,
    programs_per_sm: int | None = None,
    one_wave: bool = False,
) -> int:
    """How many pieces to cut each sequence into so that stage 1 fills the GPU.

    Stage 1 runs ``P = batch * ceil(heads / block_h)`` programs per split.

    - Small head blocks (``block_h < 64``, the memory-bound case: a program's tile is small and
      several programs share an SM, each with its loads in flight) aim for
      ``programs_per_sm`` (2) x ``num_sms`` programs: the split count nearest to that, at
      least 1. On an H200 (64, 4096, 16) ran 102 us at 4 splits (256 programs), 125 at 8 and
      142 at 2.
    - Big head blocks (``block_h = 64``, compute bound, one program an SM): 1 if ``P`` covers
      ``num_sms``; otherwise the smallest split count ``s`` whose ``P * s`` programs keep >= 90%
      of the SMs busy over all their waves (``P*s / (ceil(P*s / num_sms) * num_sms)``; e.g.
      P = 2 on 132 SMs gives 60), or the best such use if none reaches 90%. With ``one_wave``
      (the wgmma stage 1, ``csrc/mla_decode_sm90.cu``): the most splits whose ``P * s`` programs
      fit in one wave of ``num_sms`` (P = 2 gives 66, P = 8 gives 16); measured on an H200 that
      beat both the 90% count and two full waves by 5-7% at (1, 32768) and (4, 131072)
      (``benchmarks/results/h200-decode-sm90-probe.json``).

    Either way among counts that leave every split ``min_tiles_per_split`` tiles of
    ``block_n`` tokens of the longest sequence (shorter splits spend their time starting up and
    writing partials) and no more than ``max_splits`` (the merge reads every split).

    Args:
        batch: sequences in the batch (b).
        heads: query heads (h).
        max_seq_len: the longest ``seq_lens`` entry.
        num_sms: the device's streaming multiprocessors
            (``torch.cuda.get_device_properties(d).multi_processor_count``).
        block_h, block_n: the stage-1 tile; ``default_config(heads)``'s when None.
        programs_per_sm: the small-head-block target; None: 2.
        max_splits: the cap; 128, where (1, 32768, 16) and (2, 65536, 16) ran 17-18% faster
            than at 64 once the merge read all splits in one load (eager calls on an H200,
            ``benchmarks/results/h200-decode-merge-probe.json``).
    Returns:
        An int in ``[1, max_splits]``.
    """
    config = default_config(heads)
    block_h = config["BLOCK_H"] if block_h is None else block_h
    block_n = config["BLOCK_N"] if block_n is None else block_n
    programs = batch * triton.cdiv(heads, block_h)
    if programs <= 0:
        return 1
    most = max(1, min(max_splits, max_seq_len // (min_tiles_per_split * block_n)))
    if block_h < 64:
        target = (2 if programs_per_sm is None else programs_per_sm) * num_sms
        return max(1, min(most, (target + programs // 2) // programs))  # nearest count
    if programs >= num_sms:
        return 1
    if one_wave:
        return max(1, min(most, num_sms // programs))
    best, best_use = 1, 0.0
    for splits in range(1, most + 1):
        total = programs * splits
        use = total / (triton.cdiv(total, num_sms) * num_sms)  # busy share of the SMs' waves
        if use >= 0.9:
            return splits
        if use > best_use:
            best, best_use = splits, use
    return best


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _CPU_NUM_SMS


# ---------------------------------------------------------------------------------------------
# Input checks, shared by the kernel wrapper and the reference
# ---------------------------------------------------------------------------------------------


def _check_inputs(q, kv_cache, block_table, seq_lens, kv_lora_rank, softmax_scale, num_kv_splits):
    """Raise a ValueError/TypeError naming the argument at fault; read-only."""
    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mla_decode: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"mla_decode: q must be (batch, heads, c + r), got shape {tuple(q.shape)}")
    b, h, d = q.shape
    if q.dtype not in _DTYPES:
        raise TypeError(f"mla_decode: q must be bfloat16, float16 or float32, got {q.dtype}")
    if kv_cache.dim() != 3:
        raise ValueError(
            f"mla_decode: kv_cache must be (num_blocks, block_size, c + r), got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype != q.dtype:
        raise TypeError(f"mla_decode: kv_cache must have q's dtype {q.dtype}, got {kv_cache.dtype}")
    if kv_cache.shape[2] != d:
        raise ValueError(
            f"mla_decode: kv_cache's last dim must equal q's (c + r = {d}), got {kv_cache.shape[2]}"
        )
    if kv_cache.shape[1] < 1:
        raise ValueError("mla_decode: kv_cache's block_size (dim 1) must be >= 1")
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(
            f"mla_decode: block_table must be (batch={b}, max_blocks), got shape {tuple(block_table.shape)}"
        )
    if block_table.dtype != torch.int32:
        raise TypeError(f"mla_decode: block_table must be int32, got {block_table.dtype}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != b:
        raise ValueError(f"mla_decode: seq_lens must be (batch={b},), got shape {tuple(seq_lens.shape)}")
    if seq_lens.dtype != torch.int32:
        raise TypeError(f"mla_decode: seq_lens must be int32, got {seq_lens.dtype}")
    for name, t in (("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"mla_decode: {name} is on {t.device} but q is on {q.device}")
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(f"mla_decode: {name}'s last dim must be contiguous (stride 1), got strides {t.stride()}")
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, numbers.Integral):
        raise TypeError(f"mla_decode: kv_lora_rank must be an int, got {type(kv_lora_rank).__name__}")
    if not 0 < kv_lora_rank < d:
        raise ValueError(
            f"mla_decode: kv_lora_rank must be in [1, {d - 1}] (q's last dim is c + r = {d}, r >= 1), "
            f"got {kv_lora_rank}"
        )
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"mla_decode: softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"mla_decode: softmax_scale must be finite, got {softmax_scale}")
    if num_kv_splits is not None:
        if isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, numbers.Integral):
            raise TypeError(f"mla_decode: num_kv_splits must be an int or None, got {type(num_kv_splits).__name__}")
        if not 1 <= num_kv_splits <= _MAX_GRID_YZ:
            raise ValueError(f"mla_decode: num_kv_splits must be in [1, {_MAX_GRID_YZ}], got {num_kv_splits}")
    if q.dim() == 3 and q.shape[0] > _MAX_GRID_YZ:
        raise ValueError(f"mla_decode: at most {_MAX_GRID_YZ} sequences a call (q's batch is {q.shape[0]})")


def _check_seq_lens(seq_lens, block_table, block_size) -> int:
    """Check seq_lens' values against the block table; return max(seq_lens). One host sync."""
    if seq_lens.numel() == 0:
        return 0
    lo, hi = (int(x) for x in torch.stack(torch.aminmax(seq_lens)).tolist())
    if lo < 0:
        raise ValueError(f"mla_decode: seq_lens must be >= 0, got a min of {lo}")
    capacity = block_table.shape[1] * block_size
    if hi > capacity:
        raise ValueError(
            f"mla_decode: block_table is too short: a seq_len of {hi} needs {triton.cdiv(hi, block_size)} "
            f"blocks of {block_size}, but block_table has {block_table.shape[1]} columns"
        )
    return hi


# ---------------------------------------------------------------------------------------------
# Which stage-1 kernel: the CUDA one where it applies, else Triton
# ---------------------------------------------------------------------------------------------

_CUDA_HEADS, _CUDA_C, _CUDA_R, _CUDA_TILE = 16, 512, 64, 32  # what csrc/mla_decode_sm80.cu is built for
_CUDA_SMEM_BYTES = 105_088  # its shared memory a CTA (DecodeShape::kSmemBytes; a static_assert there)
_SM90_HEADS, _SM90_TILE = 64, 64  # csrc/mla_decode_sm90.cu: heads a CTA (any count runs), tokens a tile
_SM90_SMEM_BYTES = 231_712  # its shared memory a CTA (kSmemBytes; a static_assert there)
_BACKENDS = ("triton", "cuda", "sm90")


def _cuda_stage1_unfit(q, kv_cache, block_table, seq_lens, kv_lora_rank, kernel="cuda") -> str | None:
    """None if a CUDA stage 1 can run these (checked) arguments, else why not, in words.

    ``kernel``: ``"cuda"``, csrc/mla_decode_sm80.cu (<= 16 heads, sm_80 instructions), or
    ``"sm90"``, csrc/mla_decode_sm90.cu (any heads, Hopper's wgmma: compute capability 9.0).
    """
    b, h, d = q.shape
    sm90 = kernel == "sm90"
    if q.device.type != "cuda":
        return f"q is on {q.device.type}, not a GPU"
    capability = torch.cuda.get_device_capability(q.device)
    if sm90 and capability != (9, 0):
        return f"the GPU's compute capability is {capability[0]}.{capability[1]}, not 9.0 (wgmma)"
    if capability < (8, 0):
        return "the GPU's compute capability is below 8.0 (mma.sync, cp.async)"
    props = torch.cuda.get_device_properties(q.device)
    smem = getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)
    need = _SM90_SMEM_BYTES if sm90 else _CUDA_SMEM_BYTES
    if smem < need:
        return f"the GPU allows {smem} bytes of shared memory a block, the kernel needs {need}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q is {q.dtype}, not bfloat16 or float16"
    if not sm90 and h > _CUDA_HEADS:
        return f"q has {h} heads, more than {_CUDA_HEADS}"
    if (kv_lora_rank, d - kv_lora_rank) != (_CUDA_C, _CUDA_R):
        return f"c, r = {kv_lora_rank}, {d - kv_lora_rank}, not {_CUDA_C}, {_CUDA_R}"
    tile = _SM90_TILE if sm90 else _CUDA_TILE
    if kv_cache.shape[1] % tile:
        return f"the block size {kv_cache.shape[1]} is not a multiple of {tile}"
    rows_aligned = all(st % 8 == 0 for st in (q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1)))
    if not rows_aligned or q.data_ptr() % 16 or kv_cache.data_ptr() % 16:
        return "q's or kv_cache's rows are not 16-byte aligned"
    if block_table.stride(1) != 1 or seq_lens.stride(0) != 1:
        return "block_table's rows or seq_lens are not contiguous"
    from mla.kernels.concat_cache import load_extension

    state = load_extension()
    if not state["decode_sm90" if sm90 else "decode"]:
        why = state["error"] or (
            "built without it (no nvcc, or a GPU other than compute capability 9.0 at build time)"
            if sm90 else "built without it (no nvcc, or a GPU below sm_80 at build time)"
        )
        return f"the compiled extension has no {'sm90' if sm90 else 'CUDA'} decode kernel ({why})"
    return None


_warned_cuda_fallback = False


def _pick_backend(q, kv_cache, block_table, seq_lens, kv_lora_rank, backend, config_given) -> str:
    """``"cuda"``, ``"sm90"`` or ``"triton"``: by default the CUDA stage 1 for <= 16 heads, the
    wgmma one for more, where it applies; else Triton."""
    global _warned_cuda_fallback
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"mla_decode: _backend must be None, 'triton', 'cuda' or 'sm90', got {backend!r}")
    if backend == "triton" or (backend is None and (config_given or q.device.type != "cuda")):
        return "triton"  # a _config tunes the Triton kernel, so it asks for that one
    if backend in ("cuda", "sm90") and config_given:
        raise ValueError(f"mla_decode: _config tunes the Triton kernel; it cannot go with _backend={backend!r}")
    kernel = backend or ("cuda" if q.shape[1] <= _CUDA_HEADS else "sm90")
    why_not = _cuda_stage1_unfit(q, kv_cache, block_table, seq_lens, kv_lora_rank, kernel)
    if why_not is None:
        return kernel
    if backend is not None:
        raise ValueError(f"mla_decode: _backend={backend!r} cannot run these arguments: {why_not}")
    if why_not.startswith("the compiled extension") and not _warned_cuda_fallback:
        _warned_cuda_fallback = True
        warnings.warn(f"mla.kernels.mla_decode: using the Triton kernel: {why_not}", RuntimeWarning, stacklevel=3)
    return "triton"


# ---------------------------------------------------------------------------------------------
# The wrapper: check, allocate, launch
# ---------------------------------------------------------------------------------------------


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    softmax_scale: float,
    num_kv_splits: int | None = None,
    _config: dict | None = None,
    _backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention over a paged latent cache (one new token per sequence).

    Args:
        q: (b, h, c + r), bfloat16 / float16 / float32: the absorbed query ``[q_nope · W_UK | q_pe]``
            of each sequence's one new token; the last dim contiguous.
        kv_cache: (num_blocks, block_size, c + r), q's dtype: the paged cache of ``[kv_c | k_pe]``
            rows. Key = the whole row, value = its first c values. Last dim contiguous.
        block_table: (b, max_blocks) int32: ``block_table[i, j]`` is the cache block holding
            tokens ``j*block_size ... (j+1)*block_size - 1`` of sequence i. Entries past
            ``ceil(seq_lens[i] / block_size)`` are never read.
        seq_lens: (b,) int32: cached tokens of each sequence, the new one included; 0 means the
            row sits this call out (out 0, lse -inf).
        kv_lora_rank: c; the rope dim is ``r = q.shape[-1] - c``.
        softmax_scale: multiplies q·k before the softmax.
        num_kv_splits: pieces each sequence is cut into. None: ``choose_num_kv_splits`` picks
            from the batch, heads, ``max(seq_lens)`` and the SM count, which reads seq_lens on
            the host (one sync, and seq_lens' values are checked against block_table then).
            Give it to launch without a host sync (e.g. inside a CUDA graph); seq_lens' values
            are then trusted on a GPU (still checked on the CPU, where that costs nothing).
        _config: private tuning hook for benchmarks: any of ``BLOCK_H``, ``BLOCK_N``,
            ``num_warps``, ``num_stages``, ``PAGE_TILE``, ``HEAD_MAJOR``, ``SPLIT_TAIL`` (see
            ``default_config``) of the Triton kernel, which it selects.
        _backend: private hook for benchmarks and tests: ``"triton"``, ``"cuda"`` (the sm_80 kernel:
            <= 16 heads, pages of a multiple of 32) or ``"sm90"`` (the wgmma kernel: compute
            capability 9.0, pages of a multiple of 64) forces that stage-1 kernel (a CUDA one
            raises a ValueError saying why when it cannot run the arguments; with ``_config``, which
            only the Triton kernel takes, a ValueError too); None picks ``"cuda"`` for <= 16 heads
            and ``"sm90"`` for more where each applies, else Triton (see the module docstring).

    Returns:
        out: (b, h, c) in q's dtype, ``softmax(scores) @ value``.
        lse: (b, h) float32, ``log(sum(exp(scores)))`` in natural log, -inf for an empty row.
    """
    _check_inputs(q, kv_cache, block_table, seq_lens, kv_lora_rank, softmax_scale, num_kv_splits)
    b, h, d = q.shape
    c, r = kv_lora_rank, d - kv_lora_rank
    block_size = kv_cache.shape[1]
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "mla_decode: q is on the CPU, which Triton runs only in its interpreter; set "
            "TRITON_INTERPRET=1 before triton is imported (mla.kernels does so when no GPU is visible)"
        )
    config = _fit_shared_memory(
        default_config(h), max(16, triton.next_power_of_2(c)), max(16, triton.next_power_of_2(r)), q.element_size()
    )
    if _config:
        unknown = set(_config) - set(config)
        if unknown:
            raise ValueError(f"mla_decode: unknown _config keys {sorted(unknown)}; known: {sorted(config)}")
        config.update(_config)

    backend = _pick_backend(q, kv_cache, block_table, seq_lens, c, _backend, bool(_config))
    block_h, block_n = {"cuda": (_CUDA_HEADS, _CUDA_TILE), "sm90": (_SM90_HEADS, _SM90_TILE)}.get(
        backend, (config["BLOCK_H"], config["BLOCK_N"])
    )

    if num_kv_splits is None or q.device.type == "cpu":
        max_seq_len = _check_seq_lens(seq_lens, block_table, block_size)
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(
            b, h, max_seq_len, _num_sms(q.device), block_h=block_h, block_n=block_n, one_wave=backend == "sm90"
        )

    out = torch.empty((b, h, c), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h), dtype=torch.float32, device=q.device)
    if b == 0 or h == 0:
        return out, lse

    if backend != "triton":  # csrc/mla_decode_sm80.cu, _sm90.cu
        stage1 = torch.ops.mla.mla_decode_sm80 if backend == "cuda" else torch.ops.mla.mla_decode_sm90
        if num_kv_splits == 1:  # stage 1 writes the answer (out in q's dtype, lse); no merge
            stage1(q, kv_cache, block_table, seq_lens, out.unsqueeze(2), lse.unsqueeze(2), float(softmax_scale), 1)
            return out, lse
        part_out = torch.empty((b, h, num_kv_splits, c), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b, h, num_kv_splits), dtype=torch.float32, device=q.device)
        stage1(q, kv_cache, block_table, seq_lens, part_out, part_lse, float(softmax_scale), num_kv_splits)
        _merge(part_out, part_lse, out, lse)
        return out, lse

    if num_kv_splits == 1:  # stage 1 writes the answer; no workspace, no merge
        part_out, part_lse = out, lse
        part_out_strides = (out.stride(0), out.stride(1), 0)
        part_lse_strides = (lse.stride(0), lse.stride(1), 0)
    else:
        part_out = torch.empty((b, h, num_kv_splits, c), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b, h, num_kv_splits), dtype=torch.float32, device=q.device)
        part_out_strides = part_out.stride()[:3]
        part_lse_strides = part_lse.stride()

    block_c, block_r = max(16, triton.next_power_of_2(c)), max(16, triton.next_power_of_2(r))
    head_major = bool(config["HEAD_MAJOR"])
    grid = (triton.cdiv(h, block_h), b, num_kv_splits) if head_major else (b, triton.cdiv(h, block_h), num_kv_splits)
    _mla_decode_split_kernel[grid](
        q, kv_cache, block_table, seq_lens, part_out, part_lse,
        h, c, r, block_size, num_kv_splits, float(softmax_scale) * _LOG2E,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0), block_table.stride(1),
        seq_lens.stride(0),
        *part_out_strides,
        *part_lse_strides,
        BLOCK_H=block_h,
        BLOCK_N=config["BLOCK_N"],
        BLOCK_C=block_c,
        BLOCK_R=block_r,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PAGE_TILE=bool(config["PAGE_TILE"]) and block_size % config["BLOCK_N"] == 0,
        EXACT=(block_c == c and block_r == r),
        HEAD_MAJOR=head_major,
        SPLIT_TAIL=bool(config["SPLIT_TAIL"]),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    if num_kv_splits > 1:
        _merge(part_out, part_lse, out, lse)
    return out, lse


def _merge(part_out, part_lse, out, lse) -> None:
    """Stage 2: out, lse <- the (b, h, splits, c) partials and (b, h, splits) log-sum-exps."""
    b, h, num_kv_splits, c = part_out.shape
    block_s = triton.next_power_of_2(num_kv_splits)
    merge_block_c = max(16, min(triton.next_power_of_2(c), _MERGE_TILE // block_s))  # <= 4096 partials a program
    _mla_decode_merge_kernel[(b, h, triton.cdiv(c, merge_block_c))](
        part_out, part_lse, out, lse,
        c, num_kv_splits,
        *part_out.stride()[:3],
        *part_lse.stride(),
        out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        BLOCK_C=merge_block_c,
        BLOCK_S=block_s,
        num_warps=4,
    )


# ---------------------------------------------------------------------------------------------
# The reference: plain torch, one sequence at a time, in float64
# ---------------------------------------------------------------------------------------------


def mla_decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    softmax_scale: float,
    num_kv_splits: int | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_decode``'s arguments and results, computed by gathering each sequence's pages.

    ``num_kv_splits`` is accepted and ignored (splitting does not change the math).
    ``compute_dtype`` (float64 by default) is what the scores and softmax are computed in; tests
    of large shapes on a GPU may pass float32 to keep it fast. Returns out in q's dtype and lse
    in float32, like the kernel.
    """
    _check_inputs(q, kv_cache, block_table, seq_lens, kv_lora_rank, softmax_scale, num_kv_splits)
    b, h, d = q.shape
    c = kv_lora_rank
    block_size = kv_cache.shape[1]
    _check_seq_lens(seq_lens, block_table, block_size)
    out = torch.zeros((b, h, c), dtype=compute_dtype, device=q.device)
    lse = torch.full((b, h), float("-inf"), dtype=compute_dtype, device=q.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        pages = block_table[i, : triton.cdiv(seq_len, block_size)].long()
        latent = kv_cache[pages[pos // block_size], pos % block_size].to(compute_dtype)  # (t, c+r)
        # scores_{ht} = scale * sum_d q_{hd} latent_{td}
        scores = torch.einsum("hd,td->ht", q[i].to(compute_dtype), latent) * softmax_scale
        lse[i] = torch.logsumexp(scores, dim=-1)
        # out_{hc} = sum_t softmax(scores)_{ht} latent_{tc}
        out[i] = torch.einsum("ht,tc->hc", torch.softmax(scores, dim=-1), latent[:, :c])
    return out.to(q.dtype), lse.to(torch.float32)
