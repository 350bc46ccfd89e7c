"""Run by `accelerate launch` (tests/test_accelerate.py): `diff-llama train`'s engine with a callback that records,
on every process, what the process ended with: its world size, λ, and the logits of its in-memory model."""

import json
import os
import sys

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from diff_llama.training import FineTuneOptions, train  # noqa: E402


class ReplicaReport(TrainerCallback):
    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, args, state, control, model=None, **kwargs):
        input_ids = torch.arange(3, 19).view(1, -1)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids).logits
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.save(logits, os.path.join(self.folder, f"rank{rank}.logits.pt"))
        report = {
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "global_step": state.global_step,
            "lambdas": model.get_lambdas().tolist(),
        }
        with open(os.path.join(self.folder, f"rank{rank}.json"), "w") as handle:
            json.dump(report, handle)


if __name__ == "__main__":
    model, data, output, report = sys.argv[1:5]
    options = FineTuneOptions(output=output, data=data, max_steps=4, batch_size=2, block_size=32, logging_steps=1,
                              learning_rate=1e-3, seed=0)
    train(model, options, callbacks=[ReplicaReport(report)])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # See tests/test_finetuning.py: a thread of the gloo/Trainer stack can abort the process at interpreter exit.
    sys.stdout.flush()
    os._exit(0)
