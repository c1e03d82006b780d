"""The Python examples run, and check themselves (examples/python)."""

import pathlib
import runpy

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"


def test_the_toy_scheduler_serves_every_request_with_prefix_hits():
    main = runpy.run_path(str(EXAMPLES / "toy_scheduler.py"))["main"]
    for seed in range(3):
        done, stats = main(num_requests=40, num_blocks=40, seed=seed)
        assert len(done) == 40
        assert all(len(r.out) == r.max_new for r in done)
        assert stats["hit_tokens"] > 0 and stats["collisions"] == 0


def test_the_smollm2_chat_example_answers_and_reuses_the_earlier_turns(smollm2, monkeypatch):
    import io

    monkeypatch.setenv("PAGEKV_SMOLLM2", smollm2)
    main = runpy.run_path(str(EXAMPLES / "chat_smollm2.py"))["main"]
    out = io.StringIO()
    results = main(say=["What is the capital of France?", "And of Italy?"], max_tokens=24, out=out)
    assert len(results) == 2
    assert "Paris" in results[0]["text"] and "Rome" in results[1]["text"]
    assert results[1]["cached_prompt_tokens"] > 0
    assert "Paris" in out.getvalue()
