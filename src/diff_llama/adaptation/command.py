"""`diff-llama adapt MODEL OUTPUT [options]` (declared in `diff_llama_cli`): OUTPUT checked before the model loads,
the run, and the trained model saved beside its curves."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..errors import InputNotFoundError, UserError
from ..model_card import duration_text, lineage, steps_text, write_training_report
from ..resolve import copy_license_files, load_model, release_gguf_quantizer, save_tokenizer
from ..retrieval.evaluate import refuse_past_learned_positions
from .examples import RetrievalExamples
from .settings import AdaptationOptions, check_options
from .trainer import adapt


def check_adapt_output(output: Path, options: AdaptationOptions, overwrite: bool = False, inputs=()) -> None:
    """OUTPUT must be new or empty; or hold a run's checkpoints, with `resume`; or, with `overwrite`, be a folder of
    an earlier adapt run that holds nothing else, and not the model it trains (`inputs`). Each refusal names the fix
    that works for the folder as it is."""
    from ..output_folder import check_new_output, replace_refusal

    if options.resume and overwrite:
        raise UserError("give --resume (continue the run in OUTPUT) or --overwrite (start it over), not both.")
    checkpoints = output.is_dir() and any(output.glob("checkpoint-*"))
    if options.resume and not checkpoints:
        replaceable = output.is_dir() and replace_refusal(output, inputs, "adapt") is None
        start_over = ", or pass --overwrite to start over" if replaceable else ""
        raise InputNotFoundError(f"--resume: {output} holds no checkpoint-N folder to continue from (the run finished, "
                                 f"or saved none: --save-steps); choose a new folder{start_over}.")
    if not options.resume:
        check_new_output(output, "pass --resume to continue the run it holds, or choose a new folder" if checkpoints
                         else "choose a new folder", overwrite, inputs=inputs, command="adapt")


def run_adapt(model_name: str, output: str, options: AdaptationOptions, name: str | None = None,
              overwrite: bool = False) -> int:
    """`diff-llama adapt MODEL OUTPUT [options]` (declared in `diff_llama_cli`). Under `accelerate launch` every
    process trains; the main one checks and writes OUTPUT. With `overwrite`, the earlier run in OUTPUT is removed
    once the model has loaded (the new one writes its checkpoints there, for --resume)."""
    from ..output_folder import (
        clear_output, give_weights_the_usual_permissions, make_folder, record_written_files, removed_unless_written,
        write_marker,
    )
    from ..retrieval import display_name
    from ..training import continuable

    output = Path(output)
    main_process = int(os.environ.get("RANK", "0")) == 0
    if main_process:
        check_adapt_output(output, options, overwrite, inputs=[model_name])
    check_options(options)
    fresh_start = main_process and not options.resume
    with continuable(output, offers_overwrite=True):  # Ctrl-C: what was kept, and how to go on
        model, tokenizer = load_model(model_name)
        upstream = lineage(model_name)  # read first: nothing after the training reads the input
        refuse_past_learned_positions(model, [options.max_length], model_name, "--max-length")
        refuse_past_learned_positions(model, [options.long_length or 0], model_name, "--long-length")
        refuse_past_learned_positions(model, list(options.eval_lengths), model_name, "--eval-lengths")
        RetrievalExamples(tokenizer, options).check_lengths()  # before the folder exists: a rerun is not refused
        release_gguf_quantizer(model)
        name = name or display_name(model_name)
        with removed_unless_written(output) if fresh_start else contextlib.nullcontext():
            if fresh_start:
                if overwrite and output.is_dir():
                    clear_output(output, inputs=[model_name], command="adapt")
                make_folder(output)
            if main_process:  # a later --overwrite may replace the folder; a resumed run's old record of it goes
                write_marker(output, "adapt")
            history = adapt(model, tokenizer, options, output, name=name)
        if not main_process:
            return 0
        if options.save:
            save_model(model, tokenizer, output)
            copy_license_files(model_name, output)
            write_training_report(output, adaptation_report(upstream, options, history))
        give_weights_the_usual_permissions(output)  # the model's and the checkpoints'
        record_written_files(output, "adapt")
    first, last, steps = history["probes"][0], history["probes"][-1], len(history["steps"])
    print(f"{name}: {steps} step{'' if steps == 1 else 's'} in {history['train_minutes']:.1f} training minutes; probe "
          f"accuracy {first['accuracy']:.0%} -> {last['accuracy']:.0%}, perplexity {first['perplexity']:.2f} -> "
          f"{last['perplexity']:.2f}")
    print(f"Wrote {output}")
    return 0


def adaptation_report(upstream: dict, options: AdaptationOptions, history: dict) -> dict:
    """What the model card of an adapted model says of its training (`model_card.TRAINING_REPORT`), as `train`'s:
    `upstream` is the lineage of the model it trained (`model_card.lineage`)."""
    first, last, steps = history["probes"][0], history["probes"][-1], len(history["steps"])
    frozen = f", the first {options.frozen_layers} layers frozen" if options.frozen_layers else ""
    summary = (f"{steps_text(steps)} ({duration_text(history['train_minutes'])}) of training{frozen}, learning rate "
               f"{options.learning_rate:g}; held-out retrieval probe accuracy {first['accuracy']:.0%} before, "
               f"{last['accuracy']:.0%} after, perplexity {first['perplexity']:.2f} before, {last['perplexity']:.2f} "
               "after.")
    return {"finetuned_from": upstream,
            "trained_on": (f"synthetic multi-needle retrieval examples of {options.min_length} to "
                           f"{options.max_length} tokens (`diff-llama adapt`)"),
            "summary": summary, "steps": steps, "train_minutes": history["train_minutes"],
            "learning_rate": options.learning_rate, "probe_before": first, "probe_after": last}


def save_model(model, tokenizer, output: Path) -> None:
    """The trained model and its tokenizer into `output`, beside the curves and checkpoints. Written to a temporary
    folder first, then moved: a crash never leaves a half-saved model behind."""
    partial = output / ".partial"
    model.save_pretrained(partial)
    save_tokenizer(tokenizer, partial)
    for path in partial.iterdir():
        path.replace(output / path.name)
    partial.rmdir()
