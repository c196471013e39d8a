"""The paged tier's kernels: concat_and_cache (CUDA / C++ / torch), the split-KV decode (Triton,
and CUDA stage 1s for DeepSeek's sizes) and the up-projected prefill (Triton).

One module a piece: ``triton_decode`` (the Triton decode kernels), ``decode`` (the op, its
reference, checks and split policy), ``backends`` (which stage 1 runs), ``triton_prefill`` (the
Triton prefill kernel), ``prefill`` (the prefill op and its reference), ``sdpa`` (a prompt's
causal attention through torch's SDPA, and the rule that picks it), ``chunked_context`` (new
tokens over a paged cached context in bounded memory, and the log-sum-exp merge),
``extension`` (the compiled csrc extension), ``concat_cache`` (the concat-and-cache op and its
reference), ``fp8`` (the fp8 cache layouts in plain torch), ``launch`` (the Triton ops' device
and the shared-memory fit on GPUs with less than an H100's).

On a machine without a CUDA GPU the Triton kernels run in Triton's interpreter; TRITON_INTERPRET
must be set before triton is first imported, so this package sets it when no GPU is visible.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .concat_cache import concat_and_cache, concat_and_cache_reference  # noqa: E402
from .decode import mla_decode, mla_decode_reference  # noqa: E402
from .chunked_context import chunked_context_prefill, merge_attention_states  # noqa: E402
from .prefill import mla_prefill, mla_prefill_reference  # noqa: E402
from .sdpa import sdpa_prefill  # noqa: E402

__all__ = ["concat_and_cache", "concat_and_cache_reference", "mla_decode", "mla_decode_reference",
           "mla_prefill", "mla_prefill_reference", "sdpa_prefill", "merge_attention_states",
           "chunked_context_prefill"]
