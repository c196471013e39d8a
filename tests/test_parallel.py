"""Tensor parallelism: MLAWeights.shard, and every tier sharded over a process group against the
same tier unsharded.

Spawning processes is slow (each imports torch and triton), so each spawned group runs many
checks: for every config and tier, prefill, chunked prefill mixed with decode, decode, ragged
rows with a 0 row, and a call where every row sits out. The ranks count their all-reduces, which
must be the same on every rank (a collective one rank skips deadlocks the others). CPU tests run
over gloo; the GPU test over NCCL needs two GPUs.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import mla
from assertions import rel
from mla import parallel
from mla.paged import PagedLatentCache

TINY = mla.MLAConfig.from_preset("tiny")  # 4 heads: TP 2 gives 2 a rank, TP 4 one
CONFIGS = {
    "tiny": TINY,
    "tiny, bias": TINY.replace(attention_bias=True),   # o_proj's bias must be added once
    "tiny, no q_lora": TINY.replace(q_lora_rank=None),  # q_proj instead of q_a/q_b
}
LAYERS = {  # name: (tier, options)
    "naive": ("naive", {}),
    "absorbed": ("absorbed", {}),
    "absorbed, precompute": ("absorbed", {"precompute": True}),
    "absorbed, prefill absorbed": ("absorbed", {"prefill": "absorbed"}),
    "paged": ("paged", {"block_size": 4, "shuffle": 7}),
    "paged, prefill absorbed": ("paged", {"block_size": 4, "shuffle": 7, "prefill": "absorbed"}),
}
# (s, lengths) of each call, in order, on a batch of 3 with room for 16 tokens a row
CALLS = [
    (6, [6, 0, 3]),      # ragged prefill, row 1 sits out
    (4, [4, 1, 2]),      # chunked prefill over a cached prefix, a first token (decode), extend
    (1, None),           # decode every row
    (1, [1, 0, 1]),      # decode with a row sitting out
    (3, [0, 0, 0]),      # nobody takes part
    (5, [2, 5, 1]),      # extend, extend, decode
]


# ---- sharding, one process ----------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_shard_shapes_and_values(name, world_size):
    full = mla.MLAWeights(CONFIGS[name], seed=3)
    cfg = full.config
    h = cfg.num_heads // world_size
    for rank in range(world_size):
        shard = full.shard(rank, world_size)
        heads = slice(rank * h, (rank + 1) * h)
        assert shard.config.num_heads == h
        assert shard.config == cfg.replace(num_heads=h)  # every other field equal
        assert shard.config.softmax_scale == cfg.softmax_scale
        assert (f"tp {rank}/{world_size}" in shard.config.name) == (world_size > 1)
        q_name = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
        expected = {
            q_name: (h * cfg.qk_head_dim, getattr(full, q_name).in_features),
            "kv_b_proj": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            "o_proj": (cfg.hidden_size, h * cfg.v_head_dim),
        }
        for module, shape in expected.items():
            assert tuple(getattr(shard, module).weight.shape) == shape, module
        # the per-head views pick the rank's heads
        for view in ("W_UQ", "W_QR", "W_UK", "W_UV"):
            assert torch.equal(getattr(shard, view), getattr(full, view)[heads]), view
        assert torch.equal(shard.W_O, full.W_O[:, heads])
        # the latent path and o_proj's bias are whole on every rank
        for key, tensor in full.state_dict().items():
            if not key.startswith((q_name, "kv_b_proj", "o_proj.weight")):
                assert torch.equal(shard.state_dict()[key], tensor), key
        # copies, not views: the shard does not change with the full weights
        assert all(p.data_ptr() != q.data_ptr()
                   for p in shard.parameters() for q in full.parameters())


def test_shard_errors():
    full = mla.MLAWeights(TINY)
    with pytest.raises(ValueError, match="num_heads=4 .* does not split evenly over world_size=3"):
        full.shard(0, 3)
    for rank in (-1, 2, 2.0):
        with pytest.raises(ValueError, match="rank must be an int in"):
            full.shard(rank, 2)
    for world_size in (0, -2, "2"):
        with pytest.raises(ValueError, match="world_size must be a positive int"):
            full.shard(0, world_size)


@pytest.mark.parametrize("tier", ["naive", "absorbed", "paged"])
def test_partial_outputs_sum_to_the_full_layer(tier):
    """Without a process group each shard gives its heads' share (plus the bias): the sum over
    ranks is the full layer plus (world_size - 1) biases. The sharding math, no processes."""
    full = mla.MLAWeights(TINY.replace(attention_bias=True), seed=5)
    world_size, lengths = 2, [5, 0, 2]
    x = torch.randn(3, 5, TINY.hidden_size)
    with torch.no_grad():
        ref_layer = mla.build(full, tier)
        ref = ref_layer(x, ref_layer.new_cache(3, 8), lengths)
        total = torch.zeros_like(ref)
        for rank in range(world_size):
            layer = mla.build(full.shard(rank, world_size), tier)
            total += layer(x, layer.new_cache(3, 8), lengths)
    real = (torch.arange(5)[None, :] < torch.tensor(lengths)[:, None])[..., None]
    expected = torch.where(real, ref + (world_size - 1) * full.o_proj.bias.detach(), 0.0)
    assert rel(total, expected) < 1e-5


def test_shard_records_its_share_outside_the_state_dict():
    full = mla.MLAWeights(TINY)
    assert (full.tp_rank, full.tp_world_size) == (0, 1)
    shard = full.shard(1, 2)
    assert (shard.tp_rank, shard.tp_world_size) == (1, 2)
    sub = shard.shard(1, 2)                          # heads 3 of 4: rank 3 of 4
    assert (sub.tp_rank, sub.tp_world_size) == (3, 4)
    assert torch.equal(sub.W_UK, full.W_UK[3:])
    # plain attributes: the state dict keeps HF's names and loads into a fresh MLAWeights
    assert set(shard.state_dict()) == set(full.state_dict())
    fresh = mla.MLAWeights(shard.config)
    fresh.load_state_dict(shard.state_dict())
    assert (fresh.tp_rank, fresh.tp_world_size) == (0, 1)


@pytest.fixture
def group_of_one():
    """A gloo process group of one rank in this process (no port: an in-memory store)."""
    if dist.is_initialized():
        pytest.skip("a default process group exists already")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tier", mla.TIERS)
def test_process_group_must_match_the_shard(tier, group_of_one):
    full = mla.MLAWeights(TINY, seed=4)
    x = torch.randn(2, 3, TINY.hidden_size)
    with torch.no_grad():
        ref_layer = mla.build(full, tier)
        ref = ref_layer(x, ref_layer.new_cache(2, 8))
        # whole weights under a group of one: the all-reduce is the identity
        layer = mla.build(full, tier, process_group=group_of_one)
        assert rel(layer(x, layer.new_cache(2, 8)), ref) < 1e-6
    # half the heads under a group of one would drop the other half: refused
    with pytest.raises(ValueError, match=r"process_group has 1 ranks but the weights are shard "
                                         r"0 of 2 \(tp_world_size=2\).*shard\(k, 1\)"):
        mla.build(full.shard(0, 2), tier, process_group=group_of_one)


def test_process_group_without_torch_distributed():
    if dist.is_initialized():
        pytest.skip("a default process group exists already")
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        mla.build(mla.MLAWeights(TINY), "naive", process_group=object())


# ---- sharded over a process group ---------------------------------------------------------
def _latent_rows(cache, i):
    if isinstance(cache, PagedLatentCache):
        return torch.cat(cache.gather(i), dim=-1)
    t = int(cache.seq_lens[i])
    return torch.cat([cache.kv_c[i, :t], cache.k_pe[i, :t]], dim=-1)


def _check_tiers(rank, world_size, group, backend, dtype, tolerance, config_names):
    """On every rank: each config and layer, sharded and unsharded side by side through CALLS.

    Returns {(config, layer): (max rel err, all-reduces per call)} for the parent to judge.
    """
    device = parallel.device_for(rank, backend)
    # whole weights, or another rank's shard, under the group: refused before any all-reduce
    full = mla.MLAWeights(TINY, device=device)
    for weights, match in ((full, f"has {world_size} ranks but the weights are the whole layer"),
                           (full.shard((rank + 1) % world_size, world_size),
                            f"rank {rank} of process_group but the weights are shard")):
        for tier in mla.TIERS:
            try:
                mla.build(weights, tier, process_group=group)
            except ValueError as err:
                assert match in str(err), str(err)
            else:
                raise AssertionError(f"{tier}: {match!r} was not raised")
    out = {}
    for config_name in config_names:
        config = CONFIGS[config_name]
        full = mla.MLAWeights(config, dtype=dtype, device=device, seed=11)  # same on every rank
        shard = full.shard(rank, world_size)
        for layer_name, (tier, options) in LAYERS.items():
            unsharded = mla.build(full, tier, **options)
            sharded = mla.build(shard, tier, process_group=group, **options)
            reduces = []
            count = sharded.reduce_and_bias

            def counted(y, count=count):
                reduces[-1] += 1
                return count(y)

            sharded.reduce_and_bias = counted
            caches = [layer.new_cache(3, 16) for layer in (unsharded, sharded)]
            gen = torch.Generator().manual_seed(2)  # the same x on every rank
            worst = 0.0
            for s, lengths in CALLS:
                x = torch.randn(3, s, config.hidden_size, generator=gen).to(device, dtype)
                reduces.append(0)
                with torch.no_grad():
                    ref = unsharded(x, caches[0], lengths)
                    y = sharded(x, caches[1], lengths)
                if lengths is not None:
                    for i, n in enumerate(lengths):
                        assert torch.all(y[i, n:] == 0), (config_name, layer_name, lengths)
                if ref.abs().max() > 0:
                    err = rel(y, ref)
                    # checked call by call: NaN < tolerance is False, max(worst, nan) is worst
                    assert err < tolerance, (config_name, layer_name, lengths, err)
                    worst = max(worst, err)
                else:
                    assert torch.all(y == 0)
                # the latent cache is replicated: every rank holds what one rank would
                for i in range(3):
                    assert torch.equal(_latent_rows(caches[1], i), _latent_rows(caches[0], i))
            assert worst < tolerance, (config_name, layer_name, worst)
            out[(config_name, layer_name)] = (worst, reduces)
    # the paged tier's ragged entry for engines, with padding rows at the end
    full = mla.MLAWeights(TINY, dtype=dtype, device=device, seed=12)
    layers = [mla.build(w, "paged", block_size=4, process_group=g)
              for w, g in ((full, None), (full.shard(rank, world_size), group))]
    caches = [layer.new_cache(3, 16) for layer in layers]
    gen = torch.Generator().manual_seed(3)
    for qsl, seq_ids in (([0, 3, 3, 5], [2, 0, 1]), ([0, 1, 2, 3], None)):
        x = torch.randn(7, TINY.hidden_size, generator=gen).to(device, dtype)
        with torch.no_grad():
            ref, y = (layer.forward_ragged(x, cache, qsl, seq_ids)
                      for layer, cache in zip(layers, caches))
        assert rel(y, ref) < tolerance
        assert torch.all(y[qsl[-1]:] == 0)
    # and its CUDA-graph decode entry, one all-reduce a step
    for _ in range(2):
        x = torch.randn(3, 1, TINY.hidden_size, generator=gen).to(device, dtype)
        with torch.no_grad():
            ref, y = (layer.decode_step(x, cache, num_kv_splits=2, **layer.decode_inputs(cache))
                      for layer, cache in zip(layers, caches))
        assert rel(y, ref) < tolerance
    return out


def _judge(results, world_size):
    """The same collectives on every rank: one all-reduce a call; the paged tier skips it (on
    every rank alike) only when no row takes part."""
    assert len(results) == world_size
    active = [int(lengths is None or any(lengths)) for _, lengths in CALLS]
    for (config_name, layer_name), (_, reduces) in results[0].items():
        assert all(r[config_name, layer_name][1] == reduces for r in results)
        expected = active if layer_name.startswith("paged") else [1] * len(CALLS)
        assert reduces == expected, (config_name, layer_name, reduces)


# TP 2 with every config; TP 4 (one head a rank) with the plain one, to keep the time down
@pytest.mark.parametrize("world_size, config_names", [(2, list(CONFIGS)), (4, ["tiny"])])
def test_sharded_tiers_match_unsharded(world_size, config_names):
    results = parallel.launch(_check_tiers, world_size, "gloo", torch.float32, 1e-5,
                              config_names)
    _judge(results, world_size)


def _fails_on_rank_1(rank, world_size, group):
    if rank == 1:
        raise RuntimeError("rank 1 gives up")
    return rank


def test_launch_reports_a_failing_rank():
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 2 failed:.*rank 1 gives up"):
        parallel.launch(_fails_on_rank_1, 2)


def test_demo_tp_2(tmp_path):
    """`python -m mla demo --tp 2`, as a user runs it: the ranks are spawned processes, which
    must find the rank function by name although the CLI runs as `__main__`."""
    # ranks inherit the environment: without PYTHONUNBUFFERED their stdout is block-buffered
    # into the pipe, so rank 0's table shows only if the rank flushes before it leaves
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mla", "demo", "--preset", "tiny", "--tp", "2", "--batch", "3",
         "--prompt-len", "8", "--decode-steps", "2", "--no-progress", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "leaked" not in proc.stderr, proc.stderr  # no semaphore left behind by a rank
    printed = proc.stdout
    assert printed.count("mla demo: tiny") == 1  # rank 0 alone prints
    assert "tensor parallel over 2 ranks (2 heads a rank)" in printed
    result = json.loads(out.read_text())
    assert result["tp"] == 2 and result["agree"]
    # every tier, and the paged one again on an fp8_e4m3 cache (tiny's latent has no 128-value
    # groups for fp8_ds_mla): each rank calibrates its own cache's scale
    assert [(r["tier"], r["kv_cache_dtype"]) for r in result["tiers"]] == [
        *((tier, "auto") for tier in mla.TIERS), ("paged", "fp8_e4m3")]
    assert result["tiers"][-1]["max_rel_err_vs_naive"] < 2**-4
    assert result["tp_max_rel_err_vs_unsharded_naive"] < 1e-5


def test_demo_tp_refuses_uneven_heads():
    from mla.cli import main

    with pytest.raises(SystemExit, match="--tp 3: the 4 heads of tiny do not split evenly"):
        main(["demo", "--preset", "tiny", "--tp", "3"])


def test_parallel_imports_nothing_from_the_command_line():
    """mla.parallel is a library module under the CLI: no import of it, even inside a function
    (an import loop: the CLI imports parallel)."""
    tree = ast.parse(Path(parallel.__file__).read_text())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names]
    assert not [m for m in imported if m.split(".")[-1] in ("cli", "__main__")], imported


def test_disable_multicast_sets_a_given_environment():
    env = parallel.disable_multicast({"PATH": "/bin", "NCCL_NVLS_ENABLE": "1"})
    assert env == {"PATH": "/bin", **parallel.DISABLE_MULTICAST}
    assert env["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_nccl_bf16_sharded_tiers_match_unsharded():
    results = parallel.launch(_check_tiers, 2, "nccl", torch.bfloat16, 2e-2, list(CONFIGS),
                              backend="nccl")
    _judge(results, 2)


# ---- the TP benchmark (benchmarks/bench_tp.py), its gloo run ---------------------------------


def test_bench_tp_runs_over_gloo(tmp_path):
    """The script a two-GPU machine runs, end to end on the CPU: TP 1 and TP 2 rows, the TP
    step's output against the whole layer's, every rank's time."""
    from mla.cli import main

    main(["bench", "tp", "--out", str(tmp_path), "--tp", "2", "--device", "cpu", "--preset", "tiny",
          "--batches", "1,3", "--context", "9", "--iters", "2"])
    result = json.loads((tmp_path / "cpu-tp.json").read_text())
    assert result["backend"] == "gloo" and result["tp"] == 2
    rows = result["rows"]
    assert [(r["tp"], r["b"], r["heads_per_rank"]) for r in rows] == [(1, 1, 4), (1, 3, 4), (2, 1, 2), (2, 3, 2)]
    for r in rows:
        assert r["rel_err"] < 1e-5, r
        assert len(r["step_eager_us_per_rank"]) == r["tp"] and r["step_eager_us"] == max(r["step_eager_us_per_rank"])
        assert r["step_eager_us"] > 0 and "step_graph_us" not in r  # no graphs on the CPU
    assert all(r["step_eager_speedup_vs_tp1"] > 0 for r in rows if r["tp"] == 2)


NOT_ENOUGH_GPUS = pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="2 GPUs here: --tp 2 runs")


@pytest.mark.parametrize("args, match", [
    (["--tp", "1"], "--tp must be >= 2"),
    (["--tp", "0"], "--tp must be >= 2"),
    (["--tp", "3", "--preset", "tiny", "--device", "cpu"], "--tp 3 does not divide tiny's 4 heads"),
    pytest.param(["--tp", "2", "--device", "cuda"], "--tp 2 needs 2 GPUs", marks=NOT_ENOUGH_GPUS),
])
def test_bench_tp_refuses_what_it_cannot_run(tmp_path, args, match):
    from mla.cli import main

    with pytest.raises(SystemExit, match=match):
        main(["bench", "tp", "--out", str(tmp_path), *args])
    assert not list(tmp_path.iterdir())  # nothing written
