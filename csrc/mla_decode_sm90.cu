// mla_decode_sm90: stage 1 of split-KV MLA decode with Hopper's warpgroup MMA (wgmma, sm_90a),
// 64 heads a CTA: the compute-bound case (DeepSeek-V3's 128 heads on one GPU, or 64 / 32 at
// tensor parallelism 2 / 4). Fewer heads run too, padded to 64 with zero rows (a quarter of the
// MMA work is useful at 16 heads, where mla_decode_sm80.cu is the default).
//
// The same computation and outputs as mla_decode_sm80.cu (fp32 partial outputs and log-sum-exps
// for the Triton merge), for DeepSeek's sizes only (c = 512, r = 64), tiles of kN = 64 tokens:
//
//   q (64 heads, 576) -> shared memory once; K tiles (64 tokens, 576), two stages, by cp.async
//   for each tile of the split:
//     warpgroup 0: S = q . K^T           (64, 64) fp32 in registers: 36 wgmma m64n64k16
//                  online softmax on S (each head row lives in 4 lanes of one warp: no shared
//                  memory), P = exp2(S * scale * log2 e - m) as bf16 / fp16, alpha = exp2(m_old - m)
//                  P -> shared memory (for warpgroup 1), alpha -> shared memory
//     both:        O[:, 256 g : 256 g + 256] = O * alpha + P . V[:, 256 g : 256 g + 256]
//                  (V = the tile's first 512 dims, read in place: 4 wgmma m64n256k16;
//                  warpgroup 0 takes P from its registers, warpgroup 1 from shared memory)
//   part_out = O / l, part_lse = (m + log2 l) ln 2  (zeros and -inf for an empty split)
//
// Shared memory holds q and each tile as wgmma's canonical 128-byte-swizzled K-major layout:
// 9 column blocks of 64 dims (128 bytes a row), each (64 rows, 128 bytes) with the 16-byte
// chunk c of row r stored at chunk c ^ (r % 8). The same bytes are V's N-major layout for the
// second product (B = V, K = tokens, N = dims), so the tile is loaded once for both.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "concat_and_cache_mla.h"
#include "mla_decode.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

// wgmma is an sm_90a feature: the kernel body exists only in code built for it
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MLA_SM90A 1
#endif

namespace mla {
namespace {

constexpr int kC = 512, kR = 64, kD = kC + kR;
constexpr int kM = 64;                    // heads a CTA: wgmma's M
constexpr int kN = 64;                    // tokens a tile
constexpr int kStages = 2;                // tiles in shared memory
constexpr int kThreads = 256;             // two warpgroups
constexpr int kMaxHeads = 64 * 1024;      // head blocks are the grid's x (any count would do)
constexpr int kBlocks = kD / 64;          // 9 column blocks of 64 dims (128 bytes a row)
constexpr int kBlockBytes = 64 * 128;     // one column block of 64 rows
constexpr int kMatBytes = kBlocks * kBlockBytes;  // q, or one tile: 73,728 bytes
constexpr int kVecs = kD / 8;             // 72 16-byte vectors a row
constexpr int kLoads = 64 * kVecs / kThreads;     // 18 copies a thread for 64 rows
static_assert(64 * kVecs % kThreads == 0, "rows split evenly over the threads");
// q, the tiles, P (64 x 64, one column block), alpha, l, m; 1 KiB to align to 1024 bytes
constexpr size_t kSmemBytes = size_t(1 + kStages) * kMatBytes + 64 * 128 + 3 * kM * 4 + 1024;
static_assert(kSmemBytes == 231168,
              "mla/kernels/decode.py's _SM90_SMEM_BYTES must equal kSmemBytes");

// byte offset of 16-byte vector v (of 72) of row r (of 64) in the swizzled layout
__device__ __forceinline__ uint32_t swizzled(int r, int v) {
  return (v >> 3) * kBlockBytes + r * 128 + (((v & 7) ^ (r & 7)) << 4);
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// make this thread's shared-memory writes (cp.async landed, st.shared) visible to wgmma
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// wgmma matrix descriptor: start address, leading / stride byte offsets, 128-byte swizzle
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lead, uint32_t stride) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lead >> 4) << 16) |
         (static_cast<uint64_t>(stride >> 4) << 32) | (uint64_t{1} << 62);
}
// K-major operand (q, K, P): 8-row groups 1024 bytes apart (the leading offset is unused)
__device__ __forceinline__ uint64_t desc_k(uint32_t addr) { return desc(addr, 16, 1024); }
// N-major B operand (V): 64-dim column blocks kBlockBytes apart, 8-token groups 1024 apart
__device__ __forceinline__ uint64_t desc_n(uint32_t addr) { return desc(addr, kBlockBytes, 1024); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// keeps the compiler from touching accumulators between an MMA's issue and its wait
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define MLA_D32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MLA_D128 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define MLA_OUT32(d) \
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define MLA_OUT128(d) \
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
      "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
      "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
      "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
      "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
      "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
      "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
      "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

template <typename T>
constexpr bool kIsBf16 = std::is_same_v<T, __nv_bfloat16>;

// d (64 x 64, fp32) (+)= A (64 x 16, shared) . B (16 x 64, shared, K-major); zero_d: d = A . B
template <typename T>
__device__ __forceinline__ void mma_s(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
#define MLA_SS64(AB)                                                                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                    \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB " {" MLA_D32             \
               "}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                               \
               : MLA_OUT32(d)                                                                   \
               : "l"(a), "l"(b), "r"(accumulate))
  if constexpr (kIsBf16<T>) MLA_SS64("bf16"); else MLA_SS64("f16");
#undef MLA_SS64
}

// d (64 x 256, fp32) += A (64 x 16, registers) . B (16 x 256, shared, N-major)
template <typename T>
__device__ __forceinline__ void mma_o_reg(float (&d)[128], const uint32_t (&a)[4], uint64_t b) {
#define MLA_RS256(AB)                                                                           \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                   \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." AB "." AB " {" MLA_D128           \
               "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"                            \
               : MLA_OUT128(d)                                                                  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
  if constexpr (kIsBf16<T>) MLA_RS256("bf16"); else MLA_RS256("f16");
#undef MLA_RS256
}

// d (64 x 256, fp32) += A (64 x 16, shared, K-major) . B (16 x 256, shared, N-major)
template <typename T>
__device__ __forceinline__ void mma_o_smem(float (&d)[128], uint64_t a, uint64_t b) {
#define MLA_SS256(AB)                                                                           \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                   \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." AB "." AB " {" MLA_D128           \
               "}, %128, %129, p, 1, 1, 0, 1;\n}\n"                                             \
               : MLA_OUT128(d)                                                                  \
               : "l"(a), "l"(b), "r"(1))
  if constexpr (kIsBf16<T>) MLA_SS256("bf16"); else MLA_SS256("f16");
#undef MLA_SS256
}

__device__ __forceinline__ uint32_t pack(float x, float y, __nv_bfloat16) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack(float x, float y, __half) {
  const __half2 v = __floats2half2_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_sm90_kernel(
    const T* __restrict__ q,              // (b, h, 576)
    const T* __restrict__ kv,             // (pages, page_size, 576)
    const int* __restrict__ block_table,  // (b, max_pages), last dim contiguous
    const int* __restrict__ seq_lens,     // (b,)
    float* __restrict__ part_out,         // (b, h, splits, 512)
    float* __restrict__ part_lse,         // (b, h, splits)
    int num_heads, int page_size, int num_splits, float scale_log2,
    int64_t sqb, int64_t sqh, int64_t skp, int64_t skn, int64_t sbb,
    int64_t sob, int64_t soh, int64_t sos, int64_t slb, int64_t slh, int64_t sls) {
#ifdef MLA_SM90A
  extern __shared__ unsigned char smem_raw[];
  // the swizzle pattern repeats every 1024 bytes: the layouts start on such a boundary
  const uint32_t raw = smem_u32(smem_raw);
  unsigned char* smem = smem_raw + (((raw + 1023) & ~1023u) - raw);
  const uint32_t q_s = smem_u32(smem);                 // (64 heads, 576) swizzled
  const uint32_t kv_s = q_s + kMatBytes;                // (kStages, 64 tokens, 576) swizzled
  unsigned char* p_ptr = smem + (1 + kStages) * kMatBytes;  // (64 heads, 64 tokens) swizzled
  const uint32_t p_s = smem_u32(p_ptr);
  float* alpha_s = reinterpret_cast<float*>(p_ptr + 64 * 128);  // (64,)
  float* l_s = alpha_s + kM;                                    // (64,)
  float* m_s = l_s + kM;                                        // (64,)

  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  // the warpgroup, read through a shuffle so the compiler sees it is uniform in a warp (else it
  // serialises the wgmma in the branches below)
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int g = lane >> 2, c = lane & 3;   // accumulator rows 16 warp + g (+ 8), columns 2c (+ 1)
  const int row0 = 16 * warp + g;          // this thread's first head row within the CTA
  const int h0 = blockIdx.x * kM;
  const int64_t b = blockIdx.y;
  const int split = blockIdx.z;

  // ---- this split's tokens: whole tiles of 64
  const SplitTokens span = split_tokens(seq_lens[b], split, num_splits, kN);
  const int start = span.start, end = span.end, n_tiles = span.n_tiles;

  // ---- 64 rows of 576 values -> the swizzled layout at dst; rows >= valid_rows zero-filled
  auto load_rows = [&](uint32_t dst, const T* src, int64_t row_stride, int valid_rows) {
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int i = tid + k * kThreads;
      const int r = i / kVecs, v = i - r * kVecs;
      const bool ok = r < valid_rows;
      cp_async16(dst + swizzled(r, v), ok ? src + r * row_stride + v * 8 : src, ok);
    }
  };
  const int* bt_row = block_table + b * sbb;
  auto load_tile = [&](int t) {
    const int tok0 = start + t * kN;  // a tile lies in one page (page_size % 64 == 0)
    const int64_t page = bt_row[tok0 / page_size];
    load_rows(kv_s + (t % kStages) * kMatBytes, kv + page * skp + int64_t(tok0 % page_size) * skn, skn,
              end - tok0);
  };
  if (n_tiles > 0) {  // an empty split reads nothing: it writes zeros and -inf below
    load_rows(q_s, q + b * sqb + h0 * sqh, sqh, min(kM, num_heads - h0));
    load_tile(0);
  }
  cp_async_commit();

  float o[128];  // O[:, 256 wg : 256 wg + 256]: o[4j + {0,1}] row row0, cols 8j + 2c + {0,1}; {2,3} row row0 + 8
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY;  // running max (log2 units) of rows row0, row0 + 8
  float l0 = 0.f, l1 = 0.f;              // this thread's share of the running sums

  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait_all();   // tile t (and q) landed, this thread's copies ...
    fence_async_shared();  // ... visible to wgmma ...
    __syncthreads();       // ... everyone's; and every read of tile t - 1 and of P is done
    if (t + 1 < n_tiles) load_tile(t + 1);
    cp_async_commit();
    const uint32_t tile = kv_s + (t % kStages) * kMatBytes;

    uint32_t pf[4][4];  // warpgroup 0: P as wgmma A fragments, one k-step of 16 tokens each
    float alpha0, alpha1;
    if (wg == 0) {
      // -- S = q . K^T over 576 dims: 9 column blocks x 4 k-steps of 16
      float s[32];  // s[4j + {0,1}]: row row0, tokens 8j + 2c + {0,1}; {2,3}: row row0 + 8
      wgmma_fence();
#pragma unroll
      for (int kb = 0; kb < kBlocks; ++kb) {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          const uint32_t off = kb * kBlockBytes + ks * 32;
          mma_s<T>(s, desc_k(q_s + off), desc_k(tile + off), kb | ks);
        }
      }
      wgmma_commit();
      wgmma_wait_all();
      pin(s);

      // -- online softmax, rows row0 and row0 + 8 (4 lanes a row)
      const int valid = min(kN, end - (start + t * kN));
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool ok = 8 * j + 2 * c + e < valid;
          s[4 * j + e] = ok ? s[4 * j + e] * scale_log2 : -INFINITY;
          s[4 * j + 2 + e] = ok ? s[4 * j + 2 + e] * scale_log2 : -INFINITY;
          mx0 = fmaxf(mx0, s[4 * j + e]);
          mx1 = fmaxf(mx1, s[4 * j + 2 + e]);
        }
      }
#pragma unroll
      for (int x = 1; x <= 2; x <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
      }
      const float new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);  // finite: a tile has a real token
      alpha0 = exp2f(m0 - new0);  // 0 on the first tile
      alpha1 = exp2f(m1 - new1);
      m0 = new0;
      m1 = new1;
      float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[4 * j + e] = exp2f(s[4 * j + e] - new0);
          s[4 * j + 2 + e] = exp2f(s[4 * j + 2 + e] - new1);
          sum0 += s[4 * j + e];
          sum1 += s[4 * j + 2 + e];
        }
      }
      l0 = l0 * alpha0 + sum0;
      l1 = l1 * alpha1 + sum1;

      // -- P: the accumulator of two 8-token column groups is one A fragment of 16 tokens;
      // to shared memory too (16-byte vector j of row r holds tokens 8j .. 8j + 7)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        pf[ks][0] = pack(s[8 * ks + 0], s[8 * ks + 1], T{});  // row0,     tokens 16ks + 2c
        pf[ks][1] = pack(s[8 * ks + 2], s[8 * ks + 3], T{});  // row0 + 8, tokens 16ks + 2c
        pf[ks][2] = pack(s[8 * ks + 4], s[8 * ks + 5], T{});  // row0,     tokens 16ks + 8 + 2c
        pf[ks][3] = pack(s[8 * ks + 6], s[8 * ks + 7], T{});  // row0 + 8, tokens 16ks + 8 + 2c
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int j = 2 * ks + half;
          *reinterpret_cast<uint32_t*>(p_ptr + swizzled(row0, j) + 4 * c) = pf[ks][2 * half];
          *reinterpret_cast<uint32_t*>(p_ptr + swizzled(row0 + 8, j) + 4 * c) = pf[ks][2 * half + 1];
        }
      }
      if (c == 0) {
        alpha_s[row0] = alpha0;
        alpha_s[row0 + 8] = alpha1;
      }
      fence_async_shared();  // P is read by warpgroup 1's wgmma
    }
    __syncthreads();  // P and alpha are in shared memory
    if (wg == 1) {
      alpha0 = alpha_s[row0];
      alpha1 = alpha_s[row0 + 8];
    }

    // -- O = O * alpha + P . V over this warpgroup's 256 dims: 4 k-steps of 16 tokens
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o[4 * j + 0] *= alpha0;
      o[4 * j + 1] *= alpha0;
      o[4 * j + 2] *= alpha1;
      o[4 * j + 3] *= alpha1;
    }
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint64_t v = desc_n(tile + (4 * wg) * kBlockBytes + ks * 16 * 128);
      if (wg == 0) {
        mma_o_reg<T>(o, pf[ks], v);
      } else {
        mma_o_smem<T>(o, desc_k(p_s + ks * 32), v);
      }
    }
    wgmma_commit();
    wgmma_wait_all();
    pin(o);
  }
  cp_async_wait_all();

  // ---- normalise and write; an empty split (l = 0) writes zeros and lse = -inf
  if (wg == 0) {
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, x);
      l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
    if (c == 0) {
      l_s[row0] = l0;
      l_s[row0 + 8] = l1;
      m_s[row0] = m0;
      m_s[row0 + 8] = m1;
    }
  }
  __syncthreads();
  float* out = part_out + b * sob + int64_t(split) * sos;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + 8 * half, h = h0 + r;
    const float l = l_s[r];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if (h < num_heads) {
      if (wg == 0 && c == 0) {
        part_lse[b * slb + h * slh + split * sls] =
            l > 0.f ? (m_s[r] + log2f(l)) * 0.6931471805599453f : -INFINITY;
      }
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        *reinterpret_cast<float2*>(out + h * soh + 256 * wg + 8 * j + 2 * c) =
            make_float2(o[4 * j + 2 * half] * inv, o[4 * j + 2 * half + 1] * inv);
      }
    }
  }
#else
  __trap();  // built without sm_90a: the host's capability check should have stopped the launch
#endif  // MLA_SM90A
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Host side: the check (binding.cpp), then the launch on the current stream

void mla_decode_sm90(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, at::Tensor& part_out, at::Tensor& part_lse,
                     double softmax_scale, int64_t num_splits) {
  check_mla_decode(q, kv_cache, block_table, seq_lens, part_out, part_lse, num_splits,
                   {"mla_decode_sm90", kMaxHeads, kC, kR, kN});
  const int64_t b = q.size(0), h = q.size(1);
  if (b == 0 || h == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q.get_device()));
  TORCH_CHECK(major == 9 && minor == 0, "mla_decode_sm90: needs a GPU of compute capability 9.0 (wgmma), got ",
              num(int64_t{major}), ".", num(int64_t{minor}));
  int smem_optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        q.get_device()));
  TORCH_CHECK(static_cast<size_t>(smem_optin) >= kSmemBytes,
              "mla_decode_sm90: this GPU allows ", num(int64_t{smem_optin}),
              " bytes of shared memory a block, the kernel needs ", num(static_cast<int64_t>(kSmemBytes)));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>((h + kM - 1) / kM), static_cast<unsigned>(b),
                  static_cast<unsigned>(num_splits));
  const float scale_log2 = static_cast<float>(softmax_scale * 1.4426950408889634);
  auto run = [&](auto* kernel, auto type_tag) {
    using T = decltype(type_tag);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kSmemBytes)));
    kernel<<<grid, kThreads, kSmemBytes, stream>>>(
        reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(kv_cache.data_ptr()),
        block_table.data_ptr<int>(), seq_lens.data_ptr<int>(), part_out.data_ptr<float>(),
        part_lse.data_ptr<float>(), static_cast<int>(h), static_cast<int>(kv_cache.size(1)),
        static_cast<int>(num_splits), scale_log2, q.stride(0), q.stride(1), kv_cache.stride(0),
        kv_cache.stride(1), block_table.stride(0), part_out.stride(0), part_out.stride(1),
        part_out.stride(2), part_lse.stride(0), part_lse.stride(1), part_lse.stride(2));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (q.scalar_type() == at::kBFloat16) {
    run(mla_decode_sm90_kernel<__nv_bfloat16>, __nv_bfloat16{});
  } else {
    run(mla_decode_sm90_kernel<__half>, __half{});
  }
}

}  // namespace mla

TORCH_LIBRARY_IMPL(mla, CUDA, m) {
  m.impl("mla_decode_sm90", &mla::mla_decode_sm90);
}
