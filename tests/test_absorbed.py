"""The absorbed tier against the naive tier (the tier below it)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla
from mla import MLAConfig, MLAWeights

OPTIONS = [dict(precompute=False), dict(precompute=True),
           dict(precompute=False, prefill="absorbed"), dict(precompute=True, prefill="absorbed")]


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _run_both(weights, calls, batch, max_len, **options):
    naive, absorbed = mla.build(weights, "naive"), mla.build(weights, "absorbed", **options)
    cn, ca = naive.new_cache(batch, max_len), absorbed.new_cache(batch, max_len)
    worst = 0.0
    with torch.no_grad():
        for x, lengths in calls:
            yn, ya = naive(x, cn, lengths), absorbed(x, ca, lengths)
            worst = max(worst, _rel(ya, yn))
            assert torch.all(ya[yn == 0] == 0)  # padded positions are zeros in both
    assert torch.equal(cn.seq_lens, ca.seq_lens)
    assert torch.allclose(cn.kv_c, ca.kv_c) and torch.allclose(cn.k_pe, ca.k_pe)
    return worst


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("q_lora", [True, False], ids=["qlora", "noqlora"])
def test_prefill_chunked_prefill_ragged_and_decode(options, q_lora):
    cfg = MLAConfig.from_preset("tiny")
    if not q_lora:
        cfg = cfg.replace(q_lora_rank=None)
    w = MLAWeights(cfg, seed=7)
    b, hidden = 3, cfg.hidden_size
    calls = [(torch.randn(b, 30, hidden), torch.tensor([30, 11, 0])),     # ragged prefill
             (torch.randn(b, 17, hidden), torch.tensor([17, 1, 9])),      # extend + decode mixed
             (torch.randn(b, 40, hidden), torch.tensor([40, 0, 40]))]     # runs past 64 (YaRN)
    calls += [(torch.randn(b, 1, hidden), None) for _ in range(12)]       # 12 decode steps
    assert _run_both(w, calls, b, 120, **options) < 1e-5


def test_products_follow_weight_updates():
    cfg = MLAConfig.from_preset("tiny")
    w = MLAWeights(cfg, seed=8)
    absorbed = mla.build(w, "absorbed", precompute=True)
    first = [t.clone() for t in absorbed.absorbed_products()]
    w.load_state_dict(MLAWeights(cfg, seed=9).state_dict())
    second = absorbed.absorbed_products()
    assert not torch.allclose(first[0], second[0])
    assert torch.allclose(second[0], torch.einsum("hdq,hdc->hqc", w.W_UQ, w.W_UK))
    assert second[1].shape == (cfg.num_heads, cfg.kv_lora_rank, cfg.hidden_size)


def test_bad_prefill_option():
    with pytest.raises(ValueError, match="prefill must be one of"):
        mla.build(MLAWeights(MLAConfig.from_preset("tiny")), "absorbed", prefill="sometimes")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads=st.integers(1, 4), nope=st.sampled_from([4, 8]), rope=st.sampled_from([2, 4, 8]),
       value=st.sampled_from([4, 12]), rank=st.sampled_from([8, 16]),
       q_lora=st.sampled_from([None, 8]), batch=st.integers(1, 3),
       chunks=st.lists(st.integers(0, 9), min_size=1, max_size=4),
       precompute=st.booleans(), seed=st.integers(0, 2**16))
def test_property_absorbed_equals_naive(heads, nope, rope, value, rank, q_lora, batch, chunks,
                                        precompute, seed):
    cfg = MLAConfig(hidden_size=16, num_heads=heads, q_lora_rank=q_lora, kv_lora_rank=rank,
                    qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=value,
                    max_position_embeddings=64)
    w = MLAWeights(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    calls = []
    for n in chunks:
        s = max(n, 1)
        lengths = torch.randint(0, s + 1, (batch,), generator=gen)
        calls.append((torch.randn(batch, s, 16, generator=gen), lengths))
    if not any(int(l.sum()) for _, l in calls):
        return  # nothing real to compare
    assert _run_both(w, calls, batch, 40, precompute=precompute) < 1e-5


def test_precompute_flops_in_the_docstring_are_the_code_s():
    """The module docstring's per-decode-token FLOPs of each `precompute` option, recomputed."""
    from mla import absorbed as module
    from mla.memory import attention_flops, prefill_crossover

    v3 = MLAConfig.from_preset("deepseek-v3")
    f = module.absorption_flops(v3)
    h, q, c, d, v, x = 128, 1536, 512, 128, 128, 7168  # V3's config.json
    assert f == dict(query_factors=2 * h * q * d + 2 * h * d * c, query_product=2 * h * q * c,
                     output_factors=2 * h * c * v + 2 * h * v * x, output_product=2 * h * c * x)
    millions = {k: round(n / 1e6) for k, n in f.items()}
    assert millions == dict(query_factors=67, query_product=201, output_factors=252,
                            output_product=940)
    for n in millions.values():
        assert f"= {n:3d}M" in module.__doc__ or f"= {n}M" in module.__doc__, n
    # the products cost more than the factors at every DeepSeek size
    for preset in ("deepseek-v2", "deepseek-v2-lite", "deepseek-v3"):
        f = module.absorption_flops(MLAConfig.from_preset(preset))
        assert f["query_product"] > f["query_factors"]
        assert f["output_product"] > f["output_factors"]
    # the class docstring's decode and prefill figures (V3, per new token)
    doc = module.AbsorbedMLA.__doc__
    decode = attention_flops(v3, 1, 4096)
    assert f"{decode.up_projected / 1e9:.1f} GFLOPs" in doc and f"{decode.absorbed / 1e9:.2f}" in doc
    assert f"({decode.up_projected / decode.absorbed:.0f}x fewer)" in doc
    prefill = attention_flops(v3, 4096, 4096)
    assert f"{prefill.up_projected / 4096 / 1e6:.0f}M FLOPs a token up-projected" in doc
    assert f"against {prefill.absorbed / 4096 / 1e6:.0f}M absorbed" in doc
    assert f"about {prefill_crossover(v3, 4096)} new tokens" in doc
