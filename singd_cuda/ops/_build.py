"""JIT build and loading of the fused ops (``torch.utils.cpp_extension.load`` with ninja).

Two shared libraries are built from ``csrc/`` (shipped inside the package as
``singd_cuda/csrc``):

- ``cpu``: the ``singd_cuda`` op schemas and the CPU kernels; needs a C++ compiler only.
- ``cuda``: the CUDA kernels; needs ``nvcc`` (not a GPU) and is loaded after ``cpu``.

Each is built once into ``<cache>/torch-<version>-py<X.Y>/<kind>-<hash>``, where the hash
covers the sources the library compiles, the build flags (and, for CUDA, the architecture
list and ``CUDA_HOME``) and the environment: the torch installation (its directory, build
and CUDA version), the Python interpreter and the source tree's location. A changed source
or flag builds afresh, an unchanged one loads from the cache, and two environments (two
virtualenvs, two checkouts) sharing one cache never rebuild each other's library.
``<cache>`` is ``$SINGD_CUDA_CACHE_DIR``, else ``$XDG_CACHE_HOME/singd_cuda``, else
``~/.cache/singd_cuda``.

Concurrent processes (ranks started together by torchrun) build once: the builder holds an
exclusive ``flock`` on ``<dir>/build.lock``, which the operating system releases when the
holder exits or is killed, and the others wait for it and then load its library. A lock
file left by a killed build therefore blocks nothing. The first build of a library logs
one line (logger ``singd_cuda.ops``, level WARNING) saying it builds once and how long
that takes.

The floating-point contract is off on both sides (``-ffp-contract=off``, nvcc
``--fmad=false``, IEEE division and denormals): every multiply and add of
``singd_math.h`` rounds once, as in the reference's separate tensor ops, so the fused
CPU, fused CUDA and reference paths round alike, bit for bit. The CPU library's element
loops and column sums are built for AVX2 and for baseline x86-64 and the loader picks one
per CPU (``csrc/cpu/vector_isa.h``); both compute every element by the same operations.

When unset, ``CUDA_HOME`` defaults to the first CUDA toolkit found among ``$CUDA_PATH``,
``/usr/local/cuda`` and the toolkit of the ``nvcc`` on ``PATH``, and
``TORCH_CUDA_ARCH_LIST`` to the compute capabilities of the visible GPUs (``9.0`` when
there are none); both are set only for the duration of the build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = {
    "cpu": ("registration.cpp", "cpu/elementwise.cpp", "cpu/reductions.cpp", "cpu/normalise.cpp"),
    "cuda": (
        "cuda/diag_step.cu",
        "cuda/reductions.cu",
        "cuda/epilogue.cu",
        "cuda/factor_update.cu",
        "cuda/normalise.cu",
    ),
}
SOURCE_SUFFIXES = (".h", ".cuh", ".cpp", ".cu")
CFLAGS = ("-O3", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp")
# libstdc++ named explicitly: a compiler that links it statically by default (a GCC with
# -static-libstdc++ in its specs or wrapper) would put a private copy into the library,
# whose locale facets do not match the libstdc++ that torch loads (an error message that
# formats a number came out cut short, or crashed the process).
LDFLAGS = ("-fopenmp", "-lstdc++")
# No FMA contraction, IEEE division, no flush to zero: the element math rounds like the CPU
# kernels and the reference (the kernels are memory-bound; the extra instructions are free).
CUDA_FLAGS = (
    "-O3",
    "--fmad=false",
    "--prec-div=true",
    "--prec-sqrt=true",
    "--ftz=false",
    "-Xcompiler=-ffp-contract=off",
)
# Rough duration of a first build, for the one log line that announces it.
BUILD_TIME = {"cpu": "~1 min", "cuda": "a few minutes"}
LOCK_NAME = "build.lock"
DEFAULT_ARCH_LIST = "9.0"
KINDS = tuple(SOURCES)
OP_NAMES = (
    "sgd_epilogue_",
    "adam_epilogue_",
    "diag_precond_step_",
    "diag_factor_update_",
    "col_sum_squares",
    "input_sum_squares",
    "conv2d_patch_sum_squares",
)

_loaded: dict[str, bool] = {}
_log = logging.getLogger("singd_cuda.ops")


def fused_enabled() -> bool:
    """False when ``SINGD_CUDA_FUSED=0`` asks for the pure-PyTorch reference path."""
    return os.environ.get("SINGD_CUDA_FUSED", "1") != "0"


def cache_root() -> Path:
    """Root of the build cache (see the module docstring)."""
    if os.environ.get("SINGD_CUDA_CACHE_DIR"):
        return Path(os.environ["SINGD_CUDA_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "singd_cuda"


def cuda_home() -> str | None:
    """The CUDA toolkit to build with: ``$CUDA_HOME``, else the first toolkit found."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    candidates = [os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for home in filter(None, candidates):
        if (Path(home) / "bin" / "nvcc").exists() and (Path(home) / "include").is_dir():
            return home
    return None


def cuda_arch_list() -> str:
    """``$TORCH_CUDA_ARCH_LIST``, else the visible GPUs' capabilities, else ``9.0``."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    if torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return ";".join(f"{major}.{minor}" for major, minor in sorted(caps))
    return DEFAULT_ARCH_LIST


def _settings(kind: str) -> dict[str, str]:
    """Everything besides the sources that changes the built library."""
    settings = {
        "kind": kind,
        "cflags": " ".join(CFLAGS),
        "ldflags": " ".join(LDFLAGS),
        "cxx": os.environ.get("CXX", "c++"),
        # the environment: another torch install or source tree builds its own library
        "torch_dir": str(Path(torch.__file__).resolve().parent),
        "torch_build": f"{torch.version.git_version} cuda={torch.version.cuda}",
        "python": sys.prefix,
        "csrc": str(CSRC),
    }
    if kind == "cuda":
        settings.update(
            cuda_flags=" ".join(CUDA_FLAGS),
            arch_list=cuda_arch_list(),
            cuda_home=str(cuda_home()),
        )
    return settings


def build_dir(kind: str) -> Path:
    """The cache directory of one library kind for the current sources and settings."""
    digest = hashlib.sha256()
    other = {"cpu": "cuda", "cuda": "cpu"}[kind]
    sources = (p for p in CSRC.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.parent.name != other)
    for path in sorted(sources):
        digest.update(path.relative_to(CSRC).as_posix().encode())
        digest.update(path.read_bytes())
    for key, value in sorted(_settings(kind).items()):
        digest.update(f"{key}={value}".encode())
    version = f"torch-{torch.__version__}-py{sys.version_info.major}.{sys.version_info.minor}"
    return cache_root() / version / f"{kind}-{digest.hexdigest()[:16]}"


@contextlib.contextmanager
def _build_environment(kind: str) -> Iterator[object]:
    """cpp_extension with CUDA_HOME and TORCH_CUDA_ARCH_LIST set for a CUDA build."""
    overrides = {}
    if kind == "cuda":
        home = cuda_home()
        if home is None:
            raise RuntimeError("no CUDA toolkit found: set CUDA_HOME to one that has bin/nvcc")
        overrides = {"CUDA_HOME": home, "TORCH_CUDA_ARCH_LIST": cuda_arch_list()}
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    # Importing cpp_extension without a GPU logs a warning about CUDA_HOME; it is noise here.
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        cpp_extension = importlib.import_module("torch.utils.cpp_extension")
        saved_home = cpp_extension.CUDA_HOME
        if kind == "cuda":
            cpp_extension.CUDA_HOME = overrides["CUDA_HOME"]
        try:
            yield cpp_extension
        finally:
            cpp_extension.CUDA_HOME = saved_home
    finally:
        log.setLevel(level)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def library_path(kind: str) -> Path:
    """The shared library ``kind`` builds into (it exists once built)."""
    return build_dir(kind) / f"singd_cuda_{kind}_ops.so"


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Exclusive ``flock`` on ``directory/build.lock``, waiting for another holder.

    The operating system releases the lock when its holder exits or is killed, so no
    stale lock survives a killed build. Holding it, nothing else builds in ``directory``:
    a ``lock`` file that an older ``cpp_extension`` left from a killed build (its lock is
    the file's existence) is stale and removed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_NAME, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log.info("singd_cuda: waiting for another process building in %s", directory)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compile(kind: str, directory: Path, verbose: bool) -> None:
    """Build (ninja: only what is out of date) and load the ``kind`` library."""
    with _build_environment(kind) as cpp_extension:
        cpp_extension.load(
            name=f"singd_cuda_{kind}_ops",
            sources=[str(CSRC / source) for source in SOURCES[kind]],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            extra_cuda_cflags=list(CUDA_FLAGS),
            extra_include_paths=[str(CSRC)],
            build_directory=str(directory),
            with_cuda=kind == "cuda",
            is_python_module=False,
            verbose=verbose,
        )


def _build_and_load(kind: str, verbose: bool) -> None:
    directory = build_dir(kind)
    with build_lock(directory):
        if not library_path(kind).exists():
            _log.warning(
                "singd_cuda: building the fused %s ops, once, %s (cached in %s)",
                kind.upper(),
                BUILD_TIME[kind],
                directory,
            )
        _compile(kind, directory, verbose)
    if kind == "cpu":
        importlib.import_module(f"{__package__}._fake")


def load(kind: str, *, strict: bool = False, verbose: bool = False) -> bool:
    """Build (once, cached) and load the ``kind`` library; True when its ops are usable.

    ``cuda`` loads ``cpu`` first. A failed build warns once and returns False (the callers
    then take the reference path), or raises when ``strict``.
    """
    if kind not in SOURCES:
        raise ValueError(f"unknown library kind {kind!r}; expected one of {KINDS}")
    if kind in _loaded:
        return _loaded[kind]
    if kind == "cuda" and not load("cpu", strict=strict, verbose=verbose):
        _loaded[kind] = False
        return False
    try:
        _build_and_load(kind, verbose)
    except Exception as exc:
        if strict:
            raise
        summary = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(
            f"singd_cuda: building the fused {kind.upper()} ops failed ({summary}); using the "
            f"pure-PyTorch reference path. `python -m singd_cuda.ops build"
            f"{' --cuda' if kind == 'cuda' else ''}` shows the full compiler output; "
            "SINGD_CUDA_FUSED=0 selects the reference path without trying to build.",
            RuntimeWarning,
            stacklevel=3,
        )
        _loaded[kind] = False
        return False
    _loaded[kind] = True
    return True
