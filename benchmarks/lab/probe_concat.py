"""Layouts of the concat-and-cache scatter, timed side by side on the GPU (bf16, c = 512, r = 64).

    PYTHONPATH=. python3 benchmarks/lab/probe_concat.py --out benchmarks/lab/results

The op moves T rows of 576 bf16 values (72 vectors of 16 bytes) from two strided inputs to
cache rows picked by slot_mapping. ``ext`` is the kernel in csrc/; when this probe first ran
(``h200-concat-probe.json``) that was the first layout (one thread a vector, the (token, vector)
pair from a 64-bit index by division), at 0.72 of copy bandwidth at 64k tokens and 0.78 at 256k
against a target of 0.8. Candidates, built here by JIT from the source below, each checked bit
for bit against the torch write first:

- ``rows-uU``: a block of 72 x 4 threads, thread (j, y) moves vector j of rows y, y + 4, ...
  (U rows each, 4·U a block): no division, the slot read once a row, and U loads issued before
  the first store (U·16 bytes in flight a thread).
- ``rows-uU-cs``: the same with streaming hints: inputs read with ``ld.global.cs`` and the
  cache written with ``st.global.cs`` (evict-first: neither is read again soon).

Plus the references: ``copy`` (``dst.copy_(src)`` of the same bytes, contiguous) and ``ext`` on
sequential slots (``ext-seq``), which separates the cost of scattered rows from the kernel's.
Writes ``h200-concat-probe.json``.
"""

from __future__ import annotations

import argparse
import math

import torch

C, R, PAGE = 512, 64, 64
VECS = (C + R) // 8  # 16-byte vectors a row

SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cstdint>

template <int U, bool STREAM>
__global__ void rows_kernel(const uint4* __restrict__ kv_c, const uint4* __restrict__ k_pe,
                            uint4* __restrict__ cache, const int64_t* __restrict__ slots,
                            int64_t T, int64_t sc, int64_t sp, int64_t num_slots) {
  // vectors: c / 8 = 64 from kv_c, r / 8 = 8 from k_pe; strides sc, sp in vectors
  const int j = threadIdx.x;                       // vector of the row, 0..71
  const int64_t row0 = (int64_t)blockIdx.x * (4 * U) + threadIdx.y;
  uint4 x[U];
  int64_t s[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t t = row0 + 4 * u;
    if (t < T) {
      const uint4* src = j < 64 ? kv_c + t * sc + j : k_pe + t * sp + (j - 64);
      x[u] = STREAM ? __ldcs(src) : *src;
      s[u] = slots[t];
    } else {
      s[u] = -1;
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (s[u] >= 0 && s[u] < num_slots) {
      uint4* dst = cache + s[u] * 72 + j;
      if (STREAM) __stcs(dst, x[u]); else *dst = x[u];
    }
  }
}

void rows(torch::Tensor kv_c, torch::Tensor k_pe, torch::Tensor cache, torch::Tensor slots,
          int64_t unroll, bool stream) {
  const int64_t T = kv_c.size(0);
  const int64_t sc = kv_c.stride(0) / 8, sp = k_pe.stride(0) / 8;
  const int64_t num_slots = cache.numel() / 576;
  auto* a = reinterpret_cast<const uint4*>(kv_c.data_ptr());
  auto* b = reinterpret_cast<const uint4*>(k_pe.data_ptr());
  auto* o = reinterpret_cast<uint4*>(cache.data_ptr());
  const int64_t* sl = slots.data_ptr<int64_t>();
  auto st = c10::cuda::getCurrentCUDAStream();
  dim3 block(72, 4);
#define L(UU, SS) { dim3 grid((T + 4 * UU - 1) / (4 * UU)); \
  rows_kernel<UU, SS><<<grid, block, 0, st>>>(a, b, o, sl, T, sc, sp, num_slots); }
  if (stream) { if (unroll == 1) L(1, true) else if (unroll == 2) L(2, true) else if (unroll == 4) L(4, true) else L(8, true) }
  else { if (unroll == 1) L(1, false) else if (unroll == 2) L(2, false) else if (unroll == 4) L(4, false) else L(8, false) }
#undef L
}
"""
CPP = "void rows(torch::Tensor kv_c, torch::Tensor k_pe, torch::Tensor cache, torch::Tensor slots, int64_t unroll, bool stream);"


def main(argv=None):
    from torch.utils.cpp_extension import load_inline

    from benchmarks.bench_concat import torch_write
    from benchmarks.timing import bench_us, copy_bandwidth_GBps, write_json
    from mla.kernels.extension import load_extension

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/lab/results")
    args = parser.parse_args(argv)
    mod = load_inline("mla_concat_probe", CPP, cuda_sources=SOURCE, functions=["rows"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"], verbose=False)
    assert load_extension()["cuda"], "the mla extension did not build"
    op = torch.ops.mla.concat_and_cache_mla
    copy_GBps = copy_bandwidth_GBps()
    print(f"copy {copy_GBps:.0f} GB/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for T in (16384, 65536, 262144):
        num_blocks = math.ceil(T / PAGE)
        proj = torch.randn(T, C + R, device="cuda", dtype=torch.bfloat16, generator=g)
        kv_c, k_pe = proj[:, :C], proj[:, C:]
        cache = torch.zeros(num_blocks, PAGE, C + R, device="cuda", dtype=torch.bfloat16)
        slots = torch.randperm(num_blocks * PAGE, device="cuda", generator=g)[:T]
        seq = torch.arange(T, device="cuda")
        want = cache.clone()
        torch_write(kv_c, k_pe, want, slots, "auto", None)
        nbytes = T * (C + R) * 4 + T * 8
        src = torch.empty(T * (C + R), dtype=torch.bfloat16, device="cuda")  # copy moves 2x: = nbytes
        dst = torch.empty_like(src)
        cands = {"copy": lambda: dst.copy_(src),
                 "ext": lambda: op(kv_c, k_pe, cache, slots, "auto", None),
                 "ext-seq": lambda: op(kv_c, k_pe, cache, seq, "auto", None)}
        for u in (1, 2, 4, 8):
            for stream in (False, True):
                cands[f"rows-u{u}{'-cs' if stream else ''}"] = (
                    lambda u=u, stream=stream: mod.rows(kv_c, k_pe, cache, slots, u, stream))
        for name, fn in cands.items():
            ok = None
            if name.startswith(("rows", "ext")) and name != "ext-seq":
                cache.zero_()
                fn()
                ok = torch.equal(cache, want)
            us = bench_us(fn)
            row = dict(tokens=T, kernel=name, time_us=us, GBps=nbytes / us / 1e3,
                       share_of_copy=nbytes / us / 1e3 / copy_GBps, correct=ok)
            rows.append(row)
            print(f"{T:>7} {name:<12} {us:8.1f} us {row['GBps']:6.0f} GB/s {row['share_of_copy']:5.2f}  ok={ok}",
                  flush=True)
        del proj, kv_c, k_pe, cache, slots, seq, want, src, dst
        torch.cuda.empty_cache()
    write_json(args.out, "h200-concat-probe.json",
               dict(device=torch.cuda.get_device_name(0), copy_GBps=copy_GBps, rows=rows))


if __name__ == "__main__":
    main()
