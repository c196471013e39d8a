"""The Triton split-KV decode kernels of Multi-head Latent Attention, as a lesson.

In the absorbed form, MLA decode is multi-query attention over the latent cache: every head of a
sequence attends to the same cached rows ``[kv_c | k_pe]`` (c + r values a token), the key is the
whole row and the value is its first c values. One decode step of one sequence, for h heads:

    scores[h, t] = softmax_scale * (q_lat[h] . kv_c[t] + q_pe[h] . k_pe[t])     (b, h, t)
    out[h]       = sum_t softmax(scores[h])[t] * kv_c[t]                         (b, h, c)
    lse[h]       = log sum_t exp(scores[h, t])                                   (b, h)

With s_q new tokens a sequence (speculative decoding, multi-token prediction) the cache already
holds all of them, and new token j attends causally: it sees the first
``seq_len - (s_q - 1 - j)`` cached rows (the last token sees them all). The kernel treats the
s_q x h (token, head) pairs as s_q x h query rows of the same multi-query attention, each with
its own number of rows it sees; one new token (s_q = 1) is the case above.

Goals, in the order they shape the code:

1. Read the cache once. Decode is memory bound at few heads (16 a GPU under tensor parallelism)
   and compute bound at many (128), so a program takes up to 64 query rows (``BLOCK_H``) and
   reads each latent tile once for all of them, and the value is the nope part of that same
   tile: no second load. The rows are (token, head) pairs, token-major, so s_q new tokens share
   each tile load too and fill the tile at few heads. Rows past s_q x h (h = 1, 3, 20, ...) are
   padding, masked.
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
5. fp8 caches ("fp8_e4m3", "fp8_ds_mla"; ``mla.kernels.fp8``) arrive as bytes and are
   converted to q's dtype in registers as each tile is loaded. "fp8_e4m3"'s one scale
   multiplies the scores and the output once instead of every value.

Blocked pseudo-code of stage 1, one program per (sequence i, block of query rows, split); the
query row at index j * h + k is new token j's head k, and sees ``row_len = seq_len - (s_q - 1 -
j)`` cached rows:

    q_nope, q_pe = q[i, rows, :c], q[i, rows, c:]                    (BLOCK_H, c), (BLOCK_H, r)
    m, l, acc = -inf, 0, 0                                           (BLOCK_H,), (BLOCK_H, c)
    for each tile of BLOCK_N positions pos in this split:
        page, row = block_table[i, pos // page_size], pos % page_size
        kv_nope, kv_pe = cache[page, row, :c], cache[page, row, c:]  (BLOCK_N, c), (BLOCK_N, r)
        s = (q_nope @ kv_nope^T + q_pe @ kv_pe^T) * scale            (BLOCK_H, BLOCK_N)
        s = -inf where pos >= row_len                                (causal among new tokens)
        m_new = max(m, rowmax(s));  p = exp(s - m_new)
        l   = l * exp(m - m_new) + rowsum(p)
        acc = acc * exp(m - m_new) + p @ kv_nope                     (value = the nope part)
        m = m_new
    partial_out = acc / l ;  partial_lse = m + log(l)                (-inf for an empty split)

Only the split's last tiles can hold positions some row does not see (the causal limits differ
from ``seq_len`` by at most s_q - 1), so the tiles before them run without masks.

Stage 2, one program per (sequence, query row, chunk of c), over the splits k::

    lse = logsumexp_k(partial_lse[k]);  out = sum_k exp(partial_lse[k] - lse) * partial_out[k]

The exponentials run in base 2 (``exp2``, the cheap instruction), with the scale folded into
``softmax_scale * log2(e)``; the lse is turned back into natural log on the way out.

``mla.kernels.decode`` checks the arguments, chooses the split count and the launch parameters
and launches these kernels; ``docs/derivations/split-kv.md`` derives the merge and the split rule.
"""

import triton
import triton.language as tl


# ---------------------------------------------------------------------------------------------
# Reading fp8 cache rows: bytes to values in registers
# ---------------------------------------------------------------------------------------------
# An fp8 cache reaches the kernel as bytes (uint8), converted one of three ways (``E4M3``):
# 0, in hardware (sm_89 and later, two values an instruction); 1, Triton's interpreter, whose
# conversion reads 0x7F and 0xFF as +-480 where float8_e4m3fn has NaN, so those two bytes are set
# to NaN after it; 2, in integer ops, for GPUs without the conversion (sm_80, sm_86). The ds_mla
# layout's float32 scales and bf16 rope values are read through pointers of their own type:
# every offset in the row is a multiple of their size.
E4M3_HARDWARE, E4M3_INTERPRETER, E4M3_INTEGER_OPS = 0, 1, 2


@triton.jit
def _e4m3_to(byte, dtype: tl.constexpr, E4M3: tl.constexpr):
    """float8_e4m3fn bytes (uint8, any shape) -> their values in ``dtype``, exactly (every e4m3
    value, the subnormals m * 2^-9 included, is a bf16, fp16 and fp32 value)."""
    if E4M3 == 2:
        value = _e4m3_to_float32_by_integer_ops(byte).to(dtype)
    else:
        value = byte.to(tl.float8e4nv, bitcast=True).to(dtype)
        if E4M3 == 1:
            value = tl.where((byte & 0x7F) == 0x7F, float("nan"), value)
    return value


@triton.jit
def _e4m3_to_float32_by_integer_ops(byte):
    """float8_e4m3fn bytes -> float32: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 0 holds the subnormals m * 2^-9, and 0x7F / 0xFF are NaN (no infinities)."""
    bits = byte.to(tl.int32)
    mag = bits & 0x7F
    # a normal value 2^(e-7) (1 + m/8) is the float32 with exponent field e + 120 and the 3
    # mantissa bits on top of float32's 23: (e << 23 | m << 20) + (120 << 23)
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    subnormal = (mag & 0x7).to(tl.float32) * 0.001953125  # m * 2^-9
    value = tl.where((mag >> 3) == 0, subnormal, normal)
    value = tl.where(mag == 0x7F, float("nan"), value)
    return tl.where((bits & 0x80) != 0, -value, value)


@triton.jit
def _load_bytes(ptrs, mask, MASKED: tl.constexpr):
    """``tl.load(ptrs)``, masked-off entries 0 when ``MASKED``."""
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0)
    else:
        return tl.load(ptrs)


@triton.jit
def _load_fp8_tile(
    kv_rows, mask_n, offs_c, offs_r, kv_lora_rank, rope_dim, rope_offset, dtype: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, KV_FORMAT: tl.constexpr, E4M3: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The (BLOCK_N, BLOCK_C) latent and (BLOCK_N, BLOCK_R) rope values of fp8 cache rows
    (byte pointers ``kv_rows`` (BLOCK_N, 1)), in ``dtype`` (q's). ``MASKED``: tokens off
    ``mask_n`` and columns past c and r read 0; else every token and column is read.

    KV_FORMAT 1, "fp8_e4m3": bytes [0, c + r) are e4m3 values; the cache's one scale is left
    out here (the caller folds it into the softmax scale and the output), so they convert
    exactly.
    KV_FORMAT 2, "fp8_ds_mla": bytes [0, c) are e4m3, each times the float32 scale of its group
    of 128 at bytes [c + 4g, c + 4g + 4) (the product in float32, rounded once to ``dtype``);
    the rope values are bfloat16 from byte ``rope_offset`` (c + 4·c/128).
    """
    mask_nope = mask_n[:, None] & (offs_c < kv_lora_rank)[None, :]
    mask_pe = mask_n[:, None] & (offs_r < rope_dim)[None, :]
    nope_bytes = _load_bytes(kv_rows + offs_c[None, :], mask_nope, MASKED)
    if KV_FORMAT == 1:
        kv_nope = _e4m3_to(nope_bytes, dtype, E4M3)
        kv_pe = _e4m3_to(_load_bytes(kv_rows + rope_offset + offs_r[None, :], mask_pe, MASKED), dtype, E4M3)
    else:
        # one scale per (token, group of 128): (BLOCK_N, BLOCK_C / 128), broadcast over the group
        GROUPS: tl.constexpr = BLOCK_C // 128
        offs_g = tl.arange(0, GROUPS)
        scale_ptrs = (kv_rows + kv_lora_rank).to(tl.pointer_type(tl.float32)) + offs_g[None, :]
        scale = _load_bytes(scale_ptrs, mask_n[:, None] & (offs_g * 128 < kv_lora_rank)[None, :], MASKED)
        kv_nope = _e4m3_to(nope_bytes, tl.float32, E4M3)
        kv_nope = tl.reshape(tl.reshape(kv_nope, (BLOCK_N, GROUPS, 128)) * scale[:, :, None], (BLOCK_N, BLOCK_C))
        kv_nope = kv_nope.to(dtype)
        rope_ptrs = (kv_rows + rope_offset).to(tl.pointer_type(tl.bfloat16)) + offs_r[None, :]
        kv_pe = _load_bytes(rope_ptrs, mask_pe, MASKED).to(dtype)
    return kv_nope, kv_pe


# ---------------------------------------------------------------------------------------------
# Stage 1: one program per (sequence, head block, split)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _mla_decode_tile(
    q_nope, q_pe, m_i, l_i, acc,
    kv_ptr, block_table_row, start_n, split_end, row_end,
    kv_lora_rank, rope_dim, rope_offset, page_size, scale_log2,
    stride_kvp, stride_kvn, stride_btp,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,  # 0: rows in q's dtype; 1: "fp8_e4m3"; 2: "fp8_ds_mla" (bytes)
    E4M3: tl.constexpr,  # how e4m3 bytes convert: E4M3_HARDWARE, _INTERPRETER, _INTEGER_OPS
    PAGE_TILE: tl.constexpr,  # page_size % BLOCK_N == 0: the tile lies inside one page
    MASK_N: tl.constexpr,  # a tile of the split's tail: tokens past split_end, and past each
    # query row's own end row_end (BLOCK_H,), are masked
    EXACT: tl.constexpr,  # c == BLOCK_C and r == BLOCK_R: no column masks
):
    """One BLOCK_N-token step of the online softmax; returns the new (m_i, l_i, acc).

    ``row_end`` (BLOCK_H,): the position each query row stops at, ``min(its row_len,
    split_end)``; read only when ``MASK_N``.
    """
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

    # ---- one load of the latent tile: the nope part is both key and value. An fp8 tile is
    # converted to q's dtype in registers for the dots
    if KV_FORMAT != 0:
        kv_nope, kv_pe = _load_fp8_tile(
            kv_rows, mask_n, offs_c, offs_r, kv_lora_rank, rope_dim, rope_offset, q_nope.dtype,
            BLOCK_N, BLOCK_C, KV_FORMAT, E4M3, MASK_N or not EXACT,
        )
    elif MASK_N:
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

    # ---- scores, (BLOCK_H, BLOCK_N), in log2 units; positions a row does not see are -inf
    s = tl.dot(q_nope, tl.trans(kv_nope), input_precision=DOT_PRECISION)
    s = tl.dot(q_pe, tl.trans(kv_pe), s, input_precision=DOT_PRECISION)
    if MASK_N:
        s = tl.where(offs_n[None, :] < row_end[:, None], s * scale_log2, float("-inf"))
    else:
        s = s * scale_log2

    # ---- online softmax update. An unmasked tile is seen whole by every row, so m_new is
    # finite; in a masked one a row whose end lies at or before the split's start has seen
    # nothing (m_new = -inf), and its exponents are taken against 0 instead: p = 0 and
    # alpha = 0 rather than the NaN of exp2(-inf - -inf)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASK_N:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(kv_nope.dtype), kv_nope, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _mla_decode_split_kernel(
    # pointers
    q_ptr,  # (b, s_q, h, c + r)
    kv_ptr,  # (num_pages, page_size, c + r) in q's dtype, or (num_pages, page_size, width) bytes
    kv_scale_ptr,  # (1,) float32, the "fp8_e4m3" scale; not read for the other formats
    block_table_ptr,  # (b, max_pages) int32
    seq_lens_ptr,  # (b,) int32
    part_out_ptr,  # (b, s_q * h, splits, c) fp32 workspace, or out (b, s_q * h, c) when splits == 1
    part_lse_ptr,  # (b, s_q * h, splits) fp32 workspace, or lse (b, s_q * h) when splits == 1
    # sizes
    num_heads,  # h
    num_q_tokens,  # s_q, new tokens a sequence
    kv_lora_rank,  # c
    rope_dim,  # r
    rope_offset,  # where a row's rope part starts: c, or c + 4·c/128 bytes for "fp8_ds_mla"
    page_size,
    num_splits,
    scale_log2,  # softmax_scale * log2(e)
    # strides
    stride_qb, stride_qs, stride_qh,
    stride_kvp, stride_kvn,  # page, token within the page (the last dim is contiguous)
    stride_btb, stride_btp,
    stride_slb,
    stride_ob, stride_om, stride_os,  # sequence, query row (token-major (token, head)), split
    stride_lb, stride_lm, stride_ls,
    # meta-parameters
    BLOCK_H: tl.constexpr,  # query rows a program: (token, head) pairs
    BLOCK_N: tl.constexpr,  # tokens a step
    BLOCK_C: tl.constexpr,  # next_power_of_2(c)
    BLOCK_R: tl.constexpr,  # next_power_of_2(r), at least 16 (tl.dot's smallest K)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding), else "tf32"
    PAGE_TILE: tl.constexpr,  # page_size % BLOCK_N == 0: one block-table load a tile
    EXACT: tl.constexpr,  # c == BLOCK_C and r == BLOCK_R
    HEAD_MAJOR: tl.constexpr,  # grid (row blocks, b, splits) rather than (b, row blocks, splits)
    SPLIT_TAIL: tl.constexpr,  # whole tiles unmasked, then the tail; else every tile masked
    KV_FORMAT: tl.constexpr,  # 0: rows in q's dtype; 1: "fp8_e4m3"; 2: "fp8_ds_mla"
    E4M3: tl.constexpr,  # how e4m3 bytes convert: E4M3_HARDWARE, _INTERPRETER, _INTEGER_OPS
):
    # row blocks vary fastest (HEAD_MAJOR), so the programs that share a sequence's cache run
    # side by side and the second row block finds the tiles in L2
    if HEAD_MAJOR:
        pid_h = tl.program_id(0)
        pid_b = tl.program_id(1)
    else:
        pid_b = tl.program_id(0)
        pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)

    # ---- the program's query rows: index j * h + k is new token j's head k; new token j of s_q
    # sees the first seq_len - (s_q - 1 - j) cached rows (row_len; <= 0: none)
    offs_m = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    token = offs_m // num_heads
    head = offs_m % num_heads
    mask_m = offs_m < num_q_tokens * num_heads
    seq_len = tl.load(seq_lens_ptr + pid_b * stride_slb)
    row_len = seq_len - (num_q_tokens - 1 - token)  # (BLOCK_H,)

    # ---- this split's token range: whole BLOCK_N tiles, the last split may be short or empty.
    # Every row sees the positions before seq_len - (s_q - 1): the whole tiles below that run
    # unmasked, the rest of the split (at most two tiles more) runs masked
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    split_start = pid_s * tiles_per_split * BLOCK_N
    split_end = tl.maximum(tl.minimum(split_start + tiles_per_split * BLOCK_N, seq_len), split_start)
    seen_by_all = tl.maximum(tl.minimum(split_end, seq_len - (num_q_tokens - 1)), split_start)
    full_end = split_start + ((seen_by_all - split_start) // BLOCK_N) * BLOCK_N  # end of whole tiles
    row_end = tl.minimum(row_len, split_end)  # (BLOCK_H,) where each row stops in this split

    # ---- the query of BLOCK_H rows, as its nope (latent) part and its rope part
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_c = offs_c < kv_lora_rank
    mask_r = offs_r < rope_dim
    q_rows = q_ptr + pid_b.to(tl.int64) * stride_qb + token[:, None] * stride_qs + head[:, None] * stride_qh
    q_nope = tl.load(q_rows + offs_c[None, :], mask=mask_m[:, None] & mask_c[None, :], other=0.0)
    q_pe = tl.load(
        q_rows + kv_lora_rank + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0
    )

    # ---- online softmax over the split, fp32 statistics: whole tiles unmasked, then the tail
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)  # running sum of p * value
    block_table_row = block_table_ptr + pid_b.to(tl.int64) * stride_btb
    # an "fp8_e4m3" cache holds values / kv_scale: the scores and the output take the scale
    # whole, once, rather than every value of every tile
    if KV_FORMAT == 1:
        kv_scale = tl.load(kv_scale_ptr)
        scale_log2 = scale_log2 * kv_scale
    else:
        kv_scale = 1.0
    if SPLIT_TAIL:
        tail_start = full_end
    else:
        tail_start = split_start
    for start_n in range(split_start, tail_start, BLOCK_N):
        m_i, l_i, acc = _mla_decode_tile(
            q_nope, q_pe, m_i, l_i, acc, kv_ptr, block_table_row, start_n, split_end, row_end,
            kv_lora_rank, rope_dim, rope_offset, page_size, scale_log2, stride_kvp, stride_kvn,
            stride_btp, BLOCK_N, BLOCK_C, BLOCK_R, DOT_PRECISION, KV_FORMAT, E4M3, PAGE_TILE, False, EXACT,
        )
    for start_n in range(tail_start, split_end, BLOCK_N):
        m_i, l_i, acc = _mla_decode_tile(
            q_nope, q_pe, m_i, l_i, acc, kv_ptr, block_table_row, start_n, split_end, row_end,
            kv_lora_rank, rope_dim, rope_offset, page_size, scale_log2, stride_kvp, stride_kvn,
            stride_btp, BLOCK_N, BLOCK_C, BLOCK_R, DOT_PRECISION, KV_FORMAT, E4M3, PAGE_TILE, True, EXACT,
        )

    # ---- normalise and write; an empty split (l = 0) writes zeros and lse = -inf. A NaN score
    # makes l NaN, which is not 0: out and lse are NaN, as the reference's are. The scale comes
    # last: acc / l is a value's size, where kv_scale / l of a scale near 2^-126 is subnormal
    nonempty = l_i != 0.0
    l_safe = tl.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None] * kv_scale
    lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # x ln(2)

    out_ptrs = (
        part_out_ptr
        + pid_b.to(tl.int64) * stride_ob
        + offs_m[:, None] * stride_om
        + pid_s * stride_os
        + offs_c[None, :]
    )
    tl.store(out_ptrs, out.to(part_out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_c[None, :])
    lse_ptrs = part_lse_ptr + pid_b.to(tl.int64) * stride_lb + offs_m * stride_lm + pid_s * stride_ls
    tl.store(lse_ptrs, lse, mask=mask_m)


# ---------------------------------------------------------------------------------------------
# Stage 2: one program per (sequence, query row, chunk of c) merges the splits by log-sum-exp
# ---------------------------------------------------------------------------------------------


@triton.jit
def _mla_decode_merge_kernel(
    # pointers
    part_out_ptr,  # (b, s_q * h, splits, c) fp32
    part_lse_ptr,  # (b, s_q * h, splits) fp32
    out_ptr,  # (b, s_q * h, c) in q's dtype
    lse_ptr,  # (b, s_q * h) fp32
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
    # the GPU (timings against a loop over the splits: docs/derivations/split-kv.md).
    pid_b = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)  # query row: (token, head)
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

    nonempty = total != 0.0  # a NaN partial lse makes total NaN: out and lse stay NaN
    total_safe = tl.where(nonempty, total, 1.0)
    out = acc / total_safe
    tl.store(out_ptr + pid_b * stride_ob + pid_h * stride_oh + offs_c, out.to(out_ptr.dtype.element_ty), mask=mask_c)
    if pid_c == 0:
        lse = tl.where(nonempty, m + tl.log(total_safe), float("-inf"))
        tl.store(lse_ptr + pid_b * stride_lb + pid_h * stride_lh, lse)


# ---------------------------------------------------------------------------------------------
# Stage 2 after dealt pieces: one program per (sequence, BLOCK_R query rows, chunk of c) merges
# the slots of a sequence that spans several pieces; two forms, for many slots and for few
# ---------------------------------------------------------------------------------------------


@triton.jit
def _mla_decode_merge_dealt_kernel(
    # pointers
    part_out_ptr,  # (b + pieces - 1, s_q * h, c) fp32: slot i + z holds piece z's part of sequence i
    part_lse_ptr,  # (b + pieces - 1, s_q * h) fp32
    ranges_ptr,  # (b, 2) int32: each sequence's first slot and its pieces
    out_ptr,  # (b, s_q * h, c) in q's dtype
    lse_ptr,  # (b, s_q * h) fp32
    # sizes
    num_rows,  # query rows a sequence: s_q * h
    kv_lora_rank,
    # strides
    stride_pos, stride_poh,
    stride_pls, stride_plh,
    stride_ob, stride_oh,
    stride_lb, stride_lh,
    # meta-parameters
    BLOCK_R: tl.constexpr,  # query rows this program merges, one after another
    BLOCK_C: tl.constexpr,  # the chunk of c this program merges
    BLOCK_S: tl.constexpr,  # slots read at a time
):
    # A sequence whole in one piece was written by stage 1 itself (its count is 1). The others'
    # slots are consecutive; they are read BLOCK_S at a time, as one (BLOCK_S, BLOCK_C) tile
    # summed across threads, with a running maximum, since a sequence may span any number of
    # pieces.
    pid_b = tl.program_id(0).to(tl.int64)
    pid_r = tl.program_id(1)  # a block of query rows: (token, head) pairs
    pid_c = tl.program_id(2)
    first = tl.load(ranges_ptr + 2 * pid_b)
    count = tl.load(ranges_ptr + 2 * pid_b + 1)
    if count > 1:
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_c = offs_c < kv_lora_rank
        for pid_h in range(pid_r * BLOCK_R, tl.minimum(pid_r * BLOCK_R + BLOCK_R, num_rows)):
            # m: the largest lse so far; acc, total: sum_s weight_s * out_s and sum_s weight_s, the
            # weights exp(lse_s - m) (m taken as 0 while every slot so far is empty: no NaN)
            m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
            total = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
            acc = tl.zeros([BLOCK_C], tl.float32)
            for s0 in range(0, count, BLOCK_S):
                offs_s = s0 + tl.arange(0, BLOCK_S)
                mask_s = offs_s < count
                slots = (first + offs_s).to(tl.int64)
                lse_parts = tl.load(part_lse_ptr + slots * stride_pls + pid_h * stride_plh, mask=mask_s,
                                    other=float("-inf"))
                m_new = tl.maximum(m, tl.max(lse_parts, 0))
                ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                rescale = tl.exp(tl.where(m == float("-inf"), float("-inf"), m - ref))  # 0 before any weight
                weights = tl.exp(lse_parts - ref)  # (BLOCK_S,); 0 for empty and padding slots
                parts = tl.load(part_out_ptr + slots[:, None] * stride_pos + pid_h * stride_poh + offs_c[None, :],
                                mask=mask_s[:, None] & mask_c[None, :], other=0.0)  # (BLOCK_S, BLOCK_C)
                acc = acc * rescale + tl.sum(parts * weights[:, None], 0)
                total = total * rescale + tl.sum(weights, 0)
                m = m_new
            ref = tl.where(m == float("-inf"), 0.0, m)
            nonempty = total != 0.0  # a NaN partial lse makes total NaN: out and lse stay NaN
            total_safe = tl.where(nonempty, total, 1.0)
            out = acc / total_safe
            tl.store(out_ptr + pid_b * stride_ob + pid_h * stride_oh + offs_c, out.to(out_ptr.dtype.element_ty),
                     mask=mask_c)
            if pid_c == 0:
                lse = tl.where(nonempty, ref + tl.log(total_safe), float("-inf"))
                tl.store(lse_ptr + pid_b * stride_lb + pid_h * stride_lh, lse)


@triton.jit
def _mla_decode_merge_dealt_rows_kernel(
    # pointers, sizes and strides as _mla_decode_merge_dealt_kernel's
    part_out_ptr, part_lse_ptr, ranges_ptr, out_ptr, lse_ptr,
    num_rows, kv_lora_rank,
    stride_pos, stride_poh,
    stride_pls, stride_plh,
    stride_ob, stride_oh,
    stride_lb, stride_lh,
    # meta-parameters
    BLOCK_R: tl.constexpr,  # query rows this program merges, together
    BLOCK_C: tl.constexpr,  # the chunk of c this program merges
    BLOCK_S: tl.constexpr,  # slots loaded at a time
):
    # The same merge for sequences over few slots: the BLOCK_R rows go together and the slots one
    # by one. First each row's largest lse over the sequence's slots, then the slots BLOCK_S at a
    # time, each its own (BLOCK_R, BLOCK_C) load, unrolled so that the BLOCK_S loads are in flight
    # together and the sum over slots stays in each thread's registers.
    pid_b = tl.program_id(0).to(tl.int64)
    pid_r = tl.program_id(1)  # a block of query rows: (token, head) pairs
    pid_c = tl.program_id(2)
    first = tl.load(ranges_ptr + 2 * pid_b)
    count = tl.load(ranges_ptr + 2 * pid_b + 1)
    if count > 1:
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_r = offs_r < num_rows
        mask_c = offs_c < kv_lora_rank
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        for s0 in range(0, count, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            lse_parts = tl.load(part_lse_ptr + (first + offs_s).to(tl.int64)[:, None] * stride_pls
                                + offs_r[None, :] * stride_plh, mask=(offs_s < count)[:, None] & mask_r[None, :],
                                other=float("-inf"))  # (BLOCK_S, BLOCK_R)
            m = tl.maximum(m, tl.max(lse_parts, 0))
        ref = tl.where(m == float("-inf"), 0.0, m)  # every slot empty: weights 0 against 0, no NaN
        # acc, total: sum_s weight_s * out_s and sum_s weight_s, the weights exp(lse_s - ref); an
        # empty or padding slot weighs 0, a NaN lse makes total NaN (out and lse stay NaN)
        acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
        total = tl.zeros([BLOCK_R], tl.float32)
        for s0 in range(0, count, BLOCK_S):
            for k in tl.static_range(BLOCK_S):
                ok = offs_r < tl.where(s0 + k < count, num_rows, 0)  # no row of a padding slot
                slot = (first + s0 + k).to(tl.int64)
                weight = tl.exp(tl.load(part_lse_ptr + slot * stride_pls + offs_r * stride_plh, mask=ok,
                                        other=float("-inf")) - ref)  # (BLOCK_R,)
                part = tl.load(part_out_ptr + slot * stride_pos + offs_r[:, None] * stride_poh + offs_c[None, :],
                               mask=ok[:, None] & mask_c[None, :], other=0.0)  # (BLOCK_R, BLOCK_C)
                acc += part * weight[:, None]
                total += weight
        nonempty = total != 0.0
        total_safe = tl.where(nonempty, total, 1.0)
        tl.store(out_ptr + pid_b * stride_ob + offs_r[:, None] * stride_oh + offs_c[None, :],
                 (acc / total_safe[:, None]).to(out_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_c[None, :])
        if pid_c == 0:
            lse = tl.where(nonempty, ref + tl.log(total_safe), float("-inf"))
            tl.store(lse_ptr + pid_b * stride_lb + offs_r * stride_lh, lse, mask=mask_r)
