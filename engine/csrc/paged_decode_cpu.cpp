// Paged decode attention on the CPU: one query token per sequence, K/V read in place from the
// paged cache through the block table (no gather copy), fp32 accumulation, queries in any of
// fp32/bf16/fp16.
//
// Two cache kinds, one kernel (templated on the cache element S):
// - the model's dtype (S = T): kv_cache [num_blocks, 2, block_size, num_kv_heads, head_dim];
// - 8-bit (engine/kv_quant.py; S = int8_t or c10::Float8_e4m3fn): kv_cache [num_blocks,
//   block_bytes] uint8, each block its values [2, block_size, num_kv_heads, head_dim], float32
//   scales [2, num_kv_heads], then bf16 K references [num_kv_heads, head_dim]. K reads as
//   q * scale + ref, V as q * scale: K's scale multiplies a block's scores and q . ref is added to
//   them (one dot product per block and head), V's scale multiplies the softmax weights, so the
//   rows are widened and used as they are (one byte per value read, half of bf16's).
// query/out [num_seqs, num_heads, head_dim]; block_tables [num_seqs, width] int32; seq_lens
// [num_seqs] int32. GQA: query head h reads KV head h / (num_heads / num_kv_heads).
// Work is split over (sequence, KV heads) items, longest sequences first, on torch's own thread
// pool; an item computes all of its KV heads' query heads, so every K/V row is read once per step.
// The tiled kernel is written once over simd::F (simd_math.h): 16 lanes on AVX-512, 8 on AVX2.
//
// Variants (engine/attention/variant.py), in its order: scores (scale applied) are soft-capped
// (softcap * tanh(s / softcap); softcap 0 = none); a sliding window (window 0 = none) limits the
// query at position len - 1 to keys [max(0, len - window), len), and only the blocks and rows in
// that range are read; sinks (null = none, else fp32 [num_heads]) add exp(sink_h) to head h's
// softmax denominator.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include "parallel.h"
#include "row_ops.h"
#include "simd_math.h"

using row_ops::axpy;
using row_ops::dot;
using row_ops::exp_shifted;

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Fp8 = c10::Float8_e4m3fn;
template <typename S>
constexpr bool kQuant = std::is_same_v<S, int8_t> || std::is_same_v<S, Fp8>;
// Loads of S give value / kUnit (fp8 widens through fp16 bits, which divides by 256); the scales
// take the factor back.
template <typename S>
constexpr float kUnit = std::is_same_v<S, Fp8> ? 256.f : 1.f;

// Where things are in the cache, in elements of S (bytes for 8-bit).
struct Paged {
  int64_t block_size, num_kv_heads, token_stride, half_stride, block_stride;
  int64_t scale_offset;  // 8-bit: from a block's start to its float32 scales [2, num_kv_heads]
  int64_t ref_offset;    // 8-bit: from a block's start to its bf16 K references [num_kv_heads, head_dim]
};

// What a layer's attention computes beyond plain causal attention (see the header).
struct Variant {
  int64_t window = 0;            // keys in the last `window` positions only; 0: all
  float softcap = 0.f;           // 0: none
  const float* sinks = nullptr;  // [num_heads] fp32, indexed by query head; null: none

  // The first key position a query at position len - 1 sees.
  int64_t start(int64_t len) const { return window > 0 ? std::max<int64_t>(0, len - window) : 0; }
};

// Soft-cap then softmax (unnormalized: exp(s - max)) of one head's n scores, with the head's sink
// logit (if any) in the max and the denominator; returns the denominator.
inline float variant_softmax(float* scores, int64_t n, const Variant& var, int64_t head) {
  if (var.softcap > 0.f) row_ops::softcap(scores, n, var.softcap);
  return var.sinks ? exp_shifted(scores, n, var.sinks[head]) : exp_shifted(scores, n);
}

template <typename S>
inline const float* block_scales(const S* block, const Paged& p) {
  return reinterpret_cast<const float*>(block + p.scale_offset);
}

template <typename S>
inline const c10::BFloat16* block_refs(const S* block, const Paged& p) {
  return reinterpret_cast<const c10::BFloat16*>(block + p.ref_offset);
}

// Widen a row of `n` elements to fp32 (/ kUnit). The SIMD paths convert a register at a time
// (bf16 is the top half of an fp32, so a shift; fp16 through F16C); the loop is the scalar fallback.
#if defined(PDSERVE_SIMD)
template <typename S>
inline simd::F load_kv(const S* p) {
  if constexpr (std::is_same_v<S, int8_t>) return simd::load_int8(p);
  else if constexpr (std::is_same_v<S, Fp8>) return simd::load_e4m3_div256(reinterpret_cast<const uint8_t*>(p));
  else return simd::load(p);
}
#endif

template <typename S>
inline void load_row(const S* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(PDSERVE_SIMD)
  for (; i + simd::W <= n; i += simd::W) simd::store(dst + i, load_kv(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]) / kUnit<S>;
}

#if defined(PDSERVE_SIMD)
constexpr int kMaxGroup = 16;
// Query heads scored together in one walk over a sequence (their partial dot products live in
// a [kTileHeads][W] array of registers on the stack).
constexpr int64_t kTileHeads = 16;
// Blocks ahead of the one being read whose rows are software-prefetched, one row per row read:
// a table's next block is somewhere else in memory, which the hardware prefetcher cannot guess.
// Into L2 (T1), not L1: prefetches into L1 hold its few miss buffers until the data arrives and
// stalled the loads behind them (2-core Zen 4, 128 sequences: 14.5 -> 19.5 GB/s with T1).
constexpr int64_t kPrefetchBlocks = 2;

// One sequence and KV heads [head0, head0 + kv_heads), all of whose query heads fit in one tile
// (kv_heads * group <= kTileHeads); head_dim = W * NV (W = simd::W lanes); G query heads per KV
// head, or G = 0 to read `group` at run time. The query (position len - 1) reads keys [start, len)
// (start > 0 with a sliding window: the blocks before start's are never touched, start's block
// from its row start % block_size). Two passes over those blocks. Pass 1 reads
// whole token rows (all of the tile's heads) in address order and scores W tokens at a time
// (simd::hsum reduces W dot products at once) into `scores` [qheads][len - start]; reading in address
// order is what keeps memory streaming (on a 2-core Zen 4 at 128 sequences x 650 tokens, the
// kernel went from 12 to ~16 GB/s, against ~24 GB/s for a bare read of the same blocks). Softmax
// (with the variant's soft-cap and sinks; query head qi of the tile is head qhead0 + qi).
// Pass 2 accumulates p * V into `acc` [qheads][W * NV]. The same code runs on AVX-512 (W = 16) and
// AVX2 (W = 8).
template <typename T, typename S, int NV, int G>
void decode_tile(const T* q_src, const S* cache, const Paged& pg, const int32_t* table, int64_t len, int64_t start,
                 int64_t head0, int64_t kv_heads, int64_t group_rt, float scale, const Variant& var, int64_t qhead0,
                 float* scores, float* acc, T* out) {
  constexpr int64_t D = simd::W * NV;
  const int64_t group = G > 0 ? G : group_rt;
  const int64_t qheads = kv_heads * group;
  const int64_t nk = len - start;  // keys read, the row length of `scores`
  const int64_t block_size = pg.block_size, token_stride = pg.token_stride, half_stride = pg.half_stride;
  const simd::F sv = simd::set1(scale);
#if defined(__AVX512BF16__)
  // With AVX512-BF16, bf16 q.k over a bf16 cache runs as pairwise bf16 dot products accumulated
  // in fp32 (vdpbf16ps: exact products, like widening first), scaled afterwards.
  constexpr bool kDotBf16 = std::is_same_v<T, c10::BFloat16> && std::is_same_v<S, T>;
  __m512i q_bf16[kTileHeads][NV / 2 > 0 ? NV / 2 : 1];
  if constexpr (kDotBf16)
    for (int64_t qi = 0; qi < qheads; ++qi)
      for (int v = 0; v < NV / 2; ++v)
        q_bf16[qi][v] = _mm512_loadu_si512(reinterpret_cast<const void*>(q_src + qi * D + 32 * v));
#else
  constexpr bool kDotBf16 = false;
#endif
  simd::F q[kTileHeads][NV];
  if constexpr (!kDotBf16)
    for (int64_t qi = 0; qi < qheads; ++qi)
      for (int v = 0; v < NV; ++v) q[qi][v] = simd::mul(simd::load(q_src + qi * D + simd::W * v), sv);
  const int64_t row_lines = (kv_heads * D * static_cast<int64_t>(sizeof(S)) + 63) / 64;
  const int64_t first_block = start / block_size, num_blocks = (len + block_size - 1) / block_size;
  // Rows [row_lo(b), row_hi(b)) of block b hold keys in [start, len).
  auto row_lo = [&](int64_t b) { return std::max<int64_t>(0, start - b * block_size); };
  auto row_hi = [&](int64_t b) { return std::min(block_size, len - b * block_size); };
  auto block = [&](int64_t b) { return cache + static_cast<int64_t>(table[b]) * pg.block_stride; };
  auto prefetch = [](const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); };
  auto prefetch_row = [&](const S* row) {
    for (int64_t l = 0; l < row_lines; ++l) prefetch(reinterpret_cast<const char*>(row) + 64 * l);
  };
  // 8-bit: a block's scales and the tile's K references (what pass 1 reads besides the rows)
  const int64_t ref_lines = (kv_heads * D * 2 + 63) / 64;
  auto prefetch_meta = [&](const S* blk) {
    prefetch(block_scales(blk, pg));
    const c10::BFloat16* refs = block_refs(blk, pg) + head0 * D;
    for (int64_t l = 0; l < ref_lines; ++l) prefetch(reinterpret_cast<const char*>(refs) + 64 * l);
  };
  // Where the tile's rows `kPrefetchBlocks` ahead of block b start (K or V half), or null past the end.
  auto ahead = [&](int64_t b, int64_t half) -> const S* {
    const int64_t a = b + kPrefetchBlocks;
    return a < num_blocks ? block(a) + half + head0 * D : nullptr;
  };
  auto prefetch_rows = [&](int64_t b, int64_t half, int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) prefetch_row(block(b) + half + head0 * D + r * token_stride);
  };
  auto prefetch_first_blocks = [&](int64_t half) {
    for (int64_t b = first_block; b < std::min(first_block + kPrefetchBlocks, num_blocks); ++b) {
      if constexpr (kQuant<S>)
        if (half == 0) prefetch_meta(block(b));
      prefetch_rows(b, half, row_lo(b), row_hi(b));
    }
  };
  // The rows of the block ahead of b that its own row loop (rows [row_lo(b), row_hi(b))) leaves
  // out: those before row_lo(b) (b = start's block).
  auto prefetch_ahead_head = [&](int64_t b, int64_t half) {
    if (b + kPrefetchBlocks < num_blocks && row_lo(b) > 0)
      prefetch_rows(b + kPrefetchBlocks, half, 0, std::min(row_lo(b), row_hi(b + kPrefetchBlocks)));
  };

  // Pass 1: scores[qi * nk + t - start] = q_qi . k_t (8-bit: q_qi . (k_t * K's block scale + ref)).
  prefetch_first_blocks(0);
  simd::F part[kTileHeads][simd::W];
  float k_scale[kTileHeads], k_bias[kTileHeads];
  for (int64_t b = first_block; b < num_blocks; ++b) {
    const int64_t t0 = b * block_size - start, lo = row_lo(b), hi = row_hi(b);
    const S* k_block = block(b) + head0 * D;
    if constexpr (kQuant<S>) {
      const float* sc = block_scales(block(b), pg);
      for (int64_t h = 0; h < kv_heads; ++h) k_scale[h] = sc[head0 + h] * kUnit<S>;
      const c10::BFloat16* refs = block_refs(block(b), pg) + head0 * D;
      for (int64_t h = 0; h < kv_heads; ++h) {
        simd::F ref[NV];
        for (int v = 0; v < NV; ++v) ref[v] = simd::load(refs + h * D + simd::W * v);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t qi = h * group + g;
          simd::F a = simd::mul(q[qi][0], ref[0]);
          for (int v = 1; v < NV; ++v) a = simd::fmadd(q[qi][v], ref[v], a);
          k_bias[qi] = simd::reduce_add(a);
        }
      }
    }
    const S* pf = ahead(b, 0);
    const int64_t pf_rows = pf ? row_hi(b + kPrefetchBlocks) : 0;
    if constexpr (kQuant<S>)
      if (pf) prefetch_meta(block(b + kPrefetchBlocks));
    prefetch_ahead_head(b, 0);
    for (int64_t c0 = lo; c0 < hi; c0 += simd::W) {
      const int64_t n = std::min<int64_t>(simd::W, hi - c0);
      for (int64_t j = 0; j < simd::W; ++j) {
        if (j >= n) {
          for (int64_t qi = 0; qi < qheads; ++qi) part[qi][j] = simd::zero();
          continue;
        }
        if (c0 + j < pf_rows) prefetch_row(pf + (c0 + j) * token_stride);
        const S* row = k_block + (c0 + j) * token_stride;
        for (int64_t h = 0; h < kv_heads; ++h) {
          const S* k = row + h * D;
          if constexpr (kDotBf16) {
#if defined(__AVX512BF16__)
            __m512i kr[NV / 2 > 0 ? NV / 2 : 1];
            for (int v = 0; v < NV / 2; ++v) kr[v] = _mm512_loadu_si512(reinterpret_cast<const void*>(k + 32 * v));
            for (int64_t g = 0; g < group; ++g) {
              __m512 a = _mm512_setzero_ps();
              for (int v = 0; v < NV / 2; ++v)
                a = _mm512_dpbf16_ps(a, (__m512bh)q_bf16[h * group + g][v], (__m512bh)kr[v]);
              part[h * group + g][j] = a;
            }
#endif
          } else {
            simd::F kv[NV];
            for (int v = 0; v < NV; ++v) kv[v] = load_kv(k + simd::W * v);
            for (int64_t g = 0; g < group; ++g) {
              const int64_t qi = h * group + g;
              simd::F a = simd::mul(q[qi][0], kv[0]);
              for (int v = 1; v < NV; ++v) a = simd::fmadd(q[qi][v], kv[v], a);
              part[qi][j] = a;
            }
          }
        }
      }
      for (int64_t qi = 0; qi < qheads; ++qi) {
        simd::F sums = simd::hsum(part[qi]);
        if constexpr (kDotBf16) sums = simd::mul(sums, sv);
        if constexpr (kQuant<S>) sums = simd::fmadd(sums, simd::set1(k_scale[qi / group]), simd::set1(k_bias[qi]));
        simd::store_n(scores + qi * nk + t0 + c0, sums, n);
      }
    }
  }
  // Softmax per query head, normalized at the end; pass 2's first blocks load meanwhile.
  prefetch_first_blocks(half_stride);
  float inv[kTileHeads];
  for (int64_t qi = 0; qi < qheads; ++qi) {
    const float sum = variant_softmax(scores + qi * nk, nk, var, qhead0 + qi);
    inv[qi] = sum > 0.f ? 1.f / sum : 0.f;
  }
  // Pass 2: acc_qi = sum_t p_qi,t v_t (times V's block scale). Head by head within a block, so
  // that a KV head's group accumulates in registers (G * NV vectors) for the block's rows; the
  // block's V rows are read from memory by the first head (and the prefetches), from L1 by the others.
  std::fill(acc, acc + qheads * D, 0.f);
  constexpr int kGroupCap = G > 0 ? G : kMaxGroup;
  for (int64_t b = first_block; b < num_blocks; ++b) {
    const int64_t t0 = b * block_size - start, lo = row_lo(b), hi = row_hi(b);
    const S* v_block = block(b) + half_stride + head0 * D;
    const S* pf = ahead(b, half_stride);
    const int64_t pf_rows = pf ? row_hi(b + kPrefetchBlocks) : 0;
    prefetch_ahead_head(b, half_stride);
    for (int64_t h = 0; h < kv_heads; ++h) {
      float v_scale = 1.f;
      if constexpr (kQuant<S>) v_scale = block_scales(block(b), pg)[pg.num_kv_heads + head0 + h] * kUnit<S>;
      simd::F a[kGroupCap][NV];
      for (int64_t g = 0; g < group; ++g)
        for (int v = 0; v < NV; ++v) a[g][v] = simd::load(acc + (h * group + g) * D + simd::W * v);
      const float* p_rows = scores + h * group * nk + t0;
      for (int64_t j = lo; j < hi; ++j) {
        if (h == 0 && j < pf_rows) prefetch_row(pf + j * token_stride);
        const S* vr = v_block + j * token_stride + h * D;
        simd::F vv[NV];
        for (int v = 0; v < NV; ++v) vv[v] = load_kv(vr + simd::W * v);
        for (int64_t g = 0; g < group; ++g) {
          const simd::F p = simd::set1(kQuant<S> ? p_rows[g * nk + j] * v_scale : p_rows[g * nk + j]);
          for (int v = 0; v < NV; ++v) a[g][v] = simd::fmadd(p, vv[v], a[g][v]);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int v = 0; v < NV; ++v) simd::store(acc + (h * group + g) * D + simd::W * v, a[g][v]);
    }
  }
  for (int64_t qi = 0; qi < qheads; ++qi)
    for (int64_t d = 0; d < D; ++d) out[qi * D + d] = static_cast<T>(acc[qi * D + d] * inv[qi]);
}

// One sequence and KV heads [head0, head0 + kv_heads), in tiles of at most kTileHeads query
// heads, with the query-group size fixed at compile time where it is a common one.
template <typename T, typename S, int NV>
void decode_heads(int64_t group, const T* q_src, const S* cache, const Paged& pg, const int32_t* table, int64_t len,
                  int64_t start, int64_t head0, int64_t kv_heads, float scale, const Variant& var, float* scores,
                  float* acc, T* out) {
  constexpr int64_t D = simd::W * NV;
  const int64_t tile = std::max<int64_t>(1, kTileHeads / group);  // KV heads per tile
  for (int64_t h0 = 0; h0 < kv_heads; h0 += tile) {
    const int64_t kt = std::min(tile, kv_heads - h0);
    const T* q = q_src + h0 * group * D;
    T* o = out + h0 * group * D;
    const int64_t qhead0 = (head0 + h0) * group;
#define PDSERVE_DECODE_GROUP(G_)                                                                         \
  case G_:                                                                                               \
    decode_tile<T, S, NV, G_>(q, cache, pg, table, len, start, head0 + h0, kt, group, scale, var, qhead0, \
                              scores, acc, o);                                                           \
    break;
    switch (group) {
      PDSERVE_DECODE_GROUP(1)
      PDSERVE_DECODE_GROUP(2)
      PDSERVE_DECODE_GROUP(3)
      PDSERVE_DECODE_GROUP(4)
      PDSERVE_DECODE_GROUP(8)
      default:
        decode_tile<T, S, NV, 0>(q, cache, pg, table, len, start, head0 + h0, kt, group, scale, var, qhead0, scores,
                                 acc, o);
    }
#undef PDSERVE_DECODE_GROUP
  }
}
#endif

template <typename T, typename S>
void decode_kernel(at::Tensor& out, const at::Tensor& query, const S* cache, const Paged& pg,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, const Variant& var) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = pg.num_kv_heads, block_size = pg.block_size;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_width = block_tables.size(1);
  const T* q_ptr = query.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  // A work item is a sequence and a range of its KV heads. With enough sequences to keep every
  // thread busy, an item takes all heads, so K/V rows (all heads of a token are contiguous) are
  // streamed once, in order; a small batch splits by head instead, to use every thread.
  const int64_t heads_per_item = num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;

  // Most keys read (a window caps them) first, handed out to threads as they become free (parallel.h).
  auto keys_read = [&](int32_t s) { return lens[s] - var.start(lens[s]); };
  std::vector<int32_t> order(num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return keys_read(a) > keys_read(b); });

  parallel_dynamic(num_seqs * items_per_seq, [&](int64_t task) {
    const int64_t width = heads_per_item * head_dim;  // floats of one token's K (or V) in this item
    const int64_t qheads = heads_per_item * group;
    // Per-thread scratch, kept between calls.
    thread_local std::vector<float> q, acc, row, scores, sums, bias;
    q.resize(qheads * head_dim);
    acc.resize(qheads * head_dim);
    row.resize(width);
    sums.resize(qheads);
    bias.resize(qheads);
    const int64_t item = order[task / items_per_seq] * items_per_seq + task % items_per_seq;
    const int64_t seq = item / items_per_seq, first_kv_head = (item % items_per_seq) * heads_per_item;
    const int64_t len = lens[seq], start = var.start(len), nk = len - start;
    const int32_t* table = tables + seq * table_width;
    const T* q_src = q_ptr + (seq * num_heads + first_kv_head * group) * head_dim;
    T* o = out_ptr + (seq * num_heads + first_kv_head * group) * head_dim;
#if defined(PDSERVE_SIMD)
    if ((head_dim == 64 || head_dim == 128) && group <= kMaxGroup) {
      const int64_t tile_q = std::min(qheads, std::max<int64_t>(group, kTileHeads / group * group));
      scores.resize(std::max<int64_t>(nk, 1) * tile_q);
      acc.resize(tile_q * head_dim);
      if (head_dim == 64)
        decode_heads<T, S, 64 / simd::W>(group, q_src, cache, pg, table, len, start, first_kv_head, heads_per_item,
                                         fscale, var, scores.data(), acc.data(), o);
      else
        decode_heads<T, S, 128 / simd::W>(group, q_src, cache, pg, table, len, start, first_kv_head, heads_per_item,
                                          fscale, var, scores.data(), acc.data(), o);
      return;
    }
#endif
    for (int64_t i = 0; i < qheads * head_dim; ++i) q[i] = static_cast<float>(q_src[i]) * fscale;
    scores.resize(std::max<int64_t>(nk, 1) * qheads);
    // Block scales (8-bit): K's per score, V's per weight; 1 for a cache in the model's dtype.
    auto scale_of = [&](const S* block, int64_t half, int64_t head) {
      if constexpr (kQuant<S>) return block_scales(block, pg)[half * num_kv_heads + head] * kUnit<S>;
      return 1.f;
    };
    // Keys [start, len) in block-sized pieces [t, t + n): the block's rows [t % block_size, ...).
    auto for_each_piece = [&](auto&& fn) {
      for (int64_t t = start; t < len;) {
        const int64_t off = t % block_size, n = std::min(block_size - off, len - t);
        fn(cache + static_cast<int64_t>(table[t / block_size]) * pg.block_stride, off, t - start, n);
        t += n;
      }
    };
    // Pass 1: scores[h * nk + t - start] = q_h . k_t (h's KV head; 8-bit: plus q_h . the block's K reference)
    for_each_piece([&](const S* blk, int64_t off, int64_t s0, int64_t n) {
      const S* k_block = blk + first_kv_head * head_dim;
      if constexpr (kQuant<S>) {
        load_row(block_refs(blk, pg) + first_kv_head * head_dim, row.data(), width);
        for (int64_t h = 0; h < qheads; ++h) bias[h] = dot(q.data() + h * head_dim, row.data() + (h / group) * head_dim, head_dim);
      }
      for (int64_t j = 0; j < n; ++j) {
        load_row(k_block + (off + j) * pg.token_stride, row.data(), width);
        for (int64_t h = 0; h < qheads; ++h)
          scores[h * nk + s0 + j] = dot(q.data() + h * head_dim, row.data() + (h / group) * head_dim, head_dim) *
                                    scale_of(blk, 0, first_kv_head + h / group) + (kQuant<S> ? bias[h] : 0.f);
      }
    });
    // Softmax per query head (normalized at the end).
    for (int64_t h = 0; h < qheads; ++h)
      sums[h] = variant_softmax(scores.data() + h * nk, nk, var, first_kv_head * group + h);
    // Pass 2: acc_h = sum_t p_t v_t
    std::fill(acc.begin(), acc.end(), 0.f);
    for_each_piece([&](const S* blk, int64_t off, int64_t s0, int64_t n) {
      const S* v_block = blk + pg.half_stride + first_kv_head * head_dim;
      for (int64_t j = 0; j < n; ++j) {
        load_row(v_block + (off + j) * pg.token_stride, row.data(), width);
        for (int64_t h = 0; h < qheads; ++h)
          axpy(scores[h * nk + s0 + j] * scale_of(blk, 1, first_kv_head + h / group),
               row.data() + (h / group) * head_dim, acc.data() + h * head_dim, head_dim);
      }
    });
    row_ops::write_normalized(o, acc.data(), sums.data(), qheads, head_dim);
  });
}

void check_decode_args(const char* name, const at::Tensor& query, const at::Tensor& kv_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(query.dim() == 3, name, ": query must be [seqs, heads, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              name, ": block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              name, ": one block table and length per query");
}

// The variant's arguments, checked; `sinks_storage` keeps the fp32 copy `Variant::sinks` points into.
Variant make_variant(const char* name, const at::Tensor& query, int64_t window, double softcap,
                     const c10::optional<at::Tensor>& sinks, at::Tensor& sinks_storage) {
  TORCH_CHECK(window >= 0, name, ": window must be >= 0 (0: no sliding window), got ", window);
  TORCH_CHECK(softcap >= 0, name, ": softcap must be >= 0 (0: no soft-cap), got ", softcap);
  Variant var;
  var.window = window;
  var.softcap = static_cast<float>(softcap);
  if (sinks.has_value() && sinks->defined()) {
    TORCH_CHECK(sinks->device().is_cpu() && sinks->numel() == query.size(1), name,
                ": sinks must be a CPU tensor of one value per query head (", query.size(1), "), got ",
                sinks->sizes());
    sinks_storage = sinks->to(at::kFloat).contiguous();
    var.sinks = sinks_storage.data_ptr<float>();
  }
  return var;
}

// out = decode attention of query over `cache` (elements S), for query dtypes float32/bf16/fp16.
// S = void: the cache holds the query's dtype.
template <typename S>
at::Tensor dispatch(const char* name, const at::Tensor& query, const at::Tensor& cache, const Paged& pg,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, const Variant& var) {
  auto q = query.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    using Elem = std::conditional_t<std::is_void_v<S>, T, S>;
    decode_kernel<T, Elem>(out, q, reinterpret_cast<const Elem*>(cache.data_ptr()), pg, tables, lens, scale, var);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, name, ": dtype ", q.scalar_type(), " is not float32/bfloat16/float16");
  }
  return out;
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window, double softcap, const c10::optional<at::Tensor>& sinks) {
  constexpr const char* name = "paged_decode_attention";
  check_decode_args(name, query, kv_cache, block_tables, seq_lens);
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2, name, ": bad shapes");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), name, ": query and cache dtypes differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0 && query.size(2) == kv_cache.size(4),
              name, ": heads/head_dim disagree with the cache");
  at::Tensor sinks_storage;
  const Variant var = make_variant(name, query, window, softcap, sinks, sinks_storage);
  auto cache = kv_cache.contiguous();
  const int64_t block_size = cache.size(2), num_kv_heads = cache.size(3), token_stride = num_kv_heads * cache.size(4);
  const Paged pg{block_size, num_kv_heads, token_stride, block_size * token_stride, 2 * block_size * token_stride, 0, 0};
  return dispatch<void>(name, query, cache, pg, block_tables, seq_lens, scale, var);
}

at::Tensor paged_decode_attention_8bit(const at::Tensor& query, const at::Tensor& kv_cache,
                                       const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                       int64_t block_size, int64_t num_kv_heads, bool fp8, int64_t window,
                                       double softcap, const c10::optional<at::Tensor>& sinks) {
  constexpr const char* name = "paged_decode_attention_8bit";
  check_decode_args(name, query, kv_cache, block_tables, seq_lens);
  TORCH_CHECK(kv_cache.dim() == 2 && kv_cache.scalar_type() == at::kByte, name, ": kv_cache must be [blocks, block_bytes] uint8");
  TORCH_CHECK(num_kv_heads > 0 && query.size(1) % num_kv_heads == 0, name, ": heads disagree");
  const int64_t token_stride = num_kv_heads * query.size(2), values_bytes = 2 * block_size * token_stride;
  const int64_t ref_offset = values_bytes + 2 * num_kv_heads * 4;  // after the values and the float32 scales
  TORCH_CHECK(kv_cache.size(1) == ref_offset + token_stride * 2,
              name, ": block_bytes disagree with block_size, heads and head_dim");
  at::Tensor sinks_storage;
  const Variant var = make_variant(name, query, window, softcap, sinks, sinks_storage);
  auto cache = kv_cache.contiguous();
  const Paged pg{block_size, num_kv_heads, token_stride, block_size * token_stride, cache.size(1), values_bytes,
                 ref_offset};
  return fp8 ? dispatch<Fp8>(name, query, cache, pg, block_tables, seq_lens, scale, var)
             : dispatch<int8_t>(name, query, cache, pg, block_tables, seq_lens, scale, var);
}
