"""What the tests of the serving engines (test_vllm.py, test_sglang.py) share: the real SmolLM2's DIFF V2 conversion,
its prompts as token ids, a command run to success, and a server process on a port of its own, waited for until it
answers and stopped with the processes it started."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

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
