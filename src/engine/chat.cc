// ChatTemplate (chat.h).
#include "engine/chat.h"

#include <algorithm>
#include <fstream>
#include <sstream>

namespace pagekv {
namespace {

struct BuiltInTemplate {
  const char* name;
  const char* source;
};

// Written for PageKV in the shape of each family's published template.
constexpr BuiltInTemplate kBuiltIns[] = {
    {"chatml",
     "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
     "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"},
    {"llama3",
     "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
     "+ message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
     "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"},
    {"llama2",
     "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}"
     "{% else %}{% set system = '' %}{% endif %}{% for message in messages %}{% if message['role'] == 'user' %}"
     "{{ bos_token + '[INST] ' }}{% if loop.first and system %}{{ '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' }}{% endif %}"
     "{{ message['content'] | trim + ' [/INST]' }}{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}"
     "{% endfor %}"},
    {"mistral",
     "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\\n\\n' %}{% set messages = messages[1:] %}"
     "{% else %}{% set system = '' %}{% endif %}{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
     "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}{% else %}"
     "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"},
    {"gemma",
     "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\\n\\n' %}{% set messages = messages[1:] %}"
     "{% else %}{% set system = '' %}{% endif %}{{ bos_token }}{% for message in messages %}"
     "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
     "{{ '<start_of_turn>' + role + '\\n' + (system if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}"
     "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"},
    {"phi3",
     "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}{% endfor %}"
     "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"},
    {"zephyr",
     "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
     "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"},
};

std::string BuiltInNames() {
  std::string out;
  for (const BuiltInTemplate& b : kBuiltIns) out += (out.empty() ? "" : ", ") + std::string(b.name);
  return out;
}

}  // namespace

const char* ChatTemplate::BuiltIn(std::string_view name) {
  for (const BuiltInTemplate& b : kBuiltIns) {
    if (name == b.name) return b.source;
  }
  return nullptr;
}

std::string ChatTemplate::FallbackTemplateName(std::string_view arch) {
  return arch.rfind("gemma", 0) == 0 ? "gemma" : "";
}

Result<ChatTemplate> ChatTemplate::Create(const std::string& source, const std::string& override_name,
                                          const Tokenizer& tokenizer, const GgufFile* file) {
  std::string text = source, name = "model";
  if (!override_name.empty()) {
    if (const char* b = BuiltIn(override_name)) {
      text = b;
      name = override_name;
    } else {
      std::ifstream in(override_name, std::ios::binary);
      if (!in) {
        return InvalidArgumentError("chat template '" + override_name + "' is neither a built-in (" + BuiltInNames() +
                                    ") nor a readable file");
      }
      std::stringstream ss;
      ss << in.rdbuf();
      text = ss.str();
      name = override_name;
    }
  }
  if (text.empty()) {
    return InvalidArgumentError("the model has no chat template (tokenizer.chat_template): pick one with "
                                "--chat-template NAME (" + BuiltInNames() + ") or a template file");
  }
  Result<jinja::Template> t = jinja::Template::Parse(text);
  if (!t.ok()) return InvalidArgumentError("chat template (" + name + "): " + t.status().message());
  ChatTemplate c;
  c.template_ = std::make_shared<const jinja::Template>(std::move(*t));
  c.tokenizer_ = &tokenizer;
  c.name_ = name;
  if (tokenizer.bos_id() >= 0) c.bos_ = tokenizer.piece(tokenizer.bos_id());
  c.eos_ = tokenizer.piece(tokenizer.eos_id());
  c.stop_tokens_ = StopTokens(tokenizer, file);
  return c;
}

Result<std::string> ChatTemplate::Render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                         const nlohmann::ordered_json& tools) const {
  if (!messages.is_array() || messages.empty() ||
      !std::all_of(messages.begin(), messages.end(), [](const auto& m) { return m.is_object(); })) {
    return InvalidArgumentError("chat: messages must be a non-empty array of objects");
  }
  nlohmann::ordered_json vars = {{"messages", messages}, {"bos_token", bos_}, {"eos_token", eos_},
                                 {"add_generation_prompt", add_generation_prompt}};
  if (!tools.is_null()) vars["tools"] = tools;
  Result<jinja::Value> context = jinja::Value::FromJson(vars);
  if (!context.ok()) return InvalidArgumentError("chat template (" + name_ + "): " + context.status().message());
  Result<std::string> out = template_->Render(*context);
  if (!out.ok()) return InvalidArgumentError("chat template (" + name_ + "): " + out.status().message());
  return out;
}

Result<std::vector<int32_t>> ChatTemplate::Encode(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                                  const nlohmann::ordered_json& tools) const {
  PAGEKV_ASSIGN_OR_RETURN(std::string text, Render(messages, add_generation_prompt, tools));
  return tokenizer_->Encode(text, /*bos=*/false, /*eos=*/false, /*parse_special=*/true);
}

}  // namespace pagekv
