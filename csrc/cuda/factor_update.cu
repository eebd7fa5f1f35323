// CUDA kernel of the diagonal factor update (diag_factor_update_); see list_ops.cuh.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "../op_checks.h"
#include "list_ops.cuh"

namespace singd::cuda {
namespace {

// Diagonal factor update. ptr = {k K, m M, h H}; scalar = {a, b} (absent: 1).
template <typename K, typename M, typename H>
__global__ void __launch_bounds__(kThreads)
    factor_kernel(Batch<3> batch, at::opmath_type<K> alpha1, at::opmath_type<K> beta1,
                  at::opmath_type<K> damping) {
  using T = at::opmath_type<K>;
  const Entry<3> en = batch.entry[find_entry(batch)];
  K* k = static_cast<K*>(en.ptr[0]);
  M* m = static_cast<M*>(en.ptr[1]);
  const H* h = static_cast<const H*>(en.ptr[2]);
  const T a = en.scalar[0].ptr != nullptr ? load_scalar<T>(en.scalar[0]) : T(1);
  const T b = en.scalar[1].ptr != nullptr ? load_scalar<T>(en.scalar[1]) : T(1);
  const T lam_b = damping * b;
  const int64_t begin = (blockIdx.x - en.block_begin) * kChunk;
  const int64_t end = min(begin + kChunk, en.numel);
  for_chunk<vec_width<K>()>(en.vec, en.head, begin, end, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    T kv[W], mv[W], hv[W];
    load<W>(k, i, kv);
    load<W>(m, i, mv);
    load<W>(h, i, hv);
#pragma unroll
    for (int v = 0; v < W; ++v) factor_element(kv[v], mv[v], hv[v], a, lam_b, alpha1, beta1);
    store<W>(k, i, kv);
    store<W>(m, i, mv);
  });
}

// ---- host side ------------------------------------------------------------------------------

void diag_factor_update_cuda(at::TensorList k_in, at::TensorList m_in, at::TensorList h_in,
                             at::TensorList a, at::TensorList b, double alpha1, double beta1,
                             double damping) {
  const char* op = "diag_factor_update_";
  check_lists(op, k_in, {{"m", m_in}, {"h", h_in}});
  check_traces(k_in, a, "a");
  check_traces(k_in, b, "b");
  if (k_in.empty()) return;
  TORCH_CHECK(k_in[0].is_cuda(), op, ": expected CUDA tensors");
  const c10::cuda::CUDAGuard guard(k_in[0].device());
  const cudaStream_t stream = current_stream();
  auto k = in_place(k_in);
  auto m = in_place(m_in);
  const auto h = contiguous(h_in);
  std::vector<at::Tensor> m_work;
  for (const auto& t : m) m_work.push_back(t.work());
  for (const auto& [types, idx] : group_by_dtype(k_in, m_work, h)) {
    dispatch_types(
        k_in[idx[0]].scalar_type(), m_work[idx[0]].scalar_type(), h[idx[0]].scalar_type(),
        [&](auto tk, auto tm, auto th) {
          using K = typename decltype(tk)::type;
          using M = typename decltype(tm)::type;
          using H = typename decltype(th)::type;
          using T = at::opmath_type<K>;
          std::vector<Entry<3>> entries;
          for (size_t i : idx) {
            const at::Tensor& kt = k[i].work();
            constexpr int W = vec_width<K>();
            Entry<3> e = make_entry<3>({kt.data_ptr(), m_work[i].data_ptr(), read_only(h[i])},
                                       {sizeof(K), sizeof(M), sizeof(H)}, W, kt.numel(), 1, i);
            if (!a.empty()) e.scalar[0] = dev_scalar(a[i]);
            if (!b.empty()) e.scalar[1] = dev_scalar(b[i]);
            entries.push_back(e);
          }
          launch_batches<3>(entries, [&](const Batch<3>& batch) {
            factor_kernel<K, M, H><<<batch.blocks, kThreads, 0, stream>>>(
                batch, static_cast<T>(alpha1), static_cast<T>(beta1), static_cast<T>(damping));
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        });
  }
  commit_all(k);
  commit_all(m);
}

}  // namespace
}  // namespace singd::cuda

TORCH_LIBRARY_IMPL(singd_cuda, CUDA, m) {
  m.impl("diag_factor_update_", &singd::cuda::diag_factor_update_cuda);
}
