"""Where the CUDA decode's time goes, on the GPU.

    PYTHONPATH=. python3 benchmarks/lab/probe_decode_cuda.py --out benchmarks/lab/results
    PYTHONPATH=. python3 benchmarks/lab/probe_decode_cuda.py --out DIR --env NAME=0,1 --tag T

The CUDA stage 1 (``csrc/mla_decode_sm80.cu``, op ``torch.ops.mla.mla_decode_sm80``) is what
``mla_decode`` runs at <= 16 heads; its merge is the Triton one. At the 16-head shapes of the
decode benchmark, each piece in its own CUDA graph and timed as ``bench_decode.py``'s
``time_us``: a 1-element add (what the timing method itself costs), stage 1 alone, the merge
alone on stage 1's partials, the two together (``mla_decode(_backend="cuda-sm80")``), and the Triton
``mla_decode``; each pair's output against Triton's. (Correctness against the reference is the
GPU tests' job: ``tests/test_kernels_decode.py``.)

``--env NAME=v1,v2,...`` is the A/B harness for a kernel change under trial: the change's host
code reads NAME from the environment at each call while it is tried (never in a commit that
keeps it), and this times stage 1 and the pair at each value, as single calls and in steady
timing (``timing.steady_us``), writing ``h200-decode-cuda-TAG.json``. Runs so far: bulk
copies (``-bulk``, NOTES row 38) and, on this harness's first version (``--l2``: rows with
``ahead`` and ``same_as_ahead0``), the L2 prefetch (``-l2``, row 37); both taken out.

Writes ``h200-decode-cuda-breakdown.json``. Its committed copy also has 72 correctness rows (this
script's checks then) and a CUDA merge, alone and launched early by programmatic dependent
launch (PDL: it waited in ``griddepcontrol.wait`` for stage 1's writes), columns
``merge_cuda_us``, ``pair_cuda_us``, ``pair_cuda-pdl_us``: both were slower than the Triton merge
(NOTES row 35), and were removed. (``h200-decode-cuda-probe.json`` and ``-v0.json`` came from
this script's first version, which built the kernel on its own in four launch shapes:
NOTES.md rows 33-34.)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

C = 512

# (b, t, splits): the split counts the launch-shape runs found best (NOTES row 34), and b = 1 at
# 128 (what choose_num_kv_splits gives, capped) as well as 256
BREAKDOWN = ((64, 4096, 4), (128, 8192, 2), (64, 16384, 4), (1, 32768, 256), (1, 32768, 128),
             (2, 65536, 132), (2, 65536, 128), (4, 131072, 66))


def breakdown(rows):
    from benchmarks.bench_decode import SCALE, make_inputs
    from benchmarks.timing import bench_us, graphed
    from mla.kernels.decode import _merge, choose_num_kv_splits, mla_decode

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
        row["merge_triton_us"] = bench_us(graphed(lambda c: _merge(part_out, part_lse, out, lse), [cache]))
        pair = lambda c: mla_decode(  # noqa: E731  (stage 1 + the merge, as mla_decode runs them)
            q, c, table, lens, kv_lora_rank=C, softmax_scale=SCALE, num_kv_splits=splits, _backend="cuda-sm80")
        got, _ = pair(cache)
        row["pair_triton_us"] = bench_us(graphed(pair, [cache]))
        row["pair_triton_max_rel_diff_vs_triton"] = (
            (got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, cache, table, lens, part_out, part_lse
        torch.cuda.empty_cache()


def env_ab(rows, name, values):
    """An experiment switched by an environment variable the op reads at each call (`name`, set
    to each of `values`): stage 1 alone and with the merge at the six 16-head shapes, timed as
    single-call graphs and within a graph of back-to-back calls (steady_us); each output compared
    with the first value's. Rows of kind "env_ab"."""
    import os

    from benchmarks.bench_decode import SCALE, cache_copies, make_inputs
    from benchmarks.timing import bench_us, graphed, steady_us
    from mla.kernels.backends import CUDA_TILES
    from mla.kernels.decode import choose_num_kv_splits, mla_decode

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    block_h, block_n = CUDA_TILES["cuda-sm80"]
    for b, t in ((64, 4096), (128, 8192), (64, 16384), (1, 32768), (2, 65536), (4, 131072)):
        copies = cache_copies(b, t)
        q, caches, table, lens = make_inputs(b, t, 16, copies=copies)
        splits = choose_num_kv_splits(b, 16, t, num_sms, block_h=block_h, block_n=block_n)
        part_out = torch.empty((b, 16, splits, C), dtype=torch.float32, device="cuda")
        part_lse = torch.empty((b, 16, splits), dtype=torch.float32, device="cuda")

        def stage1(c):
            torch.ops.mla.mla_decode_sm80(q, c, table, lens, part_out, part_lse, float(SCALE), splits)

        pair = lambda c: mla_decode(  # noqa: E731
            q, c, table, lens, kv_lora_rank=C, softmax_scale=SCALE, num_kv_splits=splits, _backend="cuda-sm80")
        os.environ[name] = str(values[0])
        want, _ = pair(caches[0])
        for value in values:
            os.environ[name] = str(value)
            got, _ = pair(caches[0])
            row = dict(kind="env_ab", env=name, value=value, b=b, t=t, h=16, splits=splits, copies=copies,
                       stage1_us=bench_us(graphed(stage1, caches)), pair_us=bench_us(graphed(pair, caches)),
                       stage1_steady_us=steady_us(stage1, caches), pair_steady_us=steady_us(pair, caches),
                       same_as_first=bool(torch.equal(got, want)))
            rows.append(row)
            print(json.dumps(row), flush=True)
        os.environ.pop(name)
        del q, caches, table, lens, part_out, part_lse
        torch.cuda.empty_cache()


def main(argv=None):
    from benchmarks.timing import write_json
    from mla.kernels.extension import load_extension

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/lab/results")
    parser.add_argument("--env", help="NAME=v1,v2,...: an A/B experiment the op reads from the environment")
    parser.add_argument("--tag", default="ab", help="the JSON's name: h200-decode-cuda-TAG.json")
    args = parser.parse_args(argv)
    t0 = time.time()
    state = load_extension()
    print(f"extension: {state} in {time.time() - t0:.0f} s", flush=True)
    assert state["decode"], state
    rows = []
    if args.env:
        name, values = args.env.split("=")
        env_ab(rows, name, values.split(","))
        write_json(args.out, f"h200-decode-cuda-{args.tag}.json", dict(device=torch.cuda.get_device_name(0), rows=rows))
        return
    breakdown(rows)
    write_json(args.out, "h200-decode-cuda-breakdown.json", dict(device=torch.cuda.get_device_name(0), rows=rows))


if __name__ == "__main__":
    main()
