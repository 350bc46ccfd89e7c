"""Multi-needle retrieval and attention allocation of SmolLM2-135M-Instruct and its conversions, in one table.

Each model is evaluated by its own `diff-llama evaluate` run (so that they can run one after another, or on
different days, on the same cases); this script merges their retrieval.json files into
bench/results/retrieval.{json,md,png}. The runs behind bench/results (one thread each, bfloat16 weights, 80 cases):

    diff-llama convert smollm2 outputs/smollm2-v1 --diff-version 1
    diff-llama recover outputs/smollm2-v1 --output outputs/smollm2-v1-recovered
    diff-llama convert smollm2 outputs/smollm2-v2
    diff-llama evaluate MODEL --output outputs/eval-NAME --names "LABEL" --lengths 1024 2048 --cases-per-depth 2 \
        --dtype bfloat16 --threads 1          # for smollm2 and each converted model
    python -m bench retrieval outputs/eval-source outputs/eval-v1 outputs/eval-v1-recovered outputs/eval-v2 \
        outputs/adapt/eval-llama outputs/adapt/eval-v2-1e-3     # the last two: bench/adaptation.py's trained models

The paired tests compare every model with the first (the source).

An earlier float32 run at 4,096 tokens (bench/results/retrieval-4k/, in git at ac5c561) used `--lengths 4096 --settings 1x1 4x2
--perplexity_tokens 0` into outputs/eval4k-*, then `python -m bench retrieval --output bench/results/retrieval-4k ...`.

Usage: python -m bench retrieval FOLDER_OR_JSON [FOLDER_OR_JSON ...]
"""

import argparse
import json
from pathlib import Path

import suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="retrieval.json files, or the folders holding them")
    parser.add_argument("--output", default=str(suite.RESULTS),
                        help="folder for retrieval.{json,md,png} (default: %(default)s)")
    args = parser.parse_args()
    reports = []
    for path in map(Path, args.reports):
        reports.append(json.loads((path / "retrieval.json" if path.is_dir() else path).read_text()))
    from diff_llama.retrieval import merge_reports, plot_report

    merged = merge_reports(reports)
    path = suite.write_result("retrieval", Path(args.output) / "retrieval", merged, render)
    plot_report(merged, path.with_suffix(".png"))


def render(result: dict) -> str:
    from diff_llama.retrieval import markdown_report

    return markdown_report({key: value for key, value in result.items() if key != "meta"})


if __name__ == "__main__":
    main()
