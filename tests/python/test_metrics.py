"""/metrics of a real `pagekv serve` under load: Prometheus's promtool
(scripts/promtool.sh) parses every scrape; vLLM's series exist with the
model_name label and move exactly with the traffic; nothing changes when
only the scraping does."""
import os
import subprocess
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagekv_server import MODEL_ID, Server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "tiny-model"

VLLM_COUNTERS = ["vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:request_success"]
VLLM_GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:cache_config_info"]
VLLM_HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                   "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
                   "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                   "vllm:request_prompt_tokens", "vllm:request_generation_tokens"]


def promtool(text):
    """promtool's findings on a scrape; a parse error fails the test."""
    tool = subprocess.run(["bash", os.path.join(ROOT, "scripts/promtool.sh")], capture_output=True, text=True,
                          check=True).stdout.strip()
    r = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode in (0, 3), f"promtool could not parse the scrape (rc {r.returncode}): {r.stderr}{r.stdout}"
    return [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]


def samples(text):
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(sm, name, **labels):
    return sm.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def server():
    s = Server("--served-model-name", NAME)
    yield s
    s.stop()


def test_vllm_series_pass_promtool_and_move_with_traffic(server):
    status, before_text = server.get("/metrics")
    assert status == 200
    before = samples(before_text)
    client = server.client()
    usage, errors, mid = [], [], []

    def work(k):
        try:
            for j in range(3):
                prompt = ("Once upon a time there was a little girl named Lily. She liked to play with her ball in "
                          f"the park with her mom and her dog every day. {k % 2}")
                r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8 + j, temperature=0)
                usage.append((r.usage.prompt_tokens, r.usage.completion_tokens))
                if k == 0 and j == 0:
                    mid.append(server.get("/metrics")[1])  # a scrape under load
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert server.get("/no/such/path")[0] == 404
    after_text = server.get("/metrics")[1]
    after = samples(after_text)

    # promtool parses both scrapes; its only findings are the lint on the
    # ':' that vLLM's own names carry.
    for text in (mid[0], after_text):
        for finding in promtool(text):
            assert finding.startswith("vllm:") and finding.endswith("metric names should not contain ':'"), finding

    m = {"model_name": NAME}
    for name in VLLM_COUNTERS[:-1]:
        assert (name + "_total", tuple(m.items())) in after, name
    for name in VLLM_GAUGES[:-1]:
        assert (name, tuple(m.items())) in after, name
    for name in VLLM_HISTOGRAMS:
        assert (name + "_count", tuple(m.items())) in after, name
    config = [k for k in after if k[0] == "vllm:cache_config_info"]
    assert len(config) == 1 and dict(config[0][1])["block_size"] == "16" and dict(config[0][1])["model_name"] == NAME

    n = len(usage)
    prompt_tokens = sum(p for p, _ in usage)
    generated = sum(c for _, c in usage)
    delta = lambda name, **l: value(after, name, **l) - value(before, name, **l)  # noqa: E731
    assert delta("vllm:generation_tokens_total", **m) == generated
    assert delta("vllm:prompt_tokens_total", **m) == prompt_tokens
    assert delta("vllm:request_success_total", finished_reason="length", **m) == n
    assert delta("vllm:e2e_request_latency_seconds_count", **m) == n
    assert delta("vllm:time_to_first_token_seconds_count", **m) == n
    assert delta("vllm:request_prompt_tokens_sum", **m) == prompt_tokens
    assert delta("vllm:request_generation_tokens_sum", **m) == generated
    assert delta("vllm:inter_token_latency_seconds_count", **m) == generated - n
    assert delta("vllm:prefix_cache_queries_total", **m) >= prompt_tokens - n
    assert delta("vllm:prefix_cache_hits_total", **m) > 0, "the repeated prompts hit the prefix cache"
    assert value(after, "vllm:num_requests_running", **m) == 0
    assert value(after, "vllm:kv_cache_usage_perc", **m) == 0
    assert delta("pagekv_http_responses_total", route="/v1/completions", status="200") == n
    assert delta("pagekv_http_responses_total", route="unmatched", status="404") == 1
    assert value(after, "process_resident_memory_bytes") > 1e6


def test_scraping_alone_changes_nothing(server):
    """No per-scrape gauges: two scrapes with no traffic between them agree,
    but for the process's own series and the scrapes' own connections and
    answers."""
    def stable(text):
        return {k: v for k, v in samples(text).items()
                if not k[0].startswith(("process_", "pagekv_http_connections")) and dict(k[1]).get("route") != "/metrics"}
    a = stable(server.get("/metrics")[1])
    b = stable(server.get("/metrics")[1])
    assert a == b
    assert not [k for k in a if "per_second" in k[0] or "hit_rate" in k[0]]
