// The Python module of pagedserve's CPU kernels (built by pagedserve/kernels/cpu_build.py).
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale);
void write_kv_cache_(torch::Tensor kv_cache, torch::Tensor key, torch::Tensor value, torch::Tensor slot_mapping);
bool has_fused_bf16_ops();
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps);
void rotary_embedding_(torch::Tensor qk, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor argmax_rows(torch::Tensor logits);
bool has_quant_linear();
bool has_int8_activation_linear();
torch::Tensor linear_quant_avx512(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros,
                                  int64_t bits, int64_t group_size, int64_t offset, c10::optional<torch::Tensor> bias,
                                  bool int8_activations);
bool has_prefill_attention();
bool has_amx_prefill_attention();
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                      torch::Tensor seq_lens, torch::Tensor query_start_loc, double scale, bool allow_amx);
bool has_amx_linear();
torch::Tensor pack_linear_weight_amx(torch::Tensor weight);
torch::Tensor linear_amx(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);
bool has_avx512_bf16_linear();
torch::Tensor pack_linear_weight_vnni(torch::Tensor weight);
torch::Tensor linear_avx512_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);

// Every op drops the GIL while it runs: with the engine core in a thread of the server process,
// the event loop keeps serving HTTP meanwhile.
using ReleaseGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)", ReleaseGil());
  m.def("has_prefill_attention", &has_prefill_attention,
        "Whether paged_prefill_attention can run here (built with AVX512-BF16)", ReleaseGil());
  m.def("has_amx_prefill_attention", &has_amx_prefill_attention,
        "Whether paged_prefill_attention uses AMX tiles here (built with AMX, tiles granted by the OS)", ReleaseGil());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Causal paged attention of prompt chunks (CPU, bf16; AMX tiles where allowed and usable, else AVX512-BF16)",
        py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start_loc"),
        py::arg("scale"), py::arg("allow_amx") = true, ReleaseGil());
  m.def("write_kv_cache_", &write_kv_cache_, "Store new keys/values at their cache slots", ReleaseGil());
  m.def("has_fused_bf16_ops", &has_fused_bf16_ops, "Whether the fused bf16 ops below were compiled (AVX-512)", ReleaseGil());
  m.def("rms_norm", &rms_norm, "RMSNorm (bf16); with a residual: residual += x in place, RMSNorm(residual)",
        ReleaseGil());
  m.def("rotary_embedding_", &rotary_embedding_, "Rotate-half rope in place (bf16)", ReleaseGil());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (bf16)", ReleaseGil());
  m.def("has_amx_linear", &has_amx_linear, "Whether linear_amx can run here (built with AMX, tiles granted by the OS)",
        ReleaseGil());
  m.def("pack_linear_weight_amx", &pack_linear_weight_amx, "A bf16 [out, in] weight as AMX tile operands", ReleaseGil());
  m.def("linear_amx", &linear_amx, "x @ W.T (+ bias) in bf16 with AMX tiles, W packed by pack_linear_weight_amx",
        ReleaseGil());
  m.def("has_avx512_bf16_linear", &has_avx512_bf16_linear, "Whether linear_avx512_bf16 was built (AVX512-BF16)",
        ReleaseGil());
  m.def("pack_linear_weight_vnni", &pack_linear_weight_vnni, "A bf16 [out, in] weight in 16-column pair-interleaved slices",
        ReleaseGil());
  m.def("linear_avx512_bf16", &linear_avx512_bf16,
        "x @ W.T (+ bias) in bf16 with AVX512-BF16 dot products, W packed by pack_linear_weight_vnni", ReleaseGil());
  m.def("has_quant_linear", &has_quant_linear, "Whether linear_quant_avx512 was built (AVX512-BF16)", ReleaseGil());
  m.def("has_int8_activation_linear", &has_int8_activation_linear,
        "Whether linear_quant_avx512 multiplies 4-bit weights with int8 activations here (AVX512-VNNI)", ReleaseGil());
  m.def("linear_quant_avx512", &linear_quant_avx512,
        "x @ W.T (+ bias) in bf16 for 4- or 8-bit weights with group-wise float16 scales (and zero-points)",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("zeros"), py::arg("bits"), py::arg("group_size"),
        py::arg("offset"), py::arg("bias") = py::none(), py::arg("int8_activations") = false, ReleaseGil());
  m.def("argmax_rows", &argmax_rows, "Index of each row's largest logit, as torch.max(dim=-1).indices", ReleaseGil());
}
