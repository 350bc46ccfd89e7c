"""Recovery after conversion on the real SmolLM2-135M-Instruct: held-out perplexity and mean |λ| against CPU minutes.

Runs `diff-llama recover` with its defaults (full fine-tuning by distillation from the source, λ floor 0.12, 30
training minutes, evaluation excluded) on the model that `bash scripts/run_main_job.sh` converts, and writes
bench/results/recovery.{json,md,png}. `--report FILE` only turns an existing recovery_report.json into those files.

Usage: python -m bench recovery [--minutes 30] [--threads 2]     (about 40 minutes on 2 cores)
"""

import argparse
import json
import shutil
from pathlib import Path

import suite

CONVERTED = Path("outputs/SmolLM2-135M-Instruct-diff")
RECOVERED = Path("outputs/SmolLM2-135M-Instruct-diff-recovered")


def write_results(report: dict, curve_png: Path, output: str = "recovery") -> Path:
    path = suite.write_result("recovery", output, {"report": report}, render)
    shutil.copy(curve_png, path.with_suffix(".png"))
    return path


def render(result: dict) -> str:
    report = result["report"]
    source = report["source_perplexity"]
    lines = [
        f"SmolLM2-135M-Instruct converted (expand layout) then recovered by distillation: {report['steps']} steps of "
        f"batch {report['batch_size']} x {report['block_size']} tokens, {report['threads']} CPU threads, "
        f"lr {report['learning_rate']:g} (λ {report['lambda_learning_rate']:g}, schedule {report.get('lr_schedule', 'constant')}), "
        f"λ floor {report['lambda_floor']}. "
        f"Held-out perplexity on {report['eval_tokens']} tokens; source LLaMA {source:.2f}.",
        "",
        "| training minutes | step | perplexity | x source | mean abs(λ) |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['train_minutes']:.1f} | {r['step']} | {r['perplexity']:.2f} | {r['perplexity'] / source:.3f} "
              f"| {r['mean_abs_lambda']:.3f} |" for r in report["curve"]]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--report", help="an existing recovery_report.json (skips training)")
    parser.add_argument("--output", default="recovery", help="results name under bench/results, or a path (no suffix)")
    args = parser.parse_args()
    if args.report:
        report_path = Path(args.report)
    else:
        from diff_llama.recovery import RecoveryOptions, recover

        if not CONVERTED.exists():
            raise SystemExit(f"{CONVERTED} is missing: run `bash scripts/run_main_job.sh` first.")
        recover(str(CONVERTED), RecoveryOptions(output=str(RECOVERED), minutes=args.minutes, threads=args.threads))
        report_path = RECOVERED / "recovery_report.json"
    write_results(json.loads(report_path.read_text()), report_path.parent / "recovery_curve.png", args.output)


if __name__ == "__main__":
    main()
