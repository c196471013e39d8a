"""The paged tier: its cache (allocator, block tables, slot mapping) and the layer against the
absorbed tier.

The layer tests are built hostile, as FlashMLA's are: pages handed out in a shuffled order (block
tables non-contiguous), every unwritten value of the cache NaN, so a read of an unused page or of
the tail of a partial page turns the output into NaN. On the CPU the Triton decode kernel runs in
its interpreter, so shapes stay at the "tiny" preset, in float32.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla
from assertions import check_graphed_decode_steps, rel
from mla.cache import LatentCache
from mla.paged import UNUSED, OutOfBlocksError, PagedLatentCache, PagedMLA
from mla.paged.cache import slots_of

TINY = mla.MLAConfig.from_preset("tiny")
NAN = float("nan")


def pair(block_size, *, prefill="up-project", seed=1, **options):
    """(absorbed, paged) over one float32 tiny MLAWeights."""
    weights = mla.MLAWeights(TINY, dtype=torch.float32, seed=seed)
    return (mla.build(weights, "absorbed"),
            mla.build(weights, "paged", block_size=block_size, shuffle=7, prefill=prefill,
                      **options))


def poisoned(paged, b, max_seq_len, **options):
    cache = paged.new_cache(b, max_seq_len, **options)
    cache.kv_cache.fill_(NAN)
    return cache


def snapshot(cache):
    return dict(kv_cache=cache.kv_cache.clone(), block_table=cache.block_table.clone(),
                block_table_cpu=cache.block_table_cpu.clone(), seq_lens=cache.seq_lens.clone(),
                free_blocks=list(cache.free_blocks),
                pages=[cache.blocks_of(i) for i in range(cache.batch_size)])


def equal_with_nan(a, b):
    """Equal values, NaN where the other has NaN (a NaN poison page overwritten by 7.0 differs)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


def assert_unchanged(cache, before):
    after = snapshot(cache)
    for key in ("kv_cache", "block_table", "block_table_cpu", "seq_lens"):
        assert equal_with_nan(after[key], before[key]), key
    assert after["free_blocks"] == before["free_blocks"]
    assert after["pages"] == before["pages"]


def padded_batch(lengths, s, hidden=TINY.hidden_size):
    x = torch.randn(len(lengths), s, hidden)
    for i, n in enumerate(lengths):
        x[i, n:] = 0.0
    return x


def check_step(absorbed, paged, a_cache, p_cache, x, lengths=None):
    """One call through both tiers: same outputs, zeros at padding, same cached latent."""
    with torch.no_grad():
        ref = absorbed(x, a_cache, lengths)
        out = paged(x, p_cache, lengths)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < 1e-5
    if lengths is not None:
        for i, n in enumerate(torch.as_tensor(lengths).tolist()):
            assert torch.all(out[i, n:] == 0)
    assert p_cache.seq_lens.tolist() == a_cache.seq_lens.tolist()
    for i, t in enumerate(p_cache.seq_lens.tolist()):
        kv_c, k_pe = p_cache.gather(i)
        # the projections run as other GEMM shapes (T tokens, not b x s): last-bit differences
        assert torch.allclose(kv_c, a_cache.kv_c[i, :t], rtol=1e-5, atol=1e-6)
        assert torch.allclose(k_pe, a_cache.k_pe[i, :t], rtol=1e-5, atol=1e-6)
    return out


# ---- the allocator ---------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_allocator_grows_lazily_frees_and_reuses(block_size):
    c, r = 4, 2
    cache = PagedLatentCache(3, 300, c, r, block_size=block_size)
    max_blocks = math.ceil(300 / block_size)
    assert cache.num_blocks == 3 * max_blocks == cache.num_free_blocks
    assert cache.block_table.dtype == torch.int32
    assert cache.block_table.shape == (3, max_blocks)
    assert torch.all(cache.block_table == UNUSED)

    grown = [0, 0, 0]
    for new in ([5, 0, 1], [block_size, 3, 0], [1, 0, 2 * block_size + 1], [0, 40, 7]):
        rows = torch.randn(sum(new), c + r)
        cache.append(rows[:, :c], rows[:, c:], [0, 1, 2], new)
        grown = [g + n for g, n in zip(grown, new)]
        assert cache.seq_lens.tolist() == grown
        for i, t in enumerate(grown):
            pages = cache.blocks_of(i)
            assert len(pages) == math.ceil(t / block_size)  # no more than the tokens need
            assert torch.all(cache.block_table_cpu[i, len(pages):] == UNUSED)
        held = [p for i in range(3) for p in cache.blocks_of(i)]
        assert len(set(held)) == len(held)  # no page is owned twice
        assert sorted(held + cache.free_blocks) == list(range(cache.num_blocks))
        assert torch.equal(cache.block_table, cache.block_table_cpu)

    freed = cache.blocks_of(2)
    free_before = cache.num_free_blocks
    cache.free(2)
    assert cache.seq_lens[2] == 0 and torch.all(cache.block_table[2] == UNUSED)
    assert cache.num_free_blocks == free_before + len(freed)
    # the freed pages are the next to be handed out, to the next sequence of that row or another
    rows = torch.randn(len(freed) * block_size, c + r)
    cache.append(rows[:, :c], rows[:, c:], [1], [rows.shape[0]])
    assert set(freed) <= set(cache.blocks_of(1))


def test_out_of_blocks_is_all_or_nothing():
    c, r, n = 4, 2, 4
    cache = PagedLatentCache(2, 64, c, r, block_size=n, num_blocks=5, shuffle=3)
    cache.kv_cache.fill_(NAN)
    rows = torch.randn(10, c + r)
    cache.append(rows[:, :c], rows[:, c:], [0, 1], [6, 4])  # 2 + 1 pages
    before = snapshot(cache)
    # row 0 would fit (one more page), row 1 would not: neither may take a page
    more = torch.randn(13, c + r)
    with pytest.raises(OutOfBlocksError, match="out of cache blocks"):
        cache.append(more[:, :c], more[:, c:], [0, 1], [2, 11])
    assert_unchanged(cache, before)
    with pytest.raises(OutOfBlocksError):
        cache.allocate([0, 1], [2, 11])
    assert_unchanged(cache, before)
    # what does fit still works, and a freed row makes room
    cache.append(more[:2, :c], more[:2, c:], [0], [2])
    cache.free(1)
    cache.append(more[:11, :c], more[:11, c:], [1], [11])
    assert cache.seq_lens.tolist() == [8, 11] and cache.num_free_blocks == 0


def test_append_refused_by_the_kernel_gives_pages_back():
    c, r = 4, 2
    cache = PagedLatentCache(1, 32, c, r, block_size=4)
    before = snapshot(cache)
    rows = torch.randn(5, c + r, dtype=torch.float64)  # the cache is float32: concat refuses
    with pytest.raises(TypeError):
        cache.append(rows[:, :c], rows[:, c:], [0], [5])
    assert_unchanged(cache, before)


def test_shuffled_allocation_is_seeded_and_non_contiguous():
    make = lambda seed: PagedLatentCache(2, 64, 4, 2, block_size=4, shuffle=seed)  # noqa: E731
    a, b, plain = make(5), make(5), PagedLatentCache(2, 64, 4, 2, block_size=4)
    for cache in (a, b, plain):
        cache.allocate([0, 1], [30, 17])
    assert a.blocks_of(0) == b.blocks_of(0) and a.blocks_of(1) == b.blocks_of(1)
    assert plain.blocks_of(0) == list(range(8))  # in order without a seed
    assert a.blocks_of(0) != sorted(a.blocks_of(0))
    assert sorted(a.blocks_of(0) + a.blocks_of(1) + a.free_blocks) == list(range(a.num_blocks))


def test_cache_arguments_are_checked():
    for bad in (dict(batch_size=0), dict(max_seq_len=-1), dict(block_size=0),
                dict(num_blocks=0), dict(block_size=2.0)):
        args = dict(batch_size=2, max_seq_len=8, block_size=4) | bad
        with pytest.raises(ValueError):
            PagedLatentCache(args.pop("batch_size"), args.pop("max_seq_len"), 4, 2, **args)
    cache = PagedLatentCache(2, 8, 4, 2, block_size=4)
    for seq_ids, new_lens in (([0, 0], [1, 1]), ([2], [1]), ([0], [-1]), ([0], [9]), ([0], [1, 2])):
        with pytest.raises(ValueError):
            cache.allocate(seq_ids, new_lens)
    with pytest.raises(ValueError):
        cache.free(2)


# ---- slot mapping and block tables -------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_slot_mapping_against_an_independent_computation(block_size):
    c, r = 4, 2
    cache = PagedLatentCache(3, 200, c, r, block_size=block_size, shuffle=11)
    cache.kv_cache.fill_(NAN)
    written = {0: [], 1: [], 2: []}
    for new in ([3, 70, 0], [1, 1, 1], [0, 33, 129]):
        rows = torch.randn(sum(new), c + r)
        slots = cache.append(rows[:, :c], rows[:, c:], [0, 1, 2], new)
        at = 0
        for i, k in enumerate(new):
            written[i] += rows[at:at + k].tolist()
            at += k
        # the returned slots are where the rows went
        flat = cache.kv_cache.view(-1, c + r)
        assert torch.equal(flat[slots], rows)

    # slot = block_table[i][pos // n] * n + pos % n, in plain Python from the table's list
    tables = [cache.blocks_of(i) for i in range(3)]
    for i in range(3):
        t = int(cache.seq_lens[i])
        pos = torch.arange(t)
        slots = cache.slot_mapping(torch.full((t,), i), pos)
        expected = [tables[i][p // block_size] * block_size + p % block_size for p in range(t)]
        assert slots.dtype == torch.int64 and slots.tolist() == expected
        assert slots_of(cache, torch.full((t,), i), pos).tolist() == expected  # the plan's, unchecked
        kv_c, k_pe = cache.gather(i)
        assert torch.equal(torch.cat([kv_c, k_pe], -1), torch.tensor(written[i]))

    # the padded layout of the common call: -1 for padding
    lengths = torch.tensor([2, 0, 1])
    cache.allocate([0, 1, 2], lengths)
    padded = cache.slot_mapping_padded(lengths, 3)
    assert padded.shape == (3, 3) and padded.dtype == torch.int64
    for i in range(3):
        for j in range(3):
            if j < lengths[i]:
                p = int(cache.seq_lens[i]) + j
                tables = [cache.blocks_of(k) for k in range(3)]
                assert padded[i, j] == tables[i][p // block_size] * block_size + p % block_size
            else:
                assert padded[i, j] == -1
    # a token without a page is an error, not a silent write elsewhere
    with pytest.raises(ValueError, match="no page"):
        cache.slot_mapping(torch.tensor([1]), torch.tensor([199]))


def test_gather_padded_is_zero_past_each_sequence():
    c, r = 4, 2
    cache = PagedLatentCache(2, 40, c, r, block_size=8, shuffle=2)
    cache.kv_cache.fill_(NAN)
    rows = torch.randn(15, c + r)
    cache.append(rows[:, :c], rows[:, c:], [1, 0], [10, 5])
    got = cache.gather_padded([0, 1], 12)
    assert got.shape == (2, 12, c + r) and torch.isfinite(got).all()
    assert torch.equal(got[1, :10], rows[:10]) and torch.all(got[1, 10:] == 0)
    assert torch.equal(got[0, :5], rows[10:]) and torch.all(got[0, 5:] == 0)


def test_slot_mapping_and_gather_name_the_bad_argument():
    c, r = 4, 2
    cache = PagedLatentCache(2, 16, c, r, block_size=4, shuffle=1)
    rows = torch.randn(7, c + r)
    cache.append(rows[:, :c], rows[:, c:], [0, 1], [5, 2])
    before = snapshot(cache)
    one = torch.tensor([0])
    cases = [  # (call, what the error must say)
        # a negative position must not map silently to slot 0's page
        (lambda: cache.slot_mapping(one, torch.tensor([-1])),
         r"positions of real tokens must be >= 0, got \[-1\]"),
        (lambda: cache.slot_mapping(torch.tensor([2, 0]), torch.tensor([0, 1])),
         r"token_seq must lie in \[0, batch_size=2\) \(or be -1 for padding\), got \[2\]"),
        (lambda: cache.slot_mapping(torch.tensor([0, 1]), one), "of one length"),
        (lambda: cache.gather(5), r"gather\(i\) needs a row index i in \[0, batch_size=2\), got 5"),
        (lambda: cache.gather(-1), r"in \[0, batch_size=2\), got -1"),
        (lambda: cache.gather_padded([7], 4),
         r"gather_padded: seq_ids must lie in \[0, batch_size=2\), got \[7\]"),
        (lambda: cache.gather_padded([0, -1], 4), r"seq_ids must lie in .*got \[0, -1\]"),
        (lambda: cache.gather_padded([0], -1), "t must be an int >= 0, got -1"),
        (lambda: cache.gather_padded([0], 17), "longer than max_seq_len=16"),
        # kv_c and k_pe of widths 3 + 3: the page width c + r = 6 fits, the split does not
        (lambda: cache.append(rows[:, :3], rows[:, 3:], [0], [7]),
         r"append: kv_c must have shape \(T, c=4\), got \(7, 3\)"),
        (lambda: cache.append(rows[:, :c], rows[:6, c:], [0], [6]),
         r"append: k_pe must have shape \(T=7, r=2\), got \(6, 2\)"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
        assert_unchanged(cache, before)
    # padding tokens (token_seq -1) still map to -1, whatever their position
    slots = cache.slot_mapping(torch.tensor([-1, 0]), torch.tensor([-5, 1]))
    assert slots[0] == -1 and slots[1] >= 0


# ---- the layer against the absorbed tier ---------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_paged_matches_absorbed_prefill_extend_decode(block_size):
    absorbed, paged = pair(block_size)
    b, max_len = 3, 72
    a_cache, p_cache = absorbed.new_cache(b, max_len), poisoned(paged, b, max_len)
    # prefill, row 1 sits out
    check_step(absorbed, paged, a_cache, p_cache, padded_batch([13, 0, 20], 20), [13, 0, 20])
    # ragged: row 0 extends (chunked prefill), row 1 prefills, row 2 decodes
    check_step(absorbed, paged, a_cache, p_cache, padded_batch([9, 17, 1], 17), [9, 17, 1])
    # decodes, some rows sitting out now and then
    for step in range(12):
        lengths = [1, 1, 1] if step % 4 else [1, 0, 1]
        check_step(absorbed, paged, a_cache, p_cache, padded_batch(lengths, 1), lengths)
    # past the tiny preset's original YaRN context (64) and to a page boundary for some sizes
    check_step(absorbed, paged, a_cache, p_cache, padded_batch([3, 2, 0], 3), [3, 2, 0])
    check_step(absorbed, paged, a_cache, p_cache, torch.randn(b, 1, TINY.hidden_size))
    # the pages were handed out shuffled, not 0, 1, 2, ... in the order rows asked for them
    held = [p for i in range(b) for p in p_cache.blocks_of(i)]
    assert held != list(range(len(held)))


def test_paged_matches_absorbed_whole_batch_prefill_then_decode():
    absorbed, paged = pair(16)
    a_cache, p_cache = absorbed.new_cache(2, 48), poisoned(paged, 2, 48)
    check_step(absorbed, paged, a_cache, p_cache, torch.randn(2, 24, TINY.hidden_size))
    for _ in range(10):
        check_step(absorbed, paged, a_cache, p_cache, torch.randn(2, 1, TINY.hidden_size))


def test_prefill_absorbed_option_matches_absorbed_tier():
    absorbed, paged = pair(16, prefill="absorbed")
    a_cache, p_cache = absorbed.new_cache(2, 40), poisoned(paged, 2, 40)
    check_step(absorbed, paged, a_cache, p_cache, padded_batch([11, 4], 11), [11, 4])
    check_step(absorbed, paged, a_cache, p_cache, padded_batch([1, 6], 6), [1, 6])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_absorbed(dtype):
    # On the CPU bf16 decodes take the kernel's torch reference (the Triton interpreter's bf16
    # tl.dot is broken); fp16 runs the kernel in the interpreter.
    weights = mla.MLAWeights(TINY, dtype=dtype, seed=2)
    absorbed, paged = mla.build(weights, "absorbed"), mla.build(weights, "paged", block_size=8)
    a_cache, p_cache = absorbed.new_cache(2, 32), paged.new_cache(2, 32)
    p_cache.kv_cache.fill_(NAN)
    with torch.no_grad():
        for lengths, s in (([12, 5], 12), ([1, 1], 1), ([1, 4], 4), ([1, 1], 1)):
            x = padded_batch(lengths, s).to(dtype)
            ref, out = absorbed(x, a_cache, lengths), paged(x, p_cache, lengths)
            assert out.dtype == dtype and rel(out, ref) < 2e-2


def test_free_row_then_new_sequence():
    absorbed, paged = pair(4)
    p_cache = poisoned(paged, 2, 32, num_blocks=10)
    with torch.no_grad():
        paged(padded_batch([20, 12], 20), p_cache, [20, 12])  # 5 + 3 pages of 10
        p_cache.free(0)
        x = padded_batch([9, 0], 9)
        out = paged(x, p_cache, [9, 0])  # row 0 starts over on recycled (stale) pages
        a_cache = absorbed.new_cache(2, 32)
        ref = absorbed(x, a_cache, [9, 0])
    assert rel(out[0], ref[0]) < 1e-5 and torch.all(out[1] == 0)
    assert p_cache.seq_lens.tolist() == [9, 12]


# ---- the ragged entry ------------------------------------------------------------------------
def test_ragged_entry_matches_common_call():
    weights = mla.MLAWeights(TINY, dtype=torch.float32, seed=4)
    paged = mla.build(weights, "paged", block_size=8, shuffle=5)
    common, ragged = poisoned(paged, 3, 40), poisoned(paged, 3, 40)
    with torch.no_grad():
        for lengths in ([10, 3, 0], [1, 6, 2], [1, 1, 1], [0, 1, 4]):
            s = max(lengths)
            x = padded_batch(lengths, s)
            expected = paged(x, common, lengths)
            # the same tokens, rows in another order (2, 0, 1), two padding rows at the end
            order = [2, 0, 1]
            pieces = [x[i, :lengths[i]] for i in order]
            qsl = torch.tensor([0] + [sum(lengths[i] for i in order[:k + 1]) for k in range(3)],
                               dtype=torch.int32)
            flat = torch.cat(pieces + [torch.randn(2, TINY.hidden_size)])
            out = paged.forward_ragged(flat, ragged, qsl, seq_ids=torch.tensor(order))
            assert out.shape == flat.shape and torch.all(out[-2:] == 0)
            for k, i in enumerate(order):
                got = out[int(qsl[k]):int(qsl[k + 1])]
                assert torch.allclose(got, expected[i, :lengths[i]], rtol=1e-5, atol=1e-6)
            assert ragged.seq_lens.tolist() == common.seq_lens.tolist()
            # the same latents in the same places, to within the last bit: the projections ran on a
            # (T, d) batch here and a (b, s, d) one there, which the CPU's BLAS may block differently
            # (an ulp apart with torch 2.13); a wrong slot would read a NaN page or another token
            for i in range(3):
                for a, b in zip(ragged.gather(i), common.gather(i)):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ragged_entry_default_rows_and_bad_offsets():
    absorbed, paged = pair(16)
    cache = poisoned(paged, 2, 16)
    with torch.no_grad():
        out = paged.forward_ragged(torch.randn(5, TINY.hidden_size), cache, [0, 3, 5])
    assert out.shape == (5, TINY.hidden_size) and cache.seq_lens.tolist() == [3, 2]
    before = snapshot(cache)
    x = torch.randn(4, TINY.hidden_size)
    bad = [
        (dict(query_start_loc=[1, 4]), ValueError),             # does not start at 0
        (dict(query_start_loc=[0, 3, 2]), ValueError),          # decreasing
        (dict(query_start_loc=[0, 2, 5]), ValueError),          # past T
        (dict(query_start_loc=[0.0, 4.0]), TypeError),          # not integers
        (dict(query_start_loc=[0, 1, 2, 3]), ValueError),       # 3 sequences, 2 rows
        (dict(query_start_loc=[0, 2, 4], seq_ids=[1, 1]), ValueError),  # a row twice
        (dict(query_start_loc=[0, 2, 4], seq_ids=[0, 2]), ValueError),  # no such row
    ]
    for kwargs, error in bad:
        with pytest.raises(error):
            paged.forward_ragged(x, cache, **kwargs)
        assert_unchanged(cache, before)
    with torch.no_grad():
        paged.forward_ragged(torch.randn(13, TINY.hidden_size), cache, [0, 13])  # row 0 at 16
    before = snapshot(cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        paged.forward_ragged(x, cache, [0, 1])
    with pytest.raises(ValueError):
        paged.forward_ragged(x[None], cache, [0, 1])
    assert_unchanged(cache, before)


# ---- bad input leaves the cache as it was --------------------------------------------------
def test_bad_input_raises_and_leaves_cache_unchanged():
    absorbed, paged = pair(4)
    cache = poisoned(paged, 2, 24, num_blocks=9)
    with torch.no_grad():
        paged(padded_batch([10, 5], 10), cache, [10, 5])  # 3 + 2 of 9 pages
    before = snapshot(cache)
    h = TINY.hidden_size
    cases = [
        ((torch.randn(2, 3, h + 1), cache, None), ValueError),                  # hidden size
        ((torch.randn(2, 3, h, dtype=torch.float64), cache, None), TypeError),  # dtype
        ((torch.randn(2, 3, h, device="meta"), cache, None), ValueError),       # device
        ((torch.randn(3, 3, h), cache, None), ValueError),                      # batch
        ((torch.randn(2, 0, h), cache, None), ValueError),                      # no tokens
        ((torch.randn(2, 3, h), cache, [4, 1]), ValueError),                    # length > s
        ((torch.randn(2, 3, h), cache, [-1, 1]), ValueError),                   # negative
        ((torch.randn(2, 3, h), cache, [1, 1, 1]), ValueError),                 # shape
        ((torch.randn(2, 3, h), cache, [1.0, 1.0]), TypeError),                 # not ints
        ((torch.randn(2, 15, h), cache, [15, 1]), ValueError),                  # > max_seq_len
        ((torch.randn(2, 3, h), LatentCache.empty(2, 24, 32, 8, dtype=torch.float32,
                                                   device="cpu"), None), TypeError),
        ((torch.randn(2, 14, h), cache, [14, 11]), OutOfBlocksError),           # 4 + 2 > 4 free
    ]
    for (x, c, lengths), error in cases:
        with pytest.raises(error):
            with torch.no_grad():
                paged(x, c, lengths)
        assert_unchanged(cache, before)
    # a cache of another config or dtype
    other = PagedMLA(mla.MLAWeights(TINY.replace(kv_lora_rank=16)), block_size=4)
    with pytest.raises(ValueError, match="c \\+ r"):
        paged(torch.randn(2, 1, h), other.new_cache(2, 24))
    half = PagedMLA(mla.MLAWeights(TINY, dtype=torch.float16), block_size=4)
    with pytest.raises(ValueError, match="new_cache"):
        paged(torch.randn(2, 1, h), half.new_cache(2, 24))
    # the failed calls left a usable cache: the same call that ran out of blocks fits after free
    cache.free(1)
    with torch.no_grad():
        paged(padded_batch([14, 11], 14), cache, [14, 11])
    assert cache.seq_lens.tolist() == [24, 11]


def test_layer_options_are_checked():
    weights = mla.MLAWeights(TINY)
    for bad in (dict(block_size=0), dict(num_blocks=0), dict(prefill="bogus"),
                dict(num_kv_splits=0)):
        with pytest.raises(ValueError):
            mla.build(weights, "paged", **bad)
    attn = mla.build(weights, "paged", block_size=16, num_blocks=5)
    assert isinstance(attn, PagedMLA) and attn.tier == "paged"
    assert attn.new_cache(2, 100).num_blocks == 5
    assert attn.new_cache(2, 100, num_blocks=9).num_blocks == 9
    assert mla.build(weights, "paged", block_size=16).new_cache(2, 100).num_blocks == 2 * 7


# ---- the CUDA-graph decode entry and the prefill crossover -----------------------------------
def _twin_caches(paged, b, max_len, lengths):
    """Two identical poisoned caches holding the same prefill (same shuffle: same pages)."""
    caches = [poisoned(paged, b, max_len), poisoned(paged, b, max_len)]
    x = padded_batch(lengths, max(lengths))
    with torch.no_grad():
        for cache in caches:
            paged(x, cache, lengths)
    return caches


@pytest.mark.parametrize("block_size,num_kv_splits", [(16, 1), (16, 3), (5, 2)])
def test_decode_step_matches_common_call(block_size, num_kv_splits):
    _, paged = pair(block_size)
    b = 3
    common, stepped = _twin_caches(paged, b, 64, [13, 16, 1])
    for _ in range(5):                                 # crosses page boundaries for some rows
        x = torch.randn(b, 1, TINY.hidden_size)
        with torch.no_grad():
            ref = paged(x, common)
            inputs = paged.decode_inputs(stepped)
            assert inputs["slot_mapping"].dtype == torch.int64
            assert inputs["seq_lens_after"].dtype == torch.int32
            out = paged.decode_step(x, stepped, num_kv_splits=num_kv_splits, **inputs)
        assert out.shape == (b, 1, TINY.hidden_size) and torch.isfinite(out).all()
        assert rel(out, ref) < 1e-5
        assert stepped.seq_lens.tolist() == common.seq_lens.tolist()
        assert torch.equal(stepped.block_table_cpu, common.block_table_cpu)
        assert equal_with_nan(stepped.kv_cache, common.kv_cache)
    # (b, hidden) in, (b, hidden) out; reused buffers are filled in place
    x = torch.randn(b, TINY.hidden_size)
    with torch.no_grad():
        ref = paged(x[:, None], common)[:, 0]
        buffers = {k: torch.empty_like(v) for k, v in inputs.items()}
        assert paged.decode_inputs(stepped, out=buffers) is buffers
        out = paged.decode_step(x, stepped, num_kv_splits=num_kv_splits, **buffers)
    assert rel(out, ref) < 1e-5


def test_the_package_exports_the_prefill_options_the_layer_takes():
    """mla.paged.PREFILL_MODES are PagedMLA(prefill=...)'s options: each builds, the absorbed
    tier's two are among them, and another value raises naming them."""
    from mla.absorbed import PREFILL_MODES as ABSORBED_MODES
    from mla.paged import PREFILL_MODES
    weights = mla.MLAWeights(TINY, dtype=torch.float32, seed=1)
    assert "auto" in PREFILL_MODES and set(ABSORBED_MODES) < set(PREFILL_MODES)
    for mode in PREFILL_MODES:
        assert mla.build(weights, "paged", prefill=mode).prefill == mode
    with pytest.raises(ValueError, match=r"prefill must be one of \('auto', "):
        mla.build(weights, "paged", prefill="sometimes")


def test_auto_prefill_picks_by_the_crossover_and_matches_absorbed():
    from mla.paged.layer import PREFILL_CROSSOVER
    weights = mla.MLAWeights(TINY, dtype=torch.float32, seed=1)
    default = mla.build(weights, "paged")
    assert default.prefill == "auto" and default.prefill_crossover == PREFILL_CROSSOVER
    auto = mla.build(weights, "paged", block_size=16, shuffle=7, prefill_crossover=8)
    assert [auto.prefill_path(s, 100) for s in (2, 7, 8, 9, 500)] == \
        ["absorbed", "absorbed", "up-project", "up-project", "up-project"]
    assert auto.prefill_path(7, 0) == "absorbed" and auto.prefill_path(8, 0) == "up-project"
    for forced in ("up-project", "absorbed"):
        layer = mla.build(weights, "paged", prefill=forced, prefill_crossover=8)
        assert {layer.prefill_path(s, 100) for s in (2, 7, 8, 500)} == {forced}
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError):
            mla.build(weights, "paged", prefill_crossover=bad)

    # which path each row took, and the numbers against the absorbed tier
    taken = []
    original = auto.attend_prefill

    def spy(path, *args):
        taken.append(path)
        return original(path, *args)

    auto.attend_prefill = spy
    absorbed = mla.build(weights, "absorbed", prefill="absorbed")
    a_cache, p_cache = absorbed.new_cache(2, 48), poisoned(auto, 2, 48)
    check_step(absorbed, auto, a_cache, p_cache, padded_batch([20, 5], 20), [20, 5])
    assert sorted(taken) == ["absorbed", "up-project"]
    taken.clear()
    check_step(absorbed, auto, a_cache, p_cache, padded_batch([3, 7], 7), [3, 7])
    assert taken == ["absorbed"]


@pytest.mark.gpu
def test_gpu_decode_step_in_a_cuda_graph():
    weights = mla.MLAWeights(TINY, dtype=torch.float32, device="cuda", seed=2)
    paged = mla.build(weights, "paged", block_size=16, shuffle=5)
    b = 4
    common, graphed = _twin_caches_gpu(paged, b, 96, [30, 1, 17, 16])
    check_graphed_decode_steps(paged, common, graphed, TINY.hidden_size, 1e-4)


def _twin_caches_gpu(paged, b, max_len, lengths):
    caches = [paged.new_cache(b, max_len), paged.new_cache(b, max_len)]
    x = torch.randn(b, max(lengths), TINY.hidden_size, device="cuda")
    with torch.no_grad():
        for cache in caches:
            paged(x, cache, lengths)
    return caches


# ---- on the GPU: bf16 at V2-Lite's size ---------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_bf16_v2_lite_matches_absorbed(block_size):
    cfg = mla.MLAConfig.from_preset("deepseek-v2-lite")
    weights = mla.MLAWeights(cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    absorbed = mla.build(weights, "absorbed")
    paged = mla.build(weights, "paged", block_size=block_size, shuffle=3)
    b, max_len = 4, 512
    a_cache, p_cache = absorbed.new_cache(b, max_len), paged.new_cache(b, max_len)
    p_cache.kv_cache.fill_(NAN)

    def step(lengths, s):
        x = torch.randn(b, s, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            ref, out = absorbed(x, a_cache, lengths), paged(x, p_cache, lengths)
        assert torch.isfinite(out).all()
        assert rel(out, ref) < 2e-2
        for i, n in enumerate(lengths):
            assert torch.all(out[i, n:] == 0)

    step([300, 37, 0, 129], 300)        # prefill, a row sitting out
    step([1, 64, 1, 20], 64)            # mixed decode and extend
    for _ in range(10):
        step([1, 1, 1, 1], 1)           # decode through the Triton kernel
    assert p_cache.seq_lens.tolist() == a_cache.seq_lens.tolist()


# ---- what the tier accepts: dtypes, integers, options; inference only ---------------------
def test_float64_weights_are_refused_at_construction():
    weights = mla.MLAWeights(TINY, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"float32, float16 or bfloat16 .*got weights of dtype "
                                        r"torch.float64"):
        mla.build(weights, "paged")


def test_the_tier_is_inference_only_and_the_docs_say_so():
    from pathlib import Path
    weights = mla.MLAWeights(TINY, seed=3)
    assert all(p.requires_grad for p in weights.parameters())
    paged = mla.build(weights, "paged", block_size=4)
    cache = paged.new_cache(2, 24)
    h = TINY.hidden_size
    outputs = [paged(torch.randn(2, 5, h, requires_grad=True), cache, [5, 3]),      # prefill
               paged(torch.randn(2, 1, h, requires_grad=True), cache),              # decode
               paged.forward_ragged(torch.randn(3, h, requires_grad=True), cache, [0, 2, 3])]
    outputs.append(paged.decode_step(torch.randn(2, 1, h, requires_grad=True), cache,
                                     num_kv_splits=1, **paged.decode_inputs(cache)))
    assert not any(y.requires_grad for y in outputs)
    assert all(torch.isfinite(y).all() for y in outputs)
    # the naive and absorbed tiers stay differentiable
    for tier in ("naive", "absorbed"):
        layer = mla.build(weights, tier)
        y = layer(torch.randn(2, 5, h), layer.new_cache(2, 8))
        assert y.requires_grad
    page = " ".join((Path(__file__).parent.parent / "docs" / "tiers" / "paged.md").read_text()
                    .split())
    assert "inference-only" in page and "naive and absorbed tiers are differentiable" in page
    assert "Inference only" in PagedMLA.__doc__


def test_row_ids_and_counts_must_be_integers():
    _, paged = pair(4)
    cache = poisoned(paged, 2, 16)
    before = snapshot(cache)
    x = torch.randn(4, TINY.hidden_size)
    for seq_ids, match in (([True, False], "seq_ids must hold integers, got dtype torch.bool"),
                           ([0.9, 1.9], "seq_ids must hold integers, got dtype torch.float"),
                           (torch.tensor([1.0, 0.0]), "seq_ids must hold integers")):
        with pytest.raises(TypeError, match=match):
            paged.forward_ragged(x, cache, [0, 2, 4], seq_ids=seq_ids)
        assert_unchanged(cache, before)
    for call, match in ((lambda: cache.allocate([0], [1.9]), "new_lens must hold integers"),
                        (lambda: cache.allocate([True], [1]), "seq_ids must hold integers"),
                        (lambda: cache.allocate([0], [True]), "new_lens must hold integers"),
                        (lambda: cache.free(True), r"free\(i\) needs an integer row index"),
                        (lambda: cache.gather(0.0), r"gather\(i\) needs an integer row index"),
                        (lambda: cache.free(torch.tensor(1.0)), "integer row index"),
                        (lambda: cache.gather_padded([True], 4), "seq_ids must hold integers")):
        with pytest.raises(TypeError, match=match):
            call()
        assert_unchanged(cache, before)
    # numpy integers and 0-d integer tensors are integers
    np = pytest.importorskip("numpy")
    for batch, length in ((np.int64(2), np.int32(16)), (torch.tensor(2), torch.tensor(16))):
        other = paged.new_cache(batch, length, num_blocks=np.int64(9), shuffle=np.int64(3))
        assert (other.batch_size, other.max_seq_len, other.num_blocks) == (2, 16, 9)
    with torch.no_grad():
        paged.forward_ragged(x, cache, np.array([0, 3, 4]), seq_ids=np.array([1, 0]))
    assert cache.seq_lens.tolist() == [1, 3]
    cache.allocate(np.array([0]), np.array([2]))
    kv_c, _ = cache.gather(np.int64(1))
    assert torch.equal(kv_c, cache.gather(torch.tensor(1))[0]) and kv_c.shape[0] == 3
    cache.free(np.int64(1))
    cache.free(torch.tensor(0))
    assert cache.seq_lens.tolist() == [0, 0] and cache.num_free_blocks == cache.num_blocks


def test_options_of_the_wrong_type_are_refused():
    weights = mla.MLAWeights(TINY)
    for bad in (dict(num_blocks=True), dict(num_kv_splits=True), dict(num_kv_splits=2.0),
                dict(block_size=True), dict(num_kv_splits=65536)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            mla.build(weights, "paged", **bad)
    with pytest.raises(TypeError, match="shuffle must be an int"):
        mla.build(weights, "paged", shuffle=1.7)
    with pytest.raises(TypeError, match="shuffle must be an int"):
        PagedLatentCache(2, 8, 4, 2, shuffle=True)
    for bad, error, match in ((dict(kv_lora_rank=0), ValueError, "kv_lora_rank must be a positive"),
                              (dict(rope_dim=-2), ValueError, "rope_dim must be a positive"),
                              (dict(kv_lora_rank=True), ValueError, "kv_lora_rank"),
                              (dict(dtype=torch.int32), TypeError,
                               r"dtype must be one of torch.float32, torch.float16, "
                               r"torch.bfloat16.*got torch.int32"),
                              (dict(dtype=torch.float64), TypeError, "got torch.float64")):
        args = dict(kv_lora_rank=4, rope_dim=2) | bad
        with pytest.raises(error, match=match):
            PagedLatentCache(2, 8, args.pop("kv_lora_rank"), args.pop("rope_dim"), **args)


# ---- every check runs before the first write --------------------------------------------
def test_a_bad_prefill_path_raises_before_anything_is_written():
    _, paged = pair(4)
    cache = poisoned(paged, 2, 16)
    with torch.no_grad():
        paged(padded_batch([3, 1], 3), cache, [3, 1])
    before = snapshot(cache)
    paged.prefill_path = lambda new_len, context_len: "flash"
    with pytest.raises(ValueError, match="prefill_path returned 'flash'"):
        paged(padded_batch([4, 4], 4), cache, [4, 4])
    assert_unchanged(cache, before)
    with pytest.raises(ValueError, match="prefill_path returned 'flash'"):
        paged.forward_ragged(torch.randn(6, TINY.hidden_size), cache, [0, 1, 6])
    assert_unchanged(cache, before)


def test_decode_step_checks_its_arguments_before_the_write():
    _, paged = pair(4)
    common, stepped = _twin_caches(paged, 2, 32, [5, 2])
    inputs = paged.decode_inputs(stepped)
    before = snapshot(stepped)
    x = torch.randn(2, 1, TINY.hidden_size)
    bad = [dict(num_kv_splits=0), dict(num_kv_splits=True), dict(num_kv_splits=None),
           dict(num_kv_splits=1.0),
           dict(seq_lens_after=inputs["seq_lens_after"].long()),
           dict(positions=inputs["positions"][:1]),
           dict(slot_mapping=inputs["slot_mapping"].int()),
           dict(block_table=stepped.block_table.long())]
    for override in bad:
        with pytest.raises(ValueError, match=next(iter(override))):
            paged.decode_step(x, stepped, **(dict(inputs, num_kv_splits=1) | override))
        assert_unchanged(stepped, before)
    for wrong_x in (torch.randn(2, 2, TINY.hidden_size), torch.randn(3, 1, TINY.hidden_size)):
        with pytest.raises(ValueError):
            paged.decode_step(wrong_x, stepped, num_kv_splits=1, **inputs)
        assert_unchanged(stepped, before)
    # the same arguments, well formed, give the common call's step
    with torch.no_grad():
        out = paged.decode_step(x, stepped, num_kv_splits=1, **inputs)
        assert rel(out, paged(x, common)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("prefill", ["auto", "up-project"])
def test_gpu_eager_call_moves_its_metadata_in_one_copy(prefill):
    """Decode rows, short rows (the decode kernel) and, with "up-project", the flash kernels
    over contexts of several 8-token workspace chunks: one copy in, none out."""
    from torch.profiler import ProfilerActivity, profile
    weights = mla.MLAWeights(TINY, dtype=torch.float16, device="cuda", seed=2)
    paged = mla.build(weights, "paged", block_size=16, shuffle=5, num_kv_splits=2,
                      prefill=prefill, workspace_tokens=8)
    cache = paged.new_cache(4, 96)
    h = TINY.hidden_size
    with torch.no_grad():   # warm up: Triton compiles, the extension loads
        paged(torch.randn(4, 20, h, dtype=torch.float16, device="cuda"), cache, [20, 3, 1, 0])
    for lengths, s in (([1, 1, 1, 1], 1), ([5, 1, 0, 17], 17), ([1, 0, 1, 1], 1)):
        x = torch.randn(4, s, h, dtype=torch.float16, device="cuda")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            y = paged(x, cache, lengths)
            torch.cuda.synchronize()
        names = [event.name for event in prof.events()]
        assert sum("HtoD" in n for n in names) == 1, (lengths, names)
        assert sum("DtoH" in n for n in names) == 0, (lengths, names)
        assert torch.isfinite(y).all()


# ---- a property: the paged tier is the naive tier, whatever the batch, pages and paths -------
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 3), block_size=st.sampled_from([1, 3, 16]),
       prefill=st.sampled_from(["auto", "up-project", "absorbed"]),
       crossover=st.integers(2, 6), ragged=st.booleans(), seed=st.integers(0, 2**16),
       calls=st.lists(st.lists(st.integers(0, 6), min_size=3, max_size=3), min_size=1,
                      max_size=3))
def test_property_paged_equals_naive(batch, block_size, prefill, crossover, ragged, seed, calls):
    weights = mla.MLAWeights(TINY, dtype=torch.float32, seed=seed % 7)
    naive = mla.build(weights, "naive")
    paged = mla.build(weights, "paged", block_size=block_size, prefill=prefill,
                      prefill_crossover=crossover, shuffle=seed)
    n_cache, p_cache = naive.new_cache(batch, 24), poisoned(paged, batch, 24)
    gen = torch.Generator().manual_seed(seed)
    for call in calls:
        lengths = call[:batch]
        s = max(max(lengths), 1)
        x = torch.randn(batch, s, TINY.hidden_size, generator=gen)
        with torch.no_grad():
            ref = naive(x, n_cache, lengths)
            if ragged:          # the same tokens through the engines' entry, rows reversed
                order = list(range(batch))[::-1]
                flat = torch.cat([x[i, :lengths[i]] for i in order])
                qsl = [0]
                for i in order:
                    qsl.append(qsl[-1] + lengths[i])
                got = paged.forward_ragged(flat, p_cache, qsl, seq_ids=order)
                out = torch.zeros_like(x)
                for k, i in enumerate(order):
                    out[i, :lengths[i]] = got[qsl[k]:qsl[k + 1]]
            else:
                out = paged(x, p_cache, lengths)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        assert p_cache.seq_lens.tolist() == n_cache.seq_lens.tolist()


# ---- rows of several new tokens: the flash kernels (MHA mode) and the decode kernel (MQA) ----
def spy_on_prefill(paged, taken, in_reference=None):
    """Wrap paged.attend_prefill: each call's output is compared with attend_prefill_reference
    on the same arguments (the cache as the kernels see it) and its path recorded in `taken`;
    `in_reference` (a one-item list) is True while the reference runs."""
    from mla.paged.layer import attend_prefill_reference
    original = paged.attend_prefill
    in_reference = [False] if in_reference is None else in_reference

    def spy(path, q_nope, q_pe, cache, rows):
        out = original(path, q_nope, q_pe, cache, rows)
        in_reference[0] = True
        ref = attend_prefill_reference(paged, path, q_nope, q_pe, cache, rows)
        in_reference[0] = False
        assert torch.isfinite(out).all() and rel(out, ref) < 1e-5, path
        taken.append((path, rows.max_new_len, max(rows.context_lens_host)))
        return out

    paged.attend_prefill = spy


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_flash_prefill_in_a_small_workspace_matches_the_reference(block_size, monkeypatch):
    """Ragged prefill, extends over contexts of several 7-token workspace chunks, short rows of
    2..8 tokens through the decode kernel; every unused page NaN. The score-materialising
    functions are not called outside the reference."""
    import mla.paged.layer as layer
    absorbed, paged = pair(block_size, prefill="auto", prefill_crossover=9, workspace_tokens=7)
    taken, in_reference = [], [False]
    spy_on_prefill(paged, taken, in_reference)

    def only_in_the_reference(real):
        def guarded(*args, **kwargs):
            assert in_reference[0], f"{real.__name__} called outside the reference"
            return real(*args, **kwargs)
        return guarded

    for name in ("attend_up_projected", "attend_absorbed", "gather_pages"):
        monkeypatch.setattr(layer, name, only_in_the_reference(getattr(layer, name)))
    b, max_len = 3, 80
    a_cache, p_cache = absorbed.new_cache(b, max_len), poisoned(paged, b, max_len)
    for lengths in ([20, 0, 13], [12, 30, 1], [3, 8, 2], [9, 1, 0], [1, 4, 7]):
        check_step(absorbed, paged, a_cache, p_cache, padded_batch(lengths, max(lengths)),
                   lengths)
    # prefill, extends over 13..20 cached tokens (2..3 chunks of 7), short rows, a 9-token row
    assert taken == [("up-project", 20, 0), ("up-project", 30, 20), ("absorbed", 8, 32),
                     ("up-project", 9, 35), ("absorbed", 7, 39)]


def test_absorbed_rows_go_through_the_decode_kernel_in_queries_of_up_to_8(monkeypatch):
    """prefill="absorbed": rows of 2..8 new tokens are one query each, (b, s_q, h, c + r) with
    s_q their longest; longer rows are cut into pieces of 8; decode rows stay (b, h, c + r)."""
    import mla.paged.layer as layer
    absorbed, paged = pair(16, prefill="absorbed")
    taken, shapes = [], []
    spy_on_prefill(paged, taken)
    original = layer.mla_decode

    def decode_spy(q, *args, **kwargs):
        shapes.append(tuple(q.shape[:-1]))
        return original(q, *args, **kwargs)

    monkeypatch.setattr(layer, "mla_decode", decode_spy)
    a_cache, p_cache = absorbed.new_cache(3, 64), poisoned(paged, 3, 64)
    h = TINY.num_heads
    for lengths, expected in (([5, 2, 3], [(3, 5, h)]),
                              ([1, 17, 9], [(1, h), (5, 8, h)]),         # 17 = 8 + 8 + 1, 9 = 8 + 1
                              ([8, 0, 1], [(1, h), (1, 8, h)])):
        shapes.clear()
        check_step(absorbed, paged, a_cache, p_cache, padded_batch(lengths, max(lengths)), lengths)
        assert shapes == expected, lengths


def test_a_call_of_one_prefill_batch_passes_its_queries_whole():
    """Where one prefill batch holds every token of the call, in order (a prompt, padded rows
    included), the layer hands it q as it is (views of its one query buffer) and takes its
    output as o; any decode row or a second path means gathering the batch's tokens (a copy). Outputs match the absorbed tier either way."""
    absorbed, paged = pair(16, prefill="auto", prefill_crossover=6)
    seen, original = [], paged.attend_prefill

    def spy(path, q_nope, q_pe, cache, rows):
        whole = q_nope.stride(1) == q_nope.shape[-1] + q_pe.shape[-1]   # views of the layer's q
        seen.append((path, rows.every_token, whole))
        return original(path, q_nope, q_pe, cache, rows)

    paged.attend_prefill = spy
    a_cache, p_cache = absorbed.new_cache(3, 64), poisoned(paged, 3, 64)
    for lengths, expected in (([9, 7, 12], [("up-project", True, True)]),     # prompts
                              ([1, 1, 1], []),                                  # decode only
                              ([3, 0, 10], [("absorbed", False, False),         # two paths
                                            ("up-project", False, False)]),
                              ([1, 3, 2], [("absorbed", False, False)])):       # and a decode row
        seen.clear()
        check_step(absorbed, paged, a_cache, p_cache, padded_batch(lengths, max(lengths)), lengths)
        assert sorted(seen) == expected, lengths


def test_query_pieces_see_exactly_their_causal_prefix():
    """Under FlashMLA's convention (query j of s_q sees seq_len - (s_q - 1 - j) rows), token j of
    a row with t cached tokens sees t + j + 1 rows, in the row's own pieces."""
    from mla.paged.plan import query_pieces
    new_lens, context_lens = torch.tensor([2, 8, 9, 17, 3, 1]), torch.tensor([0, 5, 40, 1, 0, 7])
    s_q, piece_row, seq_lens, slots = query_pieces(new_lens, context_lens)
    assert s_q == 8 and piece_row.tolist() == [0, 1, 2, 2, 3, 3, 3, 4, 5]
    assert len(set(slots.tolist())) == int(new_lens.sum())
    token = 0
    for k, (s, t) in enumerate(zip(new_lens.tolist(), context_lens.tolist())):
        for j in range(s):
            piece, place = divmod(int(slots[token]), s_q)
            assert piece_row[piece] == k
            assert int(seq_lens[piece]) - (s_q - 1 - place) == t + j + 1, (k, j)
            token += 1
    assert query_pieces(torch.tensor([3, 2]), torch.tensor([0, 0]))[0] == 3


def test_workspace_tokens_is_checked_at_construction():
    from mla.kernels.chunked_context import DEFAULT_WORKSPACE_TOKENS
    weights = mla.MLAWeights(TINY)
    assert mla.build(weights, "paged").workspace_tokens == DEFAULT_WORKSPACE_TOKENS
    assert "workspace_tokens=5" in repr(mla.build(weights, "paged", workspace_tokens=5))
    for bad in (0, -4, 2.5, True, "16", None.__class__):
        with pytest.raises(ValueError, match="workspace_tokens must be a positive int"):
            mla.build(weights, "paged", workspace_tokens=bad)


_LONG_CONTEXT_SCRIPT = """
import resource, sys, torch
sys.path.insert(0, {root!r})
import mla
torch.manual_seed(0)
cfg = mla.MLAConfig.from_preset("tiny")
paged = mla.build(mla.MLAWeights(cfg, seed=0), "paged", prefill="up-project", block_size=64)
context, prompt = {context}, {prompt}
cache = paged.new_cache(3, context + 8)
c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
cache.append(torch.randn(context, c), torch.randn(context, r), [0], [context])
cache.append(torch.randn(40, c), torch.randn(40, r), [2], [40])
with torch.no_grad():   # a small call first: the interpreter's imports and caches
    paged(torch.randn(3, 2, cfg.hidden_size), cache, [0, 0, 2])
    x = torch.randn(3, prompt, cfg.hidden_size)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    y = paged(x, cache, [2, prompt, 0])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert torch.isfinite(y).all()
print((peak - base) * 1024)  # ru_maxrss is in KiB on Linux
"""


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"),
                    reason="ru_maxrss is in KiB on Linux only")
def test_prefill_over_a_long_context_runs_in_megabytes():
    """Row 0 adds 2 tokens to 2^17 cached ones, row 1 is a 512-token prompt: padded to the
    batch, the materialised scores are (2, 512, h, 2^17 + 2) float32 = 2 GiB (and the softmax
    as much again); the kernels hold the outputs and one 16384-token workspace (a few MiB)."""
    import subprocess
    import sys
    from pathlib import Path
    context, prompt = 2**17, 512
    assert 2 * prompt * TINY.num_heads * (context + 2) * 4 >= 2 * 2**30
    script = _LONG_CONTEXT_SCRIPT.format(root=str(Path(__file__).resolve().parents[1]),
                                         context=context, prompt=prompt)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env={"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin",
                                            "CUDA_VISIBLE_DEVICES": "",
                                            "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    grown = int(proc.stdout.strip().splitlines()[-1])
    assert grown < 64 * 2**20, f"peak RSS grew by {grown / 2**20:.1f} MiB"


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 64])
def test_gpu_bf16_v2_lite_flash_prefill_matches_the_reference(block_size):
    """bf16 at V2-Lite's size (16 heads, c = 512): ragged prefill, extends over contexts of
    several 700-token workspace chunks, short rows through the decode kernel, NaN pages."""
    cfg = mla.MLAConfig.from_preset("deepseek-v2-lite")
    weights = mla.MLAWeights(cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    absorbed = mla.build(weights, "absorbed")
    paged = mla.build(weights, "paged", block_size=block_size, shuffle=3, workspace_tokens=700,
                      prefill_crossover=9)
    taken = []
    original = paged.attend_prefill

    def spy(path, q_nope, q_pe, cache, rows):
        from mla.paged.layer import attend_prefill_reference
        out = original(path, q_nope, q_pe, cache, rows)
        ref = attend_prefill_reference(paged, path, q_nope, q_pe, cache, rows)
        assert torch.isfinite(out).all() and rel(out, ref) < 2e-2, path
        taken.append(path)
        return out

    paged.attend_prefill = spy
    b, max_len = 3, 2048
    a_cache, p_cache = absorbed.new_cache(b, max_len), paged.new_cache(b, max_len)
    p_cache.kv_cache.fill_(NAN)
    for lengths in ([1000, 0, 300], [5, 1500, 8], [300, 2, 1]):
        x = torch.randn(b, max(lengths), cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            ref, out = absorbed(x, a_cache, lengths), paged(x, p_cache, lengths)
        assert torch.isfinite(out).all() and rel(out, ref) < 2e-2, lengths
    assert taken == ["up-project", "absorbed", "up-project", "up-project", "absorbed"]


@pytest.mark.gpu
def test_gpu_long_prompt_and_extend_memory():
    """V2-Lite, bf16: a 16k-token prompt, then 4k new tokens over it. Materialised, the scores
    alone are 16 GiB (16384^2 x 16 heads x 4 bytes); the kernels' peak is the call's
    activations and one workspace, under 2 GiB."""
    cfg = mla.MLAConfig.from_preset("deepseek-v2-lite")
    weights = mla.MLAWeights(cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    paged = mla.build(weights, "paged", prefill="up-project")
    cache = paged.new_cache(1, 16384 + 4096)
    for s in (16384, 4096):
        x = torch.randn(1, s, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.no_grad():
            y = paged(x, cache)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before < 2 * 2**30, s
        assert torch.isfinite(y).all()


@pytest.mark.gpu
@pytest.mark.parametrize("prefill_backend", ["sdpa", "triton"])
def test_gpu_v3_prompt_peak_within_1_5x_of_sdpa_alone(prefill_backend):
    """DeepSeek-V3 sizes, bf16, a 32k-token prompt: the layer's whole call (projections, cache
    write and attention, its new tokens' keys and values up-projected in head groups) peaks at
    most 1.5x what cuDNN / memory-efficient SDPA alone takes on ready-made up-projected q, k and
    v of the same prompt (inputs counted)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    cfg = mla.MLAConfig.from_preset("deepseek-v3")
    s, h, dk, dv = 32768, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    q, k = (torch.randn(1, h, s, dk, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    v = torch.randn(1, h, s, dv, dtype=torch.bfloat16, device="cuda")
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.cuda.synchronize()
    sdpa_peak = torch.cuda.max_memory_allocated() - base
    del q, k, v
    weights = mla.MLAWeights(cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    paged = mla.build(weights, "paged", prefill="up-project", prefill_backend=prefill_backend)
    cache = paged.new_cache(1, s)
    x = torch.randn(1, s, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        y = paged(x, cache)
    torch.cuda.synchronize()
    layer_peak = torch.cuda.max_memory_allocated() - base
    assert torch.isfinite(y).all()
    assert layer_peak <= 1.5 * sdpa_peak, (layer_peak / 2**20, sdpa_peak / 2**20)
