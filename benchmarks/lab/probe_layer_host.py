"""What one paged-layer prompt costs the host: wall time and operator count on tiny sizes, beside
the layer written in a few lines of torch (projections, SDPA, o_proj; no cache).

    PYTHONPATH=. python benchmarks/lab/probe_layer_host.py                 # the CPU
    PYTHONPATH=. python3 benchmarks/lab/probe_layer_host.py --device cuda  # a GPU

At 1k-4k tokens the layer's GPU time is its host time (``host_ms`` in
``benchmarks/results/h200-prefill.json``: 3.3 of 3.6 ms at 1 x 1024), so what the host does per
call decides the prompt rows. Here the sizes are DeepSeek-V3's structure shrunk until the
arithmetic costs nothing (hidden 64, 2 heads, c 32, d 16, r 8, v 16), float32, so a call's wall
time is the host's: Python, torch's dispatch of every operator, and on a GPU the launches. Keep
the prompts short on the CPU, where SDPA's own arithmetic grows with them.

Contenders, each on prompts of `--shapes` (b x s, an empty cache):
- ``layer``: the paged tier's call, ``prefill="up-project"`` and ``prefill_backend="sdpa"`` (a
  GPU's default for long prompts; on the CPU the Triton kernels would run in their interpreter
  and time that instead), so short prompts take the same path as long ones;
- ``torch_layer``: the same weights in a few lines of torch (``bench_prefill.torch_layer``, the
  prefill bench's contender of that name): the query and latent as the paged tier computes
  them, k and v up-projected, one SDPA call, o_proj. No cache, no plan: the issue's "torch SDPA
  on up-projected k, v" whole-layer baseline.

Each gets ``us`` (median wall time of a call, ``--calls`` calls after warm-up; on a GPU with a
synchronize after each), ``ops`` and ``compute_ops`` (aten operators one call dispatches, and
those that are not views or metadata: on a GPU the ones that launch a kernel or copy), and for
the layer ``sections_us``: the median time of the plan, RoPE's cos / sin, the cache write and the
attention. With ``--attention`` the layer is timed again on each listed attention, its whole
call and its attention section (``by_attention``): "sdpa" (SDPA's GPU backends in the layer's
order, cuDNN first), "efficient" (SDPA's memory-efficient backend alone), "triton" (the flash
prefill kernel; on the CPU its interpreter, so time it on a GPU). Prints one line a row and
writes ``--out`` (JSON).

    PYTHONPATH=. python3 benchmarks/lab/probe_layer_host.py --device cuda --attention sdpa,efficient,triton
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode

import mla
import mla.kernels.sdpa as sdpa_module
import mla.paged.layer as paged_layer
from benchmarks.bench_prefill import torch_layer

ATTENTIONS = ("sdpa", "efficient", "triton")

# aten operators that make no kernel: views, metadata, host scalars.
NOT_COMPUTE = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "permute",
               "transpose", "t", "expand", "alias", "as_strided", "lift_fresh", "detach",
               "_local_scalar_dense", "promote_types", "unflatten", "split", "unbind"}


class CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched while active, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def compute(self) -> int:
        return sum(n for name, n in self.counts.items() if name not in NOT_COMPUTE)


def wall_us(fn, calls: int, sync) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def sections(layer, call, calls: int, sync) -> dict:
    """Median host time of the layer's plan, RoPE tables, cache write and attention in a call."""
    spent = collections.defaultdict(list)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name].append(time.perf_counter() - start)
            return out
        return wrapper

    saved = {name: getattr(paged_layer, name) for name in ("rope_cos_sin", "write_slots")}
    layer._plan = timed("plan", layer._plan)
    layer.attend_prefill = timed("attend", layer.attend_prefill)
    for name, fn in saved.items():
        setattr(paged_layer, name, timed(name, fn))
    try:
        for _ in range(calls):
            call()
            sync()
    finally:
        del layer._plan, layer.attend_prefill
        for name, fn in saved.items():
            setattr(paged_layer, name, fn)
    return {name: 1e6 * statistics.median(ts) for name, ts in spent.items()}


def by_attention(weights, attention: str, x: torch.Tensor, calls: int, sync) -> dict:
    """The layer's whole call and its attention section on one of ``ATTENTIONS``."""
    layer = mla.build(weights, "paged", block_size=64, prefill="up-project",
                      prefill_backend="triton" if attention == "triton" else "sdpa")
    b, s = x.shape[:2]
    cache = layer.new_cache(b, s)
    cache.allocate(torch.arange(b), torch.full((b,), s))

    def call():
        cache.seq_lens[:] = 0
        return layer(x, cache)

    saved = sdpa_module._SDPA_CUDA_BACKENDS
    if attention == "efficient":
        sdpa_module._SDPA_CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION]
    try:
        for _ in range(10):
            call()
        sync()
        return dict(layer_us=wall_us(call, calls, sync),
                    attend_us=sections(layer, call, calls, sync)["attend"])
    finally:
        sdpa_module._SDPA_CUDA_BACKENDS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", default="1x64,4x64,1x256")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default=None)
    parser.add_argument("--attention", default="", help=f"comma-separated, of {ATTENTIONS}")
    args = parser.parse_args()
    attentions = [a for a in args.attention.split(",") if a]
    if any(a not in ATTENTIONS for a in attentions):
        parser.error(f"--attention takes {ATTENTIONS}, got {args.attention!r}")
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.set_num_threads(1)
    cfg = mla.MLAConfig.from_preset("deepseek-v3").replace(
        hidden_size=64, num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16)
    weights = mla.MLAWeights(cfg, dtype=torch.float32, device=device, seed=0)
    layer = mla.build(weights, "paged", block_size=64, prefill="up-project", prefill_backend="sdpa")
    rows = []
    for item in args.shapes.split(","):
        b, s = (int(v) for v in item.lower().split("x"))
        x = torch.randn(b, s, cfg.hidden_size, device=device)
        cache = layer.new_cache(b, s)
        cache.allocate(torch.arange(b), torch.full((b,), s))

        def call():
            cache.seq_lens[:] = 0
            return layer(x, cache)

        row = dict(b=b, s=s)
        with torch.no_grad():
            for name, fn in (("layer", call), ("torch_layer", lambda: torch_layer(layer, x))):
                for _ in range(10):
                    fn()
                sync()
                row[f"{name}_us"] = wall_us(fn, args.calls, sync)
                with CountOps() as counter:
                    fn()
                row[f"{name}_ops"] = sum(counter.counts.values())
                row[f"{name}_compute_ops"] = counter.compute()
            row["layer_sections_us"] = sections(layer, call, args.calls, sync)
            y, y_ref = call(), torch_layer(layer, x)
            row["max_abs_diff"] = (y - y_ref).abs().max().item()
            row["by_attention"] = {a: by_attention(weights, a, x, args.calls, sync) for a in attentions}
        row["layer_over_torch_layer"] = row["layer_us"] / row["torch_layer_us"]
        rows.append(row)
        print(f"{b}x{s}: layer {row['layer_us']:.0f} us ({row['layer_compute_ops']} compute ops of "
              f"{row['layer_ops']}), torch layer {row['torch_layer_us']:.0f} us "
              f"({row['torch_layer_compute_ops']} of {row['torch_layer_ops']}), ratio "
              f"{row['layer_over_torch_layer']:.2f}; sections "
              + ", ".join(f"{k} {v:.0f}" for k, v in row["layer_sections_us"].items())
              + "".join(f"; {a}: layer {r['layer_us']:.0f}, attend {r['attend_us']:.0f}"
                        for a, r in row["by_attention"].items()))
    result = dict(device=str(device), torch=torch.__version__, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
