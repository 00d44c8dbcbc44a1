// Store a step's new K/V rows into the paged KV cache on the CPU: one call per layer instead of
// torch's index arithmetic and two index_copy_ calls (which cost more than the copy itself for a
// decode step's few rows).
//
// key/value [num_tokens, num_kv_heads, head_dim], rows contiguous in (heads, dim) but possibly
// strided between tokens (views of the fused QKV output); kv_cache [num_blocks, 2, block_size,
// num_kv_heads, head_dim] contiguous, same dtype; slot_mapping [num_tokens] int64, slot =
// block * block_size + offset, -1 = not stored.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cstring>

void store_kv_cache_(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                     const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && kv_cache.device().is_cpu(),
              "store_kv_cache_: CPU tensors only");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && kv_cache.dim() == 5 && kv_cache.size(1) == 2 &&
                  kv_cache.size(3) == key.size(1) && kv_cache.size(4) == key.size(2),
              "store_kv_cache_: key/value [T, kv_heads, head_dim] and a cache [blocks, 2, block_size, kv_heads, "
              "head_dim] expected");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "store_kv_cache_: key, value and cache dtypes differ");
  TORCH_CHECK(kv_cache.is_contiguous(), "store_kv_cache_: the cache must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              "store_kv_cache_: slot_mapping must be int64 [num_tokens]");
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "store_kv_cache_: each token's row must be contiguous");
  const int64_t num_tokens = key.size(0), block_size = kv_cache.size(2);
  const int64_t num_slots = kv_cache.size(0) * block_size;
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const int64_t half = block_size * row_bytes;  // K -> V within a block
  const auto* slots = slot_mapping.contiguous().data_ptr<int64_t>();
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  std::atomic<int64_t> bad{-1};
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      if (slot >= num_slots) {
        bad.store(slot);
        continue;
      }
      char* dst = cache + (slot / block_size) * 2 * half + (slot % block_size) * row_bytes;
      std::memcpy(dst, k + t * k_stride, row_bytes);
      std::memcpy(dst + half, v + t * v_stride, row_bytes);
    }
  });
  TORCH_CHECK(bad.load() < 0, "store_kv_cache_: slot ", bad.load(), " is past the cache's ", num_slots, " slots");
}
