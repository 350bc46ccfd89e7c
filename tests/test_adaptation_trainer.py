"""`diff-llama adapt` on the Trainer (issue 35): the same step as the recipe's own loop was, the same examples on any
number of processes, a resumed run that neither repeats nor skips an example, and the same verdicts on a GPU."""

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import diff_llama
import diff_llama.adaptation.trainer as trainer
from conftest import tiny_model, with_chat_template
from diff_llama.adaptation import (
    AdaptationOptions,
    RetrievalExamples,
    SecondHeadRate,
    TextBlocks,
    adapt,
    answer_loss,
    differential_factor,
    differential_parameters,
    freeze_lower_layers,
    learning_rate_factor,
    pair_divergence,
    text_loss,
)
from test_adaptation import CHAT_TEMPLATE, SMALL

ROOT = Path(__file__).parent.parent
SRC = str(Path(diff_llama.__file__).parent.parent)
# A V2 model whose second heads and λ projection train at another rate than the rest, a text block every step with
# a KL term: every part of the recipe's step takes part.
RECIPE = dict(SMALL, warmup_steps=2, text_every=1, kl_weight=0.5, learning_rate=1e-3, differential_learning_rate=5e-3,
              eval_every=0, autocast="none")


@pytest.fixture
def chat_tokenizer(tokenizer):
    return with_chat_template(tokenizer, CHAT_TEMPLATE)


@pytest.fixture
def no_probes(monkeypatch):
    # what the curves plot, without the probe's cost
    monkeypatch.setattr(trainer, "probe", lambda *args, **kwargs: dict(accuracy=0.0, answer_share=0.0,
                                                                       noise_share=0.0, perplexity=1.0))


def v2_model(tokenizer):
    model = tiny_model(vocab_size=len(tokenizer), max_position_embeddings=1024, diff_version=2)
    for layer in model.model.layers:  # where a lossless conversion starts: pairs equal
        heads = layer.self_attn.q_proj.weight.data.view(-1, 2, model.config.head_dim, model.config.hidden_size)
        heads[:, 1] = heads[:, 0]
    return model


def loop_of_before(model, tokenizer, options, steps):
    """The recipe's hand-written loop as it was before the Trainer (the maths of each step, kept as the reference):
    returns each step's answer and text losses."""
    from diff_llama.training import optimizer_for

    torch.manual_seed(options.seed)
    examples = RetrievalExamples(tokenizer, options)
    blocks, text_steps = TextBlocks(tokenizer, options.text_block, options.seed), 0
    reference = copy.deepcopy(model).eval().requires_grad_(False) if options.kl_weight > 0 else None
    model.train()
    freeze_lower_layers(model, options.frozen_layers)
    differential = differential_parameters(model)
    extra = [{"params": differential, "lr": options.differential_learning_rate, "weight_decay": 0.0,
              "differential": True}]
    optimizer = optimizer_for(model, options.learning_rate, options.lambda_learning_rate,
                              extra_groups=extra if differential else [])
    second_heads = SecondHeadRate(model, 1.0)
    base_rates = [group["lr"] for group in optimizer.param_groups]
    losses = []
    for step in range(steps):
        factor, own_factor = learning_rate_factor(step, options), differential_factor(step, options)
        for group, rate in zip(optimizer.param_groups, base_rates):
            group["lr"] = rate * (own_factor if group.get("differential") else factor)
        second_heads.factor = options.differential_learning_rate / options.learning_rate * (own_factor / factor)
        input_ids, answer_tokens = examples.next()
        loss = answer_loss(model, input_ids, answer_tokens)
        loss.backward()
        entry = [loss.item()]
        if step % options.text_every == 0:
            lm = text_loss(model, blocks[text_steps], reference, options.kl_weight)
            text_steps += 1
            lm.backward()
            entry.append(lm.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        second_heads.before_step()
        optimizer.step()
        second_heads.after_step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(entry)
    return losses


def test_a_trainer_step_is_a_step_of_the_recipe_as_it_was(chat_tokenizer, no_probes):
    options = AdaptationOptions(max_steps=2, **RECIPE)
    model, before = v2_model(chat_tokenizer), v2_model(chat_tokenizer)
    reference_losses = loop_of_before(before, chat_tokenizer, options, steps=2)
    history = adapt(model, chat_tokenizer, options, name="tiny")
    losses = [[s["answer_loss"], s["text_loss"]] for s in history["steps"]]
    loss_diff = (torch.tensor(losses) - torch.tensor(reference_losses)).abs().max().item()
    weights = before.state_dict()
    weight_diff = max((value - weights[name]).abs().max().item() for name, value in model.state_dict().items())
    print(f"\nmax |loss - loss of the loop before|: {loss_diff:.3g}; max |weight - its weight|: {weight_diff:.3g}")
    assert [s["examples"] for s in history["steps"]] == [[0], [1]]
    assert loss_diff < 1e-5 and weight_diff < 1e-6
    # and the step did move the second heads apart from the first (their own rate took effect)
    assert pair_divergence(model) > 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_train_on_the_examples_of_one_split_between_them(tmp_path, chat_tokenizer, no_probes):
    options = dict(RECIPE, kl_weight=0.0, max_steps=2, batch_size=2)
    model = v2_model(chat_tokenizer)
    model.save_pretrained(tmp_path / "model")
    chat_tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "options.json").write_text(json.dumps(options))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, str(Path(__file__).parent)]), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(ROOT / "configs/accelerate/ddp.yaml"), "--main_process_port", str(_free_port()),
              str(Path(__file__).parent / "adapt_worker.py"), str(tmp_path / "model"), str(tmp_path)]
    # In a session of its own, so that a hung launch is killed with its workers
    process = subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    assert process.returncode == 0, stdout[-2000:] + stderr[-4000:]

    single = adapt(model, chat_tokenizer, AdaptationOptions(**options), name="tiny")  # one process, same batch
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["processes"] for r in ranks] == [2, 2]
    # Step s trains on examples 2s and 2s + 1 in both runs; each process built only its own one.
    assert [s["examples"] for s in single["steps"]] == [s["examples"] for s in ranks[0]["steps"]] == [[0, 1], [2, 3]]
    assert sorted(ranks[0]["built"] + ranks[1]["built"]) == [0, 1, 2, 3]
    assert not set(ranks[0]["built"]) & set(ranks[1]["built"])
    for field in ("tokens", "answer_loss", "text_loss"):
        assert [s[field] for s in ranks[0]["steps"]] == pytest.approx([s[field] for s in single["steps"]], rel=1e-5)
    # DDP's mean over the processes is the Trainer's mean over the accumulated examples of one process
    trained = torch.load(tmp_path / "rank0.weights.pt")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(trained[name], value, atol=1e-6, rtol=0, msg=name)


def test_a_resumed_run_goes_on_from_the_first_example_it_had_not_trained_on(tmp_path, chat_tokenizer, no_probes,
                                                                              monkeypatch):
    options = dict(RECIPE, kl_weight=0.0, max_steps=4)
    whole = v2_model(chat_tokenizer)
    whole_history = adapt(whole, chat_tokenizer, AdaptationOptions(**options), name="tiny")

    built, real_getitem, kill = [], RetrievalExamples.__getitem__, [True]

    def build(self, index):
        if index == 3 and kill[0]:  # the first run is killed before its fourth example
            raise KeyboardInterrupt
        built.append(index)
        return real_getitem(self, index)

    monkeypatch.setattr(RetrievalExamples, "__getitem__", build)
    killed = v2_model(chat_tokenizer)
    with pytest.raises(KeyboardInterrupt):
        adapt(killed, chat_tokenizer, AdaptationOptions(**options, save_steps=2), tmp_path / "run", name="tiny")
    assert (tmp_path / "run/checkpoint-2/adapt_state.json").exists()

    # a checkpoint of a diff-llama older than an option (here frozen_layers) resumes as if it had the default
    state_file = tmp_path / "run/checkpoint-2/adapt_state.json"
    state = json.loads(state_file.read_text())
    del state["options"]["frozen_layers"]
    state_file.write_text(json.dumps(state))
    built.append("resumed")
    kill[0] = False
    resumed = v2_model(chat_tokenizer)  # the model as loaded from MODEL again: the checkpoint's weights replace it
    history = adapt(resumed, chat_tokenizer, AdaptationOptions(**options, save_steps=2, resume=True), tmp_path / "run",
                    name="tiny")
    assert built[built.index("resumed") + 1:] == [2, 3]  # built again from example 2 on, nothing before it
    assert [s["examples"] for s in history["steps"]] == [[0], [1], [2], [3]]
    assert [s["answer_loss"] for s in history["steps"]] == pytest.approx([s["answer_loss"] for s in
                                                                          whole_history["steps"]], rel=1e-6)
    assert json.loads((tmp_path / "run/adapt.json").read_text())["steps"] == history["steps"]
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, atol=1e-6, rtol=0, msg=name)
    with pytest.raises(ValueError, match="trained with other options \\(learning_rate"):
        adapt(v2_model(chat_tokenizer), chat_tokenizer,
              AdaptationOptions(**{**options, "learning_rate": 1e-4}, resume=True), tmp_path / "run", name="tiny")
    state_file = max((tmp_path / "run").glob("checkpoint-*/adapt_state.json"))  # the one --resume takes
    state = json.loads(state_file.read_text())
    del state["options"]["frozen_layers"]
    state_file.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="trained with other options \\(frozen_layers 0, not 1"):
        adapt(v2_model(chat_tokenizer), chat_tokenizer,
              AdaptationOptions(**options, frozen_layers=1, resume=True), tmp_path / "run", name="tiny")


def test_an_indexed_stream_is_the_sequential_one(chat_tokenizer):
    options = AdaptationOptions(**SMALL, long_length=900, long_fraction=0.5)
    sequential, indexed = RetrievalExamples(chat_tokenizer, options), RetrievalExamples(chat_tokenizer, options)
    stream = [sequential.next() for _ in range(4)]
    assert [indexed[i] for i in (3, 1, 0, 2)] == [stream[i] for i in (3, 1, 0, 2)]
    in_order, by_index = TextBlocks(chat_tokenizer, 64, seed=0), TextBlocks(chat_tokenizer, 64, seed=0)
    count = len(in_order.blocks)
    first = [in_order[i] for i in range(2 * count + 1)]  # over three passes
    assert all(torch.equal(by_index[i], block) for i, block in reversed(list(enumerate(first))))
    # every pass holds each block of the text once, each pass in another order
    passes = [torch.stack(first[:count]), torch.stack(first[count:2 * count])]
    assert all(sorted(p.tolist()) == sorted(in_order.blocks.tolist()) for p in passes)
    assert not torch.equal(passes[0], passes[1])


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: compares it with the CPU")


@needs_cuda
def test_evaluate_gives_the_same_verdicts_on_cuda_as_on_the_cpu(chat_tokenizer):
    from diff_llama.retrieval import evaluate_model
    from diff_llama.options import RetrievalArguments

    options = RetrievalArguments(lengths=[300, 600], settings=["1x1", "2x2", "4x2"], cases_per_depth=1,
                                 perplexity_tokens=256, threads=0, max_new_tokens=12)
    model = v2_model(chat_tokenizer).eval()
    on_cpu = evaluate_model(model, chat_tokenizer, options)
    on_cuda = evaluate_model(copy.deepcopy(model).to("cuda"), chat_tokenizer, options)
    assert [c["found"] for c in on_cuda["cases"]] == [c["found"] for c in on_cpu["cases"]]
    assert [c["output"] for c in on_cuda["cases"]] == [c["output"] for c in on_cpu["cases"]]
    assert on_cuda["perplexity"] == pytest.approx(on_cpu["perplexity"], rel=1e-4)


@needs_cuda
def test_adapt_trains_on_cuda_as_on_the_cpu(chat_tokenizer, no_probes):
    options = dict(RECIPE, max_steps=2)
    on_cpu, on_cuda = v2_model(chat_tokenizer), v2_model(chat_tokenizer)
    cpu = adapt(on_cpu, chat_tokenizer, AdaptationOptions(**options, device="cpu"), name="tiny")
    cuda = adapt(on_cuda, chat_tokenizer, AdaptationOptions(**options), name="tiny")
    assert cuda["device"] == "cuda" and on_cuda.device.type == "cuda"
    assert [s["examples"] for s in cuda["steps"]] == [s["examples"] for s in cpu["steps"]]
    assert [s["answer_loss"] for s in cuda["steps"]] == pytest.approx([s["answer_loss"] for s in cpu["steps"]],
                                                                      rel=1e-4)
    for name, value in on_cpu.state_dict().items():
        torch.testing.assert_close(on_cuda.state_dict()[name].cpu(), value, atol=1e-4, rtol=0, msg=name)
