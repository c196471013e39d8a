"""How every benchmark here times the GPU, in one place.

- ``clear_l2``: fill L2 with lines of a 256 MiB buffer before a timed call, read (clean lines,
  the default) or zeroed (dirty lines, as ``triton.testing.do_bench`` leaves it).
- ``bench_us``: the median of do_bench's loop, L2 cleared before every timed call.
- ``graphed`` / ``steady_us``: a call captured in a CUDA graph, replayed alone (the kernels of
  one call, plus the graph's own launch) or back to back in one graph (a call's share of a
  longer captured step).
- ``mean_us``: the mean of back-to-back calls between two CUDA events (a whole eager step).
- ``copy_bandwidth_GBps`` and ``matmul_TFLOPs``: the GPU's ceilings, measured in the same run
  as the figures they bound.

Importing this module touches no GPU.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics

import torch

L2_CLEAR_BYTES = 256 * 2**20  # what do_bench clears with: 5x the H200's 50 MiB of L2
_l2_buffers: dict = {}


def clear_l2(mode="clean", device=None):
    """Fill L2 with lines of a 256 MiB buffer, so a timed call finds none of its own data there.

    ``clean`` reads the buffer (a float32 sum into a float32 scalar: a memset of the reduction's
    semaphores and one reduction kernel, no cast copy): L2 is left holding clean lines, which a
    call's misses evict for free. ``dirty`` zeroes it, as ``triton.testing.do_bench`` does: L2 is
    left holding dirty lines, and a call's misses first write them back, DRAM writes that are
    not the call's own. A decode kernel only reads and its floor counts only its reads, so its
    times are taken clean.
    """
    if mode not in ("clean", "dirty"):
        raise ValueError(f"clear_l2: mode must be 'clean' or 'dirty', got {mode!r}")
    device = torch.device("cuda" if device is None else device)
    if device not in _l2_buffers:
        buffer = torch.zeros(L2_CLEAR_BYTES // 4, dtype=torch.float32, device=device)
        _l2_buffers[device] = (buffer, torch.empty((), dtype=torch.float32, device=device))
    buffer, total = _l2_buffers[device]
    if mode == "dirty":
        buffer.zero_()
    else:
        torch.sum(buffer, dim=0, out=total)  # same dtype in and out: no promoted copy of the buffer


def bench_us(fn, *, warmup_ms=25, rep_ms=100, l2="clean") -> float:
    """Median time of fn() in microseconds, L2 cleared (``clear_l2(l2)``) before each call.

    The loop is do_bench's: the number of calls from a first estimate, warm-up calls without a
    clear, then each timed call between two CUDA events with the clear before the first event.
    ``l2="dirty"`` is ``triton.testing.do_bench`` itself.
    """
    if l2 == "dirty":
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    fn()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(5):
        clear_l2(l2)
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(begin.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    reps = max(1, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        clear_l2(l2)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def mean_us(fn, iters: int, warmup: int = 3) -> float:
    """Mean of ``iters`` back-to-back calls between two CUDA events, in microseconds: a whole
    step as a serving loop runs it, launches and host work included, L2 left as it is."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


def rotation_copies(nbytes: int, most: int = 8) -> int:
    """How many copies of an input of ``nbytes`` a call should rotate through so that the copies
    total >= 3x L2: a replay then finds none of its input there even without a clear."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)  # H200: 50 MiB
    return max(1, min(most, math.ceil(3 * l2 / nbytes)))


def rotating(fn, inputs):
    """fn(input) over the inputs in turn."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(inputs)
        return fn(inputs[state["i"]])

    return call


def _warm_up(fn, inputs):
    """fn(input) once an input on a side stream, so compiling and first allocations stay out of
    a capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for item in inputs:
            fn(item)
    torch.cuda.current_stream().wait_stream(side)


def graphed(fn, inputs):
    """fn(input) for each input captured in a CUDA graph; returns a call that replays them in turn.

    Replays time the kernels alone: no Python, no launch gaps between a call's kernels, as in a
    serving loop that captures its decode step. A graph of one call also pays the graph's own
    launch, ~4-5 us on an H200 (``graph_overhead_us``).
    """
    _warm_up(fn, inputs)
    graphs = []
    for item in inputs:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(item)
        graphs.append(graph)
    return rotating(lambda graph: graph.replay(), graphs)


def graph_overhead_us() -> float:
    """The time of a graph of one 1-element kernel: what ``graphed`` adds to every call."""
    tiny = torch.zeros(1, device="cuda")
    return bench_us(graphed(lambda t: t.add_(1), [tiny]))


def steady_us(fn, inputs, min_calls=8) -> float:
    """Time a call takes within ONE CUDA graph of >= min_calls back-to-back calls, the inputs in
    turn: a call's share of a captured step of many layers, which pays the graph's launch once."""
    calls = len(inputs) * math.ceil(min_calls / len(inputs))
    _warm_up(fn, inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(inputs[i % len(inputs)])
    return bench_us(graph.replay) / calls


def copy_us(nbytes: int) -> float:
    """A device-to-device copy of nbytes (nbytes read, nbytes written), L2 cleared first."""
    src = torch.empty(max(1, nbytes // 2), dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return us


def copy_bandwidth_GBps(nbytes=2 * 2**30) -> float:
    """Device-to-device copy, bytes read + bytes written per second."""
    return 2 * nbytes / (copy_us(nbytes) * 1e-6) / 1e9


def matmul_TFLOPs(n=8192) -> float:
    """The bf16 matmul rate on n x n x n, random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    us = bench_us(lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / (us * 1e-6) / 1e12


def device_prefix(device_name: str) -> str:
    """The prefix of a result file's name: ``h200`` on an H200, else the device's name in lower
    case with dashes (``cpu``, ``nvidia-a100-sxm4-80gb``)."""
    if "H200" in device_name:
        return "h200"
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def write_json(out_dir, name, result) -> str:
    """Write ``result`` to ``out_dir/name`` (folders made as needed); returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return path
