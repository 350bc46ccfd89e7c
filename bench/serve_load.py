"""`diff-llama serve` (transformers' own server, behind diff-llama's request guard) under load and bad requests
(issue 42 §4).

Scenario: one server on MODEL (default: the SmolLM2-135M-Instruct DIFF V2 conversion, float32), warmed up by one
request. Then at once: CLIENTS streaming chat requests (the `openai` AsyncOpenAI client, as the serving throughput
bench uses it), each a different PROMPT_TOKENS-token prompt after the chat template, MAX_TOKENS new tokens, greedy;
DISCONNECTS of them, spread over the queue, leave after their third content chunk. While they run, every bad request
of `BAD_REQUESTS` is sent once (raw HTTP, since the client refuses to send most of them), one every half second.
After all have finished: /health and one more request (the server is alive), and the server's memory again.

Figures: output tokens/s = completion tokens of the completed streams (their `usage`) / wall time from the first
request to the last answer; requests/s = answered requests (any status) / the same wall time; time to first token
(first content chunk, of every stream, those that leave included) and total latency of each completed stream, p50
and p99 (nearest rank); errors by kind; the resident memory (VmRSS) of the server's processes (the server and the
model's process it starts) when idle after the warm-up, its peak (sampled every 0.25 s) and 5 s after the last
answer.
transformers' server generates for one request at a time, so a stream's time to first token is mostly its wait in
the queue.

Usage (the Hub is never asked):
    HF_HUB_OFFLINE=1 python -m bench serve_load [--model outputs/SmolLM2-135M-Instruct-diff] [--clients 32]
        [--disconnects 4] [--max-tokens 16] [--prompt-tokens 128] [--threads 2] [--request-timeout 600]
        [--output serve_load-cpu]
Writes bench/results/NAME.{json,md} through the suite's writer; the server's log goes to --work-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import threading
import time
from pathlib import Path

import suite
from serving_throughput import REPO, Server, build_prompts

DEFAULT_MODEL = REPO / "outputs" / "SmolLM2-135M-Instruct-diff"
CLIENTS, DISCONNECTS, MAX_TOKENS, PROMPT_TOKENS = 32, 4, 16, 128
REQUEST_TIMEOUT = 600
CLIENT_MARGIN = 60  # a client gives up this long after the server's own deadline: waiting forever shows as a timeout
SETTLE_SECONDS = 5
HELLO = [{"role": "user", "content": "Say hello."}]


def bad_requests(model: str, context: int) -> dict[str, tuple[bytes | dict, int, str]]:
    """name -> (body, the status it must get, words its error message must hold): the issue's bad requests."""
    too_long = [{"role": "user", "content": "hello " * (context + 500)}]
    return {
        "malformed JSON": (b'{"model": "x", "messages": [', 400, "not valid JSON"),
        "unknown model": ({"model": "gpt-4", "messages": HELLO, "max_tokens": 8}, 404, "does not exist"),
        "max_tokens 0": ({"model": model, "messages": HELLO, "max_tokens": 0}, 400, "at least 1"),
        "max_tokens 0, streamed": ({"model": model, "messages": HELLO, "max_tokens": 0, "stream": True}, 400,
                                   "at least 1"),
        "max_tokens huge": ({"model": model, "messages": HELLO, "max_tokens": 10**9}, 400,
                            f"maximum context length is {context} tokens"),
        "prompt longer than the context": ({"model": model, "messages": too_long, "max_tokens": 8}, 400,
                                           f"maximum context length is {context} tokens"),
        "prompt longer than the context, streamed": (
            {"model": model, "messages": too_long, "max_tokens": 8, "stream": True}, 400,
            f"maximum context length is {context} tokens"),
        "no messages": ({"model": model, "max_tokens": 8}, 400, "messages must be"),
    }


# ---------------------------------------------------------------- memory


def process_tree(pid: int) -> list[int]:
    """`pid` and the processes it started, and theirs: transformers serve runs its model in a process of its own."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            return [pid, *(tree for child in children.read().split() for tree in process_tree(int(child)))]
    except OSError:
        return [pid]


def own_rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def rss_mb(pid: int) -> float | None:
    """The resident memory of process `pid` and of every process it started (None: `pid` is gone)."""
    sizes = [own_rss_mb(process) for process in process_tree(pid)]
    return None if sizes[0] is None else sum(size or 0.0 for size in sizes)


class PeakMemory:
    """The highest resident memory of process `pid` and those it started, sampled every 0.25 s in a thread while in
    the context."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.25):
            self.peak = max(self.peak, rss_mb(self.pid) or 0.0)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------- clients


async def stream_client(client, model: str, text: str, max_tokens: int, leave_after: int | None) -> dict:
    """One streaming chat request: time to first content chunk, total time, completion tokens (from the final
    chunk's usage), and how it ended. With `leave_after`, the client closes the stream after that many content
    chunks."""
    started = time.perf_counter()
    record = {"kind": "disconnect" if leave_after else "stream", "ttft_s": None, "chunks": 0}
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})  # the usage chunk comes only when asked for
        async for chunk in stream:
            if chunk.usage is not None:
                record["completion_tokens"] = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].finish_reason:
                record["finish_reason"] = chunk.choices[0].finish_reason
            if chunk.choices and chunk.choices[0].delta.content:
                record["chunks"] += 1
                if record["ttft_s"] is None:
                    record["ttft_s"] = time.perf_counter() - started
                if leave_after and record["chunks"] >= leave_after:
                    await stream.close()
                    record["outcome"] = "left mid-stream"
                    break
        else:
            record["outcome"] = "completed"
        record["status"] = 200
    except Exception as error:  # every failure is a figure of this bench: its kind is recorded
        record.update(outcome=error_kind(error), status=getattr(error, "status_code", None),
                      error=str(error)[:300])
    record["latency_s"] = time.perf_counter() - started
    return record


def error_kind(error: Exception) -> str:
    import openai

    if isinstance(error, openai.APITimeoutError):
        return "client timeout"
    if isinstance(error, openai.APIStatusError):
        return f"HTTP {error.status_code}"
    if isinstance(error, openai.APIError):  # an error event inside a 200 stream
        return "stream error event"
    return type(error).__name__


async def bad_client(http, url: str, name: str, body, expected_status: int, words: str, delay: float) -> dict:
    await asyncio.sleep(delay)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    started = time.perf_counter()
    record = {"kind": "bad", "name": name, "expected_status": expected_status, "expected_words": words}
    try:
        response = await http.post(url, content=content, headers={"Content-Type": "application/json"})
        record["status"] = response.status_code
        try:
            record["message"] = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            record["message"] = response.text[:300]
        record["outcome"] = f"HTTP {response.status_code}"
    except Exception as error:
        record.update(status=None, outcome=type(error).__name__, message=str(error)[:300])
    record["latency_s"] = time.perf_counter() - started
    return record


async def load(base_url: str, model: str, prompts: list[str], max_tokens: int, disconnects: int, bad: dict,
               client_timeout: float) -> tuple[list[dict], float]:
    import httpx2
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", timeout=client_timeout, max_retries=0)
    http = httpx2.AsyncClient(timeout=client_timeout)
    step = max(1, len(prompts) // max(disconnects, 1))
    leaving = {index for index in range(step - 1, len(prompts), step)}
    leaving = set(sorted(leaving)[:disconnects])
    jobs = [stream_client(client, model, text, max_tokens, 3 if index in leaving else None)
            for index, text in enumerate(prompts)]
    jobs += [bad_client(http, f"{base_url}/chat/completions", name, body, status, words, 0.5 * (1 + index))
             for index, (name, (body, status, words)) in enumerate(bad.items())]
    started = time.perf_counter()
    records = await asyncio.gather(*jobs)
    wall = time.perf_counter() - started
    await client.close()
    await http.aclose()
    return list(records), wall


async def alive(base_url: str, model: str, timeout: float) -> dict:
    """/health, then one more chat request: the server still answers after the load."""
    import httpx2

    async with httpx2.AsyncClient(timeout=timeout) as http:
        health = await http.get(base_url.removesuffix("/v1") + "/health")
        started = time.perf_counter()
        answer = await http.post(f"{base_url}/chat/completions",
                                 json={"model": model, "messages": HELLO, "max_tokens": 8, "temperature": 0})
        return {"health": health.status_code, "request_status": answer.status_code,
                "request_s": time.perf_counter() - started}


# ---------------------------------------------------------------- the run


def run(folder: Path, clients: int = CLIENTS, disconnects: int = DISCONNECTS, max_tokens: int = MAX_TOKENS,
        prompt_tokens: int = PROMPT_TOKENS, work: Path | None = None, threads: int = 2,
        request_timeout: float = REQUEST_TIMEOUT) -> dict:
    """Start the server on `folder`, run the scenario, stop the server; the raw result (see `summarize`)."""
    from transformers import AutoTokenizer

    import diff_llama  # noqa: F401  (the folder's config is a DiffLlama's: its tokenizer loads without remote code)

    folder = Path(folder)
    work = Path(work or REPO / "outputs" / "serve_load")
    work.mkdir(parents=True, exist_ok=True)
    context = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    prompts = build_prompts(AutoTokenizer.from_pretrained(folder), 1, requests=clients, length=prompt_tokens)[0]
    client_timeout = request_timeout + CLIENT_MARGIN
    server = Server("transformers serve", "v2", folder, work, threads,
                    extra_args=("--device", "cpu", "--request-timeout", f"{request_timeout:g}"))
    try:
        start_s = server.wait_ready()
        base = server.base_url
        warmup = asyncio.run(alive(base, str(folder), client_timeout))
        time.sleep(SETTLE_SECONDS)
        idle = rss_mb(server.process.pid)
        print(f"server up in {start_s:.0f} s, idle {idle:.0f} MB; {clients} streams + {len(bad_requests('', 1))} bad "
              "requests", flush=True)
        load_before = os.getloadavg()[0]
        with PeakMemory(server.process.pid) as peak:
            records, wall = asyncio.run(load(base, str(folder), prompts, max_tokens, disconnects,
                                             bad_requests(str(folder), context), client_timeout))
        load_after = os.getloadavg()[0]
        time.sleep(SETTLE_SECONDS)
        after = rss_mb(server.process.pid)
        after_check = asyncio.run(alive(base, str(folder), client_timeout))
        after_check["process_running"] = server.process.poll() is None
    finally:
        server.stop()
    config = {"model": str(folder), "clients": clients, "disconnects": disconnects, "max_tokens": max_tokens,
              "prompt_tokens": prompt_tokens, "context": context, "threads": threads,
              "request_timeout_s": request_timeout, "client_timeout_s": client_timeout, "dtype": "float32",
              "server": shlex_join(server.command)}
    return {"config": config, "start_s": start_s, "warmup": warmup, "wall_s": wall, "records": records,
            "memory_mb": {"idle": idle, "peak": max(peak.peak, idle or 0), "after": after}, "after": after_check,
            "load_1min": {"before": load_before, "after": load_after},
            "server_log_errors": log_errors(server.log.read_text(errors="replace"))}


def log_errors(log: str) -> list[str]:
    """The last line of each traceback in a server log: the exceptions the server met, answered or not."""
    lines, found = log.splitlines(), []
    for index, line in enumerate(lines):
        if line.startswith("Traceback"):
            following = [other for other in lines[index + 1:] if other and not other.startswith((" ", "Traceback"))]
            found.append(following[0][:200] if following else line)
    return found


def shlex_join(command) -> str:
    import shlex

    return shlex.join(str(part) for part in command)


def percentile(values: list[float], share: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least `share` of the values at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def summarize(result: dict) -> dict:
    records, wall = result["records"], result["wall_s"]
    streams = [r for r in records if r["kind"] == "stream"]
    completed = [r for r in streams if r["outcome"] == "completed"]
    tokens = sum(r.get("completion_tokens") or 0 for r in completed)
    ttft = [r["ttft_s"] for r in records if r["kind"] != "bad" and r["ttft_s"] is not None]  # leavers' too
    latency = [r["latency_s"] for r in completed]
    errors: dict[str, int] = {}  # of the well-formed requests: what went wrong, by kind
    refusals: dict[str, int] = {}  # of the bad requests: what each got
    for record in records:
        if record["kind"] == "bad":
            refusals[record["outcome"]] = refusals.get(record["outcome"], 0) + 1
        elif record["outcome"] not in ("completed", "left mid-stream"):
            errors[record["outcome"]] = errors.get(record["outcome"], 0) + 1
    answered = [r for r in records if r.get("status") is not None]
    return {
        "streams": len(streams), "completed": len(completed),
        "left_mid_stream": sum(r["outcome"] == "left mid-stream" for r in records),
        "completion_tokens": tokens, "tokens_per_s": tokens / wall, "requests_per_s": len(answered) / wall,
        "ttft_s": {"p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)},
        "latency_s": {"p50": percentile(latency, 0.5), "p99": percentile(latency, 0.99),
                      "max": max((r["latency_s"] for r in records), default=None)},
        "errors": errors, "bad_requests": refusals,
        "finish_reasons": sorted({str(r.get("finish_reason")) for r in completed}),
    }


def survival(result: dict) -> dict:
    """What the issue asks of the server, each as a yes or no with its evidence: no 5xx and a 4xx that says why for
    every bad request, every stream answered, alive after, memory back near idle, no request past the deadline."""
    records, memory = result["records"], result["memory_mb"]
    bad = [r for r in records if r["kind"] == "bad"]
    wrong = [f"{r['name']}: {r['status']} {r.get('message', '')[:120]}" for r in bad
             if r["status"] != r["expected_status"] or r["expected_words"] not in (r.get("message") or "")]
    server_errors = [f"{r.get('name', r['kind'])}: {r['status']}" for r in records
                     if r.get("status") is not None and r["status"] >= 500]
    # a stream that completed without its usage cannot be counted in the figures: not answered as asked either
    unanswered = [r for r in records if r["kind"] != "bad" and (r["outcome"] not in ("completed", "left mid-stream")
                                                                or r["outcome"] == "completed"
                                                                and not r.get("completion_tokens"))]
    deadline = result["config"]["request_timeout_s"]
    late = [r for r in records if r["latency_s"] > deadline + 5]
    # memory: freed arenas stay mapped for a while, so "near" is the larger of 10% and 100 MB over the idle figure
    tolerance = max(0.1 * memory["idle"], 100.0)
    checks = {
        "every bad request refused with its 4xx and reason": not wrong,
        "no 5xx": not server_errors,
        "every stream answered": not unanswered,
        "alive after": result["after"]["process_running"] and result["after"]["health"] == 200
                       and result["after"]["request_status"] == 200,
        f"memory after within {tolerance:.0f} MB of idle": memory["after"] is not None
                                                          and memory["after"] - memory["idle"] <= tolerance,
        "no request past the request timeout": not late,
    }
    return {"checks": checks, "failures": [name for name, ok in checks.items() if not ok], "wrong_refusals": wrong,
            "server_errors": server_errors, "memory_tolerance_mb": tolerance,
            "unanswered": [f"{r['kind']}: {r['outcome']} "
                           + ("without its usage" if r["outcome"] == "completed" else r.get("error", "")[:120])
                           for r in unanswered]}


# ---------------------------------------------------------------- rendering


def _s(value, digits=1):
    return "—" if value is None else f"{value:.{digits}f}"


def render(result: dict) -> str:
    config, summary, checks = result["config"], result["summary"], result["survival"]
    memory = result["memory_mb"]
    lines = [
        "# `diff-llama serve` under load and bad requests",
        "",
        f"{config['clients']} concurrent streaming chat requests ({config['disconnects']} leave after 3 chunks), "
        f"{config['prompt_tokens']}-token prompts, max_tokens {config['max_tokens']}, greedy, with "
        f"{sum(r['kind'] == 'bad' for r in result['records'])} bad requests sent meanwhile; {config['threads']} "
        f"threads, {config['dtype']}, context {config['context']}, --request-timeout {config['request_timeout_s']:g} "
        f"s. Server: `{config['server']}`.",
        "",
        "| streams completed | left mid-stream | tokens | wall s | tokens/s | requests/s | TTFT p50 / p99 s | "
        "latency p50 / p99 s | slowest request s |",
        "|---:|---:|---:|---:|---:|---:|---|---|---:|",
        f"| {summary['completed']} of {summary['streams']} | {summary['left_mid_stream']} | "
        f"{summary['completion_tokens']} | {result['wall_s']:.1f} | {summary['tokens_per_s']:.1f} | "
        f"{summary['requests_per_s']:.2f} | {_s(summary['ttft_s']['p50'])} / {_s(summary['ttft_s']['p99'])} | "
        f"{_s(summary['latency_s']['p50'])} / {_s(summary['latency_s']['p99'])} | "
        f"{_s(summary['latency_s']['max'])} |",
        "",
        "Errors of the well-formed requests, by kind: "
        + (", ".join(f"{kind}: {count}" for kind, count in sorted(summary["errors"].items())) or "none")
        + ". The bad requests got: " + ", ".join(f"{kind}: {count}" for kind, count in
                                                  sorted(summary["bad_requests"].items())) + " (below).",
        "",
        f"1-minute load average of the machine: {result['load_1min']['before']:.2f} before the load, "
        f"{result['load_1min']['after']:.2f} after. Tracebacks in the server's log: {len(result['server_log_errors'])}"
        + "".join(f"; `{line}`" for line in result["server_log_errors"][:3]) + ".",
        "",
        f"Memory of the server's processes (VmRSS): idle {_s(memory['idle'], 0)} MB, peak {_s(memory['peak'], 0)} MB, "
        f"{SETTLE_SECONDS} s after the last answer {_s(memory['after'], 0)} MB. After the load: /health "
        f"{result['after']['health']}, one more request {result['after']['request_status']} in "
        f"{result['after']['request_s']:.1f} s.",
        "",
        "| bad request | status | s | message |",
        "|---|---:|---:|---|",
    ]
    for record in (r for r in result["records"] if r["kind"] == "bad"):
        message = (record.get("message") or "").replace("|", "\\|")
        lines.append(f"| {record['name']} | {record['status']} | {record['latency_s']:.2f} | {message[:200]} |")
    lines += ["", "| check | |", "|---|---|"]
    lines += [f"| {name} | {'yes' if ok else 'NO'} |" for name, ok in checks["checks"].items()]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a converted model folder")
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--disconnects", type=int, default=DISCONNECTS)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the server")
    parser.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT)
    parser.add_argument("--work-dir", default=str(REPO / "outputs" / "serve_load"), help="the server's log")
    parser.add_argument("--output", default="serve_load-cpu", help="results name under bench/results, or a path")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not (Path(args.model) / "config.json").exists():
        parser.error(f"no model folder at {args.model}: diff-llama convert smollm2 {args.model}, or pass --model")
    result = run(Path(args.model), args.clients, args.disconnects, args.max_tokens, args.prompt_tokens,
                 Path(args.work_dir), args.threads, args.request_timeout)
    result["summary"] = summarize(result)
    result["survival"] = survival(result)
    print(json.dumps({"summary": result["summary"], "failures": result["survival"]["failures"]}, indent=1))
    suite.write_result("serve_load", args.output, result, render)


if __name__ == "__main__":
    main()
