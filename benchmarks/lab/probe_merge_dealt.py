"""The dealt merge alone, at several tilings, on the slots a deal of real batches leaves.

    PYTHONPATH=. python3 benchmarks/lab/probe_merge_dealt.py --out DIR   # ~1 min on an H100

``mla_decode``'s wgmma path merges the slots of each sequence that spans several pieces with
``_mla_decode_merge_dealt_kernel`` (``decode._merge_dealt``). The ragged probe's kernel times
(``probe_decode_ragged.py --kernels``) put it at 30-55 us on the one-split batches of differing
lengths, about 1.2 TB/s of the bytes it moves, where FlashMLA's combine takes 7-14 us.

This probe times the merge alone on random slots laid out as a deal of each
case of SPLITS leaves them (the kernel's rule replayed in Python: ``dealt_ranges``): the ragged
probe's one-split batches, one of its batches above one split, and the decode benchmark's one
and sixteen sequences. Each case runs ``package`` (``decode._merge_dealt`` as the tree has it:
run the probe in a candidate's copy to time the candidate's merge), then each tiling of
TILINGS: the tree's kernel (``serial``; in main's tree a program's BLOCK_R rows run one after
another, in a candidate's copy the rows are the candidate's kernel at those tilings: compare
rows of one tree, or the ``package`` rows across trees) and a variant here that loads BLOCK_R
rows together (``together``). Every tiling must merge to the first one's answer on the
sequences it merges. Each is timed twice: after a clean L2 (``clean_us``), and right after the
slots are written again (``hot_us``), as stage 1 leaves them for the merge in ``mla_decode``
(the slots of one batch, 3-72 MB, against the H100's 50 MB of L2). Prints both times and the
bytes moved (slots read, out and lse written) over the hot time beside the copy bandwidth of
the same run; writes ``merge-dealt-probe.json`` under DIR.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import torch
import triton
import triton.language as tl

from benchmarks.lab.probe_decode_ragged import cases
from benchmarks.timing import bench_us, copy_bandwidth_GBps, write_json
from mla.kernels.triton_decode import _mla_decode_merge_dealt_kernel

C, ROWS = 512, 128  # DeepSeek-V3's latent and heads

# (kernel, BLOCK_R, BLOCK_S, BLOCK_C, warps): the package's one-split and multi-split tilings first
TILINGS = [
    ("serial", 8, 16, 512, 4),
    ("serial", 1, 16, 256, 4),
    ("serial", 8, 2, 512, 4),  # as the package's at one split, without its 14 masked slots
    ("serial", 8, 4, 512, 4),
    ("serial", 2, 2, 512, 2),
    ("serial", 1, 4, 512, 4),
    ("serial", 1, 2, 512, 4),
    ("serial", 1, 4, 128, 1),
    ("serial", 1, 64, 64, 4),  # the cut's merge reads all of a row's splits at once (decode._merge)
    ("serial", 1, 128, 32, 4),
    ("together", 4, 4, 512, 8),
    ("together", 2, 4, 512, 4),
    ("together", 8, 2, 512, 8),
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
    pairs = [max(1, ((n + 63) // 64 + 1) // 2) for n in lengths]
    per = -(-sum(pairs) // pieces)
    ranges, first_pair = [], 0
    for i, n in enumerate(pairs):
        first, last = first_pair // per, (first_pair + n - 1) // per
        ranges.append((i + first, last - first + 1))
        first_pair += n
    return ranges


@triton.jit
def _merge_rows_together_kernel(part_out_ptr, part_lse_ptr, ranges_ptr, out_ptr, lse_ptr, num_rows, kv_lora_rank,
                                stride_pos, stride_poh, stride_pls, stride_plh, stride_ob, stride_oh, stride_lb,
                                stride_lh, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    # the package's merge with a program's BLOCK_R rows loaded together: (BLOCK_S, BLOCK_R, BLOCK_C)
    pid_b = tl.program_id(0).to(tl.int64)
    first = tl.load(ranges_ptr + 2 * pid_b)
    count = tl.load(ranges_ptr + 2 * pid_b + 1)
    if count > 1:
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_r = offs_r < num_rows
        mask_c = offs_c < kv_lora_rank
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
        for s0 in range(0, count, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            slots = (first + offs_s).to(tl.int64)
            ok = (offs_s < count)[:, None] & mask_r[None, :]
            lse_parts = tl.load(part_lse_ptr + slots[:, None] * stride_pls + offs_r[None, :] * stride_plh, mask=ok,
                                other=float("-inf"))
            parts = tl.load(part_out_ptr + slots[:, None, None] * stride_pos + offs_r[None, :, None] * stride_poh
                            + offs_c[None, None, :], mask=ok[:, :, None] & mask_c[None, None, :], other=0.0)
            m_new = tl.maximum(m, tl.max(lse_parts, 0))
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            rescale = tl.exp(tl.where(m == float("-inf"), float("-inf"), m - ref))
            weights = tl.exp(lse_parts - ref[None, :])
            acc = acc * rescale[:, None] + tl.sum(parts * weights[:, :, None], 0)
            total = total * rescale + tl.sum(weights, 0)
            m = m_new
        ref = tl.where(m == float("-inf"), 0.0, m)
        nonempty = total != 0.0
        total_safe = tl.where(nonempty, total, 1.0)
        tl.store(out_ptr + pid_b * stride_ob + offs_r[:, None] * stride_oh + offs_c[None, :],
                 (acc / total_safe[:, None]).to(out_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_c[None, :])
        if tl.program_id(2) == 0:
            tl.store(lse_ptr + pid_b * stride_lb + offs_r * stride_lh,
                     tl.where(nonempty, ref + tl.log(total_safe), float("-inf")), mask=mask_r)


KERNELS = {"serial": _mla_decode_merge_dealt_kernel, "together": _merge_rows_together_kernel}


def merge_call(tiling, part_out, part_lse, ranges, out, lse, num_kv_splits):
    """A call of the merge at ``tiling``; ``"package"``: ``decode._merge_dealt`` itself (the tree's
    own tiling, so that the probe run in a candidate's copy times the candidate's merge)."""
    if tiling == "package":
        from mla.kernels import decode

        return lambda: decode._merge_dealt(part_out, part_lse, ranges, out, lse, num_kv_splits)
    kernel, block_r, block_s, block_c, warps = tiling
    b, rows, c = out.shape
    grid = (b, triton.cdiv(rows, block_r), triton.cdiv(c, block_c))

    def call():
        KERNELS[kernel][grid](part_out, part_lse, ranges, out, lse, rows, c, part_out.stride(0), part_out.stride(1),
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
            shape = dict(kernel="package") if tiling == "package" else dict(zip(
                ("kernel", "block_r", "block_s", "block_c", "warps"), tiling))
            row = dict(case=name, tree=pathlib.Path.cwd().name, splits=splits, pieces=pieces,
                       sequences_merged=merged, slots_read=slots, bytes=nbytes, **shape, clean_us=clean, hot_us=us,
                       GBps=nbytes / (us * 1e-6) / 1e9)
            rows.append(row)
            what = "package" if tiling == "package" else "{} R {} S {:2d} C {:3d} w {}".format(*tiling)
            print(f"{name:>32} merged {merged:3d} slots {slots:4d}  {what:>28}  clean {clean:7.1f} us  hot {us:7.1f} us"
                  f"  {row['GBps']:6.0f} GB/s", flush=True)
    write_json(args.out, "merge-dealt-probe.json",
               dict(device=torch.cuda.get_device_name(0), copy_GBps=copy_GBps, rows=rows))


if __name__ == "__main__":
    main()
