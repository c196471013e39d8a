"""Which stage-1 kernel runs a ``mla_decode`` call: Triton, or a CUDA one for DeepSeek's sizes.

The three kernels compute the same split-KV stage 1 (``mla.kernels.triton_decode``) and write the
same partials, which the Triton merge combines (with one split, each writes the answer itself):

- ``"triton"``: ``mla/kernels/triton_decode.py``. Any heads, c, r, dtype and page size, and 1 to
  8 new tokens a sequence (s_q); on the CPU it runs in Triton's interpreter.
- ``"cuda-sm80"``: ``csrc/mla_decode_sm80.cu``, warp-level tensor-core instructions (sm_80 and
  later). Up to 16 heads (one GPU's share of 128 at tensor parallelism 8, the memory-bound
  case), c = 512, r = 64, bf16 / fp16 q, pages of a multiple of 32 rows. Its fragments are
  loaded a k-step at a time, so nothing spills and two programs share an H100 / H200 SM. It
  reads caches in q's dtype and both fp8 layouts (``kv_cache_dtype="fp8_e4m3"``,
  ``"fp8_ds_mla"``), the stored bytes straight into its mma fragments, fp8_ds_mla's group scales
  applied in float32 to the scores and p. Its fp8 shapes fit GPUs of 99 KB of shared memory a
  block, where the bf16 one does not; there fp8 caches run on ``"triton"`` unless forced.
- ``"cuda-sm90"``: ``csrc/mla_decode_sm90.cu``, Hopper's warpgroup MMA (compute capability 9.0).
  Any heads, 64 a program (the compute-bound case), c = 512, r = 64, bf16 / fp16 q, pages of a
  multiple of 64 rows; one 64-token tile load serves both products. It reads caches in q's dtype
  and both fp8 layouts, dequantising each block group of a tile in place in shared memory into
  fp16 products (e4m3 is exact in fp16; fp8_ds_mla's values over a power of two a tile that its
  scores and p take back in float32, its rope block in bf16).

All three are validated on an H200 on caches in q's dtype and on both fp8 layouts (the GPU tests
of ``tests/test_kernels_decode*.py``, compute-sanitizer memcheck). On an fp8 cache the CUDA kernel
of the heads is the default, as on a cache in q's dtype: it is faster than the Triton kernel's
best fp8 tiles at every shape timed (``benchmarks/lab/results/h200-decode-fp8-triton-v0.json``,
``h200-decode-variants-fp8_*.json``).
``SM80_READS_FP8_BY_DEFAULT`` / ``SM90_READS_FP8_BY_DEFAULT`` set to False send fp8 caches back to
``"triton"``.

A query of s_q > 1 new tokens a sequence (speculative decoding, multi-token prediction):
``"cuda-sm90"`` packs its s_q x h (token, head) rows into its 64-row tiles, each row with its own
causal limit, as ``"triton"`` does; ``"cuda-sm80"`` takes one new token only (forcing it with
s_q > 1 is a ValueError). That path of ``"cuda-sm90"`` is validated on an H200 and is the default
for every s_q > 1 it can run: 1.3-2.6x faster than ``"triton"`` at s_q = 2 and 4
(``benchmarks/lab/results/h200-decode-sq-triton.json``; beside FlashMLA in
``benchmarks/results/h200-decode-sq.json``). ``SM90_TAKES_QUERY_TOKENS_BY_DEFAULT = False`` sends
s_q > 1 back to ``"triton"``.

By default a GPU runs ``"cuda-sm80"`` for <= 16 heads and ``"cuda-sm90"`` for more, where the
kernel applies: the extension holds it, the GPU and the arguments fit it (``why_backend_cannot_run``),
q has one new token a sequence (with ``SM90_TAKES_QUERY_TOKENS_BY_DEFAULT`` on, s_q > 1 goes to
``"cuda-sm90"`` at any head count), and the cache is in q's dtype (or fp8, with that kernel's
``*_READS_FP8_BY_DEFAULT`` on). Everything else runs on ``"triton"``. The times of each on an
H200 are in ``benchmarks/results/h200-decode.json``.
"""

from __future__ import annotations

import warnings

import torch

from .extension import load_extension
from .fp8 import canonical_kv_cache_dtype

__all__ = ["DECODE_BACKENDS", "CUDA_TILES", "choose_decode_backend", "sm_count", "why_backend_cannot_run"]

DECODE_BACKENDS = ("triton", "cuda-sm80", "cuda-sm90")

# (heads a program, tokens a tile) of each CUDA stage 1: what the split rule plans with
CUDA_TILES = {"cuda-sm80": (16, 32), "cuda-sm90": (64, 64)}
SM80_MAX_HEADS = 16  # the sm_80 kernel holds all heads of a sequence in one mma M of 16
CUDA_LATENT = (512, 64)  # (c, r) both CUDA kernels are built for
# shared memory a CTA on a cache in q's dtype (kSmemBytes in each .cu file, fixed by a
# static_assert there), and on each fp8 layout: the sm_80 kernel's Smem<DecodeShape, F>::kBytes;
# the wgmma kernel's kSmemBytes for every layout (it stages the stored bytes in its tile buffers)
CUDA_SMEM_BYTES = {"cuda-sm80": 105_088, "cuda-sm90": 231_744}
SM80_FP8_SMEM_BYTES = {"fp8_e4m3": 68_224, "fp8_ds_mla": 73_600}
SM90_FP8_SMEM_BYTES = dict.fromkeys(("fp8_e4m3", "fp8_ds_mla"), CUDA_SMEM_BYTES["cuda-sm90"])
# Whether an fp8 cache runs on "cuda-sm80" by default (<= 16 heads), and on "cuda-sm90" (more
# heads), rather than on "triton" (module docstring)
SM80_READS_FP8_BY_DEFAULT = True
SM90_READS_FP8_BY_DEFAULT = True
# Whether q of s_q > 1 new tokens runs on "cuda-sm90" by default rather than on "triton" (module
# docstring)
SM90_TAKES_QUERY_TOKENS_BY_DEFAULT = True
_EXTENSION_KEY = {"cuda-sm80": "decode", "cuda-sm90": "decode_sm90"}
_CPU_SM_COUNT = 132  # an H100/H200's SM count, so CPU runs choose the splits a GPU would


def sm_count(device: torch.device | str) -> int:
    """The SM count the split rule plans with on ``device``: the GPU's own, an H100/H200's 132 on
    the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _CPU_SM_COUNT


def _smem_per_block(device) -> int:
    """The shared memory a block may opt in to on this GPU, in bytes."""
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)


def why_backend_cannot_run(backend, q, kv_cache, block_table, seq_lens, kv_lora_rank,
                           kv_cache_dtype: str = "auto") -> str | None:
    """None if the CUDA stage 1 ``backend`` can run these (checked) arguments, else why not.

    q is (b, h, c + r) or (b, s_q, h, c + r); ``"cuda-sm90"`` runs s_q of 1 to 8 (its rows the
    s_q x h (token, head) pairs), ``"cuda-sm80"`` s_q = 1 only. ``kv_cache_dtype`` is the cache's
    layout (``mla_decode``'s): both CUDA kernels read all three."""
    kind = canonical_kv_cache_dtype(kv_cache_dtype)
    if kind == "auto" and kv_cache.dtype != q.dtype:
        return (f"kv_cache is {kv_cache.dtype}, not q's dtype {q.dtype}, and kv_cache_dtype is 'auto' "
                "(an fp8 cache needs its kv_cache_dtype)")
    sm90 = backend == "cuda-sm90"
    if q.dim() == 4:
        if q.shape[1] != 1 and not sm90:
            return (f"q has s_q = {q.shape[1]} new tokens a sequence; the sm_80 stage-1 kernel takes "
                    "one (s_q = 1), 'cuda-sm90' and the Triton kernel (_backend='triton') take 1 to 8")
        if q.shape[1] == 1 or q.stride(1) == q.shape[2] * q.stride(2):
            q = q[:, 0]  # (b, h, c + r): the rows' strides of mla_decode's (b, s_q·h, c + r) view
        else:
            q = q.reshape(q.shape[0], -1, q.shape[-1])  # mla_decode copies such a q too
    b, h, width = q.shape  # width = c + r
    if q.device.type != "cuda":
        return f"q is on {q.device.type}, not a GPU"
    capability = torch.cuda.get_device_capability(q.device)
    if sm90 and capability != (9, 0):
        return f"the GPU's compute capability is {capability[0]}.{capability[1]}, not 9.0 (wgmma)"
    if capability < (8, 0):
        return "the GPU's compute capability is below 8.0 (mma.sync, cp.async)"
    smem = _smem_per_block(q.device)
    fp8_smem = SM90_FP8_SMEM_BYTES if sm90 else SM80_FP8_SMEM_BYTES
    need = fp8_smem[kind] if kind != "auto" else CUDA_SMEM_BYTES[backend]
    if smem < need:
        return f"the GPU allows {smem} bytes of shared memory a block, the kernel needs {need}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q is {q.dtype}, not bfloat16 or float16"
    if not sm90 and h > SM80_MAX_HEADS:
        return f"q has {h} heads, more than {SM80_MAX_HEADS}"
    if (kv_lora_rank, width - kv_lora_rank) != CUDA_LATENT:
        return f"c, r = {kv_lora_rank}, {width - kv_lora_rank}, not {CUDA_LATENT[0]}, {CUDA_LATENT[1]}"
    tile = CUDA_TILES[backend][1]
    if kv_cache.shape[1] % tile:
        return f"the block size {kv_cache.shape[1]} is not a multiple of {tile}"
    rows_aligned = (q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0
                    and all(st * kv_cache.element_size() % 16 == 0 for st in kv_cache.stride()[:2]))
    if not rows_aligned or q.data_ptr() % 16 or kv_cache.data_ptr() % 16:
        return "q's or kv_cache's rows are not 16-byte aligned"
    if block_table.stride(1) != 1 or seq_lens.stride(0) != 1:
        return "block_table's rows or seq_lens are not contiguous"
    state = load_extension()
    if not state[_EXTENSION_KEY[backend]]:
        why = state["error"] or (
            "built without it (no nvcc, or a GPU other than compute capability 9.0 at build time)"
            if sm90 else "built without it (no nvcc, or a GPU below sm_80 at build time)"
        )
        return f"the compiled extension has no {backend} decode kernel ({why})"
    return None


_warned_cuda_fallback = False


def choose_decode_backend(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    backend: str | None = None,
    tuned: bool = False,
    kv_cache_dtype: str = "auto",
) -> str:
    """The stage-1 kernel a ``mla_decode`` call with these (checked) arguments runs.

    ``backend`` forces one of ``DECODE_BACKENDS`` (a ValueError saying why when a CUDA one cannot
    run the arguments); None picks ``"cuda-sm80"`` for <= 16 heads and ``"cuda-sm90"`` for more
    where each applies, else ``"triton"`` (with one warning when only the missing extension
    stands in the way). ``tuned``: a Triton launch configuration was given, so Triton runs.
    q is (b, h, c + r) or (b, s_q, h, c + r): s_q > 1 new tokens run on ``"cuda-sm90"`` where
    it applies while ``SM90_TAKES_QUERY_TOKENS_BY_DEFAULT`` is True (the default), else on
    ``"triton"`` (``"cuda-sm80"`` takes one token a sequence; forcing it with s_q > 1 is a
    ValueError). ``kv_cache_dtype``: the cache's layout; an fp8 one runs on the CUDA kernel that
    applies while its ``SM80_READS_FP8_BY_DEFAULT`` / ``SM90_READS_FP8_BY_DEFAULT`` is True (the
    default), else on ``"triton"``.
    """
    global _warned_cuda_fallback
    if backend is not None and backend not in DECODE_BACKENDS:
        raise ValueError(f"mla_decode: _backend must be None or one of {DECODE_BACKENDS}, got {backend!r}")
    if backend == "triton" or (backend is None and (tuned or q.device.type != "cuda")):
        return "triton"
    if backend is not None and tuned:
        raise ValueError(f"mla_decode: _config tunes the Triton kernel; it cannot go with _backend={backend!r}")
    query_tokens = len(q.shape) == 4 and q.shape[1] > 1
    if backend is None and query_tokens and not SM90_TAKES_QUERY_TOKENS_BY_DEFAULT:
        return "triton"
    kernel = backend or ("cuda-sm80" if q.shape[-2] <= SM80_MAX_HEADS and not query_tokens else "cuda-sm90")
    fp8_cache = canonical_kv_cache_dtype(kv_cache_dtype) != "auto"
    reads_fp8 = SM80_READS_FP8_BY_DEFAULT if kernel == "cuda-sm80" else SM90_READS_FP8_BY_DEFAULT
    if backend is None and fp8_cache and not reads_fp8:
        return "triton"
    why_not = why_backend_cannot_run(kernel, q, kv_cache, block_table, seq_lens, kv_lora_rank, kv_cache_dtype)
    if why_not is None and backend is None and fp8_cache and kernel == "cuda-sm80" \
            and _smem_per_block(q.device) < CUDA_SMEM_BYTES["cuda-sm80"]:
        # GPUs of 99 KB a block (sm_86, sm_89, sm_120) fit the fp8 shapes but not the bf16 one;
        # the fp8 path has run only where both fit (H100 / H200), so elsewhere it is opt-in
        return "triton"
    if why_not is None:
        return kernel
    if backend is not None:
        raise ValueError(f"mla_decode: _backend={backend!r} cannot run these arguments: {why_not}")
    if why_not.startswith("the compiled extension") and not _warned_cuda_fallback:
        _warned_cuda_fallback = True
        warnings.warn(f"mla.kernels.mla_decode: using the Triton kernel: {why_not}", RuntimeWarning, stacklevel=3)
    return "triton"
