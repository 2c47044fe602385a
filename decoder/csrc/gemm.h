// The packed int8 product of int8_gemm.cpp as a plain C++ call, for int8_linear.cpp's
// ops (decoder/quant.py Int8Linear with switch `int8_packed_gemm`).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace decoder_gemm {

// xq (M, K) int8 times the weights `packed` (int8_gemm_pack of an (N, K) int8 matrix, VNNI):
// (M, N) int32, exactly torch._int_mm(xq, wq.t())
at::Tensor int_mm(const at::Tensor& xq, const at::Tensor& packed, int64_t N);

// int_mm's product (the VNNI layout) dequantised as it is made: y (M, N) float = acc * xs[row] *
// w_scale[col] (+ bias[col]) (relu), int8_linear's epilogue with its bits, written from each
// task's tile: the int32 product never stored
at::Tensor int_mm_dequant(const at::Tensor& xq, const at::Tensor& packed, int64_t N, const at::Tensor& xs,
                          const float* w_scale, const float* bias, bool relu);

// y[r, j] = acc[r, j] * xs[r] * w_scale[j] (+ bias[j]) (relu), `rows` rows of n columns (row strides
// lda, ldy): the int8 linears' one dequantising epilogue, also int_mm_dequant's
void dequant_rows(const int32_t* acc, int64_t lda, float* y, int64_t ldy, int64_t rows, int64_t n, const float* xs,
                  const float* ws, const float* b, bool relu);

// decoder/csrc/int8_linear.cpp's row quantisation: x (..., K) float -> (q (M, K) int8, scales (M,))
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x);

// one row of it: q = round(x / s) (n values, then zeros up to np), s = amax / 127; returns s
// (int8_gemv.cpp's rows, padded to its weights' stride)
float quantize_row(const float* x, int8_t* q, int64_t n, int64_t np);

}  // namespace decoder_gemm
