// concat_and_cache_mla: write each new token's latent row [kv_c | k_pe] into the paged cache.
//
//   for every token i with slot = slot_mapping[i] >= 0:
//     kv_cache[slot / block_size, slot % block_size, :c] = q(kv_c[i])
//     kv_cache[slot / block_size, slot % block_size, c:] = q(k_pe[i])
//
// q is the identity when kv_cache_dtype == "auto" (the cache has the inputs' dtype) and
// e4m3(clamp(x / scale, -448, 448)) when kv_cache_dtype is "fp8" / "fp8_e4m3".
//
// Shapes (letters as in the rest of mla: c latent dim, r rope dim, T new tokens):
//   kv_c         (T, c)   bf16 / fp16 / fp32, any row stride, stride(-1) == 1
//   k_pe         (T, r)   same dtype as kv_c, any row stride, stride(-1) == 1
//   kv_cache     (num_blocks, block_size, c + r), contiguous, input dtype or float8_e4m3fn
//   slot_mapping (T,)     int64; -1 skips the token
//   scale        1-element float32 tensor on the cache's device (fp8 only)
//
// The cache is contiguous, so the row of slot s starts at element s * (c + r): that is
// (s / block_size) * block_size * (c + r) + (s % block_size) * (c + r) with no division.
// All offsets are int64 so caches past 2^31 elements work.
//
// The Python wrapper (mla/kernels/concat_cache.py) validates every argument with user-facing
// messages before calling the op; the checks here repeat the cheap ones as a second line of
// defence for callers that reach torch.ops.mla directly.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace mla {

// Numbers go into this extension's error messages as strings made by std::to_string, never
// streamed by c10::str: on the GPU machine (torch 2.11, g++ 13) a failing TORCH_CHECK that
// streamed an integer from this extension crashed the process (a segfault in the stream's number
// formatting) instead of raising; one that streamed only strings and dtypes raised.
inline std::string num(int64_t x) { return std::to_string(x); }
inline std::string num(double x) { return std::to_string(x); }
inline std::string dims(const at::Tensor& t) {  // "(2, 16, 576)"
  std::string out = "(";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + (t.dim() == 1 ? ",)" : ")");
}

// What the shared argument check learned about the call.
struct ConcatAndCacheArgs {
  int64_t num_tokens;   // T
  int64_t kv_lora_rank; // c
  int64_t rope_dim;     // r
  int64_t num_slots;    // num_blocks * block_size
  bool fp8;             // cache holds float8_e4m3fn values
};

// TORCH_CHECKs shapes, dtypes, devices, strides and the fp8 scale (not the slot values: that
// needs a device sync; the CPU twin checks them itself, the CUDA kernel skips out-of-range slots).
ConcatAndCacheArgs check_concat_and_cache_mla(const at::Tensor& kv_c, const at::Tensor& k_pe,
                                              const at::Tensor& kv_cache,
                                              const at::Tensor& slot_mapping,
                                              const std::string& kv_cache_dtype,
                                              const std::optional<at::Tensor>& scale);

}  // namespace mla
