"""The Triton kernels compile for an H100 / H200 (sm_90) with the Triton installed here, on any
machine: benchmarks/compile_triton.py runs the wrappers on meta tensors under a stand-in driver
and Triton's own ptxas. On the CPU the tests run the kernels in Triton's interpreter, which
compiles nothing; this is where a kernel that cannot compile for a GPU, or outgrows its shared
memory, shows before a GPU run."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_triton_kernels_compile_for_sm90_and_fp8_tiles_spill_under_a_kilobyte(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_triton.py"), "--out", str(tmp_path),
                           "--quick"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr  # a compile error, or over the shared memory
    (path,) = tmp_path.glob("triton-compile-*-sm90.json")
    cases = json.loads(path.read_text())["cases"]
    kernels = {kernel["kernel"] for case in cases for kernel in case["kernels"]}
    assert kernels == {"_mla_decode_split_kernel", "_mla_decode_merge_kernel", "mla_prefill_kernel"}
    # default_config's 16-row fp8 tile, the fastest timed on an H200, spills nothing or a few
    # dozen bytes by Triton version; a kilobyte asks for the tile to be timed again
    for case in cases:
        if "fp8" in case["case"]:
            for kernel in case["kernels"]:
                assert kernel["registers"] is not None, case  # ptxas's report was read
                assert kernel["spill_store_bytes"] < 1024, (case["case"], kernel)


def test_on_a_gpu_with_99_kb_of_shared_memory_the_kernels_step_down_until_they_fit(tmp_path):
    # sm_89 (RTX 4090, L40): the prefill's default tile needs 128 KB; Triton refuses it before it
    # launches, and mla_prefill launches the next configuration down
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_triton.py"), "--out", str(tmp_path),
                           "--quick", "--arch", "89"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = tmp_path.glob("triton-compile-*-sm89.json")
    report = json.loads(path.read_text())
    for case in report["cases"]:
        assert case["error"] is None, case
        launched = [k for k in case["kernels"] if k["launched"]]
        assert all(k["shared_bytes"] <= report["shared_limit"] for k in launched), case
    prefill = [k for case in report["cases"] for k in case["kernels"] if k["kernel"] == "mla_prefill_kernel"]
    assert [k["launched"] for k in prefill] == [False, True]  # refused, then a smaller one ran
