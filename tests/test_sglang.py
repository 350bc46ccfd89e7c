"""DIFF V2 served by SGLang through its Transformers backend (`--model-impl transformers`), against transformers' own
greedy `generate`.

Run by `bash scripts/run_sglang_tests.sh` in .venv-sglang (SGLang's PyPI wheel, on its CUDA build of torch, run on the
CPU); skipped where SGLang is not installed. SGLang has no plugin hook: it runs the folder's own code as remote code,
so these tests are what a user without this package gets. The real SmolLM2's DIFF V2 conversion is served once, by
`diff-llama serve --engine sglang`, and a copy of it with a random λ projection (λ different for every token and head)
once more, by SGLang's own command.
"""

import importlib.util
import json
import sys
import urllib.request

import pytest
import torch

from engine_serving import DIFF_LLAMA, NEW_TOKENS, ServerProcess, free_port, prompt_ids
from engine_serving import converted  # noqa: F401 (a fixture: pytest finds it by its name here)

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs SGLang: bash scripts/run_sglang_tests.sh builds .venv-sglang with it", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

# On a CPU SGLang picks its attention written in torch by itself; its KV cache is sized here for a test rather than
# for the machine's memory.
CACHE_SIZE = ["--max-total-tokens", "8192"]


def _post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.loads(reply.read())


class Server(ServerProcess):
    """SGLang's server on a folder until `stop`: started by `diff-llama serve --engine sglang` (`plain=False`), or by
    `python -m sglang.launch_server` as SGLang's documentation runs it."""

    def __init__(self, folder, log, plain=False):
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        address = ["--host", "127.0.0.1", "--port", str(port)]
        if plain:
            command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(folder), "--model-impl",
                       "transformers", "--trust-remote-code", "--dtype", "float32", "--device", "cpu", *address,
                       *CACHE_SIZE]
        else:  # SGLang's own options go after `--`
            command = [DIFF_LLAMA, "serve", str(folder), "--engine", "sglang", "--trust-remote-code", "--device", "cpu",
                       *address, "--", *CACHE_SIZE]
        super().__init__(command, log, f"{self.base}/health", env={"HF_HUB_OFFLINE": "1"})

    def generate(self, ids, max_new_tokens=NEW_TOKENS):
        """SGLang's greedy tokens for a prompt's ids, and the log-probability it gave each."""
        reply = _post(f"{self.base}/generate", {
            "input_ids": ids, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        })
        logprobs = [logprob for logprob, _token, _text in reply["meta_info"]["output_token_logprobs"]]
        return reply["output_ids"], logprobs


@pytest.fixture(scope="module")
def random_lambda(converted, tmp_path_factory):
    """The conversion with a random λ projection: λ = sigmoid(x·w) far from 0.5 and different per token and head,
    so that λ loaded into the wrong place, or not at all, shows in the tokens. Saved as `save_pretrained` writes it
    (λ's projection under its checkpoint name, `self_attn.lambda_proj`)."""
    from conftest import randomise_lambda_proj
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("sglang") / "smollm2-diff-random-lambda"
    model = AutoModelForCausalLM.from_pretrained(converted)
    randomise_lambda_proj(model)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(converted).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(converted, tmp_path_factory):
    server = Server(converted, tmp_path_factory.mktemp("sglang") / "server.log")
    yield server
    server.stop()


def _generate(folder, prompts, max_new_tokens=NEW_TOKENS):
    """transformers' greedy tokens and their log-probabilities, one prompt at a time, with this package's classes;
    an end-of-sequence token is kept, as SGLang keeps it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    results = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(ids):].tolist()
        logprobs = [torch.log_softmax(logits[0].double(), -1)[token].item()
                    for logits, token in zip(out.logits, tokens)]
        results.append((tokens, logprobs))
    return results


def _assert_served_as_generate(server, folder):
    prompts = prompt_ids(folder)
    for ids, (tokens, logprobs) in zip(prompts, _generate(folder, prompts)):
        served_tokens, served_logprobs = server.generate(ids)
        assert served_tokens == tokens
        torch.testing.assert_close(torch.tensor(served_logprobs, dtype=torch.float64),
                                   torch.tensor(logprobs, dtype=torch.float64), rtol=0, atol=2e-3)


def test_served_conversion_gives_generates_greedy_tokens(server, converted):
    _assert_served_as_generate(server, converted)


def test_served_conversion_answers_the_openai_chat_client(server, converted):
    from openai import OpenAI
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tokenizer = AutoTokenizer.from_pretrained(converted)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    ((expected, _),) = _generate(converted, [ids], max_new_tokens=24)

    client = OpenAI(base_url=f"{server.base}/v1", api_key="none")
    answer = client.chat.completions.create(model="default", messages=messages, max_tokens=24, temperature=0)
    assert answer.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert "Paris" in answer.choices[0].message.content


def test_a_lambda_that_varies_by_token_is_served_as_generate_computes_it(random_lambda, tmp_path):
    """Needs the attention's `load_weights`: SGLang's loader knows λ's projection only by its checkpoint name."""
    server = Server(random_lambda, tmp_path / "server.log", plain=True)
    try:
        _assert_served_as_generate(server, random_lambda)
    finally:
        server.stop()
