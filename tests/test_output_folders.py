"""Output folders: `--overwrite` replaces only what diff-llama wrote, never the working directory or home; a killed
run's hidden folders are cleaned up by the next one; an interrupted evaluation resumes; an interrupted training run
says in one line what it kept and how to go on, and that advice works."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from unittest import mock

import pytest

from conftest import folder_checksum, make_llama, tiny_model
from diff_llama.cli import main
from diff_llama.configuration_diff_llama import REMOTE_CODE_FILES
from diff_llama.output_folder import (
    MARKER, changed_since_written, foreign_entries, new_output_folder, read_marker, remove_stale_temporaries,
    write_marker,
)


def _fails_in_one_line(capsys, argv, code=2) -> str:
    """Run the command; it must exit with `code` and write exactly one line to stderr (no traceback)."""
    capsys.readouterr()
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


@pytest.fixture
def model_dir(tmp_path, tokenizer):
    model = tmp_path / "model"
    tiny_model(vocab_size=len(tokenizer), num_attention_heads=8, num_key_value_heads=2).save_pretrained(model)
    tokenizer.save_pretrained(model)
    return model


def _users_files(folder, ours: bool):
    """A user's files (one named like a map attention-map writes), in a folder of theirs or in one of ours."""
    folder.mkdir()
    if ours:
        write_marker(folder, "evaluate")
        (folder / "retrieval.json").write_text("{}")
    (folder / "precious.txt").write_text("my thesis")
    (folder / "layer0-head0.png").write_bytes(b"my picture")
    (folder / "sub").mkdir()
    (folder / "sub" / "notes.txt").write_text("my notes")


OVERWRITE_COMMANDS = {
    "convert": ["convert", "{model}", "{out}"],
    "evaluate": ["evaluate", "{model}", "--output", "{out}", "--lengths", "64", "--settings", "1x1", "--depths", "50",
                 "--cases-per-depth", "1", "--perplexity-tokens", "0"],
    "demo": ["demo", "--output", "{out}", "--steps", "1"],
    "attention-map": ["attention-map", "{model}", "--text", "The quick brown fox", "--layer", "0", "--head", "0",
                      "--output", "{out}"],
    "adapt": ["adapt", "{model}", "{out}", "--max-steps", "1"],
    "export-builtin": ["export-builtin", "{model}", "{out}"],
}


@pytest.mark.parametrize("ours", [False, True], ids=["users-folder", "ours-with-a-users-file"])
@pytest.mark.parametrize("command", OVERWRITE_COMMANDS)
def test_overwrite_never_removes_a_users_file(tmp_path, model_dir, capsys, command, ours):
    out = tmp_path / "out"
    _users_files(out, ours)
    before = folder_checksum(out)
    argv = [a.format(model=model_dir, out=out) for a in OVERWRITE_COMMANDS[command]]
    err = _fails_in_one_line(capsys, [*argv, "--overwrite"])
    assert "--overwrite refused" in err and "precious.txt" in err and "sub/" in err and "choose a new folder" in err
    assert folder_checksum(out) == before and (out / "sub" / "notes.txt").read_text() == "my notes"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder made
    # without --overwrite the refusal does not offer it
    assert "--overwrite" not in _fails_in_one_line(capsys, argv)


# attention-map's --overwrite replaces only the maps it draws, and adds them beside other files of its folder.
@pytest.mark.parametrize("command", [command for command in OVERWRITE_COMMANDS if command != "attention-map"])
def test_overwrite_never_removes_a_users_file_named_like_ours(tmp_path, model_dir, capsys, command):
    """Names close to the project's (a script beside the remote code, a checkpoint folder of the user's, one named
    like the Trainer's without its state) are not the project's: a folder of ours holding them is refused."""
    out = tmp_path / "out"
    out.mkdir()
    if command == "convert":
        (out / "conversion_report.json").write_text("{}")
    else:
        write_marker(out, command)
    (out / "run_diff_llama.py").write_text("print('mine')")
    for name in ("checkpoint-best", "checkpoint-3"):
        (out / name).mkdir()
        (out / name / "notes.txt").write_text("my notes")
    before = folder_checksum(out)
    argv = [a.format(model=model_dir, out=out) for a in OVERWRITE_COMMANDS[command]]
    err = _fails_in_one_line(capsys, [*argv, "--overwrite"])
    assert "--overwrite refused" in err and "checkpoint-3/" in err and "checkpoint-best/" in err, err
    assert "run_diff_llama.py" in err, err
    assert folder_checksum(out) == before


def test_convert_overwrite_never_replaces_a_model_another_command_trained(tmp_path, model_dir, capsys):
    """`adapt` writes a converted model's files (and its marker): `convert --overwrite` replaces only a conversion."""
    out = tmp_path / "adapted"
    out.mkdir()
    tiny_model().save_pretrained(out)
    write_marker(out, "adapt")
    (out / "adapt.json").write_text("{}")
    before = folder_checksum(out)
    err = _fails_in_one_line(capsys, ["convert", str(model_dir), str(out), "--overwrite"])
    assert "holds the output of diff-llama adapt" in err and "convert --overwrite never replaces" in err, err
    assert folder_checksum(out) == before


def test_convert_overwrite_never_removes_a_trainer_run_saved_in_the_converted_folder(tmp_path, llama_dir, capsys):
    """The Trainer's checkpoints are the files of the commands that train: in a conversion's folder, one is a run of
    the user's own (a Trainer pointed at the folder), which `convert --overwrite` leaves alone."""
    out = tmp_path / "diff"
    assert main(["convert", str(llama_dir), str(out), "--no-evaluate"]) == 0
    checkpoint = out / "checkpoint-500"
    checkpoint.mkdir()
    for name in ("trainer_state.json", "optimizer.pt", "model.safetensors", "training_args.bin"):
        (checkpoint / name).write_text("my run")
    before = folder_checksum(out)
    err = _fails_in_one_line(capsys, ["convert", str(llama_dir), str(out), "--overwrite", "--no-evaluate"])
    assert f"{out} holds files diff-llama did not write (checkpoint-500/)" in err, err
    assert folder_checksum(out) == before


def _edit_the_card(out):
    with (out / "README.md").open("a") as card:
        card.write("\nMy notes on this model.\n")


def _save_weights_over(out):
    tiny_model(vocab_size=128).save_pretrained(out)  # the user's own training saved where the conversion is


def _copy_without_times(out):
    """A copy made later that does not keep file times (`cp -r`): every file looks written since."""
    import shutil

    copy = out.with_name("copy")
    shutil.copytree(out, copy, copy_function=shutil.copyfile)
    later = time.time() + 60
    for path in copy.rglob("*"):
        os.utime(path, (later, later))
    shutil.rmtree(out)
    copy.rename(out)


@pytest.mark.parametrize("change, shown", [(_edit_the_card, "README.md"), (_save_weights_over, "model.safetensors"),
                                           (_copy_without_times, "model.safetensors")],
                         ids=["card-edited", "weights-saved-over", "copied-without-times"])
def test_convert_overwrite_never_replaces_a_file_written_again_since(tmp_path, llama_dir, capsys, change, shown):
    """A file of a conversion that was written again since (a model card edited by hand, weights saved there by the
    user's own training) is the user's work: `convert --overwrite` refuses the folder, naming the file and the fix."""
    out = tmp_path / "diff"
    argv = ["convert", str(llama_dir), str(out), "--no-evaluate"]
    assert main(argv) == 0
    change(out)
    before = folder_checksum(out)
    err = _fails_in_one_line(capsys, [*argv, "--overwrite"])
    assert "--overwrite refused" in err and "written again since diff-llama made the folder" in err, err
    assert shown in err and "choose a new folder, or move them out" in err, err
    assert folder_checksum(out) == before
    assert "--overwrite" not in _fails_in_one_line(capsys, argv)  # nor offered


def test_what_convert_writes_is_recorded_and_a_copy_that_keeps_times_stays_replaceable(tmp_path, llama_dir):
    """The record covers every file the conversion wrote, and nothing the command does after it counts as a change:
    an unchanged folder, one copied with its times, and one whose times lost their fraction of a second (a tar
    archive) are replaced by --overwrite. A folder of an older version, without a record, is too."""
    import shutil

    out = tmp_path / "diff"
    argv = ["convert", str(llama_dir), str(out), "--no-evaluate"]
    assert main(argv) == 0
    recorded = read_marker(out)["files"]
    assert {"config.json", "model.safetensors", "README.md", "conversion_report.json"} <= set(recorded)
    assert set(recorded) == {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {MARKER}
    assert changed_since_written(out) == []
    shutil.copytree(out, tmp_path / "copy")  # copy2: times kept
    for path in (tmp_path / "copy").rglob("*"):
        seconds = int(path.stat().st_mtime)
        os.utime(path, (seconds, seconds))
    for folder in (out, tmp_path / "copy"):
        assert main(["convert", str(llama_dir), str(folder), "--no-evaluate", "--overwrite"]) == 0
    old = json.loads((out / MARKER).read_text())
    del old["files"]
    (out / MARKER).write_text(json.dumps(old))
    _edit_the_card(out)  # an older version's folder: nothing says what was written, as before
    assert main([*argv, "--overwrite"]) == 0
    assert "My notes" not in (out / "README.md").read_text()


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_folder_made_at_the_output_while_convert_runs_is_left_as_it_is(tmp_path, llama_dir, capsys, monkeypatch,
                                                                          overwrite):
    """The output is checked when the run starts and again before the finished folder goes into place: a folder the
    user (or a second run) made there meanwhile is kept, and the finished output waits beside it, named."""
    from diff_llama.conversion import converter

    out = tmp_path / "out"
    write_model_files = converter.write_model_files

    def user_makes_the_folder(*args):
        out.mkdir()
        (out / "mine.txt").write_text("important")
        return write_model_files(*args)

    monkeypatch.setattr(converter, "write_model_files", user_makes_the_folder)
    capsys.readouterr()
    assert main(["convert", str(llama_dir), str(out), "--no-evaluate", *overwrite]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    err = err.splitlines()[-1]  # after the progress bar
    assert "was made or changed while this command ran" in err and "the finished output is in" in err, err
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "important"
    (finished,) = [p for p in tmp_path.iterdir() if p.name.startswith("out.finished-")]
    assert str(finished) in err and (finished / "config.json").is_file() and (finished / "model.safetensors").is_file()


@pytest.mark.parametrize("where, what", [(".", "the working directory"), ("..", "a folder above the working directory"),
                                         ("{home}", "your home folder")])
@pytest.mark.parametrize("command", ["convert", "evaluate"])
def test_overwrite_refuses_the_working_directory_its_parents_and_home(tmp_path, model_dir, capsys, monkeypatch,
                                                                      command, where, what):
    work, home = tmp_path / "work", tmp_path / "home"
    for folder in (work, home):
        folder.mkdir()
        write_marker(folder, "evaluate")  # even a folder that looks like ours
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    before = folder_checksum(tmp_path)
    out = where.format(home=home)
    argv = [a.format(model=model_dir, out=out) for a in OVERWRITE_COMMANDS[command]]
    err = _fails_in_one_line(capsys, [*argv, "--overwrite"])
    assert f"{out} is {what}, which diff-llama never replaces" in err
    assert folder_checksum(tmp_path) == before


def test_convert_into_an_empty_working_directory_is_refused(tmp_path, model_dir, capsys, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert "the working directory" in _fails_in_one_line(capsys, ["convert", str(model_dir), "."])
    assert (tmp_path / "work").is_dir() and not any((tmp_path / "work").iterdir())


@pytest.mark.parametrize("command", ["evaluate", "adapt", "convert"])
@pytest.mark.parametrize("output", ["the-model", "above-it"])
def test_overwrite_never_replaces_the_commands_own_input_or_a_folder_holding_it(tmp_path, model_dir, capsys,
                                                                                command, output):
    """`evaluate M --output M --overwrite` (or adapt's, or convert's from a file inside the folder) once replaced the
    model it had just read with its report: the input, and any folder that holds it, is refused with and without
    --overwrite, in one line, and nothing is touched."""
    model_file = model_dir / "model.safetensors"
    source = model_file if command == "convert" else model_dir
    out = model_dir if output == "the-model" else tmp_path
    before = folder_checksum(tmp_path)
    argv = [a.format(model=source, out=out) for a in OVERWRITE_COMMANDS[command]]
    err = _fails_in_one_line(capsys, [*argv, "--overwrite"])
    assert "--overwrite refused" in err and "this command's input" in err and "give a new folder" in err, err
    assert "--overwrite" not in _fails_in_one_line(capsys, argv)
    assert folder_checksum(tmp_path) == before


@pytest.mark.parametrize("command", ["evaluate", "adapt"])
def test_a_report_or_a_run_never_replaces_a_model_another_command_wrote(tmp_path, model_dir, llama_dir, capsys,
                                                                         command):
    """--overwrite of evaluate (or adapt) replaces only an earlier output of its own: not a converted model (nor a
    demo's folder) elsewhere, which its refusal without --overwrite does not offer either."""
    converted = tmp_path / "converted"
    assert main(["convert", str(llama_dir), str(converted), "--no-evaluate"]) == 0
    demo = tmp_path / "demo"
    demo.mkdir()
    write_marker(demo, "demo")
    for out, what in [(converted, "holds a model"), (demo, "holds the output of diff-llama demo")]:
        before = folder_checksum(out)
        argv = [a.format(model=model_dir, out=out) for a in OVERWRITE_COMMANDS[command]]
        err = _fails_in_one_line(capsys, [*argv, "--overwrite"])
        assert what in err and f"{command} --overwrite never replaces" in err and "choose a new folder" in err, err
        assert "delete it yourself" not in err, err  # its marker says which command wrote it
        assert "--overwrite" not in _fails_in_one_line(capsys, argv)
        assert folder_checksum(out) == before


def test_a_model_with_no_record_is_refused_with_the_way_out_for_an_older_output(tmp_path, model_dir, capsys):
    """A model folder without a marker (from elsewhere, or an export-builtin output of a diff-llama that wrote none)
    is not replaced, and the refusal says so, offering what to do if it is the user's own older output."""
    old = tmp_path / "old-export"
    assert main(["export-builtin", str(model_dir), str(old)]) == 0
    (old / ".diff-llama-output").unlink()
    before = folder_checksum(old)
    err = _fails_in_one_line(capsys, ["export-builtin", str(model_dir), str(old), "--overwrite"])
    assert "holds a model with no record of the command that wrote it" in err, err
    assert "delete it yourself if it is an earlier export-builtin output" in err, err
    assert folder_checksum(old) == before


INSIDE_AN_INPUT = {
    "convert": (["convert", "{llama}", "{llama}/diff"], "llama"),
    "train-in-the-model": (["train", "{model}", "--data", "{text}", "--output", "{model}/run"], "model"),
    "train-in-the-data": (["train", "{model}", "--data", "{data}", "--output", "{data}/runs/lora"], "data"),
    "recover": (["recover", "{v1}", "--output", "{v1}/recovered"], "v1"),
    "recover-in-the-source": (["recover", "{v1}", "--source", "{llama}", "--output", "{llama}/recovered"], "llama"),
    "evaluate": (["evaluate", "{llama}", "{model}", "--output", "{model}/eval"], "model"),
    "adapt": (["adapt", "{model}", "{model}/adapted"], "model"),
    "attention-map": (["attention-map", "{model}", "--text", "The quick brown fox", "--layer", "0", "--output",
                       "{model}/maps"], "model"),
    "attention-map-in-the-source": (["attention-map", "{model}", "--text", "The fox", "--layer", "0", "--source",
                                     "{llama}", "--output", "{llama}/maps"], "llama"),
    "export-builtin": (["export-builtin", "{model}", "{model}/builtin"], "model"),
}


@pytest.mark.parametrize("command", INSIDE_AN_INPUT)
def test_no_command_writes_its_output_inside_a_folder_it_reads(tmp_path, model_dir, llama_dir, capsys, command):
    """`train M --output M/run` once wrote the run into the model folder it trained (which `push M` would then
    upload), and `train M --data DIR --output DIR/run` into the data, whose model card the next run read as training
    text. An output inside any folder a command reads is refused in one line, before any work, changing nothing."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 50)
    v1 = tmp_path / "v1"
    if command.startswith("recover"):
        assert main(["convert", str(llama_dir), str(v1), "--diff-version", "1", "--no-evaluate"]) == 0
    argv, read = INSIDE_AN_INPUT[command]
    folders = dict(model=model_dir, llama=llama_dir, data=data, v1=v1)
    argv = [a.format(text=data / "text.txt", **folders) for a in argv]
    inputs = {name: folder_checksum(folder) for name, folder in folders.items() if folder.exists()}
    output = argv[argv.index("--output") + 1] if "--output" in argv else argv[2]
    err = _fails_in_one_line(capsys, argv)
    assert err.endswith(f"error: {output} is inside {folders[read]}, which this command reads; writing there would "
                        "change it, so give a folder outside it."), err
    assert {name: folder_checksum(folders[name]) for name in inputs} == inputs


def test_every_file_the_model_folders_hold_is_one_overwrite_may_replace(tmp_path, model_dir):
    write_marker(model_dir, "demo")
    for name in REMOTE_CODE_FILES:
        (model_dir / name).write_text("")
    assert foreign_entries(model_dir) == []


# ---- a killed conversion's hidden folders ---------------------------------------------------------------------------


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def test_convert_removes_the_hidden_folders_of_a_killed_run_and_says_so(tmp_path, llama_dir, capsys):
    host, dead = socket.gethostname(), _dead_pid()
    killed = tmp_path / f".diff.partial-{host}-{dead}-abcd1234"
    older = tmp_path / ".diff.partial-zz9_ab12"  # an older version's name: judged by its age
    running = tmp_path / f".diff.partial-{host}-{os.getppid()}-efgh5678"  # a live process's
    strange = tmp_path / f".diff.partial-{host}-{dead}-ijkl9012"  # holds something our runs never write
    for folder in (killed, older, running, strange):
        folder.mkdir()
        (folder / "model-00001-of-00003.safetensors").write_bytes(b"half")
    (strange / "notes.txt").write_text("mine")
    (killed / "additional_chat_templates").mkdir()  # the converter writes this folder too
    (killed / "additional_chat_templates" / "tool_use.jinja").write_text("TOOL")
    long_ago = time.time() - 7200
    for path in (older / "model-00001-of-00003.safetensors", older):
        os.utime(path, (long_ago, long_ago))
    capsys.readouterr()
    assert main(["convert", str(llama_dir), str(tmp_path / "diff"), "--no-evaluate"]) == 0
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("Removed"))
    assert older.name in line and killed.name in line and running.name not in line and strange.name not in line
    assert not killed.exists() and not older.exists() and running.exists() and (strange / "notes.txt").exists()
    assert (tmp_path / "diff" / "model.safetensors").exists()


def test_an_output_moved_aside_by_a_killed_swap_is_put_back(tmp_path, capsys):
    aside = tmp_path / f".diff.old-{socket.gethostname()}-{_dead_pid()}-abcd1234"
    (aside / "old").mkdir(parents=True)
    (aside / "old" / "conversion_report.json").write_text("{}")
    remove_stale_temporaries(tmp_path / "diff")
    assert (tmp_path / "diff" / "conversion_report.json").read_text() == "{}" and not aside.exists()
    assert "Restored" in capsys.readouterr().err


# ---- an interrupted evaluation resumes ----------------------------------------------------------------------------


def _evaluate_argv(llama, out, *extra):
    return ["evaluate", str(llama), str(llama), "--names", "a", "b", "--output", str(out), "--lengths", "160",
            "--settings", "1x1", "--depths", "0", "50", "100", "--cases-per-depth", "1", "--perplexity-tokens", "0",
            "--max-new-tokens", "2", *extra]


def _count_cases(monkeypatch, stop_at=None):
    """Count the cases scored (the real run_cases, a case a call by default); with `stop_at`, press Ctrl-C as that
    case starts."""
    from diff_llama.retrieval import evaluate

    calls, real = [], evaluate.run_cases

    def run_cases(model, tokenizer, cases, *args, **kwargs):
        calls.extend([1] * len(cases))
        if len(calls) - len(cases) < (stop_at or 0) <= len(calls):  # this call has case `stop_at`
            raise KeyboardInterrupt
        return real(model, tokenizer, cases, *args, **kwargs)

    monkeypatch.setattr(evaluate, "run_cases", run_cases)
    return calls


def _cases(report):
    """Every case's result but its timing and its attention shares (which the number of threads may move a little)."""
    return [[{k: v for k, v in case.items() if k not in ("seconds", "allocation")} for case in m["cases"]]
            for m in report["models"]]


def test_an_interrupted_evaluation_resumes_without_scoring_a_case_twice(tmp_path, tokenizer, capsys, monkeypatch):
    llama = make_llama(tmp_path / "llama", tokenizer, num_attention_heads=2, num_key_value_heads=1, hidden_size=16)
    out = tmp_path / "eval"
    _count_cases(monkeypatch, stop_at=5)  # Ctrl-C in model b's second case
    capsys.readouterr()
    assert main(_evaluate_argv(llama, out)) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"diff-llama evaluate: interrupted; the cases scored so far are kept in {out / 'cases.jsonl'}: run the same "
        "command again to resume")
    assert not (out / "retrieval.json").exists() and len((out / "cases.jsonl").read_text().splitlines()) == 4
    with open(out / "cases.jsonl", "a") as handle:  # a line cut short, as by a kill
        handle.write('{"model": "b", "len')
    # other options: refused in one line, nothing changed
    before = folder_checksum(out)
    err = _fails_in_one_line(capsys, _evaluate_argv(llama, out, "--seed", "1"))
    assert "interrupted evaluation with other models or options (seed 0, not 1)" in err
    assert folder_checksum(out) == before

    # an interruption under a diff-llama older than --batch-size: its marker has no batch_size, and 1 is what it ran
    marker = json.loads((out / MARKER).read_text())
    del marker["run"]["options"]["batch_size"]
    (out / MARKER).write_text(json.dumps(marker))
    err = _fails_in_one_line(capsys, _evaluate_argv(llama, out, "--batch-size", "2"))
    assert "other models or options (batch_size 1, not 2)" in err

    calls = _count_cases(monkeypatch)
    assert main(_evaluate_argv(llama, out, "--threads", "1")) == 0  # threads may change
    assert "the 4 case(s) already scored in cases.jsonl are kept" in capsys.readouterr().err
    assert len(calls) == 2
    resumed = json.loads((out / "retrieval.json").read_text())
    assert [json.loads(line)["model"] for line in (out / "cases.jsonl").read_text().splitlines()] == ["a"] * 3 + ["b"] * 3
    assert main(_evaluate_argv(llama, tmp_path / "fresh")) == 0
    assert _cases(resumed) == _cases(json.loads((tmp_path / "fresh" / "retrieval.json").read_text()))
    # a finished evaluation is not resumed: it is replaced with --overwrite only
    assert "pass --overwrite to replace it" in _fails_in_one_line(capsys, _evaluate_argv(llama, out))
    assert main(_evaluate_argv(llama, out, "--overwrite")) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "cases.jsonl", "retrieval.json", "retrieval.md",
                                                            "retrieval.png"])


# ---- an interrupted training run says how to go on ------------------------------------------------------------------


def _interrupt_training_at(monkeypatch, step):
    """Ctrl-C as the Trainer ends optimiser step `step`, before it saves that step's checkpoint."""
    from diff_llama.training import LogLastStep

    real = LogLastStep.on_step_end

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == step:
            raise KeyboardInterrupt
        return real(self, args, state, control, **kwargs)

    monkeypatch.setattr(LogLastStep, "on_step_end", on_step_end)


def _interrupted(capsys, argv) -> str:
    """Run the command, which Ctrl-C stops: exit code 130 and one line after the progress bars, which it returns."""
    capsys.readouterr()
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_an_interrupted_train_names_its_last_checkpoint_and_resume_continues_from_it(
        tmp_path, model_dir, capsys, monkeypatch):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "run"
    argv = ["train", str(model_dir), "--data", str(text), "--output", str(out), "--block-size", "32",
            "--batch-size", "2", "--save-steps", "2", "--logging-steps", "1", "--max-steps", "4", "--no-monitor"]
    with monkeypatch.context() as patch:
        _interrupt_training_at(patch, 3)
        assert _interrupted(capsys, argv) == (f"diff-llama train: interrupted; {out / 'checkpoint-2'} holds the run up "
                                              "to step 2: run the command again with --resume to continue")
    assert main(argv) == 2  # as without the advice: a fresh start on top of the checkpoints is refused
    assert main([*argv, "--resume"]) == 0
    history = json.loads((out / "training_log.json").read_text())
    assert [entry["step"] for entry in history if "loss" in entry] == [1, 2, 3, 4]

    # Stopped before its first checkpoint: nothing kept, not even the folders the run made, and the same command
    # starts over.
    early = [*argv[:5], str(tmp_path / "runs" / "early"), *argv[6:]]
    with monkeypatch.context() as patch:
        _interrupt_training_at(patch, 1)
        assert _interrupted(capsys, early) == (
            "diff-llama train: interrupted; no checkpoint was written yet (one every --save-steps steps); run the "
            "command again to start over")
    assert not (tmp_path / "runs").exists()
    assert main(early) == 0


def test_a_recover_stopped_before_its_first_checkpoint_leaves_no_folder(tmp_path, tokenizer, capsys, monkeypatch):
    from transformers import Trainer

    make_llama(tmp_path / "llama", tokenizer, num_hidden_layers=1)
    assert main(["convert", str(tmp_path / "llama"), str(tmp_path / "v1"), "--diff-version", "1",
                 "--calibration-tokens", "256", "--seq-len", "128", "--no-evaluate"]) == 0
    monkeypatch.setattr(Trainer, "training_step", mock.Mock(side_effect=KeyboardInterrupt))
    argv = ["recover", str(tmp_path / "v1"), "--output", str(tmp_path / "runs" / "recovered"), "--max-steps", "2",
            "--block-size", "16", "--batch-size", "1", "--eval-tokens", "64"]
    assert _interrupted(capsys, argv) == (
        "diff-llama recover: interrupted; no checkpoint was written yet (one every --save-steps steps); run the "
        "command again to start over")
    assert not (tmp_path / "runs").exists()
    # A folder that was there before the run is the user's: an interrupted run keeps it.
    (tmp_path / "mine").mkdir()
    assert _interrupted(capsys, [*argv[:3], str(tmp_path / "mine"), *argv[4:]]).endswith("run the command again to "
                                                                                          "start over")
    assert (tmp_path / "mine").is_dir()


def test_an_interrupted_demo_leaves_its_output_as_it_was(tmp_path, capsys, monkeypatch):
    """Ctrl-C after the demo saved its model, while it generates: the new folder is not left half made, and an
    earlier demo's folder that --overwrite was replacing is kept."""
    import diff_llama.demo

    def interrupted_pipeline(*args, **kwargs):
        raise KeyboardInterrupt

    out = tmp_path / "demo"
    argv = ["demo", "--output", str(out), "--steps", "1"]
    with monkeypatch.context() as patch:
        patch.setattr(diff_llama.demo, "pipeline", interrupted_pipeline)
        assert _interrupted(capsys, argv) == (
            "diff-llama demo: interrupted; nothing was written; run the command again to start over")
        assert not out.exists() and list(tmp_path.iterdir()) == []
    assert main(argv) == 0
    before = folder_checksum(out)
    with monkeypatch.context() as patch:
        patch.setattr(diff_llama.demo, "pipeline", interrupted_pipeline)
        assert _interrupted(capsys, [*argv, "--overwrite"]) == (
            f"diff-llama demo: interrupted; {out} is left as it was; run the command again to start over")
    assert folder_checksum(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


@pytest.mark.parametrize("command", [
    ["train", "{model}", "--data", "{text}", "--output", "{out}", "--max-steps", "2", "--save-steps", "1",
     "--block-size", "32", "--no-monitor"],
    ["train", "{model}", "--data", "{text}", "--output", "{out}", "--max-steps", "1", "--block-size", "32", "--lora",
     "--no-monitor"],
    ["demo", "--output", "{out}", "--steps", "1"],
    ["convert", "{llama}", "{out}"],
], ids=["train", "train-lora", "demo", "convert"])
def test_the_weights_a_command_writes_are_as_readable_as_its_other_files(tmp_path, model_dir, llama_dir, command):
    """safetensors 0.8 writes its files 0600 whatever the umask; a trained model must be readable where its config
    is (another user's server, a container)."""
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "out"
    umask = os.umask(0o022)
    try:
        argv = [a.format(model=model_dir, llama=llama_dir, out=out, text=tmp_path / "text.txt") for a in command]
        assert main(argv) == 0
    finally:
        os.umask(umask)
    weights = sorted(out.rglob("*.safetensors"))
    assert weights and {path.stat().st_mode & 0o777 for path in weights} == {0o644}, weights
    assert {path.stat().st_mode & 0o777 for path in out.rglob("*.json")} == {0o644}


def test_a_failed_run_leaves_no_folder_it_created(tmp_path, capsys, monkeypatch):
    """Bad input found after the output's folders were made: convert and demo (atomic outputs) and evaluate (a
    folder written in place) remove the folders above the output that they created, and keep those that were there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kept").mkdir()
    assert "no such folder" in _fails_in_one_line(capsys, ["convert", str(tmp_path / "absent"), "new/sub/model"])
    assert "no such folder" in _fails_in_one_line(capsys, ["convert", str(tmp_path / "absent"), "kept/sub/model"])
    assert "--steps must be 1 or more" in _fails_in_one_line(capsys, ["demo", "--output", "new/demo", "--steps", "0"])
    with pytest.raises(RuntimeError):  # evaluate, ruler and demo: a failure before anything was written
        with new_output_folder("new/deeper/run", command="evaluate"):
            raise RuntimeError("the models did not load")
    with pytest.raises(RuntimeError):
        with new_output_folder("kept/run", command="evaluate"):
            raise RuntimeError("the models did not load")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["kept"] and not any((tmp_path / "kept").iterdir())


@pytest.mark.parametrize("command", OVERWRITE_COMMANDS)
def test_an_output_under_a_file_is_one_line_naming_the_file(tmp_path, model_dir, llama_dir, capsys, command):
    """Refused before any model is read."""
    (tmp_path / "notes.txt").write_text("mine")
    out = tmp_path / "notes.txt" / "out"
    model = llama_dir if command == "convert" else model_dir
    argv = [part.format(model=model, out=out) for part in OVERWRITE_COMMANDS[command]]
    err = _fails_in_one_line(capsys, argv)
    assert err.endswith(f"error: cannot create the folder {out}: {tmp_path / 'notes.txt'} is a file; choose a place "
                        "you can write to"), err
    assert (tmp_path / "notes.txt").read_text() == "mine"


SYMLINKED_OUTPUT_COMMANDS = {
    **OVERWRITE_COMMANDS,
    "train": ["train", "{model}", "--data", "{text}", "--output", "{out}", "--max-steps", "1"],
    "export-builtin": ["export-builtin", "{model}", "{out}"],
}


@pytest.mark.parametrize("target", ["missing", "empty-folder"])
@pytest.mark.parametrize("command", SYMLINKED_OUTPUT_COMMANDS)
def test_a_symbolic_link_as_the_output_is_refused_before_any_work(tmp_path, model_dir, llama_dir, capsys, command,
                                                                   target):
    """A replacement would put a folder in the link's place (or fail at the end, for a link to nothing, with the
    finished output hidden): refused in one line, the link and what it points to left as they were."""
    (tmp_path / "empty-folder").mkdir()
    out = tmp_path / "link"
    out.symlink_to(tmp_path / target)
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    model = llama_dir if command == "convert" else model_dir
    argv = [part.format(model=model, out=out, text=tmp_path / "text.txt") for part in SYMLINKED_OUTPUT_COMMANDS[command]]
    before = sorted(path.name for path in tmp_path.iterdir())
    err = _fails_in_one_line(capsys, argv)
    missing = ", which does not exist" if target == "missing" else ""
    assert err.endswith(f"error: {out} is a symbolic link to {tmp_path / target}{missing}; give a real folder for the "
                        "output (the folder the link points to, or a new name)."), err
    assert sorted(path.name for path in tmp_path.iterdir()) == before
    assert out.is_symlink() and not any((tmp_path / "empty-folder").iterdir())


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no folder can be made")
def test_an_output_the_file_system_will_not_hold_is_one_line(llama_dir, capsys):
    for overwrite in ([], ["--overwrite"]):  # in place, and through the hidden temporary folder of a replacement
        err = _fails_in_one_line(capsys, ["convert", str(llama_dir), "/proc/diff-llama-out", *overwrite])
        assert err.endswith("error: cannot create the folder /proc/diff-llama-out: No such file or directory; choose a "
                            "place you can write to"), err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device that is always full")
def test_a_full_disk_during_conversion_is_one_line_and_leaves_nothing(tmp_path, llama_dir, capsys, monkeypatch):
    """The weights are written to /dev/full, so the kernel itself refuses them (ENOSPC), as a full disk would."""
    import builtins

    from diff_llama.conversion import writer

    def full_disk_for_writes(path, mode="r", *args, **kwargs):
        return builtins.open("/dev/full" if "w" in mode else path, mode, *args, **kwargs)

    monkeypatch.setattr(writer, "open", full_disk_for_writes, raising=False)
    capsys.readouterr()
    assert main(["convert", str(llama_dir), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "bug" not in err
    progress, err = err.strip().rsplit("\n", 1)  # the progress bar, closed before the error is printed
    assert progress.startswith("converting") and err == ("diff-llama convert: error: No space left on device; free some space, or choose a place with more, "
                   "and run it again"), err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["llama"]  # no output, no hidden partial folder


@pytest.fixture
def small_file_system(tmp_path):
    """A real file system with room for a config and a tokenizer but not the weights: a 96 KiB tmpfs (mounting needs
    root, as the CI machine runs)."""
    place = tmp_path / "small"
    place.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(place)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield place
    finally:
        subprocess.run(["umount", str(place)], check=True)


@pytest.mark.parametrize("command", ["export-builtin", "train"])
def test_a_full_disk_while_the_weights_are_written_is_one_line(tmp_path, model_dir, capsys, small_file_system,
                                                                command):
    """safetensors names the OS error only in the text of its own error type; it is said as any other full disk is,
    and the advice of a rerun points the right way."""
    out = small_file_system / "out"
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    argv = {"export-builtin": ["export-builtin", str(model_dir), str(out)],
            "train": ["train", str(model_dir), "--data", str(tmp_path / "text.txt"), "--output", str(out),
                      "--max-steps", "2", "--save-steps", "1", "--block-size", "16"]}[command]
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "bug" not in err
    err = err.strip().rsplit("\n", 1)[-1]  # after the progress bars, closed before the error is printed
    advice = "; free some space, or choose a place with more, and run it again"
    if command == "export-builtin":  # the weights first: written by safetensors
        assert err == f"diff-llama export-builtin: error: No space left on device (a .safetensors file){advice}", err
        assert not any(small_file_system.iterdir())  # nothing half written
    else:  # the Trainer writes its checkpoint in place (the model's code first): the rerun's advice is the one that works
        partial = out / "checkpoint-1"
        assert re.fullmatch(rf"diff-llama train: error: No space left on device \({re.escape(str(partial))}/\S+\)"
                            rf"{re.escape(advice)}", err), err
        assert partial.is_dir() and not (partial / "trainer_state.json").exists()
        err = _fails_in_one_line(capsys, argv)
        assert err.endswith(f"{partial} was cut short while being written (it has no trainer_state.json) and no "
                            "checkpoint is complete; remove it and run the command again, or choose a new folder."), err


@pytest.mark.parametrize("stage", ["reading the source", "writing the weights"])
def test_ctrl_c_during_conversion_says_the_output_is_as_it_was(tmp_path, llama_dir, capsys, monkeypatch, stage):
    from diff_llama.conversion import converter, writer

    out = tmp_path / "out"
    assert main(["convert", str(llama_dir), str(out)]) == 0
    before = folder_checksum(out)

    def ctrl_c_on_writing(path, mode="r", *args, **kwargs):
        if "w" in mode:
            raise KeyboardInterrupt
        return open(path, mode, *args, **kwargs)

    if stage == "writing the weights":
        monkeypatch.setattr(writer, "open", ctrl_c_on_writing, raising=False)
    else:
        monkeypatch.setattr(converter, "layerwise_runner", mock.Mock(side_effect=KeyboardInterrupt))
    for argv, said in (([str(tmp_path / "new")], "nothing was written"),
                       ([str(out), "--overwrite"], f"{out} is left as it was")):
        capsys.readouterr()
        assert main(["convert", str(llama_dir), *argv]) == 130
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert err.strip().splitlines()[-1] == f"diff-llama convert: interrupted; {said}; run the command again to " \
                                               "start over"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["llama", "out"] and folder_checksum(out) == before
