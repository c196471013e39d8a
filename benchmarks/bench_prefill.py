"""Prefill on the GPU: the paged tier's layer against torch SDPA and FlexAttention, at DeepSeek-V3 sizes.

    python -m mla bench prefill --out benchmarks/results       # a few minutes on an H200

One layer (``MLAConfig.from_preset("deepseek-v3")``, random weights, bf16, page 64). For each
(b, s, t) of ``SHAPES`` (b sequences of s new tokens over t cached ones; t = 0 is a prompt on an
empty cache), every contender in the same run:

- ``layer``: the paged tier's whole call, x (b, s, hidden) -> y, projections included, under its
  default ``prefill_backend="auto"`` (the cache's lengths are reset to t before each call);
  ``layer_triton`` and ``layer_sdpa`` the same with ``prefill_backend`` forced, at t = 0 only
  (over a cached context every choice runs the Triton kernels);
- ``layer_attention`` (and ``layer_attention_triton``, ``layer_attention_sdpa``): the same
  calls' attention alone, ``PagedMLA.attend_prefill`` replayed on the arguments the layer gave it
  (the new tokens' up-projection, the flash kernel or SDPA, the context workspace and the merge,
  or the decode kernel for rows attending absorbed), projections and cache write left out;
- ``sdpa_cudnn``, ``sdpa_efficient``, ``sdpa_flash``: ``scaled_dot_product_attention`` alone on
  up-projected q, k (b, h, ·, d + r) and v (b, h, ·, v), causal with the new tokens at the end
  (flash takes one head dim, so its v is padded to d + r and the output cut back);
- ``sdpa_layer``: the paged layer's whole call with its attention replaced by SDPA (the faster of
  cuDNN and efficient in this row, named in ``sdpa_layer_backend``) on the whole sequence: the
  cached context gathered from its pages, context and new tokens up-projected by kv_b_proj at
  once, no workspace. The layer as one would build it on SDPA: projections, cache write and
  o_proj are the paged layer's own, so ``layer`` and ``sdpa_layer`` differ only in attention;
- ``torch_layer`` (prompts, t = 0): the same weights as a layer written in a few lines of torch,
  with no cache and no plan (``torch_layer``): query and latent as the paged tier computes them,
  k and v up-projected by kv_b_proj, one SDPA call (``sdpa_layer_backend``), o_proj. The
  issue's own baseline ("torch SDPA on up-projected k, v", whole layer call);
- ``flex``: ``flex_attention`` compiled, the same mask, where it compiles.

Each gets ``*_ms`` (median of event-timed calls, the first two calls not counted), ``*_TFLOPs``
(attention FLOPs = causal pairs x h x 2 x (d + r + v), over the time: for whole calls this leaves
the projections out, so it reads low) and ``*_peak_mib`` (memory allocated above what was there
before the call: for SDPA its up-projected inputs included, for the layer its cache and weights
not); a contender that fails (out of memory, no kernel for these shapes) records ``*_error``.

The ratios. The issue's target, the paged layer at least as fast as SDPA (<= 1.0), is checked on
``layer_over_sdpa_layer``: whole call over whole call, projections on both sides; and on
``layer_over_sdpa_layer_paired``, the same pair timed in turn (which of the two goes first
alternating from pair to pair; ``paired_calls`` has every call; a failure records
``layer_over_sdpa_layer_paired_error``), the median of the pairs' ratios: two timings of one
host-bound computation made apart have differed by a quarter at 1k tokens (``layer`` and
``layer_sdpa`` in ``benchmarks/results/h200-prefill.json``), and timing them in turn puts
whatever drifts on both sides of each pair. Attention
against attention is ``layer_attention_over_best_sdpa`` (over the fastest SDPA backend's
attention). ``layer_over_best_sdpa`` (the whole call over SDPA's attention alone) mixes the two
and is kept for the results it appears in. On prompts ``layer_over_torch_layer`` and
``layer_over_torch_layer_paired`` (timed in turn, ``torch_paired_calls``) put the layer beside
``torch_layer``, which does less (no cache write, no plan): the host's part of a short prompt
shows there. The bf16 matmul rate of the same run is ``matmul_TFLOPs``.

How the calls went, for each timed contender, in ``*_calls``: ``timed_ms`` (every timed call in
order), ``first_ms`` and ``second_ms`` (the untimed calls, wall clock), ``host_ms`` (median time
the host spends issuing a call: near ``*_ms``, the call is host-bound), ``triton_compiles``
(Triton kernels compiled after the first call: a re-specialisation from call to call shows
here), ``syncs`` (synchronising operations torch reports in one more call; the layers and their
attention) and ``host_load`` (the 1-minute load average and this process's descendant processes
before a layer's measurement). TorchInductor compiles FlexAttention in this process
(``TORCHINDUCTOR_COMPILE_THREADS=1`` unless set): its default pool of compile workers starts
with the first compile and would compete with the host-bound layer calls timed next. Prints a
table and writes ``DEVICE-prefill.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
import warnings

import torch

SHAPES = [  # (b, s, t): s new tokens a sequence over t cached ones
    (1, 1024, 0), (1, 4096, 0), (4, 2048, 0), (1, 8192, 0), (1, 16384, 0), (1, 32768, 0), (1, 131072, 0),
    (1, 4096, 32768), (1, 4096, 131072),
]
SDPA = ("cudnn", "efficient", "flash")
LAYER_BACKENDS = ("auto", "triton", "sdpa")  # PagedMLA's prefill_backend values


def _suffix(backend: str) -> str:
    return "" if backend == "auto" else f"_{backend}"


LAYERS = tuple(f"layer{_suffix(b)}" for b in LAYER_BACKENDS)
ATTENTIONS = tuple(f"layer_attention{_suffix(b)}" for b in LAYER_BACKENDS)
CONTENDERS = (*LAYERS, *ATTENTIONS, *(f"sdpa_{name}" for name in SDPA), "sdpa_layer", "torch_layer", "flex")


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


def best_sdpa(row: dict, backends=SDPA) -> tuple[str | None, float | None]:
    """(name, ms) of the fastest of these SDPA backends in the row; (None, None) if none ran."""
    timed = [(row[f"sdpa_{name}_ms"], name) for name in backends if row.get(f"sdpa_{name}_ms")]
    if not timed:
        return None, None
    ms, name = min(timed)
    return name, ms


def _ratio(a, b):
    return a / b if a and b else None


def add_rates(row: dict, flops: int) -> dict:
    """``*_TFLOPs`` for every ``*_ms`` of the row (None where the time is missing), and the ratios."""
    for name in CONTENDERS:
        ms = row.get(f"{name}_ms")
        row[f"{name}_TFLOPs"] = flops / (ms * 1e-3) / 1e12 if ms else None
    _, best = best_sdpa(row)
    row["layer_over_sdpa_layer"] = _ratio(row.get("layer_ms"), row.get("sdpa_layer_ms"))
    row["layer_over_torch_layer"] = _ratio(row.get("layer_ms"), row.get("torch_layer_ms"))
    row["layer_attention_over_best_sdpa"] = _ratio(row.get("layer_attention_ms"), best)
    row["layer_over_best_sdpa"] = _ratio(row.get("layer_ms"), best)
    return row


HEADER = (f"{'b':>3} {'s':>7} {'t':>7} " + " ".join(f"{name:>15}" for name in CONTENDERS)
          + f" {'layer/sdpa_layer':>16} {'attn/sdpa':>9}")


def format_row(row: dict) -> str:
    """One line under HEADER: each contender's 'ms (TFLOP/s)', 'error' or '-', then the two
    like-for-like ratios (whole calls; attention alone)."""
    cells = []
    for name in CONTENDERS:
        ms, rate = row.get(f"{name}_ms"), row.get(f"{name}_TFLOPs")
        cell = f"{ms:.2f} ({rate:.0f})" if ms and rate else "error" if f"{name}_error" in row else "-"
        cells.append(f"{cell:>15}")
    ratios = [(row.get("layer_over_sdpa_layer"), 16), (row.get("layer_attention_over_best_sdpa"), 9)]
    return (f"{row['b']:>3} {row['s']:>7} {row['t']:>7} " + " ".join(cells) + "".join(
        f" {ratio:>{width}.2f}" if ratio else f" {'-':>{width}}" for ratio, width in ratios))


# ---------------------------------------------------------------------------------------------
# What the host does around a call
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def counting_triton_compiles():
    """Yields a dict whose "n" counts the Triton kernels compiled inside the block (a JIT
    function's in-memory cache missing: a new specialisation); "n" stays None where this Triton
    has no ``knobs.runtime.jit_cache_hook``."""
    counter = {"n": None}
    try:
        from triton import knobs
        runtime = knobs.runtime
        previous = runtime.jit_cache_hook
    except (ImportError, AttributeError):
        yield counter
        return

    def hook(*args, **kwargs):
        counter["n"] += 1
        return previous(*args, **kwargs) if previous else False  # False: compile as usual

    counter["n"] = 0
    runtime.jit_cache_hook = hook
    try:
        yield counter
    finally:
        runtime.jit_cache_hook = previous


def count_syncs(fn) -> int:
    """Synchronising CUDA operations in one fn() call, as torch's sync debug mode reports them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def host_load() -> dict:
    """The 1-minute load average and how many processes descend from this one (a compile
    worker pool shows here); None where the platform does not say."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    parents = {}
    try:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    with open(f"/proc/{entry}/stat") as f:
                        stat = f.read()
                    parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])  # field 4: ppid
    except OSError:
        return dict(load1=load, descendants=None)
    ours, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in ours} - ours
        ours |= more
        grew = bool(more)
    return dict(load1=load, descendants=len(ours) - 1)


# ---------------------------------------------------------------------------------------------
# On the GPU
# ---------------------------------------------------------------------------------------------


def measure(fn, reset=lambda: None, budget_ms=2000.0, most=10) -> dict:
    """Time fn() on the GPU: {"ms": median of event-timed calls, "peak_mib": MiB allocated above
    the start at the peak of the first call, "calls": {"first_ms", "second_ms": the two untimed
    calls' wall clock, "timed_ms": every timed call in order, "host_ms": median time fn() takes
    to return (the host issuing the call), "triton_compiles": Triton kernels compiled after the
    first call}}.

    reset() runs before each call, outside the timed events. The first call (compile, caches)
    is the memory measurement and is not timed, nor is a second (allocator and launch caches
    settling); as many calls as fit ``budget_ms`` follow, at least 3 and at most ``most``."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    reset()
    begin = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first_ms = 1e3 * (time.perf_counter() - begin)
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    calls, host = [], []
    with counting_triton_compiles() as compiles:
        reset()
        begin = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        second_ms = 1e3 * (time.perf_counter() - begin)
        for _ in range(max(3, min(most, int(budget_ms / max(second_ms, 1e-3))))):
            reset()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            begin = time.perf_counter()
            fn()
            host.append(1e3 * (time.perf_counter() - begin))
            end.record()
            torch.cuda.synchronize()
            calls.append(start.elapsed_time(end))
    return dict(ms=statistics.median(calls), peak_mib=peak_mib,
                calls=dict(first_ms=first_ms, second_ms=second_ms, timed_ms=calls,
                           host_ms=statistics.median(host), triton_compiles=compiles["n"]))


def _event_ms(fn, host: list | None = None) -> float:
    """fn() timed by CUDA events, from an idle GPU (synchronised before and after); with
    ``host``, the time fn() takes to return (the host issuing it, ms) is appended to it."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    begin = time.perf_counter()
    fn()
    if host is not None:
        host.append(1e3 * (time.perf_counter() - begin))
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def measure_pair(fn_a, fn_b, reset_a=lambda: None, reset_b=lambda: None, budget_ms=4000.0, most=20,
                 timer=_event_ms) -> dict:
    """fn_a and fn_b timed in turn after two untimed calls of each, which of the two goes first
    alternating from pair to pair (A B, B A, A B, ...): {"a_ms", "b_ms": each one's median,
    "ratio": the median over the pairs of a / b, "a_calls", "b_calls": every timed call}. Taken
    in turn, what drifts between two measurements made apart (clocks, the allocator's state, the
    host's load) weighs on both sides of each pair alike, and the alternation cancels what the
    first of a pair leaves to the second (caches, the allocator). As many pairs as fit
    ``budget_ms``, 5 to ``most``."""
    for _ in range(2):
        reset_a()
        timer(fn_a)
        reset_b()
        timer(fn_b)
    a, b = [], []
    while len(a) < most and (len(a) < 5 or sum(a) + sum(b) < budget_ms):
        if len(a) % 2 == 0:
            reset_a()
            a.append(timer(fn_a))
            reset_b()
            b.append(timer(fn_b))
        else:
            reset_b()
            b.append(timer(fn_b))
            reset_a()
            a.append(timer(fn_a))
    return dict(a_ms=statistics.median(a), b_ms=statistics.median(b),
                ratio=statistics.median(x / y for x, y in zip(a, b)), a_calls=a, b_calls=b)


def _try(row: dict, name: str, run) -> None:
    """row[name_ms], row[name_peak_mib], row[name_calls] from run() -> measure's dict, or
    row[name_error]. Only the times end in _ms at the row's top level (the docs plot those)."""
    try:
        timing = run()
        row[f"{name}_ms"], row[f"{name}_peak_mib"], row[f"{name}_calls"] = (
            timing["ms"], timing["peak_mib"], timing["calls"])
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


def bench_layer(paged, b: int, s: int, t: int) -> dict:
    """The whole call; with the host's load before it and the syncs of one more call."""
    load = host_load()
    cache, x, reset = _layer_inputs(paged, b, s, t)
    with torch.no_grad():
        timing = measure(lambda: paged(x, cache), reset)
        reset()
        timing["calls"]["syncs"] = count_syncs(lambda: paged(x, cache))
    timing["calls"]["host_load"] = load
    return timing


def bench_layer_attention(paged, b: int, s: int, t: int) -> dict:
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

    def replay():
        return [type(paged).attend_prefill(paged, *args) for args in calls]

    with torch.no_grad():
        timing = measure(replay)
        timing["calls"]["syncs"] = count_syncs(replay)
    return timing


def _sdpa_kernel(backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "flash": SDPBackend.FLASH_ATTENTION}[backend])


def _causal_mask(s: int, t: int) -> dict:
    """SDPA's mask arguments: s queries, the last of s + t keys, causal (bottom-right)."""
    from torch.nn.attention.bias import causal_lower_right

    return dict(is_causal=True) if t == 0 else dict(attn_mask=causal_lower_right(s, t + s))


def sdpa_attend_prefill(paged, backend: str):
    """A replacement for ``paged.attend_prefill`` that attends as a layer built on SDPA would:
    each row's whole sequence (its cached context gathered from the pages, then its new
    tokens) up-projected by kv_b_proj at once into k (m, h, t + s, d + r) and v (m, h, t + s, v),
    one ``scaled_dot_product_attention`` call under ``backend`` for the m rows. Rows of one
    length (as every bench shape has); rows attending absorbed keep the layer's path."""
    from mla.paged.cache import gather_pages

    w, cfg = paged.weights, paged.config
    h, d, c, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    W_kv = torch.cat([w.W_UK, w.W_UV], dim=1).reshape(h * (d + dv), c)                # (h·(d+v), c)

    def attend(path, q_nope, q_pe, cache, rows):
        if path != "up-project":
            return type(paged).attend_prefill(paged, path, q_nope, q_pe, cache, rows)
        m, s, total = rows.context_lens.numel(), rows.max_new_len, rows.max_seq_len
        if q_nope.shape[0] != m * s:
            raise ValueError("sdpa_layer times rows of one length only")
        latent = gather_pages(cache, rows.block_table, rows.context_lens + s, total)  # (m, t + s, c + r)
        kv = (latent[..., :c] @ W_kv.T).view(m, total, h, d + dv)                       # (m, t + s, h, d + v)
        k_pe = latent[:, :, None, c:].expand(-1, -1, h, -1)                              # (m, t + s, h, r)
        k = torch.cat([kv[..., :d], k_pe], dim=-1).transpose(1, 2)                       # (m, h, t + s, d + r)
        v = kv[..., d:].transpose(1, 2)                                                  # (m, h, t + s, v)
        q = torch.cat([q_nope, q_pe], dim=-1).view(m, s, h, -1).transpose(1, 2)          # (m, h, s, d + r)
        with _sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, scale=paged.softmax_scale, **_causal_mask(s, total - s))        # (m, h, s, v)
        return o.transpose(1, 2).reshape(m * s, h, dv)                                   # (T_p, h, v)

    return attend


def bench_sdpa_layer(paged, backend: str, b: int, s: int, t: int) -> dict:
    """The paged layer's whole call with ``sdpa_attend_prefill`` as its attention."""
    paged.attend_prefill = sdpa_attend_prefill(paged, backend)
    try:
        return bench_layer(paged, b, s, t)
    finally:
        del paged.attend_prefill


def bench_layer_against_sdpa_layer(paged, sdpa_paged, backend: str, b: int, s: int, t: int) -> dict:
    """The goal's pair timed in turn (``measure_pair``): ``paged``'s whole call against
    ``sdpa_paged`` (another layer on the same weights) with ``sdpa_attend_prefill`` as its
    attention, each on a cache of its own holding the same tokens, the same x."""
    cache_a, x, reset_a = _layer_inputs(paged, b, s, t)
    cache_b, _, reset_b = _layer_inputs(sdpa_paged, b, s, t)
    sdpa_paged.attend_prefill = sdpa_attend_prefill(sdpa_paged, backend)
    try:
        with torch.no_grad():
            return measure_pair(lambda: paged(x, cache_a), lambda: sdpa_paged(x, cache_b), reset_a, reset_b)
    finally:
        del sdpa_paged.attend_prefill


def torch_layer(layer, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """A prompt x (b, s, hidden) through `layer`'s weights as a few lines of torch: query and
    latent as the paged tier computes them, k and v up-projected by kv_b_proj, one causal SDPA
    call under ``backend`` (None: torch's choice), o_proj. No cache, no plan. -> (b, s, hidden)"""
    from mla.naive import latent, query_latent
    from mla.paged.layer import joint_query
    from mla.rope import rope_cos_sin

    w, cfg = layer.weights, layer.config
    b, s, _ = x.shape
    h, d = cfg.num_heads, cfg.qk_nope_head_dim
    cos, sin = rope_cos_sin(cfg, torch.arange(s, device=x.device), x.dtype)           # (s, r/2)
    c_q = query_latent(w, x)                                                          # (b, s, q)
    q = joint_query(w, c_q.flatten(0, 1), cos.repeat(b, 1), sin.repeat(b, 1))        # (b·s, h, d + r)
    kv_c, k_pe = latent(w, x, cos.expand(b, -1, -1), sin.expand(b, -1, -1))           # (b, s, c), (b, s, r)
    kv = w.kv_b_proj(kv_c).view(b, s, h, -1)                                          # (b, s, h, d + v)
    k = torch.cat([kv[..., :d], k_pe[:, :, None].expand(-1, -1, h, -1)], dim=-1)      # (b, s, h, d + r)
    with _sdpa_kernel(backend) if backend else contextlib.nullcontext():
        o = torch.nn.functional.scaled_dot_product_attention(
            q.view(b, s, h, -1).transpose(1, 2), k.transpose(1, 2), kv[..., d:].transpose(1, 2),
            is_causal=True, scale=layer.softmax_scale)                                # (b, h, s, v)
    return layer.output_projection(o.transpose(1, 2))                                 # (b, s, hidden)


def bench_torch_layer(paged, backend: str, b: int, s: int) -> dict:
    _, x, _ = _layer_inputs(paged, b, s, 0)
    with torch.no_grad():
        return measure(lambda: torch_layer(paged, x, backend))


def bench_layer_against_torch_layer(paged, backend: str, b: int, s: int) -> dict:
    """The layer's whole call and ``torch_layer`` on the same prompt, timed in turn."""
    cache, x, reset = _layer_inputs(paged, b, s, 0)
    with torch.no_grad():
        return measure_pair(lambda: paged(x, cache), lambda: torch_layer(paged, x, backend), reset)


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


def bench_sdpa(cfg, backend: str, b: int, s: int, t: int) -> dict:
    # flash takes one head dim: v padded to d + r (random in the padding, which is cut off)
    base, q, k, v = _up_projected(cfg, b, s, t, pad_v=backend == "flash")
    dk, dv = q.shape[-1], cfg.v_head_dim
    mask = _causal_mask(s, t)
    scale = dk**-0.5  # the value does not change the time

    def call():
        with _sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, **mask)
        return out[..., :dv]

    timing = measure(call)
    timing["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return timing


def bench_flex(cfg, b: int, s: int, t: int) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    base, q, k, v = _up_projected(cfg, b, s, t)
    dk = q.shape[-1]
    block_mask = create_block_mask(lambda b_, h_, i, j: i + t >= j, None, None, s, t + s, device="cuda")
    compiled = torch.compile(flex_attention)
    timing = measure(lambda: compiled(q, k, v, block_mask=block_mask, scale=dk**-0.5))
    timing["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return timing


def run(args) -> dict:
    import triton

    import mla
    from benchmarks.timing import matmul_TFLOPs
    from mla.kernels.sdpa import PREFILL_KERNEL_UP_TO, choose_prefill_backend

    t0 = time.time()
    cfg = mla.MLAConfig.from_preset(args.preset)
    matmul = matmul_TFLOPs()
    print(f"bf16 matmul {matmul:.0f} TFLOP/s; each cell: ms (attention TFLOP/s)")
    weights = mla.MLAWeights(cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    layers = {backend: mla.build(weights, "paged", block_size=64, prefill_backend=backend)
              for backend in LAYER_BACKENDS}
    sdpa_layer = mla.build(weights, "paged", block_size=64)  # the other side of the paired timing
    print(HEADER)
    rows = []
    for b, s, t in args.shapes:
        row = dict(b=b, s=s, t=t)
        # over a cached context every prefill_backend runs the Triton kernels: auto alone
        backends = LAYER_BACKENDS if t == 0 else ("auto",)
        for backend in backends:
            _try(row, f"layer{_suffix(backend)}", lambda: bench_layer(layers[backend], b, s, t))
        for backend in backends:
            _try(row, f"layer_attention{_suffix(backend)}",
                 lambda: bench_layer_attention(layers[backend], b, s, t))
        for backend in SDPA:
            _try(row, f"sdpa_{backend}", lambda: bench_sdpa(cfg, backend, b, s, t))
        fastest, _ = best_sdpa(row, ("cudnn", "efficient"))
        if fastest:
            row["sdpa_layer_backend"] = fastest
            _try(row, "sdpa_layer", lambda: bench_sdpa_layer(layers["auto"], fastest, b, s, t))
            try:
                pair = bench_layer_against_sdpa_layer(layers["auto"], sdpa_layer, fastest, b, s, t)
                row["layer_over_sdpa_layer_paired"], row["paired_calls"] = pair["ratio"], pair
            except Exception as err:  # noqa: BLE001  (out of memory: a result)
                row["layer_over_sdpa_layer_paired_error"] = f"{type(err).__name__}: {err}"[:300]
            torch.cuda.empty_cache()
            if t == 0:
                _try(row, "torch_layer", lambda: bench_torch_layer(layers["auto"], fastest, b, s))
                try:
                    pair = bench_layer_against_torch_layer(layers["auto"], fastest, b, s)
                    row["layer_over_torch_layer_paired"], row["torch_paired_calls"] = pair["ratio"], pair
                except Exception as err:  # noqa: BLE001  (out of memory: a result)
                    row["layer_over_torch_layer_paired_error"] = f"{type(err).__name__}: {err}"[:300]
                torch.cuda.empty_cache()
        if args.flex:
            _try(row, "flex", lambda: bench_flex(cfg, b, s, t))
        rows.append(add_rates(row, attention_flops(cfg, b, s, t)))
        print(format_row(row), flush=True)
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), config=args.preset, dtype="bfloat16", block_size=64,
                matmul_TFLOPs=matmul, prefill=layers["auto"].prefill,
                prefill_backend_auto={
                    f"{b}x{s}": choose_prefill_backend("auto", "cuda", equal_rows=True, new_tokens=b * s)
                    for b, s, t in args.shapes if t == 0},
                prefill_kernel_up_to=PREFILL_KERNEL_UP_TO,
                inductor_compile_threads=os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"),
                rows=rows, wall_s=time.time() - t0)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_prefill: needs a CUDA GPU")
    # FlexAttention's compile runs in this process: no pool of compile workers left running
    # beside the host-bound layer calls timed after it (read when inductor first compiles)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    from benchmarks.timing import device_prefix, write_json

    result = run(args)
    write_json(args.out, f"{device_prefix(result['device'])}-prefill.json", result)


if __name__ == "__main__":
    main()
