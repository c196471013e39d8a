"""Tier 3, paged: the production path, three files read in this order.

- cache.py: `PagedLatentCache`, the latent cache in pages of n tokens with a block allocator and
  block tables. A row is stored in the weights' dtype or in fp8 (`kv_cache_dtype` "fp8_e4m3" or
  "fp8_ds_mla", `mla.kernels.fp8`); every reader dequantises what it reads.
- plan.py: the host-side plan of one call: positions, slot mapping, block-table growth and
  each row's path, built from the lengths and moved to the device in one copy.
- layer.py: `PagedMLA`. It writes the new tokens into their slots (the concat_and_cache kernel)
  and attends. Decode rows go through `mla.kernels.mla_decode`, whose split-KV stage 1 is a
  Triton or a CUDA kernel (`mla.kernels.backends` chooses). A row of several new tokens attends
  up-projected (MHA mode: the Triton flash kernel or torch SDPA over the new tokens, the cached
  context up-projected chunk by chunk into a fixed workspace, merged by log-sum-exp) or, when
  short, absorbed (MQA mode: mla_decode's queries of several new tokens); `PREFILL_MODES` are
  the layer's `prefill=` options.
"""

from .cache import UNUSED, OutOfBlocksError, PagedLatentCache
from .layer import PREFILL_MODES, PagedMLA

__all__ = ["PagedMLA", "PagedLatentCache", "OutOfBlocksError", "UNUSED", "PREFILL_MODES"]
