// exp_nonpos: the vectorisable e^x of the softmax kernels (fused_cpu.cpp, project_topk.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// e^x for the x <= 0 of a max-shifted softmax, written so the compiler can
// vectorise it: std::exp is a libm call per element, which kept the loops
// below scalar (objdump showed no packed instruction in any clone).
// x = k ln2 + r with |r| <= ln2/2 (ln2 split in two for exactness), e^r by
// Cephes' expf polynomial, 2^k through the exponent bits. Relative error below
// 3e-7 against std::exp (tests/test_fused_ops.py); x < -87 gives 0.
inline float exp_nonpos(float x) {
  // NaN is clamped too (a NaN k would be an undefined int cast) and put back at the end
  const float xc = !(x >= -87.f) ? -87.f : x;
  const float k = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  // memcpy, not C++20's bit-cast function: torch's extension build compiles C++17 (2.11 and older)
  // (tests/test_cpp17.py); compilers turn it into one register move
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x != x ? x : (x < -87.f ? 0.f : p * scale);
}
