"""Tier 3, paged: the production path. A paged latent cache (cache.py), the new tokens written by
the concat_and_cache kernel, decode by the Triton split-KV kernel, prefill up-projected (layer.py).
"""

from .cache import UNUSED, OutOfBlocksError, PagedLatentCache
from .layer import PREFILL_MODES, PagedMLA

__all__ = ["PagedMLA", "PagedLatentCache", "OutOfBlocksError", "UNUSED", "PREFILL_MODES"]
