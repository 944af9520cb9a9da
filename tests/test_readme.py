"""The README's examples run as written: its Python blocks on one CPU device and on 8 simulated ones, its cheap
commands, and CI runs its test command verbatim."""

import ast
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)
BASH_BLOCKS = re.findall(r"^```bash\n(.*?)^```", README, re.S | re.M)
EIGHT_DEVICES = "--xla_force_host_platform_device_count=8"


def _run(argv: list[str], devices: int, timeout: int = 300) -> subprocess.CompletedProcess:
    """argv in a fresh process on the CPU platform with `devices` simulated devices (jax reads XLA_FLAGS at start)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=EIGHT_DEVICES if devices == 8 else "")
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _cli(command: str) -> list[str]:
    """A README `kdtree-jax ...` line as argv: the installed script beside this Python, else the module."""
    script = pathlib.Path(sys.executable).parent / "kdtree-jax"
    head = [str(script)] if script.exists() else [sys.executable, "-m", "kdtree_jax.cli"]
    return head + shlex.split(command)[1:]


def test_readme_has_its_examples():
    """The third Python block (the `openai` client) runs against a server in tests/test_serve.py."""
    assert len(PYTHON_BLOCKS) == 3 and len(BASH_BLOCKS) >= 3


def test_single_device_block_runs():
    """The first block as written on one device: it generates text with the embedded model."""
    assert _run([sys.executable, "-c", PYTHON_BLOCKS[0]], devices=1).stdout.strip()  # the decoded continuation


@pytest.mark.parametrize("devices", [1, 8])
def test_sharded_block_runs(devices):
    """The sharded block does nothing on one device and generates on 8 simulated ones."""
    proc = _run([sys.executable, "-c", PYTHON_BLOCKS[1]], devices=devices)
    if devices == 8:
        tokens = ast.literal_eval(proc.stdout.strip().splitlines()[-1])  # the printed [[...], [...]]
        assert [len(t) for t in tokens] == [8, 8]
    else:
        assert proc.stdout == ""


def _setup_commands() -> tuple[str, str]:
    """The two commands of "Two commands": (main job, tests)."""
    main, tests = (b.strip() for b in BASH_BLOCKS[:2])
    assert "\n" not in main and "\n" not in tests
    return main, tests


def test_setup_commands_use_distinct_environments_and_ci_runs_the_test_command():
    main, tests = _setup_commands()
    envs = [re.match(r"python3 -m venv (\S+) && \. (\S+)/bin/activate && ", c) for c in (main, tests)]
    assert all(m and m[1] == m[2] for m in envs) and envs[0][1] != envs[1][1]
    after_venv = tests[envs[1].end():]
    assert after_venv in (ROOT / ".ci" / "run").read_text().splitlines()


def test_cheap_commands_run():
    """`--help`, `plan` (no weights, no devices) and the main job's command (the embedded model, ~128 tokens)."""
    main, _ = _setup_commands()
    generate = main[main.index("kdtree-jax generate"):]
    plan = BASH_BLOCKS[2].strip()
    assert plan.startswith("kdtree-jax plan ") and "`kdtree-jax generate --help`" in README
    assert "usage: kdtree-jax generate" in _run(_cli("kdtree-jax generate --help"), devices=1).stdout
    assert "fits" in _run(_cli(plan), devices=1).stdout
    proc = _run(_cli(generate), devices=1)
    assert proc.stdout.startswith('def fibonacci(n):\n    """Return') and "[stats] method=ddtree" in proc.stdout
    assert "compiled in" in proc.stderr
