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
// q is a bit copy (kv_cache_dtype "auto") or e4m3(clamp(x / scale, -448, 448)) ("fp8"), bit for
// bit torch's IEEE quotient, clamp and cast to float8_e4m3fn; every NaN is stored as 0x7F,
// whatever its sign. The quotient takes one product and two FMAs from the scale's correctly
// rounded reciprocal, not a division a value, and the bytes are rounded two at a time (divide
// and store_e4m3 below say how, and why the bytes are the reference's).
//
// kv_cache_dtype "fp8_ds_mla" (FlashMLA's 656-byte token) has a kernel of its own below,
// concat_and_cache_ds_mla_kernel: its group scales need a reduction over 128 values before any
// of them is stored, so a warp takes a token at a time (two a warp) instead of one thread a vector.
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
  template <int N>  // dst: N values, aligned as Vec<bits_t, N>
  __device__ void store(bits_t* dst, const Vec<bits_t, N>& x) const {
    *reinterpret_cast<Vec<bits_t, N>*>(dst) = x;
  }
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// ---- x / scale and its e4m3 byte, for both fp8 writers ------------------------------------------
//
// The reference stores e4m3(clamp(RN(x / s), -448, 448)): an IEEE quotient, then e4m3's rounding.
// An IEEE division a value costs a reciprocal estimate, Newton steps, a range check and a call to
// a slow path; here one correctly rounded reciprocal r = RN(1 / s) serves every value of a scale
// and each quotient is one product and two FMAs (Markstein's correction):
//
//   q0 = RN(x r)            within 1.5 ulp of x / s (r itself is rounded)
//   e  = RN(q0 s - x)       the remainder, rounded when it needs more than 24 bits
//   q1 = RN(q0 - e r)       = RN(x / s)
//
// For s in [kReciprocalMin, kReciprocalMax] = [2^-64, 2^126] this stores the reference's byte
// for every float x. Not by Markstein's theorem: q0 is not always within an ulp, so the
// remainder is not always exact. q1 still lands on RN(x / s) because its error stays well below
// the distance from x / s to the nearest float32 rounding boundary (about 8 units of the last
// place of the remainder, against boundaries no closer than that; a bound, not a proof), and
// that is checked, not assumed: the model below tests every x within 32 units of a rounding
// boundary for every scale mantissa, besides whole mantissa sweeps. There r is a normal float,
// and an x whose quotient can round to a nonzero e4m3 value (|x / s| >= 2^-10) is at least 2^-74
// in size, so no step underflows for it; a smaller quotient can come out an ulp off, but it is
// stored as a zero of x's sign either way. e is q0 s - x rather
// than x - q0 s so that x = -0 gives e = +0 and q1 = -e r + q0 = -0, as the reference's -0 / s.
// Where x r overflows (or x is +-inf) q0 is +-inf and the reference's quotient is past 448
// too: q0 is taken, as q1 would be inf - inf = NaN. Other scales divide: below 2^-64 the
// remainder of a tiny x can lose bits (fp8_ds_mla's groups of tiny values make such scales),
// above 2^126 r is subnormal, and NaN or inf (fp8_ds_mla's spoiled groups) need the division's
// rules. benchmarks/lab/model_concat_division.py replays these float32 steps exactly on the CPU
// against torch's quotient, clamp and cast: every float32 x mantissa against 48 scale mantissas
// (q bit for bit), every bf16 and fp16 input and float32 inputs beside every e4m3 rounding
// boundary against 82 scales, and fp8.quantize_ds_mla's groups: not one byte differs, and no
// quotient differs but tiny or saturated ones. Without the guard, scales outside it do differ.
constexpr float kReciprocalMin = 0x1p-64f;
constexpr float kReciprocalMax = 0x1p126f;

// Whether x / s may take divide(x, s, RN(1 / s)); false for NaN.
__device__ __forceinline__ bool reciprocal_divides(float s) {
  return s >= kReciprocalMin && s <= kReciprocalMax;
}

// RN(x / s) as the stored byte sees it, from r = RN(1 / s) (__frcp_rn): see above.
__device__ __forceinline__ float divide(float x, float s, float r) {
  const float q0 = __fmul_rn(x, r);
  const float e = __fmaf_rn(q0, s, -x);   // q0 s - x (rounded only where q1 does not care)
  const float q1 = __fmaf_rn(-e, r, q0);  // q0 - e / s
  return isinf(q0) ? q0 : q1;
}

// Packed e4m3 bytes with each NaN byte's sign cleared: 0xFF -> 0x7F. A byte whose low 7 bits are
// all ones is a NaN (satfinite's largest finite byte is 0x7E); adding 1 to its low 7 bits carries
// into bit 7, and never past it, so the sum marks exactly the NaN bytes.
__device__ __forceinline__ uint32_t nan_as_0x7f(uint32_t bytes) {
  const uint32_t nan = ((bytes & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
  return bytes & ~nan;
}

// Quotients to e4m3 bytes: round to nearest even, saturate to +-448 (inf too), as torch's clamp
// and cast, every NaN as 0x7F. cvt.rn.satfinite.e4m3x2.f32 (sm_89+; cuda_fp8.h's software
// rounding before) rounds two at a time and keeps a NaN as an e4m3 NaN of either sign, so the
// sign is cleared afterwards on the packed word.
//
// v[0..3] -> one word, v[0] in its low byte (the first in memory)
__device__ __forceinline__ uint32_t e4m3x4(const float* v) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[0], v[1]), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[2], v[3]), __NV_SATFINITE, __NV_E4M3);
  return nan_as_0x7f(lo | (hi << 16));
}

// N quotients stored as N bytes at dst (aligned as N bytes); N is 1 or a multiple of 4.
template <int N>
__device__ __forceinline__ void store_e4m3(__nv_fp8_storage_t* dst, const float (&v)[N]) {
  if constexpr (N % 4 == 0) {
    Vec<uint32_t, N / 4> words;
#pragma unroll
    for (int k = 0; k < N / 4; ++k) words.v[k] = e4m3x4(v + 4 * k);
    *reinterpret_cast<Vec<uint32_t, N / 4>*>(dst) = words;
  } else {
    static_assert(N == 1, "store_e4m3 takes 1 value or a multiple of 4");
    *dst = static_cast<__nv_fp8_storage_t>(
        nan_as_0x7f(__nv_cvt_float_to_fp8(v[0], __NV_SATFINITE, __NV_E4M3)));
  }
}

// q for kv_cache_dtype "fp8": e4m3(clamp(x / scale, -448, 448)), round to nearest even.
template <typename input_t>
struct QuantizeE4M3 {
  using in_t = input_t;
  using cache_t = __nv_fp8_storage_t;  // the e4m3 byte
  float scale;
  QuantizeE4M3() = default;
  __device__ explicit QuantizeE4M3(const float* scale_ptr) : scale(*scale_ptr) {}
  template <int N>  // dst: N bytes, aligned as N bytes
  __device__ void store(cache_t* dst, const Vec<in_t, N>& x) const {
    float v[N];
    if (reciprocal_divides(scale)) {  // one scale for the cache: every thread takes one branch
      const float r = __frcp_rn(scale);
#pragma unroll
      for (int t = 0; t < N; ++t) v[t] = divide(to_float(x.v[t]), scale, r);
    } else {
#pragma unroll
      for (int t = 0; t < N; ++t) v[t] = to_float(x.v[t]) / scale;
    }
    store_e4m3(dst, v);
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
  q.store(kv_cache + slot * (kv_lora_rank + rope_dim) + e, x);
}

// ---- fp8_ds_mla: a warp takes two tokens, one at a time ----------------------------------------
//
// A row becomes c e4m3 bytes, c/128 float32 scales and r bf16 values (mla/kernels/fp8.py).
// The scale of a 128-value group needs the group's amax before any of its values can be
// stored, so the 32 lanes of a warp take one token and sweep its latent 512 values at a time:
// lane l holds values [16 l, 16 l + 16) of the sweep, so lanes 8k .. 8k + 7 hold group k and
// three xor-shuffles (4, 2, 1) give each of them the group's amax. Each lane then stores its
// 16 e4m3 bytes as one 16-byte vector, and the first lane of each group the group's scale.
//
// A warp takes kDsMlaTokensPerWarp tokens and asks for all of their first sweeps, rope values
// and slots before it quantises the first: a warp spends most of its time on the amax and the
// quotients, so with one token a warp the loads in flight on an SM are too few to keep memory
// busy. The values wait in the input's dtype (8 registers a sweep for bf16, not 16 floats).
//
//   for each warp (tokens i0, i0 + 1):
//     for each token i: x_i = kv_c[i, 16 l : 16 l + 16], its first kDsMlaRopeAhead rope values
//                       and slot_mapping[i], all asked for before any is used
//     for each token i, then: scale of the first sweep (below), before any slot is tested
//     for each token i (skipped if slot < 0 or slot >= num_slots):
//       for base in 0, 512, ... < c:                       (lanes past c idle but shuffle)
//         (base > 0: x = kv_c[i, base + 16 l : base + 16 l + 16])
//         amax = max |x| over the 8 lanes of the group    (NaN wins, as in torch.amax)
//         scale = max(amax / 448, 2^-126)                 (NaN stored as 0x7FC00000)
//         row[base + 16 l : ... + 16] = e4m3(clamp(x / scale, -448, 448))   (NaN as 0x7F)
//         row[c + 4 g] = scale                            (lane 8k, g = (base + 16 l) / 128)
//       row[c + 4 c/128 + 2 e] = bf16(k_pe[i, e])  for e = l, l + 32, ...   (NaN as 0x7FC0)
//
// Loads and stores go 16 bytes at a time where pointers and strides allow (VEC_IN, VEC_OUT),
// else one element or byte at a time; the values and roundings are the same either way.

constexpr int kDsMlaWarps = 8;            // warps a block of 256 threads
constexpr int kDsMlaTokensPerWarp = 2;    // tokens a warp, loaded together
constexpr int kDsMlaBlocksPerSm = 3;      // at least 3 blocks an SM (80 registers a thread at most): 48 tokens in flight
constexpr int kDsMlaValuesPerLane = 16;   // 32 lanes x 16 = 512 latent values a sweep
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kDsMlaRopeAhead = 2;        // rope values a lane reads before the slot: r <= 64 all

// max(a, b) where a NaN wins: the combine of torch.amax, associative so any reduction order
// gives the same bits.
__device__ __forceinline__ float nan_max(float a, float b) { return (isnan(a) || a > b) ? a : b; }

// to bf16, rounding to nearest even, a NaN as the positive quiet NaN 0x7FC0
template <typename in_t>
__device__ __forceinline__ __nv_bfloat16 to_bf16(in_t x) {
  const float f = to_float(x);
  return isnan(f) ? __ushort_as_bfloat16(0x7FC0) : __float2bfloat16_rn(f);
}

// a lane's 16 values of a sweep, as stored in the input
template <typename in_t>
struct alignas(16) Sweep {
  in_t v[kDsMlaValuesPerLane];
};

// 16 consecutive input values, zeros when `inside` is false (past c)
template <typename in_t, bool VEC>
__device__ __forceinline__ void load16(const in_t* __restrict__ src, bool inside, Sweep<in_t>& x) {
  if (!inside) {  // zero bits are a zero in every input dtype
#pragma unroll
    for (int k = 0; k < int(sizeof(Sweep<in_t>)) / 16; ++k) reinterpret_cast<uint4*>(x.v)[k] = make_uint4(0u, 0u, 0u, 0u);
  } else if constexpr (VEC) {
    constexpr int kPer = 16 / sizeof(in_t);  // values a 16-byte load
    using vec_t = Vec<in_t, kPer>;
#pragma unroll
    for (int k = 0; k < kDsMlaValuesPerLane / kPer; ++k) {
      reinterpret_cast<vec_t*>(x.v)[k] = reinterpret_cast<const vec_t*>(src)[k];
    }
  } else {
#pragma unroll
    for (int t = 0; t < kDsMlaValuesPerLane; ++t) x.v[t] = src[t];
  }
}

template <typename in_t, bool VEC_IN, bool VEC_OUT>
__global__ void __launch_bounds__(32 * kDsMlaWarps, kDsMlaBlocksPerSm) concat_and_cache_ds_mla_kernel(
    // pointers
    const in_t* __restrict__ kv_c,             // (T, c), row stride stride_kv_c
    const in_t* __restrict__ k_pe,             // (T, r), row stride stride_k_pe
    uint8_t* __restrict__ kv_cache,            // (num_slots, c + 4 c/128 + 2 r) bytes, contiguous
    const int64_t* __restrict__ slot_mapping,  // (T,)
    // sizes
    int64_t num_tokens, int64_t kv_lora_rank, int64_t rope_dim, int64_t num_slots,
    // strides (elements)
    int64_t stride_kv_c, int64_t stride_k_pe) {
  // ---- which tokens: kDsMlaTokensPerWarp a warp; each token's tests are uniform over the warp,
  // so the shuffles below see all 32 lanes
  const int lane = threadIdx.x % 32;
  const int64_t first =
      (static_cast<int64_t>(blockIdx.x) * kDsMlaWarps + threadIdx.x / 32) * kDsMlaTokensPerWarp;
  if (first >= num_tokens) return;
  const int64_t c = kv_lora_rank, r = rope_dim, groups = c / kDsMlaGroup;

  // ---- every token's first sweep of latent values, first kDsMlaRopeAhead x 32 rope values and
  // slot, asked for together before any is used: for c = 512 and r <= 64 a warp makes one round
  // trip to memory for its tokens, not one each (a later sweep, and rope values past the first
  // 64, are read after the slot test). A padding token's values are read and dropped; a token
  // past the end reads nothing and has slot -1.
  Sweep<in_t> x[kDsMlaTokensPerWarp];
  float pe[kDsMlaTokensPerWarp][kDsMlaRopeAhead];
  int64_t slot[kDsMlaTokensPerWarp];
#pragma unroll
  for (int i = 0; i < kDsMlaTokensPerWarp; ++i) {
    const int64_t token = first + i;
    const bool real = token < num_tokens;
    load16<in_t, VEC_IN>(kv_c + token * stride_kv_c + lane * kDsMlaValuesPerLane,
                         real && lane * kDsMlaValuesPerLane < c, x[i]);
#pragma unroll
    for (int k = 0; k < kDsMlaRopeAhead; ++k) {
      pe[i][k] = real && lane + 32 * k < r ? to_float(k_pe[token * stride_k_pe + lane + 32 * k]) : 0.0f;
    }
    slot[i] = real ? slot_mapping[token] : -1;
  }

  // group g's scale of the values in x: the amax over the group's 8 lanes (three xor-shuffles)
  auto sweep_scale = [&](const Sweep<in_t>& xs) {
    float amax = 0.0f;
#pragma unroll
    for (int t = 0; t < kDsMlaValuesPerLane; ++t) amax = nan_max(fabsf(to_float(xs.v[t])), amax);
#pragma unroll
    for (int offset = 4; offset > 0; offset /= 2) {  // within lanes 8k .. 8k + 7
      amax = nan_max(__shfl_xor_sync(kFullMask, amax, offset), amax);
    }
    // IEEE division (no fast-math), as the reference's float32 quotient
    float scale = amax / 448.0f;
    const float min_scale = __int_as_float(0x00800000);  // 2^-126, the smallest normal float
    if (scale < min_scale) scale = min_scale;
    if (isnan(scale)) scale = __int_as_float(0x7fc00000);  // the positive quiet NaN, as on the CPU
    return scale;
  };

  // the first sweep's scales of every token, before any slot is tested: the scales need the
  // loads, so no load of a token can sink below its test (into a second round trip)
  float first_scale[kDsMlaTokensPerWarp];
#pragma unroll
  for (int i = 0; i < kDsMlaTokensPerWarp; ++i) first_scale[i] = sweep_scale(x[i]);

#pragma unroll
  for (int i = 0; i < kDsMlaTokensPerWarp; ++i) {
    // -1 is padding; slots past the cache are rejected by the Python wrapper, skipped here so a
    // direct caller of torch.ops.mla cannot write out of bounds
    if (slot[i] < 0 || slot[i] >= num_slots) continue;
    const int64_t token = first + i;
    uint8_t* row = kv_cache + slot[i] * (c + 4 * groups + 2 * r);

    // ---- the latent, 512 values (4 groups) a sweep
    for (int64_t base = 0; base < c; base += 32 * kDsMlaValuesPerLane) {
      const int64_t e = base + lane * kDsMlaValuesPerLane;  // this lane's first value
      if (base > 0) load16<in_t, VEC_IN>(kv_c + token * stride_kv_c + e, e < c, x[i]);
      const float scale = base > 0 ? sweep_scale(x[i]) : first_scale[i];
      if (e >= c) continue;  // c is a multiple of 128: a group's 8 lanes agree

      float v[kDsMlaValuesPerLane];
      if (reciprocal_divides(scale)) {  // all but groups of tiny values, NaN or inf: see divide
        const float rcp = __frcp_rn(scale);
#pragma unroll
        for (int t = 0; t < kDsMlaValuesPerLane; ++t) v[t] = divide(to_float(x[i].v[t]), scale, rcp);
      } else {
#pragma unroll
        for (int t = 0; t < kDsMlaValuesPerLane; ++t) v[t] = to_float(x[i].v[t]) / scale;
      }
      uint8_t* scale_dst = row + c + 4 * (e / kDsMlaGroup);
      if constexpr (VEC_OUT) {
        store_e4m3(row + e, v);
        if (lane % 8 == 0) *reinterpret_cast<float*>(scale_dst) = scale;
      } else {
#pragma unroll
        for (int k = 0; k < kDsMlaValuesPerLane / 4; ++k) {
          const uint32_t word = e4m3x4(v + 4 * k);
          for (int t = 0; t < 4; ++t) row[e + 4 * k + t] = static_cast<uint8_t>(word >> (8 * t));
        }
        if (lane % 8 == 0) {
          const uint32_t bits = __float_as_uint(scale);
          for (int k = 0; k < 4; ++k) scale_dst[k] = static_cast<uint8_t>(bits >> (8 * k));
        }
      }
    }

    // ---- the rope part in bf16, lanes striding over its r values (the first kDsMlaRopeAhead of
    // each lane read above)
    uint8_t* rope = row + c + 4 * groups;
    auto store_rope = [&](int64_t e, float value) {
      const __nv_bfloat16 y = to_bf16(value);
      if constexpr (VEC_OUT) {
        reinterpret_cast<__nv_bfloat16*>(rope)[e] = y;
      } else {
        const uint16_t bits = __bfloat16_as_ushort(y);
        rope[2 * e] = static_cast<uint8_t>(bits);
        rope[2 * e + 1] = static_cast<uint8_t>(bits >> 8);
      }
    };
#pragma unroll
    for (int k = 0; k < kDsMlaRopeAhead; ++k) {
      if (lane + 32 * k < r) store_rope(lane + 32 * k, pe[i][k]);
    }
    for (int64_t e = lane + 32 * kDsMlaRopeAhead; e < r; e += 32) {
      store_rope(e, to_float(k_pe[token * stride_k_pe + e]));
    }
  }
}

template <typename in_t>
void launch_ds_mla(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
                   const at::Tensor& slot_mapping, const ConcatAndCacheArgs& a) {
  const auto* kv_c_ptr = reinterpret_cast<const in_t*>(kv_c.const_data_ptr());
  const auto* k_pe_ptr = reinterpret_cast<const in_t*>(k_pe.const_data_ptr());
  auto* cache_ptr = static_cast<uint8_t*>(kv_cache.data_ptr());
  const int64_t stride_kv_c = kv_c.stride(0), stride_k_pe = k_pe.stride(0);
  const int64_t width = a.kv_lora_rank + 4 * (a.kv_lora_rank / kDsMlaGroup) + 2 * a.rope_dim;

  // 16-byte loads need the kv_c base and row stride on 16 bytes (each lane's 16 values start
  // 16 values apart); 16-byte stores need every row on 16 bytes (656 is 41 x 16).
  const bool vec_in = reinterpret_cast<uintptr_t>(kv_c_ptr) % 16 == 0 &&
                      (stride_kv_c * static_cast<int64_t>(sizeof(in_t))) % 16 == 0;
  const bool vec_out = reinterpret_cast<uintptr_t>(cache_ptr) % 16 == 0 && width % 16 == 0;

  constexpr int64_t kTokensPerBlock = kDsMlaWarps * kDsMlaTokensPerWarp;
  const int64_t blocks = (a.num_tokens + kTokensPerBlock - 1) / kTokensPerBlock;
  TORCH_CHECK(blocks <= INT32_MAX, "concat_and_cache_mla: too many tokens for one launch");
  const dim3 grid(static_cast<unsigned>(blocks)), block(32 * kDsMlaWarps);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  auto run = [&](auto kernel) {
    kernel<<<grid, block, 0, stream>>>(kv_c_ptr, k_pe_ptr, cache_ptr, slots, a.num_tokens,
                                       a.kv_lora_rank, a.rope_dim, a.num_slots, stride_kv_c,
                                       stride_k_pe);
  };
  if (vec_in && vec_out) {
    run(concat_and_cache_ds_mla_kernel<in_t, true, true>);
  } else if (vec_in) {
    run(concat_and_cache_ds_mla_kernel<in_t, true, false>);
  } else if (vec_out) {
    run(concat_and_cache_ds_mla_kernel<in_t, false, true>);
  } else {
    run(concat_and_cache_ds_mla_kernel<in_t, false, false>);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---- the launcher of concat_and_cache_mla_kernel ------------------------------------------------

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

  if (a.format == CacheFormat::kFp8DsMla) {
    switch (kv_c.scalar_type()) {
      case at::kBFloat16:
        launch_ds_mla<__nv_bfloat16>(kv_c, k_pe, kv_cache, slot_mapping, a);
        break;
      case at::kHalf:
        launch_ds_mla<__half>(kv_c, k_pe, kv_cache, slot_mapping, a);
        break;
      case at::kFloat:
        launch_ds_mla<float>(kv_c, k_pe, kv_cache, slot_mapping, a);
        break;
      default: TORCH_CHECK(false, "unsupported input dtype ", kv_c.scalar_type());
    }
    return;
  }
  if (a.format == CacheFormat::kAuto) {
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
