// mla_decode_sm90: stage 1 of split-KV MLA decode with Hopper's warpgroup MMA (wgmma, sm_90a),
// 64 heads a CTA: the compute-bound case (DeepSeek-V3's 128 heads on one GPU, or 64 / 32 at
// tensor parallelism 2 / 4). Fewer heads run too, padded to 64 with zero rows (a quarter of the
// MMA work is useful at 16 heads, where mla_decode_sm80.cu is the default).
//
// The same computation and outputs as mla_decode_sm80.cu (fp32 partial outputs and log-sum-exps
// for the Triton merge, or with one split the answer itself), for DeepSeek's sizes only (c = 512,
// r = 64), tiles of kN = 64 tokens.
// The two warpgroups take the split's tiles in pairs, A = tile 2p in buffer 0 and B = tile 2p + 1
// in buffer 1 ("seesaw", the schedule of FlashMLA's Hopper kernel): each computes S for its own
// tile and holds half of O, so both do the same MMA work and one's softmax runs while the other's
// MMAs do.
//
//   warpgroup 0 (O[:, :256], tile A)           warpgroup 1 (O[:, 256:], tile B)
//   S_A = q . K_A^T (36 wgmma m64n64k16)        S_B = q . K_B^T
//   m_A = max(m, rowmax S_A), P_A, O_L *= ..   ->  m_B = max(m_A, rowmax S_B), P_B, O_R *= ..
//   O_L += P_A . V_A[:, :256] (P from regs)   <-  P_B -> smem
//   P_A * exp2(m_A - m_B) -> smem              ->  O_R += P_A . V_A[:, 256:] (P from smem)
//                                                  O_R += P_B . V_B[:, 256:] (P from regs)
//   O_L = O_L * exp2(m_A - m_B) + P_B . V_B[:, :256] (P from smem)
//   S of the next A (blocks 0-3, then 4-8)      S of the next B (blocks 4-8, then 0-3)
//
// The products are issued in that order as a rule (warpgroup 0's P_B . V_B waits for its own
// P_A . V_A to finish, by which time warpgroup 1 has issued its two), so each buffer's last reader
// comes as early as it can: buffer 0 (the next A, whose S comes first) is free after the fourth
// product of the pair, buffer 1 after the fifth and sixth, and each S starts on the block group
// refilled first.
//
// A CTA's work is one segment, a sequence's run of tiles, or several in turn. Cut per sequence,
// CTA (x, b, z) takes split z of sequence b's num_splits. Dealt (ranges given), the batch's pairs
// of tiles, sequence after sequence, are cut into num_pieces equal pieces, and CTA (x, 0, z) runs
// the segments piece z covers: the end of one sequence, whole short ones, the start of another.
// A segment's partial goes to its (sequence, piece) slot, or where the piece holds the whole
// sequence its answer straight to out; the Triton merge combines the rest. So a batch whose
// sequences differ in length takes about its tokens' time, where a cut per sequence takes its
// longest sequence's. The segments reuse the mbarriers, their phases counted on across segments.
//
// Shared memory holds q and each tile as wgmma's canonical 128-byte-swizzled K-major layout:
// 9 column blocks of 64 dims (128 bytes a row), each (64 rows, 128 bytes) with the 16-byte
// chunk c of row r stored at chunk c ^ (r % 8). The same bytes are V's N-major layout for the
// second product (B = V, K = tokens, N = dims), so a tile is loaded once for both, by the TMA
// unit (the cache's tensor maps do the swizzle; a split's last tile too, its rows past the end
// cleared once landed). A buffer's blocks are refilled as soon as both warpgroups are done with
// them, in two groups: blocks 0-3 (V's left half) by warpgroup 0, blocks 4-8 by warpgroup 1,
// each group one TMA copy (a box of 4 or 5 blocks) completing one mbarrier, so S of the next
// tile starts on the group that has landed first. P_A lives in buffer 0's rope block
// (free once S_A is computed), P_B in a block of its own.
//
// It also reads the two fp8 layouts of mla/kernels/fp8.py (kv_cache_dtype "fp8_e4m3": 576 e4m3
// bytes a row, one float32 scale in a 1-element device tensor; "fp8_ds_mla": 656 bytes, 512 e4m3
// values, 4 float32 scales one per 128 values, 64 bf16 rope values), with the same schedule. Their
// stored bytes are copied by the TMA unit into the group's own blocks (the latent bytes into their
// upper half), and the warpgroup that asked for a group turns it into the swizzled layout of its
// products' dtype there before it completes the group's mbarrier (finish_fp8_blocks), with the
// latent products in fp16 whatever q's dtype (q brought into range by a power of two):
// fp8_e4m3's e4m3 values as they are (exact in fp16; the cache's one scale is folded into the
// softmax scale and the output, the Triton kernel's values), fp8_ds_mla's e4m3 x (its group's
// scale / 2^F) rounded to fp16, with F a power of two a tile (tile_exponent) that keeps the
// tile's values and scales in fp16's range and is folded back into the tile's scores and
// probabilities in float32; fp8_ds_mla's rope block stays bf16 (times 2^-F), and its products run
// in bf16 beside the latent's. A group's copies are issued where
// a TMA copy would be and finished (waited for, converted, the mbarrier completed) later, so the
// copies' latency and the conversion overlap other work: warpgroup 0 converts the next A's blocks
// 0-3 while its P_B . V_B runs and the next B's while the next A's last scores run; warpgroup 1
// has both of its groups in flight at once and finishes the next A's first, which warpgroup 0's
// next S waits for. The products and the softmax do not change.
//
// Several new tokens a sequence (s_q = 2..8, speculative decoding): q is (b, s_q·h, 576), its rows
// (token, head) pairs token-major, packed into the 64-row tiles as heads are (the Triton kernel's
// packing; out and lse are (b, s_q·h, ...) the same way). Row R is new token j = R / h, which sees
// the first seq_len - (s_q - 1 - j) cached rows: its scores at and past that are -inf, in the
// softmax stage only (any cache layout). The segments are still cut on seq_len, the longest row's.
// A row may see no token of a tile, a split, or at all (seq_len < s_q - j) while others of its
// tile do: its max stays -inf, its exponents are taken against 0 and its rescale factor is 1 (not
// the NaN of exp2(-inf + inf)), so it ends with l = 0: out 0 and lse -inf. That masking and those
// guards are the MultiToken instantiation's; s_q = 1 runs the kernel without them.
//
// At 128 heads the instructions the warps issue bound the time as much as the MMAs do, so: the
// loops over column blocks unroll (descriptors and copy addresses are a base plus
// a constant), a positive scale is applied after the row max, inside the exponent's FFMA (a scale
// <= 0 scales first), and O is rescaled only when some row of the warp changed its max.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "concat_and_cache_mla.h"
#include "mla_decode.h"
#include "mla_decode_fp8.cuh"

#include <cuda.h>  // CUtensorMap (the types only: the encoder is fetched through the runtime)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
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
constexpr int kThreads = 256;             // two warpgroups of 128
constexpr int kMaxHeads = 64 * 1024;      // head blocks are the grid's x (any count would do)
constexpr int kBlocks = kD / 64;          // 9 column blocks of 64 dims (128 bytes a row)
constexpr int kLoBlocks = 4;              // blocks 0-3 (loaded by warpgroup 0), 4-8 (warpgroup 1)
constexpr int kBlockBytes = 64 * 128;     // one column block of 64 rows
constexpr int kMatBytes = kBlocks * kBlockBytes;  // q, or one tile: 73,728 bytes
constexpr int kVecs = kD / 8;             // 72 16-byte vectors a row
constexpr int kLoads = 64 * kVecs / kThreads;     // 18 copies a thread for q's 64 rows
static_assert(64 * kVecs % kThreads == 0, "rows split evenly over the threads");
// q, two tiles, P_B (64 x 64, one column block), m / scale_A / scale_B / l (two) a row,
// 8 mbarriers (2 buffers x 2 block groups, each a group's blocks whole and, on an fp8 cache, its
// stored bytes landed); 1 KiB to align to 1024 bytes
constexpr size_t kSmemBytes = size_t(3) * kMatBytes + kBlockBytes + 5 * kM * 4 + 2 * 2 * 2 * 8 + 1024;
static_assert(64 * (4 * kC + 32) <= 2 * kMatBytes && 2 * kThreads == kC,
              "the epilogue's rows fit in q's and buffer 0's bytes, a row's 512 values two a thread");
static_assert(kSmemBytes == 231744,
              "mla/kernels/backends.py's CUDA_SMEM_BYTES[\"cuda-sm90\"] must equal kSmemBytes");
// fp8_ds_mla's stored row (mla_decode_fp8.cuh): four float32 scales from byte kDsMlaScales, the bf16
// rope values from byte kDsMlaRope
constexpr int kDsMlaScales = ds_mla_scales(kC), kDsMlaRope = ds_mla_rope(kC);
// An fp8 cache's stored bytes are staged in the tile buffers themselves, so every layout needs
// kSmemBytes (mla/kernels/backends.py's SM90_FP8_SMEM_BYTES), within the 227 KiB a block may have:
// a block's 64 rows of 64 e4m3 bytes fill half of its 8 KiB (finish_fp8_blocks), fp8_ds_mla's
// scales (64 rows of 16 bytes) the first KiB of a group's first block, and its 128 bytes of bf16
// rope values a row block 8 as a cache in T's would.
static_assert(kSmemBytes <= 227 * 1024 && 64 * 64 == kBlockBytes / 2 && 64 * 16 <= kBlockBytes / 2 &&
                  kDsMlaRope - kDsMlaScales == 16 && stored_row_bytes(CacheFormat::kFp8DsMla, kC, kR) - kDsMlaRope == 128 &&
                  stored_row_bytes(CacheFormat::kFp8E4M3, kC, kR) - kC == 64,
              "an fp8 tile's stored bytes fit in place");
// named barriers between the warpgroups (0 is __syncthreads): one arrives, the other waits
enum : int { kBarScaleA = 1, kBarScaleB = 2, kBarPA = 3, kBarPB = 4 };
// named barrier of one warpgroup (128 threads; 5 and 6): a split's last or empty tile's rows
// past the end cleared, an fp8 block group's copies landed, scales read, values converted
template <int Id>
__device__ __forceinline__ void bar_sync_wg() { asm volatile("bar.sync %0, 128;\n" ::"n"(Id) : "memory"); }
// warpgroup wg's own barrier (wg uniform in a warp)
__device__ __forceinline__ void sync_warpgroup(int wg) {
  if (wg == 0) bar_sync_wg<5>(); else bar_sync_wg<6>();
}
// sync_warpgroup that also returns whether p held in any of the warpgroup's threads
template <int Id>
__device__ __forceinline__ bool any_wg(bool p) {
  uint32_t any;
  asm volatile("{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, 128, p;\n"
               " selp.u32 %0, 1, 0, q;\n}\n"
               : "=r"(any) : "r"(static_cast<uint32_t>(p)), "n"(Id) : "memory");
  return any != 0;
}
__device__ __forceinline__ bool sync_warpgroup_any(int wg, bool p) {
  return wg == 0 ? any_wg<5>(p) : any_wg<6>(p);
}

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
// order shared-memory writes this thread has made or observed (its st.shared; copies seen landed
// through an mbarrier or a barrier) before its later wgmma reads (the async proxy)
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// mbarriers, one arrival a phase: a block group of a cache in T completes when the TMA unit has
// written its bytes (expect_tx; no tile: the arrival alone), an fp8 group's when its warpgroup
// has converted the stored bytes (which complete the group's second mbarrier, as a TMA copy does)
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// the TMA unit copies the map's box (kv_tensor_map: its inner elements, 64 rows, its column
// blocks) at (row, block, page) of the cache into dst, swizzled or dense as the tensor map says
// (swizzled: 128 bytes, the layout above, a block's 64 rows after another's), completing its bytes
// on the mbarrier
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int row, int block, int page,
                                         uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(0), "r"(row), "r"(block), "r"(page), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  }
}
// named barrier `id` over both warpgroups: arrive (go on) or sync (wait for the other's arrive)
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }

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
// wait until at most N committed groups of this warpgroup's MMAs are still running
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// keeps the compiler from touching accumulators between an MMA's issue and its wait
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// keeps an MMA's register A operand (P) alive until the MMA has been waited for
__device__ __forceinline__ void pin(uint32_t (&a)[4][4]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) asm volatile("" : "+r"(a[i / 4][i % 4])::"memory");
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

// d (64 x 64, fp32) (+)= A (64 x 16, shared) . B (16 x 64, shared, K-major); accumulate 0: d = A . B
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
// a pair of T (the first in the low half) -> two floats, exactly
__device__ __forceinline__ float2 pair_to_float2(uint32_t w, __nv_bfloat16) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
}
__device__ __forceinline__ float2 pair_to_float2(uint32_t w, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}

// ---- fp8_ds_mla: a tile's values e4m3 x scale come into fp16 divided by 2^F, F from the largest
// group scale m of the tile's valid rows (m = 1.x 2^e): 0 for e in [-14, 5] (every value below
// 448 x 2^6 = 28,672 < 65,504, the largest scale a normal fp16 >= 2^-14), else e - 5 above and
// e + 14 below, at least -60 (the bf16 rope values times 2^-F stay finite); kNoRows for a tile
// with no valid row (m = 0). The tile's scores take 2^F back in float32, and its probabilities
// 2^(F - G), G the largest F so far (at most 1 before fp16 rounding, so none overflows and the
// largest tiles' keep their bits), O holding P . V / 2^G until the end.
constexpr int kNoRows = -1000;
__device__ __forceinline__ int tile_exponent(float m) {
  const int e = static_cast<int>((__float_as_uint(m) >> 23) & 0xFF) - 127;  // inf: 128
  if (m == 0.f) return kNoRows;
  return e > 5 ? e - 5 : (e < -14 ? max(e + 14, -60) : 0);
}
// 2^e for e <= 127, 0 below -126 (kNoRows included)
__device__ __forceinline__ float pow2(int e) {
  return e < -126 ? 0.f : __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
}

// 8 e4m3 bytes x s -> four fp16 pairs (bytes 0, 1 of x in the first): each pair to fp16 exactly in
// one cvt, then one fp16 multiply by s (a group's scale / 2^F, rounded to fp16)
__device__ __forceinline__ uint4 e4m3x8_times(uint2 bytes, __half2 s) {
  uint32_t w[4];
  e4m3x4_to<__half>(bytes.x, w[0], w[1]);
  e4m3x4_to<__half>(bytes.y, w[2], w[3]);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&w[j]), s);
    w[j] = *reinterpret_cast<const uint32_t*>(&v);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// ---- An fp8 cache's block group J0 of a tile -> the group's blocks in its products' dtype T,
// swizzled as a TMA copy of a cache in T leaves them, by one warpgroup (wtid < 128 of warpgroup
// wg), completing the group's mbarrier `bar` once they are whole. There is no room beside q and
// the two tiles for a buffer of stored bytes, so the TMA unit copies them into the group's own
// blocks (load_blocks, one thread, completing the mbarrier `raw`): the e4m3 latent values of its
// NB column blocks (64 rows of 64 bytes a block) densely into their upper half, at byte
// NB x 4096 + 4096 k for block k; fp8_ds_mla also its rows' four float32 scales (16 bytes a row)
// at byte 0 and, for the second group, its bf16 rope values straight into block 8, swizzled (so
// NB = 4 for both of its groups; fp8_e4m3's second group holds the e4m3 rope block, NB = 5).
//
// Here the warpgroup waits for them, then converts the blocks in place from the first: block k's
// output (bytes 8192 k ..) covers the stored bytes of blocks 2k - NB and 2k - NB + 1, so the
// outputs of the first NB / 2 blocks (rounded down) cover none and are written at once; then
// each thread reads the rest of its stored bytes into registers, and one barrier keeps the other
// outputs behind every read of the bytes they overwrite; fp8_ds_mla reads its scales into
// registers, and passes a barrier, before block 0's output covers them. fp8_e4m3's values become
// fp16 exactly (one cvt a pair; the cache's scale is folded into the softmax scale and the
// output); fp8_ds_mla's the tile's 2^F from the largest scale of its valid rows (each warpgroup
// finds the same from the scales its group holds: F = 0 from the barrier's vote where every
// thread's largest is in range, else from its warps' maxima, 4 floats a warpgroup at
// `tile_max_s`), then e4m3 x (group scale / 2^F) in fp16, and its bf16 rope values times 2^-F
// (exact). Rows at and past `valid` become zeros (their bytes taken as 0, fp8_ds_mla's
// scales as 0). Returns F (fp8_e4m3: 0; no valid row: kNoRows).
template <typename T, CacheFormat F, int J0>
__device__ __forceinline__ int finish_fp8_blocks(unsigned char* blocks, int valid, int wtid, int wg, uint32_t raw,
                                                   int parity, uint32_t bar, float* tile_max_s) {
  constexpr bool ds_mla = F == CacheFormat::kFp8DsMla;
  constexpr int NB = ds_mla || J0 == 0 ? kLoBlocks : kBlocks - kLoBlocks;
  static_assert(NB == 4 || NB == 5, "a block group of 4 or 5 blocks");
  static_assert(std::is_same_v<T, __half>, "an fp8 cache's latent products run in fp16");
  constexpr int kRawAt = NB * 4096;
  // the outputs of blocks 0 .. kFree - 1 end at byte 8192 kFree <= kRawAt, where the stored bytes
  // start (fp8_ds_mla's scales, under block 0's, are read before the barrier below)
  constexpr int kFree = NB / 2;
  mbar_wait(raw, parity);  // the copies landed (the TMA unit's writes, visible to this thread)
  // this thread's rows: wtid / 4 and wtid / 4 + 32; fp8_ds_mla: their scales of the group's two
  // latent groups of 128 (block k takes scale k / 2), over 2^F, in fp16
  __half2 scale[2][2];
  int fe = 0, tile_f = 0;  // F, and what is returned (kNoRows where no row is valid; fe 0 then)
  if constexpr (ds_mla) {
    float4 row_scales[2];
    float top = 0.f;  // the largest scale of this thread's valid rows (fmaxf passes over a NaN)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = (wtid >> 2) + 32 * h;
      row_scales[h] = *reinterpret_cast<const float4*>(blocks + 16 * r);
      if (r < valid) {
        top = fmaxf(top, fmaxf(fmaxf(row_scales[h].x, row_scales[h].y), fmaxf(row_scales[h].z, row_scales[h].w)));
      }
    }
    // Where every thread's largest lies in [2^-14, 2^6), so does the tile's: F = 0, the usual case,
    // known from one barrier's vote (the barrier also keeps every scale read before block 0's
    // output covers them). Otherwise (a large or small scale, or a thread with no valid row) F
    // comes from the tile's largest, the maximum of its warps' maxima.
    const bool in_range = top >= 0x1p-14f && top < 0x1p6f;
    if (!sync_warpgroup_any(wg, !in_range)) {
      tile_f = 0;
    } else {
#pragma unroll
      for (int x = 16; x > 0; x >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, x));
      if ((wtid & 31) == 0) tile_max_s[4 * wg + (wtid >> 5)] = top;
      sync_warpgroup(wg);  // every warp's maximum written
      top = fmaxf(fmaxf(tile_max_s[4 * wg], tile_max_s[4 * wg + 1]), fmaxf(tile_max_s[4 * wg + 2], tile_max_s[4 * wg + 3]));
      tile_f = tile_exponent(top);
    }
    fe = tile_f == kNoRows ? 0 : tile_f;
    const float down = pow2(-fe);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float mine[2] = {J0 == 0 ? row_scales[h].x : row_scales[h].z, J0 == 0 ? row_scales[h].y : row_scales[h].w};
      const bool row_valid = (wtid >> 2) + 32 * h < valid;  // 0 for a row past the end (below)
#pragma unroll
      for (int g = 0; g < 2; ++g) scale[h][g] = __float2half2_rn(row_valid ? mine[g] * down : 0.f);
    }
  }
  // pieces wtid and wtid + 128 of block k: row i / 4, 16 bytes (i % 4) of its 64
  uint4 v[NB][2];
  auto load = [&](int k) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // a row past the end is not read: its zeros (e4m3 0 is +0) times its fp8_ds_mla scale of 0
      // leave no NaN or inf of its bytes or scales, with no branch around the conversion
      v[k][h] = make_uint4(0u, 0u, 0u, 0u);
      if ((wtid >> 2) + 32 * h < valid) {
        v[k][h] = *reinterpret_cast<const uint4*>(blocks + kRawAt + 4096 * k + 16 * (wtid + 128 * h));
      }
    }
  };
  auto convert = [&](int k) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = wtid + 128 * h, r = i >> 2, p = i & 3;
      const uint4 x = v[k][h];
      uint4 lo, hi;
      if constexpr (ds_mla) {
        lo = e4m3x8_times(make_uint2(x.x, x.y), scale[h][k >> 1]);
        hi = e4m3x8_times(make_uint2(x.z, x.w), scale[h][k >> 1]);
      } else {
        e4m3x4_to<__half>(x.x, lo.x, lo.y);
        e4m3x4_to<__half>(x.y, lo.z, lo.w);
        e4m3x4_to<__half>(x.z, hi.x, hi.y);
        e4m3x4_to<__half>(x.w, hi.z, hi.w);
      }
      unsigned char* row = blocks + 8192 * k + 128 * r;
      *reinterpret_cast<uint4*>(row + (((2 * p) ^ (r & 7)) << 4)) = lo;
      *reinterpret_cast<uint4*>(row + (((2 * p + 1) ^ (r & 7)) << 4)) = hi;
    }
  };
#pragma unroll
  for (int k = 0; k < kFree; ++k) load(k);
#pragma unroll
  for (int k = 0; k < kFree; ++k) convert(k);  // below the stored blocks
#pragma unroll
  for (int k = kFree; k < NB; ++k) load(k);
  sync_warpgroup(wg);  // every stored byte read before the outputs below cover them
#pragma unroll
  for (int k = kFree; k < NB; ++k) convert(k);
  if constexpr (ds_mla && J0 == kLoBlocks) {
    // the rope block (8), bf16 as the TMA unit left it: zeros for rows past the split's end, the
    // rest times 2^-F (a power of two in bf16's range: exact); chunk i % 8 of row i / 8 (a chunk
    // stays in its row under the swizzle)
    const __nv_bfloat162 down = __float2bfloat162_rn(pow2(-fe));
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int i = wtid + 128 * m;
      uint4* rope = reinterpret_cast<uint4*>(blocks + 4 * kBlockBytes + 16 * i);
      if ((i >> 3) >= valid) {
        *rope = make_uint4(0u, 0u, 0u, 0u);
      } else if (fe != 0) {
        uint4 v = *rope;
        for (uint32_t* w : {&v.x, &v.y, &v.z, &v.w}) {
          const __nv_bfloat162 x = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(w), down);
          *w = *reinterpret_cast<const uint32_t*>(&x);
        }
        *rope = v;
      }
    }
  }
  fence_async_shared();  // the converted blocks, visible to wgmma ...
  sync_warpgroup(wg);      // ... everyone's
  if (wtid == 0) mbar_arrive(bar);
  return tile_f;
}

// T: q's dtype; F: the cache's layout; MultiToken: s_q > 1 new tokens a sequence (per-row causal
// limits).
template <typename T, CacheFormat F, bool MultiToken>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_sm90_kernel(
    const T* __restrict__ q,              // (b, rows, 576), rows = s_q·h (token-major)
    // the TMA unit's views of the cache (kv_tensor_map), which every tile is read through: a
    // cache (pages, page_size, 576) in T as (64, page_size, 9, pages), boxes of blocks 0-3 (lo)
    // and 4-8 (hi), 128-byte swizzle; fp8_e4m3 its bytes the same way, no swizzle; fp8_ds_mla
    // its latent bytes as (64, page_size, 8, pages), boxes of 4 blocks (lo), its bf16 rope
    // values (hi, 128-byte swizzle) and its scales (x, 16 bytes a row)
    const __grid_constant__ CUtensorMap kv_map_lo, const __grid_constant__ CUtensorMap kv_map_hi,
    const __grid_constant__ CUtensorMap kv_map_x,
    const int* __restrict__ block_table,  // (b, max_pages), last dim contiguous
    const int* __restrict__ seq_lens,     // (b,)
    // fp32 partials: (b, rows, splits, 512) and (b, rows, splits) cut per sequence; dealt, a slot
    // a (sequence, piece) pair, (b + pieces - 1, rows, 512) and (b + pieces - 1, rows)
    float* __restrict__ part_out, float* __restrict__ part_lse,
    // the answer in T and its lse, (b, rows, 512) and (b, rows): every sequence's at one split
    // (final_out), or dealt, each sequence's that lies whole in one piece
    void* __restrict__ out, float* __restrict__ lse, bool final_out,
    int* __restrict__ ranges,             // (b, 2), dealt only: each sequence's first slot and pieces
    int num_pieces,                       // 0: each sequence cut into num_splits; else the pieces dealt
    int batch,                            // b
    int num_rows,                         // query rows a sequence: s_q·h
    int heads, int q_tokens,              // h and s_q (read by the MultiToken instantiation only)
    int page_size, int num_splits, float scale_log2,
    int64_t sqb, int64_t sqh, int64_t sbb,
    int64_t sob, int64_t soh, int64_t sos, int64_t slb, int64_t slh, int64_t sls,
    int64_t sfb, int64_t sfh, int64_t sgb, int64_t sgh,
    const float* __restrict__ kv_scale) {  // (1,): the fp8_e4m3 cache's scale; not read otherwise
#ifdef MLA_SM90A
  // The products' type: T on a cache in T; fp16 on an fp8 cache whatever q's dtype: e4m3 becomes
  // fp16 exactly in one instruction a pair, where bf16 takes a float round trip of five, and the
  // conversions run in the warpgroups that issue the products. q enters them times a power of two
  // that brings the CTA's largest |q| into fp16's range (exact from bf16); P in [0, 1] takes 11
  // significant bits there (bf16: 8). fp8_ds_mla's values e4m3 x a group scale have no bound fp16
  // could hold: a tile's come in over a power of two 2^F (finish_fp8_blocks), and its bf16 rope
  // block (RT, with q's rope part in bf16) keeps bf16's range.
  static constexpr bool kDsMla = F == CacheFormat::kFp8DsMla;
  using MT = std::conditional_t<F == CacheFormat::kAuto, T, __half>;
  using RT = std::conditional_t<kDsMla, __nv_bfloat16, MT>;  // the rope block's products
  extern __shared__ unsigned char smem_raw[];
  // the swizzle pattern repeats every 1024 bytes: the layouts start on such a boundary
  const uint32_t raw = smem_u32(smem_raw);
  unsigned char* smem = smem_raw + (((raw + 1023) & ~1023u) - raw);
  const uint32_t q_s = smem_u32(smem);                  // (64 heads, 576) swizzled
  const uint32_t kv_s = q_s + kMatBytes;                // buffers 0 (tile A) and 1 (tile B), swizzled
  unsigned char* pa_ptr = smem + kMatBytes + 8 * kBlockBytes;  // P_A: buffer 0's rope block
  unsigned char* pb_ptr = smem + 3 * kMatBytes;                // P_B (64 heads, 64 tokens) swizzled
  const uint32_t pa_s = smem_u32(pa_ptr), pb_s = smem_u32(pb_ptr);
  float* m_s = reinterpret_cast<float*>(pb_ptr + kBlockBytes);  // (64,) running max, log2 units
  float* scale_a_s = m_s + kM;   // (64,) exp2(m_before - m_A): warpgroup 0 -> 1
  float* scale_b_s = m_s + 2 * kM;  // (64,) exp2(m_A - m_B): warpgroup 1 -> 0
  float* l_s = m_s + 3 * kM;     // (2, 64) each warpgroup's row sums, at the end
  const uint32_t bars = smem_u32(m_s + 5 * kM);  // (2 kinds, 2 buffers, 2 block groups) mbarriers
  // the mbarrier of buffer buf's blocks [J0, ...): group 0 is blocks 0-3, group 1 blocks 4-8
  auto bar = [&](int buf, int j0) { return bars + 8 * (2 * buf + (j0 >= kLoBlocks)); };
  // an fp8 cache: the mbarrier of the same group's stored bytes landed (the TMA copies')
  auto raw_bar = [&](int buf, int j0) { return bars + 32 + 8 * (2 * buf + (j0 >= kLoBlocks)); };

  const int tid = threadIdx.x, wtid = tid & 127, warp = (tid >> 5) & 3, lane = tid & 31;
  // the warpgroup, read through a shuffle so the compiler sees it is uniform in a warp (else it
  // serialises the wgmma in the branches below)
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int g = lane >> 2, c = lane & 3;   // accumulator rows 16 warp + g (+ 8), columns 2c (+ 1)
  const int row0 = 16 * warp + g;          // this thread's first query row within the CTA
  const int h0 = blockIdx.x * kM;          // the CTA's first query row

  // ---- the CTA's work, one segment (a sequence's run of tiles) at a time. Cut per sequence
  // (num_pieces = 0): one segment, split blockIdx.z of sequence blockIdx.y's num_splits. Dealt:
  // the batch's tile pairs, sequence after sequence (an empty sequence counts one pair, so that
  // a piece writes its zeros and -inf), go to num_pieces pieces of `per` pairs, piece blockIdx.z
  // taking pairs [lo, hi): the segments of the sequences those cover. A segment is final when
  // its sequence lies whole in this piece (the answer written here), else a partial in slot
  // b + piece, the sequence's slots consecutive from b + its first piece (ranges, for the merge).
  const int piece = blockIdx.z;
  auto pairs_of = [&](int i) { return max(1, ((seq_lens[i] + kN - 1) / kN + 1) / 2); };
  int per = 0, lo = 0, hi = 0, seq_pair0 = 0;  // dealt: the piece's pairs; the segment's first in the batch
  int64_t b = blockIdx.y;
  if (num_pieces > 0) {
    // every warp the same: the batch's pairs, then the sequence holding pair lo (a prefix sum of
    // 32 sequences at a time)
    int total = 0;
    for (int i0 = 0; i0 < batch; i0 += 32) total += __reduce_add_sync(0xffffffffu, i0 + lane < batch ? pairs_of(i0 + lane) : 0);
    per = (total + num_pieces - 1) / num_pieces;
    lo = piece * per;
    hi = min(total, lo + per);
    if (lo >= hi) return;  // no pair left for this piece (every thread alike)
    for (int i0 = 0, carry = 0;; i0 += 32) {
      const int n = i0 + lane < batch ? pairs_of(i0 + lane) : 0;
      int upto = n;  // pairs of sequences 0 .. i0 + lane
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, upto, d);
        if (lane >= d) upto += x;
      }
      upto += carry;
      const unsigned past = __ballot_sync(0xffffffffu, i0 + lane < batch && upto > lo);
      if (past != 0u) {
        const int src = __ffs(past) - 1;
        b = i0 + src;
        seq_pair0 = __shfl_sync(0xffffffffu, upto - n, src);
        break;
      }
      carry = __shfl_sync(0xffffffffu, upto, 31);
    }
  }
  int split = piece, seq_len = 0, start = 0, end = 0, n_tiles = 0, n_pairs = 0, end0 = 0, end1 = 0;
  bool final_seg = final_out;
  const int* bt_row = block_table;
  int pbase = 0;  // pairs run in earlier segments: each mbarrier completes one phase a pair
  // ---- segment b's tokens: whole tiles of 64, taken in pairs; where rows row0 and row0 + 8
  // stop seeing tokens in it: its end, or with several new tokens, row R's causal limit
  // seq_len - (s_q - 1 - R / h) if that comes first (at or before the tile's start: the row sees
  // none of it). Rows past s_q·h (zeros in q, never written) get a limit past seq_len, so the end.
  auto begin_segment = [&]() {
    seq_len = seq_lens[b];
    bt_row = block_table + b * sbb;
    if (num_pieces > 0) {
      const int n = pairs_of(b), first = seq_pair0 / per;
      const int pieces_of_seq = (seq_pair0 + n - 1) / per - first + 1;
      final_seg = pieces_of_seq == 1;
      start = 2 * (max(lo, seq_pair0) - seq_pair0) * kN;
      end = max(min(2 * (min(hi, seq_pair0 + n) - seq_pair0) * kN, seq_len), start);
      if (first == piece && blockIdx.x == 0 && tid == 0) {
        ranges[2 * b] = static_cast<int>(b) + first;
        ranges[2 * b + 1] = pieces_of_seq;
      }
    } else {
      const SplitTokens span = split_tokens(seq_len, split, num_splits, kN);
      start = span.start;
      end = span.end;
    }
    n_tiles = (end - start + kN - 1) / kN;
    n_pairs = (n_tiles + 1) / 2;
    end0 = end;
    end1 = end;
    if constexpr (MultiToken) {
      end0 = min(end, seq_len - (q_tokens - 1 - (h0 + row0) / heads));
      end1 = min(end, seq_len - (q_tokens - 1 - (h0 + row0 + 8) / heads));
    }
  };
  // the next sequence of the piece, if its pairs reach past this one's
  auto next_segment = [&]() {
    if (num_pieces == 0 || seq_pair0 + pairs_of(b) >= hi) return false;
    seq_pair0 += pairs_of(b);
    ++b;
    return true;
  };
  float e4m3_scale = 1.f;  // fp8_e4m3: the cache's one scale, on the scores and the output
  if constexpr (F == CacheFormat::kFp8E4M3) e4m3_scale = *kv_scale;
  const float base_scale_log2 = scale_log2 * e4m3_scale;  // each segment's q brings its own factor
  scale_log2 = base_scale_log2;

  // ---- blocks [J0, J1) of tile t -> buffer buf, by this warpgroup, completing the group's
  // mbarrier once they land. A cache in T: one thread has the TMA unit copy the group's 64 rows
  // of the page (the swizzle done in hardware, nothing for the other threads to issue). A
  // split's last tile comes the same way; once it lands, scores clears its rows past the end (a
  // page's unused rows may hold anything, NaN included, and P . V must not read them). No tile
  // (t >= n_tiles): a bare arrival, and scores clears every row. An fp8 cache, every tile: its
  // stored bytes are asked for here (TMA copies completing raw_bar, or a bare arrival there for
  // no tile, so its phases keep in step with bar's), and the group's mbarrier completes only in
  // finish_blocks, once they are converted (finish_fp8_blocks).
  auto load_blocks = [&](int buf, int t, auto J0, auto J1) {
    const int tok0 = start + t * kN;  // a tile lies in one page (page_size % 64 == 0)
    const int valid = end - tok0;
    constexpr int j0 = decltype(J0)::value, j1 = decltype(J1)::value;
    static_assert((j0 == 0 && j1 == kLoBlocks) || (j0 == kLoBlocks && j1 == kBlocks), "a block group");
    if constexpr (F != CacheFormat::kAuto) {  // every row of the tile's page is copied: rows at
      // and past `valid` are read and become zeros
      if (wtid == 0) {
        const uint32_t group = kv_s + buf * kMatBytes + j0 * kBlockBytes;
        if (valid <= 0) {
          mbar_arrive(raw_bar(buf, j0));
        } else if constexpr (F == CacheFormat::kFp8E4M3) {  // the group's blocks, rope block 8 included
          const int page = bt_row[tok0 / page_size], row = tok0 % page_size;
          mbar_expect_tx(raw_bar(buf, j0), (j1 - j0) * 4096);
          tma_load(group + (j1 - j0) * 4096, j0 == 0 ? &kv_map_lo : &kv_map_hi, row, j0, page, raw_bar(buf, j0));
        } else {  // fp8_ds_mla: four latent blocks, the scales, the second group the rope block
          const int page = bt_row[tok0 / page_size], row = tok0 % page_size;
          mbar_expect_tx(raw_bar(buf, j0), kLoBlocks * 4096 + kN * 16 + (j0 == 0 ? 0 : kBlockBytes));
          tma_load(group + kLoBlocks * 4096, &kv_map_lo, row, j0, page, raw_bar(buf, j0));
          tma_load(group, &kv_map_x, row, 0, page, raw_bar(buf, j0));
          if (j0 != 0) tma_load(group + kLoBlocks * kBlockBytes, &kv_map_hi, row, 0, page, raw_bar(buf, j0));
        }
      }
    } else {
      // the page's 64 rows from the tile's first, a split's last tile too (its rows past the end
      // are cleared once landed: scores); a tile past the end copies nothing, its phase completes
      // on the arrival alone
      if (wtid == 0) {
        if (valid > 0) {
          const int page = bt_row[tok0 / page_size], row = tok0 % page_size;
          mbar_expect_tx(bar(buf, j0), (j1 - j0) * kBlockBytes);
          tma_load(kv_s + buf * kMatBytes + j0 * kBlockBytes, j0 == 0 ? &kv_map_lo : &kv_map_hi, row, j0, page,
                   bar(buf, j0));
        } else {
          mbar_arrive(bar(buf, j0));
        }
      }
    }
  };
  // ---- an fp8 cache: the group load_blocks(buf, t, J0, ...) asked for, landed -> the products'
  // dtype -> its mbarrier (finish_fp8_blocks). A cache in T: nothing (its copies complete the
  // mbarrier themselves).
  // fp8_ds_mla: each tile's F lands in tile_f[buf], in both warpgroups (each finishes a group of
  // every tile, and finds the same F), after the pair that last used the buffer's F read it
  int tile_f[2] = {kNoRows, kNoRows};
  int g_run = kNoRows;  // G: the largest F so far; O holds P . V / 2^G
  auto finish_blocks = [&](int buf, int t, auto J0) {
    if constexpr (F != CacheFormat::kAuto) {
      constexpr int j0 = decltype(J0)::value;
      const int f = finish_fp8_blocks<MT, F, j0>(smem + (1 + buf) * kMatBytes + j0 * kBlockBytes,
                                                   end - (start + t * kN), wtid, wg, raw_bar(buf, j0), (pbase + (t >> 1)) & 1,
                                                   bar(buf, j0), l_s + kM);
      if (buf == 0) tile_f[0] = f; else tile_f[1] = f;
    }
  };
  // ---- a cache in T: rows [max(valid, 0), 64) of the nb blocks from j0 of buffer buf -> zeros, by
  // the warpgroup (its tile's S reads the group first; the other warpgroup's P . V reads it after
  // the P hand-over). A split's last tile came as its page's rows, whose unused ones may hold NaN
  // (P is 0 there, and 0 x NaN is NaN); a tile past the end came as nothing. V's blocks (0-7)
  // only: the rope block's scores there are masked by a select, and buffer 0's holds P_A. A row
  // is 128 contiguous bytes of its block (the swizzle moves 16-byte chunks within the row): a
  // thread clears chunks wtid + 128 k (k < 4) of each block, rows wtid / 8 + 16 k, unrolled.
  auto clear_rows = [&](int buf, int valid, int j0, int nb) {
    uint4* group = reinterpret_cast<uint4*>(smem + (1 + buf) * kMatBytes + j0 * kBlockBytes);
#pragma unroll
    for (int j = 0; j < nb; ++j) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if ((wtid >> 3) + 16 * k >= valid) {
          group[j * (kBlockBytes / 16) + wtid + 128 * k] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
    fence_async_shared();
    sync_warpgroup(wg);  // every row cleared before any thread's MMA reads the group
  };
  // ---- S (+)= q . K^T over blocks [J0, J1) of buffer buf (4 k-steps of 16 each), each block
  // group once its mbarrier completes phase `parity`; one commit group. Fresh: S = the first
  // k-step's product (the call a tile's S starts with), else S +=. Unrolled, so each descriptor is
  // a base plus a constant (addresses < 256 KiB: the 14-bit address field does not carry).
  auto scores = [&](float (&s)[32], int buf, int t, int parity, auto J0, auto J1, auto Fresh) {
    constexpr int j0 = decltype(J0)::value;
    const uint64_t q_desc = desc_k(q_s), k_desc = desc_k(kv_s + buf * kMatBytes);
    wgmma_fence();
#pragma unroll
    for (int j = j0; j < decltype(J1)::value; ++j) {
      if (j == 0 || j == kLoBlocks) {  // a group's first block
        mbar_wait(bar(buf, j), parity);
        if constexpr (F == CacheFormat::kAuto) {
          const int valid = end - (start + t * kN);  // the tile's rows before the end (<= 0: none)
          if (valid < kN) clear_rows(buf, valid, j, kLoBlocks);  // V's blocks of the group
        }
        fence_async_shared();  // the landed copies (and cleared rows), visible to wgmma
      }
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const uint32_t off = (j * kBlockBytes + ks * 32) >> 4;
        if (j == kBlocks - 1) {
          mma_s<RT>(s, q_desc + off, k_desc + off, !(decltype(Fresh)::value && j == j0 && ks == 0));
        } else {
          mma_s<MT>(s, q_desc + off, k_desc + off, !(decltype(Fresh)::value && j == j0 && ks == 0));
        }
      }
    }
    wgmma_commit();
  };
  // ---- the row maxima of scale * S (log2 units) for rows row0, row0 + 8 of the tile starting at
  // token tok0, tokens at or past each row's end (end0, end1) masked to -inf (in a tile that
  // holds one only: with one new token, a partial tile). With a positive scale (the rule) S stays
  // unscaled: the max is taken first and exponentiate folds the scale into one FFMA a score.
  const bool prescale = !(scale_log2 > 0.f);  // a softmax scale <= 0: scale S first
  float exp_mult = prescale ? 1.f : scale_log2;  // (bf16 q in fp16 products: set again below)
  auto row_max = [&](float (&s)[32], int tok0, float& mx0, float& mx1) {
    if (prescale) {
#pragma unroll
      for (int i = 0; i < 32; ++i) s[i] *= scale_log2;
    }
    const int valid0 = end0 - tok0, valid1 = end1 - tok0;  // the same with one new token
    if (min(valid0, valid1) < kN) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool ok0 = 8 * j + 2 * c + e < valid0, ok1 = 8 * j + 2 * c + e < valid1;
          s[4 * j + e] = ok0 ? s[4 * j + e] : -INFINITY;
          s[4 * j + 2 + e] = ok1 ? s[4 * j + 2 + e] : -INFINITY;
        }
      }
    }
    mx0 = -INFINITY;
    mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
      mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {  // the 4 lanes of a row
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
    }
    if (!prescale) {
      mx0 *= scale_log2;
      mx1 *= scale_log2;
    }
  };
  // ---- fp8_ds_mla: S of a tile whose values came in over 2^F, times 2^F (exact; skipped, uniformly
  // over the warpgroup, for F = 0 and for a tile of no valid row, whose S is masked)
  auto undo_tile_power = [&](float (&s)[32], int fe) {
    if (fe == 0 || fe == kNoRows) return;
    const float f = pow2(fe);
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] *= f;
  };
  // ---- P = exp2(scale * S - m) in place; returns this thread's share of the row sums
  auto exponentiate = [&](float (&s)[32], float m0, float m1, float& sum0, float& sum1) {
    sum0 = 0.f;
    sum1 = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[4 * j + e] = exp2_ftz(fmaf(s[4 * j + e], exp_mult, -m0));
        s[4 * j + 2 + e] = exp2_ftz(fmaf(s[4 * j + 2 + e], exp_mult, -m1));
        sum0 += s[4 * j + e];
        sum1 += s[4 * j + 2 + e];
      }
    }
  };
  // ---- several new tokens: a row whose new max is still -inf has seen no token (of this split,
  // so far): factor 1 (its O and l are 0) and exponents against 0 (its P is exp2(-inf) = 0),
  // instead of exp2(-inf - -inf) = NaN in both
  auto no_token_yet = [](float m0, float m1, float& f0, float& f1, float& ref0, float& ref1) {
    if (m0 == -INFINITY) {
      f0 = 1.f;
      ref0 = 0.f;
    }
    if (m1 == -INFINITY) {
      f1 = 1.f;
      ref1 = 0.f;
    }
  };
  // ---- P * (f0 for row0, f1 for row0 + 8) as wgmma A fragments: the accumulator of two 8-token
  // column groups is one fragment of 16 tokens
  auto fragments = [&](const float (&p)[32], float f0, float f1, uint32_t (&pf)[4][4]) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      pf[ks][0] = pack(p[8 * ks + 0] * f0, p[8 * ks + 1] * f0, MT{});  // row0,     tokens 16ks + 2c
      pf[ks][1] = pack(p[8 * ks + 2] * f1, p[8 * ks + 3] * f1, MT{});  // row0 + 8, tokens 16ks + 2c
      pf[ks][2] = pack(p[8 * ks + 4] * f0, p[8 * ks + 5] * f0, MT{});  // row0,     tokens 16ks + 8 + 2c
      pf[ks][3] = pack(p[8 * ks + 6] * f1, p[8 * ks + 7] * f1, MT{});  // row0 + 8, tokens 16ks + 8 + 2c
    }
  };
  // ---- P * (f0 for row0, f1 for row0 + 8) -> a swizzled (64 heads, 64 tokens) block (vector j
  // of row r: tokens 8j ..), packed a pair at a time: the fragments' registers stay an MMA's operand
  auto store_p_scaled = [&](unsigned char* dst, const float (&p)[32], float f0, float f1) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // tokens 8j + 2c (+1)
      *reinterpret_cast<uint32_t*>(dst + swizzled(row0, j) + 4 * c) = pack(p[4 * j] * f0, p[4 * j + 1] * f0, MT{});
      *reinterpret_cast<uint32_t*>(dst + swizzled(row0 + 8, j) + 4 * c) =
          pack(p[4 * j + 2] * f1, p[4 * j + 3] * f1, MT{});
    }
  };
  // ---- the fragments -> a swizzled (64 heads, 64 tokens) block (vector j of row r: tokens 8j ..)
  auto store_p = [&](unsigned char* dst, const uint32_t (&pf)[4][4]) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * ks + half;
        *reinterpret_cast<uint32_t*>(dst + swizzled(row0, j) + 4 * c) = pf[ks][2 * half];
        *reinterpret_cast<uint32_t*>(dst + swizzled(row0 + 8, j) + 4 * c) = pf[ks][2 * half + 1];
      }
    }
  };
  // ---- rows row0, row0 + 8: the new running max, and the factor the other warpgroup rescales
  // by, to shared memory (one lane a row, once all four lanes have read the old max)
  auto publish_max = [&](float m0, float m1, float* factor_s, float f0, float f1) {
    __syncwarp();
    if (c == 0) {
      m_s[row0] = m0;
      m_s[row0 + 8] = m1;
      factor_s[row0] = f0;
      factor_s[row0 + 8] = f1;
    }
  };
  // O's rows times f0 / f1, skipped when no row of this warp changed its max (f = 1): after the
  // first tiles the running max rarely moves
  auto rescale = [&](float (&o)[128], float f0, float f1) {
    if (!__any_sync(0xffffffffu, f0 != 1.f || f1 != 1.f)) return;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o[4 * j + 0] *= f0;
      o[4 * j + 1] *= f0;
      o[4 * j + 2] *= f1;
      o[4 * j + 3] *= f1;
    }
  };
  // V's 16-token k-step ks of buffer buf, this warpgroup's 256 dims (blocks 4 wg .. 4 wg + 3)
  auto v_desc = [&](int buf, int ks) { return desc_n(kv_s + buf * kMatBytes + 4 * wg * kBlockBytes + ks * 16 * 128); };

  // block ranges, as types (the loops over them unroll)
  const std::integral_constant<int, 0> kZero;
  const std::integral_constant<int, kLoBlocks> kLo;
  const std::integral_constant<int, kBlocks> kAll;
  // whether a scores call starts a tile's S (S =) or adds to it (S +=)
  const std::integral_constant<bool, true> kFresh;
  const std::integral_constant<bool, false> kAddTo;

  // ---- set-up: the mbarriers, once; then each segment: m = -inf, q (all threads) and its first
  // two tiles
  if (tid == 0) {
    for (int i = 0; i < 8; ++i) mbar_init(bars + 8 * i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // inits before any TMA completes on them
  }
  for (;;) {
    begin_segment();
    scale_log2 = base_scale_log2;  // q's factor (fp8 caches) is the segment's own
    exp_mult = prescale ? 1.f : scale_log2;
    tile_f[0] = tile_f[1] = kNoRows;
    g_run = kNoRows;
    if (tid < kM) m_s[tid] = -INFINITY;
    __syncthreads();  // (after a segment: its output's reads of shared memory done before q lands there)
    if (n_tiles > 0) {  // an empty split reads nothing: it writes zeros and -inf below
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        const int i = tid + k * kThreads;
        const int r = i / kVecs, v = i - r * kVecs;
        const bool ok = r < num_rows - h0;
        cp_async16(q_s + swizzled(r, v), ok ? q + b * sqb + (h0 + r) * sqh + v * 8 : q, ok);
      }
      cp_async_commit();
      // each warpgroup its block group of tiles 0 and 1; an fp8 cache's two groups in flight
      // together (and with q's), then finished in the order issued
      if (wg == 0) {
        load_blocks(0, 0, kZero, kLo);
        load_blocks(1, 1, kZero, kLo);
        finish_blocks(0, 0, kZero);
        finish_blocks(1, 1, kZero);
      } else {
        load_blocks(0, 0, kLo, kAll);
        load_blocks(1, 1, kLo, kAll);
        finish_blocks(0, 0, kLo);
        finish_blocks(1, 1, kLo);
      }
      // q landed (a cache in T: the tiles' copies are in no group; fp8: landed, finished above) ...
      cp_async_wait_all();
      if constexpr (!std::is_same_v<MT, T> || !std::is_same_v<RT, T>) {
        // ... q -> its products' dtypes times q_scale in place (the latent blocks MT, the rope block
        // RT), each thread its own 16-byte chunks (the swizzle moves whole chunks): the CTA's
        // largest |q| first (l_s is free until the end; fp8_ds_mla's finishes use l_s[kM ..]) ...
        __syncthreads();
        float top = 0.f;
        for (int i = tid; i < kMatBytes / 16; i += kThreads) {
          const uint4 v = *reinterpret_cast<const uint4*>(smem + 16 * i);
          for (const uint32_t w : {v.x, v.y, v.z, v.w}) {
            const float2 x = pair_to_float2(w, T{});
            top = fmaxf(top, fmaxf(fabsf(x.x), fabsf(x.y)));
          }
        }
#pragma unroll
        for (int x = 16; x > 0; x >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, x));
        if (lane == 0) l_s[tid >> 5] = top;
        __syncthreads();
#pragma unroll
        for (int w = 0; w < kThreads / 32; ++w) top = fmaxf(top, l_s[w]);
        const float q_scale = fp16_range_scale(top);
        for (int i = tid; i < kMatBytes / 16; i += kThreads) {
          uint4* chunk = reinterpret_cast<uint4*>(smem + 16 * i);
          const bool rope = 16 * i >= (kBlocks - 1) * kBlockBytes;  // block 8
          uint4 v = *chunk;
          for (uint32_t* w : {&v.x, &v.y, &v.z, &v.w}) {
            const float2 x = pair_to_float2(*w, T{});
            *w = rope ? pack(x.x * q_scale, x.y * q_scale, RT{}) : pack(x.x * q_scale, x.y * q_scale, MT{});
          }
          *chunk = v;
        }
        scale_log2 /= q_scale;  // the scores come out q_scale times too large (exact: a power of two)
        if (!prescale) exp_mult = scale_log2;
      }
      fence_async_shared();  // ... visible to wgmma ...
    }
    __syncthreads();         // ... everyone's

    float o[128];  // O[:, 256 wg : 256 wg + 256]: o[4j + {0,1}] row row0, cols 8j + 2c + {0,1}; {2,3} row row0 + 8
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float l0 = 0.f, l1 = 0.f;  // this thread's share of its warpgroup's row sums, relative to m_s
    float s[32];  // S of this warpgroup's tile: s[4j + {0,1}] row row0, tokens 8j + 2c + {0,1}; {2,3} row row0 + 8
    uint32_t pf[4][4];  // P as wgmma A fragments, one k-step of 16 tokens each

    if (n_tiles > 0) {
      scores(s, wg, wg, pbase & 1, kZero, kAll, kFresh);  // S_A (warpgroup 0, buffer 0), S_B (warpgroup 1, buffer 1)
      wgmma_wait<0>();
      pin(s);
    }
    // An fp8 cache's four block groups a pair, each issued once every wgmma that reads its blocks
    // has completed in both warpgroups (what a TMA copy waits for) and finished where its copies
    // have had time to land, before its first reader's mbarrier wait. What waits for what: the
    // next S_A (warpgroup 0) waits on buffer 0's groups, blocks 4-8 from warpgroup 1; the next S_B
    // (warpgroup 1) on buffer 1's, blocks 0-3 from warpgroup 0, which finishes them after its own
    // wait on buffer 0's blocks 4-8; warpgroup 1's softmax waits for m_A, from S_A (kBarScaleA).
    // So S_A's inputs are the critical path: warpgroup 1 finishes buffer 0's group before its own.
    for (int p = 0; p < n_pairs; ++p) {
      const int tile_a = 2 * p;
      // fp8_ds_mla: G moves up to the pair's largest F; O takes 2^(G_before - G) with the pair's
      // first rescale, and P_A, P_B go out times 2^(F_A - G), 2^(F_B - G) (else: all 1)
      float o_shift = 1.f, pa_f = 1.f, pb_f = 1.f;
      if constexpr (kDsMla) {
        const int g_new = max(g_run, max(tile_f[0], tile_f[1]));
        o_shift = pow2(g_run - g_new);  // 0 on the first pair: O is 0 then
        pa_f = pow2(tile_f[0] - g_new);
        pb_f = pow2(tile_f[1] - g_new);
        g_run = g_new;
      }
      const bool more = tile_a + 2 < n_tiles;  // a next pair: its tiles load into these buffers
      const int next_parity = (pbase + p + 1) & 1;
      if (wg == 0) {
        // -- m_A = max(m, rowmax S_A); P_A = exp2(S_A - m_A); O_L, l rescaled to m_A
        float mx0, mx1, sum0, sum1;
        if constexpr (kDsMla) undo_tile_power(s, tile_f[0]);  // A's 2^F back into S_A
        row_max(s, start + tile_a * kN, mx0, mx1);
        const float old0 = m_s[row0], old1 = m_s[row0 + 8];
        // finite with one new token (A has a real token); -inf for a row that has seen none yet
        const float new0 = fmaxf(old0, mx0), new1 = fmaxf(old1, mx1);
        float sa0 = exp2_ftz(old0 - new0), sa1 = exp2_ftz(old1 - new1);  // 0 on the first tile
        float ref0 = new0, ref1 = new1;  // what the exponents are taken against
        if constexpr (MultiToken) no_token_yet(new0, new1, sa0, sa1, ref0, ref1);
        publish_max(new0, new1, scale_a_s, sa0, sa1);
        bar_arrive(kBarScaleA);
        exponentiate(s, ref0, ref1, sum0, sum1);
        l0 = l0 * sa0 + sum0;
        l1 = l1 * sa1 + sum1;
        rescale(o, sa0 * o_shift, sa1 * o_shift);
        // -- O_L += P_A . V_A[:, :256]
        fragments(s, pa_f, pa_f, pf);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) mma_o_reg<MT>(o, pf[ks], v_desc(0, ks));
        wgmma_commit();
        // -- P_A relative to m_B -> buffer 0's rope block, for warpgroup 1, while that MMA runs
        // (packed from S: the fragments stay its operand)
        bar_sync(kBarScaleB);
        const float sb0 = scale_b_s[row0], sb1 = scale_b_s[row0 + 8];
        store_p_scaled(pa_ptr, s, sb0 * pa_f, sb1 * pa_f);
        fence_async_shared();
        bar_arrive(kBarPA);
        wgmma_wait<0>();
        pin(o);
        pin(pf);
        // buffer 0's blocks 0-3 are done with (S_A, and V_A's left half): the next A's
        if (more) load_blocks(0, tile_a + 2, kZero, kLo);
        // -- O_L = O_L * exp2(m_A - m_B) + P_B . V_B[:, :256], P_B from warpgroup 1 (V_B's blocks
        // landed before warpgroup 1's S_B waited on them and fenced, which precedes its arrive)
        bar_sync(kBarPB);
        rescale(o, sb0, sb1);
        l0 *= sb0;
        l1 *= sb1;
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) mma_o_smem<MT>(o, desc_k(pb_s + ks * 32), v_desc(1, ks));
        wgmma_commit();
        if (more) {
          // fp8: the next A's blocks 0-3 converted while P_B . V_B runs (it reads P_B and buffer 1)
          finish_blocks(0, tile_a + 2, kZero);
          // -- S of the next A: blocks 0-3 (loaded first), then buffer 1's blocks 0-3 are free
          // (V_B's left half) for the next B, then blocks 4-8 (loaded by warpgroup 1)
          scores(s, 0, tile_a + 2, next_parity, kZero, kLo, kFresh);
          wgmma_wait<1>();
          load_blocks(1, tile_a + 3, kZero, kLo);
          scores(s, 0, tile_a + 2, next_parity, kLo, kAll, kAddTo);
          // fp8: the next B's blocks 0-3 converted while those scores run (buffer 0 and q)
          finish_blocks(1, tile_a + 3, kZero);
        }
        wgmma_wait<0>();
        pin(o);
        pin(s);
      } else {
        // -- m_B = max(m_A, rowmax S_B); P_B = exp2(S_B - m_B); O_R, l rescaled from m to m_B
        float mx0, mx1, sum0, sum1;
        if constexpr (kDsMla) undo_tile_power(s, tile_f[1]);  // B's 2^F back into S_B
        row_max(s, start + (tile_a + 1) * kN, mx0, mx1);  // no tile B: all -inf
        bar_sync(kBarScaleA);
        const float ma0 = m_s[row0], ma1 = m_s[row0 + 8];
        const float new0 = fmaxf(ma0, mx0), new1 = fmaxf(ma1, mx1);
        float sb0 = exp2_ftz(ma0 - new0), sb1 = exp2_ftz(ma1 - new1);
        float ref0 = new0, ref1 = new1;
        if constexpr (MultiToken) no_token_yet(new0, new1, sb0, sb1, ref0, ref1);
        const float f0 = scale_a_s[row0] * sb0, f1 = scale_a_s[row0 + 8] * sb1;
        publish_max(new0, new1, scale_b_s, sb0, sb1);
        bar_arrive(kBarScaleB);
        exponentiate(s, ref0, ref1, sum0, sum1);
        l0 = l0 * f0 + sum0;
        l1 = l1 * f1 + sum1;
        rescale(o, f0 * o_shift, f1 * o_shift);
        // -- P_B -> shared memory for warpgroup 0
        fragments(s, pb_f, pb_f, pf);
        store_p(pb_ptr, pf);
        fence_async_shared();
        bar_arrive(kBarPB);
        // -- O_R += P_A . V_A[:, 256:], P_A from warpgroup 0 (relative to m_B; V_A's blocks landed
        // before warpgroup 0's S_A waited on them, as above); then O_R += P_B . V_B[:, 256:]. Buffer
        // 0's last reader goes first: the next A, whose S comes first, is refilled sooner
        bar_sync(kBarPA);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) mma_o_smem<MT>(o, desc_k(pa_s + ks * 32), v_desc(0, ks));
        wgmma_commit();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) mma_o_reg<MT>(o, pf[ks], v_desc(1, ks));
        wgmma_commit();
        // buffer 0's blocks 4-8 are done with (V_A's right half, P_A): the next A's; then buffer
        // 1's (S_B, V_B's right half): the next B's
        wgmma_wait<1>();
        if (more) load_blocks(0, tile_a + 2, kLo, kAll);
        wgmma_wait<0>();
        pin(o);
        pin(pf);
        if (more) {
          load_blocks(1, tile_a + 3, kLo, kAll);
          // fp8: the next A's group first (warpgroup 0's next S waits on it; the next B's may still
          // be in flight), then the next B's, which only this warpgroup reads
          finish_blocks(0, tile_a + 2, kLo);
          finish_blocks(1, tile_a + 3, kLo);
          // -- S of the next B: blocks 4-8 (refilled first, by this warpgroup), then 0-3 (by
          // warpgroup 0, once its P_B . V_B is done and the next A's blocks 0-3 have landed)
          scores(s, 1, tile_a + 3, next_parity, kLo, kAll, kFresh);
          scores(s, 1, tile_a + 3, next_parity, kZero, kLo, kAddTo);
          wgmma_wait<0>();
          pin(s);
        }
      }
    }

    // ---- normalise and write; an empty split (l = 0) writes zeros and lse = -inf. O goes out
    // through shared memory (q's and buffer 0's bytes, free now): written straight from the
    // accumulators, a warp's store covers 8 rows of 32 or 16 bytes each, half of each 32-byte
    // sector in T; from shared memory it covers 256 or 128 bytes of one row, whole sectors.
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, x);
      l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
    if (c == 0) {
      l_s[wg * kM + row0] = l0;
      l_s[wg * kM + row0 + 8] = l1;
    }
    __syncthreads();
    // a row of 512 values: fp32 partials, 8 bytes a thread (256 threads a row), or the answer in T,
    // 4 bytes a thread (the op allows rows 8- and 4-byte aligned); rows padded by 32 and 16 bytes, so
    // the accumulators' 8 rows a store fall in different banks
    const int pitch = final_seg ? 2 * kC + 16 : 4 * kC + 32;
    const float o_scale = kDsMla && g_run != kNoRows ? pow2(g_run) : 1.f;  // fp8_ds_mla: O is P . V / 2^G
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + 8 * half, h = h0 + r;
      const float l = l_s[r] + l_s[kM + r];
      const float inv = l > 0.f ? e4m3_scale * o_scale / l : 0.f;
      if (wg == 0 && c == 0 && h < num_rows) {
        const float row_lse = l > 0.f ? (m_s[r] + log2f(l)) * 0.6931471805599453f : -INFINITY;
        if (final_seg) {
          lse[b * sgb + h * sgh] = row_lse;
        } else {
          part_lse[b * slb + h * slh + split * sls] = row_lse;
        }
      }
      unsigned char* row = smem + r * pitch;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int col = 256 * wg + 8 * j + 2 * c;
        const float x = o[4 * j + 2 * half] * inv, y = o[4 * j + 2 * half + 1] * inv;
        if (final_seg) {
          *reinterpret_cast<uint32_t*>(row + 2 * col) = pack(x, y, T{});
        } else {
          *reinterpret_cast<float2*>(row + 4 * col) = make_float2(x, y);
        }
      }
    }
    __syncthreads();
    const int n_rows = min(kM, num_rows - h0);
    if (final_seg) {
      T* at = static_cast<T*>(out) + b * sfb + int64_t(h0) * sfh;
#pragma unroll 8
      for (int r = 0; r < n_rows; ++r) {
        const uint32_t v = *reinterpret_cast<const uint32_t*>(smem + r * pitch + 4 * tid);
        *reinterpret_cast<uint32_t*>(at + r * sfh + 2 * tid) = v;
      }
    } else {
      float* at = part_out + b * sob + int64_t(split) * sos + int64_t(h0) * soh;
#pragma unroll 8
      for (int r = 0; r < n_rows; ++r) {
        const float2 v = *reinterpret_cast<const float2*>(smem + r * pitch + 8 * tid);
        *reinterpret_cast<float2*>(at + r * soh + 2 * tid) = v;
      }
    }
    // ---- on to the piece's next segment, if any
    pbase += n_pairs;
    if (!next_segment()) break;
    fence_async_shared();  // the output's shared-memory accesses before the next tiles' copies
  }
#else
  __trap();  // built without sm_90a: the host's capability check should have stopped the launch
#endif  // MLA_SM90A
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Host side: the check (binding.cpp), the cache's tensor map, then the launch on the current stream

namespace {

// One view of the cache for the TMA unit: a 4-D tensor of (`inner` elements of `type` from byte
// `offset` of a row, page_size rows, `blocks` column blocks 64 elements apart, pages), copied in
// boxes of inner x 64 rows x `box_blocks` blocks, which land one block after another: 128-byte
// swizzled (the kernel's layout of a block in q's dtype) or densely (`swizzle` false, an fp8
// cache's stored bytes). A cache in T: (64 dims, page_size, 9 blocks, pages), boxes of blocks 0-3
// and 4-8; the blocks overlap no row (block k starts 128 bytes after block k - 1). binding.cpp's
// check has made the strides multiples of 16 bytes and the base 16-byte aligned, as the map needs
// (offset, 512 or 528, keeps it so).
CUtensorMap kv_tensor_map(const at::Tensor& kv_cache, int64_t offset, int inner, CUtensorMapDataType type,
                          int blocks, int box_blocks, bool swizzle) {
  if (kv_cache.size(0) == 0) return CUtensorMap{};  // no pages: every sequence is empty, no tile is read
  using Encode = decltype(&cuTensorMapEncodeTiled);
  static const Encode encode = [] {  // the driver's entry point, through the runtime (no -lcuda)
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
#else
    C10_CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found));
#endif
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                "mla_decode_sm90: the CUDA driver has no cuTensorMapEncodeTiled (needs CUDA 12)");
    return reinterpret_cast<Encode>(fn);
  }();
  TORCH_CHECK(type == CU_TENSOR_MAP_DATA_TYPE_UINT8 || type == CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 ||
                  type == CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
              "mla_decode_sm90: a tensor map of bytes, bf16 or fp16");
  const auto item = static_cast<cuuint64_t>(type == CU_TENSOR_MAP_DATA_TYPE_UINT8 ? 1 : 2);
  const auto row_bytes = static_cast<cuuint64_t>(kv_cache.stride(1) * kv_cache.element_size());
  const cuuint64_t size[4] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(kv_cache.size(1)),
                              static_cast<cuuint64_t>(blocks), static_cast<cuuint64_t>(kv_cache.size(0))};
  // rows, blocks, pages
  const cuuint64_t stride[3] = {row_bytes, 64 * item, static_cast<cuuint64_t>(kv_cache.stride(0) * kv_cache.element_size())};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(inner), kN, static_cast<cuuint32_t>(box_blocks), 1};
  const cuuint32_t step[4] = {1, 1, 1, 1};
  CUtensorMap map;
  const CUresult status = encode(
      &map, type, 4, static_cast<char*>(kv_cache.data_ptr()) + offset, size, stride, box, step,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(status == CUDA_SUCCESS, "mla_decode_sm90: kv_cache ", dims(kv_cache), " with strides (",
              num(kv_cache.stride(0)), ", ", num(kv_cache.stride(1)),
              ") cannot be described to the TMA unit (cuTensorMapEncodeTiled error ", num(int64_t{status}), ")");
  return map;
}

}  // namespace

void mla_decode_sm90(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, at::Tensor& part_out, at::Tensor& part_lse,
                     double softmax_scale, int64_t num_splits, const std::string& kv_cache_dtype,
                     const std::optional<at::Tensor>& kv_scale, int64_t q_tokens,
                     const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& lse,
                     const std::optional<at::Tensor>& ranges) {
  const bool dealt = ranges.has_value();
  const CacheFormat format =
      check_mla_decode(q, kv_cache, block_table, seq_lens, part_out, part_lse, num_splits,
                       {"mla_decode_sm90", kMaxHeads, kC, kR, kN}, kv_cache_dtype, kv_scale, q_tokens, dealt);
  const int64_t b = q.size(0), h = q.size(1);  // h: query rows a sequence, s_q·heads
  TORCH_CHECK(out.has_value() == dealt && lse.has_value() == dealt,
              "mla_decode_sm90: out and lse are given with ranges (dealt pieces) and only then");
  if (dealt) {
    TORCH_CHECK(out->scalar_type() == q.scalar_type() && out->dim() == 3 && out->size(0) == b && out->size(1) == h &&
                    out->size(2) == kC && out->stride(2) == 1 && out->stride(0) % 2 == 0 && out->stride(1) % 2 == 0 &&
                    reinterpret_cast<uintptr_t>(out->data_ptr()) % 4 == 0 && out->device() == q.device(),
                "mla_decode_sm90: out must be (b, h, ", num(int64_t{kC}), ") = (", num(b), ", ", num(h), ", ", num(int64_t{kC}),
                ") in q's dtype on q's device, 4-byte aligned, got ", dims(*out), " ", out->scalar_type());
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->dim() == 2 && lse->size(0) == b && lse->size(1) == h &&
                    lse->device() == q.device(),
                "mla_decode_sm90: lse must be (b, h) = (", num(b), ", ", num(h), ") float32 on q's device, got ",
                dims(*lse), " ", lse->scalar_type());
    TORCH_CHECK(ranges->scalar_type() == at::kInt && ranges->dim() == 2 && ranges->size(0) == b &&
                    ranges->size(1) == 2 && ranges->is_contiguous() && ranges->device() == q.device(),
                "mla_decode_sm90: ranges must be (b, 2) = (", num(b), ", 2) int32, contiguous, on q's device, got ",
                dims(*ranges), " ", ranges->scalar_type());
  }
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
  // the TMA unit's views of the cache (the kernel's kv_map_lo, kv_map_hi, kv_map_x)
  constexpr auto kU8 = CU_TENSOR_MAP_DATA_TYPE_UINT8, kBf16 = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  CUtensorMap kv_map_lo{}, kv_map_hi{}, kv_map_x{};
  if (format == CacheFormat::kAuto) {
    const auto type = kv_cache.scalar_type() == at::kBFloat16 ? kBf16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    kv_map_lo = kv_tensor_map(kv_cache, 0, 64, type, kBlocks, kLoBlocks, true);
    kv_map_hi = kv_tensor_map(kv_cache, 0, 64, type, kBlocks, kBlocks - kLoBlocks, true);
  } else if (format == CacheFormat::kFp8E4M3) {
    kv_map_lo = kv_tensor_map(kv_cache, 0, 64, kU8, kBlocks, kLoBlocks, false);
    kv_map_hi = kv_tensor_map(kv_cache, 0, 64, kU8, kBlocks, kBlocks - kLoBlocks, false);
  } else {  // fp8_ds_mla: the latent bytes, the bf16 rope values, the scales
    kv_map_lo = kv_tensor_map(kv_cache, 0, 64, kU8, kC / 64, kLoBlocks, false);
    kv_map_hi = kv_tensor_map(kv_cache, kDsMlaRope, kR, kBf16, 1, 1, true);
    kv_map_x = kv_tensor_map(kv_cache, kDsMlaScales, 16, kU8, 1, 1, false);
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>((h + kM - 1) / kM), static_cast<unsigned>(dealt ? 1 : b),
                  static_cast<unsigned>(num_splits));
  // where a sequence's answer goes when one piece holds it whole: out and lse (dealt), or at one
  // split part_out and part_lse themselves, in q's dtype
  const at::Tensor& out_t = dealt ? *out : part_out;
  const at::Tensor& lse_t = dealt ? *lse : part_lse;
  const bool final_out = !dealt && part_out.scalar_type() != at::kFloat;
  // dealt: slot b + piece, the kernel's b * sob + split * sos with sob = sos
  const int64_t sob = part_out.stride(0), soh = part_out.stride(1), sos = dealt ? sob : part_out.stride(2);
  const int64_t slb = part_lse.stride(0), slh = part_lse.stride(1), sls = dealt ? slb : part_lse.stride(2);
  const float scale_log2 = static_cast<float>(softmax_scale * 1.4426950408889634);
  const float* scale_ptr = format == CacheFormat::kFp8E4M3 ? kv_scale->data_ptr<float>() : nullptr;
  auto run = [&](auto* kernel, auto type_tag, auto format_tag) {  // format_tag: std::integral_constant
    using T = decltype(type_tag);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kSmemBytes)));
    kernel<<<grid, kThreads, kSmemBytes, stream>>>(
        reinterpret_cast<const T*>(q.data_ptr()), kv_map_lo,
        kv_map_hi, kv_map_x, block_table.data_ptr<int>(), seq_lens.data_ptr<int>(),
        static_cast<float*>(part_out.data_ptr()), part_lse.data_ptr<float>(), out_t.data_ptr(),
        lse_t.data_ptr<float>(), final_out, dealt ? ranges->data_ptr<int>() : nullptr,
        dealt ? static_cast<int>(num_splits) : 0, static_cast<int>(b), static_cast<int>(h),
        static_cast<int>(h / q_tokens), static_cast<int>(q_tokens), static_cast<int>(kv_cache.size(1)),
        static_cast<int>(num_splits), scale_log2, q.stride(0), q.stride(1), block_table.stride(0), sob, soh, sos,
        slb, slh, sls, out_t.stride(0), out_t.stride(1), lse_t.stride(0), lse_t.stride(1), scale_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  // several new tokens a sequence: the instantiation with per-row causal limits
  auto run_format = [&](auto format_tag) {
    constexpr CacheFormat F = decltype(format_tag)::value;
    if (q.scalar_type() == at::kBFloat16) {
      if (q_tokens > 1) {
        run(mla_decode_sm90_kernel<__nv_bfloat16, F, true>, __nv_bfloat16{}, format_tag);
      } else {
        run(mla_decode_sm90_kernel<__nv_bfloat16, F, false>, __nv_bfloat16{}, format_tag);
      }
    } else if (q_tokens > 1) {
      run(mla_decode_sm90_kernel<__half, F, true>, __half{}, format_tag);
    } else {
      run(mla_decode_sm90_kernel<__half, F, false>, __half{}, format_tag);
    }
  };
  switch (format) {
    case CacheFormat::kFp8E4M3:
      run_format(std::integral_constant<CacheFormat, CacheFormat::kFp8E4M3>{});
      break;
    case CacheFormat::kFp8DsMla:
      run_format(std::integral_constant<CacheFormat, CacheFormat::kFp8DsMla>{});
      break;
    default:
      run_format(std::integral_constant<CacheFormat, CacheFormat::kAuto>{});
  }
}

}  // namespace mla

TORCH_LIBRARY_IMPL(mla, CUDA, m) {
  m.impl("mla_decode_sm90", &mla::mla_decode_sm90);
}
