"""The wgmma decode stage 1 (``csrc/mla_decode_sm90.cu``) across split counts, on the GPU.

    PYTHONPATH=. python3 benchmarks/lab/probe_decode_sm90.py --out benchmarks/lab/results   # ~1 min, JIT build included

At the decode benchmark's (b, t) and 128, 64 and 16 heads (``--heads``), times stage 1 and the
merge (``torch.ops.mla.mla_decode_sm90`` then the Triton merge) in a CUDA graph as
``bench_decode.py``'s ``time_us`` does (at one split too, where ``mla_decode`` itself now skips the
merge: NOTES row 45), at a scan of split counts (1-8, and those that make
about one or two CTAs an SM) beside ``mla_decode``'s default call (``default_kernel``: what it
picks at these heads, at the split count ``bench_decode.kernel_and_splits`` fixes) and the Triton
kernel (``triton_us``). ``max_rel_diff_vs_default`` compares the best count's output with the
default's. Correctness is the GPU tests' job (``tests/test_kernels_decode.py``).

Writes ``h200-decode-sm90-probe.json`` (``--out-name``; NOTES row 41). The committed one came from
this script's first version (no ``triton_us``; ``default_us`` was then the Triton kernel at 64
and 128 heads); ``h200-decode-sm90-probe-h32.json`` is ``--heads 32``, both on row 41's kernel;
``h200-decode-sm90-probe-v8.json`` is ``--heads 64,32`` on row 43's (v8). The scan includes the
split count ``mla_decode`` itself takes (``default_splits``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

C = 512
SHAPES = ((64, 4096), (128, 8192), (64, 16384), (1, 32768), (4, 131072))


def stage1_and_merge(q, cache, table, lens, splits, scale):
    from mla.kernels.decode import _merge

    b, h, _ = q.shape
    part_out = torch.empty((b, h, splits, C), dtype=torch.float32, device="cuda")
    part_lse = torch.empty((b, h, splits), dtype=torch.float32, device="cuda")
    out = torch.empty((b, h, C), dtype=q.dtype, device="cuda")
    lse = torch.empty((b, h), dtype=torch.float32, device="cuda")
    torch.ops.mla.mla_decode_sm90(q, cache, table, lens, part_out, part_lse, float(scale), splits)
    _merge(part_out, part_lse, out, lse)
    return out, lse


def main(argv=None) -> None:
    from benchmarks.bench_decode import SCALE, cache_copies, floor_us, kernel_and_splits, make_inputs, triton_splits
    from benchmarks.timing import bench_us, copy_bandwidth_GBps, graphed, matmul_TFLOPs, write_json
    from mla.kernels.extension import load_extension
    from mla.kernels.decode import mla_decode

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--heads", default="128,64,16")
    parser.add_argument("--out-name", default="h200-decode-sm90-probe.json")
    args = parser.parse_args(argv)
    state = load_extension()
    assert state["decode_sm90"], state
    t0 = time.time()
    copy, mm = copy_bandwidth_GBps(), matmul_TFLOPs()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy {copy:.0f} GB/s, matmul {mm:.0f} TFLOP/s", flush=True)
    rows = []
    for h in (int(x) for x in args.heads.split(",")):
        for b, t in SHAPES:
            q, caches, table, lens = make_inputs(b, t, h, copies=cache_copies(b, t))
            floor, bound = floor_us(b, t, h, copy, mm)
            kernel, _, splits = kernel_and_splits(q, caches[0], table, lens, C, t, num_sms)
            row = dict(b=b, t=t, h=h, floor_us=round(floor, 1), bound=bound, default_kernel=kernel,
                       default_splits=splits)

            def default(cache, backend=None, splits=splits):
                return mla_decode(q, cache, table, lens, kv_lora_rank=C, softmax_scale=SCALE,
                                  num_kv_splits=splits, _backend=backend)

            row["default_us"] = round(bench_us(graphed(default, caches)), 1)
            row["triton_us"] = round(bench_us(graphed(
                lambda cache: default(cache, "triton", triton_splits(q, t, num_sms)), caches)), 1)
            want, _ = default(caches[0])
            head_blocks = -(-h // 64)
            scan = {1, 2, 3, 4, 6, 8, splits, max(1, round(num_sms / (head_blocks * b))),
                    max(1, round(2 * num_sms / (head_blocks * b)))}
            best = None
            for s in sorted(x for x in scan if x * 64 <= t):
                us = bench_us(graphed(lambda cache, s=s: stage1_and_merge(q, cache, table, lens, s, SCALE), caches))
                row[f"sm90_s{s}_us"] = round(us, 1)
                best = min(best or (us, s), (us, s))
            got, _ = stage1_and_merge(q, caches[0], table, lens, best[1], SCALE)
            row.update(best_splits=best[1], sm90_us=round(best[0], 1), x_floor=round(best[0] / floor, 2),
                       default_x_floor=round(row["default_us"] / floor, 2),
                       max_rel_diff_vs_default=float((got.float() - want.float()).abs().max()
                                                     / want.float().abs().max()))
            rows.append(row)
            print(json.dumps(row), flush=True)
            del q, caches, table, lens
            torch.cuda.empty_cache()
    write_json(args.out, args.out_name,
               dict(copy_GBps=copy, matmul_TFLOPs=mm, device=torch.cuda.get_device_name(0),
                    wall_s=time.time() - t0, rows=rows))


if __name__ == "__main__":
    main()
