"""Training on several processes: `accelerate launch` with the configs in configs/accelerate/, and FSDP2, on CPU (gloo)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import diff_llama
from conftest import SAMPLE_TEXT, needs_torch_distributed_of_transformers, tiny_model
from diff_llama import DiffLlamaForCausalLM

ROOT = Path(__file__).parent.parent
SRC = str(Path(diff_llama.__file__).parent.parent)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _model_and_data(tmp_path, tokenizer):
    model = tiny_model(vocab_size=len(tokenizer), num_attention_heads=8, num_key_value_heads=2)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "data.txt").write_text(SAMPLE_TEXT * 4)
    return model


def _accelerate_launch(config, *command, timeout=600):
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", DIFF_LLAMA_TRACEBACK="0")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs/accelerate" / config),
              "--main_process_port", str(_free_port()), *command]
    return subprocess.run(launch, env=env, capture_output=True, text=True, timeout=timeout)


def test_accelerate_launch_ddp_trains_identical_replicas_and_saves_them(tmp_path, tokenizer):
    start = _model_and_data(tmp_path, tokenizer)
    report = tmp_path / "report"
    report.mkdir()
    result = _accelerate_launch("ddp.yaml", str(Path(__file__).parent / "accelerate_worker.py"), str(tmp_path / "model"),
                                str(tmp_path / "data.txt"), str(tmp_path / "out"), str(report))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    ranks = [json.loads((report / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2] and [r["global_step"] for r in ranks] == [4, 4]
    # The replicas stay identical (DDP averages their gradients), and training moved λ.
    assert ranks[0]["lambdas"] == ranks[1]["lambdas"]
    assert not torch.allclose(torch.tensor(ranks[0]["lambdas"]), start.get_lambdas().detach(), atol=1e-4)
    logits = [torch.load(report / f"rank{rank}.logits.pt") for rank in (0, 1)]
    assert torch.equal(logits[0], logits[1])
    # Each process saw its own half of every batch: 4 steps x 2 processes x 2 blocks.
    history = json.loads((tmp_path / "out/training_log.json").read_text())
    blocks = len(tokenizer(SAMPLE_TEXT * 4, add_special_tokens=False).input_ids) // 32
    assert abs(history[-1]["epoch"] - 4 * 2 * 2 / blocks) < 1e-3
    assert "4 blocks of 32 tokens a step" in (tmp_path / "out" / "README.md").read_text()  # the card counts both
    # The saved model (written once, by the main process) reloads with the trained logits.
    reloaded = DiffLlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(torch.arange(3, 19).view(1, -1)).logits, logits[0], atol=1e-5, rtol=0)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="with an accelerator the FSDP config runs FSDP")
def test_accelerate_launch_fsdp_without_accelerator_is_refused(tmp_path, tokenizer):
    _model_and_data(tmp_path, tokenizer)
    result = _accelerate_launch("fsdp.yaml", "-m", "diff_llama.cli", "train", str(tmp_path / "model"),
                                "--data", str(tmp_path / "data.txt"), "--output", str(tmp_path / "out"), "--max-steps", "2")
    assert result.returncode != 0
    assert "FSDP was requested" in result.stderr and "configs/accelerate/ddp.yaml" in result.stderr
    assert not (tmp_path / "out").exists()


@needs_torch_distributed_of_transformers
def test_fsdp2_on_cpu_matches_single_process_training_and_saves_a_loadable_folder(tmp_path, tokenizer):
    # transformers' own FSDP2 (`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))`) runs on CPU
    # with gloo, where accelerate's FSDP config does not (see above).
    model = _model_and_data(tmp_path, tokenizer)
    batch = torch.randint(3, len(tokenizer), (4, 12), generator=torch.Generator().manual_seed(0))
    torch.save(batch, tmp_path / "batch.pt")
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
               str(Path(__file__).parent / "fsdp_worker.py"), str(tmp_path / "model"), str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]

    # The same 3 steps in one process on the whole batch: FSDP averages the two halves' gradients.
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        expected_logits = model(batch).logits

    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["class"] for r in ranks] == ["FSDPDiffLlamaForCausalLM"] * 2
    assert [r["local_q_rows"] for r in ranks] == [32, 32]  # the 64 query rows are sharded
    assert ranks[0]["lambdas"] == ranks[1]["lambdas"]
    torch.testing.assert_close(torch.tensor(ranks[0]["lambdas"]), model.get_lambdas().detach(), atol=1e-5, rtol=0)
    sharded_logits = torch.load(tmp_path / "rank0.logits.pt")
    torch.testing.assert_close(sharded_logits, expected_logits, atol=1e-4, rtol=0)

    # Saved whole, with this package's code (not torch's FSDP files) and an auto_map naming our classes.
    saved = tmp_path / "saved"
    assert sorted(p.name for p in saved.glob("*.py")) == sorted(diff_llama.configuration_diff_llama.REMOTE_CODE_FILES)
    config = json.loads((saved / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_diff_llama.DiffLlamaForCausalLM"
    assert config["architectures"] == ["DiffLlamaForCausalLM"]
    reloaded = DiffLlamaForCausalLM.from_pretrained(saved).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(batch).logits, sharded_logits, atol=1e-6, rtol=0)
