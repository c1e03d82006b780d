"""The engine through Python over real model files: generation equal to the
CLI's (`pagekv generate --json`) for the same prompt, seed and sampling, both
through pagekv.generate and through Engine; streaming, callbacks (and their
exceptions), cancellation, the background loop and threads submitting at
once; chat through the model's template; every bad argument a clear
exception."""

import json
import subprocess
import threading

import pytest

import pagekv


def cli_generate(cli, model, prompt, *args):
    out = subprocess.run([cli, "generate", "--model", model, "--prompt", prompt, "--json", *args],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[0])


@pytest.fixture(scope="module")
def engine(stories):
    with pagekv.Engine(stories, block_len=8, num_blocks=256, threads=1) as e:
        yield e


@pytest.mark.parametrize("sampling", [
    dict(),
    dict(temperature=0.8, seed=1234),
    dict(temperature=1.0, top_k=40, top_p=0.9, seed=7),
])
def test_generation_equals_the_cli_for_the_same_prompt_and_seed(cli, stories, engine, sampling):
    prompt = "Once upon a time, there was a little"
    flags = ["-n", "24", "--block-len", "8", "--threads", "1"]
    if "temperature" in sampling:
        flags += ["--temp", str(sampling["temperature"]), "--seed", str(sampling["seed"])]
    if "top_k" in sampling:
        flags += ["--top-k", str(sampling["top_k"]), "--top-p", str(sampling["top_p"])]
    want = cli_generate(cli, stories, prompt, *flags)
    # The library behind the CLI, called from Python.
    got = pagekv.generate(stories, prompt, max_tokens=24, block_len=8, threads=1, **sampling)
    out = got["outputs"][0]
    assert out["prompt_ids"] == want["prompt_ids"]
    assert out["generated_ids"] == want["generated_ids"]
    assert out["text"] == want["text"]
    # The engine: the same prompt ids, the same tokens.
    assert engine.encode(prompt) == want["prompt_ids"]
    r = engine.generate(prompt, max_tokens=24, ignore_eos=True, **sampling)
    assert r["tokens"] == want["generated_ids"]
    assert r["finish"] == "length"
    assert r["prompt_tokens"] == len(want["prompt_ids"])
    assert engine.decode(want["prompt_ids"] + r["tokens"]) == want["text"]


def test_stream_gives_every_token_then_the_result(engine):
    prompt = "Lily and Ben went to the park"
    whole = engine.generate(prompt, max_tokens=12, ignore_eos=True)
    s = engine.stream(prompt, max_tokens=12, ignore_eos=True)
    updates = list(s)
    assert [u["token"] for u in updates if u["token"] is not None] == whole["tokens"]
    assert updates[-1]["finish"] == "length"
    assert all(u["finish"] is None for u in updates[:-1])
    assert "".join(u["text"] for u in updates) == whole["text"]
    assert s.result["tokens"] == whole["tokens"] and s.result["id"] == s.id
    assert list(s) == []


def test_callbacks_cancellation_and_callback_errors(engine):
    seen = []
    r = engine.generate("The little cat", max_tokens=6, ignore_eos=True, on_token=seen.append)
    assert [u["token"] for u in seen if u["token"] is not None] == r["tokens"]

    # Cancelled from its own callback after three tokens.
    box = {}

    def stop_at_three(u):
        box.setdefault("n", 0)
        box["n"] += 1
        if box["n"] == 3:
            engine.cancel(u["id"])

    rid = engine.submit("The little cat", max_tokens=50, ignore_eos=True, on_token=stop_at_three)
    r = engine.wait(rid)
    assert r["finish"] == "cancelled" and len(r["tokens"]) < 50

    # An exception in a callback cancels the request and is raised by wait.
    def boom(u):
        raise KeyError("from the callback")

    rid = engine.submit("The little cat", max_tokens=50, ignore_eos=True, on_token=boom)
    with pytest.raises(KeyError, match="from the callback"):
        engine.wait(rid)
    # The engine goes on; an unknown id is a result with an error, not a hang.
    assert engine.generate("The little cat", max_tokens=2, ignore_eos=True)["finish"] == "length"
    assert engine.wait(10**9)["finish"] == "error"
    # A stream dropped unfinished is cancelled and forgotten.
    s = engine.stream("Once upon a time", max_tokens=100, ignore_eos=True)
    next(s)
    del s
    m = engine.metrics()
    assert m["running"] == 0 and m["waiting"] == 0


def test_a_started_engine_serves_threads_submitting_at_once(stories):
    prompts = ["Once upon a time", "Sara had a red ball", "One day, a boy named Tom", "The little cat"]
    with pagekv.Engine(stories, block_len=8, num_blocks=256, threads=1) as ref:
        alone = [ref.generate(p, max_tokens=10, ignore_eos=True)["tokens"] for p in prompts]
    e = pagekv.Engine(stories, block_len=8, num_blocks=256, threads=1)
    e.start()
    assert e.started
    results = [None] * len(prompts)
    updates = [0] * len(prompts)

    def client(i):
        def count(u):
            updates[i] += 1
        results[i] = e.generate(prompts[i], max_tokens=10, ignore_eos=True, on_token=count)["tokens"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone
    assert all(n >= 10 for n in updates)
    # A result goes out inside the step that finishes it; the step's token
    # counts reach the metrics when that step ends, a moment later.
    import time

    deadline = time.monotonic() + 10
    while (m := e.metrics())["generated_tokens"] < 10 * len(prompts) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m["finished"] == len(prompts) and m["generated_tokens"] == 10 * len(prompts)
    e.stop()
    e.close()
    with pytest.raises(pagekv.FailedPreconditionError, match="closed"):
        e.metrics()


def test_prefix_cache_hits_and_salts_through_the_engine(engine):
    prompt = "Once upon a time, in a big forest, there lived a bear who liked honey very much"
    engine.reset_prefix_cache()
    a = engine.generate(prompt, max_tokens=4, ignore_eos=True, salt="alice")
    b = engine.generate(prompt, max_tokens=4, ignore_eos=True, salt="alice")
    c = engine.generate(prompt, max_tokens=4, ignore_eos=True, salt="bob")
    assert a["cached_prompt_tokens"] == 0
    assert b["cached_prompt_tokens"] >= 8 and b["tokens"] == a["tokens"]
    assert c["cached_prompt_tokens"] == 0
    assert engine.metrics()["prefix"]["hit_tokens"] >= b["cached_prompt_tokens"]


def test_bad_input_raises_clear_exceptions(stories, engine, tmp_path):
    with pytest.raises(pagekv.Error, match="nonexistent"):
        pagekv.Engine(str(tmp_path / "nonexistent.gguf"))
    with pytest.raises(ValueError, match="allocator"):
        pagekv.Engine(stories, allocator="magic")
    with pytest.raises(ValueError):
        pagekv.Engine(stories, kv_dtype="f7")
    with pytest.raises(ValueError, match="tiers: unknown key"):
        pagekv.Engine(stories, tiers={"ram": 1})
    with pytest.raises(ValueError, match="temperature"):
        engine.submit("hi", temperature=-1)
    with pytest.raises(ValueError, match="vocabulary|vocab"):
        engine.submit([1, 2, 10**6])
    with pytest.raises(pagekv.Error, match="context"):
        engine.submit("Once upon a time", max_tokens=10**6)
    with pytest.raises(TypeError):
        engine.submit("hi", on_token=5)
    with pytest.raises(ValueError, match="salt"):
        engine.submit("hi", salt="")
    with pytest.raises(pagekv.Error):
        pagekv.generate(stories, "hi", max_tokens=-1)


def test_chat_with_smollm2_uses_its_template_and_ends_at_end_of_turn(smollm2, cli):
    with pagekv.Engine(smollm2, num_blocks=128, threads=1) as e:
        assert e.chat_template_name
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        text = e.render_chat(messages)
        assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
        r = e.chat(messages, max_tokens=32)
        assert r["finish"] in ("stop", "length")
        assert "Paris" in r["text"]
        # The CLI's chat turn: the same prompt ids and tokens (greedy).
        want = cli_generate(cli, smollm2, messages[0]["content"], "--chat", "-n", "32", "--threads", "1")
        assert e.encode_chat(messages) == want["prompt_ids"]
        assert r["tokens"] == want["generated_ids"]
        # A second turn continues the conversation.
        messages += [{"role": "assistant", "content": r["text"]}, {"role": "user", "content": "And of Italy?"}]
        r2 = e.chat(messages, max_tokens=32)
        assert "Rome" in r2["text"]
        assert r2["cached_prompt_tokens"] > 0  # the first turn's blocks, from the prefix cache
        with pytest.raises(ValueError, match="JSON|messages"):
            e.chat([{"role": "user", "content": object()}])


def test_generation_releases_the_gil(engine):
    """While one thread generates, another keeps running Python: the longest
    pause it sees is a small part of the generation (holding the GIL through
    the steps would make it the whole)."""
    import time

    done = threading.Event()
    span = {}

    def gen():
        span["start"] = time.monotonic()
        engine.generate("Once upon a time", max_tokens=400, ignore_eos=True)
        span["end"] = time.monotonic()
        done.set()

    t = threading.Thread(target=gen)
    stamps = []
    t.start()
    while not done.is_set():
        stamps.append(time.monotonic())
    t.join()
    inside = [s for s in stamps if span["start"] <= s <= span["end"]] + [span["end"]]
    longest = max(b - a for a, b in zip(inside, inside[1:])) if len(inside) > 1 else span["end"] - span["start"]
    assert longest < 0.5 * (span["end"] - span["start"]), (longest, span["end"] - span["start"])


@pytest.mark.parametrize("started", [False, True])
def test_closing_from_another_thread_while_one_waits_never_crashes(stories, started):
    """close() while another thread is inside generate: that call finishes
    (or was refused as closed, if it had not begun); later calls raise."""
    import time

    e = pagekv.Engine(stories, block_len=8, num_blocks=256, threads=1)
    if started:
        e.start()
    got = {}

    def gen():
        try:
            got["result"] = e.generate("Once upon a time", max_tokens=300, ignore_eos=True)
        except pagekv.FailedPreconditionError as err:
            got["closed"] = str(err)

    t = threading.Thread(target=gen)
    t.start()
    time.sleep(0.02)
    e.close()
    t.join(timeout=60)
    assert not t.is_alive()
    assert ("result" in got and got["result"]["finish"] in ("length", "cancelled")) or "closed" in got["closed"]
    with pytest.raises(pagekv.FailedPreconditionError, match="closed"):
        e.generate("hi")
    e.close()  # twice: nothing


def test_a_deepseek2_model_runs_on_the_latent_cache_from_python(cli, tmp_path):
    """A deepseek2 (MLA) file through the same Python engine: the CLI's
    tokens for the same prompt, a latent cache the prefix cache shares."""
    model = str(tmp_path / "ds.gguf")
    subprocess.run([cli, "synth-model", "--preset", "tiny-deepseek2", "--out", model], check=True,
                   capture_output=True)
    prompt = "hello there, latent world: one row per token and layer, shared by every head of the model"
    want = cli_generate(cli, model, prompt, "-n", "12", "--block-len", "16", "--threads", "1")
    with pagekv.Engine(model, block_len=16, num_blocks=64, threads=1) as e:
        first = e.generate(prompt, max_tokens=12, ignore_eos=True)
        again = e.generate(prompt, max_tokens=12, ignore_eos=True)
    assert first["tokens"] == want["generated_ids"]
    assert again["tokens"] == first["tokens"]
    assert len(want["prompt_ids"]) > 16
    assert again["cached_prompt_tokens"] >= 16, "the first request's full latent block was found"


def test_device_cuda_is_a_clear_error_without_a_gpu_and_the_cpus_tokens_with_one(stories):
    """device="cuda": without a GPU (or a build without CUDA), UnavailableError naming the fix;
    with one, greedy f32-product tokens equal to the CPU's."""
    cpu = pagekv.generate(stories, "Once upon a time", max_tokens=24, exact_products=True)
    try:
        gpu = pagekv.generate(stories, "Once upon a time", max_tokens=24, exact_products=True, device="cuda")
    except pagekv.UnavailableError as e:
        assert "--device cpu" in str(e)
        with pytest.raises(pagekv.UnavailableError):
            pagekv.Engine(stories, device="cuda")
        return
    assert gpu["outputs"][0]["generated_ids"] == cpu["outputs"][0]["generated_ids"]


def test_an_unknown_device_is_a_value_error(stories):
    with pytest.raises(ValueError, match="cpu, cuda, cuda:N"):
        pagekv.Engine(stories, device="gpu")


def test_tensor_cores_without_a_cuda_device_are_a_value_error(stories):
    """tensor_cores selects the CUDA tensor-core attention kernels: with device="cpu" it is refused."""
    with pytest.raises(ValueError, match="--device cuda"):
        pagekv.Engine(stories, tensor_cores=True)
    with pytest.raises(ValueError, match="--device cuda"):
        pagekv.generate(stories, "Once upon a time", max_tokens=4, tensor_cores=True)


def test_cuda_graphs_without_a_cuda_device_are_a_value_error(stories):
    """cuda_graphs runs decode steps as CUDA graphs: with device="cpu" it is refused."""
    with pytest.raises(ValueError, match="CUDA graphs: use it with --device cuda"):
        pagekv.Engine(stories, cuda_graphs=True)
    with pytest.raises(ValueError, match="--device cuda"):
        pagekv.generate(stories, "Once upon a time", max_tokens=4, cuda_graphs=True)
