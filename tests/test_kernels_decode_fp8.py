"""Tests of mla_decode on fp8 caches: kv_cache_dtype "fp8_e4m3" (one scale) and "fp8_ds_mla"
(FlashMLA's row: e4m3 latent, a float32 scale per 128 values, bf16 rope).

Caches are written by ``concat_and_cache`` (torch reference) from random float32 latents, pages
in random order; every byte of the unused pages and of the partial-page tails is an e4m3 NaN
(0xFF for "fp8_e4m3", 0x7F for "fp8_ds_mla"), and unused block-table entries are out of range,
so a read outside a sequence's rows shows as NaN or a fault. On the CPU the Triton kernel runs in
its interpreter, q in float32 (the interpreter's bf16 dot is wrong). The GPU tests also run the
sm_80 CUDA stage 1 on both layouts (``_backend="cuda-sm80"``), every unused byte 0xFF.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

import mla.kernels  # noqa: F401  (sets TRITON_INTERPRET before triton is imported on a CPU machine)
from mla.kernels import fp8
from mla.kernels.concat_cache import concat_and_cache
from mla.kernels.decode import mla_decode, mla_decode_reference
from mla.kernels.decode import _e4m3_conversion
from mla.kernels.triton_decode import E4M3_INTEGER_OPS, E4M3_INTERPRETER, _e4m3_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ("fp8_e4m3", "fp8_ds_mla")
POISON = {"fp8_e4m3": 0xFF, "fp8_ds_mla": 0x7F}  # both e4m3 NaN


def make_fp8_case(kind, seq_lens, *, heads, c=256, r=16, block_size=16, s_q=None, seed=0, device=DEVICE,
                  q_scale=1.0, poison=None, group_growth=None, row_pad=0):
    """An fp8 cache of len(seq_lens) sequences and the float32 cache of the same latents.

    Returns (args for mla_decode, the float32 "auto" cache, the latents (T, c + r) in the order
    written, the latents' positions); q is (b, heads, c + r) or (b, s_q, heads, c + r), scaled by
    ``q_scale``. Every unwritten byte of the cache is ``poison`` (``POISON[kind]`` by default).
    ``group_growth``: latent group g (128 values) times group_growth**g, so that a reader taking
    a neighbour group's scale is far off. ``row_pad``: the fp8 cache is a view of rows
    ``row_pad`` bytes wider (row and page strides other than the width)."""
    gen = torch.Generator().manual_seed(seed)
    b, d = len(seq_lens), c + r
    pages = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(pages) + 2
    order = torch.randperm(num_blocks, generator=gen)
    block_table = torch.tensor([10**6, -7] * (max(pages) + 2), dtype=torch.int32)[: max(pages) + 2].repeat(b, 1)
    slots, start = [], 0
    for i, (n, p) in enumerate(zip(seq_lens, pages)):
        block_table[i, :p] = order[start : start + p].int()
        start += p
        slots += [int(block_table[i, t // block_size]) * block_size + t % block_size for t in range(n)]
    latents = torch.randn(len(slots), d, generator=gen)  # (T, c + r)
    # channels of different sizes, as a normed latent has: the groups' scales differ
    latents[:, :c] *= torch.logspace(-1, 1, c // 32).repeat_interleave(32)[torch.randperm(c // 32, generator=gen)
                                                                             .repeat_interleave(32)]
    if group_growth is not None:
        latents[:, :c] *= (group_growth ** torch.arange(c // 128).float()).repeat_interleave(128)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    kv_c, k_pe = latents[:, :c], latents[:, c:]

    width = fp8.bytes_per_token(kind, c, r)
    cache = torch.full((num_blocks, block_size, width), POISON[kind] if poison is None else poison,
                       dtype=torch.uint8)
    scale = None
    if kind == "fp8_e4m3":
        cache = cache.view(torch.float8_e4m3fn)
        scale = fp8.calibrate_e4m3_scale(kv_c, k_pe)  # the largest |value| maps to 448: nothing clips
    concat_and_cache(kv_c, k_pe, cache, slot_mapping, kv_cache_dtype=kind, scale=scale, backend="reference")
    cache = cache.to(device)
    if row_pad:  # built on the device: copying a strided view there would make it contiguous
        wide = torch.full((num_blocks, block_size, width + row_pad), POISON[kind] if poison is None else poison,
                          dtype=torch.uint8, device=device).view(cache.dtype)
        wide[..., :width] = cache
        cache = wide[..., :width]
    exact = torch.full((num_blocks, block_size, d), float("nan"))
    concat_and_cache(kv_c, k_pe, exact, slot_mapping, backend="reference")

    q_shape = (b, heads, d) if s_q is None else (b, s_q, heads, d)
    q = torch.randn(q_shape, generator=gen) * q_scale
    args = dict(q=q.to(device), kv_cache=cache, block_table=block_table.to(device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), kv_lora_rank=c,
                softmax_scale=d**-0.5, kv_cache_dtype=kind,
                kv_scale=None if scale is None else scale.to(device))
    return args, exact.to(device), latents, scale


def same_bytes(a, b):
    """Equal bit for bit (NaN patterns included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def dequantised(args):
    """The fp8 cache of ``args`` read back whole by mla.kernels.fp8, as a float32 (blocks, n, c + r)."""
    cache, c = args["kv_cache"], args["kv_lora_rank"]
    if args["kv_cache_dtype"] == "fp8_e4m3":
        return torch.cat(fp8.dequantize_e4m3(cache, c, args["kv_scale"]), dim=-1)
    return torch.cat(fp8.dequantize_ds_mla(cache, c, args["q"].shape[-1] - c), dim=-1)


def as_auto(args, cache):
    """``args`` for the same decode on a cache in q's dtype."""
    return dict(args, kv_cache=cache, kv_cache_dtype="auto", kv_scale=None)


def assert_close_rows(out, lse, ref_out, ref_lse, tol):
    """out, lse (..., h, c), (..., h) against the reference: -inf lse (a token that sees no row)
    exactly with out 0, the rest within ``tol`` of the output's scale; no NaN."""
    assert not out.isnan().any() and not lse.isnan().any()
    empty = ref_lse == float("-inf")
    assert (lse[empty] == float("-inf")).all() and (out[empty] == 0).all()
    if (~empty).any():
        err = (out[~empty].double() - ref_out[~empty].double()).abs().max() / ref_out[~empty].abs().max()
        assert err.item() < tol
        assert (lse[~empty].double() - ref_lse[~empty].double()).abs().max().item() < tol


# ---------------------------------------------------------------------------------------------
# The e4m3 decoding the kernel does in registers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _decode_bytes_kernel(x_ptr, y_ptr, N: tl.constexpr, E4M3: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, _e4m3_to(tl.load(x_ptr + offs), y_ptr.dtype.element_ty, E4M3))


# the way mla_decode converts on this device, and integer ops (a GPU before sm_89), which every
# device runs; into each dtype the kernel converts to (sm_90 reaches bf16 through fp16, sm_89
# through float32)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("conversion", ["this device's", "integer ops"])
def test_e4m3_decoding_matches_torch_on_all_256_bytes(conversion, dtype):
    e4m3 = _e4m3_conversion(torch.device(DEVICE)) if conversion == "this device's" else E4M3_INTEGER_OPS
    byte = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    got = torch.empty(256, dtype=dtype, device=DEVICE)
    _decode_bytes_kernel[(1,)](byte, got, 256, e4m3)
    want = byte.view(torch.float8_e4m3fn).to(dtype)
    nan = want.isnan()
    assert nan.sum() == 2 and (got.isnan() == nan).all()  # 0x7F, 0xFF
    # bit for bit elsewhere: signed zeros, the subnormals m * 2^-9, +-448
    assert same_bytes(got[~nan], want[~nan])


def test_the_interpreter_converts_its_own_way_on_any_device(monkeypatch):
    # Triton interprets GPU tensors too (TRITON_INTERPRET=1 on a GPU machine): its conversion
    # reads 0x7F as 480 there as well, so the NaN fix-up applies whatever q's device
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for device in ("cpu", "cuda", "cuda:1"):
        assert _e4m3_conversion(torch.device(device)) == E4M3_INTERPRETER


# ---------------------------------------------------------------------------------------------
# Against the reference on the dequantised cache: the same float32 values, so fp32 rounding only
# ---------------------------------------------------------------------------------------------

# the kernel and the reference see the same float32 cache values (ds_mla: value * scale in
# float32 both; e4m3: the kernel applies the one scale to the scores and the output instead, a
# float32 rounding); what remains is the kernel's fp32 dots and exp2 against float64, as in
# tests/test_kernels_decode.py (1e-5 there over c + r <= 80 terms; c + r = 272 here)
TIGHT = 2e-5


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("s_q, splits", [(None, None), (None, 3), (3, None), (2, 4)],
                         ids=["one-token", "one-token-3-splits", "sq3", "sq2-4-splits"])
def test_matches_reference_on_dequantised_cache(kind, s_q, splits):
    args, _, _, _ = make_fp8_case(kind, [0, 1, 37, 70], heads=3, s_q=s_q, seed=1)
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    out, lse = mla_decode(**args, num_kv_splits=splits)
    ref_out, ref_lse = mla_decode_reference(**args)
    # the reference of the fp8 cache is the plain reference on fp8.dequantize_*'s cache
    plain_out, plain_lse = mla_decode_reference(**as_auto(args, dequantised(args)))
    torch.testing.assert_close(ref_out, plain_out, rtol=0, atol=0)
    torch.testing.assert_close(ref_lse, plain_lse, rtol=0, atol=0)
    assert out.dtype == torch.float32 and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert_close_rows(out, lse, ref_out, ref_lse, TIGHT)
    for k, v in before.items():
        assert same_bytes(args[k], v)


@pytest.mark.parametrize("kind", KINDS)
def test_group_scales_matter(kind):
    # c = 384 (three groups, BLOCK_C = 512: a masked fourth), pages of 5 (tiles span pages)
    args, _, _, _ = make_fp8_case(kind, [9, 23], heads=2, c=384, r=8, block_size=5, seed=2)
    out, lse = mla_decode(**args)
    ref_out, ref_lse = mla_decode_reference(**args)
    assert_close_rows(out, lse, ref_out, ref_lse, TIGHT)


def test_e4m3_scale_near_the_float32_floor():
    # the smallest scale check_e4m3_scale takes, 2^-126, over 1000 rows of about equal scores
    # in one split (l = 1000): kv_scale / l is a float32 subnormal, 2^-136, with 10 bits fewer than a
    # normal one, so the kernel applies the scale after dividing by l. Every latent value is
    # made positive (the sign bit cleared; 0xFF stays a NaN, 0x7F), so out, their mean times
    # 2^-126, is a normal float32 that keeps every bit
    args, _, _, _ = make_fp8_case("fp8_e4m3", [1000], heads=2, seed=7)
    args["kv_cache"].view(torch.uint8)[..., : args["kv_lora_rank"]] &= 0x7F
    args["kv_scale"] = torch.tensor([2.0**-126], device=DEVICE)
    out, lse = mla_decode(**args, num_kv_splits=1)
    ref_out, ref_lse = mla_decode_reference(**args)
    assert ref_out.min() > 2.0**-126
    assert_close_rows(out, lse, ref_out, ref_lse, TIGHT)


@pytest.mark.parametrize("kind", KINDS)
def test_a_nan_byte_in_a_row_a_query_sees_makes_its_out_and_lse_nan(kind):
    # byte 0 of sequence 0's last row set to 0x7F, an e4m3 NaN in the latent (key and value):
    # its scores, sums and outputs are NaN through the conversion (on a GPU, in hardware), stage
    # 1's normalisation and the merge, as the reference's; sequence 1 is untouched
    args, _, _, _ = make_fp8_case(kind, [40, 40], heads=2, seed=8)
    block, slot = divmod(40 - 1, 16)
    args["kv_cache"].view(torch.uint8)[args["block_table"][0, block], slot, 0] = 0x7F
    ref_out, ref_lse = mla_decode_reference(**args)
    assert ref_out[0].isnan().all() and ref_lse[0].isnan().all()
    for splits in (1, 2):
        out, lse = mla_decode(**args, num_kv_splits=splits)
        assert out[0].isnan().all() and lse[0].isnan().all()
        assert_close_rows(out[1:], lse[1:], ref_out[1:], ref_lse[1:], TIGHT)


def test_ds_mla_reads_each_group_its_own_scale():
    # scale group 1 of every row by 2 in place of its stored scale: the kernel must follow
    args, _, _, _ = make_fp8_case("fp8_ds_mla", [20], heads=2, seed=3)
    c = args["kv_lora_rank"]
    scales = args["kv_cache"][..., c + 4 : c + 8].contiguous().view(torch.float32)
    args["kv_cache"][..., c + 4 : c + 8] = (scales * 2).view(torch.uint8)
    out, lse = mla_decode(**args)
    ref_out, ref_lse = mla_decode_reference(**args)
    assert_close_rows(out, lse, ref_out, ref_lse, TIGHT)


def test_bf16_query_on_the_cpu():
    # bf16 q runs in float32 on the CPU (fp8 pages copied as bytes); out rounded to bf16 (2^-9)
    args, _, _, _ = make_fp8_case("fp8_ds_mla", [0, 30], heads=3, seed=4)
    args["q"] = args["q"].bfloat16()
    out, lse = mla_decode(**args, num_kv_splits=2)
    ref_out, ref_lse = mla_decode_reference(**args)
    assert out.dtype == torch.bfloat16
    assert_close_rows(out.float(), lse, ref_out.float(), ref_lse, 1e-2)


# ---------------------------------------------------------------------------------------------
# Against the float32 cache of the same latents: the fp8 rounding, within a bound derived from
# the e4m3 step
# ---------------------------------------------------------------------------------------------


def value_error_bound(kind, latents, c, scale):
    """(T, c + r): the most each cached value can move, from docs/derivations/fp8-cache.md:
    |x^ - x| <= max(|x| / 17, 2^-10 s) (1 + 2^-18) for a value stored in e4m3 under scale s
    (half an e4m3 step, 2^-4 of the value's binade, is at most |x| / 17 above 2^-6 s, and 2^-10 s
    among the subnormals below), with s the cache's one scale ("fp8_e4m3") or its group's
    amax / 448 ("fp8_ds_mla", 1e-6 added for the float32 rounding of the quotient); bf16 rope
    values move by at most |x| / 257 (half a step of 8 significant bits)."""
    mag = latents.abs().double()
    if kind == "fp8_e4m3":
        return torch.maximum(mag / 17, 2.0**-10 * float(scale) * torch.ones_like(mag)) * (1 + 2**-18)
    T = latents.shape[0]
    groups = mag[:, :c].reshape(T, -1, fp8.DS_MLA_GROUP)
    s = (groups.amax(-1, keepdim=True) / 448 * (1 + 1e-6)).clamp_min(fp8.MIN_SCALE)
    nope = torch.maximum(groups / 17, 2.0**-10 * s).reshape(T, c) * (1 + 2**-18)
    return torch.cat([nope, mag[:, c:] / 257], dim=-1)


@pytest.mark.parametrize("kind", KINDS)
def test_within_the_e4m3_bound_of_the_exact_cache(kind):
    """fp8 decode against the float64 reference on the float32 cache of the same latents.

    Every cached value k_td moves by at most e_td (``value_error_bound``). A score moves by at
    most delta = softmax_scale * max_t sum_d |q_d| e_td, so each softmax weight by a factor within
    exp(+-2 delta), and sum_t |p'_t - p_t| <= exp(2 delta) - 1. Hence, per query row,

        |out' - out| <= max_td e_td (values, d < c) + (exp(2 delta) - 1) max_td |v_td|
        |lse' - lse| <= delta

    plus 1e-5 of the output's scale for the kernel's float32 arithmetic. q is scaled by 1/4 so
    that delta stays small (~0.1) and the bound is a fraction of the output, not a multiple.
    """
    seq_lens = [0, 1, 37, 70]
    args, exact, latents, scale = make_fp8_case(kind, seq_lens, heads=3, s_q=2, seed=5, q_scale=0.25)
    c = args["kv_lora_rank"]
    out, lse = mla_decode(**args)
    ref_out, ref_lse = mla_decode_reference(**as_auto(args, exact))
    e = value_error_bound(kind, latents, c, scale)  # (T, c + r), rows in the order written
    first = 0
    for i, n in enumerate(seq_lens):
        rows = slice(first, first + n)
        first += n
        if n == 0:
            assert (lse[i] == float("-inf")).all() and (out[i] == 0).all()
            continue
        q = args["q"][i].double().abs()  # (s_q, h, c + r)
        delta = args["softmax_scale"] * torch.einsum("jhd,td->jht", q, e[rows]).amax(-1)  # (s_q, h)
        v_max = latents[rows, :c].abs().max().item()
        bound = e[rows, :c].max().item() + (torch.exp(2 * delta) - 1) * v_max + 1e-5 * v_max
        seen = ref_lse[i] > float("-inf")  # (s_q, h)
        assert (lse[i][~seen] == float("-inf")).all()
        out_err = (out[i].double() - ref_out[i].double()).abs().amax(-1)  # (s_q, h)
        assert (out_err[seen] <= bound[seen]).all()
        assert ((lse[i].double() - ref_lse[i].double()).abs()[seen] <= delta[seen] + 1e-5).all()
        # the bound is not vacuous: well under the output's size, and fp8 does move the output
        assert bound[seen].max() < 0.5 * v_max and out_err[seen].max() > 0


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, nothing changed
# ---------------------------------------------------------------------------------------------


def _v3_args(kind, width=None, dtype=None, kv_scale=None):
    """A one-block DeepSeek-V3-sized (c = 512, r = 64) call that checks fail before any kernel."""
    width = width or fp8.bytes_per_token(kind, 512, 64)
    dtype = dtype or (torch.float8_e4m3fn if kind in ("fp8", "fp8_e4m3") else torch.uint8)
    cache = torch.zeros(2, 4, width, dtype=torch.uint8).view(dtype) if dtype != torch.float32 else \
        torch.zeros(2, 4, width)
    return dict(q=torch.randn(1, 2, 576), kv_cache=cache, block_table=torch.zeros(1, 2, dtype=torch.int32),
                seq_lens=torch.tensor([3], dtype=torch.int32), kv_lora_rank=512, softmax_scale=0.1,
                kv_cache_dtype=kind, kv_scale=kv_scale)


BAD_FP8 = {
    "ds-width-655": (lambda: _v3_args("fp8_ds_mla", width=655), ValueError, r"kv_cache's last dim must be .* = 656"),
    "ds-width-657": (lambda: _v3_args("fp8_ds_mla", width=657), ValueError, r"kv_cache's last dim must be .* = 656"),
    "e4m3-width-577": (lambda: _v3_args("fp8_e4m3", width=577, kv_scale=1.0), ValueError,
                       r"kv_cache's last dim must be c \+ r = 576"),
    "ds-dtype-float8": (lambda: _v3_args("fp8_ds_mla", dtype=torch.float8_e4m3fn), TypeError,
                        "kv_cache must be torch.uint8 for kv_cache_dtype='fp8_ds_mla'"),
    "e4m3-dtype-uint8": (lambda: _v3_args("fp8_e4m3", width=576, dtype=torch.uint8, kv_scale=1.0), TypeError,
                         "kv_cache must be torch.float8_e4m3fn for kv_cache_dtype='fp8_e4m3'"),
    "auto-on-ds-cache": (lambda: _v3_args("auto", width=656, dtype=torch.uint8), TypeError,
                         "kv_cache must have q's dtype .*pass kv_cache_dtype='fp8_ds_mla'"),
    "auto-on-e4m3-cache": (lambda: _v3_args("auto", width=576, dtype=torch.float8_e4m3fn), TypeError,
                           "kv_cache must have q's dtype .*pass kv_cache_dtype='fp8_e4m3'"),
    "e4m3-scale-missing": (lambda: _v3_args("fp8_e4m3"), ValueError, "kv_scale is required"),
    "e4m3-scale-nan": (lambda: _v3_args("fp8_e4m3", kv_scale=float("nan")), ValueError,
                       "kv_scale must be positive and finite"),
    "e4m3-scale-inf": (lambda: _v3_args("fp8_e4m3", kv_scale=float("inf")), ValueError,
                       "kv_scale must be positive and finite"),
    "e4m3-scale-0": (lambda: _v3_args("fp8_e4m3", kv_scale=0.0), ValueError, "kv_scale must be positive and finite"),
    "e4m3-scale-negative": (lambda: _v3_args("fp8_e4m3", kv_scale=-1.0), ValueError,
                            "kv_scale must be positive and finite"),
    "e4m3-scale-underflows-float32": (lambda: _v3_args("fp8_e4m3", kv_scale=1e-50), ValueError,
                                      "kv_scale must be positive and finite"),
    "e4m3-scale-subnormal": (lambda: _v3_args("fp8_e4m3", kv_scale=1e-40), ValueError,
                             r"kv_scale must be positive and finite, at least 2\^-126"),
    "e4m3-scale-tensor-nan": (lambda: _v3_args("fp8_e4m3", kv_scale=torch.tensor([float("nan")])), ValueError,
                              "kv_scale must be positive and finite"),
    "e4m3-scale-tensor-0": (lambda: _v3_args("fp8", kv_scale=torch.tensor(0.0)), ValueError,
                            "kv_scale must be positive and finite"),
    "e4m3-scale-float64": (lambda: _v3_args("fp8_e4m3", kv_scale=torch.tensor([1.0], dtype=torch.float64)),
                           TypeError, "kv_scale must be a float or a 1-element float32 tensor"),
    "e4m3-scale-two": (lambda: _v3_args("fp8_e4m3", kv_scale=torch.ones(2)), TypeError,
                       "kv_scale must be a float or a 1-element float32 tensor"),
    "e4m3-scale-str": (lambda: _v3_args("fp8_e4m3", kv_scale="1"), TypeError, "kv_scale must be a float"),
    "ds-scale-given": (lambda: _v3_args("fp8_ds_mla", kv_scale=1.0), ValueError,
                       "kv_scale is for kv_cache_dtype='fp8_e4m3' only"),
    "auto-scale-given": (lambda: dict(_v3_args("auto", width=576, dtype=torch.float32), kv_scale=1.0), ValueError,
                         "kv_scale is for kv_cache_dtype='fp8_e4m3' only"),
    "unknown-kind": (lambda: dict(_v3_args("fp8_ds_mla"), kv_cache_dtype="fp8_e5m2"), ValueError,
                     "kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_ds_mla', got 'fp8_e5m2'"),
    # rows that start off a 4-byte boundary: the scales could not be read as float32 in place
    "ds-row-stride-657": (lambda: dict(_v3_args("fp8_ds_mla"),
                                       kv_cache=torch.zeros(2, 4, 657, dtype=torch.uint8)[..., :656]), ValueError,
                          r"fp8_ds_mla kv_cache's rows must start at multiples of 4 bytes .*strides \(2628, 657, 1\)"),
    "ds-storage-offset-2": (lambda: dict(_v3_args("fp8_ds_mla"),
                                         kv_cache=torch.zeros(2 * 4 * 656 + 2, dtype=torch.uint8)[2:].view(2, 4, 656)),
                            ValueError, r"rows must start at multiples of 4 bytes .*got data_ptr % 4 = 2"),
    "ds-rank-not-128s": (lambda: dict(_v3_args("fp8_ds_mla", width=500 + 12 + 152), kv_lora_rank=500), ValueError,
                         "kv_lora_rank c must be a multiple of 128 for kv_cache_dtype='fp8_ds_mla'"),
}


@pytest.mark.parametrize("name", list(BAD_FP8))
def test_bad_fp8_input(name):
    make, error, message = BAD_FP8[name]
    args = make()
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    for op in (mla_decode, mla_decode_reference):
        with pytest.raises(error, match=message):
            op(**args)
    for k, v in before.items():
        assert same_bytes(args[k], v)


@pytest.mark.parametrize("backend", ["cuda-sm80", "cuda-sm90"])
@pytest.mark.parametrize("kind", ["fp8", *KINDS])
def test_cuda_stage1_takes_fp8(kind, backend):
    # forcing either CUDA stage 1 on an fp8 cache is refused for the CPU only, not for the layout
    args = _v3_args(kind, kv_scale=None if kind == "fp8_ds_mla" else 1.0)
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=rf"_backend='{backend}' cannot run these arguments: q is on cpu, not a GPU$"):
        mla_decode(**args, _backend=backend)
    for k, v in before.items():
        assert same_bytes(args[k], v)


@pytest.mark.parametrize("heads, kernel, switch", [(16, "cuda-sm80", "SM80_READS_FP8_BY_DEFAULT"),
                                                   (128, "cuda-sm90", "SM90_READS_FP8_BY_DEFAULT")])
@pytest.mark.parametrize("kind", KINDS)
def test_fp8_cache_runs_on_the_cuda_kernel_of_its_heads_by_default(kind, heads, kernel, switch, monkeypatch):
    """The backend policy alone, so without a GPU: a stand-in q that says it is on one and CUDA
    kernels that say they can run. A call on a cache in q's dtype picks "cuda-sm80" at 16 heads,
    "cuda-sm90" at 128, and so does a call on an fp8 cache while that kernel's switch
    (``backends.SM80_READS_FP8_BY_DEFAULT`` / ``SM90_READS_FP8_BY_DEFAULT``) is on, as it is by
    default; with it off the fp8 cache goes to "triton", the other kernel's switch changing
    nothing; forced, the kernel takes it either way."""
    from types import SimpleNamespace

    from mla.kernels import backends

    asked = []  # the layouts the kernels were judged on

    def can_run(backend, q, kv_cache, block_table, seq_lens, kv_lora_rank, kv_cache_dtype="auto"):
        asked.append(kv_cache_dtype)
        return None

    monkeypatch.setattr(backends, "why_backend_cannot_run", can_run)
    smem = [232448]  # an H100 / H200's shared memory a block
    monkeypatch.setattr(backends, "_smem_per_block", lambda device: smem[0])
    args = _v3_args(kind, kv_scale=1.0 if kind == "fp8_e4m3" else None)
    q = SimpleNamespace(device=torch.device("cuda"), shape=(1, heads, 576), dtype=torch.bfloat16)

    def pick(**options):
        return backends.choose_decode_backend(q, args["kv_cache"], args["block_table"], args["seq_lens"],
                                              kv_lora_rank=512, **options)

    assert pick(kv_cache_dtype="auto") == kernel  # the stand-in reaches the CUDA choice
    assert getattr(backends, switch)
    assert pick(kv_cache_dtype=kind) == kernel
    assert asked[-1] == kind  # the kernel is judged on the cache's layout
    monkeypatch.setattr(backends, switch, False)
    assert pick(kv_cache_dtype=kind) == "triton"
    assert pick(kv_cache_dtype=kind, backend=kernel) == kernel
    other = "SM90_READS_FP8_BY_DEFAULT" if switch == "SM80_READS_FP8_BY_DEFAULT" else "SM80_READS_FP8_BY_DEFAULT"
    monkeypatch.setattr(backends, other, False)
    monkeypatch.setattr(backends, switch, True)
    assert pick(kv_cache_dtype=kind) == kernel
    # a GPU of 99 KB a block (sm_86 / 89 / 120) fits the sm_80 kernel's fp8 shapes but not its
    # bf16 one: fp8 stays on "triton" there unless forced; the sm_90 choice does not ask
    smem[0] = 101376
    assert pick(kv_cache_dtype=kind) == ("triton" if kernel == "cuda-sm80" else kernel)
    assert pick(kv_cache_dtype=kind, backend=kernel) == kernel


# ---------------------------------------------------------------------------------------------
# GPU: bf16 q at DeepSeek-V3 sizes (c = 512, r = 64, pages of 64), the default backend choice
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("heads, s_q", [(16, None), (128, None), (16, 2)], ids=["h16", "h128", "h16-sq2"])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_bf16_deepseek_v3(kind, heads, s_q):
    seq_lens = [0, 1, 64, 700, 2049]
    args, _, _, _ = make_fp8_case(kind, seq_lens, heads=heads, c=512, r=64, block_size=64, s_q=s_q, seed=6,
                                  device="cuda")
    args["q"] = args["q"].bfloat16()
    out, lse = mla_decode(**args)  # the default backend choice: the CUDA kernel of its heads
    ref_out, ref_lse = mla_decode_reference(**args, compute_dtype=torch.float32)
    assert out.dtype == torch.bfloat16
    # the kernel rounds the dequantised values and p to bf16 for the dots (2^-9 relative each)
    # and stores out in bf16; the reference keeps float32 values
    assert_close_rows(out.float().cpu(), lse.cpu(), ref_out.float().cpu(), ref_lse.cpu(), 2e-2)


# ---------------------------------------------------------------------------------------------
# GPU: the CUDA stage-1 kernels on fp8 caches (_backend="cuda-sm80" for <= 16 heads, "cuda-sm90"
# on compute capability 9.0 for any; each the default for its heads)
# ---------------------------------------------------------------------------------------------

# lengths around the 32-token tile and the pages of 32 and 64, an empty row, two long ones
SM80_LENGTHS = [0, 1, 31, 32, 33, 64, 65, 127, 1000, 3000]
# lengths around the wgmma kernel's 64-token tile, taken in pairs (a pair with and without its
# second tile, a partial second one), an empty row, two long ones
SM90_LENGTHS = [0, 1, 63, 64, 65, 128, 129, 191, 1000, 3000]


def _skip_unless_sm90():
    from tests.test_kernels_decode import _skip_unless_sm90 as skip

    skip()


def _cuda_case(kind, dtype, heads, block_size, seed, seq_lens=SM80_LENGTHS, row_pad=0, s_q=None, poison=0xFF):
    """DeepSeek-V3 sizes (c = 512, r = 64) on the GPU, q in ``dtype`` ((b, s_q, heads, 576) when
    s_q is given); every unwritten byte of the cache ``poison`` (0xFF: an e4m3 NaN, and a NaN scale
    or bf16 rope value in fp8_ds_mla's other bytes); the latent's 128-value groups 1, 2, 4 and 8
    times as large, so a wrong group's scale shows."""
    args, _, _, _ = make_fp8_case(kind, seq_lens, heads=heads, c=512, r=64, block_size=block_size, seed=seed,
                                  device="cuda", poison=poison, group_growth=2.0, row_pad=row_pad, s_q=s_q)
    args["q"] = args["q"].to(dtype)
    return args


def _scales_in_float32(kind, backend):
    """Whether ``backend`` applies the cache's scales to scores and probabilities in float32 and
    reads the e4m3 values themselves: fp8_e4m3 everywhere (one scale), and fp8_ds_mla in the sm_80
    kernel (its group scales); Triton rounds e4m3 x group scale to q's dtype, the wgmma kernel
    e4m3 x (group scale / a tile's power of two) to fp16."""
    return kind == "fp8_e4m3" or (kind == "fp8_ds_mla" and backend == "cuda-sm80")


def _reference_in_q_dtype(args, backend=None):
    """The float32 reference on the values the kernels' products read: a cache in q's dtype as it
    is; fp8_ds_mla dequantised by mla.kernels.fp8 (value * group scale in float32) and rounded once
    to q's dtype (Triton's values; the wgmma kernel's, rounded to fp16 over a tile's power of two,
    lie closer to the float32 ones); fp8_e4m3, and fp8_ds_mla for a backend that keeps its scales
    in float32 (``_scales_in_float32``), dequantised in float32 and not rounded."""
    kind = args["kv_cache_dtype"]
    if _scales_in_float32(kind, backend):  # q in float32 beside the float32 cache: the same values
        return mla_decode_reference(**as_auto(dict(args, q=args["q"].float()), dequantised(args)),
                                    compute_dtype=torch.float32)
    cache = args["kv_cache"] if kind == "auto" else dequantised(args).to(args["q"].dtype)
    return mla_decode_reference(**as_auto(args, cache), compute_dtype=torch.float32)


def _assert_same_kernel_values(out, lse, out_t, lse_t, lse_tol=1e-3):
    """A CUDA stage 1 against triton on the same fp8 cache: on fp8_e4m3 the same values (the scale
    applied in float32 by both), only the order of the float32 sums and the rounding of p differ.
    On fp8_ds_mla Triton rounds e4m3 x scale to q's dtype, which the CUDA kernels do not (the
    sm_80 kernel keeps the group scales in float32, the wgmma kernel rounds to fp16): their lse
    differ by that rounding, and the caller passes a wider ``lse_tol``; the tight check is then
    the one against the float32 reference."""
    assert torch.equal(lse.isinf(), lse_t.isinf()) and not lse.isnan().any()
    seen = ~lse_t.isinf()
    if seen.any():
        assert (out[seen].float() - out_t[seen].float()).abs().max() <= 1e-2 * out_t[seen].float().abs().max()
        assert (lse[seen] - lse_t[seen]).abs().max().item() < lse_tol


def _check_against_reference_and_triton(args, backend, splits_list):
    """``backend`` on ``args`` at each split count against the reference in q's dtype and against
    the Triton kernel; nothing it was given changed."""
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    ref_out, ref_lse = _reference_in_q_dtype(args, backend)
    # Triton rounds fp8_ds_mla's e4m3 x scale to q's dtype: up to ~2.4e-3 in lse from a kernel
    # that keeps the scale in float32 (benchmarks/lab/model_sm80_fp8_fragments.py's replay of
    # these cases), and as far from the wgmma kernel's values in fp16 (rounded twice, 11
    # significant bits each time, against bf16's 8)
    own_scales = args["kv_cache_dtype"] == "fp8_ds_mla" and _scales_in_float32("fp8_ds_mla", backend)
    own_values = args["kv_cache_dtype"] == "fp8_ds_mla" and backend in ("cuda-sm80", "cuda-sm90")
    for splits in splits_list:
        out, lse = mla_decode(**args, num_kv_splits=splits, _backend=backend)
        assert out.dtype == args["q"].dtype and lse.dtype == torch.float32
        # as the bf16 CUDA tests: p and out rounded to q's dtype (1e-2 of the output's scale)
        assert_close_rows(out.float().cpu(), lse.cpu(), ref_out.float().cpu(), ref_lse.cpu(), 1e-2)
        if own_scales:  # scores and l in float32 from exact values: lse at float32 rounding
            seen = ~ref_lse.isinf()
            assert (lse[seen].cpu() - ref_lse[seen].cpu()).abs().max().item() < 1e-4
        out_t, lse_t = mla_decode(**args, num_kv_splits=splits, _backend="triton")
        _assert_same_kernel_values(out, lse, out_t, lse_t, lse_tol=5e-3 if own_values else 1e-3)
    for k, v in before.items():
        assert same_bytes(args[k], v)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("heads", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_sm80_fp8_matches_reference_and_triton(kind, dtype, heads, block_size):
    args = _cuda_case(kind, dtype, heads, block_size, seed=heads + block_size)
    # 40 splits: most splits of the short rows are empty
    _check_against_reference_and_triton(args, "cuda-sm80", (None, 1, 5, 40))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda-sm80", "cuda-sm90"])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_cuda_fp8_bf16_q_outside_fp16s_range(kind, backend):
    # Where a CUDA kernel's fp8 products run in fp16 (the sm_80 kernel on sm_89+ and the wgmma
    # kernel, both layouts), bf16 q comes in times a power of two that brings it into
    # fp16's range (65504 at most, normal from 2^-14). A q 2^20 and 2^-40 times its size (the
    # softmax scale the inverse: the same scores) gives the reference's answer.
    heads, lengths = 16, SM80_LENGTHS
    if backend == "cuda-sm90":
        _skip_unless_sm90()
        heads, lengths = 64, SM90_LENGTHS
    args = _cuda_case(kind, torch.bfloat16, heads, 64, seed=5, seq_lens=lengths)
    for k in (20, -40):
        scaled = dict(args, q=args["q"] * 2.0**k, softmax_scale=args["softmax_scale"] * 2.0**-k)
        _check_against_reference_and_triton(scaled, backend, (None, 1, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("backend, k", [("cuda-sm80", 16), ("cuda-sm90", 16), ("cuda-sm90", 30), ("cuda-sm90", -20),
                                        ("cuda-sm90", -40)])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_cuda_fp8_cached_values_outside_fp16s_range(kind, backend, k):
    # On sm_89+ the CUDA kernels' fp8 products run in fp16: the sm_80 kernel's fp8_ds_mla p x scale
    # times a power of two set a tile at a time, the wgmma kernel's values e4m3 x scale over one.
    # Cached values 2^16 and 2^30 times larger (their scales; the softmax scale 2^-k times, so the
    # scores stay spread), past fp16's range, give the reference's answer with bf16 q; so do values
    # 2^-20 and 2^-40 times as large (rope values too), whose group scales lie below fp16's normal
    # range (the wgmma kernel lifts them by up to 2^34, its probabilities down by as much).
    heads, lengths = 16, SM80_LENGTHS
    if backend == "cuda-sm90":
        _skip_unless_sm90()
        heads, lengths = 64, SM90_LENGTHS
    args = _cuda_case(kind, torch.bfloat16, heads, 64, seed=5, seq_lens=lengths)
    scaled = dict(args, kv_cache=args["kv_cache"].clone(), softmax_scale=args["softmax_scale"] * 2.0**-k)
    if kind == "fp8_e4m3":
        scaled["kv_scale"] = args["kv_scale"] * 2.0**k
    else:  # the four float32 group scales of every row; below fp16's range, the bf16 rope values too
        scaled["kv_cache"][..., 512:528].view(torch.float32).mul_(2.0**k)
        if k < 0:
            scaled["kv_cache"][..., 528:656].view(torch.bfloat16).mul_(2.0**k)
    values = dequantised(scaled)
    top = values[values.isfinite()].abs().max()
    assert top > 2 * 65504 if k > 0 else top < 2.0**-10  # past fp16's range, or scales under 2^-14
    ref_out, ref_lse = _reference_in_q_dtype(scaled, "cuda-sm80")  # float32, no rounding of values
    for splits in (None, 1, 5):
        out, lse = mla_decode(**scaled, num_kv_splits=splits, _backend=backend)
        assert_close_rows(out.float().cpu(), lse.cpu(), ref_out.float().cpu(), ref_lse.cpu(), 1e-2)


def _ds_mla_scales(seed):
    """A fp8_ds_mla case for the wgmma kernel, a copy of its cache, and that copy's group scales as
    a (pages, 64, 4) float32 view (unwritten rows NaN) to change in place."""
    args = _cuda_case("fp8_ds_mla", torch.bfloat16, 64, 64, seed=seed, seq_lens=SM90_LENGTHS)
    cache = args["kv_cache"].clone()
    return args, cache, cache[..., 512:528].view(torch.float32)


def _set_each_pages_largest(scales, value):
    """Each written page's largest scale (``scales`` as ``_ds_mla_scales`` gives them) set to
    ``value`` in place; returns those pages' indices."""
    biggest = scales.nan_to_num(nan=0.0).flatten(1).max(dim=1)
    used = torch.nonzero(biggest.values > 0).flatten()
    scales[used, biggest.indices[used] // 4, biggest.indices[used] % 4] = value
    return used


def _check_grown_scales(args, cache, grow):
    """The wgmma kernel on ``cache``, fp8_ds_mla's rows of ``args`` with their scales grown by
    ``grow`` (a float32 scalar tensor) and changed further in place: its rope values grown the
    same, the softmax scale shrunk the same (so the scores spread as before), against the float32
    reference on the dequantised cache, with either split rule."""
    rope = cache[..., 528:656].view(torch.bfloat16)
    rope.copy_((rope.float() * grow).to(torch.bfloat16))
    grown = dict(args, kv_cache=cache, softmax_scale=args["softmax_scale"] / grow.item())
    ref_out, ref_lse = _reference_in_q_dtype(grown, "cuda-sm80")  # float32, no rounding of values
    for splits in (None, 1):
        out, lse = mla_decode(**grown, num_kv_splits=splits, _backend="cuda-sm90")
        assert_close_rows(out.float().cpu(), lse.cpu(), ref_out.float().cpu(), ref_lse.cpu(), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("bound, side", [(-14, "at"), (-14, "below"), (6, "at"), (6, "below")])
@pytest.mark.parametrize("spread", [False, True])
def test_gpu_sm90_ds_mla_tile_exponent_at_its_bounds(bound, side, spread):
    # The wgmma kernel takes F = 0 for a tile from one vote when every thread's largest scale lies
    # in [2^-14, 2^6), and otherwise F from the tile's largest (tile_exponent: F = 0 at 2^-14, -1
    # just below it, 1 at 2^6). Each tile's largest scale here sits on a bound or one float32 step
    # below it: every scale that value, or the cache's scales grown as one and each page's largest
    # then set to it (at 2^6 the four threads a warpgroup that hold that row vote out of range and
    # the rest in, at 2^-14 the reverse). Both paths must match the reference there. An F off by
    # one changes no fp16 value at these bounds (they keep a factor of two of headroom), so this
    # catches a wrong path only where it breaks the values (an overflow, a hang, the warpgroups
    # disagreeing); the next test checks the vote itself.
    _skip_unless_sm90()
    args, cache, scales = _ds_mla_scales(seed=11)
    target = torch.tensor(2.0**bound, device="cuda")
    if side == "below":
        target = torch.nextafter(target, torch.zeros_like(target))
    grow = target / scales.nan_to_num(nan=0.0).max()
    if spread:
        scales.copy_(torch.minimum(scales * grow, target))  # NaN stays NaN
        _set_each_pages_largest(scales, target)
    else:
        scales.copy_(torch.where(scales.isnan(), scales, target))
    written = scales[~scales.isnan()]
    assert written.max() == target and (spread or written.min() == target)
    assert spread == bool(written.min() < target)
    _check_grown_scales(args, cache, grow)


@pytest.mark.gpu
def test_gpu_sm90_ds_mla_one_row_past_the_bound_sets_the_tile():
    # Every group scale under 2^6 but one a page, 2^8: that group's values reach 448 x 2^8, past
    # fp16's 65,504 unless F >= 2. Only the four threads a warpgroup that hold its row vote out of
    # range; the tile must still take F from its largest (an AND in place of the vote's OR would
    # keep F = 0 and overflow).
    _skip_unless_sm90()
    args, cache, scales = _ds_mla_scales(seed=12)
    grow = 2.0**5 / scales.nan_to_num(nan=0.0).max()
    scales.mul_(grow)  # NaN stays NaN
    used = _set_each_pages_largest(scales, 2.0**8)
    tops = scales.nan_to_num(nan=0.0).flatten(1).topk(2, dim=1).values[used]  # (used pages, 2)
    assert (tops[:, 0] == 2.0**8).all() and (tops[:, 1] <= 2.0**5).all()
    _check_grown_scales(args, cache, grow)


@pytest.mark.gpu
def test_gpu_sm90_ds_mla_tiles_far_apart_in_size():
    # The wgmma kernel sets its power of two a 64-token tile at a time and keeps O over the
    # largest so far: pages (here a tile each) whose values, scales and rope values are 2^-12, 1
    # and 2^12 times as large, in turn, so the two tiles of a pair and the pairs of a split differ
    # (a tile given another's power would be 2^12 off)
    _skip_unless_sm90()
    args = _cuda_case("fp8_ds_mla", torch.bfloat16, 64, 64, seed=9, seq_lens=SM90_LENGTHS)
    cache = args["kv_cache"].clone()
    grow = 2.0 ** (12 * (torch.arange(cache.shape[0], device=cache.device) % 3 - 1)).float()  # (pages,)
    cache[..., 512:528].view(torch.float32).mul_(grow[:, None, None])
    rope = cache[..., 528:656].view(torch.bfloat16)
    rope.copy_((rope.float() * grow[:, None, None]).to(torch.bfloat16))  # exact: powers of two
    spread = dict(args, kv_cache=cache, softmax_scale=args["softmax_scale"] * 2.0**-12)
    ref_out, ref_lse = _reference_in_q_dtype(spread, "cuda-sm80")  # float32, no rounding of values
    for splits in (None, 1, 3):
        out, lse = mla_decode(**spread, num_kv_splits=splits, _backend="cuda-sm90")
        assert_close_rows(out.float().cpu(), lse.cpu(), ref_out.float().cpu(), ref_lse.cpu(), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_sm90_fp8_finite_poison_past_the_rows(kind):
    # Unwritten bytes 0x7F: in fp8_ds_mla a finite scale of 3.4e38 (and rope values as large) in
    # every row past a sequence's end; the kernel's power of two comes from the valid rows only
    _skip_unless_sm90()
    args = _cuda_case(kind, torch.bfloat16, 64, 64, seed=4, seq_lens=SM90_LENGTHS, poison=0x7F)
    _check_against_reference_and_triton(args, "cuda-sm90", (None, 1, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("heads", [16, 64, 100, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_sm90_fp8_matches_reference_and_triton(kind, dtype, heads, block_size):
    # 16 heads padded to the CTA's 64, 100 in two head blocks (the second of 36); pages of 128 put
    # tiles at both offsets of a page; 3 splits: several pairs a split, 40: most splits empty or
    # one tile (the pair's second buffer zeros)
    _skip_unless_sm90()
    args = _cuda_case(kind, dtype, heads, block_size, seed=heads + block_size, seq_lens=SM90_LENGTHS)
    _check_against_reference_and_triton(args, "cuda-sm90", (None, 1, 3, 40))


def _check_op_writes_every_partial(args, backend, splits_list):
    """The op of ``backend`` itself at each split count (the wgmma op with its pieces dealt, as
    mla_decode runs it, then cut per sequence), its partial buffers NaN-filled so a slot
    it leaves unwritten shows, merged (or with one split the answer it writes) against the
    reference, and equal to the public call's. A q of s_q new tokens (b, s_q, h, 576) goes to the
    wgmma op as its (b, s_q·h, 576) rows, token-major, with q_tokens = s_q."""
    from mla.kernels import decode

    q = args["q"]
    b, d = q.shape[0], q.shape[-1]
    rows = q.shape[-2] * (q.shape[1] if q.dim() == 4 else 1)  # s_q·h (token, head) pairs
    tokens = {"q_tokens": q.shape[1]} if q.dim() == 4 else {}
    op = {"cuda-sm80": torch.ops.mla.mla_decode_sm80, "cuda-sm90": torch.ops.mla.mla_decode_sm90}[backend]
    ref_out, ref_lse = (t.reshape(b, rows, *t.shape[q.dim() - 1:]) for t in _reference_in_q_dtype(args, backend))
    for splits in splits_list:
        if backend == "cuda-sm90":  # the batch's tiles dealt over b x splits pieces
            pieces = b * splits
            part_out = torch.full((b + pieces - 1, rows, 512), float("nan"), device="cuda")
            part_lse = torch.full((b + pieces - 1, rows), float("nan"), device="cuda")
            out = torch.full((b, rows, 512), float("nan"), dtype=q.dtype, device="cuda")
            lse = torch.full((b, rows), float("nan"), device="cuda")
            ranges = torch.full((b, 2), -7, dtype=torch.int32, device="cuda")
            op(q.reshape(b, rows, d), args["kv_cache"], args["block_table"], args["seq_lens"], part_out, part_lse,
               float(args["softmax_scale"]), pieces, args["kv_cache_dtype"], args["kv_scale"], **tokens, out=out,
               lse=lse, ranges=ranges)
            decode._merge_dealt(part_out, part_lse, ranges, out, lse, splits)
            assert_close_rows(out.float().cpu(), lse.cpu(), ref_out.float().cpu(), ref_lse.cpu(), 1e-2)
            out2, lse2 = mla_decode(**args, num_kv_splits=splits, _backend=backend)  # the public call's path
            assert torch.equal(out2.reshape(b, rows, 512), out) and torch.equal(lse2.reshape(b, rows), lse)
        # the op cut per sequence (no ranges): each sequence in `splits` pieces of its own
        dtype = q.dtype if splits == 1 else torch.float32  # one split: out itself, in q's dtype
        part_out = torch.full((b, rows, splits, 512), float("nan"), device="cuda", dtype=dtype)
        part_lse = torch.full((b, rows, splits), float("nan"), device="cuda")
        op(q.reshape(b, rows, d), args["kv_cache"], args["block_table"], args["seq_lens"], part_out, part_lse,
           float(args["softmax_scale"]), splits, args["kv_cache_dtype"], args["kv_scale"], **tokens)
        if splits == 1:
            out, lse = part_out[:, :, 0], part_lse[:, :, 0]
        else:
            out = torch.empty((b, rows, 512), dtype=q.dtype, device="cuda")
            lse = torch.empty((b, rows), device="cuda")
            decode._merge(part_out, part_lse, out, lse)
        assert_close_rows(out.float().cpu(), lse.cpu(), ref_out.float().cpu(), ref_lse.cpu(), 1e-2)
        if backend == "cuda-sm80":  # the public call's path (the wgmma one deals, above)
            out2, lse2 = mla_decode(**args, num_kv_splits=splits, _backend=backend)
            assert torch.equal(out2.reshape(b, rows, 512), out) and torch.equal(lse2.reshape(b, rows), lse)


@pytest.mark.gpu
@pytest.mark.parametrize("backend, heads", [("cuda-sm80", 16), ("cuda-sm90", 128)])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_cuda_fp8_reads_a_cache_of_wider_rows(kind, backend, heads):
    """A cache whose rows sit 16 bytes apart more than their width: the kernels step by the
    cache's strides, not by 576 or 656."""
    if backend == "cuda-sm90":
        _skip_unless_sm90()
    args = _cuda_case(kind, torch.bfloat16, heads, 64, seed=5, seq_lens=SM90_LENGTHS, row_pad=16)
    assert not args["kv_cache"].is_contiguous()
    _check_against_reference_and_triton(args, backend, (None, 3))


def _at_byte_offset(cache, offset):
    """A copy of the contiguous byte cache ``cache`` that starts ``offset`` bytes into a buffer."""
    flat = torch.full((cache.numel() + offset,), 0xFF, dtype=torch.uint8, device=cache.device)
    moved = flat[offset:].view(cache.shape)
    moved.copy_(cache)
    return moved


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("layout", ["row-stride-660", "offset-4"])
def test_gpu_triton_reads_ds_mla_rows_4_byte_aligned(layout, block_size):
    """Rows that start 4-byte but not 16-byte aligned, which mla_decode takes: Triton then
    cannot prove 16-byte alignment and must read the scales and the rope one float32 / bf16 at a
    time (a 16-byte vector load there faults). At V3 sizes every other test's rows are 656 bytes
    apart from a 16-byte aligned start; here they are 660 apart, or start 4 bytes into their
    buffer. Pages of 16 (tiles of 32 span pages) and 64."""
    args = _cuda_case("fp8_ds_mla", torch.bfloat16, 16, block_size, seed=16, seq_lens=[0, 1, 31, 33, 700],
                      row_pad=4 if layout == "row-stride-660" else 0)
    if layout == "offset-4":
        args["kv_cache"] = _at_byte_offset(args["kv_cache"], 4)
    cache = args["kv_cache"]
    assert (cache.data_ptr() % 16, cache.stride(1)) == ((0, 660) if layout == "row-stride-660" else (4, 656))
    _check_against_reference_and_triton(args, "triton", (None, 3))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_triton_runs_on_the_gpu_of_q(kind, monkeypatch):
    """q on the second GPU while the first is current (a model spread over GPUs in one process):
    Triton launches on the current device, so mla_decode makes q's current for the call, which
    is also the target whose e4m3 conversion it picks."""
    from mla.kernels import decode

    current = []  # the current device when the kernel's conversion is chosen, just before launch
    choose = decode._e4m3_conversion

    def spy(device):
        current.append(torch.cuda.current_device())
        assert current[-1] == device.index, "a launch on a GPU other than q's"
        return choose(device)

    monkeypatch.setattr(decode, "_e4m3_conversion", spy)
    args = _cuda_case(kind, torch.bfloat16, 16, 64, seed=17, seq_lens=[0, 1, 100, 1000])
    args = {k: v.to("cuda:1") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with torch.cuda.device(0):
        out, lse = mla_decode(**args, num_kv_splits=3, _backend="triton")  # stage 1 and the merge
        torch.cuda.synchronize(1)
    assert current == [1] and out.device == lse.device == torch.device("cuda:1")
    ref_out, ref_lse = _reference_in_q_dtype(args)
    assert_close_rows(out.float().cpu(), lse.cpu(), ref_out.float().cpu(), ref_lse.cpu(), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_sm80_fp8_both_launch_shapes(kind):
    # 4 stages, one CTA an SM, when b * splits fits on the SMs; 2 stages, two CTAs an SM, above:
    # split counts on both sides of the line
    from mla.kernels.extension import load_extension

    assert load_extension()["decode"]
    args = _cuda_case(kind, torch.bfloat16, 16, 64, seed=11)
    wave = torch.cuda.get_device_properties(0).multi_processor_count // len(SM80_LENGTHS)
    _check_op_writes_every_partial(args, "cuda-sm80", (wave, wave + 1))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_sm90_fp8_op_writes_every_partial(kind):
    # 1 split (the answer in q's dtype), 7 (several pairs a split) and 40 (empty splits write
    # zeros and -inf)
    _skip_unless_sm90()
    args = _cuda_case(kind, torch.bfloat16, 128, 64, seed=12, seq_lens=SM90_LENGTHS)
    _check_op_writes_every_partial(args, "cuda-sm90", (1, 7, 40))


# ---------------------------------------------------------------------------------------------
# GPU: the wgmma stage 1's fp8 reads with several new tokens a sequence, and its repeatability
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("s_q, heads", [(4, 20), (8, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_sm90_fp8_query_tokens_match_reference_and_triton(kind, dtype, s_q, heads):
    # both layouts in both q dtypes with s_q > 1: 4 x 20 = 80 rows put new token 3's heads across
    # two 64-row tiles; 8 x 128 = 1024 rows, 16 tiles of one token's heads each. Rows shorter than
    # s_q (tokens that see nothing) beside the tile and pair edges; 40 splits: most splits of the
    # short rows empty
    _skip_unless_sm90()
    lengths = sorted(set(SM90_LENGTHS) | {s_q - 1, s_q})
    args = _cuda_case(kind, dtype, heads, 64, seed=20 + s_q + heads, seq_lens=lengths, s_q=s_q)
    _check_against_reference_and_triton(args, "cuda-sm90", (None, 1, 5, 40))


def _as_bf16_cache(args):
    """``args`` on the bf16 cache of the same values ("auto"; unwritten values NaN, as dequantised)."""
    return as_auto(args, dequantised(args).bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["auto", *KINDS])
def test_gpu_sm90_query_tokens_op_writes_every_partial(kind):
    # the wgmma op itself on s_q = 4 new tokens of 20 heads (80 rows, two head blocks), partials
    # NaN-filled: every (row, split) slot is written, a row that sees nothing of a split as 0 and
    # -inf; 1 split (the answer in q's dtype), 7 (several pairs a split), 40 (most splits empty)
    _skip_unless_sm90()
    args = _cuda_case("fp8_ds_mla" if kind == "auto" else kind, torch.bfloat16, 20, 64, seed=13,
                      seq_lens=sorted(set(SM90_LENGTHS) | {3, 4}), s_q=4)
    if kind == "auto":
        args = _as_bf16_cache(args)
    _check_op_writes_every_partial(args, "cuda-sm90", (1, 7, 40))


@pytest.mark.gpu
@pytest.mark.parametrize("s_q", [None, 4], ids=["one-token", "sq4"])
@pytest.mark.parametrize("kind", ["auto", *KINDS])
def test_gpu_sm90_runs_are_repeatable(kind, s_q):
    """The wgmma kernel sums in a fixed order, so its answer is the same bits on every run: a tile
    read before its block group is whole, or a buffer refilled while a warpgroup still reads it,
    shows as a difference between runs even where it stays within the reference's tolerance. One
    split (a sequence's tiles in one CTA, up to 24 pairs) and 13 (260 CTAs with one new token, 1040
    with 4: several waves on the SMs, at staggered times)."""
    _skip_unless_sm90()
    args = _cuda_case("fp8_ds_mla" if kind == "auto" else kind, torch.bfloat16, 128, 64, seed=14,
                      seq_lens=SM90_LENGTHS, s_q=s_q)
    if kind == "auto":
        args = _as_bf16_cache(args)
    for splits in (1, 13):
        out, lse = mla_decode(**args, num_kv_splits=splits, _backend="cuda-sm90")
        assert not out.isnan().any() and not lse.isnan().any()
        for _ in range(20):
            again = mla_decode(**args, num_kv_splits=splits, _backend="cuda-sm90")
            assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@pytest.mark.gpu
@pytest.mark.parametrize("backend, heads", [("cuda-sm80", 16), ("cuda-sm90", 128), ("triton", 16)])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_cuda_fp8_cuda_graph_capture(kind, backend, heads):
    # with num_kv_splits given the call captures (Triton's choice of e4m3 conversion included);
    # the replay equals the eager call, and an fp8_e4m3 scale changed in place is read by the
    # next replay (it lives on the device)
    if backend == "cuda-sm90":
        _skip_unless_sm90()
    from tests.test_kernels_decode import captured

    args = _cuda_case(kind, torch.bfloat16, heads, 64, seed=3, seq_lens=[100, 3000, 0, 64])
    graph, (out, lse), expected = captured(lambda: mla_decode(**args, num_kv_splits=4, _backend=backend))
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
    if kind == "fp8_e4m3":
        args["kv_scale"].mul_(2)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = _reference_in_q_dtype(args)
        assert_close_rows(out.float().cpu(), lse.cpu(), ref_out.float().cpu(), ref_lse.cpu(), 1e-2)
        assert not torch.equal(lse, expected[1])


# The ops' own checks, in a child process (as tests/test_kernels_decode.py's): a check that
# crashed the process instead of raising fails the test, not the GPU run. Each bad call goes to
# both ops (the wgmma one where it is built).
_FP8_OPS_REJECT_CHILD = """
import torch
from mla.kernels.extension import load_extension
from tests.test_kernels_decode_fp8 import make_fp8_case

state = load_extension()
assert state["decode"], state
ds, _, _, _ = make_fp8_case("fp8_ds_mla", [70, 300], heads=16, c=512, r=64, block_size=64, device="cuda")
e4, _, _, _ = make_fp8_case("fp8_e4m3", [70, 300], heads=16, c=512, r=64, block_size=64, device="cuda")
q, table, lens = ds["q"].bfloat16(), ds["block_table"], ds["seq_lens"]
part_out = torch.full((2, 16, 3, 512), 7.0, device="cuda")
part_lse = torch.full((2, 16, 3), 7.0, device="cuda")
scale = e4["kv_scale"]
cases = {  # name: (kv_cache, kv_cache_dtype, kv_scale, q)
    "e4m3-no-scale": (e4["kv_cache"], "fp8_e4m3", None, q),
    "e4m3-scale-float64": (e4["kv_cache"], "fp8_e4m3", scale.double(), q),
    "e4m3-scale-cpu": (e4["kv_cache"], "fp8_e4m3", scale.cpu(), q),
    "e4m3-scale-two": (e4["kv_cache"], "fp8_e4m3", scale.repeat(2), q),
    "e4m3-as-uint8": (e4["kv_cache"].view(torch.uint8), "fp8_e4m3", scale, q),
    "e4m3-q-float32": (e4["kv_cache"], "fp8_e4m3", scale, q.float()),
    "e4m3-as-auto": (e4["kv_cache"], "auto", None, q),
    "ds-width-655": (ds["kv_cache"][..., :655], "fp8_ds_mla", None, q),
    "ds-as-float8": (ds["kv_cache"].view(torch.float8_e4m3fn), "fp8_ds_mla", None, q),
    "ds-with-scale": (ds["kv_cache"], "fp8_ds_mla", scale, q),
    "ds-as-auto": (ds["kv_cache"], "auto", None, q),
    "unknown-layout": (ds["kv_cache"], "fp8_e5m2", None, q),
}
ops = {"sm80": torch.ops.mla.mla_decode_sm80}
if state["decode_sm90"]:
    ops["sm90"] = torch.ops.mla.mla_decode_sm90
for op_name, op in ops.items():
    for name, (cache, kind, kv_scale, query) in cases.items():
        try:
            op(query, cache, table, lens, part_out, part_lse, 0.1, 3, kind, kv_scale)
            print(op_name, name, "RAN", flush=True)
        except RuntimeError as e:
            print(op_name, name, "RAISED", str(e).splitlines()[0], flush=True)
print("untouched", bool((part_out == 7.0).all() and (part_lse == 7.0).all()), flush=True)
"""


@pytest.mark.gpu
def test_gpu_cuda_fp8_ops_reject_what_they_cannot_run():
    from tests.test_kernels_decode import run_op_checks

    lines = run_op_checks(_FP8_OPS_REJECT_CHILD)
    expected = {
        "e4m3-no-scale": "kv_scale (the cache's one scale) is required for kv_cache_dtype 'fp8_e4m3'",
        "e4m3-scale-float64": "kv_scale must be a 1-element float32 tensor on q's device",
        "e4m3-scale-cpu": "kv_scale must be a 1-element float32 tensor on q's device",
        "e4m3-scale-two": "kv_scale must be a 1-element float32 tensor on q's device",
        "e4m3-as-uint8": "kv_cache must be Float8_e4m3fn for kv_cache_dtype 'fp8_e4m3', got Byte",
        "e4m3-q-float32": "q must be bfloat16 or float16",
        "e4m3-as-auto": "kv_cache is Float8_e4m3fn (an fp8 cache) but kv_cache_dtype is 'auto'; pass",
        "ds-width-655": "kv_cache must be (pages, page_size, 656 bytes)",
        "ds-as-float8": "kv_cache must be Byte for kv_cache_dtype 'fp8_ds_mla'",
        "ds-with-scale": "kv_scale must be None for kv_cache_dtype 'fp8_ds_mla'",
        "ds-as-auto": "kv_cache is Byte (an fp8 cache) but kv_cache_dtype is 'auto'; pass",
        "unknown-layout": "kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_ds_mla'",
    }
    ops = ["sm80"] + (["sm90"] if torch.cuda.get_device_capability() == (9, 0) else [])  # where the op is built
    for op in ops:
        for name, message in expected.items():
            key = f"{op} {name}"
            assert lines.get(key, "").startswith(f"RAISED mla_decode_{op}: {message}"), (key, lines.get(key))
    assert lines.get("untouched") == "True"


# ---------------------------------------------------------------------------------------------
# Every e4m3 byte read back exactly, at every row of a tile: one token of each sequence scores so
# far above the rest (q on the rope dims only, that token's rope 448 · scale, the others' 0) that
# its softmax weight is 1 and theirs exp2(-1e4) = 0, so out is that token's latent values exactly
# (e4m3 · a power-of-two scale is exact in bf16 and fp16). Each token's latent is the 254 finite
# e4m3 bytes rolled by its own amount, so reading a neighbour's row, a neighbour's scale group,
# a byte pair swapped or a subnormal wrongly shows as a wrong value. On a GPU: the sm_80 stage 1
# in bf16 / fp16 (its e4m3 conversion: cvt on sm_89+, integer decoding before); on the CPU: the
# Triton kernel in float32.

FINITE_E4M3 = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # (254,)
DS_SCALES = (2.0**-4, 8.0, 1.0, 2.0**-7)  # fp8_ds_mla's four group scales: fp16 holds each e4m3 · s


def make_exact_case(kind, seq_lens, targets, *, heads, block_size, dtype, device, seed=0):
    """(args for mla_decode, expected out (b, heads, 512) float32): sequence i's out is token
    targets[i]'s latent values. Unwritten bytes are 0xFF; unused block-table entries out of range."""
    c, r = 512, 64
    width = fp8.bytes_per_token(kind, c, r)
    gen = torch.Generator().manual_seed(seed)
    pages = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(pages) + 1
    order = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((len(seq_lens), max(pages) + 1), 10**6, dtype=torch.int32)
    cache = torch.full((num_blocks, block_size, width), 0xFF, dtype=torch.uint8)
    expected = torch.zeros(len(seq_lens), heads, c)
    scale = 2.0**-4  # fp8_e4m3's one scale
    first = 0
    for i, (n, p) in enumerate(zip(seq_lens, pages)):
        block_table[i, :p] = order[first: first + p].int()
        first += p
        for t in range(n):
            row = cache[int(block_table[i, t // block_size]), t % block_size]  # (width,) a view
            latent = FINITE_E4M3.roll(7 * i + 3 * t).repeat(3)[:c]  # (c,) bytes
            row[:c] = latent
            if kind == "fp8_e4m3":
                row[c:] = 0x7E if t == targets[i] else 0x00  # 448 or 0, times the scale
                values = latent.view(torch.float8_e4m3fn).float() * scale
            else:
                row[c: c + 16] = torch.tensor(DS_SCALES, dtype=torch.float32).view(torch.uint8)
                rope = torch.full((r,), 448.0 * 2.0**-4 if t == targets[i] else 0.0, dtype=torch.bfloat16)
                row[c + 16:] = rope.view(torch.uint8)
                values = latent.view(torch.float8_e4m3fn).float() * torch.tensor(DS_SCALES).repeat_interleave(128)
            if t == targets[i]:
                expected[i] = values
    # q on the rope dims only: the target scores 64 · 1000 · 28 · d^-1/2 ~ 7.5e4 above the others
    q = torch.zeros(len(seq_lens), heads, c + r)
    q[..., c:] = 1000.0
    args = dict(q=q.to(dtype).to(device),
                kv_cache=(cache.view(torch.float8_e4m3fn) if kind == "fp8_e4m3" else cache).to(device),
                block_table=block_table.to(device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), kv_lora_rank=c,
                softmax_scale=(c + r) ** -0.5, kv_cache_dtype=kind,
                kv_scale=torch.tensor([scale], device=device) if kind == "fp8_e4m3" else None)
    return args, expected.to(device)


def _check_exact(args, expected, splits_list, backend):
    for splits in splits_list:
        out, lse = mla_decode(**args, num_kv_splits=splits, _backend=backend)
        seen = args["seq_lens"] > 0
        assert torch.equal(out[seen].float(), expected[seen]), f"{backend}, {splits} splits"
        assert (out[~seen] == 0).all() and (lse[~seen] == float("-inf")).all()
        assert torch.isfinite(lse[seen]).all()


@pytest.mark.parametrize("kind", KINDS)
def test_every_e4m3_byte_read_exactly_triton_cpu(kind):
    if DEVICE != "cpu":
        pytest.skip("the GPU runs test_gpu_sm80_fp8_reads_every_byte_exactly")
    args, expected = make_exact_case(kind, [0, 1, 40, 70], [None, 0, 33, 69], heads=2, block_size=32,
                                     dtype=torch.float32, device="cpu")
    _check_exact(args, expected, (1, 2), "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_sm80_fp8_reads_every_byte_exactly(kind, dtype, block_size):
    # targets at rows 0, 1, 31 of a tile, the first row of a second tile and of a second page,
    # the last token of a long sequence; a sequence of length 0
    seq_lens = [0, 1, 2, 32, 33, 100, 200, 1000]
    targets = [None, 0, 1, 31, 32, 64, 131, 999]
    args, expected = make_exact_case(kind, seq_lens, targets, heads=16, block_size=block_size, dtype=dtype,
                                     device="cuda")
    # 1 and 3 splits: one CTA an SM (4 stages); 40: b x 40 past the SMs, two CTAs an SM (2 stages)
    _check_exact(args, expected, (1, 3, 40, None), "cuda-sm80")
    _check_exact(args, expected, (1, 3), "triton")
