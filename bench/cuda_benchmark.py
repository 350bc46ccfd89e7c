"""Speed and memory on a CUDA GPU, in ONE run: the LLaMA against its version 1 and DIFF V2 conversions (random weights
of the real shapes; speed does not depend on the values), bf16, SDPA.

Shapes: Llama-3.2-1B (32 query heads over 8 KV heads, 16 layers) and SmolLM2-135M (9 over 3, 30 layers); `tiny` for
the dry run. The converted configs come from the converter itself (`make_layout`, `diff_config_for`): version 1 with
the default expand layout, DIFF V2 with twice the query heads over the LLaMA's KV heads. Models: `llama`;
`llama 2x heads` (V2's query heads in a plain LLaMA: the bound for V2's attention); `diff-llama v2`;
`diff-llama v2 fused` (a probe, graphs figures only, GPU only: DIFF V2 with λ, both maps of every pair and the
subtraction in one Triton kernel at one-token steps, `bench/fused_v2_decode.py`: whether any forward reaches issue
40's 0.95x); `diff-llama` (version 1, the automatic kernel choice); `diff-llama paired` (version 1 with the
`paired_sdpa_cuda` kernel forced, which keeps only d-wide tensors for backward: train figure only).

Figures, in the order the first round measures them (what the time budget cuts is at the end):
- `train`: one training step (forward + backward) at batch 1 x 4096, and its peak memory above the model and its
  gradients;
- `prefill`: 4096 tokens, batch 1, logits of the last token;
- `eager`: decoding with a dynamic cache, eager, batch 1 and 16 (tokens/s), in the first 3 rounds only;
- `graphs`: decoding with a static cache and the step compiled with `torch.compile(mode="reduce-overhead",
  fullgraph=True)`, so that CUDA graphs replay it; batch 1 and 16 (tokens/s); `llama 2x heads` too (the bound for
  DIFF V2, which has its query heads).
Decoding is timed per step, without `generate`: an untimed prefill of a 512-token prompt (`--prompt-tokens`), warm-up
steps (they compile, and record the CUDA graph), then a fixed number of steps (64 with graphs, 16 eager), greedy argmax
fed back. Every time is taken with CUDA events around the region, after its own warm-up (on the CPU: the host clock,
same code); a model's first eager sample also decodes its timed steps once untimed first, as launch-bound steps can
run several times slower early in a process.

Each round measures every figure of every model, models interleaved (A, B, C, D, then the next figure; the order
turns by one each round). The table gives each figure's median over the rounds and its spread (largest / smallest
sample), and each model's ratio to llama's median (tokens/s: above 1 is faster; time and memory: below 1 is faster
or smaller). A ratio is "unreadable" when either side's spread exceeds the difference it claims (spread - 1 >
|1 - ratio|), or when a side has a single sample.

The time budget (`--max-seconds`). The first shape takes all of it but 90 s for each later shape, which gets what
is left. A compilation costs tens of seconds where a round of the other figures costs a few, so the first round
measures the cheap figures first, then starts a compiled figure only where compiling llama and one more model still
leaves the figures measured so far time for 3 rounds (a compilation is assumed to take as long as the longest seen
so far; `--compile-estimate` before any), and each further model only where its own compilation fits; the models
are compiled in the order llama, DIFF V2, the fused probe, llama 2x heads, version 1, so version 1 is the first left
out, then the bound, then the probe. Later rounds measure a
figure for all its models or none, fewest samples first, while their last round's time fits. Results are written
after every round, so a run cut short keeps what it measured; a figure that fails (a compile error, out of memory)
is recorded with its error, and the run goes on.

Sizing: scripts/run_cuda_checks.sh leaves the benchmark about 6 of its 8 minutes after the CUDA tests, and the
compilations take most of them (the table's notes give what each took). Eager decoding is bound by launching kernels
from Python: its samples spread wider than the differences they would show, and issue 40's decoding targets read the
graphs figures. So eager decoding takes 3 samples of 16 steps (`Plan.eager_rounds`, `Plan.eager_decode_steps`), and
the time it gives back pays for the bound's two compilations per shape. SmolLM2 gets what the 1B shape leaves: its
eager figures and what compilations the rest allows.

Usage: python -m bench cuda_benchmark --output DIR [--name cuda] [--max-seconds S] [--rounds 5]
                                      [--shapes llama-3.2-1b smollm2-135m] [--figures train prefill eager graphs]
       python -m bench cuda_benchmark --dry-run --output DIR   # the same code on the tiny shape: seconds on a CPU
Writes NAME.json (with the suite's metadata) and NAME.md into DIR. scripts/run_cuda_checks.sh runs it after the CUDA
tests, with a budget that ends both within 8 minutes.
"""

import argparse
import dataclasses
import gc
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

STARTED = time.monotonic()  # before torch's import: the time budget counts it

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402

import suite  # noqa: E402
from diff_llama import DiffLlamaForCausalLM  # noqa: E402
from diff_llama.compat_diff_llama import CACHE_NAME  # noqa: E402
from diff_llama.conversion.converter import ConversionOptions, diff_config_for, make_layout  # noqa: E402

SHAPES = {
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         tie_word_embeddings=True),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True),
}
MODELS = ("llama", "llama 2x heads", "diff-llama v2", "diff-llama v2 fused", "diff-llama", "diff-llama paired")
# The order of the compilations in a graphs figure: where the budget runs short, version 1 is left out first, then the
# bound, then the fused probe; DIFF V2 against llama is what issue 40's targets read.
COMPILE_ORDER = ("llama", "diff-llama v2", "diff-llama v2 fused", "llama 2x heads", "diff-llama")
# Models measured only in the train figure: a kernel for training, which decoding never takes.
TRAIN_ONLY_MODELS = ("diff-llama paired",)
# Models measured only in the graphs figures: the probe of a one-token kernel (bench/fused_v2_decode.py).
GRAPHS_ONLY_MODELS = ("diff-llama v2 fused",)
# Models that need a CUDA GPU (a Triton kernel): a dry run on the CPU leaves them out.
CUDA_ONLY_MODELS = ("diff-llama v2 fused",)
BASELINE = "llama"
FIGURE_KINDS = ("train", "prefill", "eager", "graphs")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run measures, and how long each measurement is."""

    device: str = "cuda"
    dtype: str = "bfloat16"
    shapes: tuple = ("llama-3.2-1b", "smollm2-135m")
    models: tuple = MODELS
    graph_models: tuple = COMPILE_ORDER  # each costs a compilation per batch
    figures: tuple = FIGURE_KINDS
    batches: tuple = (1, 16)
    train_tokens: int = 4096
    prefill_tokens: int = 4096
    prompt_tokens: int = 512
    warmup_steps: int = 4  # compiled: the first call compiles, the second records the CUDA graph, the rest replay it
    decode_steps: int = 64
    # Eager decoding: fewer samples of fewer steps (see "Sizing" above), the time they give back paying for the
    # compilations of the graphs figures.
    eager_decode_steps: int = 16
    eager_rounds: int = 3
    rounds: int = 5
    min_rounds: int = 3  # rounds of the figures already measured that a first compilation must leave time for
    later_shape_seconds: float = 90.0  # kept for each shape after the first (its eager figures, a few rounds)
    max_seconds: float | None = None
    compile_mode: str | None = "reduce-overhead"
    compile_backend: str = "inductor"
    compile_estimate: float = 60.0  # seconds a first compilation is assumed to take before one is seen

    @classmethod
    def dry_run(cls, device: str, **changes) -> "Plan":
        """The same code paths on the tiny shape: seconds on a CPU. There inductor would compile C++ for minutes (and
        torch skips CUDA graphs anyway), so unless a backend is given the compiled step is dynamo's graph run eagerly:
        graph breaks and recompilations show all the same (tests/test_compiled_decoding.py checks the model's graph
        under AOTAutograd). float32 there too: many CPUs emulate bf16, and a dry run checks code, not speed."""
        values = dict(device=device, shapes=("tiny",), batches=(1, 2), train_tokens=64, prefill_tokens=64,
                      prompt_tokens=16, warmup_steps=3, decode_steps=4, eager_decode_steps=4, rounds=2,
                      compile_estimate=5.0)
        if device == "cpu":
            values["dtype"] = "float32"
            values["models"] = models_on("cpu", changes.pop("models", MODELS))
            values["graph_models"] = models_on("cpu", changes.pop("graph_models", COMPILE_ORDER))
            if "compile_backend" not in changes:
                values.update(compile_backend="eager", compile_mode=None)
        return cls(**{**values, **changes})


def models_on(device: str, names) -> tuple:
    """The models of `names` that run on `device` ("cpu" or "cuda")."""
    return tuple(name for name in names if device == "cuda" or name not in CUDA_ONLY_MODELS)


def build(name: str, shape: dict, plan: Plan) -> torch.nn.Module:
    torch.manual_seed(0)
    llama_config = LlamaConfig(**shape, max_position_embeddings=8192)
    with torch.device(plan.device):  # random initialisation on the GPU: seconds instead of a minute for 1B on a CPU
        if name == "llama":
            model = LlamaForCausalLM(llama_config)
        elif name == "llama 2x heads":
            model = LlamaForCausalLM(LlamaConfig(**{**shape, "num_attention_heads": 2 * shape["num_attention_heads"]},
                                                 max_position_embeddings=8192))
        else:
            options = ConversionOptions(diff_version=2 if name.startswith("diff-llama v2") else 1)
            config = diff_config_for(llama_config, make_layout(shape["num_attention_heads"],
                                                               shape["num_key_value_heads"], options))
            model = DiffLlamaForCausalLM(config)
            if name == "diff-llama paired":
                model.set_differential_kernel("paired_sdpa_cuda")  # where unsupported (a CPU dry run): automatic
            if name == "diff-llama v2 fused":
                import fused_v2_decode  # Triton: the GPU machines have it, this project's CPU set-up does not

                fused_v2_decode.install(model)
    model.set_attn_implementation("sdpa")
    return model.to(getattr(torch, plan.dtype)).eval()


def elapsed_seconds(device: torch.device, work) -> float:
    """Seconds `work` takes: CUDA events around it on a GPU, whose work is asynchronous (after a synchronisation, so
    that nothing queued before counts); the host clock elsewhere."""
    if device.type != "cuda":
        started = time.perf_counter()
        work()
        return time.perf_counter() - started
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def forward_backward(model, batch):
    model(batch, labels=batch).loss.backward()


def measure_train(model, batch, device) -> dict:
    model.train()
    try:
        forward_backward(model, batch)  # warm-up; the gradients stay allocated, so the peak below is the step's own
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        seconds = elapsed_seconds(device, lambda: forward_backward(model, batch))
        # No allocator statistics on the CPU: the figure is left empty there rather than measured another way.
        peak = (torch.cuda.max_memory_allocated(device) - before) / 2**30 if device.type == "cuda" else None
    finally:  # the decoding figures need the model as it was, even after an error here (out of memory)
        model.zero_grad(set_to_none=True)
        model.eval()
    return {"train step (ms)": 1000 * seconds, "train peak memory (GiB)": peak}


@torch.no_grad()
def measure_prefill(model, ids, device) -> dict:
    model(ids, logits_to_keep=1)  # warm-up
    return {"prefill (ms)": 1000 * elapsed_seconds(device, lambda: model(ids, logits_to_keep=1))}


def decoding_step(model):
    """One greedy decoding step: the next token and position from this one's, the cache written in place."""

    def step(token, position, cache):
        logits = model(input_ids=token, position_ids=position, use_cache=True, logits_to_keep=1,
                       **{CACHE_NAME: cache}).logits
        return logits[:, -1].argmax(-1, keepdim=True), position + 1

    return step


class Decoder:
    """One model prepared for decoding at one batch size: eager over a dynamic cache, or compiled over a static one.
    The static cache is made once and reset between samples, so that its tensors keep the addresses the CUDA graph
    was recorded with."""

    def __init__(self, model, compiled: bool, batch: int, plan: Plan):
        self.model, self.compiled, self.plan = model, compiled, plan
        self.step = decoding_step(model)
        self.cache = None
        self.warmed_up = compiled  # a compiled step warms up as it compiles and records its graph
        if compiled:
            options = {"mode": plan.compile_mode} if plan.compile_mode else {}
            self.step = torch.compile(self.step, backend=plan.compile_backend, fullgraph=True, dynamic=False,
                                      **options)
            self.cache = StaticCache(config=model.config,
                                     max_cache_len=plan.prompt_tokens + plan.warmup_steps + plan.decode_steps)

    def new_cache(self):
        if self.cache is None:
            return DynamicCache(config=self.model.config)
        self.cache.reset()
        return self.cache

    @torch.no_grad()
    def tokens_per_second(self, prompt, device) -> float:
        cache = self.new_cache()
        logits = self.model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{CACHE_NAME: cache}).logits
        # Contiguous like the step's own outputs: dynamo guards on strides, and a new stride would recompile.
        position = torch.full((prompt.shape[0], 1), prompt.shape[1], dtype=torch.long, device=prompt.device)
        state = [logits[:, -1].argmax(-1, keepdim=True), position]

        def steps(count):
            for _ in range(count):
                if self.compiled:
                    torch.compiler.cudagraph_mark_step_begin()
                # Copies: a CUDA graph's outputs are overwritten by its next replay.
                state[:] = [tensor.clone() for tensor in self.step(*state, cache)]

        steps(self.plan.warmup_steps)
        timed = self.plan.decode_steps if self.compiled else self.plan.eager_decode_steps
        if not self.warmed_up:
            # A model's first eager sample runs the timed steps once untimed first: launch-bound steps can run several
            # times slower early in a process, and one such sample makes a figure's spread unreadable.
            steps(timed)
            self.warmed_up = True
        seconds = elapsed_seconds(device, lambda: steps(timed))
        return prompt.shape[0] * timed / seconds


@dataclasses.dataclass
class Figure:
    """One thing measured on several models, one sample of each per round: `measure(name)` returns {label: value}."""

    key: str
    models: list
    measure: object
    compiles: bool = False
    max_samples: int | None = None  # samples of each model, at most; None: one a round


def figures_for(plan: Plan, models: dict, inputs: dict, device: torch.device) -> list:
    figures = []
    if "train" in plan.figures:
        figures.append(Figure("train", [name for name in models if name not in GRAPHS_ONLY_MODELS],
                              lambda name: measure_train(models[name], inputs["train"], device)))
    models_beyond_training = [name for name in models if name not in TRAIN_ONLY_MODELS]
    uncompiled = [name for name in models_beyond_training if name not in GRAPHS_ONLY_MODELS]
    if "prefill" in plan.figures:
        figures.append(Figure("prefill", uncompiled,
                              lambda name: measure_prefill(models[name], inputs["prefill"], device)))
    for kind in ("eager", "graphs"):
        for batch in plan.batches if kind in plan.figures else ():
            compiled = kind == "graphs"
            decoders = {}

            def measure(name, compiled=compiled, batch=batch, decoders=decoders, kind=kind):
                if name not in decoders:  # on first use: only the compilations the budget lets start
                    decoders[name] = Decoder(models[name], compiled, batch, plan)
                value = decoders[name].tokens_per_second(inputs["prompt"][:batch], device)
                return {f"decode b{batch} {kind} (tokens/s)": value}

            if compiled:
                names = [name for name in COMPILE_ORDER if name in plan.graph_models and name in models_beyond_training]
            else:
                names = uncompiled
            figures.append(Figure(f"{kind} b{batch}", names, measure, compiles=compiled,
                                  max_samples=None if compiled else plan.eager_rounds))
    return figures


class Budget:
    """The seconds one shape may still use, and what a first compilation is expected to cost: the longest one seen
    so far (carried from shape to shape), a guess before any."""

    def __init__(self, seconds: float | None, compile_estimate: float, compile_seen: bool = False):
        self.end = None if seconds is None else time.monotonic() + seconds
        self.compile_estimate, self.compile_seen = compile_estimate, compile_seen

    def allows(self, seconds: float) -> bool:
        return self.end is None or time.monotonic() + seconds <= self.end

    def saw_compilation(self, seconds: float):
        self.compile_estimate = max(self.compile_estimate, seconds) if self.compile_seen else seconds
        self.compile_seen = True


def graph_counters() -> tuple:
    """Graphs dynamo has compiled (recompilations included) and graphs inductor ran without CUDA graphs."""
    return counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]


def new_record() -> dict:
    return {"samples": {}, "graphs_compiled": {}, "cudagraph_skips": {}, "compile_seconds": {}, "errors": {},
            "left_out": []}


def take_sample(figure: Figure, name: str, record: dict, budget: Budget, device: torch.device) -> float:
    """One sample of one model into `record`; returns the seconds that were not measurement (a compilation, an
    error), which the next round's estimate leaves out."""
    graphs_before, skips_before = graph_counters()
    started = time.monotonic()
    try:
        values = figure.measure(name)
    except Exception as error:  # noqa: BLE001  one failed figure must not cost the rest of a GPU run
        record["errors"][name] = traceback.format_exception_only(type(error), error)[-1].strip()[:500]
        print(f"{figure.key}, {name}: {record['errors'][name]}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return time.monotonic() - started
    seconds = time.monotonic() - started
    record["samples"].setdefault(name, []).append(values)
    if not figure.compiles:
        return 0.0
    graphs, skips = graph_counters()
    record["graphs_compiled"].setdefault(name, []).append(graphs - graphs_before)
    record["cudagraph_skips"].setdefault(name, []).append(skips - skips_before)
    if graphs == graphs_before:
        return 0.0
    record["compile_seconds"][name] = seconds
    budget.saw_compilation(seconds)
    return seconds


def run_shape(shape_name: str, plan: Plan, budget: Budget, result: dict, save):
    """Every figure of every model at one shape into `result`, in interleaved rounds, until the rounds or the budget
    run out; `save()` after every round."""
    device = torch.device(plan.device)
    shape = SHAPES[shape_name]
    generator = torch.Generator().manual_seed(1)
    inputs = {
        "train": torch.randint(3, shape["vocab_size"], (1, plan.train_tokens), generator=generator),
        "prefill": torch.randint(3, shape["vocab_size"], (1, plan.prefill_tokens), generator=generator),
        "prompt": torch.randint(3, shape["vocab_size"], (max(plan.batches), plan.prompt_tokens), generator=generator),
    }
    inputs = {key: value.to(device) for key, value in inputs.items()}
    started = time.monotonic()
    models = {name: build(name, shape, plan) for name in plan.models}
    result.update(build_seconds=time.monotonic() - started, rounds=0, figures={})
    figures = figures_for(plan, models, inputs, device)
    records = {figure.key: result["figures"].setdefault(figure.key, new_record()) for figure in figures}
    round_seconds = {}  # figure -> seconds of its last round, compilations and errors left out
    for round_index in range(plan.rounds):
        if round_index == 0:
            for figure in figures:
                first_round(figure, records[figure.key], budget, round_seconds, plan, device)
        else:
            # Fewest samples first: where the budget runs out, it cuts the figures measured most.
            for figure in sorted(figures, key=lambda figure: len(records[figure.key]["samples"].get(BASELINE, []))):
                later_round(figure, records[figure.key], budget, round_seconds, round_index, device)
        result["rounds"] = round_index + 1
        print(f"{shape_name}: round {round_index + 1}/{plan.rounds}, {time.monotonic() - started:.0f} s", flush=True)
        save()
        if not budget.allows(0.0):
            break
    del models, figures
    gc.collect()
    torch._dynamo.reset()  # the compiled steps hold the models
    if device.type == "cuda":
        torch.cuda.empty_cache()


def first_round(figure: Figure, record: dict, budget: Budget, round_seconds: dict, plan: Plan, device):
    """Llama, then each model in turn. A compiled figure starts only where compiling llama and one more model still
    leaves the figures measured so far time for `plan.min_rounds` rounds; each further model where its own
    compilation does. Without llama's sample, the others' would have nothing to be compared with."""
    reserve = (plan.min_rounds - 1) * sum(round_seconds.values()) if figure.compiles else 0.0
    started, not_measuring = time.monotonic(), 0.0
    for index, name in enumerate(figure.models):
        compiling = budget.compile_estimate * (2 if index == 0 else 1) if figure.compiles else 0.0
        if BASELINE not in record["samples"] and name != BASELINE or not budget.allows(compiling + reserve):
            record["left_out"].append(name)
            continue
        not_measuring += take_sample(figure, name, record, budget, device)
    round_seconds[figure.key] = time.monotonic() - started - not_measuring


def later_round(figure: Figure, record: dict, budget: Budget, round_seconds: dict, round_index: int, device):
    """All the models the first round measured, or none: a round of some models only would not be interleaved. The
    order turns by one each round."""
    names = [name for name in figure.models if name in record["samples"] and name not in record["errors"]]
    if BASELINE not in names or len(names) < 2 or not budget.allows(round_seconds[figure.key]):
        return
    if figure.max_samples is not None and len(record["samples"][BASELINE]) >= figure.max_samples:
        return
    shift = round_index % len(names)
    started, not_measuring = time.monotonic(), 0.0
    for name in names[shift:] + names[:shift]:
        not_measuring += take_sample(figure, name, record, budget, device)
    round_seconds[figure.key] = time.monotonic() - started - not_measuring


def allow_compilations(count: int):
    """Every model and batch compiles the same step function once: dynamo's per-function limit must admit them."""
    config = torch._dynamo.config
    option = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, option, max(getattr(config, option), count))


def write(results: dict, folder: Path, name: str = "cuda", echo: bool = True) -> Path:
    """FOLDER/NAME.json with the run's metadata, and its markdown rendered from it (bench/suite.py)."""
    return suite.write_result("cuda_benchmark", Path(folder) / name, results, render, echo=echo)


def values_of(record: dict, label: str) -> dict:
    """{model: the samples of one figure label}, leaving out what was not measured (CPU memory)."""
    found = {}
    for name, samples in record["samples"].items():
        values = [sample[label] for sample in samples if sample.get(label) is not None]
        if values:
            found[name] = values
    return found


def spread(values) -> float:
    return max(values) / min(values) if min(values) > 0 else float("inf")


def ratio(values, baseline) -> tuple | None:
    """(median ratio, readable): unreadable when a side has one sample, or a spread wider than the difference."""
    if not values or not baseline:
        return None
    value = statistics.median(values) / statistics.median(baseline)
    readable = min(len(values), len(baseline)) > 1 and max(spread(values), spread(baseline)) - 1 <= abs(1 - value)
    return value, readable


def ratio_text(found) -> str:
    if found is None:
        return "–"
    value, readable = found
    return f"{value:.2f}x" + ("" if readable else " unreadable")


def figure_labels(record: dict) -> list:
    samples = [sample for model_samples in record["samples"].values() for sample in model_samples]
    return list(dict.fromkeys(label for sample in samples for label in sample))


def render(results: dict) -> str:
    plan = results["plan"]
    models = [name for name in MODELS if name in plan["models"]]
    others = [name for name in models if name != BASELINE]
    compile_text = (f"`torch.compile(mode={plan['compile_mode']!r}, backend={plan['compile_backend']!r}, "
                    "fullgraph=True)`")
    lines = [
        f"# CUDA speed and memory ({results['device']}, torch {results['torch']}, {plan['dtype']}, SDPA)", "",
        f"Decoding: {decode_steps_text(plan)} timed after a {plan['prompt_tokens']}-token prefill and "
        f"{plan['warmup_steps']} warm-up steps; `eager`: dynamic cache; `graphs`: static cache, step compiled with "
        f"{compile_text}. Train: batch 1 x {plan['train_tokens']}; prefill: {plan['prefill_tokens']} tokens. Each "
        "cell: median (spread = largest / smallest sample, n = samples), models interleaved round by round. Ratios "
        "are of the medians, to llama's: tokens/s above 1 is faster, time and memory below 1 faster or smaller; "
        "unreadable where a spread is wider than the difference (or n = 1).",
        f"Command: `{results['command']}`.", "",
        "| shape | figure | " + " | ".join(models) + " | " + " | ".join(f"{name} / llama" for name in others) + " |",
        "|---" * (2 + len(models) + len(others)) + "|",
    ]
    notes = []
    for shape_name, shape in results["shapes"].items():
        for key, record in shape.get("figures", {}).items():
            for label in figure_labels(record):
                found = values_of(record, label)
                cells = [measured_cell(found.get(name), record, name) for name in models]
                cells += [ratio_text(ratio(found.get(name), found.get(BASELINE))) for name in others]
                lines.append(f"| {shape_name} | {label} | " + " | ".join(cells) + " |")
            notes += figure_notes(shape_name, key, record)
        notes.append(f"{shape_name}: {shape.get('rounds', 0)} round(s), models built in "
                     f"{shape.get('build_seconds', 0):.0f} s.")
    lines += ["", *targets(results), "", *(f"- {note}" for note in notes)]
    budget = "no limit" if plan["max_seconds"] is None else f"{plan['max_seconds']:.0f} s"
    lines.append(f"- Run time {results.get('seconds', 0):.0f} s, budget {budget}.")
    return "\n".join(lines)


def decode_steps_text(plan: dict) -> str:
    """The timed steps; eager's own count where it has one (results written before it had render as they did)."""
    eager_steps = plan.get("eager_decode_steps", plan["decode_steps"])
    if eager_steps == plan["decode_steps"]:
        return f"{plan['decode_steps']} greedy steps"
    return f"{plan['decode_steps']} greedy steps ({eager_steps} eager, at most {plan['eager_rounds']} samples)"


def measured_cell(values, record: dict, name: str) -> str:
    if values:
        return f"{statistics.median(values):.4g} ({spread(values):.2f}, n={len(values)})"
    if name in record["errors"]:
        return "error"
    return "left out" if name in record["left_out"] else "–"


def figure_notes(shape_name: str, key: str, record: dict) -> list:
    notes = [f"{shape_name}, {key}, {name}: error {message}" for name, message in record["errors"].items()]
    if record["left_out"]:
        notes.append(f"{shape_name}, {key}: left out for the time budget: {', '.join(record['left_out'])}.")
    if record["compile_seconds"]:
        notes.append(f"{shape_name}, {key}: first sample with its compilation, s: " + ", ".join(
            f"{name} {seconds:.0f}" for name, seconds in record["compile_seconds"].items()))
    for name, graphs in record["graphs_compiled"].items():
        if graphs[0] != 1 or any(graphs[1:]):
            notes.append(f"{shape_name}, {key}, {name}: graphs compiled per sample {graphs} (1, then 0 expected): "
                         "a graph break or a recompilation.")
    for name, skips in record["cudagraph_skips"].items():
        if any(skips):
            notes.append(f"{shape_name}, {key}, {name}: inductor skipped CUDA graphs {sum(skips)} time(s) "
                         "(TORCH_LOGS=perf_hints says why; on a CPU it always does).")
    return notes


def targets(results: dict) -> list:
    """Issue 40's targets, each met, not met or unreadable, from the table's figures."""
    lines = ["Targets (issue 40):", ""]
    for shape_name, shape in results["shapes"].items():
        for key, record in shape.get("figures", {}).items():
            for label in figure_labels(record):
                found = values_of(record, label)
                v2 = ratio(found.get("diff-llama v2"), found.get(BASELINE))
                if key.startswith("graphs") and v2:
                    bound = ratio(found.get("llama 2x heads"), found.get(BASELINE))
                    lines.append(f"- {shape_name}, {label}: DIFF V2 {ratio_text(v2)} of llama, target ≥ 0.95x: "
                                 f"{verdict(v2, v2[0] >= 0.95)}"
                                 + (f" (its bound, llama 2x heads: {ratio_text(bound)})" if bound else ""))
                fused = ratio(found.get("diff-llama v2 fused"), found.get(BASELINE))
                if key.startswith("graphs") and fused:
                    lines.append(f"- {shape_name}, {label}: probe, DIFF V2 with λ, both maps and the subtraction in one "
                                 f"kernel {ratio_text(fused)} of llama, ≥ 0.95x: {verdict(fused, fused[0] >= 0.95)}")
                if key.startswith("eager") and v2:
                    bound = ratio(found.get("llama 2x heads"), found.get(BASELINE))
                    if bound:
                        both = (v2[0], v2[1] and bound[1])
                        lines.append(f"- {shape_name}, {label}: DIFF V2 {ratio_text(v2)} of llama, target ≥ llama 2x "
                                     f"heads' {ratio_text(bound)}: {verdict(both, v2[0] >= bound[0])}")
                for name in ("diff-llama", "diff-llama paired"):
                    v1 = ratio(found.get(name), found.get(BASELINE))
                    if label.startswith("train peak memory") and v1:
                        lines.append(f"- {shape_name}, {label}: version 1 ({name}) {ratio_text(v1)} of llama, target "
                                     f"≤ 1.15x: {verdict(v1, v1[0] <= 1.15)}")
    return lines if len(lines) > 2 else ["Targets (issue 40): none of their figures measured."]


def verdict(found: tuple, met: bool) -> str:
    return "unreadable" if not found[1] else ("met" if met else "not met")


def with_baseline(names):
    """The models named, in the table's order, llama among them; None when none are named."""
    return names and tuple(name for name in MODELS if name == BASELINE or name in names)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="folder for NAME.json and NAME.md")
    parser.add_argument("--name", default="cuda", help="file name of the results, without .json/.md (default cuda)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the tiny shape, a few steps and 2 rounds: every code path in seconds, on the CPU too")
    parser.add_argument("--device", help="cuda (the default) or cpu (with --dry-run, the default without CUDA)")
    parser.add_argument("--max-seconds", type=float, help="time budget: no figure or round starts that would end "
                        "after it (default: none)")
    parser.add_argument("--rounds", type=int, help=f"most rounds (default {Plan.rounds}; dry run 2)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), help=f"default {' '.join(Plan.shapes)}")
    parser.add_argument("--figures", nargs="+", choices=FIGURE_KINDS, help="default: all, in this order")
    parser.add_argument("--models", nargs="+", choices=MODELS, metavar="MODEL",
                        help=f"from {list(MODELS)}; llama, the baseline, is always measured (default: all)")
    parser.add_argument("--graph-models", nargs="+", choices=MODELS, metavar="MODEL",
                        help=f"models decoded with CUDA graphs, each compiled per batch (default: "
                             f"{' '.join(Plan.graph_models)})")
    parser.add_argument("--decode-steps", type=int,
                        help=f"timed decoding steps with graphs (default {Plan.decode_steps})")
    parser.add_argument("--eager-decode-steps", type=int,
                        help=f"timed decoding steps eager (default {Plan.eager_decode_steps})")
    parser.add_argument("--prompt-tokens", type=int, help=f"prompt before decoding (default {Plan.prompt_tokens})")
    parser.add_argument("--compile-backend", help="torch.compile backend of the graphs figures (default inductor; "
                        "dry run on a CPU: eager, dynamo's graph run eagerly)")
    parser.add_argument("--compile-estimate", type=float,
                        help="seconds assumed for a first compilation until one is seen "
                             f"(default {Plan.compile_estimate:.0f})")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() or not args.dry_run else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run (the tiny shape on the CPU) or --device cpu")
    changes = {key: value for key, value in dict(
        device=device, max_seconds=args.max_seconds, rounds=args.rounds,
        shapes=args.shapes and tuple(args.shapes), figures=args.figures and tuple(args.figures),
        models=with_baseline(args.models), graph_models=with_baseline(args.graph_models),
        decode_steps=args.decode_steps, eager_decode_steps=args.eager_decode_steps,
        prompt_tokens=args.prompt_tokens, compile_backend=args.compile_backend,
        compile_estimate=args.compile_estimate).items() if value is not None}
    if device == "cpu":  # the Triton probe runs on a GPU only
        changes.update(models=models_on("cpu", changes.get("models", MODELS)),
                       graph_models=models_on("cpu", changes.get("graph_models", COMPILE_ORDER)))
    if args.compile_backend and args.compile_backend != "inductor":
        changes["compile_mode"] = None  # modes are inductor's
    plan = Plan.dry_run(**changes) if args.dry_run else Plan(**changes)
    if args.dry_run and device == "cpu":
        torch.set_num_threads(1)  # a dry run checks code, not speed: threads spinning on a shared CPU cost it twice
    run(plan, Path(args.output), args.name, started=STARTED)


def run(plan: Plan, folder: Path, name: str, started: float | None = None) -> dict:
    """Measure `plan` into FOLDER/NAME.{json,md}; its time budget counts from `started` (time.monotonic())."""
    allow_compilations(2 * len(plan.graph_models) * len(plan.batches))
    started = time.monotonic() if started is None else started
    results = {"device": torch.cuda.get_device_name() if plan.device == "cuda" else f"CPU ({plan.device})",
               "torch": torch.__version__, "plan": dataclasses.asdict(plan),
               "command": suite.COMMAND or shlex.join(["python", "bench/cuda_benchmark.py", *sys.argv[1:]]),
               "shapes": {}}

    def save():
        results["seconds"] = time.monotonic() - started
        write(results, folder, name, echo=False)

    budget = Budget(None, plan.compile_estimate)
    for index, shape_name in enumerate(plan.shapes):
        left = None if plan.max_seconds is None else max(0.0, plan.max_seconds - (time.monotonic() - started))
        later = len(plan.shapes) - index - 1
        # The first shape takes what the later ones leave it (what it does not use passes on to them); the compile
        # time learnt on one shape guides the next.
        share = None if left is None else max(left - later * plan.later_shape_seconds, left / (later + 1))
        budget = Budget(share, budget.compile_estimate, budget.compile_seen)
        results["shapes"][shape_name] = {}
        run_shape(shape_name, plan, budget, results["shapes"][shape_name], save)
    results["seconds"] = time.monotonic() - started
    write(results, folder, name)
    return results


if __name__ == "__main__":
    main()
