"""The benchmark suite's CPU-side parts (benchmarks/): timing helpers, the decode benchmark's
arguments, reference, floor, table, JSON and plot, built from fake timings. The GPU runs
themselves are not tested here; the lead runs them on the H200."""

import json

import pytest
import torch

import mla
import mla.kernels  # noqa: F401  (sets TRITON_INTERPRET before triton is imported on a CPU machine)
from benchmarks import bench_decode as bd
from benchmarks import timing
from mla.kernels import decode
from mla.kernels.backends import sm_count
from mla.kernels.decode import choose_num_kv_splits, mla_decode_reference

# ---- timing.py ------------------------------------------------------------------------------


def test_l2_clear_names_its_modes():
    # every decode time is taken after clear_l2: a mode it does not know must not fall through to
    # one of the two (a silent change of what the figures mean)
    with pytest.raises(ValueError, match="'clean' or 'dirty'.*'cold'"):
        timing.clear_l2("cold")


def test_clean_l2_clear_only_reads():
    # the clean clear must read its buffer and write nothing: summing int32 into int64 would
    # first make a promoted copy of the whole buffer (512 MiB of writes)
    from torch.profiler import ProfilerActivity, profile

    try:
        timing.clear_l2("clean", device="cpu")
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            timing.clear_l2("clean", device="cpu")
        whole = [timing.L2_CLEAR_BYTES // 4]  # the buffer's shape
        ops = [(e.name, e.input_shapes) for e in prof.events()]
        assert any(name == "aten::sum" and whole in shapes for name, shapes in ops), ops
        copies = [name for name, shapes in ops if name in ("aten::to", "aten::_to_copy", "aten::copy_", "aten::zero_")
                  and whole in shapes]
        assert not copies, ops
    finally:
        timing._l2_buffers.pop(torch.device("cpu"), None)


def test_device_prefix_names_result_files():
    assert timing.device_prefix("NVIDIA H200") == "h200"
    assert timing.device_prefix("cpu") == "cpu"
    assert timing.device_prefix("NVIDIA A100-SXM4-80GB") == "nvidia-a100-sxm4-80gb"


# ---- bench_decode.py: what a captured layer step fixes -----------------------------------------


def test_layer_splits_is_what_mla_decode_picks_for_the_cache():
    # bench_layer.py and bench_tp.py fix a captured step's split count with this helper: it must
    # read the paged cache's fields and agree with the kernel choice mla_decode makes

    paged = mla.build(mla.MLAWeights(mla.MLAConfig.from_preset("tiny")), "paged", block_size=64)
    cache = paged.new_cache(3, 4096)
    lengths = torch.tensor([100, 2000, 40])
    cache.allocate(torch.arange(3), lengths)
    cache.seq_lens[:] = lengths.to(cache.seq_lens)
    kernel, splits = bd.layer_splits(paged.config, cache)
    h = paged.config.num_heads
    config = decode.default_config(h)
    want = choose_num_kv_splits(3, h, 2001, sm_count(cache.kv_cache.device),
                                block_h=config["BLOCK_H"], block_n=config["BLOCK_N"])
    assert (kernel, splits) == ("triton", want)  # on the CPU mla_decode runs the Triton kernel


@pytest.mark.parametrize("kernel, block_h, block_n", [("cuda-sm80", 16, 32), ("cuda-sm90", 64, 64)])
def test_kernel_and_splits_plans_a_cuda_kernel_with_its_tile(kernel, block_h, block_n, monkeypatch):
    # on a GPU mla_decode plans a CUDA stage 1's splits with that kernel's tile (and the wgmma one
    # within one wave); the CPU never picks a CUDA kernel, so the choice is forced here
    from mla.kernels import backends

    monkeypatch.setattr(backends, "choose_decode_backend", lambda *args, **kwargs: kernel)
    q, (cache,), table, lens = bd.make_inputs(2, 4096, 16, s_q=2, device="cpu")
    got, config, splits = bd.kernel_and_splits(q, cache, table, lens, bd.C, 4096, 132)
    want = choose_num_kv_splits(2, 32, 4096, 132, block_h=block_h, block_n=block_n, one_wave=kernel == "cuda-sm90")
    assert got == kernel and (config["BLOCK_H"], config["BLOCK_N"]) == (block_h, block_n)
    assert splits == want


# ---- bench_decode.py: arguments -----------------------------------------------------------------


def test_decode_arguments_default_to_the_issue_table():
    args = bd.parse_args([])
    assert args.shapes == bd.SHAPES and args.s_q == [1] and args.flashmla
    assert sorted((b, t) for b, t, h in bd.SHAPES if h == 16) == [
        (1, 32768), (4, 131072), (64, 4096), (64, 16384), (128, 8192)]
    assert sorted((b, t) for b, t, h in bd.SHAPES if h == 128) == [
        (1, 32768), (4, 131072), (16, 4096), (64, 4096), (64, 16384), (128, 8192)]
    args = bd.parse_args(["--shapes", "2x4096x16, 1X64x128", "--s-q", "1,2,4", "--no-flashmla", "--out", "d"])
    assert args.shapes == [(2, 4096, 16), (1, 64, 128)] and args.s_q == [1, 2, 4]
    assert not args.flashmla and args.out == "d"


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "64x4096"], "a shape is BxTxH"),
    (["--shapes", "0x4096x16"], "a shape is BxTxH"),
    (["--s-q", "9"], "--s-q takes query lengths from 1 to 8"),
    (["--s-q", "1,x"], "--s-q takes query lengths from 1 to 8"),
])
def test_decode_arguments_refuse_bad_values(argv, message, capsys):
    with pytest.raises(SystemExit):
        bd.parse_args(argv)
    assert message in capsys.readouterr().err


def test_decode_arguments_are_checked(capsys):
    # a bad --s-q stops at the script's own arguments, naming the option
    with pytest.raises(SystemExit):
        bd.parse_args(["--s-q", "0"])
    assert "--s-q takes query lengths from 1 to 8" in capsys.readouterr().err


# ---- bench_decode.py: the torch baseline and the floor ---------------------------------------------


def test_torch_baseline_is_the_reference_for_one_query_token():
    q, (cache,), table, lens = bd.make_inputs(2, 100, 3, device="cpu")
    lens[1] = 37
    out, lse = bd.torch_decode(q.float(), cache.float(), table, lens)
    want_out, want_lse = mla_decode_reference(q.float(), cache.float(), table, lens, kv_lora_rank=bd.C,
                                              softmax_scale=bd.SCALE)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)


def test_torch_baseline_is_causal_among_the_new_tokens():
    # query j of s_q sees seq_len - (s_q - 1 - j) cached rows (FlashMLA's causal convention): each
    # row equals a one-token decode over that many rows
    s_q = 3
    q, (cache,), table, lens = bd.make_inputs(2, 70, 2, s_q=s_q, device="cpu")
    lens[0] = 65
    q, cache = q.float(), cache.float()
    out, lse = bd.torch_decode(q, cache, table, lens)
    assert out.shape == (2, s_q, 2, bd.C) and lse.shape == (2, s_q, 2)
    for j in range(s_q):
        one_out, one_lse = bd.torch_decode(q[:, j], cache, table, lens - (s_q - 1 - j))
        torch.testing.assert_close(out[:, j], one_out)
        torch.testing.assert_close(lse[:, j], one_lse)


def test_floor_grows_with_the_query_tokens():
    # compute bound (a huge copy bandwidth): the floor is the FLOPs, which scale with s_q
    one, bound = bd.floor_us(4, 4096, 128, 1e12, 700.0)
    two, _ = bd.floor_us(4, 4096, 128, 1e12, 700.0, s_q=2)
    assert bound == "compute" and two == pytest.approx(2 * one)
    # memory bound (a huge matmul rate): the cache is read once whatever s_q is
    one, bound = bd.floor_us(4, 4096, 16, 4000.0, 1e9)
    two, _ = bd.floor_us(4, 4096, 16, 4000.0, 1e9, s_q=2)
    assert bound == "memory" and one < two < 1.01 * one


# ---- bench_decode.py: table, JSON and plot from fake timings ----------------------------------------


def _fake_result(flashmla: bool) -> dict:
    rows = []
    for (b, t, h), (ours, theirs) in zip(bd.SHAPES[:3], [(22.9, 55.1), (161.0, 161.0), (86.4, 89.8)]):
        floor, bound = bd.floor_us(b, t, h, 4242.0, 690.0)
        row = dict(b=b, t=t, h=h, s_q=1, page=bd.PAGE, copies=1, floor_us=floor, bound=bound, time_us=ours,
                   flashmla_us=theirs if flashmla else None, flashmla_max_abs_diff=1e-3 if flashmla else None,
                   config=dict(kernel="cuda-sm80", num_kv_splits=4), max_rel_err_vs_torch=0.01)
        rows.append(bd.add_ratios(row))
    rows.append(bd.add_ratios(dict(b=1, t=64, h=128, s_q=2, floor_us=1.0, bound="memory", time_us=None,
                                   flashmla_us=None, error="ValueError: s_q > 1")))
    status = "1.0" if flashmla else "not importable (ModuleNotFoundError: No module named 'flash_mla')"
    return dict(device="NVIDIA H200", copy_GBps=4242.0, matmul_TFLOPs=690.0,
                flashmla="1.0" if flashmla else None, flashmla_status=status, rows=rows)


def test_ratios_come_from_the_times():
    result = _fake_result(flashmla=True)
    first = result["rows"][0]
    assert first["flashmla_over_mla"] == pytest.approx(55.1 / 22.9)
    assert first["share_of_floor"] == pytest.approx(first["floor_us"] / 22.9)
    failed = result["rows"][-1]
    assert failed["flashmla_over_mla"] is None and failed["share_of_floor"] is None


def test_table_says_when_flashmla_did_not_run():
    without = [bd.format_row(r) for r in _fake_result(flashmla=False)["rows"]]
    with_it = [bd.format_row(r) for r in _fake_result(flashmla=True)["rows"]]
    assert all(line.count("n/a") == 3 for line in without[:3])  # flashmla us, FM/mla, FM diff
    assert all("n/a" not in line for line in with_it[:3])
    assert f"{55.1 / 22.9:.2f}" in with_it[0]
    assert "error" in without[-1] and "ValueError: s_q > 1" in without[-1]


@pytest.mark.parametrize("flashmla", [False, True])
def test_results_are_written_with_null_flashmla_columns_when_it_is_missing(tmp_path, flashmla):
    paths = bd.write_results(tmp_path, _fake_result(flashmla))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["h200-decode.json", "h200-decode.png"]
    data = json.loads((tmp_path / "h200-decode.json").read_text())
    for row in data["rows"][:3]:
        assert "flashmla_us" in row and "flashmla_over_mla" in row
        assert (row["flashmla_us"] is None) == (not flashmla)
        assert (row["flashmla_over_mla"] is None) == (not flashmla)
    assert (data["flashmla"] is None) == (not flashmla)
    assert (tmp_path / "h200-decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_flashmla_is_reported_missing_here():
    ok, what = bd.flashmla_status()
    if ok:  # a machine with FlashMLA installed: nothing to say about its absence
        pytest.skip(f"flash_mla imports here ({what})")
    assert what.startswith("not importable (")


# ---- bench_prefill.py --------------------------------------------------------------------------------


def test_prefill_arguments_default_to_the_issue_list():
    from benchmarks import bench_prefill as bp

    assert bp.parse_args([]).shapes == bp.SHAPES
    assert {(b, s) for b, s, t in bp.SHAPES if t == 0} == {
        (1, 1024), (1, 4096), (4, 2048), (1, 8192), (1, 16384), (1, 32768), (1, 131072)}
    assert {(b, s, t) for b, s, t in bp.SHAPES if t} == {(1, 4096, 32768), (1, 4096, 131072)}
    assert bp.parse_args(["--shapes", "2x64, 1x4096+32768"]).shapes == [(2, 64, 0), (1, 4096, 32768)]


@pytest.mark.parametrize("text", ["64", "0x64", "1x64+", "1x64+x"])
def test_prefill_arguments_refuse_bad_shapes(text, capsys):
    from benchmarks import bench_prefill as bp

    with pytest.raises(SystemExit):
        bp.parse_args(["--shapes", text])
    assert "a shape is BxS or BxS+T" in capsys.readouterr().err


def test_prefill_flops_count_the_causal_pairs():
    from benchmarks import bench_prefill as bp

    # by brute force: query i of s (at position t + i) scores keys 0 .. t + i
    for s, t in [(1, 0), (5, 0), (3, 7)]:
        assert bp.causal_pairs(s, t) == sum(t + i + 1 for i in range(s))
    v3 = mla.MLAConfig.from_preset("deepseek-v3")
    assert bp.attention_flops(v3, 2, 3, 7) == 2 * bp.causal_pairs(3, 7) * 128 * 2 * (128 + 64 + 128)


def test_prefill_table_and_rates_from_fake_timings():
    from benchmarks import bench_prefill as bp

    row = bp.add_rates(dict(b=1, s=4096, t=0, layer_ms=4.0, layer_attention_ms=2.5, sdpa_cudnn_ms=2.0,
                            sdpa_efficient_ms=5.0, sdpa_flash_error="RuntimeError: no kernel",
                            sdpa_layer_ms=5.0, flex_error="compile failed"), 10**12)
    assert row["layer_TFLOPs"] == pytest.approx(250.0) and row["sdpa_cudnn_TFLOPs"] == pytest.approx(500.0)
    assert row["sdpa_flash_TFLOPs"] is None and row["layer_triton_TFLOPs"] is None
    # whole call over whole call; attention over the fastest SDPA attention; the mixed ratio
    assert row["layer_over_sdpa_layer"] == pytest.approx(0.8)
    assert row["layer_attention_over_best_sdpa"] == pytest.approx(1.25)
    assert row["layer_over_best_sdpa"] == pytest.approx(2.0)
    assert bp.best_sdpa(row) == ("cudnn", 2.0) and bp.best_sdpa(row, ("efficient", "flash")) == ("efficient", 5.0)
    line = bp.format_row(row)
    assert "4.00 (250)" in line and "2.00 (500)" in line and line.count("error") == 2
    assert line.split()[-2:] == ["0.80", "1.25"]
    assert bp.format_row(dict(b=1, s=8, t=0)).split()[-2:] == ["-", "-"]


def test_prefill_sdpa_layer_is_the_layer_with_sdpa_attention(monkeypatch):
    """The sdpa_layer contender's attention (whole sequences up-projected, one SDPA call, the
    bottom-right causal mask over a context) gives the naive tier's outputs: prompts, then an
    extend over them. On the CPU torch chooses the SDPA backend (the GPU's are named)."""
    import contextlib

    from benchmarks import bench_prefill as bp

    monkeypatch.setattr(bp, "_sdpa_kernel", lambda backend: contextlib.nullcontext())
    weights = mla.MLAWeights(mla.MLAConfig.from_preset("tiny"), dtype=torch.float32, seed=2)
    naive = mla.build(weights, "naive")
    paged = mla.build(weights, "paged", block_size=4, shuffle=1, prefill="up-project")
    paged.attend_prefill = bp.sdpa_attend_prefill(paged, "cudnn")
    n_cache, p_cache = naive.new_cache(2, 40), paged.new_cache(2, 40)
    gen = torch.Generator().manual_seed(0)
    for s in (11, 6):
        x = torch.randn(2, s, weights.config.hidden_size, generator=gen)
        with torch.no_grad():
            ref, out = naive(x, n_cache), paged(x, p_cache)
        assert float((out - ref).norm() / ref.norm()) < 1e-5, s
    with pytest.raises(ValueError, match="rows of one length"):
        with torch.no_grad():
            paged(torch.randn(2, 8, weights.config.hidden_size), p_cache, [8, 5])


def test_prefill_host_diagnostics():
    """What bench_prefill records beside the times, checked where it does not need a GPU."""
    import subprocess
    import sys

    from benchmarks import bench_prefill as bp

    if sys.platform.startswith("linux"):
        before = bp.host_load()["descendants"]
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert bp.host_load()["descendants"] == before + 1
        finally:
            child.kill()
            child.wait()
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    previous = getattr(getattr(knobs, "runtime", None), "jit_cache_hook", None)
    with bp.counting_triton_compiles() as compiles:
        if compiles["n"] is not None:
            assert knobs.runtime.jit_cache_hook is not previous
            assert knobs.runtime.jit_cache_hook("key") is False and compiles["n"] == 1
    if knobs is not None:
        assert knobs.runtime.jit_cache_hook is previous


def test_docs_read_the_prefill_results_bench_prefill_writes():
    # the docs' hooks draw and describe benchmarks/results/h200-prefill.json: they must read the
    # fields bench_prefill.py writes (a contender that failed has no time), and still the
    # crossover runs of the two prefill paths committed before it
    import importlib.util
    from pathlib import Path

    from benchmarks import bench_prefill as bp

    spec = importlib.util.spec_from_file_location("docs_hooks", Path(__file__).parents[1] / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    rows = [bp.add_rates(dict(b=1, s=4096, t=0, layer_ms=4.0, sdpa_cudnn_ms=2.0, sdpa_efficient_ms=5.0,
                              sdpa_flash_ms=3.0, flex_error="compile failed"), 10**12),
            bp.add_rates(dict(b=1, s=4096, t=32768, layer_ms=30.0, sdpa_cudnn_ms=20.0, sdpa_efficient_ms=40.0,
                              sdpa_flash_ms=25.0, flex_ms=35.0), 10**13)]
    result = dict(device="NVIDIA H200", config="deepseek-v3", dtype="bfloat16", matmul_TFLOPs=700.0, rows=rows)
    assert not hooks._is_crossover_run(result)
    fig = hooks._plot_prefill(result)
    assert [len(ax.patches) for ax in fig.axes] == [9, 9]  # the bars of the timed contenders
    text = hooks._contenders_sentence(hooks.RESULTS / "h200-prefill.json", result)
    assert "at 2 shapes" in text and "1.50x to 2.00x" in text
    crossover = dict(rows=[dict(b=1, s=s, t=4096, up_project_ms=up, absorbed_ms=ab)
                           for s, up, ab in ((32, 1.9, 1.7), (64, 2.4, 2.8), (128, 2.5, 3.9))])
    assert hooks._is_crossover_run(crossover) and hooks._prefill_crossovers(crossover) == {1: 64}
    assert len(hooks._plot_prefill(crossover).axes) == 2
