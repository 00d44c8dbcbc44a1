// y = x W^T for a weight W kept in a GGUF block format (engine/model/quant_linear.py), float32
// activations, for the few rows of a decode step; and W dequantized to float32, for the GEMM of a
// prefill-sized batch.
//
// Formats (ggml's blocks along K; a row of W is its blocks back to back), 32 weights a block:
//   Q4_0 (type 2, 18 bytes): fp16 d, 16 bytes of nibbles;             w = d * (q - 8)
//   Q4_1 (type 3, 20 bytes): fp16 d, fp16 m, 16 bytes;                w = d * q + m
//   Q5_0 (type 6, 22 bytes): fp16 d, 32 high bits, 16 bytes;          w = d * (q - 16)
//   Q5_1 (type 7, 24 bytes): fp16 d, fp16 m, 32 high bits, 16 bytes;  w = d * q + m
//   Q8_0 (type 8, 34 bytes): fp16 d, 32 int8;                         w = d * q
// Byte j's low nibble is weight j of its block, its high nibble weight j + 16; a 5-bit weight j's
// fifth bit is bit j of the 32-bit little-endian word before the nibbles.
// The k-quants pack 256 weights (eight sub-blocks of 32) per block:
//   Q4_K (type 12, 144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
//     nibbles (bytes 32c..32c+31: low nibbles sub-block 2c, high nibbles 2c+1); w = (d sc) q - (dmin m)
//   Q5_K (type 13, 176 bytes): Q4_K's d, dmin and scales, then 32 bytes of fifth bits (bit j of
//     byte l: weight l of sub-block j), then Q4_K's 128 bytes of nibbles; w = (d sc) q - (dmin m)
//   Q6_K (type 14, 210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales
//     (one per 16 weights), fp16 d; w = (d scale) (q - 32)
// A kernel walks a row 32 weights at a time; `dequantize_block` takes the block and the index of
// those 32 weights in it.
//
// Weights are dequantized in registers, each exactly as gguf's reference does it, rounding for
// rounding (Q4_1's d * q + m is a multiply then an add, as numpy does; a k-quant's d * scale is
// rounded once, then multiplies q), and multiplied into fp32 accumulators: the result differs from the reference's (dequantize,
// then matmul) only by the order of the sums. Decode is bound by reading W, here 4.5-8.5 bits a
// weight instead of 32. Rows of x go over each block in groups of four, so each block is read and
// dequantized once per group. W's rows are split over the threads. AVX2 + FMA + F16C (x86-64-v3),
// the ISA every supported machine has; an AVX-512 build runs the same code.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <cstring>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int kGroupRows = 4;

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: TORCH_CHECK(false, "gguf_linear: GGML type ", type,
                         " is not supported (Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, "
                         "Q6_K = 14)");
  }
  return 0;
}

// Weights per block: 256 for the k-quants, else 32.
int64_t block_weights(int64_t type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K ? 256 : kBlock; }

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

// 0x10 in byte j where bit j of the little-endian word at `bits` is set, else 0: each byte
// picks the word's byte j / 8, keeps its bit j % 8 and compares it with that bit.
inline __m256i fifth_bits(const uint8_t* bits) {
  uint32_t word;
  std::memcpy(&word, bits, sizeof(word));
  const __m256i byte_of_j = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                             2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(word)), byte_of_j);
  const __m256i bit_of_j = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit_of_j), bit_of_j);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// Q5_0 / Q5_1: the nibbles with their fifth bits, as four vectors of eight weights.
inline void dequantize_5bit_block(int64_t type, const uint8_t* block, __m256 d, __m256 out[4]) {
  const uint8_t* bits = block + (type == kQ5_1 ? 4 : 2);
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + 4));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low4),
                                           _mm_and_si128(packed, low4));
  const __m256i q = _mm256_or_si256(nibbles, fifth_bits(bits));
  const __m128i low = _mm256_castsi256_si128(q), high = _mm256_extracti128_si256(q, 1);
  const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
  if (type == kQ5_1) {
    const __m256 m = _mm256_set1_ps(fp16_at(block + 2));
    for (int i = 0; i < 4; ++i)
      out[i] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]))), m);
  } else {
    const __m256 sixteen = _mm256_set1_ps(16.0f);
    for (int i = 0; i < 4; ++i)
      out[i] = _mm256_mul_ps(d, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), sixteen));
  }
}

// 32 bytes as four vectors of eight floats, in order.
inline void bytes_to_floats(__m256i bytes, __m256 out[4]) {
  const __m128i low = _mm256_castsi256_si128(bytes), high = _mm256_extracti128_si256(bytes, 1);
  const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
  for (int i = 0; i < 4; ++i) out[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
}

// Q4_K sub-block j: the 6-bit scale and min packed in 12 bytes (ggml's get_scale_min_k4).
inline void q4k_scale_min(const uint8_t* s, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    *min = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

// Q4_K (FifthBits false) and Q5_K sub-block j: (d sc) q - (dmin m), q its nibbles (and fifth bits).
template <bool FifthBits>
inline void dequantize_k4(const uint8_t* block, int j, __m256 out[4]) {
  int scale, min;
  q4k_scale_min(block + 4, j, &scale, &min);
  const __m256 d = _mm256_set1_ps(fp16_at(block) * static_cast<float>(scale));
  const __m256 m = _mm256_set1_ps(fp16_at(block + 2) * static_cast<float>(min));
  const uint8_t* nibbles = block + (FifthBits ? 48 : 16);
  __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + 32 * (j / 2)));
  if (j % 2) q = _mm256_srli_epi16(q, 4);
  q = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
  if (FifthBits) {  // bit j of each of the 32 bytes at 16, moved to 0x10 (no bit crosses a byte)
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(bits, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(0x01));
    q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
  }
  __m256 qf[4];
  bytes_to_floats(q, qf);
  for (int i = 0; i < 4; ++i) out[i] = _mm256_sub_ps(_mm256_mul_ps(d, qf[i]), m);
}

inline void dequantize_q6k(const uint8_t* block, int j, __m256 out[4]) {
  const int half = j / 4, group = j % 4;
  __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * half + 32 * (group & 1)));
  if (group >= 2) low = _mm256_srli_epi16(low, 4);
  low = _mm256_and_si256(low, _mm256_set1_epi8(0x0F));
  const __m256i highs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * half));
  __m256i high = _mm256_and_si256(_mm256_srl_epi16(highs, _mm_cvtsi32_si128(2 * group)), _mm256_set1_epi8(0x03));
  high = _mm256_slli_epi16(high, 4);  // each byte <= 0x30: nothing crosses into the next byte
  __m256 qf[4];
  bytes_to_floats(_mm256_or_si256(low, high), qf);
  const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192) + 8 * half + 2 * group;
  const float d = fp16_at(block + 208);
  const __m256 thirty_two = _mm256_set1_ps(32.0f);
  for (int i = 0; i < 4; ++i) {
    const __m256 scale = _mm256_set1_ps(d * static_cast<float>(scales[i / 2]));  // one scale per 16 weights
    out[i] = _mm256_mul_ps(scale, _mm256_sub_ps(qf[i], thirty_two));
  }
}

// Weights [32 sub, 32 sub + 32) of the block, in order, as four vectors of eight.
inline void dequantize_block(int64_t type, const uint8_t* block, int sub, __m256 out[4]) {
  if (type == kQ4_K) {
    dequantize_k4<false>(block, sub, out);
    return;
  }
  if (type == kQ5_K) {
    dequantize_k4<true>(block, sub, out);
    return;
  }
  if (type == kQ6_K) {
    dequantize_q6k(block, sub, out);
    return;
  }
  const __m256 d = _mm256_set1_ps(fp16_at(block));
  if (type == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int i = 0; i < 4; ++i) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
      out[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
    }
    return;
  }
  if (type == kQ5_0 || type == kQ5_1) {
    dequantize_5bit_block(type, block, d, out);
    return;
  }
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (type == kQ4_1 ? 4 : 2)));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(packed, low4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  if (type == kQ4_1) {
    const __m256 m = _mm256_set1_ps(fp16_at(block + 2));
    for (int i = 0; i < 4; ++i) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
      out[i] = _mm256_add_ps(_mm256_mul_ps(d, q), m);
    }
  } else {
    const __m256 eight = _mm256_set1_ps(8.0f);
    for (int i = 0; i < 4; ++i) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
      out[i] = _mm256_mul_ps(d, _mm256_sub_ps(q, eight));
    }
  }
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// y[r, n] for the `Rows` rows of x at x_rows (stride ldx) and W's rows [n0, n1).
template <int Rows>
void rows_times_weights(const float* x_rows, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t type,
                        int64_t block_size_bytes, int64_t blocks, float* y_rows, int64_t ldy, int64_t n0,
                        int64_t n1) {
  const int64_t subs = block_weights(type) / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 even[Rows], odd[Rows];  // two chains per row of x: the FMA latency overlaps
    for (int r = 0; r < Rows; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {  // b: 32 weights
      __m256 wv[4];
      dequantize_block(type, row + b / subs * block_size_bytes, static_cast<int>(b % subs), wv);
      for (int r = 0; r < Rows; ++r) {
        const float* xb = x_rows + r * ldx + b * kBlock;
        even[r] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xb), even[r]);
        odd[r] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xb + 8), odd[r]);
        even[r] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xb + 16), even[r]);
        odd[r] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xb + 24), odd[r]);
      }
    }
    for (int r = 0; r < Rows; ++r) y_rows[r * ldy + n] = horizontal_sum(_mm256_add_ps(even[r], odd[r]));
  }
}

void check_weight(const at::Tensor& weight, int64_t type, int64_t in_features) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              "gguf_linear: the weight is a contiguous uint8 [out_features, row bytes] tensor");
  const int64_t per_block = block_weights(type);
  TORCH_CHECK(in_features > 0 && in_features % per_block == 0, "gguf_linear: in_features (", in_features,
              ") must be a positive multiple of ", per_block);
  TORCH_CHECK(weight.size(1) == in_features / per_block * block_bytes(type), "gguf_linear: a weight row has ",
              weight.size(1), " bytes, but ", in_features, " weights of type ", type, " take ",
              in_features / per_block * block_bytes(type));
}

}  // namespace

bool has_gguf_linear() { return true; }

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "gguf_linear: x is a float32 [rows, in_features] tensor");
  const int64_t in_features = x.size(1);
  check_weight(weight, type, in_features);
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), out_features = weight.size(0);
  const int64_t block_size_bytes = block_bytes(type), blocks = in_features / kBlock;
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = weight.size(1);
  // ~16 weight rows per task at least: a task reads a few KB of W, enough to amortize its start.
  at::parallel_for(0, out_features, 16, [&](int64_t n0, int64_t n1) {
    int64_t r = 0;
    for (; r + kGroupRows <= rows; r += kGroupRows)
      rows_times_weights<kGroupRows>(xp + r * in_features, in_features, wp, row_bytes, type, block_size_bytes,
                                     blocks, yp + r * out_features, out_features, n0, n1);
    switch (rows - r) {
      case 3: rows_times_weights<3>(xp + r * in_features, in_features, wp, row_bytes, type, block_size_bytes,
                                    blocks, yp + r * out_features, out_features, n0, n1); break;
      case 2: rows_times_weights<2>(xp + r * in_features, in_features, wp, row_bytes, type, block_size_bytes,
                                    blocks, yp + r * out_features, out_features, n0, n1); break;
      case 1: rows_times_weights<1>(xp + r * in_features, in_features, wp, row_bytes, type, block_size_bytes,
                                    blocks, yp + r * out_features, out_features, n0, n1); break;
      default: break;
    }
  });
  return y;
}

at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t type, int64_t in_features) {
  check_weight(weight, type, in_features);
  const int64_t out_features = weight.size(0), row_bytes = weight.size(1);
  const int64_t block_size_bytes = block_bytes(type), blocks = in_features / kBlock;
  at::Tensor w = at::empty({out_features, in_features}, weight.options().dtype(at::kFloat));
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* out = w.data_ptr<float>();
  const int64_t subs = block_weights(type) / kBlock;
  at::parallel_for(0, out_features, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t b = 0; b < blocks; ++b) {
        __m256 wv[4];
        dequantize_block(type, wp + n * row_bytes + b / subs * block_size_bytes, static_cast<int>(b % subs), wv);
        float* dst = out + n * in_features + b * kBlock;
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(dst + 8 * i, wv[i]);
      }
    }
  });
  return w;
}

#else  // not x86-64-v3: engine/model/quant_linear.py dequantizes through gguf instead

bool has_gguf_linear() { return false; }
at::Tensor gguf_linear(const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "gguf_linear needs AVX2, FMA and F16C");
  return at::Tensor();
}
at::Tensor gguf_dequantize(const at::Tensor&, int64_t, int64_t) {
  TORCH_CHECK(false, "gguf_dequantize needs AVX2, FMA and F16C");
  return at::Tensor();
}

#endif
