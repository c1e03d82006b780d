// ForwardStep (forward_step.h): reserve, compute, roll back on failure.
#include "engine/forward_step.h"

#include "base/check.h"
#ifdef PAGEKV_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif

#include <cstdio>
#include <string>
#include <unordered_set>
#include <vector>

namespace pagekv {
namespace {

// StepKv over a KvCache: item i's rows go to its sequence from the slot its
// reservation began at.
class CacheStepKv final : public StepKv {
 public:
  CacheStepKv(KvCache& cache, std::span<const ForwardItem> items, std::span<const int64_t> start,
              const StepFault* fault)
      : cache_(cache), items_(items), start_(start), fault_(fault), tables_(cache.slices() > 1 ? items.size() : 0) {}
  // A context slice's arena holds its slice of every block: the kernels
  // index it with its own layout and tables (KvCache::ArenaTable).
  const KvLayout& layout() const override { return cache_.arena_layout(); }
  const std::byte* arena() const override { return cache_.arena(); }
  Result<KvSpan> Store(size_t item, int32_t layer, const std::byte* k, const std::byte* v) override {
    const ForwardItem& it = items_[item];
    if (fault_ != nullptr && *fault_) PAGEKV_RETURN_IF_ERROR((*fault_)(item, layer));
    PAGEKV_RETURN_IF_ERROR(
        cache_.WriteLayer(it.seq, layer, start_[item], {static_cast<int64_t>(it.tokens.size()), k, v}));
    // A hybrid cache: the table of the layer's group (its block ids index
    // the same arena at the layer's offsets).
    PAGEKV_ASSIGN_OR_RETURN(const SequenceView view, cache_.View(it.seq, cache_.layout().group_of(layer)));
    if (tables_.empty()) return KvSpan{view.blocks, view.num_tokens, view.tail};
    std::vector<BlockId>& table = tables_[item];  // valid until this item's next Store
    ArenaTable(view.blocks, view.num_tokens, cache_.layout().block_len(), cache_.slices(), cache_.slice(), table);
    return KvSpan{table, view.num_tokens, view.tail};
  }

 private:
  KvCache& cache_;
  std::span<const ForwardItem> items_;
  std::span<const int64_t> start_;
  const StepFault* fault_;
  std::vector<std::vector<BlockId>> tables_;  // context slices: each item's arena table
};

}  // namespace

Result<bool> ForwardStep(const Model& model, KvCache& cache, std::span<const ForwardItem> items,
                         const ForwardOptions& options, const StepFault* fault, bool release_windows) {
  std::vector<int64_t> start;
  std::vector<StepItem> step;
  start.reserve(items.size());
  step.reserve(items.size());
  std::unordered_set<int64_t> seen;
  for (const ForwardItem& item : items) {
    if (!seen.insert(ToInt(item.seq)).second) {
      return InvalidArgumentError("sequence " + std::to_string(ToInt(item.seq)) +
                                  " appears twice in one step: give it one item with all its tokens");
    }
    PAGEKV_ASSIGN_OR_RETURN(const SequenceView before, cache.View(item.seq));
    start.push_back(before.num_tokens);
    // Positions continue past the tokens eviction dropped; slots do not.
    step.push_back({item.tokens, before.num_tokens + before.evicted, item.logits, item.all_logits, item.scores,
                    item.score_queries});
  }
  if (items.empty()) return true;
  PAGEKV_RETURN_IF_ERROR(model.CheckStep(step, cache.layout()));  // before anything changes
  // Ask before acting: when the step as a whole does not fit, return before
  // any reservation, so a full pool changes nothing (no prefix-cache block is
  // evicted for an item that then could not run). The sum is an upper bound:
  // a copy-on-write one item makes can only lower what the next needs.
  int64_t need = 0;
  for (const ForwardItem& item : items) {
    PAGEKV_ASSIGN_OR_RETURN(const AppendNeed n, cache.BlocksNeeded(item.seq, static_cast<int64_t>(item.tokens.size())));
    need += n.total();
  }
  Communicator* const tp = model.ranks();
  const bool sharded = tp != nullptr && tp->size() > 1;
  const bool fits = need <= cache.FreeBlockCount();
  if (!fits && !sharded) return false;
  // Rollback: every reservation undone exactly, the last first.
  std::vector<ReserveUndo> undos(items.size());
  auto undo = [&](size_t reserved) {
    for (size_t i = reserved; i > 0; --i) PAGEKV_CHECK(cache.Unreserve(undos[i - 1]).ok());
  };
  size_t reserved = 0;
  Status reserve_error;
  bool reserved_all = fits;
  for (size_t i = 0; reserved_all && i < items.size(); ++i) {
    Result<bool> fit = cache.Reserve(items[i].seq, static_cast<int64_t>(items[i].tokens.size()), &undos[i]);
    if (!fit.ok() || !*fit) {
      undo(i);  // all or nothing
      reserved_all = false;
      if (!fit.ok()) reserve_error = fit.status();
    } else {
      reserved = i + 1;
    }
  }
  if (sharded) {
    // Every rank must run this step on the same blocks (their collectives
    // meet inside Forward): a digest of what each decided, compared before
    // any rank computes. Ranks that differ all stop here, none hangs.
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](int64_t v) {
      for (int b = 0; b < 8; ++b) {
        h ^= static_cast<uint64_t>(v >> (8 * b)) & 0xff;
        h *= 1099511628211ull;
      }
    };
    mix(reserved_all ? 1 : 0);
    mix(static_cast<int64_t>(items.size()));
    for (size_t i = 0; i < items.size(); ++i) {
      mix(ToInt(items[i].seq));
      mix(start[i]);
      for (int32_t t : items[i].tokens) mix(t);
      for (int32_t g = 0; reserved_all && g < cache.layout().num_groups(); ++g) {
        PAGEKV_ASSIGN_OR_RETURN(const SequenceView view, cache.View(items[i].seq, g));
        for (BlockId b : view.blocks) mix(ToInt(b));
      }
    }
    Result<bool> same = tp->AllEqual(h);
    if (!same.ok() || !*same) {
      if (reserved_all) undo(reserved);
      return same.ok() ? InternalError("tensor parallel: the ranks' block tables differ at this step (rank " +
                                       std::to_string(tp->rank()) + " of " + std::to_string(tp->size()) +
                                       "): their schedulers saw different inputs; the step was not run")
                       : same.status();
    }
  }
  if (!reserve_error.ok()) return reserve_error;
  if (!reserved_all) return false;
  CacheStepKv kv(cache, items, start, fault);
  ForwardOptions run = options;
  if (run.backend == nullptr) run.backend = &cache.backend();  // the math where the pool lives
  // A decode step (one token per item, no attention weights wanted) makes
  // the same calls as the next one with new inputs: a device backend may
  // record it and replay it as a graph (CUDA graphs).
  const bool replayable = std::all_of(items.begin(), items.end(), [](const ForwardItem& item) {
    return item.tokens.size() == 1 && item.scores == nullptr;
  });
  if (replayable) run.backend->BeginReplayableStep();
  Status forward = model.Forward(step, kv, run);
  if (replayable) {
    Status ran = run.backend->EndReplayableStep();
    if (forward.ok()) forward = std::move(ran);
  }
  if (Status s = std::move(forward); !s.ok()) {
    undo(items.size());  // leave nothing half-written
    if (sharded) {
      // The other ranks may be waiting in a collective this rank will not
      // reach: end the job rather than hang it.
      std::fprintf(stderr, "pagekv: rank %d of %d: the forward pass failed: %s; aborting every rank\n", tp->rank(),
                   tp->size(), s.message().c_str());
      tp->Abort(3);
    }
    return s;
  }
  // Sliding groups give back what no later query's window reaches.
  if (release_windows && cache.layout().hybrid()) {
    for (const ForwardItem& item : items) PAGEKV_CHECK(cache.ReleaseOutOfWindow(item.seq).ok());
  }
  return true;
}

Result<bool> ForwardSequence(const Model& model, KvCache& cache, SeqId seq, std::span<const int32_t> tokens,
                             float* logits, const ForwardOptions& options) {
  const ForwardItem item{seq, tokens, logits, true};
  return ForwardStep(model, cache, {&item, 1}, options);
}

Result<std::unique_ptr<Backend>> MakeDeviceBackend(const std::string& device, DeviceChoices choices) {
  if (device.empty() || device == "cpu") {
    if (choices.tensor_cores) {
      return InvalidArgumentError("--tensor-cores selects the CUDA tensor-core attention kernels: use it with --device cuda");
    }
    if (choices.cuda_graphs) {
      return InvalidArgumentError("--cuda-graphs runs decode steps as CUDA graphs: use it with --device cuda");
    }
    return std::unique_ptr<Backend>();
  }
  int ordinal = 0;
  if (device != "cuda") {
    const std::string prefix = "cuda:";
    const std::string rest = device.rfind(prefix, 0) == 0 ? device.substr(prefix.size()) : std::string();
    if (rest.empty() || rest.size() > 4 || rest.find_first_not_of("0123456789") != std::string::npos) {
      return InvalidArgumentError("device '" + device + "' is not one of cpu, cuda, cuda:N");
    }
    ordinal = std::stoi(rest);
  }
#ifdef PAGEKV_HAVE_CUDA
  PAGEKV_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> cuda,
                          CudaBackend::Create({.device = ordinal, .tensor_core_prefill = choices.tensor_cores,
                                               .tensor_core_decode = choices.tensor_cores,
                                               .cuda_graphs = choices.cuda_graphs}));
  return std::unique_ptr<Backend>(std::move(cuda));
#else
  (void)ordinal;
  (void)choices;
  return UnavailableError("--device " + device +
                          ": this build of PageKV has no CUDA backend (no CUDA compiler was found when it was "
                          "configured): install the CUDA toolkit and rebuild, or use --device cpu");
#endif
}

}  // namespace pagekv
