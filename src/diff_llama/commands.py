"""What each `diff-llama` command runs, one function per command, called with the values `diff_llama_cli` parsed
(the positional arguments, then one instance per option dataclass; see `diff_llama_cli.command_table`). Each returns the
exit code. Heavy modules are imported inside the functions, so that a command loads only what it uses."""

import contextlib
import os
import sys
from pathlib import Path

from . import options as o
from .errors import OutputExistsError, UserError


def convert(source, output, options, command_options: o.ConvertCommandOptions) -> int:
    from .conversion.converter import convert_llama_to_diff_llama

    report = convert_llama_to_diff_llama(source, output, options, overwrite=command_options.overwrite)
    print(report.summary())
    if command_options.prompt:
        print(f"\nPrompt: {command_options.prompt}\nAnswer: {answer_prompt(output, command_options.prompt)}")
    return 0


def recover(model, options: o.RecoveryOptions) -> int:
    from .recovery import recover
    from .training import continuable

    with continuable(options.output), removed_if_left_empty(options.output):
        report = recover(model, options)
    print(f"Held-out perplexity: source {report['source_perplexity']:.2f}, recovered {report['final_perplexity']:.2f} "
          f"({report['ratio']:.3f}x) after {report['steps']} steps; mean |λ| {report['final_mean_abs_lambda']:.3f}. "
          f"Saved to {options.output}")
    return 0


def train(model, options: o.FineTuneOptions) -> int:
    from .training import continuable, train

    with continuable(options.output), removed_if_left_empty(options.output):
        output = train(model, options)
    if int(os.environ.get("RANK", "0")) == 0:  # one line for a multi-process launch too
        print(f"Saved the {'adapter' if options.lora and not options.merge else 'model'} to {output}")
    return 0


def removed_if_left_empty(output):
    """Around a run whose Trainer makes `output`: a run that fails or is stopped before its first checkpoint leaves no
    empty folder behind (and none of the folders above it that it made). A folder that was there before is kept."""
    from .output_folder import removed_unless_written

    if Path(output).exists() or int(os.environ.get("RANK", "0")) != 0:  # the main process owns the folder
        return contextlib.nullcontext()
    return removed_unless_written(output)


def generate(model, prompt, options: o.GenerateOptions) -> int:
    import torch
    from transformers import TextStreamer

    from .resolve import load_causal_lm, load_tokenizer, resolve_device

    device = resolve_device(options.device)
    if prompt == "-":  # a long prompt, or one made by another program: `echo ... | diff-llama generate MODEL -`
        prompt = sys.stdin.read().removesuffix("\n")  # the newline echo adds is not part of the prompt
    tokenizer = load_tokenizer(model)
    inputs = encode_prompt(tokenizer, prompt, use_chat_template=not options.raw)
    if inputs["input_ids"].shape[-1] == 0:
        raise UserError("the prompt is empty; give some text to continue (with --raw, no chat template adds any).")
    lm = load_causal_lm(model).to(device)
    inputs = inputs.to(device)
    sampling = dict(do_sample=True, temperature=options.temperature, top_p=options.top_p) if options.temperature > 0 else {}
    torch.manual_seed(options.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    lm.generate(**inputs, max_new_tokens=options.max_new_tokens, streamer=streamer, **sampling)
    return 0


def attention_map(model, options: o.AttentionMapOptions) -> int:
    from .attention_maps import attention_maps, plot_head
    from .output_folder import files_added_together
    from .resolve import load_causal_lm, load_config, load_tokenizer, resolve_device

    device = resolve_device(options.device)
    config = load_config(model)  # layer and head are checked before any weight is read
    differential = config.model_type in ("diff_llama", "diffllama")
    heads = config.num_attention_heads // 2 if differential else config.num_attention_heads
    if not 0 <= options.layer < config.num_hidden_layers:
        raise UserError(f"--layer must be between 0 and {config.num_hidden_layers - 1}, got {options.layer}.")
    if options.head is not None and not 0 <= options.head < heads:
        raise UserError(f"--head must be between 0 and {heads - 1} (this model has {heads} "
                        f"{'differential ' if differential else ''}heads).")
    selected = range(heads) if options.head is None else [options.head]
    output = Path(options.output)
    paths = [output / f"layer{options.layer}-head{head}.png" for head in selected]
    check_map_folder(output, [path for path in paths if path.exists()], options.overwrite,
                     inputs=[model, options.source])
    tokenizer = load_tokenizer(model)
    lm = load_causal_lm(model, attn_implementation="eager").to(device)
    first, second, lam, differential, tokens = attention_maps(lm, tokenizer, options.text, options.layer)
    source_maps = None
    if options.source:
        source = load_causal_lm(options.source, attn_implementation="eager").to(device)
        source_maps = attention_maps(source, tokenizer, options.text, options.layer)[0]
    # All of this run's maps, or none: a folder of maps alone (with the marker), which a later --overwrite may replace.
    with files_added_together(output, "attention-map") as staging:
        for head, path in zip(selected, paths):
            # Every conversion (both version-1 layouts and DIFF V2) makes LLaMA head i the first map of differential
            # head i.
            source_head = source_maps[head] if source_maps is not None and head < source_maps.shape[0] else None
            plot_head(first, second, lam, differential, tokens, head, options.layer, staging / path.name, source_head)
    for path in paths:
        print(f"wrote {path}")
    return 0


def check_map_folder(output: Path, existing: list[Path], overwrite: bool, inputs=()) -> None:
    """Maps of other layers or heads may share the folder (one that attention-map made): only the maps this run would
    replace are refused, and `overwrite` replaces them only in a folder of maps that diff-llama wrote. Never inside a
    model folder it reads (`inputs`)."""
    from .output_folder import check_output_place, holds_files, read_marker, replace_refusal

    check_output_place(output, inputs, if_a_file="give a folder for --output")
    refusal = replace_refusal(output) if existing else None
    if overwrite and refusal is not None:
        raise OutputExistsError(f"--overwrite refused: {refusal}.")
    if holds_files(output) and (read_marker(output) or {}).get("command") != "attention-map":
        raise OutputExistsError(f"{output} holds files that are not attention maps diff-llama drew; choose a new "
                                "folder for --output.")
    if existing and not overwrite:
        these = "it" if len(existing) == 1 else f"these {len(existing)} maps"
        hint = f", or pass --overwrite to replace {these}" if refusal is None else ""
        raise OutputExistsError(f"{existing[0]} already exists; choose another --output{hint}.")


def adapt(model, output, options, command_options: o.AdaptCommandOptions) -> int:
    from .adaptation import run_adapt

    return run_adapt(model, output, options, name=command_options.name, overwrite=command_options.overwrite)


def evaluate(models, options, command_options: o.EvaluateCommandOptions) -> int:
    from .retrieval import run_evaluate

    return run_evaluate(models, options, overwrite=command_options.overwrite)


def ruler(models, options, command_options: o.EvaluateCommandOptions) -> int:
    from .retrieval.ruler import run_ruler

    return run_ruler(models, options, overwrite=command_options.overwrite)


def serve(model, engine_args, options: o.ServeOptions) -> int:
    from .serving import serve

    return serve(model, options, engine_args)


def push(model, repo_id, options: o.PushOptions) -> int:
    from .output_folder import first_names
    from .publishing import files_diff_llama_did_not_write, plan_push, upload

    paths = plan_push(model, repo_id, options.keep_card, options.exclude or ())
    yours = files_diff_llama_did_not_write(paths)
    if yours:  # on stderr: the dry run's standard output stays the list of paths
        count = f"{len(yours)} file{'s' if len(yours) > 1 else ''}"
        print(f"note: push uploads {count} that neither diff-llama nor save_pretrained writes: {first_names(yours)} "
              "(--exclude PATTERN leaves files out).", file=sys.stderr)
    if options.dry_run:
        print("\n".join(paths))
        return 0
    url = upload(model, repo_id, paths, private=options.private, token=options.token, keep_card=options.keep_card)
    print(f"Uploaded: {url}")
    return 0


def merge(adapter, output, command_options: o.ReplaceOutputOptions) -> int:
    from .training import merge_adapter_folder

    merge_adapter_folder(adapter, output, overwrite=command_options.overwrite)
    print(f"Wrote {output}: {adapter} merged into its base model, one plain model folder.")
    return 0


def export_builtin(source, output, command_options: o.ReplaceOutputOptions) -> int:
    from .builtin_interop import export_folder_to_builtin

    export_folder_to_builtin(source, output, overwrite=command_options.overwrite)
    print(f"Wrote {output}: loads with transformers.AutoModelForCausalLM (model_type 'diffllama').")
    return 0


def demo(options: o.DemoOptions) -> int:
    from . import demo
    from .output_folder import give_weights_the_usual_permissions, new_output_folder

    # Not in place: Ctrl-C, at any step, leaves the output as it was (the demo has nothing to resume from).
    with new_output_folder(options.output, overwrite=options.overwrite, command="demo", in_place=False) as folder:
        demo.run_demo(folder, steps=options.steps, final_dir=options.output)
    give_weights_the_usual_permissions(options.output)
    return 0


def encode_prompt(tokenizer, prompt: str, use_chat_template: bool = True):
    if use_chat_template and tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    return tokenizer(prompt, return_tensors="pt")


def answer_prompt(model_dir: str, prompt: str, max_new_tokens: int = 256) -> str:
    """Greedy answer from a saved model, through its chat template when it has one. An answer that reaches
    `max_new_tokens` before the model ends it is marked as cut, so that a reader does not take it for the whole."""
    from .resolve import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir)
    inputs = encode_prompt(tokenizer, prompt)
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    answer = tokenizer.decode(new_tokens, skip_special_tokens=True).strip()
    ended = model.generation_config.eos_token_id
    ended = {ended} if isinstance(ended, int) else set(ended or [])
    if len(new_tokens) >= max_new_tokens and new_tokens[-1].item() not in ended:
        answer += f" [... cut at {max_new_tokens} tokens]"
    return answer
