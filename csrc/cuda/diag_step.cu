// CUDA kernel of the diagonal SINGD / AdaFisher step (diag_precond_step_); see list_ops.cuh.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "../op_checks.h"
#include "list_ops.cuh"

namespace singd::cuda {
namespace {

// Elements [i, i + W) of the diagonal path, starting at row r, column c: row and column
// scales advance with the column, so no index is divided here.
template <bool kAdaFisher, bool kState, int W, typename P, typename G, typename S, typename T>
__device__ __forceinline__ void diag_elements(P* p, const G* g, S* s, const T* rows,
                                              const T* cols, int64_t ncols, int64_t i, int64_t r,
                                              int64_t c, const Epilogue<T>& e, bool stochastic,
                                              uint32_t key) {
  T pv[W], gv[W], sv[W];
  load<W>(p, i, pv);
  load<W>(g, i, gv);
  if constexpr (kState) load<W>(s, i, sv);
  T row = rows[r];
#pragma unroll
  for (int v = 0; v < W; ++v) {
    const T col = cols[c];
    T st = kState ? sv[v] : T(0);
    if constexpr (kAdaFisher) {
      pv[v] = adafisher_element(pv[v], gv[v], st, row, col, e);
    } else {
      pv[v] = singd_diag_element<kState>(pv[v], gv[v], st, row, col, e);
    }
    sv[v] = st;
    if (v + 1 < W && ++c == ncols) {  // element i + v + 1 exists: it starts the next row
      c = 0;
      row = rows[++r];
    }
  }
  if constexpr (kState) store<W>(s, i, sv);
  store_param<W>(p, i, pv, stochastic, key);
}

// Diagonal path over a (rows, cols) parameter. ptr = {param P, grad G, state S,
// row scales T, col scales T}. Each thread divides its first vector index by the row
// length once and then advances (row, column) by its fixed stride.
template <bool kAdaFisher, bool kState, typename P, typename G, typename S>
__global__ void __launch_bounds__(kThreads)
    diag_kernel(Batch<5> batch, Epilogue<at::opmath_type<P>> e, DevScalar inv_scale,
                DevScalar found_inf, bool stochastic, int64_t seed) {
  using T = at::opmath_type<P>;
  constexpr int V = vec_width<P>();
  if (skip_step(found_inf)) return;
  if (inv_scale.ptr != nullptr) e.inv_scale = load_scalar<T>(inv_scale);
  const Entry<5> en = batch.entry[find_entry(batch)];
  P* p = static_cast<P*>(en.ptr[0]);
  const G* g = static_cast<const G*>(en.ptr[1]);
  S* s = static_cast<S*>(en.ptr[2]);
  const T* rows = static_cast<const T*>(en.ptr[3]);
  const T* cols = static_cast<const T*>(en.ptr[4]);
  const int64_t ncols = en.cols;
  const int64_t begin = (blockIdx.x - en.block_begin) * kChunk;
  const int64_t end = min(begin + kChunk, en.numel);
  const uint32_t key = stream_key(seed, en.stream);
  const ChunkSplit split = split_chunk<V>(en.vec, en.head, begin, end);
  // scalar head and tail: at most 2 * (V - 1) elements per chunk
  const auto scalar = [&](int64_t i) {
    const int64_t r = i / ncols;
    diag_elements<kAdaFisher, kState, 1>(p, g, s, rows, cols, ncols, i, r, i - r * ncols, e,
                                         stochastic, key);
  };
  for (int64_t i = begin + threadIdx.x; i < split.vec_begin; i += kThreads) scalar(i);
  int64_t i = split.vec_begin + static_cast<int64_t>(threadIdx.x) * V;
  if (i < split.vec_end) {
    constexpr int64_t kStride = static_cast<int64_t>(kThreads) * V;
    const int64_t step_r = kStride / ncols;
    const int64_t step_c = kStride - step_r * ncols;
    int64_t r = i / ncols;
    int64_t c = i - r * ncols;
    for (; i < split.vec_end; i += kStride) {
      diag_elements<kAdaFisher, kState, V>(p, g, s, rows, cols, ncols, i, r, c, e, stochastic,
                                           key);
      r += step_r;
      c += step_c;
      if (c >= ncols) {
        c -= ncols;
        ++r;
      }
    }
  }
  for (int64_t j = split.vec_end + threadIdx.x; j < end; j += kThreads) scalar(j);
}

// ---- host side ------------------------------------------------------------------------------

void diag_precond_step_cuda(at::TensorList params_in, at::TensorList grads_in,
                            at::TensorList bufs_in, at::TensorList row_scales,
                            at::TensorList col_scales, c10::string_view mode, double lr,
                            double momentum, double damping, double weight_decay, bool decoupled,
                            int64_t step, const std::optional<at::Tensor>& inv_scale,
                            const std::optional<at::Tensor>& found_inf, bool stochastic_rounding,
                            int64_t seed) {
  const char* op = "diag_precond_step_";
  const bool adafisher = parse_adafisher_mode(mode);
  Hyper h;
  h.lr = lr;
  h.momentum = momentum;
  h.weight_decay = weight_decay;
  h.damping = damping;
  h.decoupled = decoupled;
  h.adam = adafisher;
  h.step = step;
  if (adafisher) check_adam(op, h);
  const bool use_state = adafisher || momentum != 0.0;
  check_lists(op, params_in, {{"grads", grads_in}, {"bufs", bufs_in}},
              use_state ? nullptr : "bufs", "grads");
  check_scales(params_in, row_scales, col_scales);
  if (params_in.empty()) return;
  TORCH_CHECK(params_in[0].is_cuda(), op, ": expected CUDA tensors");
  check_optional_scalars(op, inv_scale, found_inf, params_in[0].device());
  const c10::cuda::CUDAGuard guard(params_in[0].device());
  const cudaStream_t stream = current_stream();

  auto params = in_place(params_in);
  auto state = in_place(use_state ? bufs_in : at::TensorList());
  const auto grads = contiguous(grads_in);
  std::vector<at::Tensor> state_work, rows_s, cols_s;
  for (const auto& s : state) state_work.push_back(s.work());
  for (size_t i = 0; i < params_in.size(); ++i) {
    rows_s.push_back(as_scale(row_scales[i], params_in[i].scalar_type()));
    cols_s.push_back(as_scale(col_scales[i], params_in[i].scalar_type()));
  }
  for (const auto& [types, idx] : group_by_dtype(params_in, grads, state_work)) {
    const at::Tensor& first = params[idx[0]].work();
    dispatch_types(
        first.scalar_type(), grads[idx[0]].scalar_type(),
        (use_state ? state_work[idx[0]] : first).scalar_type(), [&](auto tp, auto tg, auto ts) {
          using P = typename decltype(tp)::type;
          using G = typename decltype(tg)::type;
          using S = typename decltype(ts)::type;
          using T = at::opmath_type<P>;
          std::vector<Entry<5>> entries;
          for (size_t i : idx) {
            const at::Tensor& p = params[i].work();
            void* sp = use_state ? state_work[i].data_ptr() : nullptr;
            constexpr int W = vec_width<P>();
            entries.push_back(make_entry<5>({p.data_ptr(), read_only(grads[i]), sp,
                                             read_only(rows_s[i]), read_only(cols_s[i])},
                                            {sizeof(P), sizeof(G), sizeof(S), 0, 0}, W,
                                            p.numel(), p.size(1), i));
          }
          const Epilogue<T> e = make_epilogue<T>(h, 1.0);
          const DevScalar inv = dev_scalar(inv_scale);
          const DevScalar found = dev_scalar(found_inf);
          with_bool(adafisher, [&](auto ada) {
            with_bool(use_state, [&](auto st) {
              constexpr bool kAda = decltype(ada)::value;
              constexpr bool kState = decltype(st)::value;
              if constexpr (kAda && !kState) {
                TORCH_CHECK(false, op, ": AdaFisher needs its state");
              } else {
                launch_batches<5>(entries, [&](const Batch<5>& batch) {
                  diag_kernel<kAda, kState, P, G, S><<<batch.blocks, kThreads, 0, stream>>>(
                      batch, e, inv, found, stochastic_rounding, seed);
                  C10_CUDA_KERNEL_LAUNCH_CHECK();
                });
              }
            });
          });
        });
  }
  commit_all(params);
  commit_all(state);
}

}  // namespace
}  // namespace singd::cuda

TORCH_LIBRARY_IMPL(singd_cuda, CUDA, m) {
  m.impl("diag_precond_step_", &singd::cuda::diag_precond_step_cuda);
}
