"""The absorbed tier against the naive tier (the tier below it)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla
from mla import MLAConfig, MLAWeights

from assertions import assert_rel_close

OPTIONS = [dict(precompute=False), dict(precompute=True),
           dict(precompute=False, prefill="absorbed"), dict(precompute=True, prefill="absorbed")]


def _run_both(weights, calls, batch, max_len, tol=1e-5, **options):
    naive, absorbed = mla.build(weights, "naive"), mla.build(weights, "absorbed", **options)
    cn, ca = naive.new_cache(batch, max_len), absorbed.new_cache(batch, max_len)
    with torch.no_grad():
        for x, lengths in calls:
            yn, ya = naive(x, cn, lengths), absorbed(x, ca, lengths)
            assert_rel_close(ya, yn, tol)
            assert torch.all(ya[yn == 0] == 0)  # padded positions are zeros in both
    assert torch.equal(cn.seq_lens, ca.seq_lens)
    assert torch.allclose(cn.kv_c, ca.kv_c) and torch.allclose(cn.k_pe, ca.k_pe)


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
    _run_both(w, calls, b, 120, **options)


def _load_by_state_dict(w, new):
    w.load_state_dict(new.state_dict())


def _load_by_data_copy(w, new):  # writes through .data, which no version counter sees
    for p, q in zip(w.parameters(), new.parameters()):
        p.data.copy_(q.data)


def _load_by_no_grad_copy(w, new):
    with torch.no_grad():
        for p, q in zip(w.parameters(), new.parameters()):
            p.copy_(q)


def _load_by_data_swap(w, new):  # new storage
    for p, q in zip(w.parameters(), new.parameters()):
        p.data = q.data.clone()


@pytest.mark.parametrize("load", [_load_by_state_dict, _load_by_data_copy, _load_by_no_grad_copy,
                                  _load_by_data_swap], ids=lambda f: f.__name__[9:])
def test_precomputed_products_follow_weight_loads(load):
    cfg = MLAConfig.from_preset("tiny")
    w = MLAWeights(cfg, seed=8)
    naive, absorbed = mla.build(w, "naive"), mla.build(w, "absorbed", precompute=True)
    x = torch.randn(2, 1, cfg.hidden_size)
    with torch.no_grad():
        absorbed(x, absorbed.new_cache(2, 4))  # products of the first weights in use
        load(w, MLAWeights(cfg, seed=9))
        assert_rel_close(absorbed(x, absorbed.new_cache(2, 4)), naive(x, naive.new_cache(2, 4)),
                         1e-5)
        W_UQ_UK, W_UV_O = absorbed.absorbed_products()
    torch.testing.assert_close(W_UQ_UK, torch.einsum("hdq,hdc->hqc", w.W_UQ, w.W_UK))
    torch.testing.assert_close(W_UV_O, torch.einsum("hvc,xhv->hcx", w.W_UV, w.W_O))


@pytest.mark.parametrize("precompute", [False, True])
def test_gradients_match_naive(precompute):
    """The absorbed tier is differentiable: the weights' gradients are the naive tier's, call
    after call (an inference call first, then two training calls)."""
    cfg = MLAConfig.from_preset("tiny")
    w = MLAWeights(cfg, seed=3)
    naive, absorbed = mla.build(w, "naive"), mla.build(w, "absorbed", precompute=precompute,
                                                     prefill="absorbed")
    x = torch.randn(2, 5, cfg.hidden_size)
    with torch.no_grad():
        absorbed(x, absorbed.new_cache(2, 8))
    for _ in range(2):
        grads = []
        for tier in (naive, absorbed):
            tier(x, tier.new_cache(2, 8)).square().sum().backward()
            grads.append({n: p.grad for n, p in w.named_parameters()})
            w.zero_grad(set_to_none=True)
        for name, expected in grads[0].items():
            assert grads[1][name] is not None, f"no gradient reaches {name}"
            assert_rel_close(grads[1][name], expected, 1e-4)


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
    _run_both(w, calls, batch, 40, precompute=precompute)


def test_absorption_flops_and_the_class_docstring_s_figures():
    """`absorption_flops` counts each `precompute` option's FLOPs per decode token; the figures
    the class docstring quotes (V3, 4096 cached tokens) are the code's."""
    from mla import absorbed as module
    from mla.memory import attention_flops

    v3 = MLAConfig.from_preset("deepseek-v3")
    f = module.absorption_flops(v3)
    h, q, c, d, v, x = 128, 1536, 512, 128, 128, 7168  # V3's config.json
    assert f == dict(query_factors=2 * h * q * d + 2 * h * d * c, query_product=2 * h * q * c,
                     output_factors=2 * h * c * v + 2 * h * v * x, output_product=2 * h * c * x)
    # the products cost more than the factors at every DeepSeek size
    for preset in ("deepseek-v2", "deepseek-v2-lite", "deepseek-v3"):
        f = module.absorption_flops(MLAConfig.from_preset(preset))
        assert f["query_product"] > f["query_factors"]
        assert f["output_product"] > f["output_factors"]
    doc = " ".join(module.AbsorbedMLA.__doc__.split())
    decode = attention_flops(v3, 1, 4096)
    assert f"({decode.up_projected / decode.absorbed:.0f}x the FLOPs" in doc
    r = v3.qk_rope_head_dim
    per_score_up, per_score_abs = d + r + v, 2 * c + r
    assert f"d + r + v = {per_score_up} multiply-adds against 2c + r = {per_score_abs}" in doc
    assert f"{per_score_abs / per_score_up:.1f}x cheaper up-projected" in doc
