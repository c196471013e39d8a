"""A prompt's causal attention through torch's SDPA, and the rule that picks it over the kernel.

``sdpa_prefill`` takes ``mla_prefill``'s arguments for new tokens attending causally to
themselves (no cached context) and runs them through ``scaled_dot_product_attention``: cuDNN
(then memory-efficient attention) on a GPU, faster there than the Triton kernel on long prompts.
It returns no log-sum-exp, so it serves only calls with nothing to merge. The paged layer's
path (``chunked_context_prefill``) starts from the new tokens' latent rows instead and
up-projects them straight into the key layout SDPA reads (``_latent_keys_values``).
``choose_prefill_backend`` says which of the two such a call runs on (``PREFILL_BACKENDS``).

Shape letters as in ``mla.kernels.prefill``; m rows of one length in a batched call; t latent
rows, g heads of a group, c latent dim.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .prefill import _check_prefill_inputs

__all__ = ["sdpa_prefill", "choose_prefill_backend", "PREFILL_BACKENDS", "PREFILL_KERNEL_UP_TO"]

# What runs the new tokens' causal attention over themselves when a call has no cached context:
# "triton" (mla_prefill), "sdpa" (torch SDPA, as sdpa_prefill calls it) or "auto"
# (choose_prefill_backend's rule).
PREFILL_BACKENDS = ("auto", "triton", "sdpa")

# "auto" keeps a call of at most this many new tokens in all on the kernel: such a call is bound
# by the host, and the kernel's path issues less there than SDPA's (the figures:
# docs/derivations/prefill.md).
PREFILL_KERNEL_UP_TO = 2048

# SDPA's backends on a GPU, in priority order: cuDNN (the fastest at DeepSeek's head dims on an
# H200, benchmarks/results/h200-prefill.json), then memory-efficient (any float dtype). Both are
# tiled, so no score is stored; math (which stores every score) and flash (which needs the
# value's head dim equal to the key's: 128 against 192) are left out.
# An older torch's sdpa_kernel takes no set_priority: its own order then decides between the two.
_SDPA_CUDA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
_SDPA_SET_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


def choose_prefill_backend(backend: str, device: torch.device | str, *, equal_rows: bool,
                           new_tokens: int) -> str:
    """What runs a call's causal self-attention of new tokens without cached context.

    Args:
        backend: "triton" or "sdpa" (returned as they are), or "auto".
        device: where the call runs.
        equal_rows: whether every row has the same number of new tokens (one batched SDPA call).
        new_tokens: the call's new tokens, all rows together.

    Returns "triton" (``mla_prefill``) or "sdpa" (torch SDPA). "auto" is "sdpa" on a CUDA
    device with equal rows and more than ``PREFILL_KERNEL_UP_TO`` new tokens: at 4k tokens the
    layer's SDPA path is the faster (the figures: ``docs/derivations/prefill.md``). Else
    "triton": a call of at most ``PREFILL_KERNEL_UP_TO`` tokens is bound by the host, where the
    kernel's path issues a little less; ragged rows would take one SDPA call a row and a host
    read of their offsets, where the kernel takes them in one launch; and on the CPU the paged
    tier is the kernels' test bench (Triton's interpreter runs the code the GPU runs), where SDPA
    would stand in for the kernel under test.
    """
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"prefill backend must be one of {PREFILL_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    on_gpu = torch.device(device).type == "cuda"
    return "sdpa" if on_gpu and equal_rows and new_tokens > PREFILL_KERNEL_UP_TO else "triton"


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
    a's strides and a contiguous last dim (q_nope and q_pe as views of one query; W_UK and W_UV
    as views of kv_b_proj's weight), else a copy; a copy too where autograd tracks either
    (the view would be a's alone). The view reads exactly the copy's values: past a's end along
    ``dim``, its elements are b's."""
    dim = dim % a.dim()
    e = a.shape[dim]
    shape = (*a.shape[:dim], e + b.shape[dim], *a.shape[dim + 1:])
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if (a.dim() == b.dim() and (*b.shape[:dim], e, *b.shape[dim + 1:]) == a.shape
            and a.stride() == b.stride() and a.stride(-1) == 1
            and a.dtype == b.dtype and a.device == b.device and a.numel() > 0 and b.numel() > 0
            and sa.data_ptr() == sb.data_ptr() and sa.nbytes() == sb.nbytes()
            and b.storage_offset() == a.storage_offset() + e * a.stride(dim)
            and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))):
        return a.as_strided(shape, a.stride(), a.storage_offset())
    return torch.cat([a, b], dim=dim)


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 max_seqlen_q: int, scale: float) -> torch.Tensor:
    """Packed rows attending causally to themselves: q, k (total_q, h, d + r), v (total_q, h, v)
    -> (total_q, h, v). Rows of equal length (``total_q == b * max_seqlen_q``) in one batched
    SDPA call, ragged rows in one call a row (their offsets read on the host)."""
    total_q = q.shape[0]
    b = cu_seqlens_q.shape[0] - 1

    def attend(lo: int, hi: int, m: int) -> torch.Tensor:
        """Tokens lo .. hi - 1, m rows of (hi - lo) / m tokens each, in one call: (hi - lo, h, v)."""
        q_m, k_m, v_m = (t[lo:hi].unflatten(0, (m, -1)).transpose(1, 2) for t in (q, k, v))  # (m, h, s, ·)
        o = _causal_sdpa(q_m, k_m, v_m, scale)                                  # (m, h, s, v)
        return o.transpose(1, 2).flatten(0, 1)                                  # (m·s, h, v)

    if b * max_seqlen_q == total_q:   # b rows of at most max_seqlen_q tokens: all of that length
        # SDPA's output is token-major, as q is: the answer itself unless v was padded
        return attend(0, total_q, b).contiguous()
    out = q.new_empty(total_q, q.shape[1], v.shape[2])
    cu = cu_seqlens_q.tolist()
    for lo, hi in zip(cu, cu[1:]):
        if hi > lo:
            out[lo:hi] = attend(lo, hi, 1)
    return out


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
    if total_q == 0 or h == 0:
        return q_nope.new_empty(total_q, h, v.shape[2])
    q = _joined(q_nope, q_pe)                                                   # (total_q, h, d + r)
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, h, -1)], dim=-1)            # (total_q, h, d + r)
    return _attend_rows(q, k, v, cu_seqlens_q, max_seqlen_q, float(softmax_scale))


def _latent_keys_values(kv_c: torch.Tensor, k_pe: torch.Tensor, W_UK: torch.Tensor,
                        W_UV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys k = [W_UK kv_c | k_pe] (t, g, d + r) and values W_UV kv_c (t, g, v) of t latent rows
    kv_c (t, c), k_pe (t, r), for the g heads of W_UK (g, d, c) and W_UV (g, v, c) (eqs. 42, 45):
    one matmul, whose output holds k in the layout SDPA reads.

    The matmul's weight is kv_b_proj's rows in another order, with r zero rows after each head's
    key rows: [W_UK_1; 0; W_UK_2; 0; ...; W_UV_1; ...; W_UV_g]. A latent row's output is then
    every head's [k_nope | 0], then every head's v: k is its first g (d + r) columns once k_pe
    is written into the zeros, v the rest, each head's values contiguous. Joining k_nope and
    k_pe by a concatenation would read every key and write it a second time; instead the zero
    rows cost r / (d + v) more matmul work (1/4 at DeepSeek's sizes), and the reordered weight
    is built at each call (three operators: its rope rows zeroed, W_UK and W_UV copied in).
    """
    g, d, c = W_UK.shape
    r, dv = k_pe.shape[1], W_UV.shape[1]
    w = W_UK.new_empty(g * (d + r + dv), c)                                     # (g·(d+r+v), c)
    w_k = w[:g * (d + r)].view(g, d + r, c)
    w_k[:, :d] = W_UK
    w_k[:, d:] = 0
    w[g * (d + r):].view(g, dv, c).copy_(W_UV)
    kv = kv_c @ w.T                                                             # (t, g·(d+r+v))
    k = kv[:, :g * (d + r)].view(-1, g, d + r)                                  # (t, g, d + r)
    k[..., d:] = k_pe[:, None]
    return k, kv[:, g * (d + r):].view(-1, g, dv)                               # (t, g, v)


def _sdpa_prefill_latent(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                         W_UK: torch.Tensor, W_UV: torch.Tensor, cu_seqlens_q: torch.Tensor, *,
                         softmax_scale: float, max_seqlen_q: int) -> torch.Tensor:
    """``sdpa_prefill`` of new tokens given by their latent rows: q_nope (total_q, g, d), q_pe
    (total_q, g, r), kv_c (total_q, c), k_pe (total_q, r), the g heads' W_UK (g, d, c) and W_UV
    (g, v, c) -> out (total_q, g, v). Keys and values come from ``_latent_keys_values``. For
    ``chunked_context_prefill``, which has checked the arguments: nothing is checked here."""
    total_q, h, _ = q_nope.shape
    if total_q == 0 or h == 0:
        return q_nope.new_empty(total_q, h, W_UV.shape[1])
    k, v = _latent_keys_values(kv_c, k_pe, W_UK, W_UV)
    if k.shape[-1] % 8 or v.shape[-1] % 8:
        # views into rows of g (d + r + v) values may start or step off a 16-byte boundary,
        # which SDPA's GPU kernels need: copied, then padded by _causal_sdpa where a width needs it
        k, v = k.contiguous(), v.contiguous()
    return _attend_rows(_joined(q_nope, q_pe), k, v, cu_seqlens_q, max_seqlen_q, float(softmax_scale))
