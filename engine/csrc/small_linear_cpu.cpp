// y = x W^T (+ bias) for a few bf16 rows of x on CPUs with AVX512-BF16: the linear layers of a
// small decode step. There a linear layer is bound by reading W once, and oneDNN, whose packed
// weights are cold in cache at every decode step, moves them at ~10-14 GB/s on a 2-core Zen 4.
// This kernel streams W in address order with `vdpbf16ps` dot products (fp32 accumulation),
// software-prefetches the next slice of W into L2 while it computes on the current one (the
// slices of 4 or 16 rows are too short for the hardware prefetcher to run ahead), and splits
// W's rows over the threads. More than four rows of x go over each 4-row slice of W in groups
// of four, so W still comes from memory once and then from L1; each group's 16 dot products are
// reduced together by one transposed sum. Against oneDNN on its pre-blocked weights, cold in
// cache as in a decode step (4 layers of SmolLM2-135M, 2-core Zen 4): 1.3-1.8x at 1-32 rows,
// 1.15x at 64, even at 128-160 (~380 GF/s), slower above (engine/model/fused_ops.py picks).
//
// x [M, K] (rows contiguous in K), W [N, K] contiguous, bias [N] or none, all bf16; K a multiple
// of 32, M <= kMaxRows. The sum is taken in a different order than oneDNN's, so an output can
// differ from F.linear's by one bf16 rounding step. CPUs without AVX512-BF16 run bf16 through the
// fp32-compute kernel at the end of this file.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "simd_math.h"

#include <algorithm>
#include <cstring>

namespace {
constexpr int64_t kMaxRows = 256;  // what it accepts; fused_ops dispatches fewer
constexpr int64_t kGroupRows = 4;  // x rows per pass over a slice of W (16 accumulators)
}

#if defined(__AVX512BF16__)
namespace {

inline __m256i to_bf16_rne(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

// Rows first_row .. first_row + count - 1 of W (row length k) at column k0, into L2. A prefetch
// never faults, so past the end of W this names memory that is not W's at no risk; the addresses
// are formed as integers to keep that well-defined. (Kept branch-free: a variant that skipped the
// prefetch at W's end with a null-pointer test measured none of the gain.)
inline void prefetch_rows(const uint16_t* w, int64_t first_row, int count, int64_t k, int64_t k0) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(w);
  for (int r = 0; r < count; ++r) {
    const uintptr_t offset = sizeof(uint16_t) * static_cast<uintptr_t>((first_row + r) * k + k0);
    _mm_prefetch(reinterpret_cast<const char*>(base + offset), _MM_HINT_T1);
  }
}

// 16 output features for one row of x: 16 accumulators (one per W row), reduced with hsum16.
// The following 16 rows of W are prefetched alongside.
void rows16_m1(const uint16_t* x, const uint16_t* w, int64_t k, int64_t n_rows, float* out) {
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < k; k0 += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k0);
    prefetch_rows(w, 16, 16, k, k0);
    for (int r = 0; r < 16; ++r)
      if (r < n_rows) acc[r] = _mm512_dpbf16_ps(acc[r], xv, (__m512bh)_mm512_loadu_si512(w + r * k + k0));
  }
  _mm512_storeu_ps(out, hsum16(acc));
}

// 4 output features for up to kGroupRows rows of x; the following 4 rows of W are prefetched
// alongside.
void rows4_mn(const uint16_t* x, int64_t x_stride, int64_t m, const uint16_t* w, int64_t k, int64_t n_rows,
              float out[kGroupRows][4]) {
  __m512 acc[kGroupRows][4];
  for (int i = 0; i < kGroupRows; ++i)
    for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < k; k0 += 32) {
    prefetch_rows(w, 4, 4, k, k0);
    __m512bh wv[4];
    for (int r = 0; r < 4; ++r)
      wv[r] = (__m512bh)(r < n_rows ? _mm512_loadu_si512(w + r * k + k0) : _mm512_setzero_si512());
    for (int i = 0; i < kGroupRows; ++i) {
      if (i >= m) break;
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * x_stride + k0);
      for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
    }
  }
  // One transposed reduction of all 16 accumulators (x row i, W row r at 4 * i + r) instead of
  // 16 separate ones: at K = 576 those cost a third as many instructions as the dot products.
  alignas(64) float sums[kGroupRows * 4];
  _mm512_store_ps(sums, hsum16(&acc[0][0]));
  for (int i = 0; i < m; ++i)
    for (int r = 0; r < 4; ++r) out[i][r] = sums[4 * i + r];
}

}  // namespace

bool has_small_linear() { return true; }
bool small_linear_bf16_dot() { return true; }

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "small_batch_linear: bf16 x and weight only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 2 && weight.is_contiguous() &&
                  x.size(1) == weight.size(1),
              "small_batch_linear: expected x [M, K] with contiguous rows and a contiguous W [N, K]");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(m >= 1 && m <= kMaxRows && k % 32 == 0, "small_batch_linear: needs 1 to ", kMaxRows,
              " rows and K a multiple of 32");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == n, "small_batch_linear: bias must be bf16 [N]");
  }
  auto out = at::empty({m, n}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const auto* bp = b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t x_stride = x.stride(0);
  // Tasks of 16 output features; at least ~64 KiB of W per task so small layers stay on one thread.
  const int64_t tiles = (n + 15) / 16;
  const int64_t grain = std::max<int64_t>(1, 65536 / (16 * k * 2));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxRows][16];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * 16, rows = std::min<int64_t>(16, n - n0);
      if (m == 1) {
        rows16_m1(xp, wp + n0 * k, k, rows, acc[0]);
      } else {
        // x rows in groups of four over each 4-row slice of W: the first group streams the
        // slice from memory, the others find it in L1.
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
          for (int64_t i0 = 0; i0 < m; i0 += kGroupRows) {
            const int64_t group = std::min<int64_t>(kGroupRows, m - i0);
            float part[kGroupRows][4];
            rows4_mn(xp + i0 * x_stride, x_stride, group, wp + (n0 + r0) * k, k,
                     std::min<int64_t>(4, rows - r0), part);
            for (int64_t i = 0; i < group; ++i) std::memcpy(acc[i0 + i] + r0, part[i], sizeof(part[i]));
          }
        }
      }
      const __mmask16 mask = tail_mask(rows);
      for (int64_t i = 0; i < m; ++i) {
        __m512 v = _mm512_load_ps(acc[i]);
        if (bp) v = _mm512_add_ps(v, load_bf16_masked(bp + n0, mask));
        _mm256_mask_storeu_epi16(op + i * n + n0, mask, to_bf16_rne(v));
      }
    }
  });
  return out;
}

#endif

// ---- float32 compute, any CPU with AVX2 + FMA or AVX-512 ---------------------------------------
// The same idea for fp32 weights, and for bf16 ones on CPUs without AVX512-BF16 (widened to fp32
// as they are loaded, so they still cost half the memory traffic of fp32). MKL's sgemm moved
// SmolLM2-135M's fp32 weights at only 3-8 GB/s at 4 rows (1 thread, 2-vCPU AMD EPYC, AVX2): each
// 4-row slice of W is streamed from memory once, with the next slice prefetched into L2, and every
// group of x rows runs over it from L1. Dot products are summed in a different order than
// sgemm's/oneDNN's, so outputs differ from F.linear's by a few float32 ulps (one bf16 rounding step
// in bf16). x [M, K] (rows contiguous), W [N, K] contiguous, bias [N] or none, all fp32 or all
// bf16; K a multiple of the SIMD width (8 or 16; bf16: of 32), M <= kMaxRows.
#if defined(PDSERVE_SIMD)
namespace {
constexpr int kWRows = 4;                          // rows of W per slice
constexpr int kXRows = simd::W == 16 ? 4 : 2;      // x rows per pass: 16 or 8 accumulators

// part[j][i] = x_j . w_i for NX rows of x (fp32) and the slice's kWRows rows of W (pointers, so a
// short last slice repeats its last row). `pf` (or null): the next slice's first row, prefetched
// into L2 one 64-byte line per row for every line of W read (`pf_rows` rows of it exist).
template <int NX, typename TW>
inline void slice_dot(const TW* const* w, int64_t k, const float* x, int64_t x_stride, const TW* pf,
                      int64_t pf_rows, float part[][kWRows]) {
  constexpr int64_t kLine = 64 / sizeof(TW);
  simd::F acc[NX][kWRows];
  for (int j = 0; j < NX; ++j)
    for (int i = 0; i < kWRows; ++i) acc[j][i] = simd::zero();
  for (int64_t c = 0; c < k; c += simd::W) {
    if (pf != nullptr && c % kLine == 0)
      for (int64_t i = 0; i < pf_rows; ++i) _mm_prefetch(reinterpret_cast<const char*>(pf + i * k + c), _MM_HINT_T1);
    simd::F wv[kWRows];
    for (int i = 0; i < kWRows; ++i) wv[i] = simd::load(w[i] + c);
    for (int j = 0; j < NX; ++j) {
      const simd::F xv = simd::load(x + j * x_stride + c);
      for (int i = 0; i < kWRows; ++i) acc[j][i] = simd::fmadd(wv[i], xv, acc[j][i]);
    }
  }
  for (int j = 0; j < NX; ++j)
    for (int i = 0; i < kWRows; ++i) part[j][i] = simd::reduce_add(acc[j][i]);
}

// out[j][n] = emit(j, n, x_j . w_n) over all M rows of x (fp32) and N rows of W, in tasks of 16
// rows of W over torch's threads.
template <typename TW, typename Emit>
void linear_rows(const float* xp, int64_t x_stride, int64_t m, const TW* wp, int64_t k, int64_t n, Emit emit) {
  // At least ~64 KiB of W per task so small layers stay on one thread.
  const int64_t tasks = (n + 15) / 16;
  const int64_t grain = std::max<int64_t>(1, 65536 / (16 * k * static_cast<int64_t>(sizeof(TW))));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin * 16; n0 < std::min(end * 16, n); n0 += kWRows) {
      const int64_t rows = std::min<int64_t>(kWRows, n - n0);
      const TW* w[kWRows];
      for (int i = 0; i < kWRows; ++i) w[i] = wp + std::min<int64_t>(n0 + i, n - 1) * k;
      const int64_t pf_rows = std::max<int64_t>(0, std::min<int64_t>(kWRows, n - n0 - kWRows));
      const TW* pf = pf_rows > 0 ? wp + (n0 + kWRows) * k : nullptr;
      float part[kXRows][kWRows];
      for (int64_t j0 = 0; j0 < m; j0 += kXRows) {
        const int64_t group = std::min<int64_t>(kXRows, m - j0);
        const float* xj = xp + j0 * x_stride;
        const TW* slice_pf = j0 == 0 ? pf : nullptr;  // the first pass reads W from memory
        if (group == kXRows) {
          slice_dot<kXRows>(w, k, xj, x_stride, slice_pf, pf_rows, part);
        } else {
          for (int64_t j = 0; j < group; ++j)
            slice_dot<1>(w, k, xj + j * x_stride, x_stride, j == 0 ? slice_pf : nullptr, pf_rows, part + j);
        }
        for (int64_t j = 0; j < group; ++j)
          for (int64_t i = 0; i < rows; ++i) emit(j0 + j, n0 + i, part[j][i]);
      }
    }
  });
}

// The checks both entry points share; returns the bias (contiguous) or an undefined tensor.
at::Tensor check_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        at::ScalarType dtype, const char* dtype_name, int64_t k_multiple, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == dtype && weight.scalar_type() == dtype, op, ": x and weight must be ", dtype_name);
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), op, ": bad shapes");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), op, ": rows must be contiguous");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m >= 1 && m <= kMaxRows, op, ": 1 to ", kMaxRows, " rows, got ", m);
  TORCH_CHECK(k % k_multiple == 0, op, ": K must be a multiple of ", k_multiple, ", got ", k);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == dtype && b.numel() == weight.size(0), op, ": bias must be ", dtype_name, " [N]");
  }
  return b;
}
}  // namespace

bool has_small_linear_f32() { return true; }

at::Tensor small_batch_linear_f32(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const at::Tensor b = check_linear(x, weight, bias, at::kFloat, "float32", simd::W, "small_batch_linear_f32");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  auto out = at::empty({m, n}, x.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  linear_rows(x.data_ptr<float>(), x.stride(0), m, weight.data_ptr<float>(), k, n,
              [&](int64_t j, int64_t i, float dot) { op[j * n + i] = dot + (bp ? bp[i] : 0.f); });
  return out;
}

#if !defined(__AVX512BF16__)
bool has_small_linear() { return true; }
bool small_linear_bf16_dot() { return false; }

// bf16 without vdpbf16ps: x is widened to fp32 once (a few rows), W as it streams.
at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const at::Tensor b = check_linear(x, weight, bias, at::kBFloat16, "bf16", 32, "small_batch_linear");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  auto out = at::empty({m, n}, x.options());
  const auto* bp = b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr;
  auto* op = out.data_ptr<c10::BFloat16>();
  linear_rows(xf.data_ptr<float>(), k, m, weight.data_ptr<c10::BFloat16>(), k, n, [&](int64_t j, int64_t i, float dot) {
    op[j * n + i] = c10::BFloat16(dot + (bp ? static_cast<float>(bp[i]) : 0.f));
  });
  return out;
}
#endif

#else

bool has_small_linear_f32() { return false; }
bool has_small_linear() { return false; }
bool small_linear_bf16_dot() { return false; }

at::Tensor small_batch_linear_f32(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "small_batch_linear_f32 needs AVX2 + FMA or AVX-512; use F.linear");
  return {};
}

at::Tensor small_batch_linear(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "small_batch_linear needs AVX2 + FMA or AVX-512; use F.linear");
  return {};
}

#endif
