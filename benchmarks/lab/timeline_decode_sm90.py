"""Where each warpgroup of the wgmma decode stage 1 spends its cycles: per-CTA counters, on the GPU.

    PYTHONPATH=. python3 benchmarks/lab/timeline_decode_sm90.py --out benchmarks/lab/results   # ~1.5 min, JIT build included
    (cd .ab/NAME && TORCH_EXTENSIONS_DIR=/tmp/ext-NAME PYTHONPATH=. python3 benchmarks/lab/timeline_decode_sm90.py \
        --kv-cache-dtype fp8_ds_mla --out DIR --out-name NAME-timeline.json)   # a candidate's kernel, in its copy

Builds a copy of ``csrc/mla_decode_sm90.cu`` with counters added (the source is edited as text
here, so the package's kernel stays as it is; an edit that no longer applies fails loudly), as
``timeline_decode_cuda.py`` does for the sm_80 kernel, and runs it after L2 is cleared by a
read (NOTES row 44). Thread 0 of every CTA records ``%globaltimer`` and ``clock64`` at five
points: start; q landed (the prologue: q and the first two tiles' copies issued, q waited for);
warpgroup 0's first S done; the pair loop done; the output written. The first thread of
each warpgroup (0 and 128; ``--warps`` below) sums, over the pair loop, the cycles it spends:

- ``issue``: issuing the copies of the next tiles (the ``load_blocks`` calls in the loop: the
  first thread of each warpgroup reads the block table and asks the TMA unit for them);
- ``load_wait``: waiting on a block group's mbarrier before its ``wgmma`` for S (the copy not landed);
- ``wg_wait``: at a named barrier, waiting for the other warpgroup (its max, its P);
- ``mma_wait``: in ``wgmma.wait_group``, waiting for its own MMAs;
- ``convert``: on an fp8 cache (``--kv-cache-dtype``), in ``finish_blocks``: waiting for a block
  group's raw bytes to land, turning them into the products' dtype, the warpgroup's barriers and
  the mbarrier's arrival (nothing on a bf16 cache);
- ``raw_wait``: the part of ``convert`` spent waiting for the raw bytes (the mbarrier of the
  group's TMA copies), so that ``convert - raw_wait`` is the conversion and its barriers;
- inside ``convert`` too: ``vote``, ``fp8_ds_mla``'s barrier that votes on the tile's F (and
  keeps its scales read before block 0's output covers them), and ``conv_bar``, the group's two
  other warpgroup barriers (behind the reads of the stored bytes; the fence and the barrier
  before the release), so that ``convert - raw_wait - vote - conv_bar`` is the conversion: its
  reads, instructions and writes, the scales' handling and the arrival (and where F is not 0,
  the rare path's shuffles and barrier);

and ``other`` is the rest of the loop (the nested parts, ``raw_wait`` to ``conv_bar``, are not
subtracted twice): the softmax, fragments, stores of P and the issue of the MMAs. The
clock reads add a few cycles each, and registers (the instrumented copy takes more than the
kernel's own).
Thread 0 also sums, over the CTA's segments (one where the kernel cuts per sequence; dealt,
each sequence its piece holds a part of), the cycles from a segment's start to q landed
(``seg_prologue``), to the first S (``seg_first_s``), the pair loop (``seg_loop``) and the
output (``seg_output``), and counts the segments: medians and largest over the CTAs. The
warpgroups' parts are summed over the segments' pair loops too, and ``*_per_tile`` divides
them by the CTA's tiles (a dealt piece's, ``tiles_per_cta``); stamps 1-3 are the last
segment's, while stamp 0 is the CTA's start, so ``prologue_us`` (stamps 0 to 1) spans a dealt
piece's earlier segments as well (``seg_prologue_us`` is the prologues alone). Every row runs
dealt, as ``mla_decode`` launches the kernel; a CTA that returns early (a piece with no pair left) is left out. ``--cases`` adds batches of
``probe_decode_ragged.cases()`` (e.g. ``--no-shapes --cases "64 x 8192 (uniform);64: 4096, 62 x
8192, 12288"``: the same pairs a piece in one segment and in two). ``--s-q 1,2`` runs each shape
and case with one and two new tokens a sequence (the s_q x h query rows in the 64-row tiles, as
``mla_decode`` packs them); ``--shapes 64x4096x128,...`` replaces SHAPES; ``--pieces 0,66`` runs
each at the pieces ``mla_decode`` deals over and at 66 (a second segment in some CTAs).
The first thread of warp 0 of each warpgroup records its parts by default (the one that issues
the copies); ``--warps 0,3`` adds a row recorded by warp 3's, whose barrier waits show how long
the other warps wait for the issuing one. Medians over CTAs, then over 5 repetitions;
``*_per_tile`` divides a warpgroup's loop by the CTA's tiles (cycles). ``hb_*`` say how far apart
the CTAs of one piece (its head blocks, which read the same tiles) start and end their loops,
over every piece and over the later waves' (``head_block_spread``).

Writes the rows of one run to ``--out-name`` (``h200-decode-sm90-timeline-rows.json``). The
committed ``h200-decode-sm90-timeline.json`` (NOTES rows 46-48) gathers four runs by hand under
``runs``: the cp.async kernel before TMA, the TMA kernel, a variant not kept, and the kernel of
rows 47-48 (one TMA copy a block group).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import re
import statistics
import tempfile
import time

import torch

from benchmarks.lab.timeline_decode_cuda import stamp_code, stamped_runs

ROOT = pathlib.Path(__file__).resolve().parents[2]
# (b, t, h): 128 heads at four of the benchmark's shapes, the splits mla_decode picks
SHAPES = ((1, 32768, 128), (64, 4096, 128), (2, 65536, 128), (4, 131072, 128))
PARTS = ("issue", "load_wait", "wg_wait", "mma_wait", "convert", "raw_wait", "vote", "conv_bar")
NESTED = ("raw_wait", "vote", "conv_bar")  # counted inside others: not subtracted for "other"
PER_WG = len(PARTS) + 1  # a warpgroup's slots: its part sums, then its loop's cycles
# thread 0's sums over a CTA's segments (one, cut per sequence; dealt, those of its piece), cycles:
# the segment's start to q landed (its prologue), to the first S, the pair loop, the output; then
# three slots of scratch (the current segment's start, q landed, loop end), kept in the buffer
# rather than in registers, which the kernel has none to spare for
SEGMENT_PARTS = ("segments", "seg_prologue", "seg_first_s", "seg_loop", "seg_output")
SEGMENTS_AT = 11 + 2 * PER_WG
SLOTS = SEGMENTS_AT + len(SEGMENT_PARTS) + 3  # 5 x (globaltimer, clock64), SM id, each warpgroup's, the segments'


def instrumented_source(src: str | None = None) -> str:
    """The kernel's source (``src``, by default csrc/mla_decode_sm90.cu's) with the counters."""
    if src is None:
        src = (ROOT / "csrc" / "mla_decode_sm90.cu").read_text()

    def edit(old, new, count=1):
        nonlocal src
        assert src.count(old) == count, f"the kernel changed; this edit no longer applies:\n{old}"
        src = src.replace(old, new)

    def timed(call, part):
        return f"{{ const long long c_ = clock64(); {call}; acc[{part}] += clock64() - c_; }}"

    edit('#include "mla_decode.h"\n', '#include <torch/extension.h>\n#include "mla_decode.h"\n')
    edit("const float* __restrict__ kv_scale) {",
         "const float* __restrict__ kv_scale, long long* timing, int timing_warp) {")
    anchor = "  const int h0 = blockIdx.x * kM;          // the CTA's first query row\n"
    edit(anchor, anchor + """  const int64_t cta = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
""" + stamp_code(SLOTS) + f"""  long long acc[{len(PARTS)}] = {{}};
  long long* const seg = timing + cta * {SLOTS} + {SEGMENTS_AT};  // the segments' sums, then the scratch
  if (tid == 0) {{
    for (int k = 0; k < {len(SEGMENT_PARTS)}; ++k) seg[k] = 0;
  }}
  if (wtid == 32 * timing_warp) {{  // the recording thread's sums over the segments' pair loops
    for (int k = 0; k < {PER_WG}; ++k) timing[cta * {SLOTS} + 11 + {PER_WG} * wg + k] = 0;
  }}
""")
    raw, vote, conv_bar = (PARTS.index(name) for name in NESTED)
    n_seg = len(SEGMENT_PARTS)  # the scratch slots follow the sums
    # an fp8 group's wait for its raw bytes, its scales' vote and its barriers, inside
    # finish_fp8_blocks: the caller's acc
    src, n_fn = re.subn(r"(__device__ __forceinline__ \w+ finish_fp8_blocks\([^)]*)\)",
                        r"\1, long long& raw_wait, long long& vote, long long& conv_bar)", src)
    src, n_call = re.subn(r"(finish_fp8_blocks<MT, F, j0[^>]*>\([^;]*)\);",
                          rf"\1, acc[{raw}], acc[{vote}], acc[{conv_bar}]);", src)
    assert n_fn == 1 and n_call == 1, (n_fn, n_call)
    edit("  mbar_wait(raw, parity);", "  { const long long c_ = clock64(); mbar_wait(raw, parity); raw_wait += clock64() - c_; }")
    # fp8_ds_mla's vote on F (a warpgroup barrier that reduces each thread's test; a kernel with no
    # vote, such as probe-noscale's, has none to count)
    src, n_vote = re.subn(r"if \(!sync_warpgroup_any\(wg, !in_range\)\) \{",
                          "const long long cv_ = clock64(); const bool any_ = sync_warpgroup_any(wg, !in_range); "
                          "vote += clock64() - cv_; if (!any_) {", src)
    assert n_vote <= 1, n_vote
    # the group's two barriers: behind every read of the stored bytes, and after the fence before
    # its release (both warpgroup-wide; the rest of convert is the conversion, its reads and writes)
    edit("  sync_warpgroup(wg);  // every stored byte read before the outputs below cover them\n",
         "  { const long long c_ = clock64(); sync_warpgroup(wg); conv_bar += clock64() - c_; }\n")
    src, n_fence = re.subn(r"(\n  fence_async_shared\(\);  // the converted blocks[^\n]*\n  sync_warpgroup\(wg\);)([^\n]*\n)",
                           r"\n  { const long long c_ = clock64();\1 conv_bar += clock64() - c_; }\2", src)
    assert n_fence == 1, n_fence
    # the wait for a group's blocks before its S
    src, n_bar = re.subn(r"(mbar_wait\(bar\(buf, j\), parity\));", lambda m: timed(m[1], 1), src)
    assert n_bar == 1, n_bar
    # the prologue's copies and waits do not count: the sums restart at the loop
    # (the kernel's body sits in a loop over segments where it deals pieces: any indentation)
    src, n_ready = re.subn(r"\n( +)__syncthreads\(\); +// \.\.\. everyone's\n", r"\g<0>\1stamp(1);\n"
                           rf"\1if (tid == 0) seg[{n_seg + 1}] = clock64();\n", src)
    assert n_ready == 1, n_ready
    src, n_begin = re.subn(r"\n( +)for \(;;\) \{\n( +)begin_segment\(\);\n",
                           rf"\n\1for (;;) {{\n\2if (tid == 0) seg[{n_seg}] = clock64();\n\2begin_segment();\n", src)
    assert n_begin == 1, n_begin
    src, n_done = re.subn(r"\n( +)(// ---- on to the piece's next segment[^\n]*)\n", rf"""
\1if (tid == 0) {{
\1  seg[0] += 1;
\1  seg[1] += seg[{n_seg + 1}] - seg[{n_seg}];
\1  seg[2] += c_loop - seg[{n_seg + 1}];
\1  seg[3] += seg[{n_seg + 2}] - c_loop;
\1  seg[4] += clock64() - seg[{n_seg + 2}];
\1}}
\1\2
""", src)
    assert n_done == 1, n_done
    loop_at = re.search(r"\n +for \(int p = 0; p < n_pairs; \+\+p\) \{", src).start() + 1
    head, loop = src[:loop_at], src[loop_at:]
    end_at = re.search(r"\n +// ---- normalise and write", loop).start() + 1
    body, tail = loop[:end_at], loop[end_at:]
    body, n_sync = re.subn(r"bar_sync\((kBar\w+)\);", lambda m: timed(f"bar_sync({m[1]})", 2), body)
    body, n_wait = re.subn(r"wgmma_wait<(\d)>\(\);", lambda m: timed(f"wgmma_wait<{m[1]}>()", 3), body)
    body, n_load = re.subn(r"load_blocks\(([^;]*)\);", lambda m: timed(f"load_blocks({m[1]})", 0), body)
    body, n_finish = re.subn(r"finish_blocks\(([^;]*)\);", lambda m: timed(f"finish_blocks({m[1]})", 4), body)
    assert n_sync == 4 and n_wait == 6 and n_load == 4 and n_finish == 4, (n_sync, n_wait, n_load, n_finish)
    head = head.rstrip("\n") + f"""
  if (tid == 0) stamp(2);
  const long long c_loop = clock64();
  for (int k = 0; k < {len(PARTS)}; ++k) acc[k] = 0;
"""
    tail = f"""  if (wtid == 32 * timing_warp) {{  // summed over the segments: each restarts acc at its loop
    for (int k = 0; k < {len(PARTS)}; ++k) timing[cta * {SLOTS} + 11 + {PER_WG} * wg + k] += acc[k];
    timing[cta * {SLOTS} + 11 + {PER_WG} * wg + {len(PARTS)}] += clock64() - c_loop;
  }}
  stamp(3);
  if (tid == 0) seg[{n_seg + 2}] = clock64();
""" + tail
    src = head + body + tail
    edit("#else\n  __trap();", "  __syncthreads();\n  stamp(4);\n#else\n  __trap();")
    src, n_check = re.subn(
        r"const CacheFormat format =\s*check_mla_decode\([^;]*\);",
        "const CacheFormat format = kv_cache_dtype == \"fp8_e4m3\" ? CacheFormat::kFp8E4M3\n"
        "                             : kv_cache_dtype == \"fp8_ds_mla\" ? CacheFormat::kFp8DsMla : CacheFormat::kAuto;",
        src)
    assert n_check == 1, n_check
    # the counters right after q_tokens, before any later (optional) arguments: see launch_args
    src, n_args = re.subn(r"(const std::optional<at::Tensor>& kv_scale, int64_t q_tokens)([,)])",
                          r"\1, at::Tensor& timing, int64_t timing_warp\2", src)
    assert n_args == 1, n_args
    # the launch's last argument (a kernel<<<...>>>(...) call, or cudaLaunchKernelEx(...) inside a check)
    src, n_launch = re.subn(r"scale_ptr(\)+;)",
                            r"scale_ptr, (long long*)timing.data_ptr<int64_t>(), int(timing_warp)\1", src)
    assert n_launch == 1, n_launch
    src = src[: src.index("TORCH_LIBRARY_IMPL")]
    src = src.replace("namespace {\n", "", 1).replace("}  // namespace\n\n", "", 1)
    return src + 'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &mla::mla_decode_sm90); }\n'


def build():
    from torch.utils.cpp_extension import load

    source = instrumented_source()
    # one folder a source, so a second run on the same machine reuses the build
    folder = pathlib.Path(tempfile.gettempdir()) / f"mla_timeline_sm90_{hashlib.sha1(source.encode()).hexdigest()[:12]}"
    folder.mkdir(exist_ok=True)
    if not (folder / "timeline.cu").exists():  # rewritten, its new mtime would make ninja build again
        (folder / "timeline.cu").write_text(source)
    return load(name="mla_decode_timeline_sm90", sources=[str(folder / "timeline.cu")], build_directory=str(folder),
                extra_include_paths=[str(ROOT / "csrc")],
                extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"])


def head_block_spread(timing: torch.Tensor, head_blocks: int, late_us: float = 2.0) -> dict:
    """How far apart the CTAs of one piece start, and end their (last segment's) pair loop: the
    timing rows as the kernel wrote them (row (z x gridDim.y + y) x head_blocks + x; a dealt
    launch has one y, so a piece's head blocks are consecutive rows), columns 0 and 6 the CTA's
    start and the loop end as globaltimer ns (ticks of 0.256 us on the H100 and H200). For each
    piece whose head blocks all reached their last stamp: the last start less the first, and
    the same for the loop ends (us). Medians and largest over every piece, and over the
    ``late`` pieces, those whose first CTA started ``late_us`` or more after the launch's first
    (the later waves, where a piece's CTAs start as SMs come free rather than together; a piece
    that straddles the first wave's end counts with the first wave and likely carries the
    largest spread). The CTAs of a piece read the same tiles: apart, a tile's later readers may
    find it in L2 instead of sharing the first one's request (NOTES row 125)."""
    x = timing.cpu()
    pieces = x.shape[0] // head_blocks
    x = x[:pieces * head_blocks].reshape(pieces, head_blocks, -1)
    whole = (x[:, :, 8] != 0).all(dim=1)
    # relative to the first start while still int64: the timer counts ns since 1970 (~1.8e18),
    # where a double's step is 256 ns, and 0.25 us once in us
    base = x[whole][:, :, 0].min() if whole.any() else 0
    start = (x[whole][:, :, 0] - base).double() / 1e3  # us after the launch's first CTA
    loop_end = (x[whole][:, :, 6] - base).double() / 1e3
    late = start.min(dim=1).values >= late_us
    out = {}
    for name, stamps in (("start", start), ("loop_end", loop_end)):
        spread = stamps.max(dim=1).values - stamps.min(dim=1).values
        for which, sel in (("", slice(None)), ("_late", late)):
            v = spread[sel]
            out[f"hb_{name}_spread{which}_us"] = v.median().item() if v.numel() else None
            out[f"hb_{name}_spread{which}_max_us"] = v.max().item() if v.numel() else None
    out["hb_late_pieces"] = int(late.sum())
    return out


def one_shape(mod, b, t, h, repeats=5, clear="clean", kv_cache_dtype="auto", warp=0, lengths=None, s_q=1,
              pieces=0):
    """One row: b sequences of t tokens, or of ``lengths`` (b = len(lengths), t = the longest), the
    batch's tiles dealt over b x splits pieces as mla_decode launches them; with s_q new tokens a
    sequence, its s_q x h query rows token-major in the kernel's 64-row tiles; ``pieces`` > 0 deals
    the tiles over that many pieces instead."""
    from benchmarks.bench_decode import SCALE, kernel_and_splits, make_inputs, write_fp8_caches
    from benchmarks.lab.probe_decode_ragged import tile_pairs
    from mla.kernels.constants import MAX_GRID_YZ

    lengths = [t] * b if lengths is None else lengths
    q, caches, table, _ = make_inputs(b, t, h, s_q=s_q)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    scale = None
    if kv_cache_dtype != "auto":  # the same rows in the fp8 layout (bench_decode's fp8 rows)
        caches, scale = write_fp8_caches(kv_cache_dtype, caches, 1)
    cache = caches[0]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    _, _, splits = kernel_and_splits(q, cache, table, lens, 512, t, num_sms, kv_cache_dtype=kv_cache_dtype)
    rows = s_q * h
    q = q.reshape(b, rows, q.shape[-1])  # (b, s_q·h, c + r), row = token x h + head
    # b x splits pieces of `per` pairs; a slot a (sequence, piece) after the b sequences' own
    pieces = pieces or min(b * splits, MAX_GRID_YZ)
    tiles = 2 * math.ceil(sum(tile_pairs(lengths)) / pieces)
    part_out = torch.empty((b + pieces - 1, rows, 512), dtype=torch.float32, device="cuda")
    part_lse = torch.empty((b + pieces - 1, rows), dtype=torch.float32, device="cuda")
    out = torch.empty((b, rows, 512), dtype=q.dtype, device="cuda")
    lse = torch.empty((b, rows), dtype=torch.float32, device="cuda")
    ranges = torch.empty((b, 2), dtype=torch.int32, device="cuda")
    ctas = math.ceil(rows / 64) * pieces
    timing = torch.zeros((ctas, SLOTS), dtype=torch.int64, device="cuda")

    def launch():
        mod.run(q, cache, table, lens, part_out, part_lse, float(SCALE), pieces, kv_cache_dtype, scale, s_q, timing, warp,
                out, lse, ranges)

    runs = []
    for x, start, end, ghz, us in stamped_runs(launch, timing, clear, repeats):
        run = dict(span_us=end.max().item(), start_max_us=start.max().item(), end_median_us=end.median().item(),
                   prologue_us=us(0, 1).median().item(), first_s_us=us(1, 2).median().item(),
                   loop_us=us(2, 3).median().item(), epilogue_us=us(3, 4).median().item(), ghz=ghz,
                   sms=len(set(x[:, 10].tolist())), **head_block_spread(timing, math.ceil(rows / 64)))
        seg = x[:, SEGMENTS_AT:SEGMENTS_AT + len(SEGMENT_PARTS)].double()
        run["segments_median"], run["segments_max"] = seg[:, 0].median().item(), seg[:, 0].max().item()
        for k, name in enumerate(SEGMENT_PARTS[1:], 1):  # a CTA's sum over its segments
            run[f"{name}_us"] = (seg[:, k] / ghz / 1e3).median().item()
            run[f"{name}_max_us"] = (seg[:, k] / ghz / 1e3).max().item()
        for wg in (0, 1):
            loop = x[:, 11 + PER_WG * wg + len(PARTS)].double()
            parts = {name: x[:, 11 + PER_WG * wg + k].double() for k, name in enumerate(PARTS)}
            parts["other"] = loop - sum(v for name, v in parts.items() if name not in NESTED)
            run[f"wg{wg}_loop_cycles"] = loop.median().item()
            for name, v in parts.items():
                run[f"wg{wg}_{name}_cycles"] = v.median().item()
        runs.append(run)
    row = {k: statistics.median(r[k] for r in runs if r[k] is not None) if any(r[k] is not None for r in runs)
           else None for k in runs[0]}
    per_tile = {f"{k[:-7]}_per_tile": row[k] / tiles for k in row if k.endswith("_cycles")}
    return dict(b=b, t=t, h=h, s_q=s_q, kv_cache_dtype=kv_cache_dtype, warp=warp, splits=splits, pieces=pieces,
                tiles_per_cta=tiles, **row, **per_tile)


def main(argv=None):
    from benchmarks.bench_decode import parse_kv_cache_dtypes, parse_query_lengths, parse_shapes
    from benchmarks.timing import write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/lab/results")
    parser.add_argument("--out-name", default="h200-decode-sm90-timeline-rows.json")
    parser.add_argument("--kv-cache-dtype", dest="layouts", type=parse_kv_cache_dtypes, default=["auto"],
                        help="cache layouts, comma-separated: auto (bf16), fp8_e4m3, fp8_ds_mla (default auto)")
    parser.add_argument("--warps", type=lambda v: [int(w) for w in v.split(",")], default=[0],
                        help="which warp of each warpgroup (0-3) records its parts, comma-separated: one row "
                             "a warp (default 0, the warp whose first thread issues the copies)")
    parser.add_argument("--cases", type=lambda v: v.split(";"), default=[],
                        help="batches of probe_decode_ragged.cases() to run dealt after the shapes, ';'-separated "
                             "names (e.g. '64 x 8192 (uniform);64: 4096, 62 x 8192, 12288')")
    parser.add_argument("--no-shapes", action="store_true", help="the --cases only, not SHAPES")
    parser.add_argument("--shapes", type=parse_shapes, default=list(SHAPES), help="BxTxH,... instead of SHAPES")
    parser.add_argument("--s-q", type=parse_query_lengths, default=[1],
                        help="new tokens a sequence, comma-separated: each shape and case at each (default 1)")
    parser.add_argument("--pieces", type=lambda v: [int(n) for n in v.split(",")], default=[0],
                        help="pieces the tiles are dealt over, comma-separated: each shape and case at each "
                             "(default 0: b x the split count mla_decode plans)")
    args = parser.parse_args(argv)
    from benchmarks.lab.probe_decode_ragged import cases

    unknown = [name for name in args.cases if name not in cases()]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known: {list(cases())}")
    if any(not 0 <= w < 4 for w in args.warps):
        parser.error(f"--warps: each warp is 0-3, got {args.warps}")
    t0 = time.time()
    mod = build()
    print(f"built in {time.time() - t0:.0f} s", flush=True)
    from mla.kernels.extension import load_extension

    load_extension()  # the package's own build, which bench_decode's helpers use (minutes if not cached)
    print(f"the package's extension loaded at {time.time() - t0:.0f} s", flush=True)
    rows = []
    every = [(s_q, pieces, w) for s_q in args.s_q for pieces in args.pieces for w in args.warps]
    runs = [(kind, shape, None, *more) for kind in args.layouts
            for shape in ([] if args.no_shapes else args.shapes) for more in every]
    runs += [(kind, (len(cases()[name]), max(cases()[name]), 128), name, *more) for kind in args.layouts
             for name in args.cases for more in every]
    for kind, (b, t, h), name, s_q, pieces, warp in runs:
        rows.append(one_shape(mod, b, t, h, kv_cache_dtype=kind, warp=warp,
                              lengths=None if name is None else cases()[name], s_q=s_q, pieces=pieces))
        if name is not None:
            rows[-1]["case"] = name
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
        # written after every row, so a run cut short keeps the rows it has
        write_json(args.out, args.out_name, dict(device=torch.cuda.get_device_name(0), clear="clean", rows=rows))


if __name__ == "__main__":
    main()
