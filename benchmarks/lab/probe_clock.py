"""The SM clock and board power while mla_decode and FlashMLA are timed as the decode benchmark
times them: whether a gap between the two lies in the clock the GPU holds under each one's load.

    PYTHONPATH=.peers:. python3 benchmarks/lab/probe_clock.py --shapes 128x8192x128 --s-q 1,2,4 --out DIR

It times each call with the benchmark's ``bench_us`` (one call in a CUDA graph after a clean L2,
do_bench's loop) for ``--seconds`` of back-to-back measurements, ours then FlashMLA's then ours
again, while ``nvidia-smi`` samples the SM clock and the power every 20 ms; each window's samples
give its mean clock and power. A stage-1 kernel's cycles do not change with the clock, so if the
clock under ours is lower than under FlashMLA's by about the gap, the gap is the power each
draws, not the schedule. Writes
``DIR/clock-probe.json`` (the windows and every sample) and prints a table. After each shape's
windows, each kernel's time a call under torch.profiler (eager calls, ``probe_decode_ragged``'s
``kernel_times_us``) shows what the call holds besides stage 1: the merge and any copy.
"""

from __future__ import annotations

import csv
import datetime
import io
import statistics
import subprocess
import tempfile
import time

import torch

from benchmarks.bench_decode import C, cache_copies, decode_call, flashmla_fn, kernel_and_splits, make_inputs
from benchmarks.lab.probe_args import decode_probe_parser, flashmla_and_sms
from benchmarks.lab.probe_decode_ragged import kernel_times_us
from benchmarks.timing import bench_us, graphed, write_json

SAMPLE_MS = 20
QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu"


def parse_samples(text: str) -> list[dict]:
    """nvidia-smi's CSV (``--query-gpu=QUERY --format=csv,noheader,nounits``) -> samples with the
    time in seconds since the epoch (local time, as nvidia-smi writes it and time.time() reads)."""
    samples = []
    for fields in csv.reader(io.StringIO(text)):
        if len(fields) != 4:
            continue
        try:
            stamp = datetime.datetime.strptime(fields[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append(dict(t=stamp, sm_mhz=float(fields[1]), power_w=float(fields[2]), temp_c=float(fields[3])))
        except ValueError:  # a line cut short as the sampler stops, or a field nvidia-smi left "[N/A]"
            continue
    return samples


class ClockSampler:
    """``nvidia-smi`` sampling QUERY every SAMPLE_MS into a temporary file (a pipe left unread
    fills after ~30 s and stops the sampler) for the life of the ``with`` block; ``samples`` then
    holds ``parse_samples`` of what it wrote."""

    def __enter__(self):
        self._file = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                       f"--loop-ms={SAMPLE_MS}"], stdout=self._file, text=True)
        self.samples: list[dict] = []
        return self

    def __exit__(self, *exc):
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self._file.seek(0)
        self.samples = parse_samples(self._file.read())
        self._file.close()
        return False


def window_means(samples: list[dict], start: float, end: float) -> dict:
    """The mean clock, power and temperature of the samples in [start, end] (None where none fell there)."""
    inside = [s for s in samples if start <= s["t"] <= end]
    if not inside:
        return dict(samples=0, sm_mhz=None, power_w=None, temp_c=None)
    return dict(samples=len(inside), **{k: statistics.mean(s[k] for s in inside) for k in ("sm_mhz", "power_w", "temp_c")})


def timed_window(name: str, fn, caches, seconds: float) -> dict:
    """bench_us of fn's graph, again and again for ``seconds``: the medians and the wall-clock window."""
    call = graphed(fn, caches)
    start, times = time.time(), []
    while time.time() - start < seconds:
        times.append(bench_us(call))
    return dict(kernel=name, start=start, end=time.time(), time_us=statistics.median(times), measurements=len(times))


def main(argv=None) -> None:
    args = decode_probe_parser(__doc__, [(128, 8192, 128)], seconds=4.0).parse_args(argv)
    flashmla_ok, num_sms = flashmla_and_sms()
    windows, kernels = [], []
    with ClockSampler() as sampler:
        for b, t, h in args.shapes:
            for s_q in args.s_q:
                q, caches, table, lens = make_inputs(b, t, h, s_q=s_q, copies=cache_copies(b, t))
                kernel, _, splits = kernel_and_splits(q, caches[0], table, lens, C, t, num_sms)
                calls = [("mla", decode_call(q, table, lens, kernel, splits))]
                if flashmla_ok:
                    calls.append(("flashmla", flashmla_fn(q, table, lens)))
                calls.append(("mla again", calls[0][1]))
                for name, fn in calls:
                    windows.append(dict(b=b, t=t, h=h, s_q=s_q, **timed_window(name, fn, caches, args.seconds)))
                    time.sleep(1.0)  # the clock recovers between windows
                for name, fn in calls[:-1]:  # each kernel's share of a call: stage 1, the merge, any copy
                    times = kernel_times_us(fn, caches)
                    kernels.append(dict(b=b, t=t, h=h, s_q=s_q, kernel=name, kernels_us=times))
                    for key, us in times.items():
                        print(f"{b}x{t}x{h} s_q {s_q} {name:8s} {us:8.1f} us  {key[:70]}", flush=True)
                del q, caches
    samples = sampler.samples
    print(f"{'b':>4} {'t':>7} {'h':>4} {'s_q':>3} {'kernel':>10} {'time us':>9} {'SM MHz':>7} {'power W':>8} {'temp C':>6}")
    for w in windows:
        w.update(window_means(samples, w["start"], w["end"]))
        mhz, watts, temp = (f"{w[k]:{n}.0f}" if w[k] is not None else f"{'-':>{n}}"
                            for k, n in (("sm_mhz", 7), ("power_w", 8), ("temp_c", 6)))
        print(f"{w['b']:>4} {w['t']:>7} {w['h']:>4} {w['s_q']:>3} {w['kernel']:>10} {w['time_us']:9.1f} {mhz} {watts} {temp}")
    write_json(args.out, "clock-probe.json", dict(device=torch.cuda.get_device_name(0), sample_ms=SAMPLE_MS,
                                                  windows=windows, kernels=kernels, samples=samples))


if __name__ == "__main__":
    main()
