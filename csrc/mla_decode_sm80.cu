// mla_decode_sm80: stage 1 of split-KV MLA decode for up to 16 heads (the memory-bound case:
// one GPU's share of DeepSeek-V3's 128 heads at tensor parallelism 8), with warp-level
// tensor-core instructions (mma.sync m16n8k16, ldmatrix, cp.async: sm_80 and later).
//
// The same computation as the Triton kernel in mla/kernels/triton_decode.py (see its docstring),
// for DeepSeek's sizes only: a cache row is [kv_c (c = 512) | k_pe (r = 64)] in bf16 or fp16, the
// key is the whole row, the value its first c values, and the (up to) 16 heads of a sequence
// share each tile as one mma M. It writes fp32 partial outputs and log-sum-exps in the layout
// of the Triton merge kernel, which combines the splits; with one split it writes the answer
// itself (out in q's dtype, lse) and there is nothing to merge.
// mla_decode (mla/kernels/decode.py, backend "cuda-sm80") calls it for q of <= 16 heads in
// bf16 / fp16 with c = 512, r = 64 and pages of a multiple of 32 rows, on a GPU of compute
// capability >= 8.0.
//
// It also reads the two fp8 layouts of mla/kernels/fp8.py (kv_cache_dtype "fp8_e4m3": 576
// e4m3 bytes a row and one float32 scale in a 1-element device tensor; "fp8_ds_mla": 656 bytes,
// 512 e4m3 values, 4 float32 scales one per 128 values, 64 bf16 rope values). The copies bring a
// tile's stored bytes into shared memory, and each warp builds its mma B fragments from them in
// registers, a k-step at a time, just before the mma that takes them: no tile in q's dtype, no
// pass over the tile and no barrier for one. The e4m3 values enter the products as they are
// (exact in bf16 and fp16, converted without a float round trip: mla_decode_fp8.cuh), and the
// scales stay out of the values:
//   fp8_e4m3: the cache's one scale on the scores (folded into the softmax scale) and the output;
//   fp8_ds_mla: warp dq's partial score over latent group dq times the token's group scale, in
//   float32, before the rope part (bf16 values, unscaled) is added; in p . V warp w's dims are
//   latent group w, so it multiplies p by the token's scale of group w in float32 before
//   rounding p to the products' type.
// On sm_89 and later the fp8 products run in fp16 whatever q's dtype (MmaType): e4m3 becomes
// fp16 in one instruction a pair, where bf16 takes four, and with the conversions that few the
// loop is not bound by them. bf16 q enters them times a power of two that brings the CTA's
// largest |q| into fp16's range (exact), fp8_ds_mla's p x scale times a power of two set a tile
// at a time (fp16_range_scale).
// So on fp8_ds_mla the result is the attention over the dequantised cache with the scales
// applied in float32 to the scores and the probabilities: closer to the float32 reference on the
// dequantised cache than rounding e4m3 x scale to q's dtype (the Triton kernel's values), and
// not bit-identical to the Triton kernel. On fp8_e4m3 the scores are the Triton kernel's (exact
// products either way) and p is rounded to fp16 rather than bf16 where the products are fp16.
//
// Fragments from stored bytes (mma.m16n8k16: lane = 4 g + c holds B rows k = 2c, 2c + 1 (b0) and
// 2c + 8, 2c + 9 (b1) of column n = g; A and C as usual). The sum over k is order-free, so within
// each k-step of 16 dims the kernel lets physical dims 4c .. 4c + 3 play logical k = 2c, 2c + 1,
// 2c + 8, 2c + 9, in q's A fragments and in K's B fragments alike: one 32-bit load of token g's
// row gives a lane both of its B registers. In p . V (k = tokens, n = dims) a lane needs one dim
// of four tokens; there the dim axis is permuted instead: in each run of 32 dims, n-block j's
// column g is dim 4g + j, so one 32-bit load of a token's dims 4g .. 4g + 3 serves four n-blocks,
// and a byte permute pairs two tokens' bytes. The output columns come out in that order and the
// epilogue writes each to its dim. benchmarks/lab/model_sm80_fp8_fragments.py replays these maps
// lane by lane on the CPU against a direct computation.
//
// Why a second kernel: at 16 heads the Triton program holds 255 registers and spills (each warp
// keeps the whole (16, 576) query and a full tile's operand fragments) and keeps one tile in
// flight. Here the fragments are loaded a k-step at a time (165-184 registers with nvcc 13, for
// sm_90 and sm_80, no spills), the query's fragments stay in registers, and on an
// H100/H200 (228 KiB of shared memory an SM) two CTAs share an SM, each with a tile in flight
// while it computes the other (an A100 fits one; GPUs with less than the 103 KiB a block needs,
// sm_86/89/120, run the Triton kernel on a cache in q's dtype; the fp8 shapes' 67-72 KiB fit them,
// and mla/kernels/backends.py runs them there only when forced). Times on an H200:
// benchmarks/results/h200-decode.json.
//
// One CTA per (head block of 16, sequence, split); kWarps = 4 warps; tiles of kTile = 32
// tokens, kStages = 2 deep in shared memory (rows padded to 584 values so ldmatrix is free of
// bank conflicts), two CTAs an SM. When the grid fits on the SMs one CTA each (one sequence, or a
// few short ones), kStages = 4 instead, one CTA an SM: a CTA alone on its SM then has 3 tiles in
// flight rather than 1:
//
//   q (16, 576) -> shared -> each warp's fragments of its quarter of the 576 dims (registers)
//   for each tile of 32 tokens of this split (cp.async, kStages - 1 tiles ahead):
//     warp dq in 0..3: s_part = q[:, dq quarter] . K[:, dq quarter]^T       (16, 32) fp32
//       (a cache in q's dtype: dims 144 dq .. 144 dq + 143; fp8: latent group dq, dims
//       128 dq .. 128 dq + 127, and rope dims 512 + 16 dq .. 512 + 16 dq + 15)
//     s = sum over the 4 quarters (through shared memory) * scale * log2(e); -inf past the split
//     online softmax, 8 threads a head row: m, l in registers; p (16, 32) and alpha to shared
//     warp w: acc[:, 128w : 128w + 128] = acc * alpha + p . V[:, 128w : 128w + 128]   (V = K[:, :c])
//   part_out = acc / l, part_lse = (m + log2 l) * ln 2  (zeros and -inf for an empty split);
//   with one split these are out (in q's dtype) and lse themselves
//
// The template keeps the launch shape a choice (tile, stages, warps, CTAs an SM).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "mla_decode.h"
#include "mla_decode_fp8.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

namespace mla {
namespace {

constexpr int kC = 512;                  // latent dim (value width)
constexpr int kR = 64;                   // rope dim
constexpr int kD = kC + kR;              // cache row
constexpr int kHeads = 16;               // heads a CTA: one mma M
constexpr int kRowStride = kD + 8;       // 584 values = 1168 bytes: 8 rows of ldmatrix hit 8 bank groups
constexpr int kVecsPerRow = kD / 8;      // 72 16-byte vectors a row
constexpr int kQKDims = kD / 4;          // 144 dims a warp in q . k (4 dim quarters)
constexpr int kQKSteps = kQKDims / 16;   // 9 k-steps

// The stored rows of the fp8 layouts (mla_decode_fp8.cuh): fp8_ds_mla's scales from byte
// kDsMlaScales, its bf16 rope values from byte kDsMlaRope.
constexpr int kDsMlaScales = ds_mla_scales(kC);  // 512
constexpr int kDsMlaRope = ds_mla_rope(kC);      // 528
// Bytes of a stored row (0 for kAuto, whose rows are copied as they are): 576 and 656.
template <CacheFormat F>
constexpr int kStoredRowBytes = stored_row_bytes(F, kC, kR);
static_assert(kStoredRowBytes<CacheFormat::kFp8E4M3> % 16 == 0 && kStoredRowBytes<CacheFormat::kFp8DsMla> % 16 == 0 &&
                  kDsMlaRope % 16 == 0,
              "stored rows and the rope part come in whole 16-byte copies");
// The stored rows' stride in shared memory: 592 bytes (148 words) for fp8_e4m3's 576, 656 (164
// words) for fp8_ds_mla. The fragment loads read 4 bytes of 8 rows at once, at 4 neighbouring
// words (q . k: rows g, words c), or of 4 rows 2 apart at 8 neighbouring words (p . V: rows 2c,
// words g): a row stride of 148 or 164 words puts them on 32 different banks (20 g and 4 g mod 32,
// 8 c for both), where 144 would fold rows g and g + 2 onto the same 4 banks.
template <CacheFormat F>
constexpr int kRawStride = F == CacheFormat::kFp8E4M3 ? kStoredRowBytes<F> + 16 : kStoredRowBytes<F>;
static_assert(kRawStride<CacheFormat::kFp8E4M3> / 4 % 32 == 20 && kRawStride<CacheFormat::kFp8DsMla> / 4 % 32 == 4,
              "the fragment loads' rows on different banks");
// On an fp8 cache warp dq's q . k k-steps 0..7 cover latent quarter dq, which is fp8_ds_mla's
// scale group dq (dims 128 dq .. 128 dq + 127), and its k-step 8 the rope dims 512 + 16 dq ..
// 512 + 16 dq + 15. fp8_qk_dim: the first dim of k-step ks; within it lane c reads dims
// 4c .. 4c + 3, logical k = 2c, 2c + 1, 2c + 8, 2c + 9 (the header).
constexpr int kGroup = static_cast<int>(kDsMlaGroup);  // 128
constexpr int kQKLatentSteps = kGroup / 16;            // 8
static_assert(kC == 4 * kGroup && kR == 4 * 16 && kQKLatentSteps + 1 == kQKSteps,
              "fp8: a warp's q . k is one scale group and one k-step of the rope dims");
__device__ __forceinline__ int fp8_qk_dim(int dq, int ks) {
  return ks < kQKLatentSteps ? dq * kGroup + ks * 16 : kC + dq * 16;
}
// Byte of a stored row of layout F where value `dim` starts: one byte a value, except
// fp8_ds_mla's rope part (2-byte bf16 from byte kDsMlaRope).
template <CacheFormat F>
__device__ __forceinline__ int fp8_byte(int dim) {
  return F == CacheFormat::kFp8DsMla && dim >= kC ? kDsMlaRope + 2 * (dim - kC) : dim;
}

// The products' type on a cache of layout F with q in T: T itself, except on fp8 caches where the
// GPU converts e4m3 to fp16 in one instruction (cvt.rn.f16x2.e4m3x2, sm_89 and later): there both
// products run in fp16 whatever q's dtype, since the bf16 route from e4m3 takes four instructions
// for two values (the integer route of mla_decode_fp8.cuh) and the conversions, not the bytes,
// bound the loop. fp16 holds every e4m3 value exactly and p in [0, 1] to 11 bits (bf16: 8); q and
// p . V's scaled p are brought into its range by powers of two (fp16_range_scale).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
constexpr bool kE4M3ToHalfInOne = false;
#else
constexpr bool kE4M3ToHalfInOne = true;
#endif
template <typename T, CacheFormat F>
using MmaType = std::conditional_t<F != CacheFormat::kAuto && kE4M3ToHalfInOne, __half, T>;

// A launch shape: TILE tokens a step, STAGES tiles in shared memory, WARPS warps a CTA, and
// MIN_BLOCKS CTAs an SM for __launch_bounds__. Warps split q . k as (WARPS / 4 token groups) x
// (4 dim quarters) and p . V by output dims (512 / WARPS each); 2 * WARPS threads a head row do
// the softmax.
template <int TILE, int STAGES, int WARPS, int MIN_BLOCKS>
struct Shape {
  static constexpr int kTile = TILE, kStages = STAGES, kWarps = WARPS, kMinBlocks = MIN_BLOCKS;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kPStride = TILE + 8;    // p rows: 16-byte steps over the banks for ldmatrix
  static constexpr int kRedStride = TILE + 8;  // partial-score rows: 8 lanes' rows spread over banks
  static constexpr int kQKTok = TILE / (WARPS / 4);  // tokens a warp in q . k
  static constexpr int kQKN = kQKTok / 8;            // its n-tiles
  static constexpr int kPVDims = kC / WARPS;         // output dims a warp in p . V
  static constexpr int kRowThreads = kThreads / kHeads;      // softmax threads a head row
  static constexpr int kRowTok = TILE / kRowThreads;         // tokens a softmax thread
  static_assert(WARPS % 4 == 0 && kQKTok % 16 == 0, "q . k: whole pairs of n-tiles a warp");
  static_assert(kPVDims % 16 == 0 && TILE % 16 == 0, "p . V: whole n-tile pairs and k-steps");
  static_assert(kRowThreads <= 32 && 32 % kRowThreads == 0 && kRowTok % 2 == 0, "softmax rows");
  static constexpr size_t kTileBytes = size_t(TILE) * kRowStride * 2;  // one tile in q's dtype
  static constexpr size_t kRestBytes = size_t(kHeads) * kRowStride * 2  // q
                                       + size_t(4) * kHeads * kRedStride * 4  // partial scores
                                       + size_t(kHeads) * kPStride * 2        // p
                                       + 2 * kHeads * 4;                      // alpha, l
  static constexpr size_t kSmemBytes = STAGES * kTileBytes + kRestBytes;  // a cache in q's dtype
};

// Shared memory of shape S reading a cache of layout F: the kStages tiles in q's dtype (kAuto
// only), q, the partial scores, p (in q's dtype; in float32 on fp8_ds_mla, where each warp scales
// it before rounding), alpha and l; then, for fp8, the kStages tiles of stored bytes the copies
// fill (rows kRawStride<F> apart).
template <typename S, CacheFormat F>
struct Smem {
  static constexpr int kTiles = F == CacheFormat::kAuto ? S::kStages : 0;
  static constexpr int kPBytes = F == CacheFormat::kFp8DsMla ? 4 : 2;  // a p value
  static constexpr size_t kRawOffset = kTiles * S::kTileBytes + S::kRestBytes + size_t(kHeads) * S::kPStride * (kPBytes - 2);
  static constexpr size_t kBytes = kRawOffset + size_t(S::kStages) * S::kTile * kRawStride<F>;
  static_assert(kRawOffset % 16 == 0, "cp.async writes the stored bytes in 16-byte pieces");
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; zero-filled (nothing read) when !pred.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred) {
  const int bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d (16 x 8, fp32) += a (16 x 16) . b (16 x 8)
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// T: q's dtype; S: the launch shape; F: the cache's layout; KV: what its rows hold (T, or fp8 bytes).
template <typename T, typename S, CacheFormat F, typename KV = std::conditional_t<F == CacheFormat::kAuto, T, uint8_t>>
__global__ void __launch_bounds__(S::kThreads, S::kMinBlocks) mla_decode_sm80_kernel(
    const T* __restrict__ q,             // (b, h, 576)
    const KV* __restrict__ kv,           // (pages, page_size, 576) in T, or (pages, page_size, bytes) fp8
    const float* __restrict__ kv_scale,  // (1,): the fp8_e4m3 cache's scale; not read otherwise
    const int* __restrict__ block_table,  // (b, max_pages), last dim contiguous
    const int* __restrict__ seq_lens,     // (b,), contiguous
    void* __restrict__ part_out,          // (b, h, splits, 512) fp32; out (b, h, 1, 512) in T if final_out
    float* __restrict__ part_lse,         // (b, h, splits); lse (b, h, 1) if final_out
    bool final_out,                       // one split: write the answer itself, no merge after
    int num_heads, int page_size, int num_splits, float scale_log2,
    int64_t sqb, int64_t sqh, int64_t skp, int64_t skn, int64_t sbb,
    int64_t sob, int64_t soh, int64_t sos, int64_t slb, int64_t slh, int64_t sls) {
  constexpr int kTile = S::kTile, kStages = S::kStages, kThreads = S::kThreads;
  using L = Smem<S, F>;
  using MT = MmaType<T, F>;  // the products' type
  static_assert(std::is_same_v<MT, T> || std::is_same_v<T, __nv_bfloat16>, "q is bf16 where the types differ");
  // fp8_ds_mla with fp16 products: p x group scale enters p . V in fp16, each tile's times a power
  // of two (p_scale) that keeps the tile's largest product in range
  constexpr bool kTileScale = F == CacheFormat::kFp8DsMla && std::is_same_v<MT, __half>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* kv_s = reinterpret_cast<T*>(smem);                               // (L::kTiles, kTile, kRowStride)
  T* q_s = kv_s + L::kTiles * kTile * kRowStride;                     // (kHeads, kRowStride)
  float* red_s = reinterpret_cast<float*>(q_s + kHeads * kRowStride);  // (4, kHeads, kRedStride)
  MT* p_s = reinterpret_cast<MT*>(red_s + 4 * kHeads * S::kRedStride);  // (kHeads, kPStride)
  float* pf_s = reinterpret_cast<float*>(p_s);  // fp8_ds_mla: p in float32 there instead
  float* alpha_s = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(p_s) +
                                            kHeads * S::kPStride * L::kPBytes);  // (kHeads,)
  float* l_s = alpha_s + kHeads;                                      // (kHeads,)
  unsigned char* raw_s = smem + L::kRawOffset;  // fp8: (kStages, kTile, kRawStride<F>) stored rows

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int h0 = blockIdx.x * kHeads;
  const int64_t b = blockIdx.y;
  const int split = blockIdx.z;

  // ---- this split's tokens: whole tiles, as the Triton kernel cuts them (same merge)
  const SplitTokens span = split_tokens(seq_lens[b], split, num_splits, kTile);
  const int start = span.start, end = span.end, n_tiles = span.n_tiles;

  // ---- q to shared memory (head rows past num_heads zero-filled)
  for (int i = tid; i < kHeads * kVecsPerRow; i += kThreads) {
    const int row = i / kVecsPerRow, col = (i % kVecsPerRow) * 8;
    const bool ok = h0 + row < num_heads;
    cp_async16(smem_addr(q_s + row * kRowStride + col), ok ? q + b * sqb + (h0 + row) * sqh + col : q,
               ok);
  }
  cp_async_commit();

  // ---- tile t of the split -> stage: one block-table entry (the tile lies in one page), kTile
  // rows of 72 vectors; rows past the split's end are zero-filled, never read. An fp8 tile is
  // its rows' stored bytes, 16 at a time, into the stage's raw bytes
  const int* bt_row = block_table + b * sbb;
  auto load_tile = [&](int t, int stage) {
    const int tok0 = start + t * kTile;
    const int64_t page = bt_row[tok0 / page_size];
    const KV* src = kv + page * skp + static_cast<int64_t>(tok0 % page_size) * skn;
    if constexpr (F == CacheFormat::kAuto) {
      // kRowsAPass rows at a time, thread tid on vectors tid % kCols + kCols m (m = 0, 1, ...) of
      // row tid / kCols of each pass: one row pointer a pass, the vectors at constant offsets
      constexpr int kCols = 8, kRowsAPass = kThreads / kCols;
      static_assert(kVecsPerRow % kCols == 0 && kTile % kRowsAPass == 0, "whole rows a pass, whole passes a tile");
      const int r = tid / kCols, v0 = (tid % kCols) * 8;  // this thread's row in a pass, first value
#pragma unroll
      for (int pass = 0; pass < kTile / kRowsAPass; ++pass) {
        const int row = pass * kRowsAPass + r;
        const bool ok = tok0 + row < end;
        const T* from = ok ? src + row * skn + v0 : kv;
        const uint32_t to = smem_addr(kv_s + (stage * kTile + row) * kRowStride + v0);
#pragma unroll
        for (int m = 0; m < kVecsPerRow / kCols; ++m) cp_async16(to + m * kCols * 16, from + m * kCols * 8, ok);
      }
    } else {
      // kRowsAPass rows at a time, thread tid on piece tid % kRowPieces of row tid / kRowPieces
      // of each pass (the last threads idle): a pass steps both pointers by whole rows, with no
      // division or 64-bit multiply a piece
      constexpr int kRowPieces = kStoredRowBytes<F> / 16;  // 36 or 41
      constexpr int kRowsAPass = kThreads / kRowPieces;
      const int r = tid / kRowPieces;
      if (r < kRowsAPass) {
        const int col = (tid % kRowPieces) * 16;
        const KV* from = src + r * skn + col;
        uint32_t to = smem_addr(raw_s + (stage * kTile + r) * kRawStride<F> + col);
#pragma unroll
        for (int pass = 0; pass < (kTile + kRowsAPass - 1) / kRowsAPass; ++pass) {
          const int row = pass * kRowsAPass + r;
          if (kTile % kRowsAPass == 0 || row < kTile) {
            const bool ok = tok0 + row < end;
            cp_async16(to, ok ? from : kv, ok);
          }
          from += kRowsAPass * skn;
          to += kRowsAPass * kRawStride<F>;
        }
      }
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) load_tile(s, s);
    cp_async_commit();
  }

  // ---- this warp's query fragments, 9 k-steps of 16: dims [dq * 144, dq * 144 + 144); on an fp8
  // cache latent group dq and rope dims 16 dq .. 16 dq + 15, in the permuted k order
  const int tq = warp >> 2, dq = warp & 3;
  float scale_e4m3 = 1.f;  // fp8_e4m3: the cache's one scale, on the scores and the output
  if constexpr (F == CacheFormat::kFp8E4M3) scale_e4m3 = *kv_scale;
  scale_log2 *= scale_e4m3;
  cp_async_wait<kStages - 1>();  // the q group (the oldest) has landed
  __syncthreads();
  // bf16 q entering fp16 products: q x q_scale, a power of two that brings the CTA's largest |q|
  // into fp16's range (fp16_range_scale); the scores come out q_scale times too large, and the
  // softmax scale takes 1 / q_scale. fp8_ds_mla's rope part stays in bf16 products (its cached
  // values are bf16), with q x q_scale there too, exact in bf16.
  float q_scale = 1.f;
  if constexpr (!std::is_same_v<MT, T>) {
    float top = 0.f;
    for (int i = tid; i < kHeads * kVecsPerRow; i += kThreads) {
      const uint4 v = *reinterpret_cast<const uint4*>(q_s + (i / kVecsPerRow) * kRowStride + (i % kVecsPerRow) * 8);
      for (const uint32_t w : {v.x, v.y, v.z, v.w}) {
        top = fmaxf(top, fmaxf(fabsf(__uint_as_float(w << 16)), fabsf(__uint_as_float(w & 0xFFFF0000u))));
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    if (lane == 0) red_s[warp] = top;  // red_s is free until the first tile's partial scores
    __syncthreads();
#pragma unroll
    for (int w = 0; w < S::kWarps; ++w) top = fmaxf(top, red_s[w]);
    q_scale = fp16_range_scale(top);
    scale_log2 /= q_scale;  // exact: a power of two
  }
  // two q values (a fragment register) -> the products' type, times q_scale; `rope` keeps T
  auto q_pair = [&](uint32_t two, bool rope) -> uint32_t {
    if constexpr (std::is_same_v<MT, T>) {
      return two;
    } else {
      const float x = __uint_as_float(two << 16) * q_scale, y = __uint_as_float(two & 0xFFFF0000u) * q_scale;
      return rope ? pack_pair<T>(x, y) : pack_pair<MT>(x, y);
    }
  };
  uint32_t qf[kQKSteps][4];
#pragma unroll
  for (int ks = 0; ks < kQKSteps; ++ks) {
    if constexpr (F == CacheFormat::kAuto) {
      const int k0 = dq * kQKDims + ks * 16;
      ldmatrix_x4(qf[ks], smem_addr(q_s + (lane & 15) * kRowStride + k0 + ((lane >> 4) << 3)));
    } else {
      // a0 = dims d, d + 1 (logical k 2c, 2c + 1) and a2 = dims d + 2, d + 3 (2c + 8, 2c + 9) of
      // head row g; a1, a3 the same of row g + 8
      const int d = fp8_qk_dim(dq, ks) + 4 * (lane & 3);
      const uint2 lo = *reinterpret_cast<const uint2*>(q_s + (lane >> 2) * kRowStride + d);
      const uint2 hi = *reinterpret_cast<const uint2*>(q_s + ((lane >> 2) + 8) * kRowStride + d);
      const bool rope = F == CacheFormat::kFp8DsMla && ks == kQKLatentSteps;
      qf[ks][0] = q_pair(lo.x, rope);
      qf[ks][1] = q_pair(hi.x, rope);
      qf[ks][2] = q_pair(lo.y, rope);
      qf[ks][3] = q_pair(hi.y, rope);
    }
  }

  // softmax rows: kRowThreads neighbouring lanes a head row, kRowTok tokens each
  const int srow = tid / S::kRowThreads, scol = (tid % S::kRowThreads) * S::kRowTok;
  float m_row = -INFINITY, l_row = 0.f;  // log2 units
  // what p . V's p is multiplied by before rounding (kTileScale: this warp's, set a tile at a time)
  float p_scale = kTileScale ? 0x1p126f : 1.f;
  float acc[S::kPVDims / 8][4];          // (16, kPVDims) of the output
#pragma unroll
  for (int j = 0; j < S::kPVDims / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait<kStages - 2>();  // tile t has landed (this thread's copies) ...
    __syncthreads();               // ... everyone's; and every read of tile t - 1 is done
    {
      const int next = t + kStages - 1;
      if (next < n_tiles) load_tile(next, next % kStages);
      cp_async_commit();
    }
    const T* tile = kv_s + (F == CacheFormat::kAuto ? (t % kStages) * kTile * kRowStride : 0);
    const unsigned char* raw = raw_s + (t % kStages) * kTile * kRawStride<F>;  // fp8: the stored rows
    const int valid = min(kTile, end - (start + t * kTile));

    // -- partial scores of this warp: 16 heads x its kQKTok tokens over its 144 dims
    float s[S::kQKN][4];
#pragma unroll
    for (int j = 0; j < S::kQKN; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kQKSteps; ++ks) {
      if constexpr (F == CacheFormat::kAuto) {
        const int k0 = dq * kQKDims + ks * 16;
#pragma unroll
        for (int np = 0; np < S::kQKN / 2; ++np) {
          const int n0 = tq * S::kQKTok + np * 16;
          uint32_t kf[4];  // tokens n0 + 0..7 / 8..15 x dims k0 + 0..7 / 8..15
          ldmatrix_x4(kf, smem_addr(tile + (n0 + (lane & 7) + ((lane >> 4) << 3)) * kRowStride + k0 +
                                    (((lane >> 3) & 1) << 3)));
          mma16816<T>(s[2 * np], qf[ks], kf[0], kf[1]);
          mma16816<T>(s[2 * np + 1], qf[ks], kf[2], kf[3]);
        }
      } else {
        if (F == CacheFormat::kFp8DsMla && ks == kQKLatentSteps) {
          // the latent part is whole: times each token's scale of group dq (a zero-filled row's
          // scale reads 0, its score 0), then the rope part joins unscaled. Columns 2c, 2c + 1
          // of n-block j are tokens 8j + 2c, 8j + 2c + 1
#pragma unroll
          for (int j = 0; j < S::kQKN; ++j) {
            const unsigned char* at =
                raw + (tq * S::kQKTok + j * 8 + (lane & 3) * 2) * kRawStride<F> + kDsMlaScales + 4 * dq;
            const float s0 = *reinterpret_cast<const float*>(at);
            const float s1 = *reinterpret_cast<const float*>(at + kRawStride<F>);
            s[j][0] *= s0;
            s[j][1] *= s1;
            s[j][2] *= s0;
            s[j][3] *= s1;
          }
        }
        // lane (g, c): token 8j + g's dims d .. d + 3 = b0 (logical k 2c, 2c + 1), b1 (2c + 8, 2c + 9)
        const int d = fp8_qk_dim(dq, ks) + 4 * (lane & 3);
#pragma unroll
        for (int j = 0; j < S::kQKN; ++j) {
          const unsigned char* row = raw + (tq * S::kQKTok + j * 8 + (lane >> 2)) * kRawStride<F>;
          if (F == CacheFormat::kFp8DsMla && ks == kQKLatentSteps) {  // 4 bf16 rope values, in T
            const uint2 v = *reinterpret_cast<const uint2*>(row + fp8_byte<F>(d));
            mma16816<T>(s[j], qf[ks], bf16x2_to<T>(v.x), bf16x2_to<T>(v.y));
          } else {  // 4 e4m3 values, in MT
            const uint32_t v = *reinterpret_cast<const uint32_t*>(row + fp8_byte<F>(d));
            uint32_t b0, b1;
            e4m3x4_to<MT>(v, b0, b1);
            mma16816<MT>(s[j], qf[ks], b0, b1);
          }
        }
      }
    }
    {
      float* red = red_s + dq * kHeads * S::kRedStride;
      const int r = lane >> 2;
#pragma unroll
      for (int j = 0; j < S::kQKN; ++j) {
        const int tok = tq * S::kQKTok + j * 8 + (lane & 3) * 2;
        *reinterpret_cast<float2*>(red + r * S::kRedStride + tok) = make_float2(s[j][0], s[j][1]);
        *reinterpret_cast<float2*>(red + (r + 8) * S::kRedStride + tok) = make_float2(s[j][2], s[j][3]);
      }
    }
    __syncthreads();

    // -- full scores, online softmax: row srow, tokens scol ... scol + kRowTok - 1
    {
      float v[S::kRowTok];
#pragma unroll
      for (int k = 0; k < S::kRowTok; ++k) v[k] = 0.f;
#pragma unroll
      for (int d = 0; d < 4; ++d) {
#pragma unroll
        for (int k = 0; k < S::kRowTok; k += 2) {
          const float2 part =
              *reinterpret_cast<const float2*>(red_s + (d * kHeads + srow) * S::kRedStride + scol + k);
          v[k] += part.x;
          v[k + 1] += part.y;
        }
      }
      float mx = -INFINITY;
#pragma unroll
      for (int k = 0; k < S::kRowTok; ++k) {
        v[k] = scol + k < valid ? v[k] * scale_log2 : -INFINITY;
        mx = fmaxf(mx, v[k]);
      }
#pragma unroll
      for (int o = S::kRowThreads / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(m_row, mx);      // finite: every tile holds a real token
      const float alpha = exp2_ftz(m_row - m_new);  // 0 on the first tile (m_row = -inf)
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < S::kRowTok; ++k) {
        v[k] = exp2_ftz(v[k] - m_new);
        sum += v[k];
      }
#pragma unroll
      for (int o = S::kRowThreads / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      l_row = l_row * alpha + sum;
      m_row = m_new;
#pragma unroll
      for (int k = 0; k < S::kRowTok; k += 2) {
        if constexpr (F == CacheFormat::kFp8DsMla) {  // each warp scales and rounds p itself
          *reinterpret_cast<float2*>(pf_s + srow * S::kPStride + scol + k) = make_float2(v[k], v[k + 1]);
        } else {
          store_pair(p_s + srow * S::kPStride + scol + k, v[k], v[k + 1]);
        }
      }
      if (tid % S::kRowThreads == 0) alpha_s[srow] = alpha;
    }
    __syncthreads();

    // -- acc = acc * alpha + p . V over this warp's kPVDims output dims
    {
      float a_lo = alpha_s[lane >> 2], a_hi = alpha_s[(lane >> 2) + 8];
      if constexpr (kTileScale) {
        // p x scale <= the tile's largest scale of this warp's group (p <= 1; zero-filled rows
        // read 0), which p_scale takes into fp16's range; p_scale only shrinks, so earlier tiles'
        // products stay in range, and acc follows it (a ratio of powers of two: exact)
        const int group = warp * S::kPVDims / kGroup;
        float top = 0.f;
        for (int i = lane; i < kTile; i += 32) {
          top = fmaxf(top, *reinterpret_cast<const float*>(raw + i * kRawStride<F> + kDsMlaScales + 4 * group));
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
        const float next = fminf(p_scale, fp16_range_scale(top));
        const float ratio = next / p_scale;
        a_lo *= ratio;
        a_hi *= ratio;
        p_scale = next;
      }
#pragma unroll
      for (int j = 0; j < S::kPVDims / 8; ++j) {
        acc[j][0] *= a_lo;
        acc[j][1] *= a_lo;
        acc[j][2] *= a_hi;
        acc[j][3] *= a_hi;
      }
#pragma unroll
      for (int ks = 0; ks < kTile / 16; ++ks) {
        const int k0 = ks * 16;
        if constexpr (F == CacheFormat::kAuto) {
          uint32_t pf[4];
          ldmatrix_x4(pf, smem_addr(p_s + (lane & 15) * S::kPStride + k0 + ((lane >> 4) << 3)));
#pragma unroll
          for (int jj = 0; jj < S::kPVDims / 16; ++jj) {
            const int n0 = warp * S::kPVDims + jj * 16;
            uint32_t vf[4];  // tokens k0 + 0..7 / 8..15 x dims n0 + 0..7 / 8..15, transposed
            ldmatrix_x4_trans(vf, smem_addr(tile + (k0 + (lane & 7) + (((lane >> 3) & 1) << 3)) *
                                                       kRowStride +
                                                   n0 + ((lane >> 4) << 3)));
            mma16816<T>(acc[2 * jj], pf, vf[0], vf[1]);
            mma16816<T>(acc[2 * jj + 1], pf, vf[2], vf[3]);
          }
        } else {
          // lane (g, c) holds V rows k = 2c, 2c + 1 (b0) and 2c + 8, 2c + 9 (b1): the stored rows
          // of tokens k0 + 2c, k0 + 2c + 1, k0 + 2c + 8, k0 + 2c + 9
          const int g = lane >> 2, c = lane & 3;
          const unsigned char* rows[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) rows[i] = raw + (k0 + 2 * c + (i & 1) + (i >> 1) * 8) * kRawStride<F>;
          uint32_t pf[4];  // a0 / a1: head rows g / g + 8 at tokens 2c, 2c + 1; a2 / a3 at 2c + 8, 2c + 9
          if constexpr (F == CacheFormat::kFp8DsMla) {
            // this warp's dims lie in one latent group: p times each token's scale of it (times
            // p_scale), in float32, rounded once to MT (masked tokens' p is 0, and so their product)
            static_assert(kGroup % S::kPVDims == 0, "a warp's p . V dims in one scale group");
            const int group = warp * S::kPVDims / kGroup;
            float sc[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              sc[i] = p_scale * *reinterpret_cast<const float*>(rows[i] + kDsMlaScales + 4 * group);
            }
            const float* pr = pf_s + g * S::kPStride + k0 + 2 * c;
            const float2 p0 = *reinterpret_cast<const float2*>(pr);
            const float2 p1 = *reinterpret_cast<const float2*>(pr + 8 * S::kPStride);
            const float2 p2 = *reinterpret_cast<const float2*>(pr + 8);
            const float2 p3 = *reinterpret_cast<const float2*>(pr + 8 * S::kPStride + 8);
            pf[0] = pack_pair<MT>(p0.x * sc[0], p0.y * sc[1]);
            pf[1] = pack_pair<MT>(p1.x * sc[0], p1.y * sc[1]);
            pf[2] = pack_pair<MT>(p2.x * sc[2], p2.y * sc[3]);
            pf[3] = pack_pair<MT>(p3.x * sc[2], p3.y * sc[3]);
          } else {
            ldmatrix_x4(pf, smem_addr(p_s + (lane & 15) * S::kPStride + k0 + ((lane >> 4) << 3)));
          }
#pragma unroll
          for (int q4 = 0; q4 < S::kPVDims / 32; ++q4) {
            // dims d + 4g .. d + 4g + 3 of the four rows: byte j is n-block 4 q4 + j's column g
            const int d = warp * S::kPVDims + q4 * 32 + 4 * g;
            uint32_t v[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) v[i] = *reinterpret_cast<const uint32_t*>(rows[i] + d);
            // b0 of n-block j is byte j of rows 0 and 1, b1 byte j of rows 2 and 3: two byte
            // permutes a row pair put bytes j of both rows side by side, j = 0, 1 in one word and
            // j = 2, 3 in the other, and each word converts as two pairs
            uint32_t b0[4], b1[4];
            e4m3x4_to<MT>(__byte_perm(v[0], v[1], 0x5140), b0[0], b0[1]);
            e4m3x4_to<MT>(__byte_perm(v[0], v[1], 0x7362), b0[2], b0[3]);
            e4m3x4_to<MT>(__byte_perm(v[2], v[3], 0x5140), b1[0], b1[1]);
            e4m3x4_to<MT>(__byte_perm(v[2], v[3], 0x7362), b1[2], b1[3]);
#pragma unroll
            for (int j = 0; j < 4; ++j) mma16816<MT>(acc[4 * q4 + j], pf, b0[j], b1[j]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // ---- normalise and write; an empty split (l = 0) writes zeros and lse = -inf
  if (tid % S::kRowThreads == 0) {
    l_s[srow] = l_row;
    const int h = h0 + srow;
    if (h < num_heads) {
      part_lse[b * slb + h * slh + split * sls] =
          l_row > 0.f ? (m_row + log2f(l_row)) * 0.6931471805599453f : -INFINITY;
    }
  }
  __syncthreads();
  const int r = lane >> 2;
  const float l_lo = l_s[r], l_hi = l_s[r + 8];
  const float out_scale = scale_e4m3 / p_scale;  // the cache's one scale; this warp's 1 / p_scale
  const float inv_lo = l_lo > 0.f ? out_scale / l_lo : 0.f, inv_hi = l_hi > 0.f ? out_scale / l_hi : 0.f;
  const int64_t out_at = b * sob + static_cast<int64_t>(split) * sos;
  auto write = [&](int64_t at, float x, float y) {
    if (final_out) {
      store_pair(static_cast<T*>(part_out) + at, x, y);
    } else {
      *reinterpret_cast<float2*>(static_cast<float*>(part_out) + at) = make_float2(x, y);
    }
  };
  if constexpr (F == CacheFormat::kAuto) {
#pragma unroll
    for (int j = 0; j < S::kPVDims / 8; ++j) {
      const int col = warp * S::kPVDims + j * 8 + (lane & 3) * 2;
      if (h0 + r < num_heads) {
        write(out_at + (h0 + r) * soh + col, acc[j][0] * inv_lo, acc[j][1] * inv_lo);
      }
      if (h0 + r + 8 < num_heads) {
        write(out_at + (h0 + r + 8) * soh + col, acc[j][2] * inv_hi, acc[j][3] * inv_hi);
      }
    }
  } else {
    // n-block 4 q4 + j's columns 2c, 2c + 1 are dims d + 8c + j, d + 8c + 4 + j (d = the run's
    // first): lane c holds dims d + 8c .. d + 8c + 7 of its two head rows, 32 bytes from its
    // neighbours' in a float32 partial (16 in T). Stored from there, each instruction would write
    // a quarter of four 32-byte sectors a row; so the rows go through shared memory (the stages'
    // stored bytes, read for the last time before the barrier above) and come back out in order,
    // a warp's store 256 contiguous bytes of a row (128 in T).
    constexpr int kOutStride = kC + 4;  // floats: 8 lanes' 16-byte writes (rows r, r + 1) on 32 banks
    static_assert(size_t(kHeads) * kOutStride * 4 <= size_t(S::kStages) * S::kTile * kRawStride<F>,
                  "the output rows fit in the stages' bytes");
    float* o_s = reinterpret_cast<float*>(raw_s);  // (kHeads, kOutStride)
#pragma unroll
    for (int q4 = 0; q4 < S::kPVDims / 32; ++q4) {
      const int col = warp * S::kPVDims + q4 * 32 + (lane & 3) * 8;
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // head row r (C registers 0, 1), r + 8 (2, 3)
        const float inv = half ? inv_hi : inv_lo;
#pragma unroll
        for (int e = 0; e < 2; ++e) {  // column 2c + e: dims col + 4e + 0..3 = n-blocks j = 0..3
          const int k = 2 * half + e;
          *reinterpret_cast<float4*>(o_s + (r + 8 * half) * kOutStride + col + 4 * e) =
              make_float4(acc[4 * q4][k] * inv, acc[4 * q4 + 1][k] * inv, acc[4 * q4 + 2][k] * inv,
                          acc[4 * q4 + 3][k] * inv);
        }
      }
    }
    __syncthreads();
    // pair i = tid + kThreads * pass: row i / kPairs, dims 2 (i mod kPairs) and + 1; a warp 32
    // consecutive pairs of one row
    constexpr int kPairs = kC / 2;
    static_assert((kHeads * kPairs) % kThreads == 0, "whole passes over the rows");
#pragma unroll 4
    for (int i = tid; i < kHeads * kPairs; i += kThreads) {
      const int row = i / kPairs, col = (i % kPairs) * 2;
      if (h0 + row < num_heads) {
        const float2 v = *reinterpret_cast<const float2*>(o_s + row * kOutStride + col);
        write(out_at + (h0 + row) * soh + col, v.x, v.y);
      }
    }
  }
}

// The shapes built. Mostly 4 warps, 2 tiles of 32 tokens, ~103 KiB of shared memory, two CTAs an SM:
// on an H200, 8 warps x 4 tiles of 32 (one CTA an SM) run 7-19% slower from b = 4 up, and
// 8 warps x 2 tiles of 64 or 4 warps x 4 tiles of 16 run 2-17% slower.
using DecodeShape = Shape<32, 2, 4, 2>;
static_assert(DecodeShape::kSmemBytes == 105088,
              "mla/kernels/backends.py's CUDA_SMEM_BYTES[\"cuda-sm80\"] must equal DecodeShape::kSmemBytes");
// One wave of CTAs (b x splits <= SMs), one CTA an SM: 4 tiles of 32, ~176 KiB. Three tiles in
// flight keep DRAM busy for a CTA alone on its SM; a split of only a few tiles pays for the deeper
// prologue instead (docs/derivations/split-kv.md has the times).
using WaveShape = Shape<32, 4, 4, 1>;
static_assert(WaveShape::kSmemBytes == 179840, "the one-wave shape's shared memory");
// On an fp8 cache the same shapes hold kStages tiles of stored bytes and no tile in q's dtype:
// about two thirds of the bf16 shapes' shared memory (three CTAs of DecodeShape would fit an
// H100 / H200 SM's 228 KiB, 1 KiB of it reserved a CTA, but not their registers: 3 x 128 threads
// leave 170 a thread).
static_assert(Smem<DecodeShape, CacheFormat::kAuto>::kBytes == DecodeShape::kSmemBytes &&
                  Smem<WaveShape, CacheFormat::kAuto>::kBytes == WaveShape::kSmemBytes,
              "a cache in q's dtype: the shapes' own shared memory");
static_assert(Smem<DecodeShape, CacheFormat::kFp8E4M3>::kBytes == 68224 &&
                  Smem<DecodeShape, CacheFormat::kFp8DsMla>::kBytes == 73600,
              "mla/kernels/backends.py's SM80_FP8_SMEM_BYTES must equal these");
static_assert(Smem<WaveShape, CacheFormat::kFp8E4M3>::kBytes == 106112 &&
                  Smem<WaveShape, CacheFormat::kFp8DsMla>::kBytes == 115584,
              "the one-wave shape's shared memory on fp8 caches");
static_assert(2 * (Smem<DecodeShape, CacheFormat::kFp8DsMla>::kBytes + 1024) <= 228 * 1024,
              "two CTAs an H100 / H200 SM on an fp8_ds_mla cache");

// ---------------------------------------------------------------------------------------------
// Host side: the check (binding.cpp), then the launch on the current stream

// Shared memory a CTA of shape S needs on a cache of layout `format`.
template <typename S>
size_t smem_bytes(CacheFormat format) {
  switch (format) {
    case CacheFormat::kFp8E4M3:
      return Smem<S, CacheFormat::kFp8E4M3>::kBytes;
    case CacheFormat::kFp8DsMla:
      return Smem<S, CacheFormat::kFp8DsMla>::kBytes;
    default:
      return Smem<S, CacheFormat::kAuto>::kBytes;
  }
}

void mla_decode_sm80(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, at::Tensor& part_out, at::Tensor& part_lse,
                     double softmax_scale, int64_t num_splits, const std::string& kv_cache_dtype,
                     const std::optional<at::Tensor>& kv_scale) {
  // mla_decode checked the user's arguments; these guard the kernel's own assumptions.
  const CacheFormat format =
      check_mla_decode(q, kv_cache, block_table, seq_lens, part_out, part_lse, num_splits,
                       {"mla_decode_sm80", kHeads, kC, kR, DecodeShape::kTile}, kv_cache_dtype, kv_scale);
  const int64_t b = q.size(0), h = q.size(1);
  if (b == 0 || h == 0) return;

  const c10::cuda::CUDAGuard guard(q.device());
  int smem_optin = 0, num_sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        q.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, q.get_device()));
  TORCH_CHECK(static_cast<size_t>(smem_optin) >= smem_bytes<DecodeShape>(format),
              "mla_decode_sm80: this GPU allows too little shared memory a block (",
              num(static_cast<int64_t>(smem_bytes<DecodeShape>(format))), " bytes needed, ",
              num(static_cast<int64_t>(smem_optin)), " allowed)");
  const bool one_wave =
      b * num_splits <= num_sms && static_cast<size_t>(smem_optin) >= smem_bytes<WaveShape>(format);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(1, static_cast<unsigned>(b), static_cast<unsigned>(num_splits));
  const float scale_log2 = static_cast<float>(softmax_scale * 1.4426950408889634);
  const float* scale_ptr = format == CacheFormat::kFp8E4M3 ? kv_scale->data_ptr<float>() : nullptr;
  auto run = [&](auto* kernel, auto type_tag, auto shape_tag, auto format_tag) {
    using T = decltype(type_tag);
    using S = decltype(shape_tag);
    constexpr CacheFormat F = decltype(format_tag)::value;
    using KV = std::conditional_t<F == CacheFormat::kAuto, T, uint8_t>;
    constexpr size_t kBytes = Smem<S, F>::kBytes;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kBytes)));
    kernel<<<grid, S::kThreads, kBytes, stream>>>(
        reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const KV*>(kv_cache.data_ptr()), scale_ptr,
        block_table.data_ptr<int>(), seq_lens.data_ptr<int>(), part_out.data_ptr(),
        part_lse.data_ptr<float>(), part_out.scalar_type() != at::kFloat, static_cast<int>(h),
        static_cast<int>(kv_cache.size(1)), static_cast<int>(num_splits), scale_log2, q.stride(0),
        q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), part_out.stride(0),
        part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1), part_lse.stride(2));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  auto run_format = [&](auto shape_tag, auto format_tag) {
    using S = decltype(shape_tag);
    constexpr CacheFormat F = decltype(format_tag)::value;
    if (q.scalar_type() == at::kBFloat16) {
      run(mla_decode_sm80_kernel<__nv_bfloat16, S, F>, __nv_bfloat16{}, shape_tag, format_tag);
    } else {
      run(mla_decode_sm80_kernel<__half, S, F>, __half{}, shape_tag, format_tag);
    }
  };
  auto run_shape = [&](auto shape_tag) {
    switch (format) {
      case CacheFormat::kFp8E4M3:
        run_format(shape_tag, std::integral_constant<CacheFormat, CacheFormat::kFp8E4M3>{});
        break;
      case CacheFormat::kFp8DsMla:
        run_format(shape_tag, std::integral_constant<CacheFormat, CacheFormat::kFp8DsMla>{});
        break;
      default:
        run_format(shape_tag, std::integral_constant<CacheFormat, CacheFormat::kAuto>{});
    }
  };
  if (one_wave) {
    run_shape(WaveShape{});
  } else {
    run_shape(DecodeShape{});
  }
}

}  // namespace
}  // namespace mla

TORCH_LIBRARY_IMPL(mla, CUDA, m) {
  m.impl("mla_decode_sm80", &mla::mla_decode_sm80);
}
