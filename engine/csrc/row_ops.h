// Row helpers over fp32 rows shared by the native decode kernels (paged_decode_cpu.cpp,
// paged_decode_8bit_cpu.cpp): dot products, axpy, a shifted exponential for softmaxes.
#pragma once

#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace row_ops {

// dot(a, b) over n floats.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float tail = 0.f;
#if defined(PDSERVE_SIMD)
  simd::F acc = simd::zero();
  for (; i + simd::W <= n; i += simd::W) acc = simd::fmadd(simd::load(a + i), simd::load(b + i), acc);
  tail = simd::reduce_add(acc);
#endif
  for (; i < n; ++i) tail += a[i] * b[i];
  return tail;
}

// y += p * x over n floats.
inline void axpy(float p, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#if defined(PDSERVE_SIMD)
  const simd::F pv = simd::set1(p);
  for (; i + simd::W <= n; i += simd::W) simd::store(y + i, simd::fmadd(pv, simd::load(x + i), simd::load(y + i)));
#endif
  for (; i < n; ++i) y[i] += p * x[i];
}


// x <- exp(x - m) over n floats, m = max(max(x), extra); returns the sum of the results plus
// exp(extra - m). `extra` is an attention sink's logit (one more term of the softmax's
// denominator, none of its outputs); -inf (the default) adds nothing.
inline float exp_shifted(float* x, int64_t n, float extra = -std::numeric_limits<float>::infinity()) {
  float m = extra;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  int64_t i = 0;
  float sum = 0.f;
#if defined(PDSERVE_SIMD)
  const simd::F mv = simd::set1(m);
  simd::F acc = simd::zero();
  for (; i + simd::W <= n; i += simd::W) {
    const simd::F e = simd::exp(simd::sub(simd::load(x + i), mv));
    simd::store(x + i, e);
    acc = simd::add(acc, e);
  }
  sum = simd::reduce_add(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  if (extra != -std::numeric_limits<float>::infinity()) sum += std::exp(extra - m);
  return sum;
}

// x <- cap * tanh(x / cap) over n floats (attention logit soft-capping; cap > 0).
inline void softcap(float* x, int64_t n, float cap) {
  int64_t i = 0;
#if defined(PDSERVE_SIMD)
  const simd::F c = simd::set1(cap);
  for (; i + simd::W <= n; i += simd::W) simd::store(x + i, simd::mul(c, simd::tanh(simd::div(simd::load(x + i), c))));
  if (i < n) {
    simd::store_n(x + i, simd::mul(c, simd::tanh(simd::div(simd::load_n(x + i, n - i), c))), n - i);
    i = n;
  }
#endif
  for (; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

// o[r * n + d] = acc[r * n + d] / sums[r] (0 for an empty softmax) for `rows` rows of n, in T.
template <typename T>
inline void write_normalized(T* o, const float* acc, const float* sums, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = sums[r] > 0.f ? 1.f / sums[r] : 0.f;
    for (int64_t d = 0; d < n; ++d) o[r * n + d] = static_cast<T>(acc[r * n + d] * inv);
  }
}

}  // namespace row_ops
