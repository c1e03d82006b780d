// libFuzzer target: arbitrary bytes as a chat template (a GGUF file's
// tokenizer.chat_template or a --chat-template file, neither trusted),
// parsed, then rendered over a conversation with tools. Any crash, sanitizer
// report, leak, allocation past -malloc_limit_mb or run past -timeout is a
// bug: a hostile template must only ever give a Status, in bounded time and
// memory. Built in the asan build (clang); `make fuzz` runs it.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "jinja/jinja.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pagekv;
  static const jinja::Value kContext = *jinja::Value::FromJson(nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "You are terse."},
      {"role": "user", "content": "What is 2+2? <b>\u00e9\u4e2d\ud83d\ude00</b>"},
      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "c1",
        "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "4"},
      {"role": "assistant", "content": "4"},
      {"role": "user", "content": ["part", {"type": "text", "text": "more"}]}
    ],
    "tools": [{"type": "function", "function": {"name": "add", "description": "adds",
      "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "required": ["a", "b"]}}}],
    "add_generation_prompt": true,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "n": 3, "f": 0.5, "none": null, "flag": false
  })"));
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  Result<jinja::Template> t = jinja::Template::Parse(source);
  if (!t.ok()) return 0;
  (void)t->Render(kContext);
  return 0;
}
