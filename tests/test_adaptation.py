"""`diff-llama adapt`: the retrieval training recipe (issue 10 part 3)."""

import copy
import json
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_model, with_chat_template
from diff_llama.adaptation import (
    AdaptationOptions,
    RetrievalExamples,
    SecondHeadRate,
    adapt,
    answer_loss,
    check_options,
    differential_factor,
    learning_rate_factor,
    run_adapt,
    pair_divergence,
    training_sentences,
)
from diff_llama.retrieval import HELD_OUT_CITIES, TRAINING_CITIES, filler_sentences


def main(argv):
    """`diff-llama adapt ARGV`, raising its errors (the command line prints them in one line)."""
    from diff_llama_cli import parse

    model, output, options, command = parse("adapt", argv)
    return run_adapt(model, output, options, name=command.name, overwrite=command.overwrite)


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
SMALL = dict(min_length=300, max_length=450, max_needles=3, max_queries=2, text_block=64, eval_lengths=[400],
             eval_settings=["2x1"], eval_cases=1, warmup_steps=1, threads=0)


@pytest.fixture
def chat_tokenizer(tokenizer):
    return with_chat_template(tokenizer, CHAT_TEMPLATE)


def test_training_examples_share_nothing_with_the_evaluation(chat_tokenizer):
    sentences = training_sentences()
    assert len(sentences) > 500
    assert not set(sentences) & set(filler_sentences(2000, seed=0))
    assert not any(ch.isdigit() for s in sentences for ch in s)
    examples = RetrievalExamples(chat_tokenizer, AdaptationOptions(**SMALL))
    for _ in range(5):
        ids, answer_tokens = examples.next()
        text = chat_tokenizer.decode(ids)
        # at most the drawn length; below it by less than a filler sentence (long ones in this tiny vocabulary)
        assert SMALL["min_length"] // 2 <= len(ids) - answer_tokens <= SMALL["max_length"]
        assert not any(f"magic number for {city} " in text or f"for {city}?" in text for city in HELD_OUT_CITIES)
        assert any(f"magic number for {city} is" in text for city in TRAINING_CITIES)
        answer = chat_tokenizer.decode(ids[-answer_tokens:])
        assert answer.endswith(chat_tokenizer.eos_token)
        numbers = answer.removesuffix(chat_tokenizer.eos_token).split(", ")
        # every stated number is a needle of this prompt, stated in the context before the question
        assert all(len(n) == 7 and f" is {n}." in text for n in numbers)


def test_the_example_stream_depends_on_the_seed_alone(chat_tokenizer):
    """Fairness: the source LLaMA and the converted model see exactly the same examples."""
    first = RetrievalExamples(chat_tokenizer, AdaptationOptions(**SMALL))
    second = RetrievalExamples(chat_tokenizer, AdaptationOptions(**SMALL))
    other = RetrievalExamples(chat_tokenizer, AdaptationOptions(**{**SMALL, "seed": 1}))
    stream = [first.next() for _ in range(3)]
    assert stream == [second.next() for _ in range(3)]
    assert stream != [other.next() for _ in range(3)]


def test_long_examples_are_a_share_of_the_stream_up_to_long_length(chat_tokenizer):
    plain = RetrievalExamples(chat_tokenizer, AdaptationOptions(**SMALL))
    mixed = RetrievalExamples(chat_tokenizer, AdaptationOptions(**SMALL, long_length=900, long_fraction=0.5))
    lengths = [len(ids) - answer for ids, answer in (mixed.next() for _ in range(24))]
    assert all(length <= 900 for length in lengths)
    long = sum(length > SMALL["max_length"] for length in lengths)
    assert 4 <= long <= 20  # about half of 24: drawn from (450, 900]; a few fall short by a filler sentence
    assert max(lengths) > 700
    assert all(len(ids) - answer <= SMALL["max_length"] for ids, answer in (plain.next() for _ in range(24)))


def test_adapt_refuses_long_examples_it_cannot_draw(chat_tokenizer):
    model = tiny_model(vocab_size=len(chat_tokenizer))
    for bad in (dict(long_length=SMALL["max_length"]), dict(long_length=900, long_fraction=0.0),
                dict(long_length=900, long_fraction=1.5)):
        with pytest.raises(ValueError, match="--long-length above --max-length and --long-fraction above 0 and at most 1"):
            adapt(model, chat_tokenizer, AdaptationOptions(**SMALL, **bad))


def test_answer_loss_is_the_cross_entropy_of_the_answer_tokens(tokenizer):
    model = tiny_model(vocab_size=len(tokenizer)).double()
    ids = torch.randint(3, len(tokenizer), (40,)).tolist()
    logits = model(input_ids=torch.tensor([ids])).logits[0]
    expected = torch.nn.functional.cross_entropy(logits[-6:-1], torch.tensor(ids[-5:]))
    torch.testing.assert_close(answer_loss(model, ids, 5), expected, rtol=1e-12, atol=1e-12)


def test_learning_rate_warms_up_then_decays_to_zero():
    options = AdaptationOptions(max_steps=10, warmup_steps=2)
    factors = [learning_rate_factor(step, options) for step in range(10)]
    assert factors[:2] == [0.5, 1.0]
    assert all(a >= b for a, b in zip(factors[1:], factors[2:])) and factors[-1] == 1 / 8
    assert learning_rate_factor(10, options) == 0.0


def test_differential_parameters_can_warm_up_on_their_own_schedule():
    options = AdaptationOptions(max_steps=10, warmup_steps=2, differential_warmup_steps=5)
    assert [differential_factor(step, options) for step in range(10)] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 0.8, 0.6,
                                                                         0.4, 0.2]
    assert learning_rate_factor(0, options) == 0.5  # the shared schedule is unchanged
    shared = AdaptationOptions(max_steps=10, warmup_steps=2)
    assert [differential_factor(s, shared) for s in range(10)] == [learning_rate_factor(s, shared) for s in range(10)]
    with pytest.raises(ValueError, match="--differential-warmup-steps must be between 0 and --max-steps"):
        check_options(AdaptationOptions(max_steps=10, differential_warmup_steps=11))


def test_a_differential_warm_up_sets_the_rate_of_each_step(chat_tokenizer, monkeypatch):
    """Step by step, the λ projection's group and the second heads' factor follow the differential schedule."""
    import diff_llama.adaptation.trainer as trainer
    import diff_llama.training as training

    seen, rates, optimizers = [], [], []
    real_after, real_optimizer_for = SecondHeadRate.after_step, training.optimizer_for

    def after_step(self):
        seen.append(self.factor)
        rates.append([group["lr"] for group in optimizers[0].param_groups])
        real_after(self)

    monkeypatch.setattr(SecondHeadRate, "after_step", after_step)
    monkeypatch.setattr(training, "optimizer_for", lambda *a, **k: optimizers.append(real_optimizer_for(*a, **k))
                        or optimizers[-1])
    monkeypatch.setattr(trainer, "probe", lambda *args, **kwargs: {})
    model = tiny_model(vocab_size=len(chat_tokenizer), max_position_embeddings=1024, diff_version=2)
    options = AdaptationOptions(max_steps=4, eval_every=0, autocast="none", save=False,
                                **{**SMALL, "warmup_steps": 1, "differential_warmup_steps": 4})
    adapt(model, chat_tokenizer, options, name="tiny")
    ratio = options.differential_learning_rate / options.learning_rate
    expected = [ratio * differential_factor(s, options) / learning_rate_factor(s, options) for s in range(4)]
    assert seen == pytest.approx(expected) and seen[0] == pytest.approx(ratio * 0.25)
    # groups: the shared parameters, then the λ projections (no λ vectors in version 2)
    assert [r[0] for r in rates] == pytest.approx([options.learning_rate * learning_rate_factor(s, options)
                                                   for s in range(4)])
    assert [r[-1] for r in rates] == pytest.approx([options.differential_learning_rate * differential_factor(s, options)
                                                    for s in range(4)])


def test_adapt_trains_every_part_of_a_diff_v2_model_and_writes_curves(tmp_path, chat_tokenizer):
    model = tiny_model(vocab_size=len(chat_tokenizer), max_position_embeddings=1024, diff_version=2)
    for layer in model.model.layers:  # start where a conversion starts: λ projection zero, pairs equal
        layer.self_attn.differential_lambda.lambda_proj.weight.data.zero_()
    before = copy.deepcopy(model.state_dict())
    history = adapt(model, chat_tokenizer, AdaptationOptions(max_steps=3, eval_every=2, autocast="none", **SMALL),
                    tmp_path, name="tiny")
    assert [p["step"] for p in history["probes"]] == [0, 2, 3]
    assert history["autocast_dtype"] == "torch.float32"  # 'none': no autocast
    assert len(history["steps"]) == 3 and all("answer_loss" in s for s in history["steps"])
    assert [("text_loss" in s) for s in history["steps"]] == [True, False, True]
    assert history["train_minutes"] > 0 and not history["stopped_by_budget"]
    moved = {name for name, value in model.state_dict().items() if not torch.equal(value, before[name])}
    assert all(any(f"layers.{i}.self_attn.differential_lambda.lambda_proj" in n for n in moved) for i in range(3))
    assert "model.layers.0.self_attn.q_proj.weight" in moved and "lm_head.weight" in moved
    saved = json.loads((tmp_path / "adapt.json").read_text())
    assert saved["probes"][-1]["perplexity"] == history["probes"][-1]["perplexity"]
    assert (tmp_path / "adapt.png").stat().st_size > 10_000


def test_frozen_layers_stay_fixed_and_get_no_backward_pass(tmp_path, chat_tokenizer):
    model = tiny_model(vocab_size=len(chat_tokenizer), max_position_embeddings=1024, diff_version=2,
                       tie_word_embeddings=True)
    before = copy.deepcopy(model.state_dict())
    reached = []  # gradients that reach a decoder layer's output: none may reach the frozen first layer
    for i, layer in enumerate(model.model.layers):
        layer.register_full_backward_hook(lambda module, grad_in, grad_out, i=i: reached.append(i))
    adapt(model, chat_tokenizer, AdaptationOptions(max_steps=2, eval_every=0, autocast="none", frozen_layers=1,
                                                   differential_learning_rate=3e-3, **SMALL), name="tiny")
    moved = {name for name, value in model.state_dict().items() if not torch.equal(value, before[name])}
    assert not {n for n in moved if n.startswith(("model.layers.0.", "model.embed_tokens", "lm_head"))}
    assert {f"model.layers.{i}.self_attn.q_proj.weight" for i in range(1, len(model.model.layers))} <= moved
    assert reached and 0 not in reached and set(reached) == set(range(1, len(model.model.layers)))
    assert all(param.requires_grad for param in model.parameters())  # frozen for the training only


def test_frozen_layers_are_unfrozen_when_training_stops_with_an_error(chat_tokenizer):
    model = tiny_model(vocab_size=len(chat_tokenizer), max_position_embeddings=1024, diff_version=2)
    with mock.patch("diff_llama.adaptation.RetrievalExamples.__getitem__", side_effect=KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            adapt(model, chat_tokenizer, AdaptationOptions(max_steps=2, eval_every=0, autocast="none",
                                                           frozen_layers=1, **SMALL), name="tiny")
    assert all(param.requires_grad for param in model.parameters())
    assert not model.training


def test_adapt_refuses_more_frozen_layers_than_it_can_train(chat_tokenizer):
    model = tiny_model(vocab_size=len(chat_tokenizer), max_position_embeddings=1024)
    layers = len(model.model.layers)
    for bad in (layers, -1):
        with pytest.raises(ValueError, match="--frozen-layers must be"):
            adapt(model, chat_tokenizer, AdaptationOptions(frozen_layers=bad, **SMALL))


def test_adapt_says_when_the_time_budget_cuts_its_schedule_short(tmp_path, chat_tokenizer):
    model = tiny_model(vocab_size=len(chat_tokenizer), max_position_embeddings=1024)
    options = AdaptationOptions(max_steps=5, max_seconds=1e-9, eval_every=0, autocast="none",
                                **{**SMALL, "warmup_steps": 5})
    with pytest.warns(UserWarning, match="ran out after 1 of 5 steps, with the learning rate at 20%"):
        history = adapt(model, chat_tokenizer, options, name="tiny")
    assert history["stopped_by_budget"] and len(history["steps"]) == 1
    assert [p["step"] for p in history["probes"]] == [0, 1]


def test_second_heads_of_diff_v2_pairs_take_their_own_learning_rate():
    model = tiny_model(diff_version=2, num_attention_heads=6, num_key_value_heads=3)  # odd h = 3 differential heads
    plain = copy.deepcopy(model)
    for m in (model, plain):
        for name, param in m.named_parameters():
            param.grad = torch.sin(torch.arange(param.numel(), dtype=param.dtype)).view_as(param) + len(name) % 7
    scaled_rows = SecondHeadRate(model, 5.0)
    assert len(scaled_rows.rows) == len(model.model.layers)
    for m, rows in ((model, scaled_rows), (plain, SecondHeadRate(plain, 1.0))):
        before = copy.deepcopy(m.state_dict())
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-3)
        rows.before_step()
        optimizer.step()
        rows.after_step()
        m.steps = {k: v - before[k] for k, v in m.state_dict().items()}
    d = model.config.head_dim
    for key, step in model.steps.items():
        reference = plain.steps[key]
        if key.endswith("q_proj.weight"):
            by_head = step.view(6, d, -1)
            assert torch.allclose(by_head[0::2], reference.view(6, d, -1)[0::2])  # first heads: the base rate
            assert torch.allclose(by_head[1::2], 5 * reference.view(6, d, -1)[1::2], atol=1e-9)
            assert by_head[1::2].abs().min() > 0
        else:
            assert torch.equal(step, reference), key


def test_adapt_refuses_learning_rates_it_cannot_use(chat_tokenizer):
    model = tiny_model(vocab_size=len(chat_tokenizer), diff_version=2)
    for bad in (dict(learning_rate=0.0), dict(differential_learning_rate=-1e-3)):
        with pytest.raises(ValueError, match="--learning-rate above 0 and --differential-learning-rate 0 or more"):
            adapt(model, chat_tokenizer, AdaptationOptions(**bad, **SMALL))


def test_pair_divergence_is_zero_for_a_lossless_conversion_and_none_for_a_llama():
    model = tiny_model(diff_version=2)
    for layer in model.model.layers:
        heads = layer.self_attn.q_proj.weight.data.view(-1, 2, model.config.head_dim, model.config.hidden_size)
        heads[:, 1] = heads[:, 0]
    assert pair_divergence(model) == 0
    model.model.layers[0].self_attn.q_proj.weight.data.view(-1, 2, model.config.head_dim, model.config.hidden_size)[
        :, 1] *= 1.1  # first layer's second heads 10% off: the mean over layers is 0.1 / layers
    assert pair_divergence(model) == pytest.approx(0.1 / len(model.model.layers), rel=1e-5)
    assert pair_divergence(torch.nn.Linear(2, 2)) is None


def test_adapt_command_saves_a_model_that_reloads(tmp_path, chat_tokenizer, capsys):
    source = tmp_path / "source"
    tiny_model(vocab_size=len(chat_tokenizer), max_position_embeddings=1024).save_pretrained(source)
    chat_tokenizer.save_pretrained(source)
    (source / "LICENSE.txt").write_text("the source's licence")
    output = tmp_path / "adapted"
    flags = ["--max-steps", "2", "--eval-every", "0", "--autocast", "none"]
    for key, value in SMALL.items():
        flags += [f"--{key.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    assert main([str(source), str(output), *flags]) == 0
    assert "2 steps" in capsys.readouterr().out
    reloaded = AutoModelForCausalLM.from_pretrained(output)
    assert not torch.equal(reloaded.model.layers[0].self_attn.q_proj.weight,
                           AutoModelForCausalLM.from_pretrained(source).model.layers[0].self_attn.q_proj.weight)
    assert {"adapt.json", "adapt.png", "config.json", "model.safetensors"} <= {p.name for p in output.iterdir()}
    assert (output / "LICENSE.txt").read_text() == "the source's licence"  # a derivative carries it
    assert not (output / ".partial").exists()
    # Its card tells the training (`push` publishes it), with the probe figures that adapt.json holds.
    history = json.loads((output / "adapt.json").read_text())
    report = json.loads((output / "training_report.json").read_text())
    assert report["steps"] == 2 and report["probe_after"] == history["probes"][-1]
    card = (output / "README.md").read_text()
    assert "fine-tuned on\nsynthetic multi-needle retrieval examples of" in card and "from `source`." in card
    assert (f"2 steps ({report['train_minutes'] * 60:.0f} s) of training, learning rate 3e-05; held-out retrieval "
            f"probe accuracy {history['probes'][0]['accuracy']:.0%} before") in card
    assert "Unknown: the source (`source`) states no licence" in card  # a LICENSE text, but no licence metadata
    assert "No held-out evaluation" not in card  # the probe is one
    with pytest.raises(FileExistsError, match="not empty; choose a new folder, or pass --overwrite to replace it"):
        main([str(source), str(output), *flags])
    # a finished run has no checkpoint to resume from: the error says so and offers --overwrite, which works
    with pytest.raises(FileNotFoundError, match="no checkpoint-N folder .* or pass --overwrite to start over"):
        main([str(source), str(output), *flags, "--resume"])
    assert main([str(source), str(output), *flags, "--max-steps", "1", "--no-save", "--overwrite"]) == 0
    assert {p.name for p in output.iterdir()} == {".diff-llama-output", "adapt.json", "adapt.png"}
    assert len(json.loads((output / "adapt.json").read_text())["steps"]) == 1


def test_adapt_overwrite_replaces_its_own_run_with_the_checkpoints_it_kept(tmp_path, chat_tokenizer, capsys):
    """A finished run keeps its last checkpoint (with adapt's own history in it): all of it is adapt's to replace."""
    from diff_llama.cli import main as command_line
    from diff_llama.output_folder import changed_since_written, foreign_entries, read_marker

    source = tmp_path / "source"
    tiny_model(vocab_size=len(chat_tokenizer), max_position_embeddings=1024).save_pretrained(source)
    chat_tokenizer.save_pretrained(source)
    out = tmp_path / "adapted"
    argv = ["adapt", str(source), str(out), "--max-steps", "2", "--save-steps", "1", "--eval-every", "0",
            "--autocast", "none"]
    for key, value in SMALL.items():
        argv += [f"--{key.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    assert command_line(argv) == 0
    kept = sorted(out.glob("checkpoint-*"))
    assert kept and (kept[-1] / "adapt_state.json").is_file()
    assert foreign_entries(out, "adapt") == []
    assert f"{kept[-1].name}/adapt_state.json" in read_marker(out)["files"] and changed_since_written(out) == []
    assert command_line([*argv, "--overwrite"]) == 0, capsys.readouterr().err
    # The model saved over by the user's own training is theirs: refused, and left as it is.
    tiny_model(vocab_size=len(chat_tokenizer), max_position_embeddings=1024, seed=1).save_pretrained(out)
    weights = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert command_line([*argv, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "--overwrite refused" in err and "written again since diff-llama made the folder" in err, err
    assert "model.safetensors" in changed_since_written(out)
    assert (out / "model.safetensors").read_bytes() == weights


def test_an_interrupted_adapt_leaves_no_folder_when_it_kept_nothing_and_otherwise_says_resume(
        tmp_path, chat_tokenizer, capsys, monkeypatch):
    from diff_llama.cli import main as command_line

    source = tmp_path / "source"
    tiny_model(vocab_size=len(chat_tokenizer), max_position_embeddings=1024).save_pretrained(source)
    chat_tokenizer.save_pretrained(source)
    real, stop_at = RetrievalExamples.__getitem__, []

    def build(self, index):  # Ctrl-C as the example `stop_at` is built
        if stop_at and index == stop_at[0]:
            raise KeyboardInterrupt
        return real(self, index)

    monkeypatch.setattr(RetrievalExamples, "__getitem__", build)
    out = tmp_path / "runs" / "adapted"
    argv = ["adapt", str(source), str(out), "--max-steps", "3", "--eval-every", "0", "--autocast", "none"]
    for key, value in SMALL.items():
        argv += [f"--{key.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]

    def interrupted(argv) -> str:  # exit code 130, and the line after the progress bars
        capsys.readouterr()
        assert command_line(argv) == 130
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        return err.strip().splitlines()[-1]

    with monkeypatch.context() as patch:  # Ctrl-C in the first probe, before the run wrote anything
        patch.setattr("diff_llama.adaptation.trainer.probe", mock.Mock(side_effect=KeyboardInterrupt))
        assert interrupted(argv) == ("diff-llama adapt: interrupted; no checkpoint was written yet (one every "
                                     "--save-steps steps); run the command again to start over")
    assert not (tmp_path / "runs").exists()  # the folders it made, gone: the same command is not refused

    stop_at[:] = [0]  # after the first probe wrote its curves
    assert interrupted(argv) == ("diff-llama adapt: interrupted; no checkpoint was written yet (one every --save-steps "
                                 "steps); add --overwrite to start over")
    stop_at[:] = [2]  # the Trainer fetches an example one step ahead: in step 2, after step 1's checkpoint
    assert interrupted([*argv, "--save-steps", "1", "--overwrite"]) == (
        f"diff-llama adapt: interrupted; {out / 'checkpoint-1'} holds the run up to step 1: run the command again "
        "with --resume to continue")
    stop_at[:] = []
    assert command_line([*argv, "--save-steps", "1", "--resume"]) == 0
    assert len(json.loads((out / "adapt.json").read_text())["steps"]) == 3
    # readable where the config is (safetensors 0.8 writes 0600 whatever the umask)
    assert (out / "checkpoint-3" / "tokenizer.json").is_file()  # a checkpoint loads as a model of its own
    weights = [*out.glob("*.safetensors"), *out.glob("checkpoint-*/*.safetensors")]
    assert len(weights) == 2 and {path.stat().st_mode & 0o777 for path in weights} == {
        (out / "config.json").stat().st_mode & 0o777}


def test_adapt_refuses_a_min_length_its_needles_do_not_fit_before_any_work(tmp_path, chat_tokenizer):
    """Found at the first example drawn that short, steps into training, the error left a folder (probe curves, the
    marker) that refused the corrected command; it names the options, and nothing is written."""
    source = tmp_path / "source"
    tiny_model(vocab_size=len(chat_tokenizer), max_position_embeddings=1024).save_pretrained(source)
    chat_tokenizer.save_pretrained(source)
    settings = {**SMALL, "min_length": 64}
    flags = ["--max-steps", "5", "--eval-every", "0", "--autocast", "none"]
    for key, value in settings.items():
        flags += [f"--{key.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    with pytest.raises(ValueError, match=r"--min-length 64 cannot hold --max-needles 3 needles .* raise --min-length "
                                         r"to at least \d+, or lower --max-needles"):
        main([str(source), str(tmp_path / "adapted"), *flags])
    assert not (tmp_path / "adapted").exists()
    examples = RetrievalExamples(chat_tokenizer, AdaptationOptions(**settings))
    with pytest.raises(ValueError, match="cannot hold"):  # what training met before: such an example cannot be built
        for _ in range(50):
            examples.next()


def test_adapt_command_checks_its_options_before_loading_a_model(tmp_path):
    # The model path does not exist: the option error comes first, and nothing is written.
    for flags, message in ((["--autocast", "fp8"], "unknown dtype 'fp8'"),
                           (["--long-length", "1000"], "--long-length above --max-length"),
                           (["--max-seconds", "0"], "--max-seconds must be above 0, not 0"),
                           (["--max-steps", "0"], "--max-steps must be 1 or more, not 0"),
                           (["--min-length", "5000"], r"--min-length \(5000\) is above --max-length \(4096\)")):
        with pytest.raises(ValueError, match=message):
            main([str(tmp_path / "no-such-model"), str(tmp_path / "out"), *flags])
    assert not (tmp_path / "out").exists()
