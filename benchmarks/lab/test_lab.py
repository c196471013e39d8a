"""CPU checks of the lab's scripts that edit csrc/ as text, and of the candidate patches (built
and run on a GPU only): an edit of the tree that breaks one of them fails here rather than on
the next GPU run.

    PYTHONPATH=. python3 -m pytest -q benchmarks/lab/test_lab.py
"""


def test_timeline_benchmark_still_fits_the_kernel():
    """benchmarks/lab/timeline_decode_cuda.py edits csrc/mla_decode_sm80.cu as text to add its
    timestamps (built and run on a GPU only); an edit of the kernel that breaks one of its text
    patches fails here, on the CPU, rather than on the next GPU run."""
    from benchmarks.lab.timeline_decode_cuda import SECTIONS, instrumented_source

    src = instrumented_source()
    assert src.count("stamp(") == 5  # its five points
    assert "TORCH_LIBRARY_IMPL" not in src and "check_mla_decode" not in src
    assert "PYBIND11_MODULE" in src and "at::Tensor& timing" in src
    assert src.count("section[") == len(SECTIONS) + 2  # declared, four sums, written out


def test_sm90_timeline_benchmark_still_fits_the_kernel():
    """benchmarks/lab/timeline_decode_sm90.py edits csrc/mla_decode_sm90.cu the same way (counters
    around the pair loop's copies, waits and barriers, and an fp8 group's wait for its raw bytes):
    its patches must still apply."""
    from benchmarks.lab.timeline_decode_sm90 import PARTS, instrumented_source

    src = instrumented_source()  # asserts the counts of what it wraps: 4 barriers, 6 waits, 4 loads, 4 finishes
    assert src.count("stamp(") == 5  # its five points
    # the sums over a CTA's segments: each segment's start, q landed and loop end kept once, summed once
    assert all(src.count(f"seg[{k}] = clock64();") == 1 for k in (5, 6, 7)) and src.count("seg[0] += 1;") == 1
    assert "TORCH_LIBRARY_IMPL" not in src and "check_mla_decode" not in src
    assert "PYBIND11_MODULE" in src and "at::Tensor& timing" in src
    raw = PARTS.index("raw_wait")
    for part, name in enumerate(PARTS):
        if name == "raw_wait":  # counted in finish_fp8_blocks, into the caller's acc
            assert "raw_wait += clock64() - c_;" in src and f", acc[{raw}], " in src
        elif name in ("vote", "conv_bar"):  # inside finish_fp8_blocks: the vote, the two other barriers
            assert src.count(f"{name} += clock64() - c") == (1 if name == "vote" else 2)
            assert f", acc[{PARTS.index('vote')}], acc[{PARTS.index('conv_bar')}]);" in src
        else:
            assert f"acc[{part}] += clock64() - c_;" in src


def test_sm90_timeline_benchmark_fits_each_candidate_kernel(tmp_path):
    """timeline_decode_sm90.py also times a candidate's kernel (run in the candidate's copy of the
    tree, .ab/NAME): its text patches must apply to every candidate patch's csrc/mla_decode_sm90.cu."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    import pytest

    from benchmarks.lab.timeline_decode_sm90 import instrumented_source

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = Path(__file__).resolve().parents[2]
    kernel = "csrc/mla_decode_sm90.cu"
    patches = [p for p in sorted((root / "benchmarks" / "lab" / "candidates").glob("*.patch"))
               if f"+++ b/{kernel}" in p.read_text()]
    if not patches:
        pytest.skip("no candidate patch of the wgmma kernel")
    for patch in patches:
        copy = tmp_path / patch.stem
        (copy / "csrc").mkdir(parents=True)
        shutil.copy(root / kernel, copy / kernel)
        # the copy is its own ceiling: inside another repository's work tree git apply would skip
        # the patch (no path of it under the copy) and still succeed
        done = subprocess.run(["git", "apply", f"--include={kernel}", str(patch)], cwd=copy, capture_output=True,
                              text=True, env={**os.environ, "GIT_CEILING_DIRECTORIES": str(copy.parent)})
        assert done.returncode == 0, f"{patch.name}: {done.stderr.strip()}"
        src = (copy / kernel).read_text()
        assert src != (root / kernel).read_text(), f"{patch.name} changed nothing of {kernel}"
        try:
            out = instrumented_source(src)
        except AssertionError as error:
            raise AssertionError(f"timeline_decode_sm90.py does not fit {patch.name}: {error}") from None
        assert out.count("stamp(") == 5, patch.name


def test_sm90_ab_benchmark_renames_each_versions_library(tmp_path):
    """benchmarks/lab/ab_decode_sm90.py builds versions of csrc/mla_decode_sm90.cu side by side, each
    with binding.cpp, the op library renamed: both sources must still name the library once."""
    from benchmarks.lab.ab_decode_sm90 import ROOT, variant_sources

    kernel = (ROOT / "csrc" / "mla_decode_sm90.cu").read_text()
    binding, renamed = (p.read_text() for p in variant_sources("new", kernel, tmp_path))
    assert "TORCH_LIBRARY(mla_ab_new, m)" in binding and "TORCH_LIBRARY(mla, m)" not in binding
    assert "TORCH_LIBRARY_IMPL(mla_ab_new, CUDA, m)" in renamed and "TORCH_LIBRARY_IMPL(mla," not in renamed
    assert renamed.replace("mla_ab_new", "mla") == kernel  # nothing else changed


def test_candidate_patches_still_apply():
    """benchmarks/lab/candidates/*.patch are kernel changes measured on the GPU and not merged,
    kept against main for a later run (NOTES.md says what each measured): each must still apply
    to the tree, so that an edit of main that breaks one is rebased or the patch deleted."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    import pytest

    root = Path(__file__).resolve().parents[2]
    patches = sorted((root / "benchmarks" / "lab" / "candidates").glob("*.patch"))
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    if not patches:
        pytest.skip("no candidate patch waits for a GPU run")
    for patch in patches:
        # the tree's root is the ceiling: in a copy of the tree inside another repository (.ab/NAME),
        # git apply would otherwise check only the paths under the copy's folder, that is none
        done = subprocess.run(["git", "apply", "--check", str(patch)], cwd=root, capture_output=True, text=True,
                              env={**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)})
        assert done.returncode == 0, f"{patch.name} no longer applies: {done.stderr.strip()}"


def test_ab_table_reads_runs_by_version_and_round(tmp_path):
    """ab_table.py: runs named VERSION-ROUND, each candidate's median over main's per row."""
    import json

    from benchmarks.lab.ab_table import load_runs, summarise

    def run(name, us, splits):
        (tmp_path / name).mkdir()
        row = dict(b=64, t=4096, h=16, kv_cache_dtype="auto", time_us=us, config={"num_kv_splits": splits})
        (tmp_path / name / "gpu-decode.json").write_text(json.dumps({"rows": [row], "fp8_rows": []}))

    run("main-1", 100.0, 4)
    run("fp8three-1", 80.0, 6)
    run("main-2", 110.0, 4)
    run("fp8three-2", 90.0, 6)
    runs = load_runs(tmp_path)
    assert list(runs) == ["main-1", "fp8three-1", "main-2", "fp8three-2"]  # the order they ran in
    (entry,) = summarise(runs)
    assert entry["median_us"] == {"main": 105.0, "fp8three": 85.0}
    assert entry["over_main"] == {"fp8three": 85.0 / 105.0}
    assert entry["splits"] == {"main": 4, "fp8three": 6}
    assert entry["s_q"] == 1  # a row without s_q (an older run) has one new token


def test_ab_table_keeps_each_query_length_apart(tmp_path):
    """ab_table.py: a run of `bench decode --s-q 1,2` has a row a (shape, s_q), each compared
    with main's row of the same s_q, not the last one read."""
    import json

    from benchmarks.lab.ab_table import load_runs, summarise

    def run(name, times):
        (tmp_path / name).mkdir()
        rows = [dict(b=64, t=4096, h=128, s_q=s_q, kv_cache_dtype="auto", time_us=us, config={})
                for s_q, us in times.items()]
        (tmp_path / name / "gpu-decode.json").write_text(json.dumps({"rows": rows}))

    run("main-1", {1: 100.0, 2: 200.0})
    run("new-1", {1: 90.0, 2: 220.0})
    table = summarise(load_runs(tmp_path))
    assert [(e["s_q"], e["over_main"]["new"]) for e in table] == [(1, 0.9), (2, 1.1)]


def test_ab_table_reads_concat_runs(tmp_path):
    """ab_table.py: `bench concat` runs keyed by (tokens, cache dtype)."""
    import json

    from benchmarks.lab.ab_table import load_runs, summarise

    def run(name, us):
        (tmp_path / name).mkdir()
        rows = [dict(tokens=65536, kv_cache_dtype=d, time_us=us * k) for k, d in ((1, "auto"), (2, "fp8_ds_mla"))]
        (tmp_path / name / "concat.json").write_text(json.dumps({"rows": rows}))

    run("main-1", 40.0)
    run("concat2-1", 30.0)
    auto, ds_mla = summarise(load_runs(tmp_path))
    assert (auto["tokens"], auto["kv_cache_dtype"]) == (65536, "auto")
    assert ds_mla["over_main"] == {"concat2": 60.0 / 80.0}


def test_ncu_summary_reads_the_metric_tables(tmp_path):
    """ncu_decode.py --summarize: ncu's printed metric table to numbers, units and thousands
    separators dropped, a subject without a file left out."""
    from benchmarks.lab.ncu_decode import summarize

    (tmp_path / "mla-auto-metrics.txt").write_text(
        "==PROF== Connected to process\n"
        "  void mla_decode_sm90_kernel<...>(...) (2, 64, 1)x(256, 1, 1), Context 1, Stream 7\n"
        "    ---------------------------------------- ----------- ------------\n"
        "    Metric Name                              Metric Unit Metric Value\n"
        "    gpu__time_duration.sum                            us       145.38\n"
        "    l1tex__data_bank_reads.sum                                458,297,008\n"
        "    smsp__warp_issue_stalled_wait_per_warp_active.pct   %        13.37\n")
    assert summarize(str(tmp_path)) == {"mla-auto": {
        "gpu__time_duration.sum": 145.38, "l1tex__data_bank_reads.sum": 458297008.0,
        "smsp__warp_issue_stalled_wait_per_warp_active.pct": 13.37}}


def test_ncu_source_counts_sum_the_sass_page(tmp_path):
    """ncu_decode.py's source_counts: a SourceCounters CSV's executed instructions summed by
    opcode and by mnemonic, guard predicates dropped, rows without a count skipped."""
    from benchmarks.lab.ncu_decode import source_counts

    path = tmp_path / "mla-auto-source.csv"
    path.write_text(
        '"Kernel Name","void mla_decode_sm90_kernel<...>(...)"\n'
        '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait","stall_wait (Not Issued)"\n'
        '"0x10","      FSETP.GEU.AND P2, PT, R193, -126, PT","3","16384","3","2"\n'
        '"0x20","@!P2  FMUL R193, R193, 0.5","1","16,384","1","0"\n'
        '"0x30","      FMUL.FTZ R1, R2, R3","0","100","0","0"\n'
        '"0x40","@!PT  LDS RZ, [RZ]","0","7","0","0"\n'
        '"0x50","      EXIT","0","","0","0"\n')
    counts = source_counts(path)
    assert counts["total"] == 16384 + 16384 + 100 + 7
    assert counts["by_opcode"] == {"FMUL": 16484, "FSETP": 16384, "LDS": 7}
    assert counts["by_mnemonic"] == {"FSETP.GEU.AND": 16384, "FMUL": 16384, "FMUL.FTZ": 100, "LDS": 7}
    assert counts["guarded"] == {"FMUL": 16384, "LDS": 7}
    assert counts["stall_samples"] == {"wait": 4}
    top, second = counts["top_sites"][:2]  # most samples first, offsets from the page's first row
    assert (top["offset"], top["samples"], top["by_reason"], top["after"]) == ("0x0", 3, {"wait": 3}, None)
    assert (second["offset"], second["sass"], second["samples"]) == ("0x10", "@!P2  FMUL R193, R193, 0.5", 1)


def test_ncu_source_counts_name_what_a_wait_loop_waits_on(tmp_path):
    """source_counts' top sites carry the last mbarrier or barrier instruction before them, so a
    wait loop's branch (where the samples land) names the mbarrier it polls."""
    from benchmarks.lab.ncu_decode import source_counts

    path = tmp_path / "mla-auto-source.csv"
    path.write_text(
        '"Address","Source","Instructions Executed","stall_long_sb"\n'
        '"0x100","      SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR28+0x18], R8","64","0"\n'
        '"0x110","      UMOV UR9, 0x40000040","64","0"\n'
        '"0x120","@!P1  BRA 0x200","64","9"\n'
        '"0x130","      FMUL R1, R2, R3","64","2"\n')
    top, second = source_counts(path)["top_sites"][:2]
    assert (top["offset"], top["samples"]) == ("0x20", 9)
    assert top["after"] == "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR28+0x18], R8"
    assert second["after"] == "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR28+0x18], R8"  # within 16 rows


def test_deal_model_splits_keep_every_pair():
    """benchmarks/lab/model_deal.py's splits of a batch's pairs: each keeps every pair, k = 0 is the
    kernel's even deal, and the balanced split's costliest piece is never above the deal's."""
    from benchmarks.lab.model_deal import balanced_pieces, dealt_pieces, weighted_pieces

    a, b, s = 9.0, 4.0, 12.0
    for pairs, pieces in (([64] * 64, 64), ([1024] * 4, 64), ([3, 100, 1, 1, 57, 250, 9], 16), ([16] * 63 + [1024], 64)):
        deal = dealt_pieces(pairs, pieces)
        assert len(deal) == pieces and sum(p for p, _ in deal) == sum(pairs)
        assert deal == weighted_pieces(pairs, pieces, 0)
        per = -(-sum(pairs) // pieces)
        assert max(p for p, _ in deal) == per  # the kernel's share, ceil
        for k in (2, 4):
            assert sum(p for p, _ in weighted_pieces(pairs, pieces, k)) == sum(pairs)
        split = balanced_pieces(pairs, pieces, a, b, s)
        assert len(split) == pieces and sum(p for p, _ in split) == sum(pairs)
        cost = lambda parts: max(a + b * p + s * (g - 1) for p, g in parts if p)  # noqa: E731
        assert cost(split) <= cost(deal) + 1e-9


def test_clock_probe_reads_nvidia_smis_samples_into_windows():
    """probe_clock.py parses nvidia-smi's CSV (a line cut short and an [N/A] field skipped) and
    averages the samples that fall in each timed window."""
    from benchmarks.lab.probe_clock import parse_samples, window_means

    text = ("2026/12/07 12:00:00.000, 1980, 650.50, 60\n"
            "2026/12/07 12:00:00.020, 1700, 700.00, 62\n"
            "2026/12/07 12:00:00.040, [N/A], 690.00, 62\n"
            "2026/12/07 12:00:01.000, 1500, 400.00, 61\n"
            "2026/12/07 12:00:01.0")
    samples = parse_samples(text)
    assert [s["sm_mhz"] for s in samples] == [1980.0, 1700.0, 1500.0]
    t0 = samples[0]["t"]
    assert abs(samples[1]["t"] - t0 - 0.02) < 1e-6
    first = window_means(samples, t0, t0 + 0.5)
    assert first["samples"] == 2 and first["sm_mhz"] == 1840.0 and first["power_w"] == 675.25
    assert window_means(samples, t0 + 2, t0 + 3) == dict(samples=0, sm_mhz=None, power_w=None, temp_c=None)


def test_clock_sampler_keeps_sampling_past_a_pipes_size(tmp_path, monkeypatch):
    """ClockSampler collects every line nvidia-smi writes, more than a pipe holds (64 KiB): a pipe
    read only at the end fills after ~30 s of 20 ms samples and blocks the sampler, so a longer
    probe's later windows would have no clock."""
    import os
    import time

    from benchmarks.lab.probe_clock import ClockSampler

    fake = tmp_path / "nvidia-smi"  # 3,000 samples of ~80 bytes, as fast as it can write them
    fake.write_text("#!/usr/bin/env python3\n"
                    "import sys, time\n"
                    "for i in range(3000):\n"
                    "    sys.stdout.write(f'2026/12/07 12:00:{i // 50:02d}.{(i % 50) * 20:03d}, 1700, 600.00, 60{40 * \" \"}\\n')\n"
                    "sys.stdout.flush()\n"
                    "time.sleep(30)\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with ClockSampler() as sampler:
        time.sleep(2.0)
    assert len(sampler.samples) == 3000  # ~230 KiB: past what a pipe holds


def test_bench_excess_probe_touches_one_word_a_stride():
    """probe_bench_excess.py's clean+tlb way reads one 4-byte word every 64 KiB of the cache (each
    page translated, almost nothing of it brought into L2): the words it sums are those."""
    import pytest
    import torch

    from benchmarks.lab.probe_bench_excess import before_call, touch_every

    words = torch.arange(3 * 65536, dtype=torch.int32)  # 768 KiB: words 0, 16384, 32768, ...
    assert touch_every(words).item() == sum(range(0, 3 * 65536, 16384))
    bf16 = torch.ones(4, 64, 576, dtype=torch.bfloat16)  # read as int32 pairs of bf16 ones
    pair = torch.tensor([1.0, 1.0], dtype=torch.bfloat16).view(torch.int32).item()
    assert touch_every(bf16, 4096).item() == pair * (bf16.numel() * 2 // 4096)
    with pytest.raises(ValueError, match="way must be one of"):
        before_call("cold", bf16, None, None)


def test_pieces_probe_counts_pieces_that_fill_whole_waves():
    """probe_pieces.py's piece counts: P x head blocks a multiple of the SM count, up to about b
    pieces (past b a piece holds less than a sequence)."""
    from benchmarks.lab.probe_pieces import whole_wave_pieces

    assert whole_wave_pieces(128, 2, 132) == [66, 132]
    assert whole_wave_pieces(128, 4, 132) == [33, 66, 99, 132]
    assert whole_wave_pieces(128, 8, 132) == [33, 66, 99, 132]  # 16.5 pieces a wave: two waves at 33
    assert whole_wave_pieces(64, 2, 132) == [66]
    assert whole_wave_pieces(16, 2, 132) == []  # no count up to 2b fills a wave


def test_decode_probes_parse_their_shared_arguments():
    from benchmarks.lab.probe_args import decode_probe_parser

    args = decode_probe_parser("Doc.\nmore", [(128, 8192, 128)], seconds=1.5).parse_args([])
    assert (args.shapes, args.s_q, args.seconds, args.out) == ([(128, 8192, 128)], [1, 2, 4], 1.5,
                                                               "benchmarks/lab/results")
    args = decode_probe_parser("Doc.", [(128, 8192, 128)]).parse_args(
        ["--shapes", "64x4096x128,4x131072x128", "--s-q", "2", "--out", "x"])
    assert (args.shapes, args.s_q, args.out) == ([(64, 4096, 128), (4, 131072, 128)], [2], "x")
    assert not hasattr(args, "seconds")  # a probe without windows takes no --seconds


def test_head_block_spread_reads_each_pieces_rows_together():
    """timeline_decode_sm90.head_block_spread groups the timing rows a piece at a time (its head
    blocks consecutive) and tells the first wave's pieces from the later ones by their first start."""
    import torch

    from benchmarks.lab.timeline_decode_sm90 import SLOTS, head_block_spread

    rows = torch.zeros((3 * 4, SLOTS), dtype=torch.int64)
    # (piece, head block): start and loop end in ns; piece 2's head block 3 never reached its end
    starts = [[0, 0, 100, 0], [10_000, 12_000, 11_000, 10_500], [20_000, 20_000, 20_000, 21_000]]
    ends = [[50_000, 50_500, 50_000, 51_000], [60_000, 65_000, 61_000, 60_000], [70_000] * 4]
    for p in range(3):
        for x in range(4):
            rows[4 * p + x, 0], rows[4 * p + x, 6] = starts[p][x], ends[p][x]
            rows[4 * p + x, 8] = 0 if (p, x) == (2, 3) else ends[p][x] + 1
    got = head_block_spread(rows, 4)
    assert got["hb_late_pieces"] == 1  # piece 1 (piece 2 left out, piece 0 in the first wave)
    assert got["hb_start_spread_late_us"] == 2.0 and got["hb_start_spread_max_us"] == 2.0
    assert abs(got["hb_start_spread_us"] - 0.1) < 1e-9  # pieces 0 and 1: torch's median takes the lower
    assert got["hb_loop_end_spread_late_us"] == 5.0 and got["hb_loop_end_spread_max_us"] == 5.0
    # one head block: no spread; a launch of one wave: no late piece
    assert head_block_spread(rows[:4], 4)["hb_start_spread_late_us"] is None
    assert head_block_spread(rows[:4], 1)["hb_start_spread_max_us"] == 0.0
    # no piece whole (a launch whose pieces all returned early): every figure None, no error
    assert head_block_spread(rows[8:], 4)["hb_start_spread_us"] is None
    # the timer's own values, ns since 1970: a spread of one 256 ns tick stays 0.256 us
    epoch = rows.clone()
    epoch[:, [0, 6]] += 1_796_659_756_123_456_768
    epoch[1, 0] += 256
    assert abs(head_block_spread(epoch, 4)["hb_start_spread_max_us"] - 2.0) < 1e-9
    assert abs(head_block_spread(epoch[:4], 4)["hb_start_spread_max_us"] - 0.256) < 1e-9
