// Multi-head latent attention (DeepSeek's MLA, up-projections absorbed) for decodes on the CPU:
// one query token per sequence over its cached latents, read in place from the paged cache
// through the block table (no gather copy), online softmax and accumulation in fp32.
//
// The cache is engine/attention/latent.py's: a layer [num_blocks, 2, block_size, 1, half] whose
// token holds its latent [c_kv (value_dim) | k_rope] (2 * half values) as its K half then its V
// half; or the 8-bit format of engine/kv_quant.py with one KV head of head_dim = half
// ([num_blocks, block_bytes] uint8: values [2, block_size, 1, half], float32 scales [2, 1], the
// bf16 K reference [1, half]; the K half reads q * scale + ref, the V half q * scale, computed as
// KVQuantFormat.dequantize computes them, a product then a sum). query [num_seqs, heads, 2 * half]
// (fp32, bf16 or fp16; a float cache in the same dtype), block_tables [num_seqs, width] int32,
// seq_lens [num_seqs] int32; out [num_seqs, heads, value_dim] (value_dim <= 2 * half):
// softmax_p(query . latent_p * scale) weighted sum of latent_p[:value_dim] over p < seq_len.
//
// Every head reads the same latents (one KV head), so the work is two small matrix products per
// tile of kTile positions, written once over simd::F (16 lanes on AVX-512, 8 on AVX2):
//   1. the tile's latents are widened into an fp32 scratch tile [kTile][dp] (dp: the latent
//      rounded up to whole registers, zero-padded; the K and V halves joined; 8-bit dequantized);
//   2. scores [heads][kTile] = Q [heads][dp] . tile^T, in register blocks of kHeads heads by
//      kTokens latents (kHeads * kTokens accumulators over d, reduced W at a time by simd::hsum);
//   3. the online softmax step per head (running max and sum; alpha rescales what is accumulated);
//   4. acc [heads][vp] = alpha acc + p [heads][kTile] . tile[:, :vp], in blocks of kHeads heads by
//      kValueVecs registers of the value, the tile's column slice reused from L1 by every head block.
// At DeepSeek's sizes (576-wide latents, 16 heads a rank) a latent costs 16 x (576 + 512)
// multiply-adds per 2.3 KB read (fp32): the kernel is bound by FMA throughput, not memory, so
// the register blocks are what matters, and reading a latent twice (head groups) costs little.
//
// Work items: (sequence, group of heads, range of the context), handed out longest first on
// torch's thread pool (parallel.h). A batch with enough sequences for every thread takes whole
// sequences and all heads up to kMaxItemHeads (each latent read once). A smaller batch splits long contexts into
// ranges (each item's partial max, sum and accumulator merged afterwards, as flash-decoding does)
// and, where the contexts are too short to split, the heads into groups, so 2 threads are busy at
// batch 1. `num_splits` / `heads_per_item` (0: chosen as above) force either, for tests.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include "parallel.h"
#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(PDSERVE_SIMD)
namespace {

using simd::F;
using BF16 = c10::BFloat16;
using Fp8 = c10::Float8_e4m3fn;
constexpr int64_t W = simd::W;

template <typename S>
constexpr bool kQuant = std::is_same_v<S, int8_t> || std::is_same_v<S, Fp8>;
// SIMD loads of S give value / kUnit (fp8 widens through fp16 bits, which divides by 256); the
// scales take the factor back, exactly (a power of two).
template <typename S>
constexpr float kUnit = std::is_same_v<S, Fp8> ? 256.f : 1.f;

// Register blocks (see the header). AVX2 (16 registers): scores 4 heads x 3 latents (12
// accumulators, the query rows' loads folded into the FMAs where the registers run out), p.V 4
// heads x 2 registers of the value (8 accumulators, 2 value registers, 1 broadcast). AVX-512 (32
// registers): 4 x 4 and 4 x 4. Measured on the AVX2 EPYC (Zen 3) at DeepSeek's sizes, 16 heads,
// one thread: scores at 4 x 2 (8 accumulators: too few to cover the FMAs' latency) ran ~26 GFMA/s
// against p.V's ~40; at 4 x 3 with 48-position tiles the whole kernel went 0.66 -> 0.51 ms per
// 1,024 positions (min of runs; 16 -> 32 positions had been worth ~8% before).
constexpr int kHeads = 4;
constexpr int kTokens = W == 16 ? 4 : 3;
constexpr int kValueVecs = W == 16 ? 4 : 2;
// Positions per online-softmax step (a multiple of kTokens and of W): its fp32 scratch tile is
// 48 x 576 x 4 = 108 KB at DeepSeek's sizes (L2).
constexpr int64_t kTile = 48;
// The shortest context range a work item of its own is worth when a small batch splits contexts.
constexpr int64_t kSplitLen = 128;
// The most heads one work item takes (more are split into groups), so that its queries, scores and
// accumulators stay in L2 beside the tile (DeepSeek-V3 on one CPU has 128 heads: 32 are 74 KB of
// queries and 64 KB of accumulators at its sizes).
constexpr int64_t kMaxItemHeads = 32;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Where a token's latent is, in elements of S (bytes for 8-bit).
struct Layout {
  int64_t block_size, half, block_stride, half_stride;
  int64_t scale_offset;  // 8-bit: a block's float32 scales [K, V]
  int64_t ref_offset;    // 8-bit: a block's bf16 K reference [half]
};

template <typename S>
inline F load_kv(const S* p) {
  if constexpr (std::is_same_v<S, int8_t>) return simd::load_int8(p);
  else if constexpr (std::is_same_v<S, Fp8>) return simd::load_e4m3_div256(reinterpret_cast<const uint8_t*>(p));
  else return simd::load(p);
}

// dst[i] = src[i] for i < n, in fp32; 8-bit: src[i] * scale (+ ref[i] where ref is given).
template <typename S>
inline void widen(const S* src, int64_t n, float scale, const BF16* ref, float* dst) {
  int64_t i = 0;
  const F sv = simd::set1(scale);
  for (; i + W <= n; i += W) {
    F x = load_kv(src + i);
    if constexpr (kQuant<S>) {
      x = simd::mul(x, sv);
      if (ref != nullptr) x = simd::add(x, simd::load(ref + i));
    }
    simd::store(dst + i, x);
  }
  for (; i < n; ++i) {
    float x = static_cast<float>(src[i]) / kUnit<S>;
    if constexpr (kQuant<S>) {
      x = x * scale;
      if (ref != nullptr) x = x + static_cast<float>(ref[i]);
    }
    dst[i] = x;
  }
}

// The latent at position `pos` of the sequence whose block table is `table`, into dst [2 * half].
template <typename S>
inline void widen_latent(const S* cache, const Layout& lo, const int32_t* table, int64_t pos, float* dst) {
  const S* block = cache + static_cast<int64_t>(table[pos / lo.block_size]) * lo.block_stride;
  const S* k = block + (pos % lo.block_size) * lo.half;
  float k_scale = 1.f, v_scale = 1.f;
  const BF16* ref = nullptr;
  if constexpr (kQuant<S>) {
    const float* scales = reinterpret_cast<const float*>(block + lo.scale_offset);
    k_scale = scales[0] * kUnit<S>;
    v_scale = scales[1] * kUnit<S>;
    ref = reinterpret_cast<const BF16*>(block + lo.ref_offset);
  }
  widen(k, lo.half, k_scale, ref, dst);
  widen(k + lo.half_stride, lo.half, v_scale, nullptr, dst + lo.half);
}

// Software prefetch (into L2) of the latents at positions [p0, p1): a sequence's blocks lie anywhere
// in the cache, which the hardware prefetcher cannot guess; issued a tile ahead of the one computed
// (a few percent at DeepSeek's sizes, batch 8 x 1,024 positions, on the AVX2 EPYC).
template <typename S>
inline void prefetch_latents(const S* cache, const Layout& lo, const int32_t* table, int64_t p0, int64_t p1) {
  auto lines = [](const void* from, int64_t bytes) {
    const char* c = static_cast<const char*>(from);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
  };
  for (int64_t t = p0; t < p1;) {
    const int64_t off = t % lo.block_size, n = std::min(lo.block_size - off, p1 - t);
    const S* block = cache + static_cast<int64_t>(table[t / lo.block_size]) * lo.block_stride;
    const int64_t bytes = n * lo.half * static_cast<int64_t>(sizeof(S));
    lines(block + off * lo.half, bytes);
    lines(block + lo.half_stride + off * lo.half, bytes);
    if constexpr (kQuant<S>) lines(block + lo.scale_offset, 8 + lo.half * 2);  // scales, then the K reference
    t += n;
  }
}

// s[h * kTile + t] = q_h . l_t for the kHeads query rows at q and the kTokens latents at l (rows of
// dp floats, dp a multiple of W): W lanes of partial sums per pair, reduced together at the end.
inline void score_block(const float* q, const float* l, int64_t dp, float* s) {
  F acc[kHeads * kTokens];
  for (int i = 0; i < kHeads * kTokens; ++i) acc[i] = simd::zero();
  for (int64_t d = 0; d < dp; d += W) {
    F qv[kHeads];
    for (int h = 0; h < kHeads; ++h) qv[h] = simd::load(q + h * dp + d);
    for (int t = 0; t < kTokens; ++t) {
      const F lv = simd::load(l + t * dp + d);
      for (int h = 0; h < kHeads; ++h) acc[h * kTokens + t] = simd::fmadd(qv[h], lv, acc[h * kTokens + t]);
    }
  }
  // lane i of group g: the sum of acc[g * W + i]'s lanes (missing accumulators: zeros)
  constexpr int kAcc = kHeads * kTokens, kGroups = (kAcc + W - 1) / W;
  alignas(64) float sums[kGroups * W];
  for (int g = 0; g < kGroups; ++g) {
    F part[W];
    for (int i = 0; i < W; ++i) part[i] = g * W + i < kAcc ? acc[g * W + i] : simd::zero();
    simd::store(sums + g * W, simd::hsum(part));
  }
  for (int h = 0; h < kHeads; ++h)
    for (int t = 0; t < kTokens; ++t) s[h * kTile + t] = sums[h * kTokens + t];
}

// acc_h[0, NV * W) = alpha_h acc_h + sum_{t < n} p_h,t l_t[0, NV * W) for kHeads heads (the first
// tile: acc_h = the sum, whatever acc held): p rows of kTile, l rows of dp, acc rows of vp floats.
template <int NV>
inline void pv_block(const float* p, const float* l, int64_t dp, int64_t n, bool first, const float* alpha,
                     float* acc, int64_t vp) {
  F a[kHeads][NV];
  for (int h = 0; h < kHeads; ++h) {
    const F al = simd::set1(alpha[h]);
    for (int v = 0; v < NV; ++v) a[h][v] = first ? simd::zero() : simd::mul(simd::load(acc + h * vp + v * W), al);
  }
  for (int64_t t = 0; t < n; ++t) {
    F lv[NV];
    for (int v = 0; v < NV; ++v) lv[v] = simd::load(l + t * dp + v * W);
    for (int h = 0; h < kHeads; ++h) {
      const F pv = simd::set1(p[h * kTile + t]);
      for (int v = 0; v < NV; ++v) a[h][v] = simd::fmadd(pv, lv[v], a[h][v]);
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int v = 0; v < NV; ++v) simd::store(acc + h * vp + v * W, a[h][v]);
}

// dst[i] = src[i] * mul for i < n, rounded to T.
template <typename T>
inline void store_row(T* dst, const float* src, int64_t n, float mul) {
  int64_t i = 0;
  if constexpr (!std::is_same_v<T, c10::Half>) {
    const F m = simd::set1(mul);
    for (; i + W <= n; i += W) simd::store(dst + i, simd::mul(simd::load(src + i), m));
  }
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i] * mul);
}

struct Item {
  int64_t seq, head0, heads, split, p0, p1;  // heads [head0, head0 + heads), positions [p0, p1)
};

struct Problem {
  int64_t num_heads, latent, value_dim, dp, vp, table_width;
  float scale;
  Layout layout;
};

// Per-thread scratch, kept between calls.
struct Scratch {
  std::vector<float> q, tile, scores, acc, max, sum, alpha;
  int64_t tile_latent = -1;  // the latent width `tile` is laid out for (its padding columns zero)
};

// One work item: its heads' running max, sum and (unnormalized) accumulator over positions
// [p0, p1) left in the scratch (heads padded to a multiple of kHeads with zero queries; an empty
// range leaves the sums 0 and the accumulators undefined).
template <typename T, typename S>
void attend_item(const Problem& pb, const Item& it, const T* query, const S* cache, const int32_t* tables,
                 Scratch& sc) {
  const int64_t dp = pb.dp, vp = pb.vp, hp = round_up(it.heads, kHeads);
  sc.q.resize(hp * dp);
  if (sc.tile_latent != pb.latent) {  // zeros past the latent in every row, then only [0, latent) is written
    sc.tile.assign(kTile * dp, 0.f);
    sc.tile_latent = pb.latent;
  }
  sc.scores.resize(hp * kTile);
  sc.acc.resize(hp * vp);
  sc.max.assign(hp, -std::numeric_limits<float>::infinity());
  sc.sum.assign(hp, 0.f);
  sc.alpha.resize(hp);
  const T* q_src = query + (it.seq * pb.num_heads + it.head0) * pb.latent;
  for (int64_t h = 0; h < hp; ++h) {
    float* q = sc.q.data() + h * dp;
    int64_t d = 0;
    if (h < it.heads) {
      for (; d + W <= pb.latent; d += W) simd::store(q + d, simd::load(q_src + h * pb.latent + d));
      for (; d < pb.latent; ++d) q[d] = static_cast<float>(q_src[h * pb.latent + d]);
    }
    std::fill(q + d, q + dp, 0.f);
  }
  const int32_t* table = tables + it.seq * pb.table_width;
  float* tile = sc.tile.data();
  float* scores = sc.scores.data();
  for (int64_t t0 = it.p0; t0 < it.p1; t0 += kTile) {
    const int64_t n = std::min(kTile, it.p1 - t0), nb = round_up(n, kTokens);
    if (t0 == it.p0) prefetch_latents(cache, pb.layout, table, t0, t0 + n);
    prefetch_latents(cache, pb.layout, table, t0 + n, std::min(it.p1, t0 + n + kTile));  // the next tile
    // rows [n, nb) hold an earlier tile's latents (or zeros): scored, never used
    for (int64_t t = 0; t < n; ++t) widen_latent(cache, pb.layout, table, t0 + t, tile + t * dp);
    for (int64_t h = 0; h < hp; h += kHeads)
      for (int64_t t = 0; t < nb; t += kTokens)
        score_block(sc.q.data() + h * dp, tile + t * dp, dp, scores + h * kTile + t);
    // online softmax: p = exp(s * scale - m_new) over the n positions, 0 past them
    for (int64_t h = 0; h < hp; ++h) {
      float* s = scores + h * kTile;
      float tile_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < n; ++t) {
        s[t] *= pb.scale;
        tile_max = std::max(tile_max, s[t]);
      }
      const float m_old = sc.max[h], m_new = std::max(m_old, tile_max);
      const F mv = simd::set1(m_new);
      for (int64_t t = 0; t < kTile; t += W) simd::store(s + t, simd::exp(simd::sub(simd::load(s + t), mv)));
      float sum = 0.f;
      for (int64_t t = 0; t < kTile; ++t) {
        if (t >= n) s[t] = 0.f;
        sum += s[t];
      }
      const float alpha = m_old == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m_old - m_new);
      sc.alpha[h] = alpha;
      sc.sum[h] = sc.sum[h] * alpha + sum;
      sc.max[h] = m_new;
    }
    const bool first = t0 == it.p0;
    int64_t v = 0;
    for (; v + kValueVecs * W <= vp; v += kValueVecs * W)
      for (int64_t h = 0; h < hp; h += kHeads)
        pv_block<kValueVecs>(scores + h * kTile, tile + v, dp, n, first, sc.alpha.data() + h,
                             sc.acc.data() + h * vp + v, vp);
    for (; v < vp; v += W)
      for (int64_t h = 0; h < hp; h += kHeads)
        pv_block<1>(scores + h * kTile, tile + v, dp, n, first, sc.alpha.data() + h, sc.acc.data() + h * vp + v, vp);
  }
}

template <typename T, typename S>
void latent_decode(at::Tensor& out, const at::Tensor& query, const S* cache, const Layout& layout,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t value_dim,
                   int64_t num_splits, int64_t heads_per_item) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), latent = query.size(2);
  if (num_seqs == 0 || num_heads == 0) return;
  const Problem pb{num_heads, latent, value_dim, round_up(latent, W), round_up(value_dim, W), block_tables.size(1),
                   static_cast<float>(scale), layout};
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  // How many items per sequence keep every thread busy (none beyond whole sequences when the
  // batch has at least two per thread, or one thread).
  const int64_t threads = at::get_num_threads();
  const int64_t want = threads > 1 && num_seqs < 2 * threads ? (2 * threads + num_seqs - 1) / num_seqs : 1;
  std::vector<int64_t> splits(num_seqs);
  int64_t most_splits = 1;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t tiles = std::max<int64_t>(1, (lens[s] + kTile - 1) / kTile);
    splits[s] = num_splits > 0 ? std::min(num_splits, tiles) : std::clamp<int64_t>(lens[s] / kSplitLen, 1, want);
    most_splits = std::max(most_splits, splits[s]);
  }
  // Heads per item: all of them up to kMaxItemHeads, in equal groups of whole register blocks past
  // that, and fewer where the contexts are too short to split into enough items.
  const int64_t head_blocks = (num_heads + kHeads - 1) / kHeads;
  int64_t groups = (num_heads + kMaxItemHeads - 1) / kMaxItemHeads;
  if (want > most_splits) groups = std::max(groups, (want + most_splits - 1) / most_splits);
  groups = std::min(groups, head_blocks);
  const int64_t group =
      heads_per_item > 0 ? std::min(num_heads, heads_per_item) : (head_blocks + groups - 1) / groups * kHeads;
  std::vector<Item> items;
  std::vector<int64_t> slot(num_seqs, -1);  // a split sequence's first partial slot
  int64_t slots = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (splits[s] > 1) {
      slot[s] = slots;
      slots += splits[s];
    }
    const int64_t tiles = (lens[s] + kTile - 1) / kTile;
    for (int64_t i = 0; i < splits[s]; ++i) {
      const int64_t p0 = tiles * i / splits[s] * kTile;
      const int64_t p1 = std::min<int64_t>(lens[s], tiles * (i + 1) / splits[s] * kTile);
      for (int64_t h0 = 0; h0 < num_heads; h0 += group)
        items.push_back({s, h0, std::min(group, num_heads - h0), i, p0, p1});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return (a.p1 - a.p0) * a.heads > (b.p1 - b.p0) * b.heads;
  });
  // Partial results of split sequences: [slot][head] max and sum, [slot][head][vp] accumulators.
  std::vector<float> part_max(slots * num_heads), part_sum(slots * num_heads), part_acc(slots * num_heads * pb.vp);
  const T* q_ptr = query.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  T* o_ptr = out.data_ptr<T>();
  parallel_dynamic(static_cast<int64_t>(items.size()), [&](int64_t task) {
    thread_local Scratch sc;
    const Item& it = items[task];
    attend_item<T, S>(pb, it, q_ptr, cache, tables, sc);
    if (slot[it.seq] < 0) {
      for (int64_t h = 0; h < it.heads; ++h) {
        T* o = o_ptr + (it.seq * num_heads + it.head0 + h) * value_dim;
        const float sum = sc.sum[h];
        if (sum > 0.f) store_row(o, sc.acc.data() + h * pb.vp, value_dim, 1.f / sum);
        else std::fill(o, o + value_dim, T(0.f));  // an empty context
      }
      return;
    }
    const int64_t base = (slot[it.seq] + it.split) * num_heads + it.head0;
    for (int64_t h = 0; h < it.heads; ++h) {
      part_max[base + h] = sc.max[h];
      part_sum[base + h] = sc.sum[h];
      std::copy(sc.acc.data() + h * pb.vp, sc.acc.data() + (h + 1) * pb.vp, part_acc.data() + (base + h) * pb.vp);
    }
  });
  if (slots == 0) return;
  // Merge the splits: out_h = sum_i e^(m_i - m) acc_i / sum_i e^(m_i - m) l_i, m = max_i m_i.
  std::vector<int64_t> split_seqs;
  for (int64_t s = 0; s < num_seqs; ++s)
    if (slot[s] >= 0) split_seqs.push_back(s);
  at::parallel_for(0, static_cast<int64_t>(split_seqs.size()) * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(pb.vp);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = split_seqs[task / num_heads], h = task % num_heads;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < splits[s]; ++i) m = std::max(m, part_max[(slot[s] + i) * num_heads + h]);
      std::fill(merged.begin(), merged.end(), 0.f);
      float sum = 0.f;
      for (int64_t i = 0; i < splits[s]; ++i) {
        const int64_t k = (slot[s] + i) * num_heads + h;
        const float w = std::exp(part_max[k] - m);
        sum += w * part_sum[k];
        const F wv = simd::set1(w);
        const float* acc = part_acc.data() + k * pb.vp;
        for (int64_t v = 0; v < pb.vp; v += W)
          simd::store(merged.data() + v, simd::fmadd(wv, simd::load(acc + v), simd::load(merged.data() + v)));
      }
      store_row(o_ptr + (s * num_heads + h) * value_dim, merged.data(), value_dim, sum > 0.f ? 1.f / sum : 0.f);
    }
  });
}

void check_args(const char* name, const at::Tensor& query, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                int64_t block_size, int64_t num_blocks, int64_t half, int64_t value_dim) {
  TORCH_CHECK(query.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && query.size(2) == 2 * half, name, ": query must be [seqs, heads, 2 * half = ",
              2 * half, "], got ", query.sizes());
  TORCH_CHECK(value_dim > 0 && value_dim <= 2 * half, name, ": value_dim must be in [1, ", 2 * half, "], got ",
              value_dim);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  seq_lens.dim() == 1,
              name, ": block_tables [seqs, width] and seq_lens [seqs] must be int32");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0), name,
              ": one block table and length per query");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), name,
              ": block_tables and seq_lens must be contiguous");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  for (int64_t s = 0; s < query.size(0); ++s) {
    TORCH_CHECK(lens[s] >= 0 && (lens[s] + block_size - 1) / block_size <= width, name, ": sequence ", s,
                "'s length ", lens[s], " does not fit its block table (", width, " blocks of ", block_size, ")");
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[s * width + b] >= 0 && tables[s * width + b] < num_blocks, name, ": block id ",
                  tables[s * width + b], " out of range");
  }
}

// out = the attention of query (float32/bf16/fp16) over `cache` (elements S; void: the query's dtype).
template <typename S>
at::Tensor dispatch(const char* name, const at::Tensor& query, const at::Tensor& cache, const Layout& layout,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t value_dim,
                    int64_t num_splits, int64_t heads_per_item) {
  TORCH_CHECK(num_splits >= 0 && heads_per_item >= 0, name, ": num_splits and heads_per_item must be >= 0");
  auto q = query.contiguous();
  auto out = at::empty({q.size(0), q.size(1), value_dim}, q.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    using Elem = std::conditional_t<std::is_void_v<S>, T, S>;
    latent_decode<T, Elem>(out, q, reinterpret_cast<const Elem*>(cache.data_ptr()), layout, block_tables, seq_lens,
                           scale, value_dim, num_splits, heads_per_item);
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

// Its 16-lane (AVX-512) build has not yet run on an AVX-512 machine (none was at hand when it was
// written): there it reports itself absent, so callers keep the torch reference, until checked on
// one. PDSERVE_CPU_ISA=avx2 builds the 8-lane path, tested on AVX2 machines, for any x86-64-v3 CPU.
bool has_latent_decode() {
#if defined(__AVX512F__)
  return false;
#else
  return true;
#endif
}

at::Tensor latent_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, double scale, int64_t value_dim, int64_t num_splits,
                                   int64_t heads_per_item) {
  constexpr const char* name = "latent_decode_attention";
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.size(3) == 1,
              name, ": kv_cache must be a CPU [num_blocks, 2, block_size, 1, half] tensor, got ", kv_cache.sizes());
  TORCH_CHECK(kv_cache.is_contiguous(), name, ": kv_cache must be contiguous");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), name, ": query and cache dtypes differ");
  const int64_t block_size = kv_cache.size(2), half = kv_cache.size(4);
  check_args(name, query, block_tables, seq_lens, block_size, kv_cache.size(0), half, value_dim);
  const Layout layout{block_size, half, 2 * block_size * half, block_size * half, 0, 0};
  return dispatch<void>(name, query, kv_cache, layout, block_tables, seq_lens, scale, value_dim, num_splits,
                        heads_per_item);
}

at::Tensor latent_decode_attention_8bit(const at::Tensor& query, const at::Tensor& kv_cache,
                                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                        int64_t value_dim, int64_t block_size, bool fp8, int64_t num_splits,
                                        int64_t heads_per_item) {
  constexpr const char* name = "latent_decode_attention_8bit";
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 2 && kv_cache.scalar_type() == at::kByte, name,
              ": kv_cache must be a CPU [num_blocks, block_bytes] uint8 tensor");
  TORCH_CHECK(kv_cache.is_contiguous(), name, ": kv_cache must be contiguous");
  TORCH_CHECK(block_size > 0 && query.dim() == 3 && query.size(2) % 2 == 0, name, ": bad block_size or query");
  const int64_t half = query.size(2) / 2, values_bytes = 2 * block_size * half;
  const int64_t ref_offset = values_bytes + 2 * 4;  // after the values and the float32 scales [2, 1]
  TORCH_CHECK(kv_cache.size(1) == ref_offset + half * 2, name, ": block_bytes (", kv_cache.size(1),
              ") disagree with block_size ", block_size, ", one KV head and head_dim ", half);
  check_args(name, query, block_tables, seq_lens, block_size, kv_cache.size(0), half, value_dim);
  const Layout layout{block_size, half, kv_cache.size(1), block_size * half, values_bytes, ref_offset};
  return fp8 ? dispatch<Fp8>(name, query, kv_cache, layout, block_tables, seq_lens, scale, value_dim, num_splits,
                             heads_per_item)
             : dispatch<int8_t>(name, query, kv_cache, layout, block_tables, seq_lens, scale, value_dim, num_splits,
                                heads_per_item);
}

#else  // no AVX2 or AVX-512: latent attention keeps the torch reference

bool has_latent_decode() { return false; }

at::Tensor latent_decode_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                   int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "latent_decode_attention needs AVX2 + FMA or AVX-512; use engine/attention/latent.py");
  return {};
}

at::Tensor latent_decode_attention_8bit(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        double, int64_t, int64_t, bool, int64_t, int64_t) {
  TORCH_CHECK(false, "latent_decode_attention_8bit needs AVX2 + FMA or AVX-512; use engine/attention/latent.py");
  return {};
}

#endif
