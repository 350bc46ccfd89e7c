"""src/ says why the code is as it is; measured figures, the machines that gave them, dates and result paths belong in
docs/ and bench/results/, where a new run can update them (issue 33). Hardware capability checks (bf16 units, AMX,
AVX512) are code and stay."""

import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"

FORBIDDEN = {
    "machine name": r"\b(EPYC|Xeon|Ryzen|Threadripper|Sapphire Rapids|Emerald Rapids|Granite Rapids|Ice Lake|"
                    r"Cascade Lake|Skylake|Intel|AMD|Graviton|Apple M[1-4]|H100|H200|A100|A10G|V100|GH200|MI300X?)\b",
    "results path": r"bench/results",
    "date": rf"\b20\d\d-[01]\d-[0-3]\d\b|\b({MONTHS}) [0-3]?\d(st|nd|rd|th)?,? 20\d\d\b|\b[0-3]?\d ({MONTHS}) 20\d\d\b",
    "run-log phrasing": r"\bquiet (machine|run|CPU|VM)\b|\b(heavily )?loaded (machine|run|CPU|VM)\b|"
                        r"\bunder (heavy )?load\b|\bload \d|\bshared VM\b|\bin the same run\b|\brun-to-run\b|"
                        r"\bruns? of (two|three|\d)\b|\bon the benchmark (CPU|machine|GPU)\b|\bwe measured\b|"
                        r"\bmeasured (here|there|today|on (this|that|the|an?) (machine|CPU|GPU|host))\b",
    "ratio": r"(?<![\w.])\d+\.\d+x\b|(?<![\w.])\d+(\.\d+)?-\d+(\.\d+)?x\b|"
             r"(?<![\w.])\d+(\.\d+)?x (faster|slower|longer|shorter|less|more|the|its)\b",
    "speed or time figure": r"\b\d+(\.\d+)? ?(CPU-minutes|CPU minutes|tokens/s|it/s|ms (a|per) (step|token)|"
                            r"s (a|per) step)\b",
}


def source_files():
    return sorted(
        path for path in SRC.rglob("*")
        if path.suffix in (".py", ".md", ".txt", ".json", ".cfg", ".toml") and path.is_file()
        and not any(part.endswith(".egg-info") or part == "__pycache__" for part in path.parts)
    )


def test_there_are_sources_to_scan():
    names = {path.name for path in source_files()}
    assert {"modeling_diff_llama.py", "differential_kernels.py", "precision.py", "trainer.py"} <= names


@pytest.mark.parametrize("kind", list(FORBIDDEN))
def test_src_has_no_figures_machines_dates_or_results_paths(kind):
    pattern = re.compile(FORBIDDEN[kind])
    hits = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in source_files()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, f"{kind} in src/ (say why in the code; put figures in docs/ or bench/results/):\n" + "\n".join(hits)


@pytest.mark.parametrize("kind,line", [
    ("machine name", "the figures are from an Intel CPU with AMX; on an AMD EPYC (AVX2) the choice differs"),
    ("machine name", "H200, bf16, against the generic path"),
    ("results path", "(bench/results/model-kernels.md)"),
    ("date", "run on 2026-01-20"),
    ("date", "measured January 20, 2026"),
    ("run-log phrasing", "CPU, fp32, one token after 128, quiet machine, one run"),
    ("run-log phrasing", "under heavy load the older kernel lost"),
    ("ratio", "0.93x / 0.94x Llama's tokens/s"),
    ("ratio", "this path 1.19-1.71x Llama's time"),
    ("ratio", "a training step took 5x the float32 time"),
    ("speed or time figure", "the curve reached 21.7 after 30 CPU-minutes"),
])
def test_the_patterns_catch_run_logs(kind, line):
    assert re.search(FORBIDDEN[kind], line)


@pytest.mark.parametrize("line", [
    "return torch.float64 if dtype == torch.float64 else torch.float32",
    "bfloat16 where the CPU has bf16 units (AMX or AVX512-BF16 on x86, BF16 or SVE-BF16 on ARM)",
    "each LLaMA head gets its own differential head (2x attention width, keeps the LLaMA's quality)",
    "x·(1 − λ_init) as x + (−λ_init)·x: one aten op",
    "stop earlier once the training steps have used this many CPU-minutes (evaluations excluded)",
    "\"scale\": f\"a per-head output scale measured on {options.get('calibration_tokens')} tokens of {text}\"",
    "# Copyright 2026 The diff-llama authors.",
    "model.safetensors.index.json",
])
def test_the_patterns_leave_code_alone(line):
    assert not any(re.search(pattern, line) for pattern in FORBIDDEN.values()), line
