"""The tiers by name: `build(weights, tier)` makes any of them from one set of weights.

This module sits above the three tier modules (each of which sits above `mla.base`), so the
imports run one way: base -> naive -> absorbed -> paged -> tiers.
"""

from __future__ import annotations

from typing import Any

from .absorbed import AbsorbedMLA
from .base import MLAAttention
from .naive import NaiveMLA
from .paged import PagedMLA
from .weights import MLAWeights

TIERS = ("naive", "absorbed", "paged")
_CLASSES = {"naive": NaiveMLA, "absorbed": AbsorbedMLA, "paged": PagedMLA}


def build(weights: MLAWeights, tier: str, **options: Any) -> MLAAttention:
    """The attention layer of `tier` ("naive", "absorbed" or "paged") over `weights`.

    Options go to the tier's class: `process_group` for every tier; `precompute` and `prefill`
    for "absorbed"; `block_size`, `num_blocks` for "paged".
    """
    if tier not in _CLASSES:
        raise ValueError(f"unknown tier {tier!r}; expected one of {list(TIERS)}")
    return _CLASSES[tier](weights, **options)
