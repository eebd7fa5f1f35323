"""The JIT build: cache keys, toolkit defaults, the fallback on a failed build, the CLI."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from singd_cuda import ops
from singd_cuda.ops import _build, reference


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


def test_unknown_kind_raises():
    with pytest.raises(ValueError, match="unknown library kind"):
        _build.load("rocm")


def test_cli_build(cpu_ops):
    result = subprocess.run(
        [sys.executable, "-m", "singd_cuda.ops", "build"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "cpu ops ready" in result.stdout
