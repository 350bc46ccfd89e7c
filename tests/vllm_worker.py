"""Run by test_vllm.py in a process of its own: greedy tokens from vLLM's offline engine (its Transformers backend) for
a model folder, as JSON on the stdout line that starts with RESULT (vLLM logs to stdout too). vLLM starts its engine with spawn, hence the __main__ guard.

    python vllm_worker.py FOLDER PROMPTS_JSON MAX_TOKENS [--trust-remote-code] [--tensor-parallel-size N] [--compile]

(--compile: vLLM compiles the model as it does by default, and caches it under VLLM_CACHE_ROOT; otherwise eager.)
"""

import json
import sys


def main():
    from vllm import LLM, SamplingParams

    folder, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    tp_size = int(sys.argv[sys.argv.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in sys.argv else 1
    llm = LLM(model=folder, model_impl="transformers", trust_remote_code="--trust-remote-code" in sys.argv,
              dtype="float32", max_model_len=512, enforce_eager="--compile" not in sys.argv, seed=0,
              tensor_parallel_size=tp_size)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                           SamplingParams(temperature=0, max_tokens=max_tokens))
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    print("RESULT " + json.dumps({"tokens": tokens, "diff_llama_imported": "diff_llama" in sys.modules}), flush=True)


if __name__ == "__main__":
    main()
