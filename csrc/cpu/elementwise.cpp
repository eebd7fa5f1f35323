// CPU kernels of the list ops (update epilogues, diagonal preconditioned step, diagonal
// factor update): every tensor of a list is cut into spans of at most kSpan elements and
// all spans of all tensors run in one at::parallel_for. Loops are branch-free in the
// element index so the compiler vectorises them; the element math is singd_math.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "../op_checks.h"
#include "vector_isa.h"

namespace singd {
namespace {

constexpr int64_t kSpan = 1 << 15;

// Rows [begin, end) of tensor `tensor` viewed as (rows, row_len).
struct Span {
  size_t tensor;
  int64_t begin;
  int64_t end;
};

// Spans of at most ~kSpan elements over all tensors; row_len[i] elements form one row of
// tensor i (1 for flat tensors), and spans never split a row.
std::vector<Span> make_spans(const std::vector<int64_t>& rows,
                             const std::vector<int64_t>& row_len) {
  std::vector<Span> spans;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t step = std::max<int64_t>(1, kSpan / std::max<int64_t>(1, row_len[i]));
    for (int64_t r = 0; r < rows[i]; r += step) {
      spans.push_back({i, r, std::min(rows[i], r + step)});
    }
  }
  return spans;
}

template <typename F>
void parallel_spans(const std::vector<Span>& spans, const F& body) {
  at::parallel_for(0, static_cast<int64_t>(spans.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) body(spans[s]);
  });
}

// Value of an optional one-element tensor (inv_scale), 1 when absent.
double value_or_one(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->item<double>() : 1.0;
}

// Element i of a floating CPU tensor as item<double>() reads it (i = 0: its one element;
// else along its one dimension), through the data pointer for float32 and float64: no
// dispatcher call (two per factor and call of diag_factor_update_).
double cpu_value(const at::Tensor& t, int64_t i = 0) {
  const int64_t offset = i == 0 ? 0 : i * t.stride(0);
  switch (t.scalar_type()) {
    case at::kFloat:
      return static_cast<double>(t.const_data_ptr<float>()[offset]);
    case at::kDouble:
      return t.const_data_ptr<double>()[offset];
    default:
      return i == 0 ? t.item<double>() : t[i].item<double>();
  }
}

bool skip_step(const std::optional<at::Tensor>& found_inf) {
  return found_inf.has_value() && found_inf->item<double>() != 0.0;
}

// ---- loops over one span ----------------------------------------------------------------

// SGD (kAdam false; kMomentum selects whether buf is read and written) or the Adam form
// (state always present, denominator 1) on n elements; `first` is the index of p[0] in its
// tensor (the stochastic-rounding stream is indexed by it).
template <bool kAdam, bool kMomentum, bool kStochastic, typename P, typename G, typename S,
          typename T>
SINGD_CPU_CLONES void epilogue_loop(P* p, const G* g, S* state, int64_t n, int64_t first,
                                    const Epilogue<T> e, uint32_t key) {
  for (int64_t i = 0; i < n; ++i) {
    T s = kMomentum ? static_cast<T>(state[i]) : T(0);
    T np;
    if constexpr (kAdam) {
      np = adam_element(static_cast<T>(p[i]), static_cast<T>(g[i]), s, T(1), e);
    } else {
      np = sgd_element<kMomentum>(static_cast<T>(p[i]), static_cast<T>(g[i]), s, e);
    }
    if constexpr (kMomentum) state[i] = static_cast<S>(s);
    p[i] = store_param<P>(np, kStochastic, key, first + i);
  }
}

// Rows [lo, hi) of a (rows, cols) parameter on the diagonal path.
template <bool kAdaFisher, bool kMomentum, bool kStochastic, typename P, typename G, typename S,
          typename T>
SINGD_CPU_CLONES void diag_loop(P* p, const G* g, S* state, const T* row, const T* col,
                                int64_t cols, int64_t lo, int64_t hi, const Epilogue<T> e,
                                uint32_t key) {
  for (int64_t r = lo; r < hi; ++r) {
    const T rs = row[r];
    const int64_t base = r * cols;
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t i = base + j;
      T s = kMomentum ? static_cast<T>(state[i]) : T(0);
      T np;
      if constexpr (kAdaFisher) {
        np = adafisher_element(static_cast<T>(p[i]), static_cast<T>(g[i]), s, rs, col[j], e);
      } else {
        np = singd_diag_element<kMomentum>(static_cast<T>(p[i]), static_cast<T>(g[i]), s, rs,
                                           col[j], e);
      }
      if constexpr (kMomentum) state[i] = static_cast<S>(s);
      p[i] = store_param<P>(np, kStochastic, key, i);
    }
  }
}

// ---- ops ----------------------------------------------------------------------------------

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
  const bool momentum = c.hyper.adam || c.hyper.momentum != 0.0;
  check_lists(op, c.params, {{"updates", c.grads}, {c.state_name, c.state}},
              momentum ? nullptr : c.state_name);
  if (c.params.empty()) return;
  check_optional_scalars(op, c.inv_scale, c.found_inf, c.params[0].device());
  if (skip_step(c.found_inf)) return;
  const double inv = value_or_one(c.inv_scale);

  auto params = in_place(c.params);
  auto state = in_place(momentum ? c.state : at::TensorList());
  // An update whose rows (along dim 0) are each contiguous is read where it lies: the
  // preconditioned weight of a layer with a bias is such a view of the (d_C, d_K) matrix,
  // and its bias (the last column, a strided vector) one of one-element rows.
  std::vector<at::Tensor> grads;
  std::vector<int64_t> rows, row_len, row_stride;
  for (size_t i = 0; i < c.params.size(); ++i) {
    const at::Tensor& g = c.grads[i];
    const int64_t stride = contiguous_rows_stride(g);
    const bool by_row = !g.is_contiguous() && stride > 1;
    grads.push_back(by_row ? g : g.contiguous());
    const int64_t n = g.numel();
    rows.push_back(by_row ? g.size(0) : n);
    row_len.push_back(by_row ? n / g.size(0) : 1);
    row_stride.push_back(by_row ? stride : 1);
  }
  parallel_spans(make_spans(rows, row_len), [&](const Span& sp) {
    const size_t i = sp.tensor;
    const at::Tensor& p = params[i].work();
    const at::Tensor& s = momentum ? state[i].work() : p;
    const uint32_t key = stream_key(c.seed, static_cast<int64_t>(i));
    const int64_t cols = row_len[i];
    dispatch_types(
        p.scalar_type(), grads[i].scalar_type(), s.scalar_type(), [&](auto tp, auto tg, auto ts) {
          using P = typename decltype(tp)::type;
          using G = typename decltype(tg)::type;
          using S = typename decltype(ts)::type;
          using T = at::opmath_type<P>;
          const Epilogue<T> e = make_epilogue<T>(c.hyper, inv);
          P* pp = p.data_ptr<P>();
          const G* gp = grads[i].const_data_ptr<G>();
          S* sp_ = s.data_ptr<S>();
          with_bool(c.hyper.adam, [&](auto adam) {
            with_bool(momentum, [&](auto mom) {
              with_bool(c.stochastic, [&](auto sr) {
                constexpr bool kA = decltype(adam)::value, kM = decltype(mom)::value,
                               kS = decltype(sr)::value;
                if (row_stride[i] == 1) {  // flat: elements [begin, end)
                  epilogue_loop<kA, kM, kS>(pp + sp.begin, gp + sp.begin, sp_ + sp.begin,
                                            sp.end - sp.begin, sp.begin, e, key);
                } else {  // rows [begin, end) of `cols` elements, `row_stride` apart in g
                  for (int64_t r = sp.begin; r < sp.end; ++r) {
                    epilogue_loop<kA, kM, kS>(pp + r * cols, gp + r * row_stride[i],
                                              sp_ + r * cols, cols, r * cols, e, key);
                  }
                }
              });
            });
          });
        });
  });
  commit_all(params);
  commit_all(state);
}

void sgd_epilogue_cpu(at::TensorList params, at::TensorList updates, at::TensorList momentum_bufs,
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

void adam_epilogue_cpu(at::TensorList params, at::TensorList updates, at::TensorList exp_avgs,
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

void diag_precond_step_cpu(at::TensorList params_in, at::TensorList grads_in,
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
  check_optional_scalars(op, inv_scale, found_inf, params_in[0].device());
  if (skip_step(found_inf)) return;
  const double inv = value_or_one(inv_scale);

  auto params = in_place(params_in);
  auto state = in_place(use_state ? bufs_in : at::TensorList());
  const auto grads = contiguous(grads_in);
  std::vector<at::Tensor> rows_s, cols_s;
  std::vector<int64_t> rows, row_len;
  for (size_t i = 0; i < params_in.size(); ++i) {
    rows_s.push_back(as_scale(row_scales[i], params_in[i].scalar_type()));
    cols_s.push_back(as_scale(col_scales[i], params_in[i].scalar_type()));
    rows.push_back(params_in[i].size(0));
    row_len.push_back(params_in[i].size(1));
  }
  parallel_spans(make_spans(rows, row_len), [&](const Span& sp) {
    const size_t i = sp.tensor;
    const at::Tensor& p = params[i].work();
    const at::Tensor& s = use_state ? state[i].work() : p;
    const uint32_t key = stream_key(seed, static_cast<int64_t>(i));
    dispatch_types(
        p.scalar_type(), grads[i].scalar_type(), s.scalar_type(), [&](auto tp, auto tg, auto ts) {
          using P = typename decltype(tp)::type;
          using G = typename decltype(tg)::type;
          using S = typename decltype(ts)::type;
          using T = at::opmath_type<P>;
          const Epilogue<T> e = make_epilogue<T>(h, inv);
          with_bool(adafisher, [&](auto ada) {
            with_bool(use_state, [&](auto mom) {
              with_bool(stochastic_rounding, [&](auto sr) {
                diag_loop<decltype(ada)::value, decltype(mom)::value, decltype(sr)::value>(
                    p.data_ptr<P>(), grads[i].const_data_ptr<G>(), s.data_ptr<S>(),
                    rows_s[i].const_data_ptr<T>(), cols_s[i].const_data_ptr<T>(), p.size(1),
                    sp.begin, sp.end, e, key);
              });
            });
          });
        });
  });
  commit_all(params);
  commit_all(state);
}

// Factor i of diag_factor_update_ as rows: a tensor is one factor (cut into spans of single
// elements), except a 2-D (n, d) one whose a[i] and b[i] (those given) hold n > 1 values:
// n factors of d elements, one row each, read where they lie when the rows are contiguous.
struct FactorRows {
  int64_t rows;
  int64_t len;
  int64_t k_stride, m_stride, h_stride;  // elements between rows
  size_t values;                         // index of the first row's a and b values
  bool stacked;
};

// Whether factor i is a stack of rows (see FactorRows).
bool stacked_factor(const at::Tensor& k, at::TensorList a, at::TensorList b, size_t i) {
  if (k.dim() != 2 || k.size(0) < 2) return false;
  const int64_t n = k.size(0);
  return (a.empty() || a[i].numel() == n) && (b.empty() || b[i].numel() == n);
}

// n values of a floating CPU tensor of n elements (one per row of a stacked factor), as
// item<double>() would read each.
void append_values(const at::Tensor& t, std::vector<double>& out) {
  const at::Tensor flat = t.dim() == 1 ? t : t.reshape({-1});
  for (int64_t r = 0; r < flat.numel(); ++r) out.push_back(cpu_value(flat, r));
}

// The a (or b) values of factor i into `out`: one per row of a stacked factor, and
// `count` ones when none are given.
void append_factor_values(at::TensorList given, size_t i, bool stacked, size_t count,
                          std::vector<double>& out) {
  if (given.empty()) {
    out.insert(out.end(), count, 1.0);
  } else if (stacked) {
    append_values(given[i], out);
  } else {
    out.push_back(cpu_value(given[i]));
  }
}

void check_factor_values(at::TensorList k, at::TensorList a, at::TensorList b,
                         at::TensorList values, const char* name) {
  for (size_t i = 0; i < values.size(); ++i) {
    const int64_t n = stacked_factor(k[i], a, b, i) ? k[i].size(0) : 1;
    TORCH_CHECK(values[i].numel() == n, "diag_factor_update_: ", name, "[", i, "] has ",
                values[i].numel(), " elements, expected ", n,
                " (one, or one per row of a 2-D k[i] with a and b alike)");
    const at::Tensor& t = values[i];
    TORCH_CHECK(is_floating(t.scalar_type()) && t.device() == k[i].device(),
                "diag_factor_update_: ", name, "[", i, "] must be a floating tensor on ",
                k[i].device());
  }
}

// The row stride of a 2-D tensor whose rows are contiguous, else -1.
int64_t row_stride(const at::Tensor& t) {
  return t.dim() == 2 && (t.stride(1) == 1 || t.size(1) <= 1) ? t.stride(0) : -1;
}

void diag_factor_update_cpu(at::TensorList k_in, at::TensorList m_in, at::TensorList h_in,
                            at::TensorList a, at::TensorList b, double alpha1, double beta1,
                            double damping) {
  const char* op = "diag_factor_update_";
  check_lists(op, k_in, {{"m", m_in}, {"h", h_in}});
  TORCH_CHECK(a.empty() || a.size() == k_in.size(), op, ": a has ", a.size(),
              " tensors, expected 0 or ", k_in.size());
  TORCH_CHECK(b.empty() || b.size() == k_in.size(), op, ": b has ", b.size(),
              " tensors, expected 0 or ", k_in.size());
  check_factor_values(k_in, a, b, a, "a");
  check_factor_values(k_in, a, b, b, "b");
  if (k_in.empty()) return;
  // a stacked factor's rows are written where they lie when contiguous, else through a
  // contiguous working copy (InPlace)
  std::vector<InPlace> k, m;
  std::vector<at::Tensor> h;
  std::vector<FactorRows> shape;
  std::vector<double> a_val, b_val;
  std::vector<int64_t> rows, row_len;
  for (size_t i = 0; i < k_in.size(); ++i) {
    const bool stacked = stacked_factor(k_in[i], a, b, i);
    const bool direct = stacked && row_stride(k_in[i]) >= 0 && row_stride(m_in[i]) >= 0;
    k.emplace_back(k_in[i], !direct);
    m.emplace_back(m_in[i], !direct);
    h.push_back(stacked && row_stride(h_in[i]) >= 0 ? h_in[i] : h_in[i].contiguous());
    FactorRows f{};
    f.stacked = stacked;
    f.values = a_val.size();
    if (stacked) {
      f.rows = k_in[i].size(0);
      f.len = k_in[i].size(1);
      f.k_stride = direct ? k_in[i].stride(0) : f.len;
      f.m_stride = direct ? m_in[i].stride(0) : f.len;
      f.h_stride = row_stride(h_in[i]) >= 0 ? h_in[i].stride(0) : f.len;
    } else {  // one factor, in spans of elements
      f.rows = k_in[i].numel();
      f.len = 1;
      f.k_stride = f.m_stride = f.h_stride = 1;
    }
    const size_t values = stacked ? static_cast<size_t>(f.rows) : 1;
    append_factor_values(a, i, stacked, values, a_val);
    append_factor_values(b, i, stacked, values, b_val);
    rows.push_back(f.rows);
    row_len.push_back(f.len);
    shape.push_back(f);
  }
  parallel_spans(make_spans(rows, row_len), [&](const Span& sp) {
    const size_t i = sp.tensor;
    const FactorRows& f = shape[i];
    const at::Tensor& kt = k[i].work();
    const at::Tensor& mt = m[i].work();
    dispatch_types(kt.scalar_type(), mt.scalar_type(), h[i].scalar_type(),
                   [&](auto tk, auto tm, auto th) {
                     using K = typename decltype(tk)::type;
                     using M = typename decltype(tm)::type;
                     using H = typename decltype(th)::type;
                     using T = at::opmath_type<K>;
                     K* kp = kt.data_ptr<K>();
                     M* mp = mt.data_ptr<M>();
                     const H* hp = h[i].const_data_ptr<H>();
                     const T al = static_cast<T>(alpha1);
                     const T be = static_cast<T>(beta1);
                     for (int64_t r = sp.begin; r < sp.end; ++r) {
                       const size_t v = f.values + (f.stacked ? static_cast<size_t>(r) : 0);
                       const T av = static_cast<T>(a_val[v]);
                       const T lam_b = static_cast<T>(damping) * static_cast<T>(b_val[v]);
                       K* kr = kp + r * f.k_stride;
                       M* mr = mp + r * f.m_stride;
                       const H* hr = hp + r * f.h_stride;
                       for (int64_t j = 0; j < f.len; ++j) {
                         T kv = static_cast<T>(kr[j]);
                         T mv = static_cast<T>(mr[j]);
                         factor_element(kv, mv, static_cast<T>(hr[j]), av, lam_b, al, be);
                         kr[j] = static_cast<K>(kv);
                         mr[j] = static_cast<M>(mv);
                       }
                     }
                   });
  });
  commit_all(k);
  commit_all(m);
}

}  // namespace

TORCH_LIBRARY_IMPL(singd_cuda, CPU, m) {
  m.impl("sgd_epilogue_", &sgd_epilogue_cpu);
  m.impl("adam_epilogue_", &adam_epilogue_cpu);
  m.impl("diag_precond_step_", &diag_precond_step_cpu);
  m.impl("diag_factor_update_", &diag_factor_update_cpu);
}

}  // namespace singd
