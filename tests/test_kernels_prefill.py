"""Tests of the prefill kernels: the tiled varlen op (mla.kernels.prefill), the SDPA path
(mla.kernels.sdpa), the merge and chunked context prefill (mla.kernels.chunked_context).

On a machine without a GPU the kernel runs in Triton's interpreter, whose tl.dot is slow (numpy),
so the CPU tests keep heads and dims small (h <= 3, d, r, v <= 16, except one V3-sized head) and
lengths <= 300. bf16 is computed in fp32 on the CPU (the interpreter's bf16 tl.dot is wrong); the
GPU tests run bf16 for real at DeepSeek-V3's sizes.

Three independent checks of the math: ``mla_prefill_reference`` (plain torch, float64 here),
torch's scaled_dot_product_attention with an explicit bottom-right causal mask, and the naive
tier's ``attend_up_projected``. Paged contexts are built hostile: pages in random order, unused
pages, the tails of partial pages and unused block-table entries filled with NaN / garbage.
"""

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mla.kernels  # noqa: F401  (sets TRITON_INTERPRET before triton is imported on a CPU machine)
from mla import MLAConfig, MLAWeights
from mla.kernels import chunked_context as context_module
from mla.kernels import sdpa as sdpa_module
from mla.kernels.chunked_context import chunked_context_prefill, head_group, merge_attention_states
from mla.kernels.prefill import mla_prefill, mla_prefill_reference
from mla.kernels.sdpa import PREFILL_BACKENDS, PREFILL_KERNEL_UP_TO, choose_prefill_backend, sdpa_prefill
from mla.naive import attend_up_projected

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[1]


def offsets(lengths, device=DEVICE):
    """(b + 1,) int32 cumulative offsets of the given lengths."""
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def make_varlen(lens_q, lens_k, *, h=2, d=16, r=8, dv=12, dtype=torch.float32, device=DEVICE, seed=0):
    """Packed (q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k) of random values."""
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    tensors = (torch.randn(tq, h, d, generator=gen), torch.randn(tq, h, r, generator=gen),
               torch.randn(tk, h, d, generator=gen), torch.randn(tk, r, generator=gen),
               torch.randn(tk, h, dv, generator=gen))
    return (*(t.to(dtype).to(device) for t in tensors), offsets(lens_q, device), offsets(lens_k, device))


def rel_err(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def assert_lse_close(lse, ref_lse, tol):
    """Same -inf entries; the finite ones within tol (absolute, relative beyond 1)."""
    lse, ref_lse = lse.cpu().double(), ref_lse.cpu().double()
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    finite = ~ref_lse.isneginf()
    if finite.any():
        err = (lse[finite] - ref_lse[finite]).abs() / ref_lse[finite].abs().clamp_min(1.0)
        assert err.max().item() < tol


def check_against_reference(args, *, causal=True, tol=1e-5, **kwargs):
    out, lse = mla_prefill(*args, softmax_scale=0.3, causal=causal, **kwargs)
    ref_out, ref_lse = mla_prefill_reference(*args, softmax_scale=0.3, causal=causal, compute_dtype=torch.float64)
    assert out.dtype == args[0].dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_err(out, ref_out) < tol
    assert_lse_close(lse, ref_lse, tol)
    return out, lse


# ---- the kernel against the reference ---------------------------------------------------------


@pytest.mark.parametrize("config", [None, {"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 32, "BLOCK_N": 64}])
def test_ragged_causal_matches_reference(config):
    """Rows of 1..70 new tokens, each the last of its keys (context 0 up to 60 before them)."""
    lens_q = [1, 17, 70, 5, 33]
    lens_k = [1, 17, 130, 40, 33]
    check_against_reference(make_varlen(lens_q, lens_k, h=3), _config=config)


@pytest.mark.parametrize("seed", range(4))
def test_random_ragged_batches(seed):
    """Random lengths (a query count <= its key count), random tiles: diagonals at every offset."""
    gen = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 5, (1,), generator=gen))
    lens_q = torch.randint(1, 40, (b,), generator=gen).tolist()
    lens_k = [s + int(torch.randint(0, 50, (1,), generator=gen)) for s in lens_q]
    config = [{"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 16, "BLOCK_N": 32}, {"BLOCK_M": 32, "BLOCK_N": 16},
              None][seed]
    causal = seed % 2 == 0
    check_against_reference(make_varlen(lens_q, lens_k, h=2, seed=seed), causal=causal, _config=config)


def test_long_rows_match_reference():
    """300-token rows: several query blocks and key tiles, the diagonal crossing tiles."""
    check_against_reference(make_varlen([300, 129], [300, 200], h=1))


def test_v3_head_dims():
    """d = 128, r = 64, v = 128: the two dot products at DeepSeek's sizes (no column masks)."""
    check_against_reference(make_varlen([40, 9], [70, 9], h=1, d=128, r=64, dv=128))


@pytest.mark.parametrize("config", [None, {"BLOCK_M": 16, "BLOCK_N": 16}])
def test_non_causal_and_rows_without_keys(config):
    """causal=False: every query sees all its keys; a row with 0 keys gives out 0, lse -inf."""
    lens_q, lens_k = [5, 3, 20, 0], [0, 50, 7, 4]
    out, lse = check_against_reference(make_varlen(lens_q, lens_k), causal=False, _config=config)
    assert (out[:5] == 0).all() and lse[:5].isneginf().all()


def test_matches_sdpa_bottom_right_causal():
    """torch SDPA on [q_nope | q_pe] . [k_nope | k_pe] with the mask query j sees keys <= t - s + j."""
    lens_q, lens_k = [12, 1, 30], [12, 25, 61]
    args = make_varlen(lens_q, lens_k, h=3)
    q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k = args
    out, lse = mla_prefill(*args, softmax_scale=0.3)
    for i, (s, t) in enumerate(zip(lens_q, lens_k)):
        rq, rk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        q = torch.cat([q_nope[rq], q_pe[rq]], -1).double().transpose(0, 1)                  # (h, s, d + r)
        k = torch.cat([k_nope[rk], k_pe[rk, None].expand(-1, 3, -1)], -1).double().transpose(0, 1)
        vv = v[rk].double().transpose(0, 1)
        mask = torch.arange(t)[None, :] <= (t - s + torch.arange(s))[:, None]              # (s, t)
        expected = F.scaled_dot_product_attention(q, k, vv, attn_mask=mask.to(q.device), scale=0.3)
        assert rel_err(out[rq].transpose(0, 1), expected) < 1e-5
        scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~mask.to(q.device), float("-inf"))
        assert_lse_close(lse[rq].transpose(0, 1), torch.logsumexp(scores, -1), 1e-5)


def test_strided_key_value_views():
    """k_nope and v as views into one up-projected (t, h, d + v) tensor, as chunked prefill passes them."""
    q_nope, q_pe, _, k_pe, _, cu_q, cu_k = make_varlen([20, 8], [20, 40], h=2, d=16, dv=16)
    kv = torch.randn(60, 2, 32, device=DEVICE)
    args = (q_nope, q_pe, kv[..., :16], k_pe, kv[..., 16:], cu_q, cu_k)
    check_against_reference(args)


def test_float16():
    check_against_reference(make_varlen([9, 40], [30, 40], h=2, dtype=torch.float16), tol=2e-3)


def test_bfloat16():
    """bf16 (on the CPU computed in fp32): close to the float64 reference at bf16's precision."""
    check_against_reference(make_varlen([9, 40], [30, 40], h=2, dtype=torch.bfloat16), tol=2e-2)


def test_softmax_scale_and_lse_are_natural_log():
    """lse equals torch.logsumexp of the scaled scores (not log2), for a single key: its score."""
    q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k = make_varlen([1], [1], h=1)
    out, lse = mla_prefill(q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k, softmax_scale=0.7)
    score = 0.7 * ((q_nope * k_nope).sum() + (q_pe[0, 0] * k_pe[0]).sum())
    assert abs(lse.item() - score.item()) < 1e-5
    assert torch.allclose(out, v, atol=1e-6)


# ---- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), "cu_seqlens_q must be torch.int32"),
        (lambda a: a.update(cu_seqlens_q=offsets([5, 5]) + 1), "cu_seqlens_q must start at 0"),
        (lambda a: a.update(cu_seqlens_k=torch.tensor([0, 9, 8], dtype=torch.int32, device=DEVICE)),
         "cu_seqlens_k must not decrease"),
        (lambda a: a.update(cu_seqlens_k=offsets([4, 6])), r"cu_seqlens_k\[-1\] must equal"),
        (lambda a: a.update(cu_seqlens_k=offsets([4, 9]), k_nope=a["k_nope"][:13], k_pe=a["k_pe"][:13],
                            v=a["v"][:13]), "sequence 0 has 5 queries"),
        (lambda a: a.update(k_pe=a["k_pe"][:, None].expand(-1, 2, -1)), r"k_pe must be \(total_k, r\)"),
        (lambda a: a.update(q_pe=a["q_pe"][..., :4]), "k_pe must have shape"),
        (lambda a: a.update(v=a["v"].double()), "v must be torch.float32"),
        (lambda a: a.update(k_nope=a["k_nope"].transpose(0, 1).contiguous().transpose(0, 1)[..., ::2]),
         "k_nope must have shape"),
        (lambda a: a.update(softmax_scale=float("nan")), "softmax_scale must be finite"),
        (lambda a: a.update(max_seqlen_q=2), "max_seqlen_q is 2 but a sequence has 5"),
    ],
)
def test_bad_input_raises_naming_the_argument(change, match):
    q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k = make_varlen([5, 5], [5, 10])
    args = dict(q_nope=q_nope, q_pe=q_pe, k_nope=k_nope, k_pe=k_pe, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                softmax_scale=0.3)
    change(args)
    with pytest.raises((ValueError, TypeError), match=match):
        mla_prefill(**args)


# ---- the merge --------------------------------------------------------------------------------


def test_merge_of_two_key_sets_is_attention_over_their_union():
    """Keys split into a context part and a causal part; merged = attention over all keys."""
    lens_q, ctx = [7, 1, 20], [13, 0, 9]
    q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k = make_varlen(lens_q, [c + s for c, s in zip(ctx, lens_q)])
    full = mla_prefill_reference(q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k, softmax_scale=0.3,
                                 compute_dtype=torch.float64)
    first = torch.cat([torch.arange(int(cu_k[i]), int(cu_k[i]) + c) for i, c in enumerate(ctx)])
    second = torch.cat([torch.arange(int(cu_k[i]) + c, int(cu_k[i + 1])) for i, c in enumerate(ctx)])
    a = mla_prefill(q_nope, q_pe, k_nope[first], k_pe[first], v[first], cu_q, offsets(ctx), softmax_scale=0.3,
                    causal=False)
    b = mla_prefill(q_nope, q_pe, k_nope[second], k_pe[second], v[second], cu_q, cu_q, softmax_scale=0.3)
    out, lse = merge_attention_states(*a, *b)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert rel_err(out, full[0]) < 1e-5
    assert_lse_close(lse, full[1], 1e-5)


def test_merge_with_empty_sides():
    out_a, lse_a = torch.randn(4, 3, 5), torch.randn(4, 3)
    empty_out, empty_lse = torch.zeros(4, 3, 5), torch.full((4, 3), float("-inf"))
    out, lse = merge_attention_states(out_a, lse_a, empty_out, empty_lse)
    assert torch.allclose(out, out_a) and torch.allclose(lse, lse_a)
    out, lse = merge_attention_states(empty_out, empty_lse, empty_out, empty_lse)
    assert (out == 0).all() and lse.isneginf().all()
    big = torch.full((4, 3), 1e4)  # lse far beyond exp's range: merged against the max
    out, lse = merge_attention_states(out_a, big, out_a, big)
    assert torch.allclose(out, out_a) and torch.allclose(lse, big + math.log(2))


# ---- chunked context prefill over a paged cache -----------------------------------------------

GARBAGE_PAGES = (10**6, -7)  # what unused block-table entries hold


def make_context_case(news, contexts, *, page, h=2, d=16, r=8, dv=16, c=24, dtype=torch.float32, device=DEVICE,
                      seed=0):
    """New tokens over paged contexts; pages shuffled, every unused cache value NaN."""
    gen = torch.Generator().manual_seed(seed)
    b = len(news)
    pages = [math.ceil(n / page) for n in contexts]
    num_blocks = sum(pages) + 3
    max_blocks = max(pages, default=0) + 2
    order = torch.randperm(num_blocks, generator=gen)
    kv_cache = torch.full((num_blocks, page, c + r), float("nan"))
    block_table = torch.tensor(GARBAGE_PAGES * max_blocks, dtype=torch.int32)[:max_blocks].repeat(b, 1)
    context_rows, next_page = [], 0
    for i, (n, p) in enumerate(zip(contexts, pages)):
        blocks = order[next_page: next_page + p]
        next_page += p
        block_table[i, :p] = blocks.int()
        rows = torch.randn(n, c + r, generator=gen)
        kv_cache[blocks[torch.arange(n) // page], torch.arange(n) % page] = rows
        context_rows.append(rows)
    tq = sum(news)
    new = dict(q_nope=torch.randn(tq, h, d, generator=gen), q_pe=torch.randn(tq, h, r, generator=gen),
               kv_c=torch.randn(tq, c, generator=gen), k_pe=torch.randn(tq, r, generator=gen))
    weights = dict(W_UK=torch.randn(h, d, c, generator=gen) / c**0.5,
                   W_UV=torch.randn(h, dv, c, generator=gen) / c**0.5)
    case = dict(
        **{k: t.to(dtype).to(device) for k, t in new.items()},
        cu_seqlens_q=offsets(news, device),
        kv_cache=kv_cache.to(dtype).to(device),
        block_table=block_table.to(device),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
        **{k: t.to(dtype).to(device) for k, t in weights.items()},
        softmax_scale=0.3,
    )
    return case, [rows.to(dtype).to(device) for rows in context_rows]


def context_reference(case, context_rows, compute_dtype=torch.float64):
    """The whole sequence [context | new] gathered and up-projected, one causal reference call."""
    c = case["kv_c"].shape[1]
    cu = case["cu_seqlens_q"].tolist()
    latents = []
    for i, rows in enumerate(context_rows):
        new_rows = torch.cat([case["kv_c"], case["k_pe"]], -1)[cu[i]: cu[i + 1]]
        latents.append(torch.cat([rows, new_rows]))
    latent = torch.cat(latents).to(compute_dtype)                                        # (total_k, c + r)
    k_nope = torch.einsum("tc,hdc->thd", latent[:, :c], case["W_UK"].to(compute_dtype))
    v = torch.einsum("tc,hvc->thv", latent[:, :c], case["W_UV"].to(compute_dtype))
    q = (case["q_nope"].to(compute_dtype), case["q_pe"].to(compute_dtype))
    return mla_prefill_reference(*q, k_nope, latent[:, c:].contiguous(), v, case["cu_seqlens_q"],
                                 offsets([len(x) for x in latents], latent.device), softmax_scale=case["softmax_scale"],
                                 compute_dtype=compute_dtype)


@pytest.mark.parametrize(
    "page, workspace",
    [(16, 10_000), (16, 23), (1, 40), (64, 50)],  # 23, 40, 50 < the longest context: several chunks
)
def test_chunked_context_matches_reference(page, workspace):
    news, contexts = [5, 1, 37, 12], [90, 0, 60, 3]
    case, context_rows = make_context_case(news, contexts, page=page)
    before = {k: t.clone() for k, t in case.items() if isinstance(t, torch.Tensor)}
    out, lse = chunked_context_prefill(**case, workspace_tokens=workspace)
    ref_out, ref_lse = context_reference(case, context_rows)
    assert out.shape == (sum(news), 2, 16) and out.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_err(out, ref_out) < 1e-5
    assert_lse_close(lse, ref_lse, 1e-5)
    for k, t in before.items():
        torch.testing.assert_close(case[k], t, rtol=0, atol=0, equal_nan=True)


def test_chunked_context_without_context_is_causal_prefill():
    case, context_rows = make_context_case([8, 20], [0, 0], page=16)
    out, lse = chunked_context_prefill(**case, workspace_tokens=4)
    ref_out, ref_lse = context_reference(case, context_rows)
    assert rel_err(out, ref_out) < 1e-5
    assert_lse_close(lse, ref_lse, 1e-5)


def test_chunked_context_bfloat16():
    case, context_rows = make_context_case([6, 30], [40, 17], page=16, dtype=torch.bfloat16)
    out, lse = chunked_context_prefill(**case, workspace_tokens=32)
    ref_out, ref_lse = context_reference(case, context_rows)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref_out) < 3e-2
    assert_lse_close(lse, ref_lse, 3e-2)


def test_chunked_context_matches_the_naive_tier():
    """Against naive.attend_up_projected with a real MLAWeights: W_UK / W_UV are read the same way."""
    cfg = MLAConfig.from_preset("tiny")
    w = MLAWeights(cfg, seed=3)
    h, d, r, c = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    s, t_ctx = 9, 30
    case, context_rows = make_context_case([s], [t_ctx], page=8, h=h, d=d, r=r, dv=cfg.v_head_dim, c=c, seed=5)
    case.update(W_UK=w.W_UK.detach().to(DEVICE), W_UV=w.W_UV.detach().to(DEVICE))
    out, lse = chunked_context_prefill(**case, workspace_tokens=16)
    latent = torch.cat([context_rows[0], torch.cat([case["kv_c"], case["k_pe"]], -1)])     # (t, c + r)
    positions = torch.arange(t_ctx, t_ctx + s)
    visible = torch.arange(t_ctx + s)[None, None, :] <= positions[None, :, None]         # (1, s, t)
    expected = attend_up_projected(w.to(DEVICE), case["q_nope"][None], case["q_pe"][None], latent[None, :, :c],
                                   latent[None, :, c:], visible.to(DEVICE), case["softmax_scale"])[0]
    assert rel_err(out, expected.detach()) < 1e-5


def test_chunked_context_bad_input_raises_and_writes_nothing():
    case, _ = make_context_case([5, 3], [40, 20], page=16)
    before = {k: t.clone() for k, t in case.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(ValueError, match="workspace_tokens must be >= 1"):
        chunked_context_prefill(**case, workspace_tokens=0)
    short = dict(case, block_table=case["block_table"][:, :2])  # 40 tokens need 3 pages of 16
    with pytest.raises(ValueError, match="block_table is too short: sequence 0's context of 40 tokens needs 3"):
        chunked_context_prefill(**short)
    bad_page = case["block_table"].clone()
    bad_page[1, 0] = 10**6
    with pytest.raises(ValueError, match="block_table's entries for the context must be pages of kv_cache"):
        chunked_context_prefill(**dict(case, block_table=bad_page))
    with pytest.raises(ValueError, match="W_UK must be"):
        chunked_context_prefill(**dict(case, W_UK=case["W_UK"][:, :8]))
    with pytest.raises(ValueError, match="context_lens must be >= 0"):
        chunked_context_prefill(**dict(case, context_lens=torch.tensor([-1, 3], dtype=torch.int32, device=DEVICE)))
    for k, t in before.items():
        torch.testing.assert_close(case[k], t, rtol=0, atol=0, equal_nan=True)


def test_chunked_context_with_host_context_lens():
    """The host lengths a layer's plan holds: the same result; on the CPU a mismatch raises."""
    case, context_rows = make_context_case([5, 12], [40, 3], page=16)
    out, lse = chunked_context_prefill(**case, workspace_tokens=16, max_seqlen_q=12, context_lens_host=[40, 3])
    ref_out, ref_lse = context_reference(case, context_rows)
    assert rel_err(out, ref_out) < 1e-5
    assert_lse_close(lse, ref_lse, 1e-5)
    for bad in ([40, 4], [40]):
        with pytest.raises(ValueError, match="context_lens_host must hold context_lens' 2 values"):
            chunked_context_prefill(**case, max_seqlen_q=12, context_lens_host=bad)


# ---- without cached context: torch SDPA or the kernel ----------------------------------------


def count_sdpa_calls(monkeypatch):
    """Record the (q, k, v) of each scaled_dot_product_attention call (the call still runs)."""
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q, k, v, kwargs))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("lens, calls", [([1, 5, 70, 33, 2], 5), ([17, 17, 17], 1), ([64], 1), ([9, 0, 9], 2)])
def test_sdpa_prefill_matches_the_reference_and_the_kernel(lens, calls, monkeypatch):
    """Ragged rows (one call a row), equal rows (one batched call), a single row, an empty row."""
    seen = count_sdpa_calls(monkeypatch)
    args = make_varlen(lens, lens, h=3)
    q_nope, q_pe, k_nope, k_pe, v, cu, _ = args
    before = [t.clone() for t in args]
    out = sdpa_prefill(q_nope, q_pe, k_nope, k_pe, v, cu, softmax_scale=0.3)
    ref_out, _ = mla_prefill_reference(*args, softmax_scale=0.3, compute_dtype=torch.float64)
    kernel_out, _ = mla_prefill(*args, softmax_scale=0.3)
    assert out.shape == kernel_out.shape and out.dtype == torch.float32
    assert rel_err(out, ref_out) < 1e-5 and rel_err(out, kernel_out) < 1e-5
    assert len(seen) == calls
    for t, t0 in zip(args, before):
        assert torch.equal(t, t0)


def test_sdpa_prefill_at_v3_head_dims_stores_no_score(monkeypatch):
    """d + r = 192 against v = 128: padded to one width, torch's CPU flash kernel takes the call
    (its math backend would store every score)."""
    seen = count_sdpa_calls(monkeypatch)
    args = make_varlen([40, 40], [40, 40], h=2, d=128, r=64, dv=128)
    out = sdpa_prefill(*args[:6], softmax_scale=192**-0.5, max_seqlen_q=40)
    ref_out, _ = mla_prefill_reference(*args, softmax_scale=192**-0.5, compute_dtype=torch.float64)
    assert out.shape == (80, 2, 128) and rel_err(out, ref_out) < 1e-5
    (q, k, v, kwargs), = seen
    assert kwargs["is_causal"] and q.shape[0] == 2
    if DEVICE == "cpu":
        flash = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
        assert torch._fused_sdp_choice(q, k, v, is_causal=True) == flash


def test_sdpa_prefill_bad_input_raises_naming_the_argument():
    q_nope, q_pe, k_nope, k_pe, v, cu, _ = make_varlen([5, 5], [5, 5])
    with pytest.raises(ValueError, match="sdpa_prefill: k_nope must have a row for each of the total_q = 10"):
        sdpa_prefill(q_nope, q_pe, k_nope[:9], k_pe[:9], v[:9], cu, softmax_scale=0.3)
    with pytest.raises(ValueError, match="sdpa_prefill: max_seqlen_q is 2 but a sequence has 5"):
        sdpa_prefill(q_nope, q_pe, k_nope, k_pe, v, cu, softmax_scale=0.3, max_seqlen_q=2)


def test_choose_prefill_backend_rule():
    """"auto": SDPA on a CUDA device when the rows have equal lengths and the call has more than
    PREFILL_KERNEL_UP_TO new tokens, else the kernel; a forced backend stays as it is anywhere;
    another value raises."""
    assert PREFILL_BACKENDS == ("auto", "triton", "sdpa")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    many, few = PREFILL_KERNEL_UP_TO + 1, PREFILL_KERNEL_UP_TO
    assert choose_prefill_backend("auto", cuda, equal_rows=True, new_tokens=many) == "sdpa"
    assert choose_prefill_backend("auto", "cuda:1", equal_rows=True, new_tokens=many) == "sdpa"
    assert choose_prefill_backend("auto", cuda, equal_rows=True, new_tokens=few) == "triton"
    assert choose_prefill_backend("auto", cuda, equal_rows=False, new_tokens=many) == "triton"
    assert choose_prefill_backend("auto", cpu, equal_rows=True, new_tokens=many) == "triton"
    for device in (cuda, cpu):
        for equal_rows in (True, False):
            for n in (few, many):
                assert choose_prefill_backend("triton", device, equal_rows=equal_rows, new_tokens=n) == "triton"
                assert choose_prefill_backend("sdpa", device, equal_rows=equal_rows, new_tokens=n) == "sdpa"
    for bad in ("cudnn", "", None, "SDPA"):
        with pytest.raises(ValueError, match="backend must be one of"):
            choose_prefill_backend(bad, cuda, equal_rows=True, new_tokens=many)


@pytest.mark.parametrize("news", [[12, 12], [5, 30]])
def test_chunked_context_without_context_on_each_backend(news, monkeypatch):
    """No context: "sdpa" runs SDPA (no lse), "triton" the kernel, "auto" as the rule says for
    this device; the same output."""
    ran = []
    for name in ("_sdpa_prefill_latent", "mla_prefill"):
        real = getattr(context_module, name)
        monkeypatch.setattr(context_module, name,
                            lambda *a, _real=real, _name=name, **k: ran.append(_name) or _real(*a, **k))
    case, context_rows = make_context_case(news, [0, 0], page=16)
    ref_out, _ = context_reference(case, context_rows)
    auto = choose_prefill_backend("auto", DEVICE, equal_rows=news[0] == news[1], new_tokens=sum(news))
    for backend in ("sdpa", "triton", "auto"):
        ran.clear()
        out, lse = chunked_context_prefill(**case, backend=backend)
        assert rel_err(out, ref_out) < 1e-5, backend
        runs_sdpa = (auto if backend == "auto" else backend) == "sdpa"
        assert ran == (["_sdpa_prefill_latent"] if runs_sdpa else ["mla_prefill"]), backend
        assert (lse is None) == runs_sdpa


def test_chunked_context_with_context_stays_on_the_kernel(monkeypatch):
    """One row with context is enough: every row needs the lse for the merge."""
    monkeypatch.setattr(context_module, "_sdpa_prefill_latent", lambda *a, **k: pytest.fail("SDPA ran with context"))
    case, context_rows = make_context_case([6, 6], [0, 9], page=4)
    ref_out, ref_lse = context_reference(case, context_rows)
    for backend in PREFILL_BACKENDS:
        out, lse = chunked_context_prefill(**case, workspace_tokens=5, backend=backend)
        assert rel_err(out, ref_out) < 1e-5
        assert_lse_close(lse, ref_lse, 1e-5)


def test_sdpa_joins_adjacent_query_parts_without_a_copy():
    """q_nope and q_pe as views of one (t, h, d + r) buffer join as a view of it, and so do W_UK
    and W_UV along their second dim; parts that do not follow each other in one buffer are
    copied. Both equal torch.cat."""
    from mla.kernels.sdpa import _joined
    q = torch.randn(6, 3, 10)
    whole = _joined(q[..., :7], q[..., 7:])
    assert whole.data_ptr() == q.data_ptr() and torch.equal(whole, q)
    part = _joined(q[:, 1:, :7], q[:, 1:, 7:])                        # a head group's views
    assert part.data_ptr() == q[:, 1:].data_ptr() and torch.equal(part, q[:, 1:])
    for a, b in ((q[..., :7].clone(), q[..., 7:].clone()),           # two buffers
                 (q[..., 3:], q[..., :3]),                           # b before a
                 (q[..., :5], q[..., 7:]),                           # a gap between them
                 (q[..., :7], torch.randn(3, 6, 3).transpose(0, 1))):        # other strides
        joined = _joined(a, b)
        assert torch.equal(joined, torch.cat([a, b], -1))
    assert _joined(q[..., :7], q[..., 7:]).shape == (6, 3, 10)
    w = torch.randn(4, 12, 5)                                         # kv_b_proj's (h, d + v, c)
    kv = _joined(w[:, :8], w[:, 8:], dim=1)                           # W_UK and W_UV
    assert kv.data_ptr() == w.data_ptr() and torch.equal(kv, w)
    for a, b in ((w[:, :8], w[:, 9:]), (w[:, 8:], w[:, :8]), (w[:2, :8], w[2:, 8:])):
        assert torch.equal(_joined(a, b, dim=1), torch.cat([a, b], 1))
    # copies where a view would not do: a last dim SDPA's GPU backends refuse (stride 3), two
    # storages over one buffer (a view of a's would reach past its end), and autograd (the view
    # would carry a's gradient alone)
    strided = torch.randn(6, 3, 10).transpose(1, 2)                  # (6, 10, 3), strides (30, 1, 10)
    buffer = torch.arange(20.0).numpy()
    apart = torch.from_numpy(buffer[:5]), torch.from_numpy(buffer)[5:10]
    leaf = torch.randn(4, 12, 5, requires_grad=True)
    for a, b, d in ((strided[..., :1], strided[..., 1:], -1), (*apart, 0), (leaf[:, :8], leaf[:, 8:], 1)):
        joined = _joined(a, b, dim=d)
        assert torch.equal(joined, torch.cat([a, b], d)) and joined.data_ptr() != a.data_ptr()
    _joined(leaf[:, :8], leaf[:, 8:], dim=1).sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(leaf))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_keys_values_are_the_up_projection_in_sdpas_layout(dtype):
    """One matmul gives k = [W_UK kv_c | k_pe] and v = W_UV kv_c for a head group, as views of
    one buffer with contiguous heads (what SDPA reads without a copy); k's rope part is k_pe
    itself, and kv_b_proj's weight and the latent rows are left as they were."""
    from mla.kernels.sdpa import _latent_keys_values
    gen = torch.Generator().manual_seed(1)
    t, h, d, r, dv, c = 37, 5, 16, 8, 12, 24
    w = torch.randn(h, d + dv, c, generator=gen).to(dtype).to(DEVICE)    # kv_b_proj's (h, d + v, c)
    kv_c = torch.randn(t, c, generator=gen).to(dtype).to(DEVICE)
    k_pe = torch.randn(t, r, generator=gen).to(dtype).to(DEVICE)
    before = [x.clone() for x in (w, kv_c, k_pe)]
    for h0, h1 in ((0, h), (1, 4)):
        W_UK, W_UV = w[h0:h1, :d], w[h0:h1, d:]
        k, v = _latent_keys_values(kv_c, k_pe, W_UK, W_UV)
        g = h1 - h0
        assert k.shape == (t, g, d + r) and v.shape == (t, g, dv) and k.dtype == v.dtype == dtype
        assert k.stride()[1:] == (d + r, 1) and v.stride()[1:] == (dv, 1)
        assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        k_nope_ref = torch.einsum("tc,gdc->tgd", kv_c.double(), W_UK.double())
        v_ref = torch.einsum("tc,gvc->tgv", kv_c.double(), W_UV.double())
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert rel_err(k[..., :d], k_nope_ref) < tol and rel_err(v, v_ref) < tol
        assert torch.equal(k[..., d:], k_pe[:, None].expand(-1, g, -1))
    for x, x0 in zip((w, kv_c, k_pe), before):
        assert torch.equal(x, x0)


@pytest.mark.parametrize("d, r, dv", [(16, 8, 12), (12, 6, 16), (10, 5, 7)])
def test_chunked_context_sdpa_with_head_dims_not_multiples_of_8(d, r, dv):
    """The SDPA path's keys and values are views into rows of g (d + r + v) values; with widths
    that are not multiples of 8 they are copied (SDPA's GPU kernels read 16-byte-aligned rows)
    and padded where needed. Heads one a group, so the views' rows are as narrow as they get."""
    case, context_rows = make_context_case([9, 9], [0, 0], page=4, h=3, d=d, r=r, dv=dv)
    ref_out, _ = context_reference(case, context_rows)
    for workspace in (64, 3):                          # every head at once; one head a group
        out, lse = chunked_context_prefill(**case, workspace_tokens=workspace, backend="sdpa")
        assert lse is None and out.shape == (18, 3, dv) and rel_err(out, ref_out) < 1e-5, workspace


def test_chunked_context_bad_value_width_raises_before_any_work():
    """W_UV with no value dims is refused by name, whichever backend would run the call."""
    case, _ = make_context_case([5, 3], [0, 0], page=16)
    case["W_UV"] = case["W_UV"][:, :0]
    for backend in PREFILL_BACKENDS:
        with pytest.raises(ValueError, match=r"chunked_context_prefill: W_UV must be \(h=2, v >= 1, c=24\)"):
            chunked_context_prefill(**case, backend=backend)


def test_head_group_rule():
    assert head_group(100, 8, 16384) == 8              # a short prompt: every head at once
    assert head_group(32768, 128, 16384) == 64         # twice the workspace: half the heads
    assert head_group(131072, 128, 16384) == 16
    assert head_group(16385, 128, 16384) == 64         # even groups: 64 + 64, not 127 + 1
    assert head_group(23, 5, 10) == 2                  # 2 at most: 2 + 2 + 1
    assert head_group(10**6, 4, 10) == 1               # at least one head
    assert head_group(0, 4, 10) == 4


def test_sdpa_prefill_reads_a_joined_query_in_place(monkeypatch):
    """Given q_nope and q_pe as views of one query buffer, SDPA's q is that buffer (no copy);
    given two tensors, a new one."""
    seen = []
    real = sdpa_module._causal_sdpa
    monkeypatch.setattr(sdpa_module, "_causal_sdpa",
                        lambda q, k, v, scale: seen.append(q.untyped_storage().data_ptr()) or real(q, k, v, scale))
    gen = torch.Generator().manual_seed(0)
    t, h, d, r, dv = 12, 3, 16, 8, 16
    q = torch.randn(t, h, d + r, generator=gen)
    k_nope, v = torch.randn(t, h, d, generator=gen), torch.randn(t, h, dv, generator=gen)
    k_pe = torch.randn(t, r, generator=gen)
    cu = offsets([6, 6])
    joined = sdpa_prefill(q[..., :d], q[..., d:], k_nope, k_pe, v, cu, softmax_scale=0.3)
    apart = sdpa_prefill(q[..., :d].clone(), q[..., d:].clone(), k_nope, k_pe, v, cu, softmax_scale=0.3)
    assert seen == [q.untyped_storage().data_ptr(), seen[1]] and seen[1] != seen[0]
    torch.testing.assert_close(joined, apart, rtol=0, atol=0)


@pytest.mark.parametrize("backend, contexts", [("sdpa", [0, 0]), ("triton", [0, 0]), ("triton", [7, 0])])
def test_chunked_context_in_head_groups(backend, contexts, monkeypatch):
    """A budget below total_q x h token-heads cuts step 1 into head groups (5 heads: 2, 2, 1):
    the same out and lse as the reference, each group's keys and values only its heads'."""
    seen = []
    name = "_sdpa_prefill_latent" if backend == "sdpa" else "mla_prefill"
    real = getattr(context_module, name)
    monkeypatch.setattr(context_module, name,
                        lambda *a, **k: seen.append((a[0].shape[1], a[2].shape[0])) or real(*a, **k))
    news = [9, 14]
    case, context_rows = make_context_case(news, contexts, page=4, h=5)
    before = {k: t.clone() for k, t in case.items() if isinstance(t, torch.Tensor)}
    workspace = 10                                     # 23 new tokens x 2 heads <= 10 x 5
    assert head_group(sum(news), 5, workspace) == 2
    out, lse = chunked_context_prefill(**case, workspace_tokens=workspace, backend=backend)
    ref_out, ref_lse = context_reference(case, context_rows)
    assert [heads for heads, keys in seen if keys == sum(news)] == [2, 2, 1]
    assert rel_err(out, ref_out) < 1e-5
    if backend == "sdpa":
        assert lse is None
    else:
        assert_lse_close(lse, ref_lse, 1e-5)
    for k, t in before.items():
        torch.testing.assert_close(case[k], t, rtol=0, atol=0, equal_nan=True)


def test_chunked_context_bad_backend_raises_and_writes_nothing():
    case, _ = make_context_case([5, 3], [0, 0], page=16)
    before = {k: t.clone() for k, t in case.items() if isinstance(t, torch.Tensor)}
    for bad in ("cudnn", None, "flash"):
        with pytest.raises(ValueError, match="chunked_context_prefill: backend must be one of"):
            chunked_context_prefill(**case, backend=bad)
    for k, t in before.items():
        torch.testing.assert_close(case[k], t, rtol=0, atol=0, equal_nan=True)


def test_layer_prefill_backend_option(monkeypatch):
    """PagedMLA(prefill_backend=...): "sdpa" and "triton" give the naive tier's outputs through
    prompts of equal rows, ragged rows and an extend; SDPA runs only on calls without context,
    and "auto" on the CPU keeps the kernel."""
    import mla

    ran = []
    for name in ("_sdpa_prefill_latent", "mla_prefill"):
        real = getattr(context_module, name)
        monkeypatch.setattr(context_module, name,
                            lambda *a, _real=real, _name=name, **k: ran.append(_name) or _real(*a, **k))
    cfg = MLAConfig.from_preset("tiny")
    weights = MLAWeights(cfg, dtype=torch.float32, seed=4).to(DEVICE)
    naive = mla.build(weights, "naive")
    layers = {backend: mla.build(weights, "paged", block_size=4, shuffle=2, prefill="up-project",
                                 prefill_backend=backend) for backend in PREFILL_BACKENDS}
    assert layers["sdpa"].prefill_backend == "sdpa" and "prefill_backend='sdpa'" in repr(layers["sdpa"])
    assert mla.build(weights, "paged").prefill_backend == "auto"
    # two sequences of calls on fresh caches: equal prompts then an extend; ragged prompts
    sessions = ([[9, 9, 0], [4, 0, 7]], [[5, 1, 12]])
    sdpa_if_no_context = {"sdpa": "sdpa", "triton": "triton",
                          "auto": choose_prefill_backend("auto", DEVICE, equal_rows=True, new_tokens=18)}
    gen = torch.Generator().manual_seed(0)
    xs = [[torch.randn(3, max(lengths), cfg.hidden_size, generator=gen).to(DEVICE) for lengths in calls]
          for calls in sessions]
    with torch.no_grad():
        refs = []
        for calls, inputs in zip(sessions, xs):
            cache = naive.new_cache(3, 32)
            refs.append([naive(x, cache, lengths) for x, lengths in zip(inputs, calls)])
    for backend, layer in layers.items():
        runs = []
        for calls, inputs, outputs in zip(sessions, xs, refs):
            cache = layer.new_cache(3, 32)
            cache.kv_cache.fill_(float("nan"))
            for x, ref, lengths in zip(inputs, outputs, calls):
                ran.clear()
                with torch.no_grad():
                    out = layer(x, cache, lengths)
                assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-5, (backend, lengths)
                runs.append(list(ran))
        # the equal prompts as the option says; the extend on the kernel (the new tokens, then
        # one context chunk); the ragged prompts on SDPA only where forced ("auto" keeps ragged
        # rows on the kernel)
        first = "_sdpa_prefill_latent" if sdpa_if_no_context[backend] == "sdpa" else "mla_prefill"
        last = "_sdpa_prefill_latent" if backend == "sdpa" else "mla_prefill"
        assert runs == [[first], ["mla_prefill", "mla_prefill"], [last]], backend
    for bad in ("cudnn", None, True, "SDPA"):
        with pytest.raises(ValueError, match="prefill_backend must be one of"):
            mla.build(weights, "paged", prefill_backend=bad)


# ---- memory: the scores are never materialised -------------------------------------------------

_MEMORY_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    sys.path.insert(0, {root!r})
    import mla.kernels
    from mla.kernels import chunked_context_prefill
    torch.manual_seed(0)
    news, contexts, h, d, r, dv, c, page = {news}, {contexts}, 1, 16, 16, 16, 16, 64
    b, tq = len(news), sum(news)
    pages = [-(-n // page) for n in contexts]
    kv_cache = torch.randn(sum(pages), page, c + r)
    block_table = torch.zeros(b, max(pages), dtype=torch.int32)
    first = 0
    for i, p in enumerate(pages):
        block_table[i, :p] = torch.arange(first, first + p, dtype=torch.int32)
        first += p
    args = (torch.randn(tq, h, d), torch.randn(tq, h, r), torch.randn(tq, c), torch.randn(tq, r),
            torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32),
            kv_cache, block_table, torch.tensor(contexts, dtype=torch.int32))
    kw = dict(W_UK=torch.randn(h, d, c), W_UV=torch.randn(h, dv, c), softmax_scale=0.25, workspace_tokens=16384)
    small = [t[:2] for t in args[:4]]  # a small call first: the interpreter's imports and caches
    chunked_context_prefill(*small, torch.tensor([0, 2], dtype=torch.int32), kv_cache, block_table[:1],
                            torch.tensor([100], dtype=torch.int32), **kw)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out, lse = chunked_context_prefill(*args, **kw)
    assert not out.isnan().any()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((peak - base) * 1024)  # ru_maxrss is in KiB on Linux
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux only")
def test_peak_memory_does_not_grow_with_new_tokens_times_context():
    """A batch whose padded materialised scores need 2 GiB runs in well under 64 MiB of extra RSS.

    One sequence adds 2 tokens to a 2^18-token context, another is a 1024-token prompt. Scores
    materialised the way ``attend_up_projected`` does, padded to the batch's longest row, are
    (b, s_max, h, t_max) = (2, 1024, 1, 2^18 + 2) float32 = 2 GiB (and the softmax as much again);
    the chunked kernel path holds the outputs and one 16384-token workspace (2 MiB here).
    """
    news, contexts = [2, 1024], [2**18, 0]
    padded_scores = len(news) * max(news) * 1 * max(n + s for n, s in zip(contexts, news)) * 4
    assert padded_scores >= 2 * 2**30
    script = _MEMORY_SCRIPT.format(root=str(ROOT), news=news, contexts=contexts)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "",
                               # one BLAS thread: the interpreter's many small numpy matmuls run
                               # several times slower with threads contending for 2 cores
                               "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    grown = int(proc.stdout.strip().splitlines()[-1])
    assert grown < 64 * 2**20, f"peak RSS grew by {grown / 2**20:.1f} MiB"


# ---- GPU: bf16 at DeepSeek-V3's sizes ----------------------------------------------------------

V3 = dict(d=128, r=64, dv=128)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_bf16_v3_ragged_causal(heads):
    lens_q = [1, 77, 300, 1024, 129]
    lens_k = [1, 77, 1000, 1024, 4000]
    args = make_varlen(lens_q, lens_k, h=heads, dtype=torch.bfloat16, device="cuda", **V3)
    out, lse = mla_prefill(*args, softmax_scale=192**-0.5)
    ref_out, ref_lse = mla_prefill_reference(*args, softmax_scale=192**-0.5)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel_err(out, ref_out) < 2e-2
    assert_lse_close(lse, ref_lse, 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_runs_on_the_gpu_of_q():
    # q on the second GPU while the first is current (a model spread over GPUs in one process):
    # Triton launches on the current device, so mla_prefill makes q's current for the call
    args = make_varlen([1, 77, 300], [1, 77, 1000], h=16, dtype=torch.bfloat16, device="cuda:1", **V3)
    with torch.cuda.device(0):
        out, lse = mla_prefill(*args, softmax_scale=192**-0.5)
        torch.cuda.synchronize(1)
    ref_out, ref_lse = mla_prefill_reference(*args, softmax_scale=192**-0.5)
    assert out.device == lse.device == torch.device("cuda:1")
    assert rel_err(out, ref_out) < 2e-2
    assert_lse_close(lse, ref_lse, 1e-2)


@pytest.mark.gpu
def test_gpu_bf16_matches_sdpa():
    s, h = 2048, 16
    q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k = make_varlen([s], [s], h=h, dtype=torch.bfloat16, device="cuda", **V3)
    out, _ = mla_prefill(q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k, softmax_scale=192**-0.5)
    q = torch.cat([q_nope, q_pe], -1).transpose(0, 1).float()
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, h, -1)], -1).transpose(0, 1).float()
    expected = F.scaled_dot_product_attention(q, k, v.transpose(0, 1).float(), is_causal=True, scale=192**-0.5)
    assert rel_err(out.transpose(0, 1), expected) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("workspace", [10_000, 700])
def test_gpu_bf16_chunked_context(workspace):
    case, context_rows = make_context_case([300, 1, 64], [2000, 500, 0], page=64, h=16, d=128, r=64, dv=128, c=512,
                                           dtype=torch.bfloat16, device="cuda")
    out, lse = chunked_context_prefill(**case, workspace_tokens=workspace)
    ref_out, ref_lse = context_reference(case, context_rows, compute_dtype=torch.float32)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel_err(out, ref_out) < 3e-2
    assert_lse_close(lse, ref_lse, 1e-2)


@pytest.mark.gpu
def test_gpu_long_prompt_memory():
    """A 32k-token prompt at 16 heads: the kernel allocates its outputs and nothing of size s x s."""
    s, h = 32768, 16
    args = make_varlen([s], [s], h=h, dtype=torch.bfloat16, device="cuda", **V3)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out, lse = mla_prefill(*args, softmax_scale=192**-0.5, max_seqlen_q=s, max_seqlen_k=s)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - before
    assert grown <= out.numel() * out.element_size() + lse.numel() * 4 + 2**20
    assert not out.isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[2048, 2048], [300, 1000, 77]])
def test_gpu_bf16_sdpa_prefill_v3(lens):
    """cuDNN (or memory-efficient) SDPA at V3's head dims, 128 heads: rows of one length in one
    batched call, ragged rows one call each."""
    args = make_varlen(lens, lens, h=128, dtype=torch.bfloat16, device="cuda", **V3)
    out = sdpa_prefill(*args[:6], softmax_scale=192**-0.5, max_seqlen_q=max(lens))
    ref_out, _ = mla_prefill_reference(*args, softmax_scale=192**-0.5)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel_err(out, ref_out) < 2e-2


@pytest.mark.gpu
def test_gpu_sdpa_prefill_stores_no_score():
    """A 32k-token prompt at 16 heads: its scores would be 32 GiB in bf16; SDPA's tiled backends
    allocate q, k, their copies and the output, under 2 GiB."""
    s, h = 32768, 16
    args = make_varlen([s], [s], h=h, dtype=torch.bfloat16, device="cuda", **V3)
    assert s * s * h * 2 >= 32 * 2**30
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = sdpa_prefill(*args[:6], softmax_scale=192**-0.5, max_seqlen_q=s)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 2 * 2**30
    assert not out.isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("workspace", [None, 300])
def test_gpu_layer_prefill_backends_agree(workspace, monkeypatch):
    """V2-Lite in bf16: prompts of one length, more than PREFILL_KERNEL_UP_TO tokens in all
    (auto takes SDPA on the GPU), then ragged prompts (auto keeps the kernel), each
    prefill_backend against the absorbed tier; with a 300-token workspace step 1 runs in head
    groups (cuDNN and the kernel on strided head views). Every row is at least
    PREFILL_CROSSOVER tokens long, so every row up-projects."""
    import mla

    ran = []
    real_sdpa = context_module._sdpa_prefill_latent
    monkeypatch.setattr(context_module, "_sdpa_prefill_latent",
                        lambda *a, **k: ran.append("sdpa") or real_sdpa(*a, **k))
    cfg = MLAConfig.from_preset("deepseek-v2-lite")
    weights = MLAWeights(cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    absorbed = mla.build(weights, "absorbed")
    assert choose_prefill_backend("auto", "cuda", equal_rows=True, new_tokens=2200) == "sdpa"
    for lengths in ([1100, 1100], [1100, 1000]):
        x = torch.randn(2, 1100, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            ref = absorbed(x, absorbed.new_cache(2, 1100), lengths)
            for backend in PREFILL_BACKENDS:
                layer = mla.build(weights, "paged", prefill_backend=backend, workspace_tokens=workspace)
                ran.clear()
                out = layer(x, layer.new_cache(2, 1100), lengths)
                assert torch.isfinite(out).all() and rel_err(out, ref) < 2e-2, (backend, lengths)
                took_sdpa = backend == "sdpa" or (backend == "auto" and lengths[0] == lengths[1])
                assert bool(ran) == took_sdpa, (backend, lengths, ran)
                if workspace and took_sdpa:                        # 2200 or 2100 tokens, 16 heads
                    assert len(ran) == -(-cfg.num_heads // head_group(sum(lengths), cfg.num_heads, workspace)) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("d, r, dv", [(16, 8, 12), (12, 6, 16)])
def test_gpu_chunked_context_sdpa_head_dims_not_multiples_of_8(d, r, dv):
    """The layer's SDPA path in bf16 on cuDNN / memory-efficient attention with widths that are
    not multiples of 8, one head a group: its key and value views are copied to aligned rows."""
    case, context_rows = make_context_case([33, 33], [0, 0], page=16, h=3, d=d, r=r, dv=dv,
                                           dtype=torch.bfloat16, device="cuda")
    ref_out, _ = context_reference(case, context_rows)
    for workspace in (100, 11):                        # every head at once; one head a group
        out, _ = chunked_context_prefill(**case, workspace_tokens=workspace, backend="sdpa")
        assert out.shape == (66, 3, dv) and rel_err(out, ref_out) < 2e-2, workspace


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_sdpa_prefill_head_dims_not_multiples_of_8(dtype):
    """v of 12 dims (cuDNN and memory-efficient take multiples of 8: padded, then cut); float32
    (memory-efficient only)."""
    args = make_varlen([33, 33], [33, 33], h=2, dtype=dtype, device="cuda")
    out = sdpa_prefill(*args[:6], softmax_scale=0.3)
    ref_out, _ = mla_prefill_reference(*args, softmax_scale=0.3, compute_dtype=torch.float64)
    assert out.shape == (66, 2, 12) and rel_err(out, ref_out) < (2e-3 if dtype == torch.float16 else 1e-4)
