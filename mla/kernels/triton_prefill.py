"""Tiled causal varlen prefill for Multi-head Latent Attention in its up-projected ("MHA") form.

In prefill the latent of every key is up-projected once (``kv_b_proj``: W_UK, W_UV), so each head
has its own key and value, and attention is ordinary multi-head attention with two quirks of MLA:
the key is ``[k_nope | k_pe]`` where the rope part ``k_pe`` is one vector a token shared by all
heads, and the value dim differs from the key dim. For one sequence with s queries (its new
tokens, the last s of its t keys) and one head:

    scores[i, j] = softmax_scale * (q_nope[i] . k_nope[j] + q_pe[i] . k_pe[j])     (s, t)
    scores[i, j] = -inf where key j is not visible to query i
    out[i]       = sum_j softmax(scores[i])[j] * v[j]                              (s, v)
    lse[i]       = log sum_j exp(scores[i, j])                                     (s,)

Causal here is bottom-right aligned: query i (0-based among the s) sits at position t - s + i
and sees keys 0 .. t - s + i. With s = t that is ordinary causal attention; with s < t the
first t - s keys are context every query sees in full, so one kernel serves prompts and
prompts over a cached context. ``CAUSAL=False`` lets every query see every key (attending to
a chunk of context that lies wholly before the queries).

Goals, in the order they shape the code:

1. Never materialise the scores. A program owns ``BLOCK_M`` queries of one head and walks the
   keys ``BLOCK_N`` at a time, keeping only the online-softmax state (running max ``m``, sum
   ``l``, unnormalised output ``acc``): memory O(s + t), not O(s * t) (FlashAttention-2).
2. Two dot products, no padding of the head dim: ``q_nope . k_nope`` over d and
   ``q_pe . k_pe`` over r accumulate into the same scores tile (d = 128, r = 64 for V3: 192,
   where one fused dim would pad to 256). ``k_pe`` is one (t, r) tensor read by every head.
3. Skip work the mask would throw away: tiles wholly above the diagonal are never loaded, and
   tiles wholly below it (every key visible to every query of the block) run without masks;
   only the tiles the diagonal crosses, and a sequence's last partial tile, are masked.
4. Varlen: the queries of all sequences are packed without padding (``cu_seqlens_q``, b + 1
   offsets) and so are the keys and values (``cu_seqlens_k``); a program finds its sequence's
   rows from them, and programs past a sequence's end return at once.
5. fp32 statistics and accumulator whatever the inputs (bf16, fp16, fp32); exponentials in base
   2 with ``log2(e)`` folded into the scale; the lse leaves in natural log. A query that sees
   no key (a non-causal call with t = 0) writes out 0 and lse -inf.

Blocked pseudo-code, one program per (block of BLOCK_M queries, head, sequence):

    q_nope, q_pe = q_nope[rows, head], q_pe[rows, head]           (BLOCK_M, d), (BLOCK_M, r)
    m, l, acc = -inf, 0, 0                                        (BLOCK_M,), (BLOCK_M, v)
    for each tile of BLOCK_N keys j (causal: up to the block's last visible key):
        s = (q_nope @ k_nope[j, head]^T + q_pe @ k_pe[j]^T) * scale * log2(e)
        s = -inf where key j is past t or past the query's diagonal   (diagonal tiles only)
        m_new = max(m, rowmax(s));  p = exp2(s - m_new)
        l   = l * exp2(m - m_new) + rowsum(p)
        acc = acc * exp2(m - m_new) + p @ v[j, head]
        m = m_new
    out = acc / l ;  lse = (m + log2(l)) * ln(2)

The wrapper that checks the arguments, picks the block sizes and launches is
``mla.kernels.prefill.mla_prefill``; its plain-torch twin ``mla_prefill_reference``.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["mla_prefill_kernel", "default_prefill_config"]


# ---------------------------------------------------------------------------------------------
# One step of the online softmax: a tile of BLOCK_N keys
# ---------------------------------------------------------------------------------------------


# --8<-- [start:attend_tile]
@triton.jit
def _attend_tile(
    q_nope, q_pe, m_i, l_i, acc,
    k_nope_rows, k_pe_rows, v_rows,  # the sequence's first key row (k_nope and v: of this head)
    start_n, seqlen_k, last_key,  # last_key: (BLOCK_M,), the last key each query sees
    scale_log2,
    nope_dim, rope_dim, value_dim,
    stride_knt, stride_kpt, stride_vt,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
    MASK: tl.constexpr,  # a diagonal or partial tile: keys past seqlen_k or last_key are -inf
    CAUSAL: tl.constexpr,
    EXACT: tl.constexpr,  # d, r, v are the BLOCK_* sizes: no column masks
    DOT_PRECISION: tl.constexpr,
):
    """Fold keys start_n .. start_n + BLOCK_N - 1 into (m_i, l_i, acc); return the new state."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, BLOCK_R)
    offs_v = tl.arange(0, BLOCK_V)
    rows_n = offs_n.to(tl.int64)  # token offsets times a row stride exceed 2^31 at long prompts
    mask_n = offs_n < seqlen_k

    # -- the tile's keys and values; masked rows (past seqlen_k) and columns read as 0
    k_nope_ptrs = k_nope_rows + rows_n[:, None] * stride_knt + offs_d[None, :]
    k_pe_ptrs = k_pe_rows + rows_n[:, None] * stride_kpt + offs_r[None, :]
    v_ptrs = v_rows + rows_n[:, None] * stride_vt + offs_v[None, :]
    if MASK:
        k_nope = tl.load(k_nope_ptrs, mask=mask_n[:, None] & (offs_d < nope_dim)[None, :], other=0.0)
        k_pe = tl.load(k_pe_ptrs, mask=mask_n[:, None] & (offs_r < rope_dim)[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=mask_n[:, None] & (offs_v < value_dim)[None, :], other=0.0)
    elif EXACT:
        k_nope = tl.load(k_nope_ptrs)
        k_pe = tl.load(k_pe_ptrs)
        v = tl.load(v_ptrs)
    else:
        k_nope = tl.load(k_nope_ptrs, mask=(offs_d < nope_dim)[None, :], other=0.0)
        k_pe = tl.load(k_pe_ptrs, mask=(offs_r < rope_dim)[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=(offs_v < value_dim)[None, :], other=0.0)

    # -- scores (BLOCK_M, BLOCK_N) in log2 units: two products into one accumulator
    s = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PRECISION)
    s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION) * scale_log2
    if MASK:
        visible = mask_n[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))

    # -- online softmax update. A query may see none of a diagonal tile's keys, but never of
    #    the first tile it visits (key 0 is visible to every query, s_i <= t_i), so m_new is finite
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc
# --8<-- [end:attend_tile]


# ---------------------------------------------------------------------------------------------
# The kernel: one program per (block of BLOCK_M queries, head, sequence)
# ---------------------------------------------------------------------------------------------


@triton.jit
def mla_prefill_kernel(
    # pointers
    q_nope_ptr,  # (total_q, h, d)
    q_pe_ptr,  # (total_q, h, r)
    k_nope_ptr,  # (total_k, h, d)
    k_pe_ptr,  # (total_k, r): one rope key a token, shared by the heads
    v_ptr,  # (total_k, h, v)
    cu_seqlens_q_ptr,  # (b + 1,) int32: sequence i's queries are rows cu_q[i] .. cu_q[i+1] - 1
    cu_seqlens_k_ptr,  # (b + 1,) int32: its keys and values, rows cu_k[i] .. cu_k[i+1] - 1
    out_ptr,  # (total_q, h, v) in q's dtype
    lse_ptr,  # (total_q, h) float32
    # sizes
    nope_dim,  # d
    rope_dim,  # r
    value_dim,  # v
    scale_log2,  # softmax_scale * log2(e)
    # strides (every last dim is contiguous)
    stride_qnt, stride_qnh,
    stride_qpt, stride_qph,
    stride_knt, stride_knh,
    stride_kpt,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    # meta-parameters
    BLOCK_M: tl.constexpr,  # queries a program
    BLOCK_N: tl.constexpr,  # keys a step
    BLOCK_D: tl.constexpr,  # next_power_of_2(d), at least 16 (tl.dot's smallest K)
    BLOCK_R: tl.constexpr,  # next_power_of_2(r), at least 16
    BLOCK_V: tl.constexpr,  # next_power_of_2(v), at least 16
    CAUSAL: tl.constexpr,  # bottom-right causal; else every query sees every key
    EXACT: tl.constexpr,  # d, r, v == BLOCK_D, BLOCK_R, BLOCK_V
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding), else "tf32"
):
    # The query blocks of a sequence run last-first: under the causal mask the last block has the
    # most keys to visit, and starting the long programs first evens out the GPU's tail.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_b = tl.program_id(2)

    # ---- this sequence's rows; a block past its last query has nothing to do
    q_start = tl.load(cu_seqlens_q_ptr + pid_b)
    seqlen_q = tl.load(cu_seqlens_q_ptr + pid_b + 1) - q_start
    k_start = tl.load(cu_seqlens_k_ptr + pid_b)
    seqlen_k = tl.load(cu_seqlens_k_ptr + pid_b + 1) - k_start
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return

    # ---- the block's queries, nope and rope parts; rows past seqlen_q read as 0
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, BLOCK_R)
    offs_v = tl.arange(0, BLOCK_V)
    mask_m = offs_m < seqlen_q
    rows_m = (q_start + offs_m).to(tl.int64)
    q_nope = tl.load(
        q_nope_ptr + rows_m[:, None] * stride_qnt + pid_h * stride_qnh + offs_d[None, :],
        mask=mask_m[:, None] & (offs_d < nope_dim)[None, :], other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + rows_m[:, None] * stride_qpt + pid_h * stride_qph + offs_r[None, :],
        mask=mask_m[:, None] & (offs_r < rope_dim)[None, :], other=0.0,
    )

    # --8<-- [start:key_ranges]
    # ---- which keys: query i sees keys 0 .. seqlen_k - seqlen_q + i (causal, bottom-right)
    #      [0, full_end): tiles every query of the block sees whole, no masks
    #      [full_end, end): the diagonal tiles and the sequence's partial last tile, masked
    #      [end, seqlen_k): above the diagonal for every query of the block, never loaded
    if CAUSAL:
        diagonal = seqlen_k - seqlen_q  # the key position of query 0
        last_key = diagonal + offs_m
        end = tl.minimum(seqlen_k, diagonal + start_m + BLOCK_M)
        full_end = (tl.minimum(seqlen_k, diagonal + start_m + 1) // BLOCK_N) * BLOCK_N
    else:
        last_key = offs_m  # unused without CAUSAL
        end = seqlen_k
        full_end = (seqlen_k // BLOCK_N) * BLOCK_N
    # --8<-- [end:key_ranges]

    k_nope_rows = k_nope_ptr + k_start.to(tl.int64) * stride_knt + pid_h * stride_knh
    k_pe_rows = k_pe_ptr + k_start.to(tl.int64) * stride_kpt
    v_rows = v_ptr + k_start.to(tl.int64) * stride_vt + pid_h * stride_vh

    # ---- online softmax over the key tiles, fp32 state
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)  # running sum of p * v
    for start_n in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q_nope, q_pe, m_i, l_i, acc,
            k_nope_rows, k_pe_rows, v_rows, start_n, seqlen_k, last_key, scale_log2,
            nope_dim, rope_dim, value_dim, stride_knt, stride_kpt, stride_vt,
            BLOCK_N, BLOCK_D, BLOCK_R, BLOCK_V, False, CAUSAL, EXACT, DOT_PRECISION,
        )
    for start_n in range(full_end, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q_nope, q_pe, m_i, l_i, acc,
            k_nope_rows, k_pe_rows, v_rows, start_n, seqlen_k, last_key, scale_log2,
            nope_dim, rope_dim, value_dim, stride_knt, stride_kpt, stride_vt,
            BLOCK_N, BLOCK_D, BLOCK_R, BLOCK_V, True, CAUSAL, EXACT, DOT_PRECISION,
        )

    # ---- normalise and write; a query that saw no key (l = 0) writes 0 and lse -inf
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    out_ptrs = out_ptr + rows_m[:, None] * stride_ot + pid_h * stride_oh + offs_v[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_v < value_dim)[None, :])
    tl.store(lse_ptr + rows_m * stride_lt + pid_h * stride_lh, lse, mask=mask_m)


# ---------------------------------------------------------------------------------------------
# Launch parameters
# ---------------------------------------------------------------------------------------------


def default_prefill_config(head_dim: int, element_size: int, max_seqlen_q: int, max_seqlen_k: int, *,
                           interpreter: bool) -> dict:
    """``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages`` for ``mla_prefill_kernel``.

    ``head_dim`` is d + r (the key), ``element_size`` the inputs' bytes a value. On a GPU, with
    2-byte inputs and a key of >= 128 dims (DeepSeek's 192): 128 queries a program, 64 keys a
    step, 8 warps, 3 stages (FlashAttention-2's tile for head dims 128-256; the shared memory,
    3 x 64 x (192 + 128) x 2 B of keys and values plus 128 x 192 x 2 B of queries, is 168 KiB,
    inside an H100/H200 block's 227); smaller keys or few queries 64 queries, 4 warps; fp32
    inputs half the key tile and 2 stages. In Triton's interpreter (numpy, no GPU) every
    operation costs a fixed overhead whatever its size, so the tiles grow with the sequences,
    up to 64 queries and 512 keys (at least 16 each, tl.dot's smallest, as on a GPU).
    """
    if interpreter:
        block_m = min(64, max(16, triton.next_power_of_2(max_seqlen_q)))
        block_n = min(512, max(16, triton.next_power_of_2(max_seqlen_k)))
        return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 1}
    if element_size > 2:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if head_dim >= 128 and max_seqlen_q > 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
