// The engine's results as Python dicts (engine_dicts.cc): a streamed
// update, a finished request, the metrics, Generate's statistics.
#pragma once

#include <nanobind/nanobind.h>

#include "pagekv/engine.h"
#include "pagekv/generate.h"

namespace pagekv::python {

// {id, token (None at an end without one), text, finish (None or its name), logprobs?}
nanobind::dict UpdateDict(const TokenUpdate& u);
// {id, tokens, text, finish, error, prompt_tokens, cached_prompt_tokens,
// timings, logprobs?, top_logits?, logits? (NumPy), prompt_logits?}
nanobind::dict ResultDict(RequestResult r);
nanobind::dict MetricsDict(const EngineMetrics& m);
nanobind::dict GenerateStatsDict(const GenerateStats& s);

}  // namespace pagekv::python
