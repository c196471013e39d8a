"""MkDocs hooks for the mla site (registered in mkdocs.yml under `hooks:`).

What they do, in build order:

- on_config: adds every notebook under tutorials/ to the nav (none yet: the build stays green
  and the section appears when the first one lands).
- on_files: puts tutorials/*.ipynb into the site's files, so that mkdocs-jupyter renders them
  (the notebooks live at the repository root, not under docs/).
- on_page_markdown: replaces `{{ mla: EXPR }}` or `{{ mla: EXPR | FORMAT }}` with the value of
  the Python expression EXPR, evaluated in `NAMESPACE` below (the package, its presets, the
  helpers of this file) and formatted with the format spec FORMAT (`,`, `.1%`, ...). Every number
  a page states comes from the code this way; an expression that fails stops the build. Written
  with a backslash, \\{{ mla: ... }}, it is left alone (Markdown then drops the backslash).
- on_post_page: drops the CDN scripts (MathJax 2, require.js, mermaid) that nbconvert writes
  into notebook pages; MathJax 3 from the site typesets notebooks as well.
- on_post_build: copies MathJax 3's es5 bundle (from the django-static-mathjax wheel) into
  site/assets/mathjax, so math typesets offline.
"""

from __future__ import annotations

import importlib.util
import inspect
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
        "kib": lambda n: n / 1024,
        "mib": lambda n: n / 1024**2,
    }
    try:
        from mla.kernels import decode

        ns["decode"] = decode
    except Exception:  # noqa: BLE001 - the kernels may not import on every machine
        pass
    return ns


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
    """benchmarks/results/h200-decode.json, else the newest h200-decode-vN.json (not a sweep)."""
    if (RESULTS / "h200-decode.json").is_file():
        return RESULTS / "h200-decode.json"
    versions = [p for p in RESULTS.glob("h200-decode-v*.json")] if RESULTS.is_dir() else []
    versions.sort(key=lambda p: int(re.sub(r"\D", "", p.stem.rsplit("-v", 1)[1]) or 0))
    return versions[-1] if versions else None


def measured(key: str):
    """A field of the committed decode results (see _decode_results), or None without them."""
    path = _decode_results()
    return None if path is None else json.loads(path.read_text()).get(key)


def measured_section() -> str:
    """The absorption page's "Measured" section: from the committed decode results, or a plain
    statement that there are none."""
    path = _decode_results()
    if path is None:
        return ("**Not yet measured.** The GPU benchmark (`python -m mla bench`) writes "
                "`benchmarks/results/*.json`; once a result is committed, [Kernels and "
                "benchmarks](../benchmarks.md) shows it, and this section states the measured "
                "ceilings from it. Nothing on this page is a measured time.")
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
        "[Kernels and benchmarks](../benchmarks.md) records. The prefill crossover has not been "
        "timed; the FLOP count above is the only statement this page makes about it."]
    return "\n".join(lines)


def benchmark_section() -> str:
    """Tables from benchmarks/results/*.json, or a plain statement that none is committed."""
    files = sorted(RESULTS.glob("*.json")) if RESULTS.is_dir() else []
    if not files:
        return ("!!! note \"No committed results yet\"\n"
                "    `benchmarks/results/` holds no JSON yet. The GPU benchmark "
                "(`python -m mla bench`) writes it there; this page shows it once it is "
                "committed. Until then nothing on this site is a measured time.")
    parts = []
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
    for png in sorted(RESULTS.glob("*.png")):
        parts.append(f"![{png.name}]({png.relative_to(ROOT).as_posix()})\n")
    return "\n".join(parts)


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


def on_post_page(output, page, config, **kwargs):
    if page.file.src_path.endswith(".ipynb"):
        output = _SCRIPT.sub(_foreign_script, output)
    return output


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
