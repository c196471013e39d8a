"""concat_and_cache's share of the copy bandwidth by slot pattern: random, paged, sequential.

    PYTHONPATH=. python3 benchmarks/lab/probe_concat_slots.py --out benchmarks/lab/results

``bench concat`` writes distinct random slots, the worst case for a scatter. A serving system
gives each sequence whole pages, so a prefill's tokens fill consecutive slots of a page (pages
in any order). This times the shipped op (``torch.ops.mla.concat_and_cache_mla``) on the same
inputs with three slot mappings over the same cache:

    random      torch.randperm over every slot (bench concat's)
    paged       pages in a random order, the 64 slots of each in order
    sequential  slot i for token i

A 656-byte fp8_ds_mla row is 20.5 sectors of 32 bytes, so every other row shares a sector with
its neighbour: written in random order, such a sector is completed by two writes far apart in
time, and if L2 evicts it in between, memory sees two partial writes. 576- and 1152-byte rows
(fp8_e4m3, bf16) are whole sectors. If the ds_mla writer is held back by partial sectors, it
gains more from paged slots than the other two layouts do; if by its own latency, all three gain
alike. Writes ``concat-slots-probe.json`` in --out (rows: tokens, layout, pattern, time_us,
share_of_copy).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

TOKENS = [65536, 262144]
LAYOUTS = ("auto", "fp8", "fp8_ds_mla")
PATTERNS = ("random", "paged", "sequential")


def slot_mapping(pattern: str, tokens: int, page: int, g: torch.Generator) -> torch.Tensor:
    """(tokens,) int64 slots over a cache of ceil(tokens / page) pages, every slot distinct."""
    num_pages = math.ceil(tokens / page)
    if pattern == "random":
        return torch.randperm(num_pages * page, device="cuda", generator=g)[:tokens]
    if pattern == "paged":
        pages = torch.randperm(num_pages, device="cuda", generator=g)
        return (pages[:, None] * page + torch.arange(page, device="cuda")).flatten()[:tokens]
    return torch.arange(tokens, device="cuda")


def main(argv=None):
    from benchmarks.bench_concat import BLOCK_SIZE, C, FP8_SCALE, R, cache_layout, concat_bytes
    from benchmarks.timing import bench_us, copy_bandwidth_GBps, write_json
    from mla.kernels.extension import load_extension

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/lab/results"))
    args = parser.parse_args(argv)
    assert load_extension()["cuda"], "the mla extension did not build"
    copy_GBps = copy_bandwidth_GBps()
    name = torch.cuda.get_device_name()
    print(f"{name}: copy {copy_GBps:.0f} GB/s\n{'tokens':>7} {'layout':>11} {'pattern':>11} {'us':>8} {'share':>6}")
    g = torch.Generator(device="cuda").manual_seed(0)
    op = torch.ops.mla.concat_and_cache_mla
    rows = []
    for tokens in TOKENS:
        proj = torch.randn(tokens, C + R, device="cuda", dtype=torch.bfloat16, generator=g)
        kv_c, k_pe = proj[:, :C], proj[:, C:]
        for layout in LAYOUTS:
            width, dtype = cache_layout(layout)
            cache = torch.zeros(math.ceil(tokens / BLOCK_SIZE), BLOCK_SIZE, width, device="cuda").to(dtype)
            scale = torch.tensor([FP8_SCALE], device="cuda") if layout == "fp8" else None
            for pattern in PATTERNS:
                slots = slot_mapping(pattern, tokens, BLOCK_SIZE, g)
                us = bench_us(lambda: op(kv_c, k_pe, cache, slots, layout, scale))
                share = concat_bytes(tokens, layout) / (us * 1e-6) / 1e9 / copy_GBps
                rows.append(dict(tokens=tokens, kv_cache_dtype=layout, pattern=pattern, time_us=us,
                                 share_of_copy=share))
                print(f"{tokens:>7} {layout:>11} {pattern:>11} {us:>8.1f} {share:>6.3f}", flush=True)
            del cache
        del proj, kv_c, k_pe
        torch.cuda.empty_cache()
    stem = "h200" if "H200" in name else name.lower().replace(" ", "-")
    write_json(args.out, f"{stem}-concat-slots-probe.json",
               dict(device=name, torch=torch.__version__, copy_GBps=copy_GBps, rows=rows))


if __name__ == "__main__":
    main()
