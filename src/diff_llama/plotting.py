"""Shared plotting plumbing: a headless matplotlib and PNG saving."""

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, output: str | Path, dpi: int = 130, rect=(0, 0, 1, 1)) -> Path:
    """Lay out (within `rect`, in figure coordinates), write and close a figure; creates the folder."""
    fig.tight_layout(rect=rect)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=dpi)
    pyplot().close(fig)
    return output
