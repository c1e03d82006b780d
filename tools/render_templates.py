#!/usr/bin/env python3
"""Goldens for PageKV's chat-template renderer: every template in
tests/data/chat_templates rendered by jinja2 the way Hugging Face's
transformers renders chat templates (a sandboxed environment with
trim_blocks and lstrip_blocks, raise_exception, and a tojson filter that is
json.dumps with ensure_ascii=False), over a set of conversations.

    python3 tools/render_templates.py > tests/data/chat_templates/renders.json

A case whose rendering raises records the exception's message instead.
"""
import json
import os
import sys

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "chat_templates")

# template file -> (bos_token, eos_token)
TEMPLATES = {
    "smollm2.jinja": ("<|im_start|>", "<|im_end|>"),
    "llama-3.1.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama-3.2.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5.jinja": ("", "<|im_end|>"),
    "mistral-nemo.jinja": ("<s>", "</s>"),
    "gemma-2.jinja": ("<bos>", "<eos>"),
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}

CASES = [
    {"name": "one user turn", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"name": "system then user", "messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three planets."}]},
    {"name": "multi-turn", "messages": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a fun fact about octopuses."}]},
    {"name": "whitespace, quotes and unicode", "messages": [
        {"role": "user", "content": "  Caf\u00e9 \"quoted\" 'single' {braces} {{ not a tag }} \u65e5\u672c\u8a9e \U0001F600\n\n"}]},
    {"name": "ends with the assistant", "messages": [
        {"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "Yes."}],
     "add_generation_prompt": False},
    {"name": "system only", "messages": [{"role": "system", "content": "Be brief."}]},
    {"name": "not alternating", "messages": [
        {"role": "user", "content": "One."}, {"role": "user", "content": "Two."}]},
    {"name": "with tools", "tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": "What is the weather in Paris?"}]},
    {"name": "a tool call and its result", "tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call12345", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "call12345", "content": "{\"temperature\": 21.5, \"sky\": \"clear\"}"}]},
]


def render(template, bos, eos, case):
    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    variables = {"messages": case["messages"], "bos_token": bos, "eos_token": eos,
                 "add_generation_prompt": case.get("add_generation_prompt", True), "date_string": "01 Dec 2026"}
    if "tools" in case:
        variables["tools"] = case["tools"]
    return env.from_string(template).render(**variables)


def main():
    out = {"generator": "tools/render_templates.py (Jinja2 3.1.6, rendered as transformers does)",
           "variables": "messages, bos_token, eos_token, add_generation_prompt (true unless the case says), "
                        "date_string = '01 Dec 2026', tools when the case has them",
           "templates": []}
    for name, (bos, eos) in TEMPLATES.items():
        template = open(os.path.join(HERE, name), encoding="utf-8").read()
        entry = {"file": name, "bos_token": bos, "eos_token": eos, "cases": []}
        for case in CASES:
            c = dict(case)
            try:
                c["rendered"] = render(template, bos, eos, case)
            except TemplateError as e:
                c["error"] = str(e)
            entry["cases"].append(c)
        out["templates"].append(entry)
    json.dump(out, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
