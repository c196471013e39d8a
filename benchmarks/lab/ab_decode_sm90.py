"""Versions of a CUDA decode stage 1 (``csrc/mla_decode_sm90.cu``, or with ``--kernel cuda-sm80``
``csrc/mla_decode_sm80.cu``) timed side by side, on the GPU.

    PYTHONPATH=. python3 benchmarks/lab/ab_decode_sm90.py --out DIR old=PATH.cu new=csrc/mla_decode_sm90.cu
    PYTHONPATH=. python3 benchmarks/lab/ab_decode_sm90.py --out DIR --kernel cuda-sm80 --shapes 1x32768,4x4096 \
        old=PATH.cu new=csrc/mla_decode_sm80.cu

Each ``NAME=PATH`` is a version of the kernel's source (e.g. ``git show HEAD:csrc/... > old.cu``
beforehand: the GPU machine's copy has no git history). Each is built for sm_90a (so this runs
on a Hopper GPU) as an extension of its own (the sources copied with ``binding.cpp``, the op
library renamed ``mla_ab_NAME`` and the C++ namespace with it, so the versions load side by
side; ``csrc``'s headers are shared), the builds in parallel processes. At each shape
(``--shapes``, default the six of ``SHAPES``; 128 heads for cuda-sm90 and 16 for cuda-sm80 unless
``--heads``; the split count ``mla_decode`` takes) each version's stage 1, and at more than one
split the Triton merge, is captured in one CUDA graph, as ``bench_decode.py``'s ``time_us`` is;
with one split the kernel writes the answer in q's dtype itself, as ``mla_decode`` has it do.
The versions are timed in turn ``--rounds`` times (``timing.bench_us``, L2 cleared by a
read) and each one's minimum kept, so a drift of the clock over the run falls on all of them.
``NAME_diff`` is max |out - first's out| / max |first's out|: the versions are meant to compute
the same thing.
Correctness is the GPU tests' job (``tests/test_kernels_decode.py``); this only times.

Writes ``--out-name`` (``h200-decode-sm90-ab-rows.json``, ``-sm80-`` for cuda-sm80); the committed A/B files gather runs
of it by hand under ``runs``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import multiprocessing
import pathlib
import re
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
C = 512
SHAPES = ((64, 4096), (128, 8192), (64, 16384), (1, 32768), (2, 65536), (4, 131072))
ARCH = "-gencode=arch=compute_90a,code=sm_90a"


def variant_sources(name: str, kernel_source: str, folder: pathlib.Path) -> list[pathlib.Path]:
    """binding.cpp and the kernel, their op library renamed mla_ab_<name>, written into folder."""
    library = f"mla_ab_{name}"
    binding = (ROOT / "csrc" / "binding.cpp").read_text()
    out = []
    for file, text, marker in (("binding.cpp", binding, "TORCH_LIBRARY(mla, m) {"),
                               ("kernel.cu", kernel_source, "TORCH_LIBRARY_IMPL(mla, CUDA, m) {")):
        if text.count(marker) != 1:
            raise SystemExit(f"ab_decode_sm90: {name}'s {file} should hold one {marker!r}")
        (folder / file).write_text(text.replace(marker, marker.replace("(mla,", f"({library},")))
        out.append(folder / file)
    return out


def build(name: str, source_path: str, folder: str):
    """Build (or, already built, load) version `name`; returns the op."""
    from torch.utils.cpp_extension import load

    folder = pathlib.Path(folder)
    sources = variant_sources(name, pathlib.Path(source_path).read_text(), folder)
    rename = f"-Dmla=mla_ab_{name}"  # the C++ namespace: each library's own symbols
    load(name=f"mla_ab_{name}", sources=[str(s) for s in sources], build_directory=str(folder),
         extra_include_paths=[str(ROOT / "csrc")], extra_cflags=["-O3", rename],
         extra_cuda_cflags=["-O3", ARCH, rename], is_python_module=False, verbose=False)
    return str(folder)


def stage1(op, q, cache, table, lens, splits, scale):
    from mla.kernels.decode import _merge

    b, h, _ = q.shape
    if splits == 1:  # the answer itself, in q's dtype
        out = torch.empty((b, h, 1, C), dtype=q.dtype, device=q.device)
        lse = torch.empty((b, h, 1), dtype=torch.float32, device=q.device)
        op(q, cache, table, lens, out, lse, float(scale), 1)
        return out[:, :, 0]
    part_out = torch.empty((b, h, splits, C), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)
    out = torch.empty((b, h, C), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h), dtype=torch.float32, device=q.device)
    op(q, cache, table, lens, part_out, part_lse, float(scale), splits)
    _merge(part_out, part_lse, out, lse)
    return out


def main(argv=None) -> None:
    from benchmarks.bench_decode import SCALE, cache_copies, floor_us, make_inputs
    from benchmarks.timing import bench_us, copy_bandwidth_GBps, graphed, matmul_TFLOPs, write_json
    from mla.kernels.backends import CUDA_TILES, SM80_MAX_HEADS
    from mla.kernels.decode import choose_num_kv_splits

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+", metavar="NAME=PATH")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--out-name", default=None, help="default h200-decode-sm90-ab-rows.json (sm80 for cuda-sm80)")
    parser.add_argument("--kernel", choices=("cuda-sm90", "cuda-sm80"), default="cuda-sm90")
    parser.add_argument("--heads", default=None, help="comma-separated; default 128 (cuda-sm90) or 16 (cuda-sm80)")
    parser.add_argument("--shapes", default=None, help="comma-separated BxT (e.g. 1x32768); default SHAPES")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    versions = {}
    for item in args.versions:
        name, eq, path = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or not pathlib.Path(path).is_file():
            parser.error(f"a version is NAME=PATH with NAME an identifier and PATH a file, got {item!r}")
        versions[name] = path
    sm = args.kernel.removeprefix("cuda-")  # the op's and the result file's name: sm90 or sm80
    heads = [int(x) for x in (args.heads or ("128" if sm == "sm90" else "16")).split(",")]
    if sm == "sm80" and max(heads) > SM80_MAX_HEADS:
        parser.error(f"--kernel cuda-sm80 takes at most {SM80_MAX_HEADS} heads, got --heads {args.heads}")
    shapes = SHAPES
    if args.shapes:
        try:
            shapes = tuple(tuple(int(x) for x in item.split("x")) for item in args.shapes.split(","))
        except ValueError:
            shapes = ()
        if not shapes or any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
            parser.error(f"--shapes takes BxT pairs of positive integers (1x32768,2x65536), got {args.shapes!r}")
    t0 = time.time()
    folders = {name: tempfile.mkdtemp(prefix=f"mla_ab_{name}_") for name in versions}
    with concurrent.futures.ProcessPoolExecutor(len(versions), mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs = [pool.submit(build, name, path, folders[name]) for name, path in versions.items()]
        for job in jobs:
            job.result()
    ops = {}
    for name, path in versions.items():  # up to date: this only loads
        build(name, path, folders[name])
        ops[name] = getattr(getattr(torch.ops, f"mla_ab_{name}"), f"mla_decode_{sm}")
    block_h, block_n = CUDA_TILES[args.kernel]
    print(f"built {len(ops)} versions in {time.time() - t0:.0f} s", flush=True)

    copy, mm = copy_bandwidth_GBps(), matmul_TFLOPs()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy {copy:.0f} GB/s, matmul {mm:.0f} TFLOP/s", flush=True)
    first = next(iter(ops))
    rows = []
    for h in heads:
        for b, t in shapes:
            q, caches, table, lens = make_inputs(b, t, h, copies=cache_copies(b, t))
            splits = choose_num_kv_splits(b, h, t, num_sms, block_h=block_h, block_n=block_n,
                                          one_wave=sm == "sm90")
            floor, _ = floor_us(b, t, h, copy, mm)
            row = dict(b=b, t=t, h=h, splits=splits, floor_us=round(floor, 1))
            want = stage1(ops[first], q, caches[0], table, lens, splits, SCALE).float()
            calls = {}
            for name, op in ops.items():
                got = stage1(op, q, caches[0], table, lens, splits, SCALE).float()
                row[f"{name}_diff"] = float((got - want).abs().max() / want.abs().max())
                calls[name] = graphed(lambda cache, op=op: stage1(op, q, cache, table, lens, splits, SCALE), caches)
            best = {}
            for _ in range(args.rounds):
                for name in ops:
                    best[name] = min(best.get(name, float("inf")), bench_us(calls[name]))
            for name in ops:
                row[f"{name}_us"] = round(best[name], 1)
                row[f"{name}_x"] = round(best[name] / floor, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del q, caches, table, lens, calls
            torch.cuda.empty_cache()
    sources = {name: dict(path=path, sha256=hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:16])
               for name, path in versions.items()}
    write_json(args.out, args.out_name or f"h200-decode-{sm}-ab-rows.json",
               dict(device=torch.cuda.get_device_name(0), copy_GBps=copy, matmul_TFLOPs=mm, rounds=args.rounds,
                    kernel=args.kernel, versions=sources, wall_s=round(time.time() - t0), rows=rows))


if __name__ == "__main__":
    main()
