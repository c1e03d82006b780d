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
