"""The dealt merge alone, at several tilings, on the slots a deal of real batches leaves.

    PYTHONPATH=. python3 benchmarks/lab/probe_merge_dealt.py --out DIR   # ~1 min on an H100

``mla_decode``'s wgmma path merges the slots of each sequence that spans several pieces with
``_mla_decode_merge_dealt_kernel`` above one split and ``_mla_decode_merge_dealt_rows_kernel`` at
one (``decode._merge_dealt``); benchmarks/lab/NOTES.md rows 109-114 say why it is timed alone.

Each case of SPLITS lays random slots out as a deal of its batch leaves them (the kernel's rule
replayed in Python: ``dealt_ranges``): the ragged probe's one-split batches, one of its batches
above one split, and the decode benchmark's one and sixteen sequences. Each case runs
``package`` (``decode._merge_dealt`` as the tree has it: run the probe in a candidate's copy to
time the candidate's merge), then the tree's kernels at each tiling of TILINGS (in a candidate's
copy the candidate's kernels: compare tilings within one tree, ``package`` across trees). Every
tiling must merge to the first one's answer on the sequences it merges. Each is timed twice:
after a clean L2 (``clean_us``), and right after the slots are written again (``hot_us``), as
stage 1 leaves them for the merge in ``mla_decode`` (one batch's slots are 3-72 MB, an H100's
L2 50 MB). Prints both times and the bytes moved (slots read, out and lse written) over the
hot time beside the copy bandwidth of the same run; writes ``merge-dealt-probe.json`` under DIR.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import torch
import triton

from benchmarks.lab.probe_decode_ragged import cases, deal_spans, tile_pairs
from benchmarks.timing import bench_us, copy_bandwidth_GBps, write_json
from mla.kernels.triton_decode import _mla_decode_merge_dealt_kernel, _mla_decode_merge_dealt_rows_kernel

C, ROWS = 512, 128  # DeepSeek-V3's latent and heads

# (kernel, BLOCK_R, BLOCK_S, BLOCK_C, warps), the kernel "slots" (_mla_decode_merge_dealt_kernel:
# a row's slots as one tile) or "rows" (_mla_decode_merge_dealt_rows_kernel: rows together, slots
# one by one): the package's one-split and multi-split tilings first
TILINGS = [
    ("rows", 8, 4, 512, 8),
    ("slots", 1, 16, 256, 4),
    ("rows", 8, 2, 512, 8),
    ("rows", 4, 4, 512, 4),
    ("rows", 1, 16, 256, 4),
    ("slots", 8, 16, 512, 4),  # rows one after another, as the package's one-split tiling was
    ("slots", 1, 2, 512, 4),
    ("slots", 1, 4, 128, 1),
    ("slots", 1, 64, 64, 4),  # the cut's merge reads all of a row's splits at once (decode._merge)
]

# case -> num_kv_splits (mla_decode's, at 128 heads on 132 SMs; the deal takes b x splits
# pieces): the ragged probe's one-split batches, one of its batches above one split, and two of
# the decode benchmark's shapes above one split
EXTRA_CASES = {"1 x 32768": [32768], "16 x 4096": [4096] * 16}
SPLITS = {
    "1 x 32768": 66,
    "16 x 4096": 4,
    "64 in [512, 16384]": 1,
    "64 x 8192 (uniform)": 1,
    "128 in [256, 16384]": 1,
    "64: one 131072, 63 x 2048": 1,
    "64: 4096, 62 x 8192, 12288": 1,
    "4: 131072, 65536, 16384, 4096": 16,
}


def dealt_ranges(lengths: list[int], pieces: int) -> list[tuple[int, int]]:
    """Each sequence's (first slot, pieces) as the wgmma stage 1 deals the batch's tile pairs of
    64-token tiles (an empty sequence counts one pair) over ``pieces`` equal pieces."""
    per, spans = deal_spans(tile_pairs(lengths), pieces)
    return [(i + lo // per, (hi - 1) // per - lo // per + 1) for i, (lo, hi) in enumerate(spans)]


def merge_call(tiling, part_out, part_lse, ranges, out, lse, num_kv_splits):
    """A call of the merge at ``tiling``; ``"package"``: ``decode._merge_dealt`` itself (the tree's
    own tiling, so that the probe run in a candidate's copy times the candidate's merge)."""
    if tiling == "package":
        from mla.kernels import decode

        return lambda: decode._merge_dealt(part_out, part_lse, ranges, out, lse, num_kv_splits)
    form, block_r, block_s, block_c, warps = tiling
    kernel = _mla_decode_merge_dealt_rows_kernel if form == "rows" else _mla_decode_merge_dealt_kernel
    b, rows, c = out.shape
    grid = (b, triton.cdiv(rows, block_r), triton.cdiv(c, block_c))

    def call():
        kernel[grid](part_out, part_lse, ranges, out, lse, rows, c, part_out.stride(0), part_out.stride(1),
                     part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), lse.stride(0),
                     lse.stride(1), BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_S=block_s, num_warps=warps)

    return call


def hot_us(call, part_out, part_lse, fresh_out, fresh_lse, reps=30) -> float:
    """Median time of call() right after the slots are written again (outside the timed events)."""
    times = []
    for rep in range(reps + 3):
        part_out.copy_(fresh_out)
        part_lse.copy_(fresh_lse)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        if rep >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/lab/results")
    args = parser.parse_args()
    copy_GBps = copy_bandwidth_GBps()
    print(f"copy {copy_GBps:.0f} GB/s", flush=True)
    all_cases, rows = {**cases(), **EXTRA_CASES}, []
    for name, splits in SPLITS.items():
        lengths = all_cases[name]
        b = len(lengths)
        pieces = b * splits
        spans = dealt_ranges(lengths, pieces)
        ranges = torch.tensor(spans, dtype=torch.int32, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(0)
        fresh_out = torch.randn((b + pieces - 1, ROWS, C), device="cuda", generator=gen)
        fresh_lse = torch.randn((b + pieces - 1, ROWS), device="cuda", generator=gen)
        part_out, part_lse = fresh_out.clone(), fresh_lse.clone()
        merged_rows = torch.tensor([n > 1 for _, n in spans], device="cuda")
        slots = sum(n for _, n in spans if n > 1)
        merged = sum(1 for _, n in spans if n > 1)
        nbytes = slots * ROWS * (C + 1) * 4 + merged * ROWS * (C * 2 + 4)
        expected = None
        for tiling in ["package", *TILINGS]:
            out = torch.full((b, ROWS, C), float("nan"), dtype=torch.bfloat16, device="cuda")
            lse = torch.full((b, ROWS), float("nan"), device="cuda")
            call = merge_call(tiling, part_out, part_lse, ranges, out, lse, splits)
            call()
            mine = (out[merged_rows].float(), lse[merged_rows])  # what the merge writes: the merged sequences
            if expected is None:
                expected = mine
            else:  # every tiling merges to the first's
                torch.testing.assert_close(mine[0], expected[0], rtol=1e-2, atol=1e-2)
                torch.testing.assert_close(mine[1], expected[1], rtol=1e-5, atol=1e-5)
            clean, us = bench_us(call), hot_us(call, part_out, part_lse, fresh_out, fresh_lse)
            shape = dict(tiling="package") if tiling == "package" else dict(zip(
                ("kernel", "block_r", "block_s", "block_c", "warps"), tiling))
            row = dict(case=name, tree=pathlib.Path.cwd().name, splits=splits, pieces=pieces,
                       sequences_merged=merged, slots_read=slots, bytes=nbytes, **shape, clean_us=clean, hot_us=us,
                       GBps=nbytes / (us * 1e-6) / 1e9)
            rows.append(row)
            what = "package" if tiling == "package" else "{:5} R {} S {:3d} C {:3d} w {}".format(*tiling)
            print(f"{name:>32} merged {merged:3d} slots {slots:4d}  {what:>28}  clean {clean:7.1f} us  hot {us:7.1f} us"
                  f"  {row['GBps']:6.0f} GB/s", flush=True)
    write_json(args.out, "merge-dealt-probe.json",
               dict(device=torch.cuda.get_device_name(0), copy_GBps=copy_GBps, rows=rows))


if __name__ == "__main__":
    main()
