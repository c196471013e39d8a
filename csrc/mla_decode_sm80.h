// The argument check of the CUDA decode stage 1 (mla_decode_sm80.cu), defined in binding.cpp
// beside concat_and_cache_mla's (its messages put numbers in with mla::num / mla::dims, see
// concat_and_cache_mla.h for why).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace mla {

// The sizes the kernel is built for.
struct DecodeSm80Sizes {
  int64_t max_heads, c, r, tile;
};

// Raises (RuntimeError in Python) naming the argument and what was expected; reads nothing.
void check_mla_decode_sm80(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                           const at::Tensor& seq_lens, const at::Tensor& part_out,
                           const at::Tensor& part_lse, int64_t num_splits, const DecodeSm80Sizes& sizes);

}  // namespace mla
