// Reading the fp8 cache layouts in the CUDA decode stage-1 kernels (mla_decode_sm80.cu,
// mla_decode_sm90.cu): where the parts of a stored row lie, and the device helpers that turn its
// bytes into values in the products' dtype (bf16 / fp16): the e4m3 values themselves, exactly,
// with the scale applied elsewhere; fp8_ds_mla's bf16 rope values converted.
#pragma once

#include "concat_and_cache_mla.h"  // CacheFormat, kDsMlaGroup

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace mla {

// The stored rows of the fp8 layouts (mla/kernels/fp8.py) for a latent of c values and a rope
// part of r: fp8_e4m3 holds c + r e4m3 bytes; fp8_ds_mla holds c e4m3 bytes, then c / 128 float32
// scales from byte ds_mla_scales(c), then r bf16 values from byte ds_mla_rope(c).
constexpr int ds_mla_scales(int c) { return c; }
constexpr int ds_mla_rope(int c) { return ds_mla_scales(c) + 4 * c / static_cast<int>(kDsMlaGroup); }
// Bytes of a stored row of layout f (0 for kAuto, whose rows hold values in q's dtype).
constexpr int stored_row_bytes(CacheFormat f, int c, int r) {
  return f == CacheFormat::kFp8E4M3 ? c + r : f == CacheFormat::kFp8DsMla ? ds_mla_rope(c) + 2 * r : 0;
}

// two floats, rounded to T, as one 4-byte store (dst 4-byte aligned)
__device__ __forceinline__ void store_pair(__nv_bfloat16* dst, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ void store_pair(__half* dst, float x, float y) {
  *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(x, y);
}

// Two floats rounded to T (round to nearest even) as 4 bytes, x in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float x, float y) {
  uint32_t pair;
  store_pair(reinterpret_cast<T*>(&pair), x, y);
  return pair;
}

// ---------------------------------------------------------------------------------------------
// Straight into mma fragments: the sm_80 kernel builds its B fragments from stored bytes in
// registers, two values (one 32-bit fragment register) at a time, with no float round trip.

// Two e4m3 bytes -> the two values in T (bf16 or fp16), exactly, as the 4 bytes of a T pair, the
// first value in the low half. The bytes are bytes `lo` and `hi` of the 8 bytes (a, b) (a's bytes
// 0..3, b's 4..7, each little-endian); lo and hi are constants once the caller's loops unroll,
// so the byte permute has a fixed selector.
//
// bf16, by integer operations and one exact multiply: the permute puts each byte in the high
// byte of its 16-bit lane (the lanes' low bytes are ignored), so the e4m3 sign sits on bf16's
// sign bit; the 7 magnitude bits (4 exponent bits E, 3 mantissa bits m) move down 4 places,
// E onto the low 4 bits of bf16's 8-bit exponent field and m onto the top 3 of its 7 mantissa
// bits. That bf16 is 2^(E-127) (1 + m/8) for E >= 1 and, for E = 0, the bf16 subnormal
// (m/8) 2^-126 = m 2^-129; the e4m3 value is 2^(E-7) (1 + m/8), and m 2^-9 for E = 0: in both
// cases 2^120 times the bf16. 2^120 is a bf16 and the product (at most 480 in magnitude, at
// least 2^-9 unless zero) is a bf16, so the multiply rounds nothing; the signed zeros stay
// signed (the multiply adds -0). bf16's subnormals take part in the multiply: sm_80's
// fma.rn.bf16x2 and sm_90's mul.bf16x2 keep them (bf16 has no flush-to-zero form).
// fp16 before sm_89, the same way with fp16's 5 exponent bits: magnitude down 1 place, E on
// the low 4 exponent bits, m on the top 3 of 10 mantissa bits, 2^(E-15) (1 + m/8) or the fp16
// subnormal m 2^-17, times 2^8 (exact: at most 480, fp16 keeps its subnormals in the multiply).
// fp16 on sm_89 and later: one cvt.rn.f16x2.e4m3x2, exact for every e4m3 value.
// The e4m3 NaN bytes (0x7F, 0xFF) become +-480 by the integer routes (NaN by cvt): the kernels
// convert only rows a writer stored (every finite input is stored finite) or rows the copies
// zero-filled (0x00 = +0), never a NaN-poisoned byte.
template <typename T>
__device__ __forceinline__ uint32_t e4m3x2_to(uint32_t a, uint32_t b, uint32_t lo, uint32_t hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t x = __byte_perm(a, b, (lo << 4) | (hi << 12));  // bytes lo, hi on bits 8-15, 24-31
    uint32_t bits = (x & 0x80008000u) | ((x >> 4) & 0x07F007F0u);
    const uint32_t two_120 = 0x7B807B80u;  // bf16 2^120 in both lanes
    __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits),
                               *reinterpret_cast<const __nv_bfloat162*>(&two_120));
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    const uint32_t two = __byte_perm(a, b, lo | (hi << 4));  // bytes lo, hi on bits 0-7, 8-15
    const __half2_raw v = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), __NV_E4M3);
    return static_cast<uint32_t>(v.x) | (static_cast<uint32_t>(v.y) << 16);
#else
    const uint32_t x = __byte_perm(a, b, (lo << 4) | (hi << 12));  // bytes lo, hi on bits 8-15, 24-31
    uint32_t bits = (x & 0x80008000u) | ((x >> 1) & 0x3F803F80u);
    const uint32_t two_8 = 0x5C005C00u;  // fp16 2^8 in both lanes
    __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&bits), *reinterpret_cast<const __half2*>(&two_8));
    return *reinterpret_cast<const uint32_t*>(&v);
#endif
  }
}

// Four e4m3 bytes -> their values in T as two T pairs: bytes 0, 1 in b0 and 2, 3 in b1 (each pair's
// lower byte in its low half), as e4m3x2_to<T>(v, v, 0, 1) and (v, v, 2, 3) give them. fp16 on
// sm_89 and later converts each half of v in place, with no byte permute.
template <typename T>
__device__ __forceinline__ void e4m3x4_to(uint32_t v, uint32_t& b0, uint32_t& b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (std::is_same_v<T, __half>) {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n cvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
        : "=r"(b0), "=r"(b1)
        : "r"(v));
    return;
  }
#endif
  b0 = e4m3x2_to<T>(v, v, 0, 1);
  b1 = e4m3x2_to<T>(v, v, 2, 3);
}

// The power of two K that takes x >= 0 to [2^14, 2^15) (fp16's largest finite value is 65504, its
// smallest normal 2^-14), at most 2^126; 1 for an infinite or NaN x. Scaling by K is exact and
// keeps every value of a set whose largest magnitude is x finite in fp16, and exact there down to
// x 2^-28 for values of 11 significant bits or fewer (bf16 has 8).
__device__ __forceinline__ float fp16_range_scale(float x) {
  const int e = static_cast<int>(__float_as_uint(x) >> 23) & 0xFF;  // x's biased exponent
  if (e == 0xFF) return 1.f;
  const int k = min(14 - (e - 127), 126);                           // x 2^k in [2^14, 2^15)
  return __uint_as_float(static_cast<uint32_t>(k + 127) << 23);
}

// Two bf16 values (4 bytes, the first in the low half) -> T: as they are for bf16, each rounded
// to nearest even for fp16 (a bf16 is the top half of the float of the same value).
template <typename T>
__device__ __forceinline__ uint32_t bf16x2_to(uint32_t two) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return two;
  } else {
    return pack_pair<T>(__uint_as_float(two << 16), __uint_as_float(two & 0xFFFF0000u));
  }
}

}  // namespace mla
