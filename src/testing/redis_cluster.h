// A real Redis Cluster for tests: primaries and replicas (redis-server
// --cluster-enabled yes, each a RedisServer on its own loopback port and
// temporary directory) joined by `redis-cli --cluster create`, with what
// tests need to change it while they run: kill a node and wait for its
// replica's promotion, add an empty primary, move slots with `redis-cli
// --cluster reshard`, or leave one slot half-migrated (ASK redirections).
//
// Thread safety: none; one test thread drives it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "pagekv/status.h"
#include "testing/redis_server.h"

namespace pagekv::testing {

class RedisCluster {
 public:
  RedisCluster() = default;
  ~RedisCluster();
  RedisCluster(const RedisCluster&) = delete;
  RedisCluster& operator=(const RedisCluster&) = delete;

  // Starts primaries * (1 + replicas) nodes, creates the cluster and waits
  // (up to 30 s) until every node reports cluster_state:ok and every
  // replica is in sync. node_timeout_ms: how long a silent primary takes to
  // be failed over (plus an election: about twice this in all).
  Status Start(int primaries = 3, int replicas = 1, int node_timeout_ms = 1000);

  // Every running node as host:port, comma-separated (the tier's seeds).
  std::string nodes() const;
  int size() const { return static_cast<int>(servers_.size()); }
  int port(int node) const { return servers_[static_cast<size_t>(node)]->port(); }
  bool running(int node) const { return servers_[static_cast<size_t>(node)]->running(); }

  // One command (argv) to one node; the reply flattened to text: a string,
  // an integer, "nil", an error as "ERR ...", an array's elements one per
  // line (nested arrays flattened).
  Result<std::string> Command(int node, const std::vector<std::string>& argv) const;
  // The node (index) that serves `slot` as a primary, asked of a running node.
  Result<int> PrimaryOf(int slot) const;
  Result<std::string> Id(int node) const;  // CLUSTER MYID

  // SIGKILL (a crash), then wait until the cluster serves every slot again
  // without it (a replica promoted), up to timeout_ms.
  Status KillAndWaitForFailover(int node, int timeout_ms = 20000);
  // Starts an empty primary and joins it (redis-cli --cluster add-node);
  // returns its index. It owns no slot until a reshard gives it some.
  Result<int> AddPrimary();
  // Moves `slots` slots and their keys from one primary to another
  // (redis-cli --cluster reshard), waiting until every node agrees.
  Status Reshard(int from, int to, int slots);
  // One slot half-migrated: `to` importing it, `from` migrating it, and
  // `keys` (which must hash to it) moved already, so the others stay on
  // `from` and requests for the moved ones get ASK. FinishMigration hands
  // the slot to `to` everywhere.
  Status BeginMigration(int slot, int from, int to, const std::vector<std::string>& keys);
  Status FinishMigration(int slot, int to);
  // WAIT for every replica of every primary to have the writes so far.
  Status WaitForReplicas();

 private:
  Status RunCli(const std::vector<std::string>& args) const;
  Status WaitUntilStable(int timeout_ms) const;
  std::vector<std::unique_ptr<RedisServer>> servers_;
  std::string extra_args_;
  int replicas_ = 0;
};

}  // namespace pagekv::testing
