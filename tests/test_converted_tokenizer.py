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
