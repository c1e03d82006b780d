"""`pagekv serve` through the official OpenAI Python SDK.

A real server process on a free loopback port with stories260K; the SDK
(tests/python/requirements.txt, pinned) talks to it as it would to
OpenAI. Run by CTest (tests/python/run.sh) with the binary's path in
PAGEKV_CLI, from the repository root.
"""
import json
import os
import signal
import threading
import time

import openai
import pytest

from pagekv_server import MODEL, MODEL_ID, Server


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


def test_completions_greedy_are_repeatable_and_report_usage(server):
    c = server.client()
    a = c.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=12, temperature=0)
    b = c.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert a.choices[0].text == b.choices[0].text != ""
    assert a.object == "text_completion" and a.model == MODEL_ID
    assert a.usage.completion_tokens == 12
    assert a.usage.total_tokens == a.usage.prompt_tokens + 12
    assert a.choices[0].finish_reason == "length"


def test_streaming_gives_the_same_text_as_one_answer(server):
    c = server.client()
    whole = c.completions.create(model=MODEL_ID, prompt="The little cat", max_tokens=16, temperature=0)
    parts = [x.choices[0].text for x in c.completions.create(
        model=MODEL_ID, prompt="The little cat", max_tokens=16, temperature=0, stream=True) if x.choices]
    assert "".join(parts) == whole.choices[0].text
    chat = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Lily and Ben"}],
                                     max_tokens=10, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    streamed = "".join(x.choices[0].delta.content or "" for x in c.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Lily and Ben"}], max_tokens=10, temperature=0,
        stream=True) if x.choices)
    assert streamed == chat.choices[0].message.content


def test_models_list_and_retrieve(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == [MODEL_ID]
    m = c.models.retrieve(MODEL_ID)
    assert m.id == MODEL_ID and m.object == "model" and m.owned_by == "pagekv"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-9")
    assert e.value.code == "model_not_found"
    # The id is a path segment: percent-escapes are decoded (every byte
    # escaped here), a '%' without two hex digits after it is a 400.
    escaped = "".join(f"%{b:02X}" for b in MODEL_ID.encode())
    status, body = server.get("/v1/models/" + escaped)
    assert status == 200 and json.loads(body)["id"] == MODEL_ID, body
    for bad in ("%zz", "%4", MODEL_ID + "%"):
        status, body = server.get("/v1/models/" + bad)
        assert status == 400, (bad, body)
        assert json.loads(body)["error"]["code"] == "invalid_request_error"


def test_errors_map_to_the_sdk_exceptions_with_openai_codes(server):
    c = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_ID, prompt="hi", max_tokens=-1)
    assert e.value.code == "invalid_request_error" and e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_ID, prompt="hi", max_tokens=100000)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_ID, prompt="x" * 200000, max_tokens=2)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_ID, prompt="hi", max_tokens=2, temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        c.with_options().get("/nope", cast_to=object)
    assert e.value.code == "not_found"


def test_a_wrong_key_is_an_authentication_error():
    s = Server("--api-key-env", "PAGEKV_SDK_TEST_KEYS", env={**os.environ, "PAGEKV_SDK_TEST_KEYS": "k1\nk2\n"})
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            s.client("wrong").completions.create(model=MODEL_ID, prompt="hi", max_tokens=2)
        assert e.value.code == "invalid_api_key"
        ok = s.client("k2").completions.create(model=MODEL_ID, prompt="hi", max_tokens=2)
        assert ok.usage.completion_tokens == 2
    finally:
        s.stop()


def test_health_is_503_while_the_server_drains():
    s = Server()
    try:
        assert s.get("/health") == (200, '{"status":"ok"}')
        started = threading.Event()

        def long_stream():
            c = s.client()
            try:
                for _ in c.completions.create(model=MODEL_ID, prompt="Once", max_tokens=1500,
                                              stream=True, extra_body={"ignore_eos": True}):
                    started.set()
            except Exception:
                pass

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(30)
        s.proc.send_signal(signal.SIGTERM)
        status = None
        for _ in range(50):  # the drain lasts while the stream runs (at most 5 s)
            status, body = s.get("/health")
            if status == 503:
                assert json.loads(body) == {"status": "draining"}
                break
            time.sleep(0.05)
        assert status == 503
        t.join(30)
        assert s.proc.wait(30) == 0
    finally:
        s.stop()


def test_content_parts_and_an_assistant_turn_without_content(server):
    c = server.client()
    plain = c.chat.completions.create(model=MODEL_ID, temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": "Tom had a red ball"}, {"role": "assistant", "content": ""},
        {"role": "user", "content": "The sun was"}])
    parts = c.chat.completions.create(model=MODEL_ID, temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Tom had "}, {"type": "text", "text": "a red ball"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "The sun was"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL_ID, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert e.value.param == "messages" and "image_url" in e.value.message
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL_ID, max_tokens=2, messages=[{"role": "user", "content": None}])


@pytest.mark.parametrize("field,value", [
    ("best_of", 3), ("suffix", " end")])
def test_unsupported_completion_parameters_are_refused_by_name(server, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL_ID, prompt="hi", max_tokens=2, **{field: value})
    assert e.value.param == field and e.value.code == "unsupported_parameter"


def test_unsupported_chat_parameters_are_refused_and_defaults_accepted(server):
    c = server.client()
    msgs = [{"role": "user", "content": "hi"}]
    for field, value in [("response_format", {"type": "json_object"})]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=2, **{field: value})
        assert e.value.param == field and e.value.code == "unsupported_parameter", field
    # The defaults of the same parameters change nothing and are accepted.
    ok = c.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=2, n=1, logprobs=False,
                                   presence_penalty=0, frequency_penalty=0, logit_bias={},
                                   response_format={"type": "text"}, user="tester")
    assert ok.usage.completion_tokens == 2
    # repetition_penalty (an extension) is applied: greedy text changes on a repetitive prompt.
    prompt = "the cat the cat the cat the cat the cat"
    base = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0)
    pen = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0,
                               extra_body={"repetition_penalty": 1.5})
    assert pen.choices[0].text != base.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_ID, prompt="hi", max_tokens=2, extra_body={"repetition_penalty": 0.5})
    assert e.value.param == "repetition_penalty"


def test_n_choices_several_prompts_and_echo(server):
    c = server.client()
    one = c.completions.create(model=MODEL_ID, prompt="Sara found a", max_tokens=10, temperature=0)
    two = c.completions.create(model=MODEL_ID, prompt="Sara found a", max_tokens=10, temperature=0, n=2)
    assert [x.index for x in two.choices] == [0, 1]
    assert [x.text for x in two.choices] == [one.choices[0].text] * 2
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert two.usage.completion_tokens == 20
    sampled = c.completions.create(model=MODEL_ID, prompt="Sara found a", max_tokens=16, temperature=1.0, seed=7, n=4)
    again = c.completions.create(model=MODEL_ID, prompt="Sara found a", max_tokens=16, temperature=1.0, seed=7, n=4)
    assert [x.text for x in sampled.choices] == [x.text for x in again.choices]  # seeded: reproducible
    assert len({x.text for x in sampled.choices}) > 1  # and the choices differ
    prompts = ["Once upon a time", "The little cat", "A big dog"]
    many = c.completions.create(model=MODEL_ID, prompt=prompts, max_tokens=8, temperature=0)
    alone = [c.completions.create(model=MODEL_ID, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in prompts]
    assert [x.text for x in many.choices] == alone
    assert many.usage.completion_tokens == 24
    grid = c.completions.create(model=MODEL_ID, prompt=prompts[:2], max_tokens=8, temperature=0, n=2)
    assert [x.text for x in grid.choices] == [alone[0], alone[0], alone[1], alone[1]]
    echoed = c.completions.create(model=MODEL_ID, prompt="The little cat", max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == "The little cat" + alone[1]
    ids = c.completions.create(model=MODEL_ID, prompt=[[1, 2, 3], [1, 4]], max_tokens=4, temperature=0)
    assert len(ids.choices) == 2
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_ID, prompt="hi", max_tokens=2, n=65)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_ID, prompt=["a"] * 40, max_tokens=2, n=2)
    assert e.value.param == "n"


def test_n_choices_stream_by_index_and_in_chat(server):
    c = server.client()
    whole = c.completions.create(model=MODEL_ID, prompt=["One day, a boy", "The sun was"], max_tokens=12, temperature=0,
                                 n=2, echo=True)
    parts = {}
    chunks = list(c.completions.create(model=MODEL_ID, prompt=["One day, a boy", "The sun was"], max_tokens=12,
                                       temperature=0, n=2, echo=True, stream=True,
                                       stream_options={"include_usage": True}))
    for chunk in chunks:
        for ch in chunk.choices:
            parts[ch.index] = parts.get(ch.index, "") + ch.text
    assert [parts[i] for i in range(4)] == [x.text for x in whole.choices]
    # include_usage: one last chunk without choices carries the usage; no other does.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 48
    assert all(x.usage is None for x in chunks[:-1])
    plain = list(c.completions.create(model=MODEL_ID, prompt="Once", max_tokens=4, stream=True))
    assert all(x.usage is None for x in plain) and all(x.choices for x in plain)
    chat = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Tom had"}], max_tokens=8,
                                     temperature=0, n=3)
    assert len({x.message.content for x in chat.choices}) == 1 and len(chat.choices) == 3
    deltas = {}
    for chunk in c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Tom had"}],
                                           max_tokens=8, temperature=0, n=3, stream=True):
        for ch in chunk.choices:
            deltas[ch.index] = deltas.get(ch.index, "") + (ch.delta.content or "")
    assert [deltas[i] for i in range(3)] == [x.message.content for x in chat.choices]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                  extra_body={"echo": True})
    assert e.value.param == "echo"


def test_logprobs_of_completions_and_chat(server):
    c = server.client()
    r = c.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for tok, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert p <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(p, abs=1e-5)  # greedy: the chosen token is the likeliest
        assert top[tok] == pytest.approx(p, abs=1e-5)
    only = c.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=0)
    assert only.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert only.choices[0].logprobs.top_logprobs == [None] * 8
    chat = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Lily"}], max_tokens=6,
                                     temperature=0.7, seed=1, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(x.token for x in content) == chat.choices[0].message.content
    for x in content:
        assert x.logprob <= 0 and len(x.top_logprobs) == 2 and bytes(x.bytes).decode("utf-8", "replace") == x.token
        assert x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob  # the likeliest first
        assert x.logprob <= x.top_logprobs[0].logprob + 1e-5
        for alt in x.top_logprobs:
            if alt.token == x.token:
                assert alt.logprob == pytest.approx(x.logprob, abs=1e-5)
    plain = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Lily"}], max_tokens=2)
    assert plain.choices[0].logprobs is None
    # Streamed, each chunk carries its tokens' entries: together the same
    # as the whole answer's (completions with their text offsets; chat).
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in c.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=8, temperature=0,
                                      logprobs=3, stream=True):
        for ch in chunk.choices:
            for k in streamed:
                streamed[k] += getattr(ch.logprobs, k)
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [sorted(t) for t in streamed["top_logprobs"]] == [sorted(t) for t in lp.top_logprobs]
    greedy_chat = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Lily"}], max_tokens=6,
                                            temperature=0, logprobs=True, top_logprobs=2)
    entries = []
    for chunk in c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Lily"}], max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=2, stream=True):
        for ch in chunk.choices:
            entries += ch.logprobs.content if ch.logprobs else []
    want = greedy_chat.choices[0].logprobs.content
    assert [x.token for x in entries] == [x.token for x in want] and len(entries) == 6
    assert [x.logprob for x in entries] == pytest.approx([x.logprob for x in want], abs=1e-5)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=2, top_logprobs=2)
    assert e.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_ID, prompt="hi", max_tokens=2, logprobs=21)
    assert e.value.param == "logprobs"


def test_penalties_and_logit_bias_change_the_text_and_are_checked(server):
    c = server.client()
    prompt = "the cat the cat the cat the cat the cat"
    base = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0, logprobs=1)
    ids_text = base.choices[0].logprobs.tokens
    for kw in [dict(presence_penalty=1.5), dict(frequency_penalty=1.0)]:
        other = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0, **kw)
        assert other.choices[0].text != base.choices[0].text, kw
    # A bias of +100 makes a token the answer; -100 bans it.
    def one(bias):
        return c.completions.create(model=MODEL_ID, prompt=[1, 2, 3], max_tokens=1, temperature=0,
                                    logit_bias=bias).choices[0].text.strip()
    a, b = 300, 301
    assert one({str(a): 100, str(b): 99}) != one({str(a): -100, str(b): 99})
    assert one({str(b): 100}) == one({str(a): -100, str(b): 99})
    assert one({str(a): 100}) != "" and ids_text
    for kw, field in [(dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
                      (dict(logit_bias={"abc": 1}), "logit_bias"), (dict(logit_bias={"5": 200}), "logit_bias"),
                      (dict(logit_bias={"99999999": 1}), "logit_bias")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL_ID, prompt="hi", max_tokens=2, **kw)
        assert e.value.param == field, kw

