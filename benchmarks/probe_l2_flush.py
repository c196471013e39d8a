"""How the way L2 is cleared before a timed call moves mla_decode's time (NOTES row 44).

    PYTHONPATH=. python3 benchmarks/probe_l2_flush.py --out benchmarks/results     # ~1 min

``bench_decode.py`` times with ``triton.testing.do_bench``, which clears L2 before every call by
zeroing a 256 MB buffer. Zeroing WRITES: the call then starts with L2 full of dirty lines, and
each of its misses may first write one back to DRAM. A decode kernel only reads, and the floor
counts only its reads, so this probe times the same CUDA-graph replay of ``mla_decode`` (its
default kernel and split count, as ``time_us``) after three states of L2:

- ``dirty``: the 256 MB buffer zeroed (do_bench's way; ``time_us`` in h200-decode.json),
- ``clean``: the same buffer read (a sum), so L2 holds clean lines of it: cold for the cache,
  with nothing to write back. Between two layers of a served step L2 holds mostly weights read
  by the projections, so this is the nearer of the two to serving,
- ``none``: nothing between calls but the rotation of cache copies (>= 3x L2 together).

Each mode's time is the median of ``--reps`` calls, timed by CUDA events around the replay alone
(the clearing is outside the events), and the same for a graph of one 1-element add (the graph's
own launch, ``graph_overhead_us`` in h200-decode.json). Writes ``h200-decode-flush-probe.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode import (  # noqa: E402
    C, SCALE, SHAPES, copy_bandwidth_GBps, floor_us, graphed, kernel_and_splits, make_inputs, matmul_TFLOPs,
    rotation_copies, write_json,
)

MODES = ("dirty", "clean", "none")


def timed_us(fn, clear, reps):
    """Median of reps calls of fn, each after clear(), events around fn alone."""
    for _ in range(5):
        clear()
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        clear()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args(argv)
    from mla.kernels.decode import mla_decode

    buffer = torch.empty(256 * 10**6 // 4, dtype=torch.int32, device="cuda")  # do_bench's size
    total = torch.empty((), dtype=torch.int64, device="cuda")
    clears = {
        "dirty": buffer.zero_,
        "clean": lambda: torch.sum(buffer, dim=0, dtype=torch.int64, out=total),
        "none": lambda: None,
    }
    copy_GBps, mm_TFLOPs = copy_bandwidth_GBps(), matmul_TFLOPs()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiny = torch.zeros(1, device="cuda")
    add_graph = graphed(lambda x: x.add_(1), [tiny])
    overhead = {m: timed_us(add_graph, clears[m], args.reps) for m in MODES}
    print(f"copy {copy_GBps:.0f} GB/s, matmul {mm_TFLOPs:.0f} TFLOP/s; graph of one add: "
          + ", ".join(f"{m} {overhead[m]:.1f}" for m in MODES) + " us")
    print(f"{'b':>4} {'t':>7} {'h':>4} {'floor':>7} " + " ".join(f"{m:>7}" for m in MODES) + "  (us; x floor)")
    rows = []
    for b, t, h in SHAPES:
        copies = rotation_copies(b, t)
        q, caches, block_table, seq_lens = make_inputs(b, t, h, copies=copies)
        kernel, _, splits, _ = kernel_and_splits(q, caches[0], block_table, seq_lens, C, t, num_sms)

        def ours(cache):
            return mla_decode(q, cache, block_table, seq_lens, kv_lora_rank=C, softmax_scale=SCALE,
                              num_kv_splits=splits, _backend=kernel)

        replay = graphed(ours, caches)
        fl, bound = floor_us(b, t, h, copy_GBps, mm_TFLOPs)
        row = dict(b=b, t=t, h=h, kernel=kernel, num_kv_splits=splits, copies=copies, floor_us=fl, bound=bound)
        for m in MODES:
            row[f"{m}_us"] = timed_us(replay, clears[m], args.reps)
        rows.append(row)
        print(f"{b:>4} {t:>7} {h:>4} {fl:>7.1f} " + " ".join(f"{row[f'{m}_us']:>7.1f}" for m in MODES)
              + "  " + " ".join(f"{row[f'{m}_us'] / fl:.2f}x" for m in MODES), flush=True)
        del q, caches, block_table, seq_lens, replay
        torch.cuda.empty_cache()
    write_json(args.out, "h200-decode-flush-probe.json", dict(
        device=torch.cuda.get_device_name(0), torch=torch.__version__, copy_GBps=copy_GBps,
        matmul_TFLOPs=mm_TFLOPs, clear_bytes=buffer.numel() * 4, reps=args.reps,
        graph_overhead_us=overhead, rows=rows))


if __name__ == "__main__":
    main()
