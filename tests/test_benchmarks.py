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


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_ds_mla"])
def test_layer_splits_is_what_mla_decode_picks_for_the_cache(kv_cache_dtype):
    # bench_layer.py and bench_tp.py fix a captured step's split count with this helper: it must
    # read the paged cache's fields (its layout too: an fp8 cache takes its own tile) and agree
    # with the kernel choice mla_decode makes

    cfg = mla.MLAConfig.from_preset("tiny").replace(kv_lora_rank=128)  # a whole fp8_ds_mla group
    paged = mla.build(mla.MLAWeights(cfg), "paged", block_size=64, kv_cache_dtype=kv_cache_dtype)
    cache = paged.new_cache(3, 4096)
    lengths = torch.tensor([100, 2000, 40])
    cache.allocate(torch.arange(3), lengths)
    cache.seq_lens[:] = lengths.to(cache.seq_lens)
    kernel, splits = bd.layer_splits(paged.config, cache)
    h = paged.config.num_heads
    config = decode.default_config(h, kv_cache_dtype)
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
    assert splits == want == decode.plan_num_kv_splits(kernel, 2, 32, 4096, 132)  # what mla_decode plans


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
    (["--kv-cache-dtype", "fp16"], "--kv-cache-dtype takes auto, fp8_e4m3, fp8_ds_mla"),
    (["--kv-cache-dtype", "auto,"], "--kv-cache-dtype takes auto, fp8_e4m3, fp8_ds_mla"),
    (["--kv-cache-dtype", "auto fp8_e4m3"], "--kv-cache-dtype takes auto, fp8_e4m3, fp8_ds_mla"),
])
def test_decode_arguments_refuse_bad_values(argv, message, capsys):
    with pytest.raises(SystemExit):
        bd.parse_args(argv)
    assert message in capsys.readouterr().err


def test_kv_cache_dtype_argument_lists_each_layout_once_in_order():
    # the default run times the bf16 cache only; "fp8" is mla_decode's alias of fp8_e4m3
    assert bd.parse_args([]).kv_cache_dtypes == ["auto"]
    args = bd.parse_args(["--kv-cache-dtype", "fp8_ds_mla, auto,fp8,fp8_e4m3"])
    assert args.kv_cache_dtypes == ["auto", "fp8_e4m3", "fp8_ds_mla"]
    assert bd.parse_args(["--kv-cache-dtype", "fp8_ds_mla"]).kv_cache_dtypes == ["fp8_ds_mla"]


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


def test_bench_runs_the_librarys_layouts():
    from mla.kernels import fp8

    assert bd.KV_CACHE_DTYPES == fp8.LAYOUTS
    assert {fp8.canonical_kv_cache_dtype(k) for k in fp8.KV_CACHE_DTYPES} == set(fp8.LAYOUTS)


def test_floor_reads_each_layouts_bytes():
    assert [bd.bytes_per_token(k) for k in bd.KV_CACHE_DTYPES] == [1152, 576, 656]
    b, t, h = 64, 4096, 16
    q_and_out = 2 * (b * h * bd.D + b * h * bd.C)  # bf16, whatever the cache
    # memory bound (a huge matmul rate): the floor is the bytes over the copy bandwidth
    for kind, per_token in [("auto", 1152), ("fp8_e4m3", 576), ("fp8", 576), ("fp8_ds_mla", 656)]:
        floor, bound = bd.floor_us(b, t, h, 4000.0, 1e9, kv_cache_dtype=kind)
        assert bound == "memory" and floor == pytest.approx((b * t * per_token + q_and_out) / 4000e3)
    # compute bound (a huge copy bandwidth): the fp8 caches are computed on in bf16, same FLOPs
    floors = {bd.floor_us(b, t, 128, 1e12, 700.0, kv_cache_dtype=k) for k in bd.KV_CACHE_DTYPES}
    assert len(floors) == 1 and floors.pop()[1] == "compute"


# ---- bench_decode.py: the fp8 caches and a shape's rows, on the CPU --------------------------------


@pytest.fixture
def torch_writer(monkeypatch):
    """concat_and_cache on its torch reference: the CPU needs no build of the C++ twin for these
    tests (tests/test_kernels_concat_cache.py holds the twin and the CUDA kernel to it bit for bit)."""
    from mla.kernels import concat_cache

    monkeypatch.setattr(concat_cache, "extension_available", lambda device: False)
    monkeypatch.setattr(concat_cache, "_warned_fallback", True)


def test_fp8_caches_hold_the_bf16_rows_in_the_same_slots(torch_writer):
    # copy i of an fp8 layout is written from bf16 copy i % copies, so one block table reads the
    # same latents from every layout; fp8_e4m3's one scale maps the largest |value| of all to 448
    from mla.kernels import fp8

    _, caches, table, lens = bd.make_inputs(2, 100, 1, copies=2, device="cpu")
    rows = [cache.view(-1, bd.D).float() for cache in caches]
    for kind in ("fp8_e4m3", "fp8_ds_mla"):
        written, scale = bd.write_fp8_caches(kind, caches, 3)
        assert len(written) == 3 and written[0].shape == (*caches[0].shape[:2], bd.bytes_per_token(kind))
        assert torch.equal(written[2].view(torch.uint8), written[0].view(torch.uint8))
        for cache, want in zip(written, rows + rows[:1]):
            got = fp8.dequantize_rows(cache.view(-1, cache.shape[-1]), kind, bd.C, bd.R, scale)  # (T, c + r)
            amax = want[:, :bd.C].abs().amax() if kind == "fp8_e4m3" else want[:, :bd.C].abs().amax(-1, keepdim=True)
            assert ((got - want)[:, :bd.C].abs() <= amax / 17 * (1 + 2**-18)).all()  # half an e4m3 step
        if kind == "fp8_e4m3":
            assert scale.shape == (1,) and scale.dtype == torch.float32
            assert scale.item() == pytest.approx(max(r.abs().max().item() for r in rows) / 448, rel=1e-6)
        else:
            assert scale is None


def test_a_shape_gives_a_row_a_layout_on_one_set_of_inputs(monkeypatch, torch_writer):
    # bench_shape end to end on the CPU (Triton's interpreter), the GPU's timers replaced by a
    # call of the timed function and a fixed time: every layout runs mla_decode with its own
    # cache and arguments, checks it against the references and is paired with the bf16 row
    calls = []

    def fake_bench_us(fn, **kwargs):
        fn()
        return 10.0 + len(calls)

    def fake_graphed(fn, inputs):
        calls.append(len(inputs))
        return timing.rotating(fn, inputs)

    monkeypatch.setattr(timing, "bench_us", fake_bench_us)
    monkeypatch.setattr(timing, "graphed", fake_graphed)
    monkeypatch.setattr(timing, "steady_us", lambda fn, inputs, **kwargs: (fn(inputs[0]), 5.0)[1])
    monkeypatch.setattr(timing, "rotation_copies", lambda nbytes, most=8: 2 if nbytes > 100_000 else 3)
    rows = bd.bench_shape(2, 64, 16, 1, (4242.0, 690.0), 132, False, bd.KV_CACHE_DTYPES, device="cpu")
    assert [r["kv_cache_dtype"] for r in rows] == list(bd.KV_CACHE_DTYPES)
    bf16, e4m3, ds_mla = rows
    assert "error" not in bf16 and bf16["max_rel_err_vs_torch"] < 2e-2  # both out in bf16
    assert [r["copies"] for r in rows] == [2, 3, 3] and calls == [2, 2, 3, 3]  # bf16 twice: clean, dirty L2
    for row in (e4m3, ds_mla):
        assert not {"error", "check_error"} & set(row), row
        assert row["config"]["kernel"] == "triton" and row["flashmla_skipped"] == bd.FLASHMLA_SKIPPED
        # the 16-head CUDA stage 1 forced beside it (on the CPU it says why it cannot run)
        assert row["cuda_fp8_kernel"] == "cuda-sm80" and "q is on cpu" in row["cuda_fp8_error"]
        assert row["time_us"] == 10.0 + calls.index(3) + (row is ds_mla) + 1 and row["steady_us"] == 5.0
        assert row["over_bf16"] == pytest.approx(row["time_us"] / bf16["time_us"])
        assert row["floor_us"] < bf16["floor_us"] and row["bytes_per_token"] < 1152
        assert row["max_rel_err_vs_reference"] <= 2**-8  # the same dequantised values; out rounded to bf16
        assert 1e-3 < row["max_abs_err_vs_bf16_cache"] < 0.5  # what e4m3 costs: visible, bounded
    assert e4m3["kv_scale"] > 0 and "kv_scale" not in ds_mla


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


def _fp8_row(b, t, h, kind, time_us, s_q=1):
    floor, bound = bd.floor_us(b, t, h, 4242.0, 690.0, s_q=s_q, kv_cache_dtype=kind)
    row = dict(b=b, t=t, h=h, s_q=s_q, kv_cache_dtype=kind, bytes_per_token=bd.bytes_per_token(kind), page=bd.PAGE,
               copies=2, floor_us=floor, bound=bound, time_us=time_us, flashmla_us=None, flashmla_max_abs_diff=None,
               flashmla_skipped=bd.FLASHMLA_SKIPPED, config=dict(kernel="triton", num_kv_splits=8))
    if time_us is None:
        row["error"] = "CompilationError: out of resources"
    else:
        row.update(max_abs_diff=2e-3, max_rel_err_vs_reference=1e-3, max_abs_err_vs_bf16_cache=3e-2)
    return bd.add_ratios(row)


def _fake_mixed_rows() -> list[dict]:
    # bf16 rows of _fake_result at (1, 32768), (4, 131072), (64, 4096), 16 heads, and a failed one;
    # the first has the Triton kernel's time beside the CUDA one, the third ran on Triton
    rows = _fake_result(flashmla=True)["rows"]
    rows[0]["triton_time_us"] = 30.0
    rows[2]["config"] = dict(kernel="triton", num_kv_splits=4)
    rows[2]["kv_cache_dtype"] = "auto"  # the key as bench_decode writes it; the other rows lack it
    for b, t, h, (e4m3, ds_mla) in [(1, 32768, 16, (20.0, 25.0)), (4, 131072, 16, (100.0, 96.6)),
                                    (64, 4096, 16, (50.0, 51.84))]:
        rows += [_fp8_row(b, t, h, "fp8_e4m3", e4m3), _fp8_row(b, t, h, "fp8_ds_mla", ds_mla)]
    rows.append(_fp8_row(1, 64, 128, "fp8_ds_mla", None))  # failed, as its bf16 row
    return bd.pair_with_bf16(rows)


def test_the_forced_cuda_fp8_path_is_timed_beside_the_default_and_paired():
    row = _fp8_row(64, 4096, 16, "fp8_ds_mla", 51.84)
    row.update(cuda_fp8_kernel="cuda-sm80", cuda_fp8_time_us=43.2)
    rows = bd.pair_with_bf16(_fake_result(flashmla=True)["rows"] + [row])
    assert rows[-1]["cuda_fp8_over_bf16"] == pytest.approx(43.2 / 86.4)
    assert "cuda_fp8_over_bf16" not in _fake_mixed_rows()[-1]  # not timed forced: no ratio
    # on the CPU the forced CUDA kernel cannot run: the row names it, says why, and keeps its
    # other fields
    for h, kernel in ((16, "cuda-sm80"), (128, "cuda-sm90")):
        q = torch.zeros(1, h, bd.D)
        failed = dict(b=1, h=h, kv_cache_dtype="fp8_ds_mla")
        bd.cuda_fp8(failed, kernel, q, [torch.zeros(1, 64, 656, dtype=torch.uint8)],
                    torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), None, 64, 132)
        assert failed["cuda_fp8_kernel"] == kernel and "cuda_fp8_time_us" not in failed
        assert failed["cuda_fp8_error"] == f"ValueError: mla_decode: _backend={kernel!r} cannot run these arguments: " \
                                          "q is on cpu, not a GPU"


def _time_nothing(monkeypatch):
    """fp8_row's GPU parts replaced: the decode call returns zeros, the reference ones, every
    timing 1 us, one copy of the caches."""
    monkeypatch.setattr(bd, "decode_call",
                        lambda q, *args, **kwargs: lambda cache: (torch.zeros(q.shape[0], q.shape[-2], bd.C), None))
    monkeypatch.setattr(bd, "reference_out", lambda q, *args, **kwargs: torch.ones(q.shape[0], q.shape[-2], bd.C))
    monkeypatch.setattr(timing, "bench_us", lambda fn, **kwargs: 1.0)
    monkeypatch.setattr(timing, "graphed", lambda fn, inputs: fn)
    monkeypatch.setattr(timing, "steady_us", lambda fn, inputs, **kwargs: 1.0)
    monkeypatch.setattr(timing, "rotation_copies", lambda nbytes, most=8: 1)


def test_an_fp8_row_forces_the_cuda_kernel_of_its_heads(monkeypatch, torch_writer):
    # while mla_decode runs fp8 on Triton, a one-token row also times the CUDA stage 1 its heads
    # would take: sm80 at <= 16 heads, sm90 above; no CUDA kernel takes two query tokens
    forced = []
    monkeypatch.setattr(bd, "cuda_fp8", lambda row, kernel, *args: forced.append((row["h"], kernel)))
    _time_nothing(monkeypatch)
    for h, s_q in ((16, 1), (17, 1), (128, 1), (128, 2)):
        q, caches, table, lens = bd.make_inputs(1, 64, h, s_q=s_q, device="cpu")
        row = bd.fp8_row("fp8_ds_mla", 1, 64, h, s_q, q, caches, table, lens, (4242.0, 690.0), 132,
                         lambda: torch.zeros(1, h, bd.C))
        assert row["config"]["kernel"] == "triton" and "error" not in row
    assert forced == [(16, "cuda-sm80"), (17, "cuda-sm90"), (128, "cuda-sm90")]


def test_an_fp8_row_on_a_cuda_kernel_times_the_triton_kernel_beside_it(monkeypatch, torch_writer):
    """Where mla_decode picks a CUDA stage 1 for the fp8 cache, the row also times the Triton
    kernel on that cache (its own split count for the layout), and pairs it with the bf16 row's
    Triton time."""
    beside = []
    monkeypatch.setattr(bd, "kernel_and_splits",
                        lambda *args, **kwargs: ("cuda-sm80", dict(kernel="cuda-sm80"), 4))
    monkeypatch.setattr(bd, "forced_kernel", lambda row, prefix, kernel, *args, **layout: beside.append(
        (prefix, kernel, layout["kv_cache_dtype"])))
    _time_nothing(monkeypatch)
    q, caches, table, lens = bd.make_inputs(1, 64, 16, device="cpu")
    bd.fp8_row("fp8_e4m3", 1, 64, 16, 1, q, caches, table, lens, (4242.0, 690.0), 132,
               lambda: torch.zeros(1, 16, bd.C))
    assert beside == [("triton", "triton", "fp8_e4m3")]
    # the split count is the Triton kernel's for the layout
    assert bd.triton_splits(q, 4096, 132, "fp8_e4m3") >= 1
    rows = _fake_result(flashmla=True)["rows"]
    rows[0]["triton_time_us"] = 30.0
    fp8 = dict(_fp8_row(1, 32768, 16, "fp8_e4m3", 20.0), config=dict(kernel="cuda-sm80"), triton_time_us=45.0)
    paired = bd.pair_with_bf16(rows + [fp8])[-1]
    assert paired["triton_over_bf16_triton"] == pytest.approx(45.0 / 30.0)
    assert "triton_over_bf16_triton" not in _fake_mixed_rows()[-2]  # no Triton time beside: no ratio


def test_the_forced_sm90_query_token_path_says_why_it_did_not_run_on_the_cpu():
    row = dict(b=1, h=16)
    q = torch.zeros(1, 2, 16, bd.D)
    bd.sm90_query_tokens(row, q, [torch.zeros(1, 64, bd.D, dtype=torch.bfloat16)],
                         torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 64, 132)
    assert "sm90_sq_error" in row and "sm90_sq_time_us" not in row


def test_fp8_rows_are_paired_with_the_bf16_row_of_their_shape():
    rows = _fake_mixed_rows()
    by = {(r["b"], r.get("kv_cache_dtype", "auto")): r for r in rows if r["h"] == 16}
    assert by[(1, "fp8_ds_mla")]["over_bf16"] == pytest.approx(25.0 / 22.9)
    assert by[(1, "fp8_ds_mla")]["over_bf16_triton"] == pytest.approx(25.0 / 30.0)  # its triton_time_us
    assert by[(4, "fp8_e4m3")]["over_bf16"] == pytest.approx(100.0 / 161.0)
    assert by[(4, "fp8_e4m3")]["over_bf16_triton"] is None  # a CUDA kernel ran, no Triton time beside it
    assert by[(64, "fp8_ds_mla")]["over_bf16_triton"] == pytest.approx(51.84 / 86.4)  # Triton was the pick
    assert by[(1, "fp8_ds_mla")]["share_of_floor"] == pytest.approx(by[(1, "fp8_ds_mla")]["floor_us"] / 25.0)
    failed = [r for r in rows if r["h"] == 128 and r.get("kv_cache_dtype") == "fp8_ds_mla"][0]
    assert failed["over_bf16"] is None and failed["over_bf16_triton"] is None
    assert all("over_bf16" not in r for r in rows if r.get("kv_cache_dtype", "auto") == "auto")
    # an fp8 row of another query length is not paired with the one-token bf16 row
    other = bd.pair_with_bf16(_fake_result(True)["rows"][:1] + [_fp8_row(1, 32768, 16, "fp8_ds_mla", 30.0, s_q=2)])
    assert other[-1]["over_bf16"] is None


def test_targets_hold_fp8_ds_mla_at_16_heads_from_b_64_and_at_128_heads():
    bf16 = [dict(b=b, t=4096, h=h, s_q=s_q, kv_cache_dtype="auto", time_us=100.0)
            for b, h, s_q in [(1, 16, 1), (64, 16, 1), (128, 16, 1), (1, 128, 1), (64, 128, 1), (64, 16, 2)]]
    fp8 = [dict(b=b, t=4096, h=h, s_q=s_q, kv_cache_dtype=kind, time_us=us) for b, h, s_q, kind, us in [
        (1, 16, 1, "fp8_ds_mla", 90.0),     # b < 64 at 16 heads: no target
        (64, 16, 1, "fp8_ds_mla", 65.0),    # 0.65: met, at the limit
        (128, 16, 1, "fp8_ds_mla", 70.0),   # 0.70: missed
        (64, 16, 1, "fp8_e4m3", 50.0),      # the targets are fp8_ds_mla's
        (1, 128, 1, "fp8_ds_mla", 114.0),   # met
        (64, 128, 1, "fp8_ds_mla", 120.0),  # missed
        (64, 16, 2, "fp8_ds_mla", 90.0),    # two query tokens: no target
        (256, 16, 1, "fp8_ds_mla", 50.0),   # no bf16 row: no ratio
    ]]
    checks = bd.target_checks(bd.pair_with_bf16(bf16 + fp8))
    assert [(c["b"], c["h"], c["most"], c["met"]) for c in checks] == [
        (64, 16, 0.65, True), (128, 16, 0.65, False), (1, 128, 1.15, True), (64, 128, 1.15, False),
        (256, 16, 0.65, None)]
    lines = bd.format_targets(checks)
    assert "information, not a check" in lines[0] and "16 heads b >= 64: <= 0.65x" in lines[0]
    assert lines[1].endswith("0.65x against <= 0.65x  met") and lines[2].endswith("0.70x against <= 0.65x  missed")
    assert lines[5].endswith("n/a against <= 0.65x  (a time is missing)") and lines[-1] == "  2 of 5 met"
    assert "none applies" in bd.format_targets(bd.target_checks(bf16))[1]


def test_table_shows_each_layout_and_its_time_over_bf16():
    rows = _fake_mixed_rows()
    lines = [bd.format_row(r) for r in rows]
    ds_mla = lines[rows.index(next(r for r in rows if r.get("kv_cache_dtype") == "fp8_ds_mla"))]
    assert " fp8_ds_mla " in ds_mla and f" {25.0 / 22.9:.2f} " in ds_mla
    assert ds_mla.count("skip") == 3  # FlashMLA's three columns: it reads bf16 only
    assert ds_mla.endswith("2.0e-03 ref, 3.0e-02 bf16")
    assert " auto " in lines[0] and "skip" not in lines[0]
    failed = next(line for line, r in zip(lines, rows) if r["h"] == 128 and r.get("kv_cache_dtype") == "fp8_ds_mla")
    assert " error " in failed and failed.endswith("CompilationError: out of resources")
    # the cells line up under the header: the kernel column ends where its heading does
    kernel_end = len(bd.HEADER.split("  err")[0])
    assert all(line[kernel_end - 9:kernel_end].strip() in ("cuda-sm80", "triton", "") and line[kernel_end] == " "
               for line in lines)


def test_results_keep_one_bf16_row_a_shape_and_the_fp8_rows_apart(tmp_path, monkeypatch):
    # docs/hooks.py and tutorial 04 read `rows` as one row a (b, t, h, s_q); the fp8 rows go to
    # `fp8_rows`, so every reader finds exactly one row a shape
    rows = _fake_mixed_rows()
    result = bd.assemble(rows, device="NVIDIA H200", copy_GBps=4242.0, matmul_TFLOPs=690.0, flashmla="1.0")
    paths = bd.write_results(tmp_path, result)
    data = json.loads((tmp_path / "h200-decode.json").read_text())
    assert len(data["rows"]) == 4 and all(r.get("kv_cache_dtype", "auto") == "auto" for r in data["rows"])
    assert len(data["fp8_rows"]) == 7 and {r["kv_cache_dtype"] for r in data["fp8_rows"]} == {"fp8_e4m3", "fp8_ds_mla"}
    assert data["rows"][0]["flashmla_over_mla"] == pytest.approx(55.1 / 22.9)  # the fields of before, kept
    assert [(c["b"], c["h"], c["met"]) for c in data["targets"]] == [(64, 16, True), (1, 128, None)]  # 51.84 / 86.4
    hooks = _load_hooks()
    monkeypatch.setattr(hooks, "RESULTS", tmp_path)
    assert hooks.row("h200-decode.json", b=1, h=16)["time_us"] == 22.9
    assert hooks.row("h200-decode.json", key="fp8_rows", b=1, h=16, kv_cache_dtype="fp8_ds_mla")["time_us"] == 25.0
    assert len(hooks.flashmla_table().splitlines()) == 2 + 3  # header, rule, the three one-token bf16 rows
    assert [len(ax.patches) for ax in hooks._plot_decode(data).axes] == [3, 3]
    assert paths[-1].endswith("h200-decode.png")


def test_plot_draws_each_layout_over_the_bf16_floor():
    rows = _fake_mixed_rows()
    result = bd.assemble(rows, device="NVIDIA H200", copy_GBps=4242.0, matmul_TFLOPs=690.0)
    (ax,) = bd.plot(result).axes  # 16 heads only: the 128-head rows did not run
    bars = {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}
    assert list(bars) == [label for _, _, label in bd.SERIES]
    bf16 = sorted((r for r in rows if r["h"] == 16 and r.get("kv_cache_dtype", "auto") == "auto"),
                  key=lambda r: r["b"] * r["t"])  # in the plot's order: by the cache's tokens
    for kind, (_, _, label) in zip(["fp8_e4m3", "fp8_ds_mla"], bd.SERIES[2:]):
        fp8 = [next(r for r in rows if r.get("kv_cache_dtype") == kind and r["b"] == base["b"]) for base in bf16]
        assert bars[label] == pytest.approx([r["time_us"] / base["floor_us"] for r, base in zip(fp8, bf16)])
    assert bars["mla_decode, bf16"] == pytest.approx([r["time_us"] / r["floor_us"] for r in bf16])
    # a run of the bf16 cache alone draws as before: mla_decode and FlashMLA
    (ax,) = bd.plot(_fake_result(flashmla=True)).axes
    assert [c.get_label() for c in ax.containers] == ["mla_decode, bf16", "FlashMLA, bf16"]


def test_flashmla_is_reported_missing_here():
    ok, what = bd.flashmla_status()
    if ok:  # a machine with FlashMLA installed: nothing to say about its absence
        pytest.skip(f"flash_mla imports here ({what})")
    assert what.startswith("not importable (")


# ---- bench_concat.py ---------------------------------------------------------------------------------


def test_concat_counts_the_bytes_each_layout_writes():
    from benchmarks import bench_concat as bc

    read = (bc.C + bc.R) * 2 + 8  # the bf16 inputs and the int64 slot of a token
    assert [bc.concat_bytes(1000, k) for k in bc.KV_CACHE_DTYPES] == [1000 * (read + w) for w in (1152, 576, 656)]
    assert [bc.cache_layout(k) for k in bc.KV_CACHE_DTYPES] == [
        (576, torch.bfloat16), (576, torch.float8_e4m3fn), (656, torch.uint8)]


@pytest.mark.parametrize("kind", ["auto", "fp8", "fp8_ds_mla"])
def test_concat_baseline_writes_what_the_reference_writes(kind):
    # the GPU run holds its kernel to this baseline bit for bit, so the baseline must be the spec
    from benchmarks import bench_concat as bc
    from mla.kernels.concat_cache import concat_and_cache_reference

    T, blocks = 100, 3
    gen = torch.Generator().manual_seed(1)
    proj = torch.randn(T, bc.C + bc.R, generator=gen).mul(3).to(torch.bfloat16)
    kv_c, k_pe = proj[:, :bc.C], proj[:, bc.C:]
    slots = torch.randperm(blocks * bc.BLOCK_SIZE, generator=gen)[:T]
    scale = torch.tensor([bc.FP8_SCALE]) if kind == "fp8" else None
    width, dtype = bc.cache_layout(kind)
    got = torch.zeros(blocks, bc.BLOCK_SIZE, width).to(dtype)
    want = got.clone()
    bc.torch_write(kv_c, k_pe, got, slots, kind, scale)
    concat_and_cache_reference(kv_c, k_pe, want, slots, kv_cache_dtype=kind, scale=scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got.view(torch.uint8).any()


def test_concat_table_and_targets_from_fake_rows():
    from benchmarks import bench_concat as bc

    rows = [dict(tokens=262144, kv_cache_dtype=kind, bytes=bc.concat_bytes(262144, kind), time_us=us,
                 GBps=bc.concat_bytes(262144, kind) / (us * 1e3), api_us=us + 50, torch_us=10 * us,
                 speedup_vs_torch=10.0, bytes_differing_from_torch=differ)
            for kind, us, differ in [("auto", 160.0, 0), ("fp8", 250.0, 0), ("fp8_ds_mla", 140.0, 3)]]
    for row in rows:
        row["share_of_copy"] = row["GBps"] / 4200.0
        row["share_of_same_copy"] = 0.9
    lines = [bc.format_row(r) for r in rows]
    assert " fp8_ds_mla " in lines[2] and lines[2].endswith("DIFFERS FROM TORCH in 3 bytes")
    assert "DIFFERS" not in lines[0] and len(lines[0]) == len(bc.HEADER)
    assert lines[0].split()[6] == "0.90"  # the same-size copy's share, after the 2 GiB copy's
    checks = bc.target_checks(rows)
    assert [(c["kv_cache_dtype"], c["met"]) for c in checks] == [("fp8", False), ("fp8_ds_mla", True)]
    text = bc.format_targets(checks)
    assert text[1].endswith(f"{rows[1]['share_of_copy']:.2f}  missed") and text[-1] == "  1 of 2 met"


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


def test_prefill_torch_layer_is_the_layer_in_a_few_lines():
    """torch_layer (the issue's baseline: no cache, no plan, one SDPA call) gives the naive
    tier's outputs on a prompt of two rows, torch choosing SDPA's backend on the CPU."""
    from benchmarks import bench_prefill as bp

    weights = mla.MLAWeights(mla.MLAConfig.from_preset("tiny"), dtype=torch.float32, seed=3)
    naive = mla.build(weights, "naive")
    paged = mla.build(weights, "paged", block_size=4)
    x = torch.randn(2, 9, weights.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, out = naive(x, naive.new_cache(2, 9)), bp.torch_layer(paged, x)
    assert out.shape == ref.shape and float((out - ref).norm() / ref.norm()) < 1e-5


def test_prefill_measure_pair_takes_turns_and_reads_the_ratio_pair_by_pair():
    """A drift that slows every later call: timed apart, two equal calls would differ; in turn,
    which goes first alternating, the pairs' ratios straddle 1 and their median sits near it."""
    from benchmarks import bench_prefill as bp

    order, clock = [], [0.0]

    def timer(fn):
        fn()
        clock[0] += 1.0
        return 10.0 + clock[0]                          # each call 1 ms slower than the last

    got = bp.measure_pair(lambda: order.append("a"), lambda: order.append("b"),
                          reset_a=lambda: order.append("ra"), reset_b=lambda: order.append("rb"),
                          budget_ms=1000.0, most=7, timer=timer)
    assert order[:8] == ["ra", "a", "rb", "b"] * 2      # two untimed pairs first
    first = ["ra", "a", "rb", "b"]
    assert order[8:] == (first + first[2:] + first[:2]) * 3 + first  # A B, B A, ...: 7 pairs
    assert len(got["a_calls"]) == len(got["b_calls"]) == 7
    assert [x < y for x, y in zip(got["a_calls"], got["b_calls"])] == [True, False] * 3 + [True]
    assert 0.95 < got["ratio"] < 1.0
    few = bp.measure_pair(lambda: None, lambda: None, budget_ms=0.0, most=20, timer=lambda fn: 1.0)
    assert len(few["a_calls"]) == 5 and few["ratio"] == 1.0  # at least 5 pairs


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


def _load_hooks():
    """docs/hooks.py, the mkdocs hooks that read the committed results, as a module."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("docs_hooks", Path(__file__).parents[1] / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_docs_read_the_prefill_results_bench_prefill_writes():
    # the docs' hooks draw and describe benchmarks/results/h200-prefill.json: they must read the
    # fields bench_prefill.py writes (a contender that failed has no time), and still the
    # crossover runs of the two prefill paths committed before it
    from benchmarks import bench_prefill as bp

    hooks = _load_hooks()
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
