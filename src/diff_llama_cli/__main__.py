"""`python -m diff_llama_cli COMMAND ...`: the same as `diff-llama COMMAND ...`."""

from .main import main

if __name__ == "__main__":
    raise SystemExit(main())
