"""How far an fp8 latent cache moves the paged tier's output: each cache dtype against float32.

    PYTHONPATH=. python3 benchmarks/accuracy_fp8.py --out benchmarks/results          # the CPU
    PYTHONPATH=. python3 benchmarks/accuracy_fp8.py --device cuda --out ...          # a GPU, bf16

One layer of `--preset` (DeepSeek-V3) with random weights (`MLAWeights(seed=0)`). The reference
is the naive tier in float32 (the paper's dataflow, the cache in float32). Against it, the paged
tier in `--dtype` (float32 on the CPU, bf16 on a GPU) with each `kv_cache_dtype`: "auto" (the
cache in the weights' dtype), "fp8_e4m3" (calibrated on the first prefill) and "fp8_ds_mla".
Each runs the ragged scenario the tier tests run, three rows:

    prefill   rows of `--prompt` and 3/5 of it new tokens, the middle row sitting out
    mixed     an extend over the cached prompt, a whole prefill of the middle row, a decode
    decode    `--decode-steps` steps of one token a row

under each prefill path ("up-project": the flash kernels over the dequantised context;
"absorbed": the multi-token decode kernel reading the fp8 rows). For each call: the relative
error ||y - y_ref|| / ||y_ref|| over the call's real tokens, and the largest |y - y_ref| over
max |y_ref|. Also the error of the stored latent itself, ||dequantised - float32|| / ||float32||
over the cached rows, the floor every attention output inherits.

Prints a table and writes `DEVICE-fp8-accuracy.json` into `--out`. Nothing here asserts a bound;
tests/test_paged_fp8.py checks the bound the docs state (docs/derivations/fp8-cache.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch

import mla

KINDS = ("auto", "fp8_e4m3", "fp8_ds_mla")
PATHS = ("up-project", "absorbed")


def scenario(prompt: int, decode_steps: int) -> list[tuple[str, list[int]]]:
    """(phase, new tokens a row) of each call, three rows: the tests' ragged pattern, scaled."""
    calls = [("prefill", [prompt, 0, 3 * prompt // 5]),
             ("mixed", [max(2, prompt // 4), prompt // 2, 1])]
    return calls + [("decode", [1, 1, 1])] * decode_steps


def rel_errors(out: torch.Tensor, ref: torch.Tensor, lengths: list[int]) -> tuple[float, float]:
    """(||out - ref|| / ||ref||, max |out - ref| / max |ref|) over the real tokens, float64."""
    real = torch.cat([o[:n] for o, n in zip(out.double(), lengths)])
    want = torch.cat([r[:n] for r, n in zip(ref.double(), lengths)])
    diff = real - want
    return float(diff.norm() / want.norm()), float(diff.abs().max() / want.abs().max())


def latent_error(paged_cache, naive_cache) -> float:
    """||dequantised - float32|| / ||float32|| of the latent rows both caches hold."""
    num = den = 0.0
    for i in range(paged_cache.batch_size):
        t = int(paged_cache.seq_lens[i])
        if not t:
            continue
        kv_c, k_pe = paged_cache.gather(i)
        got = torch.cat([kv_c, k_pe], dim=-1).double()
        want = torch.cat([naive_cache.kv_c[i, :t], naive_cache.k_pe[i, :t]], dim=-1).double()
        num += float((got - want).pow(2).sum())
        den += float(want.pow(2).sum())
    return (num / den) ** 0.5


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = mla.MLAConfig.from_preset(args.preset)
    weights32 = mla.MLAWeights(config, dtype=torch.float32, device=device, seed=0)
    weights = weights32 if dtype == torch.float32 else copy.deepcopy(weights32).to(dtype)
    naive = mla.build(weights32, "naive")
    calls = scenario(args.prompt, args.decode_steps)
    max_len = sum(max(n) for _, n in calls)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3, max(n), config.hidden_size, generator=gen) for _, n in calls]
    for x, (_, lengths) in zip(inputs, calls):
        for i, n in enumerate(lengths):
            x[i, n:] = 0.0

    # the reference outputs, once
    ref_cache = naive.new_cache(3, max_len)
    with torch.no_grad():
        refs = [naive(x.to(device), ref_cache, lengths) for x, (_, lengths) in zip(inputs, calls)]

    rows = []
    for path in PATHS:
        for kind in KINDS:
            start = time.perf_counter()
            paged = mla.build(weights, "paged", kv_cache_dtype=kind, prefill=path)
            cache = paged.new_cache(3, max_len)
            errors: dict[str, list[tuple[float, float]]] = {}
            with torch.no_grad():
                for x, ref, (phase, lengths) in zip(inputs, refs, calls):
                    out = paged(x.to(device, dtype), cache, lengths)
                    errors.setdefault(phase, []).append(rel_errors(out, ref, lengths))
            row = dict(path=path, kv_cache_dtype=kind, bytes_per_token=cache.bytes_per_token,
                       latent_rel_err=latent_error(cache, ref_cache),
                       kv_scale=None if cache.kv_scale is None else float(cache.kv_scale))
            for phase, errs in errors.items():
                row[f"{phase}_rel_err"] = max(e[0] for e in errs)
                row[f"{phase}_max_err"] = max(e[1] for e in errs)
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            print(format_row(row), flush=True)
    return dict(device=torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or "cpu",
                torch=torch.__version__, preset=args.preset, dtype=str(dtype).removeprefix("torch."),
                reference="naive tier, float32", scenario=[dict(phase=p, lengths=n) for p, n in calls],
                rows=rows)


def format_row(row: dict) -> str:
    cells = [f"{row['path']:>10}", f"{row['kv_cache_dtype']:>10}", f"{row['bytes_per_token']:>5}",
             f"{row['latent_rel_err']:.2e}"]
    for phase in ("prefill", "mixed", "decode"):
        cells.append(f"{row.get(phase + '_rel_err', float('nan')):.2e}")
        cells.append(f"{row.get(phase + '_max_err', float('nan')):.2e}")
    return "  ".join(cells)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="the paged tier's weights (default float32 on the CPU, bf16 on a GPU)")
    parser.add_argument("--prompt", type=int, default=40, help="new tokens of the first row's prompt")
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--out", default=None, help="a directory for DEVICE-fp8-accuracy.json")
    args = parser.parse_args(argv)
    print("      path  cache dtype  B/tok  latent err  prefill rel / max   mixed rel / max"
          "     decode rel / max")
    result = run(args)
    if args.out:
        tag = "h200" if "H200" in result["device"] else ("cpu" if args.device == "cpu" else "gpu")
        path = Path(args.out) / f"{tag}-fp8-accuracy.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
