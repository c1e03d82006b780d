#!/usr/bin/env bash
# A local Redis Cluster on loopback for benchmarks and trials (tests start
# their own through src/testing/redis_cluster.cc):
#   scripts/redis-cluster.sh start [DIR] [FIRST_PORT]   3 primaries + 3 replicas on
#       127.0.0.1:FIRST_PORT..+5 (default 7100; bus ports +10000), data in DIR
#       (default build/redis-cluster); prints the nodes for --redis-cluster
#   scripts/redis-cluster.sh stop [DIR]
# cluster-require-full-coverage is off, as a cache tier wants it: while a
# failed primary's replica is being promoted, the other slots keep serving.
set -euo pipefail
cmd="${1:-start}"
dir="${2:-build/redis-cluster}"
first="${3:-7100}"
case "$cmd" in
  start)
    command -v redis-server >/dev/null && command -v redis-cli >/dev/null || {
      echo "redis-server and redis-cli are needed (apt-get install redis-server redis-tools; scripts/install-deps.sh does)" >&2
      exit 2
    }
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"  # redis-server resolves --logfile after --dir: give it absolute paths
    nodes=()
    for i in 0 1 2 3 4 5; do
      port=$((first + i))
      mkdir -p "$dir/$port"
      redis-server --port "$port" --bind 127.0.0.1 --dir "$dir/$port" --save "" --appendonly no --daemonize yes \
        --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 2000 \
        --cluster-require-full-coverage no \
        --logfile "$dir/$port/redis.log" --pidfile "$dir/$port/redis.pid" --maxmemory 512mb --maxmemory-policy allkeys-lru
      nodes+=("127.0.0.1:$port")
    done
    for n in "${nodes[@]}"; do
      until redis-cli -p "${n##*:}" ping >/dev/null 2>&1; do sleep 0.1; done
    done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >"$dir/create.log"
    until redis-cli -p "$first" cluster info | grep -q cluster_state:ok; do sleep 0.2; done
    (IFS=,; echo "${nodes[*]}")
    ;;
  stop)
    for pidfile in "$dir"/*/redis.pid; do
      [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    sleep 0.5
    rm -rf "$dir"
    ;;
  *)
    echo "usage: $0 start|stop [DIR] [FIRST_PORT]" >&2
    exit 2
    ;;
esac
