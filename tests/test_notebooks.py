"""Every research notebook runs headless, top to bottom, on CPU against the embedded checkpoint.

Notebooks are committed without outputs (strip with `jupyter nbconvert --clear-output --inplace notebooks/*.ipynb`);
a committed output fails test_committed_without_outputs. Each notebook has a wall-clock budget; a cell error,
a cell past the budget, or a run past it fails its test.
"""

import os
import time
from pathlib import Path

import pytest

try:
    import nbformat
    from nbclient import NotebookClient
except ImportError as e:  # a clear pointer instead of a bare ModuleNotFoundError at collection
    raise ImportError(f"{e}: the notebook tests need the notebooks extra: pip install '.[notebooks]'") from None

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
# Seconds per notebook: generous, since CI machines vary; measured on a shared 2-core CPU they take 8-18 s each.
BUDGET_S = {
    "01_quickstart.ipynb": 120,
    "02_ab_bench.ipynb": 180,
    "03_kernel_anatomy.ipynb": 120,
    "04_inside_the_model.ipynb": 120,
}


def test_every_notebook_has_a_budget():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(BUDGET_S)


@pytest.mark.parametrize("name", sorted(BUDGET_S))
def test_committed_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"{name}: cells {dirty} carry outputs; strip them (jupyter nbconvert --clear-output --inplace)"
    assert nb.cells[0].cell_type == "markdown" and "**Purpose.**" in nb.cells[0].source, f"{name}: no purpose statement"


@pytest.mark.parametrize("name", sorted(BUDGET_S))
def test_notebook_runs(name, monkeypatch, tmp_path):
    budget = BUDGET_S[name]
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # The kernel imports lily_mlx and bench from this checkout, runs on CPU, and writes nothing into the repo.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("LILY_MLX_CACHE", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    client = NotebookClient(nb, timeout=budget, kernel_name="python3", resources={"metadata": {"path": str(work)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError (with the traceback) on the first failing cell
    elapsed = time.perf_counter() - t0
    assert elapsed < budget, f"{name}: {elapsed:.0f} s, over its {budget} s budget"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors
