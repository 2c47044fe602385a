// CUDA kernels of the fused decode-step ops (the CPU kernels and their
// schemas are in fused_cpu.cpp; the references in decoder/fused.py).
// fp32, fp16 and bf16 inputs, arithmetic in fp32. Built only where torch has
// CUDA and nvcc is found (decoder/ops.py); tests/test_fused_ops.py runs them
// against the references when a GPU is present.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include "checks.h"
#include "vocab_chunks.h"

namespace {

constexpr int kThreads = 256;  // every kernel's block size: a multiple of the warp
constexpr int kTopThreads = 128;
constexpr int kMaxTop = 16;    // log_softmax_topk keeps n <= 16 candidates per thread (beam <= 8)

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The cache row that holds row b's key and value at position j: b itself, or the row the table names
// (beam search's row table, switch kv_row_table: a reorder rewrites the table, not the cache). Clamped
// into the cache's N rows: no table reads outside it, and checking its values would need a host read,
// which a captured graph cannot make.
__device__ __forceinline__ int64_t row_of(const int64_t* rows, int64_t b, int64_t T, int64_t j, int64_t N) {
  if (!rows) return b;
  const int64_t r = rows[b * T + j];
  return r < 0 ? 0 : r >= N ? N - 1 : r;
}

// sum (or max) over the block, returned to every thread; `sh` holds 32 floats
template <bool Max>
__device__ float block_reduce(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = Max ? warp_max(v) : warp_sum(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  const float ident = Max ? -INFINITY : 0.f;
  v = threadIdx.x < nwarps ? sh[threadIdx.x] : ident;
  if (warp == 0) v = Max ? warp_max(v) : warp_sum(v);
  if (threadIdx.x == 0) sh[0] = v;
  __syncthreads();
  v = sh[0];
  __syncthreads();
  return v;
}

// one block per row; r is recomputed in fp32 in each pass instead of re-read
// from its (possibly half-precision) output
template <typename T>
__global__ void residual_norm_kernel(const T* x, const T* h, const T* b, const T* g, const T* beta, T* r, T* y,
                                     int64_t n, float eps) {
  __shared__ float sh[32];
  const int64_t o = blockIdx.x * n;
  auto val = [&](int64_t i) { return float(x[o + i]) + float(h[o + i]) + (b ? float(b[i]) : 0.f); };
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = val(i);
    r[o + i] = T(v);
    s += v;
  }
  const float mean = block_reduce<false>(s, sh) / n;
  float q = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float d = val(i) - mean;
    q += d * d;
  }
  const float rstd = rsqrtf(block_reduce<false>(q, sh) / n + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    y[o + i] = T((val(i) - mean) * rstd * float(g[i]) + float(beta[i]));
}

// one block per (b, h, query); scores for all keys in shared memory
template <typename T>
__global__ void decode_attention_kernel(const T* q, const T* k, const T* v, const bool* mask, const int64_t* rows,
                                        T* out, int64_t BHQ, int H, int Q, int64_t T_, int64_t D, int64_t N,
                                        int64_t ks0, int64_t ks1, int64_t ks2, int64_t vs0, int64_t vs1, int64_t vs2,
                                        float scale) {
  extern __shared__ float p[];  // (T_,)
  __shared__ float sh[32];
  const int64_t bhq = blockIdx.x, b = bhq / (H * Q), h = (bhq / Q) % H;
  if (bhq >= BHQ) return;  // the whole block
  const T* qi = q + bhq * D;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < T_; j += blockDim.x) {
    float s = -INFINITY;
    if (!mask || mask[b * T_ + j]) {
      const T* kj = k + row_of(rows, b, T_, j, N) * ks0 + h * ks1 + j * ks2;
      s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += float(qi[d]) * float(kj[d]);
      s *= scale;
    }
    p[j] = s;
    mx = fmaxf(mx, s);
  }
  mx = block_reduce<true>(mx, sh);
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < T_; j += blockDim.x) {
    p[j] = mx == -INFINITY ? 0.f : __expf(p[j] - mx);
    sum += p[j];
  }
  sum = block_reduce<false>(sum, sh);  // its barriers also publish p[]
  const float inv = mx == -INFINITY ? NAN : 1.f / sum;  // every key masked: NaN, as SDPA gives
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f;
    for (int64_t j = 0; j < T_; ++j) {
      // a masked key weighs 0: its value is not read (the fixed-shape state masks the cache past
      // the position, so a step reads only the values written so far). Uniform over the block.
      const float pj = p[j];
      if (pj != 0.f) acc += pj * float(v[row_of(rows, b, T_, j, N) * vs0 + h * vs1 + j * vs2 + d]);
    }
    out[bhq * D + d] = T(acc * inv);
  }
}

constexpr int kWarps = 4;  // the warp kernels' blocks: a warp per row, kWarps rows a block

// Vec values of T in one 16-byte load or store, in fp32 (the caller has checked the alignment)
template <typename T>
struct Wide {
  static constexpr int Vec = 16 / sizeof(T);
  __device__ static __forceinline__ void load(const T* src, float* dst) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    T x[Vec];
    memcpy(x, &raw, sizeof raw);
#pragma unroll
    for (int e = 0; e < Vec; ++e) dst[e] = float(x[e]);
  }
  __device__ static __forceinline__ void store(const float* src, float scale, T* dst) {
    T x[Vec];
#pragma unroll
    for (int e = 0; e < Vec; ++e) x[e] = T(src[e] * scale);
    uint4 raw;
    memcpy(&raw, x, sizeof raw);
    *reinterpret_cast<uint4*>(dst) = raw;
  }
};

// add_bias_residual_layernorm with a warp per row, where a row fits the warp's registers (C chunks
// of Vec values a lane) and every row is 16-byte aligned: the block kernel gives a row 256 threads,
// three passes and six barriers, and at thousands of rows a step its blocks mostly wait (H200,
// 2026-11-27: 62 us a call at 8,192 rows of 512, about a tenth of memory speed). One read of x
// and h, the sums by shuffles; r has the block kernel's bits (the same fp32 sum, rounded once).
template <typename T, int C>
__global__ void residual_norm_warp_kernel(const T* x, const T* h, const T* b, const T* g, const T* beta, T* r, T* y,
                                          int64_t rows, int64_t n, float eps) {
  constexpr int Vec = Wide<T>::Vec;
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * (int64_t)kWarps + (threadIdx.x >> 5);
  if (row >= rows) return;  // a whole warp
  const int64_t o = row * n;
  float val[C][Vec];
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int64_t i = (c * 32 + lane) * int64_t(Vec);
    float xv[Vec], hv[Vec], bv[Vec] = {};
    if (i < n) {
      Wide<T>::load(x + o + i, xv);
      Wide<T>::load(h + o + i, hv);
      if (b) Wide<T>::load(b + i, bv);
    }
#pragma unroll
    for (int e = 0; e < Vec; ++e) {
      val[c][e] = i < n ? xv[e] + hv[e] + bv[e] : 0.f;
      s += val[c][e];
    }
    if (i < n) Wide<T>::store(val[c], 1.f, r + o + i);
  }
  const float mean = warp_sum(s) / n;
  float q = 0.f;
#pragma unroll
  for (int c = 0; c < C; ++c)
    if ((c * 32 + lane) * int64_t(Vec) < n)
#pragma unroll
      for (int e = 0; e < Vec; ++e) q += (val[c][e] - mean) * (val[c][e] - mean);
  const float rstd = rsqrtf(warp_sum(q) / n + eps);
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int64_t i = (c * 32 + lane) * int64_t(Vec);
    if (i >= n) continue;
    float gv[Vec], bt[Vec];
    Wide<T>::load(g + i, gv);
    Wide<T>::load(beta + i, bt);
#pragma unroll
    for (int e = 0; e < Vec; ++e) val[c][e] = (val[c][e] - mean) * rstd * gv[e] + bt[e];
    Wide<T>::store(val[c], 1.f, y + o + i);
  }
}

// one thread per row
template <typename T>
__global__ void ngram_block_kernel(T* logits, const int64_t* hist, const int64_t* vocab, int64_t R, int64_t Tn,
                                   int64_t C, int64_t n) {
  const int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (r >= R) return;
  const int64_t* row = hist + r * Tn;
  const int64_t* suffix = row + Tn - (n - 1);
  for (int64_t i = 0; i + n - 1 < Tn; ++i) {
    bool same = true;
    for (int64_t j = 0; j < n - 1 && same; ++j) same = row[i + j] == suffix[j];
    if (!same) continue;
    int64_t col = row[i + n - 1];
    if (vocab) {  // lower bound in the ascending candidate ids
      int64_t lo = 0, hi = C;
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (vocab[mid] < col) lo = mid + 1; else hi = mid;
      }
      if (lo == C || vocab[lo] != col) continue;
      col = lo;
    }
    if (col >= 0 && col < C) logits[r * C + col] = T(-INFINITY);
  }
}

__device__ __forceinline__ bool better(float a, int64_t ia, float b, int64_t ib) {
  return a > b || (a == b && ia < ib);
}

// one block per sentence: per-row shift = max + log sum exp (0 when the rows
// are log-probs already), then each thread keeps its n best of the K*V
// candidates, and thread 0 merges the lists
template <typename T>
__global__ void log_softmax_topk_kernel(const T* logits, const float* scores, float* values, int64_t* indices,
                                        int64_t K, int64_t V, int n, bool normalized) {
  __shared__ float sh[32];
  extern __shared__ unsigned char smem[];
  float* shift = reinterpret_cast<float*>(smem);                       // (K,)
  float* cand_v = shift + K;                                            // (blockDim * n)
  const size_t head = ((K + blockDim.x * n) * sizeof(float) + 7) / 8 * 8;  // as the host sizes it
  int64_t* cand_i = reinterpret_cast<int64_t*>(smem + head);              // (blockDim * n)
  const int64_t s = blockIdx.x;
  for (int64_t k = 0; k < K; ++k) {
    if (normalized) {
      if (threadIdx.x == 0) shift[k] = 0.f;
      continue;
    }
    const T* row = logits + (s * K + k) * V;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, float(row[j]));
    mx = block_reduce<true>(mx, sh);
    float sum = 0.f;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) sum += __expf(float(row[j]) - mx);
    sum = block_reduce<false>(sum, sh);
    if (threadIdx.x == 0) shift[k] = mx + logf(sum);
  }
  __syncthreads();
  float bv[kMaxTop];
  int64_t bi[kMaxTop];
  for (int t = 0; t < n; ++t) { bv[t] = -INFINITY; bi[t] = -1; }
  for (int64_t c = threadIdx.x; c < K * V; c += blockDim.x) {
    const int64_t k = c / V;
    const float val = (float(logits[s * K * V + c]) - shift[k]) + scores[s * K + k];
    if (bi[n - 1] != -1 && !better(val, c, bv[n - 1], bi[n - 1])) continue;
    int t = n - 1;
    while (t > 0 && (bi[t - 1] == -1 || better(val, c, bv[t - 1], bi[t - 1]))) {
      bv[t] = bv[t - 1]; bi[t] = bi[t - 1]; --t;
    }
    bv[t] = val; bi[t] = c;
  }
  for (int t = 0; t < n; ++t) { cand_v[threadIdx.x * n + t] = bv[t]; cand_i[threadIdx.x * n + t] = bi[t]; }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int m = blockDim.x * n;
    for (int t = 0; t < n; ++t) {
      int best = -1;
      for (int e = 0; e < m; ++e)
        if (cand_i[e] != -1 && (best == -1 || better(cand_v[e], cand_i[e], cand_v[best], cand_i[best]))) best = e;
      values[s * n + t] = cand_v[best];
      indices[s * n + t] = cand_i[best];
      cand_i[best] = -1;  // taken
    }
  }
}

// is (v, i) chosen over (bv, bi)? torch.argmax's order: NaN above every number,
// then the larger value, then the lower index
__device__ __forceinline__ bool argmax_better(float v, int64_t i, float bv, int64_t bi) {
  const bool vn = v != v, bn = bv != bv;
  if (vn || bn) return vn && (!bn || i < bi);
  return v > bv || (v == bv && i < bi);
}

// one block per row of x (R, C): the row's best, at column offset + j, written
// to (best_v, best_i), or merged into them when `merge` (a later vocabulary chunk)
template <typename T>
__global__ void argmax_kernel(const T* x, int64_t C, int64_t offset, float* best_v, int64_t* best_i, bool merge) {
  __shared__ float sv[kThreads];
  __shared__ int64_t si[kThreads];
  const int64_t row = blockIdx.x;
  const T* p = x + row * C;
  float bv = -INFINITY;
  int64_t bi = INT64_MAX;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    const float v = float(p[j]);
    if (argmax_better(v, j, bv, bi)) { bv = v; bi = j; }
  }
  sv[threadIdx.x] = bv;
  si[threadIdx.x] = bi;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s && argmax_better(sv[threadIdx.x + s], si[threadIdx.x + s], sv[threadIdx.x], si[threadIdx.x])) {
      sv[threadIdx.x] = sv[threadIdx.x + s];
      si[threadIdx.x] = si[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const float v = sv[0], b = best_v[row];
    // a later chunk replaces only with a NaN or a strictly larger value: the first index wins
    if (!merge || (b == b && (v != v || v > b))) {
      best_v[row] = v;
      best_i[row] = si[0] + offset;
    }
  }
}

// argmax_kernel with a warp per row, where rows are 16-byte aligned and C a multiple of Vec: the
// block kernel gives a chunk's row of 1,024 logits 256 threads and eight block barriers (H200,
// 2026-11-27: 22 us a call at 8,192 rows, about a sixth of memory speed); here a lane reads Vec
// at a time and the warp agrees by shuffles. The same order (argmax_better), so the same index.
template <typename T>
__global__ void argmax_warp_kernel(const T* x, int64_t R, int64_t C, int64_t offset, float* best_v, int64_t* best_i,
                                   bool merge) {
  constexpr int Vec = Wide<T>::Vec;
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * (int64_t)kWarps + (threadIdx.x >> 5);
  if (row >= R) return;  // a whole warp
  const T* p = x + row * C;
  float bv = -INFINITY;
  int64_t bi = INT64_MAX;
#pragma unroll 4
  for (int64_t j0 = lane * int64_t(Vec); j0 < C; j0 += 32 * Vec) {
    float v[Vec];
    Wide<T>::load(p + j0, v);
#pragma unroll
    for (int e = 0; e < Vec; ++e)
      if (argmax_better(v[e], j0 + e, bv, bi)) { bv = v[e]; bi = j0 + e; }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const long long oi = __shfl_xor_sync(0xffffffffu, static_cast<long long>(bi), o);
    if (argmax_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
  }
  if (lane == 0) {
    const float b = best_v[row];
    if (!merge || (b == b && (bv != bv || bv > b))) {  // as the block kernel: the first index wins
      best_v[row] = bv;
      best_i[row] = bi + offset;
    }
  }
}

// blocks of kWarps warps for a warp per row (the warp kernels)
int64_t warp_blocks(int64_t rows) { return (rows + kWarps - 1) / kWarps; }

int blocks_for(int64_t total) { return static_cast<int>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535)); }

// Every tensor's data 16-byte aligned: the wide kernels' loads and stores need it
bool aligned16(std::initializer_list<at::Tensor> ts) {
  for (const auto& t : ts)
    if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16) return false;
  return true;
}

std::tuple<at::Tensor, at::Tensor> add_bias_residual_layernorm_cuda(
    const at::Tensor& x, const at::Tensor& h, const std::optional<at::Tensor>& bias, const at::Tensor& gamma,
    const at::Tensor& beta, double eps) {
  const int64_t n = x.size(-1);
  KIT_CHECK(h.sizes() == x.sizes() && gamma.numel() == n && beta.numel() == n &&
              (!bias.has_value() || bias->numel() == n), "add_bias_residual_layernorm: inconsistent shapes");
  const c10::cuda::CUDAGuard guard(x.device());
  auto xc = x.contiguous(), hc = h.contiguous(), gc = gamma.to(x.scalar_type()).contiguous(),
       bc = beta.to(x.scalar_type()).contiguous();
  at::Tensor bb;
  if (bias.has_value()) bb = bias->to(x.scalar_type()).contiguous();
  auto r = at::empty_like(xc), y = at::empty_like(xc);
  const int64_t rows = n ? xc.numel() / n : 0;
  if (rows == 0) return {r, y};
  KIT_DISPATCH_FLOATS(x.scalar_type(), "add_bias_residual_layernorm", [&] {
    constexpr int Vec = Wide<scalar_t>::Vec;
    const int64_t chunks = (n + 32 * Vec - 1) / (32 * Vec);  // of Vec values a lane
    const bool aligned = n % Vec == 0 && chunks <= 4 &&
                         aligned16({xc, hc, gc, bc, r, y}) && (!bias.has_value() || aligned16({bb}));
    if (aligned) {
      auto kernel = chunks == 1 ? residual_norm_warp_kernel<scalar_t, 1>
                    : chunks == 2 ? residual_norm_warp_kernel<scalar_t, 2> : residual_norm_warp_kernel<scalar_t, 4>;
      kernel<<<warp_blocks(rows), 32 * kWarps, 0, c10::cuda::getCurrentCUDAStream()>>>(
          xc.data_ptr<scalar_t>(), hc.data_ptr<scalar_t>(), bias.has_value() ? bb.data_ptr<scalar_t>() : nullptr,
          gc.data_ptr<scalar_t>(), bc.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, n,
          static_cast<float>(eps));
      return;
    }
    residual_norm_kernel<scalar_t><<<rows, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        xc.data_ptr<scalar_t>(), hc.data_ptr<scalar_t>(), bias.has_value() ? bb.data_ptr<scalar_t>() : nullptr,
        gc.data_ptr<scalar_t>(), bc.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), n,
        static_cast<float>(eps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {r, y};
}

// decode_attention's inputs as the kernels read them: q dense, k and v in q's dtype with dense
// features, the mask (B, T) and the row table (B, T) dense; the output allocated. k and v have N
// rows: B, or any number with a row table.
struct AttentionArgs {
  int64_t B, H, Q, D, keys, N;
  at::Tensor q, k, v, mask, rows, out;
  AttentionArgs(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                const std::optional<at::Tensor>& mask_, const std::optional<at::Tensor>& rows_)
      : B(q_.size(0)), H(q_.size(1)), Q(q_.size(2)), D(q_.size(3)), keys(k_.size(2)), N(k_.size(0)) {
    q = q_.contiguous();
    k = (k_.stride(3) == 1 ? k_ : k_.contiguous()).to(q_.scalar_type());
    v = (v_.stride(3) == 1 ? v_ : v_.contiguous()).to(q_.scalar_type());
    if (mask_.has_value()) mask = mask_->reshape({B, keys}).contiguous();
    if (rows_.has_value()) rows = rows_->contiguous();
    out = at::empty_like(q);
  }
  template <typename S>
  void launch(void (*kernel)(const S*, const S*, const S*, const bool*, const int64_t*, S*, int64_t, int, int, int64_t,
                             int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float),
              int64_t blocks, int threads, size_t shared) const {
    kernel<<<blocks, threads, shared, c10::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<S>(), k.data_ptr<S>(), v.data_ptr<S>(), mask.defined() ? mask.data_ptr<bool>() : nullptr,
        rows.defined() ? rows.data_ptr<int64_t>() : nullptr, out.data_ptr<S>(), B * H * Q, int(H), int(Q), keys, D,
        N, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), 1.f / std::sqrt(float(D)));
  }
};

void check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool own_rows,
                     const char* name) {
  KIT_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && (!own_rows || k.size(0) == q.size(0)) &&
              k.size(1) == q.size(1) && k.size(3) == q.size(3), name, ": q (B,H,Q,D), k/v (B,H,T,D)");
}

// The block kernel; a row's scores must fit 48 KB of shared memory (decoder/fused.py gives longer
// rows, past CUDA_MAX_KEYS, the reference)
at::Tensor attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& rows,
                          const char* name) {
  const c10::cuda::CUDAGuard guard(q.device());
  const AttentionArgs a(q, k, v, mask, rows);
  if (a.q.numel() == 0) return a.out;
  const size_t shared = static_cast<size_t>(a.keys) * sizeof(float);
  KIT_CHECK(shared <= 48 * 1024, name, ": ", a.keys, " keys exceed the kernel's shared memory");
  KIT_DISPATCH_FLOATS(q.scalar_type(), name, [&] {
    a.launch<scalar_t>(decode_attention_kernel<scalar_t>, a.B * a.H * a.Q, kThreads, shared);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return a.out;
}

at::Tensor decode_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const std::optional<at::Tensor>& mask) {
  check_attention(q, k, v, true, "decode_attention");
  return attention_cuda(q, k, v, mask, std::nullopt, "decode_attention");
}

// key j of row b read from cache row rows[b, j] (clamped into k's rows, see row_of)
at::Tensor decode_attention_rows_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& rows, const std::optional<at::Tensor>& mask) {
  check_attention(q, k, v, false, "decode_attention_rows");
  KIT_CHECK(rows.dim() == 2 && rows.size(0) == q.size(0) && rows.size(1) == k.size(2) &&
              rows.scalar_type() == at::kLong && rows.device() == q.device(),
            "decode_attention_rows: rows must be long (B, T) on q's device");
  return attention_cuda(q, k, v, mask, rows, "decode_attention_rows");
}

void ngram_block_cuda(at::Tensor& logits, const at::Tensor& hist, int64_t n, const std::optional<at::Tensor>& vocab) {
  KIT_CHECK(logits.dim() == 2 && hist.dim() == 2 && hist.size(0) == logits.size(0) && logits.is_contiguous(),
              "ngram_block_: logits (R, C) contiguous and hist (R, T)");
  const int64_t R = hist.size(0), T = hist.size(1), C = logits.size(1);
  if (n < 1 || T == 0 || T < n - 1 || R == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  auto h = hist.to(at::kLong).contiguous();
  at::Tensor voc;
  if (vocab.has_value()) voc = vocab->to(at::kLong).contiguous();
  KIT_DISPATCH_FLOATS(logits.scalar_type(), "ngram_block_", [&] {
    ngram_block_kernel<scalar_t><<<blocks_for(R), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        logits.data_ptr<scalar_t>(), h.data_ptr<int64_t>(), vocab.has_value() ? voc.data_ptr<int64_t>() : nullptr,
        R, T, C, n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> log_softmax_topk_cuda(const at::Tensor& logits, const at::Tensor& scores,
                                                         int64_t K, int64_t n, bool normalized) {
  KIT_CHECK(logits.dim() == 2, "log_softmax_topk: logits must be (rows, V)");
  const int64_t R = logits.size(0), V = logits.size(1);
  KIT_CHECK(K > 0 && R % K == 0, "log_softmax_topk: ", R, " rows are not a multiple of K=", K);
  KIT_CHECK(scores.numel() == R, "log_softmax_topk: one score per row");
  KIT_CHECK(n > 0 && n <= K * V && n <= kMaxTop, "log_softmax_topk: n must be in [1, min(K*V, ", kMaxTop, ")]");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t S = R / K;
  auto lc = logits.contiguous();
  auto sc = scores.to(at::kFloat).contiguous();
  auto values = at::empty({S, n}, lc.options().dtype(at::kFloat));
  auto indices = at::empty({S, n}, lc.options().dtype(at::kLong));
  if (S == 0) return {values, indices};
  // shift (K floats), then the per-thread lists: values, then 8-byte-aligned indices
  const size_t head = ((K + kTopThreads * n) * sizeof(float) + 7) / 8 * 8;
  const size_t shared = head + kTopThreads * n * sizeof(int64_t);
  KIT_DISPATCH_FLOATS(logits.scalar_type(), "log_softmax_topk", [&] {
    log_softmax_topk_kernel<scalar_t><<<S, kTopThreads, shared, c10::cuda::getCurrentCUDAStream()>>>(
        lc.data_ptr<scalar_t>(), sc.data_ptr<float>(), values.data_ptr<float>(), indices.data_ptr<int64_t>(), K, V,
        static_cast<int>(n), normalized);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {values, indices};
}

void launch_argmax(const at::Tensor& x, int64_t offset, at::Tensor& best_v, at::Tensor& best_i, bool merge) {
  const int64_t R = x.size(0), C = x.size(1);
  if (R == 0) return;
  KIT_DISPATCH_FLOATS(x.scalar_type(), "argmax_rows", [&] {
    if (C % Wide<scalar_t>::Vec == 0 && aligned16({x})) {
      argmax_warp_kernel<scalar_t><<<warp_blocks(R), 32 * kWarps, 0, c10::cuda::getCurrentCUDAStream()>>>(
          x.data_ptr<scalar_t>(), R, C, offset, best_v.data_ptr<float>(), best_i.data_ptr<int64_t>(), merge);
      return;
    }
    argmax_kernel<scalar_t><<<R, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<scalar_t>(), C, offset, best_v.data_ptr<float>(), best_i.data_ptr<int64_t>(), merge);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor argmax_rows_cuda(const at::Tensor& logits) {
  KIT_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax_rows: logits must be (rows, C) with C > 0");
  check_argmax_dtype(logits, "argmax_rows");
  const c10::cuda::CUDAGuard guard(logits.device());
  auto lc = logits.contiguous();
  auto best_v = at::empty({lc.size(0)}, lc.options().dtype(at::kFloat));
  auto best_i = at::empty({lc.size(0)}, lc.options().dtype(at::kLong));
  launch_argmax(lc, 0, best_v, best_i, false);
  return best_i;
}

// each vocabulary chunk's cuBLAS product (vocab_chunks.h) merged into the running best per row
at::Tensor linear_argmax_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              int64_t chunk) {
  check_linear_argmax(x, weight, bias, chunk);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t R = x.size(0);
  auto best_v = at::empty({R}, x.options().dtype(at::kFloat));
  auto best_i = at::zeros({R}, x.options().dtype(at::kLong));
  if (R == 0) return best_i;
  vocab_chunks::for_each(x, weight, bias, chunk, [&](const at::Tensor& o, int64_t s) {
    launch_argmax(o, s, best_v, best_i, s > 0);
  });
  return best_i;
}

}  // namespace

TORCH_LIBRARY_IMPL(decoder_ops, CUDA, m) {
  m.impl("add_bias_residual_layernorm", &add_bias_residual_layernorm_cuda);
  m.impl("decode_attention", &decode_attention_cuda);
  m.impl("decode_attention_rows", &decode_attention_rows_cuda);
  m.impl("ngram_block_", &ngram_block_cuda);
  m.impl("log_softmax_topk", &log_softmax_topk_cuda);
  m.impl("argmax_rows", &argmax_rows_cuda);
  m.impl("linear_argmax", &linear_argmax_cuda);
}
