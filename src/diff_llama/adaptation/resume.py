"""What a resumed run needs beside the Trainer's checkpoint: the history so far and the clock (in every
checkpoint-N folder), and the options it may change without changing what it trains on."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ..errors import UserError
from ..options import option_defaults
from .settings import AdaptationOptions


ADAPT_STATE = "adapt_state.json"

# Options a resumed run may change: they do not change what it trains on or how.
RESUMABLE_CHANGES = {"max_seconds", "resume", "save_steps", "threads", "device", "save", "eval_every"}


def resumed_history(checkpoint: str, options: AdaptationOptions) -> dict:
    """The history a checkpoint holds; refuses options that would change what the resumed run trains on (an option the
    checkpoint did not record counts as its default)."""
    history = json.loads((Path(checkpoint) / ADAPT_STATE).read_text())
    before, now = {**option_defaults(type(options)), **history["options"]}, asdict(options)
    differ = {key: (before.get(key), value) for key, value in now.items()
              if key not in RESUMABLE_CHANGES and before.get(key) != value}
    if differ:
        found = ", ".join(f"{key} {old!r}, not {new!r}" for key, (old, new) in differ.items())
        raise UserError(f"--resume: {checkpoint} was trained with other options ({found}); pass the same options "
                        "(only the budget, the checkpoint and probe intervals, threads and device may change)")
    history["options"] = now
    return history


def write_state(history: dict, checkpoint: str | Path) -> None:
    """The history so far, beside the Trainer's own state in `checkpoint`."""
    (Path(checkpoint) / ADAPT_STATE).write_text(json.dumps(history))
