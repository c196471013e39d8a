"""The tiers by name: `build(weights, tier)` makes any of them from one set of weights.

This module sits above the three tier modules (each of which sits above `mla.base`), so the
imports run one way: base -> naive -> absorbed -> paged -> tiers.
"""

from __future__ import annotations

import inspect
from typing import Any

from .absorbed import AbsorbedMLA
from .base import MLAAttention
from .naive import NaiveMLA
from .paged import PagedMLA
from .weights import MLAWeights

TIERS = ("naive", "absorbed", "paged")
_CLASSES = {"naive": NaiveMLA, "absorbed": AbsorbedMLA, "paged": PagedMLA}


def tier_options(tier: str) -> tuple[str, ...]:
    """The keyword options `build(weights, tier, ...)` takes: the tier class's keyword-only
    arguments."""
    params = inspect.signature(_CLASSES[tier]).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def build(weights: MLAWeights, tier: str, **options: Any) -> MLAAttention:
    """The attention layer of `tier` ("naive", "absorbed" or "paged") over `weights`.

    Options go to the tier's class (`tier_options(tier)` lists them): `process_group` for every
    tier; `precompute` and `prefill` for "absorbed"; `block_size`, `num_blocks`, `prefill` and
    more for "paged". An option the tier does not take raises a TypeError that names it.
    """
    if not isinstance(tier, str) or tier not in _CLASSES:
        raise ValueError(f"unknown tier {tier!r}; expected one of {list(TIERS)}")
    accepted = tier_options(tier)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(f"build(..., {tier!r}) got unknown option(s) "
                        f"{', '.join(map(repr, unknown))}; the {tier} tier takes "
                        f"{', '.join(accepted)}")
    return _CLASSES[tier](weights, **options)
