"""A real `pagekv serve` process on a free loopback port, for the tests in
this folder (the binary's path in PAGEKV_CLI)."""
import os
import subprocess
import urllib.error
import urllib.request

import openai

MODEL = os.environ.get("PAGEKV_TEST_MODEL", "../shared/models/stories260K/stories260K.gguf")
MODEL_ID = os.path.basename(MODEL)


class Server:
    def __init__(self, *extra, env=None, before_listening=None):
        self.proc = subprocess.Popen(
            [os.environ["PAGEKV_CLI"], "serve", "--model", MODEL, "--port", "0", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        if before_listening:
            before_listening(self.proc)
        line = self.proc.stdout.readline()
        assert "listening on" in line, line
        self.port = int(line.strip().rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key="unused"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def request(self, method, path, body=None, headers=None):
        data = body.encode() if isinstance(body, str) else body
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def get(self, path):
        return self.request("GET", path)

    def post(self, path, body, headers=None):
        return self.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
