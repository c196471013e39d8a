"""concat_and_cache on the GPU: bandwidth of the CUDA kernel against device copy and torch.

    python -m mla bench concat --out benchmarks/results      # < 2 min incl. JIT build

The op is pure data movement, so its ceiling is the device copy bandwidth, measured in the same
run (``dst.copy_(src)`` on 2 GiB, bytes read + written). For T tokens (bf16, c = 512, r = 64,
block 64, distinct random slots over a cache of ceil(T / 64) blocks):

    bytes = T * (c + r) * 2            read kv_c and k_pe (row views of one (T, c + r) tensor)
          + T * (c + r) * cache_bytes  write the rows (2 for "auto", 1 for "fp8")
          + T * 8                      read slot_mapping

``time_us`` times the op itself (``torch.ops.mla.concat_and_cache_mla``); ``api_us`` the public
``concat_and_cache``, whose argument checks read the slot range back to the host (a sync);
``torch_us`` the same write in torch (``torch.cat`` then ``index_put_`` on the flattened cache,
plus the fp8 divide/clamp/cast). L2 is cleared before every timed call (``timing.bench_us``), so
small T is not served from cache. Prints a table and writes ``concat.json`` in ``--out``.
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
FP8_SCALE = 0.05


def torch_write(kv_c, k_pe, kv_cache, slots, kv_cache_dtype, scale_t):
    """The baseline: what the reference does, minus its argument checks and -1 masking."""
    rows = torch.cat([kv_c, k_pe], dim=-1)  # (T, c + r)
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    if kv_cache_dtype == "fp8":
        rows = (rows.float() / scale_t).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        flat = flat.view(torch.uint8)
    flat[slots] = rows


def run(out_dir: Path) -> dict:
    from benchmarks.timing import bench_us, copy_bandwidth_GBps
    from mla.kernels import concat_cache as cc
    from mla.kernels.extension import load_extension

    t0 = time.time()
    state = load_extension()
    if not (state["loaded"] and state["cuda"]):
        raise SystemExit(f"the CUDA extension is not available: {state}")
    print(f"extension ready in {time.time() - t0:.0f} s (JIT build, or the cached one)")
    props = torch.cuda.get_device_properties(0)
    copy_GBps = copy_bandwidth_GBps()
    print(f"{props.name}: device copy {copy_GBps:.0f} GB/s (read + write)\n")

    header = (f"{'tokens':>7} {'cache':>5} {'MB':>7} {'time_us':>8} {'GB/s':>6} {'of copy':>7} "
              f"{'api_us':>7} {'torch_us':>8} {'vs torch':>8}")
    print(header)
    print("-" * len(header))
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for T in TOKENS:
        for kv_cache_dtype in ("auto", "fp8"):
            num_blocks = math.ceil(T / BLOCK_SIZE)
            proj = torch.randn(T, C + R, device="cuda", dtype=torch.bfloat16, generator=g)
            kv_c, k_pe = proj[:, :C], proj[:, C:]  # (T, c), (T, r), row stride c + r
            cache_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.bfloat16
            kv_cache = torch.zeros(num_blocks, BLOCK_SIZE, C + R, device="cuda").to(cache_dtype)
            slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda", generator=g)[:T]
            scale_t = (torch.tensor([FP8_SCALE], device="cuda")
                       if kv_cache_dtype == "fp8" else None)
            kw = dict(kv_cache_dtype=kv_cache_dtype, scale=scale_t)

            # correctness once: the kernel's cache equals the torch baseline's, bit for bit
            want = kv_cache.clone()
            torch_write(kv_c, k_pe, want, slots, kv_cache_dtype, scale_t)
            cc.concat_and_cache(kv_c, k_pe, kv_cache, slots, backend="extension", **kw)
            same = torch.equal(kv_cache.view(torch.uint8), want.view(torch.uint8))
            assert same, f"kernel and torch disagree at T={T} {kv_cache_dtype}"
            del want

            op = torch.ops.mla.concat_and_cache_mla
            time_us = bench_us(lambda: op(kv_c, k_pe, kv_cache, slots, kv_cache_dtype, scale_t))
            api_us = bench_us(lambda: cc.concat_and_cache(kv_c, k_pe, kv_cache, slots,
                                                          backend="extension", **kw))
            torch_us = bench_us(lambda: torch_write(kv_c, k_pe, kv_cache, slots,
                                                    kv_cache_dtype, scale_t))
            nbytes = T * (C + R) * (2 + kv_cache.element_size()) + T * 8
            GBps = nbytes / (time_us * 1e-6) / 1e9
            row = dict(tokens=T, kv_cache_dtype=kv_cache_dtype, input_dtype="bfloat16", c=C, r=R,
                       block_size=BLOCK_SIZE, bytes=nbytes, time_us=time_us, GBps=GBps,
                       share_of_copy=GBps / copy_GBps, api_us=api_us, torch_us=torch_us,
                       speedup_vs_torch=torch_us / time_us)
            rows.append(row)
            print(f"{T:>7} {kv_cache_dtype:>5} {nbytes / 1e6:>7.1f} {time_us:>8.1f} {GBps:>6.0f} "
                  f"{GBps / copy_GBps:>7.2f} {api_us:>7.1f} {torch_us:>8.1f} "
                  f"{torch_us / time_us:>7.1f}x", flush=True)
            del proj, kv_c, k_pe, kv_cache, slots
            torch.cuda.empty_cache()

    result = dict(device=props.name, torch=torch.__version__, cuda=torch.version.cuda,
                  copy_GBps=copy_GBps, fp8_scale=FP8_SCALE, rows=rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "concat.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path} ({time.time() - t0:.0f} s in all)")
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
