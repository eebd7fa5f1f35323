"""The JIT build: cache keys, toolkit defaults, the fallback on a failed build, the CLI, and
the lifecycle (one log line, per-environment keys, concurrent and killed builds)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from singd_cuda import ops
from singd_cuda.ops import _build, reference

ROOT = Path(__file__).resolve().parents[2]


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    def broken(kind, verbose):
        raise RuntimeError("Error building extension 'x': compiler exploded\nmore output")

    monkeypatch.setattr(_build, "_loaded", {})
    monkeypatch.setattr(_build, "_build_and_load", broken)
    with pytest.warns(RuntimeWarning, match="compiler exploded.*reference path") as record:
        assert not _build.load("cpu")
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _build.load("cpu")
        assert not _build.load("cuda")
        x = torch.randn(4, 3)
        torch.testing.assert_close(ops.col_sum_squares(x), reference.col_sum_squares(x))
    monkeypatch.setattr(_build, "_loaded", {})
    with pytest.raises(RuntimeError, match="compiler exploded"):
        _build.load("cpu", strict=True)


def test_cache_key_follows_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("SINGD_CUDA_CACHE_DIR", str(tmp_path))
    assert _build.build_dir("cpu").is_relative_to(tmp_path)
    assert torch.__version__ in _build.build_dir("cpu").parent.name
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    cpu, cuda80 = _build.build_dir("cpu"), _build.build_dir("cuda")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert _build.build_dir("cpu") == cpu
    assert _build.build_dir("cuda") != cuda80
    monkeypatch.setenv("CXX", "some-other-compiler")
    assert _build.build_dir("cpu") != cpu


def test_toolkit_defaults(monkeypatch, tmp_path):
    toolkit = tmp_path / "cuda-x"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").touch()
    (toolkit / "include").mkdir()
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("CUDA_PATH", str(toolkit))
    assert _build.cuda_home() == str(toolkit)
    monkeypatch.setenv("CUDA_HOME", "/explicit")
    assert _build.cuda_home() == "/explicit"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6")
    assert _build.cuda_arch_list() == "8.6"
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    if not torch.cuda.is_available():
        assert _build.cuda_arch_list() == _build.DEFAULT_ARCH_LIST


STATIC_LIBSTDCXX_PROBE = """
import torch
from singd_cuda.ops import _build
_build.load("cpu", strict=True)
try:
    torch.ops.singd_cuda.diag_precond_step_(
        [torch.zeros(2, 2)], [torch.zeros(2, 2)], [torch.zeros(2, 2)], [torch.ones(3)],
        [torch.ones(2)], "singd", 0.1, 0.9, 0.0, 0.0, False, 1, None, None, False, 0)
except RuntimeError as exc:
    print(str(exc).splitlines()[0])
"""


@pytest.mark.slow
def test_a_compiler_that_links_libstdcxx_statically_still_formats_errors(tmp_path):
    """A C++ compiler that links libstdc++ statically by default (a GPU machine's image had
    one as ``$CXX``) builds a library that uses the libstdc++ torch loads: an error message
    that formats numbers arrives whole (with a private copy it came out cut short after the
    first number here, and crashed the process there). Builds the CPU library afresh."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ here")
    wrapper = tmp_path / "g++"
    wrapper.write_text(f'#!/bin/sh\nexec {gxx} -static-libstdc++ "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "CXX": str(wrapper), "SINGD_CUDA_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-c", STATIC_LIBSTDCXX_PROBE],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "diag_precond_step_: row_scales[0] has 3 entries, expected 2"


def test_unknown_kind_raises():
    with pytest.raises(ValueError, match="unknown library kind"):
        _build.load("rocm")


def test_cli_build(cpu_ops):
    result = subprocess.run(
        [sys.executable, "-m", "singd_cuda.ops", "build"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "cpu ops ready" in result.stdout


# ---- lifecycle: one log line, environments, concurrent and killed builds --------------------

FAKE_BUILD = """
import os, sys, time
from singd_cuda.ops import _build

def fake_compile(kind, directory, verbose):  # like ninja: builds only what is missing
    library = directory / _build.library_path(kind).name
    if not library.exists():
        with open(os.environ["BUILD_COUNT"], "a") as count:
            count.write(kind + "\\n")
        time.sleep(float(os.environ.get("BUILD_SECONDS", "0")))
        library.write_bytes(b"")

_build._compile = fake_compile
_build._build_and_load("cuda", False)
print("built", flush=True)
"""

HOLD_LOCK = """
import fcntl, os, pathlib, time

directory = pathlib.Path(os.environ["BUILD_DIR"])
directory.mkdir(parents=True)
with open(directory / "build.lock", "a") as handle:  # as _build.build_lock takes it
    fcntl.flock(handle, fcntl.LOCK_EX)
    (directory / "lock").write_text("")  # an older cpp_extension's lock file
    print("locked", flush=True)
    time.sleep(120)
"""


def _fake_compile(calls):
    def fake(kind, directory, verbose):
        calls.append(kind)
        (directory / _build.library_path(kind).name).write_bytes(b"")

    return fake


def _python(script: str, tmp_path, **env):
    """A Python process running ``script`` with the build cache in tmp_path."""
    environment = {
        **os.environ,
        "SINGD_CUDA_CACHE_DIR": str(tmp_path / "cache"),
        "BUILD_COUNT": str(tmp_path / "count"),
        "TORCH_CUDA_ARCH_LIST": "9.0",
        **env,
    }
    return subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_first_build_logs_one_line(monkeypatch, tmp_path, caplog, capsys):
    monkeypatch.setenv("SINGD_CUDA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    calls = []
    monkeypatch.setattr(_build, "_compile", _fake_compile(calls))
    with caplog.at_level(logging.INFO, logger="singd_cuda.ops"):
        _build._build_and_load("cuda", False)
        _build._build_and_load("cuda", False)  # cached: loads without building
    assert calls == ["cuda", "cuda"]
    records = [r for r in caplog.records if r.name == "singd_cuda.ops"]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    assert "building the fused CUDA ops, once" in records[0].getMessage()
    assert capsys.readouterr().out == ""


def test_cache_key_separates_environments(monkeypatch, tmp_path):
    monkeypatch.setenv("SINGD_CUDA_CACHE_DIR", str(tmp_path))
    here = {kind: _build.build_dir(kind) for kind in _build.KINDS}
    other_tree = tmp_path / "checkout" / "csrc"
    shutil.copytree(_build.CSRC, other_tree)
    for target, attribute, value in [
        (torch, "__file__", str(tmp_path / "venv2" / "torch" / "__init__.py")),
        (sys, "prefix", str(tmp_path / "venv2")),
        (_build, "CSRC", other_tree),
    ]:
        with monkeypatch.context() as patch:
            patch.setattr(target, attribute, value)
            for kind in _build.KINDS:
                assert _build.build_dir(kind) != here[kind], (attribute, kind)
    assert {kind: _build.build_dir(kind) for kind in _build.KINDS} == here


def test_concurrent_processes_build_once(tmp_path):
    """Two processes (ranks started together) building into one empty cache: one builds,
    the other waits for it and loads its library."""
    procs = [_python(FAKE_BUILD, tmp_path, BUILD_SECONDS="2") for _ in range(2)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
        assert "built" in out
    assert (tmp_path / "count").read_text().split() == ["cuda"]
    assert sum("building the fused CUDA ops" in err for _, err in outputs) == 1


def test_killed_build_leaves_no_blocking_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("SINGD_CUDA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    directory = _build.build_dir("cuda")
    assert _build.LOCK_NAME == "build.lock"
    holder = _python(HOLD_LOCK, tmp_path, BUILD_DIR=str(directory))
    try:
        assert holder.stdout.readline().strip() == "locked"
    finally:
        holder.kill()  # a build killed midway, its lock held
        holder.communicate(timeout=60)
    builder = _python(FAKE_BUILD, tmp_path)
    out, err = builder.communicate(timeout=120)
    assert builder.returncode == 0, err
    assert "built" in out
    assert (tmp_path / "count").read_text().split() == ["cuda"]
    assert (directory / _build.library_path("cuda").name).exists()
    assert not (directory / "lock").exists()
