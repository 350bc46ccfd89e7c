"""Multi-needle retrieval and attention allocation of SmolLM2-135M-Instruct and its conversions, in one table.

Each model is evaluated by its own `diff-llama evaluate` run (so that they can run one after another, or on
different days, on the same cases); this script merges their retrieval.json files into
bench/results/retrieval.{json,md,png}. The runs behind bench/results (2 CPU threads shared with other work):

    diff-llama convert smollm2 outputs/smollm2-diff
    diff-llama convert smollm2 outputs/smollm2-diff-v2 --diff-version 2
    diff-llama evaluate smollm2 --output outputs/eval-source --lengths 1024 2048 --cases_per_depth 1 --threads 1
    diff-llama evaluate outputs/smollm2-diff --output outputs/eval-v1 --lengths 1024 2048 --cases_per_depth 1 \\
        --threads 1 --names "SmolLM2 → DiffLlama V1 (converted, λ=0)"
    diff-llama evaluate outputs/smollm2-diff-v2 --output outputs/eval-v2 --lengths 1024 2048 --cases_per_depth 1 \\
        --threads 1 --names "SmolLM2 → DiffLlama V2 (converted, λ=0.5)"
    python bench/retrieval.py outputs/eval-source outputs/eval-v1 outputs/eval-v2

and at 4,096 tokens (bench/results/retrieval-4k/), the same with `--lengths 4096 --settings 1x1 4x2
--perplexity_tokens 0` into outputs/eval4k-*, then `python bench/retrieval.py --output bench/results/retrieval-4k ...`.

Usage: python bench/retrieval.py FOLDER_OR_JSON [FOLDER_OR_JSON ...]
"""

import argparse
import json
from pathlib import Path

from diff_llama.retrieval import markdown_report, merge_reports, write_report

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="retrieval.json files, or the folders holding them")
    parser.add_argument("--output", default=str(RESULTS), help="folder for retrieval.{json,md,png} (default: %(default)s)")
    args = parser.parse_args()
    reports = []
    for path in map(Path, args.reports):
        reports.append(json.loads((path / "retrieval.json" if path.is_dir() else path).read_text()))
    merged = merge_reports(reports)
    write_report(merged, args.output)
    print(markdown_report(merged))


if __name__ == "__main__":
    main()
