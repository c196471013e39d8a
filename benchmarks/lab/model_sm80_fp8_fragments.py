"""The sm_80 decode kernel's fp8 fragments, replayed lane by lane on the CPU.

    PYTHONPATH=. python3 benchmarks/lab/model_sm80_fp8_fragments.py

``csrc/mla_decode_sm80.cu`` builds its mma B fragments on an fp8 cache straight from the stored
bytes in shared memory, in a permuted k order (q . k) and a permuted dim order (p . V), and
converts e4m3 to the products' type (``mla_decode_fp8.cuh``): before sm_89 q's dtype, by integer
operations; from sm_89 fp16 whatever q's dtype, by cvt, bf16 q times a power of two
(``fp16_range_scale``) and fp8_ds_mla's p x scale times a power of two set a tile at a time. No GPU
checks that before it runs, so this script replays it: the index maps below are the CUDA
expressions line by line (``fp8_qk_dim``, ``fp8_byte``, ``kRawStride``, the lane's loads, the byte
permutes, ``e4m3x2_to`` / ``e4m3x4_to``, ``bf16x2_to``, ``q_pair``, the tile's ``p_scale``, the
epilogue's columns staged through shared memory and read back in dim order), the shared memory
is the bytes the copies leave there (rows past the split's end zero-filled, row padding and q's
padding poisoned with NaN bytes), and each ``mma.m16n8k16`` is computed in float64 from the
fragment registers the lanes hold, by the PTX fragment layout. It prints, for each layout and
each of the kernel's cases (``CASES``: q's dtype, the GPU, the conversion):

1. the conversions against torch's float8_e4m3fn -> bfloat16 / float16 on all 256 bytes (bit for
   bit on the 254 finite ones);
2. one tile's scores S (16 heads x 32 tokens) and output O (16 x 512) against a direct float64
   computation of the same step on the dequantised tile (maps right: equal to rounding order),
   also with bf16 q 2^20 and 2^-40 times its size (the softmax scale the inverse);
3. the shared-memory bank conflicts of every fragment load;
4. on the GPU tests' own fp8_ds_mla cases, how far the kernel's arithmetic on sm_89+ (scales
   applied in float32 to the scores and p, p x scale rounded to fp16) lands from the Triton
   kernel's (e4m3 x scale rounded to q's dtype) and from the tests' reference, beside the tests'
   tolerances.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from mla.kernels import fp8

C, R, D = 512, 64, 576  # latent, rope, row
HEADS, TILE, WARPS = 16, 32, 4
K_ROW_STRIDE = D + 8  # q_s row, in values
GROUP = 128  # fp8_ds_mla's scale group = a warp's latent quarter
QK_STEPS, QK_LATENT_STEPS = 9, 8
DS_SCALES, DS_ROPE = 512, 528  # kDsMlaScales, kDsMlaRope
STORED = {"fp8_e4m3": 576, "fp8_ds_mla": 656}  # kStoredRowBytes
RAW_STRIDE = {"fp8_e4m3": 576 + 16, "fp8_ds_mla": 656}  # kRawStride
PV_DIMS = C // WARPS  # kPVDims
THREADS, PAIRS, OUT_STRIDE = 32 * WARPS, C // 2, C + 4  # kThreads, kPairs, kOutStride
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ROUTES = [("bf16", "bf16"), ("fp16", "fp16-int"), ("fp16", "fp16-cvt")]  # (products' dtype, e4m3 conversion)
# The kernel's cases (MmaType): q's dtype, the GPU, and the e4m3 conversion its products take: before
# sm_89 the products run in q's dtype; from sm_89 in fp16 whatever q's dtype (bf16 q times q_scale)
CASES = [("bf16", "sm_80", "bf16"), ("fp16", "sm_80", "fp16-int"), ("bf16", "sm_89+", "fp16-cvt"),
         ("fp16", "sm_89+", "fp16-cvt")]


def mma_dtype(route: str) -> torch.dtype:
    """The products' dtype of an e4m3 conversion route."""
    return torch.bfloat16 if route == "bf16" else torch.float16


def fp16_range_scale(x: float) -> float:
    """fp16_range_scale (mla_decode_fp8.cuh): the power of two taking x >= 0 to [2^14, 2^15), at
    most 2^126; 1 for inf or NaN."""
    e = int(np.float32(x).view(np.uint32) >> 23) & 0xFF
    if e == 0xFF:
        return 1.0
    return 2.0 ** min(14 - (e - 127), 126)

# ---------------------------------------------------------------------------------------------
# The CUDA index maps and conversions, as written in csrc/


def fp8_qk_dim(dq: int, ks: int) -> int:
    """fp8_qk_dim: the first dim of warp dq's q . k k-step ks (latent group dq, then rope)."""
    return dq * GROUP + ks * 16 if ks < QK_LATENT_STEPS else C + dq * 16


def fp8_byte(kind: str, dim):
    """fp8_byte<F>: the byte of a stored row where value `dim` starts (each lane's)."""
    return np.where(dim >= C, DS_ROPE + 2 * (dim - C), dim) if kind == "fp8_ds_mla" else dim


def byte_perm(a, b, sel: int):
    """__byte_perm(a, b, sel) (prmt, default mode): byte i of the result is byte sel[i] of (a, b)."""
    pool = [(a >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)] + [
        (b >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)]
    out = np.zeros_like(a, dtype=np.uint32)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        assert nib < 8, "sign-replicating selectors are not used"
        out |= pool[nib].astype(np.uint32) << np.uint32(8 * i)
    return out


def t_values(bits16, dtype: torch.dtype):
    """uint16 bit patterns of dtype -> float64 values."""
    return torch.from_numpy(np.asarray(bits16, dtype=np.uint16).astype(np.int16)).view(dtype).double().numpy()


def t_bits(values, dtype: torch.dtype):
    """Values -> uint16 bit patterns of dtype, rounded to nearest even from float32 (pack_pair)."""
    v = torch.from_numpy(np.asarray(values, dtype=np.float32)).to(dtype)
    return v.view(torch.int16).numpy().astype(np.uint16)


def halves(word, dtype: torch.dtype):
    """A 32-bit fragment register -> its two values (low half first), float64."""
    word = np.asarray(word, dtype=np.uint32)
    return t_values(word & 0xFFFF, dtype), t_values(word >> 16, dtype)


def pack(lo16, hi16):
    return np.asarray(lo16, dtype=np.uint32) | (np.asarray(hi16, dtype=np.uint32) << np.uint32(16))


def hmul2(bits, const: int, dtype: torch.dtype):
    """__hmul2 of two T pairs: each lane's product, which must be exact (asserted), as T bits."""
    out = []
    for shift in (0, 16):
        x = t_values((bits >> np.uint32(shift)) & 0xFFFF, dtype)
        y = t_values(np.array([(const >> shift) & 0xFFFF]), dtype)
        prod = x * y  # float64: exact for two 8- or 11-bit significands
        back = torch.from_numpy(prod).to(dtype)
        assert np.array_equal(back.double().numpy(), prod, equal_nan=True), "the multiply rounded"
        out.append(back.view(torch.int16).numpy().astype(np.uint16))
    return pack(*out)


def e4m3_values(byte):
    return torch.from_numpy(np.asarray(byte, dtype=np.uint8).copy()).view(torch.float8_e4m3fn).double().numpy()


def e4m3x2_to(route: str, a, b, lo: int, hi: int):
    """e4m3x2_to<T>(a, b, lo, hi): bytes lo and hi of (a, b) -> a T pair (uint32), by `route`."""
    a, b = np.asarray(a, dtype=np.uint32), np.asarray(b, dtype=np.uint32)
    if route == "fp16-cvt":  # cvt.rn.f16x2.e4m3x2 of the low 16 bits: torch's conversion is its spec
        two = byte_perm(a, b, lo | (hi << 4))
        lo16 = torch.from_numpy(e4m3_values(two & 0xFF)).half().view(torch.int16).numpy().astype(np.uint16)
        hi16 = torch.from_numpy(e4m3_values((two >> 8) & 0xFF)).half().view(torch.int16).numpy().astype(np.uint16)
        return pack(lo16, hi16)
    x = byte_perm(a, b, (lo << 4) | (hi << 12))
    if route == "bf16":
        bits = (x & np.uint32(0x80008000)) | ((x >> np.uint32(4)) & np.uint32(0x07F007F0))
        return hmul2(bits, 0x7B807B80, torch.bfloat16)
    assert route == "fp16-int"
    bits = (x & np.uint32(0x80008000)) | ((x >> np.uint32(1)) & np.uint32(0x3F803F80))
    return hmul2(bits, 0x5C005C00, torch.float16)


def bf16x2_to(dtype: torch.dtype, two):
    """bf16x2_to<T>: two bf16 values -> T (as they are, or rounded to fp16 from their floats)."""
    two = np.asarray(two, dtype=np.uint32)
    if dtype == torch.bfloat16:
        return two
    lo, hi = halves(two, torch.bfloat16)
    return pack(t_bits(lo, dtype), t_bits(hi, dtype))


# ---------------------------------------------------------------------------------------------
# Shared memory and mma.m16n8k16, per lane

LANE = np.arange(32)
G, CC = LANE >> 2, LANE & 3  # g = lane / 4, c = lane % 4


class Raw:
    """One stage of stored rows in shared memory: TILE rows kRawStride apart; rows at and past
    `valid` zero-filled (cp.async with src-size 0), each row's padding poisoned (0xFF)."""

    def __init__(self, kind: str, rows: np.ndarray, valid: int):
        self.kind, self.stride = kind, RAW_STRIDE[kind]
        self.mem = np.full(TILE * self.stride, 0xFF, dtype=np.uint8)
        for t in range(TILE):
            self.mem[t * self.stride: t * self.stride + STORED[kind]] = rows[t] if t < valid else 0
        self.loads: dict[str, list] = {}  # load kind -> the byte addresses of each warp-wide load

    def word(self, addr, what: str, size: int = 4):
        """The 32-bit word (size 4) or the two words (size 8) at each lane's byte address."""
        addr = np.asarray(addr)
        assert (addr % size == 0).all(), f"{what}: misaligned"
        self.loads.setdefault(what, []).append((addr.copy(), size))
        get = lambda at: (self.mem[at].astype(np.uint32) | self.mem[at + 1].astype(np.uint32) << 8
                          | self.mem[at + 2].astype(np.uint32) << 16 | self.mem[at + 3].astype(np.uint32) << 24)
        return get(addr) if size == 4 else (get(addr), get(addr + 4))

    def float32(self, addr, what: str):
        return self.word(addr, what).astype(np.uint32).view(np.float32).astype(np.float64)


def mma16816(d, a, b0, b1, dtype):
    """d (32 lanes, 4) += A . B from the lanes' registers: A's a0 (row g, k 2c, 2c + 1), a1 (row
    g + 8), a2 (row g, k 2c + 8, 2c + 9), a3; B's b0 (k 2c, 2c + 1, column g), b1 (k 2c + 8, 2c + 9);
    d0, d1 (row g, columns 2c, 2c + 1), d2, d3 (row g + 8)."""
    A, B = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    for reg, (row, k) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
        lo, hi = halves(a[reg], dtype)
        A[G + row, 2 * CC + k], A[G + row, 2 * CC + k + 1] = lo, hi
    for reg, k in ((b0, 0), (b1, 8)):
        lo, hi = halves(reg, dtype)
        B[2 * CC + k, G], B[2 * CC + k + 1, G] = lo, hi
    out = A @ B  # float64
    d[:, 0] += out[G, 2 * CC]
    d[:, 1] += out[G, 2 * CC + 1]
    d[:, 2] += out[G + 8, 2 * CC]
    d[:, 3] += out[G + 8, 2 * CC + 1]


def a_fragment_rowmajor(m_bits):
    """ldmatrix_x4 of a (16, 16) row-major tile in T: the standard A fragment (as the kAuto path)."""
    m_bits = np.asarray(m_bits, dtype=np.uint16)
    return [pack(m_bits[G + row, 2 * CC + k], m_bits[G + row, 2 * CC + k + 1])
            for row, k in [(0, 0), (8, 0), (0, 8), (8, 8)]]


# ---------------------------------------------------------------------------------------------
# One tile through the kernel's fp8 path


def kernel_scores(kind, route, q_bits, raw, q_dtype):
    """The q . k part: each warp dq's partial scores through red_s, summed over dq: (16, 32), and
    divided by q_scale (the kernel folds 1 / q_scale into the softmax scale)."""
    dtype = mma_dtype(route)
    q_scale = 1.0
    if dtype != q_dtype:  # bf16 q into fp16 products: times the power of two of its largest |q|
        q_scale = fp16_range_scale(np.abs(t_values(q_bits[:, :D], q_dtype)).max())
    red = np.zeros((4, HEADS, TILE))
    for dq in range(4):
        qf = []
        for ks in range(QK_STEPS):  # q's A fragments: 64-bit loads of rows g and g + 8 at dim d
            d = fp8_qk_dim(dq, ks) + 4 * CC
            # q_pair: each value times q_scale, rounded to the step's products' type (the rope
            # step of fp8_ds_mla stays in q's dtype)
            step = q_dtype if kind == "fp8_ds_mla" and ks == QK_LATENT_STEPS else dtype
            qb = t_bits((t_values(q_bits, q_dtype) * q_scale).astype(np.float32), step) if q_scale != 1.0 \
                or step != q_dtype else q_bits
            lo = pack(qb[G, d], qb[G, d + 1]), pack(qb[G, d + 2], qb[G, d + 3])
            hi = pack(qb[G + 8, d], qb[G + 8, d + 1]), pack(qb[G + 8, d + 2], qb[G + 8, d + 3])
            qf.append([lo[0], hi[0], lo[1], hi[1]])
        s = np.zeros((TILE // 8, 32, 4))
        for ks in range(QK_STEPS):
            if kind == "fp8_ds_mla" and ks == QK_LATENT_STEPS:
                for j in range(TILE // 8):
                    at = (j * 8 + CC * 2) * raw.stride + DS_SCALES + 4 * dq
                    s0, s1 = raw.float32(at, "qk scale"), raw.float32(at + raw.stride, "qk scale")
                    s[j, :, 0] *= s0
                    s[j, :, 1] *= s1
                    s[j, :, 2] *= s0
                    s[j, :, 3] *= s1
            d = fp8_qk_dim(dq, ks) + 4 * CC
            for j in range(TILE // 8):
                row = (j * 8 + G) * raw.stride
                if kind == "fp8_ds_mla" and ks == QK_LATENT_STEPS:  # in q's dtype
                    vx, vy = raw.word(row + fp8_byte(kind, d), "qk rope (64-bit)", 8)
                    mma16816(s[j], qf[ks], bf16x2_to(q_dtype, vx), bf16x2_to(q_dtype, vy), q_dtype)
                else:  # e4m3x4_to: the word's bytes 0, 1 and 2, 3 as two pairs
                    v = raw.word(row + fp8_byte(kind, d), "qk e4m3")
                    mma16816(s[j], qf[ks], e4m3x2_to(route, v, v, 0, 1), e4m3x2_to(route, v, v, 2, 3), dtype)
        for j in range(TILE // 8):  # the red_s writes: rows g, g + 8, tokens 8j + 2c, + 1
            tok = j * 8 + CC * 2
            red[dq, G, tok], red[dq, G, tok + 1] = s[j, :, 0], s[j, :, 1]
            red[dq, G + 8, tok], red[dq, G + 8, tok + 1] = s[j, :, 2], s[j, :, 3]
    return red.sum(axis=0) / q_scale


def p_scales(kind, dtype, raw):
    """Each warp's p_scale for the tile (one tile: the first, from 2^126): fp8_ds_mla in fp16
    products takes p x scale times the power of two of the tile's largest scale of its group; 1
    otherwise. (4,) float32, warp w's is group w's."""
    if kind != "fp8_ds_mla" or dtype != torch.float16:
        return np.ones(WARPS, dtype=np.float32)
    lane = np.arange(32)  # lane i reads token i's scale of the warp's group (TILE = 32)
    top = [raw.float32(lane * raw.stride + DS_SCALES + 4 * w, "pv tile scale").max() for w in range(WARPS)]
    return np.array([min(2.0**126, fp16_range_scale(t)) for t in top], dtype=np.float32)


def kernel_output(kind, route, p32, raw):
    """The p . V part: p (16, 32) float32 as the softmax leaves it -> out (16, 512) before 1 / l
    (and with fp8_ds_mla's p_scale taken back out, as the kernel's epilogue does)."""
    dtype = mma_dtype(route)
    p_scale_w = p_scales(kind, dtype, raw)
    out = np.full((HEADS, C), np.nan)
    written = np.zeros((HEADS, C), dtype=int)
    o_s = np.full(HEADS * OUT_STRIDE, np.nan)  # the rows staged in shared memory (floats)
    staged = np.zeros(HEADS * OUT_STRIDE, dtype=int)
    p_bits = t_bits(p32, dtype)  # p_s in the products' type (fp8_e4m3)
    for w in range(WARPS):
        p_scale = p_scale_w[w]
        acc = np.zeros((PV_DIMS // 8, 32, 4))
        for ks in range(TILE // 16):
            k0 = ks * 16
            rows = [(k0 + 2 * CC + (i & 1) + (i >> 1) * 8) * raw.stride for i in range(4)]
            if kind == "fp8_ds_mla":
                group = w * PV_DIMS // GROUP
                sc = [np.float32(p_scale) * raw.float32(rows[i] + DS_SCALES + 4 * group, "pv scale").astype(np.float32)
                      for i in range(4)]
                p = p32.astype(np.float32)
                p0 = p[G, k0 + 2 * CC], p[G, k0 + 2 * CC + 1]
                p1 = p[G + 8, k0 + 2 * CC], p[G + 8, k0 + 2 * CC + 1]
                p2 = p[G, k0 + 2 * CC + 8], p[G, k0 + 2 * CC + 9]
                p3 = p[G + 8, k0 + 2 * CC + 8], p[G + 8, k0 + 2 * CC + 9]
                pf = [pack(t_bits(p0[0] * sc[0], dtype), t_bits(p0[1] * sc[1], dtype)),  # float32 products
                      pack(t_bits(p1[0] * sc[0], dtype), t_bits(p1[1] * sc[1], dtype)),
                      pack(t_bits(p2[0] * sc[2], dtype), t_bits(p2[1] * sc[3], dtype)),
                      pack(t_bits(p3[0] * sc[2], dtype), t_bits(p3[1] * sc[3], dtype))]
            else:
                pf = a_fragment_rowmajor(p_bits[:, k0: k0 + 16])
            for q4 in range(PV_DIMS // 32):
                d = w * PV_DIMS + q4 * 32 + 4 * G
                v = [raw.word(rows[i] + d, "pv e4m3") for i in range(4)]
                # two permutes a row pair put bytes j of both rows side by side (j = 0, 1 in
                # one word, 2, 3 in the other); e4m3x4_to converts each word as two pairs
                b = []
                for r0, r1 in ((v[0], v[1]), (v[2], v[3])):
                    words = byte_perm(r0, r1, 0x5140), byte_perm(r0, r1, 0x7362)
                    b.append([e4m3x2_to(route, x, x, lo, lo + 1) for x in words for lo in (0, 2)])
                for j in range(4):
                    mma16816(acc[4 * q4 + j], pf, b[0][j], b[1][j], dtype)
        # the epilogue, first half: lane c's dims col .. col + 7 of rows g and g + 8 into the
        # stages' shared memory as two float4 a row, in dim order (o_s: HEADS rows OUT_STRIDE apart)
        for q4 in range(PV_DIMS // 32):
            col = w * PV_DIMS + q4 * 32 + CC * 8
            for half in range(2):
                for e in range(2):
                    k = 2 * half + e
                    at = (G + 8 * half) * OUT_STRIDE + col + 4 * e
                    assert conflict(4 * at, 16) == 1, "the rows' float4 writes are conflict-free"
                    for j in range(4):
                        o_s[at + j] = acc[4 * q4 + j, :, k] / p_scale
                        np.add.at(staged, at + j, 1)
    # the second half, after the barrier: pair i = tid + THREADS x pass is row i / PAIRS, dims
    # 2 (i mod PAIRS) and + 1, stored to the output in order
    for first in range(0, HEADS * PAIRS, THREADS):
        for warp in range(WARPS):
            i = first + warp * 32 + LANE
            row, col = i // PAIRS, (i % PAIRS) * 2
            at = row * OUT_STRIDE + col
            assert conflict(4 * at, 8) == 1, "the read-back's float2 loads are conflict-free"
            for x in range(2):
                out[row, col + x] = o_s[at + x]
                np.add.at(written, (row, col + x), 1)
    assert (staged.reshape(HEADS, OUT_STRIDE)[:, :C] == 1).all(), \
        "the epilogue stages every (head, dim) once"
    assert (written == 1).all(), "the epilogue stores every (head, dim) once"
    return out


# ---------------------------------------------------------------------------------------------
# The direct computation on the dequantised tile


def direct(kind, dtype, q_bits, rows, valid, kv_scale, p32, q_dtype, p_scale_w):
    """S (16, valid) and O (16, 512) from the definitions, in float64: the dequantised values
    (e4m3 x scale in float64; fp8_e4m3 unscaled, as the kernel folds its scale elsewhere), and
    for O the kernel's p in the products' type `dtype` (fp8_ds_mla: p x group scale x the warp's
    p_scale in float32, rounded once)."""
    q = t_values(q_bits[:, :D], q_dtype)  # (16, 576)
    rows = rows[:valid]
    e4 = e4m3_values(rows[:, :C])  # (valid, 512)
    if kind == "fp8_ds_mla":
        scale = rows[:, DS_SCALES: DS_SCALES + 16].copy().view(np.float32).astype(np.float64)  # (valid, 4)
        rope_bf16 = rows[:, DS_ROPE: DS_ROPE + 2 * R].copy().view(np.uint16)
        rope = t_values(t_bits(t_values(rope_bf16, torch.bfloat16), q_dtype), q_dtype)  # bf16 -> q's dtype
        k = np.concatenate([e4 * np.repeat(scale, GROUP, axis=1), rope], axis=1)
        pq = np.stack([t_values(t_bits(p32[:, :valid].astype(np.float32) * (p_scale_w[g] * scale[:, g].astype(np.float32)),
                                       dtype), dtype) / float(p_scale_w[g])
                       for g in range(4)])  # (4 groups, 16, valid)
        o = np.concatenate([pq[g] @ e4[:, g * GROUP:(g + 1) * GROUP] for g in range(4)], axis=1)
    else:
        k = e4m3_values(rows[:, :D])
        o = t_values(t_bits(p32[:, :valid], dtype), dtype) @ e4
    return q @ k.T, o


# ---------------------------------------------------------------------------------------------


def check_conversions():
    print("1. e4m3 -> q's dtype on all 256 bytes (the 254 finite bit for bit; the two NaN bytes)")
    byte = np.arange(256, dtype=np.uint32)
    finite = (byte & 0x7F) != 0x7F
    for dtype_name, route in ROUTES:
        dtype = DTYPES[dtype_name]
        want = torch.from_numpy(byte.astype(np.uint8)).view(torch.float8_e4m3fn).to(dtype)
        want_bits = want.view(torch.int16).numpy().astype(np.uint16)
        # each byte in each of the 8 positions of (a, b), paired with a neighbour in the other lane
        ok = True
        for lo in range(8):
            hi = (lo + 3) % 8
            a = np.zeros(256, dtype=np.uint32)
            b = np.zeros(256, dtype=np.uint32)
            for pos, val in ((lo, byte), (hi, byte[::-1].copy())):
                if pos < 4:
                    a |= val << np.uint32(8 * pos)
                else:
                    b |= val << np.uint32(8 * (pos - 4))
            got = e4m3x2_to(route, a, b, lo, hi)
            for got16, src in ((got & 0xFFFF, byte), (got >> 16, byte[::-1])):
                fin = (src & 0x7F) != 0x7F
                ok &= np.array_equal(got16[fin].astype(np.uint16), want_bits[src[fin]])
        nan_out = t_values(e4m3x2_to(route, byte, byte, 0, 0)[~finite] & 0xFFFF, dtype)
        print(f"   {dtype_name:4s} {route:8s}: {finite.sum()} finite bytes bit-exact: {ok}; "
              f"0x7F, 0xFF -> {nan_out[0]:g}, {nan_out[1]:g}")
        assert ok


def check_tile(seed=0):
    print("2. one tile through the fragments vs. the direct float64 step on the dequantised tile")
    print("   (relative to the largest |value|; valid rows of 32, the rest zero-filled)")
    gen = torch.Generator().manual_seed(seed)
    banks = {}
    for kind in ("fp8_e4m3", "fp8_ds_mla"):
        latents = torch.randn(TILE, D, generator=gen)
        latents[:, :C] *= (2.0 ** torch.arange(4.0)).repeat_interleave(GROUP)  # groups 1, 2, 4, 8 x
        latents[:, :C] *= torch.logspace(-1, 1, C // 32).repeat_interleave(32)[torch.randperm(C // 32, generator=gen).repeat_interleave(32)]
        latents[3, 100:140] = torch.linspace(-3e-4, 3e-4, 40)  # small values, subnormal e4m3 in group 0 and 1
        kv_c, k_pe = latents[:, :C], latents[:, C:]
        if kind == "fp8_e4m3":
            kv_scale = fp8.calibrate_e4m3_scale(kv_c, k_pe)
            stored = fp8.quantize_e4m3(kv_c, k_pe, kv_scale)
            deq32 = torch.cat(fp8.dequantize_e4m3(stored, C, kv_scale), dim=-1).double().numpy()
            rows = stored.view(torch.uint8).numpy()
            kv_scale = float(kv_scale)
        else:
            kv_scale = 1.0
            stored = fp8.quantize_ds_mla(kv_c, k_pe)
            deq32 = torch.cat(fp8.dequantize_ds_mla(stored, C, R), dim=-1).double().numpy()
            rows = stored.numpy()
        for q_name, arch, route in CASES:
            q_dtype, dtype = DTYPES[q_name], mma_dtype(route)
            for valid, q_size in ((32, 1.0), (19, 1.0), (32, 2.0**20), (32, 2.0**-40)):
                q = torch.randn(HEADS, D, generator=gen) * q_size
                if q_size != 1.0 and q_dtype == torch.float16:
                    continue  # fp16 q holds neither
                q_bits = np.full((HEADS, K_ROW_STRIDE), 0x7FFF, dtype=np.uint16)  # padding: NaN
                q_bits[:, :D] = t_bits(q.numpy(), q_dtype)
                raw = Raw(kind, rows, valid)
                s = kernel_scores(kind, route, q_bits, raw, q_dtype)
                assert not np.isnan(s).any() and (s[:, valid:] == 0).all(), "zero-filled rows score 0"
                # the softmax as the kernel's: -inf past the split, p = exp2(v - m) in float32
                v = np.where(np.arange(TILE) < valid, s * kv_scale * (D ** -0.5 / q_size) * math.log2(math.e), -np.inf)
                p32 = np.exp2(v - v.max(axis=1, keepdims=True)).astype(np.float32)
                o = kernel_output(kind, route, p32, raw)
                s_ref, o_ref = direct(kind, dtype, q_bits, rows, valid, kv_scale, p32, q_dtype,
                                      p_scales(kind, dtype, raw))
                err_s = np.abs(s[:, :valid] - s_ref).max() / np.abs(s_ref).max()
                err_o = np.abs(o - o_ref).max() / np.abs(o_ref).max()
                # against mla.kernels.fp8's own float32 dequantisation of the same bytes
                q64 = t_values(q_bits[:, :D], q_dtype)
                deq = deq32[:valid].copy()
                if kind == "fp8_ds_mla" and q_dtype == torch.float16:  # the kernel's bf16 rope -> fp16
                    deq[:, C:] = t_values(t_bits(deq[:, C:], q_dtype), q_dtype)
                s_fp8 = q64 @ deq.T
                err_fp8 = np.abs(s[:, :valid] * kv_scale - s_fp8).max() / np.abs(s_fp8).max()
                o_exact = p32[:, :valid].astype(np.float64) @ deq[:, :C]  # p unrounded, values x scale
                err_exact = np.abs(o * (kv_scale if kind == "fp8_e4m3" else 1.0) - o_exact).max() / np.abs(o_exact).max()
                print(f"   {kind:10s} q {q_name} x 2^{int(math.log2(q_size)):<3d} {arch:5s} {route:8s} valid {valid:2d}: S {err_s:.1e}, O {err_o:.1e} "
                      f"(S vs fp8.dequantize_* {err_fp8:.1e}; O vs unrounded p {err_exact:.1e})")
                assert err_s < 1e-12 and err_o < 1e-12 and not np.isnan(o).any()
                assert err_fp8 < 1e-6
                for what, loads in raw.loads.items():
                    banks[(kind, what)] = max(banks.get((kind, what), 0), max(conflict(a, n) for a, n in loads))
    print("3. bank conflicts of the fragment loads (ways; 1 = none)")
    for (kind, what), ways in banks.items():
        print(f"   {kind:10s} {what:17s}: {ways}")


def conflict(addr, size):
    """Ways of the worst bank: 32-bit accesses over the warp, 64-bit ones per half-warp, 128-bit
    ones per quarter-warp."""
    worst = 0
    for lanes in [range(q, q + 128 // size) for q in range(0, 32, 128 // size)]:
        words = {int(addr[i]) // 4 + w for i in lanes for w in range(size // 4)}
        per_bank = {}
        for word in words:
            per_bank.setdefault(word % 32, set()).add(word)
        worst = max(worst, max(len(s) for s in per_bank.values()))
    return worst


def attention_ways(q, rows, dtype, softmax_scale):
    """One sequence's (out, lse) four ways, float64 but for the roundings named: "kernel" (scores
    scale x (q . e4m3) per group + q_rope . rope, p x the token's group scale rounded once to
    fp16, the products' type on sm_89+, times p_scale: here one for the sequence, the power of
    two of its largest scale of the group, where the kernel sets it a tile at a time, which
    changes nothing unless a product lands among fp16's subnormals), "triton" (values e4m3 x scale rounded to q's dtype, p rounded), "reference" (the
    tests' _reference_in_q_dtype: those values, p not rounded), "exact" (values e4m3 x scale)."""
    e4 = e4m3_values(rows[:, :C])  # (n, 512)
    scale = rows[:, DS_SCALES: DS_SCALES + 16].copy().view(np.float32).astype(np.float64)  # (n, 4)
    rope_bf16 = t_values(rows[:, DS_ROPE:].copy().view(np.uint16), torch.bfloat16)  # (n, 64)
    rope = t_values(t_bits(rope_bf16, dtype), dtype)  # in q's dtype, as the kernels read it
    exact = e4 * np.repeat(scale, GROUP, axis=1)
    rounded = t_values(t_bits(exact.astype(np.float32), dtype), dtype)
    scores = {"kernel": sum(scale[:, g] * (q[:, g * GROUP:(g + 1) * GROUP] @ e4[:, g * GROUP:(g + 1) * GROUP].T)
                            for g in range(4)) + q[:, C:] @ rope.T,
              "triton": q @ np.concatenate([rounded, rope], axis=1).T,
              "exact": q @ np.concatenate([exact, rope_bf16], axis=1).T}
    scores["reference"] = scores["triton"]
    out = {}
    for name, s in scores.items():
        z = s * softmax_scale
        m = z.max(axis=1, keepdims=True)
        p = np.exp(z - m)
        l = p.sum(axis=1)
        if name == "kernel":
            k = [fp16_range_scale(scale[:, g].max()) for g in range(4)]
            o = np.concatenate([t_values(t_bits((p * (k[g] * scale[None, :, g])).astype(np.float32), torch.float16),
                                         torch.float16) / k[g]
                                @ e4[:, g * GROUP:(g + 1) * GROUP] for g in range(4)], axis=1)
        elif name == "triton":
            o = t_values(t_bits(p.astype(np.float32), dtype), dtype) @ rounded
        else:
            o = p @ (exact if name == "exact" else rounded)
        out[name] = (o / l[:, None], m[:, 0] + np.log(l))
    return out


def check_semantics():
    """The GPU tests' own fp8_ds_mla cases of the sm_80 kernel (tests/test_kernels_decode_fp8.py:
    make_fp8_case at V3 sizes, seeds and lengths as the tests pick them), through attention_ways."""
    from tests.test_kernels_decode_fp8 import SM80_LENGTHS, SM90_LENGTHS, make_fp8_case

    print("4. fp8_ds_mla on the sm_80 GPU tests' cases: the kernel's arithmetic on sm_89+ vs the Triton kernel's")
    print("   (the tests: lse within 5e-3 for this kernel's ds_mla, 1e-3 for the rest), vs the Triton-")
    print("   rounded reference (lse 1e-2; out 1e-2 of its largest |out| for both), and the kernel's and")
    print("   Triton's vs the exact attention on the dequantised cache (the tests' reference for this")
    print("   kernel's ds_mla: lse within 1e-4)")
    cases = [(f"matches_reference_and_triton[{d}-{h}-{n}]", d, h, n, h + n, SM80_LENGTHS)
             for d in ("bf16", "fp16") for h in (1, 3, 16) for n in (32, 64)]
    cases.append(("reads_a_cache_of_wider_rows[bf16-16-64]", "bf16", 16, 64, 5, SM90_LENGTHS))
    print(f"   {'test case':42s} {'lse vs Triton':>13s} {'vs ref':>8s} {'out vs T':>8s} {'vs ref':>8s} "
          f"{'exact: kernel lse':>17s} {'Triton lse':>10s}")
    for name, dtype_name, heads, block_size, seed, lengths in cases:
        dtype = DTYPES[dtype_name]
        args, _, _, _ = make_fp8_case("fp8_ds_mla", lengths, heads=heads, c=C, r=R, block_size=block_size,
                                      seed=seed, device="cpu", poison=0xFF, group_growth=2.0)
        q = args["q"].to(dtype).double().numpy()  # (b, h, 576)
        cache, table = args["kv_cache"].numpy(), args["block_table"].numpy()
        ways = {k: ([], []) for k in ("kernel", "triton", "reference", "exact")}
        for i, n in enumerate(lengths):
            if n:
                rows = np.stack([cache[table[i, t // block_size], t % block_size] for t in range(n)])  # (n, 656)
                for k, (o, lse) in attention_ways(q[i], rows, dtype, args["softmax_scale"]).items():
                    ways[k][0].append(o)
                    ways[k][1].append(lse)
        o, lse = {k: np.concatenate(v[0]) for k, v in ways.items()}, {k: np.concatenate(v[1]) for k, v in ways.items()}
        d_lse = lambda a, b: np.abs(lse[a] - lse[b]).max()
        d_out = lambda a, b: np.abs(o[a] - o[b]).max() / np.abs(o[b]).max()  # as assert_close_rows
        flag = "  <- over 5e-3" if d_lse("kernel", "triton") >= 5e-3 else ""
        print(f"   {name:42s} {d_lse('kernel', 'triton'):13.1e} {d_lse('kernel', 'reference'):8.1e} "
              f"{d_out('kernel', 'triton'):8.1e} {d_out('kernel', 'reference'):8.1e} "
              f"{d_lse('kernel', 'exact'):17.1e} {d_lse('triton', 'exact'):10.1e}{flag}")


if __name__ == "__main__":
    check_conversions()
    check_tile()
    check_semantics()
