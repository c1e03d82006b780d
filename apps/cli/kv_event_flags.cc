#include "kv_event_flags.h"

namespace pagekv::cli {

void AddKvEventFlags(CLI::App* cmd, KvEventArgs& args) {
  KvEventsOptions& o = args.options;
  cmd->add_option("--kv-events-endpoint", o.endpoint,
                  "Publish prefix-cache KV events (vLLM's ZeroMQ/msgpack format) at tcp://HOST:PORT; implies the prefix cache");
  cmd->add_option("--kv-events-wait-ms", o.wait_ms, "Wait this long for a first subscriber (default 0)")
      ->check(CLI::Range(0, 600000));
  cmd->add_option("--kv-events-topic", o.topic, "The topic of every message (default kv@<instance>@<model>; '' for none)");
  cmd->add_option("--kv-events-instance", o.instance,
                  "This instance's name in the default topic (default <hostname>:<port> for serve, <hostname>:<pid> for generate)");
  cmd->add_option("--kv-events-hash", args.hash,
                  "Block hashes as vLLM's 64-bit integers (int, default) or the whole 32-byte key (bytes)")
      ->check(CLI::IsMember({"int", "bytes"}));
  cmd->add_option("--kv-events-replay-endpoint", o.replay_endpoint,
                  "Bind a ROUTER at tcp://HOST:PORT that resends missed batches from a sequence number (vLLM's replay)");
  cmd->add_option("--kv-events-buffer", o.buffer_batches, "Batches kept for replay (default 10000)")
      ->check(CLI::Range(int64_t{1}, int64_t{10000000}));
}

KvEventsOptions ToKvEventsOptions(const KvEventArgs& args) {
  KvEventsOptions o = args.options;
  o.hash_bytes = args.hash == "bytes";
  return o;
}

}  // namespace pagekv::cli
