"""Multi-needle retrieval and attention allocation, after the Differential Transformer paper (§3.4, Tables 2 and 3),
for any causal LM: a plain LLaMA (folder, .gguf file or 'smollm2') as well as a DiffLlama folder.

One module per concern, in the order a run goes through them:
- `cases`: the prompts (needles in generated filler) and the class of every token;
- `scoring`: a case's greedy answer (alone or in a batch), its exact match, and the attention allocation of the
  answering position;
- `evaluate`: every case through every model (`diff-llama evaluate`); models load through `resolve.load_model`;
- `statistics`: summaries, the paired McNemar test, reports of separate runs merged;
- `report`: the markdown tables, the plot and the files;
- `ruler_cases` and `ruler`: RULER's needle tasks, built by lm-eval's RULER code, scored and paired alike
  (`diff-llama ruler`; imported on use, as they need lm-eval).
"""

from .cases import (
    CATEGORIES,
    HELD_OUT_CITIES,
    NOISE,
    TRAINING_CITIES,
    NeedleCase,
    case_plan,
    filler_sentences,
    make_case,
    make_cases,
    needle_sentence,
    question_text,
)
from .evaluate import display_name, evaluate_model, evaluate_models, run_evaluate
from .report import markdown_report, plot_report, write_report
from .scoring import (
    attention_allocation,
    effective_attention_maps,
    greedy_answer,
    greedy_answers,
    map_kind,
    run_case,
    run_cases,
    score_output,
)
from .statistics import join_lengths, merge_reports, paired_comparison, summarize

__all__ = [
    "CATEGORIES", "HELD_OUT_CITIES", "NOISE", "TRAINING_CITIES", "NeedleCase", "attention_allocation", "case_plan",
    "display_name", "effective_attention_maps", "evaluate_model", "evaluate_models", "filler_sentences",
    "greedy_answer", "greedy_answers", "join_lengths", "make_case", "make_cases", "map_kind", "markdown_report",
    "merge_reports", "needle_sentence", "paired_comparison", "plot_report", "question_text", "run_case", "run_cases",
    "run_evaluate", "score_output", "summarize", "write_report",
]
