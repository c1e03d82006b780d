// The whole public API of PageKV in one include.
//
//   status.h     Status / Result<T>: how every fallible call reports errors
//   ids.h        BlockId, SeqId strong ids
//   units.h      byte sizes: "24GiB" <-> int64
//   dtype.h      element types and KV storage formats
//   kv_layout.h  CacheConfig and the byte-exact arena layout
//   kv_cache.h   KvCache: block pool, block tables, the write path, reports
//   plan.h       the planner behind `pagekv plan`, model presets
//   attention.h  paged decode and prefill attention kernels
//   bench.h      benchmarks behind `pagekv bench`
//   generate.h   text generation with a llama model on the paged cache
#pragma once

#include "pagekv/attention.h"
#include "pagekv/bench.h"
#include "pagekv/dtype.h"
#include "pagekv/generate.h"
#include "pagekv/ids.h"
#include "pagekv/kv_cache.h"
#include "pagekv/kv_layout.h"
#include "pagekv/plan.h"
#include "pagekv/prefix_cache.h"
#include "pagekv/replay.h"
#include "pagekv/sampling.h"
#include "pagekv/server.h"
#include "pagekv/engine.h"
#include "pagekv/eval.h"
#include "pagekv/eviction.h"
#include "pagekv/status.h"
#include "pagekv/synth_model.h"
#include "pagekv/tiers.h"
#include "pagekv/units.h"
