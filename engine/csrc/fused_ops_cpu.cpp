// Fused elementwise ops of the Llama block for bf16 and float32 activations on the CPU: one pass
// over memory each where the torch expressions they replace make 3-8 (every torch op reads and
// writes the whole activation, and RMSNorm's fp32 statistics add two conversions). Written once
// over the simd:: layer (simd_math.h), so AVX2-only CPUs run them too, computing in fp32 on 8 lanes.
//
// Rounding contract: each op rounds to the activation's dtype exactly where the torch expression
// in engine/model/fused_ops.py rounds (the same as transformers), so `rotary_embedding` and
// `silu_and_mul`'s multiply are bit-identical to it; RMSNorm's sum of squares and silu's exp are
// computed in a different order / with a different polynomial, which can move a result by one
// ulp of the dtype. Rows must be contiguous in the last dimension.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "simd_math.h"

#include <cmath>
#include <type_traits>
#include <vector>

#if defined(PDSERVE_SIMD)
namespace {
using simd::F;
using BF16 = c10::BFloat16;

// A value of the activation type T as the torch expression holds it: rounded to bf16 for bf16
// activations, as computed for float32 ones.
template <typename T>
inline F held(F x) {
  if constexpr (std::is_same_v<T, BF16>) return simd::round_bf16(x);
  else return x;
}

// out[i] = f(a[i], b[i]) over n elements of T (f on fp32 vectors), the tail as a partial vector.
// `out` may be `a` or `b`.
template <typename T, typename Fn>
inline void map2_row(const T* a, const T* b, T* out, int64_t n, Fn f) {
  int64_t i = 0;
  for (; i + simd::W <= n; i += simd::W) simd::store(out + i, f(simd::load(a + i), simd::load(b + i)));
  if (i < n) simd::store_n(out + i, f(simd::load_n(a + i, n - i), simd::load_n(b + i, n - i)), n - i);
}

// out = T(w * T(x * 1/sqrt(mean(x^2) + eps))) for one row of `hidden` elements.
template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t hidden, float eps) {
  F acc = simd::zero();
  int64_t i = 0;
  for (; i + simd::W <= hidden; i += simd::W) {
    const F v = simd::load(x + i);
    acc = simd::fmadd(v, v, acc);
  }
  if (i < hidden) {
    const F v = simd::load_n(x + i, hidden - i);
    acc = simd::fmadd(v, v, acc);
  }
  const float inv = 1.f / std::sqrt(simd::reduce_add(acc) / static_cast<float>(hidden) + eps);
  const F iv = simd::set1(inv);
  map2_row(w, x, out, hidden, [&](F wv, F xv) { return simd::mul(wv, held<T>(simd::mul(xv, iv))); });
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat), op,
              ": bf16 or float32 CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": expected [tokens, hidden] rows, contiguous in hidden");
}

void check_weight(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == x.size(1), op,
              ": weight must be a contiguous vector of the hidden size, in the activation's dtype");
}

// Rows per parallel task: small batches (a decode step) stay on the calling thread.
int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(row_elems, 1)); }

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, float eps) {
  const int64_t tokens = x.size(0), hidden = x.size(1), stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tokens, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_norm_row(xp + t * stride, wp, op + t * hidden, hidden, eps);
  });
}

template <typename T>
void add_rms_norm_rows(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, at::Tensor& out,
                       float eps) {
  const int64_t tokens = x.size(0), hidden = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  const T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tokens, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* rr = rp + t * rs;
      map2_row(rr, xp + t * xs, rr, hidden, [](F r, F v) { return simd::add(r, v); });
      rms_norm_row(rr, wp, op + t * hidden, hidden, eps);
    }
  });
}

// silu(g) = g / (1 + exp(-g)) in fp32, held as T (F.silu), then times up, held as T.
template <typename T>
void silu_and_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t tokens = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const F one = simd::set1(1.f);
  auto silu_mul = [&](F g, F u) {
    const F s = simd::div(g, simd::add(one, simd::exp(simd::sub(simd::zero(), g))));
    return simd::mul(held<T>(s), u);
  };
  at::parallel_for(0, tokens, grain_rows(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gp + t * stride;
      map2_row(g, g + inter, op + t * inter, inter, silu_mul);
    }
  });
}

// out = T(T(x * c) + T(rotate_half(x) * s)), with c, s the caches held as T (once per token, for
// all of its heads). For float32 nothing is rounded in between and no product is fused into an
// add (the library is compiled with -ffp-contract=off): bit-identical to torch's expression.
template <typename T>
void rotary_rows(const int64_t* pp, const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos_cache,
                 const at::Tensor& sin_cache, at::Tensor& q_out, at::Tensor& k_out) {
  const int64_t tokens = query.size(0), dim = query.size(2), half = dim / 2;
  const float* cp = cos_cache.data_ptr<float>();
  const float* sp = sin_cache.data_ptr<float>();
  auto rotate = [&](const T* src, int64_t heads, int64_t head_stride, T* dst, const float* c, const float* s) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* x = src + h * head_stride;
      T* o = dst + h * dim;
      for (int64_t i = 0; i < dim; i += simd::W) {
        const bool first = i < half;
        F rot = simd::load(x + (first ? i + half : i - half));
        if (first) rot = simd::sub(simd::zero(), rot);
        const F a = held<T>(simd::mul(simd::load(x + i), simd::load(c + i)));
        const F b = held<T>(simd::mul(rot, simd::load(s + i)));
        simd::store(o + i, simd::add(a, b));
      }
    }
  };
  const T* qp = query.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  T* qo = q_out.data_ptr<T>();
  T* ko = k_out.data_ptr<T>();
  const int64_t hq = query.size(1), hk = key.size(1);
  at::parallel_for(0, tokens, grain_rows((hq + hk) * dim), [&](int64_t begin, int64_t end) {
    std::vector<float> cs(2 * dim);
    float* c = cs.data();
    float* s = c + dim;
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < dim; i += simd::W) {
        simd::store(c + i, held<T>(simd::load(cp + pp[t] * dim + i)));
        simd::store(s + i, held<T>(simd::load(sp + pp[t] * dim + i)));
      }
      rotate(qp + t * query.stride(0), hq, query.stride(1), qo + t * hq * dim, c, s);
      rotate(kp + t * key.stride(0), hk, key.stride(1), ko + t * hk * dim, c, s);
    }
  });
}

}  // namespace

bool has_fused_ops() { return true; }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  check_weight(x, weight, "rms_norm");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) rms_norm_rows<float>(x, weight, out, static_cast<float>(eps));
  else rms_norm_rows<BF16>(x, weight, out, static_cast<float>(eps));
  return out;
}

at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(residual, "add_rms_norm_");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm_: x and residual shapes or dtypes differ");
  check_weight(x, weight, "add_rms_norm_");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) add_rms_norm_rows<float>(x, residual, weight, out, static_cast<float>(eps));
  else add_rms_norm_rows<BF16>(x, residual, weight, out, static_cast<float>(eps));
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: the last dimension must be gate|up, even");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) silu_and_mul_rows<float>(gate_up, out);
  else silu_and_mul_rows<BF16>(gate_up, out);
  return out;
}

std::vector<at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                         const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  TORCH_CHECK(query.scalar_type() == key.scalar_type() &&
                  (query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kFloat),
              "rotary_embedding: query and key must both be bf16 or both float32");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.stride(2) == 1 && key.stride(2) == 1 &&
                  query.size(0) == key.size(0) && query.size(2) == key.size(2),
              "rotary_embedding: expected query [T, Hq, D] and key [T, Hk, D], contiguous in D");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
                  cos_cache.is_contiguous() && sin_cache.is_contiguous() && cos_cache.size(1) == query.size(2),
              "rotary_embedding: cos/sin caches must be contiguous fp32 [positions, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == query.size(0),
              "rotary_embedding: one int64 position per token");
  const int64_t tokens = query.size(0), dim = query.size(2);
  TORCH_CHECK(dim % 32 == 0, "rotary_embedding: head_dim must be a multiple of 32");
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rotary_embedding: position ", pp[t], " is outside the cache");
  auto q_out = at::empty({tokens, query.size(1), dim}, query.options());
  auto k_out = at::empty({tokens, key.size(1), dim}, key.options());
  if (query.scalar_type() == at::kFloat) rotary_rows<float>(pp, query, key, cos_cache, sin_cache, q_out, k_out);
  else rotary_rows<BF16>(pp, query, key, cos_cache, sin_cache, q_out, k_out);
  return {q_out, k_out};
}

#else  // no AVX2 or AVX-512: the model keeps its torch expressions

bool has_fused_ops() { return false; }

static void unavailable() { TORCH_CHECK(false, "pdserve's fused ops need AVX2 + FMA or AVX-512; use the torch path"); }
at::Tensor rms_norm(const at::Tensor&, const at::Tensor&, double) { unavailable(); return {}; }
at::Tensor add_rms_norm_(const at::Tensor&, at::Tensor&, const at::Tensor&, double) { unavailable(); return {}; }
at::Tensor silu_and_mul(const at::Tensor&) { unavailable(); return {}; }
std::vector<at::Tensor> rotary_embedding(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&) {
  unavailable();
  return {};
}

#endif
