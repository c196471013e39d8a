"""Lab probe: where a paged layer's prefill call spends its time, call by call.

For each (b, s) prompt on an empty cache (DeepSeek-V3 sizes, bf16) it times eight calls in a row
(each its own pair of CUDA events, the cache's lengths reset between calls) and profiles one
more with torch.profiler, printing the operators with the most device and host time.

    PYTHONPATH=. python3 benchmarks/lab/probe_prefill_layer.py --shapes 1x1024,1x4096,4x2048
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import mla  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1x1024,1x4096,4x2048,1x8192")
    args = parser.parse_args()
    cfg = mla.MLAConfig.from_preset("deepseek-v3")
    paged = mla.build(mla.MLAWeights(cfg, dtype=torch.bfloat16, device="cuda", seed=0), "paged")
    for shape in args.shapes.split(","):
        b, s = (int(v) for v in shape.split("x"))
        cache = paged.new_cache(b, s)
        x = torch.randn(b, s, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
        times = []
        with torch.no_grad():
            for _ in range(8):
                cache.seq_lens[:] = 0
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                paged(x, cache)
                end.record()
                torch.cuda.synchronize()
                times.append(round(start.elapsed_time(end), 2))
            print(f"b={b} s={s}: ms a call, in order: {times}", flush=True)
            cache.seq_lens[:] = 0
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                paged(x, cache)
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8), flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=6), flush=True)


if __name__ == "__main__":
    main()
