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
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

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

// The 8-bit cache's store (engine/kv_quant.py, whose `KVQuantFormat.store` is the reference: the
// bytes written here are the same, tested): a write at offset 0 makes that token's K (in bf16)
// the block's K reference; a block's scale per (K/V, head) grows to the largest |x - ref| / qmax
// written to it since (ref = 0 for V); a write needing a larger scale for a (K/V, head)
// re-quantizes what the block holds there first: its positions before the write's first offset.
// kv_cache [num_blocks, block_bytes] uint8, each block values [2, block_size, num_kv_heads,
// head_dim] (int8 or fp8 e4m3), float32 scales [2, num_kv_heads], then bf16 K references
// [num_kv_heads, head_dim]. Tokens writing one block are handled together; blocks in parallel.
namespace {

constexpr float kMinScale = 1e-8f;  // kv_quant.MIN_SCALE

// x / scale, clamped to +-qmax, in the 8-bit type (int8: rounded half to even, as torch.round).
inline uint8_t quantize(float x, float scale, float qmax, bool fp8) {
  const float y = std::min(std::max(x / scale, -qmax), qmax);
  if (fp8) return c10::Float8_e4m3fn(y).x;
  return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)));
}

inline float dequantize(uint8_t q, bool fp8) {
  return fp8 ? static_cast<float>(c10::Float8_e4m3fn(q, c10::Float8_e4m3fn::from_bits()))
             : static_cast<float>(static_cast<int8_t>(q));
}

template <typename T>
void store_8bit(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const int64_t* slots,
                int64_t block_size, int64_t heads, bool fp8) {
  const int64_t num_tokens = key.size(0), dim = key.size(2), block_bytes = kv_cache.size(1);
  const int64_t token_values = heads * dim, values_bytes = 2 * block_size * token_values;
  const int64_t refs_offset = values_bytes + 2 * heads * static_cast<int64_t>(sizeof(float));
  const float qmax = fp8 ? 448.f : 127.f;
  const T* src[2] = {key.data_ptr<T>(), value.data_ptr<T>()};
  const int64_t src_stride[2] = {key.stride(0), value.stride(0)};
  uint8_t* cache = kv_cache.data_ptr<uint8_t>();
  // (block, token) of every stored token, grouped by block
  std::vector<std::pair<int64_t, int64_t>> writes;
  writes.reserve(num_tokens);
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slots[t] >= 0) writes.emplace_back(slots[t] / block_size, t);
  std::stable_sort(writes.begin(), writes.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<int64_t> runs;  // start of each block's writes
  for (int64_t i = 0; i < static_cast<int64_t>(writes.size()); ++i)
    if (i == 0 || writes[i].first != writes[i - 1].first) runs.push_back(i);
  runs.push_back(static_cast<int64_t>(writes.size()));
  at::parallel_for(0, static_cast<int64_t>(runs.size()) - 1, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> need(2 * heads), scale(2 * heads), ref(token_values);
    const std::vector<float> no_ref(token_values, 0.f);  // V's
    for (int64_t r = begin; r < end; ++r) {
      const int64_t block = writes[runs[r]].first;
      uint8_t* values = cache + block * block_bytes;
      float* scales = reinterpret_cast<float*>(values + values_bytes);
      c10::BFloat16* refs = reinterpret_cast<c10::BFloat16*>(values + refs_offset);
      bool fresh = false;
      int64_t first = block_size;  // the write's first offset in the block
      for (int64_t i = runs[r]; i < runs[r + 1]; ++i) {
        const int64_t t = writes[i].second;
        first = std::min(first, slots[t] % block_size);
        if (slots[t] % block_size != 0) continue;
        fresh = true;  // offset 0: this token's K is the reference from now on
        for (int64_t e = 0; e < token_values; ++e)
          refs[e] = c10::BFloat16(static_cast<float>(src[0][t * src_stride[0] + e]));
      }
      for (int64_t e = 0; e < token_values; ++e) ref[e] = static_cast<float>(refs[e]);
      const float* centre[2] = {ref.data(), no_ref.data()};
      std::fill(need.begin(), need.end(), 0.f);
      for (int64_t i = runs[r]; i < runs[r + 1]; ++i) {
        const int64_t t = writes[i].second;
        for (int64_t kv = 0; kv < 2; ++kv)
          for (int64_t h = 0; h < heads; ++h) {
            const T* x = src[kv] + t * src_stride[kv] + h * dim;
            const float* c = centre[kv] + h * dim;
            float amax = 0.f;
            for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::abs(static_cast<float>(x[d]) - c[d]));
            need[kv * heads + h] = std::max(need[kv * heads + h], amax / qmax);
          }
      }
      for (int64_t i = 0; i < 2 * heads; ++i) {
        scale[i] = std::max(std::max(need[i], fresh ? 0.f : scales[i]), kMinScale);
        if (fresh || scale[i] <= scales[i]) continue;
        // what the block holds for this (K/V, head), re-quantized with its larger scale
        const int64_t kv = i / heads, h = i % heads;
        const float old = scales[i], now = scale[i];
        for (int64_t pos = 0; pos < first; ++pos) {
          uint8_t* q = values + ((kv * block_size + pos) * heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) q[d] = quantize(dequantize(q[d], fp8) * old, now, qmax, fp8);
        }
      }
      std::copy(scale.begin(), scale.end(), scales);
      for (int64_t i = runs[r]; i < runs[r + 1]; ++i) {
        const int64_t t = writes[i].second, pos = slots[t] % block_size;
        for (int64_t kv = 0; kv < 2; ++kv)
          for (int64_t h = 0; h < heads; ++h) {
            const T* x = src[kv] + t * src_stride[kv] + h * dim;
            const float* c = centre[kv] + h * dim;
            uint8_t* q = values + ((kv * block_size + pos) * heads + h) * dim;
            const float s = scale[kv * heads + h];
            for (int64_t d = 0; d < dim; ++d) q[d] = quantize(static_cast<float>(x[d]) - c[d], s, qmax, fp8);
          }
      }
    }
  });
}

}  // namespace

void store_kv_cache_8bit_(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                          const at::Tensor& slot_mapping, int64_t block_size, bool fp8) {
  constexpr const char* name = "store_kv_cache_8bit_";
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && kv_cache.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.scalar_type() == value.scalar_type(),
              name, ": key and value must be [T, kv_heads, head_dim] of one dtype");
  const int64_t heads = key.size(1), dim = key.size(2);
  TORCH_CHECK(kv_cache.dim() == 2 && kv_cache.scalar_type() == at::kByte && kv_cache.is_contiguous() &&
                  kv_cache.size(1) == 2 * block_size * heads * dim + 2 * heads * 4 + heads * dim * 2,
              name, ": the cache must be contiguous [num_blocks, block_bytes] uint8 for this block_size and key");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              name, ": slot_mapping must be int64 [num_tokens]");
  auto rows = [](const at::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous(); };
  const at::Tensor k = rows(key), v = rows(value), slots = slot_mapping.contiguous();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(0) * block_size;
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(s[t] < num_slots, name, ": slot ", s[t], " is past the cache's ", num_slots, " slots");
  switch (k.scalar_type()) {
    case at::kFloat: store_8bit<float>(k, v, kv_cache, s, block_size, heads, fp8); break;
    case at::kBFloat16: store_8bit<c10::BFloat16>(k, v, kv_cache, s, block_size, heads, fp8); break;
    case at::kHalf: store_8bit<c10::Half>(k, v, kv_cache, s, block_size, heads, fp8); break;
    default: TORCH_CHECK(false, name, ": dtype ", k.scalar_type(), " is not float32/bfloat16/float16");
  }
}
