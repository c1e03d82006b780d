"""Fixtures of the Python module's tests: the module from the build tree
(tests/bindings/run.sh puts <build>/python on PYTHONPATH), the CLI binary to
compare against, and small caches."""

import os

import numpy as np
import pytest

import pagekv


@pytest.fixture
def cli():
    path = os.environ.get("PAGEKV_CLI")
    if not path:
        pytest.skip("PAGEKV_CLI not set (tests/bindings/run.sh sets it)")
    return path


def small_cache(**overrides):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_len=8, num_blocks=16, dtype="f32",
                prefault=False)
    args.update(overrides)
    return pagekv.KvCache(**args)


def rows(cache, n, seed, dtype=np.float32):
    """Random K and V rows for n tokens, shaped as append takes them."""
    rng = np.random.default_rng(seed)
    shape = (cache.num_layers, n, cache.num_heads, cache.row_elems)
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)


def _free_port():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port):
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free loopback port, killed afterwards: yields its url."""
    import shutil
    import subprocess
    import time

    server = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
    if server is None:
        pytest.fail("redis-server is not installed: install the Debian package redis-server (scripts/install-deps.sh does)")
    port = _free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path), "--save", "",
         "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not _ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"redis-server did not start on port {port}")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def stories():
    """The shared stories260K GGUF (tests and demos read ../shared/models)."""
    path = os.path.join(os.path.dirname(ROOT), "shared", "models", "stories260K", "stories260K.gguf")
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing: the tests read the shared models beside the repository")
    return path


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (Q4_1), fetched once into the model cache by scripts/fetch-model.sh (make test runs it)."""
    import subprocess

    path = os.environ.get("PAGEKV_SMOLLM2")
    if not path:
        r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "fetch-model.sh"), "smollm2"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.fail("SmolLM2 is not in the model cache and cannot be fetched: " + r.stderr.strip())
        path = r.stdout.strip()
    return path
