"""float32 against bfloat16 on this machine's CPU: what `--dtype auto` / `--autocast auto` decide, and why.

Times SmolLM2-135M-Instruct prefilling the same tokens in float32 and in bfloat16 (weights cast, SDPA, no autograd),
one round each after a short warm-up, and a training step (forward and backward) in float32 and under bfloat16
autocast, then reports the CPU's bf16 capabilities and `diff_llama.precision.fastest_dtype()`.

    python -m bench precision [--tokens 2048] [--threads 1]

Writes bench/results/precision-<cpu>-<bf16 units>.{json,md} (one file per kind of CPU: CPUs of one name differ, e.g. AMD EPYCs
with and without AVX512-BF16).
"""

import argparse
import re
import time

import torch

import suite


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prefill length")
    parser.add_argument("--train-tokens", type=int, default=512, help="training step length")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", help="results name or path, no suffix (default: precision-<cpu>-<bf16 units>)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from diff_llama.precision import CPU_BFLOAT16_UNITS, fastest_dtype
    from diff_llama.resolve import load_model

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
    result = {"tokens": args.tokens, "train_tokens": args.train_tokens, "threads": args.threads, "cpu": cpu,
              "bf16_units": units, "fastest_dtype": str(fastest_dtype())[6:],
              "seconds": {name: seconds for name, seconds in rows}}
    present = [name for name, found in units.items() if found] or ["no-bf16-units"]
    name = f"precision-{re.sub(r'[^a-z0-9]+', '-', '-'.join([cpu, *present]).lower()).strip('-')}"
    suite.write_result("precision", args.output or name, result, render)


def render(result: dict) -> str:
    rows = list(result["seconds"].items())
    units = result["bf16_units"]
    return "\n".join([
        f"CPU: {result['cpu']}, {result['threads']} thread(s). bf16 units: "
        + ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in units.items())
        + f". `fastest_dtype()`: **{result['fastest_dtype']}**.",
        "",
        f"SmolLM2-135M-Instruct, prefill of {result['tokens']} tokens and a training step of {result['train_tokens']} "
        "tokens, one round each after a warm-up:",
        "",
        "| what | seconds |",
        "|---|---|",
        *[f"| {name} | {seconds:.2f} |" for name, seconds in rows],
        "",
        f"bfloat16 / float32: prefill {rows[1][1] / rows[0][1]:.2f}x the time, training step "
        f"{rows[3][1] / rows[2][1]:.2f}x.",
    ])


if __name__ == "__main__":
    main()
