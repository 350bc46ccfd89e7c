"""Publishing a DiffLlama folder to the Hugging Face Hub: weights, remote code, tokenizer and model card.

`files_to_upload` is exactly what `push` sends, so it can be checked without a network.
"""

import contextlib
import fnmatch
import json
from collections.abc import Iterable
from pathlib import Path

from .configuration_diff_llama import REMOTE_CODE_FILES
from .conversion.source import CHAT_TEMPLATES_FOLDER
from .errors import UserError
from .model_card import build_model_card
from .output_folder import first_names, is_project_file_name
from .resolve import adapter_refusal, check_weights, is_adapter_folder, resolve_model

# Training leftovers that do not belong in a published model.
IGNORE_PATTERNS = ["checkpoint-*", "checkpoint-*/**", ".*", "**/.*", "runs/**", "__pycache__/**", "*.pyc"]
# What train (the Trainer's arguments, reports, plots) and recover add to a model folder; with what the other commands
# write (`is_project_file_name`), the files push publishes without naming them first.
TRAINING_FILES = ("training_args.bin", "training_log.json", "training_loss.png", "differential_attention.png",
                  "recovery_report.json", "recovery_curve.png")
# What a model folder needs to load from the Hub, which no --exclude may leave out.
NEEDED_TO_LOAD = ("config.json", "*.safetensors", "model.safetensors.index.json", *REMOTE_CODE_FILES)


def check_publishable(folder: str | Path) -> dict:
    """Raise a ValueError naming what is missing for the folder to load from the Hub; returns its config."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: no such folder; pass the folder written by diff-llama convert, recover or train.")
    if is_adapter_folder(folder):
        raise UserError(adapter_refusal(folder, "or push the adapter with peft's own push_to_hub"))
    if not (folder / "config.json").exists():
        raise UserError(f"{folder} has no config.json, so it is not a saved model: pass a folder written by "
                        "save_pretrained or diff-llama.")
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except ValueError as error:
        raise UserError(f"{folder}/config.json is not valid JSON ({error}); re-save the model with "
                        "save_pretrained.") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type != "diff_llama":
        raise UserError(f"{folder} holds a `{model_type}` model, not a diff_llama one; push it with "
                        "huggingface_hub (hf upload) instead.")
    if not any(folder.glob("*.safetensors")):
        raise UserError(f"{folder} has no .safetensors weights.")
    check_weights(resolve_model(folder))  # a file cut short would publish a model nobody can load
    missing = [name for name in REMOTE_CODE_FILES if not (folder / name).exists()]
    if missing or "auto_map" not in config:
        raise UserError(f"{folder} lacks the remote code ({', '.join(missing) or 'auto_map in config.json'}), so "
                        "it would not load with trust_remote_code=True; re-save it with diff_llama imported.")
    return config


def files_to_upload(folder: str | Path, keep_card: bool = False, exclude: Iterable[str] = ()) -> list[str]:
    """The paths in the repository that `push` writes (sorted): the folder's files, relative to it, and README.md,
    which is the model card built for the repository unless `keep_card` (then the folder's own, if it has one).
    `exclude`: glob patterns of paths (relative to the folder, as `hf upload --exclude`) to leave out; a pattern that
    matches nothing, or one that would leave out what the model needs to load, is refused, since a mistyped one would
    publish the very file it was meant to keep back."""
    from huggingface_hub.utils import filter_repo_objects

    folder = Path(folder)
    paths = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    if not keep_card:
        paths.add("README.md")
    published = set(filter_repo_objects(paths, ignore_patterns=IGNORE_PATTERNS))
    for pattern in exclude:
        left_out = published - set(filter_repo_objects(published, ignore_patterns=[pattern]))
        if not left_out:
            raise UserError(f"--exclude {pattern!r} matches no file that push would upload from {folder}, and "
                            "nothing was uploaded; patterns match paths relative to the folder (e.g. notes.txt, "
                            "'*.log', 'drafts/*'): push --dry-run lists them.")
        needed = sorted(path for path in left_out if any(fnmatch.fnmatchcase(path, name) for name in NEEDED_TO_LOAD))
        if needed:
            raise UserError(f"--exclude {pattern!r} would leave out {first_names(needed)}, which the model needs to "
                            "load from the Hub, and nothing was uploaded; give a narrower pattern.")
        published -= left_out
    return sorted(published)


def written_by_diff_llama(path: str) -> bool:
    """Whether a diff-llama command or save_pretrained writes this path of a model folder."""
    if "/" in path:
        return fnmatch.fnmatchcase(path, f"{CHAT_TEMPLATES_FOLDER}/*.jinja")
    return is_project_file_name(path) or path in TRAINING_FILES


def files_diff_llama_did_not_write(paths: list[str]) -> list[str]:
    """Of the paths push uploads, the user's own files, which push publishes too (as `hf upload` does) but names
    first."""
    return [path for path in paths if not written_by_diff_llama(path)]


def check_repo_id(repo_id: str) -> None:
    """One line naming the rule, before anything is read or sent, for a repository id the Hub would refuse."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise UserError(f"{repo_id!r} is not a Hub repository id: give owner/name (or name, in your own namespace), "
                        "each part letters, digits, '-', '_' or '.', at most 96 characters, e.g. "
                        "your-name/SmolLM2-135M-diff") from None


def require_hub(repo_id: str, endpoint: str | None = None) -> None:
    """Refuse in one line, within seconds, a push the Hub cannot take: huggingface_hub would print a bare connection
    error after its retries."""
    from .hub import HubUnreachableError, hub_fix, hub_unavailable_reason

    reason = hub_unavailable_reason(endpoint)
    if reason:
        raise HubUnreachableError(f"cannot push to {repo_id}: {reason}, and nothing was uploaded; {hub_fix()} and run "
                                  "push again (push --dry-run lists what it would upload, without the Hub).")


def plan_push(folder: str | Path, repo_id: str, keep_card: bool = False, exclude: Iterable[str] = ()) -> list[str]:
    """Everything push checks before it asks the Hub (the repository id, that the folder loads from the Hub, the
    --exclude patterns), in one line naming the fix where a check fails; returns the paths it would upload
    (`files_to_upload`), which `push --dry-run` prints."""
    check_repo_id(repo_id)
    check_publishable(folder)
    return files_to_upload(folder, keep_card, exclude)


def push(folder: str | Path, repo_id: str, *, private: bool = False, token: str | None = None,
         keep_card: bool = False, exclude: Iterable[str] = (), commit_message: str = "Upload DiffLlama model",
         endpoint: str | None = None) -> str:
    """Create `repo_id` if needed and upload the folder (see `files_to_upload`, which `exclude` is passed to) in one
    commit; returns its URL.

    The README.md uploaded is a model card built for `repo_id` from the folder's reports (the folder itself is not
    changed); `keep_card` uploads the folder's own README.md instead. `endpoint` overrides the Hub address.
    """
    paths = plan_push(folder, repo_id, keep_card, exclude)
    return upload(folder, repo_id, paths, private=private, token=token, keep_card=keep_card,
                  commit_message=commit_message, endpoint=endpoint)


def upload(folder: str | Path, repo_id: str, paths: list[str], *, private: bool = False, token: str | None = None,
           keep_card: bool = False, commit_message: str = "Upload DiffLlama model", endpoint: str | None = None) -> str:
    """`push` once `plan_push` has checked the folder and listed `paths`: one commit of them; returns its URL."""
    from huggingface_hub import CommitOperationAdd, HfApi

    folder = Path(folder)
    require_hub(repo_id, endpoint)  # before the repository is created: nothing is left half-made
    operations = [CommitOperationAdd(path, str(folder / path)) for path in paths if keep_card or path != "README.md"]
    if not keep_card and "README.md" in paths:  # not when --exclude README.md leaves the card out
        card = str(build_model_card(folder, repo_id=repo_id)).encode()
        operations.append(CommitOperationAdd("README.md", card))
    api = HfApi(endpoint=endpoint, token=token)
    with hub_refusals_explained(repo_id, token):
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.create_commit(repo_id, operations=operations, commit_message=commit_message)
    return commit.commit_url


@contextlib.contextmanager
def hub_refusals_explained(repo_id: str, token: str | None):
    """The Hub's refusals of the user's credentials as one line with the fix; any other error keeps its traceback."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    fix = (f"log in with `hf auth login`, or pass --token with a token that may write to {repo_id}, and run push "
           "again")
    no_token = f"cannot push to {repo_id}: no Hugging Face token was found; {fix}."
    try:
        yield
    except LocalTokenNotFoundError:
        raise UserError(no_token) from None
    except HfHubHTTPError as error:
        status = getattr(error.response, "status_code", None)
        if status not in (401, 403):
            raise
        if not (token or get_token()):
            raise UserError(no_token) from None
        refused = "was not accepted (401)" if status == 401 else f"may not write to {repo_id} (403)"
        raise UserError(f"cannot push to {repo_id}: the Hub says the token {refused}; {fix}.") from None
