"""MLA prefill in up-projected ("MHA") form: the public op, its reference, and chunked context.

Four things live here, each a function or two:

- ``mla_prefill``: attention of packed new tokens (``cu_seqlens_q``) over packed keys and values
  (``cu_seqlens_k``), causal bottom-right aligned or not, through the Triton kernel of
  ``mla.kernels.triton_prefill``; returns the output and the log-sum-exp.
  ``mla_prefill_reference`` computes the same in plain torch, one sequence at a time.
- ``sdpa_prefill``: the new tokens' causal attention over themselves through torch's
  ``scaled_dot_product_attention`` (cuDNN on a GPU, faster there than the Triton kernel on
  long prompts over an empty cache); ``choose_prefill_backend`` says which of the two a call
  without cached context runs on.
- ``merge_attention_states``: two attentions of the same queries over disjoint key sets, merged
  into the attention over their union by their log-sum-exps.
- ``chunked_context_prefill``: new tokens over a cached context in bounded memory. They attend
  to themselves causally (one ``mla_prefill`` a group of heads, ``head_group``; ``sdpa_prefill``
  instead where no sequence has context and its ``backend`` says so), and to their context,
  gathered from the paged latent cache and up-projected by W_UK and W_UV a chunk of at most
  ``workspace_tokens`` tokens at a time, non-causally (one ``mla_prefill`` a chunk); the pieces
  are merged by log-sum-exp.
  Peak memory grows with the new tokens and the workspace, never with new tokens x context.

Shape letters: b sequences, h heads, g heads of a group, d nope dim, r rope dim, v value dim,
c latent dim, n tokens a page; ``total_q`` / ``total_k`` are the packed rows of all sequences'
queries / keys.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import os

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import fp8
from .constants import LOG2E, MAX_GRID_YZ
from .launch import launch_fitting, on_the_gpu_of_its_first_tensor, step_down
from .triton_prefill import default_prefill_config, mla_prefill_kernel

__all__ = [
    "mla_prefill",
    "mla_prefill_reference",
    "merge_attention_states",
    "chunked_context_prefill",
    "sdpa_prefill",
    "choose_prefill_backend",
    "PREFILL_BACKENDS",
    "DEFAULT_WORKSPACE_TOKENS",
    "head_group",
]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Tokens of context up-projected at once by chunked_context_prefill. The workspace holds
# h * (d + v) values a token: 16384 tokens at DeepSeek-V3's 128 heads in bf16 are 1 GiB (128 MiB
# at the 16 heads a GPU holds under tensor parallelism 8). vLLM sizes its workspace
# min(max(8 * max_model_len, 4 * max_num_seqs * page), 64k) tokens.
DEFAULT_WORKSPACE_TOKENS = 16384

# What runs the new tokens' causal attention over themselves when a call has no cached context:
# "triton" (mla_prefill), "sdpa" (sdpa_prefill) or "auto" (choose_prefill_backend's rule).
PREFILL_BACKENDS = ("auto", "triton", "sdpa")

# SDPA's backends on a GPU, in priority order: cuDNN (the fastest at DeepSeek's head dims on an
# H200, benchmarks/results/h200-prefill.json), then memory-efficient (any float dtype). Both are
# tiled, so no score is stored; math (which stores every score) and flash (which needs the
# value's head dim equal to the key's: 128 against 192) are left out.
# An older torch's sdpa_kernel takes no set_priority: its own order then decides between the two.
_SDPA_CUDA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
_SDPA_SET_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


# ---------------------------------------------------------------------------------------------
# Input checks, shared by the op and the reference
# ---------------------------------------------------------------------------------------------


def _check_tensor(fn, name, t, dims, dtype=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(dims):
        raise ValueError(f"{fn}: {name} must be ({', '.join(dims)}), got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{fn}: {name} must be {dtype}, got {t.dtype}")


def _check_cu_seqlens_values(fn, name, cu, total) -> list[int]:
    """Host check of one offsets tensor: starts at 0, never decreases, ends at ``total``."""
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{fn}: {name} must start at 0, got {values[0]}")
    lengths = [hi - lo for lo, hi in zip(values, values[1:])]
    if any(n < 0 for n in lengths):
        i = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"{fn}: {name} must not decrease, but {name}[{i + 1}] = {values[i + 1]} < {values[i]}")
    if values[-1] != total:
        raise ValueError(f"{fn}: {name}[-1] must equal the packed rows ({total}), got {values[-1]}")
    return lengths


def _check_prefill_inputs(fn, q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                          causal, max_seqlen_q, max_seqlen_k, check_values, dtypes=_DTYPES) -> tuple[int, int]:
    """Raise a TypeError/ValueError naming the argument at fault; read-only.

    Returns (max_seqlen_q, max_seqlen_k): the given ones, or (with ``check_values``, which also
    checks the offsets' values: one host sync) the largest lengths in the offsets.
    """
    _check_tensor(fn, "q_nope", q_nope, ("total_q", "h", "d"))
    if q_nope.dtype not in dtypes:
        names = ", ".join(str(t).removeprefix("torch.") for t in dtypes)
        raise TypeError(f"{fn}: q_nope must be one of {names}, got {q_nope.dtype}")
    total_q, h, d = q_nope.shape
    _check_tensor(fn, "q_pe", q_pe, ("total_q", "h", "r"), q_nope.dtype)
    _check_tensor(fn, "k_nope", k_nope, ("total_k", "h", "d"), q_nope.dtype)
    total_k = k_nope.shape[0]
    _check_tensor(fn, "k_pe", k_pe, ("total_k", "r"), q_nope.dtype)
    _check_tensor(fn, "v", v, ("total_k", "h", "v"), q_nope.dtype)
    r, dv = q_pe.shape[2], v.shape[2]
    expected = {
        "q_pe": (q_pe, (total_q, h, r)),
        "k_nope": (k_nope, (total_k, h, d)),
        "k_pe": (k_pe, (total_k, r)),
        "v": (v, (total_k, h, dv)),
    }
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{fn}: {name} must have shape {shape} (from q_nope, q_pe, k_nope, v), got {tuple(t.shape)}"
            )
    if min(d, r, dv) < 1:
        raise ValueError(f"{fn}: d, r and v must be >= 1, got d={d}, r={r}, v={dv}")
    if h > MAX_GRID_YZ:
        raise ValueError(f"{fn}: at most {MAX_GRID_YZ} heads, got {h}")
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("k_nope", k_nope), ("k_pe", k_pe), ("v", v)):
        if t.device != q_nope.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but q_nope is on {q_nope.device}")
        if t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name}'s last dim must be contiguous (stride 1), got strides {t.stride()}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(fn, name, t, ("b + 1",), torch.int32)
        if t.device != q_nope.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but q_nope is on {q_nope.device}")
        if t.shape[0] < 1:
            raise ValueError(f"{fn}: {name} must hold b + 1 >= 1 offsets, got none")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"{fn}: cu_seqlens_q and cu_seqlens_k must both be (b + 1,), got {tuple(cu_seqlens_q.shape)} "
            f"and {tuple(cu_seqlens_k.shape)}"
        )
    if cu_seqlens_q.shape[0] - 1 > MAX_GRID_YZ:
        raise ValueError(f"{fn}: at most {MAX_GRID_YZ} sequences a call, got {cu_seqlens_q.shape[0] - 1}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"{fn}: softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"{fn}: softmax_scale must be finite, got {softmax_scale}")
    if not isinstance(causal, bool):
        raise TypeError(f"{fn}: causal must be a bool, got {type(causal).__name__}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0):
            raise ValueError(f"{fn}: {name} must be None or an int >= 0, got {value!r}")
    if not check_values:
        return max_seqlen_q, max_seqlen_k

    lens_q = _check_cu_seqlens_values(fn, "cu_seqlens_q", cu_seqlens_q, total_q)
    lens_k = _check_cu_seqlens_values(fn, "cu_seqlens_k", cu_seqlens_k, total_k)
    if causal:
        for i, (s, t) in enumerate(zip(lens_q, lens_k)):
            if s > t:
                raise ValueError(
                    f"{fn}: with causal=True a sequence's queries are the last of its keys, but sequence {i} "
                    f"has {s} queries (cu_seqlens_q) and {t} keys (cu_seqlens_k)"
                )
    longest_q, longest_k = max(lens_q, default=0), max(lens_k, default=0)
    for name, given, longest in (("max_seqlen_q", max_seqlen_q, longest_q), ("max_seqlen_k", max_seqlen_k, longest_k)):
        if given is not None and given < longest:
            raise ValueError(f"{fn}: {name} is {given} but a sequence has {longest}")
    return (longest_q if max_seqlen_q is None else max_seqlen_q, longest_k if max_seqlen_k is None else max_seqlen_k)


def _interpreted(device: torch.device) -> bool:
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------
# The op: check, allocate, launch
# ---------------------------------------------------------------------------------------------


# shared memory a prefill configuration needs shrinks with fewer stages, then keys, then queries
_STEP_DOWN = (("num_stages", 1), ("BLOCK_N", 16), ("BLOCK_M", 16))


@on_the_gpu_of_its_first_tensor
def mla_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = True,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    _config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention in MLA's up-projected form, tiled: no (query, key) score is stored.

    Args:
        q_nope: (total_q, h, d), bfloat16 / float16 / float32: the queries' nope part, the new
            tokens of all b sequences packed (sequence i's are rows ``cu_seqlens_q[i] ...
            cu_seqlens_q[i+1] - 1``).
        q_pe: (total_q, h, r), q_nope's dtype: the queries' rotary part.
        k_nope: (total_k, h, d): the keys' nope part (``W_UK`` times the latent), packed by
            ``cu_seqlens_k``.
        k_pe: (total_k, r): the rotary key, one a token, shared by all heads.
        v: (total_k, h, v): the values (``W_UV`` times the latent).
        cu_seqlens_q, cu_seqlens_k: (b + 1,) int32 offsets: start at 0, never decrease, end at
            total_q / total_k.
        softmax_scale: multiplies q . k before the softmax.
        causal: True: bottom-right aligned, sequence i's s_i queries are the last s_i of its
            t_i keys and query j sees keys 0 .. t_i - s_i + j (needs s_i <= t_i). False: every
            query sees every key of its sequence.
        max_seqlen_q, max_seqlen_k: the longest sequence's queries / keys. None: read from the
            offsets on the host, which also checks their values (one sync). Give both to launch
            without a host sync; the offsets' values are then trusted on a GPU (still checked on
            the CPU, where that costs nothing).
        _config: private tuning hook for benchmarks and tests: any of ``BLOCK_M``, ``BLOCK_N``,
            ``num_warps``, ``num_stages`` (see ``default_prefill_config``).

    All last dims must be contiguous; other strides are free (k_nope and v may be views into
    one up-projected (total_k, h, d + v) tensor).

    Returns:
        out: (total_q, h, v) in q's dtype, ``softmax(scores) @ v``; 0 for a query that sees no key.
        lse: (total_q, h) float32, ``log(sum(exp(scores)))`` over the visible keys, natural log;
            -inf for a query that sees no key.
    """
    fn = "mla_prefill"
    check_values = max_seqlen_q is None or max_seqlen_k is None or q_nope.device.type == "cpu"
    max_seqlen_q, max_seqlen_k = _check_prefill_inputs(
        fn, q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
        max_seqlen_q, max_seqlen_k, check_values,
    )
    total_q, h, d = q_nope.shape
    r, dv = q_pe.shape[2], v.shape[2]
    b = cu_seqlens_q.shape[0] - 1
    if q_nope.device.type == "cpu" and not _interpreted(q_nope.device):
        raise ValueError(
            f"{fn}: q_nope is on the CPU, which Triton runs only in its interpreter; set TRITON_INTERPRET=1 "
            "before triton is imported (mla.kernels does so when no GPU is visible)"
        )
    out = torch.empty((total_q, h, dv), dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty((total_q, h), dtype=torch.float32, device=q_nope.device)
    if total_q == 0 or h == 0 or max_seqlen_q == 0:
        return out, lse

    # The interpreter's tl.dot on bf16 is wrong: compute bf16 in fp32 there
    compute = (q_nope, q_pe, k_nope, k_pe, v)
    if q_nope.dtype == torch.bfloat16 and _interpreted(q_nope.device):
        compute = tuple(t.float() for t in compute)
    q_nope_c, q_pe_c, k_nope_c, k_pe_c, v_c = compute
    out_c = out if out.dtype == q_nope_c.dtype else torch.empty_like(out, dtype=q_nope_c.dtype)

    config = default_prefill_config(d + r, q_nope_c.element_size(), max_seqlen_q, max_seqlen_k,
                                    interpreter=_interpreted(q_nope.device))
    if _config:
        unknown = set(_config) - set(config)
        if unknown:
            raise ValueError(f"{fn}: unknown _config keys {sorted(unknown)}; known: {sorted(config)}")
        config.update(_config)
    block_d, block_r, block_v = (max(16, triton.next_power_of_2(n)) for n in (d, r, dv))

    def launch(config):
        grid = (triton.cdiv(max_seqlen_q, config["BLOCK_M"]), h, b)
        mla_prefill_kernel[grid](
            q_nope_c, q_pe_c, k_nope_c, k_pe_c, v_c, cu_seqlens_q, cu_seqlens_k, out_c, lse,
            d, r, dv, float(softmax_scale) * LOG2E,
            q_nope_c.stride(0), q_nope_c.stride(1),
            q_pe_c.stride(0), q_pe_c.stride(1),
            k_nope_c.stride(0), k_nope_c.stride(1),
            k_pe_c.stride(0),
            v_c.stride(0), v_c.stride(1),
            out_c.stride(0), out_c.stride(1),
            lse.stride(0), lse.stride(1),
            BLOCK_M=config["BLOCK_M"],
            BLOCK_N=config["BLOCK_N"],
            BLOCK_D=block_d,
            BLOCK_R=block_r,
            BLOCK_V=block_v,
            CAUSAL=causal,
            EXACT=(block_d, block_r, block_v) == (d, r, dv),
            DOT_PRECISION="ieee" if q_nope_c.dtype == torch.float32 else "tf32",
            num_warps=config["num_warps"],
            num_stages=config["num_stages"],
        )

    if _config:  # a configuration given is launched as it is: a GPU that cannot take it says so
        launch(config)
    else:
        launch_fitting(launch, config, (fn, q_nope.device, q_nope_c.dtype, d, r, dv, causal),
                       functools.partial(step_down, order=_STEP_DOWN))
    if out_c is not out:
        out.copy_(out_c)
    return out, lse


# ---------------------------------------------------------------------------------------------
# The reference: plain torch, one sequence at a time
# ---------------------------------------------------------------------------------------------


def mla_prefill_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = True,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_prefill``'s arguments and results, with each sequence's scores materialised.

    ``compute_dtype`` (float32 by default; float64 for the tightest tests) is what the scores and
    softmax are computed in; float64 inputs are accepted too. Returns out in q's dtype and lse in
    float32, like the op.
    """
    _check_prefill_inputs(
        "mla_prefill_reference", q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k,
        softmax_scale, causal, max_seqlen_q, max_seqlen_k, True, dtypes=(*_DTYPES, torch.float64),
    )
    total_q, h, _ = q_nope.shape
    out = torch.zeros((total_q, h, v.shape[2]), dtype=compute_dtype, device=q_nope.device)
    lse = torch.full((total_q, h), float("-inf"), dtype=compute_dtype, device=q_nope.device)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        s, t = q1 - q0, k1 - k0
        if s == 0 or t == 0:
            continue
        qn, qp = q_nope[q0:q1].to(compute_dtype), q_pe[q0:q1].to(compute_dtype)        # (s, h, d), (s, h, r)
        kn, kp, vv = (x[k0:k1].to(compute_dtype) for x in (k_nope, k_pe, v))          # (t, h, d), (t, r), (t, h, v)
        # scores_{hij} = scale * (q_nope_{ihd} k_nope_{jhd} + q_pe_{ihr} k_pe_{jr})
        scores = (torch.einsum("ihd,jhd->hij", qn, kn) + torch.einsum("ihr,jr->hij", qp, kp)) * softmax_scale
        if causal:  # query i sits at key position t - s + i
            keys, queries = torch.arange(t, device=q_nope.device), torch.arange(s, device=q_nope.device)
            visible = keys[None, :] <= (t - s + queries)[:, None]                         # (s, t)
            scores = scores.masked_fill(~visible, float("-inf"))
        lse[q0:q1] = torch.logsumexp(scores, dim=-1).transpose(0, 1)                  # (s, h)
        # out_{ihv} = sum_j softmax(scores)_{hij} v_{jhv}
        out[q0:q1] = torch.einsum("hij,jhv->ihv", torch.softmax(scores, dim=-1), vv)
    return out.to(q_nope.dtype), lse.to(torch.float32)


# ---------------------------------------------------------------------------------------------
# The context-free case through torch's SDPA, and the choice between it and the kernel
# ---------------------------------------------------------------------------------------------


def choose_prefill_backend(backend: str, device: torch.device | str, *, equal_rows: bool) -> str:
    """What runs a call's causal self-attention of new tokens without cached context.

    Args:
        backend: "triton" or "sdpa" (returned as they are), or "auto".
        device: where the call runs.
        equal_rows: whether every row has the same number of new tokens (one batched SDPA call).

    Returns "triton" (``mla_prefill``) or "sdpa" (``sdpa_prefill``). "auto" is "sdpa" on a CUDA
    device with equal rows: there the layer's SDPA path is faster than the kernel on prompts of
    8k tokens and more, and within the timing spread of a host-bound call below (the figures:
    ``docs/derivations/prefill.md``, from ``benchmarks/results/h200-prefill.json``).
    Else "triton": ragged rows would take one SDPA call a row and a host read of their offsets,
    where the kernel takes them in one launch; and on the CPU the paged tier is the kernels'
    test bench (Triton's interpreter runs the code the GPU runs), where SDPA would stand in for
    the kernel under test.
    """
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"prefill backend must be one of {PREFILL_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return "sdpa" if torch.device(device).type == "cuda" and equal_rows else "triton"


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """scaled_dot_product_attention(q, k, v), causal, q and k (m, h, s, d + r), v (m, h, s, v).

    On a GPU through cuDNN or memory-efficient attention (``_SDPA_CUDA_BACKENDS``), which take
    head dims that are multiples of 8. Elsewhere torch chooses; its CPU flash kernel takes one
    head dim for q, k and v (else the CPU runs the math backend, which stores every score). So
    the head dims are padded with zeros where a backend needs it: zeros add nothing to q . k,
    and the padded values' outputs are cut off.
    """
    dk, dv = q.shape[-1], v.shape[-1]
    if q.device.type == "cuda":
        width_k, width_v = -(-dk // 8) * 8, -(-dv // 8) * 8
        backends = sdpa_kernel(_SDPA_CUDA_BACKENDS, **(dict(set_priority=True) if _SDPA_SET_PRIORITY else {}))
    else:
        width_k = width_v = max(dk, dv)
        backends = contextlib.nullcontext()
    if width_k > dk:
        q, k = (F.pad(t, (0, width_k - dk)) for t in (q, k))
    if width_v > dv:
        v = F.pad(v, (0, width_v - dv))
    with backends:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[..., :dv]


def _joined(a: torch.Tensor, b: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """[a | b] along ``dim``: a view where b's values follow a's along ``dim`` in one buffer with
    a's strides (q_nope and q_pe as views of one query; W_UK and W_UV as views of kv_b_proj's
    weight), else a copy. The view reads exactly the copy's values: past a's end along ``dim``,
    its elements are b's."""
    dim = dim % a.dim()
    e = a.shape[dim]
    shape = (*a.shape[:dim], e + b.shape[dim], *a.shape[dim + 1:])
    if (a.dim() == b.dim() and (*b.shape[:dim], e, *b.shape[dim + 1:]) == a.shape
            and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device
            and a.numel() > 0 and b.numel() > 0
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + e * a.stride(dim)):
        return a.as_strided(shape, a.stride(), a.storage_offset())
    return torch.cat([a, b], dim=dim)


def sdpa_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    softmax_scale: float,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """New tokens attending causally to themselves, by torch's ``scaled_dot_product_attention``.

    The arguments of ``mla_prefill`` for a call whose keys are the new tokens themselves
    (``cu_seqlens_k = cu_seqlens_q``, ``causal=True``): q_nope (total_q, h, d), q_pe (total_q, h,
    r), k_nope (total_q, h, d), k_pe (total_q, r), v (total_q, h, v). SDPA takes one key of
    d + r dims a head, so the rope key is broadcast over the heads: k = [k_nope | k_pe] is built,
    (total_q, h, d + r), and so is q = [q_nope | q_pe] unless q_pe's values follow q_nope's in one
    buffer (views of one query, as the paged layer makes them), which SDPA then reads as they
    are. Rows of equal length (known on the host from the shapes: ``total_q == b *
    max_seqlen_q``) go in one batched call; ragged rows in one call a row, their offsets read on
    the host (one sync on a GPU).

    Returns out (total_q, h, v) in q's dtype (for rows of one length SDPA's own output, which is
    token-major); no log-sum-exp (SDPA's public call returns none), so this serves only calls
    with nothing to merge: no cached context.
    """
    fn = "sdpa_prefill"
    for name, t in (("k_nope", k_nope), ("k_pe", k_pe), ("v", v)):  # the new tokens are the keys
        if isinstance(t, torch.Tensor) and isinstance(q_nope, torch.Tensor) and t.shape[:1] != q_nope.shape[:1]:
            raise ValueError(f"{fn}: {name} must have a row for each of the total_q = {q_nope.shape[0]} new "
                             f"tokens (they are their own keys), got shape {tuple(t.shape)}")
    check_values = max_seqlen_q is None or q_nope.device.type == "cpu"
    max_seqlen_q, _ = _check_prefill_inputs(
        fn, q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_q, softmax_scale, True,
        max_seqlen_q, max_seqlen_q, check_values,
    )
    total_q, h, _ = q_nope.shape
    b = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or h == 0:
        return q_nope.new_empty(total_q, h, v.shape[2])
    q = _joined(q_nope, q_pe)                                                   # (total_q, h, d + r)
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, h, -1)], dim=-1)            # (total_q, h, d + r)

    def attend(lo: int, hi: int, m: int) -> torch.Tensor:
        """Tokens lo .. hi - 1, m rows of (hi - lo) / m tokens each, in one call: (hi - lo, h, v)."""
        q_m, k_m, v_m = (t[lo:hi].unflatten(0, (m, -1)).transpose(1, 2) for t in (q, k, v))  # (m, h, s, ·)
        o = _causal_sdpa(q_m, k_m, v_m, float(softmax_scale))                   # (m, h, s, v)
        return o.transpose(1, 2).flatten(0, 1)                                  # (m·s, h, v)

    if b * max_seqlen_q == total_q:   # b rows of at most max_seqlen_q tokens: all of that length
        # SDPA's output is token-major, as q is: the answer itself unless v was padded
        return attend(0, total_q, b).contiguous()
    out = q_nope.new_empty(total_q, h, v.shape[2])
    cu = cu_seqlens_q.tolist()
    for lo, hi in zip(cu, cu[1:]):
        if hi > lo:
            out[lo:hi] = attend(lo, hi, 1)
    return out


# ---------------------------------------------------------------------------------------------
# Merging two attentions of the same queries by log-sum-exp
# ---------------------------------------------------------------------------------------------


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over keys A + B from the attentions over A and over B (disjoint sets).

    With ``out_X = sum_{j in X} exp(s_j - lse_X) v_j`` and ``lse_X = log sum_{j in X} exp(s_j)``:

        lse = log(exp(lse_a) + exp(lse_b))
        out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

    computed against ``m = max(lse_a, lse_b)`` so nothing overflows. A side with lse -inf (no
    key) weighs 0; both -inf gives out 0 and lse -inf. The same merge, over many splits at once,
    is the split-KV decode's stage 2 (``mla.kernels.decode``).

    Args: out_a, out_b (..., v), any float dtype; lse_a, lse_b (...) the matching log-sum-exps.
    Returns: out (..., v) in float32 (or float64 when an input is), lse (...) in float32.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"merge_attention_states: out_a, out_b must be (..., v) and lse_a, lse_b (...) alike, got "
            f"{tuple(out_a.shape)}, {tuple(lse_a.shape)}, {tuple(out_b.shape)}, {tuple(lse_b.shape)}"
        )
    f32 = torch.promote_types(torch.promote_types(out_a.dtype, out_b.dtype), torch.float32)
    lse_a, lse_b = lse_a.to(f32), lse_b.to(f32)
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # both empty: weights exp(-inf) = 0
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)  # (...)
    total = w_a + w_b
    seen = total > 0
    total_safe = torch.where(seen, total, torch.ones_like(total))
    out = (out_a.to(f32) * (w_a / total_safe)[..., None]).add_(out_b.to(f32) * (w_b / total_safe)[..., None])
    lse = torch.where(seen, m + torch.log(total_safe), torch.full_like(m, float("-inf")))
    return out, lse.to(torch.float32)


# ---------------------------------------------------------------------------------------------
# New tokens over a paged cached context, a workspace of context at a time
# ---------------------------------------------------------------------------------------------


def _check_context_inputs(fn, q_nope, q_pe, kv_c, k_pe, cu_seqlens_q, kv_cache, block_table, context_lens,
                          W_UK, W_UV, workspace_tokens, context_lens_host, check_values, kv_cache_dtype,
                          kv_scale):
    """The arguments chunked_context_prefill adds to mla_prefill's; returns the host context lengths
    and the fp8_e4m3 scale as the (1,) float32 tensor on q's device (None for the other layouts).

    ``check_values`` False (a GPU caller that gave the host lengths) trusts block_table's entries:
    checking them reads the device.
    """
    total_q, h, d = q_nope.shape
    _check_tensor(fn, "kv_c", kv_c, ("total_q", "c"), q_nope.dtype)
    c = kv_c.shape[1]
    _check_tensor(fn, "k_pe", k_pe, ("total_q", "r"), q_nope.dtype)
    r = q_pe.shape[-1]
    if kv_c.shape[0] != total_q or tuple(k_pe.shape) != (total_q, r):
        raise ValueError(
            f"{fn}: kv_c and k_pe must be (total_q={total_q}, c) and (total_q, r={r}), got {tuple(kv_c.shape)} "
            f"and {tuple(k_pe.shape)}"
        )
    _check_tensor(fn, "W_UK", W_UK, ("h", "d", "c"), q_nope.dtype)
    _check_tensor(fn, "W_UV", W_UV, ("h", "v", "c"), q_nope.dtype)
    if tuple(W_UK.shape) != (h, d, c):
        raise ValueError(f"{fn}: W_UK must be (h={h}, d={d}, c={c}), got {tuple(W_UK.shape)}")
    if W_UV.shape[0] != h or W_UV.shape[2] != c:
        raise ValueError(f"{fn}: W_UV must be (h={h}, v, c={c}), got {tuple(W_UV.shape)}")
    _check_tensor(fn, "kv_cache", kv_cache, ("num_blocks", "n", "width"))
    kind = fp8.canonical_kv_cache_dtype(kv_cache_dtype)
    if kind != "auto":
        fp8.require_fp8(kv_cache_dtype)
    dtype, width = fp8.cache_row(kind, c, r, q_nope.dtype)
    if kv_cache.dtype != dtype:
        raise TypeError(f"{fn}: kv_cache must be {dtype} for kv_cache_dtype={kv_cache_dtype!r}, got {kv_cache.dtype}")
    if kv_cache.shape[2] != width:
        raise ValueError(
            f"{fn}: kv_cache's last dim must be {width} for kv_cache_dtype={kv_cache_dtype!r} (c = {c}, r = {r}), "
            f"got {kv_cache.shape[2]}"
        )
    if (kind == "fp8_e4m3") != (kv_scale is not None):
        raise ValueError(f"{fn}: kv_scale must be the cache's scale for kv_cache_dtype='fp8_e4m3' and None "
                         f"otherwise, got {kv_scale!r} for {kv_cache_dtype!r}")
    if kv_scale is not None:  # a GPU tensor's value is read only where the call reads the host anyway
        kv_scale = fp8.check_e4m3_scale(fn, "kv_scale", kv_scale, q_nope.device, read_value=check_values)
    if kv_cache.shape[1] < 1:
        raise ValueError(f"{fn}: kv_cache's page size (dim 1) must be >= 1")
    b = cu_seqlens_q.shape[0] - 1
    _check_tensor(fn, "block_table", block_table, ("b", "max_blocks"), torch.int32)
    if block_table.shape[0] != b:
        raise ValueError(f"{fn}: block_table must have b={b} rows (from cu_seqlens_q), got {block_table.shape[0]}")
    _check_tensor(fn, "context_lens", context_lens, ("b",), torch.int32)
    if context_lens.shape[0] != b:
        raise ValueError(f"{fn}: context_lens must be (b={b},), got {tuple(context_lens.shape)}")
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache), ("block_table", block_table),
                    ("context_lens", context_lens), ("W_UK", W_UK), ("W_UV", W_UV)):
        if t.device != q_nope.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but q_nope is on {q_nope.device}")
    if isinstance(workspace_tokens, bool) or not isinstance(workspace_tokens, numbers.Integral):
        raise TypeError(f"{fn}: workspace_tokens must be an int, got {type(workspace_tokens).__name__}")
    if workspace_tokens < 1:
        raise ValueError(f"{fn}: workspace_tokens must be >= 1, got {workspace_tokens}")

    lens = context_lens.tolist() if context_lens_host is None else [int(n) for n in context_lens_host]
    if len(lens) != b or (check_values and context_lens_host is not None and lens != context_lens.tolist()):
        raise ValueError(f"{fn}: context_lens_host must hold context_lens' {b} values, got {context_lens_host!r}")
    if any(n < 0 for n in lens):
        raise ValueError(f"{fn}: context_lens must be >= 0, got a min of {min(lens)}")
    page = kv_cache.shape[1]
    pages = [triton.cdiv(n, page) for n in lens]
    if max(pages, default=0) > block_table.shape[1]:
        i = max(range(b), key=lambda i: pages[i])
        raise ValueError(
            f"{fn}: block_table is too short: sequence {i}'s context of {lens[i]} tokens needs {pages[i]} pages "
            f"of {page}, but block_table has {block_table.shape[1]} columns"
        )
    if not check_values:
        return lens, kv_scale
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < torch.tensor(
        pages, device=block_table.device
    )[:, None]
    if used.any():
        lo, hi = (int(x) for x in torch.stack(torch.aminmax(block_table[used])).tolist())
        if lo < 0 or hi >= kv_cache.shape[0]:
            raise ValueError(
                f"{fn}: block_table's entries for the context must be pages of kv_cache, in [0, "
                f"{kv_cache.shape[0] - 1}], got values in [{lo}, {hi}]"
            )
    return lens, kv_scale


def head_group(total_q: int, h: int, workspace_tokens: int) -> int:
    """Heads whose new-token keys and values ``chunked_context_prefill`` up-projects at once:
    as many as keep total_q x g within workspace_tokens x h token-heads (a context chunk's
    size), at least one, at most h, and the groups as even as that allows (16385 tokens over
    128 heads with a 16384-token workspace: two groups of 64, not 127 and 1)."""
    most = max(1, min(h, workspace_tokens * h // max(total_q, 1)))
    groups = -(-h // most)
    return -(-h // groups) if groups else 1


def chunked_context_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    W_UK: torch.Tensor,
    W_UV: torch.Tensor,
    softmax_scale: float,
    workspace_tokens: int = DEFAULT_WORKSPACE_TOKENS,
    max_seqlen_q: int | None = None,
    context_lens_host: list[int] | None = None,
    kv_cache_dtype: str = "auto",
    kv_scale: float | torch.Tensor | None = None,
    backend: str = "triton",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """New tokens attend causally to themselves and fully to their cached context, in bounded memory.

    Sequence i has s_i new tokens (rows ``cu_seqlens_q[i] ...`` of q_nope, q_pe, kv_c, k_pe) at
    positions ``context_lens[i] ... context_lens[i] + s_i - 1``, after ``context_lens[i]`` cached
    tokens whose latent rows ``[kv_c | k_pe]`` live in the paged cache. The result is that of
    causal attention over the whole sequence, computed as:

    1. the new tokens over themselves, causal: keys ``W_UK kv_c``, values ``W_UV kv_c``;
    2. the new tokens over the context, a chunk of at most ``workspace_tokens`` cached tokens at a
       time (the contexts of all sequences one after the other, cut into chunks): gather the
       chunk's latent rows from their pages (dequantised from an fp8 layout into q's dtype),
       up-project them into the workspace, attend
       non-causally (every context token lies before every new token);
    3. each piece's (out, lse) merged into the running one by ``merge_attention_states``.

    Step 1 runs on a group of heads at a time (``head_group``), so the new tokens' keys and
    values, like a context chunk, take at most ``max(workspace_tokens * h, total_q) * (d + v)``
    values. Memory beyond the inputs: O(total_q * h * v) for the output and the merge, and that
    workspace for keys and values; nothing of size new tokens x context.

    Args:
        q_nope: (total_q, h, d), q_pe: (total_q, h, r): the new tokens' queries, packed.
        kv_c: (total_q, c), k_pe: (total_q, r): the new tokens' latent and rotary key (normed
            and rotated, as they go into the cache).
        cu_seqlens_q: (b + 1,) int32 offsets of the new tokens.
        kv_cache: (num_blocks, n, width): the paged cache of ``[kv_c | k_pe]`` rows in the layout
            ``kv_cache_dtype`` names: c + r values of q's dtype (``"auto"``), c + r of
            float8_e4m3fn (``"fp8_e4m3"``, with ``kv_scale``) or FlashMLA's 656-byte uint8 token
            (``"fp8_ds_mla"``); ``mla.kernels.fp8`` has the layouts.
        block_table: (b, max_blocks) int32: page j of sequence i's context is
            ``block_table[i, j]``; entries past ``ceil(context_lens[i] / n)`` are never read.
        context_lens: (b,) int32: cached tokens before each sequence's new ones (0: none).
        W_UK: (h, d, c), W_UV: (h, v, c): kv_b_proj's per-head factors (``MLAWeights.W_UK``, ``.W_UV``).
        softmax_scale: multiplies q . k before the softmax.
        workspace_tokens: the most cached tokens up-projected at once (>= 1); step 1's head groups
            hold at most workspace_tokens x h token-heads (``head_group``).
        max_seqlen_q: the most new tokens of a sequence; None: read from cu_seqlens_q.
        context_lens_host: context_lens as host ints, where the caller holds them (a layer's host
            plan does); None: read from context_lens. Give it and max_seqlen_q to launch without
            a host sync on a GPU: cu_seqlens_q's values and block_table's entries are then trusted
            there (still checked on the CPU, where that costs nothing).
        kv_cache_dtype: the cache's layout, ``"auto"``, ``"fp8_e4m3"`` or ``"fp8_ds_mla"``.
        kv_scale: ``"fp8_e4m3"`` only: the cache's scale, a float or a 1-element float32 tensor on
            q's device or the CPU, finite and at least 2^-126 (``mla.kernels.fp8.check_e4m3_scale``;
            a GPU tensor's value is trusted where the host lengths are).
        backend: what runs step 1 when no sequence has context (``PREFILL_BACKENDS``): "triton"
            (``mla_prefill``, the default), "sdpa" (``sdpa_prefill``) or "auto"
            (``choose_prefill_backend``). With context, step 1 always runs on ``mla_prefill``:
            the merge needs its log-sum-exp.

    Returns:
        out (total_q, h, v) in q's dtype, lse (total_q, h) float32 natural log; lse is None when
        step 1 ran on SDPA, which gives none.
    """
    fn = "chunked_context_prefill"
    # q_nope, q_pe, k_pe and the offsets as mla_prefill checks them (the new tokens are their own
    # keys; q_nope stands in for the keys and values, which are computed below), before any work
    check_values = max_seqlen_q is None or context_lens_host is None or q_nope.device.type == "cpu"
    max_seqlen_q, _ = _check_prefill_inputs(
        fn, q_nope, q_pe, q_nope, k_pe, q_nope, cu_seqlens_q, cu_seqlens_q, softmax_scale, True,
        max_seqlen_q, None, check_values,
    )
    lens, kv_scale = _check_context_inputs(
        fn, q_nope, q_pe, kv_c, k_pe, cu_seqlens_q, kv_cache, block_table, context_lens, W_UK, W_UV,
        workspace_tokens, context_lens_host, check_values, kv_cache_dtype, kv_scale,
    )
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {PREFILL_BACKENDS}, got {backend!r}")
    h, d = q_nope.shape[1:]
    c, r, dv = kv_c.shape[1], k_pe.shape[1], W_UV.shape[1]
    page = kv_cache.shape[1]
    device = q_nope.device
    # kv_b_proj's two factors as one (h * (d + v), c) matrix (its weight itself, when W_UK and
    # W_UV are views of it): one matmul up-projects a latent row into every head's key and
    # value; k_nope and v are views into its output
    W_kv = _joined(W_UK, W_UV, dim=1).reshape(h * (d + dv), c)                 # (h·(d+v), c)

    def up_project(latent_c, h0=0, h1=h):                                      # (t, c)
        """Heads h0 .. h1 - 1's keys and values of the latent rows (one matmul)."""
        w = W_kv[h0 * (d + dv): h1 * (d + dv)]                                  # (g·(d+v), c)
        kv = (latent_c @ w.T).view(-1, h1 - h0, d + dv)                         # (t, g, d + v)
        return kv[..., :d], kv[..., d:]                                         # (t, g, d), (t, g, v)

    # ---- 1. the new tokens over themselves, causal (bottom-right: s_i keys for s_i queries),
    # g heads at a time: their keys and values, up-projected, hold at most workspace_tokens x h
    # token-heads (a context chunk's worth; one head a group at the least), so a long prompt's
    # keys and values never exist for every head at once. Heads are independent: each group's
    # out and lse are those heads' columns of the whole.
    total_q = q_nope.shape[0]
    total_context = sum(lens)
    equal_rows = (cu_seqlens_q.shape[0] - 1) * max_seqlen_q == total_q
    on_sdpa = total_context == 0 and choose_prefill_backend(backend, device, equal_rows=equal_rows) == "sdpa"
    g = head_group(total_q, h, workspace_tokens)

    def attend_new(h0: int, h1: int):
        """Heads h0 .. h1 - 1 of the new tokens over themselves: out (total_q, g, v), lse or None."""
        k_nope_new, v_new = up_project(kv_c, h0, h1)
        q_n, q_r = q_nope[:, h0:h1], q_pe[:, h0:h1]
        if on_sdpa:
            return sdpa_prefill(q_n, q_r, k_nope_new, k_pe, v_new, cu_seqlens_q, softmax_scale=softmax_scale,
                                max_seqlen_q=max_seqlen_q), None
        return mla_prefill(q_n, q_r, k_nope_new, k_pe, v_new, cu_seqlens_q, cu_seqlens_q,
                           softmax_scale=softmax_scale, causal=True, max_seqlen_q=max_seqlen_q,
                           max_seqlen_k=max_seqlen_q)

    if g == h:
        out, lse = attend_new(0, h)
    else:
        out = q_nope.new_empty(total_q, h, dv)                                  # (total_q, h, v)
        lse = None if on_sdpa else torch.empty(total_q, h, dtype=torch.float32, device=device)
        for h0 in range(0, h, g):
            out_g, lse_g = attend_new(h0, min(h, h0 + g))
            out[:, h0:h0 + g] = out_g
            if lse is not None:
                lse[:, h0:h0 + g] = lse_g
            del out_g, lse_g
    if total_context == 0:
        return out, lse
    out = out.float()

    # --8<-- [start:context_chunks]
    # ---- 2. the contexts, one after the other, in chunks of at most workspace_tokens tokens
    cu_context = torch.zeros(len(lens) + 1, dtype=torch.int64, device=device)
    cu_context[1:] = torch.cumsum(context_lens.to(torch.int64), 0)              # (b + 1,)
    for lo in range(0, total_context, workspace_tokens):
        hi = min(lo + workspace_tokens, total_context)
        # which sequence each token of the chunk belongs to, and its position in that context
        p = torch.arange(lo, hi, device=device)                                 # (t_chunk,)
        seq = torch.searchsorted(cu_context[1:], p, right=True)                 # (t_chunk,)
        pos = p - cu_context[seq]
        pages = block_table[seq, pos // page].long()
        latent = fp8.dequantize_rows(kv_cache[pages, pos % page], kv_cache_dtype, c, r, kv_scale,
                                     q_nope.dtype)                              # (t_chunk, c + r)
        k_nope, v = up_project(latent[:, :c])                                   # the workspace
        # this chunk's keys of sequence i: its context clipped to [lo, hi), re-based to 0
        cu_k = (cu_context.clamp(lo, hi) - lo).to(torch.int32)                  # (b + 1,)
        out_chunk, lse_chunk = mla_prefill(
            q_nope, q_pe, k_nope, latent[:, c:], v, cu_seqlens_q, cu_k, softmax_scale=softmax_scale,
            causal=False, max_seqlen_q=max_seqlen_q, max_seqlen_k=hi - lo,
        )
        del latent, k_nope, v
        # ---- 3. merge this chunk into the running result
        out, lse = merge_attention_states(out, lse, out_chunk, lse_chunk)
    # --8<-- [end:context_chunks]
    return out.to(q_nope.dtype), lse
