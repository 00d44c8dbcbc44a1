// The Python module of pdserve's native CPU kernels (built by engine/cpu_kernels.py).
#include <torch/python.h>  // pybind11 and the tensor casters only; the kernels include ATen

// paged_decode_cpu.cpp
// Variants (engine/attention/variant.py): window 0 = no sliding window, softcap 0 = no soft-cap,
// sinks None or fp32-convertible [num_heads].
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window, double softcap, const c10::optional<at::Tensor>& sinks);
// paged_decode_cpu.cpp (8-bit caches, engine/kv_quant.py)
at::Tensor paged_decode_attention_8bit(const at::Tensor& query, const at::Tensor& kv_cache,
                                       const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                       int64_t block_size, int64_t num_kv_heads, bool fp8, int64_t window,
                                       double softcap, const c10::optional<at::Tensor>& sinks);
// kv_store_cpu.cpp
void store_kv_cache_(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                     const at::Tensor& slot_mapping);
void store_kv_cache_8bit_(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                          const at::Tensor& slot_mapping, int64_t block_size, bool fp8);
// flash_prefill_cpu.cpp
at::Tensor flash_prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                   double scale, int64_t window, double softcap, const c10::optional<at::Tensor>& sinks);
bool has_flash_prefill();
// fused_ops_cpu.cpp
bool has_fused_ops();
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
std::vector<at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                         const at::Tensor& cos_cache, const at::Tensor& sin_cache);
// token_mask_cpu.cpp
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows);
// small_linear_cpu.cpp
bool has_small_linear();
bool small_linear_bf16_dot();
at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
bool has_small_linear_f32();
at::Tensor small_batch_linear_f32(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
// moe_cpu.cpp
bool has_moe_experts();
int64_t moe_experts_max_tokens();
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& experts,
                       const at::Tensor& gate_up, const at::Tensor& down, const c10::optional<at::Tensor>& gate_up_bias,
                       const c10::optional<at::Tensor>& down_bias, const std::string& activation, double alpha,
                       double limit);

// latent_decode_cpu.cpp (DeepSeek's multi-head latent attention, decodes; engine/attention/latent.py's cache)
bool has_latent_decode();
at::Tensor latent_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, double scale, int64_t value_dim, int64_t num_splits,
                                   int64_t heads_per_item);
at::Tensor latent_decode_attention_8bit(const at::Tensor& query, const at::Tensor& kv_cache,
                                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                        int64_t value_dim, int64_t block_size, bool fp8, int64_t num_splits,
                                        int64_t heads_per_item);
// gguf_linear_cpu.cpp (weights kept in a GGUF block format: engine/model/quant_linear.py)
bool has_gguf_linear();
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type);
at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t type, int64_t in_features);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (CPU), with an optional sliding window, soft-cap and sinks",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("paged_decode_attention_8bit", &paged_decode_attention_8bit,
        "Decode attention over an 8-bit paged KV cache with per-block scales (CPU), variants as above",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("block_size"), py::arg("num_kv_heads"), py::arg("fp8"), py::arg("window") = 0,
        py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("store_kv_cache_", &store_kv_cache_, "Write new K/V rows into the paged cache at their slots (CPU)");
  m.def("store_kv_cache_8bit_", &store_kv_cache_8bit_,
        "Quantize new K/V rows into an 8-bit paged cache at their slots, growing block scales (CPU)");
  m.def("flash_prefill_attention", &flash_prefill_attention,
        "Causal prefill attention, bf16, AVX512-BF16 (CPU), with an optional sliding window, soft-cap and sinks",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("has_flash_prefill", &has_flash_prefill, "Whether flash_prefill_attention was compiled in");
  m.def("has_fused_ops", &has_fused_ops, "Whether the fused bf16 elementwise ops were compiled in (AVX2 or AVX-512)");
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows, rounded as transformers rounds");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x (in place), then RMSNorm of the sum");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a [T, 2I] gate|up matmul output");
  m.def("has_small_linear", &has_small_linear, "Whether small_batch_linear was compiled in (AVX2 or AVX-512)");
  m.def("small_linear_bf16_dot", &small_linear_bf16_dot,
        "Whether small_batch_linear multiplies in bf16 (vdpbf16ps, AVX512-BF16) rather than widening to fp32");
  m.def("small_batch_linear", &small_batch_linear, "x W^T (+ bias) for 1-256 bf16 rows (a decode step's linear)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("has_small_linear_f32", &has_small_linear_f32, "Whether small_batch_linear_f32 was compiled in (AVX2/AVX-512)");
  m.def("small_batch_linear_f32", &small_batch_linear_f32, "x W^T (+ bias) for 1-256 float32 rows",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("has_moe_experts", &has_moe_experts, "Whether moe_experts was compiled in (AVX2 or AVX-512)");
  m.def("moe_experts_max_tokens", &moe_experts_max_tokens, "The most tokens moe_experts accepts");
  m.def("moe_experts", &moe_experts,
        "A mixture of experts' routed experts for a decode-sized batch of float32 or bf16 rows, in one call: "
        "sum_k weights[t, k] * down(act(gate_up(x[t]))) of expert experts[t, k]",
        py::arg("x"), py::arg("weights"), py::arg("experts"), py::arg("gate_up"), py::arg("down"),
        py::arg("gate_up_bias") = py::none(), py::arg("down_bias") = py::none(), py::arg("activation") = "silu",
        py::arg("alpha") = 0.0, py::arg("limit") = 0.0);
  m.def("apply_token_bitmask_", &apply_token_bitmask_, "Set logits refused by a grammar's bitmask to -inf (in place)");
  m.def("rotary_embedding", &rotary_embedding, "Rotate-half RoPE of query and key (new contiguous tensors)");
  m.def("has_latent_decode", &has_latent_decode,
        "Whether latent_decode_attention(_8bit) were compiled in (AVX2 or AVX-512)");
  m.def("latent_decode_attention", &latent_decode_attention,
        "Multi-head latent attention (MLA) decode over a paged latent cache [blocks, 2, block_size, 1, half] read "
        "in place (CPU): [seqs, heads, 2 * half] queries -> [seqs, heads, value_dim]",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("value_dim"), py::arg("num_splits") = 0, py::arg("heads_per_item") = 0);
  m.def("latent_decode_attention_8bit", &latent_decode_attention_8bit,
        "latent_decode_attention over an 8-bit latent cache (engine/kv_quant.py, one KV head of head_dim half)",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("value_dim"), py::arg("block_size"), py::arg("fp8"), py::arg("num_splits") = 0,
        py::arg("heads_per_item") = 0);
  m.def("has_gguf_linear", &has_gguf_linear, "Whether gguf_linear and gguf_dequantize were compiled in (x86-64-v3)");
  m.def("gguf_linear", &gguf_linear,
        "float32 x [rows, K] times a GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weight [N, row bytes] transposed -> [rows, N]",
        py::arg("x"), py::arg("weight"), py::arg("type"));
  m.def("gguf_dequantize", &gguf_dequantize, "A GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weight [N, row bytes] as float32 [N, K]",
        py::arg("weight"), py::arg("type"), py::arg("in_features"));
}
