// Fused elementwise ops of the decode step, CPU kernels (TenTrans / Amun style).
//
//   add_bias_residual_layernorm  r = x + h + b;  y = LayerNorm(r)   -> (r, y)
//   log_softmax_topk             per sentence of K beam rows: the n best of
//                                log_softmax(logits[row]) + score[row] over K*V
//                                (normalized: the rows are log-probs already)
//   decode_attention             softmax(q k^T / sqrt(hd) + mask) v for the few
//                                queries of a decode step (no ATen SDPA set-up)
//   decode_attention_rows        the same with key j of row b read from cache row
//                                rows[b, j]: beam search without moving its cache
//   encoder_attention            the encoder's self-attention straight from the fused
//                                q|k|v product (B, S, 3d) to the merged heads (B, S, d),
//                                vectorised over keys and features for many queries
//   cross_arrange, cross_attention  the decoder's cross-attention: the cross K/V laid
//                                out once per batch for the encoder op's register
//                                blocks, then each step's queries (a sentence's beams)
//   ngram_block_                 in place: -inf for every token that would repeat
//                                an n-gram of the row's history (no_repeat_ngram_size)
//   argmax_rows                  greedy's argmax over each row of the logits
//   linear_argmax                argmax(x W^T + b) per row, one vocabulary chunk
//                                at a time: the full logits are never written
//   one_row_layer                a whole decoder layer for one sentence, greedy:
//                                int8 gemv products, cache write, attention and
//                                residual LayerNorms in one call (batch-1 latency)
//
// Each replaces several ATen dispatches and full passes over memory with one
// call and one or two passes. References: decoder/fused.py (the tests compare
// against them, and torch.library.opcheck checks the registrations). fp32,
// bf16 and fp16 inputs; arithmetic in fp32. The float loops are compiled for
// x86-64-v4 (AVX-512), v3 (AVX2+FMA) and baseline x86, picked at load time.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>

#include "exp.h"
#include "gemv.h"
#include "multiversion.h"
#include "checks.h"
#include "vocab_chunks.h"
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace {

// r = x + h (+ b), then mean and variance of r in two passes (as ATen's
// layer_norm: no E[x^2]-E[x]^2 cancellation); y = (r - mean) * rstd * g + beta.
MULTIVERSION(void, residual_norm_row,
             (const float* x, const float* h, const float* b, const float* g, const float* beta, float* r,
              float* y, int64_t n, float eps),
             (x, h, b, g, beta, r, y, n, eps)) {
  float sum = 0.f;
  if (b) {
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) { r[i] = x[i] + h[i] + b[i]; sum += r[i]; }
  } else {
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) { r[i] = x[i] + h[i]; sum += r[i]; }
  }
  const float mean = sum / n;
  float var = 0.f;
#pragma omp simd reduction(+ : var)
  for (int64_t i = 0; i < n; ++i) { const float d = r[i] - mean; var += d * d; }
  const float rstd = 1.f / std::sqrt(var / n + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = (r[i] - mean) * rstd * g[i] + beta[i];
}

MULTIVERSION(float, row_max, (const float* x, int64_t n), (x, n)) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

MULTIVERSION(float, row_sum_exp, (const float* x, int64_t n, float m), (x, n, m)) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += exp_nonpos(x[i] - m);
  return s;
}

// p[j] = e^(p[j] - m) in place; returns their sum (inlined into its caller's clones)
CLONE_INLINE float exp_shift_sum(float* p, int64_t n, float m) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) {
    p[i] = exp_nonpos(p[i] - m);
    s += p[i];
  }
  return s;
}

// the rows as fp32: the tensor itself when it is fp32 and contiguous, else a converted copy
at::Tensor as_float_rows(const at::Tensor& t, int64_t n) {
  return t.reshape({-1, n}).to(at::kFloat).contiguous();
}

std::tuple<at::Tensor, at::Tensor> add_bias_residual_layernorm(
    const at::Tensor& x, const at::Tensor& h, const std::optional<at::Tensor>& bias,
    const at::Tensor& gamma, const at::Tensor& beta, double eps) {
  const int64_t n = x.size(-1);
  KIT_CHECK(h.sizes() == x.sizes(), "add_bias_residual_layernorm: x and h differ in shape");
  KIT_CHECK(gamma.numel() == n && beta.numel() == n, "add_bias_residual_layernorm: norm weights must have ", n,
              " elements");
  KIT_CHECK(!bias.has_value() || bias->numel() == n, "add_bias_residual_layernorm: bias must have ", n,
              " elements");
  auto xf = as_float_rows(x, n), hf = as_float_rows(h, n);
  auto gf = gamma.to(at::kFloat).contiguous(), bf = beta.to(at::kFloat).contiguous();
  at::Tensor biasf;
  if (bias.has_value()) biasf = bias->to(at::kFloat).contiguous();
  const int64_t rows = xf.size(0);
  const bool native = x.scalar_type() == at::kFloat;
  auto r = at::empty({rows, n}, xf.options()), y = at::empty({rows, n}, xf.options());
  const float *xp = xf.data_ptr<float>(), *hp = hf.data_ptr<float>(), *gp = gf.data_ptr<float>(),
              *bp = bf.data_ptr<float>(), *bb = bias.has_value() ? biasf.data_ptr<float>() : nullptr;
  float *rp = r.data_ptr<float>(), *yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      residual_norm_row(xp + i * n, hp + i * n, bb, gp, bp, rp + i * n, yp + i * n, n, static_cast<float>(eps));
  });
  if (!native) { r = r.to(x.scalar_type()); y = y.to(x.scalar_type()); }
  return {r.view(x.sizes()), y.view(x.sizes())};
}

// logits (S*K, V), scores (S*K,) -> values (S, n) fp32 descending, indices (S, n) int64 in [0, K*V).
// Per row: max and sum of exp (two passes), then one pass that keeps the n
// best of logit - (max + log sum) + score in a small sorted buffer; the full
// log-probability matrix is never written. Ties go to the lower index.
// `normalized`: the rows are ATen's log-probs, the shift is 0, and each
// candidate is lp + score rounded once, exactly as the plain path adds them,
// so the pick equals log_softmax + add + topk bit for bit.
constexpr int64_t kBlock = 64;  // log_softmax_topk's skip test granularity

std::tuple<at::Tensor, at::Tensor> log_softmax_topk(const at::Tensor& logits, const at::Tensor& scores,
                                                    int64_t K, int64_t n, bool normalized) {
  KIT_CHECK(logits.dim() == 2, "log_softmax_topk: logits must be (rows, V)");
  const int64_t R = logits.size(0), V = logits.size(1);
  KIT_CHECK(K > 0 && R % K == 0, "log_softmax_topk: ", R, " rows are not a multiple of K=", K);
  KIT_CHECK(scores.numel() == R, "log_softmax_topk: one score per row");
  KIT_CHECK(n > 0 && n <= K * V, "log_softmax_topk: n must be in [1, K*V]");
  const int64_t S = R / K;
  auto lf = logits.to(at::kFloat).contiguous();
  auto sf = scores.to(at::kFloat).contiguous();
  auto values = at::empty({S, n}, lf.options());
  auto indices = at::empty({S, n}, lf.options().dtype(at::kLong));
  const float *lp = lf.data_ptr<float>(), *sp = sf.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t lo, int64_t hi) {
    std::vector<std::pair<float, int64_t>> best;  // descending by value, then ascending index
    best.reserve(n + 1);
    for (int64_t s = lo; s < hi; ++s) {
      best.clear();
      for (int64_t k = 0; k < K; ++k) {
        const float* row = lp + (s * K + k) * V;
        float shift = 0.f;
        if (!normalized) {
          const float m = row_max(row, V);
          shift = m + std::log(row_sum_exp(row, V, m));
        }
        const float add = sp[s * K + k];
        for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
          const int64_t b1 = std::min(V, b0 + kBlock);
          if (static_cast<int64_t>(best.size()) == n) {
            // once the list is full most blocks cannot enter it: one vectorised max
            // per block against the entry bar in logit space skips them (the
            // margin covers rounding; NaNs never enter either way)
            const float bar = (best.back().first - add) + shift;
            const float slack = 1e-4f * (1.f + std::fabs(bar) + std::fabs(best.back().first - add));
            if (row_max(row + b0, b1 - b0) < bar - slack) continue;
          }
          for (int64_t v = b0; v < b1; ++v) {
            const float c = (row[v] - shift) + add;
            if (static_cast<int64_t>(best.size()) == n && !(c > best.back().first)) continue;
            const std::pair<float, int64_t> e{c, k * V + v};
            auto pos = std::upper_bound(best.begin(), best.end(), e, [](const auto& a, const auto& b) {
              return a.first > b.first || (a.first == b.first && a.second < b.second);
            });
            best.insert(pos, e);
            if (static_cast<int64_t>(best.size()) > n) best.pop_back();
          }
        }
      }
      for (int64_t j = 0; j < n; ++j) { vp[s * n + j] = best[j].first; ip[s * n + j] = best[j].second; }
    }
  });
  return {values, indices};
}

// Inlined into attend_heads, so that each ISA clone vectorises them for its own width.
inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

struct AttendArgs {
  const float* q;
  const float *k, *v;
  const bool* mask;     // (B, T) or null
  const int64_t* rows;  // (B, T) or null: key j of row b is in k's row rows[b, j], else in row b
  float* out;
  int64_t H, Q, D, T, ks0, ks1, ks2, vs0, vs1, vs2;
  float scale;
};

// The (b, h) pairs [lo, hi): Q*T dot products of length D, a softmax over T,
// and T axpys each. p is T floats of scratch.
// always_inline: its body must be compiled in each ISA clone below, not once for baseline x86
inline __attribute__((always_inline)) void attend_heads_of(const AttendArgs& a, int64_t lo, int64_t hi, float* p) {
  const int64_t H = a.H, Q = a.Q, D = a.D, T = a.T;
  const float *k = a.k, *v = a.v;
  for (int64_t bh = lo; bh < hi; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    const bool* mb = a.mask ? a.mask + b * T : nullptr;
    const int64_t* rb = a.rows ? a.rows + b * T : nullptr;
    // key/value j: row b's own, or the row the table names (same head, same position)
    auto key = [&](int64_t j) { return k + (rb ? rb[j] : b) * a.ks0 + h * a.ks1 + j * a.ks2; };
    auto val = [&](int64_t j) { return v + (rb ? rb[j] : b) * a.vs0 + h * a.vs1 + j * a.vs2; };
    for (int64_t i = 0; i < Q; ++i) {
      const float* qi = a.q + (bh * Q + i) * D;
      float* oi = a.out + (bh * Q + i) * D;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < T; ++j) {
        p[j] = (mb && !mb[j]) ? -std::numeric_limits<float>::infinity() : dot(qi, key(j), D) * a.scale;
        mx = p[j] > mx ? p[j] : mx;
      }
      std::fill(oi, oi + D, 0.f);
      if (mx == -std::numeric_limits<float>::infinity()) {  // every key masked: NaN (older SDPA; 2.13 on CPU gives 0); decoding never has it
        std::fill(oi, oi + D, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      const float inv = 1.f / exp_shift_sum(p, T, mx);
      for (int64_t j = 0; j < T; ++j)
        if (p[j] != 0.f) axpy(p[j] * inv, val(j), oi, D);
    }
  }
}

MULTIVERSION(void, attend_heads, (const AttendArgs& a, int64_t lo, int64_t hi, float* p),
             (a, lo, hi, p)) { attend_heads_of(a, lo, hi, p); }

// q (B, H, Q, D), k and v (N, H, T, D) with any strides but the last (the cache
// slice [:, :, :t+1] is not contiguous), mask (B, 1, 1, T) bool, True = attend;
// rows (B, T) long or none (then N = B). One (b, h) pair per task; at decode
// sizes this is microseconds, where ATen's SDPA spends more choosing and
// setting up its kernel.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& rows) {
  KIT_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v must be (B, H, *, D)");
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3), T = k.size(2);
  KIT_CHECK((rows.has_value() || k.size(0) == B) && k.size(1) == H && k.size(3) == D && v.sizes() == k.sizes(),
              "decode_attention: k and v must be (B, H, T, D) matching q");
  KIT_CHECK(!mask.has_value() || (mask->numel() == B * T && mask->scalar_type() == at::kBool),
              "decode_attention: mask must be bool (B, 1, 1, T)");
  at::Tensor r;
  if (rows.has_value()) {
    KIT_CHECK(rows->dim() == 2 && rows->size(0) == B && rows->size(1) == T && rows->scalar_type() == at::kLong,
                "decode_attention_rows: rows must be long (B, T)");
    r = rows->contiguous();
    // an index outside the cache would read past it: one pass over the B*T integers a call
    const int64_t* rp = r.data_ptr<int64_t>();
    const int64_t N = k.size(0);
    KIT_CHECK(std::all_of(rp, rp + B * T, [N](int64_t x) { return x >= 0 && x < N; }),
                "decode_attention_rows: a row index is outside the cache's ", N, " rows");
  }
  auto qf = q.to(at::kFloat).contiguous();
  auto kf = k.to(at::kFloat), vf = v.to(at::kFloat);
  if (kf.stride(3) != 1) kf = kf.contiguous();
  if (vf.stride(3) != 1) vf = vf.contiguous();
  at::Tensor m;
  if (mask.has_value()) m = mask->reshape({B, T}).contiguous();
  auto out = at::empty({B, H, Q, D}, qf.options());
  const AttendArgs args{qf.data_ptr<float>(), kf.data_ptr<float>(), vf.data_ptr<float>(),
                        mask.has_value() ? m.data_ptr<bool>() : nullptr,
                        rows.has_value() ? r.data_ptr<int64_t>() : nullptr, out.data_ptr<float>(),
                        H, Q, D, T, kf.stride(0), kf.stride(1), kf.stride(2), vf.stride(0), vf.stride(1),
                        vf.stride(2), 1.f / std::sqrt(static_cast<float>(D))};
  at::parallel_for(0, B * H, 4, [&](int64_t lo, int64_t hi) {
    std::vector<float> p(T);
    attend_heads(args, lo, hi, p.data());
  });
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask) {
  return attend(q, k, v, mask, std::nullopt);
}

at::Tensor decode_attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& rows, const std::optional<at::Tensor>& mask) {
  return attend(q, k, v, mask, rows);
}

// -- encoder self-attention over the fused q|k|v product -------------------------------------
// Many queries against the same keys: the decode kernel's dot product and axpy
// per key (a horizontal sum per score) lose to SDPA there. Here, per (b, h), the
// attended keys are gathered once, K transposed into Kt (D, Sp) and V into
// (n, Dp), so both products are FMAs along a vector of keys (scores) or of
// features (output) with kQB queries' accumulators held in registers: no
// horizontal sum anywhere. Masked keys are left out of the gather, not given
// -inf; a query with no key to attend gets zeros, as ATen's CPU SDPA gives.
// The decoder's cross-attention (below) runs the same blocks on keys gathered
// once per batch.
constexpr int64_t kW = 16;  // vector width of the register blocks (one zmm, two ymm)
constexpr int64_t kQB = 4;  // queries per block: 4 x 16 accumulators

struct EncAttnArgs {
  const float* qkv;   // (B, S, 3 * H * D)
  const bool* mask;   // (B, S) or null
  float* out;         // (B, S, H * D)
  int64_t H, S, D;
  float scale;
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// One task's scratch: Q (Sq, D), Kt (D, Sp), V (S, Dp), scores (kQB, Sp), keys and
// queries padded to whole register blocks.
struct EncScratch {
  int64_t Sp, Dp, Sq;
  EncScratch(int64_t S, int64_t D) : Sp(round_up(S, kW)), Dp(round_up(D, kW)), Sq(round_up(S, kQB)) {}
  int64_t floats(int64_t S, int64_t D) const { return Sq * D + D * Sp + S * Dp + kQB * Sp; }
};

// acc[r][w] += sum_k a[r * lda + k] * b[k * ldb + r * rb + w] for the first R rows r and
// kW columns w. rb = 0: R rows of a (queries) against the same kW columns of b (keys of
// K^T, features of V); lda = 0, rb = kW: one row of a against R x kW side-by-side columns
// of b (one query, keeping the accumulators busy). Inlined into the attention kernels, so
// each ISA clone vectorises it.
template <int64_t R = kQB>
CLONE_INLINE void fma_block(float (&acc)[kQB][kW], const float* a, int64_t lda, const float* b, int64_t ldb,
                            int64_t rb, int64_t steps) {
  for (int64_t k = 0; k < steps; ++k) {
    const float* bk = b + k * ldb;
    for (int64_t qi = 0; qi < R; ++qi) {
      const float av = a[qi * lda + k];
#pragma omp simd
      for (int64_t w = 0; w < kW; ++w) acc[qi][w] += av * bk[qi * rb + w];
    }
  }
}

// The positions j < S with m[j] (every one when m is null) into keys; returns how many.
inline int64_t attended_keys(const bool* m, int64_t S, int64_t* keys) {
  int64_t n = 0;
  for (int64_t j = 0; j < S; ++j)
    if (!m || m[j]) keys[n++] = j;
  return n;
}

// Kt (D, ldk): the keys keys[0..n) of k transposed, zero from n to ldk; V (n, ldv):
// their values, zero past D. Row j of k starts at k + j * ks, of v at v + j * vs.
inline void gather_keys(const float* k, int64_t ks, const float* v, int64_t vs, const int64_t* keys, int64_t n,
                        int64_t D, float* Kt, int64_t ldk, float* V, int64_t ldv) {
  for (int64_t c = 0; c < D; ++c) std::fill(Kt + c * ldk + n, Kt + (c + 1) * ldk, 0.f);
  for (int64_t jj = 0; jj < n; ++jj) {
    const float* kr = k + keys[jj] * ks;
    for (int64_t c = 0; c < D; ++c) Kt[c * ldk + jj] = kr[c];
    const float* vr = v + keys[jj] * vs;
    std::copy(vr, vr + D, V + jj * ldv);
    std::fill(V + jj * ldv + D, V + (jj + 1) * ldv, 0.f);
  }
}

// Q (round_up(n, kQB), D) = the n query rows q + i * ldq times scale, zero rows after.
CLONE_INLINE void scaled_queries(const float* q, int64_t ldq, int64_t n, int64_t D, float scale, float* Q) {
  for (int64_t i = 0; i < n; ++i) {
    const float* qr = q + i * ldq;
#pragma omp simd
    for (int64_t c = 0; c < D; ++c) Q[i * D + c] = qr[c] * scale;
  }
  std::fill(Q + n * D, Q + round_up(n, kQB) * D, 0.f);
}

// The first n of the np scores p -> e^(p - max) in place, the rest -> 0 (padding keys
// get -inf, so the softmax runs over whole vectors); returns 1 / their sum.
CLONE_INLINE float softmax_unscaled(float* p, int64_t n, int64_t np) {
  std::fill(p + n, p + np, -std::numeric_limits<float>::infinity());
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < np; ++j) mx = p[j] > mx ? p[j] : mx;
  return 1.f / exp_shift_sum(p, np, mx);
}

// kQB queries (the rows of Q, D each, scaled) against n keys: Kt (D, ldk) the keys
// transposed, V (n, ldv) their values (ldv >= round_up(D, kW), zero past D). P:
// kQB x round_up(n, kW) floats of scratch. The first nq queries' outputs go to
// out + qi * ldo, D features each.
CLONE_INLINE void attend_queries(const float* Q, int64_t D, const float* Kt, int64_t ldk, const float* V, int64_t ldv,
                                 int64_t n, float* P, float* out, int64_t ldo, int64_t nq) {
  const int64_t np = round_up(n, kW);
  for (int64_t j0 = 0; j0 < np; j0 += kW) {  // scores, kW keys at a time
    float acc[kQB][kW] = {};
    fma_block(acc, Q, D, Kt + j0, ldk, 0, D);
    for (int64_t qi = 0; qi < kQB; ++qi) std::copy(acc[qi], acc[qi] + kW, P + qi * np + j0);
  }
  float inv[kQB];
  for (int64_t qi = 0; qi < kQB; ++qi) inv[qi] = softmax_unscaled(P + qi * np, n, np);
  // out[i] = sum_j p[i, j] V[j] / sum_j p[i, j], kW features at a time
  for (int64_t c0 = 0; c0 < D; c0 += kW) {
    float acc[kQB][kW] = {};
    fma_block(acc, P, np, V + c0, ldv, 0, n);
    const int64_t w1 = std::min(kW, D - c0);
    for (int64_t qi = 0; qi < nq; ++qi) {
      float* o = out + qi * ldo + c0;
      for (int64_t w = 0; w < w1; ++w) o[w] = acc[qi][w] * inv[qi];
    }
  }
}

MULTIVERSION(void, encoder_attend_heads,
             (const EncAttnArgs& a, int64_t lo, int64_t hi, float* buf, int64_t* keys),
             (a, lo, hi, buf, keys)) {
  const int64_t H = a.H, S = a.S, D = a.D, d = H * D, row = 3 * d;
  const EncScratch z(S, D);
  float *Q = buf, *Kt = Q + z.Sq * D, *V = Kt + D * z.Sp, *P = V + S * z.Dp;
  for (int64_t bh = lo; bh < hi; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    const float* base = a.qkv + b * S * row + h * D;  // q of position 0; k at + d, v at + 2d
    const int64_t n = attended_keys(a.mask ? a.mask + b * S : nullptr, S, keys);
    float* ob = a.out + b * S * d + h * D;
    if (n == 0) {  // every key masked: zeros, as ATen's CPU SDPA gives (torch 2.13; older ones gave NaN)
      for (int64_t i = 0; i < S; ++i) std::fill(ob + i * d, ob + i * d + D, 0.f);
      continue;
    }
    const int64_t np = round_up(n, kW);
    gather_keys(base + d, row, base + 2 * d, row, keys, n, D, Kt, np, V, z.Dp);
    scaled_queries(base, row, S, D, a.scale, Q);
    for (int64_t i0 = 0; i0 < S; i0 += kQB)
      attend_queries(Q + i0 * D, D, Kt, np, V, z.Dp, n, P, ob + i0 * d, d, std::min(kQB, S - i0));
  }
}

at::Tensor encoder_attention(const at::Tensor& qkv, const std::optional<at::Tensor>& mask, int64_t heads) {
  KIT_CHECK(qkv.dim() == 3 && heads > 0 && qkv.size(2) % (3 * heads) == 0,
              "encoder_attention: qkv must be (B, S, 3 * heads * D)");
  const int64_t B = qkv.size(0), S = qkv.size(1), D = qkv.size(2) / (3 * heads);
  KIT_CHECK(!mask.has_value() || (mask->numel() == B * S && mask->scalar_type() == at::kBool),
              "encoder_attention: mask must be bool (B, 1, 1, S)");
  auto xf = qkv.to(at::kFloat).contiguous();
  at::Tensor m;
  if (mask.has_value()) m = mask->reshape({B, S}).contiguous();
  auto out = at::empty({B, S, heads * D}, xf.options());
  if (B * S == 0 || D == 0) return qkv.scalar_type() == at::kFloat ? out : out.to(qkv.scalar_type());
  const EncAttnArgs args{xf.data_ptr<float>(), mask.has_value() ? m.data_ptr<bool>() : nullptr,
                         out.data_ptr<float>(), heads, S, D, 1.f / std::sqrt(static_cast<float>(D))};
  at::parallel_for(0, B * heads, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(EncScratch(S, D).floats(S, D));
    std::vector<int64_t> keys(S);  // the attended key positions of a row
    encoder_attend_heads(args, lo, hi, buf.data(), keys.data());
  });
  return qkv.scalar_type() == at::kFloat ? out : out.to(qkv.scalar_type());
}

// -- decoder cross-attention over K/V arranged once per batch --------------------------------
// The cross K/V of a batch never change while it decodes, so cross_arrange lays
// them out once for the encoder's blocks: per (sentence, head) the attended keys
// first (the rest left out: a key count per sentence replaces the mask), K
// transposed to (D, Sp) and V as (S, Dv), both zero-padded to whole kW vectors.
// Each step, cross_attention runs the beams of a sentence (its Q queries) through
// attend_queries, or greedy's one query through attend_query: FMAs along vectors
// of keys and features, no horizontal sum per key as in decode_attention.
constexpr int64_t kSpan = kQB * kW;  // one query's accumulators side by side: kQB vectors

// acc[r] += sum_k a[k] * b[k * ldb + r * kW] for the rows r < blocks (1..kQB): one query
// against `blocks` side-by-side vectors of b, as many accumulators as there are vectors.
CLONE_INLINE void fma_span(float (&acc)[kQB][kW], int64_t blocks, const float* a, const float* b, int64_t ldb,
                           int64_t steps) {
  switch (blocks) {
    case 1: fma_block<1>(acc, a, 0, b, ldb, kW, steps); break;
    case 2: fma_block<2>(acc, a, 0, b, ldb, kW, steps); break;
    case 3: fma_block<3>(acc, a, 0, b, ldb, kW, steps); break;
    default: fma_block<kQB>(acc, a, 0, b, ldb, kW, steps);
  }
}

// One query q (D, scaled) against n keys: the kQB accumulator rows hold up to kQB
// vectors of keys (scores) or features (output) side by side rather than kQB queries.
// Kt (D, ldk) and V (n, ldv) are zero-padded to round_up(n, kW) keys and round_up(D,
// kW) features; P: round_up(n, kW) floats of scratch. Writes out[0, D).
CLONE_INLINE void attend_query(const float* q, int64_t D, const float* Kt, int64_t ldk, const float* V, int64_t ldv,
                               int64_t n, float* P, float* out) {
  const int64_t np = round_up(n, kW), Dp = round_up(D, kW);
  for (int64_t j0 = 0; j0 < np; j0 += kSpan) {
    const int64_t blocks = std::min(kQB, (np - j0) / kW);
    float acc[kQB][kW] = {};
    fma_span(acc, blocks, q, Kt + j0, ldk, D);
    for (int64_t r = 0; r < blocks; ++r) std::copy(acc[r], acc[r] + kW, P + j0 + r * kW);
  }
  const float inv = softmax_unscaled(P, n, np);
  for (int64_t c0 = 0; c0 < Dp; c0 += kSpan) {
    float acc[kQB][kW] = {};
    fma_span(acc, std::min(kQB, (Dp - c0) / kW), P, V + c0, ldv, n);
    const int64_t w1 = std::min(kSpan, D - c0);
    for (int64_t c = 0; c < w1; ++c) out[c0 + c] = acc[c / kW][c % kW] * inv;
  }
}

struct CrossArgs {
  const float* q;           // (B, Q, H * D)
  const float *kt, *v;      // kt (B, H, D, Sp), v (B, H, S, Dv)
  const int64_t* lens;      // (B,) the keys of each sentence
  float* out;               // (B, Q, H * D)
  int64_t H, Q, D, S, Sp, Dv;
  float scale;
};

// Scratch: the scaled queries (round_up(Q, kQB), D) and the scores (kQB, Sp).
int64_t cross_scratch(int64_t Q, int64_t D, int64_t Sp) { return round_up(Q, kQB) * D + kQB * Sp; }

MULTIVERSION(void, cross_attend_heads, (const CrossArgs& a, int64_t lo, int64_t hi, float* buf), (a, lo, hi, buf)) {
  const int64_t H = a.H, Q = a.Q, D = a.D, d = H * D;
  float *Qs = buf, *P = Qs + round_up(Q, kQB) * D;
  for (int64_t bh = lo; bh < hi; ++bh) {
    const int64_t b = bh / H, h = bh % H, n = a.lens[b];
    float* ob = a.out + b * Q * d + h * D;
    if (n == 0) {  // no key: zeros, as the encoder op and ATen's CPU SDPA give
      for (int64_t i = 0; i < Q; ++i) std::fill(ob + i * d, ob + i * d + D, 0.f);
      continue;
    }
    const float* Kt = a.kt + bh * D * a.Sp;
    const float* V = a.v + bh * a.S * a.Dv;
    // beams: the next pair's keys and values towards L2 while this one computes (the K/V
    // of a batch outgrow L2, and the rest of the step evicts them); greedy's one query is
    // done too soon for that to pay (measured: 15% slower with it)
    if (Q > 1 && bh + 1 < hi) {
      const int64_t m = a.lens[(bh + 1) / H], line = 64 / sizeof(float);  // elements of a cache line
      for (int64_t c = 0; c < D; ++c)
        for (int64_t j = 0; j < m; j += line) __builtin_prefetch(Kt + D * a.Sp + c * a.Sp + j, 0, 2);
      for (const float *p = V + a.S * a.Dv, *e = p + m * a.Dv; p < e; p += line) __builtin_prefetch(p, 0, 2);
    }
    scaled_queries(a.q + b * Q * d + h * D, d, Q, D, a.scale, Qs);
    if (Q == 1) {
      attend_query(Qs, D, Kt, a.Sp, V, a.Dv, n, P, ob);
      continue;
    }
    for (int64_t i0 = 0; i0 < Q; i0 += kQB)
      attend_queries(Qs + i0 * D, D, Kt, a.Sp, V, a.Dv, n, P, ob + i0 * d, d, std::min(kQB, Q - i0));
  }
}

// k, v (B, H, S, D) as the cross projection gives them (any strides but the last),
// mask (B, 1, 1, S) bool, True = attend, or none -> kt (B, H, D, Sp) fp32, va (B, H,
// S, Dv) fp32, lens (B,) long: see above. Any mask works (the attended keys move
// first, and the softmax does not care about their order); the decoder's is right
// padding, where nothing moves.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_arrange(const at::Tensor& k, const at::Tensor& v,
                                                             const std::optional<at::Tensor>& mask) {
  KIT_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), "cross_arrange: k and v must be (B, H, S, D), the same");
  const int64_t B = k.size(0), H = k.size(1), S = k.size(2), D = k.size(3);
  KIT_CHECK(!mask.has_value() || (mask->numel() == B * S && mask->scalar_type() == at::kBool),
              "cross_arrange: mask must be bool (B, 1, 1, S)");
  auto kf = k.to(at::kFloat), vf = v.to(at::kFloat);
  if (kf.stride(3) != 1) kf = kf.contiguous();
  if (vf.stride(3) != 1) vf = vf.contiguous();
  at::Tensor m;
  if (mask.has_value()) m = mask->reshape({B, S}).contiguous();
  const int64_t Sp = round_up(S, kW), Dv = round_up(D, kW);
  auto kt = at::empty({B, H, D, Sp}, kf.options());
  auto va = at::zeros({B, H, S, Dv}, kt.options());  // the rows past a sentence's keys stay zero
  auto lens = at::empty({B}, kt.options().dtype(at::kLong));
  const float *kp = kf.data_ptr<float>(), *vp = vf.data_ptr<float>();
  const bool* mp = mask.has_value() ? m.data_ptr<bool>() : nullptr;
  float *ktp = kt.data_ptr<float>(), *vap = va.data_ptr<float>();
  int64_t* lp = lens.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> keys(S);
    for (int64_t b = lo; b < hi; ++b) {
      lp[b] = attended_keys(mp ? mp + b * S : nullptr, S, keys.data());
      for (int64_t h = 0; h < H; ++h)
        gather_keys(kp + b * kf.stride(0) + h * kf.stride(1), kf.stride(2), vp + b * vf.stride(0) + h * vf.stride(1),
                    vf.stride(2), keys.data(), lp[b], D, ktp + (b * H + h) * D * Sp, Sp,
                    vap + (b * H + h) * S * Dv, Dv);
    }
  });
  return {kt, va, lens};
}

// q (B, Q, H * D): the Q queries of each sentence (its beams), heads side by side,
// against cross_arrange's kt, va, lens -> (B, Q, H * D) in q's dtype, heads merged.
at::Tensor cross_attention(const at::Tensor& q, const at::Tensor& kt, const at::Tensor& va, const at::Tensor& lens) {
  KIT_CHECK(q.dim() == 3 && kt.dim() == 4 && va.dim() == 4 && lens.dim() == 1 && kt.size(0) == q.size(0) &&
                  va.size(0) == q.size(0) && va.size(1) == kt.size(1) && lens.size(0) == q.size(0) &&
                  kt.size(1) * kt.size(2) == q.size(2) && kt.size(3) % kW == 0 && kt.size(3) >= va.size(2) &&
                  va.size(3) % kW == 0 && va.size(3) >= kt.size(2) && va.scalar_type() == at::kFloat &&
                  kt.scalar_type() == at::kFloat && lens.scalar_type() == at::kLong && kt.is_contiguous() &&
                  va.is_contiguous(),
              "cross_attention: q must be (B, Q, H * D) and kt, va, lens as cross_arrange gives them: (B, H, D, Sp), "
              "(B, H, S, Dv) contiguous float and (B,) long; got q ", q.sizes(), ", kt ",
              kt.sizes(), ", va ", va.sizes(), ", lens ", lens.sizes());
  const int64_t B = q.size(0), Q = q.size(1), H = kt.size(1), D = kt.size(2), S = va.size(2), Sp = kt.size(3);
  auto lc = lens.contiguous();
  const int64_t* lp = lc.data_ptr<int64_t>();
  // a count past the arranged keys would read past them: one pass over B integers a call
  KIT_CHECK(std::all_of(lp, lp + B, [S](int64_t n) { return n >= 0 && n <= S; }),
              "cross_attention: a key count is outside [0, ", S, "]");
  auto qf = q.to(at::kFloat).contiguous();
  auto out = at::empty({B, Q, H * D}, qf.options());
  if (B * Q * H * D == 0) return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
  const CrossArgs args{qf.data_ptr<float>(), kt.data_ptr<float>(), va.data_ptr<float>(), lp, out.data_ptr<float>(),
                       H, Q, D, S, Sp, va.size(3), 1.f / std::sqrt(static_cast<float>(D))};
  at::parallel_for(0, B * H, 4, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(cross_scratch(Q, D, Sp));
    cross_attend_heads(args, lo, hi, buf.data());
  });
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

// One pre-norm decoder layer for one row, the math of decoder/model.py `layer`
// with fused_norm, fused_qkv and int8 gemv products, in one call: at batch 1 a
// step is ~30 small ops whose dispatch costs as much as their arithmetic.
// kc, vc (1, h, T, hd) this layer's self-attention cache (k, v written at
// position t), ck, cv (1, h, S, hd) the cross K/V. w: 6 linears x (wq, scale,
// shift, bias) -- q|k|v, out, cross q, cross out, fc1, fc2 -- then the LayerNorm
// weights and biases of norm_mid, norm_ffn and `nxt` (the next layer's norm1 or
// the decoder's final norm). epilogue_bias: out, cross out and fc2 add their
// bias in the gemv's epilogue and the norm adds none (decoder/optimisations.py
// add_norm_fused with fbgemm's linears), else the norm adds it (with ours): the
// bits of the path it replaces.
struct RowLayer {
  decoder_gemv::Weights qkv, out, cq, cout, fc1, fc2;
  const float *out_b, *cout_b, *fc2_b;  // the biases the norms add (null: in the epilogue)
  const float* norm[6];
  float *kc, *vc;
  const float *ck, *cv;
  int64_t d, H, hd, S, ks1, ks2, vs1, vs2, cks1, cks2, cvs1, cvs2;
};

// w[at .. at+30) and the caches of one layer, checked (one error naming what is wrong)
RowLayer row_layer(int64_t d, at::TensorList w, int64_t at, const at::Tensor& kc, const at::Tensor& vc,
                   const at::Tensor& ck, const at::Tensor& cv, int64_t t, bool epilogue_bias) {
  const int64_t H = kc.size(1), hd = kc.size(3), T = kc.size(2), S = ck.size(2);
  KIT_CHECK(kc.dim() == 4 && kc.size(0) == 1 && H * hd == d && vc.sizes() == kc.sizes() && kc.stride(3) == 1 &&
                  vc.stride(3) == 1 && kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat,
              "one_row_layer: kc, vc must be float (1, h, T, d/h)");
  KIT_CHECK(ck.dim() == 4 && ck.size(0) == 1 && ck.size(1) == H && ck.size(3) == hd && cv.sizes() == ck.sizes() &&
                  ck.stride(3) == 1 && cv.stride(3) == 1 && ck.scalar_type() == at::kFloat &&
                  cv.scalar_type() == at::kFloat, "one_row_layer: ck, cv must be float (1, h, S, d/h)");
  KIT_CHECK(t >= 0 && t < T, "one_row_layer: position ", t, " outside the cache of ", T);
  auto g = [&](int64_t i, int64_t K) { return decoder_gemv::weights(K, w[at + i], w[at + i + 1], w[at + i + 2],
                                                                    w[at + i + 3]); };
  RowLayer L{g(0, d), g(4, d), g(8, d), g(12, d), g(16, d), {}, nullptr, nullptr, nullptr, {}, kc.data_ptr<float>(),
             vc.data_ptr<float>(), ck.data_ptr<float>(), cv.data_ptr<float>(), d, H, hd, S, kc.stride(1),
             kc.stride(2), vc.stride(1), vc.stride(2), ck.stride(1), ck.stride(2), cv.stride(1), cv.stride(2)};
  L.fc2 = g(20, L.fc1.N);
  KIT_CHECK(L.qkv.N == 3 * d && L.out.N == d && L.cq.N == d && L.cout.N == d && L.fc2.N == d,
              "one_row_layer: linear shapes do not match d = ", d);
  for (int64_t i = 0; i < 6; ++i) {
    const at::Tensor& n = w[at + 24 + i];
    KIT_CHECK(n.numel() == d && n.scalar_type() == at::kFloat && n.is_contiguous(),
                "one_row_layer: norm weights must be float (d,)");
    L.norm[i] = n.data_ptr<float>();
  }
  if (!epilogue_bias)  // the norm adds the bias, the gemv none
    for (auto [g, b] : {std::pair{&L.out, &L.out_b}, std::pair{&L.cout, &L.cout_b}, std::pair{&L.fc2, &L.fc2_b}}) {
      *b = g->bias;
      g->bias = nullptr;
    }
  return L;
}

// x (d) the residual stream and y = norm1(x) -> xo = x', yo = nxt(x'), as `layer` does.
// buf: 5d + fc1.N + max(t+1, S) floats of scratch.
void run_row_layer(const RowLayer& L, const float* x, const float* y, int64_t t, int path, float eps, float* xo,
                   float* yo, float* buf) {
  const int64_t d = L.d, H = L.H, hd = L.hd;
  float *qkv_o = buf, *att = qkv_o + 3 * d, *h = att + d, *hid = h + d, *p = hid + L.fc1.N;
  auto attend_one = [&](const float* k, const float* v, int64_t ks1, int64_t ks2, int64_t vs1, int64_t vs2,
                        const float* q, int64_t keys) {
    const AttendArgs a{q, k, v, nullptr, nullptr, att, H, 1, hd, keys, 0, ks1, ks2, 0, vs1, vs2,
                       1.f / std::sqrt(static_cast<float>(hd))};
    attend_heads(a, 0, H, p);
  };
  // self-attention: q|k|v, k and v into the cache at t, attention over 0..t
  decoder_gemv::gemv(y, 1, d, L.qkv, false, path, qkv_o);
  for (int64_t i = 0; i < H; ++i) {
    std::copy(qkv_o + d + i * hd, qkv_o + d + (i + 1) * hd, L.kc + i * L.ks1 + t * L.ks2);
    std::copy(qkv_o + 2 * d + i * hd, qkv_o + 2 * d + (i + 1) * hd, L.vc + i * L.vs1 + t * L.vs2);
  }
  attend_one(L.kc, L.vc, L.ks1, L.ks2, L.vs1, L.vs2, qkv_o, t + 1);
  decoder_gemv::gemv(att, 1, d, L.out, false, path, h);
  residual_norm_row(x, h, L.out_b, L.norm[0], L.norm[1], xo, yo, d, eps);
  // cross-attention over the source
  decoder_gemv::gemv(yo, 1, d, L.cq, false, path, qkv_o);
  attend_one(L.ck, L.cv, L.cks1, L.cks2, L.cvs1, L.cvs2, qkv_o, L.S);
  decoder_gemv::gemv(att, 1, d, L.cout, false, path, h);
  residual_norm_row(xo, h, L.cout_b, L.norm[2], L.norm[3], xo, yo, d, eps);
  // feed-forward, relu in fc1's epilogue
  decoder_gemv::gemv(yo, 1, d, L.fc1, true, path, hid);
  decoder_gemv::gemv(hid, 1, L.fc1.N, L.fc2, false, path, h);
  residual_norm_row(xo, h, L.fc2_b, L.norm[4], L.norm[5], xo, yo, d, eps);
}

int64_t row_layer_scratch(const RowLayer& L, int64_t t) { return 5 * L.d + L.fc1.N + std::max(t + 1, L.S); }

// x (1, 1, d) the residual stream, y = norm1(x) -> (x', nxt(x'))
std::tuple<at::Tensor, at::Tensor> one_row_layer(const at::Tensor& x, const at::Tensor& y, at::TensorList w,
                                                 at::Tensor& kc, at::Tensor& vc, const at::Tensor& ck,
                                                 const at::Tensor& cv, int64_t t, int64_t isa, double eps,
                                                 bool epilogue_bias) {
  const int64_t d = x.size(-1);
  KIT_CHECK(x.numel() == d && y.numel() == d && x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                  x.is_contiguous() && y.is_contiguous(), "one_row_layer: x, y must be one float row of d");
  KIT_CHECK(w.size() == 30, "one_row_layer: 6 linears x 4 tensors and 3 norms x 2, got ", w.size());
  const RowLayer L = row_layer(d, w, 0, kc, vc, ck, cv, t, epilogue_bias);
  std::vector<float> buf(row_layer_scratch(L, t));
  auto xo = at::empty_like(x), yo = at::empty_like(y);
  run_row_layer(L, x.data_ptr<float>(), y.data_ptr<float>(), t, decoder_gemv::isa(isa), static_cast<float>(eps),
                xo.data_ptr<float>(), yo.data_ptr<float>(), buf.data());
  return {xo, yo};
}

// logits (R, C) in place; hist (R, T) token ids; vocab (C,) ascending ids of the
// columns when the logits cover a shortlist. For each row, every earlier
// position whose n-1 tokens equal the row's last n-1 bans the token after them.
void ngram_block_(at::Tensor& logits, const at::Tensor& hist, int64_t n, const std::optional<at::Tensor>& vocab) {
  KIT_CHECK(logits.dim() == 2 && hist.dim() == 2 && hist.size(0) == logits.size(0),
              "ngram_block_: logits (R, C) and hist (R, T) must have the same rows");
  KIT_CHECK(logits.is_contiguous(), "ngram_block_: logits must be contiguous");
  const int64_t R = hist.size(0), T = hist.size(1), C = logits.size(1);
  if (n < 1 || T < n - 1 || T == 0) return;
  auto h = hist.to(at::kLong).contiguous();
  const int64_t* hp = h.data_ptr<int64_t>();
  at::Tensor voc;
  if (vocab.has_value()) voc = vocab->to(at::kLong).contiguous();
  const int64_t* vp = vocab.has_value() ? voc.data_ptr<int64_t>() : nullptr;
  KIT_DISPATCH_FLOATS(logits.scalar_type(), "ngram_block_", [&] {
    scalar_t* lp = logits.data_ptr<scalar_t>();
    const scalar_t ninf = -std::numeric_limits<scalar_t>::infinity();
    at::parallel_for(0, R, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const int64_t* row = hp + r * T;
        const int64_t* suffix = row + T - (n - 1);
        for (int64_t i = 0; i + n - 1 < T; ++i) {
          if (!std::equal(row + i, row + i + n - 1, suffix)) continue;
          const int64_t tok = row[i + n - 1];
          int64_t col = tok;
          if (vp) {
            const int64_t* it = std::lower_bound(vp, vp + C, tok);
            if (it == vp + C || *it != tok) continue;  // not a candidate of this batch
            col = it - vp;
          }
          if (col >= 0 && col < C) lp[r * C + col] = ninf;
        }
      }
    });
  });
}

// First index of the row's maximum, a NaN counting as larger than any number
// (torch.argmax's rule). One vectorised pass for the max, then a scan that stops
// at its first occurrence.
MULTIVERSION(int64_t, row_argmax, (const float* x, int64_t n, float* best), (x, n, best)) {
  float m = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    nan |= x[i] != x[i];
  }
  for (int64_t i = 0; i < n; ++i)
    if (nan ? x[i] != x[i] : x[i] == m) {
      *best = x[i];
      return i;
    }
  *best = m;
  return 0;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  KIT_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax_rows: logits must be (rows, C) with C > 0");
  check_argmax_dtype(logits, "argmax_rows");
  const int64_t R = logits.size(0), C = logits.size(1);
  auto lf = as_float_rows(logits, C);
  auto out = at::empty({R}, logits.options().dtype(at::kLong));
  const float* lp = lf.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      float v;
      op[r] = row_argmax(lp + r * C, C, &v);
    }
  });
  return out;
}

// argmax(x W^T + b) per row without the (R, V) logits: each vocabulary chunk's
// product (vocab_chunks.h) updates each row's running best; ties and NaNs resolve
// as in argmax over the full row.
at::Tensor linear_argmax(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         int64_t chunk) {
  check_linear_argmax(x, weight, bias, chunk);
  const int64_t R = x.size(0);
  auto out = at::zeros({R}, x.options().dtype(at::kLong));
  if (R == 0) return out;
  std::vector<float> best(R, -std::numeric_limits<float>::infinity());
  int64_t* op = out.data_ptr<int64_t>();
  vocab_chunks::for_each(x, weight, bias, chunk, [&](const at::Tensor& o, int64_t s) {
    const int64_t w = o.size(1);
    auto of = o.scalar_type() == at::kFloat ? o : o.to(at::kFloat);
    const float* p = of.data_ptr<float>();
    at::parallel_for(0, R, 4, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        float v;
        const int64_t i = row_argmax(p + r * w, w, &v);
        // an earlier NaN stays; a later value must be strictly larger (first index wins)
        if (best[r] == best[r] && (v != v || v > best[r])) {
          best[r] = v;
          op[r] = s + i;
        }
      }
    });
  });
  return out;
}

// One greedy decode step for one sentence, whole (the latency mode): x =
// emb[token] + pos[p], y = norm1(x) by ATen's layer_norm (as the path it
// replaces), every decoder layer as one_row_layer, the output projection by the
// gemv kernel and its argmax. Returns the argmax column. At batch 1 the ~10
// tensor ops around the layers cost as much as a layer (decoder/README.md).
// w: one_row_layer's 30 tensors per layer; caches: kc, vc, ck, cv per layer;
// out, out_bias: the output projection's GemvLinear (wq, scale, shift), bias.
int64_t one_row_step(int64_t token, int64_t p, int64_t t, const at::Tensor& emb, const at::Tensor& pos,
                     const at::Tensor& norm_w, const at::Tensor& norm_b, double norm_eps, at::TensorList w,
                     at::TensorList caches, at::TensorList out, const std::optional<at::Tensor>& out_bias, int64_t isa,
                     double eps, bool epilogue_bias) {
  const int64_t d = emb.size(-1), n = static_cast<int64_t>(caches.size()) / 4;
  KIT_CHECK(emb.dim() == 2 && pos.dim() == 2 && pos.size(1) == d && emb.scalar_type() == at::kFloat &&
                  pos.scalar_type() == at::kFloat && emb.is_contiguous() && pos.is_contiguous(),
              "one_row_step: emb (V, d) and pos (P, d) must be contiguous float");
  KIT_CHECK(token >= 0 && token < emb.size(0), "one_row_step: token ", token, " outside the vocabulary");
  KIT_CHECK(p >= 0 && p < pos.size(0), "one_row_step: position ", p, " outside the table of ", pos.size(0));
  KIT_CHECK(n >= 1 && static_cast<int64_t>(caches.size()) == 4 * n && static_cast<int64_t>(w.size()) == 30 * n,
              "one_row_step: 30 weights and 4 caches per layer, got ", w.size(), " and ", caches.size());
  KIT_CHECK(out.size() == 3, "one_row_step: out must be (wq, scale, shift)");
  const decoder_gemv::Weights o = decoder_gemv::weights(d, out[0], out[1], out[2], out_bias);
  std::vector<RowLayer> layers;
  int64_t scratch = o.N;
  for (int64_t i = 0; i < n; ++i) {
    layers.push_back(row_layer(d, w, 30 * i, caches[4 * i], caches[4 * i + 1], caches[4 * i + 2],
                               caches[4 * i + 3], t, epilogue_bias));
    scratch = std::max(scratch, row_layer_scratch(layers.back(), t));
  }
  auto x = at::empty({1, 1, d}, emb.options());
  float* xp = x.data_ptr<float>();
  const float *ep = emb.data_ptr<float>() + token * d, *pp = pos.data_ptr<float>() + p * d;
  for (int64_t i = 0; i < d; ++i) xp[i] = ep[i] + pp[i];
  auto y = at::layer_norm(x, {d}, norm_w, norm_b, norm_eps);  // (1, 1, d), contiguous
  float* yp = y.data_ptr<float>();
  std::vector<float> buf(scratch);
  const int path = decoder_gemv::isa(isa);
  for (const RowLayer& L : layers)  // in place: each layer reads x and y before it writes them
    run_row_layer(L, xp, yp, t, path, static_cast<float>(eps), xp, yp, buf.data());
  decoder_gemv::gemv(yp, 1, d, o, false, path, buf.data());
  float best;
  return row_argmax(buf.data(), o.N, &best);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(decoder_ops, m) {
  m.def("add_bias_residual_layernorm(Tensor x, Tensor h, Tensor? bias, Tensor gamma, Tensor beta, float eps)"
        " -> (Tensor, Tensor)");
  m.def("log_softmax_topk(Tensor logits, Tensor scores, int K, int n, bool normalized=False) -> (Tensor, Tensor)");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask) -> Tensor");
  m.def("decode_attention_rows(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor? mask=None)"
        " -> Tensor");
  m.def("encoder_attention(Tensor qkv, Tensor? mask, int heads) -> Tensor");
  m.def("cross_arrange(Tensor k, Tensor v, Tensor? mask) -> (Tensor, Tensor, Tensor)");
  m.def("cross_attention(Tensor q, Tensor kt, Tensor va, Tensor lens) -> Tensor");
  m.def("ngram_block_(Tensor(a!) logits, Tensor hist, int n, Tensor? vocab) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("linear_argmax(Tensor x, Tensor weight, Tensor? bias, int chunk) -> Tensor");
  m.def("one_row_layer(Tensor x, Tensor y, Tensor[] w, Tensor(a!) kc, Tensor(b!) vc, Tensor ck, Tensor cv, int t,"
        " int isa, float eps, bool epilogue_bias) -> (Tensor, Tensor)");
  m.def("one_row_step(int token, int p, int t, Tensor emb, Tensor pos, Tensor norm_w, Tensor norm_b, float norm_eps,"
        " Tensor[] w, Tensor(a!)[] caches, Tensor[] out, Tensor? out_bias, int isa, float eps, bool epilogue_bias)"
        " -> int");
}

TORCH_LIBRARY_IMPL(decoder_ops, CPU, m) {
  m.impl("add_bias_residual_layernorm", &add_bias_residual_layernorm);
  m.impl("log_softmax_topk", &log_softmax_topk);
  m.impl("ngram_block_", &ngram_block_);
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_rows", &decode_attention_rows);
  m.impl("encoder_attention", &encoder_attention);
  m.impl("cross_arrange", &cross_arrange);
  m.impl("cross_attention", &cross_attention);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("linear_argmax", &linear_argmax);
  m.impl("one_row_layer", &one_row_layer);
  m.impl("one_row_step", &one_row_step);
}
