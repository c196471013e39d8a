"""What the decode benchmark's timing adds to a call's kernels: the same call, ours and
FlashMLA's, timed five ways, each for seconds while ``nvidia-smi`` samples the SM clock.

    PYTHONPATH=.peers:. python3 benchmarks/lab/probe_bench_excess.py --shapes 128x8192x128 --s-q 1,2,4 --out DIR

The benchmark times one call in a CUDA graph after a clean L2 (``bench_us``); the kernels of a
call timed under torch.profiler (``probe_clock.py``) take less. This separates what the timing
adds from what the kernels take. The ways, each a window of ``--seconds``:

- ``clean``: the benchmark's own, as ``bench_us`` times it (a 256 MiB read, then the graph);
- ``clean+tlb``: after the clear, one 4-byte read every 64 KiB of the cache (its address
  translations warm, a few hundred KiB of L2 taken);
- ``clean+table``: after the clear, the block table and seq_lens read (in L2 again);
- ``warm``: the graph replayed back to back, no clear (L2 and translations as the last call left
  them);
- ``eager``: the call itself back to back, no graph, no clear (what the profiler's times see).

Each window's median time and mean SM clock give its cycles (time x clock). If the cycles agree
across the ways, the clock is the difference; if ``clean+tlb`` or ``clean+table`` falls toward
``warm``, the cold translations or the cold block table are. Writes ``DIR/bench-excess-probe.json``
(the windows and every clock sample) and prints a table.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.bench_decode import C, cache_copies, decode_call, flashmla_fn, kernel_and_splits, make_inputs
from benchmarks.lab.probe_args import decode_probe_parser, flashmla_and_sms
from benchmarks.lab.probe_clock import SAMPLE_MS, ClockSampler, window_means
from benchmarks.timing import clear_l2, graphed, write_json

WAYS = ("clean", "clean+tlb", "clean+table", "warm", "eager")
TOUCH_STRIDE_BYTES = 64 * 2**10  # the smallest GPU page a large allocation may be mapped with


def touch_every(t: torch.Tensor, stride_bytes: int = TOUCH_STRIDE_BYTES) -> torch.Tensor:
    """A sum over one 4-byte word every ``stride_bytes`` of t's storage (t contiguous): every page
    of t translated once, almost nothing of it brought into L2."""
    words = t.view(-1).view(torch.int32) if t.element_size() * t.numel() % 4 == 0 else t.view(-1)
    return words[:: max(1, stride_bytes // words.element_size())].sum()


def before_call(way: str, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor):
    """The work each way does before its timed call (not timed)."""
    if way in ("warm", "eager"):
        return lambda: None
    if way == "clean":
        return clear_l2
    if way == "clean+tlb":
        return lambda: (clear_l2(), touch_every(cache))
    if way == "clean+table":
        return lambda: (clear_l2(), block_table.sum(), seq_lens.sum())
    raise ValueError(f"before_call: way must be one of {WAYS}, got {way!r}")


def timed_window(call, before, seconds: float, batch: int = 10) -> dict:
    """``call`` timed between two CUDA events, ``before()`` ahead of each, for ``seconds``."""
    call()
    torch.cuda.synchronize()
    start, times = time.time(), []
    while time.time() - start < seconds:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(batch)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(batch)]
        for i in range(batch):
            before()
            starts[i].record()
            call()
            ends[i].record()
        torch.cuda.synchronize()
        times += [1e3 * s.elapsed_time(e) for s, e in zip(starts, ends)]
    return dict(start=start, end=time.time(), time_us=statistics.median(times), measurements=len(times))


def main(argv=None) -> None:
    args = decode_probe_parser(__doc__, [(128, 8192, 128)], seconds=1.5).parse_args(argv)
    flashmla_ok, num_sms = flashmla_and_sms()
    windows = []
    with ClockSampler() as sampler:
        for b, t, h in args.shapes:
            for s_q in args.s_q:
                q, caches, table, lens = make_inputs(b, t, h, s_q=s_q, copies=cache_copies(b, t))
                if len(caches) != 1:
                    raise SystemExit(f"{b}x{t}x{h}: the cache is under 3x L2 and rotates; probe a larger shape")
                kernel, _, splits = kernel_and_splits(q, caches[0], table, lens, C, t, num_sms)
                calls = [("mla", decode_call(q, table, lens, kernel, splits))]
                if flashmla_ok:
                    calls.append(("flashmla", flashmla_fn(q, table, lens)))
                graphs = {name: graphed(fn, caches) for name, fn in calls}
                for way in WAYS:
                    before = before_call(way, caches[0], table, lens)
                    for name, fn in calls:
                        call = (lambda fn=fn: fn(caches[0])) if way == "eager" else graphs[name]
                        w = dict(b=b, t=t, h=h, s_q=s_q, kernel=name, way=way, **timed_window(call, before, args.seconds))
                        windows.append(w)
                        print(f"{b}x{t}x{h} s_q {s_q} {name:8s} {way:12s} {w['time_us']:9.1f} us", flush=True)
                        time.sleep(0.5)
                del q, caches, graphs
    samples = sampler.samples
    print(f"{'b':>4} {'t':>6} {'h':>4} {'s_q':>3} {'kernel':>9} {'way':>12} {'time us':>9} {'MHz':>6} "
          f"{'W':>5} {'Mcycles':>8} {'/ clean':>8}")
    for w in windows:
        w.update(window_means(samples, w["start"], w["end"]))
        w["mcycles"] = w["time_us"] * w["sm_mhz"] / 1e6 if w["sm_mhz"] else None
    for w in windows:
        clean = next(x for x in windows if x["way"] == "clean" and all(x[k] == w[k] for k in ("b", "t", "h", "s_q", "kernel")))
        ratio = w["time_us"] / clean["time_us"]
        mhz = f"{w['sm_mhz']:6.0f}" if w["sm_mhz"] else f"{'-':>6}"
        watts = f"{w['power_w']:5.0f}" if w["power_w"] else f"{'-':>5}"
        cycles = f"{w['mcycles']:8.3f}" if w["mcycles"] else f"{'-':>8}"
        print(f"{w['b']:>4} {w['t']:>6} {w['h']:>4} {w['s_q']:>3} {w['kernel']:>9} {w['way']:>12} {w['time_us']:9.1f} "
              f"{mhz} {watts} {cycles} {ratio:8.3f}")
    write_json(args.out, "bench-excess-probe.json", dict(device=torch.cuda.get_device_name(0), sample_ms=SAMPLE_MS,
                                                         ways=list(WAYS), windows=windows, samples=samples))


if __name__ == "__main__":
    main()
