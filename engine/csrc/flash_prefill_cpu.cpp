// Causal prefill attention for bf16 on CPUs with AVX512-BF16: a flash-attention forward (online
// softmax over key tiles, nothing of size [queries, keys] materialized) whose two matmuls are
// `vdpbf16ps` dot products, fp32 accumulation.
//
// Shapes (contiguous): query/out [num_queries, num_heads, head_dim]; key/value [num_keys,
// num_kv_heads, head_dim], num_keys = context + num_queries: query i sits at position context + i
// and attends keys 0..context + i. GQA: query head h reads KV head h / (num_heads / num_kv_heads).
// head_dim must be a multiple of 32. Work: K and V of each KV head are first repacked into the
// pair-interleaved layouts vdpbf16ps reads (K: 16 keys x 2 dims per vector, V: 16 dims x 2 keys),
// then (query head, 16-query block) tasks run on torch's thread pool.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kQueryBlock = 16;
constexpr int64_t kKeyTile = 64;  // four vectors of 16 keys
constexpr int kKeyVecs = kKeyTile / 16;

inline int32_t pair_at(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// One (query head, query block) task. kp: [tiles16][dim/2][16][2]; vp: [keys/2][dim/16][16][2].
void flash_block(const uint16_t* q, int64_t q_stride, int64_t rows, int64_t first_pos, int64_t num_keys,
                 const uint16_t* kp, const uint16_t* vp, int64_t dim, float scale, uint16_t* out,
                 int64_t out_stride) {
  const int64_t pairs = dim / 2, chunks = dim / 16;
  float m[kQueryBlock], l[kQueryBlock];
  alignas(64) float o[kQueryBlock][256];
  alignas(64) float s[kQueryBlock][kKeyTile];
  alignas(64) uint16_t p16[kQueryBlock][kKeyTile];
  for (int64_t r = 0; r < rows; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
    std::fill(o[r], o[r] + dim, 0.f);
  }
  const int64_t last_key = std::min(num_keys, first_pos + rows);  // keys [0, last_key) are needed
  const __m512 scale_v = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t k0 = 0; k0 < last_key; k0 += kKeyTile) {
    const uint16_t* ka = kp + (k0 / 16) * pairs * 32;  // kKeyVecs tiles of 16 keys follow
    // S = scale * Q K^T for this tile, four query rows at a time (each K vector is used 4 times).
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      __m512 acc[4][kKeyVecs];
      for (int i = 0; i < 4; ++i)
        for (int t = 0; t < kKeyVecs; ++t) acc[i][t] = _mm512_setzero_ps();
      const int64_t n = std::min<int64_t>(4, rows - r0);
      for (int64_t d2 = 0; d2 < pairs; ++d2) {
        __m512bh kv[kKeyVecs];
        for (int t = 0; t < kKeyVecs; ++t) kv[t] = (__m512bh)_mm512_loadu_si512(ka + (t * pairs + d2) * 32);
        for (int i = 0; i < 4; ++i) {
          if (i >= n) break;
          const __m512bh qq = (__m512bh)_mm512_set1_epi32(pair_at(q + (r0 + i) * q_stride + 2 * d2));
          for (int t = 0; t < kKeyVecs; ++t) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], qq, kv[t]);
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = first_pos + r0 + i;  // keys after pos (and past num_keys) are masked
        for (int half = 0; half < kKeyVecs; ++half) {
          const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(k0 + 16 * half)));
          const __mmask16 keep = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(
                                                                  std::min(pos, num_keys - 1))));
          _mm512_storeu_ps(s[r0 + i] + 16 * half,
                           _mm512_mask_mul_ps(neg_inf, keep, acc[i][half], scale_v));
        }
      }
    }
    // Online softmax: rescale what was accumulated to the new row maximum, P = exp(S - max).
    for (int64_t r = 0; r < rows; ++r) {
      __m512 sv[kKeyVecs];
      __m512 tile_max_v = neg_inf;
      for (int t = 0; t < kKeyVecs; ++t) {
        sv[t] = _mm512_loadu_ps(s[r] + 16 * t);
        tile_max_v = _mm512_max_ps(tile_max_v, sv[t]);
      }
      const float tile_max = _mm512_reduce_max_ps(tile_max_v);
      const float new_max = std::max(m[r], tile_max);
      if (new_max == -std::numeric_limits<float>::infinity()) {  // nothing visible yet
        std::memset(p16[r], 0, sizeof(p16[r]));
        continue;
      }
      const float correction = std::exp(m[r] - new_max);
      const __m512 mv = _mm512_set1_ps(new_max);
      __m512 pv[kKeyVecs];
      __m512 sum = _mm512_setzero_ps();
      for (int t = 0; t < kKeyVecs; ++t) {
        // masked lanes: exp16 clamps at -87, so zero them explicitly
        pv[t] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sv[t], neg_inf, _CMP_NEQ_OQ),
                                    exp16(_mm512_sub_ps(sv[t], mv)));
        sum = _mm512_add_ps(sum, pv[t]);
      }
      l[r] = l[r] * correction + _mm512_reduce_add_ps(sum);
      m[r] = new_max;
      if (correction != 1.f) {
        const __m512 cv = _mm512_set1_ps(correction);
        for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(o[r] + 16 * c, _mm512_mul_ps(cv, _mm512_loadu_ps(o[r] + 16 * c)));
      }
      for (int t = 0; t < kKeyVecs; t += 2)
        _mm512_storeu_si512(p16[r] + 16 * t, (__m512i)_mm512_cvtne2ps_pbh(pv[t + 1], pv[t]));
    }
    // O += P V over the tile's key pairs, four query rows x four 16-dim chunks at a time.
    const uint16_t* vt = vp + (k0 / 2) * chunks * 32;
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t n = std::min<int64_t>(4, rows - r0);
      for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
        const int64_t nc = std::min<int64_t>(4, chunks - c0);
        __m512 acc[4][4];
        for (int64_t i = 0; i < n; ++i)
          for (int64_t c = 0; c < nc; ++c) acc[i][c] = _mm512_loadu_ps(o[r0 + i] + 16 * (c0 + c));
        for (int64_t kp2 = 0; kp2 < kKeyTile / 2; ++kp2) {
          __m512bh v[4];
          for (int64_t c = 0; c < nc; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vt + (kp2 * chunks + c0 + c) * 32);
          for (int64_t i = 0; i < n; ++i) {
            const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair_at(p16[r0 + i] + 2 * kp2));
            for (int64_t c = 0; c < nc; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pp, v[c]);
          }
        }
        for (int64_t i = 0; i < n; ++i)
          for (int64_t c = 0; c < nc; ++c) _mm512_storeu_ps(o[r0 + i] + 16 * (c0 + c), acc[i][c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(l[r] > 0.f ? 1.f / l[r] : 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(inv, _mm512_loadu_ps(o[r] + 16 * c)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride + 16 * c), (__m256i)h);
    }
  }
}

}  // namespace

at::Tensor flash_prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                   double scale) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kBFloat16 &&
                  key.scalar_type() == at::kBFloat16 && value.scalar_type() == at::kBFloat16,
              "flash_prefill_attention: bfloat16 CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes(), "flash_prefill_attention: bad shapes");
  const int64_t num_queries = query.size(0), num_heads = query.size(1), dim = query.size(2);
  const int64_t num_keys = key.size(0), num_kv_heads = key.size(1);
  TORCH_CHECK(key.size(2) == dim && dim % 32 == 0 && dim <= 256, "flash_prefill_attention: head_dim must be a multiple of 32, at most 256");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "flash_prefill_attention: heads not a multiple of KV heads");
  TORCH_CHECK(num_keys >= num_queries, "flash_prefill_attention: fewer keys than queries");
  auto q = query.contiguous();
  auto k = key.contiguous();
  auto v = value.contiguous();
  auto out = at::empty_like(q);
  const int64_t context = num_keys - num_queries, group = num_heads / num_kv_heads;
  const int64_t padded = (num_keys + kKeyTile - 1) / kKeyTile * kKeyTile, pairs = dim / 2, chunks = dim / 16;
  // Repack K and V per KV head (zero-padded to whole tiles).
  std::vector<uint16_t> kp(num_kv_heads * padded * dim, 0), vp(num_kv_heads * padded * dim, 0);
  const uint16_t* kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const uint16_t* vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  at::parallel_for(0, num_kv_heads * (padded / 16), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / (padded / 16), tile = task % (padded / 16);
      uint16_t* kt = kp.data() + h * padded * dim + tile * pairs * 32;
      uint16_t* vt = vp.data() + h * padded * dim + (tile * 8) * chunks * 32;
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t key_index = tile * 16 + j;
        if (key_index >= num_keys) break;
        const uint16_t* krow = kd + (key_index * num_kv_heads + h) * dim;
        const uint16_t* vrow = vd + (key_index * num_kv_heads + h) * dim;
        for (int64_t d2 = 0; d2 < pairs; ++d2) {
          kt[(d2 * 16 + j) * 2] = krow[2 * d2];
          kt[(d2 * 16 + j) * 2 + 1] = krow[2 * d2 + 1];
        }
        const int64_t pair = j / 2, e = j % 2;
        for (int64_t d = 0; d < dim; ++d) vt[((pair * chunks + d / 16) * 16 + d % 16) * 2 + e] = vrow[d];
      }
    }
  });
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t blocks = (num_queries + kQueryBlock - 1) / kQueryBlock;
  // Later query blocks see more keys: hand out the largest first for an even split.
  at::parallel_for(0, num_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = blocks - 1 - task / num_heads, head = task % num_heads, kv_head = head / group;
      const int64_t first = block * kQueryBlock, rows = std::min(kQueryBlock, num_queries - first);
      flash_block(qd + (first * num_heads + head) * dim, num_heads * dim, rows, context + first, num_keys,
                  kp.data() + kv_head * padded * dim, vp.data() + kv_head * padded * dim, dim,
                  static_cast<float>(scale), od + (first * num_heads + head) * dim, num_heads * dim);
    }
  });
  return out;
}

bool has_flash_prefill() { return true; }

#else  // no AVX512-BF16: the Python side keeps torch's SDPA

at::Tensor flash_prefill_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  TORCH_CHECK(false, "flash_prefill_attention needs AVX512-BF16");
}

bool has_flash_prefill() { return false; }

#endif
