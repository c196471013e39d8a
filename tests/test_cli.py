"""The command line: demo (every tier agrees with naive), memory (the paper's figures), bench
(forwards to benchmarks/), and bad input refused with a message that names the option."""

import json
import math
import re
import subprocess
import sys
import sysconfig
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import torch

import mla
from mla import cli

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the command runs")
# naive and absorbed only: quick on the CPU (the paged tier's kernels run in Triton's interpreter)
SMALL_DEMO = ["demo", "--preset", "tiny", "--tiers", "absorbed", "--batch", "2",
              "--prompt-len", "5", "--decode-steps", "2", "--no-progress"]


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mla", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_demo_all_tiers_agree_and_writes_json(tmp_path):
    out = tmp_path / "demo.json"
    proc = _run("demo", "--preset", "tiny", "--batch", "3", "--prompt-len", "20",
                "--decode-steps", "4", "--no-progress", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "tiers agree with naive within 0.0001: yes" in proc.stdout
    assert "fp8 caches within 0.0625 of naive (half an e4m3 step): yes" in proc.stdout
    # tiny's latent (c = 32) has no 128-value groups: the fp8_ds_mla row is skipped, and says why
    assert "fp8_ds_mla cache skipped: needs a latent width c that is a multiple of 128" in proc.stdout
    result = json.loads(out.read_text())
    rows = [(r["tier"], r["kv_cache_dtype"]) for r in result["tiers"]]
    assert rows == [("naive", "auto"), ("absorbed", "auto"), ("paged", "auto"),
                    ("paged", "fp8_e4m3")]
    assert all(r["max_rel_err_vs_naive"] < 1e-4 for r in result["tiers"][:3])
    # the fp8 cache's error is e4m3's (about 2^-5), not float32's, and within half a step
    assert 1e-3 < result["tiers"][3]["max_rel_err_vs_naive"] < 2**-4
    assert [r["kv_bytes_per_token_layer"] for r in result["tiers"]] == [(32 + 8) * 4] * 3 + [40]


def test_demo_runs_the_paged_tier_on_each_fp8_cache(tmp_path):
    """At a latent of 128 every layout runs; --kv-cache-dtype picks them."""
    import mla.config as config
    out = tmp_path / "demo.json"
    tiny128 = dict(config.PRESETS["tiny"], kv_lora_rank=128)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(config.PRESETS, "tiny", tiny128)
        cli.main(["demo", "--preset", "tiny", "--tiers", "paged", "--batch", "2", "--prompt-len",
                  "3", "--decode-steps", "1", "--no-progress", "--json", str(out)])
        rows = json.loads(out.read_text())["tiers"]
        assert [r["kv_cache_dtype"] for r in rows] == ["auto", "auto", "fp8_e4m3", "fp8_ds_mla"]
        assert [r["kv_bytes_per_token_layer"] for r in rows] == [(128 + 8) * 4] * 2 + [136, 148]
        cli.main(["demo", "--preset", "tiny", "--tiers", "paged", "--kv-cache-dtype",
                  "auto,fp8_ds_mla", "--batch", "1", "--prompt-len", "2", "--decode-steps", "0",
                  "--no-progress", "--json", str(out)])
        assert [r["kv_cache_dtype"] for r in json.loads(out.read_text())["tiers"]] == [
            "auto", "auto", "fp8_ds_mla"]
        # the alias and a repeat: each layout once
        cli.main(["demo", "--preset", "tiny", "--tiers", "paged", "--kv-cache-dtype",
                  "fp8,fp8_e4m3", "--batch", "1", "--prompt-len", "2", "--decode-steps", "0",
                  "--no-progress", "--json", str(out)])
        assert [r["kv_cache_dtype"] for r in json.loads(out.read_text())["tiers"]] == [
            "auto", "auto", "fp8_e4m3"]
    for bad in ("fp16", "auto,fp8_e5m2"):
        proc = _run("demo", "--kv-cache-dtype", bad)
        assert proc.returncode == 2 and "--kv-cache-dtype: expected some of auto" in proc.stderr


def test_demo_rejects_unknown_tier():
    proc = _run("demo", "--preset", "tiny", "--tiers", "naive,turbo")
    assert proc.returncode != 0 and "unknown tier 'turbo'" in proc.stderr


def test_memory_reproduces_paper_figures():
    proc = _run("memory", "--preset", "deepseek-v2")
    assert proc.returncode == 0, proc.stderr
    assert "2.25 groups" in proc.stdout and "93.3% smaller" in proc.stdout


@pytest.mark.parametrize("args", [["bench"], ["frobnicate"]])
def test_bad_commands(args):
    assert _run(*args).returncode == 2


def _normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_demo_imports_only_what_the_package_declares():
    """`make demo` installs mla and its dependencies and nothing else: every module the demo
    loads (Triton's interpreter included) is from the standard library, from a dependency that
    pyproject.toml declares, or from what one of those requires in turn."""
    requirements = pytest.importorskip("packaging.requirements")
    demo = ["demo", "--preset", "tiny", "--tiers", "paged", "--batch", "1", "--prompt-len", "2",
            "--decode-steps", "1", "--no-progress"]
    code = ("import sys; before = set(sys.modules); from mla.cli import main; "
            f"main({demo!r}); "
            "print(*sorted({m.__file__ for n, m in list(sys.modules.items()) "
            "if n not in before and getattr(m, '__file__', None)}), sep='\\n')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    site_dirs = {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    owners = metadata.packages_distributions()  # top-level module -> distributions
    loaded = set()
    for file in proc.stdout.split():
        for site in site_dirs:
            if Path(file).is_relative_to(site):
                top = Path(file).relative_to(site).parts[0].split(".")[0]
                loaded.update(_normalize(d) for d in owners.get(top, [top]))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [requirements.Requirement(r).name for r in project["dependencies"]]
    allowed = set()
    while todo:  # the declared dependencies and, recursively, what they require
        name = _normalize(todo.pop())
        if name in allowed:
            continue
        try:
            files, requires = metadata.files(name), metadata.requires(name)
        except metadata.PackageNotFoundError:  # an optional requirement, not installed
            continue
        allowed.add(name)
        # what it vendors and puts on sys.path (setuptools: packaging, jaraco, ...)
        allowed.update(_normalize(f.parent.name.split("-")[0]) for f in files or []
                       if "_vendor" in f.parts and f.parent.name.endswith(".dist-info"))
        for text in requires or []:
            req = requirements.Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    assert "torch" in loaded and "triton" in loaded
    assert loaded - {"mla"} <= allowed, f"undeclared: {sorted(loaded - {'mla'} - allowed)}"


# ---- the demo's figures ---------------------------------------------------------------------
class _Wrapped:
    """A built tier with a hook on its calls: `hook(call_number, x, y)` returns the output."""

    def __init__(self, layer, hook):
        self.layer, self.hook, self.calls = layer, hook, 0

    def new_cache(self, *args, **kwargs):
        return self.layer.new_cache(*args, **kwargs)

    def __call__(self, x, cache, lengths=None):
        self.calls += 1
        return self.hook(self.calls, x, self.layer(x, cache, lengths))


def _wrap_tier(monkeypatch, tier, hook):
    def build(weights, name, **options):
        layer = mla.build(weights, name, **options)
        return _Wrapped(layer, hook) if name == tier else layer

    monkeypatch.setattr(cli, "build", build)


def test_demo_reports_nan_and_disagrees(tmp_path, monkeypatch, capsys):
    """A tier whose decode steps give NaN: the error column says nan (not the prefill's small
    error), the tiers do not agree, the demo exits 1."""
    _wrap_tier(monkeypatch, "absorbed",
               lambda call, x, y: torch.full_like(y, math.nan) if x.shape[1] == 1 else y)
    out = tmp_path / "demo.json"
    with pytest.raises(SystemExit) as exit_:
        cli.main([*SMALL_DEMO, "--json", str(out)])
    assert exit_.value.code == 1
    printed = capsys.readouterr().out
    assert "tiers agree with naive within 0.0001: NO" in printed
    errors = {r["tier"]: r["max_rel_err_vs_naive"] for r in json.loads(out.read_text())["tiers"]}
    assert errors["naive"] == 0.0 and math.isnan(errors["absorbed"])


def test_demo_warms_up_before_timing(tmp_path, monkeypatch):
    """The first call of a tier (kernel compilation, on a GPU) is not what the table reports."""
    def slow_first_call(call, x, y):
        if call == 1:
            time.sleep(0.5)
        return y

    _wrap_tier(monkeypatch, "absorbed", slow_first_call)
    out = tmp_path / "demo.json"
    cli.main([*SMALL_DEMO, "--json", str(out)])
    absorbed = json.loads(out.read_text())["tiers"][1]
    assert absorbed["tier"] == "absorbed" and absorbed["prefill_ms"] < 400, absorbed


@pytest.mark.parametrize("dtype", sorted(cli.DTYPES))
def test_every_dtype_the_demo_offers_runs_in_every_tier(dtype):
    """--dtype offers only what all three tiers build and run with (the paged tier refuses
    float64)."""
    weights = mla.MLAWeights(mla.MLAConfig.from_preset("tiny"), dtype=cli.DTYPES[dtype], seed=0)
    x = torch.randn(2, 3, weights.config.hidden_size, dtype=cli.DTYPES[dtype])
    with torch.inference_mode():
        outputs = []
        for tier in mla.TIERS:
            layer = mla.build(weights, tier)
            outputs.append(layer(x, layer.new_cache(2, 4), [3, 2]).float())
    for y in outputs[1:]:
        assert ((y - outputs[0]).norm() / outputs[0].norm()) < 3e-2


# ---- bad input: a clear message that names the option, a non-zero exit, no traceback ---------
@pytest.mark.parametrize("args, message", [
    (["memory", "--seq-len", "-5"], "argument --seq-len: must be >= 1, got -5"),
    (["memory", "--seq-len", "0"], "argument --seq-len: must be >= 1, got 0"),
    (["demo", "--tp", "0"], "argument --tp: must be >= 1, got 0"),
    (["demo", "--batch", "0"], "argument --batch: must be >= 1, got 0"),
    (["demo", "--prompt-len", "1.5"], "argument --prompt-len: expected an int, got '1.5'"),
    (["demo", "--decode-steps", "-1"], "argument --decode-steps: must be >= 0, got -1"),
    (["demo", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["demo", "--device", "gpu"], "argument --device: expected cpu, cuda or cuda:N, got 'gpu'"),
])
def test_bad_options_are_refused_by_name(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@NO_GPU
@pytest.mark.parametrize("args, message", [
    (["demo", "--device", "cuda"], "demo --device cuda: needs a CUDA GPU"),
    (["demo", "--device", "cuda:1", "--tp", "2"], "demo --device cuda:1: needs a CUDA GPU"),
    (["bench", "decode"], "bench decode: needs a CUDA GPU"),
    (["bench", "concat"], "bench concat: needs a CUDA GPU"),
    (["bench", "layer", "--out", "x"], "bench layer: needs a CUDA GPU"),
    (["bench", "prefill", "--out", "x"], "bench prefill: needs a CUDA GPU"),
    (["bench", "tp", "--out", "x"], "--tp 2 needs 2 GPUs, 0 visible"),  # bench_tp.py says it
])
def test_gpu_commands_say_they_need_a_gpu(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=message):
        cli.main(args)
    assert not list(tmp_path.iterdir())  # nothing written


def test_gpu_commands_exit_without_a_traceback():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the command runs")
    proc = _run("bench", "layer", "--out", "x")
    assert proc.returncode == 1
    assert proc.stderr == "bench layer: needs a CUDA GPU, and torch sees none\n"


@pytest.mark.parametrize("which, option", [
    ("decode", "--shapes"), ("concat", "--out"), ("layer", "--batches"), ("prefill", "--shapes"),
    ("tp", "--context"),
])
def test_bench_help_is_the_benchmarks_own(which, option, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", which, "--help"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"usage: bench_{which}.py") and option in printed
