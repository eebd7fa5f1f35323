"""CPU step time, optimizer state and allocations of singd_cuda against its peers.

Competitors, for each structure: ours with the fused ops, ours on the pure-PyTorch reference
path (``SINGD_CUDA_FUSED=0``, switched per call), PyPI ``singd`` 0.0.5 (structures it
has), and the baselines torch AdamW (foreach) and AdamW (fused). Models: an MLP (3 x Linear
512, batch 128) and a small CNN (two 3x3 convs, 32 channels, 16x16 images, batch 64).

Within one block (model, dtype, T) every competitor has its own copy of the model (same
initial weights, same batches) and the timed steps (zero_grad, forward, backward,
optimizer.step) run round-robin over all competitors, so a burst of load from other
processes hits them alike, in a new random order every round and each after an untimed
step of the plain model (a step right after a heavy one, such as PyPI singd's Toeplitz step
that allocates ~100 MB, runs measurably slower; the untimed step absorbs that). The plain
model (zero_grad, forward, backward, no optimizer and no hooks) is one more competitor of
every round; a competitor's "statistics + step" time is its step time minus the plain
model's, i.e. what the optimizer adds: its hooks and statistics during the backward pass
(where PyPI singd also updates its factors) plus ``optimizer.step()``.

Times are per step, amortized over a period of T steps: ((T - 1) x the median step without
a curvature update + the median step with one) / T, so the statistics and factor updates of
one step in T count (a plain median would hide them); the plain median for T = 1. Ratios
are those of "statistics + step" against the baselines of the same block. Allocations are
those of one steady-state ``optimizer.step()`` (torch.profiler, profile_memory=True): a step
that updates no factors when T > 1, else an update step. State bytes: every tensor the
optimizer holds; ours also keeps K Kᵀ and C Cᵀ between factor updates where that pays off
(derived, not state), counted under "cache KiB".

*products*: for dense, block-diagonal and hierarchical SINGD, the time of the matrix products
its math requires per step, amortized over T like the steps, timed in the same rounds with
``torch.mm``/``torch.bmm`` on each layer's shapes (d_K = inputs + 1, d_C = outputs, N rows
of a and g): every step G (K Kᵀ) and (C Cᵀ)(.) with the cached K Kᵀ, C Cᵀ; every update,
per side with factor K (d x d) and statistic a (N x d), a K, Π̂((a K)ᵀ(a K)), Π̂(Kᵀ K),
K m and K Kᵀ. Block-diagonal: the same on the b x b blocks (``bmm``, plus the smaller last
block). Hierarchical (k1, k2): only the dense border rows of the factor, X[:, :k1] @ (k1 x d)
and X[:, -k2:] @ (k2 x d) per product with K, and the (k1 + k2) x N x d Gram rows: a lower
bound. ours / products is the optimizer's remaining overhead over that bound.

    python benchmarks/vs_peers.py --out benchmarks/results/vs_peers.md
    python benchmarks/vs_peers.py --quick  # a small grid, a few steps
    python benchmarks/vs_peers.py --models mlp --structures diagonal adafisher --T 10
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# this checkout, not whichever singd_cuda happens to be installed
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STRUCTURES = ["dense", "diagonal", "block_diagonal", "hierarchical", "tril_toeplitz", "adafisher"]
OURS_SPEC = {
    "dense": "dense",
    "diagonal": "diagonal",
    "block_diagonal": "block_diagonal:30",
    "hierarchical": "hierarchical:15,15",
    "tril_toeplitz": "tril_toeplitz",
    "adafisher": "adafisher",
}
PEER_SPEC = {  # PyPI singd 0.0.5 names; it has no AdaFisher
    "dense": "dense",
    "diagonal": "diagonal",
    "block_diagonal": "block30diagonal",
    "hierarchical": "hierarchical15_15",
    "tril_toeplitz": "triltoeplitz",
}
DTYPES = {"float32": None, "bf16-autocast": torch.bfloat16}
# ours / singd 0.0.5 at T = 10 (issue 12, re-scoped from 0.5): with cached K Kᵀ the exact
# work of a dense period is about 26 d³ against singd's 44 d³, a bound near 0.59
TARGET_VS_PEER = 0.65
PEER_TARGET_STRUCTURES = ("dense", "block_diagonal", "hierarchical")
TARGET_TOEPLITZ_VS_PEER = 0.05
TARGET_VS_ADAMW = 1.0  # ours diagonal / adafisher step vs AdamW (foreach)


def make_model(kind: str, seed: int = 0) -> tuple[nn.Module, Callable[[int], tuple]]:
    torch.manual_seed(seed)
    if kind == "mlp":
        model = nn.Sequential(
            nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)
        )
        shape, batch, classes = (512,), 128, 512
    else:
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 8 * 8, 10),
        )
        shape, batch, classes = (3, 16, 16), 64, 10
    gen = torch.Generator().manual_seed(seed + 1)
    data = [
        (
            torch.randn(batch, *shape, generator=gen),
            torch.randint(0, classes, (batch,), generator=gen),
        )
        for _ in range(8)
    ]
    return model, lambda t: data[t % len(data)]


@contextlib.contextmanager
def fused_env(fused: bool | None):
    """SINGD_CUDA_FUSED for the duration (None: leave it)."""
    if fused is None:
        yield
        return
    old = os.environ.get("SINGD_CUDA_FUSED")
    os.environ["SINGD_CUDA_FUSED"] = "1" if fused else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SINGD_CUDA_FUSED")
        else:
            os.environ["SINGD_CUDA_FUSED"] = old


@dataclass
class Runner:
    name: str
    structure: str
    model: nn.Module
    opt: torch.optim.Optimizer
    fused: bool | None
    batches: Callable[[int], tuple]
    autocast: torch.dtype | None
    period: int = 1  # T: the steps t with t % T == 0 update the curvature
    t: int = 0
    times: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    updates: list[bool] = field(default_factory=list)
    error: str | None = None

    def forward_backward(self) -> None:
        x, y = self.batches(self.t)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        with torch.autocast(
            "cpu", dtype=self.autocast or torch.bfloat16, enabled=bool(self.autocast)
        ):
            out = self.model(x)
        F.cross_entropy(out.float(), y).backward()

    def step(self, timed: bool) -> None:
        if self.error:
            return
        try:
            with fused_env(self.fused):
                start = time.perf_counter()
                self.forward_backward()
                mid = time.perf_counter()
                if self.opt is not None:
                    self.opt.step()
                end = time.perf_counter()
        except Exception as error:  # a peer that cannot run this case
            self.error = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
            return
        if timed:
            self.times.append(end - start)
            self.step_times.append(end - mid)
            self.updates.append(self.t % self.period == 0)
        self.t += 1

    def allocations(self, period: int) -> tuple[int, int]:
        """(ops that allocate, bytes allocated) in one steady-state optimizer.step()."""
        if self.error:
            return (-1, -1)
        with fused_env(self.fused):
            while period > 1 and self.t % period == 0:  # land on a step without factor update
                self.step(timed=False)
            self.forward_backward()
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            ) as prof:
                self.opt.step()
            self.t += 1
        count = size = 0
        for event in prof.events():  # ops that allocate themselves (not via a child op)
            if event.self_cpu_memory_usage > 0:
                count += 1
                size += event.self_cpu_memory_usage
        return count, size


def tensor_bytes(*values) -> int:
    """Storage bytes of every tensor reachable from ``values`` (through dicts, lists,
    tuples and plain objects such as structured matrices), each storage counted once."""
    seen: set[int] = set()

    def walk(value) -> int:
        if isinstance(value, torch.Tensor):
            key = value.untyped_storage().data_ptr()
            if key in seen:
                return 0
            seen.add(key)
            return value.untyped_storage().nbytes()
        if isinstance(value, dict):
            return sum(walk(v) for v in value.values())
        if isinstance(value, list | tuple):
            return sum(walk(v) for v in value)
        if hasattr(value, "__dict__") and not isinstance(value, nn.Module | type):
            return sum(walk(v) for v in vars(value).values())
        return 0

    return sum(walk(value) for value in values)


def cache_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of ours' derived caches between factor updates (K Kᵀ, C Cᵀ, c², k², ...)."""
    from singd_cuda.optim.derived import DerivedCache, GroupCache

    return tensor_bytes(
        *(
            values
            for rule in getattr(opt, "_rules", {}).values()
            for cache in vars(rule).values()
            if isinstance(cache, DerivedCache | GroupCache)
            for values in cache.values()
        )
    )


def state_bytes(opt: torch.optim.Optimizer) -> int:
    # PyPI singd keeps its factors in Ks, Cs, m_Ks, m_Cs
    peer = (getattr(opt, name, {}) for name in ("Ks", "Cs", "m_Ks", "m_Cs"))
    return tensor_bytes(dict(opt.state), *peer)


def layer_shapes(kind: str) -> list[tuple[int, int, int]]:
    """(d_K, d_C, N) of every Linear / Conv2d of the model on its batches."""
    model, batches = make_model(kind)
    shapes = []

    def hook(module, inputs, output):
        if isinstance(module, nn.Conv2d):
            d_in = module.in_channels // module.groups * math.prod(module.kernel_size)
            rows = output.shape[0] * output.shape[2:].numel()
        else:
            d_in, rows = module.in_features, output.numel() // output.shape[-1]
        shapes.append((d_in + (module.bias is not None), module.weight.shape[0], rows))

    handles = [
        m.register_forward_hook(hook)
        for m in model.modules()
        if isinstance(m, nn.Linear | nn.Conv2d)
    ]
    with torch.no_grad():
        model(batches(0)[0])
    for handle in handles:
        handle.remove()
    return shapes


class Products:
    """The matrix products one structure's SINGD math needs on a model (see the module
    docstring): :meth:`step` runs those of a step without and with a factor update."""

    def __init__(
        self,
        kind: str,
        structure: str,
        T: int,
        shapes: list[tuple[int, int, int]] | None = None,
        spec: str | None = None,
    ) -> None:
        """``shapes``: (d_K, d_C, N) per layer (default: ``layer_shapes(kind)``); ``spec``:
        the structure's spec string (default: ``OURS_SPEC[structure]``)."""
        self.period = T
        self.step_products: list[Callable[[], object]] = []
        self.update_products: list[Callable[[], object]] = []
        spec = spec or OURS_SPEC[structure]
        for d_K, d_C, rows in shapes or layer_shapes(kind):
            G = torch.randn(d_C, d_K)
            self.step_products += [self._times(spec, G, d_K), self._times(spec, G.T, d_C)]
            for d in (d_K, d_C):
                a = torch.randn(rows, d)
                square = torch.randn(d, d)
                self.update_products += [
                    self._times(spec, a, d),  # a K
                    self._gram(spec, a),  # Π̂((aK)ᵀ(aK))
                    self._gram(spec, square),  # Π̂(KᵀK)
                    self._times(spec, square, d),  # K m
                    self._times(spec, square, d),  # K Kᵀ
                ]
        self.t = 0
        self.times: list[float] = []
        self.updates: list[bool] = []

    @staticmethod
    def _times(spec: str, X, d: int) -> Callable[[], object]:
        """X @ K for a factor K of dimension d in structure ``spec``."""
        X = X.contiguous()
        structure = spec.split(":")[0]
        if structure == "dense":
            K = torch.randn(d, d)
            return lambda: torch.mm(X, K)
        if structure == "block_diagonal":
            b = int(spec.split(":")[1])
            n = d // b
            Xb = X[:, : n * b].reshape(-1, n, b).transpose(0, 1).contiguous()
            blocks, last = torch.randn(n, b, b), torch.randn(d - n * b, d - n * b)
            X_last = X[:, n * b :].contiguous()
            return lambda: (torch.bmm(Xb, blocks), torch.mm(X_last, last))
        k1, k2 = (int(k) for k in spec.split(":")[1].split(","))
        top, bottom = torch.randn(k1, d), torch.randn(k2, d)
        X1, X2 = X[:, :k1].contiguous(), X[:, -k2:].contiguous()
        return lambda: (torch.mm(X1, top), torch.mm(X2, bottom))

    @staticmethod
    def _gram(spec: str, Y) -> Callable[[], object]:
        """The products of Π̂(YᵀY) in structure ``spec``."""
        structure = spec.split(":")[0]
        if structure == "dense":
            return lambda: torch.mm(Y.T, Y)
        if structure == "block_diagonal":
            b = int(spec.split(":")[1])
            d = Y.shape[1]
            n = d // b
            Yb = Y[:, : n * b].reshape(-1, n, b).transpose(0, 1).contiguous()
            Y_last = Y[:, n * b :].contiguous()
            return lambda: (torch.bmm(Yb.transpose(1, 2), Yb), torch.mm(Y_last.T, Y_last))
        k1, k2 = (int(k) for k in spec.split(":")[1].split(","))
        border = torch.cat([Y[:, :k1], Y[:, -k2:]], dim=1).T.contiguous()
        return lambda: torch.mm(border, Y)

    def step(self, timed: bool) -> None:
        update = self.t % self.period == 0
        start = time.perf_counter()
        for product in self.step_products + (self.update_products if update else []):
            product()
        if timed:
            self.times.append(time.perf_counter() - start)
            self.updates.append(update)
        self.t += 1


PRODUCT_STRUCTURES = ("dense", "block_diagonal", "hierarchical")


def build_runners(kind: str, structures: list[str], T: int, autocast, competitors: list[str]):
    from singd_cuda import SINGD

    base, batches = make_model(kind)
    runners: list[Runner] = [
        Runner("plain", "-", copy.deepcopy(base), None, None, batches, autocast)
    ]

    def add(name, structure, make_opt, fused=None):
        model = copy.deepcopy(base)
        try:
            opt = make_opt(model)
        except Exception as error:
            r = Runner(name, structure, model, None, fused, batches, autocast)  # type: ignore[arg-type]
            r.error = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
            runners.append(r)
            return
        runners.append(Runner(name, structure, model, opt, fused, batches, autocast, period=T))

    hyper = dict(lr=1e-3, momentum=0.9, damping=1e-3, T=T)
    for s in structures:
        for fused, label in ((True, "ours"), (False, "ours-ref")):
            if label in competitors:
                if s == "adafisher":
                    make = lambda m: SINGD(m, structures="adafisher", **hyper)  # noqa: E731
                else:
                    make = lambda m, s=s: SINGD(m, structures=OURS_SPEC[s], lr_cov=1e-2, **hyper)  # noqa: E731
                add(label, s, make, fused)
        if "singd" in competitors and s in PEER_SPEC:
            from singd.optim.optimizer import SINGD as PEER_SINGD

            spec = PEER_SPEC[s]
            add(
                "singd-0.0.5",
                s,
                lambda m, spec=spec: PEER_SINGD(
                    m, structures=(spec, spec), lr_cov=1e-2, warn_unsupported=False, **hyper
                ),
            )
    if "adamw-foreach" in competitors:
        add(
            "adamw-foreach", "-", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)
        )
    if "adamw-fused" in competitors:
        add("adamw-fused", "-", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True))
    return runners


def run_block(kind, dtype_name, T, structures, competitors, steps, warmup) -> list[dict]:
    runners = build_runners(kind, structures, T, DTYPES[dtype_name], competitors)
    plain, runners = runners[0], runners[1:]
    products = {s: Products(kind, s, T) for s in structures if s in PRODUCT_STRUCTURES}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        order = random.Random(0)
        timed = [plain, *runners, *products.values()]
        for i in range(warmup + steps):
            for r in order.sample(timed, len(timed)):
                plain.step(timed=False)  # settles what the previous competitor left behind
                r.step(timed=i >= warmup)
        rows = []
        for r in runners:
            count, size = r.allocations(T)
            rows.append(
                dict(
                    model=kind,
                    dtype=dtype_name,
                    T=T,
                    structure=r.structure,
                    name=r.name,
                    median_ms=amortized_ms(r.times, r.updates, T),
                    overhead_ms=amortized_ms(r.times, r.updates, T) - median_ms(plain.times),
                    step_ms=amortized_ms(r.step_times, r.updates, T),
                    plain_ms=median_ms(plain.times),
                    state_bytes=state_bytes(r.opt) if r.opt is not None else -1,
                    cache_bytes=cache_bytes(r.opt) if r.opt is not None else -1,
                    alloc_count=count,
                    alloc_bytes=size,
                    grad_bytes=sum(p.numel() * p.element_size() for p in r.model.parameters()),
                    error=r.error,
                    products_ms=(
                        amortized_ms(products[r.structure].times, products[r.structure].updates, T)
                        if r.structure in products
                        else float("nan")
                    ),
                )
            )
    base = {row["name"]: row["overhead_ms"] for row in rows if row["structure"] == "-"}
    peer = {row["structure"]: row["overhead_ms"] for row in rows if row["name"] == "singd-0.0.5"}
    for row in rows:
        row["vs_foreach"] = row["overhead_ms"] / base.get("adamw-foreach", float("nan"))
        row["vs_fused"] = row["overhead_ms"] / base.get("adamw-fused", float("nan"))
        row["vs_peer"] = row["overhead_ms"] / peer.get(row["structure"], float("nan"))
    return rows


def median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds) if seconds else float("nan")


def amortized_ms(seconds: list[float], updates: list[bool], T: int) -> float:
    """Per-step cost over a period of T steps: ((T - 1) x the median step without a
    curvature update + the median step with one) / T. A plain median would hide the
    update steps (one in T), where the statistics and factor updates happen."""
    regular = [t for t, u in zip(seconds, updates, strict=True) if not u]
    update = [t for t, u in zip(seconds, updates, strict=True) if u]
    if not regular or not update:
        return median_ms(seconds)
    return ((T - 1) * median_ms(regular) + median_ms(update)) / T


def fmt(value: float, digits: int = 2) -> str:
    return "-" if value != value else f"{value:.{digits}f}"


def targets(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        if row["name"] != "ours" or row["error"]:
            continue
        where = f"{row['model']} {row['dtype']} T={row['T']} {row['structure']}"
        shared = row["structure"] in (*PEER_TARGET_STRUCTURES, "tril_toeplitz")
        if row["T"] == 10 and shared and row["vs_peer"] == row["vs_peer"]:
            goal = (
                TARGET_TOEPLITZ_VS_PEER if row["structure"] == "tril_toeplitz" else TARGET_VS_PEER
            )
            ok = row["vs_peer"] <= goal
            verdict = "met" if ok else "MISSED"
            bound = ""
            if row["products_ms"] == row["products_ms"]:
                peer_ms = row["overhead_ms"] / row["vs_peer"]
                bound = f"; the products alone: {fmt(row['products_ms'] / peer_ms)}"
            lines.append(
                f"- {verdict}: ours/singd (stats + step) {fmt(row['vs_peer'])} <= {goal} "
                f"({where}{bound})"
            )
        dense = next(
            (
                r
                for r in rows
                if r["name"] == "ours"
                and r["structure"] == "dense"
                and (r["model"], r["dtype"], r["T"]) == (row["model"], row["dtype"], row["T"])
            ),
            None,
        )
        if row["structure"] == "tril_toeplitz" and dense is not None and not dense["error"]:
            ok = row["overhead_ms"] <= dense["overhead_ms"]
            lines.append(
                f"- {'met' if ok else 'MISSED'}: tril_toeplitz (stats + step) "
                f"{fmt(row['overhead_ms'])} ms <= dense {fmt(dense['overhead_ms'])} ms ({where})"
            )
        if row["structure"] not in ("diagonal", "adafisher"):
            ok = row["alloc_bytes"] <= row["grad_bytes"]
            lines.append(
                f"- {'met' if ok else 'MISSED'}: {row['alloc_bytes'] / 1024:.0f} KiB allocated "
                f"per steady-state step <= one gradient ({row['grad_bytes'] / 1024:.0f} KiB): "
                f"{row['alloc_bytes'] / row['grad_bytes']:.2f} gradients ({where})"
            )
        if row["structure"] in ("diagonal", "adafisher"):
            ok = row["vs_foreach"] <= TARGET_VS_ADAMW
            verdict = "met" if ok else "MISSED"
            ratio = fmt(row["vs_foreach"])
            lines.append(
                f"- {verdict}: ours/AdamW-foreach (stats + step) {ratio} <= {TARGET_VS_ADAMW} "
                f"({where})"
            )
            ok = row["alloc_bytes"] == 0
            verdict = "met" if ok else "MISSED"
            lines.append(
                f"- {verdict}: {row['alloc_bytes']} bytes in {row['alloc_count']} "
                f"allocations per steady-state step == 0 ({where})"
            )
    return lines


def report(rows: list[dict], args, elapsed: float) -> str:
    lines = [
        "# singd_cuda vs peers on the CPU",
        "",
        f"Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        "",
        f"Date: {datetime.datetime.now().isoformat(timespec='minutes')}; "
        f"machine: {platform.machine()}, "
        f"{platform.processor() or platform.platform()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads); run took {elapsed:.0f} s; "
        f"{args.steps} timed steps per competitor (after {args.warmup} warm-up), interleaved; "
        f"load average (1 min) before / after: {args.load[0]:.2f} / {os.getloadavg()[0]:.2f} "
        "(other processes on the machine add noise).",
        "",
        "Times in ms per step, amortized over a period of T steps: ((T - 1) x the median "
        "step without a curvature update + the median update step) / T (the plain median "
        "for T = 1). *total*: zero_grad + forward + backward + optimizer.step. "
        "*stats + step*: total minus the plain model's median forward + backward (same rounds) "
        "(what the optimizer adds, statistics and factor updates included). *step*: "
        "optimizer.step() alone (PyPI singd updates its factors in backward hooks, outside "
        "it). Ratios: *stats + step* against the baselines of the same block. Alloc: ops "
        "that allocate (count) and bytes allocated in one steady-state optimizer.step().",
        "",
        "| model | dtype | T | structure | optimizer | total | stats + step | step | products | "
        "/ singd 0.0.5 | / AdamW foreach | / AdamW fused | state KiB | cache KiB | alloc n "
        "| alloc KiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    plain = {}
    for row in rows:
        plain.setdefault((row["model"], row["dtype"], row["T"]), row["plain_ms"])
    for row in rows:
        head = "| " + " | ".join(str(row[k]) for k in ("model", "dtype", "T", "structure", "name"))
        head += " | "
        if row["error"]:
            lines.append(f"{head}error: {row['error']} |" + " |" * 10)
            continue
        lines.append(
            f"{head}{fmt(row['median_ms'])} | {fmt(row['overhead_ms'])} | {fmt(row['step_ms'])} | "
            f"{fmt(row['products_ms'])} | {fmt(row['vs_peer'])} | {fmt(row['vs_foreach'])} | "
            f"{fmt(row['vs_fused'])} | "
            f"{row['state_bytes'] / 1024:.0f} | {row['cache_bytes'] / 1024:.0f} | "
            f"{row['alloc_count']} | {row['alloc_bytes'] / 1024:.1f} |"
        )
    lines += [
        "",
        "Plain model forward + backward (median ms): "
        + "; ".join(f"{m} {d} T={t}: {fmt(v)}" for (m, d, t), v in plain.items()),
        "",
        "## Targets (issues 4 and 12, CPU)",
        "",
        *targets(rows),
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    parser.add_argument("--structures", nargs="+", default=STRUCTURES, choices=STRUCTURES)
    parser.add_argument("--T", nargs="+", type=int, default=[1, 10], dest="periods")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument(
        "--competitors",
        nargs="+",
        default=["ours", "ours-ref", "singd", "adamw-foreach", "adamw-fused"],
        choices=["ours", "ours-ref", "singd", "adamw-foreach", "adamw-fused"],
    )
    parser.add_argument(
        "--steps", type=int, default=40, help="timed steps per competitor (4 updates at T=10)"
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true", help="mlp, float32, T=10, few steps")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.dtypes, args.periods = ["mlp"], ["float32"], [10]
        args.steps, args.warmup = min(args.steps, 5), min(args.warmup, 1)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from singd_cuda import ops

    ops.fused_available("cpu")  # build / load before timing
    start = time.perf_counter()
    args.load = os.getloadavg()
    rows: list[dict] = []
    for kind in args.models:
        for dtype_name in args.dtypes:
            for T in args.periods:
                block = run_block(
                    kind, dtype_name, T, args.structures, args.competitors, args.steps, args.warmup
                )
                rows += block
                print(
                    f"{kind} {dtype_name} T={T}: done ({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
    text = report(rows, args, time.perf_counter() - start)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
