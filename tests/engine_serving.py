"""What the serving tests share: for the engines (test_vllm.py, test_sglang.py), the real SmolLM2's DIFF V2
conversion, its prompts as token ids and a command run to success; for all, a server process on a port of its own,
waited for until it answers and stopped with the processes it started, and `diff-llama serve` (test_serving.py,
test_serve_load.py) as one."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parent.parent / "src")
WORKER = Path(__file__).resolve().parent / "serve_worker.py"
DIFF_LLAMA = str(Path(sys.executable).parent / "diff-llama")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a city made of glass,"]
NEW_TOKENS = 32


def run(*args, timeout=900, env=None):
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The real SmolLM2 converted by `diff-llama convert` (DIFF V2, the default), once per test module."""
    folder = tmp_path_factory.mktemp("engine") / "smollm2-diff"
    run(DIFF_LLAMA, "convert", "smollm2", str(folder))
    return folder


def prompt_ids(folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]


class ServerProcess:
    """`command` running, its output in `log`, from when `ready_url` answers until `stop`."""

    def __init__(self, command, log, ready_url, env=None, cwd=None):
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                            env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            self._wait(ready_url)
        except BaseException:  # a server that never answered is stopped too, with what it started
            self.stop()
            raise

    def _wait(self, ready_url):
        deadline = time.monotonic() + 600
        while True:
            assert self.process.poll() is None, self.log.read_text()[-4000:]
            assert time.monotonic() < deadline, self.log.read_text()[-4000:]
            try:
                with urllib.request.urlopen(ready_url, timeout=5):
                    return
            except OSError:
                time.sleep(2)

    def stop(self):
        try:
            os.killpg(self.process.pid, signal.SIGTERM)  # the server and the engine processes it started
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)


class DiffLlamaServer(ServerProcess):
    """`diff-llama serve MODEL --device cpu OPTIONS` on 127.0.0.1 and a free port, run from `cwd` with the `env` on
    top of this one's, once it answers; its log in `log_folder`. With `worker`, transformers' server as
    tests/serve_worker.py sets it up (bare, or with the guard as `options` say) instead of `diff-llama serve`."""

    def __init__(self, log_folder, model, *options, cwd=None, worker=False, **env):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if worker:
            command = [sys.executable, str(WORKER), str(model), str(self.port), *options]
        else:
            command = [sys.executable, "-m", "diff_llama.cli", "serve", str(model), "--host", "127.0.0.1", "--port",
                       str(self.port), "--device", "cpu", *options]
        env = {"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env}
        super().__init__(command, Path(log_folder) / f"server-{self.port}.log", self.url + "/health", env=env,
                         cwd=cwd)

    def log_size(self) -> int:
        return len(self.log.read_text())

    def errors_since(self, start: int) -> list[str]:
        """The lines of the server's log past `start` characters that report an error."""
        return [line for line in self.log.read_text()[start:].splitlines()
                if "ERROR" in line or "Traceback" in line or "Error:" in line]
