// The CPU twin of concat_and_cache_mla.cu: same schema, same semantics, plain loops.
// It exists so that CI (no GPU) exercises the extension path end to end: the schema, the
// dispatcher, the argument checks and the fp8 rounding all run the same way as on the GPU.
#include "concat_and_cache_mla.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace mla {
namespace {

// e4m3(clamp(v, -448, 448)), rounding to nearest even; a NaN as 0x7F, the positive quiet NaN.
inline c10::Float8_e4m3fn to_e4m3(float v) {
  if (std::isnan(v)) return c10::Float8_e4m3fn(0x7F, c10::Float8_e4m3fn::from_bits());
  return c10::Float8_e4m3fn(std::fmin(std::fmax(v, -448.0f), 448.0f));
}

// e4m3(clamp(x / scale, -448, 448)).
inline c10::Float8_e4m3fn quantize_e4m3(float x, float scale) { return to_e4m3(x / scale); }

template <typename in_t>
void write_rows_fp8(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
                    const int64_t* slots, float scale, const ConcatAndCacheArgs& a) {
  const in_t* kv_c_ptr = kv_c.const_data_ptr<in_t>();
  const in_t* k_pe_ptr = k_pe.const_data_ptr<in_t>();
  auto* cache_ptr = static_cast<c10::Float8_e4m3fn*>(kv_cache.data_ptr());
  const int64_t stride_kv_c = kv_c.stride(0), stride_k_pe = k_pe.stride(0);
  const int64_t c = a.kv_lora_rank, r = a.rope_dim, W = c + r;
  at::parallel_for(0, a.num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      c10::Float8_e4m3fn* row = cache_ptr + slot * W;  // (c + r,)
      const in_t* src_c = kv_c_ptr + i * stride_kv_c;
      const in_t* src_r = k_pe_ptr + i * stride_k_pe;
      for (int64_t e = 0; e < c; ++e) row[e] = quantize_e4m3(static_cast<float>(src_c[e]), scale);
      for (int64_t e = 0; e < r; ++e)
        row[c + e] = quantize_e4m3(static_cast<float>(src_r[e]), scale);
    }
  });
}

// max(a, |x|) where a NaN wins, as torch.amax does.
inline float nan_max_abs(float a, float x) {
  const float ax = std::fabs(x);
  return (std::isnan(ax) || ax > a) ? ax : a;
}

// fp8_ds_mla: per 128-value group g of kv_c, scale = max(amax_g / 448, 2^-126) and the values
// e4m3(clamp(x / scale, -448, 448)); then the group scales as float32, then k_pe as bf16. A NaN
// is stored as the positive quiet NaN of its format (0x7FC00000, 0x7F, 0x7FC0).
template <typename in_t>
void write_rows_ds_mla(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
                       const int64_t* slots, const ConcatAndCacheArgs& a) {
  const in_t* kv_c_ptr = kv_c.const_data_ptr<in_t>();
  const in_t* k_pe_ptr = k_pe.const_data_ptr<in_t>();
  uint8_t* cache_ptr = static_cast<uint8_t*>(kv_cache.data_ptr());
  const int64_t stride_kv_c = kv_c.stride(0), stride_k_pe = k_pe.stride(0);
  const int64_t c = a.kv_lora_rank, r = a.rope_dim, groups = c / kDsMlaGroup;
  const int64_t W = c + 4 * groups + 2 * r;  // bytes a row
  const float min_scale = std::numeric_limits<float>::min();  // 2^-126
  at::parallel_for(0, a.num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      uint8_t* row = cache_ptr + slot * W;  // (W,) bytes
      const in_t* src_c = kv_c_ptr + i * stride_kv_c;
      const in_t* src_r = k_pe_ptr + i * stride_k_pe;
      for (int64_t g = 0; g < groups; ++g) {
        const in_t* x = src_c + g * kDsMlaGroup;
        float amax = 0.0f;
        for (int64_t e = 0; e < kDsMlaGroup; ++e) amax = nan_max_abs(amax, static_cast<float>(x[e]));
        float scale = amax / 448.0f;
        if (scale < min_scale) scale = min_scale;
        if (std::isnan(scale)) scale = std::numeric_limits<float>::quiet_NaN();  // 0x7FC00000
        for (int64_t e = 0; e < kDsMlaGroup; ++e) {
          const float v = static_cast<float>(x[e]) / scale;
          const uint8_t q = to_e4m3(v).x;
          row[g * kDsMlaGroup + e] = q;
        }
        std::memcpy(row + c + 4 * g, &scale, 4);
      }
      uint8_t* rope = row + c + 4 * groups;
      for (int64_t e = 0; e < r; ++e) {
        const float x = static_cast<float>(src_r[e]);
        const uint16_t y = std::isnan(x) ? uint16_t{0x7FC0} : c10::BFloat16(x).x;  // nearest even
        std::memcpy(rope + 2 * e, &y, 2);
      }
    }
  });
}

void write_rows_copy(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
                     const int64_t* slots, const ConcatAndCacheArgs& a) {
  const int64_t es = kv_c.element_size();
  const char* kv_c_ptr = static_cast<const char*>(kv_c.const_data_ptr());
  const char* k_pe_ptr = static_cast<const char*>(k_pe.const_data_ptr());
  char* cache_ptr = static_cast<char*>(kv_cache.data_ptr());
  const int64_t stride_kv_c = kv_c.stride(0) * es, stride_k_pe = k_pe.stride(0) * es;
  const int64_t c_bytes = a.kv_lora_rank * es, r_bytes = a.rope_dim * es;
  const int64_t row_bytes = c_bytes + r_bytes;
  at::parallel_for(0, a.num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      char* row = cache_ptr + slot * row_bytes;
      std::memcpy(row, kv_c_ptr + i * stride_kv_c, c_bytes);
      std::memcpy(row + c_bytes, k_pe_ptr + i * stride_k_pe, r_bytes);
    }
  });
}

void concat_and_cache_mla_cpu(const at::Tensor& kv_c, const at::Tensor& k_pe,
                              at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                              const std::string& kv_cache_dtype,
                              const std::optional<at::Tensor>& scale) {
  const ConcatAndCacheArgs a =
      check_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale);
  if (a.num_tokens == 0) return;

  // Every slot is checked before the first write, so a bad mapping leaves the cache unchanged.
  const at::Tensor slots_c = slot_mapping.contiguous();
  const int64_t* slots = slots_c.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < a.num_tokens; ++i) {
    TORCH_CHECK(slots[i] >= -1 && slots[i] < a.num_slots, "slot_mapping[", num(i), "] = ", num(slots[i]),
                " is outside [-1, ", num(a.num_slots), ")");
  }

  if (a.format == CacheFormat::kAuto) {
    write_rows_copy(kv_c, k_pe, kv_cache, slots, a);
    return;
  }
  if (a.format == CacheFormat::kFp8DsMla) {
    switch (kv_c.scalar_type()) {
      case at::kBFloat16: write_rows_ds_mla<c10::BFloat16>(kv_c, k_pe, kv_cache, slots, a); break;
      case at::kHalf: write_rows_ds_mla<c10::Half>(kv_c, k_pe, kv_cache, slots, a); break;
      case at::kFloat: write_rows_ds_mla<float>(kv_c, k_pe, kv_cache, slots, a); break;
      default: TORCH_CHECK(false, "unsupported input dtype ", kv_c.scalar_type());
    }
    return;
  }
  const float s = scale->item<float>();
  // mla.kernels.fp8.check_e4m3_scale's rule: below 2^-126 a scale is a subnormal, which a
  // flush-to-zero division reads as 0
  TORCH_CHECK(std::isfinite(s) && s >= std::numeric_limits<float>::min(),
              "scale must be positive and finite, at least 2^-126, got ", num(static_cast<double>(s)));
  switch (kv_c.scalar_type()) {
    case at::kBFloat16: write_rows_fp8<c10::BFloat16>(kv_c, k_pe, kv_cache, slots, s, a); break;
    case at::kHalf: write_rows_fp8<c10::Half>(kv_c, k_pe, kv_cache, slots, s, a); break;
    case at::kFloat: write_rows_fp8<float>(kv_c, k_pe, kv_cache, slots, s, a); break;
    default: TORCH_CHECK(false, "unsupported input dtype ", kv_c.scalar_type());
  }
}

}  // namespace
}  // namespace mla

TORCH_LIBRARY_IMPL(mla, CPU, m) {
  m.impl("concat_and_cache_mla", &mla::concat_and_cache_mla_cpu);
}
