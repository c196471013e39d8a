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

The properties W_UQ, W_QR, W_UK, W_UV, W_O are per-head views of those matrices (no copies).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from .config import MLAConfig

# Names some checkpoints carry beside the parameters: RoPE's θ_i, which mla.rope computes from
# the config. Loading skips them.
IGNORED_KEYS = ("rotary_emb.inv_freq",)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
              torch.float8_e5m2fnuz)
FP8_BLOCK = 128  # DeepSeek-V3's fp8 weights carry one scale per 128 x 128 block


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
    def W_Q(self) -> torch.Tensor:
        """(h, d+r, q): [W^{UQ}; W^{QR}] per head, both query up-projections as one matrix (input
        hidden without q_lora)."""
        proj = self.q_proj if self.config.q_lora_rank is None else self.q_b_proj
        cfg = self.config
        return proj.weight.view(cfg.num_heads, cfg.qk_head_dim, -1)

    @property
    def W_UQ(self) -> torch.Tensor:
        """(h, d, q): query latent -> per-head query without position (W^{Q}: (h, d, hidden) without q_lora)."""
        return self.W_Q[:, : self.config.qk_nope_head_dim]

    @property
    def W_QR(self) -> torch.Tensor:
        """(h, r, q): query latent -> per-head rotary query, before RoPE (input hidden without q_lora)."""
        return self.W_Q[:, self.config.qk_nope_head_dim:]

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

    def check_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True
                         ) -> None:
        """Raise ValueError naming every tensor that does not fit; change nothing.

        Checked always: each tensor this layer takes has its shape and a floating-point,
        non-fp8 dtype (fp8 weights need their scales, which `from_pretrained` applies). With
        `strict`, also missing and unexpected names. `IGNORED_KEYS` are skipped.
        """
        expected = self.expected_shapes()
        names = set(state_dict) - set(IGNORED_KEYS)
        misshaped, mistyped = [], []
        for key in sorted(names & set(expected)):
            tensor = state_dict[key]
            if not isinstance(tensor, torch.Tensor):
                mistyped.append(f"{key}: {type(tensor).__name__}, expected a tensor")
            elif tuple(tensor.shape) != expected[key]:
                misshaped.append(f"{key}: got {tuple(tensor.shape)}, expected {expected[key]}")
            elif not tensor.is_floating_point() or tensor.dtype in FP8_DTYPES:
                mistyped.append(f"{key}: {_dtype_name(tensor.dtype)}, expected a float dtype "
                                "(from_pretrained dequantises float8 weights)")
        problems = []
        if strict:
            missing = sorted(set(expected) - names)
            unexpected = sorted(names - set(expected))
            if missing:
                problems.append(f"missing {missing}")
            if unexpected:
                problems.append(f"unexpected {unexpected}")
        if misshaped:
            problems.append("mis-shaped [" + "; ".join(misshaped) + "]")
        if mistyped:
            problems.append("wrong type [" + "; ".join(mistyped) + "]")
        if problems:
            raise ValueError(f"state dict does not fit MLAWeights({self.config.name}, "
                             f"q_lora_rank={self.config.q_lora_rank}): " + ", ".join(problems))

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False):
        """Load an HF attention's state dict, checked in full before anything is copied.

        `strict=False` lets names be missing or unexpected, as in `nn.Module`; a tensor of the
        wrong shape or dtype is refused either way (`check_state_dict`). `IGNORED_KEYS` are
        skipped.
        """
        self.check_state_dict(state_dict, strict=strict)
        state = {k: t for k, t in state_dict.items() if k not in IGNORED_KEYS}
        return super().load_state_dict(state, strict=strict, assign=assign)

    @classmethod
    def from_pretrained(cls, path: str | Path, layer: int = 0, *, config: MLAConfig | None = None,
                        dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> MLAWeights:
        """Load layer `layer`'s attention from an HF checkpoint directory (safetensors).

        Reads `config.json` (unless `config` is given) and `model.safetensors` or the shards of
        `model.safetensors.index.json`, opening only the shards that hold
        `model.layers.{layer}.self_attn.*`. FP8 block-quantised weights (DeepSeek-V3's release:
        float8_e4m3fn with a `weight_scale_inv` per 128x128 block) are dequantised; their scales
        are checked. `dtype` defaults to the checkpoint's: the dtype of the projection weights,
        bfloat16 for fp8 ones; projections of mixed dtypes need `dtype` given. A file that
        cannot be read or a tensor that does not fit raises an error naming it.
        """
        path = Path(path)
        if config is None:
            config_file = path / "config.json"
            if not config_file.is_file():
                raise FileNotFoundError(f"{config_file} not found; pass config= explicitly")
            try:
                config = MLAConfig.from_hf(_read_json(config_file, "an HF model config"))
            except (TypeError, ValueError) as err:
                raise ValueError(f"{config_file}: {err}") from err
        prefix = f"model.layers.{layer}.self_attn."
        files = _layer_files(path, prefix)
        raw: dict[str, torch.Tensor] = {}
        for file, keys in files.items():
            raw.update({key[len(prefix):]: t for key, t in _read_tensors(file, keys).items()})
        where = f"{path}: {prefix}"
        state, checkpoint_dtype = _dequantize_fp8_blocks(raw, where=where)
        weights = cls(config, dtype=dtype or checkpoint_dtype(), device=device)
        try:
            weights.load_state_dict({k: t.to(weights.dtype) for k, t in state.items()})
        except ValueError as err:
            raise ValueError(f"{path}, layer {layer}: {err}") from err
        return weights

    # ---- tensor parallelism --------------------------------------------------------------
    def shard(self, rank: int, world_size: int) -> MLAWeights:
        """The weights of rank `rank`'s heads when `world_size` ranks split the heads evenly.

        Rank k takes heads k·h/w ... (k+1)·h/w - 1 (h = num_heads, w = world_size): the rows of
        its heads in q_b_proj (or q_proj) and kv_b_proj, the columns of its heads in o_proj's
        weight, and all of the latent path and o_proj's bias, which `reduce_and_bias` adds once
        after the all-reduce (table and reasons: docs/tensor-parallel.md).

        Returns a new MLAWeights whose config has num_heads = h/w (its name notes "tp k/w") and
        whose tp_rank, tp_world_size record the share (sharding a shard again splits its share:
        rank k·w' + k', world size w·w'); its tensors are copies, same dtype and device.
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


def _read_json(file: Path, what: str) -> dict:
    """The JSON object in `file`; ValueError naming the file when it is not one."""
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file}: not valid JSON ({err}); expected {what}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object ({what}), got {type(data).__name__}")
    return data


def _layer_files(path: Path, prefix: str) -> dict[Path, list[str]]:
    """The safetensors files of `path` that hold tensors named `prefix*`, with those names."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = _read_json(index_file, 'an index {"weight_map": {tensor name: shard file}}'
                                ).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ValueError(f"{index_file}: expected a 'weight_map' object of tensor name -> "
                             f"shard file, got {weight_map!r:.80}")
    elif (path / "model.safetensors").is_file():
        with _safetensors(path / "model.safetensors") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        raise FileNotFoundError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json")
    files: dict[Path, list[str]] = {}
    for key, shard in sorted(weight_map.items()):
        if key.startswith(prefix) and key[len(prefix):] not in IGNORED_KEYS:
            files.setdefault(path / shard, []).append(key)
    if not files:
        raise ValueError(f"{path} holds no tensor named {prefix}*; is that layer there?")
    for file, keys in files.items():
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found; {index_file} puts {keys[0]} there")
    return files


@contextmanager
def _safetensors(file: Path):
    """safe_open(file), with any read error raised as ValueError naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file}: not a readable safetensors file ({err})") from err


def _read_tensors(file: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    with _safetensors(file) as f:
        missing = sorted(set(keys) - set(f.keys()))
        if missing:
            raise ValueError(f"{file}: holds no tensor {missing[0]}, which the index puts there")
        return {key: f.get_tensor(key) for key in keys}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dequantize_fp8_blocks(raw: dict[str, torch.Tensor], *, where: str = "",
                           block: int = FP8_BLOCK):
    """Fold `X.weight_scale_inv` (one float per block x block tile) into float8 weights `X.weight`.

    Returns the tensors (dequantised ones in float32) and a function giving the checkpoint's
    dtype: that of the projection weights, an fp8 one counting as bfloat16. Error messages name
    tensors as `where` + name.
    """
    out, dtypes = {}, {}
    for key, tensor in raw.items():
        if key.endswith(".weight_scale_inv"):
            continue
        if not tensor.is_floating_point():
            raise ValueError(f"{where}{key} is {_dtype_name(tensor.dtype)}; expected floats")
        scale_key = key + "_scale_inv"
        scale = raw.get(scale_key)
        fp8 = tensor.dtype in FP8_DTYPES
        if fp8 and scale is None:
            raise ValueError(f"{where}{key} is {_dtype_name(tensor.dtype)} but has no "
                             f"{where}{scale_key}; expected one scale per {block}x{block} block")
        if scale is not None and not fp8:
            raise ValueError(f"{where}{scale_key} scales {where}{key}, which is "
                             f"{_dtype_name(tensor.dtype)}; expected scales on float8 weights only")
        if fp8:
            tensor = _apply_block_scales(tensor, scale, f"{where}{key}", f"{where}{scale_key}",
                                         block)
        out[key] = tensor
        if key.endswith("_proj.weight") or key.endswith("_proj_with_mqa.weight"):
            dtypes[key] = torch.bfloat16 if fp8 else tensor.dtype
    stray = [k for k in raw if k.endswith(".weight_scale_inv") and k[: -len("_scale_inv")] not in raw]
    if stray:
        raise ValueError(f"{where}*: scales without their weights: {stray}")

    def checkpoint_dtype() -> torch.dtype:
        if len(set(dtypes.values())) > 1:
            listed = ", ".join(f"{k} {_dtype_name(d)}" for k, d in sorted(dtypes.items()))
            raise ValueError(f"{where}* projection weights mix dtypes ({listed}); "
                             "pass dtype= to choose one")
        return next(iter(dtypes.values()), torch.float32)

    return out, checkpoint_dtype


def _apply_block_scales(weight: torch.Tensor, scale: torch.Tensor, name: str, scale_name: str,
                        block: int) -> torch.Tensor:
    """weight (rows, cols) float8 times scale (ceil(rows/block), ceil(cols/block)), in float32."""
    if weight.dim() != 2:
        raise ValueError(f"{name} is float8 of shape {tuple(weight.shape)}; expected a matrix")
    rows, cols = weight.shape
    grid = (-(-rows // block), -(-cols // block))
    if tuple(scale.shape) != grid:
        raise ValueError(f"{scale_name} has shape {tuple(scale.shape)}; {name} of shape "
                         f"{(rows, cols)} needs one scale per {block}x{block} block: {grid}")
    if not scale.is_floating_point() or scale.dtype in FP8_DTYPES:
        raise ValueError(f"{scale_name} is {_dtype_name(scale.dtype)}; expected float32 scales")
    scale = scale.float()
    if not torch.isfinite(scale).all():
        raise ValueError(f"{scale_name} holds values that are not finite")
    expanded = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return weight.float() * expanded
