"""The paged tier on fp8 latent caches: `PagedMLA(kv_cache_dtype="fp8_e4m3" | "fp8_ds_mla")`.

Two claims, tested apart:

- exact: the tier on an fp8 cache computes the attention over the dequantised cache. The
  reference is the same tier on a float32 cache whose writes are rounded through the layout
  (quantised, then dequantised) first: both then attend over the same float32 values, so they
  agree to float32 rounding, on every path (flash prefill over a chunked context, the decode
  kernel in pieces, one-token decode), with every unwritten byte of the fp8 cache NaN;
- accurate: against the naive tier on a float32 cache, the output's relative error stays below
  FP8_BOUND, the largest relative error of one value rounded to e4m3 (docs/derivations/fp8-cache.md
  says why that bounds an output that averages many independently rounded values).

The "tiny" preset with a latent of 128, the smallest fp8_ds_mla groups.
"""

import math

import pytest
import torch

import mla
from assertions import check_graphed_decode_steps, rel
from mla import memory
from mla.kernels import fp8
from mla.paged import PagedLatentCache, PagedMLA
from mla.paged import layer as layer_module
from mla.tiers import tier_options

CFG = mla.MLAConfig.from_preset("tiny").replace(kv_lora_rank=128)
C, R = CFG.kv_lora_rank, CFG.qk_rope_head_dim
KINDS = ("fp8_e4m3", "fp8_ds_mla")
FP8_BOUND = 2.0**-4   # half an e4m3 step, relative: the most one stored value moves
SCENARIO = ([20, 0, 13], [12, 30, 1], [1, 1, 1], [1, 0, 1], [3, 8, 2], [1, 1, 1])


def weights(dtype=torch.float32, device="cpu"):
    return mla.MLAWeights(CFG, dtype=dtype, device=device, seed=1)


def poison(cache):
    """Every byte 0xFF: e4m3 NaN, float32 and bf16 NaN for fp8_ds_mla's scales and rope."""
    cache.kv_cache.view(torch.uint8).fill_(0xFF)
    return cache


def padded(lengths, hidden=CFG.hidden_size, dtype=torch.float32, device="cpu"):
    x = torch.randn(len(lengths), max(lengths), hidden)
    for i, n in enumerate(lengths):
        x[i, n:] = 0.0
    return x.to(device, dtype)


def round_trip(kind, kv_c, k_pe, scale, dtype=torch.float32):
    """[kv_c | k_pe] (T, c + r) as a cache of `kind` stores and reads it back, in `dtype`."""
    rows = (fp8.quantize_e4m3(kv_c, k_pe, scale) if kind == "fp8_e4m3"
            else fp8.quantize_ds_mla(kv_c, k_pe))
    return fp8.dequantize_rows(rows, kind, kv_c.shape[1], k_pe.shape[1], scale, dtype)


def rounded_writes(monkeypatch, rounded_cache, kind, scale_of):
    """Make every write into `rounded_cache` (an "auto" cache) store the values rounded through
    `kind`'s layout, with the scale `scale_of()` (fp8_e4m3) at the time of the write. The rows
    are rounded in place: where an "auto" cache holds the very values the layer wrote, the
    layer attends with its own copy of them (`PrefillRows.new_latent`), and that is rounded
    too."""
    real = layer_module.write_slots

    def write(kv_c, k_pe, cache, slots):
        if cache is rounded_cache:
            c = kv_c.shape[1]
            rows = round_trip(kind, kv_c, k_pe, scale_of(), kv_c.dtype)
            kv_c.copy_(rows[:, :c])
            k_pe.copy_(rows[:, c:])
        real(kv_c, k_pe, cache, slots)

    monkeypatch.setattr(layer_module, "write_slots", write)


# ---- the tier computes the attention over the dequantised cache ------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prefill,block_size", [("up-project", 16), ("absorbed", 5),
                                                ("auto", 1)])
def test_fp8_tier_attends_over_the_dequantised_cache(kind, prefill, block_size, monkeypatch):
    w = weights()
    options = dict(block_size=block_size, shuffle=3, prefill=prefill, prefill_crossover=9,
                   workspace_tokens=7)
    fp8_layer = PagedMLA(w, kv_cache_dtype=kind, **options)
    exact_layer = PagedMLA(w, **options)
    b, max_len = 3, 80
    fp8_cache = poison(fp8_layer.new_cache(b, max_len))
    exact_cache = exact_layer.new_cache(b, max_len)
    exact_cache.kv_cache.fill_(float("nan"))
    rounded_writes(monkeypatch, exact_cache, kind, lambda: fp8_cache.kv_scale)
    torch.manual_seed(0)
    for lengths in SCENARIO:
        x = padded(lengths)
        with torch.no_grad():
            out = fp8_layer(x, fp8_cache, lengths)       # calibrates fp8_e4m3 on the first call
            ref = exact_layer(x, exact_cache, lengths)
        assert torch.isfinite(out).all()
        assert rel(out, ref) < 1e-5, lengths
        for i, n in enumerate(lengths):
            assert torch.all(out[i, n:] == 0)
    # both caches hold the same values, and reading them back needs the pages only
    for i in range(b):
        for got, want in zip(fp8_cache.gather(i), exact_cache.gather(i)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_decode_step_matches_the_common_call(kind):
    w = weights()
    paged = PagedMLA(w, kv_cache_dtype=kind, block_size=4, shuffle=2, kv_scale=(
        0.02 if kind == "fp8_e4m3" else None))
    common, stepped = (poison(paged.new_cache(3, 40)) for _ in range(2))
    x = padded([13, 7, 1])
    with torch.no_grad():
        for cache in (common, stepped):
            paged(x, cache, [13, 7, 1])
        for _ in range(5):
            x = torch.randn(3, 1, CFG.hidden_size)
            ref = paged(x, common)
            out = paged.decode_step(x, stepped, num_kv_splits=2, **paged.decode_inputs(stepped))
            assert torch.isfinite(out).all() and rel(out, ref) < 1e-5
    assert torch.equal(common.kv_cache.view(torch.uint8), stepped.kv_cache.view(torch.uint8))


# ---- and is accurate to the documented bound ------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prefill", ["up-project", "absorbed"])
def test_fp8_tier_against_float32_naive_within_the_bound(kind, prefill):
    w = weights()
    naive = mla.build(w, "naive")
    paged = PagedMLA(w, kv_cache_dtype=kind, block_size=16, prefill=prefill, workspace_tokens=7)
    n_cache, p_cache = naive.new_cache(3, 80), poison(paged.new_cache(3, 80))
    torch.manual_seed(1)
    errors = []
    for lengths in SCENARIO:
        x = padded(lengths)
        with torch.no_grad():
            errors.append(rel(paged(x, p_cache, lengths), naive(x, n_cache, lengths)))
    assert max(errors) < FP8_BOUND, errors
    assert min(errors) > 1e-3, errors   # the cache is fp8: the error is e4m3's, not float32's


# ---- the cache: layouts, bytes, calibration, moving rows --------------------------------------
def test_cache_layouts_and_bytes_a_token():
    v3 = mla.MLAConfig.from_preset("deepseek-v3")
    for kind, storage, width, nbytes in (("auto", torch.bfloat16, 576, 1152),
                                         ("fp8_e4m3", torch.float8_e4m3fn, 576, 576),
                                         ("fp8", torch.float8_e4m3fn, 576, 576),
                                         ("fp8_ds_mla", torch.uint8, 656, 656)):
        cache = PagedLatentCache(1, 64, v3.kv_lora_rank, v3.qk_rope_head_dim, num_blocks=1,
                                 dtype=torch.bfloat16, kv_cache_dtype=kind)
        assert cache.kv_cache.dtype == storage and cache.kv_cache.shape == (1, 64, width)
        assert cache.bytes_per_token == nbytes == memory.latent_cache_bytes_per_token(v3, kind)
        assert cache.dtype == torch.bfloat16
        assert cache.kv_cache_dtype == ("fp8_e4m3" if kind == "fp8" else kind)


def test_e4m3_cache_calibrates_on_its_first_write_then_keeps_the_scale():
    paged = PagedMLA(weights(), kv_cache_dtype="fp8_e4m3", block_size=4)
    cache = paged.new_cache(2, 30)
    assert cache.needs_scale and cache.kv_scale is None
    x = padded([6, 3])
    x[1, 3:] = 1e6                                   # padding: not a token, not calibrated on
    with torch.no_grad():
        paged(x, cache, [6, 3])
    kv_c, k_pe = (torch.cat([cache.gather(i)[k] for i in range(2)]) for k in (0, 1))
    amax = max(kv_c.abs().max(), k_pe.abs().max())
    # the largest stored value is the largest written one, at half of e4m3's range
    assert cache.kv_scale.shape == (1,) and cache.kv_scale.dtype == torch.float32
    assert math.isclose(float(amax) / float(cache.kv_scale), 224, rel_tol=1 / 16)
    first = cache.kv_scale.clone()
    with torch.no_grad():
        paged(10 * padded([2, 2]), cache, [2, 2])     # larger tokens: stored, the scale kept
    assert torch.equal(cache.kv_scale, first)
    # a given scale is used as it is, by every cache of the layer
    fixed = PagedMLA(weights(), kv_cache_dtype="fp8_e4m3", kv_scale=0.5, block_size=4)
    cache = fixed.new_cache(1, 8)
    assert not cache.needs_scale and float(cache.kv_scale) == 0.5
    with torch.no_grad():
        fixed(padded([3]), cache, [3])
    assert float(cache.kv_scale) == 0.5


def test_append_calibrates_on_the_real_rows_and_gives_the_scale_back_on_error():
    cache = PagedLatentCache(2, 16, C, R, block_size=4, kv_cache_dtype="fp8_e4m3")
    kv_c, k_pe = torch.randn(5, C), torch.randn(5, R)
    kv_c[4] = 1e6                                     # row 4 is padding
    bad_k_pe = k_pe.half()
    with pytest.raises(TypeError, match="k_pe must have kv_c's dtype"):
        cache.append(kv_c, bad_k_pe, [0, 1], [3, 1])
    assert cache.kv_scale is None and cache.seq_lens.tolist() == [0, 0]
    assert cache.num_free_blocks == cache.num_blocks
    cache.append(kv_c, k_pe, [0, 1], [3, 1])
    want = fp8.calibrate_e4m3_scale(kv_c[:4], k_pe[:4], headroom=2)
    assert torch.equal(cache.kv_scale, want)
    got = torch.cat(cache.gather(0), dim=-1)
    assert torch.equal(got, round_trip("fp8_e4m3", kv_c[:3], k_pe[:3], want))


@pytest.mark.parametrize("kind", ["auto", *KINDS])
def test_rows_move_between_caches_as_stored(kind):
    old = PagedLatentCache(2, 16, C, R, block_size=4, kv_cache_dtype=kind, shuffle=1)
    old.append(torch.randn(9, C), torch.randn(9, R), [0, 1], [5, 4])
    new = PagedLatentCache(1, 16, C, R, block_size=3, kv_cache_dtype=kind, kv_scale=old.kv_scale)
    new.append_stored(old.gather(1, stored=True), 0)
    assert new.seq_lens.tolist() == [4]
    assert torch.equal(new.gather(0, stored=True).view(torch.uint8),
                       old.gather(1, stored=True).view(torch.uint8))
    with pytest.raises(ValueError, match=r"append_stored: rows must be \(t, "):
        new.append_stored(torch.zeros(2, 7), 0)


def test_append_stored_carries_the_e4m3_scale():
    old = PagedLatentCache(2, 16, C, R, block_size=4, kv_cache_dtype="fp8_e4m3")
    old.append(torch.randn(5, C), torch.randn(5, R), [0], [5])
    rows = old.gather(0, stored=True)
    new = PagedLatentCache(1, 16, C, R, block_size=4, kv_cache_dtype="fp8_e4m3")
    new.append_stored(rows, 0, kv_scale=old.kv_scale)           # an uncalibrated cache adopts it
    assert torch.equal(new.kv_scale, old.kv_scale)
    new.append(100 * torch.randn(2, C), torch.randn(2, R), [0], [2])   # larger: clips, keeps it
    assert torch.equal(torch.cat(new.gather(0), dim=-1)[:5], torch.cat(old.gather(0), dim=-1))
    other = PagedLatentCache(1, 16, C, R, block_size=4, kv_cache_dtype="fp8_e4m3", kv_scale=3.0)
    before = other.seq_lens.clone(), list(other.free_blocks)
    with pytest.raises(ValueError, match="append_stored: kv_scale .* differs from this cache's"):
        other.append_stored(rows, 0, kv_scale=old.kv_scale)
    assert torch.equal(other.seq_lens, before[0]) and other.free_blocks == before[1]
    ds = PagedLatentCache(1, 16, C, R, block_size=4, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match="kv_scale is for kv_cache_dtype='fp8_e4m3' only"):
        ds.append_stored(torch.zeros(1, ds.kv_cache.shape[2], dtype=torch.uint8), 0, kv_scale=1.0)


def test_calibrate_and_dequantize_rows_name_their_bad_arguments():
    cache = PagedLatentCache(1, 8, C, R, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match=r"calibrate: kv_c must be \(T, 128\)"):
        cache.calibrate(torch.randn(3, 7), torch.randn(3, R))
    with pytest.raises(ValueError, match=r"calibrate: k_pe must be \(T, 8\)"):
        cache.calibrate(torch.randn(3, C), torch.randn(3, 2))
    assert cache.needs_scale
    e4m3 = torch.zeros(2, C + R).to(torch.float8_e4m3fn)
    for rows, kind, scale, error, match in [
        (torch.zeros(2, C + R, dtype=torch.uint8), "fp8_e4m3", 1.0, TypeError, "torch.float8_e4m3fn"),
        (e4m3[:, :5], "fp8_e4m3", 1.0, ValueError, r"rows must be \(\.\.\., c \+ r = 136\)"),
        (e4m3, "fp8_e4m3", None, ValueError, "need its scale"),
        (e4m3, "fp8_e4m3", math.nan, ValueError, "dequantize_rows: scale must be positive and finite"),
        (e4m3, "fp8_e4m3", torch.ones(2), TypeError,
         "dequantize_rows: scale must be a float or a 1-element float32 tensor"),
        (torch.zeros(2, C + R, dtype=torch.int32), "auto", None, TypeError, "bfloat16, float16"),
    ]:
        with pytest.raises(error, match=match):
            fp8.dequantize_rows(rows, kind, C, R, scale)
    assert torch.equal(fp8.dequantize_rows(e4m3, "fp8_e4m3", C, R, 0.5),
                       torch.zeros(2, C + R))


def test_gather_padded_dequantises_and_zero_fills():
    cache = PagedLatentCache(2, 16, C, R, block_size=4, kv_cache_dtype="fp8_ds_mla")
    poison(cache)
    kv_c, k_pe = torch.randn(7, C), torch.randn(7, R)
    cache.append(kv_c, k_pe, [0, 1], [5, 2])
    got = cache.gather_padded([1, 0], 6)
    assert got.shape == (2, 6, C + R) and got.dtype == torch.float32
    assert torch.equal(got[0, :2], round_trip("fp8_ds_mla", kv_c[5:], k_pe[5:], None))
    assert torch.equal(got[1, :5], round_trip("fp8_ds_mla", kv_c[:5], k_pe[:5], None))
    assert torch.all(got[0, 2:] == 0) and torch.all(got[1, 5:] == 0)


# ---- bad input: a clear error, nothing written --------------------------------------------------
def test_bad_cache_dtypes_and_scales_are_refused_by_name():
    w = weights()
    for options, error, match in [
        (dict(kv_cache_dtype="fp16"), ValueError, "kv_cache_dtype must be 'auto', 'fp8'"),
        (dict(kv_cache_dtype=None), TypeError, "kv_cache_dtype must be a str"),
        (dict(kv_scale=1.0), ValueError, "kv_scale is for kv_cache_dtype='fp8_e4m3' only"),
        (dict(kv_cache_dtype="fp8_ds_mla", kv_scale=1.0), ValueError, "kv_scale is for"),
        (dict(kv_cache_dtype="fp8_e4m3", kv_scale=0.0), ValueError, "kv_scale must be positive"),
        (dict(kv_cache_dtype="fp8_e4m3", kv_scale=-2), ValueError, "kv_scale must be positive"),
        (dict(kv_cache_dtype="fp8_e4m3", kv_scale=math.inf), ValueError, "positive and finite"),
        (dict(kv_cache_dtype="fp8_e4m3", kv_scale=math.nan), ValueError, "positive and finite"),
        (dict(kv_cache_dtype="fp8_e4m3", kv_scale=1e-40), ValueError, "at least 2\\^-126"),
        (dict(kv_cache_dtype="fp8_e4m3", kv_scale=True), TypeError, "kv_scale must be a float"),
        (dict(kv_cache_dtype="fp8_e4m3", kv_scale=torch.ones(2)), TypeError, "kv_scale must be"),
        (dict(kv_cache_dtype="fp8_e4m3", kv_scale=torch.ones(1, dtype=torch.float64)),
         TypeError, "kv_scale must be"),
    ]:
        with pytest.raises(error, match=match):
            PagedMLA(w, **options)
    small = mla.MLAWeights(mla.MLAConfig.from_preset("tiny"))          # c = 32
    with pytest.raises(ValueError, match="multiple of 128.*c = 32"):
        PagedMLA(small, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match="multiple of 128"):
        PagedLatentCache(1, 8, 32, 8, kv_cache_dtype="fp8_ds_mla")


def test_without_float8_the_fp8_caches_are_refused(monkeypatch):
    monkeypatch.setattr(fp8, "fp8_available", lambda: False)
    for kind in KINDS:
        with pytest.raises(RuntimeError, match=f"kv_cache_dtype='{kind}' needs torch.float8_e4m3fn"):
            PagedMLA(weights(), kv_cache_dtype=kind)
    PagedMLA(weights(), kv_cache_dtype="auto").new_cache(1, 4)      # "auto" does not need it


def test_uncalibrated_cache_is_refused_by_the_graph_step_before_anything_changes():
    paged = PagedMLA(weights(), kv_cache_dtype="fp8_e4m3", block_size=4)
    cache = poison(paged.new_cache(2, 8))
    before = (cache.kv_cache.view(torch.uint8).clone(), cache.seq_lens.clone(),
              list(cache.free_blocks), cache.block_table_cpu.clone())
    with pytest.raises(ValueError, match="fp8_e4m3 without a scale, and decode_inputs"):
        paged.decode_inputs(cache)
    buffers = dict(slot_mapping=torch.zeros(2, dtype=torch.int64),
                   positions=torch.zeros(2, dtype=torch.int64),
                   seq_lens_after=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="fp8_e4m3 without a scale, and decode_inputs"):
        paged.decode_step(torch.randn(2, 1, CFG.hidden_size), cache, num_kv_splits=1, **buffers)
    assert torch.equal(cache.kv_cache.view(torch.uint8), before[0])
    assert torch.equal(cache.seq_lens, before[1]) and cache.free_blocks == before[2]
    assert torch.equal(cache.block_table_cpu, before[3]) and cache.kv_scale is None


def test_a_cache_never_calibrates_on_nothing():
    """A write of no tokens, or of tokens that are all zero, leaves an fp8_e4m3 cache
    uncalibrated (a scale from them would be 2^-126 and clip everything after); the zeros it
    holds meanwhile read back as zeros, and the first real write calibrates it."""
    cache = PagedLatentCache(2, 16, C, R, block_size=4, kv_cache_dtype="fp8_e4m3")
    cache.append(torch.randn(3, C), torch.randn(3, R), [0], [0])
    assert cache.needs_scale and cache.seq_lens.tolist() == [0, 0]
    cache.append(torch.zeros(2, C), torch.zeros(2, R), [0], [2])
    assert cache.needs_scale and cache.seq_lens.tolist() == [2, 0]
    kv_c, k_pe = torch.randn(3, C), torch.randn(3, R)
    cache.append(kv_c, k_pe, [1], [3])
    assert not cache.needs_scale
    assert torch.equal(cache.kv_scale, fp8.calibrate_e4m3_scale(kv_c, k_pe, headroom=2))
    assert torch.all(torch.cat(cache.gather(0), dim=-1) == 0)
    assert torch.equal(torch.cat(cache.gather(1), dim=-1),
                       round_trip("fp8_e4m3", kv_c, k_pe, cache.kv_scale))
    # through the layer: an all-zero prompt first, then real tokens, against float32 naive
    w = weights()
    naive, paged = mla.build(w, "naive"), PagedMLA(w, kv_cache_dtype="fp8_e4m3", block_size=4)
    n_cache, p_cache = naive.new_cache(1, 40), poison(paged.new_cache(1, 40))
    with torch.no_grad():
        zeros = torch.zeros(1, 5, CFG.hidden_size)   # no bias: the latent of x = 0 is all zero
        naive(zeros, n_cache), paged(zeros, p_cache)
        assert p_cache.needs_scale
        for s in (7, 1, 1):
            x = torch.randn(1, s, CFG.hidden_size)
            assert rel(paged(x, p_cache), naive(x, n_cache)) < FP8_BOUND
    assert not p_cache.needs_scale and float(p_cache.kv_scale) > 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_bad_call_leaves_an_fp8_cache_unchanged(kind):
    paged = PagedMLA(weights(), kv_cache_dtype=kind, block_size=4)
    cache = poison(paged.new_cache(2, 12))
    with torch.no_grad():
        paged(padded([5, 2]), cache, [5, 2])
    before = (cache.kv_cache.view(torch.uint8).clone(), cache.seq_lens.clone(),
              list(cache.free_blocks), None if cache.kv_scale is None else cache.kv_scale.clone())
    for x, lengths in ((torch.randn(2, 3, CFG.hidden_size + 1), None),
                       (torch.randn(2, 9, CFG.hidden_size), [9, 1])):       # past max_seq_len
        with pytest.raises(ValueError):
            with torch.no_grad():
                paged(x, cache, lengths)
    assert torch.equal(cache.kv_cache.view(torch.uint8), before[0])
    assert torch.equal(cache.seq_lens, before[1]) and cache.free_blocks == before[2]
    assert (cache.kv_scale is None) == (before[3] is None)
    if before[3] is not None:
        assert torch.equal(cache.kv_scale, before[3])


def test_a_refused_write_leaves_an_uncalibrated_cache_uncalibrated():
    """append's checks that run after calibration (the write's own) give the scale back."""
    cache = poison(PagedLatentCache(2, 16, C, R, block_size=4, kv_cache_dtype="fp8_e4m3"))
    before = cache.kv_cache.view(torch.uint8).clone()
    with pytest.raises(ValueError, match="kv_c must have shape"):
        cache.append(torch.randn(3, C + 1), torch.randn(3, R), [0], [3])
    with pytest.raises(TypeError, match="k_pe must have kv_c's dtype"):
        cache.append(torch.randn(3, C), torch.randn(3, R).half(), [0], [3])
    assert cache.kv_scale is None and cache.seq_lens.tolist() == [0, 0]
    assert cache.num_free_blocks == cache.num_blocks
    assert torch.equal(cache.kv_cache.view(torch.uint8), before)


def test_the_cache_dtype_is_a_build_option_and_in_the_repr():
    paged = mla.build(weights(), "paged", kv_cache_dtype="fp8_ds_mla")
    assert "kv_cache_dtype='fp8_ds_mla'" in repr(paged)
    assert "kv_cache_dtype='fp8_ds_mla'" in repr(paged.new_cache(1, 4))
    assert "kv_cache_dtype" in tier_options("paged") and "kv_scale" in tier_options("paged")


def test_chunked_context_prefill_checks_the_layout():
    from mla.kernels import chunked_context_prefill
    h, d, v = CFG.num_heads, CFG.qk_nope_head_dim, CFG.v_head_dim
    q_nope, q_pe = torch.randn(3, h, d), torch.randn(3, h, R)
    kv_c, k_pe = torch.randn(3, C), torch.randn(3, R)
    args = (q_nope, q_pe, kv_c, k_pe, torch.tensor([0, 3], dtype=torch.int32))
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    w = weights()
    options = dict(W_UK=w.W_UK, W_UV=w.W_UV, softmax_scale=0.1)
    ds = torch.zeros(1, 4, 4 * C // 128 + C + 2 * R, dtype=torch.uint8)
    with pytest.raises(TypeError, match="kv_cache must be torch.uint8 for kv_cache_dtype='fp8_ds_mla'"):
        chunked_context_prefill(*args, ds.view(torch.int8), table, lens, kv_cache_dtype="fp8_ds_mla",
                                **options)
    with pytest.raises(ValueError, match="kv_cache's last dim must be 148"):
        chunked_context_prefill(*args, ds[..., :-1], table, lens, kv_cache_dtype="fp8_ds_mla",
                                **options)
    e4m3 = torch.zeros(1, 4, C + R).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_scale must be the cache's"):
        chunked_context_prefill(*args, e4m3, table, lens, kv_cache_dtype="fp8_e4m3", **options)


# ---- the fp8_e4m3 scale: one rule at every door ---------------------------------------------
# Each bad scale raises the same error class at every function an fp8_e4m3 scale enters by,
# naming the function and the argument, before anything is written. On the CPU a tensor's value
# is read too (no sync); on a GPU the readers that must not sync trust a tensor they hold.
BAD_SCALES = {  # name: (scale, the error)
    "zero": (0.0, ValueError),
    "negative": (-1.0, ValueError),
    "inf": (math.inf, ValueError),
    "nan": (math.nan, ValueError),
    "subnormal": (1e-40, ValueError),                       # below 2^-126, above 0 in float32
    "subnormal tensor": (torch.tensor([1e-40]), ValueError),
    "two elements": (torch.ones(2), TypeError),
    "float64 tensor": (torch.ones(1, dtype=torch.float64), TypeError),
    "str": ("1", TypeError),
}
SCALE_DOORS = ("concat_and_cache", "mla_decode", "mla_decode_reference", "chunked_context_prefill",
               "quantize_e4m3", "dequantize_e4m3", "dequantize_rows", "PagedLatentCache",
               "PagedMLA", "append_stored")


def _scale_door(door):
    """(the name its errors carry, the argument's name, call(scale), state()): the call with
    everything but the scale right, and the bytes and counters it could change."""
    from mla.kernels import chunked_context_prefill, concat_and_cache
    from mla.kernels.decode import mla_decode, mla_decode_reference
    w = weights()
    h, d = CFG.num_heads, CFG.qk_nope_head_dim
    kv_c, k_pe = torch.randn(3, C), torch.randn(3, R)
    cache = poison(PagedLatentCache(1, 8, C, R, block_size=4, kv_cache_dtype="fp8_e4m3",
                                    kv_scale=0.5))
    cache.append(kv_c, k_pe, [0], [3])
    kv = cache.kv_cache                                         # (blocks, 4, c + r) e4m3
    table, lens = cache.block_table, cache.seq_lens.to(torch.int32)
    rows = cache.gather(0, stored=True)                         # (3, c + r) e4m3
    empty = PagedLatentCache(1, 8, C, R, block_size=4, kv_cache_dtype="fp8_e4m3")
    decode = dict(kv_lora_rank=C, softmax_scale=0.1, kv_cache_dtype="fp8_e4m3")
    q = torch.randn(1, h, C + R)
    prefill = (torch.randn(3, h, d), torch.randn(3, h, R), kv_c, k_pe,
               torch.tensor([0, 3], dtype=torch.int32), kv, table, lens)
    doors = {
        "concat_and_cache": ("concat_and_cache", "scale", lambda s: concat_and_cache(
            kv_c, k_pe, kv, torch.tensor([3, 4, 5]), kv_cache_dtype="fp8_e4m3", scale=s,
            backend="reference")),
        "mla_decode": ("mla_decode", "kv_scale",
                       lambda s: mla_decode(q, kv, table, lens, **decode, kv_scale=s)),
        "mla_decode_reference": ("mla_decode", "kv_scale", lambda s: mla_decode_reference(
            q, kv, table, lens, **decode, kv_scale=s)),
        "chunked_context_prefill": ("chunked_context_prefill", "kv_scale",
                                    lambda s: chunked_context_prefill(
                                        *prefill, W_UK=w.W_UK, W_UV=w.W_UV, softmax_scale=0.1,
                                        kv_cache_dtype="fp8_e4m3", kv_scale=s)),
        "quantize_e4m3": ("quantize_e4m3", "scale", lambda s: fp8.quantize_e4m3(kv_c, k_pe, s)),
        "dequantize_e4m3": ("dequantize_e4m3", "scale",
                            lambda s: fp8.dequantize_e4m3(rows, C, s)),
        "dequantize_rows": ("dequantize_rows", "scale",
                            lambda s: fp8.dequantize_rows(rows, "fp8_e4m3", C, R, s)),
        "PagedLatentCache": ("PagedLatentCache", "kv_scale", lambda s: PagedLatentCache(
            1, 8, C, R, kv_cache_dtype="fp8_e4m3", kv_scale=s)),
        "PagedMLA": ("PagedMLA", "kv_scale",
                     lambda s: PagedMLA(w, kv_cache_dtype="fp8_e4m3", kv_scale=s)),
        "append_stored": ("append_stored", "kv_scale",
                          lambda s: empty.append_stored(rows, 0, kv_scale=s)),
    }

    def state():
        return [kv.view(torch.uint8).clone(), rows.view(torch.uint8).clone(),
                cache.seq_lens.clone(), cache.kv_scale.clone(),
                empty.kv_cache.view(torch.uint8).clone(), empty.seq_lens.clone(),
                torch.tensor(empty.free_blocks), torch.tensor(empty.kv_scale is None)]

    return (*doors[door], state)


@pytest.mark.parametrize("door", SCALE_DOORS)
def test_every_door_holds_a_bad_e4m3_scale_to_one_rule(door):
    fn, name, call, state = _scale_door(door)
    before = state()
    wrong = []
    for label, (scale, error) in BAD_SCALES.items():
        try:
            call(scale)
            got = None
        except (TypeError, ValueError) as e:
            got = e
        if type(got) is not error or not str(got).startswith(f"{fn}: {name} must be"):
            wrong.append(f"{label}: {type(got).__name__} {got}")
    assert not wrong, (f"{door}: each bad scale must raise its error class, saying "
                       f"'{fn}: {name} must be ...'; these did not:\n" + "\n".join(wrong))
    assert all(torch.equal(a, b) for a, b in zip(state(), before))
    call(2.0**-126)                     # the smallest scale allowed, as a float and a tensor
    call(torch.tensor([2.0**-126]))


# ---- the GPU: bf16, the CUDA writer, a graph --------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_bf16_fp8_tier_over_the_dequantised_cache_and_within_the_bound(kind, monkeypatch):
    """V2-Lite sizes in bf16, the CUDA writer, contexts of several workspace chunks: the fp8 tier
    against the same tier on a bf16 cache of the rounded values, and against the float32 naive
    tier within FP8_BOUND. The decode reads fp8_e4m3's values exactly and scales the scores in
    float32, so the scale is calibrated to a power of two here, where e4m3 x scale is exact in
    bf16 too: the same values reach the kernels. The decode rows at these 16 heads run on the
    sm_80 kernel, whose fp8 products on sm_89+ are fp16: p rounded to fp16, where the bf16
    cache's decode rounds it to bf16; and on fp8_ds_mla the group scales multiply the scores and
    p in float32 rather than e4m3 x scale rounded to bf16. So the two tiers' outputs differ by up
    to a bf16 rounding or two, 2^-9 relative each, and the comparison allows three (6e-3)."""
    if kind == "fp8_e4m3":
        calibrate = fp8.calibrate_e4m3_scale
        monkeypatch.setattr(fp8, "calibrate_e4m3_scale",
                            lambda *a, **k: torch.exp2(torch.ceil(torch.log2(calibrate(*a, **k)))))
    cfg = mla.MLAConfig.from_preset("deepseek-v2-lite")
    w32 = mla.MLAWeights(cfg, dtype=torch.float32, device="cuda", seed=0)
    w = mla.MLAWeights(cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    naive = mla.build(w32, "naive")
    options = dict(shuffle=3, workspace_tokens=300, prefill_crossover=9)
    fp8_layer = PagedMLA(w, kv_cache_dtype=kind, **options)
    exact_layer = PagedMLA(w, **options)
    b, max_len = 3, 1500
    n_cache = naive.new_cache(b, max_len)
    p_cache = poison(fp8_layer.new_cache(b, max_len))
    e_cache = exact_layer.new_cache(b, max_len)
    rounded_writes(monkeypatch, e_cache, kind, lambda: p_cache.kv_scale)
    for lengths in ([700, 0, 300], [5, 600, 8], [1, 1, 1], [300, 2, 1]):
        x = torch.randn(b, max(lengths), cfg.hidden_size, device="cuda")
        for i, n in enumerate(lengths):
            x[i, n:] = 0
        with torch.no_grad():
            ref = naive(x, n_cache, lengths)
            out = fp8_layer(x.bfloat16(), p_cache, lengths)
            exact = exact_layer(x.bfloat16(), e_cache, lengths)
        assert torch.isfinite(out).all()
        assert rel(out, exact) < 3 * 2.0**-9, lengths
        assert rel(out, ref) < FP8_BOUND, lengths


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_fp8_decode_step_in_a_cuda_graph(kind):
    """The fp8 write (CUDA kernel) and the fp8 decode (Triton) captured in one graph; the
    fp8_e4m3 caches calibrate on their prefill, outside the graph."""
    cfg = mla.MLAConfig.from_preset("deepseek-v2-lite")
    w = mla.MLAWeights(cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    paged = PagedMLA(w, kv_cache_dtype=kind, block_size=16, shuffle=5)
    b = 4
    common, graphed = (poison(paged.new_cache(b, 256)) for _ in range(2))
    prompt = torch.randn(b, 100, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for cache in (common, graphed):
            paged(prompt, cache, [100, 1, 37, 64])
    check_graphed_decode_steps(paged, common, graphed, cfg.hidden_size, 1e-2, dtype=torch.bfloat16)
    assert torch.equal(common.kv_cache.view(torch.uint8), graphed.kv_cache.view(torch.uint8))
