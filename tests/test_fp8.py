"""mla.kernels.fp8: the two fp8 cache layouts against an independent float64 spelling of them.

The reference here shares no code with the module: e4m3 and bf16 are rounded by hand in numpy
float64 (round half to even on an explicit grid), the bytes assembled with struct, and read back
the same way. The quantiser must match it byte for byte; the dequantiser value for value; and
the round trip must stay within the error bound of docs/derivations/fp8-cache.md.
"""

import math
import struct

import numpy as np
import pytest
import torch

from mla.kernels import fp8

C, R = 512, 64  # DeepSeek-V2/V3
MIN_SCALE = 2.0**-126


# ----------------------------------------------------------------------------------------------
# the independent reference: numpy float64


def round_to_grid(a: np.ndarray, mant_bits: int, min_exp: int) -> np.ndarray:
    """|a| (finite, >= 0) rounded half to even onto a binary format with `mant_bits` stored
    mantissa bits and smallest normal exponent `min_exp` (no upper limit)."""
    out = np.zeros_like(a)
    nz = a > 0
    e = np.maximum(np.floor(np.log2(a[nz])), min_exp)
    ulp = np.exp2(e - mant_bits)
    out[nz] = np.round(a[nz] / ulp) * ulp  # np.round: half to even
    return out


def e4m3_bits(v: np.ndarray) -> np.ndarray:
    """float64 values (float32-rounded, clamped to +-448 or NaN) -> float8_e4m3fn bytes."""
    sign = np.signbit(v).astype(np.int64) << 7
    nan = np.isnan(v)
    q = round_to_grid(np.where(nan, 0.0, np.abs(v)), 3, -6)
    bits = np.zeros(v.shape, dtype=np.int64)
    sub = (q > 0) & (q < 2.0**-6)
    bits[sub] = (q[sub] / 2.0**-9).astype(np.int64)
    nrm = q >= 2.0**-6
    E = np.floor(np.log2(q[nrm])).astype(np.int64)
    bits[nrm] = ((E + 7) << 3) | ((q[nrm] / np.exp2(E) - 1) * 8).astype(np.int64)
    bits[nan] = 0x7F
    return (bits | sign).astype(np.uint8)


def e4m3_value(b: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes -> float64 values."""
    b = b.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, mant = (b >> 3) & 0xF, b & 0x7
    mag = np.where(exp == 0, mant * 2.0**-9, (1 + mant / 8) * np.exp2(exp - 7))
    return np.where((exp == 15) & (mant == 7), np.nan, sign * mag)


def f32(x: np.ndarray) -> np.ndarray:
    """Round float64 to float32 (a float32 quotient of float32 operands, computed in float64
    and rounded once more, is the correctly rounded float32 quotient: 53 >= 2 * 24 + 2)."""
    return x.astype(np.float32).astype(np.float64)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float64 values (finite) -> bfloat16 bit patterns, round half to even."""
    q = np.copysign(round_to_grid(np.abs(x), 7, -126), x).astype(np.float32)
    return (q.view(np.uint32) >> 16).astype(np.uint16)


def ref_quantize_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor) -> np.ndarray:
    """FlashMLA's token, spelled out: values, then scales, then rope, little-endian."""
    x = kv_c.double().numpy()  # (T, c) exact copies of the inputs
    T, c = x.shape
    rows = []
    for i in range(T):
        values, scales = bytearray(), bytearray()
        for g in range(c // 128):
            grp = x[i, 128 * g: 128 * (g + 1)]
            amax = np.nan if np.isnan(grp).any() else np.abs(grp).max()
            scale = f32(np.array(amax / 448.0))
            scale = scale if not scale < MIN_SCALE else np.float64(MIN_SCALE)
            with np.errstate(invalid="ignore", divide="ignore"):
                v = np.clip(f32(grp / scale), -448.0, 448.0)
            values += e4m3_bits(v).tobytes()
            scales += struct.pack("<f", float(scale))
        rope = b"".join(struct.pack("<H", int(b)) for b in bf16_bits(k_pe[i].double().numpy()))
        rows.append(np.frombuffer(bytes(values + scales + rope), dtype=np.uint8))
    return np.stack(rows)


def ref_dequantize_ds_mla(rows: np.ndarray, c: int, r: int):
    """(T, W) bytes -> kv_c, k_pe in float64, read with struct."""
    kv, pe = [], []
    for row in rows:
        b = row.tobytes()
        scales = struct.unpack(f"<{c // 128}f", b[c: c + 4 * (c // 128)])
        vals = e4m3_value(row[:c]).reshape(-1, 128) * np.array(scales)[:, None]
        kv.append(vals.reshape(-1))
        rope = np.array(struct.unpack(f"<{r}H", b[c + 4 * (c // 128):]), dtype=np.uint32) << 16
        pe.append(rope.view(np.float32).astype(np.float64))
    return np.stack(kv), np.stack(pe)


def latent_rows(T, c=C, r=R, dtype=torch.bfloat16, seed=0):
    """Rows with the cases that matter planted: groups of very different size, a zero group, a
    group spanning e4m3's subnormals, negative zeros."""
    g = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(T, c, generator=g) * torch.logspace(-3, 2, T)[:, None]
    kv_c[:, :128] *= 30.0  # group 0 much larger than the rest
    groups = c // 128

    def group(k):  # the k-th planted group: row 1 + k // groups', column group k % groups'
        i, j = (1, k) if groups >= 3 else (1 + k, 0)
        return i, slice(128 * (j + (groups >= 3)), 128 * (j + (groups >= 3) + 1))

    kv_c[group(0)] = 0.0  # a zero group
    kv_c[group(1)] = -0.0  # a group of negative zeros
    kv_c[group(2)] = torch.logspace(-12, 0, 128) * torch.sign(torch.randn(128, generator=g))
    k_pe = torch.randn(T, r, generator=g) * 3.0
    return kv_c.to(dtype), k_pe.to(dtype)


# ----------------------------------------------------------------------------------------------
# sizes and layout


def test_bytes_per_token_for_deepseek_v3():
    assert fp8.bytes_per_token("auto", C, R, torch.bfloat16) == 1152
    assert fp8.bytes_per_token("auto", C, R, torch.float32) == 2304
    assert fp8.bytes_per_token("fp8_e4m3", C, R) == fp8.bytes_per_token("fp8", C, R) == 576
    assert fp8.bytes_per_token("fp8_ds_mla", C, R) == 656 == 512 + 4 * 4 + 2 * 64
    assert fp8.bytes_per_token("fp8_ds_mla", 1024, 3) == 1024 + 32 + 6
    assert fp8.ds_mla_layout(C, R) == {"values": (0, 512), "scales": (512, 528),
                                        "rope": (528, 656)}


@pytest.mark.parametrize("c", [0, 100, 500, 129])
def test_ds_mla_needs_c_a_multiple_of_128(c):
    with pytest.raises(ValueError, match=f"multiple of 128 .*got c = {c}"):
        fp8.bytes_per_token("fp8_ds_mla", c, R)
    if c:
        with pytest.raises(ValueError, match="multiple of 128"):
            fp8.quantize_ds_mla(torch.zeros(2, c), torch.zeros(2, R))


def test_unknown_cache_dtype_is_named():
    with pytest.raises(ValueError, match="kv_cache_dtype must be .*'fp8_ds_mla', got 'int4'"):
        fp8.bytes_per_token("int4", C, R)


def test_layout_byte_offsets_hold_what_they_say():
    """Known values at known places: group g of 128 values all equal to (g + 1) * 44.8 has scale
    (g + 1) / 10 and every value 448; rope value j = j + 0.5 in bf16."""
    kv_c = torch.cat([torch.full((128,), (g + 1) * 44.8) for g in range(4)])[None]  # (1, 512)
    kv_c[0, 5] = -kv_c[0, 5]
    k_pe = (torch.arange(R, dtype=torch.float32) + 0.5)[None]  # (1, 64)
    row = fp8.quantize_ds_mla(kv_c, k_pe)[0].numpy().tobytes()
    assert len(row) == 656
    for g in range(4):
        scale = struct.unpack("<f", row[512 + 4 * g: 516 + 4 * g])[0]
        assert scale == np.float32(np.float32((g + 1) * 44.8) / np.float32(448.0))
        assert math.isclose(scale, (g + 1) / 10, rel_tol=1e-6)
    # 448 = 1.75 * 2^8: exponent field 8 + 7 = 15, mantissa 6: 0b0_1111_110 = 0x7E; -448 = 0xFE
    assert row[:5] + row[6:128] == b"\x7e" * 127 and row[5] == 0xFE
    assert set(row[128:512]) == {0x7E}
    rope = struct.unpack("<64H", row[528:656])
    assert [struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in rope] == \
        [j + 0.5 for j in range(R)]


# ----------------------------------------------------------------------------------------------
# against the float64 reference, byte for byte


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("c,r", [(512, 64), (128, 3), (1152, 64)])
def test_quantize_ds_mla_matches_the_float64_reference(dtype, c, r):
    kv_c, k_pe = latent_rows(12, c, r, dtype)
    ours = fp8.quantize_ds_mla(kv_c, k_pe).numpy()
    want = ref_quantize_ds_mla(kv_c, k_pe)
    assert ours.shape == want.shape == (12, c + 4 * (c // 128) + 2 * r)
    diff = np.argwhere(ours != want)
    assert diff.size == 0, f"{len(diff)} bytes differ, first at {diff[0].tolist()}"


def test_dequantize_ds_mla_reads_the_layout_exactly():
    kv_c, k_pe = latent_rows(12)
    rows = fp8.quantize_ds_mla(kv_c, k_pe)
    got_c, got_pe = fp8.dequantize_ds_mla(rows, C, R)
    want_c, want_pe = ref_dequantize_ds_mla(rows.numpy(), C, R)
    assert got_c.dtype == got_pe.dtype == torch.float32
    # a product of a 4-bit and a 24-bit significand is exact in float64; float32 rounds it once
    np.testing.assert_array_equal(got_c.numpy(), f32(want_c))
    np.testing.assert_array_equal(got_pe.numpy(), want_pe)
    # leading dims pass through: (blocks, page, W) -> (blocks, page, c)
    paged_c, paged_pe = fp8.dequantize_ds_mla(rows.reshape(3, 4, -1), C, R)
    assert torch.equal(paged_c.reshape(12, C), got_c) and paged_pe.shape == (3, 4, R)


def test_zero_and_nonfinite_groups():
    """A zero group takes the floor scale 2^-126 and zeros of its sign; a NaN or an inf spoils
    its own group of 128 and no other."""
    kv_c, k_pe = latent_rows(4, dtype=torch.float32)
    kv_c[3] = torch.randn(C)
    kv_c[3, 130] = math.nan
    kv_c[3, 300] = math.inf
    rows = fp8.quantize_ds_mla(kv_c, k_pe)
    scales = rows[:, 512:528].contiguous().view(torch.float32)  # (T, 4)
    assert scales[1, 1] == scales[1, 2] == MIN_SCALE
    assert (rows[1, 128:256] == 0).all() and (rows[1, 256:384] == 0x80).all()
    assert torch.isnan(scales[3, 1]) and scales[3, 2] == math.inf
    assert torch.isfinite(scales[3, [0, 3]]).all()
    # every NaN is its format's positive quiet NaN, whatever the input's sign or payload
    k_pe[3, 7] = -math.nan
    rows = fp8.quantize_ds_mla(kv_c, k_pe)
    assert rows[3, 512 + 4: 512 + 8].tolist() == [0x00, 0x00, 0xC0, 0x7F]
    assert (rows[3, 128:256] == 0x7F).all()
    assert rows[3, 528 + 14: 528 + 16].tolist() == [0xC0, 0x7F]
    deq, _ = fp8.dequantize_ds_mla(rows, C, R)
    assert torch.isnan(deq[3, 128:256]).all()
    assert torch.isfinite(deq[3, :128]).all() and torch.isfinite(deq[3, 384:]).all()
    assert torch.equal(deq[1, 128:384], torch.zeros(256))


# ----------------------------------------------------------------------------------------------
# the error bound (docs/derivations/fp8-cache.md): with s the group's stored scale,
#   |x_hat - x| <= max(|x| / 17, 2^-10 s) (1 + 2^-18)
# |x| / 17 is half a step of e4m3's 3 mantissa bits at the bottom of a binade (2^-4 / (1 + 2^-4)),
# 2^-10 s half the subnormal step; the factor covers the three float32 roundings around them.
# Over a group, |x| <= amax = 448 s, so the error is at most amax / 17 (about 2^-4 amax).


def _bound(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    return np.maximum(np.abs(x) / 17, 2.0**-10 * s) * (1 + 2.0**-18)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ds_mla_round_trip_error_bound(dtype):
    kv_c, k_pe = latent_rows(64, dtype=dtype, seed=3)
    rows = fp8.quantize_ds_mla(kv_c, k_pe)
    got_c, got_pe = fp8.dequantize_ds_mla(rows, C, R)
    x = kv_c.double().numpy()
    s = np.repeat(rows[:, 512:528].contiguous().view(torch.float32).double().numpy(), 128, axis=1)
    err = np.abs(got_c.double().numpy() - x)
    assert (err <= _bound(x, s)).all()
    amax = np.abs(x).reshape(64, 4, 128).max(-1)
    assert (err.reshape(64, 4, 128).max(-1) <= amax * 2.0**-4).all()
    # the bound is tight: some value comes within 5% of |x| / 17
    normal = np.abs(x) >= 2.0**-6 * s
    assert (err[normal] / np.abs(x[normal])).max() > 0.95 / 17
    # rope: bf16 rounding only (exact for bf16 inputs): half a step of 8 significant bits,
    # 2^-8 / (1 + 2^-8) = 1/257 of the value at most
    pe = k_pe.double().numpy()
    pe_err = np.abs(got_pe.double().numpy() - pe)
    assert (pe_err <= np.abs(pe) / 257).all()
    assert (pe_err == 0).all() == (dtype == torch.bfloat16)


def test_e4m3_round_trip_bound_and_clamp():
    """fp8_e4m3: the same bound with the one cache scale, for |x| <= 448 s; past it, +-448 s."""
    kv_c, k_pe = latent_rows(32, dtype=torch.float32, seed=4)
    scale = 0.05  # 448 * 0.05 = 22.4: the large rows clamp
    rows = fp8.quantize_e4m3(kv_c, k_pe, scale)
    assert rows.dtype == torch.float8_e4m3fn and rows.shape == (32, C + R)
    # byte for byte against the float64 spelling
    x = torch.cat([kv_c, k_pe], -1).double().numpy()
    s = float(np.float32(scale))
    want = e4m3_bits(np.clip(f32(x / s), -448, 448))
    np.testing.assert_array_equal(rows.view(torch.uint8).numpy(), want)
    got_c, got_pe = fp8.dequantize_e4m3(rows, C, scale)
    got = torch.cat([got_c, got_pe], -1).double().numpy()
    inside = np.abs(x) <= 448 * s
    assert inside.any() and (~inside).any()
    assert (np.abs(got - x)[inside] <= _bound(x, s)[inside]).all()
    np.testing.assert_array_equal(got[~inside], np.sign(x[~inside]) * f32(np.array(448 * s)))


def test_calibrated_e4m3_scale_maps_amax_to_448():
    kv_c, k_pe = latent_rows(8, dtype=torch.float32)
    s = fp8.calibrate_e4m3_scale(kv_c, k_pe)
    amax = max(kv_c.abs().max(), k_pe.abs().max())
    assert s.shape == (1,) and s.dtype == torch.float32
    assert s.item() == np.float32(np.float32(amax) / np.float32(448))
    rows = fp8.quantize_e4m3(kv_c, k_pe, s)
    assert rows.float().abs().max() == 448  # the range used to its top, nothing past it
    assert fp8.calibrate_e4m3_scale(torch.zeros(2, 8), torch.zeros(2, 4)).item() == MIN_SCALE
    # headroom 2 maps amax to 224; non-finite values are left out of the amax
    assert fp8.calibrate_e4m3_scale(kv_c, k_pe, headroom=2).item() == np.float32(
        np.float32(amax) / np.float32(224))
    bad = kv_c.clone()
    bad[0, 0], bad[1, 1], bad[2, 2] = math.inf, -math.inf, math.nan
    assert fp8.calibrate_e4m3_scale(bad, k_pe).item() == np.float32(
        np.float32(max(bad[torch.isfinite(bad)].abs().max(), k_pe.abs().max())) / np.float32(448))
    for headroom in (0.5, math.inf, True, "2"):
        with pytest.raises(ValueError, match="headroom must be a finite number >= 1"):
            fp8.calibrate_e4m3_scale(kv_c, k_pe, headroom=headroom)


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan, MIN_SCALE / 2, 1e-50])
def test_e4m3_refuses_a_bad_scale(scale):
    # a float32 subnormal (2^-127) or a float that rounds to 0 in float32 (1e-50) too
    with pytest.raises(ValueError, match=r"quantize_e4m3: scale must be positive and finite, at "
                                         r"least 2\^-126"):
        fp8.quantize_e4m3(torch.ones(1, 8), torch.ones(1, 4), scale)


@pytest.mark.parametrize("scale", [0.5, torch.tensor([0.5])], ids=["float", "cpu-tensor"])
def test_e4m3_scale_from_the_host_is_refused_under_graph_capture(monkeypatch, scale):
    # a capture cannot copy a host value to the GPU; the error says what to pass instead. The
    # capture is simulated: nothing here touches a GPU before the check.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match=r"mla_decode: kv_scale must be a 1-element float32 tensor on cuda "
                                         r"under CUDA graph capture"):
        fp8.check_e4m3_scale("mla_decode", "kv_scale", scale, "cuda", read_value=False)


def test_without_float8_a_clear_error(monkeypatch):
    monkeypatch.setattr(fp8, "fp8_available", lambda: False)
    with pytest.raises(RuntimeError, match="kv_cache_dtype='fp8_ds_mla' needs torch.float8_e4m3fn"):
        fp8.quantize_ds_mla(torch.zeros(1, C), torch.zeros(1, R))
    with pytest.raises(RuntimeError, match="kv_cache_dtype='fp8_e4m3' needs torch.float8_e4m3fn"):
        fp8.quantize_e4m3(torch.zeros(1, 8), torch.zeros(1, 4), 1.0)


# ----------------------------------------------------------------------------------------------
# Every input: all 256 e4m3 bytes read back, and every bf16 / fp16 bit pattern and float32's
# rounding edges (ties, the 448-480 saturation edge, subnormals, NaN and inf) written, against
# the float64 spelling above. tests/test_kernels_concat_cache.py sends the same values through
# the C++ twin and the CUDA kernel.


def e4m3_edge_floats() -> torch.Tensor:
    """float32 values at e4m3's rounding edges, both signs: every finite e4m3 value, the ties
    between neighbours and the floats either side of them, the saturation edge, e4m3's and
    float32's subnormals, inf and NaNs of several payloads."""
    grid = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mid = (grid[:-1] + grid[1:]) / 2  # ties: exact in float32
    up = torch.nextafter(mid, torch.tensor(math.inf))
    down = torch.nextafter(mid, torch.tensor(0.0))
    special = torch.tensor([448.0, 464.0, 479.99997, 480.0, 481.0, 1e30, 3.4028235e38, math.inf,
                            2.0**-10, 3 * 2.0**-10, 2.0**-6, 1e-45, 1e-40, 1.1754942e-38])
    special = torch.cat([special, torch.nextafter(special, torch.tensor(0.0)),
                         torch.nextafter(special, torch.tensor(math.inf))])
    values = torch.cat([grid, mid, up, down, special])
    nans = torch.tensor([0x7FC00000, 0x7FC00001, 0x7F800001, 0x7FFFFFFF],
                        dtype=torch.int32).view(torch.float32)
    return torch.cat([values, -values, nans, -nans])


def sweep_values(dtype: torch.dtype) -> torch.Tensor:
    """All 65536 bit patterns of bf16 / fp16; in float32 the edge values and 4096 random bit
    patterns."""
    if dtype == torch.float32:
        g = torch.Generator().manual_seed(4)
        random_bits = torch.randint(-(2**31), 2**31, (4096,), generator=g, dtype=torch.int64)
        return torch.cat([e4m3_edge_floats(), random_bits.to(torch.int32).view(torch.float32)])
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def _same_values(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit for bit as float64 (signed zeros apart), NaN where the other is NaN."""
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got[~nan].view(np.int64), want[~nan].view(np.int64))


def test_every_e4m3_byte_reads_back_exactly():
    byte = torch.arange(256, dtype=torch.uint8)
    value = e4m3_value(byte.numpy())  # (256,) float64, NaN at 0x7F and 0xFF
    for scale in (1.0, 0.125, 3.0):  # products exact in float32: 4 significant bits times 2
        kv_c, k_pe = fp8.dequantize_e4m3(byte.view(torch.float8_e4m3fn)[None], 192, scale)
        _same_values(torch.cat([kv_c, k_pe], -1)[0].double().numpy(), value * scale)
    # fp8_ds_mla, c = 256: the 256 bytes as two groups of scales 0.125 and 3
    rows = torch.cat([byte, torch.tensor([0.125, 3.0]).view(torch.uint8), torch.zeros(2 * R, dtype=torch.uint8)])
    kv_c, _ = fp8.dequantize_ds_mla(rows[None], 256, R)
    _same_values(kv_c[0].double().numpy(), value * np.repeat([0.125, 3.0], 128))


@pytest.mark.parametrize("scale", [1.0, 0.3, 2.0**-12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_e4m3_every_input(dtype, scale):
    x = sweep_values(dtype)
    rows = torch.cat([x, x.new_zeros(-x.numel() % 512)]).reshape(-1, 512)  # (T, 448 + 64)
    got = fp8.quantize_e4m3(rows[:, :448], rows[:, 448:], scale).view(torch.uint8).numpy()
    with np.errstate(invalid="ignore", over="ignore"):  # NaN, and quotients past float32 to inf
        v = np.clip(f32(rows.double().numpy() / float(np.float32(scale))), -448.0, 448.0)
        want = e4m3_bits(v)
    want[np.isnan(v)] = 0x7F  # every NaN stored as the positive one
    diff = np.argwhere(got != want)
    assert diff.size == 0, f"{len(diff)} bytes differ, first at {diff[0].tolist()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_ds_mla_every_finite_input(dtype):
    """Groups of 127 values led by 448 (scale 1: each value meets the e4m3 rounding as it is),
    then every finite value 128 to a group in its order (scales from 2^-126 to ~2^119);
    non-finite groups: test_zero_and_nonfinite_groups."""
    x = sweep_values(dtype)
    x = x[torch.isfinite(x)]
    small = x[x.float().abs() <= 448]
    anchored = torch.cat([small, small.new_zeros(-small.numel() % 127)]).reshape(-1, 127)
    anchored = torch.cat([anchored.new_full((anchored.shape[0], 1), 448.0), anchored], dim=1)
    latent = torch.cat([anchored.reshape(-1), x])
    latent = torch.cat([latent, latent.new_zeros(-latent.numel() % C)]).reshape(-1, C)  # (T, c)
    pe = torch.cat([x, x.new_zeros(-x.numel() % R)]).reshape(-1, R)
    k_pe = pe.repeat(-(-latent.shape[0] // pe.shape[0]), 1)[: latent.shape[0]]  # (T, r)
    ours = fp8.quantize_ds_mla(latent, k_pe).numpy()
    with np.errstate(over="ignore"):  # float32 values near its top round to a bf16 inf
        want = ref_quantize_ds_mla(latent, k_pe)
    diff = np.argwhere(ours != want)
    assert diff.size == 0, f"{len(diff)} bytes differ, first at {diff[0].tolist()}"
