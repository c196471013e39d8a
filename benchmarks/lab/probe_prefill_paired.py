"""Lab probe: why the 1 x 1k prompt's layer reads 1.88 ms timed alone but 2.86 ms timed in turn
with the SDPA layer (``layer_ms`` and ``paired_calls`` at 1 x 1024 in
``benchmarks/results/nvidia-h100-80gb-hbm3-prefill.json``), while the SDPA layer reads 2.76 and
2.72 ms in the two timings.

For prompts of ``--shapes`` (DeepSeek-V3 sizes, bf16, an empty cache) it times, with
``bench_prefill``'s own timers and inputs:

- ``alone``: the paged layer on its SDPA path by ``measure`` (what the bench's ``layer_ms``
  timed then), and the SDPA layer (``sdpa_layer_ms``);
- ``pairs``: ``measure_pair`` of the layer on its SDPA path (``prefill_backend="sdpa"``; the
  runs in ``benchmarks/lab/results`` had it as "auto", which took SDPA on these prompts then)
  against itself on a second cache (``layer|layer``), against a second paged layer on the same
  weights (``layer|layer2``), against the SDPA layer as the bench pairs them
  (``layer|sdpa_layer``), the SDPA layer against itself, and the layer on the flash kernel
  (``prefill_backend="triton"``) against the SDPA layer (``layer_triton|sdpa_layer``): whether
  short prompts gain from the kernel's shorter host path;

each timed call also with its host time (the wall clock of issuing it). Then a torch.profiler
trace of three pairs of (SDPA layer, layer) calls: the host operators by their own CPU time,
whose rows show what the layer's call does in a pair that it does not do alone (a rebuilt
cuDNN plan, an allocation, a host copy). Writes probe-prefill-paired.json to --out.

    PYTHONPATH=. python3 benchmarks/lab/probe_prefill_paired.py --out /tmp/probe
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import mla  # noqa: E402
from benchmarks.bench_prefill import (  # noqa: E402
    _event_ms, _layer_inputs, bench_sdpa, measure, measure_pair, sdpa_attend_prefill)


def pair(fn_a, fn_b, reset_a, reset_b) -> dict:
    """measure_pair's dict with each side's median host time (a_host_ms, b_host_ms)."""
    host = []
    out = measure_pair(fn_a, fn_b, reset_a, reset_b, timer=functools.partial(_event_ms, host=host))
    # host[] holds the 4 untimed calls, then the timed ones in the order they ran
    timed = host[4:]
    a_host, b_host = [], []
    for i in range(0, len(timed), 2):
        first, second = timed[i], timed[i + 1]
        (a_host, b_host)[(i // 2) % 2].append(first)
        (b_host, a_host)[(i // 2) % 2].append(second)
    out.update(a_host_ms=statistics.median(a_host), b_host_ms=statistics.median(b_host))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1x1024,1x4096")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg = mla.MLAConfig.from_preset("deepseek-v3")
    weights = mla.MLAWeights(cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    # the layer's SDPA path forced: under "auto" a call of at most PREFILL_KERNEL_UP_TO new
    # tokens now runs on the kernel (layer_triton)
    layer = mla.build(weights, "paged", block_size=64, prefill_backend="sdpa")
    layer2 = mla.build(weights, "paged", block_size=64, prefill_backend="sdpa")
    layer_triton = mla.build(weights, "paged", block_size=64, prefill_backend="triton")
    sdpa_a = mla.build(weights, "paged", block_size=64)
    sdpa_b = mla.build(weights, "paged", block_size=64)
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shapes={})
    for shape in args.shapes.split(","):
        b, s = (int(v) for v in shape.split("x"))
        row = {}
        timings = {name: bench_sdpa(cfg, name, b, s, 0) for name in ("cudnn", "efficient")}
        backend = min(timings, key=lambda k: timings[k]["ms"])
        sdpa_a.attend_prefill = sdpa_attend_prefill(sdpa_a, backend)
        sdpa_b.attend_prefill = sdpa_attend_prefill(sdpa_b, backend)
        row["sdpa_backend"] = backend
        c1, x, r1 = _layer_inputs(layer, b, s, 0)
        c2, _, r2 = _layer_inputs(layer, b, s, 0)
        c3, _, r3 = _layer_inputs(layer2, b, s, 0)
        c4, _, r4 = _layer_inputs(sdpa_a, b, s, 0)
        c5, _, r5 = _layer_inputs(sdpa_b, b, s, 0)
        c6, _, r6 = _layer_inputs(layer_triton, b, s, 0)
        with torch.no_grad():
            f1 = lambda: layer(x, c1)    # noqa: E731
            f2 = lambda: layer(x, c2)    # noqa: E731
            f3 = lambda: layer2(x, c3)   # noqa: E731
            f4 = lambda: sdpa_a(x, c4)   # noqa: E731
            f5 = lambda: sdpa_b(x, c5)   # noqa: E731
            f6 = lambda: layer_triton(x, c6)  # noqa: E731
            alone = {}
            for name, fn, reset in (("layer", f1, r1), ("sdpa_layer", f4, r4)):
                m = measure(fn, reset)
                alone[name] = dict(ms=m["ms"], host_ms=m["calls"]["host_ms"], timed_ms=m["calls"]["timed_ms"])
            row["alone"] = alone
            row["pairs"] = {
                "layer|layer": pair(f1, f2, r1, r2),
                "layer|layer2": pair(f1, f3, r1, r3),
                "layer|sdpa_layer": pair(f1, f4, r1, r4),
                "sdpa_layer|sdpa_layer": pair(f4, f5, r4, r5),
                "layer_triton|sdpa_layer": pair(f6, f4, r6, r4),
            }
            for name, p in row["pairs"].items():
                print(f"{shape} {name}: a {p['a_ms']:.3f} ms (host {p['a_host_ms']:.3f}), "
                      f"b {p['b_ms']:.3f} ms (host {p['b_host_ms']:.3f}), ratio {p['ratio']:.3f}", flush=True)
            for name, a in alone.items():
                print(f"{shape} alone {name}: {a['ms']:.3f} ms (host {a['host_ms']:.3f})", flush=True)
            # the profile of pairs as the bench runs them: SDPA layer, then layer
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    r4(); f4(); torch.cuda.synchronize()   # noqa: E702
                    r1(); f1(); torch.cuda.synchronize()   # noqa: E702
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            print(table, flush=True)
            row["profile_pairs"] = table
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    r1(); f1(); torch.cuda.synchronize()   # noqa: E702
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            print(table, flush=True)
            row["profile_alone"] = table
        del sdpa_a.attend_prefill, sdpa_b.attend_prefill
        results["shapes"][shape] = row
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "probe-prefill-paired.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
