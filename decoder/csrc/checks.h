// Argument checks shared by the CPU (fused_cpu.cpp) and CUDA (fused_cuda.cu)
// kernels of the same op, so both refuse the same inputs with the same words.
#pragma once

#include <ATen/ATen.h>

#include <optional>

// the argmax kernels compare in fp32, which would merge distinct float64 values
inline void check_argmax_dtype(const at::Tensor& t, const char* op) {
  const auto d = t.scalar_type();
  TORCH_CHECK(d == at::kFloat || d == at::kHalf || d == at::kBFloat16, op, ": float32, float16 or bfloat16 only, got ",
              d);
}

inline void check_linear_argmax(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                int64_t chunk) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1) && weight.size(0) > 0,
              "linear_argmax: x (R, d) and weight (V, d) with V > 0");
  TORCH_CHECK(!bias.has_value() || bias->numel() == weight.size(0), "linear_argmax: bias must have V elements");
  TORCH_CHECK(chunk > 0, "linear_argmax: chunk must be positive");
  check_argmax_dtype(x, "linear_argmax");
}
