// Fused dynamic-int8 linear for CPU: y = dequant(quant(x) @ wq_t) + b [, relu].
//
// One pass quantises each activation row (abs-max scale, round-to-nearest), the
// int8 x int8 -> int32 product is ATen's _int_mm (oneDNN picks VNNI / AVX-512 /
// AVX2 kernels at run time) or, given `packed` weights, int8_gemm.cpp's VNNI kernel
// (the same integers, no per-call weight reorder), and one pass rescales, adds the bias and applies
// relu. `int8_linear_quantized` ends in the next layer's quantisation instead
// (fc1 -> fc2: the float hidden never written) and `int8_linear_prequantized`
// starts from it. The Python reference is decoder/quant.py:Int8Linear.reference; the
// inner loops are compiled for x86-64-v4 (AVX-512), v3 (AVX2+FMA) and baseline x86 and one is
// picked at run time (multiversion.h, capped by DECODER_MAX_CPU_ISA), so one build runs on any x86.
#include <torch/library.h>
#include <ATen/ATen.h>
#include "checks.h"
#include <ATen/Parallel.h>
#include <cmath>

#include "gemm.h"
#include "multiversion.h"
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

// q = round(x / s), s = amax / 127, zero-padded from n to np; returns s
MULTIVERSION(float, quantize_row, (const float* x, int8_t* q, int64_t n, int64_t np), (x, q, n, np)) {
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
  for (int64_t i = n; i < np; ++i) q[i] = 0;
  return amax * (1.f / 127.f);
}

// x (..., K) float -> its rows quantised (M, K) int8 and their scales (M,)
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  KIT_CHECK(x.scalar_type() == at::kFloat, "int8_linear: x must be float32");
  const int64_t K = x.size(-1);
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto xq = at::empty({M, K}, x2.options().dtype(at::kChar));
  auto xs = at::empty({M}, x2.options());
  const float* xp = x2.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = xs.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) sp[r] = quantize_row(xp + r * K, qp + r * K, K, K);
  });
  return {xq, xs};
}

struct Product {  // _int_mm of quantised rows and what its epilogue needs
  at::Tensor acc, ws, b;
  const int32_t* ap;
  const float *wsp, *bp;
  int64_t M, N;
};

using Packed = std::optional<at::Tensor>;  // int8_gemm_pack's layout of wq_t's columns, or _int_mm

void check_weight(const at::Tensor& xq, const at::Tensor& wq_t) {
  KIT_CHECK(wq_t.scalar_type() == at::kChar && wq_t.dim() == 2, "int8_linear: wq_t must be int8 (in, out)");
  KIT_CHECK(wq_t.size(0) == xq.size(1), "int8_linear: x has ", xq.size(1), " features, weight expects ",
            wq_t.size(0));
}

Product int_mm(const at::Tensor& xq, const at::Tensor& wq_t, const at::Tensor& w_scale,
               const std::optional<at::Tensor>& bias, const Packed& packed) {
  check_weight(xq, wq_t);
  Product p;
  // (M, N) int32
  p.acc = packed.has_value() ? decoder_gemm::int_mm(xq, *packed, wq_t.size(1)) : at::_int_mm(xq, wq_t);
  p.ws = w_scale.contiguous();
  if (bias.has_value()) p.b = bias->contiguous();
  p.ap = p.acc.data_ptr<int32_t>();
  p.wsp = p.ws.data_ptr<float>();
  p.bp = bias.has_value() ? p.b.data_ptr<float>() : nullptr;
  p.M = xq.size(0);
  p.N = wq_t.size(1);
  return p;
}

// the product's epilogue: y (M, N) = acc * xs[row] * w_scale [+ b] [, relu]
at::Tensor dequantized(const Product& p, const at::Tensor& xs, bool relu) {
  auto y = at::empty({p.M, p.N}, xs.options());
  float* yp = y.data_ptr<float>();
  const float* sp = xs.data_ptr<float>();
  at::parallel_for(0, p.M, 16, [&](int64_t lo, int64_t hi) {
    decoder_gemm::dequant_rows(p.ap + lo * p.N, p.N, yp + lo * p.N, p.N, hi - lo, p.N, sp + lo, p.wsp, p.bp, relu);
  });
  return y;
}

at::Tensor out_shape(const at::Tensor& y, const at::Tensor& x, int64_t N) {
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

// y (M, N) float of quantised rows: on packed VNNI weights dequantised from the product's tiles
// (int_mm_dequant, the int32 product never stored), else the product and then `dequantized`;
// the same bits either way
at::Tensor linear_rows(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& wq_t, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& bias, bool relu, const Packed& packed) {
  if (!packed.has_value())
    return dequantized(int_mm(xq, wq_t, w_scale, bias, packed), xs, relu);
  check_weight(xq, wq_t);
  const int64_t N = wq_t.size(1);
  KIT_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == N && (!bias.has_value() ||
            (bias->scalar_type() == at::kFloat && bias->numel() == N)), "int8_linear: ", N,
            " float scales (and bias values) expected");
  const auto ws = w_scale.contiguous();
  const auto b = bias.has_value() ? bias->contiguous() : at::Tensor();
  return decoder_gemm::int_mm_dequant(xq, *packed, N, xs.contiguous(), ws.data_ptr<float>(),
                                      bias.has_value() ? b.data_ptr<float>() : nullptr, relu);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& wq_t, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& bias, bool relu, const Packed& packed) {
  auto [xq, xs] = quantize_rows(x);
  return out_shape(linear_rows(xq, xs, wq_t, w_scale, bias, relu, packed), x, wq_t.size(1));
}

// int8_linear whose output is quantised for the next int8 linear (fc1 -> fc2): each
// row is rescaled into a row-sized buffer and quantised from there, so the (M, N)
// float output is never written nor read back; the same bits as int8_linear
// followed by the next call's quantize_rows. Returns (q (..., N) int8, scales (...)).
std::tuple<at::Tensor, at::Tensor> int8_linear_quantized(const at::Tensor& x, const at::Tensor& wq_t,
                                                         const at::Tensor& w_scale,
                                                         const std::optional<at::Tensor>& bias, bool relu,
                                                         const Packed& packed) {
  auto [xq, xs] = quantize_rows(x);
  auto p = int_mm(xq, wq_t, w_scale, bias, packed);
  auto q = at::empty({p.M, p.N}, xq.options());
  auto qs = at::empty({p.M}, xs.options());
  int8_t* qp = q.data_ptr<int8_t>();
  float* qsp = qs.data_ptr<float>();
  const float* sp = xs.data_ptr<float>();
  at::parallel_for(0, p.M, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> row(p.N);
    for (int64_t r = lo; r < hi; ++r) {
      decoder_gemm::dequant_rows(p.ap + r * p.N, p.N, row.data(), p.N, 1, p.N, sp + r, p.wsp, p.bp, relu);
      qsp[r] = quantize_row(row.data(), qp + r * p.N, p.N, p.N);
    }
  });
  auto shape = x.sizes().vec();
  shape.pop_back();
  return {out_shape(q, x, p.N), qs.view(shape)};
}

// int8_linear of rows already quantised (int8_linear_quantized's output)
at::Tensor int8_linear_prequantized(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& wq_t,
                                    const at::Tensor& w_scale, const std::optional<at::Tensor>& bias, bool relu,
                                    const Packed& packed) {
  KIT_CHECK(xq.scalar_type() == at::kChar && xs.scalar_type() == at::kFloat && xs.numel() * xq.size(-1) ==
              xq.numel(), "int8_linear_prequantized: xq must be int8 (..., K) with one float scale per row");
  const int64_t K = xq.size(-1);
  auto q2 = xq.reshape({-1, K}).contiguous();
  auto s2 = xs.reshape({-1}).contiguous();
  return out_shape(linear_rows(q2, s2, wq_t, w_scale, bias, relu, packed), xq, wq_t.size(1));
}

}  // namespace

namespace decoder_gemm {
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) { return ::quantize_rows(x); }
float quantize_row(const float* x, int8_t* q, int64_t n, int64_t np) { return ::quantize_row(x, q, n, np); }
}  // namespace decoder_gemm

TORCH_LIBRARY(decoder_ops, m) {
  // packed: wq_t's columns in int8_gemm_pack's layout (int8_gemm.cpp), or None for _int_mm
  m.def("int8_linear(Tensor x, Tensor wq_t, Tensor w_scale, Tensor? bias, bool relu, Tensor? packed=None) -> Tensor");
  m.def("int8_linear_quantized(Tensor x, Tensor wq_t, Tensor w_scale, Tensor? bias, bool relu, "
        "Tensor? packed=None) -> (Tensor, Tensor)");
  m.def("int8_linear_prequantized(Tensor xq, Tensor xs, Tensor wq_t, Tensor w_scale, Tensor? bias, bool relu, "
        "Tensor? packed=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(decoder_ops, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_linear_quantized", &int8_linear_quantized);
  m.impl("int8_linear_prequantized", &int8_linear_prequantized);
}
