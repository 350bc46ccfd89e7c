"""Run under `torchrun --nproc_per_node N` (gloo, CPU): load every model folder given with `tp_plan="auto"` and write
what the sharded model computes (logits, greedy tokens, a training step's gradients), for
tests/test_tensor_parallel.py to compare with the unsharded model."""

import json
import os
import sys

import torch

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# DIFF_LLAMA_REMOTE=1: the package is not imported; the model loads as remote code from its folder.
REMOTE = os.environ.get("DIFF_LLAMA_REMOTE") == "1"
if not REMOTE:
    import diff_llama  # noqa: E402,F401  (registers the Auto classes and the tensor-parallel styles)
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402


def main(out_dir, folders):
    rank = int(os.environ["RANK"])
    input_ids = torch.load(os.path.join(out_dir, "input_ids.pt"))
    results = {}
    for folder in folders:
        name = os.path.basename(folder)
        try:
            if REMOTE:  # the older spelling, still accepted (deprecated) by transformers 5.23
                model = AutoModelForCausalLM.from_pretrained(
                    folder, tp_plan="auto", dtype=torch.float32, trust_remote_code=True
                )
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    folder, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32
                )
        except ValueError as error:
            results[name] = {"error": str(error)}
            continue
        model.eval()
        q_weight = model.model.layers[0].self_attn.q_proj.weight
        with torch.no_grad():
            logits = model(input_ids).logits
            tokens = model.generate(input_ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        torch.save(logits, os.path.join(out_dir, f"{name}.rank{rank}.logits.pt"))
        # One training step's loss and gradients (gathered whole), on the same tokens.
        model.train()
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        gradients = {}
        for param_name, param in model.named_parameters():
            grad = param.grad
            gradients[param_name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        torch.save({"loss": loss.detach(), "gradients": gradients}, os.path.join(out_dir, f"{name}.rank{rank}.grads.pt"))
        results[name] = {
            "class": f"{type(model).__module__}.{type(model).__name__}",
            "tokens": tokens.tolist(),
            "tp_size": model.tp_size,
            "local_q_rows": q_weight.to_local().shape[0] if hasattr(q_weight, "to_local") else q_weight.shape[0],
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(results, handle)
    # from_pretrained(tp_plan=...) opened the process group; left open, gloo's threads can abort the interpreter at
    # exit ("terminate called without an active exception", seen once in CI).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
