// pagekv.Engine: the continuous-batching engine over a model file
// (pagekv/engine.h) from Python, and pagekv.generate (pagekv/generate.h, the
// library behind `pagekv generate`).
//
// The GIL: every call into the engine releases it (a step runs the model;
// Submit, Cancel, Metrics take the engine's lock, which the stepping thread
// holds while it reports tokens), and Python callbacks re-acquire it on the
// stepping thread. Without start(), the calls that wait (wait, generate,
// chat, a stream's next token) step the engine themselves, one Python
// thread at a time; after start() a background thread steps and they only
// wait. Ctrl-C while waiting cancels the request and raises
// KeyboardInterrupt.
#include "engine.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unordered_map.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <variant>

#include "config.h"
#include "engine_dicts.h"
#include "gil.h"
#include "errors.h"
#include "pagekv/dtype.h"
#include "pagekv/engine.h"
#include "pagekv/generate.h"
#include "pagekv/sampling.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace pagekv::python {
namespace {

// Whether the interpreter is gone or going (no GIL to take).
bool PythonGone() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() == 0 || Py_IsFinalizing() != 0;
#else
  return Py_IsInitialized() == 0 || _Py_IsFinalizing() != 0;
#endif
}

// Python objects held where they may be dropped without the GIL (a request's
// callback, destroyed by the engine on its stepping thread): takes the GIL
// to let go of them, and leaks them rather than touch a finalizing
// interpreter.
template <typename T>
void DropWithGil(T& obj) {
  if (!obj.is_valid()) return;
  if (PythonGone()) {
    (void)obj.release();
    return;
  }
  nb::gil_scoped_acquire gil;
  obj.reset();
}

// Where a request's updates go: a Python callable, a stream's queue, or both.
struct Watch {
  ~Watch() {
    DropWithGil(on_token);
    if (error) {
      if (PythonGone()) {
        (void)error.release();
      } else {
        nb::gil_scoped_acquire gil;
        error.reset();
      }
    }
  }
  nb::object on_token;  // None or a callable taking the update dict
  bool streaming = false;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<TokenUpdate> updates;  // streaming only
  std::unique_ptr<nb::python_error> error;  // what on_token raised (the request is then cancelled)
};

// The sampling and request keywords every generating call takes.
struct RequestArgs {
  int32_t max_tokens = 16;
  float temperature = 0, top_p = 1, repetition_penalty = 1, presence_penalty = 0, frequency_penalty = 0;
  int32_t top_k = 0;
  std::optional<std::unordered_map<int32_t, float>> logit_bias;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  int32_t priority = 0;
  std::optional<std::string> salt;
  bool logprobs = false;
  int32_t top_logits = 0;
  bool return_logits = false;
};

EngineRequest MakeRequest(std::vector<int32_t> prompt, const RequestArgs& a) {
  EngineRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = a.max_tokens;
  r.sampling.temperature = a.temperature;
  r.sampling.top_k = a.top_k;
  r.sampling.top_p = a.top_p;
  r.sampling.repetition_penalty = a.repetition_penalty;
  r.sampling.presence_penalty = a.presence_penalty;
  r.sampling.frequency_penalty = a.frequency_penalty;
  if (a.logit_bias) {
    for (const auto& [id, bias] : *a.logit_bias) r.sampling.logit_bias.emplace_back(id, bias);
    std::sort(r.sampling.logit_bias.begin(), r.sampling.logit_bias.end());
  }
  r.sampling.seed = a.seed;
  Check(ValidateSampling(r.sampling));
  r.stop = a.stop;
  r.ignore_eos = a.ignore_eos;
  r.priority = a.priority;
  r.extra.cache_salt = a.salt;
  r.logprobs = a.logprobs;
  r.top_logits = a.top_logits;
  r.return_logits = a.return_logits;
  return r;
}

using Prompt = std::variant<std::string, std::vector<int32_t>>;

nb::object Callback(std::optional<nb::callable> f) { return f ? nb::object(std::move(*f)) : nb::none(); }

// A reference to the engine held across a call that releases the GIL. The
// last one to go destroys the engine, with the GIL released: its destructor
// joins the stepping thread, which may be waiting for the GIL in a callback.
// (Copies are made and dropped with the GIL held, so use_count is stable.)
class EngineRef {
 public:
  explicit EngineRef(std::shared_ptr<Engine> p) : p_(std::move(p)) {}
  EngineRef(const EngineRef&) = delete;
  EngineRef& operator=(const EngineRef&) = delete;
  ~EngineRef() {
    if (p_.use_count() == 1) {
      nb::gil_scoped_release release;
      p_.reset();
    }
  }
  Engine& operator*() const { return *p_; }

 private:
  std::shared_ptr<Engine> p_;
};

}  // namespace

class PyEngine {
 public:
  explicit PyEngine(const EngineOptions& options) {
    engine_ = std::shared_ptr<Engine>(Take(Released([&] { return Engine::Create(options); })));
  }
  ~PyEngine() { Close(); }

  void Close() {
    if (!engine_) return;
    // Unfinished requests end as cancelled, their callbacks called (with
    // the GIL taken there).
    // Calls in flight on other threads (waiting, with the GIL released) hold
    // their own reference: the engine goes when the last of them returns.
    std::shared_ptr<Engine> e = std::move(engine_);
    Released([&] {
      e.reset();
      return 0;
    });
    std::lock_guard lock(watch_mu_);
    watches_.clear();
  }

  // For calls that keep the GIL (close() cannot run meanwhile).
  Engine& get() const {
    if (!engine_) Raise(Status(StatusCode::kFailedPrecondition, "engine: closed"));
    return *engine_;
  }
  // For calls that release the GIL while they use the engine: a reference
  // that keeps it alive should another thread close() it meanwhile.
  EngineRef Ref() const {
    if (!engine_) Raise(Status(StatusCode::kFailedPrecondition, "engine: closed"));
    return EngineRef(engine_);
  }

  std::vector<int32_t> Tokens(const Prompt& p) const {
    if (const auto* ids = std::get_if<std::vector<int32_t>>(&p)) return *ids;
    return get().Encode(std::get<std::string>(p));
  }

  RequestId Submit(std::vector<int32_t> prompt, const RequestArgs& a, nb::object on_token, bool streaming) {
    const EngineRef ref = Ref();
    Engine& e = *ref;
    EngineRequest r = MakeRequest(std::move(prompt), a);
    std::shared_ptr<Watch> w;
    if (!on_token.is_none() || streaming) {
      if (!on_token.is_none() && !PyCallable_Check(on_token.ptr())) RaiseInvalid("on_token: a callable is needed");
      w = std::make_shared<Watch>();
      w->on_token = std::move(on_token);
      w->streaming = streaming;
      Engine* engine = &e;
      r.on_update = [w, engine](const TokenUpdate& u) {
        if (w->on_token.is_valid() && !w->on_token.is_none()) {
          nb::gil_scoped_acquire gil;
          if (!w->error) {
            try {
              w->on_token(UpdateDict(u));
            } catch (nb::python_error& err) {
              w->error = std::make_unique<nb::python_error>(std::move(err));
              engine->Cancel(u.id);  // takes only the request lock, free while updates go out
            }
          }
        }
        if (w->streaming) {
          std::lock_guard lock(w->mu);
          w->updates.push_back(u);
          w->cv.notify_all();
        }
      };
    }
    const RequestId id = Take(Released([&] { return e.Submit(std::move(r)); }));
    if (w) {
      std::lock_guard lock(watch_mu_);
      watches_[id] = std::move(w);
    }
    return id;
  }

  // One step, from Python (one thread at a time): the background loop's job
  // when started.
  bool StepOnce() {
    const EngineRef ref = Ref();
    Engine& e = *ref;
    Result<bool> r = Released([&]() -> Result<bool> {
      std::lock_guard lock(step_mu_);
      return e.Step();
    });
    return Take(std::move(r));
  }

  bool started() const { return started_; }
  void Start() {
    const EngineRef ref = Ref();
    Engine& e = *ref;
    Released([&] {
      e.Start();
      return 0;
    });
    started_ = true;
  }
  void Stop() {
    const EngineRef ref = Ref();
    Engine& e = *ref;
    Released([&] {
      e.Stop();
      return 0;
    });
    started_ = false;
  }

  // Steps (or waits for the loop) until request id has finished; its
  // result. Ctrl-C (or any pending signal's exception) cancels the request,
  // waits for it to end, and raises.
  RequestResult Wait(RequestId id) {
    bool interrupted = false;
    for (;;) {
      if (!interrupted && PyErr_CheckSignals() != 0) {
        nb::python_error err;  // the pending exception, taken
        interrupted = true;
        Cancel(id);
        if (std::optional<RequestResult> r = Drive(id, false)) {
          try {
            (void)Finished(std::move(*r));
          } catch (nb::python_error&) {  // its callback's error: the interrupt wins
          }
        }
        throw err;
      }
      if (std::optional<RequestResult> r = Drive(id, true)) return Finished(std::move(*r));
    }
  }

  // One round of waiting for id: 100 ms of the loop's time when started,
  // else one step. The result when it has finished.
  std::optional<RequestResult> Drive(RequestId id, bool once) {
    const EngineRef ref = Ref();
    Engine& e = *ref;
    for (;;) {
      std::optional<RequestResult> r;
      if (started_) {
        r = Released([&] { return e.WaitFor(id, std::chrono::milliseconds(100)); });
      } else {
        r = Released([&] { return e.WaitFor(id, std::chrono::milliseconds(0)); });
        if (!r && !StepOnce()) {
          // Nothing to run now (a prefix loading from a lower tier).
          r = Released([&] { return e.WaitFor(id, std::chrono::milliseconds(1)); });
        }
      }
      if (r || once) return r;
    }
  }

  // The next update of a streamed request (stepping when not started);
  // nullopt once its finishing update has been returned.
  std::optional<TokenUpdate> Next(RequestId id) {
    std::shared_ptr<Watch> w = WatchOf(id);
    if (!w) return std::nullopt;
    for (;;) {
      {
        std::lock_guard lock(w->mu);
        if (!w->updates.empty()) {
          TokenUpdate u = std::move(w->updates.front());
          w->updates.pop_front();
          return u;
        }
      }
      if (PyErr_CheckSignals() != 0) {
        nb::python_error err;
        Cancel(id);  // the stream's owner takes the result when it is dropped
        throw err;
      }
      if (started_) {
        Released([&] {
          std::unique_lock lock(w->mu);
          w->cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return !w->updates.empty(); });
          return 0;
        });
      } else if (!StepOnce()) {
        Released([] {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          return 0;
        });
      }
    }
  }

  bool Cancel(RequestId id) {
    const EngineRef ref = Ref();
    Engine& e = *ref;
    return Released([&] { return e.Cancel(id); });
  }

  // The request's callback error, if any, raised (after its result is taken).
  RequestResult Finished(RequestResult r) {
    std::shared_ptr<Watch> w;
    {
      std::lock_guard lock(watch_mu_);
      auto it = watches_.find(r.id);
      if (it != watches_.end()) {
        w = std::move(it->second);
        watches_.erase(it);
      }
    }
    if (w && w->error) {
      std::unique_ptr<nb::python_error> err = std::move(w->error);
      throw nb::python_error(std::move(*err));
    }
    return r;
  }

  std::shared_ptr<Watch> WatchOf(RequestId id) {
    std::lock_guard lock(watch_mu_);
    auto it = watches_.find(id);
    return it == watches_.end() ? nullptr : it->second;
  }

 private:
  std::shared_ptr<Engine> engine_;  // changed only with the GIL held
  std::mutex step_mu_;
  bool started_ = false;
  std::mutex watch_mu_;
  std::unordered_map<RequestId, std::shared_ptr<Watch>> watches_;
};

namespace {

// An iterator over one request's updates (Engine.stream).
class PyStream {
 public:
  PyStream(PyEngine& engine, RequestId id) : engine_(&engine), id_(id) {}
  // Moved into its Python object: the source no longer owns the request.
  PyStream(PyStream&& o) noexcept
      : engine_(std::exchange(o.engine_, nullptr)), id_(o.id_), done_(o.done_), result_(std::move(o.result_)) {}
  PyStream& operator=(PyStream&&) = delete;
  ~PyStream() {
    if (!done_ && engine_ != nullptr) {
      // Abandoned: cancel it and take its result so the engine forgets it.
      try {
        engine_->Cancel(id_);
        (void)engine_->Wait(id_);
      } catch (...) {  // closed engine, or a callback's error: nobody to tell
      }
    }
  }
  RequestId id() const { return id_; }
  nb::dict Next() {
    if (done_) throw nb::stop_iteration();
    std::optional<TokenUpdate> u = engine_->Next(id_);
    if (!u) {
      done_ = true;
      throw nb::stop_iteration();
    }
    if (u->finish != FinishReason::kNone) {
      done_ = true;
      result_ = ResultDict(engine_->Wait(id_));
    }
    return UpdateDict(*u);
  }
  nb::object result() const { return result_.is_valid() ? nb::object(result_) : nb::none(); }
  bool Cancel() { return !done_ && engine_->Cancel(id_); }

 private:
  PyEngine* engine_;  // kept alive by the Python object (keep_alive)
  RequestId id_;
  bool done_ = false;
  nb::dict result_;
};

#define PAGEKV_REQUEST_ARGS                                                                                       \
  nb::kw_only(), "max_tokens"_a = 16, "temperature"_a = 0.0f, "top_k"_a = 0, "top_p"_a = 1.0f,                   \
      "repetition_penalty"_a = 1.0f, "presence_penalty"_a = 0.0f, "frequency_penalty"_a = 0.0f,                   \
      "logit_bias"_a = nb::none(), "seed"_a = nb::none(), "stop"_a = std::vector<std::string>{},                  \
      "ignore_eos"_a = false, "priority"_a = 0, "salt"_a = nb::none(), "logprobs"_a = false, "top_logits"_a = 0, \
      "return_logits"_a = false

#define PAGEKV_REQUEST_PARAMS                                                                                    \
  int32_t max_tokens, float temperature, int32_t top_k, float top_p, float repetition_penalty,                   \
      float presence_penalty, float frequency_penalty, std::optional<std::unordered_map<int32_t, float>> logit_bias, \
      std::optional<uint64_t> seed, std::vector<std::string> stop, bool ignore_eos, int32_t priority,             \
      std::optional<std::string> salt, bool logprobs, int32_t top_logits, bool return_logits

#define PAGEKV_REQUEST_VALUES                                                                                     \
  RequestArgs {                                                                                                  \
    max_tokens, temperature, top_p, repetition_penalty, presence_penalty, frequency_penalty, top_k,             \
        std::move(logit_bias), seed, std::move(stop), ignore_eos, priority, std::move(salt), logprobs, top_logits, \
        return_logits                                                                                            \
  }

std::string MessagesJson(nb::handle messages) {
  if (nb::isinstance<nb::str>(messages)) return nb::cast<std::string>(messages);
  nb::object dumps = nb::module_::import_("json").attr("dumps");
  try {
    return nb::cast<std::string>(dumps(messages));
  } catch (nb::python_error& e) {
    RaiseInvalid(std::string("messages: not JSON-serialisable (a list of {\"role\", \"content\"} dicts is needed): ") +
                 e.what());
  }
}

DType ParseKvDtype(const std::string& name) { return Take(ParseDType(name)); }

TierOptions TiersFromDict(const std::optional<nb::dict>& d) {
  TierOptions o;
  if (!d) return o;
  for (auto [k, v] : *d) {
    const std::string key = nb::cast<std::string>(k);
    if (key == "host_bytes") {
      o.host_bytes = ToBytes(nb::cast<ByteSize>(v), "tiers.host_bytes");
    } else if (key == "disk_path") {
      o.disk_path = nb::cast<std::string>(v);
    } else if (key == "disk_bytes") {
      o.disk_bytes = ToBytes(nb::cast<ByteSize>(v), "tiers.disk_bytes");
    } else if (key == "disk_direct_io") {
      o.disk_direct_io = nb::cast<bool>(v);
    } else if (key == "redis_url") {
      o.redis_url = nb::cast<std::string>(v);
    } else if (key == "redis_password") {
      o.redis_password = nb::cast<std::string>(v);
    } else if (key == "redis_namespace") {
      o.redis_namespace = nb::cast<std::string>(v);
    } else if (key == "redis_ttl_seconds") {
      o.redis_ttl_seconds = nb::cast<int64_t>(v);
    } else if (key == "write_through") {
      o.write_through = nb::cast<bool>(v);
    } else if (key == "payload_key") {
      o.payload_key = nb::cast<std::string>(v);
    } else if (key == "workers") {
      o.workers = nb::cast<int>(v);
    } else {
      RaiseInvalid("tiers: unknown key \"" + key +
                   "\" (host_bytes, disk_path, disk_bytes, disk_direct_io, redis_url, redis_password, "
                   "redis_namespace, redis_ttl_seconds, write_through, payload_key, workers)");
    }
  }
  return o;
}

}  // namespace

void BindEngine(nb::module_& m) {
  nb::class_<PyStream>(m, "TokenStream",
                       "The updates of one request as they are made (Engine.stream): dicts {id, token, text,\n"
                       "finish}; the last has finish set, and `result` then holds the request's result.\n"
                       "Dropping it unfinished cancels the request.")
      .def("__iter__", [](nb::handle self) { return self; })
      .def("__next__", &PyStream::Next)
      .def_prop_ro("id", &PyStream::id)
      .def_prop_ro("result", &PyStream::result, "The finished request's result dict (None before the end).")
      .def("cancel", &PyStream::Cancel, "Ends the request as cancelled (its last update says so).");

  nb::class_<PyEngine>(
      m, "Engine",
      "Continuous batching over the paged cache with a model file (GGUF, or llama2.c .bin with\n"
      "tokenizer=): submit requests from any thread, stream their tokens, cancel them, read metrics.\n"
      "Without start(), wait / generate / chat / streams step the engine themselves; start() runs a\n"
      "background stepping thread. Calls release the GIL; callbacks re-acquire it on the stepping thread.")
      .def(
          "__init__",
          [](PyEngine* self, const std::string& model, std::optional<std::string> tokenizer, int32_t block_len,
             const std::string& kv_dtype, const std::string& kv_layer_dtypes, int64_t num_blocks,
             std::optional<ByteSize> kv_budget, int64_t max_step_tokens, int32_t max_running, int64_t watermark_blocks,
             int64_t max_queue, const std::string& allocator, bool prefix_cache, int threads,
             const std::string& chat_template, std::optional<nb::dict> tiers, bool background_tier_moves,
             const std::string& device, bool exact_products, bool tensor_cores, bool cuda_graphs) {
            EngineOptions o;
            o.model_path = model;
            o.tokenizer_path = tokenizer.value_or("");
            o.block_len = block_len;
            o.kv_dtype = ParseKvDtype(kv_dtype);
            o.kv_layer_dtypes = kv_layer_dtypes;
            o.num_blocks = num_blocks;
            if (kv_budget) o.kv_budget_bytes = ToBytes(*kv_budget, "kv_budget");
            o.max_step_tokens = max_step_tokens;
            o.max_running = max_running;
            o.watermark_blocks = watermark_blocks;
            o.max_queue = max_queue;
            if (allocator == "paged") {
              o.allocator = Allocator::kPaged;
            } else if (allocator == "contiguous") {
              o.allocator = Allocator::kContiguous;
            } else {
              RaiseInvalid("allocator \"" + allocator + "\": \"paged\" or \"contiguous\"");
            }
            o.prefix_cache = prefix_cache;
            o.threads = threads;
            o.chat_template = chat_template;
            o.tiers = TiersFromDict(tiers);
            o.background_tier_moves = background_tier_moves;
            o.device = device;
            o.exact_products = exact_products;
            o.tensor_cores = tensor_cores;
            o.cuda_graphs = cuda_graphs;
            new (self) PyEngine(o);
          },
          "model"_a, nb::kw_only(), "tokenizer"_a = nb::none(), "block_len"_a = 16, "kv_dtype"_a = "f32",
          "kv_layer_dtypes"_a = "", "num_blocks"_a = 0, "kv_budget"_a = nb::none(), "max_step_tokens"_a = 256,
          "max_running"_a = 256, "watermark_blocks"_a = -1, "max_queue"_a = 1 << 20, "allocator"_a = "paged",
          "prefix_cache"_a = true, "threads"_a = 0, "chat_template"_a = "", "tiers"_a = nb::none(),
          "background_tier_moves"_a = true, "device"_a = "cpu", "exact_products"_a = false, "tensor_cores"_a = false,
          "cuda_graphs"_a = false,
          "Loads the model and allocates the pool: num_blocks, or as many as fit kv_budget (bytes or \"1GiB\"),\n"
          "or one full context. tiers: a dict of pagekv.Tiers' keywords (host_bytes, disk_path, disk_bytes,\n"
          "redis_url, payload_key, ...) for lower KV tiers under the prefix cache. device: \"cpu\", or\n"
          "\"cuda\" / \"cuda:N\" (the pool and the model on an NVIDIA GPU; UnavailableError without one).\n"
          "exact_products: f32 weight products throughout. tensor_cores: on a CUDA device, attention of f16 / bf16\n"
          "caches on the tensor cores; cuda_graphs: on a CUDA device, decode steps launched as CUDA graphs\n"
          "(neither is the default yet; each a ValueError without device=\"cuda\").")
      .def("close", &PyEngine::Close, "Stops the engine and frees its model and pool; unfinished requests are cancelled.")
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyEngine& e, nb::args) { e.Close(); })
      .def(
          "encode",
          [](const PyEngine& e, const std::string& text, std::optional<bool> add_special, bool parse_special) {
            if (!add_special) return e.get().Encode(text);
            return e.get().Encode(text, *add_special, parse_special);
          },
          "text"_a, "add_special"_a = nb::none(), "parse_special"_a = true,
          "Text to token ids: by default as a prompt (the model's BOS convention, special tokens written in\n"
          "the text parsed); add_special=False: no BOS / EOS.")
      .def("decode", [](const PyEngine& e, const std::vector<int32_t>& tokens) { return e.get().Detokenize(tokens); },
           "tokens"_a, "Token ids to text, from the start of a sequence.")
      .def("token_piece", [](const PyEngine& e, int32_t token) { return nb::bytes(e.get().TokenPiece(token).data(), e.get().TokenPiece(token).size()); },
           "token"_a, "One token's bytes (a byte-level piece may be part of a UTF-8 character).")
      .def(
          "render_chat",
          [](const PyEngine& e, nb::handle messages, bool add_generation_prompt) {
            return Take(e.get().RenderChat(MessagesJson(messages), add_generation_prompt));
          },
          "messages"_a, "add_generation_prompt"_a = true,
          "The conversation (a list of {\"role\", \"content\"} dicts, or its JSON) through the chat template.")
      .def(
          "encode_chat",
          [](const PyEngine& e, nb::handle messages, bool add_generation_prompt, nb::handle tools) {
            return Take(e.get().EncodeChat(MessagesJson(messages), add_generation_prompt,
                                           tools.is_none() ? std::string() : MessagesJson(tools)));
          },
          "messages"_a, "add_generation_prompt"_a = true, "tools"_a = nb::none(),
          "The conversation rendered and encoded as a prompt.")
      .def_prop_ro("context_len", [](const PyEngine& e) { return e.get().context_len(); })
      .def_prop_ro("vocab_size", [](const PyEngine& e) { return e.get().vocab_size(); })
      .def_prop_ro("eos_id", [](const PyEngine& e) { return e.get().eos_id(); })
      .def_prop_ro("stop_tokens", [](const PyEngine& e) { return e.get().stop_tokens(); })
      .def_prop_ro("chat_template_name", [](const PyEngine& e) { return e.get().chat_template_name(); })
      .def(
          "submit",
          [](PyEngine& e, const Prompt& prompt, PAGEKV_REQUEST_PARAMS, std::optional<nb::callable> on_token) {
            return e.Submit(e.Tokens(prompt), PAGEKV_REQUEST_VALUES, Callback(std::move(on_token)), false);
          },
          "prompt"_a, PAGEKV_REQUEST_ARGS, "on_token"_a = nb::none(),
          "Queues a request (prompt: text, or token ids); returns its id. on_token(update) is called on the\n"
          "stepping thread for each update (a dict {id, token, text, finish}); an exception it raises cancels\n"
          "the request and is raised again by wait(). temperature 0 is greedy; seed makes sampling\n"
          "reproducible; salt: a tenant's prefix-cache salt.")
      .def(
          "stream",
          [](PyEngine& e, const Prompt& prompt, PAGEKV_REQUEST_PARAMS) {
            const RequestId id = e.Submit(e.Tokens(prompt), PAGEKV_REQUEST_VALUES, nb::none(), true);
            return PyStream(e, id);
          },
          "prompt"_a, PAGEKV_REQUEST_ARGS, nb::keep_alive<0, 1>(),
          "Submits and returns an iterator over the request's updates as they are made.")
      .def("cancel", &PyEngine::Cancel, "id"_a,
           "Ends a request (waiting or running) as cancelled; False when unknown or already finished.")
      .def("wait", [](PyEngine& e, RequestId id) { return ResultDict(e.Wait(id)); }, "id"_a,
           "Blocks (stepping the engine unless started) until the request finishes: its result dict\n"
           "{id, tokens, text, finish, prompt_tokens, cached_prompt_tokens, timings, ...}; forgets it.")
      .def(
          "generate",
          [](PyEngine& e, const Prompt& prompt, PAGEKV_REQUEST_PARAMS, std::optional<nb::callable> on_token) {
            const RequestId id = e.Submit(e.Tokens(prompt), PAGEKV_REQUEST_VALUES, Callback(std::move(on_token)), false);
            return ResultDict(e.Wait(id));
          },
          "prompt"_a, PAGEKV_REQUEST_ARGS, "on_token"_a = nb::none(),
          "submit + wait: one completion, its result dict (text in result[\"text\"]).")
      .def(
          "chat",
          [](PyEngine& e, nb::handle messages, PAGEKV_REQUEST_PARAMS, std::optional<nb::callable> on_token) {
            std::vector<int32_t> ids = Take(e.get().EncodeChat(MessagesJson(messages), true));
            const RequestId id = e.Submit(std::move(ids), PAGEKV_REQUEST_VALUES, Callback(std::move(on_token)), false);
            return ResultDict(e.Wait(id));
          },
          "messages"_a, PAGEKV_REQUEST_ARGS, "on_token"_a = nb::none(),
          "The assistant's next message for a conversation (a list of {\"role\", \"content\"} dicts), rendered\n"
          "with the model's chat template; ends at the template's end-of-turn token.")
      .def("step", &PyEngine::StepOnce, "One engine step; False when there was nothing to do.")
      .def(
          "run_until_idle",
          [](PyEngine& e) {
            const EngineRef ref = e.Ref();
            Engine& g = *ref;
            Check(Released([&] { return g.RunUntilIdle(); }));
          },
          "Steps until every submitted request has finished (not with start()).")
      .def("start", &PyEngine::Start, "A background thread steps whenever there is work.")
      .def("stop", &PyEngine::Stop, "Stops the background thread (requests stay queued).")
      .def_prop_ro("started", &PyEngine::started)
      .def("metrics", [](PyEngine& e) {
             const EngineRef ref = e.Ref();
            Engine& g = *ref;
             return MetricsDict(Released([&] { return g.Metrics(); }));
           },
           "The pool, the queue, the prefix cache and timings, as a dict.")
      .def("reset_prefix_cache", [](PyEngine& e) {
             const EngineRef ref = e.Ref();
            Engine& g = *ref;
             Check(Released([&] { return g.ResetPrefixCache(); }));
           },
           "Drops every prefix-cache key of the pool (running requests keep their blocks).")
      .def("drain_tiers", [](PyEngine& e) {
             const EngineRef ref = e.Ref();
            Engine& g = *ref;
             Released([&] {
               g.DrainTiers();
               return 0;
             });
           },
           "Waits until the KV tiers have written every block queued for them.");

  m.def(
      "generate",
      [](const std::string& model, std::variant<std::string, std::vector<std::string>> prompts,
         std::optional<std::string> tokenizer, int32_t max_tokens, bool stop_at_eos, bool chat,
         const std::string& chat_template, const std::string& system, float temperature, int32_t top_k, float top_p,
         float repetition_penalty, std::optional<uint64_t> seed, int32_t block_len, const std::string& kv_dtype,
         const std::string& kv_layer_dtypes, int64_t num_blocks, int threads, bool truncate_prompts,
         bool prefix_cache, std::optional<std::string> salt, int32_t top_logits,
         std::optional<std::function<void(size_t, std::string)>> on_token, const std::string& device,
         bool exact_products, bool tensor_cores, bool cuda_graphs) {
        GenerateOptions o;
        o.model_path = model;
        o.tokenizer_path = tokenizer.value_or("");
        if (const auto* one = std::get_if<std::string>(&prompts)) {
          o.prompts = {*one};
        } else {
          o.prompts = std::get<std::vector<std::string>>(prompts);
        }
        o.max_new_tokens = max_tokens;
        o.stop_at_eos = stop_at_eos;
        o.chat = chat || !system.empty();
        o.chat_template = chat_template;
        o.system_prompt = system;
        o.sampling.temperature = temperature;
        o.sampling.top_k = top_k;
        o.sampling.top_p = top_p;
        o.sampling.repetition_penalty = repetition_penalty;
        o.sampling.seed = seed;
        o.block_len = block_len;
        o.kv_dtype = ParseKvDtype(kv_dtype);
        o.kv_layer_dtypes = kv_layer_dtypes;
        o.num_blocks = num_blocks;
        o.threads = threads;
        o.truncate_prompts = truncate_prompts;
        o.prefix_cache = prefix_cache || salt.has_value();
        o.extra_keys.cache_salt = salt;
        o.top_logits = top_logits;
        o.device = device;
        o.exact_products = exact_products;
        o.tensor_cores = tensor_cores;
        o.cuda_graphs = cuda_graphs;
        // nanobind's std::function wrapper takes the GIL to call Python; an
        // exception there is kept (Generate goes on without the callback)
        // and raised when it returns.
        auto error = std::make_shared<std::unique_ptr<nb::python_error>>();
        if (on_token) {
          o.on_token = [f = std::move(*on_token), error](size_t i, const std::string& text) {
            if (*error) return;
            try {
              f(i, text);
            } catch (nb::python_error& e) {
              nb::gil_scoped_acquire gil;
              *error = std::make_unique<nb::python_error>(std::move(e));
            }
          };
        }
        Result<GenerateReport> done = Released([&] { return Generate(o); });
        o.on_token = nullptr;  // drops the callable (the GIL is held here)
        if (*error) throw nb::python_error(std::move(**error));
        GenerateReport report = Take(std::move(done));
        nb::list outs;
        for (GenerateOutput& g : report.outputs) {
          nb::dict d;
          d["prompt"] = g.prompt;
          d["prompt_ids"] = g.prompt_ids;
          d["generated_ids"] = g.generated_ids;
          d["text"] = g.text;
          d["completion"] = g.completion;
          d["stopped"] = g.stopped;
          if (!g.step_top.empty()) {
            nb::list steps;
            for (const auto& step : g.step_top) {
              nb::list top;
              for (const auto& [id, logit] : step) top.append(nb::make_tuple(id, logit));
              steps.append(top);
            }
            d["top_logits"] = steps;
          }
          outs.append(d);
        }
        nb::dict r;
        r["outputs"] = outs;
        r["stats"] = GenerateStatsDict(report.stats);
        return r;
      },
      "model"_a, "prompts"_a, nb::kw_only(), "tokenizer"_a = nb::none(), "max_tokens"_a = 64,
      "stop_at_eos"_a = false, "chat"_a = false, "chat_template"_a = "", "system"_a = "", "temperature"_a = 0.0f,
      "top_k"_a = 0, "top_p"_a = 1.0f, "repetition_penalty"_a = 1.0f, "seed"_a = nb::none(), "block_len"_a = 16,
      "kv_dtype"_a = "f32", "kv_layer_dtypes"_a = "", "num_blocks"_a = 0, "threads"_a = 0,
      "truncate_prompts"_a = false, "prefix_cache"_a = false, "salt"_a = nb::none(), "top_logits"_a = 0,
      "on_token"_a = nb::none(), "device"_a = "cpu", "exact_products"_a = false, "tensor_cores"_a = false,
          "cuda_graphs"_a = false,
      "`pagekv generate` as a function: loads the model, generates every prompt as one batch (their\n"
      "common prefix computed once and forked), and returns {outputs: [{prompt, prompt_ids,\n"
      "generated_ids, text, completion, stopped}], stats}. Prompt i samples with seed + i, as the CLI.\n"
      "on_token(prompt index, text) is called as tokens are made.");
}

}  // namespace pagekv::python
