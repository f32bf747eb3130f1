"""The notebooks run top to bottom (their own asserts check the llvm kernels against numpy or eager torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "experiments" / "notebooks"


@pytest.mark.parametrize("name", ["explore_schedules.ipynb", "fuse_bert.ipynb"])
def test_notebook_runs(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    notebook = NOTEBOOKS / name
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the kernel is a new process; the notebook also finds the root
    nb = nbformat.read(notebook, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook cleared"
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(notebook.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "max abs error" in text
