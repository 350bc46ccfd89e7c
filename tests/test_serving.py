"""`diff-llama serve`: transformers' OpenAI-compatible server answers chat completions, plain and streamed, with what
`generate` gives (greedy), for the package's classes and for the folder's remote code."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import skip_unless_serving, tiny_model, with_chat_template
from engine_serving import SRC, DiffLlamaServer, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from serve_load import own_rss_mb, process_tree  # noqa: E402

openai = skip_unless_serving()

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
MAX_TOKENS = 12


@pytest.fixture
def chat_tokenizer(tokenizer):
    return with_chat_template(tokenizer, CHAT_TEMPLATE)


@pytest.fixture
def model_dir(tmp_path, chat_tokenizer):
    """A tiny converted-like model (odd G, per-layer head_norm_eps: what transformers' built-in class cannot load)
    whose greedy tokens all decode to printable ASCII, so that streamed pieces and the whole answer compare exactly."""
    model = tiny_model(vocab_size=len(chat_tokenizer), num_attention_heads=6, num_key_value_heads=3,
                       head_norm_eps=[0.5, 0.7, 0.9])
    with torch.no_grad():
        for token_id in range(len(chat_tokenizer)):
            text = chat_tokenizer.decode([token_id])
            if token_id == chat_tokenizer.eos_token_id or not (text.isascii() and text.isprintable()):
                model.lm_head.weight[token_id] = 0
        model.lm_head.weight *= 10  # the kept tokens' logits are far from 0 and from each other
    model.generation_config.max_new_tokens = MAX_TOKENS
    folder = tmp_path / "served"
    model.save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    return folder


def _expected_answer(folder, tokenizer, messages=MESSAGES):
    from diff_llama import DiffLlamaForCausalLM

    model = DiffLlamaForCausalLM.from_pretrained(folder).eval()
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(answer) >= MAX_TOKENS  # a real answer, not an empty one
    return answer


def _ask(port, folder):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    request = dict(model=str(folder), messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS)
    whole = client.chat.completions.create(**request).choices[0].message.content
    pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(**request, stream=True)
              if chunk.choices]
    return whole, pieces


def _ask_naming(port, model=None):
    """The answer to one request that names `model` (None: names no model), or the server's error."""
    import json
    import urllib.error
    import urllib.request

    body = dict(messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS, **({"model": model} if model else {}))
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}: {error.read().decode()}"


def test_serve_command_answers_like_generate(model_dir, chat_tokenizer, tmp_path):
    import json
    import urllib.request

    expected = _expected_answer(model_dir, chat_tokenizer)
    # A machine that never downloaded anything has no Hub cache folder: /v1/models must still answer.
    server = DiffLlamaServer(tmp_path, model_dir, HF_HUB_CACHE=str(tmp_path / "no-hub-cache"))
    try:
        with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as response:
            listed = [entry["id"] for entry in json.loads(response.read())["data"]]
        whole, pieces = _ask(server.port, model_dir)
    finally:
        server.stop()
    assert listed == [str(model_dir)]
    assert whole == expected
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == expected  # streamed in several pieces


def test_serve_with_continuous_batching_answers_each_request_like_generate(model_dir, chat_tokenizer, tmp_path):
    """`--continuous-batching`: requests sent together share forward passes (transformers' paged attention), and each
    gets its own greedy answer. The cache is sized with `--cb-num-blocks`; unsized, it would take most of the free
    RAM."""
    import concurrent.futures

    conversations = [[{"role": "user", "content": text}] for text in ("The quick brown fox", "Differential attention",
                                                                      "A LLaMA")]
    expected = [_expected_answer(model_dir, chat_tokenizer, messages) for messages in conversations]
    assert len(set(expected)) == 3
    server = DiffLlamaServer(tmp_path, model_dir, "--continuous-batching", "--cb-num-blocks", "4")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def answer(messages):
        return client.chat.completions.create(model=str(model_dir), messages=messages, temperature=0,
                                              max_tokens=MAX_TOKENS).choices[0].message.content

    try:
        with concurrent.futures.ThreadPoolExecutor(len(conversations)) as pool:
            answers = list(pool.map(answer, conversations))
        # transformers serve's model process, and what it started
        model_processes = process_tree(server.process.pid)[1:]
        resident = sum(own_rss_mb(pid) or 0 for pid in model_processes) * 1024**2
    finally:
        server.stop()
    assert answers == expected
    # the cache took what --cb-num-blocks asked for, not the machine's RAM
    assert model_processes and 0 < resident < 2 * 1024**3, resident


def test_serve_a_lora_adapter_answers_like_its_merged_model(model_dir, chat_tokenizer, tmp_path, capsys):
    """`diff-llama train --lora` writes an adapter folder: the server loads its base with the adapter merged in, and
    answers as that merged model does. vLLM, which would be handed the folder itself, asks for a merged model."""
    from peft import PeftModel, get_peft_model

    from diff_llama import DiffLlamaForCausalLM
    from diff_llama.cli import main
    from diff_llama.training import lora_config

    base = DiffLlamaForCausalLM.from_pretrained(model_dir)
    base.name_or_path = str(model_dir)  # what `train --lora` records as the base
    adapted = get_peft_model(base, lora_config(rank=4))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    adapter = tmp_path / "adapter"
    adapted.save_pretrained(adapter)
    chat_tokenizer.save_pretrained(adapter)
    merged = tmp_path / "merged"
    PeftModel.from_pretrained(DiffLlamaForCausalLM.from_pretrained(model_dir), adapter).merge_and_unload(
    ).save_pretrained(merged)
    expected = _expected_answer(merged, chat_tokenizer)
    assert expected != _expected_answer(model_dir, chat_tokenizer)  # the adapter changes the answer

    server = DiffLlamaServer(tmp_path, adapter)
    try:
        whole, pieces = _ask(server.port, adapter)
    finally:
        server.stop()
    assert whole == expected and "".join(pieces) == expected
    capsys.readouterr()
    assert main(["serve", str(adapter), "--engine", "vllm", "--port", str(free_port())]) == 2
    assert "is a LoRA adapter folder (adapter_config.json), not a whole model: merge it" in capsys.readouterr().err


def test_serve_as_remote_code_answers_like_generate(model_dir, chat_tokenizer, tmp_path):
    """`--trust-remote-code`: the model's process builds the model from the code saved in its folder, even where this
    package is installed. `diff-llama serve ./served` pins the server to "served"; requests may still say "./served",
    as typed (an alias)."""
    expected = _expected_answer(model_dir, chat_tokenizer)
    mark = tmp_path / "remote-code-ran"
    with open(model_dir / "modeling_diff_llama.py", "a") as code:  # the folder's code says where it ran
        code.write('\nimport os as _os\nopen(_os.environ["REMOTE_CODE_MARK"], "w").write(__name__)\n')
    server = DiffLlamaServer(tmp_path, f"./{model_dir.name}", "--trust-remote-code", cwd=model_dir.parent,
                             REMOTE_CODE_MARK=str(mark))
    try:
        whole, pieces = _ask(server.port, model_dir.name)
        by_alias, unnamed, other = (_ask_naming(server.port, name)
                                    for name in (f"./{model_dir.name}", None, "another-model"))
    finally:
        server.stop()
    assert mark.read_text().startswith("transformers_modules.")  # the folder's code, as a dynamic module
    assert whole == expected and "".join(pieces) == expected
    assert by_alias == expected and unnamed == expected
    assert other.startswith("HTTP 404") and "model_not_found" in other  # any other name is still refused


def test_transformers_serve_loader_alone_would_build_the_builtin_class(model_dir):
    # Why `diff-llama serve` exists: transformers serve's loader takes the class from transformers' namespace by the
    # name in config.json, which is the built-in DiffLlama (it refuses this odd-G model). If this starts passing
    # through the Auto classes, `transformers serve --trust-remote-code` is enough and the README should say so.
    from transformers.cli.serving.model_manager import ModelLoader

    with pytest.raises(ValueError, match="`num_key_value_heads` to be even"):
        ModelLoader(device="cpu", trust_remote_code=True)._load_model(str(model_dir))


@pytest.mark.parametrize("model", ["{tmp}/outputs/SmolLM2-diff-typo", "{tmp}/nowhere/model.gguf", "{tmp}/not-a-model"])
def test_serve_fails_fast_in_one_line_on_a_model_that_is_not_there(tmp_path, model):
    """`serve` resolves its model like every other command before transformers' server starts: a mistyped folder
    is never tried on the Hub (minutes of retries)."""
    (tmp_path / "outputs").mkdir()
    (tmp_path / "not-a-model").mkdir()
    env = dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="0")  # online: a Hub lookup would hang, not fail
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "diff_llama.cli", "serve", model.format(tmp=tmp_path),
                             "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    err = result.stderr.strip()
    assert err.startswith("diff-llama serve: error:") and "\n" not in err, err
    assert "no such" in err or "no config.json" in err
    assert time.monotonic() - started < 60  # the import of torch and transformers, no Hub retries


def test_serve_preloads_a_gguf_file_under_transformers_serves_name(tmp_path, monkeypatch, model_dir):
    import huggingface_hub.constants
    from fake_hub import cache_repo

    from diff_llama import serving

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr("diff_llama.resolve.require_gguf", lambda: None)
    assert serving.server_model_name(str(tmp_path / "m.gguf")) == f"{tmp_path}:m.gguf"
    cache_repo(tmp_path / "hub-cache", "someone/model", model_dir)  # offline (the suite's setting), from the cache
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    assert serving.server_model_name("someone/model") == "someone/model"  # a Hub id goes to the server as it is
    # ... and requests may name it as typed or by its path
    assert serving.served_names(str(tmp_path / "m.gguf"))[1] == {str(tmp_path / "m.gguf")}
    name = serving.ServedModelName(f"{tmp_path}:m.gguf", {"smollm2"})
    assert name == "smollm2" and not "smollm2" != name and name != "other" and str(name) == f"{tmp_path}:m.gguf"


def test_serve_a_hub_id_without_the_hub_fails_in_one_line_within_seconds(tmp_path, monkeypatch, capsys):
    """Issue 42: a Hub-shaped MODEL with no such folder, online, on a machine that cannot reach the Hub."""
    import huggingface_hub.constants
    from fake_hub import unreachable_endpoint

    from diff_llama.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", unreachable_endpoint())
    capsys.readouterr()
    started = time.monotonic()
    assert main(["serve", "outputs/SmolLM2-135M-Instruct-dif", "--port", str(free_port())]) == 2
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("diff-llama serve: error: outputs/SmolLM2-135M-Instruct-dif: no "
                                                   "such local folder, and as a Hub repository id"), err
    assert "is not reachable" in err


@pytest.mark.parametrize("port", ["0", "65536", "99999", "-1"])
def test_serve_refuses_a_port_outside_tcps_range_before_loading(model_dir, port, capsys):
    """Uvicorn announced "running on http://localhost:99999" for a port no client can reach."""
    from diff_llama.cli import main

    assert main(["serve", str(model_dir), "--port", port]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"diff-llama serve: error: --port {port}: a TCP port is between 1 and 65535; give one such as 8000"


def test_serve_refuses_a_device_that_is_none_before_loading(model_dir, capsys):
    """transformers' server took `--device gpu` (or cuda on a machine without one) as it loaded the model, and
    failed there with a traceback."""
    import torch

    from diff_llama.cli import main

    assert main(["serve", str(model_dir), "--device", "gpu"]) == 2
    assert capsys.readouterr().err.strip() == ("diff-llama serve: error: --device gpu is not a device: give auto, cpu, "
                                               "cuda, cuda:1, ...")
    if not torch.cuda.is_available():
        assert main(["serve", str(model_dir), "--device", "cuda"]) == 2
        assert "--device cuda: this machine has no cuda device" in capsys.readouterr().err


def test_the_server_loads_a_diff_llamas_tokenizer_without_asking_for_processor_files(model_dir):
    """AutoProcessor asks for image and video processor files first: from a Hub id, a request each (a minute of
    retries each without network). A DiffLlama reads text only."""
    from transformers import PreTrainedTokenizerBase
    from transformers.cli.serving.model_manager import ModelLoader

    from diff_llama.serving_loader import DiffLlamaModelLoader

    (model_dir / "preprocessor_config.json").write_text("{ not json")  # read by anything that asks for it
    with pytest.raises(OSError, match="preprocessor_config.json"):  # transformers' own loader reads it
        ModelLoader(device="cpu").load_processor(str(model_dir))
    processor = DiffLlamaModelLoader(device="cpu").load_processor(str(model_dir))
    assert isinstance(processor, PreTrainedTokenizerBase) and processor("The quick").input_ids


def test_the_loader_survives_the_trip_to_the_models_process():
    """transformers serve spawns the model's process, which unpickles the server's loader: the class must be found by
    its module's name there, with the server's settings."""
    import pickle

    from diff_llama.serving_loader import DiffLlamaModelLoader

    loader = pickle.loads(pickle.dumps(DiffLlamaModelLoader(device="cpu", dtype="bfloat16", trust_remote_code=True)))
    assert type(loader) is DiffLlamaModelLoader
    assert (loader.device, loader.dtype, loader.trust_remote_code) == ("cpu", torch.bfloat16, True)


def test_a_server_this_package_does_not_extend_is_refused_in_one_line(monkeypatch):
    """Servers before 5.25 load models in the server's own process, through a manager this package no longer
    extends (they have no `ModelLoader`)."""
    from transformers.cli.serving import model_manager

    from diff_llama.serving import require_supported_server

    require_supported_server()  # the installed transformers serve loads through a ModelLoader
    monkeypatch.delattr(model_manager, "ModelLoader")
    with pytest.raises(ImportError, match=r"transformers 5\.25 or newer, and this is .*: pip install -U "
                                          r"\"transformers>=5\.25,<6\".*--engine vllm or --engine sglang"):
        require_supported_server()
