"""The paged layer's decode step under tensor parallelism: TP N against TP 1, one process a GPU.

    python -m mla bench tp --out benchmarks/results --tp 2     # N GPUs, NCCL, ~2 min
    python -m mla bench tp --out DIR --tp 2 --device cpu --preset tiny \\
        --batches 2 --context 16 --iters 2                     # gloo, a smoke run

One layer (``--preset``, DeepSeek-V3 by default; random weights, the same seed on every rank),
projections included, x (b, 1, hidden) -> y (b, 1, hidden), for each batch of ``--batches``
with ``--context`` tokens already in every row. TP 1 is the whole layer in one process; TP N
starts N processes (``mla.parallel.launch``, NCCL with NVLink multicast off; gloo on the CPU),
each with its shard of the heads (``MLAWeights.shard``) and the whole latent cache (the same
random rows on every rank: the cache is replicated under TP), so a step is the rank's heads plus
one all-reduce of the (b, hidden) output. Timed on every rank after a barrier:

- ``step_eager_us``: ``PagedMLA.decode_step`` launched from Python, mean of ``--iters`` calls
  between two CUDA events (wall clock on the CPU);
- ``step_graph_us``: the same step captured in one CUDA graph, the all-reduce inside it, mean of
  ``--iters`` replays (GPU only; a capture that fails is recorded as ``graph_error``).

Each row reports the slowest rank (a step ends when every rank's does) and ``rel_err``: the TP
step's output on rank 0 against the whole layer run on the same inputs and cache there. Prints a
table and writes ``DEVICE-tp.json`` (``h200-tp.json`` on an H200, ``cpu-tp.json``) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch


def _time_us(fn, iters: int, device: torch.device, warmup: int = 2) -> float:
    """Mean of `iters` back-to-back calls: CUDA events (``timing.mean_us``), wall clock on the CPU."""
    if device.type == "cuda":
        from benchmarks.timing import mean_us

        return mean_us(fn, iters, warmup)
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return 1e6 * (time.perf_counter() - start) / iters


def _splits(layer, cache, device) -> int:
    """The split count the step runs with, chosen once for the rank's heads and the lengths as
    mla_decode would for the kernel it picks (bench_decode.layer_splits)."""
    from benchmarks.bench_decode import layer_splits

    if device.type != "cuda":
        return 2
    return layer_splits(layer.config, cache)[1]


def _rank_bench(rank: int, world_size: int, group, preset: str, device_type: str, dtype_name: str,
                batches: list[int], context: int, iters: int) -> list[dict]:
    """One rank's rows: every rank runs this with the same arguments (same calls, same order)."""
    import torch.distributed as dist

    import mla

    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    dtype = getattr(torch, dtype_name)
    cfg = mla.MLAConfig.from_preset(preset)
    full = mla.MLAWeights(cfg, dtype=dtype, device=device, seed=0)  # the same on every rank
    if world_size == 1:
        layer = mla.build(full, "paged", block_size=64)
    else:
        layer = mla.build(full.shard(rank, world_size), "paged", block_size=64, process_group=group)
    whole = mla.build(full, "paged", block_size=64) if rank == 0 else None
    rows = []
    for b in batches:
        room = context + 2 * iters + 16
        cache = layer.new_cache(b, room)
        cache.allocate(torch.arange(b), torch.full((b,), context))
        gen = torch.Generator(device=device).manual_seed(b)  # the same rows on every rank
        cache.kv_cache.copy_(torch.randn(cache.kv_cache.shape, generator=gen, device=device, dtype=torch.float32))
        cache.seq_lens[:] = context
        x = torch.randn(b, 1, cfg.hidden_size, generator=gen, device=device, dtype=torch.float32).to(dtype)
        splits = _splits(layer, cache, device)
        inputs = layer.decode_inputs(cache)  # the token's slot; every timed call rewrites it
        row = dict(tp=world_size, b=b, t=context, heads_per_rank=layer.config.num_heads, num_kv_splits=splits)
        with torch.no_grad():
            y = layer.decode_step(x, cache, num_kv_splits=splits, **inputs)
            if whole is not None:  # the whole layer on the same inputs and cache
                ref = whole.decode_step(x, cache, num_kv_splits=2, **inputs).float()
                row["rel_err"] = float((y.float() - ref).norm() / ref.norm())
            if group is not None:
                dist.barrier(group=group)
            row["step_eager_us"] = _time_us(
                lambda: layer.decode_step(x, cache, num_kv_splits=splits, **inputs), iters, device)
            if device.type == "cuda":
                graph = None
                try:  # capturing runs nothing, the all-reduce included: no rank waits here
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):  # warm up outside the capture (NCCL too)
                        layer.decode_step(x, cache, num_kv_splits=splits, **inputs)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        static_y = layer.decode_step(x, cache, num_kv_splits=splits, **inputs)
                except Exception as err:  # noqa: BLE001  (a capture that fails is a result too)
                    graph, row["graph_error"] = None, f"{type(err).__name__}: {err}"[:300]
                # Replay only if every rank captured: a graph's all-reduce with no partner on a
                # rank that moved on would pair with that rank's next collective, and hang.
                captured = torch.tensor([int(graph is not None)], device=device)
                if group is not None:
                    dist.all_reduce(captured, op=dist.ReduceOp.MIN, group=group)
                if captured.item():
                    graph.replay()
                    torch.cuda.synchronize()
                    row["graph_vs_eager_rel_err"] = float((static_y.float() - y.float()).norm() / y.float().norm())
                    if group is not None:
                        dist.barrier(group=group)
                    row["step_graph_us"] = _time_us(graph.replay, iters, device)
                elif "graph_error" not in row:
                    row["graph_error"] = "another rank's capture failed"
                del graph
        rows.append(row)
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _slowest(per_rank: list[list[dict]]) -> list[dict]:
    """Rank 0's rows with each time replaced by the slowest rank's."""
    rows = []
    for i, row in enumerate(per_rank[0]):
        row = dict(row)
        for key in ("step_eager_us", "step_graph_us"):
            times = [ranks[i].get(key) for ranks in per_rank]
            if all(v is not None for v in times):  # the graph is timed on every rank or none
                row[key], row[f"{key}_per_rank"] = max(times), times
        rows.append(row)
    return rows


def main(argv=None) -> None:
    from benchmarks.timing import device_prefix
    from mla import parallel

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2, help="ranks of the TP run (one GPU each under NCCL)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    if args.tp < 2:
        raise SystemExit(f"--tp must be >= 2 (TP 1 runs beside it), got {args.tp}")
    import mla

    heads = mla.MLAConfig.from_preset(args.preset).num_heads
    if heads % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide {args.preset}'s {heads} heads")
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} GPUs, {torch.cuda.device_count()} visible")
    backend = "nccl" if args.device == "cuda" else "gloo"
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    batches = [int(v) for v in args.batches.split(",")]
    parallel.disable_multicast()
    t0 = time.time()
    rows = []
    from benchmarks.bench_tp import _rank_bench  # by its module's name: the spawned ranks import it

    for world_size in (1, args.tp):
        per_rank = parallel.launch(_rank_bench, world_size, args.preset, args.device, dtype, batches,
                                   args.context, args.iters, backend=backend)
        rows.extend(_slowest(per_rank))
    by_b = {}
    print(f"{'tp':>3} {'b':>4} {'t':>6} {'heads':>5} {'eager us':>9} {'graph us':>9} {'rel err':>8}")
    for r in rows:
        by_b.setdefault(r["b"], {})[r["tp"]] = r
        graph = f"{r['step_graph_us']:>9.1f}" if "step_graph_us" in r else f"{'-':>9}"
        print(f"{r['tp']:>3} {r['b']:>4} {r['t']:>6} {r['heads_per_rank']:>5} {r['step_eager_us']:>9.1f} {graph} "
              f"{r.get('rel_err', float('nan')):>8.1e}")
    for b, pair in by_b.items():  # TP N's step against TP 1's, where both were timed
        for key in ("step_eager_us", "step_graph_us"):
            if key in pair.get(1, {}) and key in pair.get(args.tp, {}):
                pair[args.tp][f"{key.removesuffix('_us')}_speedup_vs_tp1"] = pair[1][key] / pair[args.tp][key]
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = dict(device=device_name, torch=torch.__version__, python=platform.python_version(),
                  backend=backend, tp=args.tp, preset=args.preset, dtype=dtype, block_size=64,
                  context=args.context, iters=args.iters, rows=rows, wall_s=time.time() - t0)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{device_prefix(device_name)}-tp.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
