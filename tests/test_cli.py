"""The command line: demo (every tier agrees with naive), memory (the paper's figures)."""

import json
import subprocess
import sys

import pytest


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mla", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_demo_all_tiers_agree_and_writes_json(tmp_path):
    out = tmp_path / "demo.json"
    proc = _run("demo", "--preset", "tiny", "--batch", "3", "--prompt-len", "20",
                "--decode-steps", "4", "--no-progress", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "tiers agree with naive within 0.0001: yes" in proc.stdout
    result = json.loads(out.read_text())
    assert [r["tier"] for r in result["tiers"]] == ["naive", "absorbed", "paged"]
    assert all(r["max_rel_err_vs_naive"] < 1e-4 for r in result["tiers"])
    assert result["tiers"][1]["kv_bytes_per_token_layer"] == (32 + 8) * 4


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
