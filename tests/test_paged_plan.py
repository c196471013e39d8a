"""The paged tier's host plan (mla/paged/plan.py) against the same metadata written out token by
token, and the layer's shortcuts against the general path they stand in for.

`plan_call` builds its per-token tensors with a few vectorised operators, skips what a call does
not need (the token index of a batch that holds every token, the block-table gather of rows that
are the whole cache in order) and packs everything into one transfer; here each field is checked
against a plain loop over the tokens and the cache's checked `slot_mapping`.
"""

import dataclasses

import pytest
import torch

import mla
from mla.paged.plan import query_pieces, to_device

TINY = mla.MLAConfig.from_preset("tiny")


def layer_and_cache(prefill, batch=4, block_size=3, **options):
    weights = mla.MLAWeights(TINY, dtype=torch.float32, seed=1)
    paged = mla.build(weights, "paged", block_size=block_size, shuffle=5, prefill=prefill,
                      prefill_crossover=4, **options)
    return paged, paged.new_cache(batch, 40)


def expected_plan(cache, held, seq_ids, new_lens, starts):
    """Per token, packed row after row: (row k, cache row, position, row of x)."""
    return [(k, i, held[i] + j, start + j)
            for k, (i, n, start) in enumerate(zip(seq_ids, new_lens, starts)) for j in range(n)]


def check_plan(paged, cache, seq_ids, new_lens, starts):
    """Plan one call as the layer does and check every field against `expected_plan`."""
    held = cache.seq_lens.tolist()
    plan = paged._plan(cache, torch.tensor(seq_ids), torch.tensor(new_lens), torch.tensor(starts))
    tokens = expected_plan(cache, held, seq_ids, new_lens, starts)
    N = len(tokens)
    rows = torch.tensor([i for _, i, _, _ in tokens])
    positions = [p for _, _, p, _ in tokens]
    slots = cache.slot_mapping(rows, torch.tensor(positions)).tolist()   # the checked mapping
    assert plan.positions.tolist() == positions
    assert plan.slot_mapping.tolist() == slots
    x_rows = [r for _, _, _, r in tokens]
    if x_rows == list(range(N)):
        assert plan.token_rows is None
    else:
        assert plan.token_rows.tolist() == x_rows
    assert torch.equal(cache.block_table.cpu(), cache.block_table_cpu)  # growth copied over

    def table_of(cache_rows):
        return cache.block_table_cpu[torch.tensor(cache_rows, dtype=torch.int64)]

    decode_ks = [k for k, n in enumerate(new_lens) if n == 1]
    if not decode_ks:
        assert plan.decode is None
    else:
        dec = plan.decode
        first = [sum(new_lens[:k]) for k in decode_ks]
        assert (dec.tokens is None) == (len(decode_ks) == N)
        if dec.tokens is not None:
            assert dec.tokens.tolist() == first
        assert dec.seq_lens.dtype == torch.int32
        assert dec.seq_lens.tolist() == [held[seq_ids[k]] + 1 for k in decode_ks]
        assert torch.equal(dec.block_table, table_of([seq_ids[k] for k in decode_ks]))
        assert dec.max_seq_len == max(held[seq_ids[k]] + 1 for k in decode_ks)
    paths = {}
    for k, n in enumerate(new_lens):
        if n > 1:
            paths.setdefault(paged.prefill_path(n, held[seq_ids[k]]), []).append(k)
    assert sorted(path for path, _ in plan.prefill) == sorted(paths)
    for path, prefill_rows in plan.prefill:
        ks = paths[path]
        path_tokens = [t for t, (k, _, _, _) in enumerate(tokens) if k in ks]
        lens = [new_lens[k] for k in ks]
        contexts = [held[seq_ids[k]] for k in ks]
        assert prefill_rows.every_token == (len(ks) == len(new_lens))
        if not prefill_rows.every_token:
            assert prefill_rows.tokens.tolist() == path_tokens
        assert prefill_rows.slots.tolist() == [slots[t] for t in path_tokens]
        assert prefill_rows.query_start_loc.dtype == torch.int32
        assert prefill_rows.query_start_loc.tolist() == [sum(lens[:m]) for m in range(len(ks) + 1)]
        assert prefill_rows.context_lens.dtype == torch.int32
        assert prefill_rows.context_lens.tolist() == contexts == prefill_rows.context_lens_host
        assert torch.equal(prefill_rows.block_table, table_of([seq_ids[k] for k in ks]))
        assert prefill_rows.max_new_len == max(lens)
        assert prefill_rows.max_seq_len == max(t + n for t, n in zip(contexts, lens))
        if path == "absorbed":
            pieces = prefill_rows.pieces
            s_q, piece_row, piece_seq_lens, query_slots = query_pieces(torch.tensor(lens),
                                                                        torch.tensor(contexts))
            assert pieces.s_q == s_q and pieces.tokens is None
            assert pieces.seq_lens.dtype == torch.int32
            assert pieces.seq_lens.tolist() == piece_seq_lens.tolist()
            assert pieces.query_slots.tolist() == query_slots.tolist()
            assert pieces.max_seq_len == int(piece_seq_lens.max())
            assert torch.equal(pieces.block_table,
                               table_of([seq_ids[ks[m]] for m in piece_row.tolist()]))
        else:
            assert prefill_rows.pieces is None
    cache.seq_lens.index_add_(0, torch.tensor(seq_ids), torch.tensor(new_lens))   # as the layer


@pytest.mark.parametrize("prefill", ["up-project", "absorbed", "auto"])
def test_plan_matches_the_tokens_written_out(prefill):
    """Prompts of every row (one batch of every token, the table itself), one row alone, decodes
    of every row and of some rows out of order, and mixed calls whose rows sit apart in x."""
    paged, cache = layer_and_cache(prefill)
    calls = [([0, 1, 2, 3], [5, 7, 2, 4], [0, 5, 12, 14]),      # a prompt, x packed
             ([0, 1, 2, 3], [1, 1, 1, 1], [0, 1, 2, 3]),        # a decode of every row
             ([2, 0], [1, 1], [0, 1]),                          # some rows, out of order
             ([3, 1, 0], [1, 6, 2], [10, 0, 20]),               # decode, extends, x apart
             ([1], [9], [0]),                                   # one row, over its context
             ([2, 3], [3, 5], [0, 8]),                          # two rows, padding between
             ([0, 1, 2, 3], [2, 2, 2, 1], [0, 2, 4, 6])]        # every row, some decoding
    for seq_ids, new_lens, starts in calls:
        check_plan(paged, cache, seq_ids, new_lens, starts)


def test_to_device_keeps_values_and_dtypes():
    host = dict(a=torch.arange(5), b=[7, -2], c=mla.paged.plan.Int32([1, 2, 3]),
                d=torch.tensor([[4, 5], [6, 7]], dtype=torch.int32), e=[],
                f=torch.tensor([[8, 9, 10]]), g=torch.tensor([1, 0], dtype=torch.int16))
    out = to_device(host, torch.device("cpu"))
    for key, value in host.items():
        want = value if isinstance(value, torch.Tensor) else torch.tensor(
            value, dtype=torch.int32 if key == "c" else torch.int64)
        dtype = torch.int32 if want.dtype == torch.int32 else torch.int64
        assert out[key].dtype == dtype and out[key].shape == want.shape, key
        assert out[key].tolist() == want.tolist(), key


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_new_tokens_in_hand_equal_their_read_back(kv_cache_dtype):
    """Where one up-projected batch holds every token of an "auto" cache's call, the layer
    attends with the new rows it just wrote instead of reading them back from their slots:
    the output is the read-back's, bit for bit. An fp8 cache reads them back (the rounded
    values are what it holds)."""
    paged, cache = layer_and_cache("up-project", batch=3, block_size=4,
                                   kv_cache_dtype=kv_cache_dtype)
    original, seen = paged.attend_prefill, []

    def both(path, q_nope, q_pe, cache, rows):
        out = original(path, q_nope, q_pe, cache, rows)
        seen.append(rows.new_latent is not None)
        read_back = original(path, q_nope, q_pe, cache, dataclasses.replace(rows, new_latent=None))
        assert torch.equal(out, read_back)
        return out

    paged.attend_prefill = both
    with torch.no_grad():
        for lengths in ([6, 6, 6], [5, 3, 0], [4, 4, 4]):     # prompts, then extends
            paged(torch.randn(3, max(lengths), TINY.hidden_size), cache, lengths)
    assert seen == [kv_cache_dtype == "auto"] * 3
