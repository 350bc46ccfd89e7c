"""float32 against bfloat16 on this machine's CPU: what `--dtype auto` / `--autocast auto` decide, and why.

Times SmolLM2-135M-Instruct prefilling the same tokens in float32 and in bfloat16 (weights cast, SDPA, no autograd),
one round each after a short warm-up, and a training step (forward and backward) in float32 and under bfloat16
autocast, then reports the CPU's bf16 capabilities and `diff_llama.precision.fastest_dtype()`.

    python bench/precision.py [--tokens 2048] [--threads 1]

Writes bench/results/precision-<cpu>-<bf16 units>.md (one file per kind of CPU: CPUs of one name differ, e.g. AMD EPYCs
with and without AVX512-BF16).
"""

import argparse
import re
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prefill length")
    parser.add_argument("--train-tokens", type=int, default=512, help="training step length")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from diff_llama.precision import CPU_BFLOAT16_UNITS, fastest_dtype
    from diff_llama.retrieval import load_model

    model, _ = load_model("smollm2", dtype="float32")
    ids = torch.randint(100, 10000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    train_ids = ids[:, : args.train_tokens]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)  # in place
        with torch.no_grad():
            model(ids[:, :64])  # warm-up
            seconds = timed(lambda: model(ids))
        rows.append((f"prefill {args.tokens} tokens, {str(dtype)[6:]} weights (s)", seconds))
    model = model.to(torch.float32).train()

    def train_step(autocast: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=train_ids, labels=train_ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    for autocast in (False, True):
        train_step(autocast)  # warm-up
        label = "bfloat16 autocast" if autocast else "float32"
        rows.append((f"training step {args.train_tokens} tokens, {label} (s)", timed(lambda: train_step(autocast))))

    capabilities = getattr(torch.cpu, "get_capabilities", lambda: {})()
    cpu = str(capabilities.get("cpu_name", "unknown cpu"))
    units = {name: bool(capabilities.get(name)) for name in CPU_BFLOAT16_UNITS}
    lines = [
        f"CPU: {cpu}, {args.threads} thread(s), torch {torch.__version__}. bf16 units: "
        + ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in units.items())
        + f". `fastest_dtype()`: **{str(fastest_dtype())[6:]}**.",
        "",
        f"`python bench/precision.py --tokens {args.tokens} --threads {args.threads}`, SmolLM2-135M-Instruct, one "
        "round each after a warm-up:",
        "",
        "| what | seconds |",
        "|---|---|",
        *[f"| {name} | {seconds:.2f} |" for name, seconds in rows],
        "",
        f"bfloat16 / float32: prefill {rows[1][1] / rows[0][1]:.2f}x the time, training step "
        f"{rows[3][1] / rows[2][1]:.2f}x.",
    ]
    RESULTS.mkdir(exist_ok=True)
    present = [name for name, found in units.items() if found] or ["no-bf16-units"]
    output = RESULTS / f"precision-{re.sub(r'[^a-z0-9]+', '-', '-'.join([cpu, *present]).lower()).strip('-')}.md"
    output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten to {output}")


if __name__ == "__main__":
    main()
