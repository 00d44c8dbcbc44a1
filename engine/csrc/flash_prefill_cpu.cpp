// Causal prefill attention for bf16 on CPUs with AVX512-BF16: a flash-attention forward (online
// softmax over key tiles, nothing of size [queries, keys] materialized) whose two matmuls are
// `vdpbf16ps` dot products, fp32 accumulation.
//
// Shapes (contiguous): query/out [num_queries, num_heads, head_dim]; key/value [num_keys,
// num_kv_heads, head_dim], num_keys = context + num_queries: query i sits at position context + i
// and attends keys 0..context + i. GQA: query head h reads KV head h / (num_heads / num_kv_heads).
// head_dim must be a multiple of 32, at most 256. Work: K and V of each KV head are first repacked
// into the pair-interleaved layouts vdpbf16ps reads (K: 16 keys x 2 dims per vector, V: 16 dims x
// 2 keys), then (query head, 16-query block) tasks run on torch's thread pool.
//
// Inside a task, four query rows at a time go through a whole key tile: S = Q K^T in 16
// registers, the online-softmax update on those registers, then O += P V with O's rows rescaled
// as they are loaded. Everything but the tile loops is fixed at compile time by the head size, so
// the accumulators stay in registers; only the tiles crossing the causal diagonal are masked.
//
// Variants (engine/attention/variant.py), natively, in its order: `softcap` > 0 soft-caps the
// scaled scores (softcap * tanh(s / softcap), before the mask); `window` > 0 lets the query at
// position p see keys p - window < j <= p only (key tiles wholly before a row block's window are
// skipped, and keys before every query's window are not even repacked); `sinks` (fp32
// [num_heads]) start head h's online softmax at max = sinks[h] with exp(0) = 1 in its sum, i.e.
// one more logit in the denominator and none in the output. Without AVX512-BF16 the Python side
// runs torch's reference instead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "parallel.h"
#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kQueryBlock = 16;
constexpr int64_t kRows = 4;      // query rows per register block
constexpr int64_t kKeyTile = 64;  // four vectors of 16 keys
constexpr int kKeyVecs = kKeyTile / 16;

inline int32_t pair_at(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The maximum of x's 16 lanes, in every lane.
inline __m512 allmax(__m512 x) {
  x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  x = _mm512_max_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_max_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
}

// Four query rows (kRows) of one (query head, query block) task through every key tile they see.
// q: the rows, bf16, stride q_stride; kp: [tiles16][dim/2][16][2]; vp: [keys/2][dim/16][16][2].
// CH = head_dim / 16. Row r sits at position first_pos + r (clamped to the last key, so padding
// rows past the end stay finite; their output is not written). window: as in the header, 0 = none;
// softcap 0 = none; sink: the head's sink logit, -inf = none.
template <int CH>
void flash_rows(const uint16_t* q, int64_t q_stride, int64_t rows, int64_t first_pos, int64_t num_keys,
                const uint16_t* kp, const uint16_t* vp, float scale, int64_t window, float softcap, float sink,
                uint16_t* out, int64_t out_stride) {
  constexpr int64_t kDim = 16 * CH, kPairs = kDim / 2;
  // O in fp32 per row; the running max (in every lane) and per-lane partial sums of P. Scores are
  // kept in log2 units (scale * log2(e) applied), so P = 2^(s - max).
  alignas(64) float o[kRows][kDim];
  alignas(64) uint16_t p16[kRows][kKeyTile];
  int32_t qpairs[kRows][kPairs];
  __m512 m[kRows], l[kRows];
  int32_t pos[kRows];
  constexpr float kLog2e = 1.44269504088896341f;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < kRows; ++i) {
    // A sink is the softmax's first logit: max = sink, sum = exp(sink - max) = 1 (in lane 0).
    m[i] = _mm512_set1_ps(sink == neg_inf ? neg_inf : sink * kLog2e);
    l[i] = sink == neg_inf ? _mm512_setzero_ps() : _mm512_maskz_mov_ps(1, _mm512_set1_ps(1.f));
    std::fill(o[i], o[i] + kDim, 0.f);
    const int64_t r = std::min<int64_t>(i, rows - 1);
    std::memcpy(qpairs[i], q + r * q_stride, sizeof(qpairs[i]));
    pos[i] = static_cast<int32_t>(std::min(first_pos + r, num_keys - 1));
  }
  const int64_t last_key = std::min(num_keys, first_pos + rows);  // keys [first_key, last_key) are needed
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, pos[0] - window + 1) : 0;
  // Key j is masked for row i unless low[i] < j <= pos[i] (low: no key without a window).
  int32_t low[kRows];
  for (int i = 0; i < kRows; ++i) low[i] = static_cast<int32_t>(window > 0 ? std::max<int64_t>(pos[i] - window, -1) : -1);
  const __m512 scale_v = _mm512_set1_ps(scale * kLog2e);
  const __m512 cap_v = _mm512_set1_ps(softcap), cap_log2_v = _mm512_set1_ps(softcap * kLog2e);
  const __m512 scale_nat_v = _mm512_set1_ps(scale);
  const __m512 neg_inf_v = _mm512_set1_ps(neg_inf);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t k0 = first_key / kKeyTile * kKeyTile; k0 < last_key; k0 += kKeyTile) {
    const uint16_t* ka = kp + (k0 / 16) * kPairs * 32;  // kKeyVecs tiles of 16 keys follow
    __m512 s[kRows][kKeyVecs];
    for (int i = 0; i < kRows; ++i)
      for (int t = 0; t < kKeyVecs; ++t) s[i][t] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int64_t d2 = 0; d2 < kPairs; ++d2) {
      __m512bh kv[kKeyVecs];
      for (int t = 0; t < kKeyVecs; ++t) kv[t] = (__m512bh)_mm512_loadu_si512(ka + (t * kPairs + d2) * 32);
      for (int i = 0; i < kRows; ++i) {
        const __m512bh qq = (__m512bh)_mm512_set1_epi32(qpairs[i][d2]);
        for (int t = 0; t < kKeyVecs; ++t) s[i][t] = _mm512_dpbf16_ps(s[i][t], qq, kv[t]);
      }
    }
    // Keys after a row's position are masked, only in tiles that reach past the first row's;
    // keys at or before a row's low end, only in tiles that start at or before the last row's.
    const bool masked = k0 + kKeyTile - 1 > pos[0] || k0 <= low[kRows - 1];
    __m512 corr[kRows];
    for (int i = 0; i < kRows; ++i) {
      __mmask16 keep[kKeyVecs];
      __m512 tile_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int t = 0; t < kKeyVecs; ++t) {
        if (softcap > 0.f)  // softcap * tanh(s * scale / softcap), in log2 units
          s[i][t] = _mm512_mul_ps(cap_log2_v, simd::tanh(_mm512_div_ps(_mm512_mul_ps(s[i][t], scale_nat_v), cap_v)));
        else
          s[i][t] = _mm512_mul_ps(s[i][t], scale_v);
        keep[t] = 0xffff;
        if (masked) {
          const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(k0 + 16 * t)));
          keep[t] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(pos[i])) &
                    _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32(low[i]));
        }
        tile_max = _mm512_mask_max_ps(tile_max, keep[t], tile_max, s[i][t]);
      }
      // The maximum stays -inf while a row has seen no key (its window starts in a later tile) and
      // has no sink: 0 stands in for it then (its O and sum are 0, its P masked).
      const __m512 new_max = _mm512_max_ps(m[i], allmax(tile_max));
      const __m512 ref = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(new_max, neg_inf_v, _CMP_NEQ_OQ), new_max);
      corr[i] = exp2_16(_mm512_sub_ps(m[i], ref));
      m[i] = new_max;
      __m512 sum = _mm512_setzero_ps();
      __m512 p[kKeyVecs];
      for (int t = 0; t < kKeyVecs; ++t) {
        p[t] = _mm512_maskz_mov_ps(keep[t], exp2_16(_mm512_sub_ps(s[i][t], ref)));
        sum = _mm512_add_ps(sum, p[t]);
      }
      l[i] = _mm512_fmadd_ps(l[i], corr[i], sum);
      for (int t = 0; t < kKeyVecs; t += 2)
        _mm512_storeu_si512(p16[i] + 16 * t, (__m512i)_mm512_cvtne2ps_pbh(p[t + 1], p[t]));
    }
    // O = corr * O + P V over the tile's key pairs, four rows x kC 16-dim chunks [c0, c0 + kC) at a
    // time: groups of four chunks, then the CH % 4 left (two for head_dim 32, 96, 160, 224).
    const uint16_t* vt = vp + (k0 / 2) * CH * 32;
    auto chunks_pv = [&](auto num_chunks, int c0) {
      constexpr int kC = decltype(num_chunks)::value;
      __m512 acc[kRows][kC];
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < kC; ++c) acc[i][c] = _mm512_mul_ps(corr[i], _mm512_load_ps(o[i] + 16 * (c0 + c)));
#pragma GCC unroll 4
      for (int64_t kp2 = 0; kp2 < kKeyTile / 2; ++kp2) {
        __m512bh v[kC];
        for (int c = 0; c < kC; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vt + (kp2 * CH + c0 + c) * 32);
        for (int i = 0; i < kRows; ++i) {
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair_at(p16[i] + 2 * kp2));
          for (int c = 0; c < kC; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pp, v[c]);
        }
      }
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < kC; ++c) _mm512_store_ps(o[i] + 16 * (c0 + c), acc[i][c]);
    };
    constexpr int kWhole = CH / 4 * 4;
    for (int c0 = 0; c0 < kWhole; c0 += 4) chunks_pv(std::integral_constant<int, 4>{}, c0);
    if constexpr (CH % 4 != 0) chunks_pv(std::integral_constant<int, CH % 4>{}, kWhole);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float sum = _mm512_reduce_add_ps(l[i]);
    const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
    for (int c = 0; c < CH; ++c) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(inv, _mm512_load_ps(o[i] + 16 * c)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * out_stride + 16 * c), (__m256i)h);
    }
  }
}

using RowsFn = void (*)(const uint16_t*, int64_t, int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*,
                        float, int64_t, float, float, uint16_t*, int64_t);

RowsFn rows_fn(int64_t dim) {
  switch (dim / 16) {
    case 2: return flash_rows<2>;
    case 4: return flash_rows<4>;
    case 6: return flash_rows<6>;
    case 8: return flash_rows<8>;
    case 10: return flash_rows<10>;
    case 12: return flash_rows<12>;
    case 14: return flash_rows<14>;
    default: return flash_rows<16>;
  }
}

// K rows of one KV head -> [tiles16][dim/2][16 keys][2]; V rows -> [keys/2][dim/16][16 dims][2 keys].
// One task is 16 keys; keys past num_keys stay zero.
void repack_tile(const uint16_t* kd, const uint16_t* vd, int64_t num_keys, int64_t num_kv_heads, int64_t h,
                 int64_t tile, int64_t dim, uint16_t* kt, uint16_t* vt) {
  const int64_t pairs = dim / 2, chunks = dim / 16, row_stride = num_kv_heads * dim;
  const int64_t first = tile * 16, n = std::min<int64_t>(16, num_keys - first);
  // K: a 16 x pairs transpose of 32-bit pairs.
  const auto* k32 = reinterpret_cast<const int32_t*>(kd + first * row_stride + h * dim);
  auto* kt32 = reinterpret_cast<int32_t*>(kt);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d2 = 0; d2 < pairs; ++d2) kt32[d2 * 16 + j] = k32[j * (row_stride / 2) + d2];
  // V: two key rows interleaved element by element, 16 dims per vector.
  for (int64_t j = 0; j < 16; j += 2) {
    const uint16_t* r0 = vd + (first + j) * row_stride + h * dim;
    const uint16_t* r1 = r0 + row_stride;
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i a = j < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 16 * c)))
                              : _mm512_setzero_si512();
      const __m512i b = j + 1 < n
                            ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 16 * c)))
                            : _mm512_setzero_si512();
      _mm512_storeu_si512(vt + ((j / 2) * chunks + c) * 32, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

}  // namespace

at::Tensor flash_prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                   double scale, int64_t window, double softcap, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kBFloat16 &&
                  key.scalar_type() == at::kBFloat16 && value.scalar_type() == at::kBFloat16,
              "flash_prefill_attention: bfloat16 CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes(), "flash_prefill_attention: bad shapes");
  const int64_t num_queries = query.size(0), num_heads = query.size(1), dim = query.size(2);
  int64_t num_keys = key.size(0);
  const int64_t num_kv_heads = key.size(1);
  TORCH_CHECK(key.size(2) == dim && dim % 32 == 0 && dim <= 256, "flash_prefill_attention: head_dim must be a multiple of 32, at most 256");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "flash_prefill_attention: heads not a multiple of KV heads");
  TORCH_CHECK(num_keys >= num_queries, "flash_prefill_attention: fewer keys than queries");
  TORCH_CHECK(window >= 0 && softcap >= 0, "flash_prefill_attention: window and softcap must be >= 0 (0: none)");
  at::Tensor sinks32;
  if (sinks.has_value() && sinks->defined()) {
    TORCH_CHECK(sinks->device().is_cpu() && sinks->numel() == num_heads,
                "flash_prefill_attention: sinks must be a CPU tensor of one value per query head");
    sinks32 = sinks->to(at::kFloat).contiguous();
  }
  const float* sink_of = sinks32.defined() ? sinks32.data_ptr<float>() : nullptr;
  auto q = query.contiguous();
  auto k = key.contiguous();
  auto v = value.contiguous();
  auto out = at::empty_like(q);
  if (num_queries == 0) return out;
  // Keys before the first query's window are seen by no query: start at the tile holding that
  // window's first key (positions below are relative to it; the window and causal masks are too).
  const int64_t key_base = window > 0 ? std::max<int64_t>(0, num_keys - num_queries - window + 1) / kKeyTile * kKeyTile : 0;
  const int64_t elems_skipped = key_base * num_kv_heads * dim;
  const int64_t context = num_keys - num_queries - key_base, group = num_heads / num_kv_heads;
  num_keys -= key_base;
  const int64_t padded = (num_keys + kKeyTile - 1) / kKeyTile * kKeyTile, chunks = dim / 16;
  // Repacked K and V per KV head, zero-padded to whole tiles (the padding is never unmasked).
  std::vector<uint16_t> kp(num_kv_heads * padded * dim), vp(num_kv_heads * padded * dim);
  const uint16_t* kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()) + elems_skipped;
  const uint16_t* vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()) + elems_skipped;
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t tiles16 = padded / 16, blocks = (num_queries + kQueryBlock - 1) / kQueryBlock;
  const RowsFn rows = rows_fn(dim);
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, num_kv_heads * tiles16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / tiles16, tile = task % tiles16;
      repack_tile(kd, vd, num_keys, num_kv_heads, h, tile, dim, kp.data() + h * padded * dim + tile * 16 * dim,
                  vp.data() + h * padded * dim + tile * 8 * chunks * 32);
    }
  });
  // Later query blocks see more keys: hand out the largest first for an even split.
  parallel_dynamic(num_heads * blocks, [&](int64_t task) {
    const int64_t block = blocks - 1 - task / num_heads, head = task % num_heads, kv_head = head / group;
    for (int64_t r0 = block * kQueryBlock; r0 < std::min((block + 1) * kQueryBlock, num_queries); r0 += kRows) {
      const int64_t n = std::min(kRows, num_queries - r0);
      rows(qd + (r0 * num_heads + head) * dim, num_heads * dim, n, context + r0, num_keys,
           kp.data() + kv_head * padded * dim, vp.data() + kv_head * padded * dim, fscale, window,
           static_cast<float>(softcap), sink_of ? sink_of[head] : -std::numeric_limits<float>::infinity(),
           od + (r0 * num_heads + head) * dim, num_heads * dim);
    }
  });
  return out;
}

bool has_flash_prefill() { return true; }

#else  // no AVX512-BF16: the Python side keeps torch's SDPA

at::Tensor flash_prefill_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, double,
                                   const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "flash_prefill_attention needs AVX512-BF16");
}

bool has_flash_prefill() { return false; }

#endif
