// The one TORCH_LIBRARY(mla, ...) of the package: the op schemas, and the argument check that the
// CPU twin (concat_and_cache_mla_cpu.cpp) and the CUDA kernel (concat_and_cache_mla.cu) of
// concat_and_cache_mla share. Each backend registers its implementations with TORCH_LIBRARY_IMPL
// in its own source, so a CPU-only build compiles no CUDA (and has no kernel for the decode ops,
// which are CUDA only: mla_decode_sm80.cu, mla_decode_sm90.cu).
#include "concat_and_cache_mla.h"
#include "mla_decode.h"

#include <torch/library.h>

namespace mla {
ConcatAndCacheArgs check_concat_and_cache_mla(const at::Tensor& kv_c, const at::Tensor& k_pe,
                                              const at::Tensor& kv_cache,
                                              const at::Tensor& slot_mapping,
                                              const std::string& kv_cache_dtype,
                                              const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(kv_c.dim() == 2, "kv_c must be (T, c), got ", num(kv_c.dim()), " dims");
  TORCH_CHECK(k_pe.dim() == 2, "k_pe must be (T, r), got ", num(k_pe.dim()), " dims");
  TORCH_CHECK(kv_cache.dim() == 3, "kv_cache must be (num_blocks, block_size, c + r), got ",
              num(kv_cache.dim()), " dims");
  TORCH_CHECK(slot_mapping.dim() == 1, "slot_mapping must be (T,), got ", num(slot_mapping.dim()),
              " dims");

  const int64_t T = kv_c.size(0);
  const int64_t c = kv_c.size(1);
  const int64_t r = k_pe.size(1);
  TORCH_CHECK(k_pe.size(0) == T, "k_pe has ", num(k_pe.size(0)), " tokens, kv_c has ", num(T));
  TORCH_CHECK(slot_mapping.size(0) == T, "slot_mapping has ", num(slot_mapping.size(0)),
              " entries, kv_c has ", num(T), " tokens");
  const auto in_dtype = kv_c.scalar_type();
  TORCH_CHECK(in_dtype == at::kBFloat16 || in_dtype == at::kHalf || in_dtype == at::kFloat,
              "kv_c must be bfloat16, float16 or float32, got ", in_dtype);
  TORCH_CHECK(k_pe.scalar_type() == in_dtype, "k_pe dtype ", k_pe.scalar_type(),
              " differs from kv_c dtype ", in_dtype);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64, got ",
              slot_mapping.scalar_type());

  CacheFormat format;
  if (kv_cache_dtype == "auto") {
    format = CacheFormat::kAuto;
    TORCH_CHECK(kv_cache.size(2) == c + r, "kv_cache last dim must be c + r = ", num(c + r), ", got ",
                num(kv_cache.size(2)));
    TORCH_CHECK(kv_cache.scalar_type() == in_dtype, "kv_cache dtype ", kv_cache.scalar_type(),
                " must equal the input dtype ", in_dtype, " when kv_cache_dtype is 'auto'");
  } else if (kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3") {
    format = CacheFormat::kFp8E4M3;
    TORCH_CHECK(kv_cache.size(2) == c + r, "kv_cache last dim must be c + r = ", num(c + r), ", got ",
                num(kv_cache.size(2)));
    TORCH_CHECK(kv_cache.scalar_type() == at::kFloat8_e4m3fn,
                "kv_cache must be float8_e4m3fn when kv_cache_dtype is '", kv_cache_dtype,
                "', got ", kv_cache.scalar_type());
    TORCH_CHECK(scale.has_value(), "scale is required when kv_cache_dtype is '", kv_cache_dtype,
                "'");
    TORCH_CHECK(scale->numel() == 1 && scale->scalar_type() == at::kFloat,
                "scale must be a 1-element float32 tensor");
    TORCH_CHECK(scale->device() == kv_cache.device(), "scale is on ", scale->device(),
                ", kv_cache on ", kv_cache.device());
  } else if (kv_cache_dtype == "fp8_ds_mla") {
    format = CacheFormat::kFp8DsMla;
    TORCH_CHECK(c > 0 && c % kDsMlaGroup == 0, "kv_c's last dim c must be a positive multiple of ",
                num(kDsMlaGroup), " for kv_cache_dtype 'fp8_ds_mla', got ", num(c));
    const int64_t width = c + 4 * (c / kDsMlaGroup) + 2 * r;
    TORCH_CHECK(kv_cache.size(2) == width, "kv_cache last dim must be c + 4 c/128 + 2 r = ", num(width),
                " bytes for kv_cache_dtype 'fp8_ds_mla', got ", num(kv_cache.size(2)));
    TORCH_CHECK(kv_cache.scalar_type() == at::kByte,
                "kv_cache must be uint8 when kv_cache_dtype is 'fp8_ds_mla', got ", kv_cache.scalar_type());
    TORCH_CHECK(!scale.has_value(), "scale must be None when kv_cache_dtype is 'fp8_ds_mla' (its scales "
                "are computed per 128-value group)");
  } else {
    TORCH_CHECK(false, "unknown kv_cache_dtype '", kv_cache_dtype,
                "' (expected 'auto', 'fp8', 'fp8_e4m3' or 'fp8_ds_mla')");
  }

  const auto device = kv_cache.device();
  TORCH_CHECK(kv_c.device() == device && k_pe.device() == device &&
                  slot_mapping.device() == device,
              "kv_c, k_pe, kv_cache and slot_mapping must share one device");
  TORCH_CHECK(kv_c.stride(1) == 1 || c <= 1, "kv_c last dim must be contiguous (stride 1)");
  TORCH_CHECK(k_pe.stride(1) == 1 || r <= 1, "k_pe last dim must be contiguous (stride 1)");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");

  return {T, c, r, kv_cache.size(0) * kv_cache.size(1), format};
}

CacheFormat check_mla_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                             const at::Tensor& seq_lens, const at::Tensor& part_out, const at::Tensor& part_lse,
                             int64_t num_splits, const DecodeKernelSizes& sizes, const std::string& kv_cache_dtype,
                             const std::optional<at::Tensor>& kv_scale, int64_t q_tokens, bool dealt) {
  const int64_t d = sizes.c + sizes.r;
  TORCH_CHECK(q.is_cuda(), sizes.name, ": q must be a CUDA tensor, got one on ", q.device());
  TORCH_CHECK(q.dim() == 3 && q.size(1) <= sizes.max_heads && q.size(2) == d,
              sizes.name, ": q must be (b, h <= ", num(sizes.max_heads), ", ", num(d), "), got ", dims(q));
  // s_q new tokens a sequence: q's rows are s_q·h (token, head) pairs, token-major
  TORCH_CHECK(q_tokens >= 1 && q_tokens <= 8 && q.size(1) % q_tokens == 0, sizes.name,
              ": q_tokens (s_q, new tokens a sequence) must be in [1, 8] and divide q's rows (s_q·h = ",
              num(q.size(1)), "), got ", num(q_tokens));
  // the cache's layout, then its row width and dtype in that layout
  CacheFormat format = CacheFormat::kAuto;
  if (kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3") {
    format = CacheFormat::kFp8E4M3;
  } else if (kv_cache_dtype == "fp8_ds_mla") {
    format = CacheFormat::kFp8DsMla;
  } else {
    TORCH_CHECK(kv_cache_dtype == "auto", sizes.name,
                ": kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_ds_mla', got '", kv_cache_dtype, "'");
  }
  const auto kv_dtype = kv_cache.scalar_type();
  TORCH_CHECK(format != CacheFormat::kAuto || (kv_dtype != at::kByte && kv_dtype != at::kFloat8_e4m3fn), sizes.name,
              ": kv_cache is ", kv_dtype,
              " (an fp8 cache) but kv_cache_dtype is 'auto'; pass kv_cache_dtype 'fp8_e4m3' (with kv_scale) or "
              "'fp8_ds_mla'");
  const bool ds_mla = format == CacheFormat::kFp8DsMla;
  const int64_t width = ds_mla ? sizes.c + 4 * (sizes.c / kDsMlaGroup) + 2 * sizes.r : d;
  TORCH_CHECK(kv_cache.dim() == 3 && kv_cache.size(2) == width && kv_cache.size(1) > 0 &&
                  kv_cache.size(1) % sizes.tile == 0,
              sizes.name, ": kv_cache must be (pages, page_size, ", num(width), ds_mla ? " bytes" : "",
              ") with page_size a multiple of ", num(sizes.tile), ", got ", dims(kv_cache));
  if (format == CacheFormat::kAuto) {
    TORCH_CHECK(q.scalar_type() == kv_dtype && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf),
                sizes.name, ": q and kv_cache must both be bfloat16 or both float16, got ", q.scalar_type(), " and ",
                kv_dtype);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, sizes.name,
                ": q must be bfloat16 or float16, got ", q.scalar_type());
    const auto stored = ds_mla ? at::kByte : at::kFloat8_e4m3fn;
    TORCH_CHECK(kv_dtype == stored, sizes.name, ": kv_cache must be ", stored, " for kv_cache_dtype '",
                kv_cache_dtype, "', got ", kv_dtype);
  }
  if (format == CacheFormat::kFp8E4M3) {
    TORCH_CHECK(kv_scale.has_value(), sizes.name, ": kv_scale (the cache's one scale) is required for kv_cache_dtype '",
                kv_cache_dtype, "'");
    TORCH_CHECK(kv_scale->numel() == 1 && kv_scale->scalar_type() == at::kFloat && kv_scale->device() == q.device(),
                sizes.name, ": kv_scale must be a 1-element float32 tensor on q's device ", q.device(), ", got ",
                dims(*kv_scale), " ", kv_scale->scalar_type(), " on ", kv_scale->device());
  } else {
    TORCH_CHECK(!kv_scale.has_value(), sizes.name, ": kv_scale must be None for kv_cache_dtype '", kv_cache_dtype,
                "'", ds_mla ? " (its scales are in each row)" : "");
  }
  const int64_t b = q.size(0), h = q.size(1);
  const int64_t kv_item = kv_cache.element_size();  // the row strides in bytes: whole 16-byte pieces
  TORCH_CHECK(q.stride(2) == 1 && kv_cache.stride(2) == 1 && q.stride(0) % 8 == 0 &&
                  q.stride(1) % 8 == 0 && kv_cache.stride(0) * kv_item % 16 == 0 &&
                  kv_cache.stride(1) * kv_item % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(kv_cache.data_ptr()) % 16 == 0,
              sizes.name, ": q's and kv_cache's rows must be contiguous and 16-byte aligned");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.size(0) == b && block_table.stride(1) == 1,
              sizes.name, ": block_table must be (b = ", num(b), ", max_pages) int32 with contiguous rows, got ",
              dims(block_table), " ", block_table.scalar_type());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == b &&
                  seq_lens.stride(0) == 1,
              sizes.name, ": seq_lens must be (b = ", num(b), ",) int32, contiguous, got ", dims(seq_lens));
  TORCH_CHECK(num_splits >= 1 && num_splits <= 65535, sizes.name, ": num_splits must be in [1, 65535], got ",
              num(num_splits));
  TORCH_CHECK(b <= 65535, sizes.name, ": at most 65535 sequences a launch, got ", num(b));
  if (dealt) {  // a slot a (sequence, piece) pair: b + num_splits - 1 of them
    const int64_t slots = b + num_splits - 1;
    TORCH_CHECK(part_out.scalar_type() == at::kFloat && part_out.dim() == 3 && part_out.size(0) == slots &&
                    part_out.size(1) == h && part_out.size(2) == sizes.c && part_out.stride(2) == 1 &&
                    part_out.stride(0) % 2 == 0 && part_out.stride(1) % 2 == 0 &&
                    reinterpret_cast<uintptr_t>(part_out.data_ptr()) % 8 == 0,
                sizes.name, ": part_out must be (b + num_splits - 1, h, ", num(sizes.c), ") = (", num(slots), ", ",
                num(h), ", ", num(sizes.c), ") float32, 8-byte aligned, got ", dims(part_out), " ",
                part_out.scalar_type());
    TORCH_CHECK(part_lse.scalar_type() == at::kFloat && part_lse.dim() == 2 && part_lse.size(0) == slots &&
                    part_lse.size(1) == h,
                sizes.name, ": part_lse must be (b + num_splits - 1, h) = (", num(slots), ", ", num(h),
                ") float32, got ", dims(part_lse), " ", part_lse.scalar_type());
  } else {
    // part_out is fp32 partials, or with one split the answer itself in q's dtype (nothing to merge)
    const bool final_out = num_splits == 1 && part_out.scalar_type() == q.scalar_type();
    TORCH_CHECK((part_out.scalar_type() == at::kFloat || final_out) && part_out.dim() == 4 &&
                    part_out.size(0) == b && part_out.size(1) == h && part_out.size(2) == num_splits &&
                    part_out.size(3) == sizes.c && part_out.stride(3) == 1 && part_out.stride(0) % 2 == 0 &&
                    part_out.stride(1) % 2 == 0 && part_out.stride(2) % 2 == 0 &&
                    reinterpret_cast<uintptr_t>(part_out.data_ptr()) % 8 == 0,
                sizes.name, ": part_out must be (b, h, num_splits, ", num(sizes.c), ") = (", num(b), ", ",
                num(h), ", ", num(num_splits), ", ", num(sizes.c),
                ") float32 (or q's dtype when num_splits is 1: the answer itself), 8-byte aligned, got ",
                dims(part_out), " ", part_out.scalar_type());
    TORCH_CHECK(part_lse.scalar_type() == at::kFloat && part_lse.dim() == 3 && part_lse.size(0) == b &&
                    part_lse.size(1) == h && part_lse.size(2) == num_splits,
                sizes.name, ": part_lse must be (b, h, num_splits) float32, got ", dims(part_lse));
  }
  for (const at::Tensor* t : {&kv_cache, &block_table, &seq_lens, &part_out, &part_lse}) {
    TORCH_CHECK(t->device() == q.device(), sizes.name, ": all tensors must be on q's device ",
                q.device(), ", got one on ", t->device());
  }
  return format;
}

}  // namespace mla

TORCH_LIBRARY(mla, m) {
  // kv_cache is written in place: Tensor(a!) tells the dispatcher (and torch.compile) so.
  m.def(
      "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "str kv_cache_dtype, Tensor? scale) -> ()");
  // Stage 1 of split-KV decode for <= 16 heads (mla/kernels/decode.py calls it as "cuda-sm80"): each split's
  // fp32 partial output and log-sum-exp, which the Triton merge combines into out and lse; with
  // num_splits = 1, part_out may be out itself (b, h, 1, c) in q's dtype and part_lse lse (b, h, 1).
  // kv_cache_dtype names the cache's layout (mla/kernels/fp8.py): 'auto' (q's dtype), 'fp8' /
  // 'fp8_e4m3' (kv_scale its 1-element float32 scale on the device) or 'fp8_ds_mla'.
  m.def(
      "mla_decode_sm80(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor(a!) part_out, Tensor(b!) part_lse, float softmax_scale, int num_splits, "
      "str kv_cache_dtype='auto', Tensor? kv_scale=None) -> ()");
  // The same for any number of heads, 64 a CTA, with Hopper's wgmma (mla_decode_sm90.cu), on the
  // same three layouts, and for q_tokens = s_q of 1 to 8 new tokens a sequence: q (b, s_q·h, c + r)
  // token-major, part_out (b, s_q·h, num_splits, c), part_lse (b, s_q·h, num_splits), new token j
  // seeing the first seq_len - (s_q - 1 - j) cached rows. With ranges given, the batch's tiles are
  // dealt instead: their pairs, sequence after sequence, cut evenly into num_splits pieces, so a
  // piece may hold the ends of several sequences and a sequence span several pieces. Piece z's
  // part of sequence i goes to slot i + z of part_out (b + num_splits - 1, s_q·h, c) and part_lse
  // (b + num_splits - 1, s_q·h), a sequence whole in one piece straight to out (b, s_q·h, c) in q's
  // dtype and lse (b, s_q·h); ranges (b, 2) int32 gets each sequence's first slot and piece count
  // (1: out and lse written, nothing to merge).
  m.def(
      "mla_decode_sm90(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor(a!) part_out, Tensor(b!) part_lse, float softmax_scale, int num_splits, "
      "str kv_cache_dtype='auto', Tensor? kv_scale=None, int q_tokens=1, Tensor(c!)? out=None, "
      "Tensor(d!)? lse=None, Tensor(e!)? ranges=None) -> ()");
}
