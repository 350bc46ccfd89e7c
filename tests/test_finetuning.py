"""Fine-tuning with the real Trainer and PEFT LoRA (λ in the adapter), `diff-llama train` with checkpoints and resume,
recovery by distillation, and multi-process training."""

import inspect
import json
import math
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import transformers
from conftest import SAMPLE_TEXT, LayerZeroQueries, differential_model, make_llama, needs_fullgraph_compile, tiny_model
from packaging import version
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from diff_llama.cli import main
from diff_llama.recovery import distillation_kl, lambda_floor_penalty
from diff_llama.training import TokenBlocks, joined_text, lora_config, optimizer_for, read_documents


def _train_briefly(model, tokenizer, tmp_path, steps=3, **args):
    data = TokenBlocks(tokenizer, SAMPLE_TEXT, block_size=32)
    arguments = TrainingArguments(str(tmp_path / "run"), max_steps=steps, per_device_train_batch_size=2,
                                  report_to="none", logging_steps=1, save_strategy="no", **args)
    trainer = Trainer(model=model, args=arguments, train_dataset=data,
                      optimizers=(optimizer_for(model, learning_rate=1e-3, lambda_learning_rate=5e-2), None))
    trainer.train()
    return trainer


@pytest.fixture
def saved_model(tmp_path, tokenizer):
    folder = tmp_path / "base"
    tiny_model(vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# A λ parameter's name in each version's checkpoint (and in memory, under `self_attn.differential_lambda`).
LAMBDA_NAME = {1: "lambda_q1", 2: "lambda_proj.weight"}


def lambdas_of(model, ids):
    """Every λ the model computes on `ids`: one per layer (version 1), one per token, head and layer (DIFF V2)."""
    with torch.no_grad():
        outputs = model(ids, output_hidden_states=True)
    return torch.cat([lam.flatten() for lam in model.differential_lambdas(outputs)])


@pytest.mark.oldest_transformers  # a Trainer step and a LoRA step on the oldest supported transformers too
@pytest.mark.parametrize("version", [1, 2])
def test_lora_trains_lambda_saves_it_in_the_adapter_and_merges_exactly(tmp_path, tokenizer, version):
    saved_model = tmp_path / "base"
    differential_model(version, torch.float32, vocab_size=len(tokenizer)).save_pretrained(saved_model)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(saved_model), lora_config())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("differential_lambda" in n and LAMBDA_NAME[version] in n for n in trainable)
    assert any("lora_A" in n for n in trainable)
    assert not any(n.endswith("q_proj.base_layer.weight") for n in trainable)
    ids = torch.tensor([[5, 9, 2, 14, 7, 3, 11]])
    lambdas_before = lambdas_of(model.eval(), ids)
    _train_briefly(model, tokenizer, tmp_path)
    model.eval()
    assert not torch.allclose(lambdas_of(model, ids), lambdas_before)

    model.save_pretrained(tmp_path / "adapter")
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any("differential_lambda" in k and LAMBDA_NAME[version] in k for k in adapter), "λ must be in the adapter"
    expected = model(ids).logits

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(saved_model), tmp_path / "adapter").eval()
    torch.testing.assert_close(lambdas_of(reloaded, ids), lambdas_of(model, ids))
    torch.testing.assert_close(reloaded(ids).logits, expected)

    merged = reloaded.merge_and_unload()
    torch.testing.assert_close(merged(ids).logits, expected, atol=1e-5, rtol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    assert f"model.layers.0.self_attn.{LAMBDA_NAME[version]}" in load_file(tmp_path / "merged" / "model.safetensors")
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(final(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_an_adapter_without_a_task_type_loads_with_peft_when_diff_llama_is_allowed(tmp_path, saved_model):
    """docs/fine-tuning.md: a LoraConfig without `task_type` records the model's class by its module, which
    AutoPeftModelForCausalLM imports only when its allowlist has it; then it loads the trained λ with the LoRA."""
    config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], modules_to_save=["differential_lambda"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(saved_model), config)
    torch.manual_seed(1)
    with torch.no_grad():  # as if trained: LoRA's B (zeros at first) and λ away from their start
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                parameter.add_(0.1 * torch.randn_like(parameter))
    model.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[5, 9, 14, 3, 7, 11]])
    with torch.no_grad():
        expected = model.eval()(ids).logits
        assert (expected - AutoModelForCausalLM.from_pretrained(saved_model)(ids).logits).abs().max() > 1e-3
        if "import_allowlist" in inspect.signature(AutoPeftModelForCausalLM.from_pretrained).parameters:
            with pytest.raises(ValueError, match="import_allowlist=\\['diff_llama.modeling_diff_llama'\\]"):
                AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
            loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", import_allowlist=["diff_llama"])
        else:  # a peft from before its allowlist imports the module as it is
            loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
        torch.testing.assert_close(loaded.eval()(ids).logits, expected)


def test_lora_on_the_mlp_when_asked():
    model = get_peft_model(tiny_model(), lora_config(include_mlp=True))
    names = [n for n, _ in model.named_parameters()]
    assert any("gate_proj.lora_A" in n for n in names) and any("o_proj.lora_A" in n for n in names)


def test_lambda_gets_its_own_learning_rate_and_no_weight_decay():
    model = tiny_model()
    optimizer = optimizer_for(model, learning_rate=1e-4, lambda_learning_rate=1e-2, weight_decay=0.1)
    lambda_ids = {id(p) for n, p in model.named_parameters() if "differential_lambda" in n}
    (rest, lambdas) = optimizer.param_groups
    assert {id(p) for p in lambdas["params"]} == lambda_ids and lambdas["lr"] == 1e-2 and lambdas["weight_decay"] == 0
    assert rest["lr"] == 1e-4 and not lambda_ids & {id(p) for p in rest["params"]}


def test_train_command_checkpoints_resumes_and_plots(tmp_path, saved_model, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text(SAMPLE_TEXT)
    (data / "b.jsonl").write_text(json.dumps({"text": SAMPLE_TEXT[::-1]}) + "\n")
    out = tmp_path / "out"
    common = [str(saved_model), "--data", str(data), "--output", str(out), "--block-size", "32", "--batch-size", "2",
              "--save-steps", "2", "--logging-steps", "1"]
    assert main(["train", *common, "--max-steps", "4"]) == 0
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-4").is_dir()
    # a checkpoint is a model of its own, tokenizer included (without the settings it was loaded with)
    assert main(["generate", str(out / "checkpoint-2"), "The quick", "--raw", "--max-new-tokens", "2"]) == 0
    assert "local_files_only" not in (out / "checkpoint-2" / "tokenizer_config.json").read_text()
    assert (out / "training_loss.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "differential_attention.png").exists()
    assert main(["train", *common, "--max-steps", "4"]) == 2  # refuses to start over on top of checkpoints
    # Mark the last checkpoint's state: a resumed run carries its log history on, a fresh start would not.
    state_file = out / "checkpoint-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["log_history"].append({"step": 4, "marker": "from checkpoint-4"})
    state_file.write_text(json.dumps(state))
    assert main(["train", *common, "--max-steps", "6", "--resume"]) == 0
    history = json.loads((out / "training_log.json").read_text())
    assert {"step": 4, "marker": "from checkpoint-4"} in history
    assert [e["step"] for e in history if "loss" in e] == [1, 2, 3, 4, 5, 6]
    # The card counts the whole run's steps and losses, and says that its clock started at the resume (the Trainer
    # times only what this process ran).
    card = (out / "README.md").read_text()
    assert "6 steps (" in card and " since the last --resume) of full fine-tuning" in card
    assert f", {[e for e in history if 'loss' in e][-1]['loss']:.3f} at the last." in card
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.get_lambdas().shape == (reloaded.config.num_hidden_layers,)
    capsys.readouterr()
    assert main(["push", str(out), "alice/x", "--dry-run"]) == 0  # every file is train's: push names none as the user's
    listed = capsys.readouterr()
    assert listed.err == "" and {"training_args.bin", "training_log.json", "model.safetensors"} <= set(listed.out.split())


@pytest.mark.parametrize("autocast,computes_in", [("bfloat16", torch.bfloat16), ("none", torch.float32)])
@pytest.mark.parametrize("lora", [False, True])
def test_train_with_autocast_and_gradient_checkpointing(tmp_path, saved_model, monkeypatch, autocast, computes_in,
                                                        lora):
    """--autocast runs the forward in its dtype (the weights, and so the saved model, stay float32);
    --gradient-checkpointing recomputes each layer in backward. Both train every weight they should, LoRA and λ
    included, and a resume may turn gradient checkpointing on or off, not change the precision."""
    from diff_llama.resolve import load_causal_lm

    (tmp_path / "text.txt").write_text(SAMPLE_TEXT)
    queries = LayerZeroQueries().watch(monkeypatch)
    out = tmp_path / "out"
    common = [str(saved_model), "--data", str(tmp_path / "text.txt"), "--output", str(out), "--block-size", "32",
              "--batch-size", "2", "--save-steps", "2", "--no-monitor", "--learning-rate", "1e-2",
              "--autocast", autocast] + (["--lora"] if lora else [])
    assert main(["train", *common, "--gradient-checkpointing", "--max-steps", "2"]) == 0
    assert queries.of("student") == [(computes_in, "cpu")] * 4  # 2 steps, each layer run again in backward
    before = AutoModelForCausalLM.from_pretrained(saved_model)
    trained = load_causal_lm(out)  # the adapter merged into its base, for --lora
    assert trained.dtype == torch.float32
    changed = {name for name, weight in trained.state_dict().items()
               if not torch.equal(weight, before.state_dict()[name])}
    assert any("lambda" in name for name in changed) and any("q_proj" in name for name in changed)
    assert lora or any("mlp" in name for name in changed)
    # Resumed without gradient checkpointing: fine. In another precision: refused, in one line.
    queries.seen.clear()
    assert main(["train", *common, "--max-steps", "3", "--resume"]) == 0
    assert queries.of("student") == [(computes_in, "cpu")]
    other = "float16" if autocast == "none" else "none"
    assert main(["train", *[a if a != autocast else other for a in common], "--max-steps", "4", "--resume"]) == 2


def _train_runs(tmp_path, tokenizer, version=2, **runs):
    """Two steps of `train` on one small DiffLlama (saved in tmp_path/base, which it returns) for each keyword: the
    run's extra arguments, its output tmp_path/KEYWORD."""
    folder = tmp_path / "base"
    differential_model(version, torch.float32, vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT)
    common = [str(folder), "--data", str(tmp_path / "text.txt"), "--block-size", "32", "--batch-size", "2",
              "--max-steps", "2", "--save-steps", "10", "--no-monitor", "--learning-rate", "1e-2"]
    for name, extra in runs.items():
        assert main(["train", *common, "--output", str(tmp_path / name), *extra]) == 0
    return folder


@pytest.mark.parametrize("version", [1, 2])
def test_train_compile_trains_as_one_graph_what_eager_training_trains(tmp_path, tokenizer, version):
    """--compile: the Trainer compiles the model (here with aot_eager, which dynamo splits into graphs as it does for
    inductor, without minutes of C++ compilation): no graph break in either version, and two steps give eager
    training's weights."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    folder = _train_runs(tmp_path, tokenizer, version=version,  # the eager run compiles nothing
                         eager=[], compiled=["--compile", "--compile-backend", "aot_eager"])
    assert counters["stats"]["unique_graphs"] >= 1 and dict(counters["graph_break"]) == {}
    eager, compiled = (AutoModelForCausalLM.from_pretrained(tmp_path / name).state_dict()
                       for name in ("eager", "compiled"))
    base = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert any(not torch.equal(compiled[name], base[name]) for name in base)  # it trained
    for name, weight in eager.items():
        torch.testing.assert_close(compiled[name], weight, rtol=1e-4, atol=1e-6, msg=name)


def _lora_runs(tmp_path, tokenizer, **runs):
    """Adapter weights of `train --lora` runs of one small DIFF V2 model, one per keyword (its extra arguments)."""
    _train_runs(tmp_path, tokenizer, **{name: ["--lora", *extra] for name, extra in runs.items()})
    return {name: load_file(tmp_path / name / "adapter_model.safetensors") for name in runs}


def _assert_same_adapters(trained, reference):
    assert any(name.endswith("lora_B.weight") and weight.abs().max() > 0 for name, weight in reference.items())
    assert trained.keys() == reference.keys()
    for name, weight in reference.items():
        torch.testing.assert_close(trained[name], weight, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.oldest_transformers  # where the Trainer's checkpointing defaults to reentrant, and names its options so
def test_lora_with_gradient_checkpointing_trains_as_without_it(tmp_path, tokenizer):
    """--lora --gradient-checkpointing: non-reentrant checkpointing, without transformers' hook that makes the frozen
    embeddings' output require grad, still takes every gradient to the adapter."""
    found = _lora_runs(tmp_path, tokenizer, plain=[], checkpointed=["--gradient-checkpointing"])
    _assert_same_adapters(found["checkpointed"], found["plain"])


@needs_fullgraph_compile
def test_lora_with_gradient_checkpointing_compiles_as_one_graph(tmp_path, tokenizer):
    """--lora --gradient-checkpointing --compile: transformers' hook on the embeddings (`requires_grad_`, which dynamo
    cannot trace) split the compiled step into three graphs; without it the step is one graph, and trains as eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = ["--gradient-checkpointing", "--compile", "--compile-backend", "aot_eager"]
    found = _lora_runs(tmp_path, tokenizer, compiled=compiled, plain=[])  # the eager run compiles nothing
    assert counters["stats"]["unique_graphs"] == 1 and dict(counters["graph_break"]) == {}
    _assert_same_adapters(found["compiled"], found["plain"])


def test_compile_on_torch_older_than_2_8_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """Before 2.8 dynamo fails on transformers' own wrappers (tested on 2.6) once the model has loaded."""
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_torch_greater_or_equal", lambda version, accept_dev=False: False)
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT)
    assert main(["train", str(tmp_path / "no-model"), "--data", str(tmp_path / "text.txt"), "--output",
                 str(tmp_path / "out"), "--compile"]) == 2
    assert "--compile needs torch 2.8 or newer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_resume_refuses_what_would_not_continue_the_run(tmp_path, saved_model, capsys, monkeypatch):
    """`--resume --lora` on a full run's checkpoints ended in a traceback from the optimizer; another --block-size,
    --batch-size, --data or MODEL trained on, from the step it stopped at, on a stream the run never saw. Each is one
    line now; what only says how long to run and how often to save may change, from any working directory."""
    text, other = tmp_path / "text.txt", tmp_path / "other.txt"
    text.write_text(SAMPLE_TEXT)
    other.write_text(SAMPLE_TEXT[::-1])
    out = tmp_path / "out"
    common = [str(saved_model), "--output", str(out), "--block-size", "32", "--batch-size", "2", "--save-steps", "1",
              "--no-monitor"]
    assert main(["train", *common, "--data", str(text), "--max-steps", "2"]) == 0
    record = json.loads((out / "checkpoint-2" / "diff_llama_run.json").read_text())
    assert record["data"] == str(text.resolve()) and record["model"] == str(saved_model.resolve())
    may_change = ("only --max-steps, --epochs, --save-steps, --logging-steps, --monitor, --merge, "
                  "--gradient-checkpointing, --compile, --compile-backend may change")
    for change, says in [
        (["--data", str(text), "--lora"],
         f"{out / 'checkpoint-2'} holds a full training run; resume it without --lora"),
        (["--data", str(other)], f"other options (--data {str(text.resolve())!r}, not {str(other.resolve())!r})"),
        (["--data", str(text), "--block-size", "16"], "other options (--block-size 32, not 16)"),
        (["--data", str(text), "--batch-size", "1", "--seed", "3"],
         "other options (--batch-size 2, not 1, --seed 0, not 3)"),
    ]:
        capsys.readouterr()
        assert main(["train", *common, *change, "--max-steps", "3", "--resume"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and says in err, err
        assert "lora" in change[-1] or err.endswith(f"({may_change}), or start a new run in a new folder."), err
    assert not (out / "checkpoint-3").exists()
    monkeypatch.chdir(tmp_path)  # the same run by relative paths, longer, logged more often
    assert main(["train", saved_model.name, "--output", "out", "--data", "text.txt", "--block-size", "32",
                 "--batch-size", "2", "--save-steps", "1", "--no-monitor", "--max-steps", "3", "--logging-steps",
                 "1", "--resume"]) == 0
    assert (out / "checkpoint-3" / "diff_llama_run.json").is_file()

    lora_out = tmp_path / "lora"
    lora = [str(saved_model), "--output", str(lora_out), "--data", str(text), "--block-size", "32", "--save-steps",
            "1", "--no-monitor", "--max-steps", "1"]
    assert main(["train", *lora, "--lora"]) == 0
    capsys.readouterr()
    assert main(["train", *lora, "--resume"]) == 2
    assert "holds a LoRA training run; resume it with --lora, as it was started." in capsys.readouterr().err


def test_train_data_in_jsonl_holds_text_and_chats_in_the_models_template(tmp_path, chatml_tokenizer, tokenizer):
    chat = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."}]
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "The quick brown fox."}) + "\n\n" + json.dumps({"messages": chat}) + "\n")
    documents = read_documents(data)
    assert documents == ["The quick brown fox.", chat]
    assert joined_text(documents, chatml_tokenizer) == (
        "The quick brown fox.\n\n<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis."
        "<|im_end|>\n")
    with pytest.raises(ValueError, match=f"{data} holds chat \"messages\", but the model's tokenizer has no chat "
                                         "template"):
        joined_text(documents, tokenizer, data)
    # the train command: a chat line trains through the model's own template
    saved_model = tmp_path / "chat-model"
    tiny_model(vocab_size=len(chatml_tokenizer)).save_pretrained(saved_model)
    chatml_tokenizer.save_pretrained(saved_model)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": chat}) + "\n" for _ in range(8)))
    assert main(["train", str(saved_model), "--data", str(chats), "--output", str(tmp_path / "out"), "--block-size",
                 "16", "--max-steps", "1", "--no-monitor"]) == 0


def test_chat_content_in_text_parts_is_joined_as_vllm_joins_it(tmp_path):
    """OpenAI's form of a message's content, a list of text parts, is the same chat as its text joined by
    newlines (what vLLM sends a text-only model)."""
    question = [{"type": "text", "text": "Describe"}, {"type": "text", "text": "a fox."}]
    parts = {"messages": [{"role": "user", "content": question},
                          {"role": "assistant", "content": "Quick and brown.", "name": "bot"}]}
    (tmp_path / "data.jsonl").write_text(json.dumps(parts) + "\n")
    assert read_documents(tmp_path / "data.jsonl") == [[
        {"role": "user", "content": "Describe\na fox."},
        {"role": "assistant", "content": "Quick and brown.", "name": "bot"}]]


def test_a_data_folder_is_read_without_its_hidden_folders_and_a_model_folder_is_refused(
        tmp_path, saved_model, capsys):
    """`--data .` in a project read the .txt and .md files of its `.venv` (licences, package READMEs) and of
    `.ipynb_checkpoints`; a model folder given as --data trained on its model card."""
    data = tmp_path / "data"
    for name, text in [("a.txt", "mine"), ("notes/b.md", "also mine"), (".venv/lib/LICENSE.txt", "a licence"),
                       (".ipynb_checkpoints/a-checkpoint.txt", "an old copy"), (".hidden.txt", "hidden")]:
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_text(text)
    assert read_documents(data) == ["mine", "also mine"]
    capsys.readouterr()
    assert main(["train", str(saved_model), "--data", str(saved_model), "--output", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"diff-llama train: error: {saved_model} is a model folder (it has a config.json), not training text; give "
        "--data a text file or a folder of them (.txt, .md, .rst, .jsonl).")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("line, problem", [
    ("not json", "is not valid JSON"),
    ('"a JSON string that contains the word text"', 'has neither a "text" string nor a "messages" list'),
    ('{"text": 5}', 'has neither a "text" string'),
    ('{"prompt": "a", "completion": "b"}', 'has neither a "text" string'),
    ('{"messages": []}', 'has neither a "text" string'),
    ('{"messages": [{"role": "user"}]}', 'has neither a "text" string'),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]}',
     'has neither a "text" string nor a "messages" list of chat messages (each a "role" and a text "content")'),
    (b"\xff\xfe\x00", "is not UTF-8 text"),
])
def test_a_bad_jsonl_line_is_one_line_naming_it_before_any_model_loads(tmp_path, capsys, line, problem):
    """So is a file that is not UTF-8 text (the last case)."""
    data = tmp_path / "data.jsonl"
    first = json.dumps({"text": "fine"}) + "\n"
    data.write_bytes(first.encode() + line) if isinstance(line, bytes) else data.write_text(first + line + "\n")
    capsys.readouterr()
    assert main(["train", str(tmp_path / "no-such-model"), "--data", str(data), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    if isinstance(line, bytes):
        assert err == (f"diff-llama train: error: {data} is not UTF-8 text (byte {len(first)}: invalid start byte); "
                       "give a text file, or convert it to UTF-8.")
    else:
        assert err.startswith(f"diff-llama train: error: {data}:2 {problem}"), err
        assert err.endswith('{"text": "..."} or {"messages": [{"role": "user", "content": "..."}, ...]}.')
    assert not (tmp_path / "o").exists()


def test_resume_passes_over_a_checkpoint_interrupted_while_being_written(tmp_path, saved_model, capsys):
    """Ctrl-C while the Trainer saves leaves a checkpoint without trainer_state.json, which it writes last; the
    Trainer's own resume fails on it with a traceback."""
    text = tmp_path / "text.txt"
    text.write_text(SAMPLE_TEXT)
    out = tmp_path / "out"
    common = [str(saved_model), "--data", str(text), "--output", str(out), "--block-size", "32", "--batch-size", "2",
              "--save-steps", "2", "--logging-steps", "1", "--no-monitor"]
    assert main(["train", *common, "--max-steps", "4"]) == 0
    (out / "checkpoint-4" / "trainer_state.json").unlink()  # what the interrupted save of checkpoint-4 left
    capsys.readouterr()
    assert main(["train", *common, "--max-steps", "6", "--resume"]) == 0
    assert "Skipping" in capsys.readouterr().err and (out / "checkpoint-6" / "trainer_state.json").is_file()
    history = json.loads((out / "training_log.json").read_text())
    assert [e["step"] for e in history if "loss" in e] == [1, 2, 3, 4, 5, 6]  # steps 3 and 4 again, from checkpoint-2

    for state in out.glob("checkpoint-*/trainer_state.json"):
        state.unlink()
    capsys.readouterr()
    assert main(["train", *common, "--max-steps", "8", "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "was interrupted while being written" in err and "checkpoint-6" in err, err


def test_a_lora_run_loads_wherever_a_model_does(tmp_path, saved_model, capsys, monkeypatch):
    """`train --lora` writes an adapter folder. generate, evaluate and the loaders take it as a model: its base loaded
    and the adapter merged in, λ included, the model `--merge` would have saved, from any working directory (the base
    is recorded as an absolute path). `serve --engine vllm`, push, convert and export-builtin, which hand the folder
    itself to other code, ask for a merged model (transformers' server takes it: tests/test_serving.py)."""
    from diff_llama.resolve import load_causal_lm, load_config, load_tokenizer

    (tmp_path / "text.txt").write_text(SAMPLE_TEXT)
    monkeypatch.chdir(tmp_path)  # relative paths, as typed
    common = ["--data", "text.txt", "--lora", "--max-steps", "2", "--block-size", "32", "--learning-rate", "1e-2",
              "--lambda-learning-rate", "0.5", "--no-monitor"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["train", saved_model.name, *common, "--output", "runs/lora"]) == 0
        load_causal_lm(tmp_path / "runs" / "lora")
    # PEFT's read of transformers' deprecated alias is PEFT's to fix, not the user's: the commands keep it quiet.
    assert not [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert main(["train", saved_model.name, *common, "--output", "runs/merged", "--merge"]) == 0
    adapter = tmp_path / "runs" / "lora"
    recorded = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(saved_model.resolve())

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    ids = torch.tensor([[5, 9, 14, 3, 7, 11]])
    with torch.no_grad():
        adapter_model = load_causal_lm(adapter)
        loaded = adapter_model(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "merged")(ids).logits
        base = AutoModelForCausalLM.from_pretrained(saved_model)(ids).logits
        native = AutoModelForCausalLM.from_pretrained(adapter)(ids).logits  # transformers' own adapter loading
        by_peft = AutoPeftModelForCausalLM.from_pretrained(adapter)(ids).logits  # peft's (the task type names the class)
    torch.testing.assert_close(loaded, merged, rtol=0, atol=1e-4)
    torch.testing.assert_close(by_peft, merged, rtol=0, atol=1e-4)
    if version.parse(transformers.__version__) >= version.parse("5.18"):  # 5.16, 5.17: LoRA loaded but not λ
        torch.testing.assert_close(loaded, native, rtol=0, atol=1e-4)
    assert (loaded - base).abs().max() > 1e-2  # what training changed is there
    assert load_config(adapter).to_dict() == load_config(saved_model).to_dict()
    assert load_tokenizer(adapter)("The quick").input_ids == load_tokenizer(saved_model)("The quick").input_ids

    capsys.readouterr()
    answers = []
    for model in (adapter, tmp_path / "runs" / "merged"):
        assert main(["generate", str(model), "The quick brown", "--raw", "--max-new-tokens", "6"]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and answers[0].strip()
    assert main(["evaluate", str(adapter), "--output", "eval", "--lengths", "256", "--settings", "1x1", "--depths",
                 "50", "--cases-per-depth", "1", "--perplexity-tokens", "0"]) == 0
    capsys.readouterr()
    refusal = (f"{adapter} is a LoRA adapter folder (adapter_config.json), not a whole model: merge it into its base "
               f"model `{recorded}` first (diff-llama merge {adapter} MERGED_FOLDER), ")
    serve_it = f"or serve the adapter folder with the transformers server, which merges it as it loads (diff-llama serve {adapter})"
    for argv, then in [(["serve", str(adapter), "--engine", "vllm"], serve_it),
                       (["serve", str(adapter), "--engine", "sglang"], serve_it),
                       (["push", str(adapter), "me/x", "--dry-run"], "or push the adapter with peft's own push_to_hub"),
                       (["convert", str(adapter), "converted"], "and convert that folder"),
                       (["export-builtin", str(adapter), "builtin"], "and export that folder")]:
        assert main(argv) == 2 and refusal + then + "." in capsys.readouterr().err, argv
    assert sorted(p.name for p in elsewhere.iterdir()) == ["eval"]

    # The refusals' way out: `diff-llama merge` writes the plain model folder that they ask for.
    assert main(["merge", str(adapter), "merged"]) == 0
    assert f"Wrote merged: {adapter} merged into its base model" in capsys.readouterr().out
    trained_merged = tmp_path / "runs" / "merged"
    written = {p.name for p in (elsewhere / "merged").iterdir()} - {".diff-llama-output"}  # beside merge's marker
    beside_training = {p.name for p in trained_merged.iterdir() if p.is_file()} - {"training_log.json",
                                                                                   "training_loss.png"}
    assert written == beside_training, written
    merged_later = AutoModelForCausalLM.from_pretrained(elsewhere / "merged")
    expected = adapter_model.state_dict()  # what the adapter folder loads as, saved: the same tensors exactly
    assert merged_later.state_dict().keys() == expected.keys()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in merged_later.state_dict().items())
    with torch.no_grad():  # a CPU matrix product's rounding may depend on where its operands lie in memory
        torch.testing.assert_close(merged_later(ids).logits, loaded, rtol=0, atol=1e-6)
    report = json.loads((elsewhere / "merged" / "training_report.json").read_text())
    trained_report = json.loads((trained_merged / "training_report.json").read_text())
    assert report.keys() == trained_report.keys() and report["merged"] and trained_report["merged"]
    method = "of LoRA (rank 16, merged into the weights), learning rate 0.01,"
    assert method in report["summary"] and method in trained_report["summary"], report["summary"]
    card = (elsewhere / "merged" / "README.md").read_text()  # a whole DiffLlama's, naming the folder, not its draft
    assert 'from_pretrained("./merged", trust_remote_code=True)' in card and "partial" not in card, card
    assert main(["push", "merged", "me/x", "--dry-run"]) == 0
    capsys.readouterr()
    # Merged again into the same folder: refused, offering --overwrite, which replaces it whole.
    assert main(["merge", str(adapter), "merged"]) == 2
    assert "merged is not empty; choose a new folder, or pass --overwrite to replace it." in capsys.readouterr().err
    first = (elsewhere / "merged" / "model.safetensors").stat().st_ino
    assert main(["merge", str(adapter), "merged", "--overwrite"]) == 0
    assert (elsewhere / "merged" / "model.safetensors").stat().st_ino != first
    assert {p.name for p in (elsewhere / "merged").iterdir()} == written | {".diff-llama-output"}
    capsys.readouterr()
    # Bad input: one line each, nothing written, the adapter as it was.
    before = {p.name: p.read_bytes() for p in adapter.iterdir() if p.is_file()}
    (elsewhere / "full").mkdir()
    (elsewhere / "full" / "mine.txt").write_text("a user's file")
    for argv, problem in [
        (["merge", str(trained_merged), "x"], f"{trained_merged} is a whole model already (it has no "
                                              "adapter_config.json), so there is nothing to merge: use it as it is."),
        (["merge", str(adapter), "full"], "full is not empty; choose a new folder."),
        (["merge", str(adapter), str(adapter / "inside")], "is inside"),
        (["merge", str(adapter), str(adapter)], f"{adapter} is not empty; choose a new folder."),
        (["merge", str(tmp_path / "nowhere"), "x"], "nowhere: no such folder"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and problem in err, err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["eval", "full", "merged"]
    assert (elsewhere / "full" / "mine.txt").read_text() == "a user's file"
    assert {p.name: p.read_bytes() for p in adapter.iterdir() if p.is_file()} == before
    # Loaded as a plain model, the merged one trains as a plain model: every weight (peft froze the base's).
    assert all(param.requires_grad for param in load_causal_lm(adapter).parameters())
    assert main(["train", str(adapter), "--data", str(tmp_path / "text.txt"), "--output", "further", "--max-steps", "1",
                 "--block-size", "32", "--no-monitor"]) == 0
    further = load_file(elsewhere / "further" / "model.safetensors")
    assert further.keys() == load_file(saved_model / "model.safetensors").keys()  # a whole model, not an adapter
    assert "fine-tuned on\n`text.txt` from `lora`" in (elsewhere / "further" / "README.md").read_text()


def test_train_command_lora_merge_and_bad_data(tmp_path, saved_model, capsys):
    text = tmp_path / "text.txt"
    text.write_text(SAMPLE_TEXT)
    (saved_model / "NOTICE").write_text("the base's notice")
    out = tmp_path / "merged"
    assert main(["train", str(saved_model), "--data", str(text), "--output", str(out), "--lora", "--merge",
                 "--max-steps", "2", "--block-size", "32", "--no-monitor"]) == 0
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").exists()
    assert (out / "NOTICE").read_text() == "the base's notice"  # a derivative carries its source's licence texts
    base, merged = load_file(saved_model / "model.safetensors"), load_file(out / "model.safetensors")
    assert base.keys() == merged.keys()  # a plain model again, λ under the built-in names
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(base[name], merged[name])  # the trained LoRA update is in the weights
    # Fewer steps than --logging-steps (10): the last step is still logged and plotted.
    history = json.loads((out / "training_log.json").read_text())
    assert [e["step"] for e in history if "loss" in e] == [2]
    assert (out / "training_loss.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "differential_attention.png").exists()  # --no-monitor
    assert main(["train", str(saved_model), "--data", str(tmp_path / "nope"), "--output", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_distillation_kl_matches_its_definition():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, dtype=torch.float64), torch.randn(2, 5, 11, dtype=torch.float64)
    p, q = teacher.softmax(-1), student.softmax(-1)
    expected = (p * (p.log() - q.log())).sum(-1).mean()
    assert distillation_kl(student, teacher).item() == pytest.approx(expected.item(), rel=1e-6)
    assert distillation_kl(teacher, teacher).item() == pytest.approx(0.0, abs=1e-6)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    masked = (p * (p.log() - q.log())).sum(-1)[mask.bool()].mean()
    assert distillation_kl(student, teacher, mask).item() == pytest.approx(masked.item(), rel=1e-6)


def test_lambda_floor_penalty_is_zero_only_above_the_floor():
    model = tiny_model()
    lambdas = model.get_lambdas()
    assert lambda_floor_penalty(model, lambdas.min().item() - 0.01).item() == 0.0
    expected = torch.relu(0.9 - lambdas).sum()
    torch.testing.assert_close(lambda_floor_penalty(model, 0.9), expected)


@pytest.mark.parametrize("lora,budget", [(False, ["--max-steps", "3", "--save-steps", "2"]),
                                         (True, ["--minutes", "0.03"])])
def test_recover_command_distils_from_the_source(tmp_path, tokenizer, lora, budget, capsys):
    source = make_llama(tmp_path / "llama", tokenizer)
    (source / "LICENSE").write_text("the LLaMA's licence")
    converted = tmp_path / "diff"
    assert main(["convert", str(source), str(converted), "--diff-version", "1", "--calibration-tokens", "1024",
                 "--eval-tokens", "1024"]) == 0
    out = tmp_path / "recovered"
    args = ["recover", str(converted), "--output", str(out), *budget, "--block-size", "32",
            "--batch-size", "2", "--lambda-floor", "0.3", "--lambda-learning-rate", "1e-2"] + (["--lora"] if lora else [])
    assert main(args) == 0
    report = json.loads((out / "recovery_report.json").read_text())
    assert report["source"] == str(source.absolute()) or report["source"] == str(source)
    assert report["curve"][0]["step"] == 0 and report["curve"][-1]["step"] == report["steps"] >= 1
    if budget[0] == "--max-steps":
        assert report["steps"] == 3
        # Like train, recover does not silently start over on top of a run's checkpoints.
        capsys.readouterr()
        assert list(out.glob("checkpoint-*"))
        assert main(args) == 2
        assert "already holds training checkpoints" in capsys.readouterr().err
        # --resume continues the same distillation only: another λ floor is refused, more steps are not.
        assert main([*args, "--resume", "--lambda-floor", "0.2"]) == 2
        assert "other options (--lambda-floor 0.3, not 0.2)" in capsys.readouterr().err
        assert main([*args, "--resume", "--max-steps", "4"]) == 0
        resumed = json.loads((out / "recovery_report.json").read_text())
        assert resumed["steps"] == 4
        report["lambdas"] = resumed["lambdas"]  # what the folder holds now
    else:  # stopped by the time budget, measured in training time
        assert report["curve"][-1]["train_minutes"] >= 0.03
    assert report["curve"][0]["mean_abs_lambda"] < 1e-5 < report["final_mean_abs_lambda"]  # λ left 0
    assert (out / "recovery_curve.png").read_bytes()[:4] == b"\x89PNG"
    recovered = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(recovered.get_lambdas(), torch.tensor(report["lambdas"]))
    assert "after recovery" in (out / "README.md").read_text()
    assert (out / "LICENSE").read_text() == "the LLaMA's licence"  # through the conversion, to the recovered model


def test_recover_with_autocast_runs_the_source_in_it_too(tmp_path, tokenizer, monkeypatch):
    """recover --autocast: the student's forward in bfloat16 (the Trainer's mixed precision) and the source's
    alongside it too, on the student's device; the saved model stays float32."""
    source = make_llama(tmp_path / "llama", tokenizer)
    converted = tmp_path / "diff"
    assert main(["convert", str(source), str(converted), "--diff-version", "1", "--calibration-tokens", "1024",
                 "--eval-tokens", "1024"]) == 0
    queries = LayerZeroQueries().watch(monkeypatch)
    out = tmp_path / "recovered"
    assert main(["recover", str(converted), "--output", str(out), "--max-steps", "2", "--block-size", "32",
                 "--batch-size", "2", "--autocast", "bfloat16"]) == 0
    assert queries.of("student") == [(torch.bfloat16, "cpu")] * 2
    assert queries.of("source").count((torch.bfloat16, "cpu")) == 2  # beside each step (not its perplexity)
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.float32


def test_recover_resume_continues_the_curve_and_the_time_budget(tmp_path, tokenizer, capsys):
    """A resumed recovery used to start its curve and its clock again: the report and plot lost what came before the
    checkpoint, and --minutes bought a whole new budget. Each checkpoint now keeps both; --minutes is the run's."""
    from diff_llama.recovery import MONITOR_STATE

    source = make_llama(tmp_path / "llama", tokenizer)
    converted = tmp_path / "diff"
    assert main(["convert", str(source), str(converted), "--diff-version", "1", "--calibration-tokens", "1024",
                 "--eval-tokens", "1024"]) == 0
    out = tmp_path / "recovered"
    args = ["recover", str(converted), "--output", str(out), "--block-size", "32", "--batch-size", "2",
            "--save-steps", "1", "--eval-minutes", "0.002"]
    assert main([*args, "--minutes", "0.01"]) == 0
    first = json.loads((out / "recovery_report.json").read_text())
    (checkpoint,) = out.glob("checkpoint-*")
    kept = json.loads((checkpoint / MONITOR_STATE).read_text())
    # At least the start and the end (more where steps are fast: the probe is due every 0.12 s)
    assert kept["curve"] == first["curve"] and kept["train_seconds"] >= 0.6 and len(first["curve"]) >= 2
    capsys.readouterr()
    assert main([*args, "--minutes", "0.01", "--resume"]) == 2
    assert "minutes into its run's training, and --minutes 0.01 is the whole run's budget; give a larger --minutes" in (
        capsys.readouterr().err)
    # What the resumed run's monitor starts from: the kept curve and clock, so its budget is what is left of the run's.
    from diff_llama.recovery import RecoveryMonitor

    monitor = RecoveryMonitor(torch.zeros(1, 8, dtype=torch.long), eval_minutes=0.002, max_minutes=0.01)
    monitor.resume(kept)
    assert monitor.curve == first["curve"] and monitor.train_seconds == kept["train_seconds"] and monitor.out_of_time
    # 0.01 minutes more than the first run spent (a step can take longer than its budget on a loaded machine)
    spent = kept["train_seconds"] / 60
    budget = math.ceil((spent + 0.01) * 1e4) / 1e4
    assert main([*args, "--minutes", str(budget), "--resume"]) == 0
    resumed = json.loads((out / "recovery_report.json").read_text())
    assert resumed["curve"][:len(first["curve"])] == first["curve"]  # the curve goes on from where it was
    assert len(resumed["curve"]) > len(first["curve"]) and resumed["steps"] > first["steps"]
    minutes = [point["train_minutes"] for point in resumed["curve"]]
    steps = [point["step"] for point in resumed["curve"]]
    assert minutes == sorted(minutes) and steps == sorted(steps) and steps[0] == 0
    assert budget <= minutes[-1]  # it trained to the whole run's budget (its clock: the monitor check above)


def test_recover_on_text_the_source_generates(tmp_path, tokenizer):
    from diff_llama.recovery import teacher_generated_text

    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                           bos_token_id=1, eos_token_id=2, pad_token_id=0))
    text = teacher_generated_text(teacher, tokenizer, num_tokens=64, length=16, batch_size=2)
    # 64 tokens = 2 rounds of 2 samples of 16 tokens each, seeded: the same text again, four samples of it.
    assert text == teacher_generated_text(teacher, tokenizer, num_tokens=64, length=16, batch_size=2)
    samples = text.split("\n\n")
    assert len(samples) == 4 and len(set(samples)) == 4
    # 16 tokens, re-tokenized: a byte token that is not UTF-8 on its own comes back as U+FFFD, three bytes
    assert 8 <= len(tokenizer(samples[0], add_special_tokens=False).input_ids) <= 3 * 16


DDP_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from conftest import SAMPLE_TEXT, tiny_model
    from transformers import AutoTokenizer, Trainer, TrainingArguments
    from diff_llama.training import TokenBlocks
    tokenizer = AutoTokenizer.from_pretrained({tok!r})
    model = tiny_model(vocab_size=len(tokenizer))
    args = TrainingArguments({out!r}, max_steps=3, per_device_train_batch_size=2, report_to="none",
                             save_strategy="no", use_cpu=True, ddp_backend="gloo")
    trainer = Trainer(model=model, args=args, train_dataset=TokenBlocks(tokenizer, SAMPLE_TEXT, 32))
    trainer.train()
    assert dist.get_world_size() == 2
    # DDP keeps the replicas identical: gather every rank's λ and compare.
    lambdas = model.get_lambdas().detach()
    gathered = [torch.zeros_like(lambdas) for _ in range(2)]
    dist.all_gather(gathered, lambdas)
    assert torch.equal(gathered[0], gathered[1]) and trainer.state.global_step == 3
    open({out!r} + f"/rank{{dist.get_rank()}}.ok", "w").write(str(lambdas.tolist()))
    dist.barrier()
    dist.destroy_process_group()
    # At interpreter exit, a C++ thread left by the gloo/Trainer stack sometimes aborts the process ("terminate called
    # without an active exception", exit -6) after everything above succeeded; leave without running those destructors.
    sys.stdout.flush()
    os._exit(0)
""")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ddp_training_on_cpu_with_gloo(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path / "tok")
    script = tmp_path / "ddp.py"
    tests = str(__import__("pathlib").Path(__file__).parent)
    script.write_text(DDP_SCRIPT.format(tests=tests, tok=str(tmp_path / "tok"), out=str(tmp_path / "ddp-run")))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()), str(script)],
        capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "ddp-run").glob("*.ok")) == ["rank0.ok", "rank1.ok"]


def test_trl_sft_trainer_with_lora_trains_lambda(tmp_path, tokenizer):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    model = tiny_model(vocab_size=len(tokenizer))
    lambdas_before = model.get_lambdas().detach().clone()
    lines = [line for line in SAMPLE_TEXT.split(". ") if line.strip()]
    config = trl.SFTConfig(str(tmp_path / "sft"), max_steps=3, per_device_train_batch_size=2, max_length=32,
                           report_to="none", save_strategy="no", learning_rate=1e-2, logging_steps=1,
                           bf16=False)  # SFTConfig defaults to bf16 and refuses it without a GPU
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": lines}),
                             processing_class=tokenizer, peft_config=lora_config())
    trainer.train()
    assert trainer.state.global_step == 3
    assert not torch.allclose(trainer.model.get_lambdas(), lambdas_before)


def test_time_decay_schedule_follows_the_training_clock():
    from diff_llama.recovery import RecoveryMonitor, time_decay_schedule

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    monitor = RecoveryMonitor(torch.zeros(4, dtype=torch.long), eval_minutes=1, max_minutes=10)
    schedule = time_decay_schedule(optimizer, monitor)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # first warm-up step
    for _ in range(20):
        optimizer.step()
        schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1.0)  # warm, no training time spent yet
    monitor.train_seconds = 450  # three quarters of the 10-minute budget
    optimizer.step()
    schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.25)
