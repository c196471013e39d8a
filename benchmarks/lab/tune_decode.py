"""Tuning the Triton decode kernel's launch config on the GPU: a sweep, a list of variants, a candidate default.

    PYTHONPATH=. python3 benchmarks/lab/tune_decode.py --out DIR --sweep              # <= ~5 min
    PYTHONPATH=. python3 benchmarks/lab/tune_decode.py --out DIR --variants           # the VARIANTS list
    PYTHONPATH=. python3 benchmarks/lab/tune_decode.py --out DIR --set num_warps=8    # a candidate default
    PYTHONPATH=. python3 benchmarks/lab/tune_decode.py --out DIR --variants --kv-cache-dtype fp8_ds_mla  # FP8_VARIANTS

Sweep: stage-1 configs (BLOCK_H, BLOCK_N, num_warps, num_stages) x split counts at
``SWEEP_SHAPES``, the best per shape printed, everything written to ``h200-decode-sweep.json``.
Each config compiles once (the compile dominates), and the sweep stops starting new configs after
``--budget-s`` seconds.

Variants: ``VARIANTS``, each entry a config change at a few shapes with the prediction written
before it ran, graph and eager times and the compiled kernel's registers, spills and shared
memory; writes ``h200-decode-variants.json``. Earlier lists, and the options they tried that
the kernel no longer has, are in git history and in NOTES.md; their results in results/.

On an fp8 cache (``--kv-cache-dtype fp8_e4m3|fp8_ds_mla``) the variants are ``FP8_VARIANTS``,
the caches written from the same bf16 rows, outputs checked against the reference on the fp8
cache; the file name takes the layout (``h200-decode-variants-fp8_ds_mla.json``).

Candidate (``--set KEY=VALUE``): the Triton kernel with a ``default_config`` key overridden, at
every shape of the decode benchmark (graph time, as its ``time_us``); writes
``h200-decode-candidate.json``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
import time

import torch

from benchmarks.bench_decode import C, PAGE, SCALE, SHAPES, make_inputs, torch_decode
from benchmarks.timing import bench_us, graphed, write_json

SWEEP_SHAPES = [(64, 4096, 16), (64, 4096, 128), (2, 65536, 16), (2, 65536, 128)]

A16, B16, C16 = (64, 4096, 16), (128, 8192, 16), (64, 16384, 16)
D16, E16, F16 = (2, 65536, 16), (4, 131072, 16), (1, 32768, 16)
VARIANTS = [  # name, config overrides, shapes, split counts (None: the automatic one), prediction
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
    ("16h-w8-small-b", {"num_warps": 8}, [D16, F16], [128], "w8 with 128 splits: 101 / 49 us"),
]


# The fp8 tiles default_config takes (16 rows: BLOCK_N 32, 4 warps, 2 stages; 64 rows: the bf16
# tile) are the fastest of these on an H200; each variant spells its whole tile, so the table
# stays what it says when the defaults move.
A128, G128 = (64, 4096, 128), (4, 131072, 128)
_FP8_16 = {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
_FP8_64 = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
FP8_VARIANTS = [
    ("fp8-16h-default", {}, [A16, D16], None, "the fastest of the 16-row tiles"),
    ("fp8-16h-n32-w8-s3", dict(_FP8_16, num_warps=8, num_stages=3), [A16, D16], None,
     "spill-free on every Triton, 1.6x slower"),
    ("fp8-16h-n64-w8-s2", dict(_FP8_16, BLOCK_N=64, num_warps=8), [A16, D16], None, "10-20% slower"),
    ("fp8-16h-bf16-tiles", dict(_FP8_16, BLOCK_N=64, num_stages=3), [A16], None, "spills, 25-30% slower"),
    ("fp8-128h-default", {}, [A128, G128], None, "64 rows, wgmma, spills: the fastest at 128 heads"),
    ("fp8-128h-32rows-s1", dict(_FP8_64, BLOCK_H=32, BLOCK_N=32, num_stages=1), [A128, G128], None,
     "spill-free, mma.sync: 3-5x slower"),
    ("fp8-128h-32rows-n64-s2", dict(_FP8_64, BLOCK_H=32), [A128], None, "mma.sync: 2-3.5x slower"),
    ("fp8-128h-64rows-n16-s1", dict(_FP8_64, BLOCK_N=16, num_stages=1), [A128, G128], None,
     "64 rows, wgmma, the least spilling of them: 2-3x slower"),
]


def triton_call(q, block_table, seq_lens, splits, overrides, kv_cache_dtype="auto", kv_scale=None):
    """fn(cache): mla_decode's Triton kernel with a config override and a fixed split count."""
    from mla.kernels.decode import mla_decode

    return lambda cache: mla_decode(q, cache, block_table, seq_lens, kv_lora_rank=C, softmax_scale=SCALE,
                                    num_kv_splits=splits, kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale,
                                    _config=overrides, _backend="triton")


def auto_splits(b, t, h, config, num_sms):
    from mla.kernels.decode import choose_num_kv_splits

    return choose_num_kv_splits(b, h, t, num_sms, block_h=config["BLOCK_H"], block_n=config["BLOCK_N"])


def sweep_configs():
    """The grid: BLOCK_H for the heads at hand, tiles of 16..64 tokens, 4 or 8 warps, 1..3 stages."""
    # likeliest first (2 stages, 32-token tiles), BLOCK_H innermost so that both head counts
    # progress together if the time budget cuts the sweep short
    for stages, block_n, warps, block_h in itertools.product((2, 1, 3), (32, 64, 16), (4, 8), (16, 64, 32)):
        if block_n == 64 and stages == 3:  # 3 x (64 x 576) bf16 tiles leave no shared memory for the rest
            continue
        yield dict(BLOCK_H=block_h, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def run_sweep(out_dir, budget_s):
    t0 = time.time()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    inputs = {shape: make_inputs(*shape) for shape in SWEEP_SHAPES}
    results, best, skipped = [], {}, 0
    configs = list(sweep_configs())
    for k, config in enumerate(configs):
        if time.time() - t0 > budget_s:
            skipped = len(configs) - k
            print(f"budget of {budget_s} s spent; {skipped} configs not tried")
            break
        for b, t, h in SWEEP_SHAPES:
            if (h <= 16) != (config["BLOCK_H"] == 16):  # 16 heads: BLOCK_H 16 only; 128 heads: 32 or 64
                continue
            q, (cache,), block_table, seq_lens = inputs[(b, t, h)]
            auto = auto_splits(b, t, h, config, num_sms)
            one_wave = b * math.ceil(h / config["BLOCK_H"]) >= num_sms
            for splits in sorted({auto, 2} if one_wave else {auto, 1, 8, 32, 64}):
                row = dict(b=b, t=t, h=h, page=PAGE, config=dict(config, num_kv_splits=splits))
                try:
                    fn = triton_call(q, block_table, seq_lens, splits, config)
                    row["time_us"] = bench_us(lambda: fn(cache), warmup_ms=5, rep_ms=25)
                except Exception as e:  # noqa: BLE001  (out of shared memory / registers: record it)
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                    results.append(row)
                    break  # the config fails the same way at every split count
                results.append(row)
                if (b, t, h) not in best or row["time_us"] < best[(b, t, h)]["time_us"]:
                    best[(b, t, h)] = row
        print(f"[{time.time() - t0:5.0f} s] config {k + 1}/{len(configs)} {config}", flush=True)
    print(f"\nbest per shape ({time.time() - t0:.0f} s):")
    for (b, t, h), row in sorted(best.items()):
        print(f"{b:>4} {t:>7} {h:>4} {row['time_us']:>9.1f}  {row['config']}")
    write_json(out_dir, "h200-decode-sweep.json", dict(
        device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=__import__("triton").__version__,
        wall_s=time.time() - t0, configs_not_tried=skipped, best=[best[key] for key in sorted(best)],
        rows=results))


def kernel_stats(jit_fn, seen: set) -> list[dict]:
    """Registers, spills, shared memory and instruction mix of kernels jit_fn compiled since last asked.

    Reads Triton's in-memory kernel cache (its layout differs between versions, so searched
    loosely); each CompiledKernel is reported once, keyed by id in ``seen``.
    """
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


def run_variants(out_dir, budget_s, variants=VARIANTS, out_name="h200-decode-variants.json",
                 kv_cache_dtype="auto"):
    from benchmarks.bench_decode import reference_out, write_fp8_caches
    from mla.kernels.decode import default_config
    from mla.kernels.triton_decode import _mla_decode_split_kernel

    t0 = time.time()
    seen = set()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    inputs, expected, rows = {}, {}, []
    print(f"{'variant':<16} {'b':>4} {'t':>7} {'h':>4} {'splits':>6} {'graph us':>9} {'eager us':>9} {'err':>8}  config")
    for name, overrides, shapes, split_list, prediction in variants:
        if time.time() - t0 > budget_s:
            print(f"budget of {budget_s} s spent; {name} and later not run")
            break
        for b, t, h in shapes:
            if (b, t, h) not in inputs:
                q, caches, block_table, seq_lens = make_inputs(b, t, h)
                scale = None
                if kv_cache_dtype != "auto":
                    caches, scale = write_fp8_caches(kv_cache_dtype, caches, 1)
                inputs[(b, t, h)] = q, caches[0], block_table, seq_lens, scale
            q, cache, block_table, seq_lens, scale = inputs[(b, t, h)]
            layout = dict(kv_cache_dtype=kv_cache_dtype, kv_scale=scale)
            config = dict(default_config(h, kv_cache_dtype), **overrides)
            auto = auto_splits(b, t, h, config, num_sms)
            for splits in split_list or [auto]:
                row = dict(variant=name, prediction=prediction, b=b, t=t, h=h, page=PAGE,
                           kv_cache_dtype=kv_cache_dtype, config=dict(config, num_kv_splits=splits), auto_splits=auto)
                try:
                    call = triton_call(q, block_table, seq_lens, splits, overrides, **layout)
                    row["eager_us"] = bench_us(lambda: call(cache), warmup_ms=5, rep_ms=30)
                    row["time_us"] = bench_us(graphed(call, [cache]), warmup_ms=5, rep_ms=30)
                    row["compiled"] = kernel_stats(_mla_decode_split_kernel, seen)
                    if (b, t, h) not in expected and kv_cache_dtype == "auto":
                        expected[(b, t, h)] = torch_decode(q, cache, block_table, seq_lens)[0].float()
                    elif (b, t, h) not in expected:  # the reference on the same fp8 cache
                        expected[(b, t, h)] = reference_out(q, cache, block_table, seq_lens, **layout)
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
    write_json(out_dir, out_name, dict(
        device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=__import__("triton").__version__,
        wall_s=time.time() - t0, rows=rows))


def parse_set(items) -> dict:
    """['KEY=VALUE', ...] -> {KEY: int or bool}."""
    overrides = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise SystemExit(f"--set takes KEY=VALUE, got {item!r}")
        lowered = value.lower()
        overrides[key] = lowered == "true" if lowered in ("true", "false") else int(value)
    return overrides


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for the JSON results")
    parser.add_argument("--sweep", action="store_true", help="time a grid of kernel configs")
    parser.add_argument("--variants", action="store_true", help="time the VARIANTS list")
    parser.add_argument("--budget-s", type=float, default=240, help="stop starting configs after this")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_ds_mla"],
                        help="the cache layout the variants and the candidate run on (fp8: FP8_VARIANTS)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a default_config key (int or true/false) tried at every shape of the decode benchmark")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_decode: needs a CUDA GPU")
    torch.manual_seed(0)
    if args.sweep:
        run_sweep(args.out, args.budget_s)
    kind = args.kv_cache_dtype
    suffix = "" if kind == "auto" else f"-{kind}"
    if args.variants:
        run_variants(args.out, args.budget_s, VARIANTS if kind == "auto" else FP8_VARIANTS,
                     f"h200-decode-variants{suffix}.json", kv_cache_dtype=kind)
    if args.set:
        overrides = parse_set(args.set)
        run_variants(args.out, args.budget_s, [("candidate", overrides, SHAPES, None, "")],
                     f"h200-decode-candidate{suffix}.json", kv_cache_dtype=kind)


if __name__ == "__main__":
    main()
