// concat_and_cache_mla: write each new token's latent row [kv_c | k_pe] into the paged cache.
//
//   for every token i with slot = slot_mapping[i] >= 0:
//     kv_cache[slot / block_size, slot % block_size, :c] = q(kv_c[i])
//     kv_cache[slot / block_size, slot % block_size, c:] = q(k_pe[i])
//
// q is the identity when kv_cache_dtype == "auto" (the cache has the inputs' dtype) and
// e4m3(clamp(x / scale, -448, 448)) when kv_cache_dtype is "fp8" / "fp8_e4m3".
//
// kv_cache_dtype "fp8_ds_mla" writes FlashMLA's token instead, a uint8 row of c + 4 c/128 + 2 r
// bytes (656 for c = 512, r = 64), with scales computed per token and per 128-value group:
//
//   bytes [0, c)                   e4m3(clamp(kv_c[128 g + j] / scale[g], -448, 448))
//   bytes [c, c + 4 c/128)         scale[g] = max(amax_g / 448, 2^-126), float32
//   bytes [c + 4 c/128, + 2 r)     bf16(k_pe)
//
// amax_g = max |kv_c| over group g, NaN if any value of the group is NaN; every rounding is to
// nearest even, every NaN stored as its format's positive quiet NaN (mla/kernels/fp8.py is the
// spec).
//
// Shapes (letters as in the rest of mla: c latent dim, r rope dim, T new tokens):
//   kv_c         (T, c)   bf16 / fp16 / fp32, any row stride, stride(-1) == 1
//   k_pe         (T, r)   same dtype as kv_c, any row stride, stride(-1) == 1
//   kv_cache     (num_blocks, block_size, W), contiguous: W = c + r in the input dtype ("auto")
//                or float8_e4m3fn ("fp8_e4m3"), W = c + 4 c/128 + 2 r uint8 ("fp8_ds_mla")
//   slot_mapping (T,)     int64; -1 skips the token
//   scale        1-element float32 tensor on the cache's device ("fp8_e4m3" only)
//
// The cache is contiguous, so the row of slot s starts at element s * W: that is
// (s / block_size) * block_size * W + (s % block_size) * W with no division.
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

// The cache layouts kv_cache_dtype names.
enum class CacheFormat {
  kAuto,      // the inputs' dtype, c + r values a row
  kFp8E4M3,   // float8_e4m3fn, c + r values a row, one scale for the cache
  kFp8DsMla,  // uint8, c + 4 c/128 + 2 r bytes a row: e4m3 latent, float32 group scales, bf16 rope
};

constexpr int64_t kDsMlaGroup = 128;  // latent values sharing one scale in fp8_ds_mla

// What the shared argument check learned about the call.
struct ConcatAndCacheArgs {
  int64_t num_tokens;   // T
  int64_t kv_lora_rank; // c
  int64_t rope_dim;     // r
  int64_t num_slots;    // num_blocks * block_size
  CacheFormat format;   // what kv_cache_dtype asks for
};

// TORCH_CHECKs shapes, dtypes, devices, strides and the fp8 scale (not the slot values: that
// needs a device sync; the CPU twin checks them itself, the CUDA kernel skips out-of-range slots).
ConcatAndCacheArgs check_concat_and_cache_mla(const at::Tensor& kv_c, const at::Tensor& k_pe,
                                              const at::Tensor& kv_cache,
                                              const at::Tensor& slot_mapping,
                                              const std::string& kv_cache_dtype,
                                              const std::optional<at::Tensor>& scale);

}  // namespace mla
