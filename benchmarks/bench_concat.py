"""concat_and_cache on the GPU: bandwidth of the CUDA kernel against device copy and torch.

    python -m mla bench concat --out benchmarks/results      # < 2 min incl. JIT build

The op is pure data movement, so its ceiling is the device copy bandwidth, measured in the same
run (``dst.copy_(src)`` on 2 GiB, bytes read + written). For T tokens (bf16, c = 512, r = 64,
block 64, distinct random slots over a cache of ceil(T / 64) blocks) and each cache layout of
``KV_CACHE_DTYPES``:

    bytes = T * (c + r) * 2            read kv_c and k_pe (row views of one (T, c + r) tensor)
          + T * bytes_per_token        write the rows: 1152 for "auto", 576 for "fp8" (one scale),
                                       656 for "fp8_ds_mla" (mla.kernels.fp8.bytes_per_token)
          + T * 8                      read slot_mapping

``time_us`` times the op itself (``torch.ops.mla.concat_and_cache_mla``); ``api_us`` the public
``concat_and_cache``, whose argument checks read the slot range back to the host (a sync);
``torch_us`` the same write in torch (``torch.cat`` then ``index_put_`` on the flattened cache,
plus the fp8 divide/clamp/cast, or ``mla.kernels.fp8.quantize_ds_mla``); ``copy_same_us`` a
device copy of the same bytes (``bytes / 2`` read and written), the ceiling of a call that size,
where a few microseconds of launch and tail weigh as much as the bytes: ``share_of_same_copy``
is its time over the kernel's. Each kernel's cache is
checked once against torch's, bit for bit. L2 is cleared before every timed call
(``timing.bench_us``), so small T is not served from cache. Prints a table, each fp8 row's share
of the copy bandwidth against ``SHARE_TARGET`` (information, not an assertion), and writes
``concat.json`` in ``--out``.

Importing this module touches no GPU: tests/test_benchmarks.py runs the byte count, the torch
baseline, the table and the targets on the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

TOKENS = [4096, 16384, 65536, 262144]
C, R, BLOCK_SIZE = 512, 64, 64
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_ds_mla")  # "fp8": fp8_e4m3, one scale for the cache
FP8_SCALE = 0.05
SHARE_TARGET = 0.8  # the share of the copy bandwidth an fp8 write is held to


def cache_layout(kv_cache_dtype: str) -> tuple[int, torch.dtype]:
    """(width, dtype) of a cache row in a layout: (576, bf16), (576, float8_e4m3fn), (656, uint8)."""
    from mla.kernels import fp8

    kind = fp8.canonical_kv_cache_dtype(kv_cache_dtype)
    dtype = {"auto": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_ds_mla": torch.uint8}[kind]
    return fp8.bytes_per_token(kind, C, R) // torch.empty((), dtype=dtype).element_size(), dtype


def concat_bytes(tokens: int, kv_cache_dtype: str) -> int:
    """Bytes one call moves: the bf16 inputs read, the layout's rows written, the slots read."""
    from mla.kernels import fp8

    return tokens * ((C + R) * 2 + fp8.bytes_per_token(kv_cache_dtype, C, R) + 8)


def torch_write(kv_c, k_pe, kv_cache, slots, kv_cache_dtype, scale_t):
    """The baseline: what the reference does, minus its argument checks and -1 masking."""
    from mla.kernels import fp8

    flat = kv_cache.view(-1, kv_cache.shape[-1])
    if kv_cache_dtype == "fp8_ds_mla":
        rows = fp8.quantize_ds_mla(kv_c, k_pe)  # (T, c + 4·c/128 + 2·r) uint8
    else:
        rows = torch.cat([kv_c, k_pe], dim=-1)  # (T, c + r)
    if kv_cache_dtype == "fp8":
        rows = (rows.float() / scale_t).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        flat = flat.view(torch.uint8)
    flat[slots] = rows


HEADER = (f"{'tokens':>7} {'cache':>10} {'MB':>7} {'time_us':>8} {'GB/s':>6} {'of copy':>7} "
          f"{'of same':>7} {'api_us':>7} {'torch_us':>8} {'vs torch':>8}")


def format_row(row: dict) -> str:
    """One line of the table under HEADER; a cache that differs from torch's says by how many bytes."""
    differ = row.get("bytes_differing_from_torch")
    return (f"{row['tokens']:>7} {row['kv_cache_dtype']:>10} {row['bytes'] / 1e6:>7.1f} {row['time_us']:>8.1f} "
            f"{row['GBps']:>6.0f} {row['share_of_copy']:>7.2f} {row['share_of_same_copy']:>7.2f} "
            f"{row['api_us']:>7.1f} {row['torch_us']:>8.1f} "
            f"{row['speedup_vs_torch']:>7.1f}x" + (f"  DIFFERS FROM TORCH in {differ} bytes" if differ else ""))


def target_checks(rows: list[dict]) -> list[dict]:
    """Each fp8 row's share of the copy bandwidth against SHARE_TARGET: tokens, kv_cache_dtype,
    share_of_copy, met."""
    return [dict(tokens=r["tokens"], kv_cache_dtype=r["kv_cache_dtype"], share_of_copy=r["share_of_copy"],
                 met=r["share_of_copy"] >= SHARE_TARGET) for r in rows if r["kv_cache_dtype"] != "auto"]


def format_targets(checks: list[dict]) -> list[str]:
    """The lines that end the table: each fp8 row against SHARE_TARGET, and how many met it."""
    lines = [f"targets, an fp8 write's share of the copy bandwidth >= {SHARE_TARGET}; information, not a check:"]
    lines += [f"  {c['tokens']:>7} {c['kv_cache_dtype']:>10}: {c['share_of_copy']:.2f}  "
              + ("met" if c["met"] else "missed") for c in checks]
    return lines + [f"  {sum(c['met'] for c in checks)} of {len(checks)} met"]


def run(out_dir: Path) -> dict:
    from benchmarks.timing import bench_us, copy_bandwidth_GBps, copy_us
    from mla.kernels import concat_cache as cc
    from mla.kernels import fp8
    from mla.kernels.extension import load_extension

    t0 = time.time()
    state = load_extension()
    if not (state["loaded"] and state["cuda"]):
        raise SystemExit(f"the CUDA extension is not available: {state}")
    print(f"extension ready in {time.time() - t0:.0f} s (JIT build, or the cached one)")
    props = torch.cuda.get_device_properties(0)
    copy_GBps = copy_bandwidth_GBps()
    print(f"{props.name}: device copy {copy_GBps:.0f} GB/s (read + write)\n")

    print(HEADER)
    print("-" * len(HEADER))
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for T in TOKENS:
        for kv_cache_dtype in KV_CACHE_DTYPES:
            num_blocks = math.ceil(T / BLOCK_SIZE)
            proj = torch.randn(T, C + R, device="cuda", dtype=torch.bfloat16, generator=g)
            kv_c, k_pe = proj[:, :C], proj[:, C:]  # (T, c), (T, r), row stride c + r
            width, cache_dtype = cache_layout(kv_cache_dtype)
            kv_cache = torch.zeros(num_blocks, BLOCK_SIZE, width, device="cuda").to(cache_dtype)
            slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda", generator=g)[:T]
            scale_t = (torch.tensor([FP8_SCALE], device="cuda")
                       if kv_cache_dtype == "fp8" else None)
            kw = dict(kv_cache_dtype=kv_cache_dtype, scale=scale_t)

            # correctness once: the kernel's cache equals the torch baseline's, bit for bit (a
            # row that does not is recorded, the run goes on and fails at the end)
            want = kv_cache.clone()
            torch_write(kv_c, k_pe, want, slots, kv_cache_dtype, scale_t)
            cc.concat_and_cache(kv_c, k_pe, kv_cache, slots, backend="extension", **kw)
            bytes_differing = int((kv_cache.view(torch.uint8) != want.view(torch.uint8)).sum())
            del want

            op = torch.ops.mla.concat_and_cache_mla
            time_us = bench_us(lambda: op(kv_c, k_pe, kv_cache, slots, kv_cache_dtype, scale_t))
            api_us = bench_us(lambda: cc.concat_and_cache(kv_c, k_pe, kv_cache, slots,
                                                          backend="extension", **kw))
            torch_us = bench_us(lambda: torch_write(kv_c, k_pe, kv_cache, slots,
                                                    kv_cache_dtype, scale_t))
            nbytes = concat_bytes(T, kv_cache_dtype)
            copy_same_us = copy_us(nbytes // 2)  # nbytes / 2 read and as many written
            GBps = nbytes / (time_us * 1e-6) / 1e9
            row = dict(tokens=T, kv_cache_dtype=kv_cache_dtype, input_dtype="bfloat16", c=C, r=R,
                       block_size=BLOCK_SIZE, bytes=nbytes, time_us=time_us, GBps=GBps,
                       share_of_copy=GBps / copy_GBps, copy_same_us=copy_same_us,
                       share_of_same_copy=copy_same_us / time_us, api_us=api_us, torch_us=torch_us,
                       speedup_vs_torch=torch_us / time_us,
                       cache_bytes_per_token=fp8.bytes_per_token(kv_cache_dtype, C, R),
                       same_as_torch=bytes_differing == 0, bytes_differing_from_torch=bytes_differing)
            rows.append(row)
            print(format_row(row), flush=True)
            del proj, kv_c, k_pe, kv_cache, slots
            torch.cuda.empty_cache()

    checks = target_checks(rows)
    print("\n".join(format_targets(checks)))
    result = dict(device=props.name, torch=torch.__version__, cuda=torch.version.cuda,
                  copy_GBps=copy_GBps, fp8_scale=FP8_SCALE, share_target=SHARE_TARGET, rows=rows,
                  targets=checks)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "concat.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path} ({time.time() - t0:.0f} s in all)")
    wrong = [f"{r['tokens']} {r['kv_cache_dtype']}" for r in rows if not r["same_as_torch"]]
    if wrong:
        raise SystemExit(f"the kernel's cache differs from torch's at {', '.join(wrong)} (bytes_differing_from_torch)")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                        help="folder for concat.json")
    args = parser.parse_args(argv)
    assert torch.cuda.is_available(), "bench_concat needs a CUDA GPU"
    run(args.out)


if __name__ == "__main__":
    main()
