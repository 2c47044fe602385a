// MULTIVERSION: compile a function for x86-64-v4 (AVX-512), v3 (AVX2+FMA) and
// baseline x86, and pick one at run time, so one build of the library runs on any
// x86-64 without -march=native:
//
//   MULTIVERSION(float, row_max, (const float* x, int64_t n), (x, n)) { ...body... }
//
// The body is compiled once per ISA (three wrappers with GCC target attributes that
// inline it) and a dispatcher calls the widest one that both the CPU and the cap
// DECODER_MAX_CPU_ISA (avx512, avx2 or default; read once) allow. GCC's
// target_clones did the same choice in an ifunc resolver, from CPUID alone, before
// any of our code runs: an AVX2-capped benchmark then still ran our kernels in
// AVX-512. The hand-written kernels (int8_gemm.cpp, int8_gemv.cpp, fused_cpu.cpp's
// F16C code) ask `decoder_isa::level()` the same way.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

// CLONE_INLINE: a helper of MULTIVERSION functions, always inlined into them, so that
// each variant compiles it for its own ISA (GCC may keep a larger helper out of line,
// and that one copy is built for baseline x86: no FMA, 4-wide vectors).
#if defined(__GNUC__)
#define CLONE_INLINE inline __attribute__((always_inline))
#else
#define CLONE_INLINE inline
#endif

namespace decoder_isa {

// levels: 0 baseline x86-64 ("default"), 1 x86-64-v3 ("avx2": AVX2, FMA, F16C), 2 x86-64-v4 ("avx512")
constexpr const char* kNames[3] = {"default", "avx2", "avx512"};
constexpr const char* kCapEnv = "DECODER_MAX_CPU_ISA";

// the level a DECODER_MAX_CPU_ISA value allows; -1 for a value that is not a level's name
inline int parse_cap(const char* v) {
  if (v == nullptr || *v == '\0') return 2;
  std::string s(v);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  for (int l = 0; l < 3; ++l)
    if (s == kNames[l]) return l;
  return -1;
}

// the cap, read once; a bad value caps nothing (decoder/ops.py warns of it when it loads the library)
inline int cap() {
  static const int c = [] {
    const int l = parse_cap(std::getenv(kCapEnv));
    return l < 0 ? 2 : l;
  }();
  return c;
}

// the widest level this CPU runs
inline int cpu() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const int l = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v4") ? 2 : __builtin_cpu_supports("x86-64-v3") ? 1 : 0;
  }();
  return l;
#else
  return 0;
#endif
}

// the level every kernel of the library runs at
inline int level() {
  static const int l = std::min(cap(), cpu());
  return l;
}

}  // namespace decoder_isa

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MULTIVERSION(ret, name, params, args)                                                           \
  CLONE_INLINE ret name##_body params;                                                                  \
  __attribute__((target("arch=x86-64-v4"))) ret name##_v4 params { return name##_body args; }           \
  __attribute__((target("arch=x86-64-v3"))) ret name##_v3 params { return name##_body args; }           \
  ret name##_v0 params { return name##_body args; }                                                     \
  ret name params {                                                                                     \
    switch (decoder_isa::level()) {                                                                     \
      case 2: return name##_v4 args;                                                                    \
      case 1: return name##_v3 args;                                                                    \
      default: return name##_v0 args;                                                                   \
    }                                                                                                   \
  }                                                                                                     \
  CLONE_INLINE ret name##_body params
#else
#define MULTIVERSION(ret, name, params, args) ret name params
#endif
