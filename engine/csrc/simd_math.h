// SIMD helpers shared by the native CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstddef>
#include <cstdint>

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
// (relative error ~2e-9 there), times 2^n. Inputs below -87 give ~0 rather than denormals.
inline __m512 exp16(__m512 x) {
  static constexpr float kTaylor[] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
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
#endif
