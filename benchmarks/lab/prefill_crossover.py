"""Prefill over a cached context: the paged tier's up-projected path against its absorbed path.

    PYTHONPATH=. python3 benchmarks/lab/prefill_crossover.py --out DIR    # ~1 min on an H200

DeepSeek-V3 sizes (one layer, random weights, bf16, page 64). Each row of the batch holds a
``--context`` (4096) token prefix plus s new tokens already in the paged cache; both paths run
the code the layer runs for such a row, ``PagedMLA.attend_prefill(path, ...)`` on the rows the
layer's own plan builds, so both paths run on the kernels the layer runs them on: "up-project"
(MHA mode: the Triton flash prefill kernel over the new tokens and over the context, up-projected
a workspace at a time, merged by log-sum-exp; with a context every ``prefill_backend`` runs it)
or "absorbed" (MQA mode: W_UK into the query, the decode kernel, ``mla_decode``, in queries of
up to 8 new tokens, W_UV out). The projections before and o_proj after are
the same for both paths and left out. s = 2, 4, ..., 4096 for one sequence and up to
``--max-b4`` for a batch of 4.

The measured crossover is the smallest s from which up-projection is faster at every larger s
measured (and the first s where it is faster at all), reported next to
``mla.memory.prefill_crossover``, the FLOP model's value. Writes ``DEVICE-prefill-crossover.json``
(``h200-prefill-crossover.json`` on an H200) into ``--out``; the docs state the crossover from
``benchmarks/results/h200-prefill.json`` where that file is such a run, else from
``benchmarks/lab/results/h200-prefill-crossover.json``.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch


def crossover(rows: list[dict]) -> tuple[int | None, int | None]:
    """(first s where up-project wins, smallest s from which it wins at every measured s)."""
    done = [r for r in rows if r["up_project_ms"] is not None and r["absorbed_ms"] is not None]
    wins = [r["s"] for r in done if r["up_project_ms"] < r["absorbed_ms"]]
    first = wins[0] if wins else None
    stable = None
    for r in reversed(done):
        if r["up_project_ms"] < r["absorbed_ms"]:
            stable = r["s"]
        else:
            break
    return first, stable


def bench(paged, b: int, context: int, sizes: list[int], budget_s: float) -> list[dict]:
    from benchmarks.timing import mean_us

    cfg, w = paged.config, paged.weights
    h, d, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    dev, dt = w.device, w.dtype
    s_max = max(sizes)
    cache = paged.new_cache(b, context + s_max)
    seq_ids = torch.arange(b)
    cache.allocate(seq_ids, torch.full((b,), context + s_max))
    gen = torch.Generator(device=dev).manual_seed(b)
    cache.kv_cache.normal_(generator=gen)
    out = []
    t0 = time.time()
    for s in sizes:
        row = dict(b=b, s=s, t=context, up_project_ms=None, absorbed_ms=None)
        if time.time() - t0 > budget_s:
            row["skipped"] = "time budget"
            out.append(row)
            continue
        q_nope = torch.randn(b * s, h, d, dtype=dt, device=dev, generator=gen)
        q_pe = torch.randn(b * s, h, r, dtype=dt, device=dev, generator=gen)
        # work ~ s: fewer repetitions for the long chunks
        reps = max(2, min(20, 4096 // (s * b)))
        for path, key in (("up-project", "up_project_ms"), ("absorbed", "absorbed_ms")):
            # the layer's plan for s new tokens a row over the context (the pages are held)
            paged.prefill, cache.seq_lens[:] = path, context
            _, prefill_rows = paged._plan(cache, seq_ids, torch.full((b,), s), seq_ids * s).prefill[0]
            try:
                with torch.no_grad():
                    row[key] = 1e-3 * mean_us(lambda: paged.attend_prefill(path, q_nope, q_pe, cache,
                                                                          prefill_rows),
                                              reps, warmup=1)
            except torch.cuda.OutOfMemoryError:
                row[key + "_error"] = "out of memory"
            torch.cuda.empty_cache()
        if row["up_project_ms"] and row["absorbed_ms"]:
            row["winner"] = "up-project" if row["up_project_ms"] < row["absorbed_ms"] else "absorbed"
        out.append(row)
        print(f"{b:>3} {s:>6} {context:>6} {row['up_project_ms'] or float('nan'):>14.3f} "
              f"{row['absorbed_ms'] or float('nan'):>12.3f}  {row.get('winner', '-')}", flush=True)
        del q_nope, q_pe
    del cache
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--max-s", type=int, default=4096)
    ap.add_argument("--max-b4", type=int, default=1024)
    ap.add_argument("--budget-s", type=float, default=35.0, help="per batch size")
    args = ap.parse_args()
    import triton

    import mla
    from benchmarks.timing import device_prefix, write_json
    from mla.memory import prefill_crossover
    from mla.paged.layer import PREFILL_CROSSOVER

    t0 = time.time()
    cfg = mla.MLAConfig.from_preset("deepseek-v3")
    weights = mla.MLAWeights(cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    paged = mla.build(weights, "paged", block_size=64, shuffle=0)
    sizes = [1 << k for k in range(1, 13) if 1 << k <= args.max_s]  # s = 1 is a decode row
    print(f"{'b':>3} {'s':>6} {'t':>6} {'up-project ms':>14} {'absorbed ms':>12}  faster")
    rows = bench(paged, 1, args.context, sizes, args.budget_s)
    rows += bench(paged, 4, args.context, [s for s in sizes if s <= args.max_b4], args.budget_s)
    model = prefill_crossover(cfg, args.context)
    summary = {}
    for b in (1, 4):
        first, stable = crossover([r for r in rows if r["b"] == b])
        summary[f"b{b}"] = dict(first_up_project_win=first, up_project_wins_from=stable)
        print(f"b={b}: up-project first faster at s={first}, faster from s={stable} on; "
              f"FLOP model (mla.memory.prefill_crossover, t={args.context}): s={model}")
    print(f"PREFILL_CROSSOVER in mla/paged/layer.py now: {PREFILL_CROSSOVER}")
    result = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), config="deepseek-v3", dtype="bfloat16", block_size=64,
        context=args.context, timed="PagedMLA.attend_prefill per path: up-project = kv_b_proj on the new "
        "tokens, mla_prefill over them and over the context a workspace at a time, the lse merge; absorbed "
        "= W_UK into the query, mla_decode in queries of up to 8 new tokens, W_UV out; projections and "
        "o_proj excluded (shared)",
        model_crossover=model, measured=summary, prefill_crossover_constant=PREFILL_CROSSOVER,
        rows=rows, wall_s=time.time() - t0)
    write_json(args.out, f"{device_prefix(result['device'])}-prefill-crossover.json", result)


if __name__ == "__main__":
    main()
