"""mla_decode beside FlashMLA on batches whose sequences differ in length (a serving step's).

    PYTHONPATH=.peers:. python3 benchmarks/lab/probe_decode_ragged.py --out DIR [--heads 128,16] [--kernels]

The decode benchmark times batches of b sequences of one length. A serving step's sequences
differ, and the split rule cuts every sequence of a call into the same number of pieces, planned
from the longest (``plan_num_kv_splits``): a short sequence's CTAs finish early and the longest
one's set the time. FlashMLA's scheduler (``get_mla_metadata``) cuts the batch's tiles evenly
over the SMs, across sequences. This probe times both on CASES, each a list of lengths on the
decode benchmark's inputs (``bench_decode.make_inputs`` for the longest, then seq_lens set to the
case's), as ``time_us`` is timed (one call in a CUDA graph after a clean L2), with FlashMLA's
metadata made once outside the graph as in the benchmark. Each row also has the floor of the
case's tokens (bytes over copy bandwidth or FLOPs over the matmul rate, both measured in the run),
the time of the longest sequence alone at the batch's split count (what a cut of every sequence
into that many pieces cannot beat: the longest one's CTAs are the same, without the others beside
them) and the largest difference between the two outputs; with ``--kernels``, each kernel's
time a call, run eagerly under torch.profiler (stage 1 apart from the merge; FlashMLA's decode
apart from its combine, its metadata made beforehand). Writes
``decode-ragged-probe.json`` under DIR and prints a table.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_decode import (C, SCALE, cache_copies, decode_call, flashmla_fn, flashmla_status, floor_us,
                                     kernel_and_splits, make_inputs)
from benchmarks.timing import bench_us, copy_bandwidth_GBps, graphed, matmul_TFLOPs, write_json


def cases() -> dict[str, list[int]]:
    """Case name -> the lengths of its sequences (the draws seeded)."""
    gen = torch.Generator().manual_seed(0)

    def uniform(b, lo, hi):
        return torch.randint(lo, hi + 1, (b,), generator=gen).tolist()

    return {
        "4 x 131072 (uniform)": [131072] * 4,
        "4: 131072, 65536, 16384, 4096": [131072, 65536, 16384, 4096],
        "16 in [1024, 32768]": uniform(16, 1024, 32768),
        "32: one 131072, 31 x 2048": [131072] + [2048] * 31,
        "64 in [512, 16384]": uniform(64, 512, 16384),
        "64 x 8192 (uniform)": [8192] * 64,
        "128 in [256, 16384]": uniform(128, 256, 16384),
        # one split: the long sequence over 32 pieces, the one-split merge's longest walk
        "64: one 131072, 63 x 2048": [131072] + [2048] * 63,
        # 64 x 8192's pairs, each piece two half sequences: one segment more a piece, 63 of the 64
        # sequences merged
        "64: 4096, 62 x 8192, 12288": [4096] + [8192] * 62 + [12288],
    }


def tile_pairs(lengths: list[int]) -> list[int]:
    """Each sequence's pairs of 64-token tiles as the wgmma stage 1 deals them (an empty sequence
    counts one pair, so that a piece writes its zeros and -inf): the kernel's ``pairs_of``."""
    return [max(1, ((n + 63) // 64 + 1) // 2) for n in lengths]


def deal_spans(pairs: list[int], pieces: int, k: int = 0) -> tuple[int, list[tuple[int, int]]]:
    """The wgmma stage 1's deal (the kernel's scan): (per, spans). The pieces split the batch's
    cost evenly, a share ``per`` each (ceil), piece z taking [z per, (z + 1) per); sequence i's
    pairs lie at spans[i] = [lo, hi) on that scale. A sequence costs its pairs (k = 0, the
    kernel's rule) or, a lab variant, its pairs and k more before them."""
    spans, start = [], 0
    for n in pairs:
        spans.append((start + k, start + k + n))
        start += k + n
    return -(-start // pieces), spans


def kernel_times_us(fn, caches, reps=20) -> dict[str, float]:
    """Each kernel's mean GPU time a call (us) when ``fn`` runs eagerly, from torch.profiler:
    stage 1 apart from the merge (the calls follow one another, so L2 is warm)."""
    for cache in caches[:2]:
        fn(cache)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            fn(caches[i % len(caches)])
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total > 0:
            times[event.key] = times.get(event.key, 0.0) + total / reps
    return times


def probe(heads, flashmla_ok, kernels=False) -> list[dict]:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_GBps, tflops = copy_bandwidth_GBps(), matmul_TFLOPs()
    print(f"copy {copy_GBps:.0f} GB/s, matmul {tflops:.0f} TFLOP/s, {num_sms} SMs", flush=True)
    rows = []
    for h in heads:
        for name, lengths in cases().items():
            b, t = len(lengths), max(lengths)
            q, caches, block_table, _ = make_inputs(b, t, h, copies=cache_copies(b, t))
            seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
            kernel, _, splits = kernel_and_splits(q, caches[0], block_table, seq_lens, C, t, num_sms)
            ours = decode_call(q, block_table, seq_lens, kernel, splits)
            row = dict(case=name, b=b, h=h, tokens=sum(lengths), longest=t, kernel=kernel, num_kv_splits=splits,
                       # bytes and FLOPs grow with the tokens: b sequences of their mean length
                       floor_us=floor_us(b, sum(lengths) / b, h, copy_GBps, tflops)[0],
                       time_us=bench_us(graphed(ours, caches)), flashmla_us=None)
            # the longest sequence alone, cut as in the batch
            longest = lengths.index(t)
            q1, bt1, sl1 = q[longest:longest + 1], block_table[longest:longest + 1], seq_lens[longest:longest + 1]
            row["longest_alone_us"] = bench_us(graphed(decode_call(q1, bt1, sl1, kernel, splits), caches))
            if flashmla_ok:
                theirs = flashmla_fn(q, block_table, seq_lens)
                row["flashmla_us"] = bench_us(graphed(theirs, caches))
                mine = ours(caches[0])[0].float()
                row["flashmla_max_abs_diff"] = (mine - theirs(caches[0]).float().view_as(mine)).abs().max().item()
                row["flashmla_over_mla"] = row["flashmla_us"] / row["time_us"]
            if kernels:
                row["mla_kernels_us"] = kernel_times_us(ours, caches)
                if flashmla_ok:
                    row["flashmla_kernels_us"] = kernel_times_us(theirs, caches)
                for who in ("mla", "flashmla"):
                    for key, us in row.get(f"{who}_kernels_us", {}).items():
                        print(f"      {who:8s} {us:8.1f} us  {key[:60]}", flush=True)
            rows.append(row)
            fm = (f"{row['flashmla_us']:8.1f}  {row['flashmla_over_mla']:.3f}  |diff| {row['flashmla_max_abs_diff']:.1e}"
                  if flashmla_ok else "       -      -")
            print(f"{h:>4} {name:>32} {kernel:>9} {splits:>4}  floor {row['floor_us']:7.1f}  mla {row['time_us']:8.1f}"
                  f"  FlashMLA {fm}  longest alone {row['longest_alone_us']:7.1f}", flush=True)
            del q, caches, block_table, seq_lens
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/lab/results")
    parser.add_argument("--heads", type=lambda s: [int(x) for x in s.split(",")], default=[128, 16])
    parser.add_argument("--kernels", action="store_true",
                        help="also each kernel's time a call, eager, from torch.profiler")
    args = parser.parse_args()
    flashmla_ok, what = flashmla_status()
    print(f"FlashMLA: {what}", flush=True)
    rows = probe(args.heads, flashmla_ok, args.kernels)
    write_json(args.out, "decode-ragged-probe.json",
               dict(device=torch.cuda.get_device_name(0), flashmla=what, scale=SCALE, rows=rows))


if __name__ == "__main__":
    main()
