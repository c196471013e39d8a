"""MkDocs hooks for the mla site (registered in mkdocs.yml under `hooks:`).

What they do, in build order:

- on_config: adds every notebook under tutorials/ to the nav (none yet: the build stays green
  and the section appears when the first one lands).
- on_files: puts tutorials/*.ipynb into the site's files, so that mkdocs-jupyter renders them
  (the notebooks live at the repository root, not under docs/).
  It also draws the benchmark plots with matplotlib from benchmarks/results/*.json and adds
  them as generated files (site/assets/benchmarks/*.png, never into the tree);
  benchmark_section embeds them on the benchmarks page.
- on_page_markdown: replaces `{{ mla: EXPR }}` or `{{ mla: EXPR | FORMAT }}` with the value of
  the Python expression EXPR, evaluated in `NAMESPACE` below (the package, its presets, the
  helpers of this file) and formatted with the format spec FORMAT (`,`, `.1%`, ...). Every number
  a page states comes from the code this way; an expression that fails stops the build. Written
  with a backslash, \\{{ mla: ... }}, it is left alone (Markdown then drops the backslash).
- on_post_page: drops the CDN scripts (MathJax 2, require.js, mermaid) that nbconvert writes
  into notebook pages; MathJax 3 from the site typesets notebooks as well. On every page it
  marks the math in table-of-contents entries (\\(...\\) or a notebook's $...$) for MathJax,
  which otherwise leaves the table of contents alone.
- on_post_build: copies MathJax 3's es5 bundle (from the django-static-mathjax wheel) into
  site/assets/mathjax, so math typesets offline.
"""

from __future__ import annotations

import importlib.util
import inspect
import io
import json
import re
import shutil
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TUTORIALS = ROOT / "tutorials"
RESULTS = ROOT / "benchmarks" / "results"
LAB_RESULTS = ROOT / "benchmarks" / "lab" / "results"

# ---- the values pages may quote -------------------------------------------------------------


def _namespace() -> dict:
    import mla
    from mla import memory
    from mla.config import MLAConfig

    ns = {
        "mla": mla,
        "memory": memory,
        "MLAConfig": MLAConfig,
        "V2": MLAConfig.from_preset("deepseek-v2"),
        "V3": MLAConfig.from_preset("deepseek-v3"),
        "LITE": MLAConfig.from_preset("deepseek-v2-lite"),
        "TINY": MLAConfig.from_preset("tiny"),
        "LAYERS": memory.NUM_LAYERS,
        "B67": memory.DEEPSEEK_67B,
        "elems": memory.cache_elements_per_token,
        "flops": memory.attention_flops,
        "source": source,
        "cpp_function": cpp_function,
        "benchmark_section": benchmark_section,
        "cache_table": cache_table,
        "flops_table": flops_table,
        "decode_table": decode_table,
        "crossover_table": crossover_table,
        "measured": measured,
        "measured_section": measured_section,
        "prefill_file_note": prefill_file_note,
        "split_rule": split_rule,
        "split_table": split_table,
        "split_probe_summary": split_probe_summary,
        "default": default,
        "default_page_tiles": default_page_tiles,
        "result": result,
        "row": row,
        "rows_where": rows_where,
        "same_copy": same_copy,
        "decode_tflops": decode_tflops,
        "flashmla_table": flashmla_table,
        "query_tokens_table": query_tokens_table,
        "ragged_table": ragged_table,
        "ragged_change": ragged_change,
        "ragged_kernels_table": ragged_kernels_table,
        "kernel_us": kernel_us,
        "clock_probe_us": clock_probe_us,
        "CLOCK_PROBE": CLOCK_PROBE,
        "NCU_SQ2": NCU_SQ2,
        "NCU_SQ2_L2": NCU_SQ2_L2,
        "CLUSTER_AB": CLUSTER_AB,
        "ncu_metric": ncu_metric,
        "ncu_top_site_share": ncu_top_site_share,
        "EXCESS_PROBE": EXCESS_PROBE,
        "warming_shift": warming_shift,
        "PIECES_PROBE": PIECES_PROBE,
        "RAGGED_KERNELS": RAGGED_KERNELS,
        "RAGGED_NOW": RAGGED_NOW,
        "segments_table": segments_table,
        "layer_table": layer_table,
        "prefill_table": prefill_table,
        "prefill_row": prefill_row,
        "prefill_rows": prefill_rows,
        "H100_PREFILL": H100_PREFILL,
        "generate_table": generate_table,
        "capacity_table": capacity_table,
        "fp8_accuracy_table": fp8_accuracy_table,
        "fp8_decode_section": fp8_decode_section,
        "kib": lambda n: n / 1024,
        "mib": lambda n: n / 1024**2,
    }
    try:
        from mla.kernels import backends, decode

        ns["decode"] = decode
        ns["backends"] = backends
    except Exception:  # noqa: BLE001 - the kernels may not import on every machine
        pass
    from mla import parallel

    ns["parallel"] = parallel
    try:
        from mla.paged import layer as paged_layer

        ns["paged_layer"] = paged_layer
    except Exception:  # noqa: BLE001 - as above: it imports the kernels
        pass
    return ns


def split_table(batches=(1, 4, 16, 64, 132), contexts=(1024, 4096, 32768, 131072)) -> str:
    """Markdown: the split counts `choose_num_kv_splits` picks on the SM count the CPU
    interpreter assumes, over the batch at t = 4,096, then for one sequence over its length; at
    16 heads for the CUDA stage 1 (what `mla_decode` runs on a GPU: 16 heads a program, tiles of
    32) and the Triton one, and at 128 heads for the Triton one and the wgmma one (what runs on
    an H100 / H200: its one-wave rule)."""
    from mla.kernels import decode
    from mla.kernels.backends import CUDA_TILES, sm_count

    sms = sm_count("cpu")
    sm80, sm90 = CUDA_TILES["cuda-sm80"], CUDA_TILES["cuda-sm90"]
    columns = {  # header: keyword arguments beyond (batch, heads, t, SMs)
        "h = 16, CUDA": (16, dict(block_h=sm80[0], block_n=sm80[1])),
        "h = 16, Triton": (16, {}),
        "h = 128, Triton": (128, {}),
        "h = 128, wgmma": (128, dict(block_h=sm90[0], block_n=sm90[1], one_wave=True)),
    }
    head = "| " + " | ".join(columns) + " |"
    rule = "|---:|" + "---:|" * len(columns)
    pick = lambda b, t: " | ".join(  # noqa: E731
        str(decode.choose_num_kv_splits(b, h, t, sms, **kw)) for h, kw in columns.values())
    out = ["| batch (t = 4,096) " + head, rule]
    out += [f"| {b:,} | {pick(b, 4096)} |" for b in batches]
    out += ["", "| length t (batch 1) " + head, rule]
    out += [f"| {t:,} | {pick(1, t)} |" for t in contexts]
    return "\n".join(out)


SPLIT_PROBE = "nvidia-h100-80gb-hbm3-decode-splits-probe-{}.json"


def split_probe_summary(*parts: str):
    """The 16-head split rule against the counts `probe_decode_splits.py` timed (the files
    SPLIT_PROBE.format(part) for each of `parts`, "grid" if none; each ratio within one file's
    run): over the rows where both the rule's count
    (`plan_num_kv_splits` for the CUDA stage 1 at 132 SMs, the H100's) and the count nearest
    `programs_per_sm` programs an SM (the rule before the one-wave cap) were timed, the geometric
    mean of each count's time over the fastest timed count's: floor_auto, nearest_auto (bf16),
    floor_fp8, nearest_fp8 (fp8_ds_mla), with rows_auto and rows_fp8 the rows it is over; at
    (48, 8,192) the rule's time over the nearest count's (at_48_auto, at_48_fp8; the first file
    that has both); shapes: how many (b, t); counts: the fewest and most counts timed a row.
    Ratios as strings of two decimals."""
    from statistics import geometric_mean
    from types import SimpleNamespace

    from mla.kernels import decode
    from mla.kernels.backends import CUDA_TILES

    defaults = {k: v.default for k, v in inspect.signature(decode.choose_num_kv_splits).parameters.items()}
    block_n = CUDA_TILES["cuda-sm80"][1]
    sms, per_sm = 132, split_rule().programs_per_sm
    ratios: dict[str, list[float]] = {}
    at_48, shapes, counts = {}, set(), []
    for part in parts or ("grid",):
        for r in result(SPLIT_PROBE.format(part))["rows"]:
            if r["h"] != 16 or r["kernel"] != "cuda-sm80":
                continue
            b, t, layout = r["b"], r["t"], r["kv_cache_dtype"]
            by_count = {int(k): v for k, v in r["time_us"].items()}
            shapes.add((b, t))
            counts.append(len(by_count))
            most = max(1, min(defaults["max_splits"], t // (defaults["min_tiles_per_split"] * block_n)))
            rule = decode.plan_num_kv_splits("cuda-sm80", b, 16, t, sms, kv_cache_dtype=layout)
            nearest = max(1, min(most, (per_sm * sms + b // 2) // b))
            if rule not in by_count or nearest not in by_count:
                continue
            kind = "auto" if layout == "auto" else "fp8"
            best = min(by_count.values())
            ratios.setdefault(f"floor_{kind}", []).append(by_count[rule] / best)
            ratios.setdefault(f"nearest_{kind}", []).append(by_count[nearest] / best)
            if (b, t) == (48, 8192):
                at_48.setdefault(kind, by_count[rule] / by_count[nearest])
    fields = {k: f"{geometric_mean(v):.2f}" for k, v in ratios.items()}
    fields.update({f"at_48_{k}": f"{v:.2f}" for k, v in at_48.items()})
    fields.update(rows_auto=len(ratios["floor_auto"]), rows_fp8=len(ratios["floor_fp8"]),
                  shapes=len(shapes), counts=f"{min(counts)}-{max(counts)}")
    return SimpleNamespace(**fields)


def default_page_tiles() -> bool:
    """Whether the paged tier's default page size is a multiple of the decode kernel's default
    BLOCK_N at every head count (so the kernel reads the block table once a tile)."""
    from mla.kernels import decode
    from mla.paged import PagedMLA

    page = default(PagedMLA, "block_size")
    return all(page % decode.default_config(h)["BLOCK_N"] == 0 for h in (1, 16, 32, 64, 128))


def default(obj, name: str):
    """The default value of keyword `name` of the callable `obj` (a class: its __init__)."""
    return inspect.signature(obj).parameters[name].default


def split_rule():
    """The constants of `mla.kernels.decode.choose_num_kv_splits`, read from the code: keyword
    defaults from its signature, the rest by asking the function itself on inputs where one
    constant decides the answer (so a page quoting them follows any change to the heuristic).

    Fields: max_splits, min_tiles_per_split, programs_per_sm (the small-head-block target a SM),
    busy (the share of the SMs' waves the 64-head rule asks for), big_block_h (the largest
    BLOCK_H, the one the second rule is for), small_block_h (the smallest), cpu_sms (the SM count
    the CPU interpreter assumes).
    """
    from types import SimpleNamespace

    from mla.kernels import decode
    from mla.kernels.backends import sm_count

    choose = decode.choose_num_kv_splits
    defaults = {k: v.default for k, v in inspect.signature(choose).parameters.items()}
    big = decode.default_config(1 << 20)["BLOCK_H"]
    small = decode.default_config(1)["BLOCK_H"]
    huge = 1 << 30
    # one program (batch 1, one small head block), one SM, no cap: the split count is the target
    programs_per_sm = choose(1, small, huge, 1, max_splits=huge)
    # one program of the big head block on 1000 SMs: the first count that keeps `busy` of them
    # busy is busy * 1000
    busy = choose(1, big, huge, 1000, max_splits=huge) / 1000
    return SimpleNamespace(max_splits=defaults["max_splits"],
                           min_tiles_per_split=defaults["min_tiles_per_split"],
                           programs_per_sm=programs_per_sm, busy=busy, big_block_h=big,
                           small_block_h=small, cpu_sms=sm_count("cpu"))


def source(dotted: str) -> str:
    """The source of a Python object `package.module.name` (or `module.Class.method`), fenced."""
    import importlib

    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name)
        break
    else:
        raise PluginError(f"source({dotted!r}): no importable module")
    obj = getattr(obj, "fn", obj)  # a triton.jit function wraps the Python one
    text = inspect.getsource(obj)
    lines = text.splitlines()
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    body = "\n".join(line[indent:] for line in lines)
    file = Path(inspect.getsourcefile(obj)).resolve()
    file = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file
    return f'```python title="{file}"\n{body}\n```'


def cpp_function(path: str, signature: str) -> str:
    """The C++/CUDA block of `path` that starts at the first line containing `signature` and ends
    at its matching closing brace, fenced. (csrc/ has no snippet markers; this finds by name.)"""
    lines = (ROOT / path).read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if signature in line), None)
    if start is None:
        raise PluginError(f"cpp_function: {signature!r} not found in {path}")
    # back up over the template line and leading comment of the definition
    while start > 0 and lines[start - 1].lstrip().startswith(("template", "//")):
        start -= 1
    depth, seen, end = 0, False, None
    for i in range(start, len(lines)):
        code = lines[i].split("//", 1)[0]
        depth += code.count("{") - code.count("}")
        seen = seen or "{" in code
        if seen and depth == 0:
            end = i
            break
    if end is None:
        raise PluginError(f"cpp_function: no closing brace for {signature!r} in {path}")
    lang = "cuda" if path.endswith(".cu") else "cpp"
    body = "\n".join(lines[start:end + 1])
    return f'```{lang} title="{path}"\n{body}\n```'


def _fmt_bytes(n: float) -> str:
    if n >= 1024**2:
        return f"{n / 1024**2:,.2f} MiB"
    if n >= 1024:
        return f"{n / 1024:,.1f} KiB"
    return f"{n:,.0f} B"


def cache_table(preset: str, bytes_per_element: float = 2.0) -> str:
    """A markdown table: cached elements per token per layer and bytes per token (all layers)."""
    from mla import memory
    from mla.config import MLAConfig

    cfg = MLAConfig.from_preset(preset)
    layers = memory.NUM_LAYERS[preset]
    h = cfg.num_heads
    schemes = [("mha", f"MHA ({h} heads)"), ("gqa-8", "GQA, 8 groups"), ("mqa", "MQA"),
               ("mla", "MLA (ours: kv_c_normed + k_pe)"),
               ("mla-expanded", "MLA keys and values up-projected")]
    mla_elems = memory.cache_elements_per_token(cfg, "mla")
    out = ["| scheme | elements / token / layer | bytes / token / layer | "
           f"bytes / token ({layers} layers) | vs MLA |",
           "|---|---:|---:|---:|---:|"]
    for scheme, label in schemes:
        e = memory.cache_elements_per_token(cfg, scheme)
        out.append(f"| {label} | {e:,} | {_fmt_bytes(e * bytes_per_element)} | "
                   f"{_fmt_bytes(e * bytes_per_element * layers)} | {e / mla_elems:,.2f}x |")
    return "\n".join(out)


def flops_table(preset: str, cases=((1, 1024), (1, 4096), (1, 32768), (512, 4096),
                                    (4096, 4096), (4096, 32768))) -> str:
    """A markdown table of attention FLOPs, up-projected vs absorbed, for s new over t tokens."""
    from mla import memory
    from mla.config import MLAConfig

    cfg = MLAConfig.from_preset(preset)
    out = ["| new tokens s | context t (incl. new) | up-projected (GFLOP) | absorbed (GFLOP) | "
           "absorbed / up-projected |", "|---:|---:|---:|---:|---:|"]
    for s, t in cases:
        f = memory.attention_flops(cfg, s, t)
        out.append(f"| {s:,} | {t:,} | {f.up_projected / 1e9:,.3f} | {f.absorbed / 1e9:,.3f} | "
                   f"{f.absorbed / f.up_projected:,.3f} |")
    return "\n".join(out)


def decode_table(preset: str, contexts=(1024, 4096, 32768), bytes_per_element: float = 2.0) -> str:
    """Markdown: one decode token of one sequence over t cached tokens, one layer, bf16.

    FLOPs from mla.memory.attention_flops; bytes = the cache read once, kv_b_proj's weights,
    plus (naive only) the up-projected keys and values written and read back once.
    """
    from mla import memory
    from mla.config import MLAConfig

    cfg = MLAConfig.from_preset(preset)
    h, d, r, v, c = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
    weights = h * (d + v) * c * bytes_per_element
    out = ["| t | naive FLOPs | absorbed FLOPs | ratio | naive bytes | absorbed bytes |",
           "|---:|---:|---:|---:|---:|---:|"]
    for t in contexts:
        f = memory.attention_flops(cfg, 1, t)
        cache = t * (c + r) * bytes_per_element
        kv = 2 * t * h * (d + v) * bytes_per_element  # K_nope and V written, then read
        out.append(f"| {t:,} | {f.up_projected / 1e9:,.2f} G | {f.absorbed / 1e9:,.3f} G | "
                   f"{f.up_projected / f.absorbed:,.0f}x | {_fmt_bytes(cache + weights + kv)} | "
                   f"{_fmt_bytes(cache + weights)} |")
    return "\n".join(out)


def crossover_table(presets=("deepseek-v2", "deepseek-v3"), contexts=(0, 1024, 4096, 32768)) -> str:
    """Markdown: the fewest new tokens for which up-projection needs fewer FLOPs (mla.memory)."""
    from mla import memory
    from mla.config import MLAConfig

    out = ["| cached context | " + " | ".join(presets) + " |",
           "|---:|" + "---:|" * len(presets)]
    cfgs = [MLAConfig.from_preset(p) for p in presets]
    for ctx in contexts:
        out.append(f"| {ctx:,} | " + " | ".join(f"{memory.prefill_crossover(cfg, ctx):,}"
                                               for cfg in cfgs) + " |")
    return "\n".join(out)


def _decode_results() -> Path | None:
    """benchmarks/results/h200-decode.json, or None when it is not committed."""
    path = RESULTS / "h200-decode.json"
    return path if path.is_file() else None


def measured(key: str):
    """A field of the committed decode results (see _decode_results), or None without them."""
    path = _decode_results()
    return None if path is None else json.loads(path.read_text()).get(key)


def measured_section() -> str:
    """The absorption page's "Measured" section: from the committed decode and prefill
    results, or a plain statement that there are none."""
    path = _decode_results()
    if path is None and not (RESULTS / PREFILL_RESULTS).is_file() and _crossover_results() is None:
        return ("**Not yet measured.** The GPU benchmark (`python -m mla bench`) writes "
                "`benchmarks/results/*.json`; once a result is committed, [Kernels and "
                "benchmarks](../benchmarks.md) shows it, and this section states the measured "
                "ceilings from it. Nothing on this page is a measured time.")
    if path is None:
        return ("No decode results are committed, so this page states no measured ceilings."
                "\n\n" + prefill_section())
    from mla.config import MLAConfig

    data = json.loads(path.read_text())
    v3 = MLAConfig.from_preset("deepseek-v3")
    per_head = (2 * v3.kv_lora_rank + v3.qk_rope_head_dim) / v3.latent_dim
    ridge = data["matmul_TFLOPs"] * 1e12 / (data["copy_GBps"] * 1e9)
    lines = [
        f"From `{path.relative_to(ROOT).as_posix()}` ({data.get('device', 'GPU')}), measured in "
        f"one run: copy bandwidth {data['copy_GBps']:,.0f} GB/s, bf16 matmul "
        f"{data['matmul_TFLOPs']:,.0f} TFLOP/s, so the ridge point is "
        f"**{ridge:,.0f} FLOPs/byte**. Absorbed decode at 16 heads "
        f"({16 * per_head:,.0f} FLOPs/byte) is memory bound there, at 128 heads "
        f"({128 * per_head:,.0f}) compute bound, as the `bound` column of the decode rows on "
        "[Kernels and benchmarks](../benchmarks.md) records.", "", prefill_section()]
    return "\n".join(lines)


PREFILL_RESULTS = "h200-prefill.json"
H100_PREFILL = "nvidia-h100-80gb-hbm3-prefill.json"  # the layer with every change the H200 file lacks
CROSSOVER_RESULTS = "h200-prefill-crossover.json"  # benchmarks/lab/prefill_crossover.py's


def _is_crossover_run(data: dict) -> bool:
    """Whether a prefill result times the paged tier's two prefill paths against each other
    (benchmarks/lab/prefill_crossover.py: rows of ``up_project_ms``, ``absorbed_ms``) rather
    than the layer against SDPA and FlexAttention (benchmarks/bench_prefill.py: rows of
    ``layer_ms``, ``sdpa_*_ms``, ``flex_ms``)."""
    return any("up_project_ms" in row for row in data.get("rows", []))


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _crossover_results() -> tuple[Path, dict] | None:
    """(path, data) of the committed crossover run of the two prefill paths: the prefill result
    when it is one, else benchmarks/lab/results/h200-prefill-crossover.json; None without one."""
    for path in (RESULTS / PREFILL_RESULTS, LAB_RESULTS / CROSSOVER_RESULTS):
        data = _load(path)
        if data is not None and _is_crossover_run(data):
            return path, data
    return None


def _prefill_crossovers(data: dict) -> dict[int, int | None]:
    """{batch: fewest new tokens from which up-projection was faster at every larger s} from a
    crossover run: its `measured` block ("b1": {"up_project_wins_from": 64}, ...) where it has
    one, else worked out from its rows. None: up-projection never won for good."""
    found: dict[int, int | None] = {}
    for key, value in (data.get("measured") or {}).items():
        batch = re.fullmatch(r"b(\d+)", key)
        if batch and isinstance(value, dict) and "up_project_wins_from" in value:
            found[int(batch.group(1))] = value["up_project_wins_from"]
    if found:
        return dict(sorted(found.items()))
    by_batch: dict[int, list[dict]] = {}
    for row in data["rows"]:
        by_batch.setdefault(row["b"], []).append(row)
    for b, rows in sorted(by_batch.items()):
        rows.sort(key=lambda r: r["s"])
        found[b] = None
        for row in reversed(rows):  # the longest run of up-projection wins that reaches the end
            if row["up_project_ms"] >= row["absorbed_ms"]:
                break
            found[b] = row["s"]
    return found


def prefill_file_note() -> str:
    """For the benchmarks page: what the committed prefill result measures when it is a crossover
    run rather than bench_prefill.py's output ('' otherwise)."""
    data = _load(RESULTS / PREFILL_RESULTS)
    if data is None or not _is_crossover_run(data):
        return ""
    return (f"The committed `{PREFILL_RESULTS}` is a measurement of the paged tier's two prefill "
            "paths against each other (`benchmarks/lab/prefill_crossover.py`), not this "
            "benchmark's output.")


def prefill_section() -> str:
    """What the committed prefill results say: the crossover of the paged tier's two prefill
    paths (a crossover run) and the layer against SDPA (bench_prefill.py's result), each where
    it is committed, or that prefill has not been timed."""
    parts = []
    crossover = _crossover_results()
    if crossover is not None:
        parts.append(_crossover_sentences(*crossover))
    data = _load(RESULTS / PREFILL_RESULTS)
    if data is not None and not _is_crossover_run(data):
        parts.append(_contenders_sentence(RESULTS / PREFILL_RESULTS, data))
    if not parts:
        return ("The prefill crossover has not been timed (no "
                f"`benchmarks/results/{PREFILL_RESULTS}` is committed); the FLOP count above is "
                "the only statement this page makes about it.")
    return " ".join(parts) + _threshold_sentence(_prefill_crossovers(crossover[1]) if crossover else {})


def _crossover_sentences(path: Path, data: dict) -> str:
    from mla import memory
    from mla.config import MLAConfig

    preset = data.get("config", "deepseek-v3")
    cfg = MLAConfig.from_preset(preset)
    context = data.get("context")
    model = data.get("model_crossover")
    if model is None and context is not None:
        model = memory.prefill_crossover(cfg, context)
    crossovers = _prefill_crossovers(data)

    def say(b, s):
        who = "one sequence" if b == 1 else f"a batch of {b}"
        return (f"from **{s:,}** new tokens on for {who}" if s is not None else
                f"at no length measured for {who}")

    found = [say(b, s) for b, s in crossovers.items()]
    where = (f"{context:,} cached tokens" if context is not None else "a cached context")
    out = [
        f"The prefill crossover was timed as well, in `{path.relative_to(ROOT).as_posix()}` "
        f"({data.get('device', 'GPU')}, {preset} sizes, {data.get('dtype', '')}, {where}; "
        f"what was timed: `{data.get('timed', 'both prefill paths')}`). Up-projection was faster "
        + (", ".join(found[:-1]) + " and " + found[-1] if len(found) > 1 else "".join(found))
        + (f", where the FLOP count above puts the crossover at **{model:,}**." if model else ".")]
    measured_lower = model and all(s is not None and s < model for s in crossovers.values())
    if measured_lower:
        out.append(
            "Time crosses over earlier than FLOPs do: the absorbed path works in float32 "
            "(`attend_absorbed` above), at \\(2 d_c + d_h^R\\) = "
            f"{2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim:,} multiply-adds for every score (its "
            "dot product and its share of the output), "
            "which costs more than its FLOP count says, while the up-projection is one bf16 "
            "GEMM, which costs less.")
    return " ".join(out)


def _contenders_sentence(path: Path, data: dict) -> str:
    """bench_prefill.py's result in one sentence: the layer's whole call over the SDPA layer's
    (whole call against whole call; timed in turn where the file has that) at the shapes where
    both ran; in a result without the SDPA layer, the layer's whole call over the fastest SDPA
    backend's attention alone."""
    paired = [r["layer_over_sdpa_layer_paired"] for r in data["rows"] if r.get("layer_over_sdpa_layer_paired")]
    like = paired or [r["layer_over_sdpa_layer"] for r in data["rows"] if r.get("layer_over_sdpa_layer")]
    mixed = [r["layer_over_best_sdpa"] for r in data["rows"] if r.get("layer_over_best_sdpa")]
    if like:
        span = (f": the layer's whole call took {min(like):.2f}x to {max(like):.2f}x the time of "
                "the same layer with its attention done by SDPA over the whole up-projected "
                "sequence (projections included on both sides"
                + ("; the two timed in turn)" if paired else ")"))
    elif mixed:
        span = (f": the layer's whole call (projections included) took {min(mixed):.2f}x to "
                f"{max(mixed):.2f}x the time of the fastest SDPA backend's attention alone")
    else:
        span = ""
    return (f"The prefill benchmark, `{path.relative_to(ROOT).as_posix()}` "
            f"({data.get('device', 'GPU')}, {data.get('config', 'deepseek-v3')} sizes, "
            f"{data.get('dtype', '')}), times the paged layer against torch's SDPA and "
            f"FlexAttention at {len(data['rows'])} shapes{span}.")


def _threshold_sentence(crossovers: dict[int, int | None]) -> str:
    try:
        from mla.paged import layer as paged_layer
    except Exception:  # noqa: BLE001 - the kernels may not import on every machine
        return ""
    constant = paged_layer.PREFILL_CROSSOVER
    same = [b for b, s in crossovers.items() if s == constant]
    who = ("" if not same else "one sequence" if same[0] == 1 else f"a batch of {same[0]}")
    origin = f", the measured crossover for {who}" if who else ""
    return (f" The paged tier's default threshold is `PREFILL_CROSSOVER` = **{constant:,}** "
            f"(`mla/paged/layer.py`){origin}: under its default `prefill=\"auto\"`, rows with "
            "fewer new tokens attend absorbed and longer ones up-project. "
            "[Kernels and benchmarks](../benchmarks.md#plots) plots the prefill times.")


# ---- figures and tables read from one committed result file --------------------------------
#
# A page quotes a measured figure as {{ mla: row("h200-layer.json", b=8)["paged_eager_us"] | .0f }}
# and shows a table as {{ mla: layer_table() }}: the numbers come from the JSON each time the
# site is built, and a figure the file no longer holds stops the build.


def result(name: str) -> dict:
    """The committed result file benchmarks/results/<name> (or benchmarks/lab/results/<name>)."""
    for folder in (RESULTS, LAB_RESULTS):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())
    raise PluginError(f"result({name!r}): not in benchmarks/results/ or benchmarks/lab/results/")


def _matching(name: str, key: str, match: dict, min_b: int | None = None) -> list[dict]:
    """The rows of result `name`'s list `key` whose fields equal `match` (and, with `min_b`, of at
    least that many sequences)."""
    return [r for r in result(name)[key]
            if (min_b is None or r["b"] >= min_b) and all(r.get(k) == v for k, v in match.items())]


def row(name: str, key: str = "rows", **match) -> dict:
    """The one row of result `name`'s list `key` whose fields equal `match` (b=64, h=128, ...)."""
    rows = _matching(name, key, match)
    if len(rows) != 1:
        raise PluginError(f"row({name!r}, {match}): {len(rows)} rows match, expected one")
    return rows[0]


def rows_where(name: str, key: str = "rows", min_b: int = 1, **match) -> list[dict]:
    """Every row of result `name`'s list `key` whose fields equal `match`, of at least `min_b`
    sequences (none matching is an error, as in row)."""
    rows = _matching(name, key, match, min_b)
    if not rows:
        raise PluginError(f"rows_where({name!r}, min_b={min_b}, {match}): no row matches")
    return rows


def same_copy(tokens: int, kv_cache_dtype: str = "auto") -> dict:
    """`bench concat`'s row of `tokens` on a cache of `kv_cache_dtype` in the H100 run with the
    same-size copy, with `copy_share`: that copy's bandwidth over the 2 GiB copy's."""
    r = row("nvidia-h100-80gb-hbm3-concat-same-copy.json", tokens=tokens, kv_cache_dtype=kv_cache_dtype)
    return {**r, "copy_share": r["share_of_copy"] / r["share_of_same_copy"]}


def decode_tflops(b: int, t: int, h: int, field: str = "time_us", name: str = "h200-decode.json") -> float:
    """Attention TFLOP/s of decode result `name`'s row (b, t, h, one query token): its FLOPs (the
    floor's compute term, floor_us x matmul_TFLOPs when compute bound, recomputed here) over
    `field` (time_us: ours, flashmla_us: FlashMLA's)."""
    from mla.config import MLAConfig

    v3 = MLAConfig.from_preset("deepseek-v3")
    flops = 2 * b * h * t * (v3.kv_lora_rank + v3.qk_rope_head_dim + v3.kv_lora_rank)
    return flops / (row(name, b=b, t=t, h=h, s_q=1)[field] * 1e-6) / 1e12


def _table(rows: list[dict], columns: list[tuple[str, object]]) -> str:
    """Markdown: one line a row, each column (header, row -> text); a cell whose field is
    missing or null reads n/a."""
    out = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---:|" * len(columns)]
    for r in rows:
        cells = []
        for _, cell in columns:
            try:
                cells.append(cell(r))
            except (KeyError, TypeError):
                cells.append("n/a")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def flashmla_table(name: str = "h200-decode.json") -> str:
    """Markdown: mla_decode beside FlashMLA at every shape of one query token a sequence, times
    in µs with their multiple of the floor, and FlashMLA's time over ours."""
    rows = [r for r in result(name)["rows"] if r.get("s_q", 1) == 1]
    rows.sort(key=lambda r: (r["h"], r["b"] * r["t"], r["b"]))
    return _table(rows, [
        ("b", lambda r: f"{r['b']:,}"), ("t", lambda r: f"{r['t']:,}"), ("h", lambda r: str(r["h"])),
        ("floor (µs)", lambda r: f"{r['floor_us']:,.1f}"),
        ("mla (µs, x floor)", lambda r: f"{r['time_us']:,.1f} ({r['time_us'] / r['floor_us']:.2f})"),
        ("FlashMLA (µs, x floor)",
         lambda r: f"{r['flashmla_us']:,.1f} ({r['flashmla_us'] / r['floor_us']:.2f})"),
        ("FlashMLA / mla", lambda r: f"**{r['flashmla_over_mla']:.2f}**"),
    ])


def query_tokens_table(name: str = "h200-decode-sq.json") -> str:
    """Markdown: s_q = 2 and 4 new tokens a sequence, the wgmma stage 1 and the Triton kernel
    beside FlashMLA, times in µs. A run whose default was Triton timed the wgmma kernel forced
    (``sm90_sq_time_us``); one whose default is the wgmma kernel has no Triton time."""
    def wgmma(r):
        return r["sm90_sq_time_us"] if "sm90_sq_time_us" in r else r["time_us"]

    def triton(r):
        return f"{r['time_us']:,.1f}" if r["config"]["kernel"] == "triton" else "-"

    rows = [r for r in result(name)["rows"] if r.get("s_q", 1) > 1]
    rows.sort(key=lambda r: (r["s_q"], r["h"], r["b"] * r["t"], r["b"]))
    return _table(rows, [
        ("s_q", lambda r: str(r["s_q"])),
        ("b", lambda r: f"{r['b']:,}"), ("t", lambda r: f"{r['t']:,}"), ("h", lambda r: str(r["h"])),
        ("floor (µs)", lambda r: f"{r['floor_us']:,.1f}"),
        ("mla, wgmma (µs)", lambda r: f"{wgmma(r):,.1f}"),
        ("Triton (µs)", triton),
        ("FlashMLA (µs)", lambda r: f"{r['flashmla_us']:,.1f}"),
        ("FlashMLA / mla", lambda r: f"**{r['flashmla_us'] / wgmma(r):.2f}**"),
    ])


RAGGED_RUNS = ("nvidia-h100-80gb-hbm3-decode-ragged-main.json", "nvidia-h100-80gb-hbm3-decode-ragged-dealall.json")
# the ragged probe with --kernels in the tree of NOTES row 114: the one-split merge's rows together
RAGGED_NOW = "nvidia-h100-80gb-hbm3-decode-ragged-rows.json"


# the first columns of the tables of probe rows by batch
CASE_COLUMN = ("batch (tokens a sequence)", lambda r: r["case"])
SPLITS_COLUMN = ("splits", lambda r: str(r["num_kv_splits"]))


def by_case(name: str) -> dict[str, dict]:
    """A probe result's rows by their ``case``."""
    return {r["case"]: r for r in result(name)["rows"]}


def ragged_table(before: str = RAGGED_RUNS[0], after: str = RAGGED_RUNS[1], now: str = RAGGED_NOW) -> str:
    """Markdown: the ragged-batch probe (``benchmarks/lab/probe_decode_ragged.py``) of two trees
    on one machine (by default RAGGED_RUNS: the cut, then the dealt stage 1), case by case: the
    floor of the batch's tokens, both trees' times and FlashMLA's in the second run, in µs, and
    FlashMLA's time over each tree's; then FlashMLA's over ours in a later run, ``now`` (by
    default the tree of NOTES row 114, whose one-split merge takes rows together, on another
    machine of the same kind)."""
    first, last = by_case(before), by_case(now)
    rows = [dict(r, before_us=first[r["case"]]["time_us"], before_fm_us=first[r["case"]]["flashmla_us"],
                 now_ratio=last[r["case"]]["flashmla_over_mla"])
            for r in result(after)["rows"] if r["case"] in first and r["case"] in last]
    return _table(rows, [
        CASE_COLUMN, SPLITS_COLUMN,
        ("floor (µs)", lambda r: f"{r['floor_us']:,.1f}"),
        ("cut (µs)", lambda r: f"{r['before_us']:,.1f}"),
        ("dealt (µs)", lambda r: f"{r['time_us']:,.1f}"),
        ("FlashMLA (µs)", lambda r: f"{r['flashmla_us']:,.1f}"),
        ("FlashMLA / cut", lambda r: f"{r['before_fm_us'] / r['before_us']:.2f}"),
        ("FlashMLA / dealt", lambda r: f"**{r['flashmla_over_mla']:.2f}**"),
        ("FlashMLA / now", lambda r: f"{r['now_ratio']:.2f}"),
    ])


def ragged_change(case: str, field: str = "time_us") -> float:
    """The ragged probe's `field` at `case` in the dealt run over the cut's (RAGGED_RUNS), as a
    change in percent."""
    before, after = (row(name, case=case)[field] for name in RAGGED_RUNS)
    return (after / before - 1) * 100


RAGGED_KERNELS = "nvidia-h100-80gb-hbm3-decode-ragged-kernels.json"


def _kernels_named(times: dict[str, float], part: str) -> float:
    """The summed time a call (µs) of the kernels in ``times`` whose name holds ``part``."""
    return sum(us for name, us in times.items() if part in name)


def kernel_us(r: dict, who: str, part: str) -> float:
    """From a ragged-probe row run with ``--kernels``: the time a call (µs) of ``who``'s
    ("mla" or "flashmla") kernel whose name holds ``part``."""
    return _kernels_named(r[f"{who}_kernels_us"], part)


CLOCK_PROBE = "nvidia-h100-80gb-hbm3-decode-clock-probe-sq12.json"


def clock_probe_us(s_q: int, who: str, part: str, b: int = 128, t: int = 8192, name: str = CLOCK_PROBE) -> float:
    """From the clock probe's run ``name`` (128 heads): the time a call (µs) of ``who``'s ("mla"
    or "flashmla") kernel whose name holds ``part``, at b sequences of t tokens and s_q new ones."""
    return _kernels_named(row(name, key="kernels", b=b, t=t, h=128, s_q=s_q, kernel=who)["kernels_us"], part)


NCU_SQ2 = "nvidia-h100-80gb-hbm3-ncu-64x4096x128-sq2.json"  # ncu_decode.sh at s_q 2, ours and FlashMLA's
NCU_SQ2_L2 = "nvidia-h100-80gb-hbm3-ncu-64x4096x128-sq2-source.json"  # the same, L2 sectors and source pages
CLUSTER_AB = "nvidia-h100-80gb-hbm3-decode-ab30-cluster.json"  # a sequence's head blocks as one cluster
EXCESS_PROBE = "nvidia-h100-80gb-hbm3-decode-bench-excess-probe.json"  # probe_bench_excess.py
PIECES_PROBE = "nvidia-h100-80gb-hbm3-decode-pieces-probe.json"  # probe_pieces.py


def ncu_metric(subject: str, metric: str, name: str = NCU_SQ2) -> float:
    """Nsight Compute's ``metric`` for ``subject`` ("mla-auto", "flashmla-auto") in the summary
    ``name`` that ``ncu_decode.py --summarize`` wrote."""
    subjects = result(name)["subjects"]
    if metric not in subjects.get(subject, {}):
        raise PluginError(f"ncu_metric: {name} has no {metric!r} for {subject!r}")
    return subjects[subject][metric]


def ncu_top_site_share(subject: str, name: str = NCU_SQ2_L2) -> float:
    """The share of ``subject``'s stall samples at its most-sampled instruction, in the source
    page summary ``name`` (``ncu_decode.py``'s ``top_sites``)."""
    source = result(name)["sources"][subject]
    return source["top_sites"][0]["samples"] / sum(source["stall_samples"].values())


def warming_shift(name: str = EXCESS_PROBE) -> float:
    """The largest relative change of a call's time, ours or FlashMLA's, when the excess probe
    warms the address translations or the block table after the L2 clear (``clean+tlb``,
    ``clean+table`` against ``clean``)."""
    windows = result(name)["windows"]
    same = ("b", "t", "h", "s_q", "kernel")
    clean = {tuple(w[k] for k in same): w["time_us"] for w in windows if w["way"] == "clean"}
    return max(abs(w["time_us"] / clean[tuple(w[k] for k in same)] - 1)
               for w in windows if w["way"] in ("clean+tlb", "clean+table"))


def ragged_kernels_table(name: str = RAGGED_NOW, before: str = RAGGED_KERNELS) -> str:
    """Markdown: each kernel's time a call in the ragged probe's ``--kernels`` run ``name``: our
    stage 1 and merge beside FlashMLA's decode and combine, and the merge in the run ``before``
    (its one-split rows one after another)."""
    first = by_case(before)
    rows = [dict(r, merge_before=kernel_us(first[r["case"]], "mla", "merge_dealt"))
            for r in result(name)["rows"] if r["case"] in first]
    return _table(rows, [
        CASE_COLUMN, SPLITS_COLUMN,
        ("stage 1 (µs)", lambda r: f"{kernel_us(r, 'mla', 'mla_decode_sm90_kernel'):,.1f}"),
        ("merge, rows in series (µs)", lambda r: f"{r['merge_before']:,.1f}"),
        ("merge (µs)", lambda r: f"**{kernel_us(r, 'mla', 'merge_dealt'):,.1f}**"),
        ("FlashMLA decode (µs)", lambda r: f"{kernel_us(r, 'flashmla', 'splitkv_mla'):,.1f}"),
        ("FlashMLA combine (µs)", lambda r: f"{kernel_us(r, 'flashmla', 'combine'):,.1f}"),
    ])


SEGMENTS = "nvidia-h100-80gb-hbm3-decode-sm90-timeline-segments.json"


def segments_table(name: str = SEGMENTS) -> str:
    """Markdown: the wgmma stage 1's timeline by segment (``timeline_decode_sm90.py --cases``):
    a CTA's segments and each stage's sum over them, in µs, each the median over the CTAs; the
    busiest CTA's tiles, and the span from the first start to the last end."""
    return _table(result(name)["rows"], [
        CASE_COLUMN, ("tiles, busiest CTA", lambda r: str(r["tiles_per_cta"])),
        ("segments", lambda r: f"{r['segments_median']:.0f}"),
        ("prologue (µs)", lambda r: f"{r['seg_prologue_us']:.1f}"), ("first S (µs)", lambda r: f"{r['seg_first_s_us']:.1f}"),
        ("loop (µs)", lambda r: f"{r['seg_loop_us']:.1f}"), ("output (µs)", lambda r: f"{r['seg_output_us']:.1f}"),
        ("span (µs)", lambda r: f"{r['span_us']:.1f}"),
    ])


def layer_table(name: str = "h200-layer.json") -> str:
    """Markdown: one layer's decode step, the absorbed and paged tiers eager and the paged
    tier's `decode_step` eager and replayed from a CUDA graph."""
    data = result(name)
    return _table(data["rows"], [
        ("b", lambda r: str(r["b"])), ("t", lambda r: f"{r['t']:,}"),
        ("absorbed, eager (µs)", lambda r: f"{r['absorbed_eager_us']:,.0f}"),
        ("paged, eager (µs)", lambda r: f"{r['paged_eager_us']:,.0f}"),
        ("paged / absorbed", lambda r: f"{r['paged_eager_us'] / r['absorbed_eager_us']:.2f}"),
        ("`decode_step`, eager (µs)", lambda r: f"{r['paged_step_eager_us']:,.0f}"),
        ("`decode_step`, CUDA graph (µs)", lambda r: f"{r['paged_graph_us']:,.0f}"),
        ("decode kernel, splits", lambda r: f"`{r['decode_kernel']}`, {r['num_kv_splits']}"),
    ])


def prefill_row(b: int, s: int, t: int = 0, name: str = PREFILL_RESULTS) -> dict:
    """The row of the committed prefill result for b sequences of s new tokens over t cached."""
    return row(name, b=b, s=s, t=t)


def prefill_rows(*, t: int = 0, min_s: int = 0, max_s: int | None = None,
                 name: str = PREFILL_RESULTS) -> list[dict]:
    """The committed prefill result's rows over t cached tokens (0: the prompts) with
    min_s <= s <= max_s new tokens a sequence, for a page's min(...) / max(...) over them."""
    rows = [r for r in result(name)["rows"]
            if r.get("t", 0) == t and r["s"] >= min_s and (max_s is None or r["s"] <= max_s)]
    if not rows:
        raise PluginError(f"prefill_rows(t={t}, min_s={min_s}, max_s={max_s}): no row in {name}")
    return rows


# bench_prefill.py's contenders as the prefill tables show them: (key, header). The layer's
# whole call under its default prefill_backend ("auto") and forced to the kernel, the layer
# with SDPA attention; then attention alone, the layer's under both choices, SDPA's backends
# and FlexAttention. A result file written before a contender existed shows "-" in its column.
_PREFILL_WHOLE = (("layer", "layer, auto"), ("layer_triton", "layer, triton"),
                  ("sdpa_layer", "SDPA layer"))
_PREFILL_ATTENTION = (("layer_attention", "ours, auto"), ("layer_attention_triton", "ours, triton"),
                      ("sdpa_cudnn", "cuDNN"), ("sdpa_efficient", "efficient"),
                      ("sdpa_flash", "flash"), ("flex", "FlexAttention"))


def _prefill_missing(r: dict, key: str) -> str:
    """The cell of a contender with no figure in row r: "out of memory" or "n/a" where it ran
    and failed (its ``*_error``), "-" where it did not run at that shape."""
    error = r.get(key + "_error")
    if error is None:
        return "-"
    return "out of memory" if "memory" in str(error) else "n/a"


def _prefill_ratio(r: dict, top: str, bottom: str, field: str = "_ms") -> str:
    """r[top + field] / r[bottom + field] to two places, "-" where either is missing."""
    a, b = r.get(top + field), r.get(bottom + field)
    return f"{a / b:.2f}" if a and b else "-"


def _attention_headers(columns: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """The attention-alone columns, the first header saying where the group starts."""
    return [(("attention: " if i == 0 else "") + header, cell) for i, (header, cell) in enumerate(columns)]


def _paired_column(rows: list[dict], key: str, header: str) -> list[tuple[str, object]]:
    """A column of the ratio ``key`` (two calls timed in turn), where the result has one."""
    if not any(r.get(key) for r in rows):
        return []
    return [(header, lambda r: f"{r[key]:.2f}" if r.get(key) else _prefill_missing(r, key))]


def prefill_table(name: str = "h200-prefill.json", what: str = "ms") -> str:
    """Markdown: bench_prefill.py's rows, one line a shape. what="ms": the whole calls (the
    layer under "auto" and "triton", the SDPA layer, the torch layer where the result has it)
    and attention alone (the layer's under
    both, each SDPA backend, FlexAttention) in ms (TFLOP/s), with the like-for-like ratios;
    what="memory": the same contenders' peak memory in MiB, and the layer's over cuDNN's."""
    rows = result(name)["rows"]
    shape = [("b x s (+ t cached)",
              lambda r: f"{r['b']} x {r['s']:,}" + (f" + {r['t']:,}" if r.get("t") else ""))]
    # the few-line torch layer (prompts), in results that have it
    whole = _PREFILL_WHOLE + ((("torch_layer", "torch layer"),)
                              if any("torch_layer_ms" in r or "torch_layer_error" in r for r in rows)
                              else ())
    if what == "memory":
        def peak(key):
            def cell(r):
                mib = r.get(key + "_peak_mib")
                return f"{mib:,.0f}" if mib is not None else _prefill_missing(r, key)
            return cell
        return _table(rows, shape
                      + [(label, peak(key)) for key, label in whole]
                      + _attention_headers([(label, peak(key)) for key, label in _PREFILL_ATTENTION])
                      + [("layer, auto / cuDNN", lambda r: _prefill_ratio(r, "layer", "sdpa_cudnn", "_peak_mib")),
                         ("layer, triton / cuDNN",
                          lambda r: _prefill_ratio(r, "layer_triton", "sdpa_cudnn", "_peak_mib"))])

    def timed(key):
        def cell(r):
            ms = r.get(key + "_ms")
            if ms is None:
                return _prefill_missing(r, key)
            rate = r.get(key + "_TFLOPs")
            return f"{ms:,.2f}" + (f" ({rate:,.0f})" if rate else "")
        return cell
    return _table(rows, shape
                  + [(label, timed(key)) for key, label in whole]
                  + [("layer / SDPA layer", lambda r: _prefill_ratio(r, "layer", "sdpa_layer"))]
                  + _paired_column(rows, "layer_over_sdpa_layer_paired", "in turn")
                  + _paired_column(rows, "layer_over_torch_layer_paired", "layer / torch layer, in turn")
                  + _attention_headers([(label, timed(key)) for key, label in _PREFILL_ATTENTION])
                  + [("ours, auto / cuDNN", lambda r: _prefill_ratio(r, "layer_attention", "sdpa_cudnn"))])


def generate_table(name: str = "h200-generate.json") -> str:
    """Markdown: bench_generate.py's rows, one line a contender and batch."""
    rows = [r for r in result(name)["rows"] if not r.get("oom")]
    return _table(rows, [
        ("contender", lambda r: r["contender"]), ("b", lambda r: str(r["b"])),
        ("decode tokens/s", lambda r: f"{r['decode_tokens_per_s']:,.0f}"),
        ("prefill (s)", lambda r: f"{r['prefill_s']:.2f}"),
        ("tokens/s, whole call", lambda r: f"{r['tokens_per_s']:,.0f}"),
        ("peak GiB, prefill / decode", lambda r: f"{r['prefill_peak_gib']:.1f} / {r['decode_peak_gib']:.1f}"),
        ("tokens equal to eager", lambda r: f"{r['tokens_equal_reference']:.0%}"),
    ])


def fp8_accuracy_table(name: str = "cpu-fp8-accuracy.json") -> str:
    """Markdown: benchmarks/accuracy_fp8.py's rows, the paged tier's largest relative error
    against the float32 naive tier per phase, one line a prefill path and cache layout."""
    return _table(result(name)["rows"], [
        ("prefill path", lambda r: f"`{r['path']}`"),
        ("`kv_cache_dtype`", lambda r: f"`{r['kv_cache_dtype']}`"),
        ("bytes / token", lambda r: str(r["bytes_per_token"])),
        ("latent", lambda r: f"{r['latent_rel_err']:.1e}"),
        ("prefill", lambda r: f"{r['prefill_rel_err']:.1e}"),
        ("extend + prefill + decode", lambda r: f"{r['mixed_rel_err']:.1e}"),
        ("decode", lambda r: f"{r['decode_rel_err']:.1e}"),
    ])


def fp8_decode_section(name: str = "h200-decode.json") -> str:
    """Markdown: the decode benchmark's fp8 rows (one query token), each layout's time beside
    the bf16 row's, or a sentence saying the committed run has none."""
    data = result(name)
    rows = [r for r in data.get("fp8_rows", []) if r.get("s_q", 1) == 1]
    if not rows:
        return (f"`benchmarks/results/{name}` holds no fp8 rows yet: its run timed the bf16 "
                "cache only. `python -m mla bench decode --kv-cache-dtype "
                "auto,fp8_e4m3,fp8_ds_mla` times every layout in one run, and this table fills "
                "in from it.")
    rows.sort(key=lambda r: (r["h"], r["b"] * r["t"], r["b"], r["kv_cache_dtype"]))
    # the Triton kernel on the fp8 cache beside a CUDA pick, in results that time it
    beside = ([("Triton: fp8 / bf16", lambda r: f"{r['triton_over_bf16_triton']:.2f}"
                if r.get("triton_over_bf16_triton") else "-")]
              if any(r.get("triton_over_bf16_triton") for r in rows) else [])
    return _table(rows, [
        ("b", lambda r: str(r["b"])), ("t", lambda r: f"{r['t']:,}"), ("h", lambda r: str(r["h"])),
        ("cache", lambda r: f"`{r['kv_cache_dtype']}`"),
        ("µs (x floor)", lambda r: f"{r['time_us']:.1f} ({r['time_us'] / r['floor_us']:.2f})"),
        ("x bf16", lambda r: f"**{r['over_bf16']:.2f}**"),
        ("x bf16 on Triton", lambda r: f"{r['over_bf16_triton']:.2f}"),
        *beside,
    ])


def capacity_table(name: str = "h200-generate.json") -> str:
    """Markdown: the largest batch each contender decodes at the long context within the budget:
    the memory model's estimate, the batch the probe ran, and the probe's peak memory."""
    return _table(result(name)["capacity"], [
        ("contender", lambda r: r["contender"]), ("context t", lambda r: f"{r['t']:,}"),
        ("estimate", lambda r: f"{r['estimate']:,}"), ("ran", lambda r: f"**{r['verified']:,}**"),
        ("probe's peak (GiB)", lambda r: f"{r['verified_peak_gib']:.1f}"),
        ("batches tried", lambda r: ", ".join(
            f"{p['b']:,}" + ("" if p["fits"] else " (out of memory)") for p in r["probes"])),
    ])


def benchmark_section(shown: tuple[str, ...] = ()) -> str:
    """Tables from benchmarks/results/*.json, or a plain statement that none is committed; the
    PNGs there too, but for those named in `shown` (the page shows them elsewhere)."""
    files = sorted(RESULTS.glob("*.json")) if RESULTS.is_dir() else []
    if not files:
        return ("!!! note \"No committed results yet\"\n"
                "    `benchmarks/results/` holds no JSON yet. The GPU benchmark "
                "(`python -m mla bench`) writes it there; this page shows it once it is "
                "committed. Until then nothing on this site is a measured time.")
    parts = _plots_section()
    for path in files:
        data = json.loads(path.read_text())
        parts.append(f"### `{path.relative_to(ROOT)}`\n")
        scalars = {k: v for k, v in data.items() if not isinstance(v, (list, dict))}
        if scalars:
            parts.append("| field | value |\n|---|---|")
            parts.extend(f"| `{k}` | {_cell(v)} |" for k, v in scalars.items())
            parts.append("")
        for key, rows in data.items():
            if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
                if len(rows) > 40:
                    parts.append(f"`{key}`: {len(rows)} rows, in the file (not shown).\n")
                    continue
                cols = list(dict.fromkeys(c for r in rows for c in r))
                parts.append(f"`{key}`:\n")
                parts.append("| " + " | ".join(cols) + " |")
                parts.append("|" + "---:|" * len(cols))
                for r in rows:
                    parts.append("| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |")
                parts.append("")
                parts.append("")
    # plots: on_files puts benchmarks/results/*.png into the site; this page sits at the root
    for png in sorted(p for p in RESULTS.glob("*.png") if p.name not in shown):
        parts.append(f"![{png.name}]({png.relative_to(ROOT).as_posix()})\n")
    return "\n".join(parts)


# ---- plots of the committed results, drawn when the site is built ---------------------------
#
# on_files draws one PNG per known result file with matplotlib and adds it to the site as a
# generated file (site/assets/benchmarks/*.png; nothing is written into the tree);
# benchmark_section embeds them, or says which file is missing. Every plot reads its file by its
# fields (rows of dicts, as bench_*.py write them), never by position, so a rerun that rewrites a
# file with the same schema is plotted as it is.

PLOT_DIR = "assets/benchmarks"
_PLOTS: dict[str, dict] = {}  # name -> title, caption, file, src (site path) or note


def _tokens(t: int) -> str:
    return f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else f"{t:,}"


def _plain_log2(ax) -> None:
    """A base-2 log x axis labelled 1, 4, 16, ... 4k rather than 2^0, 2^2, ..."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _tokens(int(round(v)))))


def _figure(panels: int):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 0.3 + 3.4 * panels), layout="constrained")
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]  # stacked: the page is one column
    for ax in axes:
        ax.grid(True, which="major", alpha=0.3)
    return fig, axes


# result files written before the decode backends took their names say "cuda" and "sm90"
_OLD_KERNEL_NAMES = {"cuda": "cuda-sm80", "sm90": "cuda-sm90"}


def _kernel(row: dict) -> str | None:
    """The stage-1 kernel a decode row ran (``config.kernel``), by its ``DECODE_BACKENDS`` name."""
    kernel = (row.get("config") or {}).get("kernel")
    return _OLD_KERNEL_NAMES.get(kernel, kernel)


def _plot_decode(data: dict):
    """Time against the floor, and the share of the floor, for each (b, t) shape and head count:
    the rows of one query token a sequence that were timed."""
    rows = [r for r in data["rows"] if r.get("s_q", 1) == 1 and r.get("time_us")]
    shapes = sorted({(r["b"], r["t"]) for r in rows}, key=lambda bt: (bt[0] * bt[1], bt[0]))
    heads = sorted({r["h"] for r in rows})
    fig, (ax_time, ax_share) = _figure(2)
    width = 0.8 / len(heads)
    for k, h in enumerate(heads):
        of_h = {(r["b"], r["t"]): r for r in rows if r["h"] == h}
        xs = [i + (k - (len(heads) - 1) / 2) * width for i, bt in enumerate(shapes) if bt in of_h]
        sel = [of_h[bt] for bt in shapes if bt in of_h]
        bounds = {r.get("bound") for r in sel} - {None}
        kernels = sorted({_kernel(r) for r in sel} - {None})
        label = (f"{h} heads" + (f", {' / '.join(kernels)}" if kernels else "")
                 + (f" ({bounds.pop()} bound)" if len(bounds) == 1 else ""))
        color = f"C{k}"
        ax_time.bar(xs, [r["time_us"] for r in sel], width, color=color, label=label)
        ax_time.plot(xs, [r["floor_us"] for r in sel], linestyle="none", marker="_",
                     markersize=60 * width, markeredgewidth=2, color="black",
                     label="floor" if k == len(heads) - 1 else None)
        ax_share.bar(xs, [r["share_of_floor"] for r in sel], width, color=color, label=label)
    labels = [f"b {b}\nt {_tokens(t)}" for b, t in shapes]
    for ax in (ax_time, ax_share):
        ax.set_xticks(range(len(shapes)), labels)
        ax.set_xlabel("batch b, cached tokens t (a sequence)")
    ax_time.set_yscale("log")
    ax_time.set_ylabel("decode step (µs), log scale")
    ax_time.set_title("measured time and its floor")
    ax_share.set_ylim(0, 1.05)
    ax_share.axhline(1.0, color="black", linewidth=0.8)
    ax_share.set_ylabel("share of floor (floor / time)")
    ax_share.set_title("share of the floor reached")
    ax_time.legend(fontsize=8)
    ax_share.legend(fontsize=8)
    return fig


def _plot_prefill(data: dict):
    """A crossover run's plot or bench_prefill.py's, whichever the result is."""
    return _plot_prefill_paths(data) if _is_crossover_run(data) else _plot_prefill_contenders(data)


def _plot_prefill_contenders(data: dict):
    """bench_prefill.py's result: each contender's time at each (b, s, t) shape, and its
    attention TFLOP/s against the matmul rate of the same run."""
    rows = data["rows"]
    # the tables' contenders, in their order; the forced "sdpa" runs are left out (on a GPU
    # they time what "auto" runs on these rows, and the tables leave them out too)
    shown = [key for key, _ in _PREFILL_WHOLE + _PREFILL_ATTENTION]
    present = {k[:-3] for r in rows for k in r if k.endswith("_ms")}
    names = [key for key in shown if key in present]
    labels = {**{key: f"{label} (whole call)" for key, label in _PREFILL_WHOLE},
              **{key: f"{label} (attention)" for key, label in _PREFILL_ATTENTION}}
    if not names:
        raise ValueError("no *_ms columns")
    fig, (ax_time, ax_rate) = _figure(2)
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        timed = [(i, r) for i, r in enumerate(rows) if r.get(f"{name}_ms")]
        xs = [i + (k - (len(names) - 1) / 2) * width for i, _ in timed]
        label = labels.get(name, name)
        ax_time.bar(xs, [r[f"{name}_ms"] for _, r in timed], width, color=f"C{k}", label=label)
        rated = [(x, r[f"{name}_TFLOPs"]) for x, (_, r) in zip(xs, timed) if r.get(f"{name}_TFLOPs")]
        ax_rate.bar([x for x, _ in rated], [v for _, v in rated], width, color=f"C{k}", label=label)
    if data.get("matmul_TFLOPs"):
        ax_rate.axhline(data["matmul_TFLOPs"], color="black", linestyle="--", label="bf16 matmul")
    ticks = [f"b {r['b']}\ns {_tokens(r['s'])}" + (f"\n+{_tokens(r['t'])}" if r.get("t") else "")
             for r in rows]
    for ax in (ax_time, ax_rate):
        ax.set_xticks(range(len(rows)), ticks, fontsize=7)
        ax.set_xlabel("batch b, new tokens s (+ cached tokens t)")
    ax_time.set_yscale("log")
    ax_time.set_ylabel("prefill (ms), log scale")
    ax_time.set_title("the whole calls, and attention alone")
    ax_rate.set_ylabel("attention TFLOP/s")
    ax_rate.set_title("attention FLOPs over the time (the layer's projections left out)")
    # one legend for both panels, below them: inside, it would hide the bars
    fig.legend(*ax_rate.get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=7)
    return fig


def _plot_prefill_paths(data: dict):
    """A crossover run: both prefill paths' times against the new tokens s, and their ratio,
    per batch."""
    rows = data["rows"]
    batches = sorted({r["b"] for r in rows})
    crossovers = _prefill_crossovers(data)
    model = data.get("model_crossover")
    fig, (ax_time, ax_ratio) = _figure(2)
    for k, b in enumerate(batches):
        sel = sorted((r for r in rows if r["b"] == b), key=lambda r: r["s"])
        s = [r["s"] for r in sel]
        color = f"C{k}"
        ax_time.plot(s, [r["up_project_ms"] for r in sel], "o-", color=color, markersize=3,
                     label=f"b {b}: up-projected")
        ax_time.plot(s, [r["absorbed_ms"] for r in sel], "s--", color=color, markersize=3,
                     label=f"b {b}: absorbed")
        ax_ratio.plot(s, [r["absorbed_ms"] / r["up_project_ms"] for r in sel], "o-",
                      color=color, markersize=3, label=f"b {b}")
        if crossovers.get(b) is not None:
            ax_ratio.axvline(crossovers[b], color=color, linestyle=":",
                             label=f"b {b}: up-projection faster from s = {crossovers[b]:,}")
    if model:
        ax_ratio.axvline(model, color="black", linestyle="--",
                         label=f"FLOP model's crossover, s = {model:,}")
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    for ax in (ax_time, ax_ratio):
        _plain_log2(ax)
        ax.set_xlabel("new tokens a sequence, s"
                      + (f" (over {data['context']:,} cached)" if "context" in data else ""))
    ax_time.set_yscale("log")
    ax_time.set_ylabel("prefill attention (ms), log scale")
    ax_time.set_title("both paths")
    ax_ratio.set_ylabel("absorbed time / up-projected time")
    ax_ratio.set_title("above 1: up-projection is faster")
    ax_time.legend(fontsize=7)
    ax_ratio.legend(fontsize=7)
    return fig


def _plot_layer(data: dict):
    """One layer's decode step: every `*_us` column of each row, side by side."""
    rows = data["rows"]
    series = list(dict.fromkeys(k for r in rows for k in r if k.endswith("_us")))
    if not series:
        raise ValueError("no *_us columns")
    fig, (ax,) = _figure(1)
    width = 0.8 / len(series)
    for k, key in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i, r in enumerate(rows) if key in r]
        ax.bar(xs, [r[key] for r in rows if key in r], width, color=f"C{k}",
               label=key[:-3].replace("_", " "))
    ax.set_xticks(range(len(rows)),
                  [f"b {r['b']}" + (f"\nt {_tokens(r['t'])}" if "t" in r else "") for r in rows])
    ax.set_xlabel("batch b, cached tokens t")
    ax.set_ylabel("one decode step of one layer (µs)")
    ax.legend(fontsize=8)
    return fig


def _plot_concat(data: dict):
    """concat_and_cache's bandwidth against the tokens written, per cache dtype, and the copy
    bandwidth measured in the same run."""
    rows = data["rows"]
    kinds = list(dict.fromkeys(r.get("kv_cache_dtype", "") for r in rows))
    fig, (ax,) = _figure(1)
    for k, kind in enumerate(kinds):
        sel = sorted((r for r in rows if r.get("kv_cache_dtype", "") == kind),
                     key=lambda r: r["tokens"])
        ax.plot([r["tokens"] for r in sel], [r["GBps"] for r in sel], "o-", color=f"C{k}",
                label=f"kv_cache_dtype={kind}" if kind else "concat_and_cache")
    if "copy_GBps" in data:
        ax.axhline(data["copy_GBps"], color="black", linestyle="--", label="device copy")
    _plain_log2(ax)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("tokens written in one call")
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.legend(fontsize=8)
    return fig


def _prefill_plot_text() -> tuple[str, str]:
    """(title, caption) of the prefill plot, for the kind of result committed."""
    data = _load(RESULTS / PREFILL_RESULTS)
    if data is not None and _is_crossover_run(data):
        return ("Prefill: up-projection against absorption",
                "The two paths of the paged tier's prefill for each number of new tokens s. Top: "
                "both times. Bottom: absorbed time over up-projected time; above 1 up-projection "
                "is faster. Dotted lines: where up-projection became faster for good in this run; "
                "dashed: where the FLOP model puts the crossover.")
    return ("Prefill: the layer against SDPA and FlexAttention",
            "For each shape (b sequences of s new tokens over t cached ones): top, the whole "
            "calls (projections included) of the paged layer under `prefill_backend=\"auto\"` "
            "and `\"triton\"` and of the layer with SDPA attention, then attention alone: the "
            "paged layer's under both choices, each SDPA backend and FlexAttention (log scale); "
            "bottom, their attention FLOPs over the time, against the bf16 matmul rate of the "
            "same run (dashed). A contender missing at a shape did not run there: over a cached "
            "context the backend is not forced, and one that failed has its error in the tables.")


def _plot_specs() -> list[tuple[str, Path, object, str, str]]:
    """(name, result file, drawing function, title, caption) of each plot."""
    decode = _decode_results() or RESULTS / "h200-decode.json"
    return [
        ("decode", decode, _plot_decode, "Decode kernel against its floor",
         "`mla_decode` for each shape of the run, grouped by head count. Top: the measured time "
         "(bars, log scale) and the floor of that shape (black ticks): the larger of bytes over "
         "the measured copy bandwidth and FLOPs over the measured matmul rate. Bottom: "
         "`share_of_floor`, floor over time; 1 would be the ceiling."),
        ("prefill", RESULTS / PREFILL_RESULTS, _plot_prefill, *_prefill_plot_text()),
        ("layer", RESULTS / "h200-layer.json", _plot_layer, "One layer's decode step",
         "A whole decode step of one layer, projections included, for each batch: the absorbed "
         "tier and the paged tier called eagerly, and the paged tier's `decode_step` eagerly "
         "and replayed as a CUDA graph (the file's note says how each was timed)."),
        ("concat", RESULTS / "h200-concat.json", _plot_concat, "concat_and_cache against device "
         "copy", "The concat-and-cache kernel's bandwidth (bytes read plus bytes written over "
         "time) for each number of tokens written in one call, for a cache in the input dtype "
         "(`auto`) and in fp8, against the device copy bandwidth measured in the same run."),
    ]


def _draw_plots(config, files) -> None:
    """Draw every plot whose result file is committed and add it to `files`; record a note for
    the others. Fills _PLOTS."""
    _PLOTS.clear()
    specs = _plot_specs()
    if not any(path.is_file() for _, path, _, _, _ in specs):
        return
    try:
        import matplotlib
    except ImportError as err:
        raise PluginError("matplotlib is missing: pip install matplotlib (the docs extra) to "
                          "draw the benchmark plots") from err
    matplotlib.rcParams.update({"font.size": 9, "axes.titlesize": 9})
    for name, path, draw, title, caption in specs:
        rel = path.relative_to(ROOT).as_posix()
        entry = {"title": title, "caption": caption, "file": rel, "src": None, "note": ""}
        _PLOTS[name] = entry
        if not path.is_file():
            entry["note"] = f"`{rel}` is not committed, so there is nothing to plot here."
            continue
        try:
            data = json.loads(path.read_text())
            fig = draw(data)
        except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError) as err:
            entry["note"] = (f"`{rel}` is committed but could not be plotted ({err!r}): its "
                             "fields are not the ones this plot reads. Its tables are below.")
            continue
        device = data.get("device")
        fig.suptitle(rel + (f" ({device})" if device else ""), fontsize=9)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=144, metadata={"Software": None})
        src = f"{PLOT_DIR}/{name}.png"
        existing = files.get_file_from_path(src)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, src, content=buf.getvalue()))
        entry["src"] = src


def _plots_section() -> list[str]:
    if not _PLOTS:
        return []
    parts = ["### Plots", "",
             "Drawn with matplotlib from the committed JSON files (below) each time the site is "
             "built; the images exist only in the built site.", ""]
    for entry in _PLOTS.values():
        parts.append(f"#### {entry['title']}\n")
        if entry["src"]:
            parts.append(f"{entry['caption']} From `{entry['file']}`.\n")
            parts.append(f"![{entry['title']}]({entry['src']})\n")
        else:
            parts.append(f"!!! note \"Not plotted\"\n    {entry['note']}\n")
    return parts


def _cell(v) -> str:
    if isinstance(v, (dict, list)):
        return "`" + json.dumps(v, separators=(",", ":")).replace("|", "/") + "`"
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


# ---- hooks ----------------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"(?<!\\)\{\{\s*mla:\s*(.+?)\s*(?:\|\s*([^}|]*?)\s*)?\}\}", re.S)
_NS: dict | None = None


def _notebooks() -> list[Path]:
    return sorted(TUTORIALS.glob("*.ipynb")) if TUTORIALS.is_dir() else []


def on_config(config, **kwargs):
    notebooks = _notebooks()
    if notebooks:
        nav = config["nav"]
        entries = [{_title(nb): f"tutorials/{nb.name}"} for nb in notebooks]
        nav.insert(next((i + 1 for i, item in enumerate(nav) if "Tiers" in item), len(nav)),
                   {"Tutorials": entries})
    return config


def _title(nb: Path) -> str:
    """The first markdown heading of a notebook, else its file name."""
    try:
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                for line in "".join(cell["source"]).splitlines():
                    if line.startswith("# "):
                        return line[2:].strip()
    except (ValueError, KeyError):
        pass
    return nb.stem.replace("_", " ").replace("-", " ")


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns them into notebook pages
def on_files(files, config, **kwargs):
    for nb in _notebooks():
        src = f"tutorials/{nb.name}"
        if files.get_file_from_path(src) is None:
            files.append(File(src, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    for png in sorted(RESULTS.glob("*.png")) if RESULTS.is_dir() else []:
        src = png.relative_to(ROOT).as_posix()
        if files.get_file_from_path(src) is None:
            files.append(File(src, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    _draw_plots(config, files)
    return files


def on_page_markdown(markdown, page, config, files, **kwargs):
    global _NS
    if "{{" not in markdown:
        return markdown
    if _NS is None:
        _NS = _namespace()

    def substitute(match: re.Match) -> str:
        expr, spec = match.group(1), match.group(2)
        try:
            value = eval(expr, dict(_NS))  # noqa: S307 - our own pages, our own package
            return format(value, spec) if spec else str(value)
        except Exception as err:  # noqa: BLE001
            raise PluginError(f"{page.file.src_path}: {{{{ mla: {expr} }}}} failed: {err!r}") \
                from err

    return _PLACEHOLDER.sub(substitute, markdown)


_SCRIPT = re.compile(r"<script\b([^>]*)>(.*?)</script>", re.S)


def _foreign_script(match: re.Match) -> str:
    """'' for a script nbconvert adds that reaches outside the site, else the script as it was:
    MathJax 2 from a CDN (or, with its URL blanked, `src=""`: the page itself as a script),
    its configuration, require.js, the mermaid loader that imports from a CDN."""
    attrs, body = match.group(1), match.group(2)
    src = re.search(r"\bsrc=\"([^\"]*)\"", attrs)
    if src is not None and (src.group(1) == "" or re.match(r"(https?:)?//", src.group(1))):
        return ""
    if "text/x-mathjax-config" in attrs or "init_mathjax" in body:
        return ""
    if re.search(r"https?://", body) and ("import(" in body or "mermaid" in body):
        return ""
    return match.group(0)


# A table-of-contents entry: the theme writes each heading's text, tags stripped, into a span
# with a class, which MathJax skips (mathjax.js: only .arithmatex and notebook markdown are
# searched). Its math, \(...\) from a page or $...$ from a notebook, is wrapped the way
# arithmatex wraps inline math, so MathJax typesets it there too.
_TOC_ENTRY = re.compile(r'(<a href="#[^"]*" class="md-nav__link">\s*<span class="md-ellipsis">)'
                        r"(.*?)(</span>)", re.S)
_TOC_MATH = re.compile(r"\\\((.+?)\\\)|(?<![\\$])\$(?!\$)(.+?)(?<![\\$])\$")


def _toc_math(match: re.Match) -> str:
    def wrap(m: re.Match) -> str:
        tex = m.group(1) if m.group(1) is not None else m.group(2)
        return f'<span class="arithmatex">\\({tex}\\)</span>'

    return match.group(1) + _TOC_MATH.sub(wrap, match.group(2)) + match.group(3)


def on_post_page(output, page, config, **kwargs):
    if page.file.src_path.endswith(".ipynb"):
        output = _SCRIPT.sub(_foreign_script, output)
    return _TOC_ENTRY.sub(_toc_math, output)


def on_post_build(config, **kwargs):
    spec = importlib.util.find_spec("mathjax")
    if spec is None or not spec.submodule_search_locations:
        raise PluginError("MathJax is missing: pip install django-static-mathjax (the docs extra)")
    es5 = Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax" / "es5"
    if not (es5 / "tex-chtml.js").is_file():
        raise PluginError(f"{es5}/tex-chtml.js not found; is django-static-mathjax 3.x installed?")
    dest = Path(config["site_dir"]) / "assets" / "mathjax"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    shutil.copy2(es5 / "tex-chtml.js", dest / "tex-chtml.js")
    # what tex-chtml.js loads on demand: TeX extensions (autoload), the CHTML fonts, the menu's
    # accessibility parts
    for sub in ("input/tex/extensions", "output/chtml", "a11y", "ui", "sre", "adaptors"):
        if (es5 / sub).is_dir():
            shutil.copytree(es5 / sub, dest / sub)
    for license_file in es5.parent.glob("LICENSE*"):
        shutil.copy2(license_file, dest / license_file.name)
