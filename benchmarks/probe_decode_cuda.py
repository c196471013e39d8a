"""Where the CUDA decode's time goes, on the GPU.

    PYTHONPATH=. python3 benchmarks/probe_decode_cuda.py --out benchmarks/results

The CUDA stage 1 (``csrc/mla_decode_sm80.cu``, op ``torch.ops.mla.mla_decode_sm80``) is what
``mla_decode`` runs at <= 16 heads; its merge is the Triton one.

1. Correctness: stage 1 + the merge against ``mla_decode_reference`` (float64) on caches whose
   unused pages are NaN and whose unused block-table entries point past the cache; bf16 and
   fp16, 1, 3 and 16 heads, lengths 0-5000, 1-256 splits.
2. Breakdown at the 16-head shapes of the decode benchmark, each piece in its own CUDA graph and
   timed as ``bench_decode.py``'s ``time_us``: a 1-element add (what the timing method itself
   costs), stage 1 alone, the merge alone on stage 1's partials, the two together, and the
   Triton ``mla_decode``.

Writes ``h200-decode-cuda-breakdown.json``. Its committed copy also has a CUDA merge, alone and
launched early by programmatic dependent launch (PDL: it waited in ``griddepcontrol.wait`` for
stage 1's writes), columns ``merge_cuda_us``, ``pair_cuda_us``, ``pair_cuda-pdl_us``: both were
slower than the Triton merge (NOTES row 35), and were removed. (``h200-decode-cuda-probe.json`` and ``-v0.json``
came from this script's first version, which built the kernel on its own in four launch shapes:
``benchmarks/NOTES.md`` rows 33-34.)
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

C, R = 512, 64
MERGES = ("triton",)


def cuda_decode(q, kv_cache, block_table, seq_lens, *, softmax_scale, num_kv_splits, merge="triton"):
    """The CUDA stage 1, then the merge named (one of MERGES); mla_decode's outputs."""
    b, h, _ = q.shape
    part_out = torch.empty((b, h, num_kv_splits, C), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b, h, num_kv_splits), dtype=torch.float32, device=q.device)
    torch.ops.mla.mla_decode_sm80(q, kv_cache, block_table, seq_lens, part_out, part_lse, float(softmax_scale),
                                  num_kv_splits)
    out = torch.empty((b, h, C), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h), dtype=torch.float32, device=q.device)
    run_merge(merge, part_out, part_lse, out, lse)
    return out, lse


def run_merge(merge, part_out, part_lse, out, lse):
    from mla.kernels.decode import _merge

    assert merge in MERGES, merge
    _merge(part_out, part_lse, out, lse)


def poisoned_case(seq_lens, heads, dtype, page=64, seed=0):
    """Pages shuffled, unused rows NaN, unused block-table entries 10**6."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = len(seq_lens)
    max_pages = max(1, max(math.ceil(n / page) for n in seq_lens)) + 1
    num_pages = sum(math.ceil(n / page) for n in seq_lens) + 3
    cache = torch.full((num_pages, page, C + R), float("nan"), device="cuda", dtype=dtype)
    table = torch.full((b, max_pages), 10**6, dtype=torch.int32, device="cuda")
    perm = torch.randperm(num_pages, device="cuda", generator=g).int()
    used = 0
    for i, n in enumerate(seq_lens):
        pages = math.ceil(n / page)
        table[i, :pages] = perm[used:used + pages]
        for j in range(pages):
            rows = min(page, n - j * page)
            cache[perm[used + j], :rows] = torch.randn(rows, C + R, device="cuda", generator=g).to(dtype)
        used += pages
    q = torch.randn(b, heads, C + R, device="cuda", generator=g).to(dtype)
    return q, cache, table, torch.tensor(seq_lens, dtype=torch.int32, device="cuda")


def check(rows):
    from mla.kernels import mla_decode_reference

    scale = 192**-0.5
    cases = [([1, 31, 32, 33, 64, 65, 1000, 0], 16, [1, 2, 3, 7]), ([5000, 1, 700], 16, [1, 5, 40, 256]),
             ([100, 3000], 3, [1, 4]), ([300, 7, 0], 1, [2, 33])]
    ok_all = True
    for dtype in (torch.bfloat16, torch.float16):
        for seq_lens, heads, split_list in cases:
            q, cache, table, lens = poisoned_case(seq_lens, heads, dtype)
            ref, ref_lse = mla_decode_reference(q, cache, table, lens, kv_lora_rank=C, softmax_scale=scale)
            for splits in split_list:
                for merge in MERGES:
                    out, lse = cuda_decode(q, cache, table, lens, softmax_scale=scale, num_kv_splits=splits,
                                           merge=merge)
                    torch.cuda.synchronize()
                    real = lens > 0
                    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-9)).item()
                    lse_err = (lse[real] - ref_lse[real]).abs().max().item() if real.any() else 0.0
                    empty_ok = bool((out[~real] == 0).all() and (lse[~real] == float("-inf")).all())
                    ok = (not out.isnan().any().item()) and err < 1e-2 and lse_err < 1e-2 and empty_ok
                    ok_all &= ok
                    row = dict(kind="check", merge=merge, dtype=str(dtype), seq_lens=seq_lens, heads=heads,
                               splits=splits, rel_err=err, lse_err=lse_err, empty_ok=empty_ok, ok=ok)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return ok_all


# (b, t, splits): the split counts the launch-shape runs found best (NOTES row 34), and b = 1 at
# 128 (what choose_num_kv_splits gives, capped) as well as 256
BREAKDOWN = ((64, 4096, 4), (128, 8192, 2), (64, 16384, 4), (1, 32768, 256), (1, 32768, 128),
             (2, 65536, 132), (2, 65536, 128), (4, 131072, 66))


def breakdown(rows):
    from benchmarks.bench_decode import SCALE, bench_us, graphed, make_inputs
    from mla.kernels.decode import choose_num_kv_splits, mla_decode

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiny = torch.zeros(1, device="cuda")
    null_us = bench_us(graphed(lambda c: tiny.add_(1), [tiny]))
    for b, t, splits in BREAKDOWN:
        q, (cache,), table, lens = make_inputs(b, t, 16)
        part_out = torch.empty((b, 16, splits, C), dtype=torch.float32, device="cuda")
        part_lse = torch.empty((b, 16, splits), dtype=torch.float32, device="cuda")
        out = torch.empty((b, 16, C), dtype=q.dtype, device="cuda")
        lse = torch.empty((b, 16), dtype=torch.float32, device="cuda")

        def stage1(c):
            torch.ops.mla.mla_decode_sm80(q, c, table, lens, part_out, part_lse, float(SCALE), splits)

        stage1(cache)
        auto = choose_num_kv_splits(b, 16, t, num_sms)  # the Triton kernel's own count
        triton_call = lambda c: mla_decode(  # noqa: E731
            q, c, table, lens, kv_lora_rank=C, softmax_scale=SCALE, num_kv_splits=auto, _backend="triton")
        want, _ = triton_call(cache)
        row = dict(kind="breakdown", b=b, t=t, h=16, splits=splits, null_us=null_us,
                   stage1_us=bench_us(graphed(stage1, [cache])),
                   triton_us=bench_us(graphed(triton_call, [cache])), triton_splits=auto)
        for merge in MERGES:
            row[f"merge_{merge}_us"] = bench_us(graphed(
                lambda c, m=merge: run_merge(m, part_out, part_lse, out, lse), [cache]))
            fn = lambda c, m=merge: cuda_decode(  # noqa: E731
                q, c, table, lens, softmax_scale=SCALE, num_kv_splits=splits, merge=m)
            got, _ = fn(cache)
            row[f"pair_{merge}_us"] = bench_us(graphed(fn, [cache]))
            row[f"pair_{merge}_max_rel_diff_vs_triton"] = (
                (got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, cache, table, lens, part_out, part_lse
        torch.cuda.empty_cache()


def main(argv=None):
    from benchmarks.bench_decode import write_json
    from mla.kernels.concat_cache import load_extension

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--check-only", action="store_true")
    args = parser.parse_args(argv)
    t0 = time.time()
    state = load_extension()
    print(f"extension: {state} in {time.time() - t0:.0f} s", flush=True)
    assert state["cuda"], state
    rows = []
    ok = check(rows)
    print(f"correct: {ok}", flush=True)
    if ok and not args.check_only:
        breakdown(rows)
    write_json(args.out, "h200-decode-cuda-breakdown.json", dict(device=torch.cuda.get_device_name(0), correct=ok,
                                                                  rows=rows))


if __name__ == "__main__":
    main()
