// Fused elementwise ops of the Llama block for bf16 activations on the CPU: one pass over memory
// each where the torch expressions they replace make 3-8 (every torch op reads and writes the
// whole activation, and RMSNorm's fp32 statistics add two conversions).
//
// Rounding contract: each op rounds to bf16 exactly where the torch expression in
// engine/model/llama.py and engine/model/rope.py rounds (the same as transformers), so
// `rotary_embedding` and `silu_and_mul`'s multiply are bit-identical to it; RMSNorm's sum of
// squares and silu's exp are computed in a different order / with a different polynomial, which
// can move a result by one bf16 ulp. Rows must be contiguous in the last dimension.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "simd_math.h"

#include <cmath>
#include <vector>

#if defined(__AVX512F__)
namespace {

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

inline __m512 round_bf16(__m512 x) {  // x rounded to bf16 and widened back
  return widen_bf16(to_bf16(x));
}

inline void store_bf16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x));
}

inline void store_bf16_masked(c10::BFloat16* p, __m512 x, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16(x)); }

// out[i] = f(a[i], b[i]) over n bf16 elements (f on fp32 vectors), the tail under a mask.
// `out` may be `a` or `b`.
template <typename F>
inline void map2_row(const c10::BFloat16* a, const c10::BFloat16* b, c10::BFloat16* out, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store_bf16(out + i, f(load_bf16(a + i), load_bf16(b + i)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    store_bf16_masked(out + i, f(load_bf16_masked(a + i, m), load_bf16_masked(b + i, m)), m);
  }
}

// out = bf16(w * bf16(x * 1/sqrt(mean(x^2) + eps))) for one row of `hidden` elements.
void rms_norm_row(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* out, int64_t hidden, float eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= hidden; i += 16) {
    const __m512 v = load_bf16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  if (i < hidden) {
    const __m512 v = load_bf16_masked(x + i, tail_mask(hidden - i));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(hidden) + eps);
  const __m512 iv = _mm512_set1_ps(inv);
  map2_row(w, x, out, hidden, [&](__m512 wv, __m512 xv) { return _mm512_mul_ps(wv, round_bf16(_mm512_mul_ps(xv, iv))); });
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, op, ": bf16 CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": expected [tokens, hidden] rows, contiguous in hidden");
}

// Rows per parallel task: small batches (a decode step) stay on the calling thread.
int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(row_elems, 1)); }

}  // namespace

bool has_fused_ops() { return true; }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: weight must be a contiguous bf16 vector of the hidden size");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  auto out = at::empty({tokens, hidden}, x.options());
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = weight.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, tokens, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_norm_row(xp + t * stride, wp, op + t * hidden, hidden, static_cast<float>(eps));
  });
  return out;
}

at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(residual, "add_rms_norm_");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm_: x and residual shapes differ");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == x.size(1),
              "add_rms_norm_: weight must be a contiguous bf16 vector of the hidden size");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  auto out = at::empty({tokens, hidden}, x.options());
  const auto* xp = x.data_ptr<c10::BFloat16>();
  auto* rp = residual.data_ptr<c10::BFloat16>();
  const auto* wp = weight.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, tokens, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      c10::BFloat16* rr = rp + t * rs;
      map2_row(rr, xp + t * xs, rr, hidden, [](__m512 r, __m512 v) { return _mm512_add_ps(r, v); });
      rms_norm_row(rr, wp, op + t * hidden, hidden, static_cast<float>(eps));
    }
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: the last dimension must be gate|up, even");
  const int64_t tokens = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({tokens, inter}, gate_up.options());
  const auto* gp = gate_up.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t stride = gate_up.stride(0);
  const __m512 one = _mm512_set1_ps(1.f);
  // silu(g) = g / (1 + exp(-g)) in fp32, rounded to bf16 (F.silu on bf16), then times up, rounded.
  auto silu_mul = [&](__m512 g, __m512 u) {
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    return _mm512_mul_ps(round_bf16(s), u);
  };
  at::parallel_for(0, tokens, grain_rows(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const c10::BFloat16* g = gp + t * stride;
      map2_row(g, g + inter, op + t * inter, inter, silu_mul);
    }
  });
  return out;
}

std::vector<at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                         const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16,
              "rotary_embedding: bf16 query and key only");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.stride(2) == 1 && key.stride(2) == 1 &&
                  query.size(0) == key.size(0) && query.size(2) == key.size(2),
              "rotary_embedding: expected query [T, Hq, D] and key [T, Hk, D], contiguous in D");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
                  cos_cache.is_contiguous() && sin_cache.is_contiguous() && cos_cache.size(1) == query.size(2),
              "rotary_embedding: cos/sin caches must be contiguous fp32 [positions, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == query.size(0),
              "rotary_embedding: one int64 position per token");
  const int64_t tokens = query.size(0), dim = query.size(2), half = dim / 2;
  TORCH_CHECK(dim % 32 == 0, "rotary_embedding: head_dim must be a multiple of 32");
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rotary_embedding: position ", pp[t], " is outside the cache");
  auto q_out = at::empty({tokens, query.size(1), dim}, query.options());
  auto k_out = at::empty({tokens, key.size(1), dim}, key.options());
  const float* cp = cos_cache.data_ptr<float>();
  const float* sp = sin_cache.data_ptr<float>();
  // out = bf16(bf16(x * c) + bf16(rotate_half(x) * s)), with c, s the caches rounded to bf16
  // (once per token, for all of its heads).
  auto rotate = [&](const c10::BFloat16* src, int64_t heads, int64_t head_stride, c10::BFloat16* dst, const float* c,
                    const float* s) {
    for (int64_t h = 0; h < heads; ++h) {
      const c10::BFloat16* x = src + h * head_stride;
      c10::BFloat16* o = dst + h * dim;
      for (int64_t i = 0; i < dim; i += 16) {
        const bool first = i < half;
        __m512 rot = load_bf16(x + (first ? i + half : i - half));
        if (first) rot = _mm512_sub_ps(_mm512_setzero_ps(), rot);
        const __m512 a = round_bf16(_mm512_mul_ps(load_bf16(x + i), _mm512_loadu_ps(c + i)));
        const __m512 b = round_bf16(_mm512_mul_ps(rot, _mm512_loadu_ps(s + i)));
        store_bf16(o + i, _mm512_add_ps(a, b));
      }
    }
  };
  const auto* qp = query.data_ptr<c10::BFloat16>();
  const auto* kp = key.data_ptr<c10::BFloat16>();
  auto* qo = q_out.data_ptr<c10::BFloat16>();
  auto* ko = k_out.data_ptr<c10::BFloat16>();
  const int64_t hq = query.size(1), hk = key.size(1);
  at::parallel_for(0, tokens, grain_rows((hq + hk) * dim), [&](int64_t begin, int64_t end) {
    std::vector<float> cs(2 * dim);
    float* c = cs.data();
    float* s = c + dim;
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < dim; i += 16) {
        _mm512_storeu_ps(c + i, round_bf16(_mm512_loadu_ps(cp + pp[t] * dim + i)));
        _mm512_storeu_ps(s + i, round_bf16(_mm512_loadu_ps(sp + pp[t] * dim + i)));
      }
      rotate(qp + t * query.stride(0), hq, query.stride(1), qo + t * hq * dim, c, s);
      rotate(kp + t * key.stride(0), hk, key.stride(1), ko + t * hk * dim, c, s);
    }
  });
  return {q_out, k_out};
}

#else  // no AVX-512: the model keeps its torch expressions

bool has_fused_ops() { return false; }

static void unavailable() { TORCH_CHECK(false, "pdserve's fused ops need AVX-512; use the torch path"); }
at::Tensor rms_norm(const at::Tensor&, const at::Tensor&, double) { unavailable(); return {}; }
at::Tensor add_rms_norm_(const at::Tensor&, at::Tensor&, const at::Tensor&, double) { unavailable(); return {}; }
at::Tensor silu_and_mul(const at::Tensor&) { unavailable(); return {}; }
std::vector<at::Tensor> rotary_embedding(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&) {
  unavailable();
  return {};
}

#endif
