"""The model card and `diff-llama push`. The Hub is unreachable here: uploads go to a local fake of its HTTP API
(tests/fake_hub.py) through the real huggingface_hub client."""

import json
import os
import time

import pytest
from conftest import make_llama, tiny_model
from fake_hub import FakeHub
from huggingface_hub import ModelCard

from diff_llama.cli import main
from diff_llama.errors import UserError
from diff_llama.publishing import check_publishable, files_to_upload, push


@pytest.fixture
def converted(tmp_path, tokenizer):
    source = make_llama(tmp_path / "llama", tokenizer)
    out = tmp_path / "diff"
    assert main(["convert", str(source), str(out), "--diff-version", "1", "--calibration-tokens", "1024",
                 "--eval-tokens", "1024"]) == 0
    (out / "checkpoint-5").mkdir()  # training leftovers must not be uploaded
    (out / "checkpoint-5" / "optimizer.pt").write_bytes(b"x")
    return out


@pytest.fixture
def online(monkeypatch):
    # The test suite runs with HF_HUB_OFFLINE=1, which makes the client refuse any HTTP call; the fake Hub is local.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_files_to_upload_are_the_loadable_model_without_checkpoints(converted):
    files = files_to_upload(converted)
    for needed in ("config.json", "model.safetensors", "configuration_diff_llama.py", "modeling_diff_llama.py",
                   "tokenizer.json", "README.md", "conversion_report.json"):
        assert needed in files
    assert not any(f.startswith("checkpoint-") for f in files)


def test_model_card_metadata_and_measured_quality(converted):
    card = ModelCard.load(converted / "README.md")
    report = json.loads((converted / "conversion_report.json").read_text())
    assert card.data.library_name == "transformers"
    assert "diff-llama" in card.data.tags and card.data.pipeline_tag == "text-generation"
    assert card.data.eval_results[0].metric_type == "perplexity"
    assert card.data.eval_results[0].metric_value == pytest.approx(report["quality"]["converted_perplexity"], abs=1e-3)
    assert f"{report['quality']['source_perplexity']:.2f}" in card.text
    assert card.text.lstrip().startswith("# diff\n")  # the output's name, not the temporary folder it was written in
    assert "partial" not in str(card)


def test_push_uploads_exactly_the_folder_and_a_card_for_the_repo(converted, online):
    before = {p: p.read_bytes() for p in converted.rglob("*") if p.is_file()}
    with FakeHub() as hub:
        url = push(converted, "alice/tiny-diff", token="hf_fake", endpoint=hub.endpoint, private=True)
        repo = hub.repos["alice/tiny-diff"]
        assert hub.validated_cards and "library_name: transformers" in hub.validated_cards[0]
    assert url.startswith(hub.endpoint) and repo["visibility"] == "private" and len(repo["commits"]) == 1
    assert sorted(repo["files"]) == files_to_upload(converted)
    for name in ("model.safetensors", "config.json", "modeling_diff_llama.py"):
        assert repo["files"][name] == (converted / name).read_bytes()
    card = repo["files"]["README.md"].decode()
    assert 'from_pretrained("alice/tiny-diff", trust_remote_code=True)' in card
    assert {p: p.read_bytes() for p in converted.rglob("*") if p.is_file()} == before  # the folder is untouched


def test_push_command_dry_run_and_errors(tmp_path, converted, capsys, online):
    assert main(["push", str(converted), "alice/x", "--dry-run"]) == 0
    assert capsys.readouterr().out.split() == files_to_upload(converted)

    with FakeHub() as hub:  # a repo that exists already is reused, and a wrong token is reported
        push(converted, "alice/x", token="hf_fake", endpoint=hub.endpoint)
        push(converted, "alice/x", token="hf_fake", endpoint=hub.endpoint, commit_message="again")
        assert hub.repos["alice/x"]["commits"] == ["Upload DiffLlama model", "again"]

    plain = tmp_path / "plain"
    tiny_model().save_pretrained(plain)
    (plain / "modeling_diff_llama.py").unlink()
    with pytest.raises(ValueError, match="remote code"):
        check_publishable(plain)
    assert main(["push", str(tmp_path / "missing"), "alice/x"]) == 2
    assert "no such folder" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["config", "weights"])
def test_push_refuses_a_folder_that_would_not_load_from_the_hub(tmp_path, converted, capsys, online, damage):
    """A config.json that is not JSON, or a weights file cut short: one line, before anything is listed or sent."""
    if damage == "config":
        (converted / "config.json").write_text("{'model_type': 'diff_llama'}")
        says = f"{converted}/config.json is not valid JSON (Expecting property name enclosed in double quotes"
    else:
        weights = converted / "model.safetensors"
        os.truncate(weights, weights.stat().st_size - 100)
        says = f"{weights} is truncated or corrupt (Error while deserializing header: incomplete metadata"
    with FakeHub() as hub:
        for dry_run in (["--dry-run"], []):
            capsys.readouterr()
            assert main(["push", str(converted), "alice/x", "--token", "hf_fake", *dry_run]) == 2
            captured = capsys.readouterr()
            assert captured.out == "" and captured.err.startswith(f"diff-llama push: error: {says}"), captured.err
            assert captured.err.count("\n") == 1
        assert hub.repos == {}


def test_push_names_the_users_own_files_and_exclude_leaves_them_out(converted, online, capsys):
    """What a command or save_pretrained wrote goes up unnamed; a file of the user's goes up too (as hf upload does)
    but is named first, and --exclude leaves it out. A pattern that matches nothing (a typo would publish the very
    file it meant to keep back) or that takes what the model needs to load is refused before anything is sent."""
    (converted / "training_log.json").write_text("[]")  # train's report: ours
    capsys.readouterr()
    assert main(["push", str(converted), "alice/x", "--dry-run"]) == 0
    assert capsys.readouterr().err == ""
    (converted / "notes.txt").write_text("not for the Hub")
    (converted / "drafts").mkdir()
    (converted / "drafts" / "card.md").write_text("draft")
    assert main(["push", str(converted), "alice/x", "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert {"notes.txt", "drafts/card.md"} <= set(captured.out.split())
    assert captured.err == ("note: push uploads 2 files that neither diff-llama nor save_pretrained writes: "
                            "drafts/card.md, notes.txt (--exclude PATTERN leaves files out).\n")
    exclude = ["--exclude", "notes.txt", "drafts/*"]
    assert main(["push", str(converted), "alice/x", "--dry-run", *exclude]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "notes.txt" not in captured.out and "drafts/card.md" not in captured.out
    with FakeHub() as hub:
        push(converted, "alice/x", token="hf_fake", endpoint=hub.endpoint, exclude=exclude[1:])
        uploaded = sorted(hub.repos["alice/x"]["files"])
    assert uploaded == captured.out.split() and "training_log.json" in uploaded
    with FakeHub() as hub:  # no card at all, neither the folder's nor one built for the repository
        push(converted, "alice/x", token="hf_fake", endpoint=hub.endpoint, exclude=["README.md"])
        assert "README.md" not in hub.repos["alice/x"]["files"]

    for pattern, says in [("note.txt", "--exclude 'note.txt' matches no file that push would upload from"),
                          ("*.py", "--exclude '*.py' would leave out compat_diff_llama.py, configuration_diff_llama.py, "
                                   "differential_kernels.py and 3 more, which the model needs to load from the Hub")]:
        with FakeHub() as hub:
            for dry_run in (["--dry-run"], []):
                assert main(["push", str(converted), "alice/x", "--token", "hf_fake", "--exclude", pattern,
                             *dry_run]) == 2
                captured = capsys.readouterr()
                assert captured.out == "" and captured.err.startswith(f"diff-llama push: error: {says}"), captured.err
                assert "nothing was uploaded" in captured.err and captured.err.count("\n") == 1
            with pytest.raises(UserError, match="--exclude"):
                push(converted, "alice/x", token="hf_fake", endpoint=hub.endpoint, exclude=[pattern])
            assert hub.repos == {}


def test_the_dry_run_lists_what_push_writes_for_a_folder_without_a_readme(converted, online, capsys):
    (converted / "README.md").unlink()
    assert main(["push", str(converted), "alice/x", "--dry-run"]) == 0
    listed = capsys.readouterr().out.split()
    assert "README.md" in listed  # the card built for alice/x
    with FakeHub() as hub:
        push(converted, "alice/x", token="hf_fake", endpoint=hub.endpoint)
        assert sorted(hub.repos["alice/x"]["files"]) == listed
    assert main(["push", str(converted), "alice/x", "--dry-run", "--keep-card"]) == 0
    assert "README.md" not in capsys.readouterr().out.split()  # the folder's own card, which it does not have


@pytest.mark.parametrize("repo_id", ["your-name/team/model", "my model", "", "team/model-", "a/" + "b" * 97])
def test_push_refuses_a_repository_id_the_hub_would_refuse_before_anything_else(converted, repo_id, online, capsys):
    with FakeHub() as hub:
        for dry_run in ([], ["--dry-run"]):
            assert main(["push", str(converted), repo_id, "--token", "hf_fake", *dry_run]) == 2
            err = capsys.readouterr().err.strip()
            assert err == (f"diff-llama push: error: {repo_id!r} is not a Hub repository id: give owner/name (or name, "
                           "in your own namespace), each part letters, digits, '-', '_' or '.', at most 96 characters, "
                           "e.g. your-name/SmolLM2-135M-diff")
        with pytest.raises(UserError, match="is not a Hub repository id"):
            push(converted, repo_id, token="hf_fake", endpoint=hub.endpoint)
        assert not hub.repos


def test_push_names_the_cause_and_the_fix_for_an_adapter(tmp_path, capsys):
    from peft import get_peft_model

    from diff_llama.training import lora_config

    get_peft_model(tiny_model(), lora_config()).save_pretrained(tmp_path / "adapter")
    assert main(["push", str(tmp_path / "adapter"), "alice/x", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is a LoRA adapter" in err
    assert f"diff-llama merge {tmp_path / 'adapter'} MERGED_FOLDER" in err  # the fix, as a command


@pytest.mark.parametrize("minutes,lambdas,says", [
    (0.4, [0.004, 0.01, 0.0], ["3 steps, 24 s of training", "this run stopped before all layers got there",
                               "lowest λ: 0.000"]),
    (30.1, [0.12, 0.125, 0.1195], ["3 steps, 30 minutes of training", "all layers reached it"]),
])
def test_card_tells_the_truth_about_short_recovery_runs(converted, minutes, lambdas, says):
    from diff_llama.model_card import build_model_card

    quality = json.loads((converted / "conversion_report.json").read_text())["quality"]
    recovery = {"steps": 3, "curve": [{"train_minutes": 0.0}, {"train_minutes": minutes}], "lambda_floor": 0.12,
                "lambdas": lambdas, "final_mean_abs_lambda": sum(map(abs, lambdas)) / 3, "text": "some text",
                "lora": False, "final_perplexity": 12.0, "source_perplexity": quality["source_perplexity"],
                "ratio": 12.0 / quality["source_perplexity"]}
    (converted / "recovery_report.json").write_text(json.dumps(recovery))
    card = str(build_model_card(converted))
    for sentence in says:
        assert sentence in card
    assert "CPU minutes" not in card and "λ held at" not in card


def test_push_to_an_unreachable_hub_is_one_line_and_creates_nothing(converted, online):
    from fake_hub import unreachable_endpoint

    from diff_llama.hub import HubUnreachableError

    before = {p: p.read_bytes() for p in converted.rglob("*") if p.is_file()}
    endpoint = unreachable_endpoint()
    started = time.monotonic()
    with pytest.raises(HubUnreachableError) as error:
        push(converted, "alice/x", token="hf_fake", endpoint=endpoint)
    assert time.monotonic() - started < 10
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"cannot push to alice/x: the Hugging Face Hub ({endpoint}) is "
                                                      "not reachable (")
    assert "nothing was uploaded" in message and "--dry-run" in message
    assert {p: p.read_bytes() for p in converted.rglob("*") if p.is_file()} == before


def test_push_command_without_network_is_one_line_with_exit_code_2(converted, online, capsys):
    """This machine's real network (no route to the Hub): the error names the cause and the fix at once, instead of a
    bare ConnectError with exit code 1."""
    from diff_llama.hub import _request_failure, hub_endpoint

    if _request_failure(hub_endpoint(), 3.0) is None:
        pytest.skip("the Hub is reachable from here")
    capsys.readouterr()
    started = time.monotonic()
    assert main(["push", str(converted), "alice/x", "--token", "hf_fake"]) == 2
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("diff-llama push: error: cannot push to alice/x: the Hugging Face "
                                                   f"Hub ({hub_endpoint()}) is not reachable"), err
    assert "check the network connection" in err and "push --dry-run" in err



@pytest.mark.parametrize("status, said", [(401, "was not accepted (401)"), (403, "may not write to alice/x (403)")])
def test_push_with_a_token_the_hub_refuses_is_one_line_naming_the_fix(converted, online, status, said):
    with FakeHub(refuse_with=status) as hub:
        with pytest.raises(UserError) as refused:
            push(converted, "alice/x", token="hf_wrong", endpoint=hub.endpoint)
        assert hub.repos == {}
    message = str(refused.value)
    assert "\n" not in message and f"the Hub says the token {said}" in message and "hf auth login" in message


def test_push_without_any_token_is_one_line_naming_the_fix(converted, online, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with FakeHub() as hub:
        with pytest.raises(UserError) as refused:
            push(converted, "alice/x", endpoint=hub.endpoint)
        assert hub.repos == {}
    message = str(refused.value)
    assert "\n" not in message and "no Hugging Face token was found" in message and "hf auth login" in message
