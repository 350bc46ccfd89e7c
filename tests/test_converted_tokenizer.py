"""A converted folder's tokenizer is the source's: it loads as the source's does, in a Python without diff-llama.

transformers' AutoTokenizer reads config.json before tokenizer_config.json; a converted folder's config.json names
the `diff_llama` model type, whose class is remote code, so AutoTokenizer needs `trust_remote_code=True` there (as the
model card's snippet shows). The tokenizer class itself is a transformers class, and the tokenizer files load with it
and no remote code at all.
"""

import json
import os
import subprocess
import sys

from conftest import make_llama

from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama


def test_converted_tokenizer_loads_as_the_source_s_in_a_fresh_python(tmp_path, tokenizer):
    source = make_llama(tmp_path / "llama", tokenizer, num_hidden_layers=2)
    # a source whose tokenizer_config.json names no class: transformers picks one from config.json's model_type,
    # which the converted folder's `diff_llama` cannot do without remote code
    config_file = source / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["tokenizer_class"]
    config_file.write_text(json.dumps(config))
    out = tmp_path / "diff"
    convert_llama_to_diff_llama(str(source), str(out), ConversionOptions(evaluate=False), progress=False)
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    card = (out / "README.md").read_text()
    # the card's usage names the folder as the reader has it (./NAME beside it), never this machine's absolute path
    assert 'AutoTokenizer.from_pretrained("./diff", trust_remote_code=True)' in card and str(tmp_path) not in card

    script = f"""
import sys
sys.modules["diff_llama"] = None  # a user without the package
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
text = "The quick brown fox"
source = AutoTokenizer.from_pretrained({str(source)!r})
plain = PreTrainedTokenizerFast.from_pretrained({str(out)!r})  # no config.json read, no remote code
auto = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)
assert type(auto) is type(source) and type(auto).__module__.startswith("transformers."), type(auto)
assert plain(text).input_ids == auto(text).input_ids == source(text).input_ids
model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)
ids = auto(text, return_tensors="pt").input_ids
print("OK", type(model).__name__, model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] - ids.shape[1])
"""
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            stdin=subprocess.DEVNULL, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Do you wish" not in result.stdout + result.stderr
    assert result.stdout.split()[-3:] == ["OK", "DiffLlamaForCausalLM", "3"]


def test_every_tokenizer_file_named_chat_template_and_licence_travels(tmp_path, tokenizer):
    """A GPT-2-style tokenizer (vocab.json and merges.txt, no tokenizer.json), a named chat template beside the
    default one and the licence texts: the converted folder's tokenizer encodes and templates as the source's."""
    from transformers import AutoTokenizer

    source = make_llama(tmp_path / "llama", tokenizer, num_hidden_layers=2)
    (source / "tokenizer.json").unlink()
    tokenizer.backend_tokenizer.model.save(str(source))  # vocab.json, merges.txt
    config_file = source / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    config_file.write_text(json.dumps(config))
    (source / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (source / "additional_chat_templates").mkdir()
    (source / "additional_chat_templates" / "tool_use.jinja").write_text("TOOL:{{ messages[0].content }}")
    licences = {"LICENSE": "the agreement", "USE_POLICY.md": "the policy", "notice.txt": "a notice"}
    for name, text in licences.items():
        (source / name).write_text(text)
    (source / "notes.txt").write_text("not the model's")
    out = tmp_path / "diff"
    convert_llama_to_diff_llama(str(source), str(out), ConversionOptions(evaluate=False), progress=False)

    expected, converted = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(out,
                                                                                               trust_remote_code=True)
    text = "The quick brown fox jumps over the lazy dog"
    assert len(expected(text).input_ids) > 3 and converted(text).input_ids == expected(text).input_ids
    assert len(converted) == len(expected)
    chat = [{"role": "user", "content": "hi"}]
    for template in (None, "tool_use"):
        assert (converted.apply_chat_template(chat, chat_template=template, tokenize=False)
                == expected.apply_chat_template(chat, chat_template=template, tokenize=False))
    assert converted.apply_chat_template(chat, chat_template="tool_use", tokenize=False) == "TOOL:hi"
    assert {name: (out / name).read_text() for name in licences} == licences
    assert not (out / "notes.txt").exists()
    from diff_llama.output_folder import foreign_entries
    assert foreign_entries(out) == []  # all of it counts as ours: a later convert --overwrite replaces it


def test_a_hub_snapshot_fetches_what_the_conversion_copies(tmp_path, tokenizer, monkeypatch):
    """The Hub is unreachable here: `snapshot_download` is replaced by a fake that applies its `allow_patterns` to a
    local folder, as the Hub does to a repository's files."""
    import shutil

    import huggingface_hub
    from fake_hub import cache_repo
    from huggingface_hub.utils import filter_repo_objects

    source = make_llama(tmp_path / "llama", tokenizer, num_hidden_layers=2)
    tokenizer.backend_tokenizer.model.save(str(source))
    (source / "additional_chat_templates").mkdir()
    (source / "additional_chat_templates" / "tool_use.jinja").write_text("TOOL")
    for name in ("LICENSE.txt", "USE_POLICY.md", "notes.txt"):
        (source / name).write_text(name)
    cache_repo(tmp_path / "hub-cache", "someone/tiny-llama", source)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    snapshot = tmp_path / "snapshot"

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None):
        files = [str(path.relative_to(source)) for path in source.rglob("*") if path.is_file()]
        for name in filter_repo_objects(files, allow_patterns=allow_patterns):
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, snapshot / name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    convert_llama_to_diff_llama("someone/tiny-llama", str(tmp_path / "diff"), ConversionOptions(evaluate=False),
                                progress=False)
    fetched = {str(path.relative_to(snapshot)) for path in snapshot.rglob("*") if path.is_file()}
    assert {"vocab.json", "merges.txt", "additional_chat_templates/tool_use.jinja", "LICENSE.txt",
            "USE_POLICY.md"} <= fetched and "notes.txt" not in fetched
    for name in ("vocab.json", "merges.txt", "additional_chat_templates/tool_use.jinja", "LICENSE.txt"):
        assert (tmp_path / "diff" / name).read_bytes() == (source / name).read_bytes(), name
