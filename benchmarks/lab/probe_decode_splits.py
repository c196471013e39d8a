"""mla_decode's time at each split count, beside the count it plans: does the split rule pick well?

    PYTHONPATH=. python3 benchmarks/lab/probe_decode_splits.py --out DIR \\
        --shapes 64x4096x16,128x8192x16 --kv-cache-dtype auto,fp8_ds_mla --splits 1,2,3,4,6,8

For each (b, t, h) and cache layout, the decode benchmark's inputs (``bench_decode.make_inputs``;
an fp8 layout's caches written from the same bf16 rows by ``write_fp8_caches``), the stage-1
kernel ``mla_decode`` picks, and its time in a CUDA graph after a clean L2 (``bench_us``, as the
benchmark's ``time_us``) at every split count given, the planned one among them. Prints a table
(each count's time over the planned count's) and writes ``decode-splits-probe.json`` under DIR.
``--grid`` takes GRID's shapes and GRID_SPLITS' counts (those of
``lab/results/nvidia-h100-80gb-hbm3-decode-splits-probe-grid.json``, ~2.5 min on an H100 with
bf16 and fp8_ds_mla) where ``--shapes`` and ``--splits`` are not given.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_decode import (C, cache_copies, decode_call, kernel_and_splits, make_inputs,
                                     parse_kv_cache_dtypes, parse_shapes, write_fp8_caches)
from benchmarks.timing import bench_us, graphed, write_json


# 16 heads, 13 batches by 3 lengths, at most 2^20 cached tokens in all
GRID = [(b, t, 16) for b in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128) for t in (2048, 8192, 32768)
        if b * t <= 1 << 20]
GRID_SPLITS = [1, 2, 3, 4, 5, 6, 8, 11, 12, 16, 22, 24, 32, 33, 44, 48, 64, 66, 128]


def probe(shapes, layouts, counts) -> list[dict]:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for b, t, h in shapes:
        q, caches, block_table, seq_lens = make_inputs(b, t, h, copies=cache_copies(b, t))
        for layout in layouts:
            cache_set, scale = caches, None
            if layout != "auto":
                cache_set, scale = write_fp8_caches(layout, caches, cache_copies(b, t, layout))
            kernel, _, planned = kernel_and_splits(q, cache_set[0], block_table, seq_lens, C, t, num_sms,
                                                   kv_cache_dtype=layout)
            times = {}
            for splits in sorted(set(counts) | {planned}):
                call = decode_call(q, block_table, seq_lens, kernel, splits, kv_cache_dtype=layout, kv_scale=scale)
                times[splits] = bench_us(graphed(call, cache_set))
            best = min(times, key=times.get)
            rows.append(dict(b=b, t=t, h=h, kv_cache_dtype=layout, kernel=kernel, planned=planned,
                             time_us={str(k): v for k, v in times.items()}, best=best,
                             planned_over_best=times[planned] / times[best]))
            r = rows[-1]
            cells = "  ".join(f"{k}:{v / times[planned]:.3f}" for k, v in times.items())
            print(f"{b:>4} {t:>7} {h:>4} {layout:>10} {kernel:>9}  planned {planned} ({times[planned]:.1f} us)"
                  f"  best {best}  x planned: {cells}", flush=True)
            del cache_set
            torch.cuda.empty_cache()
        del q, caches, block_table, seq_lens
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/lab/results")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="BxTxH, comma-separated (default 64x4096x16,128x8192x16,64x16384x16, or GRID)")
    parser.add_argument("--kv-cache-dtype", dest="layouts", type=parse_kv_cache_dtypes,
                        default=["auto", "fp8_e4m3", "fp8_ds_mla"])
    parser.add_argument("--splits", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="counts, comma-separated (default 1,2,3,4,6,8, or GRID_SPLITS)")
    parser.add_argument("--grid", action="store_true", help="GRID and GRID_SPLITS where not given")
    args = parser.parse_args()
    shapes = args.shapes or (GRID if args.grid else parse_shapes("64x4096x16,128x8192x16,64x16384x16"))
    counts = args.splits or (GRID_SPLITS if args.grid else [1, 2, 3, 4, 6, 8])
    rows = probe(shapes, args.layouts, counts)
    write_json(args.out, "decode-splits-probe.json", dict(device=torch.cuda.get_device_name(0), rows=rows))


if __name__ == "__main__":
    main()
