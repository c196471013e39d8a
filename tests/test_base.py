"""The common call's checks: clear errors, nothing written (naive and absorbed; every tier for
the cache's fit).

(The paged tier's own bad-input tests live in tests/test_paged.py.)
"""

import re

import pytest
import torch

import mla
from mla import MLAConfig, MLAWeights
from mla.paged import PagedLatentCache


@pytest.fixture(params=["naive", "absorbed"])
def layer(request):
    return mla.build(MLAWeights(MLAConfig.from_preset("tiny")), request.param)


def _snapshot(cache):
    return cache.kv_c.clone(), cache.k_pe.clone(), cache.seq_lens.clone()


def _unchanged(cache, snap):
    return all(torch.equal(a, b) for a, b in zip((cache.kv_c, cache.k_pe, cache.seq_lens), snap))


CASES = [
    ("hidden", lambda x: torch.randn(2, 3, 63), None, ValueError, "hidden_size=64"),
    ("ndim", lambda x: torch.randn(3, 64), None, ValueError, "shape"),
    ("empty", lambda x: torch.randn(2, 0, 64), None, ValueError, "at least one token"),
    ("dtype", lambda x: x.double(), None, TypeError, "float64 but the weights are torch.float32"),
    ("device", lambda x: x.to("meta"), None, ValueError, "meta"),
    ("batch", lambda x: torch.randn(3, 3, 64), None, ValueError, "batch 3"),
    ("len-shape", lambda x: x, [1, 2, 3], ValueError, r"shape \(batch,\)"),
    ("len-range", lambda x: x, [4, 0], ValueError, r"lie in \[0, tokens=3\]"),
    ("len-neg", lambda x: x, [-1, 2], ValueError, "lie in"),
    ("len-float", lambda x: x, torch.tensor([1.0, 2.0]), TypeError, "integers"),
    ("not-tensor", lambda x: x.tolist(), None, TypeError, "torch.Tensor"),
]


@pytest.mark.parametrize("name,make_x,lengths,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_and_leaves_cache(layer, name, make_x, lengths, exc, match):
    cache = layer.new_cache(2, 8)
    layer(torch.randn(2, 2, 64), cache, [2, 1])  # something already cached
    snap = _snapshot(cache)
    with pytest.raises(exc, match=match):
        layer(make_x(torch.randn(2, 3, 64)), cache, lengths)
    assert _unchanged(cache, snap)


def test_past_max_seq_len_and_wrong_cache(layer):
    cache = layer.new_cache(2, 8)
    layer(torch.randn(2, 6, 64), cache, [6, 2])
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="row 0 .*holding 6.* max_seq_len=8"):
        layer(torch.randn(2, 3, 64), cache, [3, 3])
    assert _unchanged(cache, snap)
    with pytest.raises(TypeError, match="LatentCache"):
        layer(torch.randn(2, 1, 64), {"kv_c": None})
    with pytest.raises(ValueError, match="max_seq_len must be an int >= 1, got 0"):
        layer.new_cache(2, 0)


def test_unknown_tier_and_bad_weights():
    with pytest.raises(ValueError, match="unknown tier 'fast'"):
        mla.build(MLAWeights(MLAConfig.from_preset("tiny")), "fast")
    with pytest.raises(TypeError, match="mla.MLAWeights"):
        mla.build(torch.nn.Linear(2, 2), "naive")


def test_rows_sitting_out_keep_their_cache(layer):
    cache = layer.new_cache(2, 8)
    layer(torch.randn(2, 3, 64), cache, [3, 2])
    row1 = cache.kv_c[1].clone()
    y = layer(torch.randn(2, 2, 64), cache, [2, 0])
    assert cache.seq_lens.tolist() == [5, 2]
    assert torch.equal(cache.kv_c[1], row1) and torch.all(y[1] == 0)


# ---- a cache that does not fit the layer, every tier ----------------------------------------
TINY = MLAConfig.from_preset("tiny")  # kv_lora_rank 32, rope width 8
MISFITS = {  # name: (the config and dtype of the layer that makes the cache, its batch, error)
    "dtype": (TINY, torch.bfloat16, 2, ValueError,
              "cache has dtype torch.bfloat16 but the weights are torch.float32"),
    "kv_lora_rank": (TINY.replace(kv_lora_rank=16), torch.float32, 2, ValueError,
                     r"cache holds latents of c \+ r = 16 \+ 8 .* expects 32 \+ 8"),
    "rope width": (TINY.replace(qk_rope_head_dim=4), torch.float32, 2, ValueError,
                   r"cache holds .* = 32 \+ 4 .* expects 32 \+ 8"),
    # c + r the same (40), split elsewhere: a paged page of 40 would take it without complaint
    "same width": (TINY.replace(kv_lora_rank=30, qk_rope_head_dim=10), torch.float32, 2,
                   ValueError, r"cache holds .* = 30 \+ 10 .* expects 32 \+ 8"),
    "batch": (TINY, torch.float32, 3, ValueError, "cache was made for batch 3 but x has batch 2"),
}


def _cache_state(cache):
    """Everything a call could change, cloned (the paged allocator's state included)."""
    if isinstance(cache, PagedLatentCache):
        return (cache.kv_cache.clone(), cache.block_table.clone(), cache.block_table_cpu.clone(),
                cache.seq_lens.clone(), list(cache.free_blocks), cache.blocks_of(0))
    return _snapshot(cache)


def _same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("tier", mla.TIERS)
@pytest.mark.parametrize("misfit", list(MISFITS))
def test_cache_that_does_not_fit_raises_and_stays_unchanged(tier, misfit):
    config, dtype, batch, exc, match = MISFITS[misfit]
    options = {"block_size": 4} if tier == "paged" else {}
    layer = mla.build(MLAWeights(TINY), tier, **options)
    maker = mla.build(MLAWeights(config, dtype=dtype, seed=1), tier, **options)
    cache = maker.new_cache(batch, 8)
    maker(torch.randn(batch, 3, config.hidden_size, dtype=dtype), cache)  # something cached
    before = _cache_state(cache)
    with pytest.raises(exc, match=match):
        layer(torch.randn(2, 2, 64), cache, [2, 1])
    assert _same(_cache_state(cache), before)


@pytest.mark.parametrize("tier", mla.TIERS)
def test_cache_on_another_device_raises(tier):
    layer = mla.build(MLAWeights(TINY), tier)
    cache = mla.build(MLAWeights(TINY, device="meta"), tier).new_cache(2, 8)
    with pytest.raises(ValueError, match="cache is on meta but the weights are on cpu"):
        layer(torch.randn(2, 2, 64), cache)
    assert cache.seq_lens.tolist() == [0, 0]


def test_hand_made_latent_cache_is_checked():
    from mla.cache import LatentCache

    layer = mla.build(MLAWeights(TINY), "absorbed")
    good = layer.new_cache(2, 8)
    bad = [(LatentCache(good.kv_c, good.k_pe[:, :5], good.seq_lens), "same b and t"),
           (LatentCache(good.kv_c, good.k_pe.double(), good.seq_lens), "cache.k_pe is"),
           (LatentCache(good.kv_c, good.k_pe, good.seq_lens.int()), "cache.seq_lens must be")]
    for cache, match in bad:
        with pytest.raises(ValueError, match=match):
            layer(torch.randn(2, 1, 64), cache)
        assert torch.all(cache.kv_c == 0) and torch.all(cache.k_pe == 0)
    # append itself refuses latents that do not fit, before writing
    with pytest.raises(ValueError, match=r"append: k_pe must have shape \(b=2, s=1, r=8\)"):
        good.append(torch.ones(2, 1, 32), torch.ones(2, 1, 6), torch.tensor([1, 1]))
    assert torch.all(good.kv_c == 0) and good.seq_lens.tolist() == [0, 0]


# ---- options of the wrong type are refused, never converted ----------------------------------
BAD_OPTIONS = [
    ("absorbed", dict(precompute="no"), TypeError, "precompute must be True or False, got 'no'"),
    ("absorbed", dict(precompute=1), TypeError, "precompute must be True or False, got 1"),
    ("absorbed", dict(precompute=None), TypeError, "precompute must be True or False"),
    ("absorbed", dict(prefill=True), TypeError, "prefill must be a str"),
    ("absorbed", dict(prefill="sometimes"), ValueError, "prefill must be one of"),
    ("naive", dict(precompute=True), TypeError,
     r"build\(\.\.\., 'naive'\) got unknown option\(s\) 'precompute'; the naive tier takes "
     r"process_group"),
    ("absorbed", dict(prefil="absorbed", block_size=4), TypeError,
     r"unknown option\(s\) 'block_size', 'prefil'; the absorbed tier takes precompute, prefill, "
     r"process_group"),
    ("paged", dict(precompute=True), TypeError, r"unknown option\(s\) 'precompute'; .*block_size"),
]


@pytest.mark.parametrize("tier,options,exc,match", BAD_OPTIONS,
                         ids=[f"{t}-{'-'.join(o)}" for t, o, _, _ in BAD_OPTIONS])
def test_bad_option_raises_naming_it(tier, options, exc, match):
    with pytest.raises(exc, match=match):
        mla.build(MLAWeights(TINY), tier, **options)


def test_tier_that_is_not_a_name():
    with pytest.raises(ValueError, match=r"unknown tier \['naive'\]"):
        mla.build(MLAWeights(TINY), ["naive"])


def test_new_cache_sizes(layer):
    import numpy as np

    cache = layer.new_cache(np.int64(2), torch.tensor(8))  # integers of numpy and torch pass
    assert (cache.batch_size, cache.max_seq_len) == (2, 8) and isinstance(cache.max_seq_len, int)
    for bad in (True, 8.0, "8", torch.tensor([8])):
        with pytest.raises(TypeError, match=f"max_seq_len must be an int, got {re.escape(repr(bad))}"):
            layer.new_cache(2, bad)
