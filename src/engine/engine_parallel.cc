// A leader engine's step inputs, sent to the engines of the other ranks of a
// split model (EngineOptions::parallel_leader): the new requests (ids,
// shared-group roles, every field that changes what is computed, seeds
// included), cancellations, a prefix-cache reset, or the stop; msgpack over
// the all-ranks communicator, size first.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine_state.h"

namespace pagekv {
namespace {

using json = nlohmann::json;

json RequestJson(const EngineRequest& r) {
  json s = {{"temperature", r.sampling.temperature},
            {"top_k", r.sampling.top_k},
            {"top_p", r.sampling.top_p},
            {"repetition_penalty", r.sampling.repetition_penalty},
            {"presence_penalty", r.sampling.presence_penalty},
            {"frequency_penalty", r.sampling.frequency_penalty},
            {"logit_bias", r.sampling.logit_bias}};
  if (r.sampling.seed) s["seed"] = *r.sampling.seed;
  json extra = {{"adapter_id", r.extra.adapter_id}, {"model_fingerprint", r.extra.model_fingerprint}, {"extra", r.extra.extra}};
  if (r.extra.cache_salt) extra["cache_salt"] = *r.extra.cache_salt;
  return {{"prompt", r.prompt},
          {"max_tokens", r.max_tokens},
          {"stop_at_tokens", r.stop_at_tokens},
          {"sampling", std::move(s)},
          {"stop", r.stop},
          {"ignore_eos", r.ignore_eos},
          {"priority", r.priority},
          {"extra", std::move(extra)},
          {"top_logits", r.top_logits},
          {"logprobs", r.logprobs},
          {"forced_tokens", r.forced_tokens},
          {"return_logits", r.return_logits},
          {"prompt_logits", r.prompt_logits}};
}

EngineRequest RequestFromJson(const json& j) {
  EngineRequest r;
  r.prompt = j.at("prompt").get<std::vector<int32_t>>();
  r.max_tokens = j.at("max_tokens").get<int32_t>();
  r.stop_at_tokens = j.at("stop_at_tokens").get<int32_t>();
  const json& s = j.at("sampling");
  r.sampling.temperature = s.at("temperature").get<float>();
  r.sampling.top_k = s.at("top_k").get<int32_t>();
  r.sampling.top_p = s.at("top_p").get<float>();
  r.sampling.repetition_penalty = s.at("repetition_penalty").get<float>();
  r.sampling.presence_penalty = s.at("presence_penalty").get<float>();
  r.sampling.frequency_penalty = s.at("frequency_penalty").get<float>();
  r.sampling.logit_bias = s.at("logit_bias").get<std::vector<std::pair<int32_t, float>>>();
  if (s.contains("seed")) r.sampling.seed = s.at("seed").get<uint64_t>();
  r.stop = j.at("stop").get<std::vector<std::string>>();
  r.ignore_eos = j.at("ignore_eos").get<bool>();
  r.priority = j.at("priority").get<int32_t>();
  const json& e = j.at("extra");
  r.extra.adapter_id = e.at("adapter_id").get<int64_t>();
  r.extra.model_fingerprint = e.at("model_fingerprint").get<std::string>();
  r.extra.extra = e.at("extra").get<std::vector<std::string>>();
  if (e.contains("cache_salt")) r.extra.cache_salt = e.at("cache_salt").get<std::string>();
  r.top_logits = j.at("top_logits").get<int32_t>();
  r.logprobs = j.at("logprobs").get<bool>();
  r.forced_tokens = j.at("forced_tokens").get<std::vector<int32_t>>();
  r.return_logits = j.at("return_logits").get<bool>();
  r.prompt_logits = j.at("prompt_logits").get<bool>();
  return r;
}

}  // namespace

Status Engine::State::SendInputs(bool reset, const std::vector<std::unique_ptr<Seq>>& fresh,
                                 const std::vector<RequestId>& cancel, bool stop) {
  json j = {{"stop", stop}, {"reset", reset}, {"cancel", cancel}, {"requests", json::array()}};
  for (const auto& s : fresh) {
    j["requests"].push_back({{"id", s->id},
                             {"awaiting_fork", s->awaiting_fork},
                             {"root", s->root},
                             {"members", s->members},
                             {"request", RequestJson(s->req)}});
  }
  std::vector<uint8_t> bytes = json::to_msgpack(j);
  Communicator& all = *o.parallel.all;
  auto size = static_cast<int64_t>(bytes.size());
  PAGEKV_RETURN_IF_ERROR(all.Broadcast(&size, sizeof size, 0));
  return all.Broadcast(bytes.data(), size, 0);
}

Status Engine::State::ReceiveInputs(bool& stop) {
  Communicator& all = *o.parallel.all;
  int64_t size = 0;
  PAGEKV_RETURN_IF_ERROR(all.Broadcast(&size, sizeof size, 0));
  if (size < 0 || size > (int64_t{1} << 34)) return InternalError("engine: the leader sent a step of " + std::to_string(size) + " bytes");
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  PAGEKV_RETURN_IF_ERROR(all.Broadcast(bytes.data(), size, 0));
  const json j = json::from_msgpack(bytes, true, false);
  if (j.is_discarded() || !j.is_object()) return InternalError("engine: the leader's step inputs do not decode");
  try {
    stop = j.at("stop").get<bool>();
    if (stop) return Status::Ok();
    std::lock_guard lock(mu);
    if (j.at("reset").get<bool>()) reset_requested = true;
    for (const json& r : j.at("requests")) {
      const auto id = r.at("id").get<RequestId>();
      if (id < next_id) return InternalError("engine: the leader sent request " + std::to_string(id) + " out of order");
      next_id = id;
      const RequestId got = EnqueueLocked(RequestFromJson(r.at("request")), r.at("awaiting_fork").get<bool>(), r.at("root").get<bool>());
      PAGEKV_CHECK(got == id);
      inbox.back()->members = r.at("members").get<std::vector<RequestId>>();
    }
    for (RequestId id : j.at("cancel").get<std::vector<RequestId>>()) cancels.push_back(id);
  } catch (const json::exception& e) {
    return InternalError(std::string("engine: the leader's step inputs are malformed: ") + e.what());
  }
  return Status::Ok();
}

}  // namespace pagekv
