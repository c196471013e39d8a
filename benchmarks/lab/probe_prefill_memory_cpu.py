"""Peak resident memory of one paged-layer prompt call on the CPU, for a before/after of a
change to the prefill path's buffers when no GPU is at hand.

    PYTHONPATH=. python benchmarks/lab/probe_prefill_memory_cpu.py --tokens 4096 --workspace 1024

DeepSeek-V3's head dims (d 128, r 64, v 128, c 512) with `--heads` heads, float32 weights, one
prompt of `--tokens` tokens on an empty cache, prefill="up-project" and the given
`prefill_backend`. The weights, cache and input are made and one short call warms the
allocator first; the figure is the most the process's resident memory grows during one call
(sampled from /proc/self/statm every millisecond by a thread: torch's kernels release the GIL),
so it counts every buffer the call holds at its peak, as the GPU bench's `*_peak_mib` does.
Prints one JSON line.
"""

import argparse
import json
import os
import threading

import torch

import mla


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_growth(fn) -> tuple[int, object]:
    """The most resident memory grows above where it starts while fn() runs, and fn's result."""
    start, peak, done = resident_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes())
            done.wait(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], resident_bytes()) - start, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--workspace", type=int, default=16384)
    parser.add_argument("--backend", default="sdpa")
    args = parser.parse_args()
    torch.set_num_threads(2)
    cfg = mla.MLAConfig.from_preset("deepseek-v3").replace(num_heads=args.heads)
    weights = mla.MLAWeights(cfg, dtype=torch.float32, seed=0)
    layer = mla.build(weights, "paged", block_size=64, prefill="up-project",
                      workspace_tokens=args.workspace, prefill_backend=args.backend)
    x = torch.randn(1, args.tokens, cfg.hidden_size)
    with torch.no_grad():
        layer(torch.randn(1, 64, cfg.hidden_size), layer.new_cache(1, 64), [64])  # warm
        cache = layer.new_cache(1, args.tokens)
        grown, y = peak_growth(lambda: layer(x, cache, [args.tokens]))
    print(json.dumps(dict(tokens=args.tokens, heads=args.heads, workspace=args.workspace,
                          backend=args.backend, peak_growth_mib=grown / 2**20,
                          finite=bool(torch.isfinite(y).all()))))


if __name__ == "__main__":
    main()
