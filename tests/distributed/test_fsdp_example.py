"""examples/fsdp_train.py under torchrun (2 CPU ranks, gloo): it learns, checks its own
resume, removes its checkpoint, and ends gloo's threads before the interpreter exits
(left running into the exit they can abort the process after training finished)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--steps", "10", "--hidden", "32", "--layers", "1", "--distribute-factors"]

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None, reason="needs transformers"
    ),
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc"),
]


def _run_example(tmp_path: Path, *args: str) -> str:
    """The output of one torchrun of the example (checked: exit code 0)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", str(ROOT / "tests/distributed/exit_threads.py")]
    command += [str(ROOT / "examples/fsdp_train.py"), *args]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def _check_run(output: str) -> None:
    assert "terminate called" not in output, output
    # (the two ranks' lines can land on one line of the output: each list is matched alone)
    threads = re.findall(r"rank (\d) gloo threads at exit: (\[[^\]]*\])", output)
    assert sorted(rank for rank, _ in threads) == ["0", "1"], output
    assert all(alive == "[]" for _, alive in threads), output
    assert "losses after the restore equal the uninterrupted run's, bit for bit" in output
    head, tail = map(float, re.search(r"mean loss ([\d.]+) .* -> ([\d.]+) ", output).groups())
    assert tail < head - 0.5, output


def test_the_example_learns_checks_its_resume_and_exits_cleanly(tmp_path):
    _check_run(_run_example(tmp_path, *SMALL))
    assert not list(tmp_path.glob("fsdp_ckpt_*")), "the temporary checkpoint was left behind"


@pytest.mark.slow
def test_a_named_checkpoint_folder_is_kept(tmp_path):
    output = _run_example(tmp_path, *SMALL, "--checkpoint", str(tmp_path / "ckpt"))
    _check_run(output)
    assert (tmp_path / "ckpt" / ".metadata").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("repeat", range(5))
def test_the_shutdown_holds_on_every_run(tmp_path, repeat):
    _check_run(_run_example(tmp_path, *SMALL))
