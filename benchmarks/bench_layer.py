"""One MLA layer's decode step at DeepSeek-V3 sizes: absorbed (eager), paged (eager), paged in a
CUDA graph.

    python -m mla bench layer --out benchmarks/results      # ~1 min on an H200

One layer only (MLAConfig.from_preset("deepseek-v3"), random weights, bf16), projections
included: x (b, 1, hidden) -> y (b, 1, hidden). Every row of the batch already holds
``--context`` tokens (4096), written straight into the caches (random latent rows), then each
contender decodes one token a row:

- ``absorbed_eager``: mla.AbsorbedMLA over its contiguous LatentCache, the common call.
- ``paged_eager``: mla.PagedMLA's common call (its metadata planned on the host and moved in
  one packed copy, the split count chosen from the host's longest row: no host sync).
- ``paged_step_eager``: ``PagedMLA.decode_step`` on device tensors from ``decode_inputs``,
  launched eagerly (no host sync, but every kernel is still launched from Python).
- ``paged_graph``: the same ``decode_step`` captured once in a CUDA graph and replayed
  (fixed-shape static buffers; the stage-1 kernel and split count ``mla_decode`` would pick, fixed at
  capture by ``bench_decode.layer_splits``).

Eager times are the mean of ``--iters`` back-to-back calls between two CUDA events (the caches
grow by one token a call, ~1% over 4096); graph times are the mean of ``--iters`` replays, each
rewriting the same slot. Prints a table and writes ``layer.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch


def bench_batch(weights, b: int, context: int, iters: int) -> dict:
    import mla
    from benchmarks.bench_decode import layer_splits
    from benchmarks.timing import mean_us

    cfg = weights.config
    dev, dt = weights.device, weights.dtype
    room = context + 4 * iters + 64
    gen = torch.Generator(device=dev).manual_seed(b)
    x = torch.randn(b, 1, cfg.hidden_size, dtype=dt, device=dev, generator=gen)

    absorbed = mla.build(weights, "absorbed")
    a_cache = absorbed.new_cache(b, room)
    a_cache.kv_c.normal_(generator=gen)
    a_cache.k_pe.normal_(generator=gen)
    a_cache.seq_lens[:] = context

    paged = mla.build(weights, "paged", block_size=64, shuffle=0)
    p_cache = paged.new_cache(b, room)
    rows = torch.arange(b)
    p_cache.allocate(rows, torch.full((b,), context))
    p_cache.kv_cache.normal_(generator=gen)
    p_cache.seq_lens[:] = context

    row = dict(b=b, t=context)
    with torch.no_grad():
        row["absorbed_eager_us"] = mean_us(lambda: absorbed(x, a_cache), iters)
        del a_cache
        torch.cuda.empty_cache()
        row["paged_eager_us"] = mean_us(lambda: paged(x, p_cache), iters)

        row["decode_kernel"], splits = layer_splits(cfg, p_cache)
        row["num_kv_splits"] = splits

        def eager_step():
            inputs = paged.decode_inputs(p_cache)
            return paged.decode_step(x, p_cache, num_kv_splits=splits, **inputs)

        row["paged_step_eager_us"] = mean_us(eager_step, iters)

        # the graph: static inputs, warm up on a side stream, capture, replay
        static_x = x.clone()
        buffers = paged.decode_inputs(p_cache)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                eager_y = paged.decode_step(static_x, p_cache, num_kv_splits=splits, **buffers)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = paged.decode_step(static_x, p_cache, num_kv_splits=splits, **buffers)
        graph.replay()
        torch.cuda.synchronize()
        err = float((static_y.float() - eager_y.float()).norm() / eager_y.float().norm())
        row["graph_vs_eager_rel_err"] = err
        if not err < 1e-2:
            raise AssertionError(f"b={b}: graph replay differs from the eager step (rel {err})")
        row["paged_graph_us"] = mean_us(graph.replay, iters)
        del graph
    row["graph_speedup_vs_absorbed"] = row["absorbed_eager_us"] / row["paged_graph_us"]
    row["graph_speedup_vs_paged_eager"] = row["paged_eager_us"] / row["paged_graph_us"]
    del p_cache
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    import triton

    import mla

    t0 = time.time()
    cfg = mla.MLAConfig.from_preset("deepseek-v3")
    weights = mla.MLAWeights(cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    rows = []
    print(f"{'b':>4} {'t':>6} {'absorbed eager':>15} {'paged eager':>12} {'step eager':>11} "
          f"{'paged graph':>12} {'splits':>6} {'x absorbed':>10} {'x paged':>8}   (us)")
    for b in (int(v) for v in args.batches.split(",")):
        r = bench_batch(weights, b, args.context, args.iters)
        rows.append(r)
        print(f"{r['b']:>4} {r['t']:>6} {r['absorbed_eager_us']:>15.1f} {r['paged_eager_us']:>12.1f} "
              f"{r['paged_step_eager_us']:>11.1f} {r['paged_graph_us']:>12.1f} "
              f"{r['num_kv_splits']:>6} {r['graph_speedup_vs_absorbed']:>10.2f} "
              f"{r['graph_speedup_vs_paged_eager']:>8.2f}", flush=True)
    result = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), config="deepseek-v3", layers=1, dtype="bfloat16",
        block_size=64, context=args.context, iters=args.iters,
        note="one layer's decode step, projections included; eager = mean of back-to-back "
             "calls (cache grows one token a call), graph = mean of replays",
        rows=rows, wall_s=time.time() - t0)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "layer.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'layer.json')} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
