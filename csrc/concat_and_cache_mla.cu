// concat_and_cache_mla, CUDA: scatter each new token's [kv_c | k_pe] row into the paged cache.
//
// Goal: run at copy bandwidth. Each token moves (c + r) values (576 for DeepSeek: 1152 bytes in
// bf16) from two strided input rows to one cache row picked by slot_mapping; there is no reuse,
// so the kernel is a scatter whose only job is to keep enough bytes in flight.
//
// Work split: one thread per VEC-wide vector of a row (VEC * sizeof(in) = 16 bytes when the
// pointers and strides allow, else VEC = 1), in 2-D blocks of (vectors a row) x (rows). A row of
// 576 bf16 values is 72 vectors, so a block is 72 x 4 threads moving 4 rows: thread (j, y) of
// block k moves vector j of token 4k + y. Token and vector are the block and thread indices, no
// division; a warp moves consecutive vectors of one or two rows (coalesced) and no lane idles
// at a row's end. Rows of more than 1024 vectors take several blocks side by side (grid y).
//
//   for each thread (token i, vector j):
//     x, slot = the vector j of [kv_c[i] | k_pe[i]], slot_mapping[i]     (both loads in flight)
//     if slot < 0 or slot >= num_slots: done                            (-1 = skip)
//     kv_cache_flat[slot * (c + r) + j*VEC : ... + VEC] = q(x)
//
// On an H200 (bf16, random slots) this layout, with both loads in flight, runs at 0.82 / 0.87 of
// copy bandwidth at 64k / 256k tokens, where one flat index split by a 64-bit division, with the
// input load after the slot test, runs at 0.72 / 0.78; 2, 4 or 8 rows a thread run within 1% of
// one, and streaming cache hints (ld/st.global.cs) cost 5%
// (benchmarks/lab/results/h200-concat-probe.json, benchmarks/results/h200-concat.json).
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

#include <algorithm>
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
  CopyBits() = default;
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
  QuantizeE4M3() = default;
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

  // ---- which (token, vector) this thread moves: block (x, y) = (vector, row), grid (rows, vectors)
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t e = j * VEC;  // first element of this vector in the row [kv_c | k_pe]

  // ---- load the input and the slot together, then test the slot. Written this way (both loads
  // in one block, the slot -1 otherwise) the compiler issues the two loads back to back; with
  // the slot test between them it sinks the input load below the test, so each thread waits
  // for slot_mapping before asking for its input: two round trips to memory in a row (0.72 of
  // copy bandwidth at 64k tokens against 0.82).
  in_vec x;
  int64_t slot = -1;
  Q q;  // fp8: the scale is a third load, issued with the other two
  if (token < num_tokens && e < kv_lora_rank + rope_dim) {
    x = *reinterpret_cast<const in_vec*>(e < kv_lora_rank ? kv_c + token * stride_kv_c + e
                                                          : k_pe + token * stride_k_pe + (e - kv_lora_rank));
    slot = slot_mapping[token];
    q = Q(scale);
  }
  // -1 is padding (and the spare threads of the last blocks); slots past the cache are rejected
  // by the Python wrapper, skipped here so a caller of torch.ops.mla that skips validation
  // cannot write out of bounds.
  if (slot < 0 || slot >= num_slots) return;

  // ---- quantise (or copy) and store into the contiguous cache row of this slot
  cache_vec y;
#pragma unroll
  for (int t = 0; t < VEC; ++t) y.v[t] = q(x.v[t]);
  *reinterpret_cast<cache_vec*>(kv_cache + slot * (kv_lora_rank + rope_dim) + e) = y;
}

constexpr int64_t kThreads = 288;  // 4 rows of 72 vectors (576 bf16 values)

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
  // block: (vectors a row, capped at 1024) x (rows), about kThreads threads: 72 x 4 at c + r = 576
  const int64_t vecs_per_row = (a.kv_lora_rank + a.rope_dim) / (vec_ok ? kVec : 1);
  const dim3 block(static_cast<unsigned>(std::min<int64_t>(vecs_per_row, 1024)),
                   static_cast<unsigned>(std::max<int64_t>(1, kThreads / vecs_per_row)));
  const int64_t blocks = (a.num_tokens + block.y - 1) / block.y;
  TORCH_CHECK(blocks <= INT32_MAX, "concat_and_cache_mla: too many tokens for one launch");
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>((vecs_per_row + block.x - 1) / block.x));

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  if (vec_ok) {
    concat_and_cache_mla_kernel<Q, kVec><<<grid, block, 0, stream>>>(
        kv_c_ptr, k_pe_ptr, cache_ptr, slots, scale, a.num_tokens, a.kv_lora_rank, a.rope_dim,
        a.num_slots, stride_kv_c, stride_k_pe);
  } else {
    concat_and_cache_mla_kernel<Q, 1><<<grid, block, 0, stream>>>(
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
