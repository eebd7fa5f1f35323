// CUDA kernels of the list ops (update epilogues, diagonal preconditioned step, diagonal
// factor update). Tensors are grouped by dtype combination; each group runs as one
// multi-tensor launch (per kMax tensors) with 16-byte vector access; only the unaligned head
// and the tail of each chunk take scalar access. found_inf and inv_scale are read on the
// device. Element math: singd_math.h.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <array>
#include <map>
#include <tuple>
#include <vector>

#include "../op_checks.h"
#include "device_utils.cuh"

namespace singd::cuda {
namespace {

// Indices of `params` grouped by the dtypes of (params[i], a[i], b[i]); b may be empty.
std::map<std::tuple<int, int, int>, std::vector<size_t>> group_by_dtype(
    at::TensorList params, const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  std::map<std::tuple<int, int, int>, std::vector<size_t>> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto key = std::make_tuple(
        static_cast<int>(params[i].scalar_type()), static_cast<int>(a[i].scalar_type()),
        static_cast<int>((b.empty() ? params[i] : b[i]).scalar_type()));
    groups[key].push_back(i);
  }
  return groups;
}

// Vector width of a parameter dtype: 16 bytes of parameters.
template <typename P>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(P));
}

// ---- kernels ------------------------------------------------------------------------------

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

// Entry of tensor `stream`: `elem_bytes` is the element size of each pointer accessed by
// vector of `width` elements (0 for the others; null pointers are not accessed).
template <int NPTR>
Entry<NPTR> make_entry(const std::array<void*, NPTR>& ptrs,
                       const std::array<int64_t, NPTR>& elem_bytes, int width, int64_t numel,
                       int64_t cols, size_t stream) {
  Entry<NPTR> e{};
  for (int j = 0; j < NPTR; ++j) e.ptr[j] = ptrs[j];
  set_vector_access<NPTR>(e, elem_bytes, width);
  e.numel = numel;
  e.cols = cols;
  e.stream = static_cast<int32_t>(stream);
  return e;
}

// Pointer of a tensor the kernels only read (the Entry holds untyped pointers).
inline void* read_only(const at::Tensor& t) { return const_cast<void*>(t.const_data_ptr()); }

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
              use_state ? nullptr : "bufs");
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
  m.impl("sgd_epilogue_", &singd::cuda::sgd_epilogue_cuda);
  m.impl("adam_epilogue_", &singd::cuda::adam_epilogue_cuda);
  m.impl("diag_precond_step_", &singd::cuda::diag_precond_step_cuda);
  m.impl("diag_factor_update_", &singd::cuda::diag_factor_update_cuda);
}
