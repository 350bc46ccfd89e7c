"""The retrieval question on a CUDA GPU, in ONE run of five minutes (issue 40 §5): SmolLM2-135M-Instruct and its exact
DIFF V2 conversion, trained alike by `diff-llama adapt`, then scored on the same cases from two independent
generators, with the paired McNemar test per generator and pooled. The test, its sample sizes and what counts as
confirmed were declared before any run: docs/results/2026-11-27-gpu-retrieval-declaration.md.

Steps, each a `diff-llama` command or the project's own scoring functions:
1. `diff-llama convert SOURCE WORK/v2 --diff-version 2` (exact) while `diff-llama adapt SOURCE WORK/adapted-source`
   trains the source; then `diff-llama adapt WORK/v2 WORK/adapted-v2` with the same options. The example stream
   depends on the seed alone, so both models train on the same examples. The recipe is `adapt`'s default (90 steps,
   examples up to 4K tokens), the one whose gain on the project's own cases is in question; its probes run at the
   start and the end only (they do not change the training).
2. The cases: the project's own (`retrieval.case_plan` and `make_case`, what `diff-llama evaluate` builds: the
   multi-needle settings 4x2 and 6x2 at 2K and 4K tokens, seed 7, never used before), and RULER's, built by lm-eval's
   RULER code on a CPU and saved in bench/cases/ (lm-eval is not needed here).
3. `--workers` scoring processes per model start with the run: while the models train, they import, and build the
   own cases with the source's tokenizer (a share each, written to WORK/cases/ for all); a trained model uses them
   when its tokenizer is the same (it is: `adapt` saves the source's), else builds its own. A process scores
   `--batch` cases at a time, each generator's in one left-padded batch, with `retrieval.run_cases` (what `diff-llama
   evaluate` runs a case with) or, for RULER's, `retrieval.ruler.run_ruler_cases` (as `diff-llama ruler` does): a
   row's answer is the case's alone (tests/test_retrieval.py checks it). On a GPU a decoding step of a 135M model is
   kernel launches; the processes' kernels take turns on the GPU, so the first run's 7 processes a model, one case
   each, spent 65-80 ms a step, and a batch's rows share each launch. The cases are shuffled with a fixed seed, and
   every process takes the next cases nobody took, of whichever trained model has the fewer cases taken: the
   source's first, while DIFF V2 still trains, then DIFF V2's until it caught up. So no process waits for the other
   model, and a run cut short has scored a random subset of every cell, about the same one for both models.
4. The cases both models scored are paired; the exact McNemar test (`retrieval.paired_comparison`) per generator and
   pooled; NAME.json (with the suite's metadata) and NAME.md.

The time guard (`--max-seconds`, the whole run): `adapt` gets 35% of it as its own training budget (it stops early
and says so; the run then does not count as the declared one), the trainings are stopped at 60%, the scoring
processes 15 seconds before the end; every result a worker wrote until then is kept (each case is appended to its
file as it is scored) and the report is written from them.

Usage: python -m bench cuda_retrieval --model SOURCE --output DIR --work DIR [--name cuda-retrieval]
                                      [--max-seconds S] [--workers W] [--batch B] [--dry-run]
scripts/run_cuda_retrieval.sh runs it on a GPU machine (the model arrives there in two calls; see that script).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

STARTED = time.monotonic()  # the time budget counts the imports too

import suite  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RULER_CASES = REPO / "bench" / "cases" / "ruler-smollm2-2k-4k.json.gz"
DECLARATION = "docs/results/2026-11-27-gpu-retrieval-declaration.md"
ALPHA = 0.05
MIN_PAIRS = 1000  # the declared sample: fewer paired cases and the run does not test the declaration
MODELS = ("source", "v2")
LABELS = {"source": "SmolLM2-135M-Instruct, adapted", "v2": "DIFF V2 conversion, adapted"}
GENERATORS = {"own": "the project's own (`make_cases`)", "ruler": "RULER (lm-eval's RULER code)"}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run trains and scores, and how its time is shared out."""

    device: str = "cuda"
    dtype: str = "bfloat16"  # the scored models' weights; training autocasts (`adapt --autocast auto`)
    steps: int = 90  # adapt's default recipe
    adapt_options: tuple = ()  # more `diff-llama adapt` options (the dry run's short examples)
    own_lengths: tuple = (2048, 4096)
    own_settings: tuple = ("4x2", "6x2")
    own_depths: tuple = (0.0, 25.0, 50.0, 75.0, 100.0)
    own_cases_per_depth: int = 25
    own_seed: int = 7
    ruler_file: str = str(RULER_CASES)
    ruler_lengths: tuple | None = None  # None: every length in the file
    ruler_cases_per_cell: int | None = None  # None: every case of each (task, length)
    workers: int = 4  # scoring processes per model
    batch: int = 16  # cases a scoring process scores at once (one model's, one generator's)
    max_seconds: float | None = None
    training_share: float = 0.35  # adapt's own budget, of the training steps alone
    training_stop: float = 0.6  # the trainings (and the conversion) are stopped at this share of the budget
    report_seconds: float = 15.0  # kept at the end for the report
    dry_run: bool = False

    @classmethod
    def for_dry_run(cls, device: str, **changes) -> "Plan":
        """The same steps with a tiny budget: two training steps on short examples, five cases a model."""
        values = dict(device=device, dtype="float32", steps=2, own_lengths=(512,), own_settings=("2x1",),
                      own_depths=(0.0, 100.0), own_cases_per_depth=1, ruler_lengths=(2048,), ruler_cases_per_cell=1,
                      workers=1, batch=3, dry_run=True,
                      adapt_options=("--min-length", "384", "--max-length", "512", "--max-needles", "2",
                                     "--max-queries", "2", "--text-block", "128", "--warmup-steps", "1",
                                     "--eval-lengths", "512", "--eval-settings", "2x1"))
        return cls(**{**values, **changes})

    def declared_pairs(self, ruler_cases: int) -> dict:
        own = (len(self.own_lengths) * len(self.own_settings) * len(self.own_depths) * self.own_cases_per_depth)
        return {"own": own, "ruler": ruler_cases}


class Job:
    """One child process (a `diff-llama` command or a scoring worker), its log, and how it ended."""

    def __init__(self, name: str, command: list, log: Path):
        self.name, self.command, self.log = name, [str(part) for part in command], log
        self.started = time.monotonic()
        with open(log, "w") as handle:
            self.process = subprocess.Popen(self.command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO)
        self.stopped_by_guard = False
        self.seconds = None

    def poll(self) -> int | None:
        code = self.process.poll()
        if code is not None and self.seconds is None:
            self.seconds = time.monotonic() - self.started
        return code

    def stop(self):
        """Stop it at the time limit: SIGTERM, then SIGKILL after 5 seconds."""
        if self.poll() is not None:
            return
        self.stopped_by_guard = True
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.poll()

    def record(self) -> dict:
        return {"command": shlex.join(self.command), "returncode": self.poll(), "stopped_by_time_guard":
                self.stopped_by_guard, "seconds": None if self.seconds is None else round(self.seconds, 1)}


def cli(*args) -> list:
    return [sys.executable, "-m", "diff_llama.cli", *args]


def adapt_command(plan: Plan, model, output: Path, name: str) -> list:
    """The same `diff-llama adapt` options for both models; only the model, its folder and its label differ."""
    budget = max(1.0, plan.training_share * plan.max_seconds) if plan.max_seconds else 3600.0
    return cli("adapt", model, output, "--name", name, "--max-steps", plan.steps, "--max-seconds", f"{budget:.0f}",
               "--eval-every", 0, "--eval-cases", 1, "--threads", 1, "--seed", 0, *plan.adapt_options)


def own_options(plan: Plan):
    """The project's own cases: what `diff-llama evaluate --lengths ... --settings ... --depths ...
    --cases-per-depth ... --seed ...` scores."""
    from diff_llama.options import RetrievalArguments

    return RetrievalArguments(lengths=list(plan.own_lengths), settings=list(plan.own_settings),
                              depths=list(plan.own_depths), cases_per_depth=plan.own_cases_per_depth,
                              seed=plan.own_seed)


def select_ruler_cases(plan: Plan) -> dict:
    """The saved RULER file's description and the cases this plan scores."""
    from diff_llama.retrieval.ruler_cases import read_case_file

    contents = read_case_file(plan.ruler_file)
    cases = [case for case in contents["cases"]
             if (plan.ruler_lengths is None or case["length"] in plan.ruler_lengths)
             and (plan.ruler_cases_per_cell is None or case["index"] < plan.ruler_cases_per_cell)]
    return {"about": {key: value for key, value in contents.items() if key != "cases"}, "cases": cases}


def shuffled(keys: list[str]) -> list[str]:
    """The case keys in the order every worker scores them (fixed seed): a run stopped early has a random subset of
    every cell, and the same one for both models."""
    keys = list(keys)
    random.Random(0).shuffle(keys)
    return keys


def worker_names(workers: int) -> list[tuple[str, str]]:
    """(name, home model) of each scoring process: `workers` per model."""
    return [(f"score-{model}-{index}", model) for model in MODELS for index in range(workers)]


def claim(work: Path, model: str, index: int) -> bool:
    """Take case `index` of `model` for this worker, if no worker has (an exclusive create: one winner)."""
    try:
        os.close(os.open(work / "claims" / model / str(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def claimed(work: Path, model: str) -> int:
    return len(os.listdir(work / "claims" / model))


def model_state(work: Path, model: str) -> str | None:
    """"ok" once the run saved the trained model, "failed" if it never will, None while its training runs."""
    path = work / f"ready-{model}"
    return path.read_text() if path.exists() else None


def tokenizer_identity(tokenizer) -> tuple:
    """What decides the token ids of a case: the tokenizer's own definition, its chat template and special tokens."""
    return (type(tokenizer).__name__, tokenizer.backend_tokenizer.to_str(), tokenizer.chat_template,
            sorted(tokenizer.special_tokens_map.items()))


class Worker:
    """A scoring process. It starts with the run: while the models train it builds its share of the own cases with
    the source's tokenizer (written to WORK/cases/ for every worker), then scores case after case, the model whose
    cases are least advanced first (its home model on a tie), so that both models go through the cases in the same
    order and neither waits for the other's training."""

    def __init__(self, spec: dict):
        from diff_llama.options import RetrievalArguments
        from diff_llama.retrieval import case_plan
        from diff_llama.retrieval.ruler_cases import read_case_file

        self.spec, self.work = spec, Path(spec["work"])
        self.keys = spec["keys"]
        self.own = {case["seed"]: case for case in case_plan(RetrievalArguments(**spec["own_options"]))}
        self.ruler = {case["id"]: case for case in read_case_file(spec["ruler_file"])["cases"]}
        self.models, self.prebuilt, self.read, self.cursor = {}, {}, set(), {model: 0 for model in MODELS}

    def build_share(self):
        """Build this worker's share of the own cases with the source's tokenizer and write them for every worker;
        a trained model uses them only if its tokenizer is the same (`tokenizer_identity`)."""
        from diff_llama.resolve import load_tokenizer
        from diff_llama.retrieval import make_case

        self.source_tokenizer = load_tokenizer(self.spec["source"])
        cases = {key: dataclasses.asdict(make_case(self.source_tokenizer, **self.own[key.partition("/")[2]]))
                 for key in self.spec["build"]}
        folder = self.work / "cases"
        partial = folder / f".{self.spec['name']}.json"
        partial.write_text(json.dumps(cases))
        os.replace(partial, folder / f"{self.spec['name']}.json")  # whole or absent for the readers

    def load(self, name: str):
        """The trained model `name` (loaded once), and whether the prebuilt own cases are its own."""
        if name not in self.models:
            from diff_llama.resolve import load_model

            model, tokenizer = load_model(str(self.work / f"adapted-{name}"), self.spec["dtype"], self.spec["device"])
            same = tokenizer_identity(tokenizer) == tokenizer_identity(self.source_tokenizer)
            if same and self.spec["build"]:  # and, to be sure, one case built both ways
                from diff_llama.retrieval import make_case

                key = self.spec["build"][0]
                again = make_case(tokenizer, **self.own[key.partition("/")[2]])
                same = self.own_case(key, tokenizer, True) == again
            self.models[name] = (model, tokenizer, same)
        return self.models[name]

    def own_case(self, key: str, tokenizer, same: bool):
        """An own case as `evaluate` builds it with `tokenizer`: prebuilt when the tokenizer is the source's."""
        from diff_llama.retrieval import make_case
        from diff_llama.retrieval.cases import NeedleCase

        if same and key not in self.prebuilt:  # read the shares written since the last look
            for file in sorted(set((self.work / "cases").glob("score-*.json")) - self.read):
                self.prebuilt.update(json.loads(file.read_text()))
                self.read.add(file)
        if same and key in self.prebuilt:
            return NeedleCase(**self.prebuilt[key])
        return make_case(tokenizer, **self.own[key.partition("/")[2]])

    def next_cases(self) -> tuple[str, list[int]] | None:
        """(model, case indices) claimed for this worker, up to a batch of one model's cases; None once every case of
        every model is taken or cannot be."""
        while True:
            waiting, open_models = False, []
            for name in MODELS:
                state = model_state(self.work, name)
                waiting = waiting or state is None
                if state == "ok" and self.cursor[name] < len(self.keys):
                    open_models.append(name)
            open_models.sort(key=lambda name: (claimed(self.work, name), name != self.spec["home"]))
            for name in open_models:
                taken = []
                while self.cursor[name] < len(self.keys) and len(taken) < self.spec["batch"]:
                    index = self.cursor[name]
                    self.cursor[name] += 1
                    if claim(self.work, name, index):
                        taken.append(index)
                if taken:
                    return name, taken
            if not waiting:
                return None
            time.sleep(0.2)

    def score(self, name: str, keys: list[str]) -> list[dict]:
        """The cases `keys` of model `name`, each generator's in one batch (`retrieval.evaluate.scored_cases`, as
        `diff-llama evaluate` scores a case; `retrieval.ruler.run_ruler_cases`, as `diff-llama ruler` does). A case's
        seconds are its share of its batch's."""
        from diff_llama.retrieval.evaluate import scored_cases
        from diff_llama.retrieval.ruler import run_ruler_cases

        model, tokenizer, same = self.load(name)
        scored = []
        for generator in GENERATORS:
            batch = [key for key in keys if key.partition("/")[0] == generator]
            if not batch:
                continue
            started = time.perf_counter()
            if generator == "own":
                cases = [self.own_case(key, tokenizer, same) for key in batch]
                built = time.perf_counter()
                results = scored_cases(model, tokenizer, cases)
            else:
                built = started
                results = run_ruler_cases(model, tokenizer, [self.ruler[key.partition("/")[2]] for key in batch])
            share, build_share = (time.perf_counter() - started) / len(batch), (built - started) / len(batch)
            done_at = round(time.time() - self.spec["run_started"], 1)
            for key, result in zip(batch, results):
                # Where a case's time goes: building it, and its answer's length (a decoding step a token).
                result.update(seconds=round(share, 3), build_seconds=round(build_share, 3), batch=len(batch),
                              worker=self.spec["name"], done_at=done_at,
                              answer_tokens=len(tokenizer(result["output"], add_special_tokens=False).input_ids))
                scored.append({"key": key, "generator": generator, **result})
        return scored

    def run(self) -> int:
        import torch

        self.build_share()
        torch.empty(0, device=self.spec["device"])  # the device's context, made while the models train
        files = {}
        try:
            while (taken := self.next_cases()) is not None:
                name, indices = taken
                if name not in files:
                    files[name] = open(self.work / f"results-{name}-{self.spec['name']}.jsonl", "a")
                for result in self.score(name, [self.keys[index] for index in indices]):
                    files[name].write(json.dumps(result) + "\n")
                files[name].flush()
        finally:
            for handle in files.values():
                handle.close()
        return 0


def score_share(spec_file: str) -> int:
    """A worker (see `Worker`), from the spec the run wrote for it."""
    import torch

    torch.set_num_threads(1)  # the GPU does the work; a core per worker
    return Worker(json.loads(Path(spec_file).read_text())).run()


def read_results(files) -> dict:
    """{key: result} from workers' files; a line cut short when a worker was stopped is left out."""
    found = {}
    for file in files:
        if not Path(file).exists():
            continue
        for line in Path(file).read_text().splitlines():
            try:
                result = json.loads(line)
            except ValueError:
                continue
            found[result["key"]] = result
    return found


def compare(results: dict, keys: list[str]) -> dict:
    """Pairs scored by both models, in the cases' order, and the paired test per generator and pooled."""
    from diff_llama.retrieval import paired_comparison

    paired = [key for key in keys if all(key in results[name] for name in MODELS)]
    comparison = {}
    for generator in (*GENERATORS, "pooled"):
        subset = [key for key in paired if generator == "pooled" or key.startswith(generator + "/")]
        first, second = ([results[name][key] for key in subset] for name in MODELS)
        comparison[generator] = {**paired_comparison(first, second, key="key"),
                                 "source_right": sum(r["correct"] for r in first),
                                 "v2_right": sum(r["correct"] for r in second)}
    return comparison


def cell_of(result: dict) -> str:
    if result["generator"] == "own":
        return f"own/{result['length']}/{result['num_needles']}x{result['num_queries']}"
    return f"ruler/{result['length']}/{result['task']}"


def accuracy_by_cell(results: dict, keys: list[str]) -> dict:
    """{cell: [pairs, source right, V2 right]} over the paired cases."""
    cells = {}
    for key in keys:
        if all(key in results[name] for name in MODELS):
            row = cells.setdefault(cell_of(results["source"][key]), [0, 0, 0])
            row[0] += 1
            row[1] += results["source"][key]["correct"]
            row[2] += results["v2"][key]["correct"]
    return cells


def reading(test: dict, counts: bool) -> str:
    """What a test says under the declaration: only a complete run counts."""
    if not counts:
        return "does not count (see notes)"
    if test["p_value"] >= ALPHA:
        return "no difference shown"
    return "DIFF V2 ahead" if test["only_second"] > test["only_first"] else "source ahead"


def training_history(work: Path, name: str) -> dict | None:
    path = work / f"adapted-{name}" / "adapt.json"
    return json.loads(path.read_text()) if path.exists() else None


def notes_on(result: dict) -> list[str]:
    """Why a run does not count as the declared test (empty when it does)."""
    notes = []
    if result["plan"]["dry_run"]:
        notes.append("dry run: the code path on a tiny budget, not the declared run")
    for name in MODELS:
        history = result["training"].get(name)
        if history is None:
            notes.append(f"{LABELS[name]}: no training finished")
        elif history.get("stopped_by_budget") or len(history["steps"]) != result["plan"]["steps"]:
            notes.append(f"{LABELS[name]}: trained {len(history['steps'])} of {result['plan']['steps']} steps")
    if result["mismatched_prompts"]:
        notes.append(f"{len(result['mismatched_prompts'])} paired cases differ between the models' prompts")
    pairs = result["comparison"]["pooled"]["cases"]
    if pairs < MIN_PAIRS and not result["plan"]["dry_run"]:
        notes.append(f"{pairs} paired cases, fewer than the declared {MIN_PAIRS}")
    for name, job in result["jobs"].items():
        if job["stopped_by_time_guard"]:
            notes.append(f"{name} was stopped by the time guard")
        elif job["returncode"] not in (0, None):
            notes.append(f"{name} failed (exit {job['returncode']}; see logs.txt)")
    return notes


class Run:
    """The steps of one run and the time guard over them."""

    def __init__(self, plan: Plan, model: str, work: Path, started: float):
        self.plan, self.model, self.work, self.started = plan, model, work, started
        self.jobs: dict[str, Job] = {}
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        if self.plan.max_seconds is None:
            return float("inf")
        return self.plan.max_seconds - (time.monotonic() - self.started)

    def start(self, name: str, command: list):
        print(f"[{time.monotonic() - self.started:6.1f} s] start {name}", flush=True)
        self.jobs[name] = Job(name, command, self.logs / f"{name}.log")

    def finished(self, name: str) -> bool:
        return name in self.jobs and self.jobs[name].poll() is not None

    def start_workers(self, keys: list, spec: dict):
        """Every scoring process at once: they build the own cases and load what they need while the models train."""
        for model in MODELS:
            (self.work / "claims" / model).mkdir(parents=True, exist_ok=True)
        (self.work / "cases").mkdir(exist_ok=True)
        names = worker_names(self.plan.workers)
        own_keys = [key for key in keys if key.startswith("own/")]
        for index, (name, home) in enumerate(names):
            spec_file = self.work / f"{name}.json"
            spec_file.write_text(json.dumps({**spec, "name": name, "home": home, "keys": keys, "work": str(self.work),
                                             "build": own_keys[index::len(names)]}))
            self.start(name, [sys.executable, "-m", "bench", "cuda_retrieval", "--score", spec_file])

    def execute(self) -> dict:
        plan, work = self.plan, self.work
        self.start("convert", cli("convert", self.model, work / "v2", "--diff-version", 2, "--no-evaluate"))
        self.start("adapt-source", adapt_command(plan, self.model, work / "adapted-source", LABELS["source"]))
        from diff_llama.retrieval import case_plan  # after the first steps started: it imports torch

        options = own_options(plan)
        own, ruler = case_plan(options), select_ruler_cases(plan)
        keys = [f"own/{case['seed']}" for case in own] + [f"ruler/{case['id']}" for case in ruler["cases"]]
        spec = {"device": plan.device, "dtype": plan.dtype, "batch": plan.batch,
                "own_options": dataclasses.asdict(options),
                "ruler_file": plan.ruler_file, "source": self.model,
                "run_started": time.time() - (time.monotonic() - self.started)}  # the run's clock, for done_at
        try:
            self.guard(lambda: self.start_workers(shuffled(keys), spec))
        finally:  # an error here (or Ctrl-C) leaves no process behind
            for job in self.jobs.values():
                job.stop()
        results = {model: read_results(self.work.glob(f"results-{model}-*.jsonl")) for model in MODELS}
        return self.report(own, ruler, keys, results)

    def announce(self, model: str, state: str):
        """Tell the workers whether a trained model is there to score ("ok") or never will be ("failed")."""
        path = self.work / f"ready-{model}"
        if not path.exists():
            (self.work / f".ready-{model}").write_text(state)
            os.replace(self.work / f".ready-{model}", path)  # whole or absent for the workers

    def guard(self, start_workers):
        """Start each step once what it needs is there, tell the workers which models they can score, and stop what
        still runs when its time is up. The workers start as the conversion ends: long before the first training
        does, and without taking the conversion's CPU on a small machine."""
        plan, work = self.plan, self.work
        training_end = plan.training_stop * plan.max_seconds if plan.max_seconds else None
        while True:
            elapsed = time.monotonic() - self.started
            in_time = self.left() >= plan.report_seconds
            if in_time and self.jobs["convert"].poll() is not None and not any(
                    name.startswith("score-") for name in self.jobs):
                start_workers()
            if "adapt-v2" not in self.jobs and self.jobs["convert"].poll() is not None:
                if (in_time and (training_end is None or elapsed < training_end)
                        and self.jobs["convert"].poll() == 0):
                    self.start("adapt-v2", adapt_command(plan, work / "v2", work / "adapted-v2", LABELS["v2"]))
                else:
                    self.announce("v2", "failed")
            for model in MODELS:
                if self.finished(f"adapt-{model}"):
                    self.announce(model, "ok" if self.jobs[f"adapt-{model}"].poll() == 0 else "failed")
            if all(job.poll() is not None for job in self.jobs.values()):  # after what this round started
                break
            if training_end is not None and elapsed > training_end:
                for name in ("convert", "adapt-source", "adapt-v2"):
                    if name in self.jobs and self.jobs[name].poll() is None:
                        print(f"[{elapsed:6.1f} s] time guard: stopping {name}", flush=True)
                        self.jobs[name].stop()
            if not in_time:
                print(f"[{elapsed:6.1f} s] time guard: stopping what still runs", flush=True)
                for job in self.jobs.values():
                    job.stop()
            time.sleep(0.5)

    def report(self, own: list, ruler: dict, keys: list, results: dict) -> dict:
        plan = self.plan
        seconds = [r["seconds"] for model in MODELS for r in results[model].values()]
        paired = [key for key in keys if all(key in results[model] for model in MODELS)]
        # Each model's cases came from its own tokenizer (or the same one): the pairs must have been the same prompts.
        mismatched = [key for key in paired if any(results["source"][key][field] != results["v2"][key][field]
                                                   for field in ("prompt_tokens", "expected"))]
        return {"plan": dataclasses.asdict(plan), "model": self.model, "device": plan.device,
                "declaration": DECLARATION,
                "cases": {"own": {"generator": "diff_llama.retrieval.make_cases", "count": len(own),
                                  "lengths": list(plan.own_lengths), "settings": list(plan.own_settings),
                                  "depths": list(plan.own_depths), "cases_per_depth": plan.own_cases_per_depth,
                                  "seed": plan.own_seed},
                          "ruler": {**ruler["about"], "file": os.path.relpath(plan.ruler_file, REPO),
                                    "count": len(ruler["cases"])}},
                "declared_pairs": plan.declared_pairs(len(ruler["cases"])),
                "training": {model: training_history(self.work, model) for model in MODELS},
                "mismatched_prompts": mismatched,
                "jobs": {name: job.record() for name, job in self.jobs.items()},
                "comparison": compare(results, keys), "accuracy_by_cell": accuracy_by_cell(results, keys),
                "median_case_seconds": {model: statistics.median([r["seconds"] for r in results[model].values()])
                                        if results[model] else None for model in MODELS},
                "scored": {model: len(results[model]) for model in MODELS},
                "seconds_per_answer_token": {model: seconds_per_answer_token(results[model].values())
                                             for model in MODELS},
                "results": {model: [results[model][key] for key in keys if key in results[model]]
                            for model in MODELS},
                "seconds": round(time.monotonic() - self.started, 1), "case_seconds_total": round(sum(seconds), 1)}


def seconds_per_answer_token(results) -> float | None:
    """The cases' scoring time (without building them; a case's share of its batch) over their answers' tokens and
    the one that ended each, in all: a decoding step's time over the rows of its batch, the prefill included."""
    timed = [r for r in results if "answer_tokens" in r]
    steps = sum(r["answer_tokens"] + 1 for r in timed)
    return round(sum(r["seconds"] - r["build_seconds"] for r in timed) / steps, 4) if steps else None


def write_logs(work: Path, output: Path):
    """Every child's log in one file (a GPU run brings back a few files only)."""
    parts = []
    for log in sorted((work / "logs").glob("*.log")):
        parts.append(f"==== {log.stem}\n{log.read_text(errors='replace')[-20000:]}")
    (output / "logs.txt").write_text("\n".join(parts))


def run(plan: Plan, model: str, output: Path, work: Path, name: str = "cuda-retrieval",
        started: float = STARTED) -> Path:
    """The run (`started`: when its budget began), its logs and its report in `output`; returns the JSON."""
    output.mkdir(parents=True, exist_ok=True)
    result = Run(plan, model, work, started).execute()
    write_logs(work, output)
    return suite.write_result("cuda_retrieval", output / name, result, render, echo=False)  # the script prints it


def _pct(right: int, cases: int) -> str:
    return f"{right} ({right / cases:.0%})" if cases else "–"


def render(result: dict) -> str:
    plan, comparison, notes = result["plan"], result["comparison"], notes_on(result)
    counts = not notes
    declared = result["declared_pairs"]
    ruler = result["cases"]["ruler"]
    lines = [
        f"Retrieval after the same training ({plan['steps']} steps of `diff-llama adapt`, the same examples): "
        f"SmolLM2-135M-Instruct (the source) against its DIFF V2 conversion, on the same cases ({plan['device']}, "
        f"{plan['dtype']} weights, greedy). Declared before the run: {result['declaration']}. Exact McNemar test, "
        f"two-sided, α = {ALPHA}.", "",
        "| cases | pairs / declared | source right | DIFF V2 right | only source | only DIFF V2 | p | reading |",
        "|---|---|---|---|---|---|---|---|"]
    for generator in (*GENERATORS, "pooled"):
        test = comparison[generator]
        label = GENERATORS.get(generator, "pooled")
        wanted = sum(declared.values()) if generator == "pooled" else declared[generator]
        lines.append(f"| {label} | {test['cases']} / {wanted} | {_pct(test['source_right'], test['cases'])} | "
                     f"{_pct(test['v2_right'], test['cases'])} | {test['only_first']} | {test['only_second']} | "
                     f"{test['p_value']:.3g} | {reading(test, counts)} |")
    lines += ["", "| cell | pairs | source | DIFF V2 |", "|---|---|---|---|"]
    for cell, (pairs, first, second) in sorted(result["accuracy_by_cell"].items()):
        lines.append(f"| {cell} | {pairs} | {first / pairs:.0%} | {second / pairs:.0%} |")
    lines += ["", "| model | steps | training seconds | probe accuracy | probe perplexity |", "|---|---|---|---|---|"]
    for name in MODELS:
        history = result["training"].get(name)
        if history is None:
            lines.append(f"| {LABELS[name]} | – | – | – | – |")
            continue
        first, last = history["probes"][0], history["probes"][-1]
        # An adapt stopped by the time guard left the history of its last probe: no total, the steps' own clock.
        minutes = history.get("train_minutes", history["steps"][-1]["train_minutes"] if history["steps"] else None)
        seconds = "–" if minutes is None else f"{60 * minutes:.0f}"
        lines.append(f"| {LABELS[name]} | {len(history['steps'])} | {seconds} | "
                     f"{first['accuracy']:.0%} → {last['accuracy']:.0%} | {first['perplexity']:.2f} → "
                     f"{last['perplexity']:.2f} |")
    own = result["cases"]["own"]
    lines += ["", f"Own cases: {own['count']} (settings {', '.join(own['settings'])} at "
              f"{', '.join(map(str, own['lengths']))} tokens, {own['cases_per_depth']} per depth, seed {own['seed']}). "
              f"RULER cases: {ruler['count']} of {ruler['file']} ({ruler['generator']}, seed {ruler['seed']}, sized "
              f"with {ruler['tokenizer']}'s tokenizer).",
              f"Scored: {result['scored']['source']} and {result['scored']['v2']} cases, in batches of up to "
              f"{plan.get('batch', 1)}; median seconds a case (its share of its batch): "
              + ", ".join(f"{LABELS[m]} {s:.2f}" if s is not None else f"{LABELS[m]} –"
                          for m, s in result["median_case_seconds"].items())
              + "".join("; seconds an answer token: " + ", ".join(
                  f"{LABELS[m]} {s:.3f}" if s is not None else f"{LABELS[m]} –" for m, s in per_token.items())
                  for per_token in [result.get("seconds_per_answer_token")] if per_token)
              + f"; run {result['seconds']:.0f} s of {plan['max_seconds'] or '∞'} s.", ""]
    if notes:
        lines += ["Not the declared test:", *[f"- {note}" for note in notes]]
    else:
        lines.append("The run is complete as declared: the readings above are the declared test's.")
    return "\n".join(lines) + "\n"


def cuda_device_count() -> int:
    """CUDA devices the driver sees, asked without importing torch (seconds on a GPU machine, which the steps would
    wait for): what torch.cuda.is_available() asks the driver."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def torch_sees_cuda() -> bool:
    """torch's own answer, where the driver could not be asked directly (its import takes seconds)."""
    import torch

    return torch.cuda.is_available()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="the source LLaMA (a .gguf file, a folder, smollm2)")
    parser.add_argument("--output", help="folder for NAME.json, NAME.md and logs.txt")
    parser.add_argument("--work", help="folder for the models and the workers' files (large; not brought back)")
    parser.add_argument("--name", default="cuda-retrieval")
    parser.add_argument("--max-seconds", type=float, default=None, help="the whole run's time budget")
    parser.add_argument("--workers", type=int, default=None, help="scoring processes per model (default: 4)")
    parser.add_argument("--batch", type=int, default=None, help="cases a process scores at once (default: 16)")
    parser.add_argument("--dry-run", action="store_true", help="the same steps with a tiny budget, on the CPU too")
    parser.add_argument("--score", metavar="SPEC", help=argparse.SUPPRESS)  # a worker (started by the run)
    args = parser.parse_args()
    if args.score:
        sys.exit(score_share(args.score))
    if not args.output or not args.work:
        parser.error("--output and --work are needed")
    device = "cuda" if cuda_device_count() or torch_sees_cuda() else "cpu"
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model  # children run elsewhere
    changes = {"max_seconds": args.max_seconds}
    for option in ("workers", "batch"):
        if getattr(args, option):
            changes[option] = getattr(args, option)
    plan = Plan.for_dry_run(device, **changes) if args.dry_run else Plan(device=device, **changes)
    if device == "cpu" and not args.dry_run:
        print("cuda_retrieval: no CUDA device; a full run on a CPU takes hours: pass --dry-run", file=sys.stderr)
        sys.exit(2)
    run(plan, model, Path(args.output).resolve(), Path(args.work).resolve(), args.name)


if __name__ == "__main__":
    main()
