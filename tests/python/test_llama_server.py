"""llama-server's endpoints on a real `pagekv serve`: /tokenize (with
pieces), /detokenize, /apply-template, /props, /slots and /completion
(n_predict, n_probs, cache_prompt, streaming), mapped onto the same engine
as the OpenAI routes; a curl-style form body read as JSON; /health while
the model loads and after."""
import json
import math
import os
import socket
import subprocess
import threading
import time
import urllib.request

import pytest

from pagekv_server import MODEL, MODEL_ID, Server

PROMPT = "Once upon a time there was a little girl named Lily. She liked to play with her ball in the park."


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


def post(server, path, body, content_type="application/json"):
    status, text = server.request("POST", path, json.dumps(body), {"Content-Type": content_type})
    return status, json.loads(text) if text else None


def stream(server, body):
    """The data: objects of a streamed /completion."""
    req = urllib.request.Request(server.url + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    return chunks


def test_tokenize_and_detokenize_round_trip(server):
    status, ids = post(server, "/tokenize", {"content": PROMPT})
    assert status == 200 and all(isinstance(t, int) for t in ids["tokens"])
    status, special = post(server, "/tokenize", {"content": PROMPT, "add_special": True})
    assert special["tokens"][1:] == ids["tokens"] and special["tokens"][0] != ids["tokens"][0], "BOS first"
    status, pieces = post(server, "/tokenize", {"content": PROMPT, "with_pieces": True})
    assert [p["id"] for p in pieces["tokens"]] == ids["tokens"]
    assert "".join(p["piece"] for p in pieces["tokens"]).strip() == PROMPT.strip()
    status, text = post(server, "/detokenize", {"tokens": ids["tokens"]})
    assert status == 200 and text["content"].strip() == PROMPT
    # The same ids the completions endpoint counts.
    status, done = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == len(special["tokens"])
    assert post(server, "/detokenize", {"tokens": [10**9]})[0] == 400
    assert post(server, "/tokenize", {"content": 5})[0] == 400


def test_props_and_slots_describe_the_model_and_the_running_sequences(server):
    status, body = server.get("/props")
    props = json.loads(body)
    assert status == 200 and props["model_alias"] == MODEL_ID and props["n_ctx"] > 0
    kv = props["kv_cache"]
    assert kv["block_size"] == 16 and kv["num_blocks"] > 0 and kv["bytes_per_block"] > 0 and kv["prefix_caching"]
    assert props["total_slots"] == 64
    # A long request in flight shows in /slots with its KV use.
    done = threading.Event()

    def long_one():
        post(server, "/completion", {"prompt": PROMPT, "n_predict": 200, "ignore_eos": True})
        done.set()

    t = threading.Thread(target=long_one)
    t.start()
    seen = []
    for _ in range(200):
        slots = json.loads(server.get("/slots")[1])
        if slots:
            seen = slots
            break
        time.sleep(0.005)
    t.join()
    assert seen, "the running request never showed in /slots"
    s = seen[0]
    assert s["is_processing"] and s["n_prompt_tokens"] > 0 and s["kv_tokens"] > 0
    assert s["kv_blocks"] == math.ceil(s["kv_tokens"] / 16) and s["kv_bytes"] == s["kv_blocks"] * kv["bytes_per_block"]
    assert json.loads(server.get("/slots")[1]) == []


def test_apply_template_renders_what_chat_reads(server):
    messages = [{"role": "user", "content": "Hello"}]
    status, body = post(server, "/apply-template", {"messages": messages})
    assert status == 200 and "Hello" in body["prompt"]
    # The rendered prompt, tokenized with specials parsed (and no BOS of
    # its own), is the chat request's prompt.
    _, ids = post(server, "/tokenize", {"content": body["prompt"], "parse_special": True})
    _, chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == len(ids["tokens"])


def test_completion_takes_llama_servers_fields(server):
    status, a = post(server, "/completion", {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "cache_prompt": True})
    assert status == 200 and a["stop"] and a["tokens_predicted"] == 12 and a["stop_type"] == "limit"
    assert a["model"] == MODEL_ID and a["tokens_evaluated"] > 0 and a["timings"]["predicted_n"] == 12
    # The same greedy text as the OpenAI route; the repeat finds its prompt cached.
    _, o = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert o["choices"][0]["text"] == a["content"]
    _, b = post(server, "/completion", {"prompt": PROMPT, "n_predict": 12, "temperature": 0})
    assert b["content"] == a["content"] and b["tokens_cached"] >= 16
    # n_probs: each token with its log-probability and the top alternatives.
    _, p = post(server, "/completion", {"prompt": PROMPT, "n_predict": 5, "temperature": 0, "n_probs": 3})
    probs = p["completion_probabilities"]
    assert len(probs) == 5 and all(len(x["top_logprobs"]) == 3 for x in probs)
    assert all(x["top_logprobs"][0]["id"] == x["id"] and x["logprob"] <= 0 for x in probs)  # greedy: the top one
    assert "".join(x["token"] for x in probs) == p["content"]
    # n_predict -1 runs until EOS or the context: ends with a stop type.
    _, e = post(server, "/completion", {"prompt": PROMPT, "temperature": 0})
    assert e["stop_type"] in ("eos", "limit") and e["tokens_predicted"] >= 1
    # llama-server's samplers PageKV lacks are named, not ignored.
    status, err = post(server, "/completion", {"prompt": PROMPT, "min_p": 0.1})
    assert status == 400 and err["error"]["param"] == "min_p"
    assert post(server, "/completion", {"prompt": PROMPT, "n_predict": 0})[0] == 400


def test_completion_streams_as_llama_server_does(server):
    chunks = stream(server, {"prompt": PROMPT, "n_predict": 10, "temperature": 0, "stream": True})
    assert chunks[-1]["stop"] and chunks[-1]["tokens_predicted"] == 10
    assert not any(c["stop"] for c in chunks[:-1])
    _, whole = post(server, "/completion", {"prompt": PROMPT, "n_predict": 10, "temperature": 0, "n_probs": 2})
    assert "".join(c["content"] for c in chunks) == whole["content"]
    # n_probs streamed: each chunk its token's entry, together the whole's.
    probs = [p for c in stream(server, {"prompt": PROMPT, "n_predict": 10, "temperature": 0, "stream": True, "n_probs": 2})
             for p in c.get("completion_probabilities", [])]
    assert [p["id"] for p in probs] == [p["id"] for p in whole["completion_probabilities"]]


def test_a_form_encoded_json_body_is_read_as_json(server):
    """curl -d sends application/x-www-form-urlencoded."""
    status, body = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3},
                        content_type="application/x-www-form-urlencoded")
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    status, body = post(server, "/completion", {"prompt": PROMPT, "n_predict": 3},
                        content_type="application/x-www-form-urlencoded")
    assert status == 200 and body["tokens_predicted"] == 3


def test_health_is_503_while_the_model_loads():
    """The port is taken before the model loads (the KV-event wait here
    holds the load); /health says loading, then ok."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        pub_port = s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([os.environ["PAGEKV_CLI"], "serve", "--model", MODEL, "--port", str(port),
                             "--kv-events-endpoint", f"tcp://127.0.0.1:{pub_port}", "--kv-events-wait-ms", "1500"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        statuses = []
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    statuses.append((r.status, r.read().decode()))
                    break
            except urllib.error.HTTPError as e:
                statuses.append((e.code, e.read().decode()))
            except OSError:
                pass  # not bound yet
            time.sleep(0.05)
        assert (503, '{"status":"loading"}') in statuses, statuses[:3]
        assert statuses[-1] == (200, '{"status":"ok"}'), statuses[-3:]
        assert "listening on" in proc.stdout.readline()
    finally:
        proc.kill()
        proc.wait()
