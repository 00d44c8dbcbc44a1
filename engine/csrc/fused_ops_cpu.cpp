// Fused elementwise ops of the Llama block for bf16 activations on the CPU: one pass over memory
// each where the torch expressions they replace make 3-8 (every torch op reads and writes the
// whole activation, and RMSNorm's fp32 statistics add two conversions). Written once over the
// simd:: layer (simd_math.h), so AVX2-only CPUs run them too, computing in fp32 on 8 lanes.
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

#if defined(PDSERVE_SIMD)
namespace {
using simd::F;
using BF16 = c10::BFloat16;

// out[i] = f(a[i], b[i]) over n bf16 elements (f on fp32 vectors), the tail as a partial vector.
// `out` may be `a` or `b`.
template <typename Fn>
inline void map2_row(const BF16* a, const BF16* b, BF16* out, int64_t n, Fn f) {
  int64_t i = 0;
  for (; i + simd::W <= n; i += simd::W) simd::store(out + i, f(simd::load(a + i), simd::load(b + i)));
  if (i < n) simd::store_n(out + i, f(simd::load_n(a + i, n - i), simd::load_n(b + i, n - i)), n - i);
}

// out = bf16(w * bf16(x * 1/sqrt(mean(x^2) + eps))) for one row of `hidden` elements.
void rms_norm_row(const BF16* x, const BF16* w, BF16* out, int64_t hidden, float eps) {
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
  map2_row(w, x, out, hidden, [&](F wv, F xv) { return simd::mul(wv, simd::round_bf16(simd::mul(xv, iv))); });
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
  const auto* xp = x.data_ptr<BF16>();
  const auto* wp = weight.data_ptr<BF16>();
  auto* op = out.data_ptr<BF16>();
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
  const auto* xp = x.data_ptr<BF16>();
  auto* rp = residual.data_ptr<BF16>();
  const auto* wp = weight.data_ptr<BF16>();
  auto* op = out.data_ptr<BF16>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, tokens, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      BF16* rr = rp + t * rs;
      map2_row(rr, xp + t * xs, rr, hidden, [](F r, F v) { return simd::add(r, v); });
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
  const auto* gp = gate_up.data_ptr<BF16>();
  auto* op = out.data_ptr<BF16>();
  const int64_t stride = gate_up.stride(0);
  const F one = simd::set1(1.f);
  // silu(g) = g / (1 + exp(-g)) in fp32, rounded to bf16 (F.silu on bf16), then times up, rounded.
  auto silu_mul = [&](F g, F u) {
    const F s = simd::div(g, simd::add(one, simd::exp(simd::sub(simd::zero(), g))));
    return simd::mul(simd::round_bf16(s), u);
  };
  at::parallel_for(0, tokens, grain_rows(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const BF16* g = gp + t * stride;
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
  auto rotate = [&](const BF16* src, int64_t heads, int64_t head_stride, BF16* dst, const float* c,
                    const float* s) {
    for (int64_t h = 0; h < heads; ++h) {
      const BF16* x = src + h * head_stride;
      BF16* o = dst + h * dim;
      for (int64_t i = 0; i < dim; i += simd::W) {
        const bool first = i < half;
        F rot = simd::load(x + (first ? i + half : i - half));
        if (first) rot = simd::sub(simd::zero(), rot);
        const F a = simd::round_bf16(simd::mul(simd::load(x + i), simd::load(c + i)));
        const F b = simd::round_bf16(simd::mul(rot, simd::load(s + i)));
        simd::store(o + i, simd::add(a, b));
      }
    }
  };
  const auto* qp = query.data_ptr<BF16>();
  const auto* kp = key.data_ptr<BF16>();
  auto* qo = q_out.data_ptr<BF16>();
  auto* ko = k_out.data_ptr<BF16>();
  const int64_t hq = query.size(1), hk = key.size(1);
  at::parallel_for(0, tokens, grain_rows((hq + hk) * dim), [&](int64_t begin, int64_t end) {
    std::vector<float> cs(2 * dim);
    float* c = cs.data();
    float* s = c + dim;
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < dim; i += simd::W) {
        simd::store(c + i, simd::round_bf16(simd::load(cp + pp[t] * dim + i)));
        simd::store(s + i, simd::round_bf16(simd::load(sp + pp[t] * dim + i)));
      }
      rotate(qp + t * query.stride(0), hq, query.stride(1), qo + t * hq * dim, c, s);
      rotate(kp + t * key.stride(0), hk, key.stride(1), ko + t * hk * dim, c, s);
    }
  });
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
