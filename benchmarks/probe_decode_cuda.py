"""A CUDA stage-1 decode kernel (benchmarks/cuda/mla_decode_sm80.cu) against the Triton one, on the GPU.

    PYTHONPATH=. python3 benchmarks/probe_decode_cuda.py --out benchmarks/results

Builds the kernel on its own by JIT (the package's extension is not touched), then:

1. Correctness: against ``mla_decode_reference`` (float64) on caches whose unused pages are NaN
   and whose unused block-table entries point past the cache, for bf16 and fp16, 1, 3, 16, 20
   and 128 heads, lengths 0, 1, 31, 32, 33, 64, 65, 1000, 5000 and several split counts. The
   merge is the Triton one.
2. Speed: CUDA-graph replays (as ``bench_decode.py``'s ``time_us``) of Triton's ``mla_decode``
   and of this kernel + the merge, at the 16-head shapes of the decode benchmark; splits for the
   CUDA kernel: for each launch shape (``VARIANTS``: warps, tile, stages) the count nearest one
   wave of programs (one or two CTAs an SM, by its shared memory) and twice that.

Writes ``h200-decode-cuda-probe.json`` (``h200-decode-cuda-probe-v0.json`` is the first run, of
Shape0 alone, before the kernel was a template).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
C, R = 512, 64


def build():
    from torch.utils.cpp_extension import load

    load(name="mla_decode_cuda_probe", sources=[os.path.join(HERE, "cuda", "mla_decode_sm80.cu")],
         extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"], is_python_module=False, verbose=False)


VARIANTS = {  # variant: (description, CTAs an SM)
    0: ("8 warps, 4 tiles of 32", 1), 1: ("4 warps, 2 tiles of 32", 2),
    2: ("8 warps, 2 tiles of 64", 1), 3: ("4 warps, 4 tiles of 16", 2),
}


def cuda_decode(q, kv_cache, block_table, seq_lens, *, softmax_scale, num_kv_splits, variant=0):
    """Stage 1 in CUDA, stage 2 the Triton merge; mla_decode's outputs."""
    import triton

    from mla.kernels.decode import _MERGE_TILE, _mla_decode_merge_kernel

    b, h, _ = q.shape
    part_out = torch.empty((b, h, num_kv_splits, C), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b, h, num_kv_splits), dtype=torch.float32, device=q.device)
    torch.ops.mla_probe.mla_decode_sm80(q, kv_cache, block_table, seq_lens, part_out, part_lse,
                                  float(softmax_scale), num_kv_splits, variant)
    out = torch.empty((b, h, C), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h), dtype=torch.float32, device=q.device)
    block_s = triton.next_power_of_2(num_kv_splits)
    merge_block_c = max(16, min(C, _MERGE_TILE // block_s))
    _mla_decode_merge_kernel[(b, h, triton.cdiv(C, merge_block_c))](
        part_out, part_lse, out, lse, C, num_kv_splits,
        *part_out.stride()[:3], *part_lse.stride(), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        BLOCK_C=merge_block_c, BLOCK_S=block_s, num_warps=4,
    )
    return out, lse


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

    scale = (192) ** -0.5
    cases = [([1, 31, 32, 33, 64, 65, 1000, 0], 16, [1, 2, 3, 7]), ([5000, 1, 700], 16, [1, 5, 40]),
             ([100, 3000], 3, [1, 4]), ([100, 3000, 0], 20, [2]), ([300, 7], 128, [1, 4])]
    ok_all = True
    for dtype in (torch.bfloat16, torch.float16):
        for seq_lens, heads, split_list in cases:
            q, cache, table, lens = poisoned_case(seq_lens, heads, dtype)
            ref, ref_lse = mla_decode_reference(q, cache, table, lens, kv_lora_rank=C, softmax_scale=scale)
            for splits, variant in ((s_, v_) for s_ in split_list for v_ in VARIANTS):
                out, lse = cuda_decode(q, cache, table, lens, softmax_scale=scale, num_kv_splits=splits,
                                       variant=variant)
                torch.cuda.synchronize()
                real = lens > 0
                err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-9)).item()
                lse_err = (lse[real] - ref_lse[real]).abs().max().item() if real.any() else 0.0
                empty_ok = bool((out[~real] == 0).all() and (lse[~real] == float("-inf")).all())
                ok = (not out.isnan().any().item()) and err < 1e-2 and lse_err < 1e-2 and empty_ok
                ok_all &= ok
                row = dict(kind="check", variant=variant, dtype=str(dtype), seq_lens=seq_lens, heads=heads, splits=splits,
                           rel_err=err, lse_err=lse_err, empty_ok=empty_ok, ok=ok)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return ok_all


def bench(rows):
    from benchmarks.bench_decode import SCALE, bench_us, graphed, make_inputs
    from mla.kernels.decode import choose_num_kv_splits, mla_decode

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for b, t in ((64, 4096), (128, 8192), (64, 16384), (1, 32768), (2, 65536), (4, 131072)):
        q, (cache,), table, lens = make_inputs(b, t, 16)
        auto = choose_num_kv_splits(b, 16, t, num_sms)
        triton_us = bench_us(graphed(lambda c: mla_decode(q, c, table, lens, kv_lora_rank=C, softmax_scale=SCALE,
                                                           num_kv_splits=auto), [cache]))
        want, _ = mla_decode(q, cache, table, lens, kv_lora_rank=C, softmax_scale=SCALE, num_kv_splits=auto)
        for variant, (desc, per_sm) in VARIANTS.items():
            one_wave = max(1, min(t // 128, round(per_sm * num_sms / b)))
            for splits in sorted({one_wave, 2 * one_wave}):
                fn = lambda c, s=splits, v=variant: cuda_decode(  # noqa: E731
                    q, c, table, lens, softmax_scale=SCALE, num_kv_splits=s, variant=v)
                got, _ = fn(cache)
                err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                us = bench_us(graphed(fn, [cache]))
                row = dict(kind="bench", variant=variant, shape=desc, b=b, t=t, h=16, splits=splits, cuda_us=us,
                           triton_us=triton_us, triton_splits=auto, max_rel_diff_vs_triton=err)
                rows.append(row)
                print(json.dumps(row), flush=True)
        del q, cache, table, lens
        torch.cuda.empty_cache()


def main(argv=None):
    from benchmarks.bench_decode import write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--check-only", action="store_true")
    args = parser.parse_args(argv)
    t0 = time.time()
    build()
    print(f"built in {time.time() - t0:.0f} s", flush=True)
    rows = []
    ok = check(rows)
    print(f"correct: {ok}", flush=True)
    if ok and not args.check_only:
        bench(rows)
    write_json(args.out, "h200-decode-cuda-probe.json",
               dict(device=torch.cuda.get_device_name(0), correct=ok, rows=rows))


if __name__ == "__main__":
    main()
