"""Kernel times of mla_decode's two stages (split kernel, merge) at small batch, two kernels side by side.

    git show 7ccd04e:mla/kernels/decode.py > /tmp/decode_old.py      # the loop-over-splits merge
    PYTHONPATH=. python3 benchmarks/probe_merge.py --old /tmp/decode_old.py --out benchmarks/results

For each (b, t, h) and split count: the whole call's do_bench median (eager, L2 flushed) and each
kernel's mean device time over 20 back-to-back calls from torch.profiler, for this checkout's
kernel ("new"), the same with 8 warps at 16 heads ("new-w8") and the kernel in --old ("old").
Writes ``h200-decode-merge-probe.json``. This is how NOTES.md row 22 (the one-load merge) was
measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import torch

SHAPES = [((1, 32768, 16), [16, 64, 128]), ((1, 32768, 128), [30, 60, 120]),
          ((2, 65536, 16), [64, 128]), ((64, 4096, 16), [4])]


def kernel_times_us(fn, n=20) -> dict[str, float]:
    """Mean device time a call of each mla_decode kernel, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / n, 1) for e in prof.key_averages() if "mla_decode" in e.key}


def main(argv=None):
    from benchmarks.bench_decode import C, SCALE, bench_us, make_inputs, write_json
    import mla.kernels.decode as new

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="path of the decode.py to compare against")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    spec = importlib.util.spec_from_file_location("decode_old", os.path.abspath(args.old))
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)

    rows = []
    for (b, t, h), split_counts in SHAPES:
        q, (cache,), block_table, seq_lens = make_inputs(b, t, h)
        for splits in split_counts:
            for name, module, config in (("new", new, None), ("new-w8", new, {"num_warps": 8}), ("old", old, None)):
                if config and h > 16:
                    continue

                def fn(module=module, config=config, splits=splits):
                    return module.mla_decode(q, cache, block_table, seq_lens, kv_lora_rank=C,
                                             softmax_scale=SCALE, num_kv_splits=splits, _config=config)

                row = dict(b=b, t=t, h=h, splits=splits, kernel=name, eager_us=bench_us(fn, warmup_ms=5, rep_ms=30),
                           kernel_us=kernel_times_us(fn))
                rows.append(row)
                print(json.dumps(row), flush=True)
    write_json(args.out, "h200-decode-merge-probe.json",
               dict(device=torch.cuda.get_device_name(0), old=args.old, rows=rows))


if __name__ == "__main__":
    main()
