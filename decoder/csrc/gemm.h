// The packed int8 product of int8_gemm.cpp as a plain C++ call, for int8_linear.cpp's
// ops (decoder/quant.py Int8Linear with switch `int8_packed_gemm`).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace decoder_gemm {

// xq (M, K) int8 times the weights `packed` (int8_gemm_pack of an (N, K) int8 matrix, VNNI,
// or int8_gemm_widen's int16 copy of it, AVX2): (M, N) int32, exactly torch._int_mm(xq, wq.t())
at::Tensor int_mm(const at::Tensor& xq, const at::Tensor& packed, int64_t N);

}  // namespace decoder_gemm
