// The chat-template renderer: every template in tests/data/chat_templates
// over every conversation, against what jinja2 rendered
// (tests/data/chat_templates/renders.json, by tools/render_templates.py);
// then the language's corners one at a time, each checked against the
// output jinja2 gives for it.
#include "jinja/jinja.h"

#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

namespace pagekv::jinja {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path << " is missing (tests run from the repository root)";
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(ChatTemplateTest, RealTemplatesRenderExactlyAsJinja2) {
  const auto goldens = nlohmann::ordered_json::parse(ReadFile("tests/data/chat_templates/renders.json"));
  int cases = 0, errors = 0;
  for (const auto& t : goldens["templates"]) {
    const std::string file = t["file"];
    Result<Template> tpl = Template::Parse(ReadFile("tests/data/chat_templates/" + file));
    ASSERT_TRUE(tpl.ok()) << file << ": " << tpl.status().message();
    for (const auto& c : t["cases"]) {
      nlohmann::ordered_json vars;
      vars["messages"] = c["messages"];
      vars["bos_token"] = t["bos_token"];
      vars["eos_token"] = t["eos_token"];
      vars["add_generation_prompt"] = c.value("add_generation_prompt", true);
      vars["date_string"] = "01 Dec 2026";
      if (c.contains("tools")) vars["tools"] = c["tools"];
      Result<std::string> out = tpl->Render(*Value::FromJson(vars));
      const std::string what = file + " / " + c["name"].get<std::string>();
      if (c.contains("error")) {
        ASSERT_FALSE(out.ok()) << what << " rendered, but jinja2 raised: " << c["error"];
        EXPECT_NE(out.status().message().find(c["error"].get<std::string>()), std::string::npos)
            << what << ": " << out.status().message();
        ++errors;
      } else {
        ASSERT_TRUE(out.ok()) << what << ": " << out.status().message();
        EXPECT_EQ(*out, c["rendered"].get<std::string>()) << what;
      }
      ++cases;
    }
  }
  EXPECT_EQ(cases, 54);
  EXPECT_GE(errors, 4);
}

std::string Render(const std::string& tpl, const nlohmann::ordered_json& vars = nlohmann::ordered_json::object()) {
  Result<Template> t = Template::Parse(tpl);
  if (!t.ok()) return "PARSE: " + t.status().message();
  Result<Value> context = Value::FromJson(vars);
  if (!context.ok()) return "CONTEXT: " + context.status().message();
  Result<std::string> out = t->Render(*context);
  return out.ok() ? *out : "ERROR: " + out.status().message();
}

// Each expectation is what jinja2 3.1.6 (trim_blocks, lstrip_blocks) renders.
TEST(ChatTemplateTest, ScopingFollowsJinja) {
  EXPECT_EQ(Render("{% for i in [1,2] %}{% if i == 2 %}{{ x }}{% endif %}{% set x = i %}{% endfor %}[{{x}}]"), "[]");
  EXPECT_EQ(Render("{% set x = 5 %}{% for i in [1,2] %}{{ x }}{% set x = i %}{% endfor %}[{{x}}]"), "55[5]");
  EXPECT_EQ(Render("{% if true %}{% set y = 3 %}{% endif %}{{ y }}"), "3");
  EXPECT_EQ(Render("{% set ns = namespace(a=1) %}{% for i in range(3) %}{% set ns.a = ns.a + i %}{% endfor %}{{ ns.a }}"), "4");
  EXPECT_EQ(Render("{% macro f(a, b=2) %}[{{a}}{{b}}]{% endmacro %}{{ f(1) }}{{ f(1, b=3) }}"), "[12][13]");
  EXPECT_EQ(Render("{% set t %}a{{ 1 }}b{% endset %}{{ t ~ t }}"), "a1ba1b");
}

TEST(ChatTemplateTest, WhitespaceControl) {
  EXPECT_EQ(Render("  {% if true %}\n  yes\n  {% endif %}\n  {{ 1 }}\n"), "  yes\n  1");
  EXPECT_EQ(Render("a  {%- if true -%}  b  {%- endif -%}  c"), "abc");
  EXPECT_EQ(Render("a\n  {%+ if true %}x{% endif %}"), "a\n  x");
  EXPECT_EQ(Render("a {{- ' b ' -}} c"), "a b c");
  EXPECT_EQ(Render("x{# a comment #}\ny"), "xy");
  EXPECT_EQ(Render("{% raw %}{{ not evaluated }}{% endraw %}"), "{{ not evaluated }}");
}

TEST(ChatTemplateTest, ValuesPrintAsPython) {
  EXPECT_EQ(Render("{{ none }} {{ true }} {{ 1.0 }} {{ [1, \"a\", none] }} {{ {\"a\": 1} }} {{ 1/2 }} {{ 7//2 }} "
                   "{{ -7 % 3 }} {{ 2**10 }} {{ 1e20 }} {{ 0.1+0.2 }}"),
            "None True 1.0 [1, 'a', None] {'a': 1} 0.5 3 2 1024 1e+20 0.30000000000000004");
  EXPECT_EQ(Render("{{ x.y }}", {{"x", nlohmann::ordered_json::object()}}), "");
  EXPECT_NE(Render("{{ x.y.z }}", {{"x", nlohmann::ordered_json::object()}}).find("ERROR"), std::string::npos);
  EXPECT_EQ(Render("{{ u }}|{{ u|length }}|{{ u ~ \"a\" }}|{{ u is defined }}|{{ not u }}"), "|0|a|False|True");
  EXPECT_EQ(Render("{{ \"abc\"[::-1] }} {{ [1,2,3][1:] }} {{ \"a,b\".split(\",\") }} {{ \"  x \".strip() }}"),
            "cba [2, 3] ['a', 'b'] x");
  EXPECT_EQ(Render("{{ \"x\" ~ 1 ~ none }} {{ 3 in [1,3] }} {{ \"b\" in \"abc\" }} {{ \"a\" in {\"a\":1} }}"),
            "x1None True True True");
  EXPECT_EQ(Render("{{ 1 if false }}|{{ \"a\" if true else \"b\" }}"), "|a");
  EXPECT_EQ(Render("{{ '\\u00e9\\n'|length }} {{ 'caf\xc3\xa9'[3] }} {{ 'x\\'y' }}"), "2 \xc3\xa9 x'y");
  EXPECT_EQ(Render("{{ [1,2,3,4,5][-2:] }} {{ [1,2,3,4,5][::2] }} {{ [1,2,3,4,5][4:1:-1] }} {{ \"abc\"[-1:] }} "
                   "{{ [1,2,3][10:] }} {{ [1,2,3][:-5] }} {{ [1,2,3,4,5][-1:-4:-2] }}"),
            "[4, 5] [1, 3, 5] [5, 4, 3] c [] [] [5, 3]");
  EXPECT_EQ(Render("{{ \"a b  c\".split() }} {{ \"a,b,,c\".split(\",\", 1) }} {{ \"a,b,c\".rsplit(\",\", 1) }} "
                   "{{ \"xxhixx\".strip(\"x\") }} {{ \"Hello World\".lower().startswith((\"he\", \"x\")) }}"),
            "['a', 'b', 'c'] ['a', 'b,,c'] ['a,b', 'c'] hi True");
  EXPECT_EQ(Render("{{ 10 / 4 }} {{ -7 // 2 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ 2 ** -1 }} {{ 3 * \"ab\" }} {{ [0] * 3 }} "
                   "{{ 1 == 1.0 }} {{ true + 1 }}"),
            "2.5 -4 3.0 0.5 0.5 ababab [0, 0, 0] True 2");
  EXPECT_EQ(Render("{{ [1,[2,3]]|tojson }}|{{ {\"a\":{}}|tojson(indent=2) }}|{{ []|tojson(indent=2) }}"),
            "[1, [2, 3]]|{\n  \"a\": {}\n}|[]");
  EXPECT_EQ(Render("{{ 1e-5 }} {{ 123456789012345678.0 }} {{ 1e16 }} {{ 0.1 }} {{ 100.0 }} {{ 3.14159 }}"),
            "1e-05 1.2345678901234568e+17 1e+16 0.1 100.0 3.14159");
}

TEST(ChatTemplateTest, FiltersAndLoops) {
  EXPECT_EQ(Render("{{ [3,1,2]|sort }} {{ {\"b\":1,\"a\":2}|dictsort }} {{ [1,2]|join(\"-\") }} {{ \"hello world\"|title }} "
                   "{{ \"Hello\"|capitalize }} {{ 3.7|int }} {{ \"4\"|int + 1 }} {{ 2.5|round }} {{ [1,2,1]|unique|list }}"),
            "[1, 2, 3] [['a', 2], ['b', 1]] 1-2 Hello World Hello 3 5 2.0 [1, 2]");
  EXPECT_EQ(Render("{% for a, b in [[1,2],[3,4]] %}{{a}}{{b}}{{loop.index}}{{loop.last}}{{loop.length}}{% endfor %}"),
            "121False2342True2");
  EXPECT_EQ(Render("{% for k, v in d.items() %}{{k}}={{v}};{% endfor %}{% for k in d %}{{k}}{% endfor %}",
                   {{"d", {{"z", 1}, {"a", 2}}}}),
            "z=1;a=2;za");
  EXPECT_EQ(Render("{% for x in [1,2,3,4] if x is even %}{{ x }}{{ loop.index }}{% else %}none{% endfor %}"), "2142");
  EXPECT_EQ(Render("{% for x in [] %}{{ x }}{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(Render("{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}"),
            "013");
  EXPECT_EQ(Render("{{ m|selectattr('role', 'equalto', 'user')|map(attribute='content')|join(',') }}",
                   {{"m", {{{"role", "user"}, {"content", "a"}}, {{"role", "bot"}, {"content", "b"}}, {{"role", "user"}, {"content", "c"}}}}}),
            "a,c");
  EXPECT_EQ(Render("{{ x|tojson }} {{ x|tojson(indent=2) }}", {{"x", {{"a", {1, 2.5, nullptr, true, "\xc3\xa9\""}}}}}),
            "{\"a\": [1, 2.5, null, true, \"\xc3\xa9\\\"\"]} {\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true,\n    \"\xc3\xa9\\\"\"\n  ]\n}");
  EXPECT_EQ(Render("{% filter upper %}ab{% endfilter %}"), "AB");
}

TEST(ChatTemplateTest, UnsupportedConstructsAndBadTemplatesAreNamed) {
  EXPECT_NE(Render("{% include 'x' %}").find("{% include %} is not supported"), std::string::npos);
  EXPECT_NE(Render("{{ x|nonesuch }}").find("the filter 'nonesuch' is not supported"), std::string::npos);
  EXPECT_NE(Render("{% if x %}").find("expected {% endif %}"), std::string::npos);
  EXPECT_NE(Render("{{ 'abc' }").find("unbalanced '}'"), std::string::npos);
  EXPECT_NE(Render("{{ 'abc'").find("never closed"), std::string::npos);
  EXPECT_NE(Render("{{ 'abc }}").find("a string is never closed"), std::string::npos);
  EXPECT_NE(Render("line\n{{ raise_exception('boom') }}").find("boom"), std::string::npos);
  EXPECT_NE(Render("{{ 1 + 'a' }}").find("unsupported operand"), std::string::npos);
  EXPECT_NE(Render("{% for x in none %}{% endfor %}").find("not iterable"), std::string::npos);
  EXPECT_NE(Render("{{ x is nonesuch }}").find("the test 'nonesuch'"), std::string::npos);
}

}  // namespace
}  // namespace pagekv::jinja

namespace pagekv::jinja {
namespace {

// Concatenation by appends (GCC 12 warns falsely, -Wrestrict, on chains of +).
std::string Cat(std::initializer_list<std::string_view> parts) {
  std::string out;
  for (std::string_view p : parts) out.append(p);
  return out;
}

// A chat template comes in the model file: as untrusted as a request. Each
// of these once overflowed the stack, ran for hours or asked for terabytes;
// each must now end at once with an error naming what it did.
TEST(ChatTemplateTest, HostileTemplatesEndWithANamedErrorNeverACrash) {
  auto repeat = [](std::string_view s, int n) {
    std::string out;
    for (int i = 0; i < n; ++i) out.append(s);
    return out;
  };
  const std::string chain = [&] {
    std::string s = "{{ 1";
    for (int i = 0; i < 100000; ++i) s.append(" + 1");
    s.append(" }}");
    return s;
  }();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {Cat({"{{ ", repeat("(", 100000), "1", repeat(")", 100000), " }}"}), "nested more than 128 levels deep"},
      {Cat({"{{ ", repeat("-", 100000), "1 }}"}), "nested more than 128 levels deep"},
      {Cat({"{{ ", repeat("not ", 100000), "1 }}"}), "nested more than 128 levels deep"},
      {Cat({"{{ ", repeat("1 if x else ", 100000), "1 }}"}), "nested more than 128 levels deep"},
      {Cat({repeat("{% if 1 %}", 50000), "x", repeat("{% endif %}", 50000)}), "nested more than 128 levels deep"},
      {chain, "an expression nested more than 256 levels deep"},
      {Cat({"{{ a", repeat(".b", 100000), " }}"}), "an expression nested more than 256 levels deep"},
      {"{% for a in range(1000000) %}{% for b in range(1000000) %}{% endfor %}{% endfor %}", "steps (a loop that does not end?"},
      {"{% macro m(n) %}{% for i in range(3) %}{{ m(n) }}{% endfor %}{% endmacro %}{{ m(1) }}", "nested"},
      {"{% set ns = namespace(x=1) %}{% set ns.x = ns %}{{ ns }}", "a namespace may not hold another (nor itself)"},
      {"{% set ns = namespace(x=1) %}{% set ns.x = [[ns]] %}", "a namespace may not hold another"},
      {"{% set a = namespace() %}{% set b = namespace(x=a) %}", "a namespace may not hold another"},
      {"{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
       "larger than 16 MiB"},
      {"{% set l = [0] * 1048576 %}{{ (l + [1])|length }}", "a list of more than 1048576 items"},
      {"{% set l = [0] * 1048577 %}", "a repetition too large"},
      {"{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}",
       "a value nested more than 256 levels deep"},
      {"{% set s = 'a' * 1000000 %}{{ s.replace('a', s) }}", "larger than 16 MiB"},
      {"{% set s = 'ab' * 4000000 %}{{ (s|list)|length }}", "more than 1048576 characters"},
      {"{% set s = ',' * 4000000 %}{{ s.split(',')|length }}", "more than 1048576 parts"},
      {"{% set l = ['x' * 1000000] * 16 %}{{ l|join('-' * 1000000) }}", "larger than 16 MiB"},
      {"{{ 'a\nb'|indent(100000000000) }}", "indent wider than 16 MiB"},
      {"{{ [[1]]|tojson(indent=1000000000) }}", "too wide"},
      {"{{ x.99999999999999999999999 }}", "the index 99999999999999999999999 is too large"},
      {"{% set s = 'x' * 10000000 %}{% for i in range(100000) %}{{ s[9999999] }}{% endfor %}", "steps"},
  };
  for (const auto& [tpl, want] : cases) {
    const std::string got = Render(tpl);
    EXPECT_NE(got.find(want), std::string::npos) << tpl.substr(0, 120) << " gave: " << got.substr(0, 300);
    EXPECT_TRUE(got.rfind("ERROR: ", 0) == 0 || got.rfind("PARSE: ", 0) == 0) << got.substr(0, 300);
  }
  // Namespaces print as a leaf and compare by identity (as Python's do), and
  // are no JSON.
  EXPECT_EQ(Render("{% set ns = namespace(a=1) %}{{ ns }} {{ [ns] }} {{ ns == ns }} {{ ns == namespace(a=1) }}"),
            "<Namespace> [<Namespace>] True False");
  EXPECT_NE(Render("{% set ns = namespace(a=1) %}{{ ns|tojson }}").find("not JSON serializable"), std::string::npos);
}

// What the limits leave: a long conversation with tools through a real
// template, and the deepest values and expressions allowed.
TEST(ChatTemplateTest, TheLimitsLeaveLongConversationsAndDeepValuesAlone) {
  Result<Template> tpl = Template::Parse(ReadFile("tests/data/chat_templates/qwen2.5.jinja"));
  ASSERT_TRUE(tpl.ok()) << tpl.status().message();
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  messages.push_back({{"role", "system"}, {"content", "You are terse."}});
  for (int i = 0; i < 4000; ++i) {
    messages.push_back({{"role", i % 2 == 0 ? "user" : "assistant"}, {"content", std::string(500, 'a' + i % 26)}});
  }
  nlohmann::ordered_json tools = nlohmann::ordered_json::array();
  for (int i = 0; i < 64; ++i) {
    tools.push_back({{"type", "function"},
                     {"function", {{"name", Cat({"f", std::to_string(i)})}, {"parameters", {{"type", "object"}}}}}});
  }
  nlohmann::ordered_json vars = {{"messages", messages}, {"tools", tools}, {"add_generation_prompt", true}};
  Result<Value> context = Value::FromJson(vars);
  ASSERT_TRUE(context.ok());
  Result<std::string> out = tpl->Render(*context);
  ASSERT_TRUE(out.ok()) << out.status().message();
  EXPECT_GT(out->size(), 4000u * 500u);

  const std::string deep = std::string(250, '[') + std::string(250, ']');
  EXPECT_EQ(Render("{{ x|length }}", {{"x", nlohmann::ordered_json::parse(deep)}}), "1");
  const std::string too_deep = std::string(300, '[') + std::string(300, ']');
  EXPECT_NE(Render("{{ x }}", {{"x", nlohmann::ordered_json::parse(too_deep)}}).find("CONTEXT: "), std::string::npos);
  std::string sum = "{{ 0";
  for (int i = 0; i < 200; ++i) sum.append(" + 1");
  sum.append(" }}");
  EXPECT_EQ(Render(sum), "200");
  EXPECT_EQ(Render(Cat({"{{ ", std::string(100, '('), "7", std::string(100, ')'), " }}"})), "7");
}

}  // namespace
}  // namespace pagekv::jinja
