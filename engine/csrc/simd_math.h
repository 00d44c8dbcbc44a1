// SIMD helpers shared by the native CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>

// The low n lanes (0 <= n <= 16).
inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

// 16 bf16 -> 16 fp32 (bf16 is the top half of an fp32, so a widen and a shift).
inline __m512 widen_bf16(__m256i raw) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)); }
inline __m512 load_bf16(const c10::BFloat16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load_bf16_masked(const c10::BFloat16* p, __mmask16 m) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }

// c[0] + x (c[1] + x (c[2] + ...)) for 16 floats: Horner's rule, coefficients lowest degree first.
template <size_t N>
inline __m512 horner16(__m512 x, const float (&c)[N]) {
  __m512 p = _mm512_set1_ps(c[N - 1]);
  for (size_t i = N - 1; i-- > 0;) p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(c[i]));
  return p;
}

// exp(x) for 16 floats: x = n ln2 + r with |r| <= ln2/2, exp(r) by its degree-7 Taylor polynomial
// (relative error ~2e-9 there), times 2^n. Inputs below -87 give ~0 rather than denormals; inputs
// are clamped to [-87, 89] as on the AVX2 path (above 89 exp is +inf anyway): unclamped, a huge x
// (1e30) cancels catastrophically in x - n ln2, the polynomial of that r overflows to -inf or NaN,
// and silu(-1e30) came out +0 instead of torch's -0.
inline __m512 exp16(__m512 x) {
  static constexpr float kTaylor[] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  return _mm512_scalef_ps(horner16(r, kTaylor), n);
}

// 2^x for 16 floats, for softmaxes kept in log2 units: x = n + f with |f| <= 1/2, 2^f = e^(f ln2)
// by its degree-5 Taylor polynomial (relative error < 3e-6: for probabilities rounded to bf16
// next), times 2^n. Four instructions fewer than exp16. Inputs below -126 give ~0, not denormals.
inline __m512 exp2_16(__m512 x) {
  static constexpr float kTaylor[] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120};
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.69314718055994531f));
  return _mm512_scalef_ps(horner16(f, kTaylor), n);
}

// Lane i of the result = the sum of v[i]'s 16 lanes: a transpose-and-add tree, ~3 instructions per
// sum instead of a full horizontal reduction for each.
inline __m512 hsum16(const __m512* v) {
  __m512 w[8], u[4], r[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// fp32 -> bf16, round to nearest even, NaN -> 0x7FC0: c10::BFloat16's own conversion, 16 lanes.
inline __m256i to_bf16_portable(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

// The same conversion. With AVX512-BF16 it is one vcvtneps2bf16, which rounds the same way but
// keeps a NaN's payload and reads denormal inputs as zero; the (rare) vectors holding either take
// the portable path for those lanes. The conversions were ~a quarter of silu_and_mul's time.
inline __m256i to_bf16(__m512 x) {
#if defined(__AVX512BF16__)
  const __m256i fast = (__m256i)_mm512_cvtneps_pbh(x);
  const __mmask16 odd = _mm512_fpclass_ps_mask(x, 0x01 | 0x20 | 0x80);  // QNaN, denormal, SNaN
  return odd ? _mm256_mask_mov_epi16(fast, odd, to_bf16_portable(x)) : fast;
#else
  return to_bf16_portable(x);
#endif
}
#endif

// One register of fp32 lanes, for kernels written once for both instruction sets (paged decode
// attention, the fused elementwise ops, the small-batch linear layers): 16 lanes on AVX-512, 8 on
// AVX2 + FMA + F16C (any x86-64-v3 CPU). PDSERVE_SIMD is defined where one of them is available;
// elsewhere those kernels take their scalar loops or report themselves unavailable.
#if defined(__AVX512F__)
#define PDSERVE_SIMD 1
namespace simd {
using F = __m512;
constexpr int W = 16;
inline F zero() { return _mm512_setzero_ps(); }
inline F set1(float x) { return _mm512_set1_ps(x); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F load(const float* p) { return _mm512_loadu_ps(p); }
inline F load(const c10::BFloat16* p) { return load_bf16(p); }
inline F load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store(float* p, F x) { _mm512_storeu_ps(p, x); }
inline void store_n(float* p, F x, int64_t n) { _mm512_mask_storeu_ps(p, tail_mask(n), x); }
inline F load_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(tail_mask(n), p); }
inline float reduce_add(F x) { return _mm512_reduce_add_ps(x); }
inline F exp(F x) { return exp16(x); }
inline F hsum(const F* v) { return hsum16(v); }  // lane i = the sum of v[i]'s lanes
inline F div(F a, F b) { return _mm512_div_ps(a, b); }
// tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) in (0, 1] (never overflows); absolute error
// ~1e-7 (relative error grows near 0, where 1 - e cancels: fine for soft-capped logits, whose
// error is absolute). NaN in, NaN out.
inline F tanh(F x) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  const __m512i bits = _mm512_castps_si512(x);
  const F ax = _mm512_castsi512_ps(_mm512_andnot_si512(sign, bits));
  const F e = exp16(_mm512_mul_ps(ax, _mm512_set1_ps(-2.f)));
  const F t = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.f), e), _mm512_add_ps(_mm512_set1_ps(1.f), e));
  const F r = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(sign, bits)));
  return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}
// bf16 rows: tails of n < W lanes read as zeros past n and write only n; rounding is c10's.
inline F load_n(const c10::BFloat16* p, int64_t n) { return load_bf16_masked(p, tail_mask(n)); }
inline void store(c10::BFloat16* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
inline void store_n(c10::BFloat16* p, F x, int64_t n) { _mm256_mask_storeu_epi16(p, tail_mask(n), to_bf16(x)); }
inline F round_bf16(F x) { return widen_bf16(to_bf16(x)); }  // x rounded to bf16, widened back
// 8-bit KV values (engine/kv_quant.py), W at a time: int8 as they are; fp8 e4m3 bits b as b's value
// / 256 (sign to bit 15, exponent and mantissa up by 7 gives fp16 bits: e4m3's bias is 7, fp16's
// 15, so the shift divides by 2^8 for normal and subnormal values alike; e4m3fn has no
// infinities, and quantization never writes its NaN).
inline F load_int8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline F load_e4m3_div256(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7)));
}
}  // namespace simd

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PDSERVE_SIMD 1
namespace simd {
using F = __m256;
constexpr int W = 8;
inline F zero() { return _mm256_setzero_ps(); }
inline F set1(float x) { return _mm256_set1_ps(x); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F load(const float* p) { return _mm256_loadu_ps(p); }
inline F load(const c10::BFloat16* p) {  // bf16 is the top half of an fp32: widen and shift
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline F load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store(float* p, F x) { _mm256_storeu_ps(p, x); }
inline F load_n(const float* p, int64_t n) {
  alignas(32) float lanes[8] = {};
  std::memcpy(lanes, p, n * sizeof(float));
  return _mm256_load_ps(lanes);
}
inline void store_n(float* p, F x, int64_t n) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, x);
  for (int64_t i = 0; i < n; ++i) p[i] = lanes[i];
}
inline float reduce_add(F x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// exp16's method on 8 lanes; 2^n is built in the exponent bits (AVX2 has no scalef), as
// 2^(n - n/2) * 2^(n/2) so that n = 128 (x in (88.38, 89]) is representable: results up to
// FLT_MAX are right and larger ones overflow to +inf as scalef's do. Inputs are clamped to
// [-87, 89] first (above 89, exp is +inf anyway; unclamped, n + 127 would reach the sign bit and
// exp(100) would read -0). Where one factor 2^n fits (x <= 88.38), the product is exact until
// the one rounding both ways share, so those results are bit for bit what a single 2^n gave.
inline F exp(F x) {
  static constexpr float kTaylor[] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};
  x = _mm256_min_ps(_mm256_max_ps(x, set1(-87.f)), set1(89.f));
  const F n = _mm256_round_ps(mul(x, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  F r = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
  F p = set1(kTaylor[7]);
  for (int i = 6; i >= 0; --i) p = fmadd(p, r, set1(kTaylor[i]));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);  // n in [-126, 128]
  const __m256i bias = _mm256_set1_epi32(127);
  const F two_half = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const F two_rest = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
  return mul(mul(p, two_half), two_rest);
}
// Lane i = the sum of v[i]'s 8 lanes (two rounds of pairwise adds, then the 128-bit halves).
inline F hsum(const F* v) {
  const F u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const F u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return add(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline F div(F a, F b) { return _mm256_div_ps(a, b); }
// tanh as on AVX-512 above.
inline F tanh(F x) {
  const F sign = set1(-0.f);
  const F e = exp(mul(_mm256_andnot_ps(sign, x), set1(-2.f)));
  const F r = _mm256_or_ps(div(sub(set1(1.f), e), add(set1(1.f), e)), _mm256_and_ps(sign, x));
  return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
// x's bf16 bits (c10's conversion: round to nearest even, NaN -> 0x7FC0) in each 32-bit lane's low half.
inline __m256i bf16_bits(F x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}
inline __m128i to_bf16(F x) {  // 8 bf16: pack the 32-bit lanes to 16 bits, then join the 128-bit halves
  const __m256i r = bf16_bits(x);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
}
inline F load_n(const c10::BFloat16* p, int64_t n) {
  alignas(16) c10::BFloat16 lanes[8] = {};
  std::memcpy(lanes, p, n * sizeof(c10::BFloat16));
  return load(lanes);
}
inline void store(c10::BFloat16* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
inline void store_n(c10::BFloat16* p, F x, int64_t n) {
  alignas(16) uint16_t lanes[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), to_bf16(x));
  std::memcpy(p, lanes, n * sizeof(uint16_t));
}
inline F round_bf16(F x) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16)); }
// 8-bit KV values, as on AVX-512 above.
inline F load_int8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline F load_e4m3_div256(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                      _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7)));
}
}  // namespace simd
#endif
