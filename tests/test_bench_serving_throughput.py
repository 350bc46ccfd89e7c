"""bench/serving_throughput.py's own logic, without vLLM or a server: prompts of exactly 512 templated tokens with the
real SmolLM2 tokenizer, the figures of a batch, the summary's ratios, the log diff and the markdown."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import serving_throughput as st  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from diff_llama.smollm2 import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_vllm_is_not_imported_by_the_module():
    assert "vllm" not in sys.modules


def test_prompts_are_exactly_512_templated_tokens_and_all_different(tokenizer):
    prompts = st.build_prompts(tokenizer, batches=2, requests=3)
    assert [len(batch) for batch in prompts] == [3, 3]
    texts = [text for batch in prompts for text in batch]
    assert len(set(texts)) == 6
    assert {st.templated_length(tokenizer, text) for text in texts} == {st.PROMPT_TOKENS}
    # the template is what the servers apply: a user turn, then the assistant's opening
    ids = tokenizer.apply_chat_template([{"role": "user", "content": texts[0]}], add_generation_prompt=True,
                                        tokenize=False)
    assert texts[0] in ids and ids.rstrip().endswith("assistant")


def test_fit_prompt_hits_other_lengths_too(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 200, add_special_tokens=False)
    text, end = st.fit_prompt(tokenizer, ids, 5, length=100)
    assert st.templated_length(tokenizer, text) == 100 and 5 < end < len(ids)


def _batch(rate, tokens=2048):
    return {"requests": 16, "wall_s": tokens / rate, "completion_tokens": tokens, "tokens_per_s": rate, "prompt_tokens": [512],
            "finish_reasons": ["length"], "latency_s": {"min": 1.0, "median": 2.0, "max": 3.0}, "load_1min": 1.5}


def test_batch_figures_count_usage_tokens_over_the_wall_time():
    answers = [{"latency_s": 2.0 + i, "completion_tokens": 100 + i, "prompt_tokens": 512, "finish_reason": "stop"}
               for i in range(4)]
    figures = st.batch_figures(answers, wall=8.0)
    assert figures["requests"] == 4 and figures["completion_tokens"] == 406 and figures["tokens_per_s"] == pytest.approx(406 / 8)
    assert figures["latency_s"] == {"min": 2.0, "median": 3.5, "max": 5.0}
    assert figures["prompt_tokens"] == [512] and figures["finish_reasons"] == ["stop"]
    with pytest.raises(RuntimeError):
        st.batch_figures([{**answers[0], "completion_tokens": None}], wall=1.0)


def result():
    runs = [
        {"engine": "vllm transformers", "model": "v2", "start_s": 50, "warmup": _batch(70),
         "rounds": [_batch(80), _batch(90), _batch(85)]},
        {"engine": "vllm transformers", "model": "source", "start_s": 50, "warmup": _batch(90),
         "rounds": [_batch(100), _batch(90), _batch(95)]},
        {"engine": "vllm native", "model": "source", "start_s": 40, "rounds": [_batch(120)]},
    ]
    summary = st.summarize(runs)
    return {"config": {"requests": 16, "prompt_tokens": 512, "new_tokens": 128, "threads": 2, "rounds": 3,
                       "vllm_flags": "--enforce-eager"},
            "summary": summary, "runs": runs,
            "target": {"engine": "vllm transformers", "ratio": 0.95, "ratio_best": summary[0]["ratio_best"],
                       "ratio_median": summary[0]["ratio_median"], "met": False},
            "warnings": {"vllm transformers / v2": ["WARNING x left unfused"]}}


def test_summary_takes_best_and_median_and_the_ratios_of_each_to_the_source_of_the_same_engine():
    rows = {(row["engine"], row["model"]): row for row in result()["summary"]}
    v2 = rows["vllm transformers", "v2"]
    assert (v2["best"], v2["median"], v2["rounds"]) == (90, 85, 3)
    assert v2["ratio_best"] == pytest.approx(0.9) and v2["ratio_median"] == pytest.approx(85 / 95)
    assert rows["vllm native", "source"]["ratio_best"] == 1.0


def test_render_has_the_table_the_verdict_and_every_batch():
    markdown = st.render(result())
    assert "| vllm transformers | v2 | 16 | 3 | 90.0 | 85.0 | 0.900 | 0.895 |" in markdown
    assert "NOT met" in markdown and "left unfused" in markdown
    assert markdown.count("| warm-up | 16 |") == 2 and "| vllm native | source | 1 | 16 | 2048 |" in markdown


def test_log_warnings_keep_what_only_the_v2_server_said():
    source = ("(APIServer pid=1) WARNING 11-27 00:15:51 [cpu.py:224] Triton is not installed.\n"
              "(APIServer pid=1) INFO 11-27 00:15:51 [core.py:1] no error here\n")
    v2 = ("(APIServer pid=7) WARNING 11-27 00:16:02 [cpu.py:224] Triton is not installed.\n"
          "(Worker pid=9) WARNING 11-27 00:16:16 [fuser.py:93] DiffLlamaRMSNorm ... left unfused.\n"
          "(APIServer pid=7) INFO 11-27 00:16:02 [core.py:1] an error-free info line\n")
    assert st.log_warnings(v2, source) == ["(Worker pid=9) WARNING 11-27 00:16:16 [fuser.py:93] DiffLlamaRMSNorm "
                                           "... left unfused."]


@pytest.mark.parametrize("tied", [True, False])
def test_the_floor_probe_is_a_llama_with_the_conversions_function(tmp_path, tied):
    """The floor of the throughput benchmark: a plain LlamaForCausalLM with 2H query heads whose logits are the fresh
    V2 conversion's (λ = 0.5 for every token), checked here independently of build_floor's own check."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from conftest import tiny_model

    v2 = tiny_model(diff_version=2, num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=tied)
    with torch.no_grad():
        for layer in v2.model.layers:
            layer.self_attn.differential_lambda.lambda_proj.weight.zero_()  # as `convert` leaves it
    v2.save_pretrained(tmp_path / "v2")
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
                            ).save_pretrained(tmp_path / "v2")
    st.build_floor(tmp_path / "v2", tmp_path / "floor")
    floor = AutoModelForCausalLM.from_pretrained(tmp_path / "floor")
    assert type(floor) is LlamaForCausalLM and floor.config.num_attention_heads == 6
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(floor(ids).logits, v2(ids).logits, rtol=0, atol=1e-5)
