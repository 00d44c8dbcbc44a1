// Paged decode attention over an 8-bit KV cache (engine/kv_quant.py): one query token per
// sequence, the 8-bit K/V read in place through the block table and widened to fp32 a row at a
// time, so a step reads one byte per cached value instead of the model dtype's two or four.
//
// kv_cache [num_blocks, block_bytes] uint8; each block: values [2, block_size, num_kv_heads,
// head_dim] (int8, or fp8 e4m3 bits), then float32 scales [2, num_kv_heads]. A value reads as
// q * scale: for K the block's scale multiplies a whole row's dot product, for V it multiplies
// the softmax weight. query/out [num_seqs, num_heads, head_dim] (float32, bfloat16 or float16);
// block_tables [num_seqs, width] int32; seq_lens [num_seqs] int32. GQA as in paged_decode_cpu.cpp.
// Work: one item per (sequence, KV head), longest sequences first.
#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>

#include "parallel.h"
#include "row_ops.h"
#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

// fp8 e4m3 bits b -> the fp16 bits of b's value / 256: sign to bit 15, exponent and mantissa
// shifted by 7 (e4m3's bias is 7, fp16's 15: the shift scales by 2^-8 for normal and subnormal
// values alike; e4m3fn has no infinities, and quantization never writes its NaN).
constexpr float kFp8Unscale = 256.f;
constexpr int64_t kMaxGroup = 16;  // query heads per KV head on the register path

inline void widen_int8(const int8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(src + i)))));
#elif defined(PDSERVE_SIMD)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                  reinterpret_cast<const __m128i*>(src + i)))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// dst = the e4m3 values / 256 (kFp8Unscale goes into the scale).
inline void widen_fp8(const uint8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
  }
#elif defined(PDSERVE_SIMD)
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i)
    dst[i] = static_cast<float>(c10::Float8_e4m3fn(src[i], c10::Float8_e4m3fn::from_bits())) / kFp8Unscale;
}

using row_ops::axpy;
using row_ops::dot;
using row_ops::exp_shifted;

template <typename T>
void decode_8bit(at::Tensor& out, const at::Tensor& query, const at::Tensor& cache, const at::Tensor& tables,
                 const at::Tensor& lens_t, double scale, int64_t block_size, int64_t num_kv_heads, bool fp8) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t group = num_heads / num_kv_heads, block_bytes = cache.size(1), width = tables.size(1);
  const int64_t token_bytes = num_kv_heads * head_dim, values_bytes = 2 * block_size * token_bytes;
  const T* q_ptr = query.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const uint8_t* base = cache.data_ptr<uint8_t>();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  const float unscale = fp8 ? kFp8Unscale : 1.f;  // widen_fp8 gives value / 256
  std::vector<int64_t> order(num_seqs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  parallel_dynamic(num_seqs * num_kv_heads, [&](int64_t task) {
    const int64_t seq = order[task / num_kv_heads], h = task % num_kv_heads, len = lens[seq];
    const int32_t* table = table_ptr + seq * width;
    thread_local std::vector<float> q, row, scores, acc, sums;  // reused: no allocation per item
    q.resize(group * head_dim);
    row.resize(head_dim);
    scores.resize(std::max<int64_t>(len, 1) * group);
    acc.assign(group * head_dim, 0.f);
    sums.resize(group);
    const T* q_src = q_ptr + (seq * num_heads + h * group) * head_dim;
    for (int64_t i = 0; i < group * head_dim; ++i) q[i] = static_cast<float>(q_src[i]) * static_cast<float>(scale);
    auto widen = [&](const uint8_t* src) {
      if (fp8) widen_fp8(src, row.data(), head_dim);
      else widen_int8(reinterpret_cast<const int8_t*>(src), row.data(), head_dim);
    };
    // Pass 1: scores[g * len + t] = q_g . k_t
#if defined(PDSERVE_SIMD)
    if (head_dim % simd::W == 0 && group <= kMaxGroup) {
      // W tokens at a time: each token's products stay in a register per query head, and one
      // transpose-and-add tree (simd::hsum) turns W of them into W scores (no reduction per row).
      const int64_t nv = head_dim / simd::W;
      simd::F part[kMaxGroup][simd::W];
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const uint8_t* block = base + static_cast<int64_t>(table[t0 / block_size]) * block_bytes;
        const simd::F k_scale = simd::set1(reinterpret_cast<const float*>(block + values_bytes)[h] * unscale);
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t c0 = 0; c0 < n; c0 += simd::W) {
          const int64_t count = std::min<int64_t>(simd::W, n - c0);
          for (int64_t j = 0; j < simd::W; ++j) {
            if (j >= count) {
              for (int64_t g = 0; g < group; ++g) part[g][j] = simd::zero();
              continue;
            }
            widen(block + (c0 + j) * token_bytes + h * head_dim);
            for (int64_t g = 0; g < group; ++g) {
              const float* qg = q.data() + g * head_dim;
              simd::F a = simd::mul(simd::load(qg), simd::load(row.data()));
              for (int64_t v = 1; v < nv; ++v) a = simd::fmadd(simd::load(qg + v * simd::W), simd::load(row.data() + v * simd::W), a);
              part[g][j] = a;
            }
          }
          for (int64_t g = 0; g < group; ++g)
            simd::store_n(scores.data() + g * len + t0 + c0, simd::mul(simd::hsum(part[g]), k_scale), count);
        }
      }
    } else
#endif
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
      const uint8_t* block = base + static_cast<int64_t>(table[t0 / block_size]) * block_bytes;
      const float k_scale = reinterpret_cast<const float*>(block + values_bytes)[h] * unscale;
      const int64_t n = std::min(block_size, len - t0);
      for (int64_t j = 0; j < n; ++j) {
        widen(block + j * token_bytes + h * head_dim);
        for (int64_t g = 0; g < group; ++g)
          scores[g * len + t0 + j] = dot(q.data() + g * head_dim, row.data(), head_dim) * k_scale;
      }
    }
    for (int64_t g = 0; g < group; ++g) sums[g] = exp_shifted(scores.data() + g * len, len);  // normalized at the end
    // Pass 2: acc_g = sum_t p_t v_t, V's block scale folded into p
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
      const uint8_t* block = base + static_cast<int64_t>(table[t0 / block_size]) * block_bytes;
      const float v_scale = reinterpret_cast<const float*>(block + values_bytes)[num_kv_heads + h] * unscale;
      const int64_t n = std::min(block_size, len - t0);
      for (int64_t j = 0; j < n; ++j) {
        widen(block + (block_size + j) * token_bytes + h * head_dim);
        for (int64_t g = 0; g < group; ++g)
          axpy(scores[g * len + t0 + j] * v_scale, row.data(), acc.data() + g * head_dim, head_dim);
      }
    }
    row_ops::write_normalized(out_ptr + (seq * num_heads + h * group) * head_dim, acc.data(), sums.data(), group,
                              head_dim);
  });
}

}  // namespace

at::Tensor paged_decode_attention_8bit(const at::Tensor& query, const at::Tensor& kv_cache,
                                       const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                       int64_t block_size, int64_t num_kv_heads, bool fp8) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode_attention_8bit: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 2 && kv_cache.scalar_type() == at::kByte,
              "paged_decode_attention_8bit: query [seqs, heads, dim], kv_cache [blocks, block_bytes] uint8");
  TORCH_CHECK(num_kv_heads > 0 && query.size(1) % num_kv_heads == 0, "paged_decode_attention_8bit: heads disagree");
  TORCH_CHECK(kv_cache.size(1) == 2 * block_size * num_kv_heads * query.size(2) + 2 * num_kv_heads * 4,
              "paged_decode_attention_8bit: block_bytes disagree with block_size, heads and head_dim");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode_attention_8bit: block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              "paged_decode_attention_8bit: one block table and length per query");
  auto q = query.contiguous();
  auto cache = kv_cache.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: decode_8bit<float>(out, q, cache, tables, lens, scale, block_size, num_kv_heads, fp8); break;
    case at::kBFloat16:
      decode_8bit<c10::BFloat16>(out, q, cache, tables, lens, scale, block_size, num_kv_heads, fp8);
      break;
    case at::kHalf: decode_8bit<c10::Half>(out, q, cache, tables, lens, scale, block_size, num_kv_heads, fp8); break;
    default: TORCH_CHECK(false, "paged_decode_attention_8bit: dtype ", q.scalar_type(), " is not float32/bfloat16/float16");
  }
  return out;
}
