// Structured output: set the logits of disallowed tokens to -inf, from a grammar's bitmask.
//
// logits [num_rows, vocab] float32; bitmask [num_rows, ceil(vocab / 32)] int32, bit b of word w
// allows token 32 * w + b (xgrammar's layout); rows int64, the rows to mask. Most words of a
// row are all-allowed (skipped) or all-refused (one fill): a grammar allows either nearly every
// token (inside a string) or a handful (between JSON tokens). xgrammar's own CPU kernel writes
// token by token and takes ~7 ms for 32 rows of a 49k vocabulary in the second case; this takes
// a fraction of a millisecond.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.device().is_cpu() && bitmask.device().is_cpu() && rows.device().is_cpu(),
              "apply_token_bitmask_: CPU tensors only");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "apply_token_bitmask_: logits must be [rows, vocab] float32 with contiguous rows");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "apply_token_bitmask_: bitmask must be a contiguous [rows, words] int32 tensor");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "apply_token_bitmask_: rows must be int64");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), row_stride = logits.stride(0);
  TORCH_CHECK(words * 32 >= vocab, "apply_token_bitmask_: the bitmask covers ", words * 32, " tokens, the logits ",
              vocab);
  TORCH_CHECK(bitmask.size(0) == logits.size(0), "apply_token_bitmask_: one bitmask row per logits row");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0), "apply_token_bitmask_: row ", row_ids[i],
                " is out of range");
  float* base = logits.data_ptr<float>();
  const int32_t* masks = bitmask.data_ptr<int32_t>();
  constexpr float kRefused = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* out = base + row_ids[i] * row_stride;
      const uint32_t* mask = reinterpret_cast<const uint32_t*>(masks + row_ids[i] * words);
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t bits = mask[w];
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t first = w * 32, count = std::min<int64_t>(32, vocab - first);
        if (bits == 0) {
          std::fill_n(out + first, count, kRefused);
          continue;
        }
        for (int64_t b = 0; b < count; ++b)
          if (!((bits >> b) & 1u)) out[first + b] = kRefused;
      }
    }
  });
}
