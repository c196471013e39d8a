"""MLAConfig: the sizes of one MLA layer, under the field names of HF's DeepseekV2/V3 configs.

Shape letters used across the package (one legend everywhere):

    b batch   s new tokens   t cached tokens   h heads
    d qk_nope_head_dim   r qk_rope_head_dim   v v_head_dim
    c kv_lora_rank (the latent)   q q_lora_rank (the query latent)
    p page (block) index   n tokens per page (block_size)

The paper's symbols (DeepSeek-V2, section 2.1): d_c = c, d_c' = q, d_h = d (= v in the paper),
d_h^R = r, n_h = h.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_YARN_REQUIRED = ("factor", "original_max_position_embeddings")
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


@dataclass(frozen=True)
class MLAConfig:
    """The attention sizes of a DeepSeek-V2/V3 layer, under HF's field names (`from_hf`).

    Args:
        hidden_size: model width (`hidden`).
        num_heads: attention heads `h` (HF: `num_attention_heads`).
        q_lora_rank: query latent width `q`; None: no query compression (DeepSeek-V2-Lite), the
            query is `q_proj(x)` straight from the hidden state.
        kv_lora_rank: KV latent width `c`, the cached part, up-projected into keys and values.
        qk_nope_head_dim: per-head query/key width without position `d`.
        qk_rope_head_dim: per-head width of the decoupled rotary query/key `r` (even).
        v_head_dim: per-head value width `v`.
        rope_theta: RoPE base (> 1).
        rope_scaling: None, or a YaRN dict with `factor` and `original_max_position_embeddings`
            (and optionally `beta_fast`, `beta_slow`, `mscale`, `mscale_all_dim`).
        max_position_embeddings: longest position the model is meant for.
        rms_norm_eps: epsilon of the two RMSNorms on the latents.
        attention_bias: whether q_a_proj / q_proj, kv_a_proj_with_mqa and o_proj carry a bias
            (False in every released checkpoint).
        name: a label for reprs and error messages (the preset's name, or the HF model_type);
            not compared, so two configs of the same sizes are equal whatever their names.

    Sizes are positive ints (not bools), numbers finite; an error names the field.
    """

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        # Sizes must be ints (numpy's too, stored as int), not bools; floats finite.
        for key in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
            self._set(key, _positive_int(f"MLAConfig.{key}", getattr(self, key)))
        if self.q_lora_rank is not None:
            self._set("q_lora_rank", _positive_int("MLAConfig.q_lora_rank (or None)",
                                                   self.q_lora_rank))
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                "MLAConfig.qk_rope_head_dim must be even (RoPE rotates pairs), "
                f"got {self.qk_rope_head_dim}"
            )
        # base^(-2i/r) falls with i only for a base above 1 (and YaRN divides by ln base)
        self._set("rope_theta", _finite_above("MLAConfig.rope_theta", self.rope_theta, 1.0))
        self._set("rms_norm_eps", _finite_above("MLAConfig.rms_norm_eps", self.rms_norm_eps, 0.0))
        if not isinstance(self.attention_bias, bool):
            raise ValueError(f"MLAConfig.attention_bias must be a bool, got {self.attention_bias!r}")
        if self.rope_scaling is not None:
            self._set("rope_scaling", _check_yarn(self.rope_scaling, self.max_position_embeddings))

    def _set(self, key: str, value: Any) -> None:
        object.__setattr__(self, key, value)  # the dataclass is frozen; only __post_init__ sets

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """d + r: the width of one head's query and key."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """c + r: values cached per token (kv_c_normed then k_pe); 576 for V2/V3."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def yarn(self) -> dict[str, float] | None:
        """The YaRN parameters with defaults filled in, or None without rope scaling."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def softmax_scale(self) -> float:
        """(d + r)^-0.5, times mscale^2 under YaRN (mscale from mscale_all_dim), as HF does."""
        return softmax_scale(self)

    def replace(self, **changes: Any) -> MLAConfig:
        """A copy with some fields changed (and validated again)."""
        return dataclasses.replace(self, **changes)

    # ---- constructors --------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str) -> MLAConfig:
        """One of "deepseek-v2", "deepseek-v2-lite", "deepseek-v3", "tiny"."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        return cls(**PRESETS[name], name=name)

    @classmethod
    def from_hf(cls, config: Any) -> MLAConfig:
        """From an HF DeepseekV2Config/DeepseekV3Config, or its config.json as a dict.

        Reads transformers 4.x (`rope_scaling` with "type"/"rope_type") and 5.x
        (`rope_parameters`, which also holds rope_theta) styles.
        """
        get = config.get if isinstance(config, Mapping) else (
            lambda key, default=None: getattr(config, key, default))
        rope = get("rope_parameters", None) or get("rope_scaling", None)
        rope = dict(rope) if rope else {}
        rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        rope_theta = rope.pop("rope_theta", None) or get("rope_theta", None) or 10000.0
        if rope_type in ("yarn", "deepseek_yarn"):
            rope_scaling = rope
        elif rope_type == "default":
            rope_scaling = None
        else:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported; MLA checkpoints use 'yarn'")
        if rope_scaling is not None and "original_max_position_embeddings" not in rope_scaling:
            # transformers 5 keeps it on the config itself for some models
            original = get("original_max_position_embeddings", None)
            if original is not None:
                rope_scaling["original_max_position_embeddings"] = original
        num_heads = get("num_attention_heads", None) or get("num_heads", None)
        return cls(
            hidden_size=get("hidden_size"),
            num_heads=num_heads,
            q_lora_rank=get("q_lora_rank", None),
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=get("qk_nope_head_dim"),
            qk_rope_head_dim=get("qk_rope_head_dim"),
            v_head_dim=get("v_head_dim"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=get("max_position_embeddings", 4096),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            attention_bias=get("attention_bias", False),
            name=str(get("model_type", "hf")),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The attention fields as an HF config.json would spell them (transformers 4.x style)."""
        out: dict[str, Any] = {
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": self.attention_bias,
            "rope_scaling": None,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"type": "yarn", **self.rope_scaling}
        return out


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1·mscale·ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config: MLAConfig) -> float:
    """(d + r)^-0.5, times mscale(factor, mscale_all_dim)^2 when YaRN is on and mscale_all_dim != 0."""
    scale = config.qk_head_dim ** -0.5
    yarn = config.yarn
    if yarn is not None and yarn["mscale_all_dim"]:
        mscale = yarn_get_mscale(yarn["factor"], yarn["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def _positive_int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{where} must be a positive int, got {value!r}")
    return int(value)


def _finite_above(where: str, value: Any, low: float, *, inclusive: bool = False) -> float:
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real)
          and math.isfinite(value) and (value >= low if inclusive else value > low))
    if not ok:
        raise ValueError(f"{where} must be a finite number {'>=' if inclusive else '>'} {low:g}, "
                         f"got {value!r}")
    return float(value)


def _check_yarn(rope_scaling: Mapping[str, Any], max_position_embeddings: int) -> dict[str, float]:
    if not isinstance(rope_scaling, Mapping):
        raise ValueError(f"MLAConfig.rope_scaling must be a dict or None, got {rope_scaling!r}")
    scaling = {k: v for k, v in rope_scaling.items() if k not in ("type", "rope_type")}
    missing = [k for k in _YARN_REQUIRED if scaling.get(k) is None]
    if missing:
        raise ValueError(f"MLAConfig.rope_scaling (YaRN) is missing {missing}; "
                         f"it needs {list(_YARN_REQUIRED)}")
    for key, default in _YARN_DEFAULTS.items():
        if scaling.get(key) is None:
            scaling[key] = default
    unknown = sorted(set(scaling) - set(_YARN_REQUIRED) - set(_YARN_DEFAULTS))
    if unknown:
        raise ValueError(f"MLAConfig.rope_scaling has unknown YaRN keys {unknown}")
    out = {key: _finite_above(f"MLAConfig.rope_scaling[{key!r}]", scaling[key], low,
                              inclusive=True)
           for key, low in (("factor", 1.0), ("beta_fast", 0.0), ("beta_slow", 0.0),
                            ("mscale", 0.0), ("mscale_all_dim", 0.0))}
    factor = out["factor"]
    original = _positive_int("MLAConfig.rope_scaling['original_max_position_embeddings']",
                             scaling["original_max_position_embeddings"])
    out["original_max_position_embeddings"] = original
    if original > max_position_embeddings:
        raise ValueError(
            f"YaRN stretches original_max_position_embeddings={original} up to "
            f"max_position_embeddings={max_position_embeddings}; the original must not be longer")
    if max_position_embeddings > factor * original * (1 + 1e-9):
        raise ValueError(
            f"inconsistent YaRN factor: max_position_embeddings={max_position_embeddings} is more "
            f"than factor ({factor}) x original_max_position_embeddings ({original})")
    if not out["beta_fast"] > out["beta_slow"] > 0:
        raise ValueError("MLAConfig.rope_scaling needs beta_fast > beta_slow > 0, got "
                         f"{scaling['beta_fast']} and {scaling['beta_slow']}")
    return out


# Values from each checkpoint's config.json on the HF hub (deepseek-ai/DeepSeek-V2,
# deepseek-ai/DeepSeek-V2-Lite, deepseek-ai/DeepSeek-V3); tests/test_config.py writes them out again.
_DEEPSEEK_COMMON = dict(
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_theta=10000.0,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
)
_YARN_V2 = dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)
_YARN_V3 = dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v2": dict(hidden_size=5120, num_heads=128, q_lora_rank=1536,
                        rope_scaling=_YARN_V2, **_DEEPSEEK_COMMON),
    "deepseek-v2-lite": dict(hidden_size=2048, num_heads=16, q_lora_rank=None,
                             rope_scaling=_YARN_V2, **_DEEPSEEK_COMMON),
    "deepseek-v3": dict(hidden_size=7168, num_heads=128, q_lora_rank=1536,
                        rope_scaling=_YARN_V3, **_DEEPSEEK_COMMON),
    # Small enough for the CPU and the Triton interpreter; YaRN on, with a short original
    # context, so that tests run past original_max_position_embeddings.
    "tiny": dict(hidden_size=64, num_heads=4, q_lora_rank=24, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0,
                 rope_scaling=dict(factor=4.0, original_max_position_embeddings=64,
                                   beta_fast=32.0, beta_slow=1.0, mscale=0.707,
                                   mscale_all_dim=0.707),
                 max_position_embeddings=256, rms_norm_eps=1e-6),
}
