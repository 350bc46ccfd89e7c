"""Run by `accelerate launch` (tests/test_adaptation_trainer.py): `adaptation.adapt` on every process, recording
which retrieval examples this process built, the history and the trained weights."""

import json
import os
import sys

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import diff_llama.adaptation as adaptation  # noqa: E402
import diff_llama.adaptation.trainer as trainer  # noqa: E402
from diff_llama import DiffLlamaForCausalLM  # noqa: E402

if __name__ == "__main__":
    model_path, folder = sys.argv[1:3]
    options = adaptation.AdaptationOptions(**json.loads(open(os.path.join(folder, "options.json")).read()))
    trainer.probe = lambda *args, **kwargs: {}  # the probes are not what this checks, and cost time
    built, real_getitem = [], adaptation.RetrievalExamples.__getitem__

    def build(self, index):
        built.append(index)
        return real_getitem(self, index)

    adaptation.RetrievalExamples.__getitem__ = build
    model = DiffLlamaForCausalLM.from_pretrained(model_path)
    history = adaptation.adapt(model, AutoTokenizer.from_pretrained(model_path), options, name="tiny")
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as handle:
        json.dump({**history, "built": built}, handle)
    torch.save(model.state_dict(), os.path.join(folder, f"rank{rank}.weights.pt"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # See tests/test_finetuning.py: a thread of the gloo/Trainer stack can abort the process at interpreter exit.
    sys.stdout.flush()
    os._exit(0)
