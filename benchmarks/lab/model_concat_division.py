"""A CPU model of the fp8 concat writers' division (csrc/concat_and_cache_mla.cu), checked byte
for byte against the reference's IEEE quotient: every input it can, the dangerous ones else.

    PYTHONPATH=. python3 benchmarks/lab/model_concat_division.py      (about 25 s on one core)
    PYTHONPATH=. python3 benchmarks/lab/model_concat_division.py --near   (check 9 too: minutes)

The kernels ("fp8" and "fp8_ds_mla") store e4m3(satfinite(q)) for each value x and its scale s,
every NaN as 0x7F, where q is computed from one correctly rounded reciprocal r a scale:

    fast path, s in [S_MIN, S_MAX] (read from the .cu):
        r  = RN(1 / s)                     __frcp_rn, once a thread ("fp8") or a group (ds_mla)
        q0 = RN(x * r)
        e  = RN(q0 * s - x)                fmaf(q0, s, -x): rounded where it needs > 24 bits
        q1 = RN(q0 - e * r)                fmaf(-e, r, q0)
        q  = q0 if q0 is +-inf else q1     (x * r overflowed, or x is +-inf: saturates)
    any other s (NaN and inf too):   q = RN(x / s)   the IEEE division

and the bytes come two at a time from cvt.rn.satfinite.e4m3x2.f32, a NaN byte's sign bit then
cleared (0xFF -> 0x7F) by integer ops on the packed word. The reference (mla/kernels/fp8.py) is
e4m3(clamp(RN(x / s), -448, 448)), NaN as 0x7F, computed here by torch itself. Both sides' e4m3
rounding is torch's cast of clamp(q) (which is what cvt.rn.satfinite does; the GPU tests pin the
instruction to torch's cast over every input), so the model checks what changed: q, and the NaN
fix-up. Checks 1-6 print their mismatches (all must be 0; the script exits 1 otherwise):

1. the model's fma (float64 products, TwoSum and round-to-odd) against fractions.Fraction;
2. the packed NaN fix-up over every byte value in every position of a word;
3. every float32 mantissa of x against each of 48 scale mantissas: q == RN(x / s) bit for bit.
   Every step scales by a power of two with x and s while no value underflows or overflows, so
   this covers every x and s of those mantissas away from the ends of the float32 range;
4. every bf16 and every fp16 bit pattern against each of 82 scales: the e4m3 byte, and every
   quotient q != RN(x / s) must be harmless (both below 2^-11 in size: a zero byte of x's sign;
   or both past 448 with one sign: saturated);
5. the same for float32 x at and beside every e4m3 rounding boundary m times s (and the x whose
   quotient lands on the float32 neighbours of m), plus random x, against each scale;
6. fp8_ds_mla end to end: groups of bf16 / fp16 / float32 values through fp8.quantize_ds_mla
   against the model with the reference's own group scales.

Then, as information (each should be far from 0): 7. the fast path without its guard, on the
scales outside [S_MIN, S_MAX], and 8. mutations of the steps (no correction, the remainder's
other sign, no inf select, a reciprocal one ulp low): the checks above would catch each.
"""

from __future__ import annotations

import math
import re
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from mla.kernels import fp8

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "concat_and_cache_mla.cu"
F32 = np.float32
E4M3_MAX = fp8.E4M3_MAX


def guard_range() -> tuple[float, float]:
    """[S_MIN, S_MAX], the scales the kernel's fast path takes, as written in the .cu."""
    text = SOURCE.read_text()
    lo = re.search(r"kReciprocalMin\s*=\s*(0x[0-9a-fp.+-]+)f", text)
    hi = re.search(r"kReciprocalMax\s*=\s*(0x[0-9a-fp.+-]+)f", text)
    assert lo and hi, f"kReciprocalMin / kReciprocalMax not found in {SOURCE}"
    return float.fromhex(lo.group(1)), float.fromhex(hi.group(1))


S_MIN, S_MAX = guard_range()


# ----------------------------------------------------------------------------------------------
# float32 arithmetic, exactly


def bits(a) -> np.ndarray:
    return np.asarray(a, dtype=F32).view(np.uint32)


def from_bits(b) -> np.ndarray:
    return np.asarray(b, dtype=np.uint32).view(F32)


def mul32(a, b) -> np.ndarray:
    """RN_f32(a * b): the product of two float32 is exact in float64 (48 bits, exponents within
    float64's normal range), so one cast rounds it once."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64)).astype(F32)


def fma32(a, b, c) -> np.ndarray:
    """RN_f32(a * b + c) with one rounding, as fmaf. a * b is exact in float64; TwoSum gives the
    sum's float64 rounding and its exact error; rounding that sum to odd (the neighbour with an
    odd last bit when the error is not zero) keeps it on the same side of every float32 midpoint,
    so the cast to float32 rounds the exact value once (float64 has 29 more bits than float32).
    IEEE special cases (inf, NaN, signed zeros) follow from the float64 operations themselves."""
    a, b, c = (np.asarray(v, np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    with np.errstate(invalid="ignore", over="ignore"):
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
    err = np.where(np.isfinite(s), err, 0.0)
    even = (s.view(np.int64) & 1) == 0
    toward = np.nextafter(s, np.where(err > 0, np.inf, -np.inf))
    with np.errstate(over="ignore"):  # past float32's range: inf, as fmaf
        return np.where((err != 0) & even, toward, s).astype(F32)


def rn32_fraction(v: Fraction, zero_sign: float = 1.0) -> float:
    """RN_f32 of an exact rational (ties to even, subnormals, overflow to inf), as a Python float."""
    if v == 0:
        return math.copysign(0.0, zero_sign)
    sign, a = (-1.0 if v < 0 else 1.0), abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2^e <= a < 2^(e+2)
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    quantum = Fraction(2) ** (max(e, -126) - 23)
    n = a / quantum
    k = n.numerator // n.denominator
    frac = n - k
    if frac > Fraction(1, 2) or (frac == Fraction(1, 2) and k % 2):
        k += 1
    value = k * quantum
    if value >= Fraction(2) ** 128:
        return sign * math.inf
    return sign * float(value)


# ----------------------------------------------------------------------------------------------
# The kernel's quotient and byte, and the reference's byte


def reciprocal(s: float) -> np.float32:
    """__frcp_rn(s): 1 / s rounded to nearest even (numpy's float32 division is IEEE)."""
    return F32(1.0) / F32(s)


def quotient_fast(x: np.ndarray, s: float, mutant: str | None = None) -> np.ndarray:
    """The fast path's q for float32 x and scale s (no guard). ``mutant`` names a deliberate
    error (MUTANTS), to show the checks catch it."""
    s = F32(s)
    r = reciprocal(s)
    if mutant == "r one ulp low":
        r = np.nextafter(r, F32(0))
    with np.errstate(over="ignore", invalid="ignore"):
        q0 = mul32(x, r)
        if mutant == "no correction":
            return q0
        if mutant == "e = x - q0 s":  # the same remainder, but +0 for x = -0
            q1 = fma32(fma32(-q0, s, x), r, q0)
        else:
            e = fma32(q0, s, -x)
            q1 = fma32(-e, r, q0)
    if mutant == "no inf select":
        return q1
    return np.where(np.isinf(q0), q0, q1)


MUTANTS = ("no correction", "e = x - q0 s", "no inf select", "r one ulp low")


def quotient(x: np.ndarray, s: float, mutant: str | None = None) -> np.ndarray:
    """The kernel's q: the fast path inside [S_MIN, S_MAX], the IEEE division outside."""
    if S_MIN <= s <= S_MAX:
        return quotient_fast(x, s, mutant)
    with np.errstate(all="ignore"):
        return (x / F32(s)).astype(F32)


def e4m3_bytes(q: np.ndarray) -> np.ndarray:
    """e4m3(satfinite(q)) as stored, every NaN as 0x7F: torch's cast of clamp(q)."""
    v = torch.from_numpy(np.ascontiguousarray(q, dtype=F32)).clamp(-E4M3_MAX, E4M3_MAX)
    v = v.masked_fill(v.isnan(), math.nan)
    return v.to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def reference_bytes(x: np.ndarray, s: float) -> np.ndarray:
    """The reference's bytes: fp8.quantize_e4m3 for the scales it accepts, else (ds_mla's inf or
    NaN group scales) the same expression as fp8.quantize_ds_mla's values."""
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=F32)).reshape(1, -1)
    if math.isfinite(s) and s >= fp8.MIN_SCALE:
        return fp8.quantize_e4m3(xt, xt[:, :0], float(s)).view(torch.uint8).reshape(-1).numpy()
    v = (xt / torch.tensor([s], dtype=torch.float32)).clamp(-E4M3_MAX, E4M3_MAX)
    v = v.masked_fill(v.isnan(), math.nan).to(torch.float8_e4m3fn)
    return v.view(torch.uint8).reshape(-1).numpy()


def nan_fixup(words: np.ndarray) -> np.ndarray:
    """The kernel's NaN fix-up on packed e4m3 bytes: a byte whose low 7 bits are all ones (0x7F
    or 0xFF, e4m3's NaNs; satfinite never gives them otherwise) loses its sign bit."""
    w = words.astype(np.uint32)
    nan_bytes = ((w & np.uint32(0x7F7F7F7F)) + np.uint32(0x01010101)) & np.uint32(0x80808080)
    return w & ~nan_bytes


# ----------------------------------------------------------------------------------------------
# Inputs


def all_bf16() -> np.ndarray:
    return (np.arange(1 << 16, dtype=np.uint32) << 16).view(F32)


def all_fp16() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(F32)


def e4m3_boundaries() -> np.ndarray:
    """Every value where e4m3 rounding of a nonnegative float32 turns: the midpoints between
    consecutive finite e4m3 values (subnormal ones and 2^-10, the half of the smallest, included),
    the values themselves, and past 448 the would-be midpoint 480 and 512; both signs."""
    finite = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    mids = (finite[:-1].astype(np.float64) + finite[1:]) / 2
    pos = np.unique(np.concatenate([finite, mids, [480.0, 512.0]]).astype(F32))
    return np.concatenate([pos, -pos])


def neighbours(v: np.ndarray, k: int) -> np.ndarray:
    """v and its k float32 neighbours each side (positive or negative v, no sign crossing)."""
    b = bits(v).astype(np.int64)
    steps = np.arange(-k, k + 1, dtype=np.int64)
    out = (b[:, None] + steps[None, :]).reshape(-1)
    out = out[(out >= 0) & (out < (1 << 32))].astype(np.uint32)
    return from_bits(out)


def boundary_inputs(s: float) -> np.ndarray:
    """float32 x where x / s lies on or beside an e4m3 boundary m: RN(m s) and 4 neighbours each
    side, and RN(q s) with 2 neighbours for each q among m's 3 float32 neighbours each side."""
    m = e4m3_boundaries()
    with np.errstate(over="ignore"):
        near_q = neighbours(m[m != 0], 3)
        x = np.concatenate([neighbours(mul32(m, s), 4), neighbours(mul32(near_q, s), 2)])
    return x[np.isfinite(x)]


def random_inputs(rng: np.random.Generator, s: float, n: int) -> np.ndarray:
    """n random float32 bit patterns (every exponent) and n values log-uniform in
    s * [2^-14, 2^10], either sign (the range where the byte is neither 0 nor saturated)."""
    patterns = from_bits(rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32))
    with np.errstate(over="ignore"):
        mag = F32(s) * np.exp2(rng.uniform(-14, 10, n)).astype(F32)
    near = (mag * rng.choice(np.array([-1, 1], F32), n)).astype(F32)
    return np.concatenate([patterns, near[np.isfinite(near)]])


def scale_set(rng: np.random.Generator) -> list[float]:
    """Scales the writers meet: random over the realistic range, amax/448 for amax in several
    binades (ds_mla's, clamped to 2^-126 as the writer does), powers of two, the floor 2^-126 and
    scales just above it, both guard edges and their neighbours, mantissas of all ones, the GPU
    tests' scales, and the extremes (FLT_MAX, inf, NaN: ds_mla's spoiled groups)."""

    def f(v):  # the float32 value, as a Python float
        return float(F32(v))

    out = [f(v) for v in 2.0 ** rng.uniform(-30, 20, 24)]
    for e in (-130, -120, -100, -80, -60, -30, -10, -4, 0, 4, 8, 12, 16, 40, 100, 127):
        amax = F32(2.0**e * rng.uniform(1, 2))
        out.append(float(max(F32(amax / F32(448.0)), F32(fp8.MIN_SCALE))))
    out += [2.0**e for e in (-126, -125, -100, -90, -64, -63, -24, -12, -1, 0, 1, 12, 64, 100, 126, 127)]
    tiny = np.uint32(0x00800000)  # 2^-126
    out += [float(from_bits(tiny + np.uint32(k))) for k in (1, 2, 3, 0x123456)]
    for edge in (S_MIN, S_MAX):
        b = bits(F32(edge))
        out += [float(from_bits(b - np.uint32(1))), float(from_bits(b + np.uint32(1)))]
    out += [float(from_bits(np.uint32(((127 + e) << 23) | 0x7FFFFF))) for e in (-70, -3, 0, 5)]
    out += [float(from_bits(np.uint32(((127 + e) << 23) | 1))) for e in (-70, -3, 0, 5)]
    out += [1.0, 0.3, 2.0**-12, 0.05, 0.01, 448.0, 1 / 448, f(np.finfo(F32).max), math.inf, math.nan]
    return [f(v) if math.isfinite(v) else v for v in out]


# ----------------------------------------------------------------------------------------------
# The checks


def check_fma(rng: np.random.Generator, n: int = 4000) -> int:
    """fma32 against Fraction on the triples the kernel forms (q0, s, -x) and (-e, r, q0) for
    random x and s over the float32 range (subnormal x and quotients included), and on random
    triples with c near -a*b (cancellation) and results in the subnormal range."""
    xs = from_bits(rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32))
    ss = from_bits(rng.integers(0x00800000, 0x7F000000, n, dtype=np.uint64).astype(np.uint32))
    small = (rng.uniform(-1, 1, n) * 2.0 ** rng.integers(-149, -100, n)).astype(F32)
    xs = np.concatenate([xs, small, mul32(ss[:n], F32(1.5))])
    ss = np.concatenate([ss, ss, ss])
    keep = np.isfinite(xs)
    xs, ss = xs[keep], ss[keep]
    rs = (F32(1.0) / ss).astype(F32)
    with np.errstate(all="ignore"):
        q0 = mul32(xs, rs)
        e = fma32(q0, ss, -xs)
    with np.errstate(all="ignore"):  # c within 2 ulps of -RN(x * s): heavy cancellation
        near = bits(-mul32(xs, ss)).astype(np.int64) + rng.integers(-2, 3, xs.size)
    near = from_bits(np.clip(near, 0, (1 << 32) - 1).astype(np.uint32))
    a = np.concatenate([q0, -e, xs])
    b = np.concatenate([ss, rs, ss])
    c = np.concatenate([-xs, q0, near])
    keep = np.isfinite(a) & np.isfinite(b) & np.isfinite(c)
    a, b, c = a[keep], b[keep], c[keep]
    ours = fma32(a, b, c)
    bad = 0
    for ai, bi, ci, oi in zip(a.tolist(), b.tolist(), c.tolist(), ours.tolist()):
        exact = Fraction(ai) * Fraction(bi) + Fraction(ci)
        prod_neg = (math.copysign(1, ai) * math.copysign(1, bi)) < 0
        zero_sign = -1.0 if (exact == 0 and ai * bi == 0 and ci == 0 and prod_neg
                             and math.copysign(1, ci) < 0) else 1.0
        want = rn32_fraction(exact, zero_sign)
        if not (want == oi and math.copysign(1, want) == math.copysign(1, oi)) and not (
                math.isnan(want) and math.isnan(oi)):
            bad += 1
    return bad


def check_nan_fixup() -> int:
    """Every byte value in each of the 4 byte positions, the other bytes random: the fix-up must
    turn 0xFF into 0x7F and leave every other byte alone."""
    rng = np.random.default_rng(1)
    bad = 0
    for pos in range(4):
        other = rng.integers(0, 1 << 32, 256, dtype=np.uint64).astype(np.uint32)
        byte = np.arange(256, dtype=np.uint32)
        words = (other & ~np.uint32(0xFF << (8 * pos))) | (byte << np.uint32(8 * pos))
        want = words.view(np.uint8).copy()
        want[want == 0xFF] = 0x7F
        bad += int((nan_fixup(words).view(np.uint8) != want).sum())
    return bad


def check_mantissas(scale_mantissas: list[float], chunk: int = 1 << 21) -> tuple[int, int]:
    """Every x in [1, 2) against each scale in [1, 2): q == RN(x / s) bit for bit. Returns
    (mismatches, values checked)."""
    bad = total = 0
    for s in scale_mantissas:
        s32 = F32(s)
        for start in range(0, 1 << 23, chunk):
            x = from_bits(np.arange(start, start + chunk, dtype=np.uint32) + np.uint32(0x3F800000))
            bad += int((bits(quotient_fast(x, s32)) != bits(x / s32)).sum())
            total += x.size
    return bad, total


def check_bytes(x: np.ndarray, scales: list[float], mutant: str | None = None) -> tuple[int, int, int]:
    """The kernel's bytes against the reference's for every x and each scale. Returns (byte
    mismatches, quotients q != RN(x / s) where that could matter, those where it cannot: both
    below 2^-11 in size, a zero byte of x's sign, or both past 448 with one sign, saturated)."""
    bad = odd = harmless = 0
    for s in scales:
        q = quotient(x, s, mutant)
        bad += int((e4m3_bytes(q) != reference_bytes(x, s)).sum())
        with np.errstate(all="ignore"):
            exact = (x / F32(s)).astype(F32)
            differ = (bits(q) != bits(exact)) & ~(np.isnan(q) & np.isnan(exact))
            small = (np.abs(q) < 2.0**-11) & (np.abs(exact) < 2.0**-11)
            past = (np.abs(q) > E4M3_MAX) & (np.abs(exact) > E4M3_MAX) & (np.sign(q) == np.sign(exact))
        odd += int((differ & ~small & ~past).sum())
        harmless += int((differ & (small | past)).sum())
    return bad, odd, harmless


def check_ds_mla(rng: np.random.Generator) -> tuple[int, int]:
    """fp8.quantize_ds_mla on groups of every bf16 / fp16 pattern (in order and shuffled, 128 a
    group) and of random float32 values over many binades, against the model with the group
    scales the reference stored. Returns (byte mismatches, values checked)."""
    bad = total = 0
    sets = [all_bf16(), all_fp16(),
            (rng.standard_normal(1 << 16) * np.exp2(rng.integers(-140, 120, 1 << 16))).astype(F32)]
    for values in sets:
        for v in (values, values[rng.permutation(values.size)]):
            kv_c = torch.from_numpy(v.copy()).reshape(-1, 512)  # (T, c = 512)
            rows = fp8.quantize_ds_mla(kv_c, kv_c[:, :0]).numpy()  # (T, 512 + 16) uint8
            scales = rows[:, 512:528].copy().view(F32).reshape(-1)  # (T * 4,)
            x = v.reshape(-1, 128)
            ours = np.concatenate([e4m3_bytes(quotient(x[g], float(scales[g]))) for g in range(len(x))])
            bad += int((ours != rows[:, :512].reshape(-1)).sum())
            total += v.size
    return bad, total


def float32_inputs(rng: np.random.Generator, s: float) -> np.ndarray:
    """Check 5's float32 inputs for a scale: its boundary inputs and random ones."""
    if not math.isfinite(s):
        return random_inputs(rng, 1.0, 40000)
    return np.concatenate([boundary_inputs(s), random_inputs(rng, s, 40000)])


def check_near_rounding_points(t: int, reach: int = 32) -> tuple[int, int]:
    """(mismatches, pairs): for every scale mantissa 2^t x odd (t = 0..3 covers every mantissa
    up to a factor of 2^4 of odd ones) and every x mantissa whose quotient lies within ``reach``
    units of a float32 rounding boundary (a midpoint between two floats), q == RN(x / s) bit for
    bit. The remainder e may be rounded (q0 can be 1.5 ulp from x / s), so exactness rests on
    q1's error staying below the distance to the nearest boundary: these are the x where it
    would not. x and s in [1, 2); powers of two carry it elsewhere, as in check 3."""
    odd = np.arange((1 << (23 - t)) + 1, 1 << (24 - t), 2, dtype=np.uint64)   # s = 2^t odd / 2^23
    half = (odd + np.uint64(1)) // np.uint64(2)                              # 2^-1 mod odd

    def inverse_power(m):
        acc = np.ones_like(odd)
        for _ in range(m):
            acc = (acc * half) % odd
        return acc

    pairs = bad = 0
    for shift, below_one in ((25 - t, True), (24 - t, False)):
        ip = inverse_power(shift)
        for d in (*range(1, reach + 1), *range(-reach, 0)):
            x0 = ((np.int64(d) % odd.astype(np.int64)).astype(np.uint64) * ip) % odd  # x 2^shift = d mod odd
            for j in range(2 ** (t + 1) + 3):
                xm = x0 + np.uint64(j) * odd
                ok = (xm >= (1 << 23)) & (xm < (1 << 24)) & (
                    (xm < (odd << np.uint64(t))) if below_one else (xm >= (odd << np.uint64(t))))
                x = (xm[ok].astype(np.float64) * 2.0**-23).astype(F32)
                sc = (odd[ok].astype(np.float64) * 2.0 ** (t - 23)).astype(F32)
                r = (F32(1) / sc).astype(F32)
                with np.errstate(all="ignore"):
                    q0 = mul32(x, r)
                    q1 = fma32(-fma32(q0, sc, -x), r, q0)
                q = np.where(np.isinf(q0), q0, q1)
                pairs += x.size
                bad += int((bits(q) != bits((x / sc).astype(F32))).sum())
    return bad, pairs


def main() -> int:
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    failures = 0

    def report(name, bad, extra=""):
        nonlocal failures
        failures += bad != 0
        print(f"{name:52s} {bad:6d}  {extra}  [{time.perf_counter() - t0:4.0f} s]")

    print(f"fast path for scales in [2^{math.log2(S_MIN):.0f}, 2^{math.log2(S_MAX):.0f}] "
          f"(kReciprocalMin, kReciprocalMax in {SOURCE.name})")
    print(f"{'check':52s} {'bad':>6s}")
    report("1. fma32 against Fraction: results", check_fma(rng))
    report("2. NaN fix-up, every byte in every position: bytes", check_nan_fixup())

    special = [1.0, 1.75, 1.5, 1 + 2.0**-23, 2 - 2.0**-23, 1 + 2.0**-22, 2 - 2.0**-22,
               float(F32(1.6)), float(F32(0.05 * 32)), float(F32(0.3 * 4))]
    mantissas = special + [float(F32(v)) for v in rng.uniform(1, 2, 38)]
    bad, n = check_mantissas(mantissas)
    report(f"3. every x mantissa, {len(mantissas)} scale mantissas: q bits", bad,
           f"{n:,} quotients")

    scales = scale_set(rng)
    inside = sum(S_MIN <= s <= S_MAX for s in scales)
    inputs = {"bf16": all_bf16(), "fp16": all_fp16()}
    for name, x in inputs.items():
        bad, odd, harmless = check_bytes(x, scales)
        report(f"4. every {name} x {len(scales)} scales ({inside} fast): bytes", bad,
               f"{x.size * len(scales):,} values")
        report("   q != RN(x/s) not both tiny or both saturated", odd,
               f"({harmless} both tiny or saturated)")
    bad = odd = harmless = n = 0
    for s in scales:
        x = float32_inputs(rng, s)
        b, o, h = check_bytes(x, [s])
        bad, odd, harmless, n = bad + b, odd + o, harmless + h, n + x.size
    report("5. float32 at e4m3 boundaries x s, random: bytes", bad, f"{n:,} values")
    report("   q != RN(x/s) not both tiny or both saturated", odd,
           f"({harmless} both tiny or saturated)")
    bad, n = check_ds_mla(rng)
    report("6. fp8.quantize_ds_mla's groups, its scales: bytes", bad, f"{n:,} values")
    if "--near" in sys.argv:  # a few minutes more
        for t in range(4):
            bad, n = check_near_rounding_points(t)
            report(f"9. x within 32 units of a rounding point, s = 2^{t} odd: q bits", bad, f"{n:,} pairs")

    # ---- what the checks catch (information: each of these should be far from 0)
    finite = [s for s in scales if math.isfinite(s)]
    groups = {"in [2^-126, S_MIN)": [s for s in finite if s < S_MIN],
              "in (S_MAX, FLT_MAX]": [s for s in finite if s > S_MAX],
              "inf and NaN": [math.inf, math.nan]}
    for label, group in groups.items():
        wrong = 0
        for s in group:
            for x in (*inputs.values(), float32_inputs(rng, s)):
                with np.errstate(all="ignore"):
                    wrong += int((e4m3_bytes(quotient_fast(x, s)) != reference_bytes(x, s)).sum())
        print(f"7. no guard, {len(group):2d} scales {label:20s} byte mismatches {wrong:8d}")
    fast = [s for s in scales if S_MIN <= s <= S_MAX]
    for mutant in MUTANTS:
        wrong = sum(check_bytes(x, fast, mutant)[0] for x in inputs.values())
        wrong += sum(check_bytes(float32_inputs(rng, s), [s], mutant)[0] for s in fast[::4])
        print(f"8. mutant {mutant!r:22s} byte mismatches {wrong:8d}")

    print(f"{'FAIL' if failures else 'ok'}: {failures} checks with mismatches, "
          f"{time.perf_counter() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
