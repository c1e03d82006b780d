// StepGraphs (see step_graphs.h): recording a step's operations, and
// running them as a kept graph, a new one, or one by one.
#include "cuda/step_graphs.h"

#include <algorithm>

namespace pagekv::cuda_backend_internal {

namespace {
constexpr size_t kAlign = 256;
constexpr size_t kFirstChunk = size_t{256} << 10;
}  // namespace

cudaError_t StepGraphs::Bump::Add(size_t bytes) {
  void* p = nullptr;
  const cudaError_t e = pinned ? cudaMallocHost(&p, bytes) : cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return e;
  }
  chunks.emplace_back(static_cast<std::byte*>(p), bytes);
  return cudaSuccess;
}

std::byte* StepGraphs::Bump::Take(size_t bytes) {
  size_t at_aligned = (at + kAlign - 1) / kAlign * kAlign;
  if (chunks.empty() || at_aligned + bytes > chunks.back().second) {
    const size_t want = std::max({bytes, kFirstChunk, chunks.empty() ? size_t{0} : 2 * chunks.back().second});
    if (Add(want) != cudaSuccess) return nullptr;
    at_aligned = 0;
  }
  at = at_aligned + bytes;
  return chunks.back().first + at_aligned;
}

cudaError_t StepGraphs::Bump::Settle() {
  at = 0;
  if (chunks.size() <= 1) return cudaSuccess;
  size_t total = 0;
  for (const auto& [p, size] : chunks) total += size;
  Free();
  return Add(total);
}

void StepGraphs::Bump::Free() {
  for (const auto& [p, size] : chunks) pinned ? cudaFreeHost(p) : cudaFree(p);
  chunks.clear();
  at = 0;
}

StepGraphs::~StepGraphs() {
  for (Graph& g : graphs_) {
    if (g.exec != nullptr) cudaGraphExecDestroy(g.exec);
  }
  for (void* p : retired_device_) cudaFree(p);
  for (auto& [p, size] : lanes_) cudaFree(p);
  host_.Free();
  device_.Free();
}

cudaError_t StepGraphs::Begin() {
  for (void* p : retired_device_) cudaFree(p);
  retired_device_.clear();
  ops_.clear();
  key_.clear();
  cudaError_t e = host_.Settle();
  if (const cudaError_t d = device_.Settle(); e == cudaSuccess) e = d;
  recording_ = e == cudaSuccess;
  return e;
}

void StepGraphs::Append(std::initializer_list<uint64_t> key, Op op) {
  key_.insert(key_.end(), key.begin(), key.end());
  key_.push_back(kEnd);
  ops_.push_back(std::move(op));
}

cudaError_t StepGraphs::Upload(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return cudaSuccess;
  std::byte* slot = host_.Take(bytes);
  if (slot == nullptr) return cudaErrorMemoryAllocation;
  std::copy_n(static_cast<const std::byte*>(src), bytes, slot);
  Append({0x75706c64 /* "upld" */, Key(dst), Key(slot), Key(bytes)}, [dst, slot, bytes](cudaStream_t s) {
    return cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, s);
  });
  return cudaSuccess;
}

void* StepGraphs::Device(size_t bytes) { return device_.Take(std::max<size_t>(bytes, 1)); }

void* StepGraphs::Lane(int lane, size_t bytes) {
  auto& [p, size] = lanes_[lane];
  if (size < bytes) {
    if (p != nullptr) retired_device_.push_back(p);
    p = nullptr;
    size = 0;
    const size_t want = std::max(bytes, bytes + bytes / 2);
    if (cudaMalloc(&p, want) != cudaSuccess) {
      cudaGetLastError();
      p = nullptr;
      return nullptr;
    }
    size = want;
  }
  return p;
}

cudaError_t StepGraphs::RunOps() {
  ++uncaptured_;
  for (const Op& op : ops_) {
    if (const cudaError_t e = op(stream_); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t StepGraphs::Flush() {
  if (!recording_) return cudaSuccess;
  recording_ = false;
  if (ops_.empty()) return cudaSuccess;
  cudaError_t e = cudaSuccess;
  auto kept = std::find_if(graphs_.begin(), graphs_.end(), [&](const Graph& g) { return g.key == key_; });
  if (kept != graphs_.end()) {
    kept->used = ++clock_;
    if (kept->exec == nullptr) {
      e = RunOps();
    } else {
      e = cudaGraphLaunch(kept->exec, stream_);
      ++launches_;
    }
  } else {
    // Capture. Relaxed: the backend's other calls this thread may make
    // meanwhile (none, under the lock) are not refused.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cudaError_t c = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed);
    if (c == cudaSuccess) {
      for (size_t i = 0; i < ops_.size() && c == cudaSuccess; ++i) c = ops_[i](stream_);
      const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
      if (c == cudaSuccess) c = end;
    }
    if (c == cudaSuccess && graph != nullptr) c = cudaGraphInstantiate(&exec, graph, 0);
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (c != cudaSuccess) {
      cudaGetLastError();
      if (exec != nullptr) cudaGraphExecDestroy(exec);
      exec = nullptr;
    }
    if (graphs_.size() == kGraphs) {
      auto oldest = std::min_element(graphs_.begin(), graphs_.end(),
                                     [](const Graph& a, const Graph& b) { return a.used < b.used; });
      if (oldest->exec != nullptr) cudaGraphExecDestroy(oldest->exec);
      graphs_.erase(oldest);
    }
    graphs_.push_back({key_, exec, ++clock_});
    if (exec != nullptr) {
      ++captures_;
      e = cudaGraphLaunch(exec, stream_);
      ++launches_;
    } else {
      e = RunOps();  // the operations' own error, if that was why
    }
  }
  ops_.clear();
  key_.clear();
  return e;
}

}  // namespace pagekv::cuda_backend_internal
