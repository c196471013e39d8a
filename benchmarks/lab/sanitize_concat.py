"""Run the CUDA concat_and_cache kernel a few times on small inputs, for compute-sanitizer.

    PYTHONPATH=. compute-sanitizer --tool memcheck python3 benchmarks/lab/sanitize_concat.py

Covers the vector path (16-byte aligned rows) and the scalar path (odd row stride, c % 8 != 0),
every input dtype, the "auto", "fp8" and "fp8_ds_mla" caches (the last where c is a multiple of
128), -1 slots, the last slot of the cache, and a
direct op call with an out-of-range slot (the kernel must skip it, not write past the cache).
Each run is checked against the reference; exits non-zero on a mismatch. Build the extension
first (the test suite does) so the JIT build does not run under the sanitizer.
"""

import sys

import torch

from mla.kernels import concat_cache as cc
from mla.kernels import fp8
from mla.kernels.extension import load_extension


def main() -> int:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    state = load_extension()
    assert state["loaded"] and state["cuda"], f"CUDA extension not available: {state}"
    g = torch.Generator(device="cuda").manual_seed(0)
    failures = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for c, r, extra in ((512, 64, 0), (512, 64, 7), (12, 4, 0), (1152, 64, 0), (256, 130, 0)):
            for kv_cache_dtype in ("auto", "fp8", "fp8_ds_mla")[: 3 if c % 128 == 0 else 2]:
                T, block_size, num_blocks = 33, 16, 4
                proj = torch.randn(T, c + r + extra, device="cuda", dtype=dtype, generator=g)
                kv_c, k_pe = proj[:, :c], proj[:, c : c + r]  # row views, as in the layer
                cache_dtype, width = fp8.cache_row(kv_cache_dtype, c, r, dtype)
                cache = torch.zeros(num_blocks, block_size, width, device="cuda").to(cache_dtype)
                # distinct slots: two tokens writing one slot would race (which one lands is undefined)
                slots = torch.randperm(num_blocks * block_size - 1, device="cuda", generator=g)[:T]
                slots[::4] = -1
                slots[1] = num_blocks * block_size - 1
                kw = dict(kv_cache_dtype=kv_cache_dtype,
                          scale=0.01 if kv_cache_dtype == "fp8" else None)
                ref = cache.clone()
                cc.concat_and_cache(kv_c, k_pe, cache, slots, backend="extension", **kw)
                cc.concat_and_cache_reference(kv_c, k_pe, ref, slots, **kw)
                same = torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
                failures += not same
                print(f"{str(dtype):15s} c={c:3d} r={r:2d} extra={extra} {kv_cache_dtype:10s} "
                      f"{'ok' if same else 'MISMATCH'}")
    # out-of-range slot through the raw op: skipped by the kernel
    cache = torch.zeros(2, 16, 576, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(3, 576, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([0, 32, 1 << 40], device="cuda")
    torch.ops.mla.concat_and_cache_mla(x[:, :512], x[:, 512:], cache, slots, "auto", None)
    torch.cuda.synchronize()
    print("out-of-range slots skipped:", bool(cache[0, 1:].eq(0).all() and cache[1].eq(0).all()))
    print("FAILED" if failures else "all ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
