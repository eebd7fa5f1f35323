// Device helpers of the CUDA kernels: multi-tensor launch metadata, vector loads/stores,
// one-element tensors read on the device, block reductions.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

#include "../singd_math.h"

namespace singd::cuda {

constexpr int kThreads = 256;
// Elements per block of the list kernels; a multiple of every vector width times kThreads.
constexpr int64_t kChunk = 8192;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- one-element tensors (inv_scale, found_inf, traces) read on the device ---------------

struct DevScalar {
  const void* ptr = nullptr;  // null: absent
  at::ScalarType type = at::kFloat;
};

inline DevScalar dev_scalar(const at::Tensor& t) { return {t.const_data_ptr(), t.scalar_type()}; }

inline DevScalar dev_scalar(const std::optional<at::Tensor>& t) {
  return t.has_value() ? dev_scalar(*t) : DevScalar{};
}

template <typename T>
__device__ __forceinline__ T load_scalar(const DevScalar& s) {
  switch (s.type) {
    case at::kDouble:
      return static_cast<T>(*static_cast<const double*>(s.ptr));
    case at::kHalf:
      return static_cast<T>(*static_cast<const c10::Half*>(s.ptr));
    case at::kBFloat16:
      return static_cast<T>(*static_cast<const c10::BFloat16*>(s.ptr));
    default:
      return static_cast<T>(*static_cast<const float*>(s.ptr));
  }
}

// True when found_inf is given and nonzero: the step is skipped.
__device__ __forceinline__ bool skip_step(const DevScalar& found_inf) {
  return found_inf.ptr != nullptr && load_scalar<float>(found_inf) != 0.f;
}

// ---- multi-tensor launch ----------------------------------------------------------------
// One launch covers many tensors: block b works on elements [(b - block_begin) * kChunk,
// +kChunk) of the entry whose block range holds b (binary search over block_begin). The
// metadata travels in the kernel parameters (kept under the 4 KiB limit), so a launch needs
// no allocation or host-to-device copy and is CUDA-graph safe; lists longer than kMax
// entries take ceil(n / kMax) launches.

template <int NPTR>
struct Entry {
  void* ptr[NPTR];
  int64_t numel;
  int64_t cols;         // row length of a 2-D tensor (diagonal path), else unused
  int64_t block_begin;  // first block of this entry in its launch
  DevScalar scalar[2];  // per-tensor scalars (factor update a, b), else unused
  int32_t stream;       // position in the op's list (random-bit key)
  int32_t head;         // elements before the first vector-aligned one (0 .. width - 1)
  bool vec;             // vector access after the head (the pointers share one misalignment)
};

template <int NPTR>
struct Batch {
  static constexpr int kMax = 3072 / sizeof(Entry<NPTR>);
  Entry<NPTR> entry[kMax];
  int n = 0;
  int64_t blocks = 0;
};

// Entry index of this block.
template <int NPTR>
__device__ __forceinline__ int find_entry(const Batch<NPTR>& batch) {
  const int64_t block = blockIdx.x;
  int lo = 0;
  int hi = batch.n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.entry[mid].block_begin <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Calls launch(batch) for consecutive batches of the non-empty entries.
template <int NPTR, typename Launch>
void launch_batches(const std::vector<Entry<NPTR>>& entries, const Launch& launch) {
  Batch<NPTR> batch;
  for (Entry<NPTR> e : entries) {
    if (e.numel == 0) continue;
    e.block_begin = batch.blocks;
    batch.entry[batch.n++] = e;
    batch.blocks += ceil_div(e.numel, kChunk);
    if (batch.n == Batch<NPTR>::kMax) {
      launch(batch);
      batch = Batch<NPTR>{};
    }
  }
  if (batch.n > 0) launch(batch);
}

inline bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

// Vector access of `width` elements for the pointers with a nonzero element size in
// `elem_bytes` (null pointers are not accessed): every such pointer must sit at the same
// element offset modulo `width` from a vector boundary. Sets e.vec and e.head, the number
// of leading elements that take scalar access before the first whole vector.
template <int NPTR>
void set_vector_access(Entry<NPTR>& e, const std::array<int64_t, NPTR>& elem_bytes, int width) {
  int64_t residue = -1;
  e.vec = true;
  for (int j = 0; j < NPTR; ++j) {
    if (e.ptr[j] == nullptr || elem_bytes[j] == 0) continue;
    const auto address = reinterpret_cast<uintptr_t>(e.ptr[j]);
    const auto bytes = static_cast<uintptr_t>(elem_bytes[j]);
    if (address % bytes != 0) {
      e.vec = false;
      break;
    }
    const auto r = static_cast<int64_t>((address / bytes) % static_cast<uintptr_t>(width));
    if (residue >= 0 && r != residue) {
      e.vec = false;
      break;
    }
    residue = r;
  }
  e.head = e.vec && residue > 0 ? static_cast<int32_t>(width - residue) : 0;
}

// ---- vector access ------------------------------------------------------------------------

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <int V, typename T, typename A>
__device__ __forceinline__ void load(const T* p, int64_t i, A (&out)[V]) {
  const Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p + i);
#pragma unroll
  for (int v = 0; v < V; ++v) out[v] = static_cast<A>(pk.v[v]);
}

template <int V, typename T, typename A>
__device__ __forceinline__ void store(T* p, int64_t i, const A (&in)[V]) {
  Pack<T, V> pk;
#pragma unroll
  for (int v = 0; v < V; ++v) pk.v[v] = static_cast<T>(in[v]);
  *reinterpret_cast<Pack<T, V>*>(p + i) = pk;
}

// Parameter write of V elements starting at i, optionally stochastically rounded.
template <int V, typename P, typename A>
__device__ __forceinline__ void store_param(P* p, int64_t i, const A (&in)[V], bool stochastic,
                                            uint32_t key) {
  Pack<P, V> pk;
#pragma unroll
  for (int v = 0; v < V; ++v) pk.v[v] = singd::store_param<P>(in[v], stochastic, key, i + v);
  *reinterpret_cast<Pack<P, V>*>(p + i) = pk;
}

// Split of a block's chunk [begin, end) of an entry: scalar head [begin, vec_begin), whole
// vectors [vec_begin, vec_end), scalar tail [vec_end, end). Chunks start at multiples of
// kChunk (a multiple of V), so the entry's head offset puts vec_begin on a vector boundary.
struct ChunkSplit {
  int64_t vec_begin;
  int64_t vec_end;
};

template <int V>
__device__ __forceinline__ ChunkSplit split_chunk(bool vec, int64_t head, int64_t begin,
                                                  int64_t end) {
  if (!vec) return {end, end};
  const int64_t vb = min(begin + head, end);
  return {vb, vb + (end - vb) / V * V};
}

// f(std::integral_constant<int, W>, i) for the elements [i, i + W) of [begin, end) this
// thread owns: W = V for the aligned whole vectors (when `vec`), W = 1 for the head, the
// tail and everything when not `vec`.
template <int V, typename F>
__device__ __forceinline__ void for_chunk(bool vec, int64_t head, int64_t begin, int64_t end,
                                          const F& f) {
  const ChunkSplit s = split_chunk<V>(vec, head, begin, end);
  for (int64_t i = begin + threadIdx.x; i < s.vec_begin; i += blockDim.x) {
    f(std::integral_constant<int, 1>{}, i);
  }
  for (int64_t i = s.vec_begin + threadIdx.x * V; i < s.vec_end; i += blockDim.x * V) {
    f(std::integral_constant<int, V>{}, i);
  }
  for (int64_t i = s.vec_end + threadIdx.x; i < end; i += blockDim.x) {
    f(std::integral_constant<int, 1>{}, i);
  }
}

// ---- reductions -------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); valid in thread 0.
template <typename T>
__device__ __forceinline__ T block_sum(T v) {
  __shared__ T warp_totals[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  v = warp_sum(v);
  if (lane == 0) warp_totals[warp] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? warp_totals[lane] : T(0);
  if (warp == 0) v = warp_sum(v);
  return v;
}

// Multiprocessors of the current device (sizes the grids of the reductions), queried once
// per device.
inline int64_t sm_count() {
  static std::mutex mutex;
  static std::vector<int> counts;  // 0: not queried yet
  const int device = c10::cuda::current_device();
  const std::lock_guard<std::mutex> lock(mutex);
  if (counts.size() <= static_cast<size_t>(device)) counts.resize(device + 1, 0);
  if (counts[device] == 0) {
    C10_CUDA_CHECK(
        cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device));
  }
  return counts[device];
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace singd::cuda
