"""`python -m diff_llama.cli COMMAND ...`: the `diff-llama` command (declared and parsed in `diff_llama_cli`, run by
`diff_llama.commands`)."""

from diff_llama_cli import main

from .commands import answer_prompt  # noqa: F401  (kept importable from here)

if __name__ == "__main__":
    raise SystemExit(main())
