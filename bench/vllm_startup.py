"""Start-up time of `diff-llama serve MODEL --engine vllm` with an empty vLLM cache and again with the cache the first
start wrote (issue 42).

vLLM compiles the model with torch.compile when its engine starts (Dynamo, then Inductor) and saves the compiled
function under VLLM_CACHE_ROOT (its "AOT" artefact), so that the next start of the same model loads it instead of
compiling again. Each start here runs the server with VLLM_CACHE_ROOT pointed at one fresh folder (a temporary one
unless --cache-root names it), times it from the command to the first answer of /v1/models, asks it for one greedy
completion (the same prompt every time, so the starts can be compared token for token), and stops it. The first start
finds the folder empty; every later one finds what the earlier ones saved. From each server log it keeps vLLM's own
report of the engine's start (`init engine ... took`) and its lines about the compiled artefact (saved, loaded,
unable to save).

Usage (in the environment with vLLM; the Hub is never asked):
    HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m bench vllm_startup outputs/SmolLM2-135M-Instruct-diff \\
        --output bench/results/vllm_startup-cpu [--starts 2] [--threads 2] [--cache-root DIR] [--logs DIR]
Writes OUTPUT.json (with the suite's `meta` block) and OUTPUT.md through the suite's writer; the server logs go to
--logs (outputs/vllm_startup by default).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import suite

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"
NEW_TOKENS = 16
START_TIMEOUT = 900
# What vLLM's log says about the compiled artefact and the engine's start (its own timing of the compile).
LOG_PATTERNS = {
    "aot": re.compile(r"(saved AOT compiled function|Directly load AOT compilation|unable to save AOT compiled "
                      r"function|Compiling model again due to a load failure)[^\n]*"),
    "engine": re.compile(r"init engine \(profile, create kv cache, warmup model\) took [^\n]*"),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(process: subprocess.Popen, base: str, log: Path, timeout: float = START_TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; log tail:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"{base}/models", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the server did not answer /v1/models in {timeout:.0f} s; log tail:\n{tail(log)}")


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def completion(base: str, model: str) -> list[int]:
    request = urllib.request.Request(
        f"{base}/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
                         "return_token_ids": True}).encode())
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.load(answer)["choices"][0]["token_ids"]


def stop(process: subprocess.Popen):
    """SIGINT to the server, so that it stops its engine processes; then the whole group if it lingers."""
    for sig, kill in ((signal.SIGINT, os.kill), (signal.SIGTERM, os.killpg), (signal.SIGKILL, os.killpg)):
        try:
            kill(process.pid, sig)
            process.wait(30)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def start_once(model: str, cache_root: Path, log: Path, threads: int, extra: list[str]) -> dict:
    """One start of the server on `cache_root`: seconds to the first answer, the greedy tokens, vLLM's log lines."""
    port = free_port()
    command = [str(Path(sys.executable).with_name("diff-llama")), "serve", model, "--engine", "vllm",
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--log-level", "info", *extra]
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache_root), "OMP_NUM_THREADS": str(threads),
           "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    base = f"http://127.0.0.1:{port}/v1"
    print(f"starting: {' '.join(command)} (VLLM_CACHE_ROOT={cache_root})", flush=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                   start_new_session=True)
    try:
        wait_ready(process, base, log)
        ready_s = time.perf_counter() - started
        tokens = completion(base, model)
    finally:
        stop(process)
    text = log.read_text(errors="replace")
    found = {name: [match.group(0).strip() for match in pattern.finditer(text)] for name, pattern in LOG_PATTERNS.items()}
    print(f"ready after {ready_s:.1f} s; {found}", flush=True)
    return {"ready_s": ready_s, "tokens": tokens, "aot_log": found["aot"], "engine_log": found["engine"],
            "log": str(log)}


def render(result: dict) -> str:
    config, starts = result["config"], result["starts"]
    lines = [
        "# vLLM start-up: empty compile cache, then the cache the first start saved", "",
        f"`diff-llama serve {config['model']} --engine vllm --dtype float32`, {config['threads']} threads, "
        f"vLLM {config['vllm_version']}; seconds from the command to the first answer of /v1/models.", "",
        "| start | vLLM cache | ready (s) | engine start, vLLM's log | compiled artefact, vLLM's log |",
        "|---|---|---|---|---|",
    ]
    for index, start in enumerate(starts, 1):
        cache = "empty" if index == 1 else "from the earlier start(s)"
        engine = "; ".join(start["engine_log"]) or "-"
        aot = "; ".join(re.sub(r" (to|from)( path)? /\S+", "", line) for line in start["aot_log"]) or "-"
        lines.append(f"| {index} | {cache} | {start['ready_s']:.1f} | {engine} | {aot} |")
    first, *later = starts
    if later:
        lines += ["", f"Later starts take {later[-1]['ready_s'] / first['ready_s']:.2f}x the first's time; "
                  f"greedy tokens ({NEW_TOKENS}, prompt {PROMPT!r}) "
                  + ("identical on every start." if all(s["tokens"] == first["tokens"] for s in later)
                     else "DIFFER between starts.")]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a DIFF V2 folder (e.g. outputs/SmolLM2-135M-Instruct-diff)")
    parser.add_argument("--output", required=True, help="OUTPUT.json and OUTPUT.md are written (a bare name goes "
                        "under bench/results)")
    parser.add_argument("--starts", type=int, default=2, help="starts on the same cache, the first on an empty one")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the server")
    parser.add_argument("--cache-root", help="an empty or missing folder for VLLM_CACHE_ROOT (default: a temporary "
                        "one, removed afterwards)")
    parser.add_argument("--logs", default=str(REPO / "outputs" / "vllm_startup"),
                        help="folder for the server logs (never the results folder)")
    parser.add_argument("--extra", default="", help="more options for diff-llama serve, as one string")
    args = parser.parse_args()
    if args.starts < 2:
        parser.error("--starts must be at least 2: the first start fills the cache, the later ones read it")
    if args.cache_root and Path(args.cache_root).exists() and any(Path(args.cache_root).iterdir()):
        parser.error(f"--cache-root {args.cache_root} is not empty: the first start must find no compiled artefact")
    output = suite.result_path(args.output, ".json")
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-startup-") as scratch:
        cache_root = Path(args.cache_root or Path(scratch) / "vllm-cache")
        logs = Path(args.logs)
        logs.mkdir(parents=True, exist_ok=True)
        starts = [start_once(args.model, cache_root, logs / f"start-{index}.log", args.threads, args.extra.split())
                  for index in range(1, args.starts + 1)]
    config = {"model": args.model, "threads": args.threads, "starts": args.starts, "prompt": PROMPT,
              "new_tokens": NEW_TOKENS, "extra": args.extra,
              "vllm_version": suite.package_version("vllm") or suite.package_version("vllm-cpu")}
    suite.write_result("vllm_startup", output, {"config": config, "starts": starts}, render)


if __name__ == "__main__":
    main()
