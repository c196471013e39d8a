"""Prefill on the GPU: the paged tier's layer against torch SDPA and FlexAttention, at DeepSeek-V3 sizes.

    python -m mla bench prefill --out benchmarks/results       # a few minutes on an H200

One layer (``MLAConfig.from_preset("deepseek-v3")``, random weights, bf16, page 64). For each
(b, s, t) of ``SHAPES`` (b sequences of s new tokens over t cached ones; t = 0 is a prompt on an
empty cache):

- ``layer``: the paged tier's whole call, x (b, s, hidden) -> y, projections included, through
  whatever prefill path the layer takes (the cache's lengths are reset to t before each call);
- ``layer_attention``: the same call's attention alone, ``PagedMLA.attend_prefill`` replayed on
  the arguments the layer gave it (the flash kernels, the context workspace and the merge, or
  the decode kernel for rows attending absorbed), projections and cache write left out: the
  number to hold against SDPA's;
- ``sdpa_cudnn``, ``sdpa_efficient``, ``sdpa_flash``: ``scaled_dot_product_attention`` alone on
  up-projected q, k (b, h, ·, d + r) and v (b, h, ·, v), causal with the new tokens at the end
  (flash takes one head dim, so its v is padded to d + r and the output cut back);
- ``flex``: ``flex_attention`` compiled, the same mask, where it compiles.

Each gets ``*_ms`` (median of event-timed calls, the first call not counted), ``*_TFLOPs``
(attention FLOPs = causal pairs x h x 2 x (d + r + v), over the time: for the layer this leaves
its projections out, so it reads low) and ``*_peak_mib`` (memory allocated above what was
there before the call: for SDPA its up-projected inputs included, for the layer its cache and
weights not). A contender that fails (out of memory, no kernel for these shapes) records
``*_error``. ``layer_over_best_sdpa`` and ``layer_attention_over_best_sdpa`` are the layer's and
its attention's time over the fastest SDPA backend's. The bf16 matmul rate of the same run is
``matmul_TFLOPs``. Prints a table and writes ``DEVICE-prefill.json``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch

SHAPES = [  # (b, s, t): s new tokens a sequence over t cached ones
    (1, 1024, 0), (1, 4096, 0), (4, 2048, 0), (1, 8192, 0), (1, 16384, 0), (1, 32768, 0), (1, 131072, 0),
    (1, 4096, 32768), (1, 4096, 131072),
]
SDPA = ("cudnn", "efficient", "flash")
CONTENDERS = ("layer", "layer_attention", *(f"sdpa_{name}" for name in SDPA), "flex")


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'BxS,BxS+T,...' -> [(b, s, t), ...]: s new tokens over t cached (0 without '+T')."""
    shapes = []
    for item in text.split(","):
        new, plus, cached = item.strip().partition("+")
        parts = new.lower().split("x") + [cached if plus else "0"]
        if len(parts) != 3 or not all(p.isdigit() for p in parts) or int(parts[0]) < 1 or int(parts[1]) < 1:
            raise argparse.ArgumentTypeError(f"a shape is BxS or BxS+T (e.g. 1x4096+32768); got {item!r}")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON")
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES, help="BxS or BxS+T, comma-separated")
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--no-flex", dest="flex", action="store_false", help="skip FlexAttention (its compile)")
    return parser.parse_args(argv)


def causal_pairs(s: int, t: int) -> int:
    """(query, key) pairs a causal prefill of s new tokens over t cached ones scores, a sequence."""
    return s * t + s * (s + 1) // 2


def attention_flops(config, b: int, s: int, t: int) -> int:
    """Causal pairs x h x 2 x (d + r + v): the scores and the weighted sum of values."""
    width = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    return b * causal_pairs(s, t) * config.num_heads * 2 * width


def add_rates(row: dict, flops: int) -> dict:
    """``*_TFLOPs`` for every ``*_ms`` of the row (None where the time is missing)."""
    for name in CONTENDERS:
        ms = row.get(f"{name}_ms")
        row[f"{name}_TFLOPs"] = flops / (ms * 1e-3) / 1e12 if ms else None
    times = [row.get(f"sdpa_{name}_ms") for name in SDPA]
    best = min((ms for ms in times if ms), default=None)
    row["layer_over_best_sdpa"] = row["layer_ms"] / best if best and row.get("layer_ms") else None
    attention = row.get("layer_attention_ms")
    row["layer_attention_over_best_sdpa"] = attention / best if best and attention else None
    return row


HEADER = f"{'b':>3} {'s':>7} {'t':>7} " + " ".join(f"{name:>15}" for name in CONTENDERS) + f" {'layer/sdpa':>10}"


def format_row(row: dict) -> str:
    """One line under HEADER: each contender's 'ms (TFLOP/s)', 'error' or '-'."""
    cells = []
    for name in CONTENDERS:
        ms, rate = row.get(f"{name}_ms"), row.get(f"{name}_TFLOPs")
        cell = f"{ms:.2f} ({rate:.0f})" if ms and rate else "error" if f"{name}_error" in row else "-"
        cells.append(f"{cell:>15}")
    ratio = row.get("layer_over_best_sdpa")
    return (f"{row['b']:>3} {row['s']:>7} {row['t']:>7} " + " ".join(cells)
            + (f" {ratio:>10.2f}" if ratio else f" {'-':>10}"))


# ---------------------------------------------------------------------------------------------
# On the GPU
# ---------------------------------------------------------------------------------------------


def measure(fn, reset=lambda: None, budget_ms=2000.0, most=10) -> tuple[float, float]:
    """(median ms of event-timed calls, MiB allocated above the start at the peak of the first).

    reset() runs before each call, outside the timed events. The first call (compile, caches)
    is the memory measurement and is not timed, nor is a second (allocator and launch caches
    settling); as many calls as fit ``budget_ms`` follow, at least 3 and at most ``most``."""
    import statistics

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    reset()
    begin = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    reset()
    begin = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    second_ms = 1e3 * (time.perf_counter() - begin)
    times = []
    for _ in range(max(3, min(most, int(budget_ms / max(second_ms, 1e-3))))):
        reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), peak_mib


def _try(row: dict, name: str, run) -> None:
    """row[name_ms], row[name_peak_mib] from run() -> (ms, MiB), or row[name_error]."""
    try:
        row[f"{name}_ms"], row[f"{name}_peak_mib"] = run()
    except Exception as err:  # noqa: BLE001  (out of memory, no kernel for these shapes: a result)
        row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]
    torch.cuda.empty_cache()


def _layer_inputs(paged, b: int, s: int, t: int):
    """(cache, x, reset): a cache of b rows holding t random tokens each, the new tokens x."""
    cfg = paged.config
    gen = torch.Generator(device="cuda").manual_seed(s + t)
    cache = paged.new_cache(b, t + s)
    cache.allocate(torch.arange(b), torch.full((b,), t + s))
    if t:
        cache.kv_cache.normal_(generator=gen)
    x = torch.randn(b, s, cfg.hidden_size, dtype=paged.weights.dtype, device="cuda", generator=gen)

    def reset():
        cache.seq_lens[:] = t

    return cache, x, reset


def bench_layer(paged, b: int, s: int, t: int) -> tuple[float, float]:
    cache, x, reset = _layer_inputs(paged, b, s, t)
    with torch.no_grad():
        return measure(lambda: paged(x, cache), reset)


def bench_layer_attention(paged, b: int, s: int, t: int) -> tuple[float, float]:
    """The layer's ``attend_prefill`` calls of one whole call, replayed: they read the cache and
    write nothing, so the same arguments time the same work again."""
    cache, x, reset = _layer_inputs(paged, b, s, t)
    calls = []

    def record(*args):
        calls.append(args)
        return type(paged).attend_prefill(paged, *args)

    paged.attend_prefill = record
    try:
        reset()
        with torch.no_grad():
            paged(x, cache)
    finally:
        del paged.attend_prefill
    del x
    with torch.no_grad():
        return measure(lambda: [type(paged).attend_prefill(paged, *args) for args in calls])


def _up_projected(cfg, b: int, s: int, t: int, pad_v: bool = False):
    """(memory allocated before, q, k, v): random up-projected inputs in bf16, q (b, h, s, d + r),
    k (b, h, t + s, d + r), v (b, h, t + s, v) or, with pad_v, v padded to d + r. The peak
    memory statistics are reset first, so a contender's peak counts its inputs."""
    h, dk = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    dv = dk if pad_v else cfg.v_head_dim
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator(device="cuda").manual_seed(s + t)
    q = torch.randn(b, h, s, dk, dtype=torch.bfloat16, device="cuda", generator=gen)
    k = torch.randn(b, h, t + s, dk, dtype=torch.bfloat16, device="cuda", generator=gen)
    v = torch.randn(b, h, t + s, dv, dtype=torch.bfloat16, device="cuda", generator=gen)
    return base, q, k, v


def bench_sdpa(cfg, backend: str, b: int, s: int, t: int) -> tuple[float, float]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    kernel = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "flash": SDPBackend.FLASH_ATTENTION}[backend]
    # flash takes one head dim: v padded to d + r (random in the padding, which is cut off)
    base, q, k, v = _up_projected(cfg, b, s, t, pad_v=backend == "flash")
    dk, dv = q.shape[-1], cfg.v_head_dim
    mask = dict(is_causal=True) if t == 0 else dict(attn_mask=causal_lower_right(s, t + s))
    scale = dk**-0.5  # the value does not change the time

    def call():
        with sdpa_kernel(kernel):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, **mask)
        return out[..., :dv]

    ms, _ = measure(call)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def bench_flex(cfg, b: int, s: int, t: int) -> tuple[float, float]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    base, q, k, v = _up_projected(cfg, b, s, t)
    dk = q.shape[-1]
    block_mask = create_block_mask(lambda b_, h_, i, j: i + t >= j, None, None, s, t + s, device="cuda")
    compiled = torch.compile(flex_attention)
    ms, _ = measure(lambda: compiled(q, k, v, block_mask=block_mask, scale=dk**-0.5))
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def run(args) -> dict:
    import triton

    import mla
    from benchmarks.timing import matmul_TFLOPs

    t0 = time.time()
    cfg = mla.MLAConfig.from_preset(args.preset)
    matmul = matmul_TFLOPs()
    print(f"bf16 matmul {matmul:.0f} TFLOP/s; each cell: ms (attention TFLOP/s)")
    weights = mla.MLAWeights(cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    paged = mla.build(weights, "paged", block_size=64)
    print(HEADER)
    rows = []
    for b, s, t in args.shapes:
        row = dict(b=b, s=s, t=t)
        _try(row, "layer", lambda: bench_layer(paged, b, s, t))
        _try(row, "layer_attention", lambda: bench_layer_attention(paged, b, s, t))
        for backend in SDPA:
            _try(row, f"sdpa_{backend}", lambda: bench_sdpa(cfg, backend, b, s, t))
        if args.flex:
            _try(row, "flex", lambda: bench_flex(cfg, b, s, t))
        rows.append(add_rates(row, attention_flops(cfg, b, s, t)))
        print(format_row(row), flush=True)
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), config=args.preset, dtype="bfloat16", block_size=64,
                matmul_TFLOPs=matmul, prefill=getattr(paged, "prefill", None), rows=rows, wall_s=time.time() - t0)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_prefill: needs a CUDA GPU")
    from benchmarks.timing import device_prefix, write_json

    result = run(args)
    write_json(args.out, f"{device_prefix(result['device'])}-prefill.json", result)


if __name__ == "__main__":
    main()
