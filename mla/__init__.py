"""mla: DeepSeek's Multi-head Latent Attention in three tiers built from one set of weights.

    import mla
    weights = mla.MLAWeights(mla.MLAConfig.from_preset("deepseek-v2-lite"))
    attn = mla.build(weights, "absorbed")          # or "naive", "paged"
    cache = attn.new_cache(batch_size=2, max_seq_len=512)
    y = attn(x, cache)                             # x (2, s, 2048) -> y (2, s, 2048)
"""

from .cache import LatentCache
from .config import PRESETS, MLAConfig
from .base import MLAAttention
from .tiers import TIERS, build
from .weights import MLAWeights

__all__ = ["MLAConfig", "MLAWeights", "MLAAttention", "LatentCache", "build", "PRESETS", "TIERS"]
__version__ = "0.1.0"
