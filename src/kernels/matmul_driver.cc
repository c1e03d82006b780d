// MatMul and MatMulShared (matmul.h): the calls' checks, X rounded once for
// the integer or AMX paths, and the rows of every output cut into chunks for
// the thread pool, each chunk through the dispatched kernels of matmul.cc.
#include <algorithm>
#include <span>
#include <vector>

#include "base/thread_pool.h"
#include "kernels/matmul_internal.h"

namespace pagekv {

bool IntActivationsAvailable() { return kernels::IntDot(); }

Status MatMul(const WeightMatrix& w, const float* x, int64_t tokens, float* y, int threads, Activations activations) {
  const MatMulOutput one{w, y};
  return MatMulShared({&one, 1}, x, tokens, threads, activations);
}

Status MatMulShared(std::span<const MatMulOutput> outputs, const float* x, int64_t tokens, int threads,
                    Activations activations) {
  if (x == nullptr) return InvalidArgumentError("matmul: null pointer");
  std::vector<kernels::MatMulTask> tasks;
  std::vector<int64_t> row_ends, first_chunk;  // per output; first_chunk has one more entry
  tasks.reserve(outputs.size());
  int64_t work = 0, chunks = 0;
  // Chunks of 32 rows (a few per thread at least) for load balance; panels
  // end on the padded row count (a multiple of the widest tile).
  // With the AMX tiles, chunks of kAmxMaxRows rows (X is streamed once per chunk).
  auto takes_amx = [&](const WeightMatrix& w) {
    return (w.panels || IsBlockQuantized(w.type)) && tokens >= kernels::AmxMinTokens(w.type);
  };
  bool amx_call = activations == Activations::kFast && !outputs.empty() && outputs[0].w.cols % 32 == 0 &&
                  kernels::AmxMatMulEnabled() && kernels::AmxTarget();
  if (amx_call) {
    bool any = false;
    for (const MatMulOutput& out : outputs) any = any || takes_amx(out.w);
    amx_call = any;
  }
  const int64_t kChunkRows = amx_call ? kernels::AmxRowsPerTask(outputs[0].w.cols) : kernels::kPanelPadRows;
  for (const MatMulOutput& out : outputs) {
    const WeightMatrix& w = out.w;
    if (w.data == nullptr || out.y == nullptr) return InvalidArgumentError("matmul: null pointer");
    if (w.rows <= 0 || w.cols <= 0 || tokens <= 0) {
      return InvalidArgumentError("matmul: rows, cols and tokens must be positive (got " + std::to_string(w.rows) +
                                  ", " + std::to_string(w.cols) + ", " + std::to_string(tokens) + ")");
    }
    const WeightFormat& f = FormatOf(w.type);
    if (w.cols % f.block_elems != 0) {
      return InvalidArgumentError("matmul: " + std::string(f.name) + " rows need a multiple of " +
                                  std::to_string(f.block_elems) + " columns, got " + std::to_string(w.cols));
    }
    if (w.panels && !kernels::PanelLayout(w.type)) {
      return InvalidArgumentError("matmul: " + std::string(f.name) + " weights are never in panels");
    }
    if (w.cols != outputs[0].w.cols) return InvalidArgumentError("matmul: products sharing X need the same column count");
    tasks.push_back({w, WeightRowBytes(w.type, w.cols), x, tokens, out.y});
    row_ends.push_back(w.panels ? (w.rows + kernels::kPanelPadRows - 1) / kernels::kPanelPadRows * kernels::kPanelPadRows : w.rows);
    first_chunk.push_back(chunks);
    chunks += (row_ends.back() + kChunkRows - 1) / kChunkRows;
    work += w.rows * w.cols * tokens;
  }
  first_chunk.push_back(chunks);
  // The integer path: X quantized once for every block-format product of the call.
  bool integer = activations == Activations::kFast && tokens <= kernels::kIntMaxTokens && outputs[0].w.cols % 32 == 0;
  if (integer) {
    integer = false;
    for (const kernels::MatMulTask& t : tasks) integer = integer || IsBlockQuantized(t.w.type);
    integer = integer && IntActivationsAvailable();
  }
  if (integer) {
    const int64_t cols = outputs[0].w.cols;
    thread_local std::vector<int16_t> xq;
    thread_local std::vector<float> xd, xs;
    xq.resize(static_cast<size_t>(tokens * cols));
    xd.resize(static_cast<size_t>(tokens * cols / 32));
    xs.resize(static_cast<size_t>(tokens * cols / 16));
    kernels::QuantizeQ16(x, tokens, cols, xq.data(), xd.data(), xs.data());
    for (kernels::MatMulTask& t : tasks) {
      if (!IsBlockQuantized(t.w.type)) continue;
      t.xq = xq.data();
      t.xd = xd.data();
      t.xs = xs.data();
    }
  }
  // AMX tiles for many tokens (amx_matmul.h): X split once for every
  // product of the call that takes them (panels, block formats).
  static_assert(kernels::AmxMinTokens(WeightType::kQ8_0) >= kernels::kDecodedPanelMinTokens);
  kernels::AmxActivations amx_x;
  if (amx_call) {
    {
      const int64_t cols = outputs[0].w.cols;
      amx_x = {nullptr, nullptr, tokens, kernels::AmxPaddedTokens(tokens), cols};
      thread_local std::vector<uint16_t> xhi, xlo;
      xhi.resize(static_cast<size_t>(amx_x.tokens_pad * cols));
      xlo.resize(xhi.size());
      // Split on the pool too (it reads X from memory once, at the memory's pace).
      const int64_t pieces = amx_x.tokens_pad / 32;
      uint16_t* const hi = xhi.data();  // this thread's buffers (inside the lambda the names are the worker's)
      uint16_t* const lo = xlo.data();
      auto split = [=](int64_t i) { kernels::AmxSplitActivations(x, tokens, cols, 32 * i, 32 * (i + 1), hi, lo); };
      if (threads == 1 || pieces == 1 || ThreadPool::Shared().RunningAlone()) {
        for (int64_t i = 0; i < pieces; ++i) split(i);
      } else {
        ThreadPool::Shared().ParallelFor(pieces, threads, split);
      }
      amx_x.hi = xhi.data();
      amx_x.lo = xlo.data();
      for (kernels::MatMulTask& t : tasks) {
        if (takes_amx(t.w)) t.amx = &amx_x;
      }
    }
  }
  auto run = [&](size_t o, int64_t begin, int64_t end) {
    end = std::min(end, row_ends[o]);
    if (tasks[o].w.panels) {
      kernels::PanelRange(tasks[o], begin, end);
    } else {
      kernels::RowRange(tasks[o], begin, end);
    }
  };
  // Below ~256 K multiply-adds a call is cheaper on one thread than the
  // hand-off to the pool.
  if (threads == 1 || work < (int64_t{1} << 18) || ThreadPool::Shared().RunningAlone()) {
    for (size_t o = 0; o < tasks.size(); ++o) run(o, 0, row_ends[o]);
    return Status::Ok();
  }
  ThreadPool::Shared().ParallelFor(chunks, threads, [&](int64_t i) {
    const auto o = static_cast<size_t>(std::upper_bound(first_chunk.begin(), first_chunk.end(), i) - first_chunk.begin() - 1);
    const int64_t begin = (i - first_chunk[o]) * kChunkRows;
    run(o, begin, begin + kChunkRows);
  });
  return Status::Ok();
}

}  // namespace pagekv
