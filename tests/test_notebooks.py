"""The notebooks run top to bottom (they carry their own checks: equal tokens, errors vs transformers)."""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.fixture(autouse=True)
def patient_heartbeat(monkeypatch):
    """The client's heartbeat waits an hour, not 1 s, for the kernel's reply. On a loaded machine (2 cores, a JAX
    compile in the kernel) a late reply counts as heart failure, the client makes a new heartbeat socket, and at
    shutdown its thread can block forever sending on it to the kernel already gone, so `execute` never returns
    (seen in a local CI run: jupyter_client 8.10, HBChannel.stop joining that thread). The heartbeat decides
    nothing here: nbclient watches the kernel process and the cell timeout."""
    channels = pytest.importorskip("jupyter_client.channels")
    monkeypatch.setattr(channels.HBChannel, "time_to_dead", 3600.0)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    env = {"JAX_PLATFORMS": "cpu", "MPLBACKEND": "Agg", "XLA_FLAGS": ""}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel is a child process: it inherits these
    try:
        nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                resources={"metadata": {"path": tmp_path}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert len(NOTEBOOKS) >= 4
