"""The common call's checks, for the naive and absorbed tiers: clear errors, nothing written.

(The paged tier's own bad-input tests live in tests/test_paged.py.)
"""

import pytest
import torch

import mla
from mla import MLAConfig, MLAWeights


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
    with pytest.raises(ValueError, match="max_seq_len must be a positive int"):
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
