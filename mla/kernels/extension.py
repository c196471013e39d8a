"""The compiled extension of csrc/: its build, its loading, and what it serves on a device.

One extension holds every compiled kernel of the package, registered as ``torch.ops.mla.*``:

- ``concat_and_cache_mla``: the C++ CPU twin (``csrc/concat_and_cache_mla_cpu.cpp``), and with a
  GPU the CUDA kernel (``csrc/concat_and_cache_mla.cu``);
- ``mla_decode_sm80``: the decode stage 1 of ``csrc/mla_decode_sm80.cu``, built for GPUs of
  compute capability 8.0 and later;
- ``mla_decode_sm90``: the wgmma decode stage 1 of ``csrc/mla_decode_sm90.cu``, built for
  compute capability 9.0 (H100 / H200) as sm_90a.

It is built by JIT on first use, cached on disk by torch (``TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``) and loaded once per process. Where no compiler is available or the
build fails, ``concat_and_cache`` uses its torch reference and ``mla_decode`` its Triton kernel.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

__all__ = ["load_extension", "extension_available", "concat_backend"]

_CSRC = Path(__file__).resolve().parents[2] / "csrc"

# The extension, loaded at most once per process: None = not tried yet.
_ext_state: dict | None = None


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
    ``decode`` (whether the sm_80 decode stage 1 is), ``decode_sm90`` (whether the wgmma one is),
    ``error`` (why not, when not loaded). Never raises.
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
        # the sm_80 decode stage 1 uses sm_80 instructions (mma.sync on bf16, cp.async)
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
    except Exception as exc:  # noqa: BLE001 - any failure means "use the fallbacks"
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        error = f"{type(exc).__name__}: {first_line}"
        _ext_state = {"loaded": False, "cuda": False, "decode": False, "decode_sm90": False, "error": error}
    return _ext_state


def extension_available(device: torch.device | str) -> bool:
    """Whether the extension's ``concat_and_cache_mla`` runs on ``device`` (loads it if need be)."""
    device = torch.device(device)
    state = load_extension()
    return state["loaded"] and (device.type == "cpu" or (device.type == "cuda" and state["cuda"]))


def concat_backend(device: torch.device | str = "cpu") -> str:
    """``"extension"`` or ``"reference"``: what ``concat_and_cache`` uses by default on ``device``."""
    return "extension" if extension_available(device) else "reference"
