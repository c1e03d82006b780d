// RedisCluster (redis_cluster.h): real nodes, joined and changed with the
// real redis-cli.
#include "testing/redis_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <sstream>
#include <thread>

namespace pagekv::testing {
namespace {

using Clock = std::chrono::steady_clock;

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

std::string FindCli() {
  if (const char* path = std::getenv("PATH")) {
    std::stringstream ss(path);
    for (std::string dir; std::getline(ss, dir, ':');) {
      const std::string p = dir + "/redis-cli";
      if (::access(p.c_str(), X_OK) == 0) return p;
    }
  }
  return ::access("/usr/bin/redis-cli", X_OK) == 0 ? "/usr/bin/redis-cli" : "";
}

Result<Reply> Call(int port, const std::vector<std::string>& argv) {
  const timeval tv{5, 0};
  redisContext* c = redisConnectWithTimeout("127.0.0.1", port, tv);
  if (c == nullptr || c->err != 0) {
    if (c != nullptr) redisFree(c);
    return UnavailableError("cannot connect to redis on port " + std::to_string(port));
  }
  redisSetTimeout(c, tv);
  std::vector<const char*> args;
  std::vector<size_t> lens;
  for (const std::string& a : argv) {
    args.push_back(a.data());
    lens.push_back(a.size());
  }
  Reply r(static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(args.size()), args.data(), lens.data())));
  redisFree(c);
  if (!r) return UnavailableError("no reply from redis on port " + std::to_string(port));
  return r;
}

void Flatten(const redisReply* r, std::string& out) {
  switch (r->type) {
    case REDIS_REPLY_STRING:
    case REDIS_REPLY_STATUS: out.append(r->str, r->len); break;
    case REDIS_REPLY_ERROR: out.append(r->str, r->len); break;
    case REDIS_REPLY_INTEGER: out += std::to_string(r->integer); break;
    case REDIS_REPLY_NIL: out += "nil"; break;
    case REDIS_REPLY_ARRAY:
      for (size_t i = 0; i < r->elements; ++i) {
        Flatten(r->element[i], out);
        if (i + 1 < r->elements) out += "\n";
      }
      break;
    default: break;
  }
}

bool PortFree(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return free;
}

// A port p for a cluster node: p and its bus port p + 10000 both free, below
// the kernel's ephemeral range (so no outgoing connection takes them
// meanwhile), spread by process so parallel tests rarely meet.
int NodePort() {
  static int next = 20000 + static_cast<int>(::getpid() % 500) * 16;
  for (int tries = 0; tries < 10000; ++tries) {
    const int p = next;
    next = next + 1 >= 30000 ? 20000 : next + 1;
    if (PortFree(p) && PortFree(p + 10000)) return p;
  }
  return 0;
}

}  // namespace

RedisCluster::~RedisCluster() = default;  // each RedisServer kills its node and removes its directory

Status RedisCluster::Start(int primaries, int replicas, int node_timeout_ms) {
  if (!servers_.empty()) return FailedPreconditionError("the cluster is already started");
  if (FindCli().empty()) {
    return NotFoundError("redis-cli is not installed: install the Debian package redis-tools (scripts/install-deps.sh does)");
  }
  replicas_ = replicas;
  extra_args_ = "--cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout " +
                std::to_string(node_timeout_ms) + " --cluster-require-full-coverage no";
  std::vector<std::string> create = {"--cluster", "create"};
  for (int i = 0; i < primaries * (1 + replicas); ++i) {
    servers_.push_back(std::make_unique<RedisServer>());
    servers_.back()->UsePort(NodePort());
    PAGEKV_RETURN_IF_ERROR(servers_.back()->Start(extra_args_));
    create.push_back("127.0.0.1:" + std::to_string(servers_.back()->port()));
  }
  create.push_back("--cluster-replicas");
  create.push_back(std::to_string(replicas));
  create.push_back("--cluster-yes");
  PAGEKV_RETURN_IF_ERROR(RunCli(create));
  return WaitUntilStable(30000);
}

std::string RedisCluster::nodes() const {
  std::string out;
  for (const auto& s : servers_) {
    if (!s->running()) continue;
    if (!out.empty()) out += ",";
    out += "127.0.0.1:" + std::to_string(s->port());
  }
  return out;
}

Result<std::string> RedisCluster::Command(int node, const std::vector<std::string>& argv) const {
  PAGEKV_ASSIGN_OR_RETURN(Reply r, Call(port(node), argv));
  std::string out;
  Flatten(r.get(), out);
  return out;
}

Result<std::string> RedisCluster::Id(int node) const { return Command(node, {"CLUSTER", "MYID"}); }

Result<int> RedisCluster::PrimaryOf(int slot) const {
  for (int n = 0; n < size(); ++n) {
    if (!running(n)) continue;
    Result<Reply> r = Call(port(n), {"CLUSTER", "SLOTS"});
    if (!r.ok() || (*r)->type != REDIS_REPLY_ARRAY) continue;
    for (size_t k = 0; k < (*r)->elements; ++k) {
      const redisReply* range = (*r)->element[k];
      if (range->elements < 3 || range->element[0]->integer > slot || range->element[1]->integer < slot) continue;
      const auto p = static_cast<int>(range->element[2]->element[1]->integer);
      for (int i = 0; i < size(); ++i) {
        if (port(i) == p) return i;
      }
    }
    return NotFoundError("no node serves slot " + std::to_string(slot));
  }
  return UnavailableError("no node of the cluster answers");
}

Status RedisCluster::RunCli(const std::vector<std::string>& args) const {
  std::vector<std::string> argv = {FindCli()};
  argv.insert(argv.end(), args.begin(), args.end());
  const pid_t pid = ::fork();
  if (pid < 0) return UnavailableError("fork failed");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int null = ::open("/dev/null", O_RDWR);
    if (null >= 0) {
      ::dup2(null, 0);
      ::dup2(null, 1);
      ::dup2(null, 2);
    }
    std::vector<char*> a;
    for (std::string& s : argv) a.push_back(s.data());
    a.push_back(nullptr);
    ::execv(a[0], a.data());
    ::_exit(127);
  }
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return UnavailableError("redis-cli " + args[0] + " " + args[1] + " did not finish within 60 s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return UnavailableError("redis-cli " + args[0] + " " + args[1] + " failed (exit " +
                            std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) + ")");
  }
  return Status::Ok();
}

Status RedisCluster::WaitUntilStable(int timeout_ms) const {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  std::string why;
  while (Clock::now() < deadline) {
    bool ok = true;
    why.clear();
    for (int n = 0; n < size() && ok; ++n) {
      if (!running(n)) continue;
      Result<std::string> info = Command(n, {"CLUSTER", "INFO"});
      if (!info.ok() || info->find("cluster_state:ok") == std::string::npos ||
          info->find("cluster_slots_ok:16384") == std::string::npos) {
        ok = false;
        why = "node " + std::to_string(port(n)) + " does not serve every slot yet";
        break;
      }
      Result<std::string> role = Command(n, {"INFO", "replication"});
      if (!role.ok() || (role->find("role:slave") != std::string::npos &&
                         role->find("master_link_status:up") == std::string::npos)) {
        ok = false;
        why = "replica " + std::to_string(port(n)) + " is not in sync yet";
      }
    }
    // Every node agrees on the slots (redis-cli's own check).
    if (ok) {
      for (int n = 0; n < size(); ++n) {
        if (!running(n)) continue;
        if (RunCli({"--cluster", "check", "127.0.0.1:" + std::to_string(port(n))}).ok()) return Status::Ok();
        why = "the nodes do not agree on the slots yet";
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return UnavailableError("redis cluster: not stable within " + std::to_string(timeout_ms) + " ms: " + why);
}

Status RedisCluster::KillAndWaitForFailover(int node, int timeout_ms) {
  const int dead = port(node);
  servers_[static_cast<size_t>(node)]->Kill();
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < deadline) {
    bool promoted = true;
    for (int slot : {0, 5000, 10000, 16383}) {
      Result<int> p = PrimaryOf(slot);
      if (!p.ok() || port(*p) == dead) promoted = false;
    }
    if (promoted) {
      const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
      return WaitUntilStable(std::max(left, 1000));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return UnavailableError("redis cluster: no replica took over from port " + std::to_string(dead) + " within " +
                          std::to_string(timeout_ms) + " ms");
}

Result<int> RedisCluster::AddPrimary() {
  servers_.push_back(std::make_unique<RedisServer>());
  servers_.back()->UsePort(NodePort());
  PAGEKV_RETURN_IF_ERROR(servers_.back()->Start(extra_args_));
  const int added = size() - 1;
  int existing = -1;
  for (int n = 0; n < added && existing < 0; ++n) existing = running(n) ? n : -1;
  if (existing < 0) return UnavailableError("no running node to join");
  PAGEKV_RETURN_IF_ERROR(RunCli({"--cluster", "add-node", "127.0.0.1:" + std::to_string(port(added)),
                                 "127.0.0.1:" + std::to_string(port(existing))}));
  // Known to every node before anything moves to it.
  PAGEKV_RETURN_IF_ERROR(WaitUntilStable(30000));
  return added;
}

Status RedisCluster::Reshard(int from, int to, int slots) {
  PAGEKV_ASSIGN_OR_RETURN(std::string from_id, Id(from));
  PAGEKV_ASSIGN_OR_RETURN(std::string to_id, Id(to));
  PAGEKV_RETURN_IF_ERROR(RunCli({"--cluster", "reshard", "127.0.0.1:" + std::to_string(port(from)), "--cluster-from",
                                 from_id, "--cluster-to", to_id, "--cluster-slots", std::to_string(slots),
                                 "--cluster-yes"}));
  return WaitUntilStable(30000);
}

Status RedisCluster::BeginMigration(int slot, int from, int to, const std::vector<std::string>& keys) {
  PAGEKV_ASSIGN_OR_RETURN(std::string from_id, Id(from));
  PAGEKV_ASSIGN_OR_RETURN(std::string to_id, Id(to));
  const std::string s = std::to_string(slot);
  PAGEKV_ASSIGN_OR_RETURN(std::string a, Command(to, {"CLUSTER", "SETSLOT", s, "IMPORTING", from_id}));
  PAGEKV_ASSIGN_OR_RETURN(std::string b, Command(from, {"CLUSTER", "SETSLOT", s, "MIGRATING", to_id}));
  if (a != "OK" || b != "OK") return UnavailableError("CLUSTER SETSLOT refused: " + a + " / " + b);
  if (keys.empty()) return Status::Ok();
  std::vector<std::string> migrate = {"MIGRATE", "127.0.0.1", std::to_string(port(to)), "", "0", "5000", "KEYS"};
  migrate.insert(migrate.end(), keys.begin(), keys.end());
  PAGEKV_ASSIGN_OR_RETURN(std::string m, Command(from, migrate));
  if (m != "OK") return UnavailableError("MIGRATE refused: " + m);
  return Status::Ok();
}

Status RedisCluster::FinishMigration(int slot, int to) {
  PAGEKV_ASSIGN_OR_RETURN(std::string to_id, Id(to));
  for (int n = 0; n < size(); ++n) {
    if (!running(n)) continue;
    Result<std::string> role = Command(n, {"INFO", "replication"});
    if (!role.ok() || role->find("role:master") == std::string::npos) continue;
    PAGEKV_RETURN_IF_ERROR(Command(n, {"CLUSTER", "SETSLOT", std::to_string(slot), "NODE", to_id}).status());
  }
  return WaitUntilStable(30000);
}

Status RedisCluster::WaitForReplicas() {
  if (replicas_ == 0) return Status::Ok();
  for (int n = 0; n < size(); ++n) {
    if (!running(n)) continue;
    Result<std::string> role = Command(n, {"INFO", "replication"});
    if (!role.ok() || role->find("role:master") == std::string::npos || role->find("connected_slaves:0") != std::string::npos) {
      continue;
    }
    PAGEKV_ASSIGN_OR_RETURN(std::string acked, Command(n, {"WAIT", std::to_string(replicas_), "5000"}));
    if (std::atoi(acked.c_str()) < replicas_) {
      return UnavailableError("redis cluster: port " + std::to_string(port(n)) + "'s replicas acknowledged " + acked);
    }
  }
  return Status::Ok();
}

}  // namespace pagekv::testing
