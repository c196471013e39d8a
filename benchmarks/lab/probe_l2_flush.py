"""How the way L2 is cleared before a timed call moves mla_decode's time (NOTES row 44).

    PYTHONPATH=. python3 benchmarks/lab/probe_l2_flush.py --out benchmarks/lab/results     # ~1 min

``triton.testing.do_bench`` clears L2 before every call by zeroing a 256 MiB buffer. Zeroing
WRITES: the call then starts with L2 full of dirty lines, and each of its misses may first write
one back to DRAM. A decode kernel only reads, and the floor counts only its reads, so this probe
times the same CUDA-graph replay of ``mla_decode`` (its default kernel and split count, as
``time_us``) after three states of L2, in turn, in one process:

- ``dirty``: the buffer zeroed (do_bench's way; ``dirty_l2_time_us`` in h200-decode.json),
- ``clean``: the buffer read (a float32 sum: L2 holds clean lines of it, cold for the cache, with
  nothing to write back; ``time_us`` from v9 on). Between two layers of a served step L2 holds
  mostly weights read by the projections, so this is the nearer of the two to serving,
- ``none``: nothing between calls but the rotation of cache copies (>= 3x L2 together). With
  no GPU work ahead of the start event the host's launch of the replay is timed too (a graph of
  one add reads ~16 us so against ~5): read this column as an upper bound.

Each is ``timing.bench_us``'s loop (do_bench's: events around the replay alone, the clear
before the first event; ``none`` with a clear that does nothing), and the same for a graph of one
1-element add (the graph's own launch, ``graph_overhead_us``). It also lists the kernels each
clear launches (torch.profiler), so a clear that copies the buffer shows (``clear_l2``'s; the
``dirty`` timing is do_bench's own, which zeroes an int32 buffer of the same size). Writes
``h200-decode-flush-probe.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import benchmarks.bench_decode as bd  # noqa: E402
import benchmarks.timing as timing  # noqa: E402

MODES = ("dirty", "clean", "none")


def clear_kernels(mode):
    """Names of the GPU kernels one clear_l2(mode) launches."""
    from torch.profiler import ProfilerActivity, profile

    timing.clear_l2(mode)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timing.clear_l2(mode)
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})


def timed_us(fn, mode):
    if mode != "none":
        return timing.bench_us(fn, l2=mode)
    real = timing.clear_l2
    timing.clear_l2 = lambda mode="clean", device=None: None  # bench_us's loop without a clear
    try:
        return timing.bench_us(fn)
    finally:
        timing.clear_l2 = real


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/lab/results")
    args = parser.parse_args(argv)
    from mla.kernels.decode import mla_decode

    kernels = {m: clear_kernels(m) for m in ("dirty", "clean")}
    print("kernels a clear launches:", kernels)
    copy_GBps, mm_TFLOPs = timing.copy_bandwidth_GBps(), timing.matmul_TFLOPs()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiny = torch.zeros(1, device="cuda")
    add_graph = timing.graphed(lambda x: x.add_(1), [tiny])
    overhead = {m: timed_us(add_graph, m) for m in MODES}
    print(f"copy {copy_GBps:.0f} GB/s, matmul {mm_TFLOPs:.0f} TFLOP/s; graph of one add: "
          + ", ".join(f"{m} {overhead[m]:.1f}" for m in MODES) + " us")
    print(f"{'b':>4} {'t':>7} {'h':>4} {'floor':>7} " + " ".join(f"{m:>7}" for m in MODES) + "  (us; x floor)")
    rows = []
    for b, t, h in bd.SHAPES:
        copies = bd.cache_copies(b, t)
        q, caches, block_table, seq_lens = bd.make_inputs(b, t, h, copies=copies)
        kernel, _, splits = bd.kernel_and_splits(q, caches[0], block_table, seq_lens, bd.C, t, num_sms)

        def ours(cache):
            return mla_decode(q, cache, block_table, seq_lens, kv_lora_rank=bd.C, softmax_scale=bd.SCALE,
                              num_kv_splits=splits, _backend=kernel)

        replay = timing.graphed(ours, caches)
        fl, bound = bd.floor_us(b, t, h, copy_GBps, mm_TFLOPs)
        row = dict(b=b, t=t, h=h, kernel=kernel, num_kv_splits=splits, copies=copies, floor_us=fl, bound=bound)
        for m in MODES:
            row[f"{m}_us"] = timed_us(replay, m)
        rows.append(row)
        print(f"{b:>4} {t:>7} {h:>4} {fl:>7.1f} " + " ".join(f"{row[f'{m}_us']:>7.1f}" for m in MODES)
              + "  " + " ".join(f"{row[f'{m}_us'] / fl:.2f}x" for m in MODES), flush=True)
        del q, caches, block_table, seq_lens, replay
        torch.cuda.empty_cache()
    timing.write_json(args.out, "h200-decode-flush-probe.json", dict(
        device=torch.cuda.get_device_name(0), torch=torch.__version__, copy_GBps=copy_GBps,
        matmul_TFLOPs=mm_TFLOPs, clear_bytes=timing.L2_CLEAR_BYTES, clear_kernels=kernels,
        graph_overhead_us=overhead, rows=rows))


if __name__ == "__main__":
    main()
