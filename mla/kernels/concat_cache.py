"""concat_and_cache: write the new tokens' latent rows ``[kv_c | k_pe]`` into the paged cache.

The paged tier keeps one cache row of ``c + r`` values per token (the normed latent ``kv_c``,
then the rotated rope key ``k_pe``; 512 + 64 = 576 for DeepSeek-V2/V3). Blocks of
``block_size`` rows make a page; a token's *slot* is ``block * block_size + offset``::

    for every token i with slot = slot_mapping[i] >= 0:
        kv_cache[slot // block_size, slot % block_size, :c] = q(kv_c[i])    # (c,)
        kv_cache[slot // block_size, slot % block_size, c:] = q(k_pe[i])    # (r,)

``q`` is the identity for ``kv_cache_dtype="auto"`` (the cache has the inputs' dtype) and
``e4m3(clamp(x / scale, -448, 448))`` for ``"fp8"`` / ``"fp8_e4m3"`` (a ``float8_e4m3fn``
cache; read back as ``x ~= cache.float() * scale``). ``"fp8_ds_mla"`` stores FlashMLA's token
instead, a ``uint8`` row of c + 4·c/128 + 2·r bytes (656 for DeepSeek): the latent in e4m3 with
one float32 scale per 128 values, computed as the row is written, then k_pe in bf16
(``mla.kernels.fp8`` spells out the layout and its rounding). Slot -1 skips the token (padding).

Three implementations of the same op:

- ``concat_and_cache_reference``: plain torch (``index_put_`` on the flattened cache); the spec.
- the CUDA kernel ``csrc/concat_and_cache_mla.cu``, one thread per 16-byte vector;
- its C++ CPU twin ``csrc/concat_and_cache_mla_cpu.cpp``, so that CI runs the extension path.

The two compiled ones are the op ``torch.ops.mla.concat_and_cache_mla`` of the package's
extension (``mla.kernels.extension``). Where it does not load, ``concat_and_cache`` falls back to
the reference with one warning.
"""

from __future__ import annotations

import warnings

import torch

from . import fp8
from .extension import extension_available, load_extension

__all__ = ["concat_and_cache", "concat_and_cache_reference"]

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# ----------------------------------------------------------------------------------------------
# The fallback when the extension does not serve the device


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


def _check_cache_layout(kind, kv_cache_dtype, kv_c, kv_cache, c, r) -> None:
    """The cache's width and dtype for the layout ``kind`` (the canonical name)."""
    if kind != "auto":
        fp8.require_fp8(kv_cache_dtype)
    if kind == "fp8_ds_mla":
        if c % fp8.DS_MLA_GROUP or c == 0:
            raise ValueError(
                f"kv_c's last dim c must be a positive multiple of {fp8.DS_MLA_GROUP} for "
                f"kv_cache_dtype='fp8_ds_mla' (one float32 scale per {fp8.DS_MLA_GROUP} "
                f"values), got c = {c}"
            )
    dtype, width = fp8.cache_row(kind, c, r, kv_c.dtype)
    if kind == "fp8_ds_mla":
        formula = f"c + 4*c/128 + 2*r = {c} + {4 * c // 128} + {2 * r} = {width} bytes"
    else:
        formula = f"c + r = {c} + {r} = {c + r}"
    what = f"have the inputs' dtype {dtype}" if kind == "auto" else f"be {dtype}"
    if kv_cache.shape[2] != width:
        raise ValueError(
            f"kv_cache last dim must be {formula} for kv_cache_dtype={kv_cache_dtype!r}, got "
            f"shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype != dtype:
        hint = {"float8_e4m3fn": " (pass kv_cache_dtype='fp8_e4m3')",
                "uint8": " (pass kv_cache_dtype='fp8_ds_mla')"}.get(
                    str(kv_cache.dtype).removeprefix("torch."), "") if kind == "auto" else ""
        raise TypeError(
            f"kv_cache must {what} for kv_cache_dtype={kv_cache_dtype!r}, got "
            f"{kv_cache.dtype}{hint}"
        )


def _validate(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale) -> torch.Tensor | None:
    """Check every argument; return the fp8_e4m3 scale as a (1,) float32 tensor on the cache's
    device (None for the other layouts). Raises ValueError / TypeError / RuntimeError naming the
    argument and what was expected."""
    kind = fp8.canonical_kv_cache_dtype(kv_cache_dtype)
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache),
                    ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")

    # ---- shapes and dtypes of the inputs
    if kv_c.dim() != 2:
        raise ValueError(f"kv_c must be (T, c), got shape {tuple(kv_c.shape)}")
    if k_pe.dim() != 2:
        raise ValueError(f"k_pe must be (T, r), got shape {tuple(k_pe.shape)}")
    T, c = kv_c.shape
    r = k_pe.shape[1]
    if k_pe.shape[0] != T:
        raise ValueError(f"k_pe must have T = {T} rows like kv_c, got shape {tuple(k_pe.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != T:
        raise ValueError(
            f"slot_mapping must be (T,) = ({T},), got shape {tuple(slot_mapping.shape)}"
        )
    if kv_c.dtype not in _INPUT_DTYPES:
        raise TypeError(f"kv_c must be bfloat16, float16 or float32, got {kv_c.dtype}")
    if k_pe.dtype != kv_c.dtype:
        raise TypeError(f"k_pe must have kv_c's dtype {kv_c.dtype}, got {k_pe.dtype}")
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be torch.int64, got {slot_mapping.dtype}")

    # ---- the cache: its layout's dtype and width
    if kv_cache.dim() != 3:
        raise ValueError(
            f"kv_cache must be (num_blocks, block_size, width), got shape {tuple(kv_cache.shape)}"
        )
    _check_cache_layout(kind, kv_cache_dtype, kv_c, kv_cache, c, r)

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

    # ---- the scale: given for fp8_e4m3, computed per group for fp8_ds_mla
    scale_t = None
    if kind == "fp8_ds_mla" and scale is not None:
        raise ValueError(
            "scale must be None for kv_cache_dtype='fp8_ds_mla': its scales are computed per "
            "token and per 128-value group as the row is written"
        )
    if kind == "fp8_e4m3":
        if scale is None:
            raise ValueError(f"scale is required for kv_cache_dtype={kv_cache_dtype!r}")
        # its value read on the host (a device sync on GPU), as the slots' below
        scale_t = fp8.check_e4m3_scale("concat_and_cache", "scale", scale, device,
                                       read_value=True)

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
    kind = fp8.canonical_kv_cache_dtype(kv_cache_dtype)
    flat = kv_cache.view(-1, kv_cache.shape[-1])  # (num_blocks * block_size, width)
    if kind == "auto":
        rows = torch.cat([kv_c, k_pe], dim=-1)  # (T, c + r)
    elif kind == "fp8_e4m3":
        rows = fp8.quantize_e4m3(kv_c, k_pe, scale_t).view(torch.uint8)  # (T, c + r)
        flat = flat.view(torch.uint8)  # index_put_ on the bytes
    else:
        rows = fp8.quantize_ds_mla(kv_c, k_pe)  # (T, c + 4·c/128 + 2·r) uint8
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
        kv_cache: (num_blocks, block_size, width), contiguous: width c + r in kv_c's dtype for
            ``kv_cache_dtype="auto"``, c + r ``torch.float8_e4m3fn`` for ``"fp8_e4m3"``,
            c + 4·c/128 + 2·r ``torch.uint8`` for ``"fp8_ds_mla"`` (656 for c = 512, r = 64).
        slot_mapping: (T,) int64, ``block * block_size + offset`` per token; -1 skips it.
        kv_cache_dtype: ``"auto"`` (store as is), ``"fp8_e4m3"`` or its alias ``"fp8"`` (store
            ``e4m3(clamp(x / scale, -448, 448))``), or ``"fp8_ds_mla"`` (FlashMLA's token: the
            latent in e4m3 with a float32 scale per 128 values, then k_pe in bf16; the layout
            and its rounding are in ``mla.kernels.fp8``). Both fp8 layouts need a torch with
            ``torch.float8_e4m3fn``.
        scale: ``"fp8_e4m3"`` only: a float or a 1-element float32 tensor on kv_cache's device
            or the CPU, finite and at least 2^-126 (``mla.kernels.fp8.check_e4m3_scale``);
            ignored for ``"auto"``, refused for ``"fp8_ds_mla"`` (which computes its scales).
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
    if not extension_available(device):
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
