// The one TORCH_LIBRARY(mla, ...) of the package: the op schemas, and the argument check that the
// CPU twin (concat_and_cache_mla_cpu.cpp) and the CUDA kernel (concat_and_cache_mla.cu) of
// concat_and_cache_mla share. Each backend registers its implementations with TORCH_LIBRARY_IMPL
// in its own source, so a CPU-only build compiles no CUDA (and has no kernel for the two decode
// ops, which are CUDA only: mla_decode_sm80.cu).
#include "concat_and_cache_mla.h"

#include <torch/library.h>

namespace mla {

ConcatAndCacheArgs check_concat_and_cache_mla(const at::Tensor& kv_c, const at::Tensor& k_pe,
                                              const at::Tensor& kv_cache,
                                              const at::Tensor& slot_mapping,
                                              const std::string& kv_cache_dtype,
                                              const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(kv_c.dim() == 2, "kv_c must be (T, c), got ", kv_c.dim(), " dims");
  TORCH_CHECK(k_pe.dim() == 2, "k_pe must be (T, r), got ", k_pe.dim(), " dims");
  TORCH_CHECK(kv_cache.dim() == 3, "kv_cache must be (num_blocks, block_size, c + r), got ",
              kv_cache.dim(), " dims");
  TORCH_CHECK(slot_mapping.dim() == 1, "slot_mapping must be (T,), got ", slot_mapping.dim(),
              " dims");

  const int64_t T = kv_c.size(0);
  const int64_t c = kv_c.size(1);
  const int64_t r = k_pe.size(1);
  TORCH_CHECK(k_pe.size(0) == T, "k_pe has ", k_pe.size(0), " tokens, kv_c has ", T);
  TORCH_CHECK(slot_mapping.size(0) == T, "slot_mapping has ", slot_mapping.size(0),
              " entries, kv_c has ", T, " tokens");
  TORCH_CHECK(kv_cache.size(2) == c + r, "kv_cache last dim must be c + r = ", c + r, ", got ",
              kv_cache.size(2));

  const auto in_dtype = kv_c.scalar_type();
  TORCH_CHECK(in_dtype == at::kBFloat16 || in_dtype == at::kHalf || in_dtype == at::kFloat,
              "kv_c must be bfloat16, float16 or float32, got ", in_dtype);
  TORCH_CHECK(k_pe.scalar_type() == in_dtype, "k_pe dtype ", k_pe.scalar_type(),
              " differs from kv_c dtype ", in_dtype);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64, got ",
              slot_mapping.scalar_type());

  bool fp8;
  if (kv_cache_dtype == "auto") {
    fp8 = false;
    TORCH_CHECK(kv_cache.scalar_type() == in_dtype, "kv_cache dtype ", kv_cache.scalar_type(),
                " must equal the input dtype ", in_dtype, " when kv_cache_dtype is 'auto'");
  } else if (kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3") {
    fp8 = true;
    TORCH_CHECK(kv_cache.scalar_type() == at::kFloat8_e4m3fn,
                "kv_cache must be float8_e4m3fn when kv_cache_dtype is '", kv_cache_dtype,
                "', got ", kv_cache.scalar_type());
    TORCH_CHECK(scale.has_value(), "scale is required when kv_cache_dtype is '", kv_cache_dtype,
                "'");
    TORCH_CHECK(scale->numel() == 1 && scale->scalar_type() == at::kFloat,
                "scale must be a 1-element float32 tensor");
    TORCH_CHECK(scale->device() == kv_cache.device(), "scale is on ", scale->device(),
                ", kv_cache on ", kv_cache.device());
  } else {
    TORCH_CHECK(false, "unknown kv_cache_dtype '", kv_cache_dtype,
                "' (expected 'auto', 'fp8' or 'fp8_e4m3')");
  }

  const auto device = kv_cache.device();
  TORCH_CHECK(kv_c.device() == device && k_pe.device() == device &&
                  slot_mapping.device() == device,
              "kv_c, k_pe, kv_cache and slot_mapping must share one device");
  TORCH_CHECK(kv_c.stride(1) == 1 || c <= 1, "kv_c last dim must be contiguous (stride 1)");
  TORCH_CHECK(k_pe.stride(1) == 1 || r <= 1, "k_pe last dim must be contiguous (stride 1)");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");

  return {T, c, r, kv_cache.size(0) * kv_cache.size(1), fp8};
}

}  // namespace mla

TORCH_LIBRARY(mla, m) {
  // kv_cache is written in place: Tensor(a!) tells the dispatcher (and torch.compile) so.
  m.def(
      "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "str kv_cache_dtype, Tensor? scale) -> ()");
  // Split-KV decode for <= 16 heads (mla/kernels/decode.py calls them): stage 1 writes each
  // split's fp32 partial output and log-sum-exp, the merge combines them into out and lse.
  m.def(
      "mla_decode_sm80(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor(a!) part_out, Tensor(b!) part_lse, float softmax_scale, int num_splits) -> ()");
  m.def("mla_decode_merge(Tensor part_out, Tensor part_lse, Tensor(a!) out, Tensor(b!) lse, bool pdl) -> ()");
}
