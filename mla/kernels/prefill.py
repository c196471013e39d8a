"""MLA prefill in up-projected ("MHA") form: the public op and its reference.

``mla_prefill`` is the attention of packed new tokens (``cu_seqlens_q``) over packed keys and
values (``cu_seqlens_k``), causal bottom-right aligned or not, through the Triton kernel of
``mla.kernels.triton_prefill``; it returns the output and the log-sum-exp.
``mla_prefill_reference`` computes the same in plain torch, one sequence at a time, every score
materialised. The checks here are shared with the two modules built on the op:
``mla.kernels.sdpa`` (a prompt's causal attention through torch's SDPA instead) and
``mla.kernels.chunked_context`` (new tokens over a paged cached context in bounded memory).

Shape letters: b sequences, h heads, d nope dim, r rope dim, v value dim; ``total_q`` /
``total_k`` are the packed rows of all sequences' queries / keys.
"""

from __future__ import annotations

import math
import numbers
import os

import torch
import triton

from .constants import LOG2E, MAX_GRID_YZ
from .launch import launch_fitting, on_the_gpu_of_its_first_tensor
from .triton_prefill import default_prefill_config, mla_prefill_kernel

__all__ = ["mla_prefill", "mla_prefill_reference"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------
# Input checks, shared by the op, its reference and the modules built on the op
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
                       _STEP_DOWN)
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
