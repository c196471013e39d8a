"""Randomized: the paged tier against the naive tier, through the public API only.

Each example draws a batch, a page size, a prefill mode and a run of calls (prefill, chunked
prefill / extend, decode steps), with ragged lengths and rows that sit a call out, and feeds the
same tokens to both tiers built from one set of weights (the tiny preset, float32, on the CPU).
Every call's output must agree. Hypothesis runs derandomized and without its example database,
so CI sees the same examples on every run.
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla

from assertions import assert_rel_close

CFG = mla.MLAConfig.from_preset("tiny")


@st.composite
def runs(draw):
    """(batch, [lengths of each call]): prefill and extend calls of up to 9 new tokens a row,
    decode calls of 0 or 1, in any order."""
    batch = draw(st.integers(1, 3))
    row = st.lists(st.integers(0, 9), min_size=batch, max_size=batch)
    decode = st.lists(st.integers(0, 1), min_size=batch, max_size=batch)
    calls = draw(st.lists(st.one_of(row, decode), min_size=1, max_size=5))
    return batch, calls


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(run=runs(), block_size=st.sampled_from([1, 3, 16, 64]),
       prefill=st.sampled_from([("up-project", None), ("absorbed", None), ("auto", 1),
                                ("auto", 4), ("auto", 64)]),
       room=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_paged_equals_naive(run, block_size, prefill, room, seed):
    batch, calls = run
    mode, crossover = prefill
    options = dict(block_size=block_size, prefill=mode)
    if crossover is not None:
        options["prefill_crossover"] = crossover
    weights = mla.MLAWeights(CFG, seed=seed)
    naive, paged = mla.build(weights, "naive"), mla.build(weights, "paged", **options)
    max_seq_len = max(map(sum, zip(*calls))) + room
    if max_seq_len == 0:
        max_seq_len = 1
    cache_n, cache_p = naive.new_cache(batch, max_seq_len), paged.new_cache(batch, max_seq_len)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lengths in calls:
            x = torch.randn(batch, max(max(lengths), 1), CFG.hidden_size, generator=gen)
            y_n, y_p = naive(x, cache_n, lengths), paged(x, cache_p, lengths)
            assert_rel_close(y_p, y_n, 1e-4)
            pad = torch.arange(x.shape[1])[None, :] >= torch.tensor(lengths)[:, None]
            assert torch.all(y_p[pad] == 0), "the paged tier's padded positions are not zeros"
            assert cache_p.seq_lens.tolist() == cache_n.seq_lens.tolist()
