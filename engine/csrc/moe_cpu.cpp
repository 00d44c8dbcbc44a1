// A mixture-of-experts layer's experts for a decode-sized batch, in one call (engine/model/moe.py
// `run_experts`): for every expert that any token chose, gate|up = x_rows W_gate_up[e]^T (+ bias),
// the gated activation, then W_down[e] (+ bias), scaled by the routing weight and added per token.
// The torch reference (`grouped_experts_torch`) runs one linear pair per chosen expert from a
// Python loop, two small parallel matmuls and a handful of torch ops per expert: at a decode step
// that dispatch adds up to a good part of the time it takes to read the weights.
//
// Each chosen expert's weights are read once per call, all of its tokens together: its slices of
// 4 weight rows stream from memory once (the next slice prefetched into L2) and every group of
// token rows runs over them from L1, as in the small-batch linear kernel (small_linear_cpu.cpp).
// Two parallel phases, so both cores stay busy with a single active expert:
//   1. gate|up + activation: tasks of (expert, 16 intermediate columns), each reading that
//      expert's 16 gate rows and 16 up rows, handed out dynamically (experts hold different
//      numbers of tokens); the activations go to a [pairs, inter] fp32 buffer, pairs sorted by
//      expert (a stable counting sort: within an expert, tokens in their routing order).
//   2. down + combine: tasks of 16 hidden rows (output features), each running every active
//      expert's 16 down rows in ascending expert id order and adding each (token, expert) output,
//      scaled by its weight, into that token's row: so each output is summed in the reference's
//      order (experts ascending, each output scaled then added) and no two tasks write one value.
//
// Rounding: every dot product is taken as small_batch_linear_f32 takes it (fp32 lanes of FMAs over
// K in order, then one horizontal sum), and the rest as the reference's torch expressions round
// it. So in float32, with K a multiple of 16 (where the reference's linear layers use that kernel)
// and SwiGLU, the result is bit-identical to the reference; GeGLU's tanh and gpt-oss's sigmoid are
// evaluated with other polynomials than torch's (a few ulps). bf16 is computed in fp32 (weights
// widened as they stream, on every ISA) and rounded to bf16 wherever the reference rounds (each
// linear layer's output, each step of the activation, the weighted output, each addition), so it
// stays within a bf16 rounding step or two of the reference.
//
// x [T, H] (rows contiguous), weights [T, k] float32, experts [T, k] int64, gate_up [E, 2I, H],
// down [E, H, I], gate_up_bias [E, 2I] / down_bias [E, H] or none; x, the weights and biases all
// float32 or all bf16, contiguous; 1 <= T <= kMaxTokens; any H and I (tails of a partial vector);
// a token may even name one expert twice (its pairs then run in blocks of kBlock rows).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "parallel.h"
#include "simd_math.h"

#include <algorithm>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

namespace {
// The most tokens it takes (`moe_experts_max_tokens()`, the bound engine/model/moe.py dispatches
// by): decode steps. As many rows as the fp32 small-batch linear kernel takes (fused_ops'
// SMALL_LINEAR_F32_MAX_ROWS), above which MKL's sgemm runs each expert's rows faster. Per layer
// (8 experts of 512, hidden 1024, top 2, weights cold; 2-vCPU AMD EPYC, AVX2), kernel against the
// reference: fp32 0.47 vs 0.70 ms at 1 token, 2.0 vs 2.5 at 16, 4.6 vs 5.0 at 64 (at 1-16 tokens
// the kernel reads the weights at 24-26 GB/s, this machine's read bandwidth); bf16 0.25 vs 0.44,
// 1.4 vs 2.2, 4.0 vs 5.9 ms. At 128-256 tokens (measured on a busy machine) the two were even.
constexpr int64_t kMaxTokens = 64;
}

#if defined(PDSERVE_SIMD)
namespace {
using simd::F;
using BF16 = c10::BFloat16;

// A slice is kWRows rows of W times up to kXRows token rows per pass (16 or 8 accumulators), more
// tokens in more passes over the slice, from L1. bf16 weights on AVX2 with more than kXRows tokens
// take slices of 2 rows times up to kWideXRows tokens (12 accumulators) instead, so each weight
// vector is widened once for 6 tokens rather than once per pass: per layer (8 experts of 512,
// hidden 1024, top 2, 2-vCPU EPYC) 1.37 vs 1.65 ms at 16 tokens, 4.0 vs 4.6 at 64. fp32 weights
// gain nothing from it (the narrower slices load x more often): they keep 4-row slices.
constexpr int kWRows = 4;
constexpr int kXRows = simd::W == 16 ? 4 : 2;
constexpr int kWideXRows = simd::W == 16 ? 0 : 6;
constexpr int64_t kCols = 16;                  // columns (gate|up: intermediate; down: hidden) per task
constexpr int64_t kBlock = 64;                 // an expert's (token) rows per pass over a task's weights
constexpr int64_t kSerialBytes = 256 * 1024;   // below this much weight per call, one thread (no fork)

enum class Act { kSilu, kGeluTanh, kClampedSwiglu };

// A value as the reference holds it: rounded to bf16 for bf16 activations, as computed for fp32.
template <typename T>
inline F held(F v) {
  if constexpr (std::is_same_v<T, BF16>) return simd::round_bf16(v);
  else return v;
}
template <typename T>
inline float held1(float v) {
  if constexpr (std::is_same_v<T, BF16>) return static_cast<float>(BF16(v));
  else return v;
}

// part[j][i] = x_j . w_i for NX token rows (fp32, pointers) and NW weight rows (pointers). Lane-wise
// FMAs over K in order, then one horizontal sum per dot: the order small_batch_linear_f32 sums in.
// `pf` (or null): NW rows of the next slice, prefetched into L2 one 64-byte line per row for every
// line of the slice read.
template <int NX, int NW, typename TW>
inline void slice_dot(const TW* const* w, const float* const* x, int64_t k, const TW* const* pf, float (*part)[NW]) {
  constexpr int64_t kLine = 64 / sizeof(TW);
  F acc[NX][NW];
  for (int j = 0; j < NX; ++j)
    for (int i = 0; i < NW; ++i) acc[j][i] = simd::zero();
  int64_t c = 0;
  for (; c + simd::W <= k; c += simd::W) {
    if (pf != nullptr && c % kLine == 0)
      for (int i = 0; i < NW; ++i) _mm_prefetch(reinterpret_cast<const char*>(pf[i] + c), _MM_HINT_T1);
    F wv[NW];
    for (int i = 0; i < NW; ++i) wv[i] = simd::load(w[i] + c);
    for (int j = 0; j < NX; ++j) {
      const F xv = simd::load(x[j] + c);
      for (int i = 0; i < NW; ++i) acc[j][i] = simd::fmadd(wv[i], xv, acc[j][i]);
    }
  }
  if (c < k) {  // a partial vector: zeros past K
    F wv[NW];
    for (int i = 0; i < NW; ++i) wv[i] = simd::load_n(w[i] + c, k - c);
    for (int j = 0; j < NX; ++j) {
      const F xv = simd::load_n(x[j] + c, k - c);
      for (int i = 0; i < NW; ++i) acc[j][i] = simd::fmadd(wv[i], xv, acc[j][i]);
    }
  }
  for (int j = 0; j < NX; ++j)
    for (int i = 0; i < NW; ++i) part[j][i] = simd::reduce_add(acc[j][i]);
}

// slice_dot for a run-time number of token rows g (1 <= g <= G).
template <int G, int NW, typename TW>
inline void slice_dot_g(int64_t g, const TW* const* w, const float* const* x, int64_t k, const TW* const* pf,
                        float (*part)[NW]) {
  if constexpr (G > 1) {
    if (g < G) return slice_dot_g<G - 1, NW>(g, w, x, k, pf, part);
  }
  slice_dot<G, NW>(w, x, k, pf, part);
}

// emit(j, r, x_j . rows[r]) for the m token rows `x` and n weight rows `rows`, NW rows of W at a
// time, tokens G at a time over each (the first pass prefetches the next slice; the others find
// this one in L1).
template <int NW, int G, typename TW, typename Emit>
inline void dot_rows_by(const TW* const* rows, int64_t n, const float* const* x, int64_t m, int64_t k, Emit& emit) {
  float part[G][NW];
  for (int64_t r0 = 0; r0 < n; r0 += NW) {
    const TW* w[NW];
    const TW* pf[NW];
    for (int i = 0; i < NW; ++i) {  // a short slice repeats its last row (and emits it once)
      w[i] = rows[std::min<int64_t>(r0 + i, n - 1)];
      pf[i] = rows[std::min<int64_t>(r0 + NW + i, n - 1)];
    }
    const int64_t valid = std::min<int64_t>(NW, n - r0);
    for (int64_t j0 = 0; j0 < m; j0 += G) {
      const int64_t group = std::min<int64_t>(G, m - j0);
      slice_dot_g<G, NW>(group, w, x + j0, k, j0 == 0 && r0 + NW < n ? pf : nullptr, part);
      for (int64_t j = 0; j < group; ++j)
        for (int64_t i = 0; i < valid; ++i) emit(j0 + j, r0 + i, part[j][i]);
    }
  }
}

template <typename TW, typename Emit>
inline void dot_rows(const TW* const* rows, int64_t n, const float* const* x, int64_t m, int64_t k, Emit emit) {
  if constexpr (kWideXRows > 0 && std::is_same_v<TW, BF16>) {
    if (m > kXRows) return dot_rows_by<2, kWideXRows>(rows, n, x, m, k, emit);
  }
  dot_rows_by<kWRows, kXRows>(rows, n, x, m, k, emit);
}

// The gated activation of one vector of gate and up values (already held as T), as the torch
// expressions of `ExpertActivation` round them.
template <typename T>
inline F activate(Act act, F g, F u, float alpha, float limit) {
  const F one = simd::set1(1.f);
  switch (act) {
    case Act::kSilu: {  // fused_ops.silu_and_mul: silu(g) held, times up
      const F s = simd::div(g, simd::add(one, simd::exp(simd::sub(simd::zero(), g))));
      return held<T>(simd::mul(held<T>(s), u));
    }
    case Act::kGeluTanh: {  // F.gelu(g, approximate="tanh") held, times up
      const F beta = simd::set1(0.7978845608028654f), kappa = simd::set1(0.044715f), half = simd::set1(0.5f);
      const F cube = simd::mul(simd::mul(g, g), g);
      const F inner = simd::mul(beta, simd::add(g, simd::mul(kappa, cube)));
      const F gelu = simd::mul(simd::mul(half, g), simd::add(one, simd::tanh(inner)));
      return held<T>(simd::mul(held<T>(gelu), u));
    }
    case Act::kClampedSwiglu:
    default: {  // (up.clamp(-limit, limit) + 1) * (gate * sigmoid(gate * alpha)), gate.clamp(max=limit)
#if defined(__AVX512F__)
      // min/max return their second operand where either is NaN: NaN stays NaN, as with clamp
      const F gc = _mm512_min_ps(simd::set1(limit), g);
      const F uc = _mm512_max_ps(simd::set1(-limit), _mm512_min_ps(simd::set1(limit), u));
#else
      const F gc = _mm256_min_ps(simd::set1(limit), g);
      const F uc = _mm256_max_ps(simd::set1(-limit), _mm256_min_ps(simd::set1(limit), u));
#endif
      const F z = held<T>(simd::mul(gc, simd::set1(alpha)));
      const F sig = held<T>(simd::div(one, simd::add(one, simd::exp(simd::sub(simd::zero(), z)))));
      const F glu = held<T>(simd::mul(gc, sig));
      return held<T>(simd::mul(held<T>(simd::add(uc, one)), glu));
    }
  }
}

Act parse_activation(const std::string& kind) {
  if (kind == "silu") return Act::kSilu;
  if (kind == "gelu_pytorch_tanh") return Act::kGeluTanh;
  if (kind == "clamped_swiglu") return Act::kClampedSwiglu;
  TORCH_CHECK(false, "moe_experts: unknown activation ", kind, " (silu, gelu_pytorch_tanh, clamped_swiglu)");
  return Act::kSilu;
}

template <typename F_>
void run_tasks(int64_t n, bool serial, const F_& fn) {
  if (serial) {
    for (int64_t task = 0; task < n; ++task) fn(task);
  } else {
    parallel_dynamic(n, fn);
  }
}

template <typename T>
void moe_experts_impl(const float* xf, int64_t tokens, int64_t top_k, const float* route_w, const int64_t* route_e,
                      const T* gate_up, const T* down, const T* gate_up_bias, const T* down_bias, int64_t num_experts,
                      int64_t hidden, int64_t inter, Act act, float alpha, float limit, float* out) {
  // (token, expert) pairs sorted by expert, stably: per expert, its tokens in routing order.
  const int64_t pairs = tokens * top_k;
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) ++start[route_e[p] + 1];
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> pair_token(pairs), fill(start.begin(), start.end() - 1);
  std::vector<float> pair_weight(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t slot = fill[route_e[p]]++;
    pair_token[slot] = p / top_k;
    pair_weight[slot] = held1<T>(route_w[p]);  // weights.to(x.dtype)
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < num_experts; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  const int64_t n_active = static_cast<int64_t>(active.size());
  const bool serial = at::get_num_threads() <= 1 ||
                      n_active * 3 * inter * hidden * static_cast<int64_t>(sizeof(T)) < kSerialBytes;

  // Phase 1: act[p] = activation(x[token p] W_gate_up[e]^T + b), tasks of (expert, kCols columns).
  std::vector<float> act_buf(pairs * inter);
  float* actp = act_buf.data();
  const int64_t col_tiles = (inter + kCols - 1) / kCols;
  run_tasks(n_active * col_tiles, serial, [&](int64_t task) {
    const int64_t e = active[task / col_tiles], c0 = (task % col_tiles) * kCols;
    const int64_t cols = std::min<int64_t>(kCols, inter - c0);
    const T* wg = gate_up + e * 2 * inter * hidden;
    const T* rows[2 * kCols];  // the task's gate rows, then its up rows
    for (int64_t c = 0; c < cols; ++c) {
      rows[c] = wg + (c0 + c) * hidden;
      rows[cols + c] = wg + (inter + c0 + c) * hidden;
    }
    alignas(64) float bias_g[kCols] = {}, bias_u[kCols] = {};
    if (gate_up_bias != nullptr)
      for (int64_t c = 0; c < cols; ++c) {
        bias_g[c] = static_cast<float>(gate_up_bias[e * 2 * inter + c0 + c]);
        bias_u[c] = static_cast<float>(gate_up_bias[e * 2 * inter + inter + c0 + c]);
      }
    alignas(64) float gate[kBlock][kCols], up[kBlock][kCols];
    const float* x_rows[kBlock];
    for (int64_t b0 = start[e]; b0 < start[e + 1]; b0 += kBlock) {
      const int64_t m = std::min<int64_t>(kBlock, start[e + 1] - b0);
      for (int64_t j = 0; j < m; ++j) x_rows[j] = xf + pair_token[b0 + j] * hidden;
      if (cols < kCols)  // lanes past `cols` go through the activation too (and are not stored)
        for (int64_t j = 0; j < m; ++j) std::fill(gate[j], gate[j] + kCols, 0.f), std::fill(up[j], up[j] + kCols, 0.f);
      dot_rows(rows, 2 * cols, x_rows, m, hidden, [&](int64_t j, int64_t r, float dot) {
        if (r < cols) gate[j][r] = dot;
        else up[j][r - cols] = dot;
      });
      // bias, held as the linear layer's output, then the activation, a vector at a time
      for (int64_t j = 0; j < m; ++j) {
        float* dst = actp + (b0 + j) * inter + c0;
        for (int64_t c = 0; c < cols; c += simd::W) {
          const F g = held<T>(simd::add(simd::load(gate[j] + c), simd::load(bias_g + c)));
          const F u = held<T>(simd::add(simd::load(up[j] + c), simd::load(bias_u + c)));
          const F a = activate<T>(act, g, u, alpha, limit);
          if (cols - c >= simd::W) simd::store(dst + c, a);
          else simd::store_n(dst + c, a, cols - c);
        }
      }
    }
  });

  // Phase 2: out[t] += w_p (act[p] W_down[e]^T + b), tasks of kCols hidden rows over every active
  // expert in ascending order.
  const int64_t row_tiles = (hidden + kCols - 1) / kCols;
  run_tasks(row_tiles, serial, [&](int64_t tile) {
    const int64_t n0 = tile * kCols, rows_here = std::min<int64_t>(kCols, hidden - n0);
    const float* a_rows[kBlock];
    for (int64_t e : active) {
      const T* rows[kCols];
      for (int64_t r = 0; r < rows_here; ++r) rows[r] = down + (e * hidden + n0 + r) * inter;
      for (int64_t b0 = start[e]; b0 < start[e + 1]; b0 += kBlock) {
        const int64_t m = std::min<int64_t>(kBlock, start[e + 1] - b0);
        for (int64_t j = 0; j < m; ++j) a_rows[j] = actp + (b0 + j) * inter;
        dot_rows(rows, rows_here, a_rows, m, inter, [&](int64_t j, int64_t r, float dot) {
          const int64_t n = n0 + r;
          const float b = down_bias != nullptr ? static_cast<float>(down_bias[e * hidden + n]) : 0.f;
          const float y = held1<T>(dot + b);                      // the linear layer's output
          const float scaled = held1<T>(y * pair_weight[b0 + j]);  // times the routing weight
          float& o = out[pair_token[b0 + j] * hidden + n];
          o = held1<T>(o + scaled);                                // index_add_, experts ascending
        });
      }
    }
  });
}

void check_weight(const at::Tensor& t, const at::Tensor& x, std::initializer_list<int64_t> shape, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == x.scalar_type(), "moe_experts: ", name,
              " must be a CPU tensor of x's dtype");
  TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), "moe_experts: ", name, " has shape ", t.sizes(),
              ", expected ", at::IntArrayRef(shape));
  TORCH_CHECK(t.is_contiguous(), "moe_experts: ", name, " must be contiguous");
}

}  // namespace

// Its 16-lane (AVX-512) build has not yet run on an AVX-512 machine (none was at hand when it was
// written): there it reports itself absent, so callers keep the torch reference, until checked on
// one. PDSERVE_CPU_ISA=avx2 builds the 8-lane path, tested on AVX2 machines, for any x86-64-v3 CPU.
bool has_moe_experts() {
#if defined(__AVX512F__)
  return false;
#else
  return true;
#endif
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& experts,
                       const at::Tensor& gate_up, const at::Tensor& down, const c10::optional<at::Tensor>& gate_up_bias,
                       const c10::optional<at::Tensor>& down_bias, const std::string& activation, double alpha,
                       double limit) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_experts: x must be a float32 or bf16 CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "moe_experts: x must be [tokens, hidden], rows contiguous");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(tokens >= 1 && tokens <= kMaxTokens, "moe_experts: 1 to ", kMaxTokens, " tokens, got ", tokens);
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(1) % 2 == 0,
              "moe_experts: gate_up must be [experts, 2 * inter, hidden]");
  const int64_t num_experts = gate_up.size(0), inter = gate_up.size(1) / 2;
  check_weight(gate_up, x, {num_experts, 2 * inter, hidden}, "gate_up");
  check_weight(down, x, {num_experts, hidden, inter}, "down");
  const bool has_gu_bias = gate_up_bias.has_value() && gate_up_bias->defined();
  const bool has_down_bias = down_bias.has_value() && down_bias->defined();
  if (has_gu_bias) check_weight(*gate_up_bias, x, {num_experts, 2 * inter}, "gate_up_bias");
  if (has_down_bias) check_weight(*down_bias, x, {num_experts, hidden}, "down_bias");
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.dim() == 2 && experts.size(0) == tokens,
              "moe_experts: experts must be int64 [tokens, top_k]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == experts.sizes(),
              "moe_experts: weights must be float32 [tokens, top_k]");
  const Act act = parse_activation(activation);
  const at::Tensor route_e = experts.contiguous(), route_w = weights.contiguous();
  const int64_t top_k = experts.size(1);
  const int64_t* ep = route_e.data_ptr<int64_t>();
  for (int64_t p = 0; p < tokens * top_k; ++p)
    TORCH_CHECK(ep[p] >= 0 && ep[p] < num_experts, "moe_experts: expert id ", ep[p], " out of range");

  const at::Tensor xf = x.to(at::kFloat).contiguous();  // bf16: widened once (a few rows)
  at::Tensor out = at::zeros({tokens, hidden}, x.options().dtype(at::kFloat));
  auto run = [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    moe_experts_impl<T>(xf.data_ptr<float>(), tokens, top_k, route_w.data_ptr<float>(), ep, gate_up.data_ptr<T>(),
                        down.data_ptr<T>(), has_gu_bias ? gate_up_bias->data_ptr<T>() : nullptr,
                        has_down_bias ? down_bias->data_ptr<T>() : nullptr, num_experts, hidden, inter, act,
                        static_cast<float>(alpha), static_cast<float>(limit), out.data_ptr<float>());
  };
  if (x.scalar_type() == at::kBFloat16) {
    run(BF16());
    return out.to(at::kBFloat16);  // exact: every value is already held as bf16
  }
  run(0.f);
  return out;
}

#else  // no AVX2 or AVX-512: run_experts keeps the torch reference

bool has_moe_experts() { return false; }

at::Tensor moe_experts(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, const std::string&, double,
                       double) {
  TORCH_CHECK(false, "moe_experts needs AVX2 + FMA or AVX-512; use grouped_experts_torch");
  return {};
}

#endif

int64_t moe_experts_max_tokens() { return kMaxTokens; }
