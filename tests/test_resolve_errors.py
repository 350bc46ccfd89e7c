"""Folders that are not whole models: every command that loads a model names what is missing and the fix, in one line
(transformers alone blames a missing sentencepiece or tiktoken)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_model

import diff_llama.resolve
from diff_llama.cli import main
from diff_llama.resolve import (
    AdapterFolderError,
    MissingTokenizerError,
    ModelNotFoundError,
    NotAModelFolderError,
    load_causal_lm,
    load_config,
    load_tokenizer,
)


def _not_a_model(tmp_path) -> Path:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a model")
    return folder


def _model_without_tokenizer(tmp_path) -> Path:
    folder = tmp_path / "my-diff-llama"
    tiny_model().save_pretrained(folder)  # what the README's first snippet does: weights and config only
    return folder


def _adapter(tmp_path) -> Path:
    from peft import LoraConfig, get_peft_model

    folder = tmp_path / "adapter"
    model = tiny_model()
    model.name_or_path = "outputs/SmolLM2-diff"
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).save_pretrained(folder)
    assert (folder / "adapter_config.json").is_file() and not (folder / "config.json").exists()
    return folder


def _fails_in_one_line(capsys, argv) -> str:
    capsys.readouterr()  # drop what making the folders printed
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "sentencepiece" not in err and "tiktoken" not in err
    return err


@pytest.mark.parametrize("loader", [load_config, load_tokenizer, load_causal_lm])
def test_a_folder_without_config_is_not_a_model(tmp_path, loader):
    with pytest.raises(NotAModelFolderError, match="has no config.json"):
        loader(_not_a_model(tmp_path))


def test_a_model_folder_without_tokenizer_names_where_to_get_one(tmp_path, tokenizer):
    folder = _model_without_tokenizer(tmp_path)
    with pytest.raises(MissingTokenizerError, match=r"no tokenizer.*AutoTokenizer\.from_pretrained\(SOURCE\)"):
        load_tokenizer(folder)
    assert load_config(folder).model_type == "diff_llama"  # the model itself is fine
    tokenizer.save_pretrained(folder)  # the fix the message names
    assert load_tokenizer(folder)("The quick").input_ids == tokenizer("The quick").input_ids


@pytest.mark.parametrize("loader", [load_config, load_tokenizer, load_causal_lm])
def test_an_adapter_on_a_base_that_is_not_there_names_both(tmp_path, loader):
    """An adapter folder loads on its base model (tests/test_finetuning.py); when that base cannot be found, the one
    line names the adapter, the base it records and why that base cannot load."""
    folder = _adapter(tmp_path)
    # "no such folder", or where no outputs/ folder exists here, "no such local folder, and as a Hub repository id..."
    with pytest.raises(ModelNotFoundError, match=f"^{folder} is a LoRA adapter on `outputs/SmolLM2-diff`, which cannot "
                                                 "be loaded: outputs/SmolLM2-diff: no such (local )?folder"):
        loader(folder)


def test_errors_are_model_not_found_errors():
    """The CLI prints OSErrors (ModelNotFoundError is one) as one line with no traceback."""
    for error in (NotAModelFolderError, MissingTokenizerError, AdapterFolderError):
        assert issubclass(error, ModelNotFoundError) and issubclass(error, OSError)


@pytest.mark.parametrize("case", ["not-a-model", "no-tokenizer", "adapter"])
def test_train_and_evaluate_name_what_is_missing(tmp_path, capsys, case):
    folder = {"not-a-model": _not_a_model, "no-tokenizer": _model_without_tokenizer, "adapter": _adapter}[case](tmp_path)
    expected = {"not-a-model": "has no config.json", "no-tokenizer": "no tokenizer",
                "adapter": "is a LoRA adapter on `outputs/SmolLM2-diff`, which cannot be loaded"}[case]
    data = tmp_path / "data.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 50)
    for argv in (["train", str(folder), "--data", str(data), "--output", str(tmp_path / "trained")],
                 ["evaluate", str(folder), "--output", str(tmp_path / "evaluation")]):
        err = _fails_in_one_line(capsys, argv)
        assert err.startswith(f"diff-llama {argv[0]}: error:") and expected in err, err
    assert not (tmp_path / "trained").exists() and not (tmp_path / "evaluation").exists()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def test_a_weights_file_cut_short_is_named_before_any_work(tmp_path, capsys, tokenizer):
    """A copy or download cut short: safetensors refuses its header. Every command that loads models names the file
    at once (evaluate before it scores the first, good model), where transformers alone raises a SafetensorError."""
    good, damaged = tmp_path / "good", tmp_path / "damaged"
    for folder in (good, damaged):
        tiny_model(vocab_size=len(tokenizer)).save_pretrained(folder, max_shard_size="20KB")
        tokenizer.save_pretrained(folder)
    shards = sorted(damaged.glob("model-*.safetensors"))
    assert len(shards) > 2
    os.truncate(shards[1], shards[1].stat().st_size // 2)
    expected = (f"error: {shards[1]} is truncated or corrupt (Error while deserializing header: incomplete metadata, "
                "file not fully covered); copy or download the model again.")
    for argv in (["generate", str(damaged), "Hi"], ["attention-map", str(damaged), "--text", "x", "--layer", "0"],
                 ["evaluate", str(good), str(damaged), "--output", str(tmp_path / "evaluation")],
                 ["serve", str(damaged), "--port", str(_free_port())]):
        assert _fails_in_one_line(capsys, argv) == f"diff-llama {argv[0]}: {expected}"
    assert not (tmp_path / "evaluation").exists()
    with pytest.raises(ModelNotFoundError, match="truncated or corrupt"):
        load_causal_lm(damaged)


def test_generate_through_the_installed_cli(tmp_path):
    """The real `diff-llama` entry point in a fresh process: each case is one line naming the fix, exit code 2."""
    executable = shutil.which("diff-llama", path=str(Path(sys.executable).parent)) or shutil.which("diff-llama")
    assert executable, "the diff-llama entry point is not installed"
    cases = {
        _not_a_model(tmp_path): "has no config.json",
        _model_without_tokenizer(tmp_path): "AutoTokenizer.from_pretrained(SOURCE).save_pretrained(",
        _adapter(tmp_path): "is a LoRA adapter on `outputs/SmolLM2-diff`, which cannot be loaded",
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("DIFF_LLAMA_TRACEBACK", None)
    for folder, expected in cases.items():
        result = subprocess.run([executable, "generate", str(folder), "Hello"], capture_output=True, text=True,
                                env=env, stdin=subprocess.DEVNULL, timeout=300)
        err = result.stderr.strip()
        assert result.returncode == 2, err[-2000:]
        assert err.count("\n") == 0 and err.startswith("diff-llama generate: error:") and expected in err, err
        assert "sentencepiece" not in err and "tiktoken" not in err


def test_adapter_config_without_a_base_still_names_peft(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    with pytest.raises(AdapterFolderError, match="names no base model.*PeftModel.from_pretrained"):
        load_causal_lm(folder)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA",
                                                            "base_model_name_or_path": str(folder)}))
    with pytest.raises(AdapterFolderError, match="names itself as its base model"):
        load_causal_lm(folder)


# ---- a Hub id on a machine without the Hub (issue 42) -----------------------------------------------------------

TYPO = "outputs/SmolLM2-135M-Instruct-dif"  # shaped like a Hub id, and no such folder here


@pytest.fixture
def hub_at(monkeypatch, tmp_path):
    """Online mode (the suite runs with HF_HUB_OFFLINE=1) against the Hub at a given address, with an empty cache."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # restored after a test that switched to the cache

    def point_at(endpoint):
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        return endpoint

    return point_at


@pytest.mark.parametrize("command", [["generate", TYPO, "Hi"], ["attention-map", TYPO, "--text", "x", "--layer", "0"]])
def test_a_hub_id_without_the_hub_fails_in_one_line_within_seconds(tmp_path, monkeypatch, capsys, hub_at, command):
    from fake_hub import unreachable_endpoint

    monkeypatch.chdir(tmp_path)  # no outputs/ folder here
    endpoint = hub_at(unreachable_endpoint())
    started = time.monotonic()
    err = _fails_in_one_line(capsys, command)
    assert time.monotonic() - started < 10
    assert err.startswith(f"diff-llama {command[0]}: error: {TYPO}: no such local folder, and as a Hub repository id")
    assert f"the Hugging Face Hub ({endpoint}) is not reachable" in err and "check the path" in err, err


def test_a_hub_id_in_offline_mode_names_the_setting(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = _fails_in_one_line(capsys, ["generate", TYPO, "Hi"])  # the suite's HF_HUB_OFFLINE=1, an empty cache
    assert "no such local folder" in err and "offline mode is on (HF_HUB_OFFLINE)" in err and "unset HF_HUB_OFFLINE" in err


def test_a_cached_hub_model_loads_offline_when_the_hub_is_unreachable(tmp_path, capsys, caplog, hub_at, tokenizer):
    """A model downloaded earlier answers at once from the cache instead of after a minute of retries per file."""
    import huggingface_hub.constants
    from fake_hub import cache_repo, unreachable_endpoint

    folder = tmp_path / "model"
    model = tiny_model(vocab_size=len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    cache_repo(tmp_path / "hub-cache", "someone/tiny-diff", folder)
    hub_at(unreachable_endpoint())
    started = time.monotonic()
    assert main(["generate", "someone/tiny-diff", "The quick", "--max-new-tokens", "4", "--raw"]) == 0
    assert time.monotonic() - started < 10
    assert capsys.readouterr().out.strip()
    assert huggingface_hub.constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"
    assert "is not reachable" in caplog.text and "loading someone/tiny-diff from the local cache, offline" in caplog.text


def test_a_hub_that_never_answers_is_given_up_on_after_the_timeout():
    import socket

    from diff_llama.hub import hub_unavailable_reason

    with socket.socket() as server:  # listens (the kernel completes connections) but never answers
        server.bind(("127.0.0.1", 0))
        server.listen()
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        import huggingface_hub.constants

        offline, huggingface_hub.constants.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE, False
        try:
            started = time.monotonic()
            reason = hub_unavailable_reason(endpoint, timeout=1)
        finally:
            huggingface_hub.constants.HF_HUB_OFFLINE = offline
    assert time.monotonic() - started < 3
    assert reason.startswith(f"the Hugging Face Hub ({endpoint}) is not reachable (") and "Timeout" in reason


def test_a_hub_that_comes_back_is_noticed_once_its_answer_is_old(monkeypatch):
    """An answer is reused for `REACHABILITY_MEMORY` seconds (a command asks several times), not for the life of the
    process: a notebook that pushes again after the network came back is not refused."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import huggingface_hub.constants

    from diff_llama import hub
    from fake_hub import unreachable_endpoint

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    endpoint = unreachable_endpoint()
    assert "is not reachable" in hub.hub_unavailable_reason(endpoint, timeout=1)
    server = ThreadingHTTPServer(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])), BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert "is not reachable" in hub.hub_unavailable_reason(endpoint, timeout=1)  # remembered
        monkeypatch.setattr(hub, "REACHABILITY_MEMORY", 0.0)
        assert hub.hub_unavailable_reason(endpoint, timeout=1) is None  # any answer (here a 501) is an answer
    finally:
        server.shutdown()
        server.server_close()


def test_generate_a_hub_id_in_a_fresh_process_without_network(tmp_path):
    """Online mode in a fresh process, on this machine's real network (no route to the Hub): one line, exit code 2,
    and within 10 s of the imports (torch and transformers alone take seconds on a loaded machine; the retries took
    a minute)."""
    from diff_llama.hub import _request_failure, hub_endpoint

    if _request_failure(hub_endpoint(), 3.0) is None:
        pytest.skip("the Hub is reachable from here")
    script = ("import sys, time; import diff_llama.commands; from diff_llama_cli import main; started = time.monotonic(); "
              "code = main(sys.argv[1:]); print(time.monotonic() - started); sys.exit(code)")
    env = {key: value for key, value in os.environ.items()
           if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "DIFF_LLAMA_TRACEBACK")}
    env["HF_HUB_CACHE"] = str(tmp_path / "hub-cache")
    env["PYTHONPATH"] = str(Path(diff_llama.resolve.__file__).parents[1])  # this source tree, from any folder
    result = subprocess.run([sys.executable, "-c", script, "generate", TYPO, "Hello"], capture_output=True, text=True,
                            env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, timeout=300)
    err = result.stderr.strip()
    assert result.returncode == 2 and err.count("\n") == 0, err[-2000:]
    assert err.startswith(f"diff-llama generate: error: {TYPO}: no such local folder") and "is not reachable" in err
    assert float(result.stdout) < 10


# ---- GGUF files that are not GGUF models ----------------------------------------------------------------------


@pytest.mark.parametrize("content, says", [(b"", "is empty, so it is not a GGUF model"),
                                           (b"PK\x03\x04 a zip file", "does not start with GGUF's magic bytes"),
                                           (b"GGUF\x03\x00\x00\x00\x01", "cannot be read as a GGUF model")])
def test_a_bad_gguf_file_is_named_with_the_fix(tmp_path, capsys, content, says):
    pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    for command in (["generate", str(path), "Hi"], ["convert", str(path), str(tmp_path / "out")]):
        err = _fails_in_one_line(capsys, command)
        assert str(path) in err and says in err and "download it again" in err, err
    assert path.read_bytes() == content and not (tmp_path / "out").exists()


# ---- recover names its model's problem first ---------------------------------------------------------------------


def test_recover_names_a_missing_model_before_its_source(tmp_path, capsys):
    err = _fails_in_one_line(capsys, ["recover", str(tmp_path / "MISSING"), "--output", str(tmp_path / "out")])
    assert "MISSING: no such folder" in err and "--source" not in err, err


def test_a_conversion_records_its_local_source_wherever_recover_runs(tmp_path, monkeypatch, tokenizer):
    """A source given by a relative path is recorded by its absolute one: `recover` run from another folder, beside
    another model of the same name, reads the right source."""
    from conftest import make_llama

    from diff_llama.cli import main

    make_llama(tmp_path / "llama", tokenizer, num_hidden_layers=1)
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "llama", "v1", "--diff-version", "1", "--calibration-tokens", "256", "--seq-len", "128",
                 "--no-evaluate"]) == 0
    report = json.loads((tmp_path / "v1" / "conversion_report.json").read_text())
    assert report["source"] == str(tmp_path / "llama")
    (tmp_path / "elsewhere").mkdir()
    make_llama(tmp_path / "elsewhere" / "llama", tokenizer, num_hidden_layers=2)  # not the source
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["recover", "../v1", "--output", "../recovered", "--max-steps", "1", "--block-size", "16",
                 "--batch-size", "1", "--eval-tokens", "64"]) == 0
    recovered = json.loads((tmp_path / "recovered" / "recovery_report.json").read_text())
    assert recovered["source"] == str(tmp_path / "llama"), recovered


def test_recover_names_a_recorded_source_that_moved(tmp_path, capsys, tokenizer):
    from conftest import make_llama

    from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama

    source = make_llama(tmp_path / "llama", tokenizer, num_hidden_layers=1)
    for version in (1, 2):
        convert_llama_to_diff_llama(str(source), str(tmp_path / f"v{version}"),
                                    ConversionOptions(diff_version=version, evaluate=False), progress=False)
    shutil.rmtree(source)
    err = _fails_in_one_line(capsys, ["recover", str(tmp_path / "v1"), "--output", str(tmp_path / "out")])
    assert f"{source}: no such folder" in err and "the source recorded in" in err and "pass --source" in err, err
    # A DIFF V2 model cannot be recovered wherever its source is: that is said first, not where the source went.
    err = _fails_in_one_line(capsys, ["recover", str(tmp_path / "v2"), "--output", str(tmp_path / "out")])
    assert "is a DIFF V2 conversion" in err and "--source" not in err, err
    assert not (tmp_path / "out").exists()


def _write_gguf(path, name):
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_each_gguf_file_is_parsed_once_within_the_block(tmp_path):
    """transformers parses a GGUF header for the config, the model and the tokenizer; convert shares one parse per
    file (the real SmolLM2 conversion: once instead of five times)."""
    gguf = pytest.importorskip("gguf")
    from diff_llama.gguf_metadata import each_gguf_parsed_once

    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    _write_gguf(first, "a")
    _write_gguf(second, "b")
    parse = gguf.GGUFReader
    with each_gguf_parsed_once():
        reader = gguf.GGUFReader(first)
        assert gguf.GGUFReader(str(first)) is reader and gguf.GGUFReader(second) is not reader
        assert bytes(reader.fields["general.name"].parts[-1]) == b"a"
        _write_gguf(first, "rewritten")  # another file at the same path: parsed afresh
        assert bytes(gguf.GGUFReader(first).fields["general.name"].parts[-1]) == b"rewritten"
    assert gguf.GGUFReader is parse and gguf.GGUFReader(first) is not gguf.GGUFReader(first)


def test_a_device_is_checked_before_anything_loads(tmp_path, capsys, monkeypatch):
    """`evaluate` and `ruler` default to `--device auto` (the accelerator where there is one); a device that torch
    does not know, or that this machine lacks, is one line before any model loads or the output folder is made,
    where it was a traceback from `model.to()`."""
    import torch

    from diff_llama.cli import main
    from diff_llama.errors import UserError
    from diff_llama.resolve import accelerator, resolve_device

    assert resolve_device("auto") == (accelerator().type if accelerator() is not None else "cpu")
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(UserError, match=r"^--device gpu is not a device: give auto, cpu, cuda, cuda:1, \.\.\.$"):
        resolve_device("gpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    has = f"{count} cuda device{'s' if count != 1 else ''}" if count else "no cuda device"
    with pytest.raises(UserError, match=f"^--device cuda:{count}: this machine has {has} "):
        resolve_device(f"cuda:{count}")
    # Before torch 2.6 (no torch.accelerator): CUDA's own answer.
    monkeypatch.delattr(torch, "accelerator")
    assert accelerator() == (torch.device("cuda") if torch.cuda.is_available() else None)
    monkeypatch.undo()
    for command in (["evaluate", "smollm2"], ["ruler", "smollm2"], ["attention-map", "smollm2", "--text", "Hi",
                                                                     "--layer", "0"]):
        out = tmp_path / command[0]
        assert main([*command, "--output", str(out), "--device", "gpu"]) == 2
        assert capsys.readouterr().err.strip().endswith("error: --device gpu is not a device: give auto, cpu, cuda, "
                                                        "cuda:1, ...")
        assert not out.exists()


def test_a_transformers_that_cannot_read_ggufs_version_is_named_with_the_fix(tmp_path, capsys, monkeypatch):
    """transformers before 5.23 on Python 3.10 fails on gguf's version "N/A" (its wheels lack top_level.txt); the
    command says which upgrade reads it. Mocked: this venv's transformers reads it (the real failure was seen with
    transformers 5.16.1 on Python 3.10)."""
    pytest.importorskip("gguf")
    from packaging import version
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_gguf_available", lambda: version.parse("N/A") >= version.parse("0.10.0"))
    for command in (["generate", "smollm2", "Hi"], ["convert", "smollm2", str(tmp_path / "out")]):
        err = _fails_in_one_line(capsys, command)
        assert "cannot read the installed gguf's version" in err and 'pip install -U "transformers>=5.23"' in err, err
    assert not (tmp_path / "out").exists()


def test_commands_called_from_python_give_the_callers_thread_count_back(tmp_path, monkeypatch):
    """evaluate, ruler, adapt and recover take --threads for the command's run only: torch's count is global to the
    process, and a notebook (or a test worker sharing the cores) calling them would otherwise keep it."""
    import torch

    from diff_llama.adaptation import AdaptationOptions, adapt
    from diff_llama.options import RecoveryOptions, RetrievalArguments, RulerOptions
    from diff_llama.recovery import recover
    from diff_llama.retrieval import evaluate
    from diff_llama.retrieval.ruler import ruler_models

    seen = []

    def record_and_stop(name):
        seen.append(torch.get_num_threads())
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "display_name", record_and_stop)
    callers = torch.get_num_threads()
    missing = str(tmp_path / "no-such-model")
    calls = [lambda: evaluate.evaluate_models([missing], RetrievalArguments(threads=3)),  # stopped while running
             lambda: ruler_models([missing, missing], RulerOptions(names=["one"], threads=3)),
             lambda: adapt(None, None, AdaptationOptions(threads=3, resume=True)),  # resume with no output folder
             lambda: recover(missing, RecoveryOptions(output=str(tmp_path / "out"), threads=3))]
    for call in calls:
        with pytest.raises((KeyboardInterrupt, ValueError, FileNotFoundError)):
            call()
        assert torch.get_num_threads() == callers
    assert seen == [3]  # the command's own count while it runs
    assert not (tmp_path / "out").exists()
