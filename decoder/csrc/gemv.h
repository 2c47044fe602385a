// The int8 gemv of int8_gemv.cpp as a plain C++ call, for other kernels of the
// library (fused_cpu.cpp's one-row decoder layer) that run it without a tensor
// dispatch per product. Weights as decoder/quant.py GemvLinear keeps them.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace decoder_gemv {

struct Weights {
  const int8_t* wq;      // (Np, Kp) row major, zero-padded to Np % 4 == 0 and Kp % 64 == 0
  const float* scale;    // (N,) per output row
  const int32_t* shift;  // (Np,) 128 x the row sums of wq
  const float* bias;     // (N,) or null
  int64_t N, Np, Kp;
};

// y (M, N) = dequant(q(x) wq^T) [+ bias] [relu] for x (M, K) float rows; `path` from isa()
void gemv(const float* x, int64_t M, int64_t K, const Weights& w, bool relu, int path, float* y);

// A GemvLinear's tensors for x of K features, checked (one error naming what is wrong)
Weights weights(int64_t K, const at::Tensor& wq, const at::Tensor& w_scale, const at::Tensor& w_shift,
                const std::optional<at::Tensor>& bias);

// the path gemv takes here under `cap` (0 plain, 1 AVX2, 2 VNNI)
int isa(int64_t cap);

}  // namespace decoder_gemv
