// CUDA kernels of the update epilogues (sgd_epilogue_, adam_epilogue_); see list_ops.cuh.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "../op_checks.h"
#include "list_ops.cuh"

namespace singd::cuda {
namespace {

// SGD (kAdam false; kState: momentum buffer read/written) or the Adam form (kState true).
// ptr = {param P, update G, state S}.
template <bool kAdam, bool kState, typename P, typename G, typename S>
__global__ void __launch_bounds__(kThreads)
    epilogue_kernel(Batch<3> batch, Epilogue<at::opmath_type<P>> e, DevScalar inv_scale,
                    DevScalar found_inf, bool stochastic, int64_t seed) {
  using T = at::opmath_type<P>;
  if (skip_step(found_inf)) return;
  if (inv_scale.ptr != nullptr) e.inv_scale = load_scalar<T>(inv_scale);
  const Entry<3> en = batch.entry[find_entry(batch)];
  P* p = static_cast<P*>(en.ptr[0]);
  const G* g = static_cast<const G*>(en.ptr[1]);
  S* s = static_cast<S*>(en.ptr[2]);
  const int64_t begin = (blockIdx.x - en.block_begin) * kChunk;
  const int64_t end = min(begin + kChunk, en.numel);
  const uint32_t key = stream_key(seed, en.stream);
  for_chunk<vec_width<P>()>(en.vec, en.head, begin, end, [&](auto width, int64_t i) {
    constexpr int W = decltype(width)::value;
    T pv[W], gv[W], sv[W];
    load<W>(p, i, pv);
    load<W>(g, i, gv);
    if constexpr (kState) load<W>(s, i, sv);
#pragma unroll
    for (int v = 0; v < W; ++v) {
      T st = kState ? sv[v] : T(0);
      if constexpr (kAdam) {
        pv[v] = adam_element(pv[v], gv[v], st, T(1), e);
      } else {
        pv[v] = sgd_element<kState>(pv[v], gv[v], st, e);
      }
      sv[v] = st;
    }
    if constexpr (kState) store<W>(s, i, sv);
    store_param<W>(p, i, pv, stochastic, key);
  });
}

// ---- host side ------------------------------------------------------------------------------

struct EpilogueCall {
  const char* state_name;
  at::TensorList params;
  at::TensorList grads;
  at::TensorList state;
  Hyper hyper;
  const std::optional<at::Tensor>& inv_scale;
  const std::optional<at::Tensor>& found_inf;
  bool stochastic;
  int64_t seed;
};

void run_epilogue(const char* op, const EpilogueCall& c) {
  const bool use_state = c.hyper.adam || c.hyper.momentum != 0.0;
  check_lists(op, c.params, {{"updates", c.grads}, {c.state_name, c.state}},
              use_state ? nullptr : c.state_name);
  if (c.params.empty()) return;
  TORCH_CHECK(c.params[0].is_cuda(), op, ": expected CUDA tensors");
  check_optional_scalars(op, c.inv_scale, c.found_inf, c.params[0].device());
  const c10::cuda::CUDAGuard guard(c.params[0].device());
  const cudaStream_t stream = current_stream();

  auto params = in_place(c.params);
  auto state = in_place(use_state ? c.state : at::TensorList());
  const auto grads = contiguous(c.grads);
  std::vector<at::Tensor> state_work;
  for (const auto& s : state) state_work.push_back(s.work());
  for (const auto& [types, idx] : group_by_dtype(c.params, grads, state_work)) {
    const at::Tensor& first = params[idx[0]].work();
    dispatch_types(
        first.scalar_type(), grads[idx[0]].scalar_type(),
        (use_state ? state_work[idx[0]] : first).scalar_type(), [&](auto tp, auto tg, auto ts) {
          using P = typename decltype(tp)::type;
          using G = typename decltype(tg)::type;
          using S = typename decltype(ts)::type;
          using T = at::opmath_type<P>;
          std::vector<Entry<3>> entries;
          for (size_t i : idx) {
            const at::Tensor& p = params[i].work();
            void* sp = use_state ? state_work[i].data_ptr() : nullptr;
            constexpr int W = vec_width<P>();
            entries.push_back(make_entry<3>({p.data_ptr(), read_only(grads[i]), sp},
                                            {sizeof(P), sizeof(G), sizeof(S)}, W, p.numel(), 1,
                                            i));
          }
          const Epilogue<T> e = make_epilogue<T>(c.hyper, 1.0);
          const DevScalar inv = dev_scalar(c.inv_scale);
          const DevScalar found = dev_scalar(c.found_inf);
          with_bool(c.hyper.adam, [&](auto adam) {
            with_bool(use_state, [&](auto st) {
              constexpr bool kAdam = decltype(adam)::value;
              constexpr bool kState = decltype(st)::value;
              if constexpr (kAdam && !kState) {
                TORCH_CHECK(false, op, ": the Adam form needs its state");
              } else {
                launch_batches<3>(entries, [&](const Batch<3>& batch) {
                  epilogue_kernel<kAdam, kState, P, G, S><<<batch.blocks, kThreads, 0, stream>>>(
                      batch, e, inv, found, c.stochastic, c.seed);
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

void sgd_epilogue_cuda(at::TensorList params, at::TensorList updates, at::TensorList momentum_bufs,
                       double lr, double momentum, double weight_decay, bool decoupled,
                       const std::optional<at::Tensor>& inv_scale,
                       const std::optional<at::Tensor>& found_inf, bool stochastic_rounding,
                       int64_t seed) {
  Hyper h;
  h.lr = lr;
  h.momentum = momentum;
  h.weight_decay = weight_decay;
  h.decoupled = decoupled;
  run_epilogue("sgd_epilogue_", {"momentum_bufs", params, updates, momentum_bufs, h, inv_scale,
                                 found_inf, stochastic_rounding, seed});
}

void adam_epilogue_cuda(at::TensorList params, at::TensorList updates, at::TensorList exp_avgs,
                        double lr, double beta, int64_t step, double weight_decay, bool decoupled,
                        const std::optional<at::Tensor>& inv_scale,
                        const std::optional<at::Tensor>& found_inf, bool stochastic_rounding,
                        int64_t seed) {
  Hyper h;
  h.lr = lr;
  h.momentum = beta;
  h.weight_decay = weight_decay;
  h.decoupled = decoupled;
  h.adam = true;
  h.step = step;
  check_adam("adam_epilogue_", h);
  run_epilogue("adam_epilogue_", {"exp_avgs", params, updates, exp_avgs, h, inv_scale, found_inf,
                                  stochastic_rounding, seed});
}

}  // namespace
}  // namespace singd::cuda

TORCH_LIBRARY_IMPL(singd_cuda, CUDA, m) {
  m.impl("sgd_epilogue_", &singd::cuda::sgd_epilogue_cuda);
  m.impl("adam_epilogue_", &singd::cuda::adam_epilogue_cuda);
}
