"""Benchmark mla_decode against the GPU's own ceilings, measured in the same run.

    PYTHONPATH=. python3 benchmarks/bench_decode.py --out benchmarks/results            # ~2-4 min
    PYTHONPATH=. python3 benchmarks/bench_decode.py --out benchmarks/results --sweep    # <= ~5 min

Default run. Ceilings first: device-to-device copy bandwidth (a 2 GiB copy, read + write counted)
and the bf16 matmul rate (8192^3, random data). Then, for DeepSeek-V3's cache (bf16, page 64,
c + r = 576, value c = 512) at each (b, t, h) of ``SHAPES``: mla_decode, plain torch (gather the
pages, einsum, softmax, einsum) and FlashMLA / FlashInfer when they import, each the median of
do_bench's loop with L2 cleared before every call by READING a 256 MiB buffer (``clear_l2``; do_bench
zeroes it, which leaves L2 full of dirty lines a read-only kernel must first write back: NOTES row
44; ``dirty_l2_time_us`` is do_bench's own figure); caches under 3x L2 are also rotated between
copies. mla_decode is timed twice: ``time_us`` replays it from a CUDA graph (the
kernels alone, as a serving loop that captures its decode step runs them) and ``eager_us``
calls it from Python (checks, allocation and one or two launches each time: at short shapes
the part of the call's CPU time that the clear before it does not cover shows, which depends
on the host; NOTES has the v11-v13 figures).
``steady_us`` is a call's share of a graph of >= 8 back-to-back calls (the copies in turn): a
single-call graph also pays the graph's own launch (``graph_overhead_us``, ~4-5 us on the H200),
which a captured decode step of many layers pays once (NOTES row 39). The floor of a shape is ``max(bytes / copy_bw, FLOPs / matmul_rate)`` with
bytes = cache rows read + q + out and FLOPs = 2·b·h·t·(576 + 512). Prints a table and writes
``h200-decode.json`` in DESIGN.md's schema.

Sweep (``--sweep``): stage-1 configs (BLOCK_H, BLOCK_N, num_warps, num_stages) x split counts at
a few shapes, the best per shape printed, everything written to ``h200-decode-sweep.json``. Each
config compiles once (the compile dominates), and the sweep stops starting new configs after
``--budget-s`` seconds.

Variants (``--variants``): the short ``VARIANTS`` list, each entry a config change at a few
shapes with the prediction written before it ran; writes ``h200-decode-variants.json``.

Importing this module touches no GPU, so ``python -c 'import benchmarks.bench_decode'`` works
on a CPU machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

C, R, PAGE = 512, 64, 64  # DeepSeek-V3: kv_lora_rank, rope dim, page size
D = C + R
SCALE = 192**-0.5  # (qk_nope_head_dim + qk_rope_head_dim)^-0.5; the value does not change the time
DEVICE = "cuda"

SHAPES = [  # (b, t, h)
    *[(b, t, h) for (b, t) in [(64, 4096), (128, 8192), (64, 16384)] for h in (16, 128)],
    *[(b, t, h) for (b, t) in [(1, 32768), (2, 65536), (4, 131072)] for h in (16, 128)],
]
SWEEP_SHAPES = [(64, 4096, 16), (64, 4096, 128), (2, 65536, 16), (2, 65536, 128)]


# ---------------------------------------------------------------------------------------------
# Timing and ceilings
# ---------------------------------------------------------------------------------------------


L2_CLEAR_BYTES = 256 * 2**20  # what do_bench clears with: 5x the H200's 50 MiB of L2
_l2_buffers: dict = {}


def clear_l2(mode="clean", device=None):
    """Fill L2 with lines of a 256 MiB buffer, so a timed call finds none of its own data there.

    ``clean`` reads the buffer (a float32 sum into a float32 scalar: a memset of the reduction's
    semaphores and one reduction kernel, no cast copy): L2 is left holding clean lines, which a
    call's misses evict for free. ``dirty`` zeroes it, as ``triton.testing.do_bench`` does: L2 is
    left holding dirty lines, and a call's misses first write them back, DRAM writes that are
    not the call's own (NOTES row 44).
    A decode kernel only reads and its floor counts only its reads, so its times are taken clean;
    between two layers of a served step, L2 holds mostly the weights the projections read.
    """
    if mode not in ("clean", "dirty"):
        raise ValueError(f"clear_l2: mode must be 'clean' or 'dirty', got {mode!r}")
    device = torch.device(DEVICE if device is None else device)
    if device not in _l2_buffers:
        buffer = torch.zeros(L2_CLEAR_BYTES // 4, dtype=torch.float32, device=device)
        _l2_buffers[device] = (buffer, torch.empty((), dtype=torch.float32, device=device))
    buffer, total = _l2_buffers[device]
    if mode == "dirty":
        buffer.zero_()
    else:
        torch.sum(buffer, dim=0, out=total)  # same dtype in and out: no promoted copy of the buffer


def bench_us(fn, *, warmup_ms=25, rep_ms=100, l2="clean") -> float:
    """Median time of fn() in microseconds, L2 cleared (``clear_l2(l2)``) before each call.

    The loop is do_bench's: the number of calls from a first estimate, warm-up calls without a
    clear, then each timed call between two CUDA events with the clear before the first event.
    ``l2="dirty"`` is ``triton.testing.do_bench`` itself (what every time here was before v9).
    """
    if l2 == "dirty":
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    fn()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(5):
        clear_l2(l2)
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(begin.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    reps = max(1, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        clear_l2(l2)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth_GBps(nbytes=2 * 2**30) -> float:
    """Device-to-device copy, bytes read + bytes written per second."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (us * 1e-6) / 1e9


def matmul_TFLOPs(n=8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    us = bench_us(lambda: a @ b)
    return 2 * n**3 / (us * 1e-6) / 1e12


def floor_us(b, t, h, copy_GBps, matmul_TFLOPs_) -> tuple[float, str]:
    nbytes = 2 * (b * t * D + b * h * D + b * h * C)  # cache rows + q + out, bf16
    flops = 2 * b * h * t * (D + C)
    mem_us = nbytes / (copy_GBps * 1e3)
    compute_us = flops / (matmul_TFLOPs_ * 1e6)
    return (mem_us, "memory") if mem_us >= compute_us else (compute_us, "compute")


# ---------------------------------------------------------------------------------------------
# Inputs: b sequences of t tokens each, pages of 64 in random order
# ---------------------------------------------------------------------------------------------


def make_inputs(b, t, h, *, copies=1, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    pages_per_seq = math.ceil(t / PAGE)
    num_blocks = b * pages_per_seq
    caches = [
        torch.randn(num_blocks, PAGE, D, device=DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(copies)
    ]
    block_table = torch.randperm(num_blocks, device=DEVICE, generator=gen).int().view(b, pages_per_seq)
    seq_lens = torch.full((b,), t, dtype=torch.int32, device=DEVICE)
    q = torch.randn(b, h, D, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    return q, caches, block_table, seq_lens


def rotation_copies(b, t):
    """Copies of the cache so the ones a call reads total >= 3x L2 (do_bench also flushes L2)."""
    cache_bytes = 2 * b * math.ceil(t / PAGE) * PAGE * D
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)  # H200: 50 MiB
    return max(1, min(8, math.ceil(3 * l2 / cache_bytes)))


def rotating(fn, caches):
    """fn(cache) over the copies in turn."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(caches)
        return fn(caches[state["i"]])

    return call


def _warm_up(fn, caches):
    """fn(cache) once a copy on a side stream, so compiling and first allocations stay out of a capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile) outside the capture
        for cache in caches:
            fn(cache)
    torch.cuda.current_stream().wait_stream(side)


def graphed(fn, caches):
    """fn(cache) for each copy captured in a CUDA graph; returns a call that replays them in turn.

    Replays time the kernels alone: no Python, no launch gaps between stage 1 and the merge, as
    in a serving loop that captures its decode step (``PagedMLA.decode_step``).
    """
    _warm_up(fn, caches)
    graphs = []
    for cache in caches:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(cache)
        graphs.append(graph)
    return rotating(lambda graph: graph.replay(), graphs)


def graphed_sequence(fn, caches, min_calls=8):
    """fn(cache) called back to back, the copies in turn, >= min_calls times in ONE CUDA graph.

    Returns (replay, calls): time replay and divide by calls for the time a call takes inside a
    longer sequence of kernels, as in a captured decode step of many layers. A graph of a single
    call (``graphed``) also pays the graph's own launch, ~4-5 us on the H200 (``graph_overhead_us``)
    that a step of 61 layers pays once. The copies (>= 3x L2 together) keep each call's reads
    out of L2 as in ``graphed``.
    """
    calls = len(caches) * math.ceil(min_calls / len(caches))
    _warm_up(fn, caches)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(caches[i % len(caches)])
    return graph.replay, calls


def steady_us(fn, caches) -> float:
    """Time a call takes within a graph of back-to-back calls (see graphed_sequence)."""
    replay, calls = graphed_sequence(fn, caches)
    return bench_us(replay) / calls


def torch_decode(q, kv_cache, block_table, seq_lens):
    """The plain-torch way: gather every sequence's pages, then dense MQA attention."""
    b, h, _ = q.shape
    latent = kv_cache[block_table].flatten(1, 2)  # (b, t_max, c + r)
    scores = torch.einsum("bhd,btd->bht", q, latent).float() * SCALE
    valid = torch.arange(latent.shape[1], device=q.device)[None, :] < seq_lens[:, None]  # (b, t)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.einsum("bht,btc->bhc", p, latent[..., :C])
    return out, lse


# ---------------------------------------------------------------------------------------------
# Other kernels, when installed (they are not on our machine; every failure is recorded, not raised)
# ---------------------------------------------------------------------------------------------


def flashmla_fn(q, kv_cache, block_table, seq_lens):
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    h = q.shape[1]
    metadata, num_splits = get_mla_metadata(seq_lens, h, 1)
    q4, k4 = q.unsqueeze(1), kv_cache.unsqueeze(2)  # (b, s_q=1, h, d), (blocks, page, h_kv=1, d)
    return lambda: flash_mla_with_kvcache(
        q4, k4, block_table, seq_lens, C, metadata, num_splits, softmax_scale=SCALE, causal=False
    )


def flashinfer_fn(q, kv_cache, block_table, seq_lens):
    import flashinfer

    b, h, _ = q.shape
    workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=DEVICE)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace)
    pages = block_table.shape[1]
    wrapper.plan(
        torch.arange(b + 1, dtype=torch.int32, device=DEVICE),  # qo_indptr: one query a sequence
        torch.arange(b + 1, dtype=torch.int32, device=DEVICE) * pages,  # kv_indptr
        block_table.flatten(),  # kv_indices
        seq_lens,  # kv_len_arr
        h, C, R, PAGE, False, SCALE, q.dtype, kv_cache.dtype,
    )
    q_nope, q_pe = q[..., :C].contiguous(), q[..., C:].contiguous()
    ckv, kpe = kv_cache[..., :C], kv_cache[..., C:]
    return lambda: wrapper.run(q_nope, q_pe, ckv, kpe)


OTHERS = {"flashmla": flashmla_fn, "flashinfer": flashinfer_fn}


# ---------------------------------------------------------------------------------------------
# Default run
# ---------------------------------------------------------------------------------------------


def kernel_and_splits(q, kv_cache, block_table, seq_lens, kv_lora_rank, t, num_sms, overrides=None):
    """The stage-1 kernel mla_decode picks for these arguments, its config, the split count a call
    that fixes it (a captured one) should pass for sequences of up to t tokens, and the split
    count the Triton kernel would take: (kernel, config, splits, triton_splits)."""
    from mla.kernels.decode import (
        _CUDA_HEADS, _CUDA_TILE, _SM90_HEADS, _SM90_TILE, _pick_backend, choose_num_kv_splits, default_config,
    )

    b, h, _ = q.shape
    config = dict(default_config(h), **(overrides or {}))
    triton_splits = choose_num_kv_splits(b, h, t, num_sms, block_h=config["BLOCK_H"], block_n=config["BLOCK_N"])
    kernel = _pick_backend(q, kv_cache, block_table, seq_lens, kv_lora_rank, None, bool(overrides))
    if kernel != "triton":  # csrc/mla_decode_sm80.cu (16 heads a program, tiles of 32), _sm90.cu (64, 64)
        block_h, block_n, warps = (_CUDA_HEADS, _CUDA_TILE, 4) if kernel == "cuda" else (_SM90_HEADS, _SM90_TILE, 8)
        config = dict(kernel=kernel, BLOCK_H=block_h, BLOCK_N=block_n, num_warps=warps, num_stages=2)
        splits = choose_num_kv_splits(b, h, t, num_sms, block_h=block_h, block_n=block_n, one_wave=kernel == "sm90")
        return kernel, config, splits, triton_splits
    return kernel, dict(config, kernel="triton"), triton_splits, triton_splits


def layer_splits(config, cache) -> tuple[str, int]:
    """The stage-1 kernel and the split count a paged layer's captured decode step should fix for
    this cache (its heads, its longest sequence plus the token the step appends), as
    ``kernel_and_splits`` picks them: used by bench_layer.py and bench_tp.py."""
    from mla.kernels.decode import _num_sms

    b = cache.batch_size
    q = torch.empty(b, config.num_heads, config.kv_lora_rank + config.qk_rope_head_dim,
                    dtype=cache.kv_cache.dtype, device=cache.kv_cache.device)  # the step's absorbed query
    t = int(cache.seq_lens.max()) + 1
    kernel, _, splits, _ = kernel_and_splits(q, cache.kv_cache, cache.block_table, cache.seq_lens,
                                             config.kv_lora_rank, t, _num_sms(q.device))
    return kernel, splits


def run_default(out_dir, overrides=None, out_name="h200-decode.json"):
    from mla.kernels.decode import mla_decode

    t0 = time.time()
    copy_GBps, mm_TFLOPs = copy_bandwidth_GBps(), matmul_TFLOPs()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiny = torch.zeros(1, device=DEVICE)
    graph_overhead_us = bench_us(graphed(lambda t: t.add_(1), [tiny]))  # in every time_us; not in the floor
    print(f"ceilings: copy {copy_GBps:.0f} GB/s (read + write), bf16 matmul {mm_TFLOPs:.0f} TFLOP/s, {num_sms} SMs; "
          f"a graph of one 1-element kernel times {graph_overhead_us:.1f} us")
    available = {}
    for name in OTHERS:
        try:
            __import__({"flashmla": "flash_mla", "flashinfer": "flashinfer"}[name])
            available[name] = True
        except Exception:  # noqa: BLE001  (not installed, or broken: either way not timed)
            available[name] = False

    rows = []
    print(
        f"{'b':>4} {'t':>7} {'h':>4} {'floor us':>9} {'bound':>7} {'mla us':>9} {'share':>6} {'steady':>7} {'dirty':>7} {'eager us':>9} "
        f"{'torch us':>9} {'splits':>6} {'kernel':>6} {'triton us':>9}  err"
    )
    for b, t, h in SHAPES:
        copies = rotation_copies(b, t)
        q, caches, block_table, seq_lens = make_inputs(b, t, h, copies=copies)
        kernel, config, splits, triton_splits = kernel_and_splits(
            q, caches[0], block_table, seq_lens, C, t, num_sms, overrides)

        def ours(cache, backend=kernel, splits=splits):
            return mla_decode(
                q, cache, block_table, seq_lens, kv_lora_rank=C, softmax_scale=SCALE, num_kv_splits=splits,
                _config=overrides, _backend=backend,
            )

        row = dict(b=b, t=t, h=h, page=PAGE, config=dict(config, num_kv_splits=splits), copies=copies)
        fl, bound = floor_us(b, t, h, copy_GBps, mm_TFLOPs)
        row.update(floor_us=fl, bound=bound, time_us=None, share_of_floor=None)
        try:  # a config that does not compile here is a result too: record it, time the rest
            row["eager_us"] = bench_us(rotating(ours, caches))
            row["time_us"] = bench_us(graphed(ours, caches))
            row["share_of_floor"] = fl / row["time_us"]
            row["dirty_l2_time_us"] = bench_us(graphed(ours, caches), l2="dirty")  # do_bench's clear
            row["steady_us"] = steady_us(ours, caches)
            row["steady_share_of_floor"] = fl / row["steady_us"]
            if kernel != "triton":  # the Triton kernel beside it, as it would run here
                row["triton_time_us"] = bench_us(graphed(
                    lambda cache: ours(cache, backend="triton", splits=triton_splits), caches))
                row["triton_num_kv_splits"] = triton_splits
                row["triton_steady_us"] = steady_us(
                    lambda cache: ours(cache, backend="triton", splits=triton_splits), caches)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        try:
            expected, _ = torch_decode(q, caches[0], block_table, seq_lens)
            if row["time_us"] is not None:
                got = ours(caches[0])[0].float()
                err = (got - expected.float()).abs().max() / expected.float().abs().max()
                row["max_rel_err_vs_torch"] = err.item()
                del got
            del expected
            row["torch_us"] = bench_us(rotating(lambda cache: torch_decode(q, cache, block_table, seq_lens), caches))
        except torch.cuda.OutOfMemoryError:
            row["torch_us"] = None
        for name, ok in available.items():
            if ok:
                try:
                    row[f"{name}_us"] = bench_us(OTHERS[name](q, caches[0], block_table, seq_lens))
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        cells = [
            f"{b:>4} {t:>7} {h:>4} {fl:>9.1f} {bound:>7}",
            f"{row['time_us']:>9.1f} {row['share_of_floor']:>6.2f} {row.get('steady_us', float('nan')):>7.1f} "
            f"{row.get('dirty_l2_time_us', float('nan')):>7.1f} {row['eager_us']:>9.1f}"
            if row["time_us"] else f"{'error':>9} {'':>6} {'':>7} {'':>7} {'':>9}",
            f"{row['torch_us']:>9.1f}" if row.get("torch_us") else f"{'-':>9}",
            f"{splits:>6} {kernel:>6} " + (f"{row['triton_time_us']:>9.1f} " if "triton_time_us" in row else f"{'':>9} "),
            f"{row['max_rel_err_vs_torch']:.1e}" if "max_rel_err_vs_torch" in row else row.get("error", "-"),
        ]
        print(" ".join(cells), flush=True)
        del q, caches, block_table, seq_lens
        torch.cuda.empty_cache()

    result = dict(
        copy_GBps=copy_GBps,
        matmul_TFLOPs=mm_TFLOPs,
        graph_overhead_us=graph_overhead_us,
        l2_clear="clean: a 256 MiB buffer read (a float32 sum) before each timed call (dirty_l2_time_us: zeroed, "
                 "do_bench's way)",
        device=torch.cuda.get_device_name(0),
        num_sms=num_sms,
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        python=platform.python_version(),
        wall_s=time.time() - t0,
        rows=rows,
    )
    if overrides:
        result["overrides"] = overrides
    write_json(out_dir, out_name, result)
    print(f"done in {time.time() - t0:.0f} s")


# ---------------------------------------------------------------------------------------------
# Sweep
# ---------------------------------------------------------------------------------------------


def sweep_configs():
    """The grid: BLOCK_H for the heads at hand, tiles of 16..64 tokens, 4 or 8 warps, 1..3 stages."""
    # likeliest first (2 stages, 32-token tiles), BLOCK_H innermost so that both head counts
    # progress together if the time budget cuts the sweep short
    for stages, block_n, warps, block_h in itertools.product((2, 1, 3), (32, 64, 16), (4, 8), (16, 64, 32)):
        if block_n == 64 and stages == 3:  # 3 x (64 x 576) bf16 tiles leave no shared memory for the rest
            continue
        yield dict(BLOCK_H=block_h, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def split_candidates(b, t, h, config, num_sms):
    from mla.kernels.decode import choose_num_kv_splits

    auto = choose_num_kv_splits(b, h, t, num_sms, block_h=config["BLOCK_H"], block_n=config["BLOCK_N"])
    if b * math.ceil(h / config["BLOCK_H"]) >= num_sms:
        return sorted({auto, 2})
    return sorted({auto, 1, 8, 32, 64})


def run_sweep(out_dir, budget_s):
    from mla.kernels.decode import mla_decode

    t0 = time.time()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    inputs = {shape: make_inputs(*shape) for shape in SWEEP_SHAPES}
    results = []
    best = {}
    configs = list(sweep_configs())
    skipped = 0
    for k, config in enumerate(configs):
        if time.time() - t0 > budget_s:
            skipped = len(configs) - k
            print(f"budget of {budget_s} s spent; {skipped} configs not tried")
            break
        for b, t, h in SWEEP_SHAPES:
            # 16 heads: BLOCK_H 16 only (bigger blocks are padding); 128 heads: 32 or 64
            if (h <= 16) != (config["BLOCK_H"] == 16):
                continue
            q, (cache,), block_table, seq_lens = inputs[(b, t, h)]
            for splits in split_candidates(b, t, h, config, num_sms):
                row = dict(b=b, t=t, h=h, page=PAGE, config=dict(config, num_kv_splits=splits))
                try:
                    fn = lambda: mla_decode(  # noqa: E731
                        q, cache, block_table, seq_lens, kv_lora_rank=C, softmax_scale=SCALE,
                        num_kv_splits=splits, _config=config, _backend="triton",
                    )
                    row["time_us"] = bench_us(fn, warmup_ms=5, rep_ms=25)
                except Exception as e:  # noqa: BLE001  (out of shared memory / registers: record it)
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                    results.append(row)
                    break  # the config fails the same way at every split count
                results.append(row)
                key = (b, t, h)
                if key not in best or row["time_us"] < best[key]["time_us"]:
                    best[key] = row
        print(f"[{time.time() - t0:5.0f} s] config {k + 1}/{len(configs)} {config}", flush=True)

    print(f"\nbest per shape ({time.time() - t0:.0f} s):")
    print(f"{'b':>4} {'t':>7} {'h':>4} {'us':>9}  config")
    for (b, t, h), row in sorted(best.items()):
        print(f"{b:>4} {t:>7} {h:>4} {row['time_us']:>9.1f}  {row['config']}")
    write_json(
        out_dir,
        "h200-decode-sweep.json",
        dict(
            device=torch.cuda.get_device_name(0),
            torch=torch.__version__,
            triton=__import__("triton").__version__,
            wall_s=time.time() - t0,
            configs_not_tried=skipped,
            best=[best[key] for key in sorted(best)],
            rows=results,
        ),
    )


# ---------------------------------------------------------------------------------------------
# Variants: a short, targeted list (each with the prediction made before it ran)
# ---------------------------------------------------------------------------------------------

S16 = [(64, 4096, 16), (128, 8192, 16), (2, 65536, 16)]
S128 = [(64, 4096, 128), (128, 8192, 128), (2, 65536, 128)]
# v2 ran on the kernel with PAGE_TILE / HEAD_MAJOR / split tail and default_config then:
# 16 heads BLOCK_N 32, 8 warps, 2 stages; 128 heads BLOCK_N 64, 8 warps, 2 stages
# (results/h200-decode-variants-v2.json). v3 (VARIANTS) ran on the defaults of today.
VARIANTS_V2 = [  # name, config overrides, shapes, split counts (None: the automatic one), prediction
    ("v2-default", {}, S16 + S128, None,
     "16 h: 64x4096 ~150 us, 128x8192 ~550, 2x65536 ~115; 128 h: 64x4096 ~380, 128x8192 ~1400, 2x65536 ~210"),
    ("v2-splits-16h", {}, [(64, 4096, 16)], [4, 16], "8 (auto) best; 4 and 16 within 10%"),
    ("v2-splits-16h", {}, [(128, 8192, 16)], [1, 2, 8], "4 (auto) beats 1 by >= 20%"),
    ("v2-splits-16h", {}, [(2, 65536, 16)], [64], "128 (auto) <= 64's time"),
    ("no-page-tile", {"PAGE_TILE": False}, [(64, 4096, 16), (2, 65536, 16), (64, 4096, 128)], None,
     "5-10% slower than v2-default at 16 h, ~same at 128 h"),
    ("batch-major", {"HEAD_MAJOR": False}, [(64, 4096, 128), (128, 8192, 128)], None,
     "~same at 64x4096 (one wave), 10-20% slower at 128x8192 (L2 reuse lost)"),
    ("16h-n32-s3", {"num_stages": 3}, [(64, 4096, 16), (2, 65536, 16)], None, "within 5% of 2 stages"),
    ("16h-n32-s4", {"num_stages": 4}, [(64, 4096, 16), (2, 65536, 16)], None, "slower (fewer programs an SM)"),
    ("16h-n64-s3", {"BLOCK_N": 64, "num_stages": 3}, [(64, 4096, 16), (2, 65536, 16)], None,
     "may not fit shared memory; else ~5% faster than n32"),
    ("16h-n16-w4-s4", {"BLOCK_N": 16, "num_warps": 4, "num_stages": 4}, [(64, 4096, 16), (2, 65536, 16)], None,
     "slower than n32 (more loop overhead a byte)"),
    ("128h-n64-s3", {"num_stages": 3}, [(64, 4096, 128), (2, 65536, 128)], None,
     "likely out of shared memory (3 x 72 KiB tiles + q)"),
    ("128h-n128-s1", {"BLOCK_N": 128, "num_stages": 1}, [(64, 4096, 128), (2, 65536, 128)], None,
     "slower than n64-s2 (no overlap of load and math)"),
    ("128h-n32-s3", {"BLOCK_N": 32, "num_stages": 3}, [(64, 4096, 128), (2, 65536, 128)], None,
     "v1 sweep: 485 us at 64x4096; with the fast paths ~10% better, still behind n64-s2"),
]


A16, B16, C16, D16, E16, F16 = (64, 4096, 16), (128, 8192, 16), (64, 16384, 16), (2, 65536, 16), (4, 131072, 16), (1, 32768, 16)
VARIANTS = [  # v3, on default_config of today (16 h: BLOCK_N 64, 8 warps, 3 stages)
    ("v3-splits-16h", {}, [A16], [4, 16], "8 (auto) best, as with n32"),
    ("v3-splits-16h", {}, [B16], [1, 2], "4 (auto) within 5% of the best"),
    ("v3-splits-16h", {}, [D16], [64], "128 (auto) within 5% of 64"),
    ("16h-n32-s2", {"BLOCK_N": 32, "num_stages": 2}, [B16, C16, E16], None,
     "v2's default: 5-20% slower than n64-s3 at the big shapes (as at 64x4096)"),
    ("16h-n16-w4-s4", {"BLOCK_N": 16, "num_warps": 4, "num_stages": 4}, [B16, E16, F16], None,
     "faster than n64-s3 at small batch (as at 2x65536), slower at 128x8192"),
    ("16h-no-split-tail", {"SPLIT_TAIL": False}, [A16, D16], None, "within 3% (the masks cost little)"),
    ("16h-n64-w4-s3", {"num_warps": 4}, [A16, D16], None, "slower: fewer warps to issue the loads"),
    ("16h-n64-s3-no-page-tile", {"PAGE_TILE": False}, [A16], None, "5-10% slower"),
    ("128h-no-split-tail", {"SPLIT_TAIL": False}, [(64, 4096, 128)], None, "within 3%"),
    ("128h-w16", {"num_warps": 16}, [(64, 4096, 128), (2, 65536, 128)], None,
     "~same or a little faster (half the accumulator registers a thread)"),
    ("128h-splits", {}, [(2, 65536, 128)], [32, 60], "32 ~5% faster than 30 (v1 sweep)"),
]

VARIANTS_V3 = VARIANTS
A128, B128, D128, F128 = (64, 4096, 128), (128, 8192, 128), (2, 65536, 128), (1, 32768, 128)
# v4, on default_config of today: 16 h BLOCK_N 64, 4 warps, 3 stages, ~2 programs an SM, cap 64;
# the merge reads all splits of a chunk of c in one load (was a loop over the splits)
VARIANTS = [
    ("16h-swap", {"SWAP_AB": True}, [A16, B16, D16, F16], None,
     "wgmma (64-row tiles) instead of mma.sync: 15-30% faster if the tile stays pipelined"),
    ("16h-swap-s2", {"SWAP_AB": True, "num_stages": 2}, [A16, B16], None, "within 5% of swap s3"),
    ("16h-swap-w8", {"SWAP_AB": True, "num_warps": 8}, [A16, B16], None,
     "two warpgroups halve the acc^T rows each: faster than swap w4 if registers spill at w4"),
    ("128h-swap", {"SWAP_AB": True}, [A128, B128, D128], None,
     "q^T from shared memory frees ~70 registers a thread: fewer spills, 10-30% faster"),
    ("128h-swap-n32-s3", {"SWAP_AB": True, "BLOCK_N": 32, "num_stages": 3}, [A128, D128], None,
     "smaller tiles, deeper pipeline: within 10% of swap n64 s2"),
    ("v4-16h-w8-old-default", {"num_warps": 8}, [A16, B16, D16], None,
     "8 warps ~20% slower than 4 (v3: 146 vs 116 at 64x4096)"),
    ("v4-16h-splits", {}, [A16], [8], "8 splits (old 4-an-SM rule) ~8% slower than auto (4)"),
    ("v4-16h-splits", {}, [B16], [4], "4 splits within 3% of auto (2)"),
    ("v4-16h-splits", {}, [D16, F16], [32, 128],
     "with the one-load merge, 128 splits beat 64 (auto) at b <= 2: every SM reads"),
    ("v4-128h-splits", {}, [D128, F128], [16, 64, 120],
     "with the one-load merge more splits stop costing: 60-120 within 10% of the best"),
]
# ran once (results/h200-decode-variants-v4.json) on a kernel with a SWAP_AB option (the products
# transposed so a 16-head block uses wgmma); it lost everywhere and was removed (NOTES.md)
VARIANTS_V4 = VARIANTS
# v5, on the same defaults: 16-head tiles and stages at 4 warps, split counts around the rule
VARIANTS = [
    ("16h-n32-w4-s3", {"BLOCK_N": 32, "num_stages": 3}, [A16, B16], None,
     "half the B-fragment registers of n64: no spills; within 10% of n64 s3"),
    ("16h-n32-w4-s4", {"BLOCK_N": 32, "num_stages": 4}, [A16, B16], None, "within 5% of n32 s3"),
    ("16h-n32-w4-s5", {"BLOCK_N": 32, "num_stages": 5}, [A16, B16], None, "within 5% of n32 s3"),
    ("16h-n64-w4-s2", {"num_stages": 2}, [A16, B16], None, "5-10% slower than s3 (one tile in flight)"),
    ("16h-n16-w4-s6", {"BLOCK_N": 16, "num_stages": 6}, [A16, B16], None, "slower: 4x the loop trips of n64"),
    ("16h-splits", {}, [A16], [2, 3, 5, 6], "4 (auto) within 5% of the best"),
    ("16h-splits", {}, [B16, C16], [1, 3], "2 (auto) within 5% of the best"),
    ("16h-w8-small-b", {"num_warps": 8}, [D16, E16, F16], None,
     "one program an SM: 8 warps hide more latency than 4; faster than w4 at b <= 4"),
    ("16h-w8-small-b", {"num_warps": 8}, [D16, F16], [128], "v3 (w8, 128 splits): 101 / 49 us"),
]
VARIANTS_V5 = VARIANTS  # results/h200-decode-variants-v5.json
# v6 (results/h200-decode-variants-v6.json) ran on a kernel with a TMA option: whole tiles by
# tensor descriptor instead of pointer loads. Correct and memcheck-clean, but 16 heads lost
# 50-70% and 128 heads gained 1-2%, so the option was removed (NOTES.md); kept as the record.
VARIANTS_V6 = [
    ("16h-tma", {"TMA": True}, [A16, B16, C16, D16, F16], None,
     "no per-element addresses in registers (255 -> <200, no spills): 10-25% faster at 16 h"),
    ("16h-tma-s2", {"TMA": True, "num_stages": 2}, [A16, B16], None, "within 5% of tma s3"),
    ("16h-tma-s4", {"TMA": True, "num_stages": 4}, [A16, B16], None, "may not fit; else within 5%"),
    ("16h-tma-w8", {"TMA": True, "num_warps": 8}, [A16, B16], None, "slower than w4, as without TMA"),
    ("128h-tma", {"TMA": True}, [A128, B128, D128], None, "within 10% (compute bound)"),
    ("128h-tma-s3-n32", {"TMA": True, "BLOCK_N": 32, "num_stages": 3}, [A128, D128], None,
     "deeper pipeline fits with TMA's smaller footprint: within 10% of n64 s2"),
]
# v7 (results/h200-decode-variants-v7.json) ran on a kernel with a PREFETCH_PAGE option (the next
# tile's block-table entry loaded a step ahead), on the v5 defaults; graph and eager times.
# Compiled for sm_90 with Triton 3.6 on the CPU machine first: without it a 16-head program's
# tile has ONE shared-memory buffer at any num_stages (the block-table load takes a pipeline
# stage, and the tile is re-staged for p @ V), so no tile is in flight while one is computed;
# with it, num_stages - 1 buffers (n64 s3: 2 x 72 KiB, 164 KiB, one program an SM; n32 s3:
# 2 x 36 KiB, 91 KiB, two an SM; n32 s4: 3 buffers, 127 KiB; n16 s4: 3 buffers, 72 KiB). At 64
# heads (wgmma) the n64 s2 tile already has 2 buffers; n32 s3 / s4 get 3 / 4.
VARIANTS_V7 = [
    ("default", {}, [A16, B16, C16, D16, E16, F16, A128, B128, D128], None, "the v5 numbers (same run, graph)"),
    ("16h-pf-n64-s3", {"PREFETCH_PAGE": True}, [A16, B16, C16, D16, E16, F16], None,
     "a tile in flight while one is computed: 10-20% faster, most at small b (one program an SM)"),
    ("16h-pf-n64-s3", {"PREFETCH_PAGE": True}, [A16], [2], "one program an SM at 164 KiB: 2 splits (one wave) beat 4"),
    ("16h-pf-n32-s3", {"PREFETCH_PAGE": True, "BLOCK_N": 32}, [A16, B16, C16, D16, E16, F16], None,
     "two programs an SM, each with a tile in flight: the best at 16 h, 1.25x the floor at large b"),
    ("16h-pf-n32-s3", {"PREFETCH_PAGE": True, "BLOCK_N": 32}, [F16], [256], "b = 1: 256 splits fill 2 programs an SM"),
    ("16h-pf-n32-s4", {"PREFETCH_PAGE": True, "BLOCK_N": 32, "num_stages": 4}, [A16, B16, F16], None,
     "3 buffers, one program an SM: within 5% of n32 s3"),
    ("16h-pf-n16-s4", {"PREFETCH_PAGE": True, "BLOCK_N": 16, "num_stages": 4}, [A16, B16, F16], None,
     "3 small buffers, 2 programs an SM (registers): within 10% of n32 s3"),
    ("128h-pf", {"PREFETCH_PAGE": True}, [A128, B128, D128], None, "same buffers as today: within 3%"),
    ("128h-pf-n32-s3", {"PREFETCH_PAGE": True, "BLOCK_N": 32, "num_stages": 3}, [A128, B128, D128], None,
     "3 buffers of 32 tokens (180 KiB): 5-10% faster than n64 s2"),
    ("128h-pf-n32-s4", {"PREFETCH_PAGE": True, "BLOCK_N": 32, "num_stages": 4}, [A128, B128, D128], None,
     "4 buffers (216 KiB): within 5% of n32 s3"),
]
# The predictions failed: double buffering was slower at 16 h from b = 2 up (n64 s3 +20%, one
# program an SM; n32 s3 +7%) and 10% faster only at b = 1; at 128 h n32 lost 25%. The option
# was removed (NOTES.md row 30); the list is kept as the record.
VARIANTS = VARIANTS_V5  # --variants reruns v5 on today's kernel


def kernel_stats(jit_fn, seen: set) -> list[dict]:
    """Registers, spills, shared memory and instruction mix of kernels jit_fn compiled since last asked.

    Reads Triton's in-memory kernel cache (its layout differs between versions, so searched
    loosely); each CompiledKernel is reported once, keyed by id in ``seen``.
    """
    import re

    found = []
    for cache in getattr(jit_fn, "device_caches", {}).values():
        for part in cache if isinstance(cache, tuple) else (cache,):
            if isinstance(part, dict):
                found += [k for k in part.values() if hasattr(k, "asm")]
    stats = []
    for k in found:
        if id(k) in seen:
            continue
        seen.add(id(k))
        ptx = k.asm.get("ptx", "")
        stats.append(dict(
            n_regs=getattr(k, "n_regs", None), n_spills=getattr(k, "n_spills", None),
            shared=k.metadata.shared, num_warps=k.metadata.num_warps, num_stages=k.metadata.num_stages,
            wgmma=len(re.findall(r"wgmma.mma_async", ptx)), mma_sync=len(re.findall(r"\bmma.sync", ptx)),
            cp_async=len(re.findall(r"cp.async.(?:ca|cg)", ptx)), tma=len(re.findall(r"cp.async.bulk.tensor", ptx)),
        ))
    return stats


def run_variants(out_dir, budget_s):
    from mla.kernels.decode import _mla_decode_split_kernel, choose_num_kv_splits, default_config, mla_decode

    t0 = time.time()
    seen = set()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = sorted({shape for _, _, shs, _, _ in VARIANTS for shape in shs})
    inputs, expected = {}, {}
    rows = []
    print(f"{'variant':<16} {'b':>4} {'t':>7} {'h':>4} {'splits':>6} {'graph us':>9} {'eager us':>9} {'err':>8}  config / error")
    for name, overrides, shs, split_list, prediction in VARIANTS:
        if time.time() - t0 > budget_s:
            print(f"budget of {budget_s} s spent; {name} and later not run")
            break
        for b, t, h in shs:
            if (b, t, h) not in inputs:
                inputs[(b, t, h)] = make_inputs(b, t, h)
            q, (cache,), block_table, seq_lens = inputs[(b, t, h)]
            config = dict(default_config(h), **overrides)
            auto = choose_num_kv_splits(b, h, t, num_sms, block_h=config["BLOCK_H"], block_n=config["BLOCK_N"])
            for splits in split_list or [auto]:
                row = dict(variant=name, prediction=prediction, b=b, t=t, h=h, page=PAGE,
                           config=dict(config, num_kv_splits=splits), auto_splits=auto)
                try:
                    call = lambda cache_: mla_decode(  # noqa: E731
                        q, cache_, block_table, seq_lens, kv_lora_rank=C, softmax_scale=SCALE,
                        num_kv_splits=splits, _config=overrides, _backend="triton",
                    )
                    row["eager_us"] = bench_us(lambda: call(cache), warmup_ms=5, rep_ms=30)
                    row["time_us"] = bench_us(graphed(call, [cache]), warmup_ms=5, rep_ms=30)
                    row["compiled"] = kernel_stats(_mla_decode_split_kernel, seen)
                    if (b, t, h) not in expected:
                        expected[(b, t, h)] = torch_decode(q, cache, block_table, seq_lens)[0].float()
                    want = expected[(b, t, h)]
                    row["max_rel_err_vs_torch"] = ((call(cache)[0].float() - want).abs().max() / want.abs().max()).item()
                    msg = str(config) + (f" {row['compiled']}" if row["compiled"] else "")
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                    msg = row["error"][:100]
                rows.append(row)
                us = (f"{row['time_us']:9.1f} {row['eager_us']:9.1f} {row['max_rel_err_vs_torch']:8.1e}"
                      if "max_rel_err_vs_torch" in row else f"{'error':>9} {'':>9} {'':>8}")
                print(f"{name:<16} {b:>4} {t:>7} {h:>4} {splits:>6} {us}  {msg}", flush=True)
                if "error" in row:
                    break
    write_json(
        out_dir,
        "h200-decode-variants.json",
        dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
             triton=__import__("triton").__version__, wall_s=time.time() - t0, rows=rows),
    )


def write_json(out_dir, name, result):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON results")
    parser.add_argument("--sweep", action="store_true", help="time a grid of kernel configs instead")
    parser.add_argument("--variants", action="store_true", help="time the VARIANTS list instead")
    parser.add_argument("--budget-s", type=float, default=240, help="sweep: stop starting configs after this")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="default run: override a default_config key (int or true/false), to try a "
                             "candidate default at every shape; writes h200-decode-candidate.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_decode: needs a CUDA GPU")
    torch.manual_seed(0)
    if args.variants:
        run_variants(args.out, args.budget_s)
    elif args.sweep:
        run_sweep(args.out, args.budget_s)
    elif args.set:
        overrides = {}
        for item in args.set:
            key, eq, value = item.partition("=")
            if not eq or not value:
                parser.error(f"--set takes KEY=VALUE, got {item!r}")
            overrides[key] = {"true": True, "false": False}.get(value.lower(), value)
            if isinstance(overrides[key], str):
                overrides[key] = int(value)
        run_default(args.out, overrides, "h200-decode-candidate.json")
    else:
        run_default(args.out)


if __name__ == "__main__":
    main()
