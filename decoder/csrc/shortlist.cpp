// The lexical shortlist's candidates for one batch, CPU:
//
//   shortlist_candidates  src (B, S) source ids -> (C,) ascending: the union of
//                         each source id's CSR list (offsets, ids) and `always`
//
// decoder/shortlist.py `Shortlist.candidates_reference` is the same union in
// tensor ops (unique, a repeat_interleave of the list starts, a boolean scatter,
// nonzero): a dozen dispatches, ~0.3 ms for one sentence, once per batch, which
// at batch 1 is 5% of a sentence. Here: one pass over the source ids marking a
// vocabulary-sized bitmap, one pass reading it out in order.
#include <torch/library.h>
#include <ATen/ATen.h>
#include "checks.h"

#include <cstdint>
#include <vector>

namespace {

at::Tensor shortlist_candidates(const at::Tensor& src, const at::Tensor& offsets, const at::Tensor& ids,
                                const at::Tensor& always) {
  KIT_CHECK(src.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong &&
                  ids.scalar_type() == at::kLong && always.scalar_type() == at::kLong,
              "shortlist_candidates: src, offsets, ids and always must be int64");
  KIT_CHECK(offsets.dim() == 1 && offsets.numel() >= 1 && ids.dim() == 1 && always.dim() == 1,
              "shortlist_candidates: offsets (V+1,), ids (nnz,) and always (N,) must be 1-d");
  const auto s = src.contiguous(), o = offsets.contiguous(), l = ids.contiguous(), a = always.contiguous();
  const int64_t V = o.numel() - 1, nnz = l.numel();
  const int64_t *sp = s.data_ptr<int64_t>(), *op = o.data_ptr<int64_t>(), *lp = l.data_ptr<int64_t>(),
                *ap = a.data_ptr<int64_t>();
  std::vector<uint8_t> seen(V, 0), allowed(V, 0);
  auto allow = [&](int64_t id) {
    KIT_CHECK(id >= 0 && id < V, "shortlist_candidates: target id ", id, " outside the vocabulary of ", V);
    allowed[id] = 1;
  };
  for (int64_t i = 0, n = s.numel(); i < n; ++i) {
    const int64_t x = sp[i];
    KIT_CHECK(x >= 0 && x < V, "shortlist_candidates: source id ", x, " outside the vocabulary of ", V);
    if (seen[x]) continue;
    seen[x] = 1;
    KIT_CHECK(op[x] >= 0 && op[x] <= op[x + 1] && op[x + 1] <= nnz, "shortlist_candidates: bad offsets at ", x);
    for (int64_t k = op[x]; k < op[x + 1]; ++k) allow(lp[k]);
  }
  for (int64_t i = 0, n = a.numel(); i < n; ++i) allow(ap[i]);
  int64_t C = 0;
  for (int64_t v = 0; v < V; ++v) C += allowed[v];
  auto out = at::empty({C}, src.options().device(at::kCPU));  // (C,)
  int64_t* p = out.data_ptr<int64_t>();
  for (int64_t v = 0; v < V; ++v)
    if (allowed[v]) *p++ = v;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(decoder_ops, m) {
  m.def("shortlist_candidates(Tensor src, Tensor offsets, Tensor ids, Tensor always) -> Tensor");
}

TORCH_LIBRARY_IMPL(decoder_ops, CPU, m) {
  m.impl("shortlist_candidates", &shortlist_candidates);
}
