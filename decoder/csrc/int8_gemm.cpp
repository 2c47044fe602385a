// int8 x int8 -> int32 matrix product on weights packed once for AVX-512 VNNI.
//
// `at::_int_mm` (oneDNN) reorders the plain (K, N) int8 weights into its VNNI
// layout on every call: ~50 us per MB of weights, a fifth of the decoder's
// int8 products at 30-40 rows. Here they are packed once (at load time, or per
// batch for the shortlist's slice of the output projection):
//   shift  (Np,) int32: 128 x the column sums (zero past N), then
//   panels (Np/64, Kp/4, 64, 4) int8: 64 output columns, each column's 4
//          consecutive k together, zero-padded to Np % 64 == 0 and Kp % 4 == 0,
// all in one int8 tensor. One 64-byte load is then 16 columns x 4 k, and
// `vpdpbusd` multiplies it by one activation row's 4 k broadcast to every lane.
// vpdpbusd takes u8 x s8, so the activations go in shifted (u = q + 128, as in
// int8_gemv.cpp) and the accumulators start at minus the shift: the result is
// exactly sum_k q[k] w[k, j], the integers _int_mm returns. A micro-tile is 6
// rows x 64 columns (24 zmm accumulators), K innermost; a task is one panel and
// up to 96 rows, so a panel stays in L1 while its rows stream past it.
#include <torch/library.h>
#include <ATen/ATen.h>
#include "checks.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GEMM_X86 1
#endif

#include "gemm.h"
#include "multiversion.h"

namespace {

constexpr int64_t kCols = 64;       // columns a panel: four zmm of int32
constexpr int64_t kRows = 6;        // rows a micro-tile: 6 x 4 accumulators of 32 zmm
constexpr int64_t kTaskRows = 96;   // rows a task (16 tiles) over one panel
constexpr int64_t kBlockK4 = 64;    // k groups a pass over a task's tiles: a 16 KB slice of the panel

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

int64_t packed_numel(int64_t N, int64_t K) {
  const int64_t Np = round_up(N, kCols), Kp = round_up(K, 4);
  return Np * 4 + Np * Kp;
}

bool cpu_vnni() {
#ifdef GEMM_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni") && decoder_isa::level() >= 2;
  }();
  return ok;
#else
  return false;
#endif
}

// Panel p of the packed layout: a transpose of 64 rows' 4-byte groups, written in
// order (the 64 source rows, 16 KB at K 256, stay in L1), and the rows' shifts.
MULTIVERSION(void, pack_panel,
             (const int8_t* wp, int64_t K, const int64_t* ip, int64_t N, int64_t p, int8_t* dst, int32_t* shift),
             (wp, K, ip, N, p, dst, shift)) {
  const int64_t K4 = round_up(K, 4) / 4, nc = std::min(kCols, N - p * kCols);
  const int8_t* rows[kCols];
  for (int64_t c = 0; c < kCols; ++c) {
    const int64_t j = p * kCols + c;
    rows[c] = c < nc ? wp + (ip ? ip[j] : j) * K : nullptr;
    int32_t sum = 0;
    for (int64_t k = 0; c < nc && k < K; ++k) sum += rows[c][k];
    shift[j] = 128 * sum;  // zero columns past N: nothing added, nothing written out
  }
  for (int64_t g = 0; g < K4; ++g) {
    int8_t* d = dst + g * kCols * 4;
    const int64_t kn = std::min<int64_t>(4, K - 4 * g);  // 4 but in the last group of a K not a multiple of 4
    for (int64_t c = 0; c < kCols; ++c) {
      if (c < nc && kn == 4) {
        std::memcpy(d + 4 * c, rows[c] + 4 * g, 4);
      } else {
        int8_t b[4] = {0, 0, 0, 0};
        for (int64_t t = 0; c < nc && t < kn; ++t) b[t] = rows[c][4 * g + t];
        std::memcpy(d + 4 * c, b, 4);
      }
    }
  }
}

// The packed layout of rows idx (or all) of wq (rows, K) int8: see the header.
at::Tensor int8_gemm_pack(const at::Tensor& wq, const std::optional<at::Tensor>& idx) {
  KIT_CHECK(wq.scalar_type() == at::kChar && wq.dim() == 2, "int8_gemm_pack: wq must be int8 (out, in)");
  const auto w = wq.contiguous();
  const int64_t K = w.size(1);
  at::Tensor ix;
  if (idx.has_value()) {
    KIT_CHECK(idx->scalar_type() == at::kLong && idx->dim() == 1, "int8_gemm_pack: idx must be int64 (C,)");
    ix = idx->contiguous();
  }
  const int64_t N = idx.has_value() ? ix.numel() : w.size(0);
  const int64_t Np = round_up(N, kCols), Kp = round_up(K, 4), K4 = Kp / 4;
  const int64_t* ip = idx.has_value() ? ix.data_ptr<int64_t>() : nullptr;
  for (int64_t j = 0; ip && j < N; ++j)
    KIT_CHECK(ip[j] >= 0 && ip[j] < w.size(0), "int8_gemm_pack: index ", ip[j], " out of range for ",
                w.size(0), " rows");
  auto out = at::empty({packed_numel(N, K)}, w.options());
  int32_t* shift = reinterpret_cast<int32_t*>(out.data_ptr<int8_t>());
  int8_t* panels = out.data_ptr<int8_t>() + Np * 4;
  const int8_t* wp = w.data_ptr<int8_t>();
  at::parallel_for(0, Np / kCols, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) pack_panel(wp, K, ip, N, p, panels + p * K4 * kCols * 4, shift);
  });
  return out;
}

#ifdef GEMM_X86
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

// c + u8 a x s8 w by fours. As inline asm: through the intrinsic GCC copied every
// accumulator to another register and the stack around each vpdpbusd (half the speed).
VNNI inline __m512i dpbusd(__m512i c, __m512i a, __m512i w) {
  asm("vpdpbusd %[w], %[a], %[c]" : [c] "+v"(c) : [a] "v"(a), [w] "v"(w));
  return c;
}

// Per row r of a tile: its four accumulators (named, not an array: GCC spills arrays
// of vectors to the stack), what one k group adds to them, and their store.
#define ROW_INIT(r) __m512i c##r##0 = n0, c##r##1 = n1, c##r##2 = n2, c##r##3 = n3;
#define ROW_STEP(r)                                                                    \
  if constexpr (MR > r) {                                                              \
    const __m512i a = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(u + r * ldu + 4 * g)); \
    c##r##0 = dpbusd(c##r##0, a, w0);                                     \
    c##r##1 = dpbusd(c##r##1, a, w1);                                     \
    c##r##2 = dpbusd(c##r##2, a, w2);                                     \
    c##r##3 = dpbusd(c##r##3, a, w3);                                     \
  }
#define ROW_LOAD(r)                                                                    \
  if constexpr (MR > r) {                                                              \
    const int32_t* cr = c + r * ldc;                                                   \
    c##r##0 = _mm512_maskz_loadu_epi32(m0, cr);                                        \
    c##r##1 = _mm512_maskz_loadu_epi32(m1, cr + 16);                                   \
    c##r##2 = _mm512_maskz_loadu_epi32(m2, cr + 32);                                   \
    c##r##3 = _mm512_maskz_loadu_epi32(m3, cr + 48);                                   \
  }
#define ROW_STORE(r)                                                                   \
  if constexpr (MR > r) {                                                              \
    int32_t* cr = c + r * ldc;                                                         \
    _mm512_mask_storeu_epi32(cr, m0, c##r##0);                                         \
    _mm512_mask_storeu_epi32(cr + 16, m1, c##r##1);                                    \
    _mm512_mask_storeu_epi32(cr + 32, m2, c##r##2);                                    \
    _mm512_mask_storeu_epi32(cr + 48, m3, c##r##3);                                    \
  }

inline __mmask16 cols_mask(int64_t n) {  // the first n (clamped to 0..16) of 16 lanes
  n = std::clamp<int64_t>(n, 0, 16);
  return static_cast<__mmask16>((1u << n) - 1u);
}

// c (MR, ncols <= 64) = u (MR, 4 K4) . panel - shift: u the shifted activations (row stride ldu);
// first: c starts at minus the shift, else at what an earlier k block left in c
template <int MR>
VNNI void tile(const uint8_t* u, int64_t ldu, const int8_t* panel, int64_t K4, const int32_t* shift, int32_t* c,
               int64_t ldc, int64_t ncols, bool first) {
  // the last panel stores only its columns below N
  const __mmask16 m0 = cols_mask(ncols), m1 = cols_mask(ncols - 16), m2 = cols_mask(ncols - 32),
                  m3 = cols_mask(ncols - 48);
  const __m512i zero = _mm512_setzero_si512();
  const __m512i n0 = _mm512_sub_epi32(zero, _mm512_loadu_si512(shift)),
                n1 = _mm512_sub_epi32(zero, _mm512_loadu_si512(shift + 16)),
                n2 = _mm512_sub_epi32(zero, _mm512_loadu_si512(shift + 32)),
                n3 = _mm512_sub_epi32(zero, _mm512_loadu_si512(shift + 48));
  ROW_INIT(0) ROW_INIT(1) ROW_INIT(2) ROW_INIT(3) ROW_INIT(4) ROW_INIT(5)
  if (!first) {
    ROW_LOAD(0) ROW_LOAD(1) ROW_LOAD(2) ROW_LOAD(3) ROW_LOAD(4) ROW_LOAD(5)
  }
  for (int64_t g = 0; g < K4; ++g) {
    const int8_t* b = panel + g * kCols * 4;
    const __m512i w0 = _mm512_loadu_si512(b), w1 = _mm512_loadu_si512(b + 64), w2 = _mm512_loadu_si512(b + 128),
                  w3 = _mm512_loadu_si512(b + 192);
    ROW_STEP(0) ROW_STEP(1) ROW_STEP(2) ROW_STEP(3) ROW_STEP(4) ROW_STEP(5)
  }
  ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)
}
#undef ROW_INIT
#undef ROW_STEP
#undef ROW_STORE
#undef ROW_LOAD

using Tile = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const int32_t*, int32_t*, int64_t, int64_t,
                     bool);
const Tile kTiles[kRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};
#endif

}  // namespace

namespace {
MULTIVERSION(void, shift_rows, (const uint8_t* x, uint8_t* u, int64_t M, int64_t K, int64_t Kp), (x, u, M, K, Kp)) {
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t k = 0; k < K; ++k) u[r * Kp + k] = x[r * K + k] ^ 0x80u;
    for (int64_t k = K; k < Kp; ++k) u[r * Kp + k] = 0x80u;
  }
}

// y[r, j] = acc[r, j] * xs[r] * ws[j] (+ b[j]) (relu) for `rows` rows of n columns: the one
// dequantising epilogue of the int8 linears (int8_linear.cpp calls it as decoder_gemm::dequant_rows)
MULTIVERSION(void, dequant_tile,
             (const int32_t* acc, int64_t lda, float* y, int64_t ldy, int64_t rows, int64_t n, const float* xs,
              const float* ws, const float* b, bool relu),
             (acc, lda, y, ldy, rows, n, xs, ws, b, relu)) {
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* a = acc + r * lda;
    float* o = y + r * ldy;
    const float s = xs[r];
    if (b) {
      for (int64_t j = 0; j < n; ++j) o[j] = static_cast<float>(a[j]) * s * ws[j] + b[j];
    } else {
      for (int64_t j = 0; j < n; ++j) o[j] = static_cast<float>(a[j]) * s * ws[j];
    }
    if (relu)
      for (int64_t j = 0; j < n; ++j) o[j] = o[j] > 0.f ? o[j] : 0.f;
  }
}

struct Epilogue {  // the dequantising epilogue written from each task's tile
  const float *xs, *ws, *b;  // (M,) row scales, (N,) column scales, (N,) bias or null
  bool relu;
  float* y;  // (M, N)
};

// xq (M, K) int8 . packed -> cp (M, N) int32, or with `epi` y (M, N) float: each task (96 rows
// of one 64-column panel) accumulates in a 24 KB scratch that stays in cache and is dequantised
// from there, so the int32 product is never written out (it left L2 at the encoder's sizes)
void product(const at::Tensor& xq, const at::Tensor& packed, int64_t N, int32_t* cp, const Epilogue* epi) {
  const int64_t M = xq.size(0), K = xq.size(1);
  KIT_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 1 && packed.is_contiguous() &&
              packed.numel() == packed_numel(N, K), "int8_gemm: packed weights of ", packed.numel(),
              " bytes are not int8_gemm_pack's layout of ", N, " outputs x ", K, " features");
  KIT_CHECK(cpu_vnni(), "int8_gemm: this CPU has no AVX-512 VNNI (use torch._int_mm)");
#ifdef GEMM_X86
  if (M == 0 || N == 0) return;
  const int64_t Np = round_up(N, kCols), Kp = round_up(K, 4), K4 = Kp / 4;
  // u = q + 128 (the sign bit flipped), rows padded with u = 128 (q = 0) against zero weights
  std::unique_ptr<uint8_t[]> u(new uint8_t[M * Kp]);
  const auto x = xq.contiguous();
  shift_rows(reinterpret_cast<const uint8_t*>(x.data_ptr<int8_t>()), u.get(), M, K, Kp);
  const int32_t* shift = reinterpret_cast<const int32_t*>(packed.data_ptr<int8_t>());
  const int8_t* panels = packed.data_ptr<int8_t>() + Np * 4;
  const int64_t chunks = (M + kTaskRows - 1) / kTaskRows, tasks = (Np / kCols) * chunks;
  // a thread's share at least ~1M multiply-adds: small products stay on one thread
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / (std::min(M, kTaskRows) * kCols * Kp));
  at::parallel_for(0, tasks, grain, [&](int64_t lo, int64_t hi) {
    std::unique_ptr<int32_t[]> scratch(epi ? new int32_t[kTaskRows * kCols] : nullptr);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t p = t / chunks, r0 = (t % chunks) * kTaskRows, r1 = std::min(M, r0 + kTaskRows);
      const int8_t* panel = panels + p * K4 * kCols * 4;
      const int64_t ncols = std::min(kCols, N - p * kCols), ldc = epi ? kCols : N;
      // row r of the task's int32 at c + (r - r0) * ldc
      int32_t* c = epi ? scratch.get() : cp + r0 * N + p * kCols;
      // K in blocks: at K 1024 a whole panel (64 KB) fell out of L1 between tiles
      for (int64_t g0 = 0; g0 < K4; g0 += kBlockK4) {
        const int64_t gn = std::min(kBlockK4, K4 - g0);
        for (int64_t r = r0; r < r1; r += kRows) {
          const int64_t mr = std::min(kRows, r1 - r);
          kTiles[mr](u.get() + r * Kp + 4 * g0, Kp, panel + g0 * kCols * 4, gn, shift + p * kCols,
                     c + (r - r0) * ldc, ldc, ncols, g0 == 0);
        }
      }
      if (epi) {
        const int64_t j0 = p * kCols;
        dequant_tile(c, ldc, epi->y + r0 * N + j0, N, r1 - r0, ncols, epi->xs + r0, epi->ws + j0,
                     epi->b ? epi->b + j0 : nullptr, epi->relu);
      }
    }
  });
#endif
}

}  // namespace

namespace decoder_gemm {

at::Tensor int_mm(const at::Tensor& xq, const at::Tensor& packed, int64_t N) {
  KIT_CHECK(xq.scalar_type() == at::kChar && xq.dim() == 2, "int8_gemm: xq must be int8 (M, K)");
  auto out = at::empty({xq.size(0), N}, xq.options().dtype(at::kInt));
  product(xq, packed, N, out.data_ptr<int32_t>(), nullptr);
  return out;
}

at::Tensor int_mm_dequant(const at::Tensor& xq, const at::Tensor& packed, int64_t N, const at::Tensor& xs,
                          const float* w_scale, const float* bias, bool relu) {
  KIT_CHECK(xq.scalar_type() == at::kChar && xq.dim() == 2 && packed.scalar_type() == at::kChar,
            "int8_gemm: xq must be int8 (M, K), packed int8_gemm_pack's layout");
  KIT_CHECK(xs.scalar_type() == at::kFloat && xs.is_contiguous() && xs.numel() == xq.size(0),
            "int8_gemm: one float scale per row");
  auto y = at::empty({xq.size(0), N}, xs.options());
  const Epilogue e{xs.data_ptr<float>(), w_scale, bias, relu, y.data_ptr<float>()};
  product(xq, packed, N, nullptr, &e);
  return y;
}

void dequant_rows(const int32_t* acc, int64_t lda, float* y, int64_t ldy, int64_t rows, int64_t n, const float* xs,
                  const float* ws, const float* b, bool relu) {
  dequant_tile(acc, lda, y, ldy, rows, n, xs, ws, b, relu);
}

}  // namespace decoder_gemm

namespace {
at::Tensor int8_gemm(const at::Tensor& xq, const at::Tensor& packed, int64_t n) {
  return decoder_gemm::int_mm(xq, packed, n);
}
bool int8_gemm_available() { return cpu_vnni(); }
// the variant every MULTIVERSION kernel of the library runs: "avx512", "avx2" or "default"
std::string kernel_isa() { return decoder_isa::kNames[decoder_isa::level()]; }
}  // namespace

TORCH_LIBRARY_FRAGMENT(decoder_ops, m) {
  m.def("int8_gemm_pack(Tensor wq, Tensor? idx=None) -> Tensor");
  m.def("int8_gemm(Tensor xq, Tensor packed, int n) -> Tensor");  // packed: int8_gemm_pack's layout
  m.def("int8_gemm_available() -> bool", &int8_gemm_available);  // whether this CPU runs int8_gemm
  m.def("kernel_isa() -> str", &kernel_isa);  // the ISA our kernels run here (multiversion.h)
}

TORCH_LIBRARY_IMPL(decoder_ops, CPU, m) {
  m.impl("int8_gemm_pack", &int8_gemm_pack);
  m.impl("int8_gemm", &int8_gemm);
}
