"""The notebooks' stored outputs from the current code (`make notebooks`): each notebook runs top to
bottom in a fresh kernel started in its own folder, headless, at the sizes a reader sees.

    python -m utils.run_notebooks notebooks/flowrl.ipynb                         # in place
    python -m utils.run_notebooks --toy-only --out-dir mine notebooks/flowrl.ipynb  # a new file

--toy-only skips the cells tagged "real-model" (SmolLM2 on the CPU, minutes to an hour each): they
keep the source and the stored outputs they had. --out-dir writes the result there instead of over
the notebook. A cell that raises stops its notebook with the cell's traceback.
"""

import argparse
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REAL_MODEL = "real-model"  # the tag of a cell that trains the bundled SmolLM2


def run(path, toy_only):
    """Execute the notebook at `path` and return it with its new outputs."""
    book = nbformat.read(path, as_version=4)
    client = NotebookClient(
        book,
        timeout=None,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    with client.setup_kernel():
        for index, cell in enumerate(book.cells):
            skipped = toy_only and REAL_MODEL in cell.metadata.get("tags", [])
            if cell.cell_type == "code" and not skipped:
                client.execute_cell(cell, index)
    return book


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument(
        "--toy-only", action="store_true", help=f"skip the cells tagged {REAL_MODEL}"
    )
    parser.add_argument("--out-dir", type=Path, help="write here instead of over each notebook")
    args = parser.parse_args()
    for path in args.notebooks:
        start = time.time()
        book = run(path.resolve(), args.toy_only)
        out = args.out_dir / path.name if args.out_dir else path
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(book, out)
        print(f"{out}: {time.time() - start:.0f} s")
