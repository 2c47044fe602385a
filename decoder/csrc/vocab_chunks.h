// linear_argmax's product, a vocabulary chunk at a time, shared by its CPU
// (fused_cpu.cpp) and CUDA (fused_cuda.cu) kernels: the two differ only in the
// argmax that each chunk is handed to.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace vocab_chunks {

// x (R, d), weight (V, d), bias (V,) or none: x W^T + b taken `chunk` vocabulary
// rows at a time into one (R, chunk) buffer that stays in cache; on_chunk(o, s)
// gets each chunk's product o (R, w) and the vocabulary index s of its first
// column, in increasing s. Every chunk has the same width (the last one starts at
// V - chunk and overlaps its neighbour) because a GEMM's rounding can depend on the
// width: a narrow tail once broke an exact tie the full product kept.
template <typename OnChunk>
void for_each(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t chunk,
              OnChunk&& on_chunk) {
  const int64_t V = weight.size(0), R = x.size(0), w = std::min(chunk, V);
  auto xr = x.contiguous();
  std::optional<at::Tensor> b1d;
  if (bias.has_value()) b1d = bias->reshape({-1});
  auto o = at::empty({R, w}, xr.options());
  for (int64_t s0 = 0; s0 < V; s0 += w) {
    const int64_t s = std::min(s0, V - w);
    auto ws = weight.narrow(0, s, w).t();
    if (b1d.has_value())
      at::addmm_out(o, b1d->narrow(0, s, w), xr, ws);
    else
      at::mm_out(o, xr, ws);
    on_chunk(o, s);
  }
}

}  // namespace vocab_chunks
