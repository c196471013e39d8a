"""The documentation site: it builds strictly, works offline, and reads right in a real browser.

The site is built once (`mkdocs build --strict` into a temporary folder), served on 127.0.0.1
from a thread, and every page is opened in headless Chromium (Debian's `chromium`, driven by
playwright without any browser download of its own). Each page must load with no console error
and no failed request; pages with math must show typeset MathJax (and no raw TeX delimiters in
the visible text); every local link must answer 200. Screenshots of the derivation pages go to
$MLA_DOCS_SCREENSHOTS (default /tmp/mla-docs-screenshots) for a person to look at.

The browser tests skip (with the reason) only when Chromium or playwright is missing; `make test`
installs both (the `browser` target and the docs extra).
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = Path(os.environ.get("MLA_DOCS_SCREENSHOTS", "/tmp/mla-docs-screenshots"))
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]

pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")


# ---- the site, built once --------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _pages(site: Path) -> list[str]:
    """URL paths of every page (directory URLs), home first."""
    pages = []
    for html in sorted(site.rglob("index.html")):
        rel = html.parent.relative_to(site).as_posix()
        if rel.startswith(("assets", "search")):
            continue
        pages.append("" if rel == "." else rel + "/")
    return sorted(pages, key=lambda p: (p != "", p))


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _tags(html: Path) -> list[tuple[str, dict]]:
    parser = _Tags()
    parser.feed(html.read_text(encoding="utf-8"))
    return parser.tags


# ---- checks that need no browser --------------------------------------------------------------


def test_every_page_listed_is_built(site):
    pages = _pages(site)
    for expected in ("", "derivations/latent-cache/", "derivations/rope/",
                     "derivations/absorption/", "derivations/paged-cache/",
                     "derivations/split-kv/", "derivations/concat-and-cache/", "tiers/naive/",
                     "tiers/absorbed/", "tiers/paged/", "benchmarks/", "faq/", "api/config/",
                     "api/layers/", "api/kernels/"):
        assert expected in pages, f"page {expected!r} missing from the built site"
    assert (site / "assets" / "mathjax" / "tex-chtml.js").is_file()
    assert (site / "assets" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2").is_dir()


def test_no_asset_from_outside_the_site(site):
    """Offline: no page loads a script, style, font or frame from another host."""
    for html in site.rglob("*.html"):
        for tag, attrs in _tags(html):
            url = (attrs.get("src") if tag in ("script", "img", "iframe") else
                   attrs.get("href") if tag == "link" else None)
            if url and urlparse(url).scheme in ("http", "https") or (url or "").startswith("//"):
                raise AssertionError(f"{html.relative_to(site)}: <{tag}> loads {url}")
        text = html.read_text(encoding="utf-8")
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text, html
    for css in site.rglob("*.css"):
        assert not re.search(r"@import\s+url\(\s*['\"]?(https?:)?//", css.read_text()), css


def test_home_example_runs():
    """The five-line example on the home page runs as written, for every tier."""
    text = (ROOT / "docs" / "index.md").read_text()
    block = re.search(r"## Swapping tiers\s+```python\n(.*?)```", text, re.S)
    assert block, "the home page lost its example"
    code = block.group(1)
    for tier in ("naive", "absorbed", "paged"):
        scope: dict = {}
        exec(compile(code.replace('"absorbed"', f'"{tier}"'), "docs/index.md", "exec"), scope)
        assert tuple(scope["y"].shape) == (2, 7, scope["cfg"].hidden_size)


def test_tiers_example_runs():
    """The tiers page's example builds all three tiers on one weights object and compares them."""
    text = (ROOT / "docs" / "tiers" / "index.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "docs/tiers/index.md", "exec"), scope)
    assert set(scope["outputs"]) == {"naive", "absorbed", "paged"}


def _text(site: Path, page: str) -> str:
    html = (site / page / "index.html").read_text(encoding="utf-8")
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_numbers_on_the_pages_are_the_packages(site):
    """The hook fills numbers from mla; recompute a few here, independently of the hook."""
    from mla import memory
    from mla.config import MLAConfig

    v2, v3 = MLAConfig.from_preset("deepseek-v2"), MLAConfig.from_preset("deepseek-v3")
    page = _text(site, "derivations/latent-cache")
    assert "{{" not in page and "mla:" not in page
    assert f"{memory.paper_kv_reduction_vs_67b(6.0):.1%}" == "93.3%"
    assert "93.3%" in page
    assert f"{memory.paper_kv_reduction_vs_67b(16.0):.1%}" in page
    assert memory.mla_equivalent_gqa_groups(v2) == 2.25 and "2.25" in page
    assert f"{memory.cache_elements_per_token(v3, 'mla'):,}" in page          # 576
    assert f"{memory.cache_elements_per_token(v3, 'mha'):,}" in page          # 32,768
    absorption = _text(site, "derivations/absorption")
    assert f"{memory.prefill_crossover(v3, 4096):,}" in absorption
    home = _text(site, "")
    assert f"{memory.cache_elements_per_token(v3, 'mha') / memory.cache_elements_per_token(v3, 'mla'):.1f}" in home


def test_benchmark_page_is_honest(site):
    """Measured numbers appear only when benchmarks/results has them."""
    page = _text(site, "benchmarks")
    results = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    if not results:
        assert "No committed results yet" in page
        assert "not yet measured" in _text(site, "derivations/absorption").lower()
    for path in results:
        assert path.name in page, f"{path.name} is committed but not shown"
        json.loads(path.read_text())
    decode = [p for p in results if p.name.startswith("h200-decode") and "sweep" not in p.name]
    if decode:
        absorption = _text(site, "derivations/absorption")
        assert "not yet measured" not in absorption.lower()
        assert "ridge point" in absorption
    # the plots are drawn at build time from the JSON, into the site only
    html = (site / "benchmarks" / "index.html").read_text(encoding="utf-8")
    names = {p.name for p in results}
    for plot, present in (("decode", bool(decode)), ("prefill", "h200-prefill.json" in names),
                          ("layer", "h200-layer.json" in names),
                          ("concat", "h200-concat.json" in names)):
        png = site / "assets" / "benchmarks" / f"{plot}.png"
        if present:
            assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
            assert f"assets/benchmarks/{plot}.png" in html, f"the {plot} plot is not on the page"
        else:
            assert not png.exists()
    assert not list((ROOT / "docs").rglob("*.png")), "a plot was written into the tree"
    prefill = ROOT / "benchmarks" / "results" / "h200-prefill.json"
    absorption = _text(site, "derivations/absorption")
    if prefill.is_file():
        assert "has not been timed" not in absorption
        for value in json.loads(prefill.read_text()).get("measured", {}).values():
            assert f"from {value['up_project_wins_from']:,} new tokens on" in absorption
    else:
        assert "has not been timed" in absorption


def test_prefill_tables_read_every_result_schema(monkeypatch):
    """The prefill tables of the benchmarks page read bench_prefill.py's rows whatever they hold:
    a prompt with every contender (one out of memory), an extend with "auto" alone, and a row
    of a file written before the forced backends and the SDPA layer existed. A contender that
    did not run reads "-", one that failed says so, and nothing stops the build."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    full = {f"{k}_{f}": v for k in ("layer", "layer_triton", "sdpa_layer", "layer_attention",
                                    "layer_attention_triton", "sdpa_cudnn", "sdpa_efficient",
                                    "sdpa_flash") for f, v in (("ms", 2.0), ("TFLOPs", 300.0),
                                                               ("peak_mib", 1000.0))}
    rows = [dict(b=1, s=8192, t=0, **full, flex_error="OutOfMemoryError: CUDA out of memory"),
            dict(b=1, s=4096, t=32768, layer_ms=3.0, layer_peak_mib=500.0, sdpa_layer_ms=6.0,
                 sdpa_layer_peak_mib=900.0, sdpa_cudnn_ms=4.0, sdpa_cudnn_peak_mib=250.0,
                 layer_triton_TFLOPs=None, flex_error="RuntimeError: no kernel"),
            dict(b=4, s=2048, t=0, layer_ms=5.0, layer_attention_ms=2.5, sdpa_cudnn_ms=1.25)]
    monkeypatch.setattr(hooks, "result", lambda name: {"rows": rows})

    def cells(table: str) -> list[list[str]]:
        return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]

    ms = cells(hooks.prefill_table())
    head, prompt, extend, old = ms[0], ms[2], ms[3], ms[4]
    col = {h: i for i, h in enumerate(head)}
    assert len(head) == 12 and all(len(r) == 12 for r in ms[2:])
    assert prompt[col["layer, triton"]] == "2.00 (300)" and prompt[col["layer / SDPA layer"]] == "1.00"
    assert prompt[col["FlexAttention"]] == "out of memory"
    assert extend[col["layer, triton"]] == "-" and extend[col["ours, triton"]] == "-"
    assert extend[col["layer / SDPA layer"]] == "0.50" and extend[col["FlexAttention"]] == "n/a"
    assert old[col["SDPA layer"]] == "-" and old[col["layer / SDPA layer"]] == "-"
    assert old[col["layer, auto"]] == "5.00" and old[col["ours, auto / cuDNN"]] == "2.00"
    memory = cells(hooks.prefill_table(what="memory"))
    col = {h: i for i, h in enumerate(memory[0])}
    assert memory[2][col["layer, triton / cuDNN"]] == "1.00" and memory[2][col["FlexAttention"]] == "out of memory"
    assert memory[3][col["layer, auto / cuDNN"]] == "2.00" and memory[3][col["layer, triton"]] == "-"
    assert memory[4][col["layer, auto"]] == "-"
    assert [r["s"] for r in hooks.prefill_rows()] == [8192, 2048]
    assert [r["s"] for r in hooks.prefill_rows(min_s=4096)] == [8192]
    assert "in turn" not in ms[0]                      # no paired timing in these rows
    rows[0]["layer_over_sdpa_layer_paired"] = 0.97     # a file with the pair timed in turn
    paired = cells(hooks.prefill_table())
    col = {h: i for i, h in enumerate(paired[0])}
    assert paired[2][col["in turn"]] == "0.97" and paired[3][col["in turn"]] == "-"
    assert "torch layer" not in paired[0]              # no torch layer in these rows
    rows[0].update(torch_layer_ms=2.5, torch_layer_TFLOPs=240.0, torch_layer_peak_mib=800.0,
                   layer_over_torch_layer_paired=0.81)  # a file with the torch layer
    rows[2]["torch_layer_error"] = "OutOfMemoryError: CUDA out of memory"
    torch_rows = cells(hooks.prefill_table())
    col = {h: i for i, h in enumerate(torch_rows[0])}
    assert torch_rows[2][col["torch layer"]] == "2.50 (240)"
    assert torch_rows[2][col["layer / torch layer, in turn"]] == "0.81"
    assert torch_rows[3][col["torch layer"]] == "-" and torch_rows[4][col["torch layer"]] == "out of memory"
    memory = cells(hooks.prefill_table(what="memory"))
    assert memory[2][{h: i for i, h in enumerate(memory[0])}["torch layer"]] == "800"
    assert hooks.prefill_row(1, 4096, 32768) is rows[1]


def test_fp8_decode_table_shows_the_triton_kernel_beside_where_timed(monkeypatch):
    """The fp8 decode table of the fp8 page: each layout's time over the bf16 cache's, and where
    the result timed the Triton kernel beside a CUDA pick, its own fp8-over-bf16 ratio."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    row = dict(b=64, t=4096, h=16, s_q=1, kv_cache_dtype="fp8_e4m3", time_us=100.0, floor_us=50.0,
               over_bf16=1.2, over_bf16_triton=0.9)
    rows = [row, dict(row, kv_cache_dtype="fp8_ds_mla", triton_over_bf16_triton=1.75)]
    monkeypatch.setattr(hooks, "result", lambda name: {"fp8_rows": rows})
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in hooks.fp8_decode_section().splitlines()]
    col = {h: i for i, h in enumerate(lines[0])}
    by_cache = {line[col["cache"]]: line for line in lines[2:]}
    assert by_cache["`fp8_e4m3`"][col["x bf16"]] == "**1.20**"
    assert by_cache["`fp8_e4m3`"][col["Triton: fp8 / bf16"]] == "-"
    assert by_cache["`fp8_ds_mla`"][col["Triton: fp8 / bf16"]] == "1.75"
    rows[1].pop("triton_over_bf16_triton")             # a result without it: no such column
    assert "Triton: fp8 / bf16" not in hooks.fp8_decode_section()


# ---- the browser --------------------------------------------------------------------------------


def _chromium() -> str | None:
    for name in (os.environ.get("MLA_CHROMIUM"), "chromium", "chromium-browser"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # the browser may drop a connection it no longer needs (a font, a prefetch)
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _serve(directory: Path):
    """Serve `directory` on 127.0.0.1 from a thread; yields the base URL."""
    httpd = _Server(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(directory)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def server(site):
    yield from _serve(site)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    executable = _chromium()
    if executable is None:
        pytest.skip("no chromium on this machine (make browser installs Debian's package)")
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed (the docs extra)")
    profile = tmp_path_factory.mktemp("chromium-profile")  # a fresh --user-data-dir
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=executable, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 900})
        yield context
        context.close()


_RAW_TEX = re.compile(r"\\\(|\\\)|\\\[|\\\]|\$\$")

_VISIBLE_TEXT = """() => {
  const root = document.querySelector('article') || document.body;
  const clone = root.cloneNode(true);
  clone.querySelectorAll('pre, code, mjx-container, script, style, .highlight').forEach(e => e.remove());
  return clone.innerText;
}"""

# TeX that reached the reader as text. Markdown eats the backslash of \[ and \( (and `_..._`
# may become emphasis), so a display block it did not hand to arithmatex shows up as "[ q_{t,i}
# = \operatorname{RoPE}(...) ]" in a <p>, which _RAW_TEX cannot see: the delimiters are gone,
# the commands, sub- and superscripts are not. So every text node of the article and of the
# table of contents outside MathJax's output and code is searched for a TeX command (a backslash
# and two or more letters), `^{`, `_{` or a delimiter. Hidden text (a notebook cell's copy of its
# source for the clipboard) and mkdocstrings' rendering of docstrings (which write W^{UK} as plain
# text on purpose, for help()) are left out.
_TEX_LEFT_IN_TEXT = r"""() => {
  const roots = document.querySelectorAll('article, .md-sidebar--secondary');
  const skip = 'mjx-container, pre, code, kbd, samp, script, style, textarea, .highlight, .doc';
  const tex = /\\[A-Za-z]{2,}|[\^_]\{|\\[\[\]()]|\$\$/;
  const found = [];
  for (const root of roots) {
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      const parent = node.parentElement;
      if (parent.closest(skip) || !parent.checkVisibility()) continue;
      const text = node.data.replace(/\s+/g, ' ').trim();
      const hit = text.match(tex);
      if (hit) found.push(text.slice(Math.max(0, hit.index - 30), hit.index + 50));
    }
  }
  return found;
}"""

_GLYPHS_DRAWN = """() => {
  const c = document.querySelector('mjx-container mjx-c');
  if (!c) return null;
  return getComputedStyle(c, '::before').content;
}"""


_PROBE_NOTEBOOK = {
    "cells": [
        {"cell_type": "markdown", "metadata": {},
         "source": ["# 00. Probe\n", "Inline $c^{KV}_t = W^{DKV} h_t$ and display\n",
                    "$$o_{t,i} = \\sum_j p_{t,j,i}\\, v_{j,i}$$\n"]},
        {"cell_type": "code", "execution_count": 1, "metadata": {},
         "outputs": [{"name": "stdout", "output_type": "stream", "text": ["576\n"]}],
         "source": ["print(512 + 64)"]},
    ],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                "name": "python3"}, "language_info": {"name": "python"}},
    "nbformat": 4, "nbformat_minor": 5,
}


@pytest.fixture(scope="module")
def notebook_site(tmp_path_factory) -> Path:
    """The site built from a copy of the tree with one probe notebook under tutorials/, so the
    notebook path (mkdocs-jupyter, the nav entry, MathJax on $-math, no CDN) is tested before
    the real tutorials land."""
    tree = tmp_path_factory.mktemp("tree")
    shutil.copy2(ROOT / "mkdocs.yml", tree / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tree / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("mla", "csrc", "benchmarks"):
        if (ROOT / name).exists():
            (tree / name).symlink_to(ROOT / name)
    (tree / "tutorials").mkdir()
    (tree / "tutorials" / "00_probe.ipynb").write_text(json.dumps(_PROBE_NOTEBOOK))
    out = tree / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                           str(out)], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"build with a notebook failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_notebooks_render_offline_with_math(notebook_site, browser):
    page_dir = notebook_site / "tutorials" / "00_probe"
    html = (page_dir / "index.html").read_text(encoding="utf-8")
    assert 'src=""' not in html and "cdnjs" not in html, "nbconvert's CDN scripts were left in"
    assert "00. Probe" in (notebook_site / "index.html").read_text(encoding="utf-8"), \
        "the notebook is not in the nav"
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda e: errors.append(str(e)))
    base = _serve(notebook_site)
    page.goto(urljoin(next(base), "tutorials/00_probe/"), wait_until="load")
    page.wait_for_function("window.MathJax && MathJax.startup && MathJax.startup.promise",
                           timeout=20000)
    page.evaluate("MathJax.startup.promise.then(() => 1)")
    assert page.locator(".jp-RenderedMarkdown mjx-container").count() == 2
    assert not _RAW_TEX.findall(page.evaluate(_VISIBLE_TEXT)), "raw TeX left in the notebook"
    assert "$" not in page.locator(".jp-RenderedMarkdown").first.inner_text()
    left = page.evaluate(_TEX_LEFT_IN_TEXT)
    assert not left, f"TeX left as text in the notebook or its table of contents: {left[:5]}"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "tutorials_probe.png"), full_page=True)
    page.close()
    base.close()
    assert not errors, errors


class _OpenRequests:
    """The requests a page has made and not yet seen finish or fail, and when the last of
    those events came.

    Stands in for Playwright's "networkidle", which waits for the same quiet (it too leaves
    EventSource streams out) but, when a page does not settle, times out without saying what
    it waited for; this one names the requests still open when it gives up.
    """

    def __init__(self, page):
        self.open: dict[int, str] = {}
        self.last_event = time.monotonic()
        page.on("request", self._started)
        page.on("requestfinished", self._ended)
        page.on("requestfailed", self._ended)

    def _started(self, request):
        self.last_event = time.monotonic()
        if request.resource_type != "eventsource":
            self.open[id(request)] = request.url

    def _ended(self, request):
        self.last_event = time.monotonic()
        self.open.pop(id(request), None)

    def settle(self, page, seconds: float, quiet: float = 0.5) -> list[str]:
        """Waits until no request is open and none has started or ended for `quiet` seconds,
        and returns []; or returns the URLs still open after `seconds`. Playwright delivers
        the page's events while `wait_for_timeout` runs."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not self.open and time.monotonic() - self.last_event >= quiet:
                return []
            page.wait_for_timeout(50)
        return sorted(self.open.values())


class _FakePage:
    """Just enough of a Playwright page for _OpenRequests: handlers, and a wait that delivers
    the events scheduled for its moment."""

    def __init__(self, script):
        self.handlers: dict[str, list] = {}
        self.script = script  # [(waits before delivery, event, request)]
        self.waits = 0

    def on(self, event, handler):
        self.handlers.setdefault(event, []).append(handler)

    def wait_for_timeout(self, ms):
        time.sleep(ms / 1000)
        self.waits += 1
        for at, event, request in self.script:
            if at == self.waits:
                for handler in self.handlers.get(event, []):
                    handler(request)


class _Req:
    def __init__(self, url, resource_type="fetch"):
        self.url, self.resource_type = url, resource_type


def test_open_requests_names_what_never_finished():
    index, font, hung = _Req("search_index.json"), _Req("font.woff"), _Req("hung.js")
    stream = _Req("events", "eventsource")  # open for the page's life, as networkidle allows
    page = _FakePage([(1, "request", index), (1, "request", font), (1, "request", stream),
                      (2, "request", hung), (3, "requestfinished", index),
                      (4, "requestfailed", font)])
    assert _OpenRequests(page).settle(page, seconds=1.5, quiet=0.2) == ["hung.js"]
    # a page that settles: each wait sleeps at least 50 ms, so the quiet after the finish at
    # wait 3 takes at least two more
    page = _FakePage([(1, "request", index), (3, "requestfinished", index)])
    assert _OpenRequests(page).settle(page, seconds=5, quiet=0.1) == []
    assert page.waits >= 5
    # a request that starts and ends between two looks restarts the quiet all the same
    page = _FakePage([(2, "request", font), (2, "requestfinished", font)])
    assert _OpenRequests(page).settle(page, seconds=5, quiet=0.2) == []
    assert page.waits >= 6


def test_pages_in_the_browser(site, server, browser):
    pages = _pages(site)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page()
    # on a machine busy with other work a page's load can take past Playwright's default 30 s
    page.set_default_timeout(120_000)
    problems: list[str] = []
    current = {"url": ""}
    page.on("console", lambda m: m.type == "error" and problems.append(
        f"{current['url']}: console error: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"{current['url']}: page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(
        f"{current['url']}: request failed: {r.url} ({r.failure})"))
    open_requests = _OpenRequests(page)
    page.on("response", lambda r: r.status >= 400 and problems.append(
        f"{current['url']}: {r.status} for {r.url}"))
    links: set[str] = set()
    math_pages = 0
    for path in pages:
        url = current["url"] = urljoin(server, path)
        page.goto(url, wait_until="load")
        html = (site / path / "index.html").read_text(encoding="utf-8")
        has_math = 'class="arithmatex"' in html or "jp-RenderedMarkdown" in html and "$" in html
        page.wait_for_function("window.MathJax && MathJax.startup && MathJax.startup.promise",
                               timeout=20000)
        page.evaluate("MathJax.startup.promise.then(() => document.fonts.ready).then(() => 1)")
        if has_math:
            math_pages += 1
            assert page.locator("mjx-container").count() > 0, f"{path}: math not typeset"
            assert page.locator("mjx-merror").count() == 0, \
                f"{path}: MathJax error: {page.locator('mjx-merror').first.inner_text()}"
            glyph = page.evaluate(_GLYPHS_DRAWN)
            assert glyph not in (None, "none", "normal"), f"{path}: MathJax drew no glyphs"
            raw = _RAW_TEX.findall(page.evaluate(_VISIBLE_TEXT))
            assert not raw, f"{path}: raw TeX left in the text: {raw[:5]}"
        # on every page, math or not: a page whose only display block went untypeset has no
        # arithmatex element at all
        left = page.evaluate(_TEX_LEFT_IN_TEXT)
        if left:
            problems.append(f"{path}: TeX left as text (not typeset): {left[:3]}")
        for href in page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)"):
            parsed = urlparse(href)
            if href.startswith(server):
                links.add(href.split("#", 1)[0])
            elif parsed.scheme not in ("http", "https", "mailto", "javascript", ""):
                problems.append(f"{path}: odd link {href}")
        if path.startswith("derivations/") or path in ("", "tiers/absorbed/", "benchmarks/"):
            name = (path.strip("/").replace("/", "_") or "home") + ".png"
            page.screenshot(path=str(SCREENSHOTS / name), full_page=True)
        # the page's own requests done (the search index among them) before the next page is
        # asked for: a request the next navigation cuts off would read as a failed one
        left_open = open_requests.settle(page, seconds=120)
        assert not left_open, f"{path}: requests still open after 120 s: {left_open}"
    page.close()
    assert math_pages >= 5, f"only {math_pages} pages with math"
    for link in sorted(links):
        try:
            with urllib.request.urlopen(link, timeout=10) as response:
                status = response.status
        except urllib.error.HTTPError as err:
            status = err.code
        if status != 200:
            problems.append(f"broken link {link}: {status}")
    assert not problems, "\n".join(problems)
