// Fused dynamic-int8 linear for CPU: y = dequant(quant(x) @ wq_t) + b [, relu].
//
// One pass quantises each activation row (abs-max scale, round-to-nearest), the
// int8 x int8 -> int32 product is ATen's _int_mm (oneDNN picks VNNI / AVX-512 /
// AVX2 kernels at run time), and one pass rescales, adds the bias and applies
// relu. The Python reference is decoder/quant.py:Int8Linear.reference; the
// inner loops are compiled for x86-64-v4 (AVX-512), v3 (AVX2+FMA) and baseline x86 and the loader
// picks one at run time (GCC target_clones), so one build runs on any x86.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>

#include "multiversion.h"
#include <cstdint>

namespace {

MULTIVERSION
float quantize_row(const float* x, int8_t* q, int64_t n) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    amax = a > amax ? a : amax;
  }
  amax = amax > 1e-12f ? amax : 1e-12f;
  const float inv = 127.f / amax;
  // round half to even, as torch.round; -fno-math-errno lets this vectorise
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
  return amax * (1.f / 127.f);
}

MULTIVERSION
void dequant_row(const int32_t* acc, float* y, int64_t n, float xs, const float* ws, const float* b,
                 bool relu) {
  if (b) {
    for (int64_t j = 0; j < n; ++j) y[j] = static_cast<float>(acc[j]) * xs * ws[j] + b[j];
  } else {
    for (int64_t j = 0; j < n; ++j) y[j] = static_cast<float>(acc[j]) * xs * ws[j];
  }
  if (relu)
    for (int64_t j = 0; j < n; ++j) y[j] = y[j] > 0.f ? y[j] : 0.f;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& wq_t, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& bias, bool relu) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int8_linear: x must be float32");
  TORCH_CHECK(wq_t.scalar_type() == at::kChar && wq_t.dim() == 2, "int8_linear: wq_t must be int8 (in, out)");
  const int64_t K = x.size(-1), N = wq_t.size(1);
  TORCH_CHECK(wq_t.size(0) == K, "int8_linear: x has ", K, " features, weight expects ", wq_t.size(0));
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto xq = at::empty({M, K}, x2.options().dtype(at::kChar));
  auto xs = at::empty({M}, x2.options());
  const float* xp = x2.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = xs.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) sp[r] = quantize_row(xp + r * K, qp + r * K, K);
  });
  auto acc = at::_int_mm(xq, wq_t);  // (M, N) int32
  auto y = at::empty({M, N}, x2.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
  auto ws = w_scale.contiguous();
  const float* wsp = ws.data_ptr<float>();
  at::Tensor b;
  if (bias.has_value()) b = bias->contiguous();
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) dequant_row(ap + r * N, yp + r * N, N, sp[r], wsp, bp, relu);
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY(decoder_ops, m) {
  m.def("int8_linear(Tensor x, Tensor wq_t, Tensor w_scale, Tensor? bias, bool relu) -> Tensor");
}

TORCH_LIBRARY_IMPL(decoder_ops, CPU, m) {
  m.impl("int8_linear", &int8_linear);
}
