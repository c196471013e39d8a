"""The Triton split-KV decode kernels of Multi-head Latent Attention, as a lesson.

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
2. Fill the GPU when the batch is small. The sequence is cut into ``num_splits`` pieces, each
   its own program (split-KV, "flash decoding"); a second, small kernel merges the pieces by
   log-sum-exp. With one split, stage 1 writes the result directly and no merge runs.
3. Paged cache. Token ``pos`` of sequence ``i`` lives in page ``block_table[i, pos // page]`` at
   row ``pos % page``. When the page size is a multiple of ``BLOCK_N`` a tile lies inside one
   page: one block-table load a tile, a contiguous 2-D tile load (``PAGE_TILE``); otherwise the
   page is looked up per token, so a tile may span pages and any page size >= 1 works. Nothing
   outside a sequence's pages is read: tokens past ``seq_len`` and block-table entries past
   ``ceil(seq_len / page)`` are masked loads. Page offsets are int64, so caches beyond 2^31
   elements work. The entries inside ``seq_len`` are trusted: ``mla_decode`` checks them.
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

Stage 2, one program per (sequence, head, chunk of c)::

    lse = logsumexp_s(partial_lse[s]);  out = sum_s exp(partial_lse[s] - lse) * partial_out[s]

The exponentials run in base 2 (``exp2``, the cheap instruction), with the scale folded into
``softmax_scale * log2(e)``; the lse is turned back into natural log on the way out.

``mla.kernels.decode`` checks the arguments, chooses the split count and the launch parameters
and launches these kernels; ``docs/derivations/split-kv.md`` derives the merge and the split rule.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e)); the launcher folds it into the scale


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
    # ---- where each token of the tile lives: its page (through the block table) and row
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

    # ---- one load of the latent tile: the nope part is both key and value
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

    # ---- scores, (BLOCK_H, BLOCK_N), in log2 units; tokens past the split are -inf
    s = tl.dot(q_nope, tl.trans(kv_nope), input_precision=DOT_PRECISION)
    s = tl.dot(q_pe, tl.trans(kv_pe), s, input_precision=DOT_PRECISION)
    if MASK_N:
        s = tl.where(mask_n[None, :], s * scale_log2, float("-inf"))
    else:
        s = s * scale_log2

    # ---- online softmax update; every tile holds >= 1 real token, so m_new is finite
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
    lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # x ln(2)

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
    # the GPU: 2.6 us at (1, 32768, 16 heads) with 128 splits on an H200, where a loop over the
    # splits takes 15 us (benchmarks/lab/results/h200-decode-merge-probe.json).
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


