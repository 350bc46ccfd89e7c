"""scripts/setup_env.sh, the one set-up of every virtual environment: arguments it cannot use are refused in one line
before anything is created. (Installing is exercised by every run of the scripts that call it, CI included.)"""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("arguments, message", [
    ([], "give the virtual environment and the extras first"),
    (["test"], "give the virtual environment and the extras first"),
    (["--transformers", "5.16.1", "VENV", "test"], "give the virtual environment and the extras first"),
    (["VENV", "test", "--with"], "--with needs a value"),
    (["VENV", "test", "--torch"], "--torch needs a value"),
    (["VENV", "test", "--transformers", "--remove", "x"], "--transformers needs a value"),
    (["VENV", "test", "--pin", "x"], "unknown option '--pin'"),
])
def test_bad_arguments_are_refused_in_one_line_and_create_nothing(tmp_path, arguments, message):
    arguments = [str(tmp_path / "venv") if a == "VENV" else a for a in arguments]
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup_env.sh"), *arguments], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "VENV EXTRAS" in out.stderr
    assert not (tmp_path / "venv").exists() and not (ROOT / "test").exists()


def test_every_script_that_needs_a_venv_sets_it_up_through_setup_env():
    for script in ("run_tests.sh", "run_main_job.sh", "run_oldest_transformers_tests.sh", "run_vllm_tests.sh"):
        code = "\n".join(line for line in (ROOT / "scripts" / script).read_text().splitlines()
                          if not line.lstrip().startswith("#"))
        assert "bash scripts/setup_env.sh " in code, script
        assert "-m venv" not in code and "pip install" not in code and "torch==" not in code, script
