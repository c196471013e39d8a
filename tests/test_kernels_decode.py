"""Tests of mla.kernels.decode: the Triton split-KV paged decode against its float64 reference.

On a machine without a GPU the kernel runs in Triton's interpreter (mla.kernels sets
TRITON_INTERPRET=1), so the CPU tests keep shapes small: b <= 4, h in {1, 3, 16, 20}, c + r <= 80,
lengths <= 200. bf16 on the CPU runs in float32 inside mla_decode (the interpreter's bf16 dot is
wrong); test_bf16_matches_reference checks that path.

Every case is built hostile: pages in random order, unused pages and the tails of partial pages
filled with NaN, unused block-table entries out of range (10**6, -7), so any read outside a
sequence's pages turns the result into NaN or faults.
"""

import math

import pytest
import torch

import mla.kernels  # noqa: F401  (sets TRITON_INTERPRET before triton is imported on a CPU machine)
from mla.kernels import decode
from mla.kernels.backends import choose_decode_backend
from mla.kernels.decode import choose_num_kv_splits, mla_decode, mla_decode_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GARBAGE_PAGES = (10**6, -7)  # what unused block-table entries hold


def make_case(seq_lens, *, heads, c, r, block_size, dtype=torch.float32, device=DEVICE, spare_pages=3, seed=0,
              s_q=None):
    """A paged cache holding len(seq_lens) sequences, pages shuffled, every unused value NaN;
    q (b, heads, c + r), or (b, s_q, heads, c + r) when s_q is given."""
    gen = torch.Generator().manual_seed(seed)
    b, d = len(seq_lens), c + r
    pages_needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(pages_needed) + spare_pages
    max_blocks = max(pages_needed, default=0) + 2
    order = torch.randperm(num_blocks, generator=gen)  # page k of the concatenation -> block order[k]

    kv_cache = torch.full((num_blocks, block_size, d), float("nan"))
    block_table = torch.tensor(GARBAGE_PAGES * max_blocks, dtype=torch.int32)[:max_blocks].repeat(b, 1)
    next_page = 0
    for i, (n, pages) in enumerate(zip(seq_lens, pages_needed)):
        blocks = order[next_page : next_page + pages]
        next_page += pages
        block_table[i, :pages] = blocks.int()
        rows = torch.randn(n, d, generator=gen)
        pos = torch.arange(n)
        kv_cache[blocks[pos // block_size], pos % block_size] = rows  # partial-page tails stay NaN
    q = torch.randn(b, heads, d, generator=gen) if s_q is None else torch.randn(b, s_q, heads, d, generator=gen)
    return dict(
        q=q.to(dtype).to(device),
        kv_cache=kv_cache.to(dtype).to(device),
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        kv_lora_rank=c,
        softmax_scale=d**-0.5,
    )


def rel_err(actual, expected):
    """max |actual - expected| / max |expected|: the error in units of the output's scale."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def assert_matches(out, lse, ref_out, ref_lse, seq_lens, tol):
    """out and lse against the reference; empty rows exactly (0, -inf); no NaN anywhere."""
    assert not out.isnan().any() and not lse.isnan().any()
    empty = seq_lens.cpu() == 0
    out, lse, ref_out, ref_lse = out.cpu(), lse.cpu(), ref_out.cpu(), ref_lse.cpu()
    assert (out[empty] == 0).all()
    assert (lse[empty] == float("-inf")).all()
    if (~empty).any():
        assert rel_err(out[~empty], ref_out[~empty]) < tol
        # lse is a log: compare absolutely, scaled by its size when it is large
        lse_err = (lse[~empty].double() - ref_lse[~empty].double()).abs() / ref_lse[~empty].abs().clamp_min(1.0)
        assert lse_err.max().item() < tol


def rows_seen(seq_lens, s_q):
    """(b, s_q): cached rows new token j of s_q sees, seq_len - (s_q - 1 - j), at least 0."""
    return (seq_lens.cpu()[:, None] - (s_q - 1 - torch.arange(s_q))).clamp_min(0)


def assert_tokens_match(out, lse, ref_out, ref_lse, seq_lens, s_q, tol):
    """assert_matches for (b, s_q, h, ...) results: each (sequence, new token) a row of its own,
    with the rows it sees as its length, so that a token that sees none must give (0, -inf)."""
    assert out.shape[:2] == lse.shape[:2] == (len(seq_lens), s_q)
    seen = rows_seen(seq_lens, s_q).flatten()
    assert_matches(out.flatten(0, 1), lse.flatten(0, 1), ref_out.flatten(0, 1), ref_lse.flatten(0, 1), seen, tol)


def run_both(case, **kwargs):
    out, lse = mla_decode(**case, **kwargs)
    ref_out, ref_lse = mla_decode_reference(**case)
    return out, lse, ref_out, ref_lse


# fp32: the kernel's fp32 dots over c + r <= 80 terms and its exp2 of fp32 scores err by a few
# ulps (~1e-7 relative) each; accumulated over <= 200 tokens and a merge that stays ~1e-6 of the
# output's scale, so 1e-5 leaves a 10x margin and still catches any real mistake (a dropped or
# double-counted token moves the output by ~1/200 = 5e-3). fp16: inputs are exact in both, but
# p is rounded to fp16 before p·V (2^-11 relative) and out is stored in fp16, hence 1e-2.
TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


# ---------------------------------------------------------------------------------------------
# Against the reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [1, 3, 16])
def test_matches_reference(dtype, block_size, heads):
    # lengths: empty, one token, not a multiple of the page or of BLOCK_N, a few pages long
    case = make_case([0, 1, 37, 200], heads=heads, c=32, r=8, block_size=block_size, dtype=dtype)
    # 3 splits: the 1-token row has two empty splits, the others uneven ones
    assert_matches(*run_both(case, num_kv_splits=3), case["seq_lens"], TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_split_counts_agree(dtype):
    case = make_case([5, 64, 129, 200], heads=16, c=64, r=16, block_size=16, dtype=dtype, seed=1)
    ref_out, ref_lse = mla_decode_reference(**case)
    results = {s: mla_decode(**case, num_kv_splits=s) for s in (None, 1, 4, 8)}
    for out, lse in results.values():
        assert_matches(out, lse, ref_out, ref_lse, case["seq_lens"], TOL[dtype])
    out1, lse1 = results[1]
    for s in (4, 8):
        assert rel_err(results[s][0], out1) < TOL[dtype]
        assert (results[s][1] - lse1).abs().max().item() < TOL[dtype] * 10


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_all_rows_empty(num_kv_splits):
    case = make_case([0, 0, 0], heads=3, c=32, r=8, block_size=16)
    out, lse = mla_decode(**case, num_kv_splits=num_kv_splits)
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_sequences_shorter_than_split_count():
    # 8 splits of 1..3 tokens: at most one split of each row holds anything
    case = make_case([1, 2, 3], heads=3, c=32, r=8, block_size=1, seed=2)
    assert_matches(*run_both(case, num_kv_splits=8), case["seq_lens"], TOL[torch.float32])


@pytest.mark.parametrize(
    "block_size, block_n",
    [(1, 16), (5, 16), (16, 32), (64, 16), (3, 64)],
    ids=["page1", "page5-odd", "tile-spans-pages", "tile-inside-page", "page3-tile64"],
)
def test_tiles_and_pages_unaligned(block_size, block_n):
    case = make_case([1, 17, 95, 130], heads=3, c=32, r=8, block_size=block_size, seed=3)
    out = run_both(case, num_kv_splits=2, _config={"BLOCK_N": block_n})
    assert_matches(*out, case["seq_lens"], TOL[torch.float32])


@pytest.mark.parametrize("page_tile", [True, False], ids=["page-tile", "per-token-pages"])
@pytest.mark.parametrize("block_n", [16, 32, 64])
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "batch-major"])
def test_fast_paths(page_tile, block_n, head_major):
    # c, r powers of two (no column masks), page 64 (a multiple of every BLOCK_N: one page
    # lookup a tile), lengths that end mid-tile, on a tile and on a page boundary
    case = make_case([1, 31, 64, 65, 200], heads=20, c=64, r=16, block_size=64, seed=10)
    config = {"BLOCK_N": block_n, "PAGE_TILE": page_tile, "HEAD_MAJOR": head_major}
    for splits in (1, 3):
        out = run_both(case, num_kv_splits=splits, _config=config)
        assert_matches(*out, case["seq_lens"], TOL[torch.float32])


@pytest.mark.parametrize("split_tail", [True, False], ids=["split-tail", "all-masked"])
def test_split_tail(split_tail):
    case = make_case([1, 31, 64, 65, 200], heads=3, c=64, r=16, block_size=64, seed=11)
    out = run_both(case, num_kv_splits=3, _config={"BLOCK_N": 32, "SPLIT_TAIL": split_tail})
    assert_matches(*out, case["seq_lens"], TOL[torch.float32])


def test_merge_many_splits_in_chunks():
    # 100 splits: the merge reads (128 splits x 32 columns) a program, so c = 64 takes two
    # chunks; most splits of the short rows are empty
    case = make_case([3, 150, 1600], heads=3, c=64, r=16, block_size=16, seed=13)
    assert_matches(*run_both(case, num_kv_splits=100), case["seq_lens"], TOL[torch.float32])


@pytest.mark.parametrize("heads, block_h", [(3, 16), (20, 16), (20, 32), (3, 64)])
def test_padded_head_blocks(heads, block_h):
    # heads not a multiple of BLOCK_H: the last head block is part padding
    case = make_case([7, 100], heads=heads, c=48, r=12, block_size=16, seed=4)
    out = run_both(case, num_kv_splits=2, _config={"BLOCK_H": block_h})
    assert_matches(*out, case["seq_lens"], TOL[torch.float32])


def test_peaky_softmax():
    # a large scale: scores in the hundreds, so a softmax without max-subtraction overflows
    case = make_case([50, 200], heads=3, c=32, r=8, block_size=16, seed=5)
    case["softmax_scale"] = 20.0
    assert_matches(*run_both(case, num_kv_splits=4), case["seq_lens"], TOL[torch.float32])


def test_every_output_element_written(monkeypatch):
    # the wrapper allocates out, lse and the split workspace with torch.empty: make that NaN
    class PoisonedTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            return torch.empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(decode, "torch", PoisonedTorch())
    for s_q, heads in ((None, 20), (3, 3)):  # 3 new tokens: rows of 1 and 2 hold tokens that see nothing
        case = make_case([0, 1, 70, 33, 2], heads=heads, c=32, r=8, block_size=16, seed=6, s_q=s_q)
        for splits in (1, 5):
            out, lse = mla_decode(**case, num_kv_splits=splits)
            assert not out.isnan().any() and not lse.isnan().any()


def test_inputs_unchanged():
    case = make_case([3, 120], heads=3, c=32, r=8, block_size=16, seed=7)
    before = {k: v.clone() for k, v in case.items() if isinstance(v, torch.Tensor)}
    mla_decode(**case, num_kv_splits=4)
    for k, v in before.items():
        torch.testing.assert_close(case[k], v, rtol=0, atol=0, equal_nan=True)


def test_reference_is_dense_attention():
    # the reference itself, against scaled-dot-product attention over the gathered latent (MQA)
    case = make_case([40], heads=3, c=32, r=8, block_size=16, seed=8)
    q, kv, bt = case["q"].double(), case["kv_cache"].double(), case["block_table"]
    latent = kv[bt[0, :3].long()].reshape(-1, 40)[:40]  # (t, c + r)
    scores = q[0] @ latent.T * case["softmax_scale"]
    expected = torch.softmax(scores, -1) @ latent[:, :32]
    out, lse = mla_decode_reference(**case)
    assert rel_err(out[0], expected) < 1e-6
    assert (lse[0].double() - torch.logsumexp(scores, -1)).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------------
# Several new tokens a sequence: q (b, s_q, h, c + r), new token j sees seq_len - (s_q - 1 - j)
# rows; s_q x h (token, head) rows packed into the kernel's tile of query rows
# ---------------------------------------------------------------------------------------------


def multi_token_lengths(s_q):
    """Ragged lengths: empty, shorter than s_q (tokens that see nothing), s_q, several pages."""
    return sorted({0, 1, max(0, s_q - 1), s_q, 130})


# (s_q, heads, splits): every s_q from 1 to 8, every head count of the CPU tests, s_q x heads rows
# from 1 to 160, so that a tile of rows holds several tokens, one token, or a token split across
# tiles. The merge is one interpreted program a (sequence, row), so the cases of many rows run one
# split (no merge) and the others three.
MULTI_TOKEN_SHAPES = [
    (1, 3, 3), (2, 1, 3), (2, 16, 3), (3, 20, 1), (4, 3, 3), (5, 1, 3), (6, 16, 1), (6, 3, 3), (7, 3, 3),
    (8, 20, 1), (8, 1, 3),
]


@pytest.mark.parametrize("s_q, heads, splits", MULTI_TOKEN_SHAPES,
                         ids=[f"sq{s}-h{h}-splits{n}" for s, h, n in MULTI_TOKEN_SHAPES])
def test_multi_token_matches_reference(s_q, heads, splits):
    case = make_case(multi_token_lengths(s_q), heads=heads, c=32, r=8, block_size=16, seed=20 + s_q, s_q=s_q)
    ref_out, ref_lse = mla_decode_reference(**case)
    assert ref_out.shape == (len(case["seq_lens"]), s_q, heads, 32) and ref_lse.shape == ref_out.shape[:3]
    # with 3 splits a row's causal tail and its short tokens' ends fall in different splits
    out, lse = mla_decode(**case, num_kv_splits=splits)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert_tokens_match(out, lse, ref_out, ref_lse, case["seq_lens"], s_q, TOL[torch.float32])


@pytest.mark.parametrize("s_q, heads", [(2, 64), (8, 128)], ids=["sq2-h64", "sq8-h128"])
def test_multi_token_many_heads(s_q, heads):
    # 128 and 1024 rows: tiles of 64 rows, each holding a whole token or a part of one; one split
    # (the merge is the same program for every row, tested above)
    case = make_case([3, 70], heads=heads, c=32, r=16, block_size=16, seed=30 + s_q, s_q=s_q)
    assert_tokens_match(*run_both(case, num_kv_splits=1), case["seq_lens"], s_q, TOL[torch.float32])


@pytest.mark.parametrize("s_q", [2, 5])
def test_multi_token_fp16(s_q):
    case = make_case(multi_token_lengths(s_q), heads=3, c=32, r=8, block_size=16, dtype=torch.float16,
                     seed=40 + s_q, s_q=s_q)
    assert_tokens_match(*run_both(case, num_kv_splits=3), case["seq_lens"], s_q, TOL[torch.float16])


def test_multi_token_bf16_on_the_cpu():
    case = make_case([0, 2, 40], heads=3, c=32, r=8, block_size=16, dtype=torch.bfloat16, seed=44, s_q=4)
    out, lse, ref_out, ref_lse = run_both(case, num_kv_splits=2)
    assert out.dtype == torch.bfloat16
    assert_tokens_match(out.float(), lse, ref_out.float(), ref_lse, case["seq_lens"], 4, 1e-2)


@pytest.mark.parametrize(
    "block_size, heads, config",
    [
        (16, 1, {"BLOCK_N": 16}),  # page tiles; at length 35 the causal positions span two tiles
        (16, 1, {"BLOCK_N": 16, "SPLIT_TAIL": False}),  # every tile masked
        (5, 1, {"BLOCK_N": 16}),  # a tile spans pages: the block table read per token
        (64, 1, {"BLOCK_N": 32, "HEAD_MAJOR": False}),
        (16, 3, {"BLOCK_N": 16, "BLOCK_H": 16}),  # 8 x 3 = 24 rows in two tiles of 16
    ],
    ids=["page-tile", "all-masked", "per-token-pages", "batch-major", "rows-across-tiles"],
)
def test_multi_token_tiles_and_masks(block_size, heads, config):
    # s_q = 8: the last 7 positions are causal. Lengths where they straddle a tile boundary (35),
    # end on one (32), fill a tile's end (40), lie inside the first tile (9), or outnumber the
    # cache (6: new tokens 0 and 1 see nothing)
    case = make_case([35, 32, 40, 9, 6], heads=heads, c=32, r=8, block_size=block_size, seed=50, s_q=8)
    for splits in (1, 3):
        out = run_both(case, num_kv_splits=splits, _config=config)
        assert_tokens_match(*out, case["seq_lens"], 8, TOL[torch.float32])


def test_multi_token_peaky_softmax():
    # scores in the hundreds, of both signs: the masked tiles' rows that see nothing of a split
    # (all -inf) beside rows whose exponents overflow without the max subtracted
    case = make_case([3, 50, 200], heads=3, c=32, r=8, block_size=16, seed=51, s_q=6)
    case["softmax_scale"] = -20.0
    assert_tokens_match(*run_both(case, num_kv_splits=4), case["seq_lens"], 6, TOL[torch.float32])


def test_one_token_4d_is_3d():
    # s_q = 1 as (b, 1, h, c + r) gives exactly the (b, h, c + r) results with a token dim
    case = make_case([0, 1, 37, 200], heads=3, c=32, r=8, block_size=16, seed=52)
    case4 = dict(case, q=case["q"].unsqueeze(1))
    for splits in (None, 1, 3):
        out3, lse3 = mla_decode(**case, num_kv_splits=splits)
        out4, lse4 = mla_decode(**case4, num_kv_splits=splits)
        assert out3.shape == (4, 3, 32) and lse3.shape == (4, 3)
        assert out4.shape == (4, 1, 3, 32) and lse4.shape == (4, 1, 3)
        assert torch.equal(out4[:, 0], out3) and torch.equal(lse4[:, 0], lse3)
    ref3, ref4 = mla_decode_reference(**case), mla_decode_reference(**case4)
    assert torch.equal(ref4[0][:, 0], ref3[0]) and torch.equal(ref4[1][:, 0], ref3[1])


def test_multi_token_tokens_are_causal():
    # new token j is the attention of the last s_q - j ... rows back: the same as a one-token
    # call on the cache with the rows after it dropped, for every j
    s_q = 4
    case = make_case([3, 40, 90], heads=3, c=32, r=8, block_size=16, seed=53, s_q=s_q)
    out, lse = mla_decode(**case, num_kv_splits=2)
    for j in range(s_q):
        shorter = (case["seq_lens"] - (s_q - 1 - j)).clamp_min(0).int()
        out_j, lse_j = mla_decode(**dict(case, q=case["q"][:, j], seq_lens=shorter), num_kv_splits=2)
        assert_matches(out[:, j], lse[:, j], out_j, lse_j, shorter, TOL[torch.float32])


def test_reference_multi_token_is_dense_causal_attention():
    # the reference, against a dense attention with the causal mask written by position: the new
    # tokens sit at positions t - s_q .. t - 1, and a query sees the keys at its position or before
    s_q, t = 5, 40
    case = make_case([t], heads=3, c=32, r=8, block_size=16, seed=54, s_q=s_q)
    q, kv, bt = case["q"].double(), case["kv_cache"].double(), case["block_table"]
    latent = kv[bt[0, :3].long()].reshape(-1, 40)[:t]  # (t, c + r)
    scores = torch.einsum("shd,td->sht", q[0], latent) * case["softmax_scale"]
    query_pos = torch.arange(t - s_q, t)
    visible = torch.arange(t)[None, :] <= query_pos[:, None]  # (s_q, t)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    expected = torch.softmax(scores, -1) @ latent[:, :32]
    out, lse = mla_decode_reference(**case)
    assert rel_err(out[0], expected) < 1e-6
    assert (lse[0].double() - torch.logsumexp(scores, -1)).abs().max().item() < 1e-5


def test_multi_token_inputs_unchanged():
    case = make_case([3, 120], heads=3, c=32, r=8, block_size=16, seed=55, s_q=3)
    before = {k: v.clone() for k, v in case.items() if isinstance(v, torch.Tensor)}
    mla_decode(**case, num_kv_splits=4)
    for k, v in before.items():
        torch.testing.assert_close(case[k], v, rtol=0, atol=0, equal_nan=True)


def test_multi_token_nan_in_a_row_a_token_does_not_see_reaches_it():
    # mla_decode's documented limit: the kernel loads a tile once for all of a sequence's tokens,
    # so a NaN in row seq_len - 1, which only the last new token sees, meets token 0's p = 0 in
    # the p . value dot (0 x NaN = NaN), while its lse, a sum of p, is right; the reference takes
    # token 0's rows only and stays finite
    s_q = 2
    case = make_case([40, 40], heads=3, c=32, r=8, block_size=16, seed=56, s_q=s_q)
    block, slot = divmod(40 - 1, 16)
    case["kv_cache"][case["block_table"][0, block], slot] = float("nan")
    ref_out, ref_lse = mla_decode_reference(**case)
    assert ref_out[0, 1].isnan().all() and ref_out[0, 0].isfinite().all() and ref_lse[0, 0].isfinite().all()
    assert ref_lse[0, 1].isnan().all()
    for splits in (1, 2):
        out, lse = mla_decode(**case, num_kv_splits=splits)
        assert out[0, 1].isnan().all() and out[0, 0].isnan().all()
        assert lse[0, 1].isnan().all()  # the token that sees the NaN: a NaN sum is not an empty split
        torch.testing.assert_close(lse[0, 0], ref_lse[0, 0], rtol=TOL[torch.float32], atol=0)  # p = 0 there
        assert_tokens_match(out[1:], lse[1:], ref_out[1:], ref_lse[1:], case["seq_lens"][1:], s_q, TOL[torch.float32])


def test_multi_token_bad_block_table_entry():
    # s_q = 4, page 16, seq_len 17: new token 0 sees 14 rows (entry 0 only), the last token all 17
    # (entries 0 and 1): entry 1 is read and checked; entry 2 is not read
    args = make_case([5, 17], heads=3, c=32, r=8, block_size=16, seed=56, s_q=4)
    args["block_table"][1, 1] = -1
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    for fn in (mla_decode, mla_decode_reference):
        with pytest.raises(ValueError, match=r"block_table\[1, 1\] = -1 is not a block of kv_cache"):
            fn(**args)
    for k, v in before.items():
        torch.testing.assert_close(args[k], v, rtol=0, atol=0, equal_nan=True)


def test_multi_token_sm80_backend_refused():
    # the sm_80 stage 1 takes one new token a sequence: forcing it with s_q > 1 says so
    args = make_case([5, 40], heads=3, c=32, r=8, block_size=16, seed=57, s_q=2)
    with pytest.raises(ValueError, match=r"_backend='cuda-sm80' cannot run .*s_q = 2 new tokens"):
        mla_decode(**args, _backend="cuda-sm80")


def test_multi_token_sm90_backend_wants_only_a_gpu():
    # the wgmma stage 1 takes s_q > 1: on the CPU, forcing it fails for the lack of a GPU alone
    args = make_case([5, 40], heads=3, c=32, r=8, block_size=16, seed=57, s_q=2)
    with pytest.raises(ValueError, match=r"_backend='cuda-sm90' cannot run .*not a GPU") as error:
        mla_decode(**args, _backend="cuda-sm90")
    assert "s_q" not in str(error.value)


@pytest.mark.parametrize("heads", [16, 128])
def test_multi_token_default_is_the_wgmma_kernel(heads, monkeypatch):
    """The backend policy alone, so without a GPU: a stand-in q that says it is on one and CUDA
    kernels that say they can run. s_q > 1 picks "cuda-sm90" at any heads while
    ``backends.SM90_TAKES_QUERY_TOKENS_BY_DEFAULT`` is on, as it is by default, and "triton" with
    it off; forced, "cuda-sm90" takes it either way; s_q = 1 picks as the 3-d q does."""
    from types import SimpleNamespace

    from mla.kernels import backends

    monkeypatch.setattr(backends, "why_backend_cannot_run", lambda *args, **kwargs: None)
    case = make_case([5, 40], heads=1, c=32, r=8, block_size=16, seed=58)

    def pick(shape, **options):
        q = SimpleNamespace(device=torch.device("cuda"), shape=shape, dtype=torch.bfloat16)
        return backends.choose_decode_backend(q, case["kv_cache"], case["block_table"], case["seq_lens"],
                                              kv_lora_rank=512, **options)

    one_token = "cuda-sm80" if heads <= backends.SM80_MAX_HEADS else "cuda-sm90"
    assert pick((2, heads, 576)) == pick((2, 1, heads, 576)) == one_token  # the stand-in reaches the CUDA choice
    assert backends.SM90_TAKES_QUERY_TOKENS_BY_DEFAULT
    assert pick((2, 4, heads, 576)) == "cuda-sm90"
    monkeypatch.setattr(backends, "SM90_TAKES_QUERY_TOKENS_BY_DEFAULT", False)
    for s_q in (2, 8):
        assert pick((2, s_q, heads, 576)) == "triton"
        assert pick((2, s_q, heads, 576), backend="cuda-sm90") == "cuda-sm90"
    assert pick((2, 1, heads, 576)) == one_token


def _sm90_stage1_in_torch(q, kv_cache, block_table, seq_lens, part_out, part_lse, softmax_scale, num_splits, *,
                          kv_cache_dtype, kv_scale, q_tokens=1, out, lse, ranges):
    """What csrc/mla_decode_sm90.cu writes as mla_decode launches it, in plain torch (float64): q
    (b, s_q·h, c + r) token-major, row R seeing the first seq_len - (s_q - 1 - R / h) rows; a row
    that sees none of a piece gets 0 and -inf. The batch's pairs of tiles of 64 tokens (an empty
    sequence counts one) are dealt over num_splits pieces of ceil(pairs / num_splits): piece z's
    part of sequence i goes to slot i + z, a sequence whole in one piece to out and lse, and
    ranges[i] = (first slot, pieces)."""
    assert kv_cache_dtype == "auto" and kv_scale is None
    b, rows, _ = q.shape
    c, heads, block_size = part_out.shape[-1], rows // q_tokens, kv_cache.shape[1]
    lengths = seq_lens.tolist()

    def attend(i, start, end, dst_out, dst_lse):  # rows of sequence i over tokens [start, end)
        seq_len = lengths[i]
        pos = torch.arange(seq_len)
        latent = kv_cache[block_table[i, pos // block_size].long(), pos % block_size].double()  # (t, c + r)
        for row in range(rows):
            stop = min(end, seq_len - (q_tokens - 1 - row // heads))
            if stop <= start:
                dst_out[row], dst_lse[row] = 0.0, float("-inf")
                continue
            scores = latent[start:stop] @ q[i, row].double() * softmax_scale  # (tokens,)
            dst_out[row] = (torch.softmax(scores, 0) @ latent[start:stop, :c]).to(dst_out.dtype)
            dst_lse[row] = torch.logsumexp(scores, 0).float()

    pairs = [max(1, (-(-n // 64) + 1) // 2) for n in lengths]
    per = -(-sum(pairs) // num_splits)
    first_pair = 0
    for i, (seq_len, n) in enumerate(zip(lengths, pairs)):
        first, last = first_pair // per, (first_pair + n - 1) // per
        ranges[i, 0], ranges[i, 1] = i + first, last - first + 1
        for piece in range(first, last + 1):
            lo, hi = max(piece * per, first_pair) - first_pair, min((piece + 1) * per, first_pair + n) - first_pair
            start = 2 * lo * 64
            end = max(min(2 * hi * 64, seq_len), start)
            if first == last:
                attend(i, start, end, out[i], lse[i])
            else:
                attend(i, start, end, part_out[i + piece], part_lse[i + piece])
        first_pair += n


@pytest.mark.parametrize("strided_q", [False, True], ids=["q-contiguous", "q-head-major"])
def test_multi_token_sm90_dispatch(strided_q, monkeypatch):
    # mla_decode's launch of the wgmma stage 1 for s_q > 1, with the kernel written in torch
    # (_sm90_stage1_in_torch): q as (b, s_q·h, c + r) rows, out / lse (b, s_q·h, ...) with the
    # slots (pieces, s_q·h, ...), s_q passed on, and the merge over the rows; the GPU tests run the
    # kernel itself
    calls = []

    def stage1(q, *args, **kwargs):
        calls.append((tuple(q.shape), kwargs["q_tokens"]))
        _sm90_stage1_in_torch(q, *args, **kwargs)

    monkeypatch.setattr(decode, "choose_decode_backend", lambda *args, **kwargs: "cuda-sm90")
    monkeypatch.setattr(torch.ops.mla, "mla_decode_sm90", stage1, raising=False)
    s_q, heads = 4, 3
    case = make_case([0, 2, 3, 64, 130], heads=heads, c=32, r=8, block_size=64, seed=59, s_q=s_q)
    if strided_q:  # (b, h, s_q, d) memory: not a view of (b, s_q·h, d)
        case["q"] = case["q"].transpose(1, 2).contiguous().transpose(1, 2)
    ref_out, ref_lse = mla_decode_reference(**case)
    for splits in (1, 3):
        out, lse = mla_decode(**case, num_kv_splits=splits)
        assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
        assert_tokens_match(out, lse, ref_out, ref_lse, case["seq_lens"], s_q, TOL[torch.float32])
        assert calls[-1] == ((5, s_q * heads, 40), s_q)


@pytest.mark.parametrize("s_q, heads", [(1, 2), (2, 2), (2, 9)])  # 18 rows: the one-split merge's 8-row blocks
def test_sm90_dealt_pieces_merge_to_the_reference(s_q, heads, monkeypatch):
    # mla_decode's launch of the wgmma stage 1, the kernel written in torch:
    # the batch's tiles dealt over b x num_kv_splits pieces, so that a piece holds the ends of
    # several sequences (short and empty ones) and a long sequence spans many pieces. Every slot,
    # out and lse start NaN and ranges garbage, so whatever stage 1 and the merge leave unwritten
    # or read past shows.
    pieces = []

    def stage1(q, kv_cache, block_table, seq_lens, part_out, part_lse, scale, num_splits, **kwargs):
        for t in (part_out, part_lse, kwargs["out"], kwargs["lse"]):
            t.fill_(float("nan"))
        kwargs["ranges"].fill_(-7)
        pieces.append((num_splits, part_out.shape[0]))
        _sm90_stage1_in_torch(q, kv_cache, block_table, seq_lens, part_out, part_lse, scale, num_splits, **kwargs)

    monkeypatch.setattr(decode, "choose_decode_backend", lambda *args, **kwargs: "cuda-sm90")
    monkeypatch.setattr(torch.ops.mla, "mla_decode_sm90", stage1, raising=False)
    lengths = [0, 700, 64, 1, 2000, 130, 0, 4096, 65]
    case = make_case(lengths, heads=heads, c=32, r=8, block_size=64, seed=61, s_q=s_q)
    ref_out, ref_lse = mla_decode_reference(**case)
    # 40: 360 pieces for 61 pairs, one a piece and the rest idle; 8000: pieces capped at a grid's 65535
    for splits in (1, 2, 3, 7, 40, 8000):
        out, lse = mla_decode(**case, num_kv_splits=splits)
        expected = min(9 * splits, 65535)
        assert pieces[-1] == (expected, expected + 8)  # b + pieces - 1 slots
        assert_tokens_match(out, lse, ref_out, ref_lse, case["seq_lens"], s_q, TOL[torch.float32])


@pytest.mark.parametrize("num_kv_splits", [1, 3])  # the one-split tiling (row blocks) and the other (a row a program)
def test_merge_dealt_weighs_each_sequences_slots_by_their_lse(num_kv_splits):
    # _merge_dealt alone, on slots laid out by hand: sequences over 1, 2, 5, 1 and 33 slots, 18
    # rows (the last row block partial). Among the slots: an empty piece (lse -inf in every row),
    # a row empty in every slot (out 0, lse -inf), a NaN lse (that row's out and lse NaN, the
    # others untouched by it) and lse values near 300, whose exp overflows float32 unless taken
    # against the largest. A sequence in one slot is stage 1's to write: the merge leaves it.
    gen = torch.Generator().manual_seed(5)
    rows, c, counts = 18, 40, [1, 2, 5, 1, 33]
    b, firsts = len(counts), [len(counts) + sum(counts[:i]) for i in range(len(counts))]
    part_out = torch.randn((b + sum(counts), rows, c), generator=gen)
    part_lse = 4 * torch.randn((b + sum(counts), rows), generator=gen)
    part_lse[firsts[2] + 1] = float("-inf")  # an empty piece
    part_lse[firsts[4]:firsts[4] + 33, 3] = float("-inf")  # row 3 sees no token in any piece
    part_lse[firsts[1] + 1, 5] = float("nan")
    part_lse[firsts[4]:firsts[4] + 33] += 300.0
    part_lse[firsts[4] + 30, 7] += 100.0  # one row's largest lse in a late slot, far above its others
    ranges = torch.tensor(list(zip(firsts, counts)), dtype=torch.int32)
    out = torch.full((b, rows, c), 7.0)
    lse = torch.full((b, rows), 7.0)
    decode._merge_dealt(part_out, part_lse, ranges, out, lse, num_kv_splits)
    for i, (first, count) in enumerate(zip(firsts, counts)):
        if count == 1:
            assert (out[i] == 7.0).all() and (lse[i] == 7.0).all()
            continue
        lse_s = part_lse[first:first + count].double()  # (count, rows)
        parts = part_out[first:first + count].double()
        want_lse = torch.logsumexp(lse_s, 0)
        want_out = (torch.softmax(lse_s, 0)[:, :, None] * parts).sum(0)
        empty = torch.isneginf(lse_s).all(0)
        want_out[empty], want_lse[empty] = 0.0, float("-inf")
        torch.testing.assert_close(out[i].double(), want_out, rtol=1e-5, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(lse[i].double(), want_lse, rtol=1e-6, atol=1e-4, equal_nan=True)
    assert out[1, 5].isnan().all() and lse[1, 5].isnan() and not out[1, 4].isnan().any()
    assert (out[4, 3] == 0).all() and torch.isneginf(lse[4, 3])

# ---------------------------------------------------------------------------------------------
# The split heuristic
# ---------------------------------------------------------------------------------------------


def test_plan_num_kv_splits_takes_the_tile_of_the_stage_1_it_plans_for():
    from mla.kernels.decode import default_config, plan_num_kv_splits

    assert plan_num_kv_splits("cuda-sm90", 1, 128, 32_768, 132) == choose_num_kv_splits(
        1, 128, 32_768, 132, block_h=64, block_n=64, one_wave=True) == 66
    assert plan_num_kv_splits("cuda-sm80", 64, 16, 4096, 132) == choose_num_kv_splits(
        64, 16, 4096, 132, block_h=16, block_n=32)
    # a CUDA stage 1's own tile, whatever Triton tile the caller holds
    assert plan_num_kv_splits("cuda-sm80", 1, 16, 512, 132, block_h=64, block_n=64) == 4
    for layout in ("auto", "fp8_e4m3", "fp8_ds_mla"):
        config = default_config(16, layout)
        assert plan_num_kv_splits("triton", 2, 16, 10_000, 132, kv_cache_dtype=layout) == choose_num_kv_splits(
            2, 16, 10_000, 132, block_h=config["BLOCK_H"], block_n=config["BLOCK_N"])
    assert plan_num_kv_splits("triton", 1, 16, 512, 132, block_h=16, block_n=32) == 4  # a tuned tile
    with pytest.raises(ValueError, match="backend must be one of"):
        plan_num_kv_splits("cuda-sm9O", 1, 16, 512, 132)


def test_choose_num_kv_splits():
    # 64-head blocks (compute bound): enough programs already, no split
    assert choose_num_kv_splits(64, 128, 100_000, 132) == 1  # 64 x 2 head blocks of 64
    assert choose_num_kv_splits(256, 64, 100_000, 132) == 1
    # 64-head blocks, small batch: the first count that keeps >= 90% of 132 SMs busy
    assert choose_num_kv_splits(1, 128, 32_768, 132) == 60  # 2 head blocks x 60 splits: 91%
    assert choose_num_kv_splits(4, 128, 131_072, 132) == 15  # 8 x 15 = 120 programs
    # one_wave (the wgmma kernel): the most splits that fit in one wave
    assert choose_num_kv_splits(1, 128, 32_768, 132, one_wave=True) == 66  # 2 x 66 = 132
    assert choose_num_kv_splits(4, 128, 131_072, 132, one_wave=True) == 16  # 8 x 16 = 128
    assert choose_num_kv_splits(4, 64, 131_072, 132, one_wave=True) == 33
    assert choose_num_kv_splits(1, 64, 131_072, 132, one_wave=True) == 128  # max_splits
    assert choose_num_kv_splits(1, 128, 2048, 132, one_wave=True) == 8  # >= 4 tiles of 64 a split
    assert choose_num_kv_splits(64, 128, 4096, 132, one_wave=True) == 1
    # 16-head blocks (memory bound): the most splits within one wave of 2 programs an SM
    assert choose_num_kv_splits(64, 16, 4096, 132) == 4  # 256 programs (H200: 102 us vs 125 at 8)
    assert choose_num_kv_splits(16, 16, 4096, 132, block_n=32) == 16  # 256 programs, not 17 (272)
    assert choose_num_kv_splits(48, 16, 8192, 132) == 5  # 240, not 6 (288)
    assert choose_num_kv_splits(96, 16, 8192, 132) == 2  # 192, not 3 (288)
    # ... then the fewest splits of the same whole tiles: 33 of 128 tiles would be 32 of 4 and
    # one empty
    assert choose_num_kv_splits(8, 16, 8192, 132) == 32
    assert choose_num_kv_splits(8, 16, 8192, 132, block_n=32) == 32  # 33 of 256 tiles: 8 a split
    assert choose_num_kv_splits(128, 16, 8192, 132) == 2
    assert choose_num_kv_splits(64, 16, 4096, 132, programs_per_sm=4) == 8
    assert choose_num_kv_splits(264, 16, 100_000, 132) == 1  # already 2 an SM
    assert choose_num_kv_splits(2000, 16, 100_000, 132) == 1
    # one sequence, long: capped at max_splits
    assert choose_num_kv_splits(1, 16, 131_072, 132) == 128
    assert choose_num_kv_splits(1, 16, 131_072, 132, max_splits=64) == 64
    # short sequences: every split keeps >= 4 tiles of 64 tokens (16 heads' BLOCK_N)
    assert choose_num_kv_splits(1, 16, 512, 132) == 2
    assert choose_num_kv_splits(1, 16, 100, 132) == 1
    assert choose_num_kv_splits(1, 16, 512, 132, block_n=32) == 4
    assert choose_num_kv_splits(0, 16, 0, 132) == 1


@pytest.mark.parametrize("block_n", [32, 64])
def test_small_head_block_splits_fit_one_wave_in_whole_tiles(block_n):
    # every batch and length up to the caps: the programs of the chosen count fit one wave of 2
    # an SM (or it is 1 split), the count is at most the tiles over 4 (and 128), no split is
    # empty, and every larger count that shortens the splits passes the wave
    sms, wave = 132, 264
    for batch in [*range(1, 70), 96, 128, 200, 264, 300]:
        for t in (100, 512, 2048, 4000, 4001, 8191, 8192, 10_000, 32_768, 131_072):
            splits = choose_num_kv_splits(batch, 16, t, sms, block_h=16, block_n=block_n)
            tiles = math.ceil(t / block_n)
            most = max(1, min(128, t // (4 * block_n)))
            assert 1 <= splits <= most, (batch, t, splits)
            assert splits == 1 or batch * splits <= wave, (batch, t, splits)
            per = math.ceil(tiles / splits)
            assert math.ceil(tiles / per) == splits, (batch, t, splits)  # no empty split
            # the most such counts: a larger one that shortens the splits passes the wave
            more = next((s for s in range(splits + 1, most + 1) if math.ceil(tiles / s) < per), None)
            assert more is None or batch * more > wave, (batch, t, splits, more)


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error before anything runs, and nothing the caller gave is modified
# ---------------------------------------------------------------------------------------------


def _noncontiguous_last(t):
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


BAD_INPUTS = {
    "q-2d": (lambda a: a.update(q=a["q"][:, 0]), ValueError, "q must be"),
    "q-float64": (lambda a: a.update(q=a["q"].double()), TypeError, "q must be bfloat16"),
    "q-5d": (lambda a: a.update(q=a["q"][:, None, None]), ValueError, "q must be"),
    "q-s_q-0": (lambda a: a.update(q=a["q"][:, None][:, :0]), ValueError, r"q's dim 1 \(s_q"),
    "q-s_q-9": (lambda a: a.update(q=a["q"][:, None].expand(-1, 9, -1, -1)), ValueError,
                r"must be in \[1, 8\], got 9"),
    "q-rows-past-grid": (lambda a: a.update(q=a["q"].new_zeros(2, 8, 8192, 40)), ValueError,
                         "at most 65535 query rows"),
    "q-int": (lambda a: a.update(q=a["q"].int()), TypeError, "q must be bfloat16"),
    "q-not-tensor": (lambda a: a.update(q=a["q"].tolist()), TypeError, "q must be a torch.Tensor"),
    "q-strided-last-dim": (lambda a: a.update(q=_noncontiguous_last(a["q"])), ValueError, "q's last dim"),
    "kv-dtype": (lambda a: a.update(kv_cache=a["kv_cache"].half()), TypeError, "kv_cache must have q's dtype"),
    "kv-2d": (lambda a: a.update(kv_cache=a["kv_cache"][0]), ValueError, "kv_cache must be"),
    "kv-last-dim": (lambda a: a.update(kv_cache=a["kv_cache"][..., :-1]), ValueError, "kv_cache's last dim"),
    "kv-strided-last-dim": (
        lambda a: a.update(kv_cache=_noncontiguous_last(a["kv_cache"])),
        ValueError,
        "kv_cache's last dim must be contiguous",
    ),
    "kv-device": (lambda a: a.update(kv_cache=a["kv_cache"].to("meta")), ValueError, "kv_cache is on meta"),
    "bt-int64": (lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table must be int32"),
    "bt-batch": (lambda a: a.update(block_table=a["block_table"][:1]), ValueError, "block_table must be"),
    "bt-too-short": (lambda a: a.update(block_table=a["block_table"][:, :2]), ValueError, "block_table is too short"),
    "sl-int64": (lambda a: a.update(seq_lens=a["seq_lens"].long()), TypeError, "seq_lens must be int32"),
    "sl-shape": (lambda a: a.update(seq_lens=a["seq_lens"][None]), ValueError, "seq_lens must be"),
    "sl-negative": (lambda a: a["seq_lens"].__setitem__(0, -1), ValueError, "seq_lens must be >= 0"),
    "rank-0": (lambda a: a.update(kv_lora_rank=0), ValueError, "kv_lora_rank must be in"),
    "rank-all": (lambda a: a.update(kv_lora_rank=40), ValueError, "kv_lora_rank must be in"),
    "rank-too-big": (lambda a: a.update(kv_lora_rank=64), ValueError, "kv_lora_rank must be in"),
    "rank-float": (lambda a: a.update(kv_lora_rank=32.0), TypeError, "kv_lora_rank must be an int"),
    "scale-nan": (lambda a: a.update(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    "scale-str": (lambda a: a.update(softmax_scale="0.1"), TypeError, "softmax_scale must be a float"),
    "splits-0": (lambda a: a.update(num_kv_splits=0), ValueError, r"num_kv_splits must be in \[1, 65535\]"),
    "splits-negative": (lambda a: a.update(num_kv_splits=-2), ValueError, r"num_kv_splits must be in \[1, 65535\]"),
    "splits-past-grid": (lambda a: a.update(num_kv_splits=65536), ValueError, r"num_kv_splits must be in \[1, 65535\]"),
    "splits-float": (lambda a: a.update(num_kv_splits=2.5), TypeError, "num_kv_splits must be an int"),
    "config-key": (lambda a: a.update(_config={"BLOCK_M": 16}), ValueError, "unknown _config keys"),
    "backend-name": (lambda a: a.update(_backend="cutlass"), ValueError, "_backend must be None or one of"),
    "backend-old-name": (lambda a: a.update(_backend="sm90"), ValueError, "_backend must be None or one of"),
    # c = 32, r = 8 here (and on a CPU machine, q on the CPU): the CUDA stage 1 says why it cannot
    "backend-sm80-unfit": (lambda a: a.update(_backend="cuda-sm80"), ValueError, "_backend='cuda-sm80' cannot run"),
    "backend-sm90-unfit": (lambda a: a.update(_backend="cuda-sm90"), ValueError, "_backend='cuda-sm90' cannot run"),
    "backend-with-config": (lambda a: a.update(_backend="cuda-sm80", _config={"num_warps": 4}), ValueError,
                            "_config tunes the Triton kernel; it cannot go with _backend='cuda-sm80'"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input(name):
    mutate, error, message = BAD_INPUTS[name]
    args = make_case([5, 40], heads=3, c=32, r=8, block_size=16, seed=9)
    mutate(args)
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(error, match=message):
        mla_decode(**args)
    for k, v in before.items():
        torch.testing.assert_close(args[k], v, rtol=0, atol=0, equal_nan=True)
    if not name.startswith(("config-", "backend-")):  # the reference has neither hook
        args.pop("_config", None)
        with pytest.raises(error, match=message):
            mla_decode_reference(**args)


# Block-table values: a row reads entries 0 .. ceil(seq_len / block_size) - 1, and each must name a
# block of kv_cache. make_case([5, 40], block_size=16): row 0 reads entry 0, row 1 entries 0..2;
# the entries past those hold 10**6 and -7, which must pass.
BAD_ENTRIES = {
    "past-the-cache": (1, 2, "num_blocks"),
    "far-past-the-cache": (0, 0, 1_000_000),
    "minus-one-inside-seq-len": (1, 1, -1),
}


def set_bad_entry(args, name):
    """Write BAD_ENTRIES[name] into args' block table; return the error message expected."""
    i, j, value = BAD_ENTRIES[name]
    value = args["kv_cache"].shape[0] if value == "num_blocks" else value
    args["block_table"][i, j] = value
    return rf"block_table\[{i}, {j}\] = {value} is not a block of kv_cache"


@pytest.mark.parametrize("check_block_table", [None, True, False], ids=["default", "checked", "unchecked"])
@pytest.mark.parametrize("num_kv_splits", [None, 2], ids=["auto-splits", "fixed-splits"])
@pytest.mark.parametrize("name", list(BAD_ENTRIES))
def test_bad_block_table_entry_on_the_cpu(name, num_kv_splits, check_block_table):
    # the CPU checks whatever check_block_table says: an interpreted read past the cache crashes
    args = make_case([5, 40], heads=3, c=32, r=8, block_size=16, seed=9, device="cpu")
    message = set_bad_entry(args, name)
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=message):
        mla_decode(**args, num_kv_splits=num_kv_splits, check_block_table=check_block_table)
    with pytest.raises(ValueError, match=message):
        mla_decode_reference(**args)  # no wrapping of -1 to the last block either
    for k, v in before.items():
        torch.testing.assert_close(args[k], v, rtol=0, atol=0, equal_nan=True)


def test_empty_cache_is_refused():
    args = make_case([5, 40], heads=3, c=32, r=8, block_size=16, seed=9)
    args["kv_cache"] = args["kv_cache"][:0]
    for fn in (mla_decode, mla_decode_reference):
        with pytest.raises(ValueError, match="kv_cache has no blocks"):
            fn(**args)


def test_check_block_table_takes_a_bool():
    args = make_case([5, 40], heads=3, c=32, r=8, block_size=16, seed=9)
    with pytest.raises(TypeError, match="check_block_table must be True, False or None"):
        mla_decode(**args, check_block_table="yes")


def test_max_seq_len_picks_the_splits_a_read_of_seq_lens_would():
    # a host bound equal to max(seq_lens) chooses the same split count as reading seq_lens does,
    # so the output is bitwise the same; a bound below a row's seq_len is refused where checked
    args = make_case([5, 40, 130], heads=3, c=32, r=8, block_size=16, seed=9)
    out, lse = mla_decode(**args)
    hinted_out, hinted_lse = mla_decode(**args, max_seq_len=130)
    assert torch.equal(out, hinted_out) and torch.equal(lse, hinted_lse)
    with pytest.raises(ValueError, match="above max_seq_len=100"):
        mla_decode(**args, max_seq_len=100)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="max_seq_len must be None or an int"):
            mla_decode(**args, max_seq_len=bad)


@pytest.mark.parametrize("num_kv_splits", [None, 3])
def test_bf16_matches_reference(num_kv_splits):
    # on the CPU the interpreter's bf16 dot is wrong, so mla_decode runs fp32 copies there
    case = make_case([0, 1, 37, 200, 16], heads=3, c=32, r=8, block_size=16, dtype=torch.bfloat16, seed=12)
    before = {k: v.clone() for k, v in case.items() if isinstance(v, torch.Tensor)}
    out, lse = mla_decode(**case, num_kv_splits=num_kv_splits)
    ref_out, ref_lse = mla_decode_reference(**case)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # bf16 inputs are exact in both; out is rounded to bf16 (2^-9 relative) at the end
    assert_matches(out.float(), lse, ref_out.float(), ref_lse, case["seq_lens"], 1e-2)
    for k, v in before.items():
        torch.testing.assert_close(case[k], v, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# GPU: bf16 at DeepSeek-V3 shapes (c = 512, r = 64, page 64), caches past 2^31 elements, graphs
# ---------------------------------------------------------------------------------------------

V3 = dict(c=512, r=64, block_size=64)


def _gpu_case(seq_lens, heads, seed=0, dtype=torch.bfloat16, block_size=V3["block_size"], s_q=None):
    """make_case's layout built on the GPU directly (the CPU build is slow at 32k-token lengths);
    q (b, heads, c + r), or (b, s_q, heads, c + r) when s_q is given."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    c, r = V3["c"], V3["r"]
    b, d = len(seq_lens), c + r
    pages_needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(pages_needed) + 3
    max_blocks = max(pages_needed) + 2
    order = torch.randperm(num_blocks, device="cuda", generator=gen).int()
    kv_cache = torch.full((num_blocks, block_size, d), float("nan"), device="cuda", dtype=dtype)
    block_table = torch.full((b, max_blocks), GARBAGE_PAGES[0], dtype=torch.int32, device="cuda")
    start = 0
    for i, (n, pages) in enumerate(zip(seq_lens, pages_needed)):
        blocks = order[start : start + pages]
        start += pages
        block_table[i, :pages] = blocks
        pos = torch.arange(n, device="cuda")
        rows = torch.randn(n, d, device="cuda", generator=gen).to(dtype)
        kv_cache[blocks[pos // block_size].long(), pos % block_size] = rows
    q_shape = (b, heads, d) if s_q is None else (b, s_q, heads, d)
    q = torch.randn(q_shape, device="cuda", generator=gen).to(dtype)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return dict(
        q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens, kv_lora_rank=c, softmax_scale=192**-0.5
    )


def _random_lengths(b, max_len, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, max_len + 1, (b,), generator=gen).tolist()


GPU_SHAPES = {
    "b4-h16-32k": (16, [1, 64, 4097, 32768]),
    "b2-h128-32k": (128, [32768, 17]),
    "b16-h64-8k": (64, _random_lengths(16, 8192, 0)),
    "b128-h128-2k": (128, _random_lengths(128, 2048, 1)),
    "b128-h16-4k-with-empty": (16, [0] + _random_lengths(127, 4096, 2)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "triton"], ids=["default", "triton"])
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_gpu_bf16_deepseek_v3_shapes(name, backend):
    heads, seq_lens = GPU_SHAPES[name]
    case = _gpu_case(seq_lens, heads)
    out, lse = mla_decode(**case, _backend=backend)
    ref_out, ref_lse = mla_decode_reference(**case, compute_dtype=torch.float32)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_matches(out.float(), lse, ref_out.float(), ref_lse, case["seq_lens"], 1e-2)
    # split counts agree with each other (1 split is the no-merge path)
    out1, lse1 = mla_decode(**case, num_kv_splits=1, _backend=backend)
    out7, lse7 = mla_decode(**case, num_kv_splits=7, _backend=backend)
    assert rel_err(out1, out7) < 1e-2
    assert_matches(out1.float(), lse1, ref_out.float(), ref_lse, case["seq_lens"], 1e-2)
    assert_matches(out7.float(), lse7, ref_out.float(), ref_lse, case["seq_lens"], 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "triton"], ids=["default", "triton"])
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_cache_past_int32_offsets(heads, backend):
    # num_blocks * 64 * 576 > 2^31 elements (~4.3 GB in bf16); the sequences' pages sit at the end
    block_size, d, c = 64, 576, 512
    num_blocks = 2**31 // (block_size * d) + 40
    assert num_blocks * block_size * d > 2**31
    kv_cache = torch.full((num_blocks, block_size, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    seq_lens = [1000, 1]
    pages = [math.ceil(n / block_size) for n in seq_lens]
    block_table = torch.full((2, 20), -7, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    end = num_blocks
    for i, (n, p) in enumerate(zip(seq_lens, pages)):
        blocks = torch.arange(end - p, end, device="cuda", dtype=torch.int32).flip(0)  # reversed, at the end
        end -= p
        block_table[i, :p] = blocks
        pos = torch.arange(n, device="cuda")
        kv_cache[blocks[pos // block_size].long(), pos % block_size] = torch.randn(
            n, d, device="cuda", generator=gen
        ).to(torch.bfloat16)
    assert int(block_table.max()) * block_size * d > 2**31  # the last page's offset needs int64
    case = dict(
        q=torch.randn(2, heads, d, device="cuda", generator=gen).to(torch.bfloat16),
        kv_cache=kv_cache,
        block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        kv_lora_rank=c,
        softmax_scale=192**-0.5,
    )
    for splits in (None, 1, 3):
        out, lse = mla_decode(**case, num_kv_splits=splits, _backend=backend)
        ref_out, ref_lse = mla_decode_reference(**case, compute_dtype=torch.float32)
        assert_matches(out.float(), lse, ref_out.float(), ref_lse, case["seq_lens"], 1e-2)
    del kv_cache, case
    torch.cuda.empty_cache()


def captured(call):
    """(graph, outputs, expected) for a call that takes no host reads: `call()` run eagerly
    (which also compiles its kernels), then captured in a CUDA graph on a side stream and
    replayed once; `outputs` are the graph's static outputs, `expected` the eager call's."""
    expected = call()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
        with torch.cuda.graph(graph):
            outputs = call()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return graph, outputs, expected


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "triton"], ids=["default", "triton"])
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_cuda_graph_capture(heads, backend):
    # with num_kv_splits given the wrapper never syncs, so it can be captured in a CUDA graph
    case = _gpu_case([100, 3000, 0, 64], heads=heads, seed=3)
    _, (out, lse), expected = captured(lambda: mla_decode(**case, num_kv_splits=4, _backend=backend))
    torch.testing.assert_close(out, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(lse, expected[1], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "triton"], ids=["default", "triton"])
@pytest.mark.parametrize("name", list(BAD_ENTRIES))
def test_gpu_bad_block_table_entry_is_caught_where_checked(name, backend):
    # checked by default when num_kv_splits is None (seq_lens are read on the host anyway), and
    # with check_block_table=True when it is given; the unchecked fast path is not run here
    case = _gpu_case([70, 300], 16)
    message = set_bad_entry(case, name)
    before = {k: v.clone() for k, v in case.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=message):
        mla_decode(**case, _backend=backend)
    with pytest.raises(ValueError, match=message):
        mla_decode(**case, num_kv_splits=3, check_block_table=True, _backend=backend)
    for k, v in before.items():
        torch.testing.assert_close(case[k], v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
def test_gpu_checked_and_unchecked_calls_agree():
    case = _gpu_case([70, 300, 0], 16, seed=5)
    out1, lse1 = mla_decode(**case, num_kv_splits=3, check_block_table=True)
    out2, lse2 = mla_decode(**case, num_kv_splits=3, check_block_table=False)
    torch.testing.assert_close(out1, out2, rtol=0, atol=0)
    torch.testing.assert_close(lse1, lse2, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_no_host_read_inside_a_graph_capture():
    # a check or a split choice would read seq_lens on the host: refused with a clear error
    case = _gpu_case([100, 3000], heads=16, seed=3)
    mla_decode(**case, num_kv_splits=4)  # compiles outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for options in (dict(num_kv_splits=4, check_block_table=True), dict(num_kv_splits=None)):
            with pytest.raises(ValueError, match="CUDA graph capture"):
                with torch.cuda.graph(torch.cuda.CUDAGraph()):
                    mla_decode(**case, **options)
    torch.cuda.current_stream().wait_stream(stream)


@pytest.mark.gpu
def test_gpu_max_seq_len_captures_without_a_split_count():
    # with a host bound the split choice reads nothing on the device: it captures, and the
    # replay equals the eager call with the same bound
    case = _gpu_case([100, 3000], heads=16, seed=4)
    want_out, want_lse = mla_decode(**case, max_seq_len=3000)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = mla_decode(**case, max_seq_len=3000)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


# ---------------------------------------------------------------------------------------------
# GPU: several new tokens a sequence, bf16 at DeepSeek-V3's sizes; the Triton kernel runs them
# ---------------------------------------------------------------------------------------------

# lengths shorter than 8 new tokens (tokens that see nothing), around the tiles and pages, long
MULTI_TOKEN_GPU_LENGTHS = [0, 1, 3, 7, 64, 65, 1000, 5000]


@pytest.mark.gpu
@pytest.mark.parametrize("s_q", [1, 2, 4, 8])
@pytest.mark.parametrize("heads", [1, 3, 16, 20, 64, 128])
def test_gpu_multi_token_bf16_matches_reference(heads, s_q):
    case = _gpu_case(MULTI_TOKEN_GPU_LENGTHS, heads, seed=heads + s_q, s_q=s_q)
    ref_out, ref_lse = mla_decode_reference(**case, compute_dtype=torch.float32)
    for splits in (None, 1, 5, 40):  # 40 splits: most splits of the short rows are empty
        out, lse = mla_decode(**case, num_kv_splits=splits)
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        assert out.shape == (len(MULTI_TOKEN_GPU_LENGTHS), s_q, heads, 512) and lse.shape == out.shape[:3]
        assert_tokens_match(out.float(), lse, ref_out.float(), ref_lse, case["seq_lens"], s_q, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_one_token_4d_is_3d(heads):
    # s_q = 1 as (b, 1, h, c + r) runs the kernel the 3-d call runs (a CUDA one where it applies)
    case = _gpu_case([70, 300, 0, 1000], heads, seed=9)
    case4 = dict(case, q=case["q"].unsqueeze(1))
    for splits in (None, 1, 3):
        out3, lse3 = mla_decode(**case, num_kv_splits=splits)
        out4, lse4 = mla_decode(**case4, num_kv_splits=splits)
        assert out4.shape == (4, 1, heads, 512) and lse4.shape == (4, 1, heads)
        torch.testing.assert_close(out4[:, 0], out3, rtol=0, atol=0)
        torch.testing.assert_close(lse4[:, 0], lse3, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_multi_token_runs_on_the_wgmma_kernel_on_hopper(heads):
    # s_q > 1 picks the wgmma stage 1 by default on compute capability 9.0, Triton elsewhere; the
    # sm_80 stage 1 takes one new token; s_q = 1 is judged as the 3-d q
    from mla.kernels.backends import why_backend_cannot_run

    case = _gpu_case([70, 300], heads, s_q=2)
    args = (case["kv_cache"], case["block_table"], case["seq_lens"])
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert choose_decode_backend(case["q"], *args, kv_lora_rank=512) == ("cuda-sm90" if hopper else "triton")
    one = case["q"][:, :1]
    assert choose_decode_backend(one, *args, kv_lora_rank=512) == choose_decode_backend(one[:, 0], *args,
                                                                                        kv_lora_rank=512)
    for backend in ("cuda-sm80", "cuda-sm90"):
        assert why_backend_cannot_run(backend, one, *args, 512) == why_backend_cannot_run(backend, one[:, 0], *args,
                                                                                          512)
    assert "s_q = 2 new tokens" in why_backend_cannot_run("cuda-sm80", case["q"], *args, 512)
    with pytest.raises(ValueError, match=r"_backend='cuda-sm80' cannot run .*s_q = 2 new tokens"):
        mla_decode(**case, _backend="cuda-sm80")
    sm90_why = why_backend_cannot_run("cuda-sm90", case["q"], *args, 512)
    assert (sm90_why is None) if hopper else "not 9.0" in sm90_why
    out, lse = mla_decode(**case)
    backend = "cuda-sm90" if hopper else "triton"
    out_b, lse_b = mla_decode(**case, _backend=backend)
    torch.testing.assert_close(out, out_b, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_b, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "cuda-sm90"], ids=["default", "sm90"])
@pytest.mark.parametrize("s_q", [2, 4, 8])
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_multi_token_cuda_graph_capture(heads, s_q, backend):
    # with num_kv_splits given, a call of several new tokens captures too; replayed after q and
    # seq_lens change in place, the graph computes the new step
    if backend == "cuda-sm90":
        _skip_unless_sm90()
    case = _gpu_case([100, 3000, 0, 64, 5], heads=heads, seed=4, s_q=s_q)
    graph, (out, lse), expected = captured(lambda: mla_decode(**case, num_kv_splits=4, _backend=backend))
    torch.testing.assert_close(out, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(lse, expected[1], rtol=0, atol=0)
    # the next step: new queries, shorter lengths (pages already filled), one row below s_q
    gen = torch.Generator(device="cuda").manual_seed(5)
    case["q"].copy_(torch.randn(case["q"].shape, device="cuda", generator=gen).to(case["q"].dtype))
    case["seq_lens"].copy_(torch.tensor([97, 2999, 0, 1, 5], dtype=torch.int32, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = mla_decode_reference(**case, compute_dtype=torch.float32)
    assert_tokens_match(out.float(), lse, ref_out.float(), ref_lse, case["seq_lens"], s_q, 1e-2)


# ---------------------------------------------------------------------------------------------
# GPU: the CUDA stage-1 kernels mla_decode picks: csrc/mla_decode_sm80.cu for <= 16 heads,
# csrc/mla_decode_sm90.cu (compute capability 9.0) for more; the Triton one beside them
# ---------------------------------------------------------------------------------------------

# lengths around the 32-token tile and the pages, an empty row, and two long ones
CUDA_LENGTHS = [0, 1, 31, 32, 33, 64, 65, 1000, 5000, 127]


def _skip_unless_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma stage 1 (csrc/mla_decode_sm90.cu) runs on compute capability 9.0 only")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda-sm80", "cuda-sm90", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", [1, 3, 16, 20, 64, 100, 128])
@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_gpu_backends_match_reference(backend, dtype, heads, block_size):
    if backend == "cuda-sm80" and heads > 16:
        pytest.skip("the sm_80 CUDA stage 1 takes <= 16 heads")
    if backend == "cuda-sm90":
        _skip_unless_sm90()
        if block_size % 64:
            pytest.skip("the wgmma stage 1 takes pages of a multiple of 64")
    case = _gpu_case(CUDA_LENGTHS, heads, seed=heads + block_size, dtype=dtype, block_size=block_size)
    ref_out, ref_lse = mla_decode_reference(**case, compute_dtype=torch.float32)
    for splits in (None, 1, 5, 40):  # 40 splits: most splits of the short rows are empty
        out, lse = mla_decode(**case, num_kv_splits=splits, _backend=backend)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert_matches(out.float(), lse, ref_out.float(), ref_lse, case["seq_lens"], 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda-sm80", "cuda-sm90", "triton"])
@pytest.mark.parametrize("scale", [-0.3, 0.0, 2.0])
def test_gpu_backends_take_any_softmax_scale(backend, scale):
    # the wgmma kernel takes the row max before scaling when the scale is positive, and scales
    # first otherwise: a negative scale turns the max into a min, a zero one makes every weight equal
    if backend == "cuda-sm90":
        _skip_unless_sm90()
    heads = 16 if backend == "cuda-sm80" else 64
    case = dict(_gpu_case([1, 70, 300, 1000], heads, seed=7), softmax_scale=scale * 192**-0.5)
    ref_out, ref_lse = mla_decode_reference(**case, compute_dtype=torch.float32)
    for splits in (None, 3):
        out, lse = mla_decode(**case, num_kv_splits=splits, _backend=backend)
        assert_matches(out.float(), lse, ref_out.float(), ref_lse, case["seq_lens"], 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("s_q", [1, 2])
def test_gpu_sm90_deals_a_ragged_batch(s_q):
    # the wgmma stage 1 deals the batch's tiles over b x num_kv_splits pieces:
    # here pieces that hold the ends of several sequences (short and empty ones among them) and
    # sequences that span several pieces, 128 heads, NaN in every unused page row
    _skip_unless_sm90()
    lengths = [4096, 0, 100, 9000, 64, 1, 2500, 640, 65, 12000]
    case = _gpu_case(lengths, 128, seed=17, dtype=torch.bfloat16, s_q=s_q)
    before = {k: v.clone() for k, v in case.items() if isinstance(v, torch.Tensor)}
    ref_out, ref_lse = mla_decode_reference(**case, compute_dtype=torch.float32)
    for splits in (1, 2, 3, 13):
        out, lse = mla_decode(**case, num_kv_splits=splits, _backend="cuda-sm90")
        if s_q == 1:
            out, lse = out.unsqueeze(1), lse.unsqueeze(1)
        assert_tokens_match(out.float(), lse, ref_out.float().reshape(out.shape), ref_lse.reshape(lse.shape),
                            case["seq_lens"], s_q, 1e-2)
    for k, v in before.items():  # the inputs as they were (the cache's NaN rows included)
        assert torch.equal(case[k].nan_to_num(7.0), v.nan_to_num(7.0)), k


# ---------------------------------------------------------------------------------------------
# GPU: the wgmma stage 1 on several new tokens a sequence (_backend="cuda-sm90"; the default for
# s_q > 1 on compute capability 9.0: backends.SM90_TAKES_QUERY_TOKENS_BY_DEFAULT)
# ---------------------------------------------------------------------------------------------


def _sm90_token_lengths(s_q):
    """Rows shorter than s_q (tokens that see nothing: 0, 1, s_q - 1), s_q itself, around the
    64-token tile and its pairs (a causal limit inside a tile, on its edge, in a second tile),
    a page edge of 128, two long ones."""
    return sorted({0, 1, s_q - 1, s_q, 63, 64, 65, 66, 127, 128, 129, 191, 1000, 3000})


def _assert_agrees_with_triton(out, lse, out_t, lse_t):
    """The same rows see nothing (-inf, 0), the rest within bf16 rounding of the Triton kernel."""
    assert torch.equal(lse.isinf(), lse_t.isinf()) and not lse.isnan().any() and not out.isnan().any()
    assert (out[lse.isinf()] == 0).all()
    seen = ~lse_t.isinf()
    if seen.any():
        assert (out[seen].float() - out_t[seen].float()).abs().max() <= 1e-2 * out_t[seen].float().abs().max()
        assert (lse[seen] - lse_t[seen]).abs().max().item() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", [16, 20, 64, 128])
@pytest.mark.parametrize("s_q", [2, 3, 4, 8])
def test_gpu_sm90_query_tokens_match_reference_and_triton(s_q, heads, dtype):
    # s_q x heads rows: 32 (a partial tile) to 1024 (16 tiles); 20 heads put a token's rows across
    # two tiles; pages of 64 and 128
    _skip_unless_sm90()
    for block_size in (64, 128):
        case = _gpu_case(_sm90_token_lengths(s_q), heads, seed=heads + s_q, dtype=dtype, block_size=block_size,
                         s_q=s_q)
        before = {k: v.clone() for k, v in case.items() if isinstance(v, torch.Tensor)}
        ref_out, ref_lse = mla_decode_reference(**case, compute_dtype=torch.float32)
        for splits in (None, 1, 5, 40):  # 40 splits: most splits of the short rows are empty
            out, lse = mla_decode(**case, num_kv_splits=splits, _backend="cuda-sm90")
            assert out.dtype == dtype and lse.dtype == torch.float32
            assert out.shape == (len(case["seq_lens"]), s_q, heads, 512) and lse.shape == out.shape[:3]
            assert_tokens_match(out.float(), lse, ref_out.float(), ref_lse, case["seq_lens"], s_q, 1e-2)
            _assert_agrees_with_triton(out, lse, *mla_decode(**case, num_kv_splits=splits, _backend="triton"))
        for k, v in before.items():
            torch.testing.assert_close(case[k], v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_sm90_query_tokens_any_q_layout_and_scale(heads):
    # q laid out (b, h, s_q, d) (mla_decode packs a copy), and softmax scales <= 0 (the kernel
    # scales before the row max): the rows that see nothing still give 0 and -inf
    _skip_unless_sm90()
    s_q = 4
    case = _gpu_case(_sm90_token_lengths(s_q), heads, seed=11, s_q=s_q)
    case["q"] = case["q"].transpose(1, 2).contiguous().transpose(1, 2)
    for scale in (192**-0.5, 0.0, -0.3 * 192**-0.5):
        scaled = dict(case, softmax_scale=scale)
        ref_out, ref_lse = mla_decode_reference(**scaled, compute_dtype=torch.float32)
        for splits in (None, 3):
            out, lse = mla_decode(**scaled, num_kv_splits=splits, _backend="cuda-sm90")
            assert_tokens_match(out.float(), lse, ref_out.float(), ref_lse, case["seq_lens"], s_q, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("s_q", [2, 4])
def test_gpu_sm90_query_tokens_fp8_ds_mla(s_q, heads):
    # the per-row masks sit in the softmax stage, the fp8 tiles are dequantised before it: the
    # fp8_ds_mla instantiation against the reference on the dequantised cache and against Triton
    from tests.test_kernels_decode_fp8 import SM90_LENGTHS, _check_against_reference_and_triton, make_fp8_case

    _skip_unless_sm90()
    lengths = sorted(set(SM90_LENGTHS) | {s_q - 1, s_q})
    args, _, _, _ = make_fp8_case("fp8_ds_mla", lengths, heads=heads, c=512, r=64, block_size=64, s_q=s_q,
                                  seed=12 + s_q, device="cuda", poison=0xFF, group_growth=2.0)
    args["q"] = args["q"].bfloat16()
    _check_against_reference_and_triton(args, "cuda-sm90", (None, 1, 5))


@pytest.mark.gpu
def test_gpu_sm80_kernel_both_launch_shapes():
    # csrc/mla_decode_sm80.cu runs 4 tiles deep, one CTA an SM, when b * splits fits on the SMs
    # (and the GPU allows its 176 KiB of shared memory a block: an H100 / H200 does, an A100 not),
    # and 2 deep, two CTAs an SM, above that: split counts on both sides of the line, partial
    # buffers NaN-filled so that a slot left unwritten shows
    from mla.kernels.extension import load_extension

    assert load_extension()["decode"]
    heads, b = 16, len(CUDA_LENGTHS)
    case = _gpu_case(CUDA_LENGTHS, heads, seed=11)
    ref_out, ref_lse = mla_decode_reference(**case, compute_dtype=torch.float32)
    wave = torch.cuda.get_device_properties(0).multi_processor_count // b
    for splits in (wave, wave + 1):
        part_out = torch.full((b, heads, splits, 512), float("nan"), device="cuda")
        part_lse = torch.full((b, heads, splits), float("nan"), device="cuda")
        torch.ops.mla.mla_decode_sm80(case["q"], case["kv_cache"], case["block_table"], case["seq_lens"], part_out,
                                      part_lse, float(case["softmax_scale"]), splits)
        out = torch.empty((b, heads, 512), dtype=torch.bfloat16, device="cuda")
        lse = torch.empty((b, heads), device="cuda")
        decode._merge(part_out, part_lse, out, lse)
        assert_matches(out.float(), lse, ref_out.float(), ref_lse, case["seq_lens"], 1e-2)
        out2, lse2 = mla_decode(**case, num_kv_splits=splits)  # the public call takes the same path
        torch.testing.assert_close(out2, out, rtol=0, atol=0)
        torch.testing.assert_close(lse2, lse, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_cuda_backend_is_the_default_where_it_applies():
    case = _gpu_case([70, 300], 16)
    pick = lambda **kw: choose_decode_backend(  # noqa: E731
        kw.get("q", case["q"]), kw.get("kv_cache", case["kv_cache"]), kw.get("block_table", case["block_table"]),
        case["seq_lens"], kv_lora_rank=512, backend=kw.get("backend"), tuned=kw.get("config", False),
    )
    assert pick() == "cuda-sm80"
    assert pick(q=case["q"].half(), kv_cache=case["kv_cache"].half()) == "cuda-sm80"
    assert pick(config=True) == "triton"  # a _config tunes the Triton kernel
    assert pick(backend="triton") == "triton"
    wide = _gpu_case([70, 300], 20)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert pick(q=wide["q"]) == ("cuda-sm90" if hopper else "triton")  # more than 16 heads: the wgmma kernel
    with pytest.raises(ValueError, match="20 heads, more than 16"):
        pick(q=wide["q"], backend="cuda-sm80")
    if hopper:
        assert pick(backend="cuda-sm90") == "cuda-sm90"  # it runs 16 heads too (padded), when asked
        assert pick(q=wide["q"], kv_cache=_gpu_case([70, 300], 20, block_size=32)["kv_cache"]) == "triton"
        with pytest.raises(ValueError, match="block size 32 is not a multiple of 64"):
            pick(kv_cache=_gpu_case([70, 300], 16, block_size=32)["kv_cache"], backend="cuda-sm90")
    else:
        with pytest.raises(ValueError, match="not 9.0"):
            pick(q=wide["q"], backend="cuda-sm90")
    small_pages = _gpu_case([70, 300], 16, block_size=16)
    assert pick(kv_cache=small_pages["kv_cache"]) == "triton"
    with pytest.raises(ValueError, match="block size 16 is not a multiple of 32"):
        pick(kv_cache=small_pages["kv_cache"], backend="cuda-sm80")
    assert pick(q=case["q"].float(), kv_cache=case["kv_cache"].float()) == "triton"
    strided_table = torch.cat([case["block_table"], case["block_table"]], dim=1)[:, ::2]
    assert pick(block_table=strided_table) == "triton"  # the kernel reads block-table rows contiguously
    # the two backends agree on the default call
    out_c, lse_c = mla_decode(**case)
    out_t, lse_t = mla_decode(**case, _backend="triton")
    assert rel_err(out_c, out_t) < 1e-2 and (lse_c - lse_t).abs().max().item() < 1e-3


# Run in a child process: a failing check inside the extension that crashed the process (say, a
# fault while formatting its message) instead of raising fails this test, and the rest of the
# GPU suite still runs.
_OPS_REJECT_CHILD = """
import torch
from mla.kernels.extension import load_extension
from tests.test_kernels_decode import _gpu_case

state = load_extension()
assert state["decode"], state
case = _gpu_case([70, 300], 16)
q, cache, table, lens = case["q"], case["kv_cache"], case["block_table"], case["seq_lens"]
part_out = torch.full((2, 16, 3, 512), 7.0, device="cuda")
part_lse = torch.full((2, 16, 3), 7.0, device="cuda")
cases = {
    "heads": dict(q=torch.zeros(2, 32, 576, device="cuda", dtype=q.dtype)),
    "dtype": dict(q=q.float(), kv_cache=cache.float()),
    "page": dict(kv_cache=cache.view(-1, 16, 576)),
    "no-page": dict(kv_cache=cache[:, :0]),
    "table": dict(block_table=table.long()),
    "splits": dict(num_splits=4),
    "answer-splits": dict(part_out=torch.full((2, 16, 3, 512), 7.0, device="cuda", dtype=q.dtype)),
}
ops = {"sm80": torch.ops.mla.mla_decode_sm80}
if state["decode_sm90"]:
    ops["sm90"] = torch.ops.mla.mla_decode_sm90
    cases["sm90-page"] = dict(kv_cache=cache.view(-1, 32, 576))
for op_name, op in ops.items():
    for name, override in cases.items():
        if (name == "heads" and op_name == "sm90") or (name == "sm90-page" and op_name == "sm80"):
            continue  # sm90 takes any number of heads; pages of 32 are sm80's own
        args = dict(q=q, kv_cache=cache, block_table=table, seq_lens=lens, part_out=part_out, part_lse=part_lse,
                    softmax_scale=0.1, num_splits=3)
        args.update(override)
        try:
            op(*args.values())
            print(op_name, name, "RAN", flush=True)
        except RuntimeError as e:
            print(op_name, name, "RAISED", str(e).splitlines()[0], flush=True)
if "sm90" in ops:  # q_tokens must divide q's 16 rows and lie in [1, 8]
    for q_tokens in (3, 16):
        try:
            ops["sm90"](q, cache, table, lens, part_out, part_lse, 0.1, 3, q_tokens=q_tokens)
            print("sm90", f"q_tokens-{q_tokens}", "RAN", flush=True)
        except RuntimeError as e:
            print("sm90", f"q_tokens-{q_tokens}", "RAISED", str(e).splitlines()[0], flush=True)
# dealt over 3 pieces: slots (b + 3 - 1, h, c), out (b, h, c) in q's dtype, lse (b, h), ranges (b, 2) int32
slots_out = torch.full((4, 16, 512), 7.0, device="cuda")
slots_lse = torch.full((4, 16), 7.0, device="cuda")
out = torch.full((2, 16, 512), 7.0, device="cuda", dtype=q.dtype)
lse = torch.full((2, 16), 7.0, device="cuda")
ranges = torch.full((2, 2), 7, device="cuda", dtype=torch.int32)
dealt = {
    "dealt-slots": dict(part_out=part_out, part_lse=part_lse),
    "dealt-out-dtype": dict(out=out.float()),
    "dealt-lse": dict(lse=lse[:1]),
    "dealt-ranges": dict(ranges=ranges.long()),
    "dealt-no-out": dict(out=None),
}
if "sm90" in ops:
    for name, override in dealt.items():
        args = dict(part_out=slots_out, part_lse=slots_lse, out=out, lse=lse, ranges=ranges)
        args.update(override)
        try:
            ops["sm90"](q, cache, table, lens, args["part_out"], args["part_lse"], 0.1, 3, out=args["out"],
                        lse=args["lse"], ranges=args["ranges"])
            print("sm90", name, "RAN", flush=True)
        except RuntimeError as e:
            print("sm90", name, "RAISED", str(e).splitlines()[0], flush=True)
untouched = (part_out, part_lse, slots_out, slots_lse, out, lse, ranges)
print("untouched", all(bool((t == 7).all()) for t in untouched), flush=True)
"""


def run_op_checks(script: str) -> dict:
    """Run ``script`` in a child Python (the repository on its path) that prints a line
    "OP CASE RAISED message" or "OP CASE RAN" per call and "untouched True|False" last; returns
    {"OP CASE": "RAISED message", "untouched": "True"}. A check that crashes the child fails here."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    child = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                           timeout=600, env={**os.environ, "PYTHONPATH": str(root)})
    assert child.returncode == 0, f"the child exited with {child.returncode}:\n{child.stdout}\n{child.stderr[-2000:]}"
    lines = {}  # "sm80 heads" -> "RAISED ...", "untouched" -> "True"
    for line in child.stdout.splitlines():
        words = line.split(" ", 2)
        key, rest = (words[0], words[1]) if words[0] == "untouched" else (" ".join(words[:2]), words[2])
        lines[key] = rest
    return lines


@pytest.mark.gpu
def test_gpu_cuda_ops_reject_what_they_cannot_run():
    # the op's own checks (mla_decode checks first; these guard direct callers), nothing written
    lines = run_op_checks(_OPS_REJECT_CHILD)
    expected = {"sm80 heads": "mla_decode_sm80: q must be (b, h <= 16", "sm80 dtype": "bfloat16 or both float16",
                "sm80 page": "multiple of 32", "sm80 no-page": "multiple of 32", "sm80 table": "block_table must be",
                "sm80 splits": "part_out must be", "sm80 answer-splits": "q's dtype when num_splits is 1"}
    if torch.cuda.get_device_capability() == (9, 0):  # the wgmma kernel is built
        expected.update({"sm90 dtype": "mla_decode_sm90: q and kv_cache must both be bfloat16",
                         "sm90 page": "multiple of 64", "sm90 sm90-page": "multiple of 64",
                         "sm90 no-page": "multiple of 64", "sm90 table": "block_table must be",
                         "sm90 splits": "part_out must be", "sm90 answer-splits": "q's dtype when num_splits is 1",
                         "sm90 q_tokens-3": "q_tokens (s_q, new tokens a sequence) must be in [1, 8]",
                         "sm90 q_tokens-16": "q_tokens (s_q, new tokens a sequence) must be in [1, 8]",
                         "sm90 dealt-slots": "part_out must be (b + num_splits - 1, h, 512)",
                         "sm90 dealt-out-dtype": "out must be (b, h, 512)",
                         "sm90 dealt-lse": "lse must be (b, h)", "sm90 dealt-ranges": "ranges must be (b, 2)",
                         "sm90 dealt-no-out": "out and lse are given with ranges"})
    for name, message in expected.items():
        assert lines.get(name, "").startswith("RAISED") and message in lines[name], (name, lines.get(name))
    assert lines.get("untouched") == "True"
