// `pagekv demo`: the paged cache at work. A few hundred sequences of random
// lengths arrive, prefill, decode, fork (parallel samples sharing a prompt),
// roll back speculative tokens (truncate) and finish (free), all through one
// preallocated pool. Each phase prints utilization and fragmentation next to
// what a contiguous max-length reservation per sequence would have needed.
#include <algorithm>
#include <cstdio>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "commands.h"
#include "pagekv/pagekv.h"

namespace pagekv::cli {

struct DemoArgs {
  int64_t sequences = 300;
  int64_t max_len = 2048;
  int64_t block_len = 16;
  int64_t blocks = 2048;
  int64_t report_every = 250;
  uint32_t seed = 1;
};

namespace {

struct Live {
  SeqId id;
  int64_t target_len;  // finishes when it reaches this length
};

int RunDemo(const DemoArgs& a) {
  CacheConfig config;
  config.num_layers = 8;
  config.num_q_heads = 32;
  config.num_kv_heads = 8;
  config.head_dim = 64;
  config.block_len = static_cast<int32_t>(a.block_len);
  config.format = KvFormat::Plain(DType::kF16);
  config.num_blocks = a.blocks;
  if (a.sequences <= 0 || a.max_len < 32 || a.report_every <= 0) {
    std::fprintf(stderr, "error: --sequences and --report-every must be positive and --max-len at least 32\n");
    return kExitBadInput;
  }
  auto created = KvCache::Create({.config = config, .leak_sink = [](const std::string& r) {
                                    std::fprintf(stderr, "leak report at shutdown:\n%s", r.c_str());
                                  }});
  if (!created.ok()) {
    std::fprintf(stderr, "error: %s\n", created.status().message().c_str());
    return kExitBadInput;
  }
  KvCache& cache = **created;
  const KvLayout& l = cache.layout();
  std::printf("PageKV demo: %d layers x %d KV heads x %d dims, f16, block_len %d, %ld blocks (%s pool)\n",
              l.num_layers(), l.num_heads(), l.row_elems(), l.block_len(), l.num_blocks(),
              FormatBytes(l.total_bytes()).c_str());
  std::printf("%ld sequences: prompts of 16-%ld tokens, each generating up to %ld; 1 in 10 forks a second "
              "sample;\nevery 7th step drafts 4 speculative tokens and rolls back the rejected ones. The "
              "contiguous\nbaseline reserves %ld slots (max length) per sequence up front.\n\n",
              a.sequences, a.max_len / 2, a.max_len / 4, a.max_len);

  std::mt19937 rng(a.seed);
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  // One buffer of token rows, reused as the K and V payload of every append.
  const int64_t max_chunk = a.max_len;
  std::vector<uint8_t> rows(static_cast<size_t>(l.num_layers() * max_chunk * l.num_heads() * l.row_bytes()));
  for (auto& b : rows) b = static_cast<uint8_t>(rng());
  auto append = [&](SeqId id, int64_t n) { return *cache.Append(id, {n, rows.data(), rows.data()}); };

  std::deque<int64_t> waiting;  // prompt lengths not yet admitted
  for (int64_t i = 0; i < a.sequences; ++i) waiting.push_back(uniform(16, a.max_len / 2));
  std::vector<Live> live;
  int64_t step = 0, finished = 0, forks = 0, cows = 0, rollbacks = 0, stalls = 0, preemptions = 0;
  int64_t peak_paged = 0, peak_contig = 0, peak_live = 0;
  double frag_sum = 0, util_sum = 0;
  std::string busiest;  // the memory report at the step with the most live sequences
  int64_t samples = 0;

  std::printf("  %6s %6s %8s %9s %12s %12s %8s %6s\n", "step", "live", "tokens", "blocks", "paged",
              "contiguous", "frag", "util");
  while (!waiting.empty() || !live.empty()) {
    // Admit while the pool has room for the prompt plus a few decode blocks.
    while (!waiting.empty()) {
      const int64_t prompt = waiting.front();
      const SeqId id = cache.AddSequence(fmt::format("request-{}", a.sequences - static_cast<int64_t>(waiting.size())));
      const AppendNeed need = *cache.BlocksNeeded(id, prompt);
      // Watermark: keep a block of headroom per live sequence for its decode steps.
      if (need.total() + static_cast<int64_t>(live.size()) + 8 > cache.Stats().blocks_free || !append(id, prompt)) {
        (void)cache.Free(id);
        if (live.empty()) {
          std::fprintf(stderr, "error: a %ld-token prompt does not fit in %ld blocks of %ld tokens: raise --blocks\n",
                       prompt, a.blocks, a.block_len);
          return kExitBadInput;
        }
        break;
      }
      waiting.pop_front();
      const int64_t gen = uniform(1, a.max_len / 4);
      live.push_back({id, prompt + gen});
      if (uniform(0, 9) == 0) {  // parallel sampling: a second sample shares the prompt
        live.push_back({*cache.Fork(id, "sample"), prompt + uniform(1, a.max_len / 4)});
        ++forks;
      }
    }
    // One decode step for every live sequence; every 7th step a speculative
    // draft of 4 tokens of which a random number is rolled back.
    bool progressed = false;
    for (size_t i = 0; i < live.size();) {
      const SeqId id = live[i].id;
      const int64_t len = cache.View(id)->num_tokens;
      const bool speculate = step % 7 == 0;
      const int64_t n = speculate ? 4 : 1;
      if (cache.BlocksNeeded(id, n)->copy_on_write) ++cows;
      if (!append(id, n)) {
        ++stalls;  // pool full: this sequence waits a step
        ++i;
        continue;
      }
      progressed = true;
      if (speculate) {
        const int64_t keep = uniform(1, 4);
        if (keep < 4) ++rollbacks;
        (void)cache.Truncate(id, len + keep);
      }
      if (cache.View(id)->num_tokens >= live[i].target_len) {
        (void)cache.Free(id);
        live[i] = live.back();
        live.pop_back();
        ++finished;
        continue;
      }
      ++i;
    }
    if (!progressed && !live.empty()) {
      // Every sequence is waiting for a block: preempt the newest one (free
      // its blocks) and requeue it for recomputation, as a scheduler would.
      const Live victim = live.back();
      live.pop_back();
      waiting.push_front(std::min(cache.View(victim.id)->num_tokens, a.max_len / 2));
      (void)cache.Free(victim.id);
      ++preemptions;
    }
    const CacheStats st = cache.Stats();
    const int64_t contiguous = st.num_sequences * a.max_len * l.bytes_per_token();
    if (st.num_sequences > peak_live) busiest = cache.Memory().ToString();
    peak_paged = std::max(peak_paged, st.bytes_allocated);
    peak_contig = std::max(peak_contig, contiguous);
    peak_live = std::max(peak_live, st.num_sequences);
    if (st.blocks_used > 0) {
      frag_sum += st.internal_fragmentation;
      util_sum += st.utilization;
      ++samples;
    }
    if (step % a.report_every == 0) {
      std::printf("  %6ld %6ld %8ld %4ld/%-4ld %12s %12s %7.1f%% %5.0f%%\n", step, st.num_sequences,
                  st.tokens_logical, st.blocks_used, st.blocks_total, FormatBytes(st.bytes_allocated).c_str(),
                  FormatBytes(contiguous).c_str(), 100 * st.internal_fragmentation, 100 * st.utilization);
    }
    ++step;
  }

  std::printf("\n%ld sequences finished in %ld steps: %ld forks, %ld copy-on-write copies, %ld speculative "
              "rollbacks, %ld stalls on a full pool, %ld preemptions\n",
              finished, step, forks, cows, rollbacks, stalls, preemptions);
  std::printf("  peak live sequences            %ld\n", peak_live);
  std::printf("  peak paged allocation          %s\n", FormatBytes(peak_paged).c_str());
  std::printf("  contiguous max-length reserve  %s for the same live sequences (%.1fx the paged peak)\n",
              FormatBytes(peak_contig).c_str(),
              peak_paged ? static_cast<double>(peak_contig) / static_cast<double>(peak_paged) : 0.0);
  std::printf("  contiguous, same pool          %ld sequences of %ld slots fit at once; paged held up to %ld\n",
              l.total_bytes() / (a.max_len * l.bytes_per_token()), a.max_len, peak_live);
  std::printf("  mean internal fragmentation    %.2f%% of allocated bytes (partly filled last blocks)\n",
              samples ? 100 * frag_sum / static_cast<double>(samples) : 0.0);
  std::printf("  mean pool utilization          %.1f%%\n", samples ? 100 * util_sum / static_cast<double>(samples) : 0.0);
  std::printf("\nMemory at the busiest step (%ld live sequences):\n%s", peak_live, busiest.c_str());
  std::printf("Leak check: %s", cache.LeakReport().c_str());
  cache.CheckInvariants();
  return kExitOk;
}

}  // namespace

CLI::App* AddDemoCommand(CLI::App& app, int& exit_code) {
  static DemoArgs args;
  CLI::App* cmd = app.add_subcommand("demo", "Random sequences through the paged pool: utilization and fragmentation");
  cmd->add_option("--sequences", args.sequences, "Sequences to run (default 300)");
  cmd->add_option("--max-len", args.max_len, "Longest sequence; the contiguous baseline reserves this (default 2048)");
  cmd->add_option("--block-len", args.block_len, "Tokens per block (default 16)");
  cmd->add_option("--blocks", args.blocks, "Blocks in the pool (default 2048)")->check(CLI::Range(int64_t{1}, int64_t{1} << 31));
  cmd->add_option("--report-every", args.report_every, "Print a progress line every N steps (default 250)");
  cmd->add_option("--seed", args.seed, "Random seed (default 1)");
  cmd->callback([&exit_code] { exit_code = RunDemo(args); });
  return cmd;
}

}  // namespace pagekv::cli
