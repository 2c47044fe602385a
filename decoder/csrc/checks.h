// Argument checks shared by the CPU (fused_cpu.cpp) and CUDA (fused_cuda.cu)
// kernels of the same op, so both refuse the same inputs with the same words.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <type_traits>

// KIT_CHECK(cond, parts...): TORCH_CHECK with its message joined here, by std::to_string,
// never by std::ostream. TORCH_CHECK streams every message of more than one part through
// an ostringstream compiled into this library, and on the GPU machine's build (g++ 13.3,
// torch 2.11) the first number streamed there crashed the process (SIGSEGV inside
// ostream::_M_insert<long>) instead of raising (issue 30). A message that is one string
// reaches torch as it is. Every check in decoder/csrc goes through here
// (tests/test_check_messages.py).
namespace kit_check {
inline void put(std::string& s, const char* a) { s += a; }
inline void put(std::string& s, const std::string& a) { s += a; }
inline void put(std::string& s, c10::ScalarType a) { s += c10::toString(a); }
inline void put(std::string& s, double a) { s += std::to_string(a); }
inline void put(std::string& s, c10::IntArrayRef a) {
  s += '[';
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  s += ']';
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void put(std::string& s, T a) { s += std::to_string(a); }
template <typename... A>
inline std::string msg(const A&... a) {
  std::string s;
  (put(s, a), ...);
  return s;
}
}  // namespace kit_check

#define KIT_CHECK(cond, ...) TORCH_CHECK(cond, ::kit_check::msg(__VA_ARGS__))

// KIT_DISPATCH_FLOATS(type, name, fn): fn() with scalar_t bound to the C++ type of a
// float32/float64/float16/bfloat16 tensor (fn returns nothing); AT_DISPATCH's own refusal
// streams its message.
#define KIT_DISPATCH_CASE(ENUM, TYPE, ...) \
  case ENUM: {                             \
    using scalar_t = TYPE;                 \
    return __VA_ARGS__();                  \
  }
#define KIT_DISPATCH_FLOATS(SCALAR_TYPE, NAME, ...)                            \
  [&] {                                                                        \
    const at::ScalarType kit_st_ = (SCALAR_TYPE);                              \
    switch (kit_st_) {                                                         \
      KIT_DISPATCH_CASE(at::kFloat, float, __VA_ARGS__)                        \
      KIT_DISPATCH_CASE(at::kDouble, double, __VA_ARGS__)                      \
      KIT_DISPATCH_CASE(at::kHalf, at::Half, __VA_ARGS__)                      \
      KIT_DISPATCH_CASE(at::kBFloat16, at::BFloat16, __VA_ARGS__)              \
      default:                                                                 \
        KIT_CHECK(false, NAME, ": no kernel for ", kit_st_);                   \
    }                                                                          \
  }()

// the argmax kernels compare in fp32, which would merge distinct float64 values
inline void check_argmax_dtype(const at::Tensor& t, const char* op) {
  const auto d = t.scalar_type();
  KIT_CHECK(d == at::kFloat || d == at::kHalf || d == at::kBFloat16, op, ": float32, float16 or bfloat16 only, got ",
              d);
}

inline void check_linear_argmax(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                int64_t chunk) {
  KIT_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1) && weight.size(0) > 0,
              "linear_argmax: x (R, d) and weight (V, d) with V > 0");
  KIT_CHECK(!bias.has_value() || bias->numel() == weight.size(0), "linear_argmax: bias must have V elements");
  KIT_CHECK(chunk > 0, "linear_argmax: chunk must be positive");
  check_argmax_dtype(x, "linear_argmax");
}
