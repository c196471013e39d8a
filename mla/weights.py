"""MLAWeights: one layer's attention parameters, under the names of HF's DeepseekV2/V3 attention.

Every tier is built from one MLAWeights and reads its parameters, never a copy, so two tiers
built from the same object compute with the same numbers. The submodules carry HF's names, so
`MLAWeights(config).load_state_dict(hf_attention.state_dict())` works unchanged:

    q_a_proj            Linear(hidden -> q)        W^{DQ}            (with q_lora_rank)
    q_a_layernorm       RMSNorm(q)
    q_b_proj            Linear(q -> h·(d+r))       [W^{UQ}; W^{QR}]  per head
    q_proj              Linear(hidden -> h·(d+r))  [W^{Q}; W^{QR}]   (q_lora_rank None, V2-Lite)
    kv_a_proj_with_mqa  Linear(hidden -> c+r)      [W^{DKV}; W^{KR}]
    kv_a_layernorm      RMSNorm(c)
    kv_b_proj           Linear(c -> h·(d+v))       [W^{UK}; W^{UV}]  per head
    o_proj              Linear(h·v -> hidden)      W^{O}

The properties W_UQ, W_QR, W_UK, W_UV, W_O are per-head *views* of those matrices (no copies).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from .config import MLAConfig


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) · weight, computed in at least float32 (HF's DeepseekV2RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        x32 = x.to(compute_dtype)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLAWeights(nn.Module):
    """The attention parameters of one DeepSeek-V2/V3 layer.

    Args:
        config: the layer's sizes.
        dtype: parameter dtype (activations must match it).
        device: where the parameters live.
        seed: random init, reproducible across machines: each matrix ~ N(0, 1/fan_in) so that
            activations stay O(1) through random layers; norm weights 1 + N(0, 0.1^2) so that a
            forgotten norm weight shows in tests. Load a checkpoint to get real values.

    Attributes:
        tp_rank, tp_world_size: which share of the heads these weights hold: 0 and 1 for a
            whole layer, k and w for `shard(k, w)`. Plain ints, not parameters or buffers, so
            state dicts are HF's either way; a tier built with a process_group checks them
            against the group (`mla.base.MLAAttention`).
    """

    def __init__(self, config: MLAConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, seed: int = 0):
        super().__init__()
        self.config = config
        cfg = config
        h, d, r, v, c = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                         cfg.v_head_dim, cfg.kv_lora_rank)
        bias = cfg.attention_bias
        kw = dict(dtype=dtype, device=device)
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, h * (d + r), bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias, **kw)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps).to(**kw)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * (d + r), bias=False, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, c + r, bias=bias, **kw)
        self.kv_a_layernorm = RMSNorm(c, cfg.rms_norm_eps).to(**kw)
        self.kv_b_proj = nn.Linear(c, h * (d + v), bias=False, **kw)
        self.o_proj = nn.Linear(h * v, cfg.hidden_size, bias=bias, **kw)
        self.tp_rank, self.tp_world_size = 0, 1  # the whole layer; shard() sets its share
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Seeded random init (see the class docstring); drawn on the CPU in float64, then cast."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in sorted(self.named_parameters()):
            if name.endswith("layernorm.weight"):
                values = 1 + 0.1 * torch.randn(param.shape, generator=gen, dtype=torch.float64)
            elif name.endswith(".bias"):
                values = 0.1 * torch.randn(param.shape, generator=gen, dtype=torch.float64)
            else:
                fan_in = param.shape[1]
                values = torch.randn(param.shape, generator=gen, dtype=torch.float64) * fan_in**-0.5
            param.copy_(values)

    # ---- per-head views, the paper's matrices -------------------------------------------
    # Shapes in the legend of mla/config.py; the last axis is always the input of the map.
    @property
    def _q_heads(self) -> torch.Tensor:
        proj = self.q_proj if self.config.q_lora_rank is None else self.q_b_proj
        cfg = self.config
        return proj.weight.view(cfg.num_heads, cfg.qk_head_dim, -1)  # (h, d+r, q or hidden)

    @property
    def W_UQ(self) -> torch.Tensor:
        """(h, d, q): query latent -> per-head query without position (W^{Q}: (h, d, hidden) without q_lora)."""
        return self._q_heads[:, : self.config.qk_nope_head_dim]

    @property
    def W_QR(self) -> torch.Tensor:
        """(h, r, q): query latent -> per-head rotary query, before RoPE (input hidden without q_lora)."""
        return self._q_heads[:, self.config.qk_nope_head_dim:]

    @property
    def W_DKV(self) -> torch.Tensor:
        """(c, hidden): hidden -> KV latent."""
        return self.kv_a_proj_with_mqa.weight[: self.config.kv_lora_rank]

    @property
    def W_KR(self) -> torch.Tensor:
        """(r, hidden): hidden -> the rotary key shared by all heads, before RoPE."""
        return self.kv_a_proj_with_mqa.weight[self.config.kv_lora_rank:]

    @property
    def _kv_heads(self) -> torch.Tensor:
        cfg = self.config
        return self.kv_b_proj.weight.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                          cfg.kv_lora_rank)  # (h, d+v, c)

    @property
    def W_UK(self) -> torch.Tensor:
        """(h, d, c): KV latent -> per-head key without position."""
        return self._kv_heads[:, : self.config.qk_nope_head_dim]

    @property
    def W_UV(self) -> torch.Tensor:
        """(h, v, c): KV latent -> per-head value."""
        return self._kv_heads[:, self.config.qk_nope_head_dim:]

    @property
    def W_O(self) -> torch.Tensor:
        """(hidden, h, v): concatenated head outputs -> hidden."""
        cfg = self.config
        return self.o_proj.weight.view(cfg.hidden_size, cfg.num_heads, cfg.v_head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_b_proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.kv_b_proj.weight.device

    # ---- loading -------------------------------------------------------------------------
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter name this layer takes, with its shape."""
        return {name: tuple(p.shape) for name, p in self.state_dict().items()}

    def check_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Raise ValueError naming every missing, unexpected or mis-shaped tensor."""
        expected = self.expected_shapes()
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        misshaped = [f"{k}: got {tuple(state_dict[k].shape)}, expected {expected[k]}"
                     for k in sorted(set(expected) & set(state_dict))
                     if tuple(state_dict[k].shape) != expected[k]]
        problems = []
        if missing:
            problems.append(f"missing {missing}")
        if unexpected:
            problems.append(f"unexpected {unexpected}")
        if misshaped:
            problems.append("mis-shaped [" + "; ".join(misshaped) + "]")
        if problems:
            raise ValueError(f"state dict does not fit MLAWeights({self.config.name}, "
                             f"q_lora_rank={self.config.q_lora_rank}): " + ", ".join(problems))

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False):
        """Load an HF attention's state dict. Checked in full before anything is copied."""
        if strict:
            self.check_state_dict(state_dict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @classmethod
    def from_pretrained(cls, path: str | Path, layer: int = 0, *, config: MLAConfig | None = None,
                        dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> MLAWeights:
        """Load layer `layer`'s attention from an HF checkpoint directory (safetensors).

        Reads `config.json` (unless `config` is given) and `model.safetensors` or the shards of
        `model.safetensors.index.json`, opening only the shards that hold
        `model.layers.{layer}.self_attn.*`. FP8 block-quantised weights (DeepSeek-V3's release:
        float8_e4m3fn with `weight_scale_inv` per 128x128 block) are dequantised. `dtype` defaults
        to the checkpoint's (bfloat16 for FP8 checkpoints).
        """
        from safetensors import safe_open

        path = Path(path)
        if config is None:
            config_file = path / "config.json"
            if not config_file.is_file():
                raise FileNotFoundError(f"{config_file} not found; pass config= explicitly")
            config = MLAConfig.from_hf(json.loads(config_file.read_text()))
        prefix = f"model.layers.{layer}.self_attn."
        index_file = path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        elif (path / "model.safetensors").is_file():
            with safe_open(path / "model.safetensors", framework="pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{path} has neither model.safetensors nor model.safetensors.index.json")
        names = {k: shard for k, shard in weight_map.items() if k.startswith(prefix)}
        if not names:
            raise ValueError(f"{path} holds no tensor named {prefix}*; is layer {layer} there?")
        raw: dict[str, torch.Tensor] = {}
        for shard in sorted(set(names.values())):
            with safe_open(path / shard, framework="pt") as f:
                for key in (k for k, s in names.items() if s == shard):
                    raw[key[len(prefix):]] = f.get_tensor(key)
        state = _dequantize_fp8_blocks(raw)
        if dtype is None:
            dtype = next(iter(state.values())).dtype
        weights = cls(config, dtype=dtype, device=device)
        weights.load_state_dict({k: t.to(dtype) for k, t in state.items()})
        return weights

    # ---- tensor parallelism --------------------------------------------------------------
    def shard(self, rank: int, world_size: int) -> MLAWeights:
        """The weights of rank `rank`'s heads when `world_size` ranks split the heads evenly.

        Rank k takes heads k·h/w ... (k+1)·h/w - 1 (h = num_heads, w = world_size), as the
        system we started from does. What each rank keeps:

            q_b_proj / q_proj    the output rows of its heads       (h/w·(d+r), q or hidden)
            kv_b_proj            the output rows of its heads       (h/w·(d+v), c)
            o_proj.weight        the input columns of its heads     (hidden, h/w·v)
            q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm, o_proj.bias: all of it

        The latent path is replicated: every rank computes (and caches) the same c + r values a
        token. Each rank's o_proj gives a partial sum over its heads;
        `MLAAttention.reduce_and_bias` all-reduces the partials and then adds o_proj's bias, so
        the bias, kept whole on every shard, counts once. The softmax scale depends on d + r and
        YaRN only, not on h.

        Returns a new MLAWeights whose config has num_heads = h/w (its name notes "tp k/w") and
        whose tp_rank, tp_world_size record the share (sharding a shard again splits its share:
        rank k·w' + k', world size w·w'); its tensors are copies (same dtype and device), so
        changing one set of weights later does not change the other.
        """
        cfg = self.config
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
            raise ValueError(
                f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        if cfg.num_heads % world_size:
            raise ValueError(f"num_heads={cfg.num_heads} of {cfg.name!r} does not split evenly "
                             f"over world_size={world_size} ranks")
        h = cfg.num_heads // world_size
        heads = slice(rank * h, (rank + 1) * h)
        d, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        name = cfg.name if world_size == 1 else f"{cfg.name} tp {rank}/{world_size}"
        config = cfg.replace(num_heads=h, name=name)

        state = dict(self.state_dict())                          # replicated unless set below
        q_name = "q_proj.weight" if cfg.q_lora_rank is None else "q_b_proj.weight"
        q = state[q_name]                                        # (h·(d+r), q or hidden)
        state[q_name] = q.view(cfg.num_heads, d + r, -1)[heads].reshape(h * (d + r), -1)
        kv_b = state["kv_b_proj.weight"]                         # (h·(d+v), c)
        state["kv_b_proj.weight"] = kv_b.view(cfg.num_heads, d + v, -1)[heads].reshape(
            h * (d + v), -1)
        o = state["o_proj.weight"]                               # (hidden, h·v)
        state["o_proj.weight"] = o.view(-1, cfg.num_heads, v)[:, heads].reshape(-1, h * v)

        shard = MLAWeights(config, dtype=self.dtype, device=self.device)
        shard.load_state_dict(state)                             # copies into the new tensors
        shard.tp_rank = self.tp_rank * world_size + rank
        shard.tp_world_size = self.tp_world_size * world_size
        return shard.requires_grad_(self.kv_b_proj.weight.requires_grad)


def _dequantize_fp8_blocks(raw: dict[str, torch.Tensor], block: int = 128
                           ) -> dict[str, torch.Tensor]:
    """Fold `X.weight_scale_inv` (one float per block x block tile) into float8 weights `X.weight`."""
    out = {}
    for key, tensor in raw.items():
        if key.endswith(".weight_scale_inv"):
            continue
        scale_key = key + "_scale_inv"
        if scale_key in raw:
            scale = raw[scale_key].float()
            rows, cols = tensor.shape
            expanded = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
            tensor = (tensor.float() * expanded).to(torch.bfloat16)
        out[key] = tensor
    stray = [k for k in raw if k.endswith(".weight_scale_inv") and k[: -len("_scale_inv")] not in raw]
    if stray:
        raise ValueError(f"scales without their weights: {stray}")
    return out
