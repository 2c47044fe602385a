// int8 linear for a few rows (batch-1 decoding): y = dequant(q(x) . wq^T) + b [, relu].
//
// At one row a product is bound by reading the weights and by fixed costs, so
// this is a plain dot product per output row over weights kept (out, in) row
// major, padded to 64 bytes, and no packing, threads or allocation beyond the
// output. Each row of x is quantised with its own symmetric scale to int8 q
// in [-127, 127]; the kernels return exactly sum_k q[k] * wq[j, k] (int32):
//  - AVX-512 VNNI: `vpdpbusd` multiplies u8 x s8, so the activations go in
//    shifted, u = q + 128 (intgemm's trick), and the excess 128 * sum_k wq[j, k]
//    (`w_shift`, made at load time) starts the accumulator negative.
//  - AVX2: `vpmaddubsw` adds pairs of u8 x s8 products into int16 and saturates
//    past 32767, which shifted 8-bit activations reach (2 * 255 * 127). So it
//    multiplies |q| by wq with q's sign (`vpsignb`): pairs stay <= 2 * 127 * 127,
//    all 8 bits kept, and no 7-bit `reduce_range` as fbgemm needs there.
//  - elsewhere a plain loop (compiled per ISA by MULTIVERSION).
// So every path gives the same integers and, through one float epilogue, the
// same output bits: decoder/quant.py `GemvLinear.reference` is that math in
// tensor ops. The SIMD paths are picked at run time from the CPU and the `isa`
// cap (0 plain, 1 AVX2, 2 VNNI: ATEN_CPU_CAPABILITY caps it from Python) under
// DECODER_MAX_CPU_ISA (multiversion.h), so one build runs on any x86-64 and each path can be tested on one machine.
#include <torch/library.h>
#include <ATen/ATen.h>
#include "checks.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GEMV_X86 1
#endif

#include "gemm.h"
#include "gemv.h"
#include "multiversion.h"

namespace {

constexpr int64_t kPad = 64;   // `in` padded to one zmm of int8 (zero weights there)
constexpr int64_t kBlock = 4;  // output rows a block: their four sums reduce together

struct Args {
  const int8_t* q;      // (M, Kp) quantised rows; VNNI: u8 q + 128 instead
  const int8_t* aux;    // AVX2: (M, Kp) |q|
  const int8_t* w;      // (Np, Kp)
  const int32_t* shift; // (Np,) 128 * row sums of w
  int32_t* acc;         // (M, Np)
  int64_t M, Kp, Np;
};

MULTIVERSION(void, dot_plain, (const Args& a, int64_t j0, int64_t j1), (a, j0, j1)) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t r = 0; r < a.M; ++r) {
      const int8_t* q = a.q + r * a.Kp;
      const int8_t* w = a.w + j * a.Kp;
      int32_t s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < a.Kp; ++k) s += static_cast<int32_t>(q[k]) * static_cast<int32_t>(w[k]);
      a.acc[r * a.Np + j] = s;
    }
}

#ifdef GEMV_X86
// four vectors of four int32 -> their four sums, in order
__attribute__((target("sse4.1,ssse3"))) inline __m128i hsum4(__m128i s0, __m128i s1, __m128i s2, __m128i s3) {
  return _mm_hadd_epi32(_mm_hadd_epi32(s0, s1), _mm_hadd_epi32(s2, s3));
}

__attribute__((target("avx2"))) inline __m128i half(__m256i s) {
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m128i quarter(__m512i s) {
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
void dot_vnni(const Args& a, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; j += kBlock) {
    const int8_t* w = a.w + j * a.Kp;
    for (int64_t r = 0; r < a.M; ++r) {
      const int8_t* u = a.q + r * a.Kp;
      __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
      for (int64_t k = 0; k < a.Kp; k += 64) {
        const __m512i x = _mm512_loadu_si512(u + k);
        s0 = _mm512_dpbusd_epi32(s0, x, _mm512_loadu_si512(w + k));
        s1 = _mm512_dpbusd_epi32(s1, x, _mm512_loadu_si512(w + a.Kp + k));
        s2 = _mm512_dpbusd_epi32(s2, x, _mm512_loadu_si512(w + 2 * a.Kp + k));
        s3 = _mm512_dpbusd_epi32(s3, x, _mm512_loadu_si512(w + 3 * a.Kp + k));
      }
      const __m128i s = hsum4(quarter(s0), quarter(s1), quarter(s2), quarter(s3));
      const __m128i sh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.shift + j));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.acc + r * a.Np + j), _mm_sub_epi32(s, sh));
    }
  }
}

// s + sum of q * w by fours: |q| times w with q's sign, int16 pairs <= 2 * 127 * 127 (no saturation)
__attribute__((target("avx2"))) inline __m256i dot(__m256i s, __m256i aq, __m256i q, const int8_t* w) {
  const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)w), q));
  return _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

__attribute__((target("avx2")))
void dot_avx2(const Args& a, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; j += kBlock) {
    const int8_t* w = a.w + j * a.Kp;
    for (int64_t r = 0; r < a.M; ++r) {
      const int8_t* q = a.q + r * a.Kp;
      const int8_t* aq = a.aux + r * a.Kp;
      __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
      for (int64_t k = 0; k < a.Kp; k += 32) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)(q + k));
        const __m256i ax = _mm256_loadu_si256((const __m256i*)(aq + k));
        s0 = dot(s0, ax, x, w + k);
        s1 = dot(s1, ax, x, w + a.Kp + k);
        s2 = dot(s2, ax, x, w + 2 * a.Kp + k);
        s3 = dot(s3, ax, x, w + 3 * a.Kp + k);
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.acc + r * a.Np + j),
                       hsum4(half(s0), half(s1), half(s2), half(s3)));
    }
  }
}

int cpu_isa() {
  static const int isa = [] {
    __builtin_cpu_init();
    const int cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vnni") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
    return std::min(cpu, decoder_isa::level());  // DECODER_MAX_CPU_ISA caps this path too
  }();
  return isa;
}
#else
int cpu_isa() { return 0; }
#endif

// Compiled for baseline x86 only (no FMA to contract into): the product and
// the sum round separately, as the reference's two tensor ops do.
void epilogue(const int32_t* acc, float* y, int64_t n, float xs, const float* ws, const float* b, bool relu) {
  for (int64_t j = 0; j < n; ++j) {
    float v = static_cast<float>(acc[j]) * (xs * ws[j]);
    if (b) v = v + b[j];
    y[j] = relu && v < 0.f ? 0.f : v;
  }
}

int64_t int8_gemv_isa(int64_t cap) { return std::min<int64_t>(cap, cpu_isa()); }

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& w_scale, const at::Tensor& w_shift,
                     const std::optional<at::Tensor>& bias, bool relu, int64_t isa) {
  KIT_CHECK(x.scalar_type() == at::kFloat, "int8_gemv: x must be float32");
  const int64_t K = x.size(-1), N = w_scale.numel();
  const decoder_gemv::Weights w = decoder_gemv::weights(K, wq, w_scale, w_shift, bias);
  const auto x2 = x.reshape({-1, K}).contiguous();
  auto y = at::empty({x2.size(0), N}, x2.options());
  decoder_gemv::gemv(x2.data_ptr<float>(), x2.size(0), K, w, relu, static_cast<int>(int8_gemv_isa(isa)),
                     y.data_ptr<float>());
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

}  // namespace

namespace decoder_gemv {

void gemv(const float* xp, int64_t M, int64_t K, const Weights& w, bool relu, int path, float* yp) {
  const int64_t Np = w.Np, Kp = w.Kp;
  std::vector<int8_t> q(M * Kp), aux(path == 1 ? M * Kp : 0);
  std::vector<float> xs(M);
  std::vector<int32_t> acc(M * Np);
  for (int64_t r = 0; r < M; ++r) {
    int8_t* qr = q.data() + r * Kp;
    xs[r] = decoder_gemm::quantize_row(xp + r * K, qr, K, Kp);  // int8_linear.cpp's
    if (path == 2)  // u8 q + 128: the same bits with the sign bit flipped
      for (int64_t k = 0; k < Kp; ++k) qr[k] = static_cast<int8_t>(static_cast<uint8_t>(qr[k]) ^ 0x80u);
    if (path == 1)
      for (int64_t k = 0; k < Kp; ++k) aux[r * Kp + k] = static_cast<int8_t>(std::abs(qr[k]));
  }
  const Args a{q.data(), aux.data(), w.wq, w.shift, acc.data(), M, Kp, Np};
  // one thread below ~256k multiply-adds a task: batch 1's layer linears never split
  const int64_t blocks = Np / kBlock, grain = std::max<int64_t>(1, (1 << 18) / (M * Kp * kBlock));
  at::parallel_for(0, blocks, grain, [&](int64_t lo, int64_t hi) {
#ifdef GEMV_X86
    if (path == 2) return dot_vnni(a, lo * kBlock, hi * kBlock);
    if (path == 1) return dot_avx2(a, lo * kBlock, hi * kBlock);
#endif
    dot_plain(a, lo * kBlock, hi * kBlock);
  });
  for (int64_t r = 0; r < M; ++r) epilogue(acc.data() + r * Np, yp + r * w.N, w.N, xs[r], w.scale, w.bias, relu);
}

int isa(int64_t cap) { return static_cast<int>(int8_gemv_isa(cap)); }

Weights weights(int64_t K, const at::Tensor& wq, const at::Tensor& w_scale, const at::Tensor& w_shift,
                   const std::optional<at::Tensor>& bias) {
  KIT_CHECK(wq.scalar_type() == at::kChar && wq.dim() == 2 && wq.is_contiguous(),
              "int8_gemv: wq must be contiguous int8 (out, in) padded");
  const int64_t N = w_scale.numel(), Np = wq.size(0), Kp = wq.size(1);
  KIT_CHECK(Kp % kPad == 0 && Kp >= K && Kp < K + kPad, "int8_gemv: wq has ", Kp, " columns for ", K,
              " features, expected ", K, " padded to a multiple of ", kPad);
  KIT_CHECK(Np % kBlock == 0 && Np >= N && Np < N + kBlock, "int8_gemv: wq has ", Np, " rows for ", N,
              " outputs, expected them padded to a multiple of ", kBlock);
  KIT_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous(), "int8_gemv: w_scale float32 (out,)");
  KIT_CHECK(w_shift.scalar_type() == at::kInt && w_shift.numel() == Np && w_shift.is_contiguous(),
              "int8_gemv: w_shift int32 (padded out,)");
  KIT_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous()),
              "int8_gemv: bias float32 (out,)");
  return {wq.data_ptr<int8_t>(), w_scale.data_ptr<float>(), w_shift.data_ptr<int32_t>(),
          bias.has_value() ? bias->data_ptr<float>() : nullptr, N, Np, Kp};
}

}  // namespace decoder_gemv

TORCH_LIBRARY_FRAGMENT(decoder_ops, m) {
  m.def("int8_gemv(Tensor x, Tensor wq, Tensor w_scale, Tensor w_shift, Tensor? bias, bool relu, int isa) -> Tensor");
  m.def("int8_gemv_isa(int cap) -> int", &int8_gemv_isa);  // the path int8_gemv takes under that cap
}

TORCH_LIBRARY_IMPL(decoder_ops, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
}
