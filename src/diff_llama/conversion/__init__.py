"""The LLaMA -> DiffLlama converter (`diff-llama convert`): `converter.convert_llama_to_diff_llama` is the route,
from source (source.py) through one version (version1.py or version2.py, on base.py) to the written folder."""
