// MULTIVERSION: compile a function for x86-64-v4 (AVX-512), v3 (AVX2+FMA) and
// baseline x86, and let the loader pick one at run time (GCC target_clones), so
// one build of the library runs on any x86-64 without -march=native.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MULTIVERSION
#endif

// CLONE_INLINE: a helper of MULTIVERSION functions, always inlined into them, so that
// each clone compiles it for its own ISA (GCC may keep a larger helper out of line,
// and that one copy is built for baseline x86: no FMA, 4-wide vectors).
#if defined(__GNUC__)
#define CLONE_INLINE inline __attribute__((always_inline))
#else
#define CLONE_INLINE inline
#endif
