// The argument check of the CUDA decode stage-1 kernels (mla_decode_sm80.cu, mla_decode_sm90.cu),
// defined in binding.cpp beside concat_and_cache_mla's (its messages put numbers in with mla::num / mla::dims, see
// concat_and_cache_mla.h for why).
#pragma once

#include <ATen/ATen.h>

#include "concat_and_cache_mla.h"  // CacheFormat, kDsMlaGroup

#include <cstdint>
#include <optional>
#include <string>

namespace mla {

// The kernel's name (it starts every message) and the sizes it is built for.
struct DecodeKernelSizes {
  const char* name;
  int64_t max_heads, c, r, tile;
};

// Raises (RuntimeError in Python) naming the argument and what was expected; reads nothing.
// Returns the cache's layout: kv_cache_dtype "auto" (a cache in q's dtype), "fp8" / "fp8_e4m3"
// (float8_e4m3fn, c + r a row, kv_scale a 1-element float32 tensor on q's device) or
// "fp8_ds_mla" (uint8, c + 4 c/128 + 2 r bytes a row, no kv_scale). q_tokens: s_q, the new
// tokens a sequence, 1 to 8 and dividing q's rows (b, s_q·h, c + r; the wgmma kernel's only).
CacheFormat check_mla_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                             const at::Tensor& seq_lens, const at::Tensor& part_out, const at::Tensor& part_lse,
                             int64_t num_splits, const DecodeKernelSizes& sizes, const std::string& kv_cache_dtype,
                             const std::optional<at::Tensor>& kv_scale, int64_t q_tokens = 1, bool dealt = false);

#ifdef __CUDACC__
// The tokens [start, end) that split `split` of `num_splits` owns in a sequence of seq_len: whole
// tiles of `tile` tokens, cut as the Triton kernel cuts them (the merge takes any cut); n_tiles
// is 0 for an empty split.
struct SplitTokens {
  int start, end, n_tiles;
};
__device__ __forceinline__ SplitTokens split_tokens(int seq_len, int split, int num_splits, int tile) {
  const int tiles_per_split = ((seq_len + tile - 1) / tile + num_splits - 1) / num_splits;
  const int start = split * tiles_per_split * tile;
  const int end = max(min(start + tiles_per_split * tile, seq_len), start);
  return {start, end, (end - start + tile - 1) / tile};
}

// 2^x in one instruction (ex2.approx.ftz): exp2f's own approximation, without the steps it takes
// to return a denormal result for x < -126 (a compare and two multiplies an exponent); here such a
// result is +0. The kernels exponentiate x <= 0 only: a score less its row's maximum, whose own
// term is 1, or an old maximum less a new one (the factor that rescales O and l); so what is
// flushed weighs less than 2^-126 of the row sum it joins or of the terms it rescales.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

}  // namespace mla
