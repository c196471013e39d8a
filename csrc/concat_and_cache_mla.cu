// concat_and_cache_mla, CUDA: scatter each new token's [kv_c | k_pe] row into the paged cache.
//
// Goal: run at copy bandwidth. Each token moves (c + r) values (576 for DeepSeek: 1152 bytes in
// bf16) from two strided input rows to one cache row picked by slot_mapping; there is no reuse,
// so the kernel is a gather-free scatter whose only job is to keep enough bytes in flight.
//
// Work split: one thread per VEC-wide vector of a row (VEC * sizeof(in) = 16 bytes when the
// pointers and strides allow, else VEC = 1). A row of 576 bf16 values is 72 vectors; thread k of
// the grid takes vector k % 72 of token k / 72, so a warp covers consecutive vectors of one or
// two tokens (coalesced), every launched thread moves 16 bytes and no lane idles at a row's end
// (one block or one warp per token would leave 56 of 128 lanes idle in its last pass).
//
//   for each thread (token i, vector j):
//     x     = j < c / VEC ? kv_c[i, j*VEC : j*VEC+VEC] : k_pe[i, j*VEC-c : ...]   (load first)
//     slot  = slot_mapping[i];  if slot < 0 or slot >= num_slots: done            (-1 = skip)
//     kv_cache_flat[slot * (c + r) + j*VEC : ... + VEC] = q(x)
//
// q is a bit copy (kv_cache_dtype "auto") or e4m3(clamp(x / scale, -448, 448)) ("fp8"): the
// division is IEEE (no fast-math), and __NV_SATFINITE clamps to +-448 while keeping NaN as NaN,
// which is what torch's clamp followed by a cast to float8_e4m3fn does.
#include "concat_and_cache_mla.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>

namespace mla {
namespace {

// N values of T that move as one aligned load / store.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// q for kv_cache_dtype "auto": the cache has the inputs' dtype, so move the bits.
template <typename bits_t>
struct CopyBits {
  using in_t = bits_t;
  using cache_t = bits_t;
  __device__ explicit CopyBits(const float*) {}
  __device__ bits_t operator()(bits_t x) const { return x; }
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// q for kv_cache_dtype "fp8": e4m3(clamp(x / scale, -448, 448)), round to nearest even.
template <typename input_t>
struct QuantizeE4M3 {
  using in_t = input_t;
  using cache_t = __nv_fp8_storage_t;  // the e4m3 byte
  float scale;
  __device__ explicit QuantizeE4M3(const float* scale_ptr) : scale(*scale_ptr) {}
  __device__ cache_t operator()(in_t x) const {
    return __nv_cvt_float_to_fp8(to_float(x) / scale, __NV_SATFINITE, __NV_E4M3);
  }
};

template <typename Q, int VEC>
__global__ void concat_and_cache_mla_kernel(
    // pointers
    const typename Q::in_t* __restrict__ kv_c,     // (T, c), row stride stride_kv_c
    const typename Q::in_t* __restrict__ k_pe,     // (T, r), row stride stride_k_pe
    typename Q::cache_t* __restrict__ kv_cache,    // (num_slots, c + r), contiguous
    const int64_t* __restrict__ slot_mapping,      // (T,)
    const float* __restrict__ scale,               // (1,) for fp8, else unused
    // sizes
    int64_t num_tokens, int64_t kv_lora_rank, int64_t rope_dim, int64_t num_slots,
    // strides (elements)
    int64_t stride_kv_c, int64_t stride_k_pe) {
  using in_vec = Vec<typename Q::in_t, VEC>;
  using cache_vec = Vec<typename Q::cache_t, VEC>;

  // ---- which (token, vector) this thread moves
  const int64_t vecs_per_row = (kv_lora_rank + rope_dim) / VEC;
  const int64_t total = num_tokens * vecs_per_row;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= total) return;
  int64_t token, j;
  if (total <= UINT32_MAX) {  // uniform branch: 32-bit division is several times cheaper
    const uint32_t k32 = static_cast<uint32_t>(k), n32 = static_cast<uint32_t>(vecs_per_row);
    token = k32 / n32;
    j = k32 - static_cast<uint32_t>(token) * n32;
  } else {
    token = k / vecs_per_row;
    j = k - token * vecs_per_row;
  }
  const int64_t e = j * VEC;  // first element of this vector in the row [kv_c | k_pe]

  // ---- load the inputs before the slot, so the two loads are in flight together
  in_vec x;
  if (e < kv_lora_rank) {
    x = *reinterpret_cast<const in_vec*>(kv_c + token * stride_kv_c + e);
  } else {
    x = *reinterpret_cast<const in_vec*>(k_pe + token * stride_k_pe + (e - kv_lora_rank));
  }
  const int64_t slot = slot_mapping[token];
  // -1 is padding; slots past the cache are rejected by the Python wrapper, skipped here so that
  // a caller of torch.ops.mla that skips validation cannot write out of bounds.
  if (slot < 0 || slot >= num_slots) return;

  // ---- quantise (or copy) and store into the contiguous cache row of this slot
  const Q q(scale);
  cache_vec y;
#pragma unroll
  for (int t = 0; t < VEC; ++t) y.v[t] = q(x.v[t]);
  *reinterpret_cast<cache_vec*>(kv_cache + slot * (kv_lora_rank + rope_dim) + e) = y;
}

constexpr int kThreads = 256;

template <typename Q>
void launch(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
            const at::Tensor& slot_mapping, const float* scale, const ConcatAndCacheArgs& a) {
  using in_t = typename Q::in_t;
  using cache_t = typename Q::cache_t;
  constexpr int kVec = 16 / sizeof(in_t);  // 16-byte loads

  const auto* kv_c_ptr = reinterpret_cast<const in_t*>(kv_c.const_data_ptr());
  const auto* k_pe_ptr = reinterpret_cast<const in_t*>(k_pe.const_data_ptr());
  auto* cache_ptr = reinterpret_cast<cache_t*>(kv_cache.data_ptr());
  const int64_t stride_kv_c = kv_c.stride(0), stride_k_pe = k_pe.stride(0);

  // The vector path needs every vector of every row aligned: the base pointers, the row strides
  // and the seam at c (in the inputs and in the cache row) all on a VEC boundary.
  auto aligned = [](const void* p, int64_t bytes) {
    return reinterpret_cast<uintptr_t>(p) % bytes == 0;
  };
  const bool vec_ok = a.kv_lora_rank % kVec == 0 && a.rope_dim % kVec == 0 &&
                      stride_kv_c % kVec == 0 && stride_k_pe % kVec == 0 &&
                      aligned(kv_c_ptr, 16) && aligned(k_pe_ptr, 16) &&
                      aligned(cache_ptr, kVec * sizeof(cache_t));
  const int64_t vecs = a.num_tokens * (a.kv_lora_rank + a.rope_dim) / (vec_ok ? kVec : 1);
  const int64_t blocks = (vecs + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks <= INT32_MAX, "concat_and_cache_mla: too many tokens for one launch");

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  if (vec_ok) {
    concat_and_cache_mla_kernel<Q, kVec><<<blocks, kThreads, 0, stream>>>(
        kv_c_ptr, k_pe_ptr, cache_ptr, slots, scale, a.num_tokens, a.kv_lora_rank, a.rope_dim,
        a.num_slots, stride_kv_c, stride_k_pe);
  } else {
    concat_and_cache_mla_kernel<Q, 1><<<blocks, kThreads, 0, stream>>>(
        kv_c_ptr, k_pe_ptr, cache_ptr, slots, scale, a.num_tokens, a.kv_lora_rank, a.rope_dim,
        a.num_slots, stride_kv_c, stride_k_pe);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void concat_and_cache_mla_cuda(const at::Tensor& kv_c, const at::Tensor& k_pe,
                               at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                               const std::string& kv_cache_dtype,
                               const std::optional<at::Tensor>& scale) {
  const ConcatAndCacheArgs a =
      check_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale);
  TORCH_CHECK(slot_mapping.is_contiguous(), "slot_mapping must be contiguous");
  if (a.num_tokens == 0 || a.kv_lora_rank + a.rope_dim == 0) return;
  const c10::cuda::CUDAGuard device_guard(kv_cache.device());

  if (!a.fp8) {
    // Same dtype in and out: move 2- or 4-byte words without looking at them.
    if (kv_c.element_size() == 2) {
      launch<CopyBits<uint16_t>>(kv_c, k_pe, kv_cache, slot_mapping, nullptr, a);
    } else {
      launch<CopyBits<uint32_t>>(kv_c, k_pe, kv_cache, slot_mapping, nullptr, a);
    }
    return;
  }
  // The scale stays on the device (no sync); the wrapper has checked it is positive and finite.
  const float* s = scale->const_data_ptr<float>();
  switch (kv_c.scalar_type()) {
    case at::kBFloat16:
      launch<QuantizeE4M3<__nv_bfloat16>>(kv_c, k_pe, kv_cache, slot_mapping, s, a);
      break;
    case at::kHalf:
      launch<QuantizeE4M3<__half>>(kv_c, k_pe, kv_cache, slot_mapping, s, a);
      break;
    case at::kFloat:
      launch<QuantizeE4M3<float>>(kv_c, k_pe, kv_cache, slot_mapping, s, a);
      break;
    default:
      TORCH_CHECK(false, "unsupported input dtype ", kv_c.scalar_type());
  }
}

}  // namespace
}  // namespace mla

TORCH_LIBRARY_IMPL(mla, CUDA, m) {
  m.impl("concat_and_cache_mla", &mla::concat_and_cache_mla_cuda);
}
