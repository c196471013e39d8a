"""The split-KV paged decode of Multi-head Latent Attention: the public op, its reference, its
input checks and its split policy.

``mla_decode(q, kv_cache, block_table, seq_lens, ...)`` is multi-query attention of each
sequence's new tokens (one, or s_q of 1..8, causal among themselves) over its cached latent rows
``[kv_c | k_pe]`` (key = the whole row, value = its first c values), returning ``out`` (b, h, c)
and ``lse`` (b, h), or (b, s_q, h, c) and (b, s_q, h) for a query of s_q tokens. It checks its
arguments, chooses the stage-1 kernel (``mla.kernels.backends``), the split count
(``plan_num_kv_splits``, the rule ``choose_num_kv_splits`` on that kernel's tile) and the Triton
launch parameters (``default_config``), and launches the kernels of ``mla.kernels.triton_decode``
(or a CUDA stage 1 and the Triton merge).
``mla_decode_reference`` computes the same in plain torch, one sequence and token at a time.
"""

from __future__ import annotations

import functools
import math
import numbers
import os

import torch
import triton

from . import fp8
from .backends import CUDA_TILES, DECODE_BACKENDS, choose_decode_backend, sm_count
from .constants import LOG2E, MAX_GRID_YZ
from .launch import launch_fitting, on_the_gpu_of_its_first_tensor
from .triton_decode import (E4M3_HARDWARE, E4M3_INTEGER_OPS, E4M3_INTERPRETER, _mla_decode_merge_dealt_kernel,
                            _mla_decode_merge_dealt_rows_kernel, _mla_decode_merge_kernel, _mla_decode_split_kernel)

__all__ = [
    "MAX_QUERY_TOKENS",
    "mla_decode",
    "mla_decode_reference",
    "choose_num_kv_splits",
    "plan_num_kv_splits",
    "default_config",
]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_QUERY_TOKENS = 8  # s_q: new tokens a sequence one call takes (speculative decoding, MTP)
_MERGE_TILE = 4096  # partial-output values one merge program reads (splits x chunk of c)
# the kernel's KV_FORMAT for each cache layout (mla.kernels.fp8 defines the fp8 ones)
_KV_FORMATS = {"auto": 0, "fp8_e4m3": 1, "fp8_ds_mla": 2}


# ---------------------------------------------------------------------------------------------
# The op: check, choose, allocate, launch
# ---------------------------------------------------------------------------------------------


@on_the_gpu_of_its_first_tensor
def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    softmax_scale: float,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
    check_block_table: bool | None = None,
    kv_cache_dtype: str = "auto",
    kv_scale: float | torch.Tensor | None = None,
    _config: dict | None = None,
    _backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention over a paged latent cache (1 to 8 new tokens per sequence).

    Args:
        q: (b, h, c + r), or (b, s_q, h, c + r) with 1 <= s_q <= 8; bfloat16 / float16 /
            float32: the absorbed query ``[q_nope · W_UK | q_pe]`` of each sequence's new
            token(s); the last dim contiguous. With s_q new tokens the cache already holds all
            of them, and new token j (0-based) attends causally: it sees the first
            ``seq_len - (s_q - 1 - j)`` cached rows, so the last one sees all ``seq_len``
            (FlashMLA's convention). A token that sees no row (``seq_len < s_q - j``) gets out 0
            and lse -inf.
        kv_cache: (num_blocks >= 1, block_size, width): the paged cache of ``[kv_c | k_pe]``
            rows, in the layout ``kv_cache_dtype`` names (as ``concat_and_cache`` writes it).
            Key = the whole row, value = its first c values. Last dim contiguous.
        block_table: (b, max_blocks) int32: ``block_table[i, j]`` is the cache block holding
            tokens ``j*block_size ... (j+1)*block_size - 1`` of sequence i, in
            ``[0, num_blocks)``. Entries past ``ceil(seq_lens[i] / block_size)`` are never read.
        seq_lens: (b,) int32: cached tokens of each sequence, the new ones included; 0 means
            the row sits this call out (out 0, lse -inf).
        kv_lora_rank: c; the rope dim is ``r = q.shape[-1] - c``.
        softmax_scale: multiplies q·k before the softmax.
        num_kv_splits: pieces each sequence is cut into. None: ``choose_num_kv_splits`` picks
            from the batch, the query rows (s_q x h), ``max(seq_lens)`` and the SM count, which
            reads seq_lens on the host (one sync). Give it to launch without a host sync (a
            CUDA graph). ``"cuda-sm90"`` deals the batch's tiles instead: b x ``num_kv_splits``
            equal pieces of the batch's tile pairs, taken sequence after sequence, so that a
            piece may end one sequence and start the next and a long sequence spans more
            pieces than a short one; a batch of differing lengths then takes about the time
            of its tokens, not of its longest sequence (one of equal lengths whose tile pairs
            the pieces divide, the cut's pieces). Its float32 workspace is
            (b + pieces - 1, s_q x h, c): at one split about twice the answer's size in float32.
        max_seq_len: an upper bound of seq_lens the caller knows on the host (a serving loop
            does): with ``num_kv_splits`` None, the split count is chosen from it instead of
            from a read of seq_lens, so the call makes no host sync. seq_lens above it are
            refused where seq_lens are checked (the CPU, ``check_block_table=True``) and
            trusted otherwise.
        check_block_table: whether seq_lens and the block-table entries a row reads are checked
            (a ValueError naming the row and entry; a read past the cache would return garbage
            or crash). The CPU always checks. On a GPU, True checks at the cost of one host sync
            (not allowed in a CUDA graph capture), False trusts the block-table entries, and
            None checks where it costs no extra sync: when ``num_kv_splits`` and ``max_seq_len``
            are None (seq_lens are read on the host anyway) and no graph is being captured.
        kv_cache_dtype: the cache's layout (``mla.kernels.fp8``): ``"auto"``, rows of c + r
            values in q's dtype; ``"fp8_e4m3"`` (alias ``"fp8"``), a ``torch.float8_e4m3fn``
            cache of width c + r read as ``value * kv_scale``; ``"fp8_ds_mla"``, a ``torch.uint8``
            cache of width c + 4·c/128 + 2·r (656 for c = 512, r = 64) holding each token's latent
            in e4m3 with a float32 scale per 128 values and its rope part in bf16, each row
            starting at a multiple of 4 bytes. The Triton kernel converts fp8 rows to q's dtype
            in registers for the dots: e4m3 values exactly, with ``kv_scale`` applied to the
            scores and the output; ds_mla values times their group's scale in float32, rounded
            once (exact for float32 q). ``"cuda-sm90"`` computes the same values into its tiles
            in shared memory; ``"cuda-sm80"`` reads the e4m3 values exactly into its mma
            fragments (fp16 products on sm_89 and later, q brought into fp16's range by a power
            of two) and applies ds_mla's group scales in float32 to the scores and p. Both run
            fp8 caches by default where they apply (``mla.kernels.backends``).
        kv_scale: ``"fp8_e4m3"`` only (None otherwise): the cache's one scale, a float or a
            1-element float32 tensor on q's device or the CPU, finite and at least 2^-126
            (``mla.kernels.fp8.check_e4m3_scale``). A GPU tensor's value is checked where seq_lens
            are (``check_block_table``) and trusted elsewhere; under CUDA graph capture pass a
            tensor on q's device.
        _config, _backend: private hooks for benchmarks and tests: ``_config`` overrides keys of
            ``default_config`` and selects the Triton kernel; ``_backend`` forces one of
            ``mla.kernels.backends.DECODE_BACKENDS`` (a ValueError if it cannot run the arguments).

    Returns:
        out: (b, h, c), or (b, s_q, h, c) for a 4-d q, in q's dtype: ``softmax(scores) @ value``.
        lse: (b, h), or (b, s_q, h), float32: ``log(sum(exp(scores)))`` in natural log, -inf for
            a query that sees no row.

    The Triton kernel runs every s_q, packing the s_q x h (token, head) pairs of a sequence into
    its tile of query rows. ``"cuda-sm90"`` packs them the same way into its 64-row tiles and is
    the default for s_q > 1 where it applies (``mla.kernels.backends``); s_q > 1 runs on Triton
    otherwise. ``"cuda-sm80"`` takes one new token only:
    ``_backend`` forcing it with s_q > 1 is a ValueError. On the CPU the Triton kernel runs in its interpreter; bf16 there runs in
    float32 on copies of q and the pages the rows use (the interpreter's bf16 dot is wrong), out
    cast back to bf16. On a GPU every kernel runs on q's, whichever device is current.

    With s_q > 1, a NaN or inf in the value (first c values) of a cached row that token j does
    not see (between its causal limit and ``seq_len``) still reaches token j's out, not its lse,
    in the Triton and the ``"cuda-sm90"`` kernels: the value tile is shared by all the sequence's
    tokens, and token j's probability 0 there times NaN is NaN in the dot.
    ``mla_decode_reference`` ignores such rows.
    """
    kind = _check_inputs(q, kv_cache, block_table, seq_lens, kv_lora_rank, softmax_scale, num_kv_splits,
                         kv_cache_dtype, kv_scale)
    if check_block_table is not None and not isinstance(check_block_table, bool):
        raise TypeError(f"mla_decode: check_block_table must be True, False or None, got {check_block_table!r}")
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, numbers.Integral)
                                    or max_seq_len < 0):
        raise ValueError(f"mla_decode: max_seq_len must be None or an int >= 0, got {max_seq_len!r}")
    if q.dim() == 3:  # one new token a sequence: s_q = 1, without the token dim
        out, lse = mla_decode(q.unsqueeze(1), kv_cache, block_table, seq_lens, kv_lora_rank=kv_lora_rank,
                              softmax_scale=softmax_scale, num_kv_splits=num_kv_splits,
                              max_seq_len=max_seq_len, check_block_table=check_block_table,
                              kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale,
                              _config=_config, _backend=_backend)
        return out[:, 0], lse[:, 0]
    b, s_q, h, d = q.shape
    rows = s_q * h  # query rows a sequence: the (token, head) pairs a program's tile packs
    c, r = kv_lora_rank, d - kv_lora_rank
    block_size = kv_cache.shape[1]
    on_cpu = q.device.type == "cpu"
    capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if capturing and ((num_kv_splits is None and max_seq_len is None) or check_block_table):
        why = "check_block_table=True" if check_block_table else "num_kv_splits=None without max_seq_len"
        raise ValueError(f"mla_decode: {why} reads seq_lens on the host, which a CUDA graph capture cannot do")
    if on_cpu:
        check = True  # an interpreted read past the cache crashes the process
    elif check_block_table is None:  # seq_lens go to the host anyway
        check = num_kv_splits is None and max_seq_len is None and not capturing
    else:
        check = check_block_table
    if check or (num_kv_splits is None and max_seq_len is None):
        longest = _check_seq_lens(seq_lens, block_table, kv_cache, check_block_table=check)
        if max_seq_len is not None and longest > max_seq_len:
            raise ValueError(f"mla_decode: seq_lens holds {longest}, above max_seq_len={max_seq_len}")
        max_seq_len = longest if max_seq_len is None else max_seq_len
    scale_t = None
    if kind == "fp8_e4m3":  # a GPU tensor's value is read only where the call reads the host anyway
        scale_t = fp8.check_e4m3_scale("mla_decode", "kv_scale", kv_scale, q.device, read_value=check)
    if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "mla_decode: q is on the CPU, which Triton runs only in its interpreter; set "
            "TRITON_INTERPRET=1 before triton is imported (mla.kernels does so when no GPU is visible)"
        )

    if on_cpu and q.dtype == torch.bfloat16:
        out, lse = _decode_bf16_in_fp32(q, kv_cache, block_table, seq_lens, kv_lora_rank=c,
                                        softmax_scale=softmax_scale, num_kv_splits=num_kv_splits,
                                        max_seq_len=max_seq_len, kv_cache_dtype=kind, kv_scale=scale_t,
                                        _config=_config, _backend=_backend)
        return out.to(torch.bfloat16), lse

    config = default_config(rows, kind)
    if _config:
        unknown = set(_config) - set(config)
        if unknown:
            raise ValueError(f"mla_decode: unknown _config keys {sorted(unknown)}; known: {sorted(config)}")
        config.update(_config)

    backend = choose_decode_backend(q, kv_cache, block_table, seq_lens, kv_lora_rank=c, backend=_backend,
                                    tuned=bool(_config), kv_cache_dtype=kind)
    if num_kv_splits is None:
        num_kv_splits = plan_num_kv_splits(backend, b, rows, max_seq_len, sm_count(q.device),
                                           kv_cache_dtype=kind, block_h=config["BLOCK_H"], block_n=config["BLOCK_N"])

    out = torch.empty((b, s_q, h, c), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, s_q, h), dtype=torch.float32, device=q.device)
    if b == 0 or h == 0:
        return out, lse
    out_rows, lse_rows = out.view(b, rows, c), lse.view(b, rows)  # row = token * h + head

    if backend != "triton":  # csrc/mla_decode_sm80.cu (s_q = 1), csrc/mla_decode_sm90.cu (s_q 1..8)
        # any layout: the cache as it is stored, and its scale for fp8_e4m3
        if backend == "cuda-sm80":
            stage1 = functools.partial(torch.ops.mla.mla_decode_sm80, kv_cache_dtype=kind, kv_scale=scale_t)
        else:  # the s_q x h rows packed into its 64-row tiles, each with its own causal limit
            stage1 = functools.partial(torch.ops.mla.mla_decode_sm90, kv_cache_dtype=kind, kv_scale=scale_t,
                                       q_tokens=s_q)
        q_rows = q.reshape(b, rows, d)  # row = token * h + head; a view when q is contiguous in (s_q, h)
        if backend == "cuda-sm90":
            # the batch's tiles dealt over b x num_kv_splits pieces across sequences: a batch of
            # differing lengths takes about its tokens' time, not its longest sequence's
            pieces = min(b * num_kv_splits, MAX_GRID_YZ)
            part_out = torch.empty((b + pieces - 1, rows, c), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((b + pieces - 1, rows), dtype=torch.float32, device=q.device)
            ranges = torch.empty((b, 2), dtype=torch.int32, device=q.device)
            stage1(q_rows, kv_cache, block_table, seq_lens, part_out, part_lse, float(softmax_scale), pieces,
                   out=out_rows, lse=lse_rows, ranges=ranges)
            _merge_dealt(part_out, part_lse, ranges, out_rows, lse_rows, num_kv_splits)
            return out, lse
        if num_kv_splits == 1:  # stage 1 writes the answer (out in q's dtype, lse); no merge
            stage1(q_rows, kv_cache, block_table, seq_lens, out_rows.unsqueeze(2), lse_rows.unsqueeze(2),
                   float(softmax_scale), 1)
            return out, lse
        part_out = torch.empty((b, rows, num_kv_splits, c), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b, rows, num_kv_splits), dtype=torch.float32, device=q.device)
        stage1(q_rows, kv_cache, block_table, seq_lens, part_out, part_lse, float(softmax_scale), num_kv_splits)
        _merge(part_out, part_lse, out_rows, lse_rows)
        return out, lse

    if num_kv_splits == 1:  # stage 1 writes the answer; no workspace, no merge
        part_out, part_lse = out_rows, lse_rows
        part_out_strides = (out_rows.stride(0), out_rows.stride(1), 0)
        part_lse_strides = (lse_rows.stride(0), lse_rows.stride(1), 0)
    else:
        part_out = torch.empty((b, rows, num_kv_splits, c), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b, rows, num_kv_splits), dtype=torch.float32, device=q.device)
        part_out_strides = part_out.stride()[:3]
        part_lse_strides = part_lse.stride()

    block_c, block_r = max(16, triton.next_power_of_2(c)), max(16, triton.next_power_of_2(r))
    head_major = bool(config["HEAD_MAJOR"])
    # an fp8 cache goes in as its bytes; the scale pointer is read for "fp8_e4m3" only
    kv = kv_cache if kind == "auto" else kv_cache.view(torch.uint8)
    rope_offset = fp8.ds_mla_layout(c, r)["rope"][0] if kind == "fp8_ds_mla" else c
    def launch(config):
        block_h = config["BLOCK_H"]
        row_blocks = triton.cdiv(rows, block_h)
        grid = (row_blocks, b, num_kv_splits) if head_major else (b, row_blocks, num_kv_splits)
        _mla_decode_split_kernel[grid](
            q, kv, scale_t if scale_t is not None else seq_lens, block_table, seq_lens, part_out, part_lse,
            h, s_q, c, r, rope_offset, block_size, num_kv_splits, float(softmax_scale) * LOG2E,
            q.stride(0), q.stride(1), q.stride(2),
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
            KV_FORMAT=_KV_FORMATS[kind],
            E4M3=_e4m3_conversion(q.device),
            num_warps=config["num_warps"],
            num_stages=config["num_stages"],
        )

    if _config:  # a configuration given is launched as it is: a GPU that cannot take it says so
        launch(config)
    else:
        launch_fitting(launch, config, ("mla_decode", q.device, kind, q.dtype),
                       _STEP_DOWN)
    if num_kv_splits > 1:
        _merge(part_out, part_lse, out_rows, lse_rows)
    return out, lse


# shared memory a decode configuration needs shrinks with fewer stages, then tokens, then rows
_STEP_DOWN = (("num_stages", 1), ("BLOCK_N", 16), ("BLOCK_H", 16))


def _e4m3_conversion(device: torch.device) -> int:
    """How the Triton kernel converts e4m3 bytes on ``device`` (``mla.kernels.triton_decode``):
    the interpreter's conversion on the CPU and wherever Triton interprets (it runs GPU tensors
    too); in hardware where the target has it (sm_89 and later); in integer ops elsewhere. The
    target is the current device's, the one Triton compiles for (``mla_decode`` makes it q's)."""
    if device.type == "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        return E4M3_INTERPRETER
    target = triton.runtime.driver.active.get_current_target()
    return E4M3_HARDWARE if target.backend == "cuda" and target.arch >= 89 else E4M3_INTEGER_OPS


def _merge(part_out, part_lse, out, lse) -> None:
    """Stage 2: out (b, rows, c), lse (b, rows) <- the (b, rows, splits, c) partials and
    (b, rows, splits) log-sum-exps; a row is one (token, head) pair."""
    b, rows, num_kv_splits, c = part_out.shape
    block_s = triton.next_power_of_2(num_kv_splits)
    merge_block_c = max(16, min(triton.next_power_of_2(c), _MERGE_TILE // block_s))  # <= 4096 partials a program
    _mla_decode_merge_kernel[(b, rows, triton.cdiv(c, merge_block_c))](
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


def _merge_dealt(part_out, part_lse, ranges, out, lse, num_kv_splits) -> None:
    """Stage 2 after dealt pieces: out (b, rows, c), lse (b, rows) <- the slots of each sequence
    that spans several pieces, ``ranges`` (b, 2) its first slot and count; a sequence whole in one
    piece was written by stage 1. Above one split a program takes one row and a chunk of c and
    reads its slots min(16, splits) at a time as one tile. At one split most sequences are whole
    or span two or three pieces and most programs only read their sequence's count, so the rows
    kernel takes 8 rows together (8 warps) and all of c, its slots one by one, 4 in flight."""
    b, rows, c = out.shape
    if num_kv_splits == 1:
        kernel, block_r, block_s, warps = _mla_decode_merge_dealt_rows_kernel, 8, 4, 8
        merge_block_c = max(16, triton.next_power_of_2(c))
    else:
        block_s = min(16, triton.next_power_of_2(num_kv_splits))
        kernel, block_r, warps = _mla_decode_merge_dealt_kernel, 1, 4
        merge_block_c = max(16, min(triton.next_power_of_2(c), _MERGE_TILE // block_s))
    grid = (b, triton.cdiv(rows, block_r), triton.cdiv(c, merge_block_c))
    kernel[grid](
        part_out, part_lse, ranges, out, lse,
        rows, c,
        part_out.stride(0), part_out.stride(1),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        BLOCK_R=block_r,
        BLOCK_C=merge_block_c,
        BLOCK_S=block_s,
        num_warps=warps,
    )


def _decode_bf16_in_fp32(q, kv_cache, block_table, seq_lens, **options):
    """``mla_decode`` on float32 copies of q and of the pages the rows read (checked values),
    renumbered into a compact cache; the caller casts out back to bf16. fp8 pages are copied as
    they are (the kernel dequantises them to float32)."""
    block_size = kv_cache.shape[1]
    as_read = (lambda t: t) if options.get("kv_cache_dtype", "auto") != "auto" else (lambda t: t.float())  # noqa: E731
    pages = (seq_lens.long() + block_size - 1) // block_size  # (b,) pages each row reads
    used = torch.arange(block_table.shape[1])[None, :] < pages[:, None]  # (b, max_blocks)
    blocks = block_table[used].long()  # (k,)
    compact = as_read(kv_cache[blocks] if blocks.numel() else kv_cache[:1])  # (k, n, width)
    table = torch.zeros_like(block_table)
    table[used] = torch.arange(blocks.numel(), dtype=torch.int32)
    return mla_decode(q.float(), compact, table, seq_lens, check_block_table=False, **options)


# ---------------------------------------------------------------------------------------------
# The reference: plain torch, one sequence and new token at a time, in float64
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
    kv_cache_dtype: str = "auto",
    kv_scale: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_decode``'s arguments and results, computed by gathering each sequence's pages.

    q is (b, h, c + r) or (b, s_q, h, c + r); new token j of s_q attends to the first
    ``seq_len - (s_q - 1 - j)`` cached rows, as in ``mla_decode``. Checks the same as
    ``mla_decode`` with ``check_block_table=True``. ``num_kv_splits`` is
    accepted and ignored (splitting does not change the math). ``compute_dtype`` (float64 by
    default) is what the scores and softmax are computed in; tests of large shapes on a GPU may
    pass float32. Returns out in q's dtype and lse in float32, like the kernel. An fp8 cache
    (``kv_cache_dtype``, ``kv_scale`` as in ``mla_decode``) is first dequantised whole to float32
    by ``mla.kernels.fp8.dequantize_e4m3`` / ``dequantize_ds_mla``.
    """
    kind = _check_inputs(q, kv_cache, block_table, seq_lens, kv_lora_rank, softmax_scale, num_kv_splits,
                         kv_cache_dtype, kv_scale)
    q_tokens = q if q.dim() == 4 else q.unsqueeze(1)  # (b, s_q, h, c + r)
    b, s_q, h, d = q_tokens.shape
    c = kv_lora_rank
    block_size = kv_cache.shape[1]
    _check_seq_lens(seq_lens, block_table, kv_cache, check_block_table=True)
    r = d - c
    if kind == "fp8_e4m3":  # (blocks, n, c + r) float32 = e4m3 value * the cache's scale
        scale_t = fp8.check_e4m3_scale("mla_decode", "kv_scale", kv_scale, q.device, read_value=True)
        kv_cache = torch.cat(fp8.dequantize_e4m3(kv_cache, c, scale_t), dim=-1)
    elif kind == "fp8_ds_mla":  # (blocks, n, c + r) float32: latent * its group's scale, bf16 rope
        kv_cache = torch.cat(fp8.dequantize_ds_mla(kv_cache, c, r), dim=-1)
    out = torch.zeros((b, s_q, h, c), dtype=compute_dtype, device=q.device)
    lse = torch.full((b, s_q, h), float("-inf"), dtype=compute_dtype, device=q.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        pages = block_table[i, : triton.cdiv(seq_len, block_size)].long()
        latent = kv_cache[pages[pos // block_size], pos % block_size].to(compute_dtype)  # (t, c+r)
        for j in range(s_q):
            seen = seq_len - (s_q - 1 - j)  # new token j sees the cache up to its own row
            if seen <= 0:
                continue
            # scores_{ht} = scale * sum_d q_{hd} latent_{td}, over the t < seen rows
            scores = torch.einsum("hd,td->ht", q_tokens[i, j].to(compute_dtype), latent[:seen]) * softmax_scale
            lse[i, j] = torch.logsumexp(scores, dim=-1)
            # out_{hc} = sum_t softmax(scores)_{ht} latent_{tc}
            out[i, j] = torch.einsum("ht,tc->hc", torch.softmax(scores, dim=-1), latent[:seen, :c])
    if q.dim() == 3:
        out, lse = out[:, 0], lse[:, 0]
    return out.to(q.dtype), lse.to(torch.float32)


# ---------------------------------------------------------------------------------------------
# The split policy and the launch parameters
# ---------------------------------------------------------------------------------------------


def default_config(num_heads: int, kv_cache_dtype: str = "auto") -> dict:
    """The Triton stage-1 launch parameters used unless ``_config=`` overrides them.

    ``num_heads``: query rows a sequence, h, or s_q x h with s_q new tokens (the kernel packs
    the (token, head) pairs into one tile of rows). ``kv_cache_dtype``: the cache's layout.
    ``BLOCK_H``: query rows a program, the power of two >= ``num_heads`` between 16 (``tl.dot``'s
    smallest M) and 64 (a (BLOCK_H, c) fp32 accumulator fits in registers at c = 512).
    ``BLOCK_N``: tokens a step. ``num_warps``, ``num_stages``: as in ``triton.Config``.
    ``PAGE_TILE``: one block-table load a tile when the page size is a multiple of ``BLOCK_N``.
    ``HEAD_MAJOR``: a sequence's head blocks run side by side and share its tiles through L2.
    ``SPLIT_TAIL``: whole tiles run without token masks, the split's partial last tile apart.
    The tiles for caches in q's dtype are the fastest on an H200 (``docs/derivations/split-kv.md``);
    where a GPU refuses one for its shared memory (float32 caches; GPUs with less than an H100's
    227 KB a block) ``mla_decode`` launches the next smaller (``mla.kernels.launch``). An fp8
    cache takes the same tiles but at 16 rows, where half the tokens a step on 4 warps and 2
    stages are the fastest of the fp8 tiles timed on an H200: an fp8 tile is converted in
    registers beside the accumulator, and at 64 rows, where the bf16 tile spills, it is still
    3-5x faster than the spill-free 32-row tiles, which use ``mma.sync`` rather than ``wgmma``.
    """
    block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
    if block_h == 16 and fp8.canonical_kv_cache_dtype(kv_cache_dtype) != "auto":
        tile = {"BLOCK_H": block_h, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    elif block_h >= 64:
        tile = {"BLOCK_H": block_h, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    elif block_h == 16:
        tile = {"BLOCK_H": block_h, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    else:
        tile = {"BLOCK_H": block_h, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    return dict(tile, PAGE_TILE=True, HEAD_MAJOR=True, SPLIT_TAIL=True)


def plan_num_kv_splits(
    backend: str,
    batch: int,
    rows: int,
    max_seq_len: int,
    num_sms: int,
    *,
    kv_cache_dtype: str = "auto",
    block_h: int | None = None,
    block_n: int | None = None,
) -> int:
    """The split count ``mla_decode`` takes when ``num_kv_splits`` is None: ``choose_num_kv_splits``
    on the tile of stage 1 ``backend`` ("triton", "cuda-sm80", "cuda-sm90"), within one wave for
    the wgmma kernel. ``rows``: query rows a sequence (s_q x h). ``block_h``, ``block_n``: the
    Triton kernel's tile, ``default_config(rows, kv_cache_dtype)``'s when None; a CUDA stage 1
    has its own (``CUDA_TILES``). A caller that fixes the count for a CUDA graph (the decode
    benchmark, a captured layer step) plans with this, so that it runs what ``mla_decode`` would.
    """
    if backend not in DECODE_BACKENDS:
        raise ValueError(f"plan_num_kv_splits: backend must be one of {DECODE_BACKENDS}, got {backend!r}")
    if backend in CUDA_TILES:
        block_h, block_n = CUDA_TILES[backend]
    elif block_h is None or block_n is None:
        config = default_config(rows, kv_cache_dtype)
        block_h = config["BLOCK_H"] if block_h is None else block_h
        block_n = config["BLOCK_N"] if block_n is None else block_n
    return choose_num_kv_splits(batch, rows, max_seq_len, num_sms, block_h=block_h, block_n=block_n,
                                one_wave=backend == "cuda-sm90")


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

    ``heads``: query rows a sequence, h, or s_q x h with s_q new tokens (``mla_decode`` passes
    that). Stage 1 runs ``P = batch * ceil(heads / block_h)`` programs per split. Small head blocks
    (``block_h < 64``: memory bound, several programs an SM) take the most splits whose
    programs fit in one wave of ``programs_per_sm`` (2) x ``num_sms``, then the fewest splits
    that cut the longest sequence into pieces of the same whole tiles. 64-head blocks (compute
    bound, one program an SM) take 1 if ``P >= num_sms``, else the smallest count whose
    programs keep >= 90% of the SMs busy over all their waves, or with ``one_wave`` (the wgmma
    stage 1) the most whose programs fit in one wave. Either way the count is at most the
    longest sequence's tiles of ``block_n`` tokens over ``min_tiles_per_split``, and at most
    ``max_splits`` (the merge reads every split). ``block_h``, ``block_n``: the stage-1 tile,
    ``default_config(heads)``'s when None. ``docs/derivations/split-kv.md`` derives the rule
    and tabulates its choices. Returns an int in ``[1, max_splits]``.
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
        # a count past one wave leaves its last few programs a second round on their own
        splits = max(1, min(most, target // programs))
        # the kernels cut whole tiles, ceil(tiles / splits) a split: where that leaves the
        # last splits empty, fewer splits of the same length do the same work
        tiles = triton.cdiv(max_seq_len, block_n)
        return triton.cdiv(tiles, triton.cdiv(tiles, splits)) if tiles > 0 else splits
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


# ---------------------------------------------------------------------------------------------
# Input checks, shared by the op and the reference
# ---------------------------------------------------------------------------------------------


def _check_inputs(q, kv_cache, block_table, seq_lens, kv_lora_rank, softmax_scale, num_kv_splits,
                  kv_cache_dtype="auto", kv_scale=None) -> str:
    """Raise a ValueError/TypeError naming the argument at fault; read-only. Returns the cache
    layout's canonical name (``mla.kernels.fp8.canonical_kv_cache_dtype``)."""
    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mla_decode: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() not in (3, 4):
        raise ValueError(
            f"mla_decode: q must be (batch, heads, c + r) or (batch, s_q, heads, c + r), got shape {tuple(q.shape)}"
        )
    if q.dim() == 4 and not 1 <= q.shape[1] <= MAX_QUERY_TOKENS:
        raise ValueError(
            f"mla_decode: q's dim 1 (s_q, new tokens a sequence) must be in [1, {MAX_QUERY_TOKENS}], "
            f"got {q.shape[1]} (q's shape {tuple(q.shape)})"
        )
    b, h, d = q.shape[0], q.shape[-2], q.shape[-1]
    rows = h * (q.shape[1] if q.dim() == 4 else 1)
    if q.dtype not in _DTYPES:
        raise TypeError(f"mla_decode: q must be bfloat16, float16 or float32, got {q.dtype}")
    if kv_cache.dim() != 3:
        raise ValueError(
            f"mla_decode: kv_cache must be (num_blocks, block_size, c + r), got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[1] < 1:
        raise ValueError("mla_decode: kv_cache's block_size (dim 1) must be >= 1")
    if kv_cache.shape[0] < 1:
        raise ValueError(f"mla_decode: kv_cache has no blocks (shape {tuple(kv_cache.shape)}); it needs at least one")
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
    kind = _check_kv_format(q, kv_cache, kv_lora_rank, kv_cache_dtype, kv_scale)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"mla_decode: softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"mla_decode: softmax_scale must be finite, got {softmax_scale}")
    if num_kv_splits is not None:
        if isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, numbers.Integral):
            raise TypeError(f"mla_decode: num_kv_splits must be an int or None, got {type(num_kv_splits).__name__}")
        if not 1 <= num_kv_splits <= MAX_GRID_YZ:
            raise ValueError(f"mla_decode: num_kv_splits must be in [1, {MAX_GRID_YZ}], got {num_kv_splits}")
    if b > MAX_GRID_YZ:
        raise ValueError(f"mla_decode: at most {MAX_GRID_YZ} sequences a call (q's batch is {b})")
    if rows > MAX_GRID_YZ:
        raise ValueError(
            f"mla_decode: at most {MAX_GRID_YZ} query rows (s_q x heads) a sequence, q has {rows} "
            f"(shape {tuple(q.shape)})"
        )
    return kind


def _check_kv_format(q, kv_cache, kv_lora_rank, kv_cache_dtype, kv_scale) -> str:
    """kv_cache's dtype and width, and whether kv_scale is given, against ``kv_cache_dtype``;
    returns its canonical name. kv_scale itself is checked where the call turns it into the
    tensor the kernel reads (``fp8.check_e4m3_scale``), once a call knows whether it may read
    the host."""
    try:
        kind = fp8.canonical_kv_cache_dtype(kv_cache_dtype)
    except ValueError as error:
        raise ValueError(f"mla_decode: {error}") from None
    d = q.shape[-1]
    c, r = kv_lora_rank, d - kv_lora_rank
    if kind == "auto":
        if kv_cache.dtype != q.dtype:
            hint = {torch.uint8: " (an fp8_ds_mla cache? pass kv_cache_dtype='fp8_ds_mla')"}.get(kv_cache.dtype, "")
            if fp8.fp8_available() and kv_cache.dtype == torch.float8_e4m3fn:
                hint = " (pass kv_cache_dtype='fp8_e4m3' and its kv_scale)"
            raise TypeError(f"mla_decode: kv_cache must have q's dtype {q.dtype}, got {kv_cache.dtype}{hint}")
        if kv_cache.shape[2] != d:
            raise ValueError(f"mla_decode: kv_cache's last dim must equal q's (c + r = {d}), got {kv_cache.shape[2]}")
    else:
        try:
            fp8.require_fp8(kind)
        except RuntimeError as error:
            raise RuntimeError(f"mla_decode: {error}") from None
        if kind == "fp8_ds_mla" and c % fp8.DS_MLA_GROUP:
            raise ValueError(
                f"mla_decode: kv_lora_rank c must be a multiple of {fp8.DS_MLA_GROUP} for "
                f"kv_cache_dtype='fp8_ds_mla' (one float32 scale per {fp8.DS_MLA_GROUP} values), got {c}"
            )
        dtype, width = fp8.cache_row(kind, c, r, q.dtype)
        formula = (f"c + r = {d}" if kind == "fp8_e4m3" else
                   f"c + 4*c/128 + 2*r = {c} + {4 * c // fp8.DS_MLA_GROUP} + {2 * r} = {width} bytes")
        if kv_cache.dtype != dtype:
            raise TypeError(
                f"mla_decode: kv_cache must be {dtype} for kv_cache_dtype={kv_cache_dtype!r}, got {kv_cache.dtype}"
            )
        if kv_cache.shape[2] != width:
            raise ValueError(
                f"mla_decode: kv_cache's last dim must be {formula} for kv_cache_dtype={kv_cache_dtype!r} "
                f"(c = kv_lora_rank = {c}, r = {r} from q's last dim {d}), got {kv_cache.shape[2]}"
            )
        # the kernels read a row's scales as float32 and its rope part as bf16 in place: every
        # row must start 4-byte aligned (a misaligned load faults on a GPU)
        if kind == "fp8_ds_mla" and (kv_cache.data_ptr() % 4 or kv_cache.stride(0) % 4 or kv_cache.stride(1) % 4):
            raise ValueError(
                f"mla_decode: an fp8_ds_mla kv_cache's rows must start at multiples of 4 bytes (its scales "
                f"are read as float32), got data_ptr % 4 = {kv_cache.data_ptr() % 4} and strides "
                f"{tuple(kv_cache.stride())}"
            )
    if kind != "fp8_e4m3":
        if kv_scale is not None:
            raise ValueError(
                f"mla_decode: kv_scale is for kv_cache_dtype='fp8_e4m3' only; it must be None for "
                f"kv_cache_dtype={kv_cache_dtype!r}" + (" (its scales are stored in each row)" if kind != "auto" else "")
            )
        return kind
    if kv_scale is None:
        raise ValueError("mla_decode: kv_scale is required for kv_cache_dtype='fp8_e4m3' (the cache's one scale)")
    return kind


def _check_seq_lens(seq_lens, block_table, kv_cache, *, check_block_table: bool) -> int:
    """Check seq_lens' values against the block table's width, and with ``check_block_table``
    every block-table entry a row reads against the cache (the entries of its first seq_len
    tokens, which its last new token reads, and with them every earlier token's); return
    max(seq_lens). One host sync
    (a second one only to name a bad entry); read-only."""
    if seq_lens.numel() == 0:
        return 0
    num_blocks, block_size = kv_cache.shape[:2]
    stats = list(torch.aminmax(seq_lens))
    if check_block_table:
        # entry j of row i is read iff j * block_size < seq_lens[i]; a few small kernels, no sync
        first_tokens = torch.arange(0, block_table.shape[1] * block_size, block_size, device=seq_lens.device)
        read = first_tokens[None, :] < seq_lens[:, None]  # (b, max_blocks)
        bad = read & (block_table.clamp(0, num_blocks - 1) != block_table)
        stats.append(bad.any())
    lo, hi, *any_bad = torch.stack([s.to(torch.int64) for s in stats]).tolist()
    if lo < 0:
        raise ValueError(f"mla_decode: seq_lens must be >= 0, got a min of {lo}")
    capacity = block_table.shape[1] * block_size
    if hi > capacity:
        raise ValueError(
            f"mla_decode: block_table is too short: a seq_len of {hi} needs {triton.cdiv(hi, block_size)} "
            f"blocks of {block_size}, but block_table has {block_table.shape[1]} columns"
        )
    if any_bad and any_bad[0]:
        i, j = bad.nonzero()[0].tolist()
        seq_len = int(seq_lens[i])
        raise ValueError(
            f"mla_decode: block_table[{i}, {j}] = {int(block_table[i, j])} is not a block of kv_cache, "
            f"which has {num_blocks} (valid: 0..{num_blocks - 1}); row {i} has seq_len {seq_len}, so its "
            f"first {triton.cdiv(seq_len, block_size)} entries are read"
        )
    return hi
