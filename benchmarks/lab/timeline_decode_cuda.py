"""Where each CTA of the CUDA decode stage 1 spends its time: per-CTA timestamps, on the GPU.

    PYTHONPATH=. python3 benchmarks/lab/timeline_decode_cuda.py --out benchmarks/lab/results   # ~1.5 min, JIT build included

Builds a copy of ``csrc/mla_decode_sm80.cu`` with timestamps added (the source is edited as
text here, so the package's kernel stays as it is; an edit that no longer applies fails loudly)
and runs it once per repetition after L2 is cleared (``--clear``). Thread 0 of every CTA records
``%globaltimer`` (ns, one clock for the whole GPU) and ``clock64`` (its SM's cycles) at five
points: start; the query in shared memory (the prologue); the first tile landed; the tile loop
done; the partials written. It also sums the cycles it spent in the loop's wait for a tile and
the barrier after it (``loop_wait_us``: an upper bound on waiting for memory, as it includes
waiting at the barrier for slower warps); ``math_us_per_tile`` is what is left of ``loop_us``
over the CTA's tiles (the loop starts once tile 0 has landed, so it holds every tile's body and
all waits but the first): the copies issued plus the math. ``%globaltimer`` ticks in steps of
0.256 us here, so start skew below that does not show. The loop body's four parts between its
barriers are summed over the tiles too, as thread 0 sees them: ``issue_us`` (thread 0 issuing
its copies of the next tile: no barrier ends it, so a stall there is the SM's queue of
outstanding requests being full), ``scores_us`` (q . k and the partial scores through shared
memory) and ``softmax_us`` (each ending at a barrier: the whole CTA's), ``pv_us`` (p . V). The clock reads
add a few cycles each. Medians over CTAs, then over 5 repetitions; cycles are turned into us at
the clock the two timers give. (``h200-decode-cuda-timeline-first.json`` is the first run, before
the four parts: NOTES row 40.)

Writes ``h200-decode-cuda-timeline.json`` (NOTES row 40), with L2 zeroed before each run as
do_bench leaves it. ``--shapes 64x4096x4,128x8192x2 --kv-cache-dtype auto,fp8_ds_mla`` picks the
shapes (b x t x splits) and the cache layouts (an fp8 cache written from the same rows by
``bench_decode.write_fp8_caches``); give such a run its own ``--out-name``. On an fp8 cache stamp 1
comes before q is brought into fp16's range (a CTA-wide max and a barrier), so that step counts
in ``first_tile_us``. ``--clear both --out-name h200-decode-cuda-timeline-l2.json`` runs every shape
after a read clear and after a zeroing one, in turn, on one build (NOTES row 44).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import pathlib
import statistics
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
# (b, t, splits): 16 heads; b = 1 at the rule's 128 splits, and 256 (two CTAs an SM) and 64
SHAPES = ((1, 32768, 128), (1, 32768, 256), (1, 32768, 64), (64, 4096, 4), (4, 131072, 66))
SECTIONS = ("issue", "scores", "softmax", "pv")  # the loop body between its barriers
SLOTS = 16  # a CTA's row: 5 x (globaltimer, clock64), SM id, wait cycles, 4 section cycle sums


def stamp_code(slots: int) -> str:
    """C++ for a kernel's top (``cta`` and ``timing`` defined): ``stamp(k)`` has thread 0 record
    ``%globaltimer`` and ``clock64`` in slots 2k, 2k + 1 of its CTA's row; stamp 0 and the SM id
    (slot 10) are taken at once."""
    return f"""  auto stamp = [&](int k) {{
    if (threadIdx.x == 0) {{
      unsigned long long g;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
      timing[cta * {slots} + 2 * k] = (long long)g;
      timing[cta * {slots} + 2 * k + 1] = clock64();
    }}
  }};
  stamp(0);
  if (threadIdx.x == 0) {{
    int smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    timing[cta * {slots} + 10] = smid;
  }}
"""


def instrumented_source() -> str:
    src = (ROOT / "csrc" / "mla_decode_sm80.cu").read_text()

    def edit(old, new):
        nonlocal src
        assert old in src, f"the kernel changed; this edit no longer applies:\n{old}"
        src = src.replace(old, new, 1)

    edit('#include "mla_decode.h"\n', '#include <torch/extension.h>\n#include "mla_decode.h"\n')
    edit("int64_t slb, int64_t slh, int64_t sls) {", """int64_t slb, int64_t slh, int64_t sls, long long* timing) {
  const int64_t cta = int64_t(blockIdx.z) * gridDim.y + blockIdx.y;
""" + stamp_code(SLOTS))
    edit("""  cp_async_wait<kStages - 1>();  // the q group (the oldest) has landed
  __syncthreads();""", """  cp_async_wait<kStages - 1>();  // the q group (the oldest) has landed
  __syncthreads();
  stamp(1);""")
    edit("""  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait<kStages - 2>();  // tile t has landed (this thread's copies) ...
    __syncthreads();               // ... everyone's; and every read of tile t - 1 is done""",
         """  long long waited = 0, section[4] = {0, 0, 0, 0};
  for (int t = 0; t < n_tiles; ++t) {
    const long long w0 = clock64();
    cp_async_wait<kStages - 2>();  // tile t has landed (this thread's copies) ...
    __syncthreads();               // ... everyone's; and every read of tile t - 1 is done
    const long long c_landed = clock64();
    if (t > 0) waited += c_landed - w0;
    if (t == 0) stamp(2);""")
    # the loop body's four parts, between its barriers, summed over the tiles (cycles)
    edit("""      cp_async_commit();
    }
    const T* tile =""", """      cp_async_commit();
    }
    const long long c_issued = clock64();
    const T* tile =""")
    edit("""    __syncthreads();

    // -- full scores""", """    __syncthreads();
    const long long c_scored = clock64();

    // -- full scores""")
    edit("""    __syncthreads();

    // -- acc = acc""", """    __syncthreads();
    const long long c_softmaxed = clock64();

    // -- acc = acc""")
    edit("""      }
    }
  }
  cp_async_wait<0>();
""", """      }
    }
    const long long c_done = clock64();
    section[0] += c_issued - c_landed;
    section[1] += c_scored - c_issued;
    section[2] += c_softmaxed - c_scored;
    section[3] += c_done - c_softmaxed;
  }
  cp_async_wait<0>();
""")
    edit("  cp_async_wait<0>();\n", """  cp_async_wait<0>();
  stamp(3);
  if (threadIdx.x == 0) {
    timing[cta * 16 + 11] = waited;
    for (int k = 0; k < 4; ++k) timing[cta * 16 + 12 + k] = section[k];
  }
""")
    end = src.rindex("}\n", 0, src.index("// The shapes built"))  # the kernel's closing brace
    src = src[:end] + "  __syncthreads();\n  stamp(4);\n" + src[end:]
    edit("""  const CacheFormat format =
      check_mla_decode(q, kv_cache, block_table, seq_lens, part_out, part_lse, num_splits,
                       {"mla_decode_sm80", kHeads, kC, kR, DecodeShape::kTile}, kv_cache_dtype, kv_scale);""",
         """  const CacheFormat format = kv_cache_dtype == "fp8_ds_mla" ? CacheFormat::kFp8DsMla
                             : kv_cache_dtype == "fp8_e4m3"  ? CacheFormat::kFp8E4M3
                                                             : CacheFormat::kAuto;  // unchecked here""")
    edit("const std::optional<at::Tensor>& kv_scale) {", "const std::optional<at::Tensor>& kv_scale, at::Tensor& timing) {")
    edit("part_lse.stride(0), part_lse.stride(1), part_lse.stride(2));",
         "part_lse.stride(0), part_lse.stride(1), part_lse.stride(2), (long long*)timing.data_ptr<int64_t>());")
    src = src[: src.index("TORCH_LIBRARY_IMPL")]
    src = src.replace("namespace {\n", "", 1).replace("}  // namespace\n}  // namespace mla", "}  // namespace mla")
    return src + 'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &mla::mla_decode_sm80); }\n'


def build():
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    folder = pathlib.Path(tempfile.mkdtemp(prefix="mla_timeline_"))
    (folder / "timeline.cu").write_text(instrumented_source())
    return load(name="mla_decode_timeline", sources=[str(folder / "timeline.cu")], build_directory=str(folder),
                extra_include_paths=[str(ROOT / "csrc")],
                extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"])


def stamped_runs(launch, timing, clear, repeats=5):
    """launch() `repeats` times after two warm-ups, each after clear_l2(clear) (dirty: a buffer
    zeroed, as do_bench leaves L2; clean: read, NOTES row 44). Yields for each run: the timing rows
    (on the CPU; columns 0-9 the five (globaltimer, clock64) stamps), each CTA's start and end (us
    from the first start), the SM clock (GHz, from the two timers), and us(a, z): each CTA's time
    from stamp a to stamp z (us, from its cycles). Only the CTAs that reached their last stamp
    count: one that returns early (a dealt piece with no pair left) leaves it 0, as zeroed."""
    from benchmarks.timing import clear_l2

    for rep in range(repeats + 2):
        clear_l2(clear)
        launch()
        torch.cuda.synchronize()
        if rep < 2:
            continue
        x = timing.cpu()
        x = x[x[:, 8] != 0]
        ns, cycles = x[:, 0:10:2].double(), x[:, 1:10:2].double()
        start, end = (ns[:, 0] - ns[:, 0].min()) / 1e3, (ns[:, 4] - ns[:, 0].min()) / 1e3
        ghz = ((cycles[:, 4] - cycles[:, 0]) / (ns[:, 4] - ns[:, 0])).median().item()

        def us(a, z, cycles=cycles, ghz=ghz):
            return (cycles[:, z] - cycles[:, a]) / ghz / 1e3

        yield x, start, end, ghz, us


def by_sm_load(smid, end):
    """How the CTAs spread over the SMs, and when they end by their SM's load: ``sms_with_k`` the
    SMs that ran k CTAs over the launch, ``end_median_k_us`` / ``end_max_k_us`` the median and
    last end of the CTAs on such SMs (us from the first start). Tells a tail of CTAs that share
    their SM from one spread over all."""
    smid = smid.long()
    per_sm = torch.bincount(smid)
    load = per_sm[smid]  # each CTA's SM's count
    out = {}
    for k in sorted(set(load.tolist())):
        ends = end[load == k]
        out[f"sms_with_{k}"] = int((per_sm == k).sum())
        out[f"end_median_{k}_us"] = ends.median().item()
        out[f"end_max_{k}_us"] = ends.max().item()
    return out


def one_shape(mod, b, t, splits, repeats=5, clear="dirty", kv_cache_dtype="auto"):
    from benchmarks.bench_decode import SCALE, make_inputs, write_fp8_caches

    q, caches, table, lens = make_inputs(b, t, 16)
    scale = None
    if kv_cache_dtype != "auto":  # the same rows, written in the fp8 layout
        caches, scale = write_fp8_caches(kv_cache_dtype, caches, 1)
    cache = caches[0]
    part_out = torch.empty((b, 16, splits, 512), dtype=torch.float32, device="cuda")
    part_lse = torch.empty((b, 16, splits), dtype=torch.float32, device="cuda")
    timing = torch.zeros((b * splits, SLOTS), dtype=torch.int64, device="cuda")
    runs = []

    def launch():
        mod.run(q, cache, table, lens, part_out, part_lse, float(SCALE), splits, kv_cache_dtype, scale, timing)

    for x, start, end, ghz, us in stamped_runs(launch, timing, clear, repeats):
        def med(v):
            return v.median().item()

        runs.append(dict(
            span_us=end.max().item(), start_max_us=start.max().item(), end_first_us=end.min().item(),
            end_median_us=med(end), prologue_us=med(us(0, 1)), first_tile_us=med(us(1, 2)), loop_us=med(us(2, 3)),
            loop_wait_us=med(x[:, 11].double() / ghz / 1e3), epilogue_us=med(us(3, 4)), cta_us=med(us(0, 4)),
            **{f"{name}_us": med(x[:, 12 + k].double() / ghz / 1e3) for k, name in enumerate(SECTIONS)},
            cta_max_us=us(0, 4).max().item(), ghz=ghz, sms=len(set(x[:, 10].tolist())),
            **by_sm_load(x[:, 10], end)))
    keys = set.intersection(*(set(r) for r in runs))  # the SM loads may differ between runs
    row = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k in keys}
    tiles = math.ceil(math.ceil(t / 32) / splits)
    return dict(b=b, t=t, h=16, kv_cache_dtype=kv_cache_dtype, splits=splits, tiles_per_cta=tiles,
                math_us_per_tile=(row["loop_us"] - row["loop_wait_us"]) / tiles, **row)


def main(argv=None):
    from benchmarks.bench_decode import parse_kv_cache_dtypes, parse_shapes  # BxTxSPLITS here
    from benchmarks.timing import write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/lab/results")
    parser.add_argument("--clear", choices=("dirty", "clean", "both"), default="dirty",
                        help="L2 before each run: a buffer zeroed (dirty lines, do_bench's way), read (clean "
                             "lines), or both in turn (one build; writes runs = {clean: rows, dirty: rows})")
    parser.add_argument("--out-name", default="h200-decode-cuda-timeline.json")
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES,
                        help="comma-separated BxTxSPLITS, 16 heads (default: the five of NOTES row 40)")
    parser.add_argument("--kv-cache-dtype", dest="kv_cache_dtypes", type=parse_kv_cache_dtypes, default=["auto"],
                        help="comma-separated cache layouts: auto, fp8_e4m3 (or fp8), fp8_ds_mla")
    args = parser.parse_args(argv)
    t0 = time.time()
    mod = build()
    print(f"built in {time.time() - t0:.0f} s", flush=True)
    runs = {}
    for clear in ("clean", "dirty") if args.clear == "both" else (args.clear,):
        runs[clear] = []
        for (b, t, splits), kind in itertools.product(args.shapes, args.kv_cache_dtypes):
            runs[clear].append(one_shape(mod, b, t, splits, clear=clear, kv_cache_dtype=kind))
            print(clear, json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in runs[clear][-1].items()}),
                  flush=True)
    result = dict(device=torch.cuda.get_device_name(0), clear=args.clear)
    if args.clear == "both":
        result["runs"] = runs
    else:
        result["rows"] = runs[args.clear]
    write_json(args.out, args.out_name, result)


if __name__ == "__main__":
    main()
