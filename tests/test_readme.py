"""Every ```python block of README.md runs as written, each in a fresh namespace, on a tiny model.

The blocks run in order in one scratch folder that holds what the README assumes a reader has: the main job's
output folder `outputs/SmolLM2-135M-Instruct-diff` (here a tiny DIFF V2 DiffLlama with a tokenizer), `corpus.txt`, and a LLaMA
at `path/to/llama`. A block that needs more (the real SmolLM2, a network) is skipped by
putting `<!-- readme-test: skip (the reason) -->` on the line before its fence.
"""

import re
from pathlib import Path

import pytest

from conftest import SAMPLE_TEXT, make_llama, tiny_model

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP_MARKER = "<!-- readme-test: skip"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block not marked to be skipped."""
    blocks = []
    lines = text.splitlines()
    for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        line = text.count("\n", 0, match.start()) + 1
        previous = lines[line - 2].strip() if line >= 2 else ""
        if not previous.startswith(SKIP_MARKER):
            blocks.append((line, match.group(1)))
    return blocks


def test_the_block_finder_sees_blocks_and_markers():
    text = "a\n```python\nx = 1\n```\n<!-- readme-test: skip (needs SmolLM2) -->\n```python\ny = 2\n```\n"
    assert python_blocks(text) == [(2, "x = 1\n")]


def test_readme_python_blocks_run_as_written(tmp_path, monkeypatch, tokenizer):
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 5, "the README lost its examples (or the block finder broke)"
    model = tiny_model(vocab_size=len(tokenizer), diff_version=2)  # what the main job's conversion writes
    model.save_pretrained(tmp_path / "outputs" / "SmolLM2-135M-Instruct-diff")
    tokenizer.save_pretrained(tmp_path / "outputs" / "SmolLM2-135M-Instruct-diff")
    (tmp_path / "corpus.txt").write_text(SAMPLE_TEXT * 8)
    make_llama(tmp_path / "path" / "to" / "llama", tokenizer, num_hidden_layers=2)
    monkeypatch.chdir(tmp_path)
    for line, code in blocks:
        try:
            exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
        except Exception as error:
            pytest.fail(f"the README's Python block at line {line} fails: {type(error).__name__}: {error}")
