"""Multi-needle retrieval and attention allocation (`diff-llama evaluate`)."""

import json
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import tiny_model, with_chat_template
from diff_llama.cli import main
from diff_llama.retrieval import (
    CATEGORIES,
    HELD_OUT_CITIES,
    TRAINING_CITIES,
    attention_allocation,
    effective_attention_maps,
    filler_sentences,
    join_lengths,
    make_case,
    markdown_report,
    merge_reports,
    needle_sentence,
    paired_comparison,
    run_case,
    score_output,
    summarize,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def tiny_llama(vocab_size, seed=0, **overrides):
    torch.manual_seed(seed)
    config = LlamaConfig(**{**dict(vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                                   max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                   attn_implementation="sdpa"), **overrides})
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def chat_tokenizer(tokenizer):
    return with_chat_template(tokenizer, CHAT_TEMPLATE)


def _names(case, positions):
    return [CATEGORIES[case.categories[i]] for i in positions]


def test_filler_is_deterministic_and_free_of_digits_and_cities():
    assert filler_sentences(50, seed=3)[:20] == filler_sentences(20, seed=3)
    assert filler_sentences(20, seed=3) != filler_sentences(20, seed=4)
    text = " ".join(filler_sentences(500, seed=0))
    assert not any(ch.isdigit() for ch in text)
    assert not any(city in text for city in HELD_OUT_CITIES + TRAINING_CITIES)
    assert not set(HELD_OUT_CITIES) & set(TRAINING_CITIES)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needles_sit_where_asked_and_tokens_are_classified(tokenizer, chat_tokenizer, chat, depth):
    tok = chat_tokenizer if chat else tokenizer
    case = make_case(tok, 400, depth, num_needles=3, num_queries=2, seed="t", chat_template=True)
    assert 320 <= len(case.input_ids) <= 400  # filled up to the length (to a sentence; ~40 tokens here), never over
    assert len(case.categories) == len(case.input_ids)
    assert case.query_numbers == case.numbers[:2] and all(1_000_000 <= n <= 9_999_999 for n in case.numbers)
    assert len(set(case.cities)) == 3
    # The answer needle's tokens are one contiguous run that decodes to exactly the needle sentence.
    answer = case.answer_positions
    assert answer == list(range(answer[0], answer[-1] + 1))
    assert tok.decode([case.input_ids[i] for i in answer]).strip() == needle_sentence(case.cities[0], case.numbers[0])
    other = [i for i, c in enumerate(case.categories) if CATEGORIES[c] == "other_needles"]
    decoded_other = tok.decode([case.input_ids[i] for i in other])
    for city, number in zip(case.cities[1:], case.numbers[1:]):
        assert needle_sentence(city, number) in decoded_other
    # Order of the classes: prefix, then the context (filler and needles), then the question.
    names = [CATEGORIES[c] for c in case.categories]
    context = [i for i, n in enumerate(names) if n in ("answer", "other_needles", "filler")]
    question = [i for i, n in enumerate(names) if n == "question"]
    assert context == list(range(context[0], context[-1] + 1)) and question[0] == context[-1] + 1
    assert question[-1] == len(names) - 1
    assert all(n == "prefix" for n in names[: context[0]])
    assert ("What are the magic numbers for" in tok.decode([case.input_ids[i] for i in question]))
    if chat:
        assert case.prompt.startswith("<s>user\n") and case.prompt.endswith("<s>assistant\n")
        assert context[0] > 0  # the template's "<s>user\n" is prefix
    # Depth: the share of filler tokens before the answer needle.
    filler = [i for i, n in enumerate(names) if n == "filler"]
    before = sum(i < answer[0] for i in filler) / len(filler)
    if depth == 0.0:
        assert answer[0] == context[0]
    elif depth == 1.0:
        assert names[answer[-1] + 1] in ("question", "other_needles") and before == 1.0
    else:
        assert 0.4 < before < 0.6


def test_cases_are_reproducible_and_vary_with_the_seed(tokenizer):
    a = make_case(tokenizer, 300, 0.25, 4, 2, seed=1)
    assert a == make_case(tokenizer, 300, 0.25, 4, 2, seed=1)
    b = make_case(tokenizer, 300, 0.25, 4, 2, seed=2)
    assert (a.cities, a.numbers) != (b.cities, b.numbers)
    with pytest.raises(ValueError):
        make_case(tokenizer, 300, 0.25, 2, 3)
    with pytest.raises(ValueError, match=r"^20 tokens cannot hold 6 needles and the question, which take \d+;") as no:
        make_case(tokenizer, 20, 0.25, 6, 2)  # the needles alone do not fit
    least = int(re.search(r"which take (\d+);", str(no.value)).group(1))
    assert len(make_case(tokenizer, least, 0.25, 6, 2).input_ids) <= least  # the length it asks for does fit
    with pytest.raises(ValueError, match="^5 tokens cannot hold 1 needle and the question"):
        make_case(tokenizer, 5, 0.25, 1, 1)


def test_a_share_of_the_case_plan_builds_the_very_cases_of_make_cases(tokenizer):
    """Workers that each build a share of the cases from its plan (bench/cuda_retrieval.py) score what `evaluate`
    scores."""
    from diff_llama.options import RetrievalArguments
    from diff_llama.retrieval import case_plan, make_cases

    options = RetrievalArguments(lengths=[300], settings=["1x1", "4x2"], depths=[0.0, 50.0], cases_per_depth=2, seed=5)
    plan = case_plan(options)
    assert len({case["seed"] for case in plan}) == len(plan) == 8
    share = plan[1::3]
    assert [make_case(tokenizer, **case) for case in share] == make_cases(tokenizer, options)[1::3]


def test_score_is_exact_match_of_whole_numbers():
    assert score_output("The magic number for Paris is 1234567.", [1234567]) == [True]
    assert score_output("1234567 and 7654321", [7654321, 1234567]) == [True, True]
    assert score_output("12345678", [1234567]) == [False]  # a longer number is not a match
    assert score_output("123456", [1234567]) == [False]
    assert score_output("1,234,567", [1234567]) == [False]
    assert score_output("", [1234567]) == [False]


def _independent_allocation(model, case, differential):
    """Full prompt, eager attention, every map kept: the last query row, classes summed by hand."""
    model.set_attn_implementation("eager")
    out = model(torch.tensor([case.input_ids]), output_attentions=True)
    model.set_attn_implementation("sdpa")
    sums = {name: 0.0 for name in CATEGORIES}
    count = 0
    for layer, maps in enumerate(out.attentions):
        rows = maps[0, :, -1, :].double()
        if differential:
            lam = float(model.model.layers[layer].self_attn.differential_lambda().detach())
            half = rows.shape[0] // 2
            rows = rows[:half] - lam * rows[half:]
        for row in rows:
            count += 1
            for key, value in enumerate(row.tolist()):
                sums[CATEGORIES[case.categories[key]]] += value
    return {name: value / count for name, value in sums.items()}


@pytest.mark.oldest_transformers  # the cache's name differs: adapt's probe once failed below 5.24
@pytest.mark.parametrize("kind", ["diff_llama", "llama"])
def test_allocation_matches_an_independent_computation(tokenizer, kind):
    case = make_case(tokenizer, 300, 0.5, 3, 2, seed="alloc")
    if kind == "diff_llama":
        model = tiny_model(vocab_size=len(tokenizer), max_position_embeddings=512)
        model.set_attn_implementation("sdpa")
        lambdas = model.get_lambdas().double()
        assert lambdas.abs().min() > 0.05  # the check below would not see a missing λ otherwise
        expected_total = (1 - lambdas).mean().item()
    else:
        model = tiny_llama(len(tokenizer))
        expected_total = 1.0
    result = run_case(model, tokenizer, case, max_new_tokens=3)
    shares = result["allocation"]
    reference = _independent_allocation(model, case, kind == "diff_llama")
    for name in CATEGORIES:
        assert shares[name] == pytest.approx(reference[name], abs=1e-5), name
    assert shares["noise"] == pytest.approx(shares["other_needles"] + shares["filler"] + shares["prefix"])
    assert shares["answer"] + shares["noise"] + shares["question"] == pytest.approx(shares["total"], abs=1e-9)
    assert shares["total"] == pytest.approx(expected_total, abs=1e-5)
    assert shares["answer"] != 0 and shares["other_needles"] != 0
    assert model.config._attn_implementation == "sdpa"  # restored after the eager step


@pytest.mark.oldest_transformers
def test_run_case_generates_what_generate_does(tokenizer):
    model = tiny_llama(len(tokenizer), seed=1)
    case = make_case(tokenizer, 150, 0.0, 1, 1, seed="gen")
    result = run_case(model, tokenizer, case, max_new_tokens=6)
    expected = model.generate(torch.tensor([case.input_ids]), max_new_tokens=6, do_sample=False,
                              attention_mask=torch.ones(1, len(case.input_ids), dtype=torch.long))
    new = expected[0, len(case.input_ids):].tolist()
    new = new[: new.index(2)] if 2 in new else new
    assert result["output"] == tokenizer.decode(new, skip_special_tokens=True)
    assert result["correct"] == all(result["found"])


@pytest.mark.parametrize("kind", ["llama", "diff_llama"])
def test_lookahead_decoding_gives_the_same_answers_and_stops(tokenizer, kind):
    """Queuing each step before the previous token is read back (as on a GPU) changes no answer, whichever way the
    answer stops: at the token limit, at an end-of-sequence token, or once `answered` says so."""
    from diff_llama.retrieval.scoring import greedy_answer

    model = tiny_llama(len(tokenizer), seed=3) if kind == "llama" else tiny_model(vocab_size=len(tokenizer))
    case = make_case(tokenizer, 200, 0.5, 2, 1, seed="look")
    plain = greedy_answer(model, tokenizer, case.input_ids, 8, lookahead=False)[0]
    assert len(tokenizer(plain, add_special_tokens=False).input_ids) >= 4  # stopped by the limit, not at once
    stops = {"limit": (8, None), "answered": (8, lambda text: len(text) >= len(plain) // 2), "one token": (1, None)}
    for name, (limit, answered) in stops.items():
        expected = greedy_answer(model, tokenizer, case.input_ids, limit, answered, lookahead=False)[0]
        assert greedy_answer(model, tokenizer, case.input_ids, limit, answered, lookahead=True)[0] == expected, name
    tokens = model.generate(torch.tensor([case.input_ids]), max_new_tokens=8, do_sample=False,
                            attention_mask=torch.ones(1, len(case.input_ids), dtype=torch.long))[0, -8:].tolist()
    model.generation_config.eos_token_id = next(t for i, t in enumerate(tokens) if i and t not in tokens[:i])
    expected = greedy_answer(model, tokenizer, case.input_ids, 8, lookahead=False)[0]  # ends before that token
    assert greedy_answer(model, tokenizer, case.input_ids, 8, lookahead=True)[0] == expected != plain


@pytest.mark.oldest_transformers
@pytest.mark.parametrize("kind", ["llama", "diff_llama", "diff_v2"])
def test_a_batch_answers_and_allocates_each_case_as_alone(tokenizer, kind):
    """Cases of different lengths in one left-padded batch: each row's answer, where it stops (the token limit, an
    end-of-sequence token, `answered`), and its attention allocation are the case's alone, with and without
    lookahead."""
    from diff_llama.retrieval.scoring import greedy_answer, greedy_answers, run_cases

    varied = 0.2  # the initialisation's scale: at the default, a tiny model repeats one token whatever the prompt
    if kind == "llama":
        model = tiny_llama(len(tokenizer), seed=3, initializer_range=varied)
    else:
        model = tiny_model(vocab_size=len(tokenizer), max_position_embeddings=512, initializer_range=varied,
                           diff_version=2 if kind == "diff_v2" else 1)
        if kind == "diff_v2":  # λ varies by token and head
            for layer in model.model.layers:
                torch.nn.init.normal_(layer.self_attn.differential_lambda.lambda_proj.weight, std=1.0)
    cases = [make_case(tokenizer, length, depth, 2, 1, seed=f"batch-{length}")
             for length, depth in [(300, 0.5), (160, 0.0), (220, 1.0), (260, 0.25)]]
    assert len({len(case.input_ids) for case in cases}) == 4  # every row but the longest is padded
    alone = [run_case(model, tokenizer, case, max_new_tokens=6) for case in cases]
    for lookahead in (False, True):
        together = run_cases(model, tokenizer, cases, max_new_tokens=6, lookahead=lookahead)
        for first, second in zip(alone, together):
            assert second["output"] == first["output"]
            for name, share in first["allocation"].items():
                assert second["allocation"][name] == pytest.approx(share, abs=1e-6), name
    # Rows that stop at different steps: `answered` after 2 and after 5 tokens (rows 0 and 1), an end-of-sequence
    # token that row 2 states first, the limit (row 3).
    prompts = [case.input_ids for case in cases]
    plain = [model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
             for ids in prompts]
    model.generation_config.eos_token_id = next(token for token in plain[2][1:]
                                                if token not in plain[0][:2] + plain[1][:5] + plain[3])

    class Stop:  # `answered` that stops after `after` tokens, and counts the tokens it saw
        def __init__(self, after=None):
            self.after, self.seen = after, 0

        def __call__(self, text):
            self.seen += 1
            return self.seen == self.after

    def answers(together, lookahead):
        stops = [Stop(2), Stop(5), Stop(), Stop()]
        if together:
            texts = [text for text, _ in greedy_answers(model, tokenizer, prompts, 8, stops, lookahead=lookahead)]
        else:
            texts = [greedy_answer(model, tokenizer, ids, 8, stop)[0] for ids, stop in zip(prompts, stops)]
        return texts, [stop.seen for stop in stops]

    expected, seen = answers(False, False)
    assert seen[:2] == [2, 5] and 1 <= seen[2] < 8 and seen[3] == 8, seen
    for lookahead in (False, True):
        assert answers(True, lookahead) == (expected, seen)


def test_ruler_cases_in_a_batch_are_scored_as_alone(chat_tokenizer):
    """RULER's cases of different lengths in one batch: the same answers, scores and prompt lengths as alone."""
    from diff_llama.retrieval.ruler import run_ruler_case, run_ruler_cases
    from diff_llama.retrieval.ruler_cases import read_case_file

    cases = [case for case in read_case_file("bench/cases/ruler-smollm2-2k-4k.json.gz")["cases"]
             if case["length"] == 2048][:3]
    model = tiny_llama(len(chat_tokenizer), seed=5, initializer_range=0.2)  # varied answers (see above)
    model.config.max_position_embeddings = 4096
    alone = [run_ruler_case(model, chat_tokenizer, case, max_new_tokens=5) for case in cases]
    together = run_ruler_cases(model, chat_tokenizer, cases, max_new_tokens=5)
    def untimed(result):
        return {key: value for key, value in result.items() if key != "seconds"}

    assert list(map(untimed, together)) == list(map(untimed, alone))
    assert len({result["prompt_tokens"] for result in alone}) > 1  # padded


def test_effective_maps_dispatch(tokenizer):
    model = tiny_model(vocab_size=len(tokenizer))
    model.set_attn_implementation("eager")
    out = model(torch.tensor([[5, 6, 7, 8]]), output_attentions=True)
    maps = effective_attention_maps(model, out)
    assert len(maps) == 3 and maps[0].shape == (1, 3, 4, 4)  # differential heads: H/2
    lam = model.get_lambdas()
    assert torch.allclose(maps[1], out.attentions[1][:, :3] - lam[1] * out.attentions[1][:, 3:])
    # A model that knows its own maps is asked for them.
    marker = tuple(torch.full((1, 2, 4, 4), float(i)) for i in range(3))
    from types import SimpleNamespace

    for name in ("differential_maps", "differential_attention_maps_from_outputs"):
        own = SimpleNamespace(config=SimpleNamespace(model_type="other"), **{name: lambda outputs: marker})
        assert all(torch.equal(a, b) for a, b in zip(effective_attention_maps(own, out), marker))
    # A LLaMA: its softmax maps, rows summing to 1.
    llama = tiny_llama(len(tokenizer))
    llama.set_attn_implementation("eager")
    out = llama(torch.tensor([[5, 6, 7, 8]]), output_attentions=True)
    maps = effective_attention_maps(llama, out)
    assert maps[0].shape == (1, 6, 4, 4) and torch.allclose(maps[2].sum(-1), torch.ones(1, 6, 4))


def test_allocation_of_a_diff_v2_model_uses_per_token_lambda(tokenizer):
    """DIFF V2 (per-token λ): run_case's allocation equals A_2i − λ_t,i A_2i+1 computed here from a full forward."""
    case = make_case(tokenizer, 300, 0.25, 2, 1, seed="v2")
    model = tiny_model(vocab_size=len(tokenizer), max_position_embeddings=512, diff_version=2)
    for layer in model.model.layers:  # λ varies by token and head (the conversion's start is a constant 0.5)
        torch.nn.init.normal_(layer.self_attn.differential_lambda.lambda_proj.weight, std=1.0)
    model.set_attn_implementation("sdpa")
    shares = run_case(model, tokenizer, case, max_new_tokens=2)["allocation"]
    model.set_attn_implementation("eager")
    out = model(torch.tensor([case.input_ids]), output_attentions=True, output_hidden_states=True)
    rows, totals, lambdas = [], [], []
    for layer, maps in enumerate(out.attentions):
        x = model.model.layers[layer].input_layernorm(out.hidden_states[layer])[0, -1].double()
        lam = torch.sigmoid(model.model.layers[layer].self_attn.differential_lambda.lambda_proj.weight.double() @ x)  # (h,)
        last = maps[0, :, -1, :].double()
        rows.append(last[0::2] - lam[:, None] * last[1::2])
        totals.append((1 - lam).mean())
        lambdas.append(lam)
    rows = torch.cat(rows)
    classes = torch.tensor(case.categories)
    assert shares["answer"] == pytest.approx(rows[:, classes == 0].sum(-1).mean().item(), abs=1e-5)
    assert shares["question"] == pytest.approx(rows[:, classes == 4].sum(-1).mean().item(), abs=1e-5)
    assert shares["total"] == pytest.approx(torch.stack(totals).mean().item(), abs=1e-5)
    assert torch.cat(lambdas).std() > 0.1  # a λ mixed up between heads, layers or tokens would show


def test_allocation_rejects_mismatched_classes():
    with pytest.raises(ValueError):
        attention_allocation([torch.ones(1, 2, 1, 5) / 5], [0, 1, 2])


def test_evaluate_command_writes_json_table_and_plot(tmp_path, tokenizer, capsys):
    diff = tiny_model(vocab_size=len(tokenizer), max_position_embeddings=512)
    diff.save_pretrained(tmp_path / "diff")
    tokenizer.save_pretrained(tmp_path / "diff")
    llama = tiny_llama(len(tokenizer))
    llama.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    out = tmp_path / "eval"
    code = main(["evaluate", str(tmp_path / "llama"), str(tmp_path / "diff"), "--output", str(out),
                 "--lengths", "250", "350", "--settings", "1x1", "3x2", "--depths", "0", "100",
                 "--cases_per_depth", "1", "--max_new_tokens", "4", "--perplexity_tokens", "64", "--threads", "0"])
    assert code == 0
    report = json.loads((out / "retrieval.json").read_text())
    assert [m["name"] for m in report["models"]] == ["llama", "diff"]
    assert [m["maps"] for m in report["models"]] == ["softmax", "differential (V1)"]
    for m in report["models"]:
        assert len(m["cases"]) == 2 * 2 * 2 and m["perplexity"] > 1
        assert set(m["summary"]["accuracy_by_cell"]) == {"250/1x1", "250/3x2", "350/1x1", "350/3x2"}
        assert set(m["summary"]["allocation_by_depth"]) == {"0", "100"}
    # The same cases for every model (same tokenizer).
    assert [c["expected"] for c in report["models"][0]["cases"]] == [c["expected"] for c in report["models"][1]["cases"]]
    table = (out / "retrieval.md").read_text()
    assert "| llama | softmax |" in table and "N=3, R=2" in table and "0% answer ↑" in table
    assert "McNemar" in table and "| llama | diff | 250 | " in table and "| llama | diff | all | " in table
    assert (out / "retrieval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    captured = capsys.readouterr()
    assert "Wrote" in captured.out and "Warning" not in captured.err  # 350 tokens: inside both models' 512
    lines = (out / "cases.jsonl").read_text().splitlines()
    assert len(lines) == 16 and json.loads(lines[-1])["model"] == "diff"
    # In batches of 3 (left-padded: the prompts' lengths differ): each case's answer and allocation as alone.
    assert main(["evaluate", str(tmp_path / "llama"), str(tmp_path / "diff"), "--output", str(tmp_path / "batched"),
                 "--lengths", "250", "350", "--settings", "1x1", "3x2", "--depths", "0", "100", "--cases_per_depth",
                 "1", "--max_new_tokens", "4", "--perplexity_tokens", "0", "--threads", "0", "--batch-size", "3"]) == 0
    batched = json.loads((tmp_path / "batched" / "retrieval.json").read_text())
    for alone, together in zip(report["models"], batched["models"]):
        assert [c["output"] for c in together["cases"]] == [c["output"] for c in alone["cases"]]
        for first, second in zip(alone["cases"], together["cases"]):
            assert second["allocation"] == pytest.approx(first["allocation"], abs=1e-6)
    assert len((tmp_path / "batched" / "cases.jsonl").read_text().splitlines()) == 16
    a = report["models"][0]["summary"]["allocation"]
    assert a["noise_share"] == pytest.approx(a["noise"] / a["total"])
    assert a["noise_share"] == pytest.approx(a["prefix_share"] + a["filler_share"] + a["other_needles_share"])
    parts = next(line for line in table.split("Noise by part")[1].splitlines() if line.startswith("| llama |"))
    assert [float(x) for x in parts.strip("| ").split(" | ")[1:]] == pytest.approx(
        [a["prefix_share"], a["filler_share"], a["other_needles_share"], a["noise_share"]], abs=6e-4)
    # Reports of separate runs merge when they were run on the same cases, and only then.
    merged = merge_reports([report, report])
    assert len(merged["models"]) == 4
    other = json.loads(json.dumps(report))
    other["options"]["seed"] = 1
    with pytest.raises(ValueError, match="seed"):
        merge_reports([report, other])
    # Runs at separate lengths join into the run at both: the same cases, summaries and paired tests.
    at = {n: dict(report, options=dict(report["options"], lengths=[n]),
                  models=[dict(m, cases=[c for c in m["cases"] if c["length"] == n]) for m in report["models"]])
          for n in (250, 350)}
    joined = join_lengths([at[250], at[350]])
    assert joined["options"]["lengths"] == [250, 350]
    for m, original in zip(joined["models"], report["models"]):
        assert m["cases"] == original["cases"] and m["summary"] == summarize(original["cases"])
    assert "| llama | diff | all | " in markdown_report(joined)
    with pytest.raises(ValueError, match="more than one report"):
        join_lengths([at[250], at[250]])
    with pytest.raises(ValueError, match="seed"):
        join_lengths([at[250], dict(at[350], options=dict(at[350]["options"], seed=1))])
    with pytest.raises(ValueError, match="different models"):
        join_lengths([at[250], dict(at[350], models=at[350]["models"][::-1])])
    # Options are validated.
    assert main(["evaluate", str(tmp_path / "llama"), "--output", str(out), "--settings", "2"]) == 2


def test_a_length_past_the_models_context_is_warned_of_not_refused(capsys):
    from diff_llama.retrieval.evaluate import warn_past_context

    model = tiny_llama(128)  # max_position_embeddings 512
    warn_past_context(model, [256, 512], "small")
    assert capsys.readouterr().err == ""
    warn_past_context(model, [256, 1024, 4096], "small")
    err = capsys.readouterr().err
    assert "small has a context of 512 tokens" in err and "--lengths 1024 4096 run past it" in err
    assert "256" not in err


def test_the_plot_of_a_run_without_attention_says_so_and_warns_of_nothing(tmp_path):
    import warnings

    from diff_llama.retrieval.report import plot_report

    summary = {"accuracy_by_depth": {"0": 1.0, "100": 0.5}, "accuracy_by_length": {"250": 0.75}, "allocation": None}
    report = {"options": {"depths": [0.0, 100.0], "lengths": [250]}, "models": [{"name": "a", "summary": summary}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = plot_report(report, tmp_path / "retrieval.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluate_help_lists_the_options(capsys):
    from diff_llama_cli import main as entry_point

    assert main(["evaluate", "--help"]) == 0  # the command line turns argparse's exit into a return code
    text = capsys.readouterr().out
    assert "--cases_per_depth" in text and "--lengths" in text and "MODEL" in text
    assert entry_point(["--help"]) == 0
    assert "evaluate" in capsys.readouterr().out


@pytest.mark.slow
def test_smollm2_retrieves_one_needle():
    from diff_llama.resolve import load_model

    from diff_llama.retrieval import run_cases

    model, tokenizer = load_model("smollm2")
    cases = [make_case(tokenizer, 1024, depth, 1, 1, seed=f"slow-{depth}") for depth in (0.0, 0.5, 1.0)]
    results = [run_case(model, tokenizer, case) for case in cases]
    assert sum(r["correct"] for r in results) >= 2, [r["output"] for r in results]
    for r in results:
        assert r["allocation"]["total"] == pytest.approx(1.0, abs=1e-4)
        assert 0 < r["allocation"]["answer"] < 1
    # The real model in one padded batch: each case's answer and allocation as alone.
    assert len({len(case.input_ids) for case in cases}) > 1
    for alone, together in zip(results, run_cases(model, tokenizer, cases)):
        assert together["output"] == alone["output"]
        assert together["allocation"] == pytest.approx(alone["allocation"], abs=1e-6)


def _exact_two_sided(k: int, n: int) -> float:
    """The exact binomial test's definition: the total probability (p = 1/2) of every outcome no likelier than k."""
    from fractions import Fraction
    from math import comb

    observed = Fraction(comb(n, k), 2 ** n)
    return float(sum(Fraction(comb(n, i), 2 ** n) for i in range(n + 1) if Fraction(comb(n, i), 2 ** n) <= observed))


@pytest.mark.parametrize("outcomes", [
    "1100" * 5 + "10" * 7 + "01" * 2,  # 7 against 2 disagreements
    "10" * 12 + "01",                  # 12 against 1
    "11" * 9 + "00" * 3,               # no disagreement: p = 1
    "01" * 4 + "10" * 4,               # a tie
])
def test_paired_comparison_is_mcnemars_exact_test(outcomes):
    first = [{"seed": str(i), "correct": outcomes[2 * i] == "1"} for i in range(len(outcomes) // 2)]
    second = [{"seed": str(i), "correct": outcomes[2 * i + 1] == "1"} for i in range(len(outcomes) // 2)]
    c = paired_comparison(first, second)
    pairs = [outcomes[i:i + 2] for i in range(0, len(outcomes), 2)]
    counts = tuple(pairs.count(p) for p in ("11", "10", "01", "00"))
    assert (c["both"], c["only_first"], c["only_second"], c["neither"]) == counts
    assert c["cases"] == len(pairs)
    assert c["p_value"] == pytest.approx(_exact_two_sided(c["only_second"], c["only_first"] + c["only_second"]))
    assert paired_comparison(second, first)["p_value"] == pytest.approx(c["p_value"])
    with pytest.raises(ValueError, match="same cases"):
        paired_comparison(first, second[::-1])


def test_evaluate_with_a_missing_model_writes_nothing(tmp_path, tokenizer, capsys):
    llama = tiny_llama(len(tokenizer))
    llama.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    out = tmp_path / "eval"
    assert main(["evaluate", str(tmp_path / "llama"), str(tmp_path / "nowhere"), "--output", str(out),
                 "--lengths", "250", "--settings", "1x1", "--depths", "0", "--cases_per_depth", "1",
                 "--perplexity_tokens", "0"]) == 2
    assert "nowhere: no such folder" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("command", ["evaluate", "adapt"])
def test_lengths_past_a_models_learned_positions_are_refused_in_one_line(tmp_path, tokenizer, capsys, command):
    """GPT-2 learns 128 positions here: evaluate warned that 256 measures extrapolation, then failed with an index error
    in the model's forward (adapt too, at its first step); each now says what runs past, before any work."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=1, n_head=2)
                    ).save_pretrained(model)
    tokenizer.save_pretrained(model)
    out = tmp_path / "out"
    argv = (["evaluate", str(model), "--output", str(out), "--lengths", "256", "--settings", "1x1", "--depths", "50",
             "--cases-per-depth", "1", "--perplexity-tokens", "0"] if command == "evaluate"
            else ["adapt", str(model), str(out), "--max-steps", "1", "--max-length", "512", "--min-length", "100",
                  "--eval-lengths", "100"])
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    option, length = ("--lengths", "256") if command == "evaluate" else ("--max-length", "512")
    assert "learns its positions, up to 128 tokens" in err and f"{option} {length} run past that" in err, err
    assert not out.exists()
