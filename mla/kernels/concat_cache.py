"""concat_and_cache: write the new tokens' latent rows ``[kv_c | k_pe]`` into the paged cache.

The paged tier keeps one cache row of ``c + r`` values per token (the normed latent ``kv_c``,
then the rotated rope key ``k_pe``; 512 + 64 = 576 for DeepSeek-V2/V3). Blocks of
``block_size`` rows make a page; a token's *slot* is ``block * block_size + offset``::

    for every token i with slot = slot_mapping[i] >= 0:
        kv_cache[slot // block_size, slot % block_size, :c] = q(kv_c[i])    # (c,)
        kv_cache[slot // block_size, slot % block_size, c:] = q(k_pe[i])    # (r,)

``q`` is the identity for ``kv_cache_dtype="auto"`` (the cache has the inputs' dtype) and
``e4m3(clamp(x / scale, -448, 448))`` for ``"fp8"`` / ``"fp8_e4m3"`` (a ``float8_e4m3fn``
cache; read back as ``x ~= cache.float() * scale``). Slot -1 skips the token (padding).

Three implementations of the same op:

- ``concat_and_cache_reference``: plain torch (``index_put_`` on the flattened cache); the spec.
- the CUDA kernel ``csrc/concat_and_cache_mla.cu``, one thread per 16-byte vector;
- its C++ CPU twin ``csrc/concat_and_cache_mla_cpu.cpp``, so that CI runs the extension path.

The two compiled ones form one extension (op ``torch.ops.mla.concat_and_cache_mla``) that is
built by JIT on first use, cached on disk by torch (``TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``) and loaded once per process. If no compiler is available or the
build fails, ``concat_and_cache`` falls back to the reference with one warning. A CUDA build
also holds the decode stage 1 of ``csrc/mla_decode_sm80.cu`` (op ``torch.ops.mla.mla_decode_sm80``),
which ``mla.kernels.mla_decode`` uses for few heads, and on an H100 / H200 the wgmma one of
``csrc/mla_decode_sm90.cu`` (op ``torch.ops.mla.mla_decode_sm90``) for more.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from pathlib import Path

import torch

__all__ = [
    "concat_and_cache",
    "concat_and_cache_reference",
    "load_extension",
    "active_backend",
]

_CSRC = Path(__file__).resolve().parents[2] / "csrc"
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_NAMES = ("fp8", "fp8_e4m3")
_FP8_MAX = 448.0  # largest finite float8_e4m3fn

# The extension, loaded at most once per process: None = not tried yet.
_ext_state: dict | None = None


# ----------------------------------------------------------------------------------------------
# Building and loading the extension


def _cuda_build_possible() -> bool:
    """CUDA sources are compiled only with a visible GPU, a CUDA torch and nvcc on the path."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = Path(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
    return (nvcc is not None and nvcc.exists()) or shutil.which("nvcc") is not None


def _cuda_arch_flags() -> list[str]:
    """Code for this device only: sm_90a on an H100/H200 (wgmma, for mla_decode_sm90), else the
    device's own capability."""
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def load_extension() -> dict:
    """Build (first time on this machine) and load the extension; at most once per process.

    Returns a dict: ``loaded`` (bool), ``cuda`` (whether the CUDA concat kernel is in it),
    ``decode`` (whether the CUDA decode stage 1 is: built for GPUs of compute capability >= 8.0),
    ``decode_sm90`` (whether the wgmma one is: built for compute capability 9.0, as sm_90a),
    ``error`` (why not, when not loaded). Never raises: a failed build is reported once by
    ``concat_and_cache`` and the reference is used instead.
    """
    global _ext_state
    if _ext_state is not None:
        return _ext_state
    try:
        from torch.utils.cpp_extension import is_ninja_available, load

        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            raise RuntimeError(f"no C++ compiler ({cxx!r} not found)")
        if not is_ninja_available():
            raise RuntimeError("ninja is not installed")
        with_cuda = _cuda_build_possible()
        # the decode stage 1 uses sm_80 instructions (mma.sync on bf16, cp.async)
        with_decode = with_cuda and torch.cuda.get_device_capability() >= (8, 0)
        # and the wgmma one is Hopper's (sm_90a)
        with_sm90 = with_cuda and torch.cuda.get_device_capability() == (9, 0)
        sources = [_CSRC / "binding.cpp", _CSRC / "concat_and_cache_mla_cpu.cpp"]
        if with_cuda:
            sources.append(_CSRC / "concat_and_cache_mla.cu")
        if with_decode:
            sources.append(_CSRC / "mla_decode_sm80.cu")
        if with_sm90:
            sources.append(_CSRC / "mla_decode_sm90.cu")
        load(
            # Different names keep the CPU-only and the CUDA builds apart in the cache dir.
            name="mla_C_cuda" if with_cuda else "mla_C_cpu",
            sources=[str(s) for s in sources],
            extra_include_paths=[str(_CSRC)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=(["-O3", *_cuda_arch_flags()] if with_cuda else None),
            is_python_module=False,  # the library registers torch.ops.mla.* when loaded
            verbose=False,
        )
        _ext_state = {"loaded": True, "cuda": with_cuda, "decode": with_decode, "decode_sm90": with_sm90,
                      "error": None}
    except Exception as exc:  # noqa: BLE001 - any failure means "use the reference"
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        error = f"{type(exc).__name__}: {first_line}"
        _ext_state = {"loaded": False, "cuda": False, "decode": False, "decode_sm90": False, "error": error}
    return _ext_state


def _extension_serves(device: torch.device) -> bool:
    state = load_extension()
    return state["loaded"] and (device.type == "cpu" or (device.type == "cuda" and state["cuda"]))


def active_backend(device: torch.device | str = "cpu") -> str:
    """``"extension"`` or ``"reference"``: what ``concat_and_cache`` uses by default on ``device``.

    Builds and loads the extension if that has not happened yet in this process.
    """
    return "extension" if _extension_serves(torch.device(device)) else "reference"


_warned_fallback = False


def _warn_fallback_once(device: torch.device) -> None:
    global _warned_fallback
    if _warned_fallback:
        return
    _warned_fallback = True
    state = load_extension()
    why = state["error"] or f"the extension was built without a {device.type} kernel"
    warnings.warn(
        f"mla.kernels.concat_and_cache: using the torch reference on {device.type} ({why})",
        RuntimeWarning,
        stacklevel=3,
    )


# ----------------------------------------------------------------------------------------------
# Validation (shared by every backend, before anything is written)


def _fp8_cache(kv_cache_dtype: str) -> bool:
    if kv_cache_dtype == "auto":
        return False
    if kv_cache_dtype in _FP8_NAMES:
        return True
    raise ValueError(
        f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {kv_cache_dtype!r}"
    )


def _validate(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale) -> torch.Tensor | None:
    """Check every argument; return the fp8 scale as a (1,) float32 tensor on the cache's device
    (None for "auto"). Raises ValueError / TypeError naming the argument and what was expected."""
    fp8 = _fp8_cache(kv_cache_dtype)
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache),
                    ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")

    # ---- shapes
    if kv_c.dim() != 2:
        raise ValueError(f"kv_c must be (T, c), got shape {tuple(kv_c.shape)}")
    if k_pe.dim() != 2:
        raise ValueError(f"k_pe must be (T, r), got shape {tuple(k_pe.shape)}")
    T, c = kv_c.shape
    r = k_pe.shape[1]
    if k_pe.shape[0] != T:
        raise ValueError(f"k_pe must have T = {T} rows like kv_c, got shape {tuple(k_pe.shape)}")
    if kv_cache.dim() != 3:
        raise ValueError(
            f"kv_cache must be (num_blocks, block_size, c + r), got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[2] != c + r:
        raise ValueError(
            f"kv_cache last dim must be c + r = {c} + {r} = {c + r}, got shape "
            f"{tuple(kv_cache.shape)}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != T:
        raise ValueError(
            f"slot_mapping must be (T,) = ({T},), got shape {tuple(slot_mapping.shape)}"
        )

    # ---- dtypes
    if kv_c.dtype not in _INPUT_DTYPES:
        raise TypeError(f"kv_c must be bfloat16, float16 or float32, got {kv_c.dtype}")
    if k_pe.dtype != kv_c.dtype:
        raise TypeError(f"k_pe must have kv_c's dtype {kv_c.dtype}, got {k_pe.dtype}")
    if fp8 and kv_cache.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"kv_cache must be torch.float8_e4m3fn for kv_cache_dtype={kv_cache_dtype!r}, "
            f"got {kv_cache.dtype}"
        )
    if not fp8 and kv_cache.dtype != kv_c.dtype:
        raise TypeError(
            f"kv_cache must have the inputs' dtype {kv_c.dtype} for kv_cache_dtype='auto', got "
            f"{kv_cache.dtype}" + (" (pass kv_cache_dtype='fp8')"
                                   if kv_cache.dtype == torch.float8_e4m3fn else "")
        )
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be torch.int64, got {slot_mapping.dtype}")

    # ---- devices and layout
    device = kv_cache.device
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe), ("slot_mapping", slot_mapping)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, kv_cache on {device}: use one device")
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(
                f"{name} last dim must be contiguous (stride(-1) == 1), got strides {t.stride()}"
            )
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous, got strides {kv_cache.stride()}")

    # ---- fp8 scale
    scale_t = None
    if fp8:
        if scale is None:
            raise ValueError(f"scale is required for kv_cache_dtype={kv_cache_dtype!r}")
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1 or scale.dtype != torch.float32:
                raise TypeError(
                    f"scale must be a float or a 1-element float32 tensor, got a tensor of shape "
                    f"{tuple(scale.shape)} and dtype {scale.dtype}"
                )
            scale_t = scale.reshape(1).to(device)
        elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
            scale_t = torch.tensor([float(scale)], dtype=torch.float32, device=device)
        else:
            raise TypeError(f"scale must be a float or a 1-element float32 tensor, got {scale!r}")
        s = scale_t.item()  # a device sync on GPU
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"scale must be positive and finite, got {s}")

    # ---- slot values (a device sync on GPU)
    if T > 0:
        lo, hi = (v.item() for v in torch.aminmax(slot_mapping))
        num_slots = kv_cache.shape[0] * kv_cache.shape[1]
        if lo < -1 or hi >= num_slots:
            bad = lo if lo < -1 else hi
            raise ValueError(
                f"slot_mapping values must lie in [-1, num_blocks * block_size = {num_slots}), "
                f"got {bad}"
            )
    return scale_t


# ----------------------------------------------------------------------------------------------
# The op


def concat_and_cache_reference(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_cache_dtype: str = "auto",
    scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The spec in plain torch: same arguments and result as ``concat_and_cache``."""
    scale_t = _validate(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)
    rows = torch.cat([kv_c, k_pe], dim=-1)  # (T, c + r)
    flat = kv_cache.view(-1, kv_cache.shape[-1])  # (num_blocks * block_size, c + r)
    if scale_t is not None:
        # Divide by a tensor (never a Python scalar: CUDA would multiply by the reciprocal).
        rows = (rows.float() / scale_t).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        rows, flat = rows.view(torch.uint8), flat.view(torch.uint8)  # index_put_ on the bytes
    keep = slot_mapping >= 0  # (T,)
    flat.index_put_((slot_mapping[keep],), rows[keep])
    return kv_cache


def concat_and_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_cache_dtype: str = "auto",
    scale: float | torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Write each token's ``[kv_c | k_pe]`` row into its slot of the paged cache, in place.

    Args:
        kv_c: (T, c) bf16 / fp16 / fp32, the normed latent; any row stride, last dim contiguous
            (usually ``proj[:, :c]`` of the ``kv_a_proj_with_mqa`` output ``proj`` (T, c + r)).
        k_pe: (T, r), kv_c's dtype, the rotated rope key; any row stride, last dim contiguous.
        kv_cache: (num_blocks, block_size, c + r), contiguous; kv_c's dtype for
            ``kv_cache_dtype="auto"``, ``torch.float8_e4m3fn`` for ``"fp8"`` / ``"fp8_e4m3"``.
        slot_mapping: (T,) int64, ``block * block_size + offset`` per token; -1 skips it.
        kv_cache_dtype: ``"auto"`` (store as is) or ``"fp8"`` / ``"fp8_e4m3"`` (store
            ``e4m3(clamp(x / scale, -448, 448))``).
        scale: fp8 only (ignored for "auto"): a positive float or a 1-element float32 tensor.
        backend: ``None`` (the extension if it loads, else the reference with one warning),
            ``"extension"`` (raise if it is not available) or ``"reference"``.

    Returns:
        ``kv_cache``. Every argument is checked before anything is written, so after an error
        the cache is unchanged. The checks read the slot range (and an fp8 scale tensor), which
        syncs with the GPU; call ``torch.ops.mla.concat_and_cache_mla`` to skip them.
    """
    if backend not in (None, "extension", "reference"):
        raise ValueError(f"backend must be None, 'extension' or 'reference', got {backend!r}")
    if backend == "reference":
        return concat_and_cache_reference(kv_c, k_pe, kv_cache, slot_mapping,
                                          kv_cache_dtype=kv_cache_dtype, scale=scale)
    device = kv_cache.device if isinstance(kv_cache, torch.Tensor) else torch.device("cpu")
    if not _extension_serves(device):
        if backend == "extension":
            state = load_extension()
            raise RuntimeError(
                f"the concat_and_cache extension cannot run on {device} "
                f"({state['error'] or 'built without CUDA'})"
            )
        _warn_fallback_once(device)
        return concat_and_cache_reference(kv_c, k_pe, kv_cache, slot_mapping,
                                          kv_cache_dtype=kv_cache_dtype, scale=scale)
    scale_t = _validate(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)
    torch.ops.mla.concat_and_cache_mla(
        kv_c, k_pe, kv_cache, slot_mapping.contiguous(), kv_cache_dtype, scale_t
    )
    return kv_cache
