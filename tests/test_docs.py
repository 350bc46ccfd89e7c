"""Every ```python block of README.md and docs/*.md runs as a reader would run it: in a fresh Python.

Each block runs in its own `sys.executable` subprocess (nothing imported beforehand, so a block that forgets
`import diff_llama` fails here as it would for a user), from a scratch folder that holds what the docs say a reader
has: the main job's output `outputs/SmolLM2-135M-Instruct-diff` (here a tiny DIFF V2 DiffLlama with a tokenizer that
has SmolLM2's chat template and ChatML tokens, as the real folder does).
Blocks of one page run in order in one folder, so a block may use what an earlier block of its page wrote; pages run
side by side. A block may write only under `outputs/`, which `.gitignore` ignores, so that running the docs
leaves a reader's `git status` clean.

Markers, on the lines just before a block's fence:
- `<!-- docs-test: skip (reason) -->` skips it (it needs what a test cannot have: the real SmolLM2, a GPU, the
  Hub, torchrun); the test reports the skip with that reason.
- `<!-- docs-test: expect "text" -->` requires that text in the block's output (stdout and stderr), so a block that
  exits 0 without doing what it promises fails.
- `<!-- docs-test: quantizers -->` runs it in a Python that also sees torchao and bitsandbytes, which the test
  environment keeps beside it (`conftest.QUANTIZERS_ASIDE`), as a reader who installed them has them.
"""

import os
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import QUANTIZERS_ASIDE, tiny_model

ROOT = Path(__file__).resolve().parents[1]
MODEL_FOLDER = Path("outputs") / "SmolLM2-135M-Instruct-diff"  # what `bash scripts/run_main_job.sh` writes
MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|expect|quantizers)\s*(.*?)\s*-->")
FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
BLOCK_TIMEOUT = 300


@dataclass
class Block:
    page: str  # path relative to the repository root
    line: int
    code: str
    skip: str | None = None  # the reason, when skipped
    expect: list[str] = field(default_factory=list)
    quantizers: bool = False  # run with torchao and bitsandbytes importable

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def parse_blocks(text: str, page: str) -> list[Block]:
    """Every ```python block of a page, with the markers on the lines right above its fence."""
    lines = text.splitlines()
    blocks = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        block = Block(page, line, match.group(1))
        above = line - 2  # index of the line before the fence
        while above >= 0 and (found := MARKER.search(lines[above])):
            kind, argument = found.groups()
            if kind == "quantizers":
                block.quantizers = True
            elif kind == "skip":
                reason = argument.strip()
                block.skip = reason[1:-1] if reason.startswith("(") and reason.endswith(")") else reason
                if not block.skip:
                    raise ValueError(f"{page}:{line}: a docs-test skip must give its reason")
            else:
                expected = re.fullmatch(r'"(.*)"', argument)
                if not expected:
                    raise ValueError(f'{page}:{line}: write expect as <!-- docs-test: expect "text" -->')
                block.expect.append(expected.group(1))
            above -= 1
        blocks.append(block)
    return blocks


def documented_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def all_blocks() -> list[Block]:
    blocks = []
    for page in documented_pages():
        blocks += parse_blocks(page.read_text(encoding="utf-8"), str(page.relative_to(ROOT)))
    return blocks


def test_the_block_finder_reads_blocks_and_markers():
    text = (
        "a\n```python\nx = 1\n```\n"
        "<!-- docs-test: skip (needs the real SmolLM2) -->\n```python\ny = 2\n```\n"
        '<!-- docs-test: expect "shape (1, 4)" -->\n<!-- docs-test: expect "done" -->\n```python\nz = 3\n```\n'
        '<!-- docs-test: quantizers -->\n```python\nw = 4\n```\n'
    )
    first, second, third, fourth = parse_blocks(text, "page.md")
    assert (first.line, first.code, first.skip, first.expect, first.quantizers) == (2, "x = 1\n", None, [], False)
    assert second.skip == "needs the real SmolLM2"
    assert third.expect == ["done", "shape (1, 4)"] and third.skip is None
    assert fourth.quantizers and fourth.skip is None
    with pytest.raises(ValueError, match="reason"):
        parse_blocks("<!-- docs-test: skip -->\n```python\nx\n```\n", "page.md")


def test_the_docs_keep_their_examples():
    blocks = all_blocks()
    assert len([b for b in blocks if b.page == "README.md" and not b.skip]) >= 1, "the README lost its quickstart"
    assert len([b for b in blocks if not b.skip]) >= 8, "the docs lost their examples (or the block finder broke)"


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    anchors = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"#+\s+(.*)", line)
        if heading:
            anchors.add(re.sub(r"[^\w\s-]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def test_links_between_the_pages_lead_somewhere():
    pages = [*documented_pages(), ROOT / "bench" / "results" / "README.md"]
    broken = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in heading_anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, command, options) of every `diff-llama COMMAND ...` line in a ```bash block of the docs."""
    found = []
    for page in documented_pages():
        text = page.read_text(encoding="utf-8")
        for block in re.finditer(r"^```bash\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
            first = text.count("\n", 0, block.start()) + 2
            for offset, line in enumerate(block.group(1).splitlines()):
                command = re.match(r"\s*(?:\S+/)?diff-llama\s+([a-z-]+)(.*)", line.split("#")[0])
                if command:
                    options = re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", command.group(2))
                    where = f"{page.relative_to(ROOT)}:{first + offset}"
                    found.append((where, command.group(1), options))
    return found


def test_documented_commands_and_options_exist():
    """Bash blocks are not run, but every `diff-llama COMMAND --option` they show must be one the CLI has."""
    commands = documented_commands()
    assert len(commands) >= 10
    helps, wrong = {}, []
    for where, command, options in commands:
        if command not in helps:
            done = subprocess.run([sys.executable, "-c", "import sys; from diff_llama_cli import main; "
                                   "sys.exit(main(sys.argv[1:]))", command, "--help"],
                                  capture_output=True, text=True, timeout=120)
            names = set(re.findall(r"--[a-z][a-z0-9_-]*", done.stdout)) if done.returncode == 0 else None
            helps[command] = names and names | {name.replace("_", "-") for name in names}
        if helps[command] is None:
            wrong.append(f"{where}: no command `diff-llama {command}`")
            continue
        for option in options:
            plain = "--" + option[len("--no-"):] if option.startswith("--no-") else option
            if plain not in helps[command]:
                wrong.append(f"{where}: `diff-llama {command}` has no option {option}")
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------------------------------------------------------
# Running the pages: one scratch folder per page, its blocks in order, two pages at a time.

class PageRuns:
    def __init__(self, base: Path, workers: int):
        self.base = base
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.futures = {}
        self.lock = threading.Lock()

    def result(self, block: Block, pages: list[str]) -> dict:
        with self.lock:  # the first request starts every page the session will ask for
            for page in [block.page, *pages]:
                if page not in self.futures:
                    self.futures[page] = self.pool.submit(self.run_page, page)
        return self.futures[block.page].result()[block.line]

    def run_page(self, page: str) -> dict:
        folder = self.base / re.sub(r"[^A-Za-z0-9]+", "_", page)
        shutil.copytree(self.base / "reader", folder)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   OMP_NUM_THREADS="1", MPLBACKEND="Agg")
        env.pop("PYTHONPATH", None)
        results = {}
        for block in parse_blocks((ROOT / page).read_text(encoding="utf-8"), page):
            if block.skip:
                continue
            script = folder / f"block_{block.line}.py"
            script.write_text(block.code, encoding="utf-8")
            before = files_outside_outputs(folder)
            try:
                block_env = dict(env, PYTHONPATH=str(QUANTIZERS_ASIDE)) if block.quantizers else env
                done = subprocess.run([sys.executable, script.name], cwd=folder, env=block_env, capture_output=True,
                                      text=True, timeout=BLOCK_TIMEOUT)
                results[block.line] = {"rc": done.returncode, "output": done.stdout + done.stderr}
            except subprocess.TimeoutExpired:
                results[block.line] = {"rc": "timeout", "output": f"still running after {BLOCK_TIMEOUT} s"}
            script.unlink()
            results[block.line]["stray"] = sorted(files_outside_outputs(folder) - before)
        return results


def files_outside_outputs(folder: Path) -> set[str]:
    """What a reader's checkout would show in `git status`: `outputs/` is ignored, anything else is not."""
    found = set()
    for path in folder.rglob("*"):
        relative = path.relative_to(folder)
        if relative.parts[0] != "outputs" and not path.is_dir():
            found.add(str(relative))
    return found


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory, chatml_tokenizer):
    base = tmp_path_factory.mktemp("docs")
    reader = base / "reader"  # what a reader has after `bash scripts/run_main_job.sh`
    tokenizer = chatml_tokenizer  # the real folder chats: SmolLM2's template (TRL's conversational data needs one)
    # Widths in bitsandbytes' blocks of 64, as SmolLM2's are (its CPU kernels need them: fine-tuning.md's QLoRA).
    model = tiny_model(vocab_size=len(tokenizer), diff_version=2, hidden_size=64, intermediate_size=128,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    model.save_pretrained(reader / MODEL_FOLDER)
    tokenizer.save_pretrained(reader / MODEL_FOLDER)
    runs = PageRuns(base, workers=int(os.environ.get("DOCS_TEST_WORKERS", "2")))
    yield runs
    runs.pool.shutdown(wait=True, cancel_futures=True)


BLOCKS = all_blocks()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_documented_python_block_runs_in_a_fresh_python(block, page_runs, request):
    if block.skip:
        pytest.skip(f"{block.name}: {block.skip}")
    pages = sorted({item.callspec.params["block"].page for item in request.session.items
                    if item.originalname == request.node.originalname and hasattr(item, "callspec")})
    result = page_runs.result(block, pages)
    tail = result["output"][-3000:]
    assert result["rc"] == 0, f"{block.name} fails in a fresh Python (exit {result['rc']}):\n{tail}"
    assert not result["stray"], f"{block.name} writes outside outputs/ (a reader's git status shows it): {result['stray']}"
    for text in block.expect:
        assert text in result["output"], f"{block.name} ran but did not print {text!r}:\n{tail}"
