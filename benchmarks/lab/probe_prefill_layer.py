"""Lab probe: where a paged layer's prefill call spends its time, call by call.

For each (b, s) prompt on an empty cache (DeepSeek-V3 sizes, bf16) it times eight calls in a row
(each its own pair of CUDA events, the cache's lengths reset between calls, the host's share of
each call beside it) and profiles one more with torch.profiler, printing the operators with the
most device and host time.

With ``--flex-compile`` it then compiles FlexAttention at the same shape (after
``torch._dynamo.reset()``, so every shape compiles, as bench_prefill.py's flex contender does
before the next shape's layer) and times eight more layer calls right after, with the 1-minute
load average and this process's descendant processes (TorchInductor's compile workers) before
each series: bench_prefill.py read 60 / 80 ms a call at 1 x 4096 / 4 x 2048 where this probe,
without a compile, reads 6.6 / 9.9. Run it twice, with and without
``TORCHINDUCTOR_COMPILE_THREADS=1`` (no worker pool), to see whether the pool is the cause.

    PYTHONPATH=. python3 benchmarks/lab/probe_prefill_layer.py --shapes 1x1024,1x4096,4x2048
    PYTHONPATH=. python3 benchmarks/lab/probe_prefill_layer.py --flex-compile
    TORCHINDUCTOR_COMPILE_THREADS=1 PYTHONPATH=. python3 benchmarks/lab/probe_prefill_layer.py --flex-compile
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import mla  # noqa: E402
from benchmarks.bench_prefill import host_load  # noqa: E402


def time_calls(paged, x, cache, n=8) -> tuple[list[float], list[float]]:
    """(event ms, host ms) of n calls in a row, the cache's lengths reset before each."""
    times, host = [], []
    with torch.no_grad():
        for _ in range(n):
            cache.seq_lens[:] = 0
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            begin = time.perf_counter()
            paged(x, cache)
            host.append(round(1e3 * (time.perf_counter() - begin), 2))
            end.record()
            torch.cuda.synchronize()
            times.append(round(start.elapsed_time(end), 2))
    return times, host


def compile_flex(cfg, b: int, s: int) -> float:
    """Compile and run flex_attention on up-projected inputs of this shape; seconds taken."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    begin = time.perf_counter()
    torch._dynamo.reset()
    h, dk = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q, k = (torch.randn(b, h, s, dk, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    v = torch.randn(b, h, s, cfg.v_head_dim, dtype=torch.bfloat16, device="cuda")
    block_mask = create_block_mask(lambda b_, h_, i, j: i >= j, None, None, s, s, device="cuda")
    torch.compile(flex_attention)(q, k, v, block_mask=block_mask, scale=dk**-0.5)
    torch.cuda.synchronize()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1x1024,1x4096,4x2048,1x8192")
    parser.add_argument("--flex-compile", action="store_true",
                        help="time the calls again right after a FlexAttention compile")
    parser.add_argument("--prefill-backend", default="triton", choices=("auto", "triton", "sdpa"),
                        help="the layer's prefill_backend (triton: the path the slow bench rows took)")
    args = parser.parse_args()
    print(f"TORCHINDUCTOR_COMPILE_THREADS={os.environ.get('TORCHINDUCTOR_COMPILE_THREADS')}, "
          f"prefill_backend={args.prefill_backend}", flush=True)
    cfg = mla.MLAConfig.from_preset("deepseek-v3")
    paged = mla.build(mla.MLAWeights(cfg, dtype=torch.bfloat16, device="cuda", seed=0), "paged",
                      prefill_backend=args.prefill_backend)
    for shape in args.shapes.split(","):
        b, s = (int(v) for v in shape.split("x"))
        cache = paged.new_cache(b, s)
        x = torch.randn(b, s, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
        load = host_load()
        times, host = time_calls(paged, x, cache)
        print(f"b={b} s={s}: ms a call, in order: {times}; host ms: {host}; before: {load}", flush=True)
        if args.flex_compile:
            seconds = compile_flex(cfg, b, s)
            load = host_load()
            times, host = time_calls(paged, x, cache)
            print(f"b={b} s={s} after a {seconds:.1f} s flex compile: ms a call: {times}; host ms: {host}; "
                  f"before: {load}", flush=True)
        cache.seq_lens[:] = 0
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                                 torch.profiler.ProfilerActivity.CUDA]) as prof:
            paged(x, cache)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8), flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=6), flush=True)


if __name__ == "__main__":
    main()
