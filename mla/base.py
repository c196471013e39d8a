"""What all three tiers share: construction from MLAWeights, the call's checks, the output.

Every tier is an `MLAAttention` with the same two calls:

    cache = attn.new_cache(batch_size, max_seq_len)
    y = attn(x, cache, lengths=None)        # x (b, s, hidden) -> y (b, s, hidden)

`attn(x, cache, lengths)` appends the real tokens of each row to that row's cache at positions
seq_lens[i], seq_lens[i]+1, ... and attends causally over everything cached for the row. lengths
(b,) says how many of the s tokens of each row are real (right padding); 0 means the row sits
this call out. One call can mix prefill (a long row on an empty cache), extend (chunked
prefill: a long row on a cached prefix) and decode (one token). Outputs at padded positions are
zeros. Bad input raises before anything is written, so the cache is unchanged.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .cache import LatentCache
from .weights import MLAWeights

class MLAAttention(nn.Module):
    """Base of the tiers: holds the shared MLAWeights (a reference, never a copy).

    Args:
        weights: the layer's MLAWeights, whole or a `shard(rank, world_size)` of them.
        process_group: tensor parallelism over heads: each rank holds `weights.shard(rank, w)`
            and the tier all-reduces the heads' partial outputs over the group. The group's size
            must be the shard's world size and this process's rank in it the shard's rank
            (checked here): whole weights under a group of w ranks would sum w full outputs.
    """

    tier: str = "base"

    def __init__(self, weights: MLAWeights, *, process_group: Any = None):
        super().__init__()
        if not isinstance(weights, MLAWeights):
            raise TypeError(f"weights must be an mla.MLAWeights, got {type(weights).__name__}")
        if process_group is not None:
            _check_process_group(process_group, weights)
        self.weights = weights
        self.config = weights.config
        self.process_group = process_group
        self.softmax_scale = self.config.softmax_scale

    # ---- the cache ----------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_seq_len: int) -> LatentCache:
        """An empty latent cache for `batch_size` sequences of up to `max_seq_len` tokens."""
        batch_size = check_int("batch_size", batch_size, minimum=1)
        max_seq_len = check_int("max_seq_len", max_seq_len, minimum=1)
        cfg = self.config
        return LatentCache.empty(batch_size, max_seq_len, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                 dtype=self.weights.dtype, device=self.weights.device)

    # ---- checks shared by every tier -----------------------------------------------------
    def check_inputs(self, x: torch.Tensor, cache: Any, lengths: Any,
                     cache_type: type = LatentCache) -> torch.Tensor:
        """Validate one call; return lengths as a CPU int64 (b,) tensor. Writes nothing."""
        self.check_x(x)
        b, s, _ = x.shape
        if s == 0:
            raise ValueError("x must hold at least one token per row (shape (b, s>=1, hidden))")
        self.check_cache(cache, b, cache_type)
        lengths = _as_lengths(lengths, b, s)
        held = cache.seq_lens.tolist()                      # host ints: no tensor operators
        over = [i for i, n in enumerate(lengths.tolist()) if n > cache.max_seq_len - held[i]]
        if over:
            i = over[0]
            raise ValueError(
                f"appending {int(lengths[i])} tokens to row {i} (holding {int(cache.seq_lens[i])}) "
                f"would pass max_seq_len={cache.max_seq_len}")
        return lengths

    def check_x(self, x: torch.Tensor, *, ragged: bool = False) -> None:
        """x must be (b, s, hidden) (or (T, hidden) when `ragged`) in the weights' dtype and
        device. Reads only metadata."""
        cfg, w = self.config, self.weights
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        layout = "(tokens, " if ragged else "(batch, tokens, "
        if x.dim() != (2 if ragged else 3) or x.shape[-1] != cfg.hidden_size:
            raise ValueError(f"x must have shape {layout}hidden_size={cfg.hidden_size}), "
                             f"got {tuple(x.shape)}")
        if x.dtype != w.dtype:
            raise TypeError(f"x has dtype {x.dtype} but the weights are {w.dtype}; cast one of them")
        if x.device != w.device:
            raise ValueError(f"x is on {x.device} but the weights are on {w.device}")

    def check_cache(self, cache: Any, batch_size: int | None,
                    cache_type: type = LatentCache) -> None:
        """cache must be a `cache_type` that fits this layer (c, r, dtype, device) for a call of
        `batch_size` rows (None: any). Writes nothing."""
        cfg, w = self.config, self.weights
        if not isinstance(cache, cache_type):
            raise TypeError(f"cache must be a {cache_type.__name__} from this tier's new_cache(), "
                            f"got {type(cache).__name__}")
        batch_size = cache.batch_size if batch_size is None else batch_size
        cache.check_fits(batch_size=batch_size, kv_lora_rank=cfg.kv_lora_rank,
                         rope_dim=cfg.qk_rope_head_dim, dtype=w.dtype, device=w.device)

    # ---- the output projection, all-reduced under tensor parallelism ---------------------
    def output_projection(self, o: torch.Tensor) -> torch.Tensor:
        """Eq. (47): u = W^O [o_1; ...; o_h]. o (b, s, h, v) -> (b, s, hidden)."""
        return self.reduce_and_bias(torch.einsum("bshv,xhv->bsx", o, self.weights.W_O))

    def reduce_and_bias(self, y: torch.Tensor) -> torch.Tensor:
        """Sum the heads' partial outputs over the process group, then add o_proj's bias once."""
        if self.process_group is not None:
            dist.all_reduce(y, group=self.process_group)
        if self.weights.o_proj.bias is not None:
            y = y + self.weights.o_proj.bias
        return y

    def extra_repr(self) -> str:
        return f"tier={self.tier!r}, config={self.config.name!r}"


# ---- options of the tiers: refused when of the wrong type, never converted -------------------
def check_bool(name: str, value: Any) -> bool:
    """`value` if it is True or False; a TypeError naming option `name` otherwise (bool("no") is
    True, so converting would turn a refusal into its opposite)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """`value` as a Python int: ints, numpy integers and 0-d integer tensors pass; bools,
    floats and strings raise a TypeError naming `name` (True is not a count, 1.7 not an index).
    Below `minimum`: ValueError."""
    n = None
    if isinstance(value, torch.Tensor):
        ok = value.dim() == 0 and not value.dtype.is_floating_point and value.dtype != torch.bool
    else:
        ok = not isinstance(value, bool)
    if ok:
        try:
            n = operator.index(value)
        except TypeError:
            pass
    if n is None:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and n < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {n}")
    return n


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """`value` if it is one of the strings `choices`; TypeError or ValueError naming `name`."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {choices}, got {value!r} "
                        f"({type(value).__name__})")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _check_process_group(group: Any, weights: MLAWeights) -> None:
    """The group's size and this process's rank in it must be the shard's (MLAWeights.shard)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("process_group was given but torch.distributed is not initialised; "
                         "call torch.distributed.init_process_group first (see mla.parallel)")
    rank, world_size = weights.tp_rank, weights.tp_world_size
    size, group_rank = dist.get_world_size(group), dist.get_rank(group)
    if size != world_size:
        held = "the whole layer" if world_size == 1 else f"shard {rank} of {world_size}"
        raise ValueError(
            f"process_group has {size} ranks but the weights are {held} (tp_world_size="
            f"{world_size}); the all-reduce would sum {size} outputs of a {world_size}-way head "
            f"split. On rank k pass full_weights.shard(k, {size})")
    if group_rank != rank:
        raise ValueError(f"this process is rank {group_rank} of process_group but the weights are "
                         f"shard {rank} of {world_size}; rank k must hold weights.shard(k, "
                         f"{world_size})")


def _as_lengths(lengths: Any, b: int, s: int) -> torch.Tensor:
    if lengths is None:
        return torch.full((b,), s, dtype=torch.int64)
    if not isinstance(lengths, torch.Tensor):
        try:
            lengths = torch.tensor(lengths)
        except (TypeError, ValueError) as err:
            raise TypeError(f"lengths must be a (batch,) integer tensor or list, got {lengths!r}") \
                from err
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must hold integers, got dtype {lengths.dtype}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must have shape (batch,) = ({b},), got {tuple(lengths.shape)}")
    lengths = lengths.to("cpu", torch.int64)
    if bool(((lengths < 0) | (lengths > s)).any()):
        raise ValueError(f"lengths must lie in [0, tokens={s}], got {lengths.tolist()}")
    return lengths
