"""concat_and_cache: the C++ twin and the CUDA kernel against the torch reference, bit for bit.

Every comparison covers the WHOLE cache, prefilled with random bits, so a write to a wrong slot,
a skipped token (-1) that was written anyway, or a row spilling into its neighbour all show.
"""

import math
import shutil

import pytest
import torch

from mla.kernels import concat_cache as cc
from mla.kernels import extension, fp8
from mla.kernels import concat_and_cache, concat_and_cache_reference
from test_fp8 import sweep_values

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def ext():
    """Build and load the extension once for this module (~25-50 s the first time on a machine)."""
    state = extension.load_extension()
    if not state["loaded"]:
        if shutil.which("c++") and shutil.which("ninja"):
            pytest.fail(f"a compiler is present but the extension did not load: {state['error']}")
        pytest.skip(f"no compiler: {state['error']}")
    return state


# ----------------------------------------------------------------------------------------------
# helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers, so NaN == NaN and -0 != +0 in comparisons."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    diff = (bits(a) != bits(b)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} values differ, first at {diff[0].tolist()}"


def make_rows(T, c, r, dtype, device, *, extra=0, magnitude=1.0, seed=0):
    """kv_c, k_pe as row views of one projection output (T, c + r + extra), as in the layer."""
    g = torch.Generator().manual_seed(seed)
    proj = (torch.randn(T, c + r + extra, generator=g) * magnitude).to(dtype).to(device)
    return proj[:, :c], proj[:, c : c + r]


def make_cache(num_blocks, block_size, width, dtype, device, *, seed=1):
    """A cache full of random bits (NaNs included), so any stray write changes it."""
    g = torch.Generator().manual_seed(seed)
    n = num_blocks * block_size * width
    elem = torch.empty((), dtype=dtype).element_size()
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[elem]
    lo, hi = (0, 256) if elem == 1 else (torch.iinfo(int_dtype).min, torch.iinfo(int_dtype).max)
    raw = torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(int_dtype)
    return raw.view(dtype).view(num_blocks, block_size, width).to(device)


def make_slots(T, num_slots, device, *, skip_every=5, seed=2):
    """Distinct random slots (a token's row is written once), every skip_every-th token -1."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:T].clone()
    if skip_every:
        slots[::skip_every] = -1
    return slots.to(device)


def run_both(kv_c, k_pe, cache, slots, **kw):
    """The extension and the reference on two copies of one cache; return both caches."""
    ours, ref = cache.clone(), cache.clone()
    concat_and_cache(kv_c, k_pe, ours, slots, backend="extension", **kw)
    concat_and_cache_reference(kv_c, k_pe, ref, slots, **kw)
    return ours, ref


def check_fp8_error(kv_c, k_pe, cache, slots, scale):
    """Dequantised rows are within e4m3's rounding of the inputs; rows past 448*scale clamp."""
    s = float(scale)
    rows = torch.cat([kv_c, k_pe], -1).float().cpu()
    keep = (slots >= 0).cpu()
    got = cache.view(-1, cache.shape[-1]).cpu()[slots.cpu()[keep]].float() * s
    want = rows[keep]
    inside = want.abs() <= 448 * s
    # 3 mantissa bits: half an ulp is 2^-4 relative; subnormals (below 2^-6) are 2^-9 apart.
    tol = torch.maximum(want.abs() * 2**-4, torch.full_like(want, 2**-10 * s)) * (1 + 1e-6)
    assert ((got - want).abs() <= tol)[inside].all()
    assert torch.equal(got[~inside], torch.sign(want[~inside]) * 448 * s)
    assert (~inside).any() and inside.any(), "the test data should exercise both regimes"


# ----------------------------------------------------------------------------------------------
# the backend in use


def test_extension_is_used_when_a_compiler_is_present(ext):
    assert extension.concat_backend("cpu") == "extension"
    if torch.cuda.is_available():
        assert ext["cuda"], "a GPU and nvcc are present but the CUDA kernel was not built"
        assert extension.concat_backend("cuda") == "extension"


def test_fallback_warns_once_and_uses_the_reference(monkeypatch):
    monkeypatch.setattr(extension, "_ext_state", {"loaded": False, "cuda": False,
                                           "error": "RuntimeError: no compiler (test)"})
    monkeypatch.setattr(cc, "_warned_fallback", False)
    kv_c, k_pe = make_rows(6, 8, 4, torch.float32, "cpu")
    cache = make_cache(2, 4, 12, torch.float32, "cpu")
    slots = make_slots(6, 8, "cpu")
    ref = cache.clone()
    concat_and_cache_reference(kv_c, k_pe, ref, slots)
    with pytest.warns(RuntimeWarning, match="using the torch reference") as record:
        concat_and_cache(kv_c, k_pe, cache, slots)
        concat_and_cache(kv_c, k_pe, cache, slots)
    assert len(record) == 1
    assert_bitwise_equal(cache, ref)
    with pytest.raises(RuntimeError, match="cannot run on cpu"):
        concat_and_cache(kv_c, k_pe, cache, slots, backend="extension")


# ----------------------------------------------------------------------------------------------
# the spec itself, against the loop in the docstring


@pytest.mark.parametrize("fp8", [False, True])
def test_reference_matches_the_loop(fp8):
    c, r, block_size = 6, 2, 4
    kv_c, k_pe = make_rows(9, c, r, torch.float32, "cpu", extra=3, magnitude=200.0)
    cache = make_cache(3, block_size, c + r, FP8 if fp8 else torch.float32, "cpu")
    slots = make_slots(9, 12, "cpu", skip_every=4)
    want = cache.clone()
    kw = dict(kv_cache_dtype="fp8", scale=0.25) if fp8 else {}
    concat_and_cache_reference(kv_c, k_pe, cache, slots, **kw)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        row = torch.cat([kv_c[i], k_pe[i]])
        if fp8:
            row = (row / 0.25).clamp(-448, 448).to(FP8)
        want[slot // block_size, slot % block_size] = row
    assert_bitwise_equal(cache, want)


# ----------------------------------------------------------------------------------------------
# CPU twin vs reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("c,r,extra", [(512, 64, 0), (512, 64, 7), (12, 4, 3)])
def test_cpu_matches_reference(ext, dtype, block_size, c, r, extra):
    T = 37
    num_blocks = -(-2 * T // block_size)
    kv_c, k_pe = make_rows(T, c, r, dtype, "cpu", extra=extra)
    assert kv_c.stride(0) == c + r + extra
    cache = make_cache(num_blocks, block_size, c + r, dtype, "cpu")
    slots = make_slots(T, num_blocks * block_size, "cpu")
    ours, ref = run_both(kv_c, k_pe, cache, slots)
    assert_bitwise_equal(ours, ref)
    assert not torch.equal(bits(ours), bits(cache)), "something should have been written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.5, 3.0, "tensor"])
@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_cpu_fp8_matches_reference(ext, dtype, scale, name):
    T, c, r, block_size = 41, 512, 64, 16
    scale = torch.tensor([0.75]) if scale == "tensor" else scale
    # magnitude 300 * scale puts ~15% of the values past 448 * scale (clamped) and some subnormal.
    kv_c, k_pe = make_rows(T, c, r, dtype, "cpu", extra=5, magnitude=300.0 * float(scale))
    cache = make_cache(6, block_size, c + r, FP8, "cpu")
    slots = make_slots(T, 6 * block_size, "cpu")
    ours, ref = run_both(kv_c, k_pe, cache, slots, kv_cache_dtype=name, scale=scale)
    assert_bitwise_equal(ours, ref)
    check_fp8_error(kv_c, k_pe, ours, slots, scale)


def test_fp8_e4m3_stores_every_nan_as_0x7f(ext):
    """A NaN input, whatever its sign, is written as e4m3's positive quiet NaN by every writer
    (the CUDA conversion makes 0x7F of any NaN; torch's cast on the CPU would keep the sign)."""
    kv_c, k_pe = make_rows(6, 8, 4, torch.float32, "cpu")
    kv_c[1, 2], k_pe[3, 0] = -math.nan, math.nan
    cache = make_cache(2, 4, 12, FP8, "cpu")
    ours, ref = run_both(kv_c, k_pe, cache, torch.arange(6), kv_cache_dtype="fp8_e4m3", scale=0.5)
    assert_bitwise_equal(ours, ref)
    assert ours.view(torch.uint8)[0, 1, 2] == ours.view(torch.uint8)[0, 3, 8] == 0x7F


def test_cpu_empty_and_all_skipped(ext):
    kv_c, k_pe = make_rows(5, 8, 4, torch.bfloat16, "cpu")
    cache = make_cache(2, 4, 12, torch.bfloat16, "cpu")
    before = cache.clone()
    concat_and_cache(kv_c[:0], k_pe[:0], cache, torch.empty(0, dtype=torch.int64),
                     backend="extension")
    concat_and_cache(kv_c, k_pe, cache, torch.full((5,), -1), backend="extension")
    assert_bitwise_equal(cache, before)


# ----------------------------------------------------------------------------------------------
# bad input: a clear error, and the cache untouched


def _bad_cases():
    """(name, change to the good call, exception, message regex)."""
    f8 = dict(kv_cache_dtype="fp8", scale=0.5)

    def fp8_cache(a):
        a["kv_cache"] = torch.zeros(a["kv_cache"].shape, dtype=FP8)

    return [
        ("kv_c 3-D", lambda a: a.update(kv_c=a["kv_c"][None]), ValueError,
         r"kv_c must be \(T, c\)"),
        ("k_pe 1-D", lambda a: a.update(k_pe=a["k_pe"][0]), ValueError, r"k_pe must be \(T, r\)"),
        ("k_pe rows", lambda a: a.update(k_pe=a["k_pe"][:-1]), ValueError, r"k_pe must have T = 6"),
        ("cache 2-D", lambda a: a.update(kv_cache=a["kv_cache"][0]), ValueError,
         r"kv_cache must be \(num_blocks, block_size, width\)"),
        ("cache width", lambda a: a.update(kv_cache=a["kv_cache"][..., :-1].contiguous()),
         ValueError, r"kv_cache last dim must be c \+ r = 8 \+ 4 = 12"),
        ("slots length", lambda a: a.update(slot_mapping=a["slot_mapping"][:-1]), ValueError,
         r"slot_mapping must be \(T,\) = \(6,\)"),
        ("slots int32", lambda a: a.update(slot_mapping=a["slot_mapping"].int()), TypeError,
         r"slot_mapping must be torch.int64"),
        ("kv_c float64", lambda a: a.update(kv_c=a["kv_c"].double(), k_pe=a["k_pe"].double()),
         TypeError, r"kv_c must be bfloat16, float16 or float32"),
        ("k_pe dtype", lambda a: a.update(k_pe=a["k_pe"].half()), TypeError,
         r"k_pe must have kv_c's dtype torch.float32"),
        ("cache dtype", lambda a: a.update(kv_cache=a["kv_cache"].half()), TypeError,
         r"kv_cache must have the inputs' dtype torch.float32"),
        ("fp8 cache, auto", fp8_cache, TypeError, r"pass kv_cache_dtype='fp8_e4m3'"),
        ("uint8 cache, auto", lambda a: a.update(kv_cache=a["kv_cache"].view(torch.uint8)[..., :12]
                                                 .contiguous()),
         TypeError, r"pass kv_cache_dtype='fp8_ds_mla'"),
        ("fp8, bf16 cache", lambda a: a.update(**f8), TypeError,
         r"kv_cache must be torch.float8_e4m3fn for kv_cache_dtype='fp8'"),
        ("fp8 no scale", lambda a: (fp8_cache(a), a.update(kv_cache_dtype="fp8_e4m3")), ValueError,
         r"scale is required for kv_cache_dtype='fp8_e4m3'"),
        ("fp8 scale 0", lambda a: (fp8_cache(a), a.update(f8, scale=0.0)), ValueError,
         r"concat_and_cache: scale must be positive and finite, at least 2\^-126 \(the smallest "
         r"normal float32\), got 0.0"),
        ("fp8 scale subnormal", lambda a: (fp8_cache(a), a.update(f8, scale=1e-40)), ValueError,
         r"scale must be positive and finite, at least 2\^-126"),
        ("fp8 scale -1", lambda a: (fp8_cache(a), a.update(f8, scale=-1.0)), ValueError,
         r"scale must be positive and finite"),
        ("fp8 scale inf", lambda a: (fp8_cache(a), a.update(f8, scale=math.inf)), ValueError,
         r"scale must be positive and finite"),
        ("fp8 scale nan", lambda a: (fp8_cache(a), a.update(f8, scale=torch.tensor([math.nan]))),
         ValueError, r"scale must be positive and finite"),
        ("fp8 scale 2 elems", lambda a: (fp8_cache(a), a.update(f8, scale=torch.ones(2))),
         TypeError, r"scale must be a float or a 1-element float32 tensor"),
        ("fp8 scale float64", lambda a: (fp8_cache(a), a.update(f8, scale=torch.ones(1).double())),
         TypeError, r"scale must be a float or a 1-element float32 tensor"),
        ("fp8 scale str", lambda a: (fp8_cache(a), a.update(f8, scale="1")), TypeError,
         r"scale must be a float"),
        ("unknown dtype", lambda a: a.update(kv_cache_dtype="int8"), ValueError,
         r"kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_ds_mla', got 'int8'"),
        ("fp8 without float8", lambda a: (fp8_cache(a), a.update(f8), a.update(no_fp8=True)),
         RuntimeError, r"kv_cache_dtype='fp8' needs torch.float8_e4m3fn"),
        ("slot too big", lambda a: a["slot_mapping"].__setitem__(2, 24), ValueError,
         r"slot_mapping values must lie in \[-1, num_blocks \* block_size = 24\), got 24"),
        ("slot -2", lambda a: a["slot_mapping"].__setitem__(4, -2), ValueError,
         r"slot_mapping values must lie in \[-1, .*got -2"),
        ("kv_c strided last dim", lambda a: a.update(kv_c=torch.randn(6, 16)[:, ::2]), ValueError,
         r"kv_c last dim must be contiguous \(stride\(-1\) == 1\)"),
        ("k_pe strided last dim", lambda a: a.update(k_pe=torch.randn(6, 8)[:, ::2]), ValueError,
         r"k_pe last dim must be contiguous"),
        ("cache not contiguous", lambda a: a.update(kv_cache=torch.zeros(4, 4, 12)[::2]),
         ValueError, r"kv_cache must be contiguous"),
        ("kv_c on meta", lambda a: a.update(kv_c=a["kv_c"].to("meta")), ValueError,
         r"kv_c is on meta, kv_cache on cpu"),
        ("slots not a tensor", lambda a: a.update(slot_mapping=[0, 1, 2, 3, 4, 5]), TypeError,
         r"slot_mapping must be a torch.Tensor"),
    ]


BAD = _bad_cases()


def assert_refused(args, exc, match, backend, monkeypatch):
    """concat_and_cache(**args) raises exc matching `match` and leaves the cache as it was."""
    if args.pop("no_fp8", False):
        monkeypatch.setattr(fp8, "fp8_available", lambda: False)
    before = args["kv_cache"].clone()
    with pytest.raises(exc, match=match):
        concat_and_cache(args["kv_c"], args["k_pe"], args["kv_cache"], args["slot_mapping"],
                         kv_cache_dtype=args["kv_cache_dtype"], scale=args["scale"],
                         backend=backend)
    assert_bitwise_equal(args["kv_cache"], before)


@pytest.mark.parametrize("backend", ["extension", "reference"])
@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_and_leaves_cache_unchanged(ext, backend, case, monkeypatch):
    _, change, exc, match = case
    kv_c, k_pe = make_rows(6, 8, 4, torch.float32, "cpu", extra=2)
    args = dict(kv_c=kv_c, k_pe=k_pe, kv_cache=make_cache(3, 8, 12, torch.float32, "cpu"),
                slot_mapping=make_slots(6, 24, "cpu", skip_every=0), kv_cache_dtype="auto",
                scale=None)
    change(args)
    assert_refused(args, exc, match, backend, monkeypatch)


def test_bad_backend_name():
    kv_c, k_pe = make_rows(2, 8, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="backend must be None, 'extension' or 'reference'"):
        concat_and_cache(kv_c, k_pe, torch.zeros(1, 2, 12), torch.zeros(2, dtype=torch.long),
                         backend="triton")


def _op(kv_c, k_pe, cache, slots, kv_cache_dtype="auto", scale=None):
    torch.ops.mla.concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_cache_dtype, scale)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(slots=torch.tensor([0, 1, 99])), r"slot_mapping\[2\] = 99 is outside"),
        (lambda a: a.update(slots=torch.tensor([0, -3, 1])), r"slot_mapping\[1\] = -3 is outside"),
        (lambda a: a.update(k_pe=a["k_pe"].half()), r"k_pe dtype Half differs"),
        (lambda a: a.update(cache=a["cache"].half()), r"kv_cache dtype Half must equal"),
        (lambda a: a.update(cache=a["cache"][..., :-1].contiguous()), r"kv_cache last dim must be"),
        (lambda a: a.update(kv_cache_dtype="int4"), r"unknown kv_cache_dtype 'int4'"),
        (lambda a: a.update(cache=a["cache"].view(torch.uint8)[..., :12].contiguous(),
                            kv_cache_dtype="fp8_ds_mla"), r"c must be a positive multiple of 128"),
        (lambda a: a.update(cache=a["cache"].to(FP8), kv_cache_dtype="fp8"), r"scale is required"),
        (lambda a: a.update(cache=a["cache"].to(FP8), kv_cache_dtype="fp8",
                            scale=torch.tensor([-1.0])), r"scale must be positive and finite"),
        (lambda a: a.update(cache=a["cache"].to(FP8), kv_cache_dtype="fp8",
                            scale=torch.tensor([1e-40])), r"scale must be positive and finite, at least 2\^-126"),
        (lambda a: a.update(kv_c=torch.randn(3, 16)[:, ::2]), r"kv_c last dim must be contiguous"),
    ],
)
def test_cpp_checks_defend_direct_callers(ext, change, match):
    """torch.ops.mla.concat_and_cache_mla checks its arguments too (the wrapper is skippable)."""
    kv_c, k_pe = make_rows(3, 8, 4, torch.float32, "cpu")
    a = dict(kv_c=kv_c, k_pe=k_pe, cache=make_cache(2, 4, 12, torch.float32, "cpu"),
             slots=torch.tensor([0, 5, 7]), kv_cache_dtype="auto", scale=None)
    change(a)
    before = a["cache"].clone()
    with pytest.raises(RuntimeError, match=match):
        _op(a["kv_c"], a["k_pe"], a["cache"], a["slots"], a["kv_cache_dtype"], a["scale"])
    assert_bitwise_equal(a["cache"], before)


# ----------------------------------------------------------------------------------------------
# fp8_ds_mla: FlashMLA's 656-byte token (mla.kernels.fp8 is its spec; tests/test_fp8.py checks
# that against a float64 spelling of the layout)

DS = dict(kv_cache_dtype="fp8_ds_mla")


def ds_width(c, r):
    return c + 4 * (c // 128) + 2 * r


def make_ds_rows(T, c, r, dtype, device, *, extra=0, nonfinite=False, seed=0):
    """Latent rows of very different sizes with a zero group, a -0 group, a group across e4m3's
    subnormals and (nonfinite=True) a NaN and an inf, as row views of one projection output."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(T, c + r + extra, generator=g) * torch.logspace(-4, 3, T)[:, None]
    # rows 1-4, 6, 7: make_slots skips every 5th token from 0
    proj[1 % T, :128] = 0.0
    proj[2 % T, :128] = -0.0
    proj[3 % T, :128] = torch.logspace(-14, 1, 128) * torch.sign(torch.randn(128, generator=g))
    if nonfinite:
        proj[4 % T, 5], proj[6 % T, c - 1], proj[7 % T, c + 1] = math.nan, -math.inf, math.nan
    proj = proj.to(dtype).to(device)
    return proj[:, :c], proj[:, c: c + r]


def assert_unwritten_rows_untouched(ours, before, slots):
    """Rows whose slot no token names keep every byte (NaN poison included)."""
    written = torch.zeros(ours.shape[0] * ours.shape[1], dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    flat_ours = bits(ours).reshape(written.numel(), -1).cpu()
    flat_before = bits(before).reshape(written.numel(), -1).cpu()
    assert torch.equal(flat_ours[~written], flat_before[~written])
    assert not torch.equal(flat_ours[written], flat_before[written])


def test_reference_ds_mla_matches_the_loop():
    c, r, block_size = 256, 8, 4
    kv_c, k_pe = make_ds_rows(9, c, r, torch.float32, "cpu", extra=3)
    cache = make_cache(3, block_size, ds_width(c, r), torch.uint8, "cpu")
    slots = make_slots(9, 12, "cpu", skip_every=4)
    want = cache.clone()
    concat_and_cache_reference(kv_c, k_pe, cache, slots, **DS)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[slot // block_size, slot % block_size] = fp8.quantize_ds_mla(kv_c[i:i + 1],
                                                                               k_pe[i:i + 1])[0]
    assert_bitwise_equal(cache, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 64])
# 656 bytes a row (V3); c = 1152 sweeps 512 values twice and then 128; r = 3 makes rows of 135
# bytes, so scales sit off 4-byte boundaries; r = 130: rope values past those read before the slot
@pytest.mark.parametrize("c,r,extra", [(512, 64, 0), (512, 64, 7), (1152, 64, 0), (128, 3, 1), (256, 130, 0)])
def test_cpu_ds_mla_matches_reference(ext, dtype, block_size, c, r, extra):
    T = 37
    num_blocks = -(-2 * T // block_size)
    kv_c, k_pe = make_ds_rows(T, c, r, dtype, "cpu", extra=extra, nonfinite=True)
    cache = make_cache(num_blocks, block_size, ds_width(c, r), torch.uint8, "cpu")
    slots = make_slots(T, num_blocks * block_size, "cpu")
    ours, ref = run_both(kv_c, k_pe, cache, slots, **DS)
    assert_bitwise_equal(ours, ref)
    assert_unwritten_rows_untouched(ours, cache, slots)


def _ds_bad_cases():
    """(name, change to a good V3 call, exception, message regex)."""
    return [
        ("width 655", lambda a: a.update(kv_cache=torch.zeros(3, 8, 655, dtype=torch.uint8)),
         ValueError, r"kv_cache last dim must be c \+ 4\*c/128 \+ 2\*r = 512 \+ 16 \+ 128 = 656 "
                     r"bytes for kv_cache_dtype='fp8_ds_mla', got shape \(3, 8, 655\)"),
        ("width 657", lambda a: a.update(kv_cache=torch.zeros(3, 8, 657, dtype=torch.uint8)),
         ValueError, r"= 656 bytes .*got shape \(3, 8, 657\)"),
        ("width 576 fp8", lambda a: a.update(kv_cache=torch.zeros(3, 8, 576, dtype=FP8)),
         ValueError, r"656 bytes for kv_cache_dtype='fp8_ds_mla'"),
        ("int8 cache", lambda a: a.update(kv_cache=torch.zeros(3, 8, 656, dtype=torch.int8)),
         TypeError, r"kv_cache must be torch.uint8 for kv_cache_dtype='fp8_ds_mla', got "
                    r"torch.int8"),
        ("c = 500", lambda a: a.update(kv_c=a["kv_c"][:, :500]), ValueError,
         r"kv_c's last dim c must be a positive multiple of 128 .*got c = 500"),
        ("a scale", lambda a: a.update(scale=1.0), ValueError,
         r"scale must be None for kv_cache_dtype='fp8_ds_mla'"),
        ("slot too big", lambda a: a["slot_mapping"].__setitem__(1, 24), ValueError,
         r"slot_mapping values must lie in \[-1, num_blocks \* block_size = 24\), got 24"),
        ("no float8", lambda a: a.update(no_fp8=True), RuntimeError,
         r"kv_cache_dtype='fp8_ds_mla' needs torch.float8_e4m3fn"),
    ]


DS_BAD = _ds_bad_cases()


@pytest.mark.parametrize("backend", ["extension", "reference"])
@pytest.mark.parametrize("case", DS_BAD, ids=[b[0] for b in DS_BAD])
def test_ds_mla_bad_input_raises_and_leaves_cache_unchanged(ext, backend, case, monkeypatch):
    _, change, exc, match = case
    kv_c, k_pe = make_ds_rows(6, 512, 64, torch.bfloat16, "cpu")
    args = dict(kv_c=kv_c, k_pe=k_pe, kv_cache=make_cache(3, 8, 656, torch.uint8, "cpu"),
                slot_mapping=make_slots(6, 24, "cpu", skip_every=0), scale=None, **DS)
    change(args)
    assert_refused(args, exc, match, backend, monkeypatch)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(cache=torch.zeros(2, 4, 655, dtype=torch.uint8)),
         r"kv_cache last dim must be c \+ 4 c/128 \+ 2 r = 656 bytes .*got 655"),
        (lambda a: a.update(cache=torch.zeros(2, 4, 656, dtype=FP8)), r"kv_cache must be uint8"),
        (lambda a: a.update(scale=torch.ones(1)), r"scale must be None"),
        (lambda a: a.update(kv_c=a["kv_c"][:, :100].contiguous(),
                            cache=torch.zeros(2, 4, 228, dtype=torch.uint8)),
         r"multiple of 128 for kv_cache_dtype 'fp8_ds_mla', got 100"),
        (lambda a: a.update(slots=torch.tensor([0, 8, 1])), r"slot_mapping\[1\] = 8 is outside"),
    ],
)
def test_cpp_checks_ds_mla(ext, change, match):
    kv_c, k_pe = make_ds_rows(3, 512, 64, torch.bfloat16, "cpu")
    a = dict(kv_c=kv_c, k_pe=k_pe, cache=make_cache(2, 4, 656, torch.uint8, "cpu"),
             slots=torch.tensor([0, 5, 7]), scale=None)
    change(a)
    before = a["cache"].clone()
    with pytest.raises(RuntimeError, match=match):
        _op(a["kv_c"], a["k_pe"], a["cache"], a["slots"], "fp8_ds_mla", a["scale"])
    assert_bitwise_equal(a["cache"], before)


# ----------------------------------------------------------------------------------------------
# GPU: the CUDA kernel (vector and scalar paths) vs the reference run on the same GPU


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 64])
# extra 0 and 8 keep rows 16-byte aligned for 2-byte types (vector path); 7 and c=12 do not.
# The kernel's block is (vectors a row) x (rows): 72 x 4 at 576 bf16 values, 16 x 18 at c=12
# (scalar), 264 x 1 at c=2048, and 1024 x 1 in 3 blocks side by side at c=2048, extra=7 (2112
# scalar vectors, the third block mostly idle). T = 301 leaves the last row block part empty.
@pytest.mark.parametrize(
    "c,r,extra", [(512, 64, 0), (512, 64, 8), (512, 64, 7), (12, 4, 0), (2048, 64, 0), (2048, 64, 7)]
)
def test_cuda_matches_reference(ext, dtype, block_size, c, r, extra):
    T = 301
    num_blocks = -(-2 * T // block_size)
    kv_c, k_pe = make_rows(T, c, r, dtype, "cuda", extra=extra)
    cache = make_cache(num_blocks, block_size, c + r, dtype, "cuda")
    slots = make_slots(T, num_blocks * block_size, "cuda")
    ours, ref = run_both(kv_c, k_pe, cache, slots)
    assert_bitwise_equal(ours, ref)
    # and the same bits as the CPU twin
    ours_cpu = cache.cpu()
    concat_and_cache(kv_c.cpu(), k_pe.cpu(), ours_cpu, slots.cpu(), backend="extension")
    assert_bitwise_equal(ours.cpu(), ours_cpu)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.5, 3.0, "tensor"])
@pytest.mark.parametrize("extra", [0, 7])
def test_cuda_fp8_matches_reference(ext, dtype, scale, extra):
    T, c, r, block_size = 300, 512, 64, 64
    scale = torch.tensor([0.75], device="cuda") if scale == "tensor" else scale
    kv_c, k_pe = make_rows(T, c, r, dtype, "cuda", extra=extra, magnitude=300.0 * float(scale))
    cache = make_cache(10, block_size, c + r, FP8, "cuda")
    slots = make_slots(T, 10 * block_size, "cuda")
    ours, ref = run_both(kv_c, k_pe, cache, slots, kv_cache_dtype="fp8", scale=scale)
    assert_bitwise_equal(ours, ref)
    check_fp8_error(kv_c, k_pe, ours, slots, scale)
    ref_cpu = cache.cpu()
    concat_and_cache_reference(kv_c.cpu(), k_pe.cpu(), ref_cpu, slots.cpu(),
                               kv_cache_dtype="fp8", scale=float(scale))
    assert_bitwise_equal(ours.cpu(), ref_cpu)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("kv_cache_dtype,width,make", [("auto", 576, make_rows),
                                                       ("fp8_ds_mla", 656, make_ds_rows)])
def test_cuda_kernel_skips_out_of_range_slots(ext, kv_cache_dtype, width, make):
    """A direct op call with a bad slot must not write out of bounds (the wrapper rejects it)."""
    kv_c, k_pe = make(4, 512, 64, torch.bfloat16, "cuda")
    cache = make_cache(2, 16, width, kv_c.dtype if width == 576 else torch.uint8, "cuda")
    slots = torch.tensor([3, 32, 1 << 40, 7], device="cuda")
    want = cache.clone()
    concat_and_cache_reference(kv_c[[0, 3]], k_pe[[0, 3]], want, slots[[0, 3]],
                               kv_cache_dtype=kv_cache_dtype)
    _op(kv_c, k_pe, cache, slots, kv_cache_dtype)
    torch.cuda.synchronize()
    assert_bitwise_equal(cache, want)


@pytest.mark.gpu
@requires_gpu
def test_cuda_empty_and_all_skipped(ext):
    kv_c, k_pe = make_rows(5, 512, 64, torch.bfloat16, "cuda")
    cache = make_cache(2, 4, 576, torch.bfloat16, "cuda")
    before = cache.clone()
    concat_and_cache(kv_c[:0], k_pe[:0], cache, torch.empty(0, dtype=torch.int64, device="cuda"))
    concat_and_cache(kv_c, k_pe, cache, torch.full((5,), -1, device="cuda"))
    assert_bitwise_equal(cache, before)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 64])
# (512, 64, 0): 16-byte loads and stores; extra 7: scalar loads; c = 1152: a sweep with idle
# lanes; r = 3: 135-byte rows, byte stores; r = 130: the rope values past the first 64, read after
# the slot test
@pytest.mark.parametrize("c,r,extra", [(512, 64, 0), (512, 64, 7), (1152, 64, 8), (128, 3, 0), (256, 130, 0)])
def test_cuda_ds_mla_matches_reference(ext, dtype, block_size, c, r, extra):
    """Every NaN is written as its format's positive quiet NaN, so NaN and inf inputs compare
    bit for bit too."""
    T = 301
    num_blocks = -(-2 * T // block_size)
    kv_c, k_pe = make_ds_rows(T, c, r, dtype, "cuda", extra=extra, nonfinite=True)
    cache = make_cache(num_blocks, block_size, ds_width(c, r), torch.uint8, "cuda")
    slots = make_slots(T, num_blocks * block_size, "cuda")
    ours, ref = run_both(kv_c, k_pe, cache, slots, **DS)
    assert_bitwise_equal(ours, ref)
    assert_unwritten_rows_untouched(ours, cache, slots)
    ours_cpu = cache.cpu()
    concat_and_cache(kv_c.cpu(), k_pe.cpu(), ours_cpu, slots.cpu(), backend="extension", **DS)
    assert_bitwise_equal(ours.cpu(), ours_cpu)


@pytest.mark.gpu
@pytest.mark.slow
@requires_gpu
def test_cuda_cache_past_2_pow_32_elements(ext):
    """Offsets past int32 and uint32: bf16, block 64, width 576, 4.3e9 elements (8.6 GB x 2)."""
    block_size, c, r = 64, 512, 64
    num_blocks = 2**32 // (block_size * (c + r)) + 8  # 116_516 blocks, 2^32 + 2.4e5 elements
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs 24 GiB of GPU memory")
    num_slots = num_blocks * block_size
    cache = torch.zeros(num_blocks, block_size, c + r, dtype=torch.bfloat16, device="cuda")
    assert cache.numel() > 2**32
    T = 256
    kv_c, k_pe = make_rows(T, c, r, torch.bfloat16, "cuda", extra=0)
    first_past_int32 = 2**31 // (c + r) + 1  # the first slot whose row starts past 2^31
    slots = torch.cat([
        torch.arange(num_slots - 100, num_slots),                         # the very end
        torch.arange(first_past_int32 - 50, first_past_int32 + 50),       # across 2^31
        torch.arange(2**32 // (c + r) - 28, 2**32 // (c + r) + 28),       # across 2^32
    ]).cuda()
    assert slots.numel() == T
    ref = cache.clone()
    concat_and_cache(kv_c, k_pe, cache, slots, backend="extension")
    concat_and_cache_reference(kv_c, k_pe, ref, slots)
    assert torch.equal(bits(cache), bits(ref))
    assert torch.equal(cache.view(-1, c + r)[slots], torch.cat([kv_c, k_pe], -1))


# ----------------------------------------------------------------------------------------------
# Every conversion input: all bf16 and fp16 bit patterns, and the float32 values where e4m3
# rounding turns (ties, the 448-480 saturation edge, subnormals, NaN payloads and signs, inf),
# through each writer bit for bit against the reference. On a GPU this pins the e4m3 conversion
# instruction (cvt.rn.satfinite on sm_89+, software before) to torch's cast; the cache is also
# written through a view 1 byte off its storage, so the kernels take their unaligned paths.


def _as_rows(values: torch.Tensor, width: int) -> torch.Tensor:
    """values -> (T, width), zero padded."""
    T = -(-values.numel() // width)
    return torch.cat([values, values.new_zeros(T * width - values.numel())]).reshape(T, width)


def _ds_mla_sweep_rows(values: torch.Tensor, c: int, r: int, seed: int = 0):
    """kv_c, k_pe rows for fp8_ds_mla: first groups of 127 finite values |x| <= 448 led by 448
    (scale exactly 1, so each value meets the e4m3 rounding as it is), a group led by inf, then
    every value in its order and shuffled, 128 to a group (NaN, inf and huge values setting their
    group's scale)."""
    finite = values[values.float().abs() <= 448]
    anchored = _as_rows(finite, 127)
    anchored = torch.cat([anchored.new_full((anchored.shape[0], 1), 448.0), anchored], dim=1).reshape(-1)
    inf_group = torch.cat([finite.new_full((1,), math.inf), finite[:127]])  # scale inf: zeros, NaN
    perm = torch.randperm(values.numel(), generator=torch.Generator().manual_seed(seed))
    kv_c = _as_rows(torch.cat([anchored, inf_group, _as_rows(values, 128).reshape(-1),
                               _as_rows(values[perm], 128).reshape(-1)]), c)
    k_pe = _as_rows(torch.cat([values, values[perm]]), r)[: kv_c.shape[0]]
    k_pe = torch.cat([k_pe, k_pe.new_zeros(kv_c.shape[0] - k_pe.shape[0], r)])  # (T, r)
    return kv_c, k_pe


def _offset_cache(num_slots: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A contiguous (num_slots, 1, width) cache whose data starts 1 byte into its storage,
    filled with random bytes."""
    g = torch.Generator().manual_seed(5)
    storage = torch.randint(0, 256, (num_slots * width + 16,), generator=g, dtype=torch.uint8).to(device)
    return storage[1: 1 + num_slots * width].view(dtype).view(num_slots, 1, width)


def _check_sweep(kv_c, k_pe, width, cache_dtype, device, **kw):
    T = kv_c.shape[0]
    slots = torch.arange(T, device=device)
    slots[3] = -1  # a skipped token keeps its row's random bytes
    for cache in (make_cache(T, 1, width, cache_dtype, device), _offset_cache(T, width, cache_dtype, device)):
        ours, ref = cache.clone(), cache.clone()
        concat_and_cache(kv_c.to(device), k_pe.to(device), ours, slots, backend="extension", **kw)
        concat_and_cache_reference(kv_c.to(device), k_pe.to(device), ref, slots, **kw)
        assert_bitwise_equal(ours, ref)
        assert torch.equal(bits(ours[3]), bits(cache[3]))
        if device != "cpu":  # and the C++ twin writes the same bytes
            twin = cache.cpu()
            cpu_kw = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            concat_and_cache(kv_c, k_pe, twin, slots.cpu(), backend="extension", **cpu_kw)
            assert_bitwise_equal(ours.cpu(), twin)
    return ours


SWEEP_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_gpu])]


@pytest.mark.parametrize("device", SWEEP_DEVICES)
@pytest.mark.parametrize("scale", [1.0, 0.3, 2.0**-12, 2.0**-100, 0.7 * 2.0**-64, 2.0**-64, 2.0**126, 2.0**127])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_e4m3_every_input_bit_for_bit(ext, device, dtype, scale):
    """1: each value meets the e4m3 rounding as it is; 0.3: an IEEE quotient first; 2^-12: most
    values past 448 (saturated) and fp16's subnormals in e4m3's range. The CUDA writer divides by
    a reciprocal for scales in [2^-64, 2^126] and by IEEE division outside: 2^-64 and 2^126 are
    the edges of the one, 2^-100, 0.7 x 2^-64 and 2^127 inside the other."""
    rows = _as_rows(sweep_values(dtype), 512 + 64)
    ours = _check_sweep(rows[:, :512], rows[:, 512:], 576, FP8, device, kv_cache_dtype="fp8_e4m3",
                        scale=torch.tensor([scale], device=device))
    stored = torch.cat([bits(ours[:3]), bits(ours[4:])]).reshape(-1).cpu()  # row 3 is skipped
    assert (stored == 0x7F).any() and not (stored == 0xFF).any()  # NaN, always positive
    assert (stored == 0x7E).any() and (stored == 0xFE).any()  # +-448: saturated, never NaN


@pytest.mark.parametrize("device", SWEEP_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_ds_mla_every_input_bit_for_bit(ext, device, dtype):
    kv_c, k_pe = _ds_mla_sweep_rows(sweep_values(dtype), 512, 64)
    ours = _check_sweep(kv_c, k_pe, 656, torch.uint8, device, kv_cache_dtype="fp8_ds_mla")
    scales = ours[:, 0, 512:528].contiguous().view(torch.float32).cpu()
    assert (scales == 1.0).any() and scales.isnan().any() and scales.isinf().any()
