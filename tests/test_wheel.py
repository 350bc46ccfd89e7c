"""What users get from `pip install .` or a wheel, not what an editable install shows: build the wheel, install it
(not editable) into a fresh virtual environment, and use it there. The environment reuses this one's packages (a
path file), so torch and transformers are not downloaded again; the test checks that diff_llama
itself is imported from the wheel, not from this checkout."""

import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from conftest import make_llama

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # about a minute and a half of building, installing and three fresh interpreters


def _run(command, **kwargs):
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    work = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work / "dist"),
          str(ROOT)])
    (wheel,) = (work / "dist").glob("diff_llama-*.whl")
    _run([sys.executable, "-m", "venv", str(work / "venv")])
    python = work / "venv" / "bin" / "python"
    # This environment's packages (torch, transformers, ...) for the new one, whether this is the base interpreter or a
    # virtual environment (`--system-site-packages` would only see the base interpreter's). A plain path line: the
    # .pth files there, the checkout's editable install among them, are not run.
    site_packages = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout
    ours = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    (Path(site_packages.strip()) / "_test_parent_environment.pth").write_text("\n".join(sorted(ours)) + "\n")
    # --no-deps: every requirement is already there (system site packages); --force-reinstall: the checkout's own
    # editable install is visible too and must not count as "already installed".
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)])
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(work / "modules"), PATH=f"{work / 'venv' / 'bin'}:/usr/bin:/bin")
    return wheel, python, env


def test_wheel_holds_every_module(wheel_env):
    wheel, _, _ = wheel_env
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src").rglob("*.py")}
    assert sources <= names, f"missing from the wheel: {sorted(sources - names)}"
    assert "diff_llama/model_cards/diff_llama_model.md" in names


def test_installed_wheel_converts_generates_and_loads_as_remote_code(wheel_env, tmp_path, tokenizer):
    _, python, env = wheel_env
    where = _run([str(python), "-c", "import diff_llama, sys; print(diff_llama.__file__)"], env=env, cwd=tmp_path)
    assert str(python.parents[1]) in where.stdout, "diff_llama was not imported from the installed wheel"

    help_text = _run(["diff-llama", "--help"], env=env, cwd=tmp_path).stdout
    assert "convert" in help_text

    source = make_llama(tmp_path / "llama", tokenizer, num_hidden_layers=2)
    out = tmp_path / "diff"
    converted = _run(["diff-llama", "convert", str(source), str(out), "--diff-version", "1", "--calibration-tokens", "1024",
                      "--eval-tokens", "1024", "--seq-len", "128"], env=env, cwd=tmp_path)
    assert "held-out perplexity" in converted.stdout
    generated = _run(["diff-llama", "generate", str(out), "The quick brown", "--max-new-tokens", "5", "--raw"],
                     env=env, cwd=tmp_path)
    assert generated.stdout.strip()

    # A user without diff-llama: the folder's own code runs.
    script = textwrap.dedent(f"""
        import sys
        sys.modules["diff_llama"] = None
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)
        print(type(model).__module__, model.get_lambdas().shape[0])
    """)
    remote = _run([str(python), "-c", script], env=env, cwd=tmp_path)
    module, layers = remote.stdout.split()
    assert module.startswith("transformers_modules") and layers == "2"
