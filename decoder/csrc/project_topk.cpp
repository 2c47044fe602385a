// Beam search's output projection, log-softmax and top-k in one pass over the
// product's tiles (switch `fused_project_topk`, decoder/optimisations.py).
//
//   int8_linear_topk  x (S*K, d) float through the packed int8 output layer of N
//                     columns (int8_gemm.cpp's layout, its scales and bias), scores
//                     (S*K,) -> per sentence of K beam rows the n best (values (S, n),
//                     indices (S, n) in [0, K*N)) of log_softmax(logits[row]) + score[row]
//
// The reference is the logits written whole, then log-softmax + top-k (decoder/fused.py
// int8_linear_topk_reference). Here each thread takes a block of rows and walks the
// output columns 128 at a time (two of int8_gemm's 64-column panels): that chunk's int32
// product (block rows x 128, in L1/L2) is rescaled exactly as int8_linear's epilogue
// rescales it (the same float logits), and each row keeps
//   - a running max m and 16 partial sums s of e^(logit - m): online log-sum-exp, s
//     scaled by e^(m_old - m_new) when a chunk raises the max;
//   - its n best raw logits, by logit descending, then column ascending.
// The (rows x N) int32 and float logits are never written. At the end a candidate is
// (logit - (m + log s)) + score, rounded as log_softmax_topk rounds it, and each sentence
// takes the n best of its rows' candidates ordered by
//   (candidate descending, row ascending, raw logit descending, column ascending):
// between rows the lower index wins a tie, as in log_softmax_topk; within a row the
// larger logit wins a tie that only the rounding of the candidate made (the plain path
// takes the lower column there), and that is what makes each row's n best logits
// enough to find the sentence's n best exactly. The online sum rounds differently from
// the two-pass sum of log_softmax_topk (the shift moves by an ulp or so), so near ties
// between rows may go the other way than on the plain path. Rows with NaN logits have
// NaN candidates, which sort last.
//
// It is level with the plain path, not ahead (switch off; decoder/optimisations.py says
// by how much): in column order a row's values come in no order, so each row's list takes a
// few dozen entries (k ln(N/k)) and most 16-value blocks need a look, where the plain
// log_softmax_topk, knowing each row's shift first, keeps one list per sentence whose
// bar skips most columns of the beams behind the best.
#include <torch/library.h>
#include <ATen/ATen.h>
#include "checks.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "exp.h"
#include "gemm.h"
#include "multiversion.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TOPK_X86 1
#endif

namespace {

// The op runs only where int8_gemm's VNNI product does (AVX-512): its epilogue is AVX-512 code.
#ifdef TOPK_X86
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))
#else
#define AVX512
#endif

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kPanel = decoder_gemm::kPanelCols;
constexpr int64_t kTileRows = 6;     // int8_gemm.cpp's micro-tile rows: threads split the rows in whole tiles
constexpr int64_t kBlockRows = 96;   // rows a walk over the columns (as int8_gemm's tasks: the weights stream
                                     // past once per block)
constexpr int64_t kChunk = 2 * kPanel;  // columns an epilogue pass: per-row costs (a max across lanes, the
                                        // best-list check) once per 128 values; 48 KB of int32 (four
                                        // panels a pass, 96 KB, were 1.1x slower)
constexpr int64_t kLanes = 16;       // each row's sum of exps kept in 16 partial sums, added up once at the end

// Each row's running state, indexed by row; a row's best list is tv/ti[row * nr, +count).
struct Rows {
  float *m, *s, *tv;  // s: kLanes partial sums a row
  int64_t *ti, *count;
  int64_t nr;  // the most candidates a row keeps: n, or N if fewer
};

// x into the sorted best list tv/ti of k < nr or, full, in place of its last; the caller
// knows it belongs there. Without branches on the data: a branch on where a value goes
// mispredicts at nearly every entry (the entries come in no order), and each row takes a
// few dozen.
CLONE_INLINE void insert(float x, int64_t col, float* tv, int64_t* ti, int64_t k, int64_t nr) {
  int64_t p = 0;
  for (int64_t i = 0; i < k; ++i) p += tv[i] >= x;  // equal values already in stay ahead
  for (int64_t i = nr - 1; i > 0; --i) {  // every slot, selects: a fixed trip count
    const bool down = i > p;
    tv[i] = down ? tv[i - 1] : tv[i];
    ti[i] = down ? ti[i - 1] : ti[i];
  }
  tv[p] = x;
  ti[p] = col;
}

// v[0, nc) at columns c0.. into a best list of at most nr (descending; an equal value
// later in the row never enters, so the lower column stays ahead); NaNs never enter.
// Once the list is full, one compare per 16 values finds those above its last entry:
// in column order a row's values come in no order, so a full list still takes a few
// dozen entries a row, each from a different block.
AVX512 inline void keep_best(const float* v, int64_t nc, int64_t c0, float* tv, int64_t* ti, int64_t* count,
                             int64_t nr) {
  int64_t k = *count, start = 0;
  for (; k < nr && start < nc; ++start) {  // the list's first values: each enters
    if (v[start] != v[start]) continue;
    insert(v[start], c0 + start, tv, ti, k, nr);
    ++k;
  }
  *count = k;
  if (k < nr) return;
#ifdef TOPK_X86
  for (int64_t j0 = start; j0 < nc; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, nc - j0);
    const __mmask16 lanes = static_cast<__mmask16>(m == 16 ? 0xFFFFu : (1u << m) - 1u);
    __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes, _mm512_maskz_loadu_ps(lanes, v + j0),
                                            _mm512_set1_ps(tv[nr - 1]), _CMP_GT_OQ);
    while (hit) {
      const int l = __builtin_ctz(hit);
      hit = static_cast<__mmask16>(hit & (hit - 1));
      const float x = v[j0 + l];
      if (x > tv[nr - 1])  // an earlier one of the block may have raised the bar past it
        insert(x, c0 + j0 + l, tv, ti, nr, nr);
    }
  }
#else  // never run (no VNNI product), but the library builds everywhere
  for (int64_t j = start; j < nc; ++j)
    if (v[j] > tv[nr - 1]) insert(v[j], c0 + j, tv, ti, nr, nr);
#endif
}

// One chunk of the product c (mb rows x nc columns, row stride kChunk) of rows r0.. at
// columns c0..: rescaled as decoder_gemm::dequant_rows (acc * xs * ws [+ b], the same
// bits), folded into each row's max and partial sums, and the values that can enter into
// the row's best list.
AVX512 void chunk_epilogue(const int32_t* c, int64_t mb, int64_t nc, int64_t c0, int64_t r0, const float* xs,
                    const float* ws, const float* b, const Rows& st) {
  float v[kChunk];
  for (int64_t r = 0; r < mb; ++r) {
    const int64_t row = r0 + r;
    const int32_t* acc = c + r * kChunk;
    const float x = xs[row];
    if (b) {
      for (int64_t j = 0; j < nc; ++j) v[j] = static_cast<float>(acc[j]) * x * ws[j] + b[j];
    } else {
      for (int64_t j = 0; j < nc; ++j) v[j] = static_cast<float>(acc[j]) * x * ws[j];
    }
    float cm = kNegInf;
#pragma omp simd reduction(max : cm)
    for (int64_t j = 0; j < nc; ++j) cm = v[j] > cm ? v[j] : cm;
    float& m = st.m[row];
    float sum[kLanes];
    std::copy(st.s + row * kLanes, st.s + (row + 1) * kLanes, sum);
    if (cm > m) {  // a new max: the sums so far rescaled to it (e^-inf = 0 on the first chunk)
      const float f = exp_nonpos(m - cm);
      for (int64_t l = 0; l < kLanes; ++l) sum[l] *= f;
      m = cm;
    }
    if (m != kNegInf) {  // else every logit so far is -inf and adds nothing
      const float mm = m;
      int64_t j0 = 0;
      for (; j0 + kLanes <= nc; j0 += kLanes)
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) sum[l] += exp_nonpos(v[j0 + l] - mm);
      for (int64_t l = 0; j0 + l < nc; ++l) sum[l] += exp_nonpos(v[j0 + l] - mm);
    }
    std::copy(sum, sum + kLanes, st.s + row * kLanes);
    float* tv = st.tv + row * st.nr;
    if (st.count[row] < st.nr || cm > tv[st.nr - 1])  // most chunks of most rows: none can enter
      keep_best(v, nc, c0, tv, st.ti + row * st.nr, st.count + row, st.nr);
  }
}

struct Candidate {
  float c;         // (logit - shift) + score; NaN sorts as -inf
  int64_t row;     // the beam row within its sentence
  float logit;
  int64_t col;
};

bool before(const Candidate& a, const Candidate& b) {
  const float ac = a.c != a.c ? kNegInf : a.c, bc = b.c != b.c ? kNegInf : b.c;
  if (ac != bc) return ac > bc;
  if (a.row != b.row) return a.row < b.row;
  if (a.logit != b.logit) return a.logit > b.logit;
  return a.col < b.col;
}

// Per sentence of K rows the n best of their rows' candidates -> values, indices (S, n)
void merge_sentences(const Rows& st, const float* sp, int64_t S, int64_t K, int64_t N, int64_t n, float* vp,
                     int64_t* ip) {
  at::parallel_for(0, S, 16, [&](int64_t lo, int64_t hi) {
    std::vector<Candidate> cands;
    cands.reserve(K * st.nr);
    for (int64_t s = lo; s < hi; ++s) {
      cands.clear();
      for (int64_t k = 0; k < K; ++k) {
        const int64_t row = s * K + k;
        float sum = 0.f;
        for (int64_t l = 0; l < kLanes; ++l) sum += st.s[row * kLanes + l];
        const float shift = st.m[row] + std::log(sum), add = sp[row];
        for (int64_t i = 0; i < st.count[row]; ++i) {
          const float l = st.tv[row * st.nr + i];
          cands.push_back({(l - shift) + add, k, l, st.ti[row * st.nr + i]});
        }
      }
      const int64_t m = std::min<int64_t>(n, static_cast<int64_t>(cands.size()));
      std::partial_sort(cands.begin(), cands.begin() + m, cands.end(), before);
      for (int64_t j = 0; j < n; ++j) {  // fewer than n only where NaN logits never entered a list
        vp[s * n + j] = j < m ? cands[j].c : kNegInf;
        ip[s * n + j] = j < m ? cands[j].row * N + cands[j].col : 0;
      }
    }
  });
}

void check_args(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                const std::optional<at::Tensor>& bias, int64_t N, const at::Tensor& scores, int64_t K, int64_t n) {
  KIT_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_linear_topk: x must be float32 (rows, d)");
  const int64_t R = x.size(0), Np = (N + kPanel - 1) / kPanel * kPanel;
  KIT_CHECK(K > 0 && R % K == 0, "int8_linear_topk: ", R, " rows are not a multiple of K=", K);
  KIT_CHECK(scores.numel() == R && scores.scalar_type() == at::kFloat, "int8_linear_topk: one float score per row");
  KIT_CHECK(N > 0 && n > 0 && n <= K * N, "int8_linear_topk: n must be in [1, K*N]");
  KIT_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() == Np * 4 + Np * decoder_gemm::padded_k(x.size(1)),
              "int8_linear_topk: packed weights are not int8_gemm_pack's layout of ", N, " outputs x ", x.size(1),
              " features");
  KIT_CHECK(w_scale.numel() == N && w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous(),
              "int8_linear_topk: w_scale must be float32 (N,)");
  KIT_CHECK(!bias.has_value() || (bias->numel() == N && bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              "int8_linear_topk: bias must be float32 (N,)");
  KIT_CHECK(decoder_gemm::vnni(), "int8_linear_topk: this CPU has no AVX-512 VNNI");
}

std::tuple<at::Tensor, at::Tensor> int8_linear_topk(const at::Tensor& x, const at::Tensor& packed,
                                                    const at::Tensor& w_scale, const std::optional<at::Tensor>& bias,
                                                    int64_t N, const at::Tensor& scores, int64_t K, int64_t n) {
  check_args(x, packed, w_scale, bias, N, scores, K, n);
  const int64_t R = x.size(0), d = x.size(1), S = R / K, Kp = decoder_gemm::padded_k(d);
  auto values = at::empty({S, n}, x.options());
  auto indices = at::empty({S, n}, x.options().dtype(at::kLong));
  if (R == 0) return {values, indices};
  auto [xq, xs] = decoder_gemm::quantize_rows(x);  // (R, d) int8, (R,): int8_linear's own quantisation
  std::unique_ptr<uint8_t[]> u(new uint8_t[R * Kp]);
  decoder_gemm::shift_activations(xq.data_ptr<int8_t>(), u.get(), R, d);
  const int64_t nr = std::min(n, N);
  std::vector<float> m(R, kNegInf), s(R * kLanes, 0.f), tv(R * nr);
  std::vector<int64_t> ti(R * nr), count(R, 0);
  const Rows st{m.data(), s.data(), tv.data(), ti.data(), count.data(), nr};
  const float *xsp = xs.data_ptr<float>(), *ws = w_scale.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int8_t* pk = packed.data_ptr<int8_t>();
  // each thread a run of whole tiles; per block of rows every panel once, so the weights
  // stream past once per block, as int8_gemm's tasks read them
  at::parallel_for(0, (R + kTileRows - 1) / kTileRows, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int32_t> c(kBlockRows * kChunk);
    const int64_t end = std::min(R, hi * kTileRows);
    for (int64_t r0 = lo * kTileRows; r0 < end; r0 += kBlockRows) {
      const int64_t mb = std::min(kBlockRows, end - r0);
      for (int64_t c0 = 0; c0 < N; c0 += kChunk) {
        const int64_t nc = std::min(kChunk, N - c0);
        for (int64_t p = c0 / kPanel; p * kPanel < c0 + nc; ++p)
          decoder_gemm::panel_product(u.get() + r0 * Kp, mb, d, pk, N, p, c.data() + (p * kPanel - c0), kChunk);
        chunk_epilogue(c.data(), mb, nc, c0, r0, xsp, ws + c0, bp ? bp + c0 : nullptr, st);
      }
    }
  });
  merge_sentences(st, scores.contiguous().data_ptr<float>(), S, K, N, n, values.data_ptr<float>(),
                  indices.data_ptr<int64_t>());
  return {values, indices};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(decoder_ops, m) {
  m.def("int8_linear_topk(Tensor x, Tensor packed, Tensor w_scale, Tensor? bias, int N, Tensor scores, int K, "
        "int n) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(decoder_ops, CPU, m) {
  m.impl("int8_linear_topk", &int8_linear_topk);
}
