"""Benchmark mla_decode against the GPU's own ceilings and FlashMLA, measured in the same run.

    python -m mla bench decode --out benchmarks/results                  # ~3-5 min on an H200
    python -m mla bench decode --kv-cache-dtype auto,fp8_e4m3,fp8_ds_mla  # ~5-7 min: each layout
    PYTHONPATH=.peers:. python -m mla bench decode --out DIR --s-q 1,2,4  # FlashMLA from .peers/

Ceilings first: device-to-device copy bandwidth (a 2 GiB copy, read + write counted) and the
bf16 matmul rate (8192^3, random data). Then, for DeepSeek-V3's cache (page 64, c + r = 576,
value c = 512) at each (b, t, h) of ``SHAPES``, each query length s_q of ``--s-q`` and each
cache layout of ``--kv-cache-dtype``: mla_decode, and on the bf16 cache (``auto``) plain torch
(gather the pages, einsum, softmax, einsum) and FlashMLA when ``import flash_mla`` works, all on
the same inputs.

The layouts of one (b, t, h, s_q) share q, the block table and the latents: the bf16 cache holds
random rows, and each fp8 cache (``mla.kernels.fp8``) is written from them by
``concat_and_cache``, ``fp8_e4m3`` with the one scale ``calibrate_e4m3_scale`` gives for all of
them, ``fp8_ds_mla`` with its per-128-value scales. An fp8 row times mla_decode alone
(FlashMLA's dense decode reads bf16 caches only: ``flashmla_skipped`` says so) and checks it:
``max_abs_diff`` against ``mla_decode_reference`` on the same fp8 cache (dequantised, float64),
``max_abs_err_vs_bf16_cache`` against the reference on the bf16 rows it was written from (what
quantising costs). ``over_bf16`` = time_us / the bf16 row's time_us (each on the kernel
mla_decode picks for it: a CUDA stage 1 where one applies, for bf16 and fp8 alike),
``over_bf16_triton`` the same against the bf16 cache on the Triton kernel. While mla_decode runs
an fp8 cache on Triton (``mla.kernels.backends``' switches off), a one-token fp8 row also times
the CUDA stage 1 of its heads forced on it (``cuda_fp8_kernel``: "cuda-sm80" at <= 16 heads, "cuda-sm90" above;
``cuda_fp8_time_us``, ``cuda_fp8_over_bf16``, ``cuda_fp8_max_rel_err_vs_reference``, or
``cuda_fp8_error``); while it runs an fp8 cache on a CUDA stage 1 (the switches on, the default),
the row times the Triton kernel on the same cache beside it (``triton_time_us``,
``triton_num_kv_splits``, ``triton_max_rel_err_vs_reference``, ``triton_over_bf16_triton``: over
the bf16 cache on Triton). ``TARGETS`` are the speeds the fp8_ds_mla cache is held to; the table ends
with each against its row, as information, not an assertion.

Every time is the median of do_bench's loop with L2 cleared before each call by READING a
256 MiB buffer (``timing.clear_l2``). ``time_us`` replays one call from a CUDA graph (the
kernels alone, plus the graph's own launch, ``graph_overhead_us``), the copies of the cache in
turn (>= 3x L2 together); ``flashmla_us`` is FlashMLA's call timed the same way, and
``flashmla_over_mla`` = flashmla_us / time_us (above 1: ours is faster);
``flashmla_max_abs_diff`` is the largest |our out - FlashMLA's out|. ``steady_us`` is a call's
share of one graph of >= 8 back-to-back calls (the graph's launch paid once, as in a captured
step of many layers); ``eager_us`` a plain Python call; ``dirty_l2_time_us`` the graph replay
after a zeroing clear (do_bench's own, which leaves dirty lines in L2 to write back).

The floor of a row is ``max(bytes / copy_bw, FLOPs / matmul_rate)`` with bytes = cache rows
read (``bytes_per_token`` of its layout: 1152, 576, 656) + q + out and FLOPs =
2·b·s_q·h·t·(576 + 512). Prints a table, writes ``DEVICE-decode.json`` (``h200-decode.json`` on
an H200) and a plot of each against the bf16 floor beside it (``DEVICE-decode.png``, when
matplotlib imports). The JSON's ``rows`` are the bf16 (``auto``) rows, one per (b, t, h, s_q),
which every reader of the file takes; ``fp8_rows`` the fp8 ones, one per (b, t, h, s_q,
kv_cache_dtype); ``targets`` the checks above.

Importing this module touches no GPU: the table, the JSON and the plot are built by functions
that take the rows, and tests/test_benchmarks.py runs them on fake timings on the CPU.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import sys
import time

import torch

C, R, PAGE = 512, 64, 64  # DeepSeek-V3: kv_lora_rank, rope dim, page size
D = C + R
SCALE = 192**-0.5  # (qk_nope_head_dim + qk_rope_head_dim)^-0.5; the value does not change the time

# the cache layouts in the order a shape runs them: mla.kernels.fp8.LAYOUTS (a test keeps them equal)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_ds_mla")
SHAPES = [  # (b, t, h): the shapes mla_decode is compared with FlashMLA on
    *[(b, t, 16) for b, t in [(1, 32768), (4, 131072), (64, 4096), (128, 8192), (64, 16384)]],
    *[(b, t, 128) for b, t in [(1, 32768), (4, 131072), (16, 4096), (64, 4096), (128, 8192), (64, 16384)]],
]


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'BxTxH,BxTxH,...' -> [(b, t, h), ...]."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"a shape is BxTxH with positive integers, e.g. 64x4096x16; got {item!r}")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def parse_query_lengths(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: query tokens a sequence, 1 to 8."""
    try:
        lengths = [int(v) for v in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or not all(1 <= s <= 8 for s in lengths):
        raise argparse.ArgumentTypeError(f"--s-q takes query lengths from 1 to 8, e.g. 1,2,4; got {text!r}")
    return lengths


def parse_kv_cache_dtypes(text: str) -> list[str]:
    """'auto,fp8_e4m3,fp8_ds_mla' -> those layouts, each once, in KV_CACHE_DTYPES' order ('fp8'
    is 'fp8_e4m3', as in mla_decode)."""
    names = ["fp8_e4m3" if name.strip() == "fp8" else name.strip() for name in text.split(",")]
    if not all(name in KV_CACHE_DTYPES for name in names):
        raise argparse.ArgumentTypeError(
            f"--kv-cache-dtype takes {', '.join(KV_CACHE_DTYPES)} (comma-separated; fp8 = fp8_e4m3); got {text!r}")
    return [kind for kind in KV_CACHE_DTYPES if kind in names]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON and the plot")
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES,
                        help="BxTxH,... (default: the 11 shapes of SHAPES)")
    parser.add_argument("--s-q", dest="s_q", type=parse_query_lengths, default=[1],
                        help="query tokens a sequence, comma-separated, 1..8 (default 1)")
    parser.add_argument("--kv-cache-dtype", dest="kv_cache_dtypes", type=parse_kv_cache_dtypes, default=["auto"],
                        metavar="LAYOUT[,LAYOUT...]",
                        help="cache layouts to time at each shape, comma-separated: auto (bf16), fp8_e4m3, "
                             "fp8_ds_mla (default auto); fp8 rows are paired with the auto row of their shape")
    parser.add_argument("--no-flashmla", dest="flashmla", action="store_false",
                        help="do not time FlashMLA even where it imports")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# The floor of a shape
# ---------------------------------------------------------------------------------------------


def bytes_per_token(kv_cache_dtype: str) -> int:
    """Bytes a cached token of DeepSeek-V3 takes in a layout: 1152 (auto, bf16), 576, 656."""
    from mla.kernels import fp8

    return fp8.bytes_per_token(kv_cache_dtype, C, R, torch.bfloat16)


def floor_us(b, t, h, copy_GBps, matmul_TFLOPs, s_q=1, kv_cache_dtype="auto") -> tuple[float, str]:
    """(floor in us, "memory" or "compute"): the larger of bytes / copy bandwidth and FLOPs /
    matmul rate, for b sequences of t cached tokens in the layout ``kv_cache_dtype``, s_q query
    tokens of h heads each (q and out in bf16; an fp8 cache is computed on in bf16 too)."""
    nbytes = b * t * bytes_per_token(kv_cache_dtype) + 2 * (b * s_q * h * D + b * s_q * h * C)  # cache + q + out
    flops = 2 * b * s_q * h * t * (D + C)
    mem_us = nbytes / (copy_GBps * 1e3)
    compute_us = flops / (matmul_TFLOPs * 1e6)
    return (mem_us, "memory") if mem_us >= compute_us else (compute_us, "compute")


# ---------------------------------------------------------------------------------------------
# Inputs: b sequences of t tokens each, pages of 64 in random order
# ---------------------------------------------------------------------------------------------


def make_inputs(b, t, h, *, s_q=1, copies=1, seed=0, device="cuda"):
    """q (b, h, c + r) for s_q = 1, else (b, s_q, h, c + r); `copies` caches (blocks, 64, c + r)
    of random rows; the block table (b, pages) in random order; seq_lens (b,) all t."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages_per_seq = math.ceil(t / PAGE)
    num_blocks = b * pages_per_seq
    caches = [
        torch.randn(num_blocks, PAGE, D, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(copies)
    ]
    block_table = torch.randperm(num_blocks, device=device, generator=gen).int().view(b, pages_per_seq)
    seq_lens = torch.full((b,), t, dtype=torch.int32, device=device)
    q_shape = (b, h, D) if s_q == 1 else (b, s_q, h, D)
    q = torch.randn(*q_shape, device=device, dtype=torch.bfloat16, generator=gen)
    return q, caches, block_table, seq_lens


def cache_copies(b, t, kv_cache_dtype="auto") -> int:
    """Copies of a (b, t) cache in a layout to rotate through so that they total >= 3x L2."""
    from benchmarks.timing import rotation_copies

    return rotation_copies(b * math.ceil(t / PAGE) * PAGE * bytes_per_token(kv_cache_dtype))


def write_fp8_caches(kv_cache_dtype, caches, copies) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """``copies`` caches in the fp8 layout ``kv_cache_dtype``, copy i written by concat_and_cache
    from the rows of the bf16 ``caches[i % len(caches)]`` into the same slots (so one block table
    serves all), and the fp8_e4m3 scale: the (1,) float32 tensor mapping the largest |value| of
    all the bf16 caches to 448 (None for fp8_ds_mla, whose scales are in its rows)."""
    from mla.kernels import fp8
    from mla.kernels.concat_cache import concat_and_cache

    num_blocks, page, _ = caches[0].shape
    rows = [cache.view(-1, D) for cache in caches]  # (blocks·page, c + r) each
    slots = torch.arange(num_blocks * page, device=caches[0].device)  # every slot, in order
    scale = None
    if kv_cache_dtype == "fp8_e4m3":
        scale = torch.stack([fp8.calibrate_e4m3_scale(r[:, :C], r[:, C:]) for r in rows]).amax().reshape(1)
    dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else torch.uint8
    written = []
    for i in range(copies):
        src = rows[i % len(rows)]
        cache = torch.empty(num_blocks, page, bytes_per_token(kv_cache_dtype), dtype=dtype, device=src.device)
        written.append(concat_and_cache(src[:, :C], src[:, C:], cache, slots, kv_cache_dtype=kv_cache_dtype,
                                        scale=scale))
    return written, scale


def torch_decode(q, kv_cache, block_table, seq_lens):
    """The plain-torch way: gather every sequence's pages, then dense MQA attention; query j of
    s_q sees seq_len - (s_q - 1 - j) cached rows (FlashMLA's causal convention). q (b, h, c + r)
    or (b, s_q, h, c + r); returns out and lse shaped as q without its last dim (c for out)."""
    q4 = q if q.dim() == 4 else q.unsqueeze(1)  # (b, s_q, h, c + r)
    s_q = q4.shape[1]
    latent = kv_cache[block_table].flatten(1, 2)  # (b, t_max, c + r)
    scores = torch.einsum("bshd,btd->bsht", q4, latent).float() * SCALE
    positions = torch.arange(latent.shape[1], device=q.device)  # (t_max,)
    sees = seq_lens[:, None] - (s_q - 1 - torch.arange(s_q, device=q.device))[None, :]  # (b, s_q)
    valid = positions[None, None, :] < sees[:, :, None]  # (b, s_q, t_max)
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (b, s_q, h)
    p = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.einsum("bsht,btc->bshc", p, latent[..., :C])  # (b, s_q, h, c)
    return (out, lse) if q.dim() == 4 else (out.squeeze(1), lse.squeeze(1))


# ---------------------------------------------------------------------------------------------
# The kernel mla_decode picks, and the split count a captured call fixes
# ---------------------------------------------------------------------------------------------

# warps a CTA of each CUDA stage 1: kWarps of csrc/mla_decode_sm80.cu, kThreads / 32 of
# csrc/mla_decode_sm90.cu (two warpgroups)
CUDA_WARPS = {"cuda-sm80": 4, "cuda-sm90": 8}


def kernel_and_splits(q, kv_cache, block_table, seq_lens, kv_lora_rank, t, num_sms,
                      kv_cache_dtype="auto"):
    """The stage-1 kernel mla_decode picks for these arguments (the cache in the layout
    ``kv_cache_dtype``), its tile, and the split count a call that fixes it (a captured one)
    should pass for sequences of up to t tokens: (kernel, config, splits). A q of s_q > 1 tokens
    is planned as the s_q·h query rows the kernels pack into their head tile."""
    from mla.kernels.backends import CUDA_TILES, choose_decode_backend
    from mla.kernels.decode import default_config, plan_num_kv_splits

    rows = q.flatten(1, 2) if q.dim() == 4 else q  # (b, s_q·h, c + r)
    b, h, _ = rows.shape
    kernel = choose_decode_backend(q, kv_cache, block_table, seq_lens, kv_lora_rank=kv_lora_rank,
                                   kv_cache_dtype=kv_cache_dtype)
    if kernel == "triton":
        config = dict(default_config(h, kv_cache_dtype), kernel=kernel)
    else:
        block_h, block_n = CUDA_TILES[kernel]
        config = dict(kernel=kernel, BLOCK_H=block_h, BLOCK_N=block_n, num_warps=CUDA_WARPS[kernel])
    splits = plan_num_kv_splits(kernel, b, h, t, num_sms, kv_cache_dtype=kv_cache_dtype)
    return kernel, config, splits


def triton_splits(q, t, num_sms, kv_cache_dtype="auto") -> int:
    """The split count mla_decode takes for its Triton kernel at these heads, length and layout."""
    from mla.kernels.decode import plan_num_kv_splits

    b, h = q.shape[0], q.shape[-2] * (q.shape[1] if q.dim() == 4 else 1)
    return plan_num_kv_splits("triton", b, h, t, num_sms, kv_cache_dtype=kv_cache_dtype)


def layer_splits(config, cache) -> tuple[str, int]:
    """The stage-1 kernel and the split count a paged layer's captured decode step should fix for
    this cache (its heads, its longest sequence plus the token the step appends), as
    ``kernel_and_splits`` picks them: used by bench_layer.py and bench_tp.py."""
    from mla.kernels.backends import sm_count

    b = cache.batch_size
    q = torch.empty(b, config.num_heads, config.kv_lora_rank + config.qk_rope_head_dim,
                    dtype=cache.dtype, device=cache.kv_cache.device)  # the step's absorbed query
    t = int(cache.seq_lens.max()) + 1
    kernel, _, splits = kernel_and_splits(q, cache.kv_cache, cache.block_table, cache.seq_lens,
                                          config.kv_lora_rank, t, sm_count(q.device),
                                          kv_cache_dtype=cache.kv_cache_dtype)
    return kernel, splits


# ---------------------------------------------------------------------------------------------
# FlashMLA, when it imports
# ---------------------------------------------------------------------------------------------


def flashmla_status() -> tuple[bool, str]:
    """(importable, what): its version or module path, or why ``import flash_mla`` failed."""
    try:
        import flash_mla
    except Exception as err:  # noqa: BLE001  (not installed, no sm_90 GPU, a failed build: not timed)
        return False, f"not importable ({type(err).__name__}: {err})"[:300]
    return True, str(getattr(flash_mla, "__version__", None) or getattr(flash_mla, "__file__", "flash_mla"))


def flashmla_fn(q, block_table, seq_lens):
    """A call fn(kv_cache) -> out (b, s_q, h, c) of FlashMLA's dense decode on our inputs.

    FlashMLA takes q (b, s_q, h, c + r) and the cache as (blocks, page, h_kv = 1, c + r), the value
    being the first c columns of the key, as ours. Its scheduling metadata is made on the first
    call (the warm-up, outside any capture) and reused by later ones, which is allowed while the
    shapes and seq_lens stay the same. ``get_mla_metadata``'s arguments are those of FlashMLA's
    older interface, which the current one accepts and ignores.
    """
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    q4 = q if q.dim() == 4 else q.unsqueeze(1)  # (b, s_q, h, c + r)
    s_q, h = q4.shape[1], q4.shape[2]
    metadata, num_splits = get_mla_metadata(seq_lens, s_q * h, 1)

    def call(kv_cache):
        out, _ = flash_mla_with_kvcache(q4, kv_cache.unsqueeze(2), block_table, seq_lens, C, metadata, num_splits,
                                        softmax_scale=SCALE, causal=s_q > 1)
        return out

    return call


# ---------------------------------------------------------------------------------------------
# Table, JSON and plot (no GPU needed: tests run them on fake rows)
# ---------------------------------------------------------------------------------------------


def add_ratios(row: dict) -> dict:
    """Fill ``share_of_floor`` and ``flashmla_over_mla`` from the row's times, and for s_q > 1
    ``flashmla_over_sm90_sq`` where the wgmma kernel was timed forced (None where a time is
    missing)."""
    ours, theirs, floor = row.get("time_us"), row.get("flashmla_us"), row["floor_us"]
    row["share_of_floor"] = floor / ours if ours else None
    row["flashmla_over_mla"] = theirs / ours if ours and theirs else None
    forced = row.get("sm90_sq_time_us")
    if forced:  # s_q > 1: FlashMLA against the wgmma kernel's packed rows, forced
        row["flashmla_over_sm90_sq"] = theirs / forced if theirs else None
    return row


def _layout(row: dict) -> str:
    return row.get("kv_cache_dtype", "auto")  # a row without the key is a bf16 row


def _shape(row: dict) -> tuple[int, int, int, int]:
    return row["b"], row["t"], row["h"], row.get("s_q", 1)


def pair_with_bf16(rows: list[dict]) -> list[dict]:
    """Fill each fp8 row's ``over_bf16``, its time over the time of the auto row of the same
    (b, t, h, s_q), and ``over_bf16_triton``, over that row's time on the Triton kernel
    (``triton_time_us``, or ``time_us`` where Triton is what mla_decode picked), and where a CUDA
    kernel's fp8 path was timed forced (``cuda_fp8``), ``cuda_fp8_over_bf16``; None where a time is
    missing; where mla_decode picked a CUDA kernel for the fp8 cache and the Triton kernel was timed
    beside it, ``triton_over_bf16_triton``, Triton on fp8 over Triton on bf16 (what dequantising
    costs that kernel). Returns ``rows``."""
    bf16 = {_shape(r): r for r in rows if _layout(r) == "auto"}
    for row in rows:
        if _layout(row) == "auto":
            continue
        base = bf16.get(_shape(row), {})
        ours, theirs = row.get("time_us"), base.get("time_us")
        on_triton = (base.get("config") or {}).get("kernel") == "triton"
        triton = base.get("triton_time_us") or (theirs if on_triton else None)
        row["over_bf16"] = ours / theirs if ours and theirs else None
        row["over_bf16_triton"] = ours / triton if ours and triton else None
        forced = row.get("cuda_fp8_time_us")
        if forced is not None:
            row["cuda_fp8_over_bf16"] = forced / theirs if theirs else None
        beside = row.get("triton_time_us")  # the Triton kernel on the fp8 cache, beside a CUDA pick
        if beside is not None:
            row["triton_over_bf16_triton"] = beside / triton if triton else None
    return rows


# The speeds the fp8_ds_mla cache is held to, one query token a sequence: heads -> (the smallest
# batch it applies at, the most time over the bf16 cache's). 16 heads are memory bound, so the
# time should follow the bytes (656 / 1152 = 0.57); at 128 heads the matmuls and the
# dequantisation in registers are what the time pays for, not the bytes.
TARGETS = {16: (64, 0.65), 128: (1, 1.15)}


def target_checks(rows: list[dict]) -> list[dict]:
    """One entry a fp8_ds_mla row that a target of ``TARGETS`` applies to: its shape, its
    ``over_bf16``, the ``most`` it may be and whether it ``met`` it (None without both times)."""
    checks = []
    for row in rows:
        b, t, h, s_q = _shape(row)
        if _layout(row) != "fp8_ds_mla" or s_q != 1 or h not in TARGETS or b < TARGETS[h][0]:
            continue
        ratio, most = row.get("over_bf16"), TARGETS[h][1]
        checks.append(dict(b=b, t=t, h=h, s_q=s_q, kv_cache_dtype="fp8_ds_mla", over_bf16=ratio, most=most,
                           met=None if ratio is None else ratio <= most))
    return checks


def format_targets(checks: list[dict]) -> list[str]:
    """The lines that end the table: each target against its row, and how many were met."""
    rules = ", ".join(f"{h} heads" + (f" b >= {b}" if b > 1 else "") + f": <= {most:.2f}x"
                      for h, (b, most) in TARGETS.items())
    lines = [f"targets, fp8_ds_mla time over the bf16 cache's at s_q = 1 ({rules}); information, not a check:"]
    if not checks:
        return lines + ["  none applies: no fp8_ds_mla row beside an auto row at such a shape"]
    for c in checks:
        got = f"{c['over_bf16']:.2f}x" if c["over_bf16"] is not None else "n/a"
        verdict = {True: "met", False: "missed", None: "(a time is missing)"}[c["met"]]
        lines.append(f"  b {c['b']:>4} t {c['t']:>7} h {c['h']:>4}: {got:>6} against <= {c['most']:.2f}x  {verdict}")
    met = sum(c["met"] is True for c in checks)
    return lines + [f"  {met} of {len(checks)} met"]


def assemble(rows: list[dict], **fields) -> dict:
    """The result: ``fields`` (ceilings, versions...), then ``rows``, the auto rows (one a (b, t,
    h, s_q), which every reader of the file takes), ``fp8_rows`` (one a (b, t, h, s_q,
    kv_cache_dtype)) and ``targets`` (``target_checks``)."""
    return dict(fields, rows=[r for r in rows if _layout(r) == "auto"],
                fp8_rows=[r for r in rows if _layout(r) != "auto"], targets=target_checks(rows))


FLASHMLA_SKIPPED = "not run: FlashMLA's dense decode reads bf16 caches only"

HEADER = (f"{'b':>4} {'t':>7} {'h':>4} {'s_q':>3} {'cache':>10} {'floor us':>9} {'bound':>7} {'mla us':>8} "
          f"{'x floor':>7} {'x bf16':>6} {'steady':>7} {'eager us':>8} {'torch us':>9} {'flashmla':>8} {'FM/mla':>6} "
          f"{'FM diff':>8} {'splits':>6} {'kernel':>9}  err (auto: rel. to torch; fp8: abs. to reference, to bf16)")


def format_row(row: dict) -> str:
    """One line of the table under HEADER; '-' for a time not taken, 'n/a' for FlashMLA's
    columns when it did not run, 'skip' on an fp8 row (FlashMLA reads bf16 only)."""
    def num(key, width, fmt=".1f", missing="-"):
        value = row.get(key)
        return f"{value:>{width}{fmt}}" if value is not None else f"{missing:>{width}}"

    ours = row.get("time_us")
    if "flashmla_skipped" in row:
        flashmla_missing = ratio_missing = "skip"
    else:
        ratio_missing = "n/a"
        flashmla_missing = "n/a" if row.get("flashmla_us") is None and "flashmla_error" not in row else "error"
    if "max_rel_err_vs_torch" in row:
        err = f"{row['max_rel_err_vs_torch']:.1e}"
    elif "max_abs_diff" in row:
        err = f"{row['max_abs_diff']:.1e} ref" + (f", {row['max_abs_err_vs_bf16_cache']:.1e} bf16"
                                                 if row.get("max_abs_err_vs_bf16_cache") is not None else "")
    else:
        err = row.get("error") or row.get("check_error") or "-"
    cells = [
        f"{row['b']:>4} {row['t']:>7} {row['h']:>4} {row.get('s_q', 1):>3} {_layout(row):>10} "
        f"{row['floor_us']:>9.1f} {row['bound']:>7}",
        num("time_us", 8, missing="error"),
        f"{ours / row['floor_us']:>7.2f}" if ours else f"{'':>7}",
        num("over_bf16", 6, ".2f"),
        num("steady_us", 7), num("eager_us", 8), num("torch_us", 9),
        num("flashmla_us", 8, missing=flashmla_missing), num("flashmla_over_mla", 6, ".2f", missing=ratio_missing),
        num("flashmla_max_abs_diff", 8, ".1e", missing=ratio_missing),
        f"{row.get('config', {}).get('num_kv_splits', ''):>6} {row.get('config', {}).get('kernel', ''):>9}",
        err,
    ]
    return " ".join(cells)


# the plot's bar series: (layout, time field, label); a series' colour is its place here
SERIES = [("auto", "time_us", "mla_decode, bf16"), ("auto", "flashmla_us", "FlashMLA, bf16"),
          ("fp8_e4m3", "time_us", "mla_decode, fp8_e4m3"), ("fp8_ds_mla", "time_us", "mla_decode, fp8_ds_mla")]


def plot(result: dict):
    """A matplotlib Figure: for each head count, the time of mla_decode on each cache layout and
    of FlashMLA over the bf16 floor at each (b, t, s_q), that floor at 1 and each fp8 layout's
    floor as a tick over its bars; a series absent where it did not run."""
    from matplotlib.figure import Figure

    rows = [r for r in result["rows"] + result.get("fp8_rows", []) if r.get("time_us")]
    heads = sorted({r["h"] for r in rows})

    def bf16_floor(r):
        if _layout(r) == "auto":
            return r["floor_us"]
        return floor_us(r["b"], r["t"], r["h"], result["copy_GBps"], result["matmul_TFLOPs"], s_q=r.get("s_q", 1))[0]

    fig = Figure(figsize=(8.0, 0.4 + 3.2 * max(1, len(heads))), layout="constrained")
    axes = fig.subplots(max(1, len(heads)), 1, squeeze=False)[:, 0]
    for ax, h in zip(axes, heads):
        by = {(_layout(r), r.get("s_q", 1), r["b"], r["t"]): r for r in rows if r["h"] == h}
        shapes = sorted({key[1:] for key in by}, key=lambda k: (k[0], k[1] * k[2], k[1]))  # (s_q, b, t)
        drawn = [(k, kind, field, label) for k, (kind, field, label) in enumerate(SERIES)
                 if any(by.get((kind, *shape), {}).get(field) for shape in shapes)]
        width = 0.8 / max(1, len(drawn))
        for i, (k, kind, field, label) in enumerate(drawn):
            timed = [(x + (i - (len(drawn) - 1) / 2) * width, by[(kind, *shape)]) for x, shape in enumerate(shapes)
                     if by.get((kind, *shape), {}).get(field)]
            xs = [x for x, _ in timed]
            ax.bar(xs, [r[field] / bf16_floor(r) for _, r in timed], width, color=f"C{k}", label=label)
            if kind != "auto":
                ax.plot(xs, [r["floor_us"] / bf16_floor(r) for _, r in timed], linestyle="none", marker="_",
                        markersize=40 * width, markeredgewidth=1.5, color="black")
        ax.axhline(1.0, color="black", linewidth=0.8, label="floor (bf16; ticks: fp8's)" if len(drawn) > 2 else "floor")
        ax.set_xticks(range(len(shapes)), [f"b {b}\nt {t // 1024}k" + (f"\ns_q {s_q}" if s_q > 1 else "")
                                           for s_q, b, t in shapes], fontsize=7)
        ax.set_ylabel("time / bf16 floor")
        flashmla_ran = any(field == "flashmla_us" for _, _, field, _ in drawn)
        ax.set_title(f"{h} heads" + ("" if flashmla_ran else " (FlashMLA not run)"))
        ax.set_ylim(bottom=0)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"decode against its floor, {result.get('device', '')}", fontsize=9)
    return fig


def write_results(out_dir, result: dict) -> list[str]:
    """The JSON, and its plot as a PNG beside it when matplotlib imports; returns the paths."""
    from benchmarks.timing import device_prefix, write_json

    name = f"{device_prefix(result.get('device', 'gpu'))}-decode.json"
    paths = [write_json(out_dir, name, result)]
    try:
        fig = plot(result)
    except ImportError:
        print("matplotlib is not installed: no plot")
        return paths
    png = os.path.join(out_dir, name.removesuffix(".json") + ".png")
    fig.savefig(png, dpi=120, metadata={"Software": None})
    print(f"wrote {png}")
    return paths + [png]


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def decode_call(q, block_table, seq_lens, kernel, splits, kv_cache_dtype="auto", kv_scale=None):
    """fn(kv_cache) -> (out, lse): mla_decode on these inputs with its stage-1 kernel and split
    count fixed, as a captured call needs."""
    from mla.kernels.decode import mla_decode

    def call(cache):
        return mla_decode(q, cache, block_table, seq_lens, kv_lora_rank=C, softmax_scale=SCALE, num_kv_splits=splits,
                          kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale, _backend=kernel)

    return call


def reference_out(q, kv_cache, block_table, seq_lens, **layout) -> torch.Tensor:
    """mla_decode_reference's out (softmax in float64) as float32; ``layout``: kv_cache_dtype and
    kv_scale of an fp8 cache."""
    from mla.kernels.decode import mla_decode_reference

    return mla_decode_reference(q, kv_cache, block_table, seq_lens, kv_lora_rank=C, softmax_scale=SCALE,
                                **layout)[0].float()


def bench_shape(b, t, h, s_q, ceilings, num_sms, flashmla_ok, kv_cache_dtypes=("auto",), device="cuda") -> list[dict]:
    """One row a cache layout of ``kv_cache_dtypes``, all on the same q, block table and latents;
    fp8 rows paired with the auto row (``pair_with_bf16``)."""
    copies = cache_copies(b, t)
    q, caches, block_table, seq_lens = make_inputs(b, t, h, s_q=s_q, copies=copies, device=device)
    exact = functools.cache(lambda: reference_out(q, caches[0], block_table, seq_lens))  # shared by the fp8 rows
    rows = []
    for kind in kv_cache_dtypes:
        if kind == "auto":
            rows.append(bf16_row(b, t, h, s_q, q, caches, block_table, seq_lens, ceilings, num_sms, flashmla_ok))
        else:
            rows.append(fp8_row(kind, b, t, h, s_q, q, caches, block_table, seq_lens, ceilings, num_sms, exact))
        torch.cuda.empty_cache()
    del q, caches, block_table, seq_lens, exact
    torch.cuda.empty_cache()
    return pair_with_bf16(rows)


def bf16_row(b, t, h, s_q, q, caches, block_table, seq_lens, ceilings, num_sms, flashmla_ok) -> dict:
    """The bf16 cache's row: mla_decode (and the Triton kernel where it picks a CUDA one), plain
    torch and FlashMLA."""
    from benchmarks.timing import bench_us, graphed, rotating, steady_us

    fl, bound = floor_us(b, t, h, *ceilings, s_q=s_q)
    row = dict(b=b, t=t, h=h, s_q=s_q, kv_cache_dtype="auto", bytes_per_token=bytes_per_token("auto"), page=PAGE,
               copies=len(caches), floor_us=fl, bound=bound, time_us=None, flashmla_us=None,
               flashmla_max_abs_diff=None)
    ours_out = None
    try:  # a call that fails here is a result too: record it, time the rest
        kernel, config, splits = kernel_and_splits(q, caches[0], block_table, seq_lens, C, t, num_sms)
        row["config"] = dict(config, num_kv_splits=splits)
        ours = decode_call(q, block_table, seq_lens, kernel, splits)
        row["eager_us"] = bench_us(rotating(ours, caches))
        row["time_us"] = bench_us(graphed(ours, caches))
        row["dirty_l2_time_us"] = bench_us(graphed(ours, caches), l2="dirty")
        row["steady_us"] = steady_us(ours, caches)
        if kernel != "triton":  # the Triton kernel beside it, as it would run here
            tsplits = triton_splits(q, t, num_sms)
            row["triton_time_us"] = bench_us(graphed(decode_call(q, block_table, seq_lens, "triton", tsplits), caches))
            row["triton_num_kv_splits"] = tsplits
        ours_out = ours(caches[0])[0].float()
        if kernel == "triton" and s_q > 1:
            sm90_query_tokens(row, q, caches, block_table, seq_lens, t, num_sms)
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    try:
        expected, _ = torch_decode(q, caches[0], block_table, seq_lens)
        if ours_out is not None:
            want = expected.float()
            row["max_rel_err_vs_torch"] = ((ours_out - want).abs().max() / want.abs().max()).item()
        del expected
        row["torch_us"] = bench_us(rotating(lambda cache: torch_decode(q, cache, block_table, seq_lens), caches))
    except torch.cuda.OutOfMemoryError:
        row["torch_us"] = None
    if flashmla_ok:
        try:
            theirs = flashmla_fn(q, block_table, seq_lens)
            row["flashmla_us"] = bench_us(graphed(theirs, caches))
            if ours_out is not None:
                their_out = theirs(caches[0]).float().view_as(ours_out)
                row["flashmla_max_abs_diff"] = (ours_out - their_out).abs().max().item()
        except Exception as e:  # noqa: BLE001
            row["flashmla_error"] = f"{type(e).__name__}: {e}"[:300]
    return add_ratios(row)


def fp8_row(kind, b, t, h, s_q, q, caches, block_table, seq_lens, ceilings, num_sms, exact) -> dict:
    """An fp8 layout's row: its caches written from the bf16 ``caches``, mla_decode timed on them
    as on the bf16 ones, its out checked against the reference on the same fp8 cache and against
    ``exact()``, the reference's out on the bf16 rows."""
    from benchmarks.timing import bench_us, graphed, steady_us

    fl, bound = floor_us(b, t, h, *ceilings, s_q=s_q, kv_cache_dtype=kind)
    row = dict(b=b, t=t, h=h, s_q=s_q, kv_cache_dtype=kind, bytes_per_token=bytes_per_token(kind), page=PAGE,
               copies=cache_copies(b, t, kind), floor_us=fl, bound=bound, time_us=None, flashmla_us=None,
               flashmla_max_abs_diff=None, flashmla_skipped=FLASHMLA_SKIPPED)
    try:  # a layout that fails here is a result too: record it, run the next
        fp8_caches, scale = write_fp8_caches(kind, caches, row["copies"])
        if scale is not None:
            row["kv_scale"] = scale.item()
        kernel, config, splits = kernel_and_splits(q, fp8_caches[0], block_table, seq_lens, C, t, num_sms,
                                                   kv_cache_dtype=kind)
        row["config"] = dict(config, num_kv_splits=splits)
        ours = decode_call(q, block_table, seq_lens, kernel, splits, kv_cache_dtype=kind, kv_scale=scale)
        row["time_us"] = bench_us(graphed(ours, fp8_caches))
        row["steady_us"] = steady_us(ours, fp8_caches)
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"[:300]
        return add_ratios(row)
    try:
        out = ours(fp8_caches[0])[0].float()
        want = reference_out(q, fp8_caches[0], block_table, seq_lens, kv_cache_dtype=kind, kv_scale=scale)
        row["max_abs_diff"] = (out - want).abs().max().item()
        row["max_rel_err_vs_reference"] = row["max_abs_diff"] / want.abs().max().item()
        del want
        row["max_abs_err_vs_bf16_cache"] = (out - exact()).abs().max().item()
    except Exception as e:  # noqa: BLE001
        row["check_error"] = f"{type(e).__name__}: {e}"[:300]
    if kernel == "triton" and s_q == 1:
        cuda_fp8(row, "cuda-sm80" if h <= 16 else "cuda-sm90", q, fp8_caches, block_table, seq_lens, scale, t,
                 num_sms)
    elif kernel != "triton":  # the Triton kernel on this cache beside it, as it runs where no CUDA stage 1 does
        forced_kernel(row, "triton", "triton", q, fp8_caches, block_table, seq_lens, t, num_sms,
                      kv_cache_dtype=kind, kv_scale=scale)
    return add_ratios(row)


def forced_kernel(row, prefix, kernel, q, caches, block_table, seq_lens, t, num_sms, **layout) -> None:
    """Time a stage-1 ``kernel`` that mla_decode does not pick by default for these arguments,
    forced, as ``time_us`` is timed: ``{prefix}_time_us``, its split count, its largest error
    against the reference on the same cache relative to the output's largest value
    (``{prefix}_max_rel_err_vs_reference``), or ``{prefix}_error`` saying why it did not run.
    ``layout``: kv_cache_dtype and kv_scale of an fp8 cache."""
    from benchmarks.timing import bench_us, graphed
    from mla.kernels.decode import plan_num_kv_splits

    try:
        rows = q.shape[1] * q.shape[2] if q.dim() == 4 else q.shape[1]  # s_q x h query rows
        splits = plan_num_kv_splits(kernel, row["b"], rows, t, num_sms,
                                    kv_cache_dtype=layout.get("kv_cache_dtype", "auto"))
        call = decode_call(q, block_table, seq_lens, kernel, splits, **layout)
        out = call(caches[0])[0].float()
        want = reference_out(q, caches[0], block_table, seq_lens, **layout)
        row[f"{prefix}_max_rel_err_vs_reference"] = (out - want).abs().max().item() / want.abs().max().item()
        del out, want
        row[f"{prefix}_time_us"] = bench_us(graphed(call, caches))
        row[f"{prefix}_num_kv_splits"] = splits
    except Exception as e:  # noqa: BLE001
        row[f"{prefix}_error"] = f"{type(e).__name__}: {e}"[:300]


def sm90_query_tokens(row, q, caches, block_table, seq_lens, t, num_sms) -> None:
    """The wgmma stage 1 on s_q > 1 query tokens (its s_q x h rows packed into 64-row tiles),
    forced while mla_decode does not pick it by default
    (``backends.SM90_TAKES_QUERY_TOKENS_BY_DEFAULT``): the ``sm90_sq_*`` fields."""
    forced_kernel(row, "sm90_sq", "cuda-sm90", q, caches, block_table, seq_lens, t, num_sms)


def cuda_fp8(row, kernel, q, fp8_caches, block_table, seq_lens, scale, t, num_sms) -> None:
    """The fp8 path of the CUDA stage 1 ``kernel`` ("cuda-sm80" at <= 16 heads, "cuda-sm90" above),
    forced while mla_decode does not pick it by default (``backends.SM80_READS_FP8_BY_DEFAULT``,
    ``SM90_READS_FP8_BY_DEFAULT``): ``cuda_fp8_kernel`` names it, and the ``cuda_fp8_*`` fields."""
    row["cuda_fp8_kernel"] = kernel
    forced_kernel(row, "cuda_fp8", kernel, q, fp8_caches, block_table, seq_lens, t, num_sms,
                  kv_cache_dtype=row["kv_cache_dtype"], kv_scale=scale)


def run(args) -> dict:
    import triton

    from benchmarks.timing import copy_bandwidth_GBps, graph_overhead_us, matmul_TFLOPs

    t0 = time.time()
    flashmla_ok, flashmla = flashmla_status() if args.flashmla else (False, "not run (--no-flashmla)")
    ceilings = copy_bandwidth_GBps(), matmul_TFLOPs()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    overhead = graph_overhead_us()
    print(f"ceilings: copy {ceilings[0]:.0f} GB/s (read + write), bf16 matmul {ceilings[1]:.0f} TFLOP/s, "
          f"{num_sms} SMs; a graph of one 1-element kernel times {overhead:.1f} us")
    print(f"FlashMLA: {flashmla}" + ("" if flashmla_ok else "; its columns are n/a"))
    print(f"cache layouts: {', '.join(args.kv_cache_dtypes)}")
    print(HEADER)
    rows = []
    for s_q in args.s_q:
        for b, t, h in args.shapes:
            for row in bench_shape(b, t, h, s_q, ceilings, num_sms, flashmla_ok, args.kv_cache_dtypes):
                rows.append(row)
                print(format_row(row), flush=True)
    if args.kv_cache_dtypes != ["auto"]:
        print("\n".join(format_targets(target_checks(rows))))
    return assemble(
        rows,
        copy_GBps=ceilings[0], matmul_TFLOPs=ceilings[1], graph_overhead_us=overhead,
        l2_clear="clean: a 256 MiB buffer read (a float32 sum) before each timed call (dirty_l2_time_us: zeroed, "
                 "do_bench's way)",
        flashmla=flashmla if flashmla_ok else None, flashmla_status=flashmla,
        device=torch.cuda.get_device_name(0), num_sms=num_sms, torch=torch.__version__,
        triton=triton.__version__, python=platform.python_version(), kv_cache_dtypes=args.kv_cache_dtypes,
        wall_s=time.time() - t0,
    )


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_decode: needs a CUDA GPU")
    torch.manual_seed(0)
    write_results(args.out, run(args))


if __name__ == "__main__":
    main()
