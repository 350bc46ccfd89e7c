"""One entry point for the benchmarks.

    python -m bench list                   # every benchmark, one line each
    python -m bench NAME [options]         # run one (NAME --help for its options)
    python -m bench render FILE.json       # render a result's markdown again from its JSON
"""

import runpy
import shlex
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import suite  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] == "list":
        width = max(map(len, suite.BENCHMARKS))
        for name, description in suite.BENCHMARKS.items():
            print(f"{name:<{width}}  {description}")
        return 0
    if argv[0] == "render":
        for file in argv[1:]:
            try:
                suite.render_file(file)
            except ValueError as error:
                print(f"python -m bench render: {error}", file=sys.stderr)
                return 2
        return 0
    name, options = argv[0], argv[1:]
    if name not in suite.BENCHMARKS:
        print(f"unknown benchmark {name!r}; `python -m bench list` shows them", file=sys.stderr)
        return 2
    suite.COMMAND = shlex.join(["python", "-m", "bench", name, *options])
    sys.argv = [str(BENCH / f"{name}.py"), *options]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
