"""Run under `torchrun --nproc_per_node 2` (gloo, CPU) by tests/test_distributed_training.py: load a model sharded with
transformers' FSDP2 (`DistributedConfig(fsdp_size=2)`), train 3 AdamW steps on this rank's half of a batch, save it."""

import json
import os
import sys

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

import diff_llama  # noqa: E402,F401


def main(model_dir, out):
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=DistributedConfig(fsdp_size=2), dtype=torch.float32
    )
    rank = dist.get_rank()
    batch = torch.load(os.path.join(out, "batch.pt"))
    input_ids = batch.chunk(2)[rank]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    q_weight = model.model.layers[0].self_attn.q_proj.weight
    report = {
        "class": type(model).__name__,
        "local_q_rows": q_weight.to_local().shape[0],
        "lambdas": model.get_lambdas().full_tensor().tolist(),
    }
    model.eval()
    with torch.no_grad():
        torch.save(model(batch).logits, os.path.join(out, f"rank{rank}.logits.pt"))
    model.save_pretrained(os.path.join(out, "saved"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump(report, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
