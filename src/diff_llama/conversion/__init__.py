"""The LLaMA -> DiffLlama converter (`diff-llama convert`); see `converter.convert_llama_to_diff_llama`."""
