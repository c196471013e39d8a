"""Swap the tiers into transformers' DeepSeek-V2/V3 models; `generate()` runs unchanged.

    model = transformers.AutoModelForCausalLM.from_pretrained(path)   # DeepseekV2/V3
    mla.hf.swap_attention(model, "absorbed")                          # or "naive", "paged"
    out = model.generate(**batch, max_new_tokens=64)                  # same call, same tokens
    mla.hf.swap_back(model)                                           # transformers' attention

transformers' DeepseekV2/V3 attention caches the latent, as MLA intends, but every step it
up-projects the whole cached latent into per-head keys and values (t·h·(d + v) numbers a
sequence a layer) before attending. `swap_attention` puts `MLASelfAttention` in place of every
layer's attention: it builds the chosen tier from that layer's own projections (the same
`nn.Linear` and norm objects, no copy) and keeps the latent in the tier's own cache.

How the pieces meet transformers' conventions:

- The weights. `MLASelfAttention` registers the projections under the names transformers'
  attention gives them (q_a_proj, q_a_layernorm, q_b_proj or q_proj, kv_a_proj_with_mqa,
  kv_a_layernorm, kv_b_proj, o_proj), so `state_dict()` and `save_pretrained` write exactly the
  names of the original model, and `model.to(...)` moves the tier's weights with the model's.
- The cache. `generate()` makes a `DynamicCache` for each call. At its first step a swapped
  layer puts an `MLALayerCache` (a transformers cache layer) in its slot of that cache; the
  layer holds the tier's `LatentCache` or `PagedLatentCache` and lives and dies with the
  generation. `MLACache(model)` makes such a cache up front (`generate(..., cache=...)`).
  Capacity grows as the sequences do: contiguous caches by 1.5x, the paged tier's page pool
  likewise (the allocator hands pages to rows token by token; `num_blocks=` fixes the pool).
- Padding. transformers pads prompts on the LEFT and counts positions from each row's first
  real token (`position_ids = attention_mask.cumsum(-1) - 1`); the tiers take RIGHT padding
  (`lengths`) and count each row's positions from its cached length. Each call moves a row's
  real tokens to the front, caches only those (pad tokens never enter the latent cache) and
  puts the outputs back in place; zeros at pad positions. A call without padded rows (every
  step of generate after the prompt) moves nothing.
- One read a step. The mask and position ids live on the GPU, and reading them on the host
  waits for the GPU to finish the work queued before. The model's first layer reads them at
  each step and the other layers reuse what it read (`_StepInputs`, kept beside the step's
  Cache), so a step waits for those two reads, not for two reads a layer (without a cache,
  as with `use_cache=False`, each layer reads them).

Shapes: b batch, s new tokens, t cached tokens, h heads, d nope dim, r rope dim, v value dim,
c kv_lora_rank.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

from .cache import LatentCache
from .config import MLAConfig
from .memory import attention_flops
from .paged import PagedLatentCache
from .tiers import TIERS, build
from .weights import MLAWeights

try:
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
except ImportError as err:  # pragma: no cover - transformers is a dependency of this module
    raise ImportError("mla.hf needs transformers (pip install transformers)") from err

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
# The submodules of transformers' DeepseekV2/V3 attention that MLAWeights takes, by name.
PROJECTIONS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa",
               "kv_a_layernorm", "kv_b_proj", "o_proj")
# Room a new or grown cache gives each row beyond what the call needs, in tokens; capacities
# are whole multiples of it.
HEADROOM = 256


# ---- finding the attention modules ---------------------------------------------------------
def _attention_classes() -> tuple[type, ...]:
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    return DeepseekV2Attention, DeepseekV3Attention


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a DeepseekV2/V3 model (ForCausalLM or base); raise otherwise."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model, nn.Module) or model_type not in MODEL_TYPES:
        raise TypeError(
            f"model must be a transformers DeepseekV2/V3 model (ForCausalLM or base model, "
            f"config.model_type in {MODEL_TYPES}), got {type(model).__name__}"
            + (f" with model_type {model_type!r}" if model_type else ""))
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(hasattr(x, "self_attn") for x in layers):
        raise TypeError(f"model ({type(model).__name__}) has no decoder layers with self_attn; "
                        f"expected DeepseekV2/V3ForCausalLM or DeepseekV2/V3Model")
    return layers


def swapped_tier(model: nn.Module) -> str | None:
    """The tier swapped into `model` by `swap_attention`, or None for transformers' attention."""
    tiers = {layer.self_attn.tier.tier for layer in _decoder_layers(model)
             if isinstance(layer.self_attn, MLASelfAttention)}
    return tiers.pop() if tiers else None


# ---- swapping ------------------------------------------------------------------------------
def swap_attention(model: nn.Module, tier: str, **options: Any) -> nn.Module:
    """Put `tier` ("naive", "absorbed" or "paged") in place of every layer's attention.

    Args:
        model: a transformers DeepseekV2ForCausalLM / DeepseekV3ForCausalLM, or their base
            models, with transformers' own attention in every layer.
        tier: the mla tier to run (`mla.TIERS`).
        **options: passed to the tier's class through `mla.build` (e.g. `block_size`,
            `num_blocks`, `prefill` for "paged"; `precompute` for "absorbed"). With
            `num_blocks` the paged tier's page pool has that fixed size; without it the pool
            grows with the sequences.

    Returns:
        The same model, changed in place. `model.generate(...)` runs as before; `swap_back`
        restores transformers' attention. Bad input (not a DeepSeek V2/V3 model, an unknown
        tier or option, a model already swapped) raises before any layer changes.
    """
    layers = _decoder_layers(model)
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; expected one of {list(TIERS)}")
    current = swapped_tier(model)
    if current is not None:
        raise ValueError(f"model already has the {current!r} tier swapped in; call "
                         f"mla.hf.swap_back(model) before swapping again")
    attention_classes = _attention_classes()
    for i, layer in enumerate(layers):
        if not isinstance(layer.self_attn, attention_classes):
            raise TypeError(f"layer {i}'s self_attn is a {type(layer.self_attn).__name__}, not "
                            f"transformers' DeepseekV2Attention/DeepseekV3Attention")
    if getattr(model.config, "rope_interleave", True) is False:
        raise ValueError("model.config.rope_interleave is False (RoPE over rotated halves); the "
                         "tiers rotate DeepSeek's interleaved pairs, as every released "
                         "checkpoint does")
    config = MLAConfig.from_hf(model.config)
    # Build every replacement first: an error in any of them leaves the model as it was.
    swapped = [MLASelfAttention(layer.self_attn, config, tier, options) for layer in layers]
    swapped[0].opens_step = True           # the first layer of a step reads its inputs anew
    for layer, attention in zip(layers, swapped):
        layer.self_attn = attention
    return model


def swap_back(model: nn.Module) -> nn.Module:
    """Restore transformers' attention in every layer swapped by `swap_attention`.

    The original modules come back holding the projections the model holds now (moved, cast or
    replaced since the swap), so the model is the one transformers would have.
    """
    layers = _decoder_layers(model)
    if swapped_tier(model) is None:
        raise ValueError("model has no mla tier swapped in (nothing to swap back)")
    for layer in layers:
        attention = layer.self_attn
        if isinstance(attention, MLASelfAttention):
            layer.self_attn = attention.original()
    return model


# ---- the replacement attention -------------------------------------------------------------
class MLASelfAttention(nn.Module):
    """One layer's attention, computed by an mla tier over the layer's own projections.

    Called as transformers' DeepseekV2/V3 attention is (`hidden_states`, `attention_mask`,
    `cache`, `position_ids`, ...); returns `(output, None)` (no attention weights).

    Attributes:
        tier: the mla layer (`mla.build(weights, tier)`); not a registered submodule, so the
            parameters appear once, under transformers' names.
        layer_idx: the layer's index, as transformers' attention has it.
    """

    def __init__(self, hf_attention: nn.Module, config: MLAConfig, tier: str,
                 options: dict[str, Any]):
        super().__init__()
        self.layer_idx = hf_attention.layer_idx
        self.config = hf_attention.config
        for name in PROJECTIONS:
            module = getattr(hf_attention, name, None)
            if module is not None:
                setattr(self, name, module)  # the same object: no copy
        weights = _shared_weights(config, self)
        object.__setattr__(self, "tier", build(weights, tier, **options))
        object.__setattr__(self, "_original", hf_attention)
        # A paged tier built with num_blocks keeps that pool; without, the pool grows.
        self.fixed_blocks = options.get("num_blocks") if tier == "paged" else None
        # The model's first layer reads each step's mask and position ids; the others reuse
        # what it read where they are handed the same inputs (`_step_inputs`).
        self.opens_step = False

    def original(self) -> nn.Module:
        """transformers' attention module, holding this module's current projections."""
        for name in PROJECTIONS:
            if name in self._modules:
                setattr(self._original, name, self._modules[name])
        return self._original

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings: Any = None, cache: Cache | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Cache | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
        # position_embeddings (transformers' cos/sin) go unused: the tier computes the same RoPE
        # from the config, at the positions it assigns (checked against position_ids below).
        x = hidden_states                                          # (b, s, hidden)
        b, s, _ = x.shape
        cache = cache if cache is not None else past_key_values
        layer_cache = (MLALayerCache(self) if cache is None        # no cache: this call only
                       else _layer_cache(cache, self))
        step = _step_inputs(cache, attention_mask, position_ids, b, s, x.device,
                            fresh=self.opens_step)
        cached = layer_cache.row_lengths(b)
        step.check_positions(cached, self.layer_idx)

        # Left padding -> right padding: row i's real tokens move to columns 0 .. lengths[i]-1.
        x_right = x if step.shift is None else x.gather(1, step.shift[..., None].expand_as(x))
        mla_cache = layer_cache.reserve(step.lengths)
        y_right = self.tier(x_right, mla_cache, step.lengths)      # zeros past lengths[i]
        layer_cache.seen += s
        if step.shift is None:
            return y_right, None

        # ... and back: output column j of row i is y_right[i, j - starts[i]] for real tokens.
        y = y_right.gather(1, step.back[..., None].expand_as(y_right))
        return torch.where(step.keep[..., None], y, 0.0), None

    def extra_repr(self) -> str:
        return f"tier={self.tier.tier!r}, layer_idx={self.layer_idx}"


def _shared_weights(config: MLAConfig, module: nn.Module) -> MLAWeights:
    """An MLAWeights whose submodules are `module`'s (the same objects): made on the meta
    device, so nothing is allocated or drawn, then given the real projections."""
    with torch.device("meta"):
        weights = MLAWeights(config)
    for name in dict(weights.named_children()):
        setattr(weights, name, getattr(module, name))
    return weights


# ---- reading transformers' inputs ----------------------------------------------------------
class _StepInputs:
    """What one model step's attention mask and position ids say, read on the host once for
    every layer of the step (a read of a GPU tensor waits for the GPU).

    lengths, starts (b,) int64 on the CPU: row i's real tokens are columns starts[i] .. s - 1.
    positions: the position ids as (b, s) on the CPU, or None.
    shift, back, keep: (b, s) on the layers' device, None when no row is padded: the gather
    index that moves each row's real tokens to the front (left padding -> right padding), the
    one that moves the outputs back, and which outputs are real.
    """

    def __init__(self, attention_mask: Any, position_ids: torch.Tensor | None, b: int, s: int,
                 device: torch.device):
        self.lengths, self.starts = _left_padded(_real_tokens(attention_mask, b, s))
        self.positions = (None if position_ids is None
                          else position_ids.reshape(-1, s).expand(b, s).cpu())
        self.inputs = (_held(attention_mask), _held(position_ids), b, s, device)
        self.checked: list[list[int]] = []       # cached lengths the positions were checked for
        self.shift = self.back = self.keep = None
        if bool(self.starts.any()):
            j = torch.arange(s)[None, :]
            back = j - self.starts[:, None]                                     # (b, s)
            moves = torch.stack([(j + self.starts[:, None]).clamp_max(s - 1),   # shift
                                 back.clamp_min(0), (back >= 0).long()])        # back, keep
            moves = _to_device(moves, device)
            self.shift, self.back, self.keep = moves[0], moves[1], moves[2].bool()

    def matches(self, attention_mask: Any, position_ids: Any, b: int, s: int,
                device: torch.device) -> bool:
        """Whether these are this step's inputs: the same objects, unchanged, and shapes."""
        mask, pos, *rest = self.inputs
        return rest == [b, s, device] and _same(mask, attention_mask) and _same(pos, position_ids)

    def check_positions(self, cached: torch.Tensor, layer_idx: int) -> None:
        """`_check_positions` for a layer whose rows hold `cached` tokens (once a step for
        each distinct `cached`: the layers of a model all hold the same)."""
        key = cached.tolist()
        if key not in self.checked:
            _check_positions(self.positions, self.starts, cached, layer_idx)
            self.checked.append(key)


def _held(t: Any) -> tuple | None:
    """A weak reference to an input tensor and its version (None for an inference tensor,
    which keeps none)."""
    if t is None:
        return None
    return weakref.ref(t), None if t.is_inference() else t._version


def _same(held: tuple | None, t: Any) -> bool:
    if held is None or t is None:
        return held is None and t is None
    ref, version = held
    return ref() is t and version == (None if t.is_inference() else t._version)


# The inputs of the step each transformers Cache is in, for the step's layers to share.
_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _step_inputs(cache: Cache | None, attention_mask: Any, position_ids: Any, b: int, s: int,
                 device: torch.device, *, fresh: bool) -> _StepInputs:
    """The step's `_StepInputs`: read anew by the model's first layer (`fresh`) and shared by
    the others where a cache ties the step's layers together and they are handed the same,
    unchanged inputs (a guard: a buffer written in place under inference mode, which keeps no
    versions, is caught by the first layer's fresh read); read by each call without a cache."""
    step = None if fresh or cache is None else _STEPS.get(cache)
    if step is None or not step.matches(attention_mask, position_ids, b, s, device):
        step = _StepInputs(attention_mask, position_ids, b, s, device)
        if cache is not None:
            _STEPS[cache] = step
    return step


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: through pinned memory on a GPU."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _real_tokens(attention_mask: Any, b: int, s: int) -> torch.Tensor:
    """(b, s) bool on the CPU: which of this call's s tokens are real (not padding).

    transformers hands the attention a mask over (cached + new) keys: None (no padding),
    (b, kv) as the flash-attention path does, or (b or 1, 1, s, kv) as eager (float, 0 where
    visible) and SDPA (bool, True where visible) do. Under left padding the last new token is
    real and sees every real key, so the mask's last query row tells which new tokens are real.
    """
    if attention_mask is None:
        return torch.ones(b, s, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask of type {type(attention_mask).__name__} is not "
                        f"supported by mla.hf; load the model with attn_implementation='sdpa' or "
                        f"'eager'")
    if attention_mask.dim() == 2:
        visible = attention_mask[:, -s:]
    elif attention_mask.dim() == 4:
        visible = attention_mask[:, 0, -1, -s:]                  # the last query's row
    else:
        raise ValueError(f"attention_mask must be 2-D (b, kv) or 4-D (b, 1, s, kv), got shape "
                         f"{tuple(attention_mask.shape)}")
    if visible.dtype != torch.bool:
        visible = (visible == 0) if attention_mask.dim() == 4 else (visible != 0)
    return visible.expand(b, s).cpu()


def _left_padded(real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lengths (b,) and starts (b,): each row's real tokens are columns starts .. s-1."""
    b, s = real.shape
    lengths = real.sum(1)
    starts = s - lengths
    suffix = torch.arange(s)[None, :] >= starts[:, None]
    bad = torch.nonzero((suffix != real).any(1)).flatten().tolist()
    if bad:
        i = bad[0]
        raise ValueError(
            f"row {i} of the batch has padding after a real token (attention mask "
            f"{real[i].int().tolist()}); mla.hf takes left padding, as transformers' generate "
            f"expects (tokenizer.padding_side = 'left')")
    return lengths, starts


def _check_positions(pos: torch.Tensor | None, starts: torch.Tensor, cached: torch.Tensor,
                     layer_idx: int) -> None:
    """The tiers place row i's new tokens at positions cached[i], cached[i] + 1, ...; the model's
    position_ids (`pos`, (b, s) on the CPU) must say the same, or the tier's RoPE would differ
    from transformers'."""
    if pos is None:
        return
    j = torch.arange(pos.shape[1])[None, :]
    expected = cached[:, None] + j - starts[:, None]
    wrong = (j >= starts[:, None]) & (pos != expected)
    if bool(wrong.any()):
        i = int(torch.nonzero(wrong.any(1))[0])
        got = pos[i, int(starts[i]):].tolist()
        raise ValueError(
            f"layer {layer_idx}: row {i}'s real tokens have position_ids {got[:8]}..., but the row "
            f"holds {int(cached[i])} cached tokens, so they sit at {int(cached[i])}, "
            f"{int(cached[i]) + 1}, ...; with left padding pass position_ids = "
            f"attention_mask.cumsum(-1) - 1 (generate does)")


# ---- the cache -----------------------------------------------------------------------------
class MLALayerCache(CacheLayerMixin):
    """A transformers cache layer that holds one swapped layer's latent cache.

    transformers sees a cache of `seen` positions a row (padding included, as its masks count
    them); the tier's cache (`LatentCache` or `PagedLatentCache`, in `latent`) holds each row's
    real tokens only. Capacity grows as the rows do: a contiguous cache is re-made 1.5x longer
    (rows copied over); the paged tier's pool of pages grows the same way (rows re-appended),
    unless the tier was built with a fixed `num_blocks`, in which case running out of pages
    raises `mla.paged.OutOfBlocksError`.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, owner: MLASelfAttention):
        super().__init__()
        self.owner = owner
        self.attn = owner.tier
        self.latent: LatentCache | PagedLatentCache | None = None
        self.seen = 0  # positions transformers has passed through this layer, padding included

    # ---- what transformers asks of a cache layer ------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the latent cache is made at the first call, when the batch size is known

    def update(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("a swapped MLA layer writes its latent cache itself; "
                                  "MLALayerCache.update is not called")

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.latent, self.seen = None, 0

    def offload(self) -> None:
        pass  # the latent stays on the tier's device

    def prefetch(self) -> None:
        pass

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("cropping a swapped MLA layer's cache is not supported "
                                  "(assisted generation); swap_back(model) to use it")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.latent is not None:
            self._remake(torch.as_tensor(indices).to("cpu", torch.int64).tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.latent is not None:
            rows = [i for i in range(self.latent.batch_size) for _ in range(repeats)]
            self._remake(rows)

    # ---- what the swapped attention asks --------------------------------------------------
    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self.latent is not None

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        pass  # CacheLayerMixin.__init__ sets it; here it follows `latent`

    @property
    def paged(self) -> bool:
        return isinstance(self.latent, PagedLatentCache)

    def row_lengths(self, b: int) -> torch.Tensor:
        """(b,) int64 on the CPU: real tokens cached in each row (zeros before the first call)."""
        if self.latent is None:
            return torch.zeros(b, dtype=torch.int64)
        if self.latent.batch_size != b:
            raise ValueError(f"the cache holds {self.latent.batch_size} rows but this call has "
                             f"batch {b}")
        return self.latent.seq_lens.clone()

    def reserve(self, lengths: torch.Tensor):
        """The tier's cache, with room for `lengths` (b,) more tokens in each row."""
        b = lengths.numel()
        fixed = self.owner.fixed_blocks
        if self.latent is None:
            need = int(lengths.max()) if b else 0
            self.latent = self._new(b, _capacity(need), fixed or self._blocks_for(lengths, b))
            return self.latent
        need = int((self.latent.seq_lens + lengths).max())
        if isinstance(self.latent, PagedLatentCache):
            if fixed:
                return self.latent  # the allocator raises OutOfBlocksError if it runs out
            rows = torch.arange(b)
            short = int(self.latent.blocks_needed(rows, lengths).sum()) - self.latent.num_free_blocks
            if short > 0:
                held = self.latent.num_blocks - self.latent.num_free_blocks
                blocks = max(held + short + b, self.latent.num_blocks * 3 // 2)
                self._remake(list(range(b)), blocks)
        elif need > self.latent.max_seq_len:
            self._remake(list(range(b)), None, _capacity(need, self.latent.max_seq_len))
        return self.latent

    # ---- helpers ----------------------------------------------------------------------------
    def _blocks_for(self, lengths: torch.Tensor, b: int) -> int | None:
        if self.attn.tier != "paged":
            return None
        n = self.attn.block_size
        return sum(math.ceil((int(new) + HEADROOM) / n) for new in lengths) or b

    def _new(self, b: int, max_seq_len: int, num_blocks: int | None):
        if num_blocks is None:
            return self.attn.new_cache(b, max_seq_len)
        # every row may hold the whole pool: the block table is as wide as the pool
        return self.attn.new_cache(b, num_blocks * self.attn.block_size, num_blocks=num_blocks)

    def _remake(self, rows: list[int], num_blocks: int | None = None,
                max_seq_len: int | None = None) -> None:
        """Replace the tier's cache by a new one whose row k holds old row rows[k]."""
        old = self.latent
        assert old is not None
        if isinstance(old, PagedLatentCache):
            new = self._new(len(rows), 0, num_blocks or old.num_blocks)
            for k, i in enumerate(rows):       # bytes as stored, an fp8_e4m3 scale kept
                if int(old.seq_lens[i]):
                    new.append_stored(old.gather(i, stored=True), k, kv_scale=old.kv_scale)
        else:
            new = self._new(len(rows), max_seq_len or old.max_seq_len, None)
            idx = torch.tensor(rows, dtype=torch.int64)
            t = int(old.seq_lens.max())
            new.kv_c[:, :t] = old.kv_c[idx.to(old.device), :t]
            new.k_pe[:, :t] = old.k_pe[idx.to(old.device), :t]
            new.seq_lens.copy_(old.seq_lens[idx])
        self.latent = new

    def __repr__(self) -> str:
        return f"MLALayerCache(tier={self.attn.tier!r}, seen={self.seen}, latent={self.latent!r})"


def _capacity(need: int, old: int = 0) -> int:
    """Tokens a row of a new contiguous cache holds: `need` plus HEADROOM, at least 1.5x `old`,
    rounded up to a whole multiple of HEADROOM."""
    target = max(need + HEADROOM, old * 3 // 2)
    return math.ceil(target / HEADROOM) * HEADROOM


def _layer_cache(cache: Cache, owner: MLASelfAttention) -> MLALayerCache:
    """The MLALayerCache in the slot of `owner`'s layer in a transformers Cache, put there on
    first use."""
    layer_idx = owner.layer_idx
    if not isinstance(cache, Cache):
        raise TypeError(f"cache must be a transformers Cache (DynamicCache or mla.hf.MLACache), "
                        f"got {type(cache).__name__}")
    if cache.layer_class_to_replicate is not None:
        while len(cache.layers) <= layer_idx:
            cache.layers.append(cache.layer_class_to_replicate())
    if layer_idx >= len(cache.layers):
        raise ValueError(f"the cache has {len(cache.layers)} layers; layer {layer_idx} has no slot")
    slot = cache.layers[layer_idx]
    if isinstance(slot, MLALayerCache):
        if slot.owner is not owner:
            raise ValueError(f"layer {layer_idx}'s cache was made for another swapped model or "
                             f"swap; start a new cache for this one")
        return slot
    if type(slot) is DynamicLayer and slot.get_seq_length() == 0:
        cache.layers[layer_idx] = MLALayerCache(owner)
        return cache.layers[layer_idx]
    raise ValueError(
        f"layer {layer_idx}'s slot of the cache holds a {type(slot).__name__}"
        f"{' with tokens' if isinstance(slot, DynamicLayer) else ''}; a swapped model caches "
        f"latents in its own layers: pass an empty DynamicCache or mla.hf.MLACache(model)")


class MLACache(Cache):
    """A transformers Cache for a swapped model, one MLALayerCache a layer.

    `generate()` makes its own (a DynamicCache that the swapped layers fill with
    MLALayerCache); make this one to hold the cache yourself, e.g. to read `latent_bytes()`.
    """

    def __init__(self, model: nn.Module):
        layers = _decoder_layers(model)
        attns = [layer.self_attn for layer in layers]
        if not all(isinstance(a, MLASelfAttention) for a in attns):
            raise ValueError("MLACache(model) needs a model with an mla tier swapped in "
                             "(mla.hf.swap_attention)")
        super().__init__(layers=[MLALayerCache(a) for a in attns])

    def latent_bytes(self) -> int:
        """Bytes the layers' latent caches hold (contiguous buffers or page pools)."""
        total = 0
        for layer in self.layers:
            latent = layer.latent
            if isinstance(latent, PagedLatentCache):
                total += latent.kv_cache.numel() * latent.kv_cache.element_size()
            elif latent is not None:
                total += sum(t.numel() * t.element_size() for t in (latent.kv_c, latent.k_pe))
        return total


# ---- the arithmetic of one decode step -----------------------------------------------------
def decode_step_costs(config: MLAConfig, t: int, bytes_per_element: int = 2) -> dict[str, dict]:
    """FLOPs and transient bytes of one decode step of one sequence over t cached tokens, one
    layer, beyond the projections every implementation shares.

    transformers (and the naive tier) up-project the cache: kv_b_proj makes t·h·(d + v) values
    (2·t·c·h·(d + v) FLOPs), transformers copies the keys into a t·h·(d + r) tensor, and MHA
    over them costs 2·t·h·(d + r + v). The absorbed and paged tiers fold W_UK into the query
    and W_UV into the output (2·c·h·(d + v)) and attend over the latent itself: 2·t·h·(2c + r),
    holding h·t scores (float32) and no per-head key or value. Scores (float32) are counted for
    all. The FLOPs are `mla.memory.attention_flops(config, 1, t)`'s (t >= 1 counts the new token,
    which the cache holds before the step attends).
    """
    h, d, r, v = (config.num_heads, config.qk_nope_head_dim, config.qk_rope_head_dim,
                  config.v_head_dim)
    flops = attention_flops(config, 1, t)
    up_flops, absorbed_flops = flops.up_projected, flops.absorbed
    scores = 4 * h * t
    return {
        "transformers": dict(flops=up_flops,
                             transient_bytes=t * h * (2 * d + r + v) * bytes_per_element + scores),
        "naive": dict(flops=up_flops, transient_bytes=t * h * (d + v) * bytes_per_element + scores),
        "absorbed": dict(flops=absorbed_flops, transient_bytes=scores),
        "paged": dict(flops=absorbed_flops, transient_bytes=scores),
    }


# ---- random models for demos and benchmarks ------------------------------------------------
def random_model(config: MLAConfig, *, num_layers: int = 2, vocab_size: int = 1024,
                 intermediate_size: int | None = None, moe: bool = True,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 attn_implementation: str = "eager", seed: int = 0) -> nn.Module:
    """A transformers DeepseekV3ForCausalLM with `config`'s attention and random weights.

    `moe=True` makes every layer after the first a small mixture of experts (4 routed, 2 a
    token), as V3's layers are; `moe=False` keeps every MLP dense. transformers' own init
    draws the weights (normal, std 0.02 scaled up to keep a small model's activations O(1)).
    """
    import transformers

    fields = config.to_hf_dict()
    intermediate = intermediate_size or 2 * config.hidden_size
    fields.update(vocab_size=vocab_size, num_hidden_layers=num_layers,
                  num_key_value_heads=config.num_heads, intermediate_size=intermediate,
                  moe_intermediate_size=max(1, intermediate // 4), n_routed_experts=4,
                  num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                  first_k_dense_replace=1 if moe else num_layers,
                  initializer_range=min(0.2, 1.0 / config.hidden_size ** 0.5),
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf_config = transformers.DeepseekV3Config(**fields)
    hf_config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.DeepseekV3ForCausalLM(hf_config)
    return model.to(dtype).eval()
