"""Host cost of the optimizers: overhead per layer against torch AdamW, and device reads.

Two models, single-threaded (``torch.set_num_threads(1)``), every optimizer interleaved
with the plain model (forward + backward, no optimizer, no hooks) in one run, in rounds:
one iteration each per round (the default), or with ``--block N`` one untimed and N timed
consecutive iterations each per round. The order is shuffled every round (a fixed seed),
so that no competitor always follows the same one: on the mlp the K-FAC rows' step sweeps
megabytes and leaves the caches cold for whichever comes next (measured: +0.6 ms on the
next competitor's forward + backward of 5.9 ms). One iteration each is the fairest to load
drift, but each iteration then follows another competitor's and finds the caches and
branch predictors cold, which costs more the more host code a competitor runs; in training
an optimizer's step follows its own last one, as in a block:

- ``tiny``: 64 x (Linear(16, 16) + Tanh), batch 8. The arithmetic is negligible, so the
  overhead is host work: Python and op dispatch per layer, which is what a GPU step pays
  when its kernels take microseconds.
- ``mlp``: 3 x Linear(512, 512) with ReLU, batch 128.

Overhead = (forward + backward + step) - the plain model's forward + backward, amortized
over a period of T steps (``vs_peers.amortized_ms``), per preconditioned layer, and its
ratio to AdamW (foreach)'s overhead, with the middle 90 % of that ratio over resamples
of the rounds (:func:`ratio_interval`): the run's own spread, against which a target is
read. ``reads`` counts the device->host reads the library
makes in one period of T steady-state iterations: calls of ``Tensor.item``, ``__bool__``,
``__float__``, ``__int__`` or ``tolist`` on a floating-point or boolean tensor with a
``singd_cuda`` frame on the stack, by call site. On a GPU each one is a synchronisation.
Not counted: torch's own reads (foreach AdamW's of its CPU step counters; fused AdamW on a
GPU makes none) and the capture's int64 counters and tokens, which live on the host by
design whatever the model's device.

``floor``: a minimal optimizer written here, not a user-facing class (:class:`Floor`): a
forward hook writing the input's column sums of squares into a preallocated buffer row, an
output-gradient hook (``register_hook`` on the output) writing the other side's, and a
``torch._foreach_`` step doing AdaFisher's diagonal work (EMAs, min-max normalisation,
s' x h' + damping, momentum, the bias-corrected update). Every row is read against AdamW
and against this floor. ``floor + the capture contract`` (:class:`ContractFloor`) adds
the hooks the library's capture contract needs and nothing else: a post-accumulate-grad
hook per weight that commits the staged row and a callback per backward pass that drops
the uncommitted ones; the same ops, so it prices the contract's Python hooks alone.
``floor + K-FAC's inversions`` (:class:`InvertingFloor`) adds the
two damped inversions per layer that K-FAC makes when it inverts every step, one
``torch.linalg.inv_ex`` per matrix as K-FAC calls them. ``K-FAC's floor`` (:class:`KfacFloor`)
is K-FAC's own work at T=1 written the same minimal way (hooks writing aᵀa and gᵀg into
stacked rows, the EMAs, the products and the write on stacks and foreach lists; the same
trajectory as ``KFAC`` in float64): the bound of the two K-FAC rows, between inversions and
(``, inverting every step``) with its per-matrix inversions at every step. Per layer per
iteration (whole iterations, forward + backward + step, over a few steady-state
iterations, a whole number of T periods): Python and C function calls
(``sys.setprofile``'s 'call' and 'c_call' events, C being builtins such as ``list.append``
and torch's bindings; on a CPU the backward runs in the calling thread, so its hooks are
counted; the iteration zeroes the gradients from a list, since resuming
``model.parameters()``'s nested generators would count as calls); ``ops``, dispatcher ops
(a ``TorchDispatchMode`` counting the ops that reach it: the top-level ops after autograd,
backward included, custom ops as one, the ops a C++ kernel calls inside not seen); and
``GC / iter``, garbage collections per iteration (``gc.callbacks``, every generation, over
200 steady-state iterations of that competitor alone, 40 after a full collection).

    python benchmarks/host_cost.py --out benchmarks/results/host_cost.md
    python benchmarks/host_cost.py --block 20 --out benchmarks/results/host_cost_blocks.md
    python benchmarks/host_cost.py --models tiny --steps 20  # quick look
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_peers import amortized_ms, median_ms

import singd_cuda
from singd_cuda import KFAC, SINGD, AdaFisher

READS = ("item", "__bool__", "__float__", "__int__", "tolist")
_INV_EX = torch.linalg.inv_ex  # K-FAC's inversion: torch.linalg.inv without its error check
PACKAGE = str(Path(singd_cuda.__file__).resolve().parent)
MODELS = {
    # name: (layers, width, batch, activation)
    "tiny": (64, 16, 8, nn.Tanh),
    "mlp": (3, 512, 128, nn.ReLU),
}


def optimizers() -> dict[str, tuple[int, Callable[[nn.Module], torch.optim.Optimizer]]]:
    """name -> (T, model -> optimizer); AdamW (foreach) is the baseline."""
    return {
        "AdamW (foreach)": (1, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)),
        "floor (hooks into buffers + foreach step)": (1, lambda m: Floor(m, lr=1e-4)),
        "floor + the capture contract (commit hooks, end-of-pass callback)": (
            1,
            lambda m: ContractFloor(m, lr=1e-4),
        ),
        "floor + K-FAC's inversions (2 per layer, one torch.linalg.inv_ex each)": (
            1,
            lambda m: InvertingFloor(m, lr=1e-4),
        ),
        "K-FAC's floor (grams into stacks, stacked EMA and products, T=1, between inversions)": (
            1,
            lambda m: KfacFloor(m, lr=1e-4),
        ),
        "K-FAC's floor, inverting every step": (
            1,
            lambda m: KfacFloor(m, lr=1e-4, invert_every_step=True),
        ),
        "AdaFisher (T=1)": (1, lambda m: AdaFisher(m, lr=1e-4)),
        "AdaFisher (T=1), nonfinite='device'": (
            1,
            lambda m: AdaFisher(m, lr=1e-4, nonfinite="device"),
        ),
        "SINGD diagonal T=1": (1, lambda m: SINGD(m, lr=1e-4, structures="diagonal", T=1)),
        "SINGD diagonal T=1, nonfinite='device'": (
            1,
            lambda m: SINGD(m, lr=1e-4, structures="diagonal", T=1, nonfinite="device"),
        ),
        "SINGD diagonal T=10": (10, lambda m: SINGD(m, lr=1e-4, structures="diagonal", T=10)),
        "SINGD block_diagonal:32 T=1": (1, lambda m: SINGD(m, lr=1e-4, T=1)),
        "SINGD block_diagonal:32 T=10": (10, lambda m: SINGD(m, lr=1e-4, T=10)),
        "K-FAC T=1 (between inversions)": (1, lambda m: KFAC(m, lr=1e-4, T=1, T_inv=10**9)),
        "K-FAC T=1 (inverting every step)": (1, lambda m: KFAC(m, lr=1e-4, T=1, T_inv=1)),
    }


def _linear_layers(model) -> tuple[list[nn.Linear], int, int]:
    """The floors' model: its ``nn.Linear`` layers, all of one shape (d_out, d_in) with a
    bias, and that shape."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    d_out, d_in = layers[0].weight.shape
    assert all(m.weight.shape == (d_out, d_in) and m.bias is not None for m in layers)
    return layers, d_out, d_in


def _weight_and_bias_views(stack: torch.Tensor) -> list[torch.Tensor]:
    """Per layer of an (L, d_out, d_in + 1) stack, the views shaped like its weight
    (columns :d_in) and its bias (column d_in), in the order of the parameter lists."""
    return [v for matrix in stack for v in (matrix[:, :-1], matrix[:, -1])]


class Floor:
    """The floor: AdaFisher's diagonal work at T=1 with nothing else, for a model whose
    layers are all ``nn.Linear`` of one shape (d_out, d_in) with a bias.

    Per layer and pass, one reduction per side into its row of a preallocated (L, d)
    buffer: the forward hook writes sum_n x² (L, d_in) and registers the output-gradient
    hook, which writes sum_n g² (L, d_out). The step, per stacked buffer and over the
    parameter lists: h <- γh + (1-γ)·mean x², s <- γs + (1-γ)·N·sum g² (a mean loss),
    min-max normalised, F = s' ⊗ h' + λ (L, d_out, d_in + 1, the bias as column d_in),
    m <- βm + (1-β)g and θ <- θ - lr·(m/(1-βᵗ))/F over ``torch._foreach_`` lists.
    """

    def __init__(self, model, lr, beta=0.9, gamma=0.8, damping=1e-2):
        layers, d_out, d_in = _linear_layers(model)
        self.layers = layers
        new = layers[0].weight.new_zeros
        L = len(layers)
        self.lr, self.beta, self.gamma, self.damping = lr, beta, gamma, damping
        self.t, self.n = 0, 1  # the update count; the last batch size
        self.h, self.h_new = new(L, d_in + 1), new(L, d_in + 1)
        self.s, self.s_new = new(L, d_out), new(L, d_out)
        self.h_norm, self.s_norm, self.F = new(L, d_in + 1), new(L, d_out), new(L, d_out, d_in + 1)
        self.low, self.span = new(L, 1), new(L, 1)
        self.params = [p for m in layers for p in (m.weight, m.bias)]
        self.data = [p.detach() for p in self.params]  # written in place outside autograd
        self.moms = [torch.zeros_like(p) for p in self.params]
        self.scales = _weight_and_bias_views(self.F)
        for i, layer in enumerate(layers):
            layer.register_forward_hook(self._forward_hook(self.h_new[i, :d_in], self.s_new[i]))

    def _forward_hook(self, in_row, out_row):
        grad_hook = self._grad_hook(out_row)

        def hook(module, inputs, output):
            x = inputs[0].detach()
            self.n = x.shape[0]
            torch.sum(x.square(), 0, out=in_row)
            output.register_hook(grad_hook)

        return hook

    def _grad_hook(self, out_row):
        def grad_hook(g):
            torch.sum(g.square(), 0, out=out_row)

        return grad_hook

    def _normalise(self, v, out):
        torch.aminmax(v, dim=1, keepdim=True, out=(self.low, self.span))
        self.span.sub_(self.low).clamp_min_(torch.finfo(v.dtype).tiny)
        torch.sub(v, self.low, out=out).div_(self.span)

    def step(self):
        self.h_new[:, -1].fill_(self.n)  # the bias column: sum_n 1²
        self.h.mul_(self.gamma).add_(self.h_new, alpha=(1 - self.gamma) / self.n)
        self.s.mul_(self.gamma).add_(self.s_new, alpha=(1 - self.gamma) * self.n)
        self._normalise(self.h, self.h_norm)
        self._normalise(self.s, self.s_norm)
        torch.mul(self.s_norm.unsqueeze(2), self.h_norm.unsqueeze(1), out=self.F).add_(self.damping)
        self.t += 1
        torch._foreach_lerp_(self.moms, [p.grad for p in self.params], 1 - self.beta)
        updates = torch._foreach_div(self.moms, self.scales)
        torch._foreach_add_(self.data, updates, alpha=-self.lr / (1 - self.beta**self.t))


class InvertingFloor(Floor):
    """The floor plus the work K-FAC adds when it inverts every step and nothing else:
    per layer, (A + λI)⁻¹ of a (d_in + 1)² and (G + λI)⁻¹ of a d_out² factor, one
    ``torch.linalg.inv_ex`` per matrix as K-FAC calls it (a batched call is faster but not
    bitwise the same for every size), written into kept buffers by one foreach copy per
    side. The factors stay λ-damped identities: LAPACK's time does not depend on them."""

    def __init__(self, model, lr, **kwargs):
        super().__init__(model, lr, **kwargs)
        L, d_out, d_in = self.F.shape
        self.factors = [
            torch.eye(d, dtype=self.F.dtype).mul_(1 + self.damping).expand(L, d, d).clone()
            for d in (d_in, d_out)
        ]
        self.inverses = [list(torch.empty_like(factor).unbind(0)) for factor in self.factors]

    def step(self):
        super().step()
        for factor, inverses in zip(self.factors, self.inverses, strict=True):
            torch._foreach_copy_(inverses, [inverse for inverse, _ in map(_INV_EX, factor)])


class KfacFloor:
    """The floor of the K-FAC rows: K-FAC's work at T=1 with nothing else, for a model
    whose layers are all ``nn.Linear`` of one shape (d_out, d_in) with a bias, and a loss
    that is a mean over the batch (N rows).

    Per layer and pass: the forward hook forms a = [x, 1] / √N (N, d_in + 1) and writes
    aᵀa into its row of a preallocated (L, d_in + 1, d_in + 1) stack, and registers the
    output-gradient hook, which writes gᵀg into its row of an (L, d_out, d_out) stack. The
    step: A ← ρA + (1-ρ)A_new and G ← ρG + (1-ρ)·N·G_new on the stacks (the first update
    takes them as they are); the damped inverses (A + √λI)⁻¹ and (G + √λI)⁻¹ at the first
    step (``invert_every_step``: at every step), one ``torch.linalg.inv_ex`` per matrix as
    K-FAC calls them; the gradients copied into an (L, d_out, d_in + 1) stack (one
    foreach copy), G⁻¹ ∇W A⁻¹ as two batched products into a kept stack, and momentum
    SGD (buf ← m·buf + direction, θ ← θ - lr·buf) over ``torch._foreach_`` lists.
    """

    def __init__(
        self, model, lr, momentum=0.9, damping=1e-3, stat_decay=0.95, invert_every_step=False
    ):
        layers, d_out, d_in = _linear_layers(model)
        self.layers = layers
        L, k, weight = len(layers), d_in + 1, layers[0].weight
        self.lr, self.momentum, self.decay = lr, momentum, stat_decay
        self.root, self.invert_every_step = math.sqrt(damping), invert_every_step
        self.n, self.updates = 1, 0  # the last batch size; the factor updates so far
        self.A, self.A_new = weight.new_zeros(L, k, k), weight.new_zeros(L, k, k)
        self.G, self.G_new = weight.new_zeros(L, d_out, d_out), weight.new_zeros(L, d_out, d_out)
        self.A_inv, self.G_inv = torch.zeros_like(self.A), torch.zeros_like(self.G)
        self.grads, self.naturals = weight.new_zeros(L, d_out, k), weight.new_zeros(L, d_out, k)
        self.params = [p for m in layers for p in (m.weight, m.bias)]
        self.data = [p.detach() for p in self.params]  # written in place outside autograd
        self.grad_views = _weight_and_bias_views(self.grads)
        self.directions = _weight_and_bias_views(self.naturals)
        self.bufs = [torch.zeros_like(p) for p in self.params]
        for i, layer in enumerate(layers):
            layer.register_forward_hook(self._forward_hook(self.A_new[i], self.G_new[i]))

    def _forward_hook(self, A_row, G_row):
        def grad_hook(g):
            torch.mm(g.T, g, out=G_row)

        def hook(module, inputs, output):
            x = inputs[0].detach()
            self.n = x.shape[0]
            a = torch.constant_pad_nd(x, (0, 1), 1.0).div_(math.sqrt(self.n))
            torch.mm(a.T, a, out=A_row)
            output.register_hook(grad_hook)

        return hook

    def step(self):
        self.G_new.mul_(self.n)  # g of a mean loss carries 1/N
        decay = self.decay if self.updates > 0 else 0.0
        for factor, new in ((self.A, self.A_new), (self.G, self.G_new)):
            factor.mul_(decay).add_(new, alpha=1.0 - decay)
        if self.updates == 0 or self.invert_every_step:
            for factor, inverses in ((self.A, self.A_inv), (self.G, self.G_inv)):
                damped = factor + self.root * torch.eye(factor.shape[-1], dtype=factor.dtype)
                found = [inverse for inverse, _ in map(_INV_EX, damped)]
                torch._foreach_copy_(list(inverses.unbind(0)), found)
        self.updates += 1
        torch._foreach_copy_(self.grad_views, [p.grad for p in self.params])
        torch.bmm(torch.bmm(self.G_inv, self.grads), self.A_inv, out=self.naturals)
        torch._foreach_mul_(self.bufs, self.momentum)
        torch._foreach_add_(self.bufs, self.directions)
        torch._foreach_add_(self.data, self.bufs, alpha=-self.lr)


class ContractFloor(Floor):
    """The floor plus what the capture contract (README, "What counts as curvature") adds
    and nothing else: the output-gradient hook marks its row staged, each weight's
    post-accumulate-grad hook commits it (a statistic counts only when its pass
    accumulates into the weight's ``.grad``), and a callback queued once per backward
    pass drops the rows staged and not committed (none in steady state). The same ops as
    the floor: the Python hooks are the difference, the bound for the library's rows,
    whose capture keeps this contract.
    """

    def __init__(self, model, lr, **kwargs):
        self.staged = []  # rows of s_new written by this pass and not committed
        self.queued = False
        super().__init__(model, lr, **kwargs)
        for i, layer in enumerate(self.layers):
            layer.weight.register_post_accumulate_grad_hook(self._commit_hook(i))

    def _grad_hook(self, out_row):
        index = len(self.staged)
        self.staged.append(False)

        def grad_hook(g):
            torch.sum(g.square(), 0, out=out_row)
            self.staged[index] = True
            if not self.queued:
                self.queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)

        return grad_hook

    def _commit_hook(self, index):
        def commit(weight):
            self.staged[index] = False

        return commit

    def _end_pass(self):
        self.queued = False
        for index, staged in enumerate(self.staged):
            if staged:  # its weight's .grad did not accumulate: the row counts for nothing
                self.s_new[index].zero_()
                self.staged[index] = False


class _CountOps(TorchDispatchMode):
    """Counts the ops that reach the Python dispatch key."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def build(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(model, inputs, targets) of model ``name``, the same weights for every competitor."""
    layers, width, batch, activation = MODELS[name]
    torch.manual_seed(0)
    model = nn.Sequential(
        *[m for _ in range(layers) for m in (nn.Linear(width, width), activation())]
    )
    x = torch.randn(batch, width)
    y = torch.randint(0, width, (batch,))
    return model, x, y


def _library_site() -> str | None:
    """``path:line`` of the innermost singd_cuda frame of the caller's stack, or None."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE):
            path = Path(frame.f_code.co_filename).relative_to(Path(PACKAGE).parent)
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return None


@contextlib.contextmanager
def counting_reads() -> Iterator[Counter]:
    """Counts the library's calls of the Tensor methods that read a value to the host, by
    call site (``path:line`` in singd_cuda)."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name, original):
        def read(self, *args, **kwargs):
            device_data = self.is_floating_point() or self.dtype == torch.bool
            site = _library_site() if device_data else None
            if site is not None:
                counts[f"{site} ({name})"] += 1
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class Competitor:
    """One model and its optimizer (None: the plain model); timings of whole iterations."""

    def __init__(self, model_name: str, T: int, make) -> None:
        self.model, self.x, self.y = build(model_name)
        # zeroed from a list: iterating model.parameters() resumes nested generators, each
        # resumption a Python 'call' event, which would count as the optimizer's calls
        self.params = list(self.model.parameters())
        self.opt = make(self.model) if make is not None else None
        self.T = T
        self.t = 0
        self.times: list[float] = []  # whole iterations
        self.backward_times: list[float] = []  # forward + backward (with the capture)
        self.updates: list[bool] = []

    def iteration(self, timed: bool) -> None:
        start = time.perf_counter()
        for p in self.params:
            p.grad = None
        F.cross_entropy(self.model(self.x), self.y).backward()
        backward_done = time.perf_counter()
        if self.opt is not None:
            self.opt.step()
        if timed:
            self.times.append(time.perf_counter() - start)
            self.backward_times.append(backward_done - start)
            self.updates.append(self.t % self.T == 0)
        self.t += 1

    def ms(self) -> float:
        return amortized_ms(self.times, self.updates, self.T)

    def backward_ms(self) -> float:
        """Forward + backward, the capture's hooks and statistics included."""
        return amortized_ms(self.backward_times, self.updates, self.T)

    def after_read_us(self, steps: int) -> float | None:
        """Median host µs of a step after its device->host read (None: no read).

        The read drains the device; until the step's host work after it queues kernels
        again, the device idles, so on a GPU the read costs at most this (plus the
        round trip of the transfer), whatever the model."""
        verdict = getattr(self.opt, "_verdict", None)
        if verdict is None:
            return None
        marks: list[float] = []

        def timed_verdict():
            reason = verdict()
            marks.append(time.perf_counter())
            return reason

        self.opt._verdict = timed_verdict  # the instance attribute shadows the method
        gaps = []
        try:
            for _ in range(steps):
                count = len(marks)
                self.iteration(timed=False)
                if len(marks) > count:
                    gaps.append(time.perf_counter() - marks[-1])
        finally:
            del self.opt._verdict
        return 1e6 * statistics.median(gaps) if gaps else None

    def counted_iterations(self) -> int:
        """A whole number of T periods, at least 3 iterations."""
        return self.T * math.ceil(3 / self.T)

    def calls(self) -> tuple[float, float]:
        """(Python function calls, C function calls) per iteration: the profile's 'call'
        and 'c_call' events (builtins such as ``list.append`` and torch's ops are C)."""
        counts = Counter()

        def profile(frame, event, arg):
            counts[event] += 1

        iterations = self.counted_iterations()
        sys.setprofile(profile)
        try:
            for _ in range(iterations):
                self.iteration(timed=False)
        finally:
            sys.setprofile(None)
        return counts["call"] / iterations, counts["c_call"] / iterations

    def ops(self) -> float:
        """Dispatcher ops per iteration."""
        iterations = self.counted_iterations()
        with _CountOps() as mode:
            for _ in range(iterations):
                self.iteration(timed=False)
        return mode.count / iterations

    def collections(self, iterations: int = 200, settle: int = 40) -> float:
        """Garbage collections (any generation) per iteration, over ``iterations`` after
        ``settle`` uncounted ones that follow a full collection (right after one, the
        young generations fill again: SINGD diagonal collects 6 times in the next 40
        iterations, then about once in 400)."""
        count = 0

        def callback(phase, info):
            nonlocal count
            count += phase == "start"

        gc.collect()
        for _ in range(settle):
            self.iteration(timed=False)
        gc.callbacks.append(callback)
        try:
            for _ in range(iterations):
                self.iteration(timed=False)
        finally:
            gc.callbacks.remove(callback)
        return count / iterations

    def reads(self) -> Counter:
        """The library's device->host reads over one period of T steady-state iterations,
        by call site."""
        with counting_reads() as counts:
            for _ in range(self.T):
                self.iteration(timed=False)
        return counts


def ratio_interval(
    plain: Competitor,
    baseline: Competitor,
    competitor: Competitor,
    block: int,
    draws: int = 1000,
    seed: int = 0,
) -> tuple[float, float]:
    """The 5th and 95th percentiles of ``competitor``'s overhead ÷ ``baseline``'s over
    resamples of the rounds (drawn with replacement, ``draws`` times): each resample
    takes the same rounds from all three, so that a round's load hits them alike, and
    recomputes the plain model's median and both amortized overheads from those rounds'
    iterations (``block`` timed iterations a round)."""
    rounds = len(plain.times) // block
    draw = random.Random(seed)

    def rows_of(c: Competitor, picked: list[int]) -> tuple[list[float], list[bool]]:
        spans = [range(r * block, (r + 1) * block) for r in picked]
        return [c.times[i] for s in spans for i in s], [c.updates[i] for s in spans for i in s]

    ratios = []
    for _ in range(draws):
        picked = [draw.randrange(rounds) for _ in range(rounds)]
        base = median_ms(rows_of(plain, picked)[0])
        own = amortized_ms(*rows_of(competitor, picked), competitor.T) - base
        ratios.append(own / (amortized_ms(*rows_of(baseline, picked), baseline.T) - base))
    ratios.sort()
    return ratios[int(0.05 * (draws - 1))], ratios[int(0.95 * (draws - 1))]


def measure(model_name: str, steps: int, block: int = 1) -> list[dict]:
    layers = MODELS[model_name][0]
    plain = Competitor(model_name, 1, None)
    competitors = {
        name: Competitor(model_name, T, make) for name, (T, make) in optimizers().items()
    }
    everyone = [plain, *competitors.values()]
    for _ in range(3):  # warm-up: first statistics, warm start, the one inversion
        for c in everyone:
            c.iteration(timed=False)
    order = random.Random(0)
    for _ in range(math.ceil(steps / block)):  # in rounds: load changes hit all alike
        order.shuffle(everyone)
        for c in everyone:
            if block > 1:  # the first iteration after another competitor's: untimed
                c.iteration(timed=False)
            for _ in range(block):
                c.iteration(timed=True)
    base = median_ms(plain.times)
    adamw_competitor = next(iter(competitors.values()))
    adamw_backward = adamw_competitor.backward_ms()
    rows = []
    for name, c in competitors.items():
        overhead = c.ms() - base
        # against AdamW's forward + backward (the same hook-free model, timed in shuffled
        # positions as the others, not the plain model's)
        capture = c.backward_ms() - adamw_backward
        rows.append(
            {
                "optimizer": name,
                "iteration_ms": c.ms(),
                "overhead_ms": overhead,
                "capture_us": 1e3 * capture / layers,
                "step_us": 1e3 * (overhead - capture) / layers,
            }
        )
    adamw = rows[0]["overhead_ms"]
    floor = next(r for r in rows if r["optimizer"].startswith("floor"))["overhead_ms"]
    plain_calls = plain.calls()
    plain_counts = {
        "py_calls": plain_calls[0] / layers,
        "c_calls": plain_calls[1] / layers,
        "ops": plain.ops() / layers,
    }
    for row, c in zip(rows, competitors.values(), strict=True):
        row["per_layer_us"] = 1e3 * row["overhead_ms"] / layers
        row["vs_floor"] = row["overhead_ms"] / floor
        py_calls, c_calls = c.calls()
        row["py_calls"], row["c_calls"] = py_calls / layers, c_calls / layers
        row["ops"] = c.ops() / layers
        row["gc"] = c.collections()
        # the part of the ratio the capture alone takes: what a step may cost is the rest
        row["capture_vs_adamw"] = row["capture_us"] / rows[0]["per_layer_us"]
        row["vs_adamw"] = row["overhead_ms"] / adamw
        row["vs_adamw_90"] = ratio_interval(plain, adamw_competitor, c, block)
        sites = c.reads()
        row["reads"] = sum(sites.values())
        row["after_read_us"] = c.after_read_us(max(steps // 2, 1))
        row["read_sites"] = dict(sites.most_common())
    return [
        {"plain_ms": base, **{f"plain_{k}": v for k, v in plain_counts.items()}, **row}
        for row in rows
    ]


def table(model_name: str, rows: list[dict], steps: int, block: int = 1) -> list[str]:
    layers, width, batch, _ = MODELS[model_name]
    timed = (
        f"{steps} timed steps"
        if block == 1
        else (f"{block * math.ceil(steps / block)} timed steps in blocks of {block}")
    )
    lines = [
        f"### {model_name}: {layers} x Linear({width}, {width}), batch {batch}, {timed} "
        f"(plain forward + backward {rows[0]['plain_ms']:.2f} ms, "
        f"per layer {rows[0]['plain_py_calls']:.0f} Python + "
        f"{rows[0]['plain_c_calls']:.0f} C calls and {rows[0]['plain_ops']:.0f} ops)",
        "",
        "| optimizer | iteration ms | overhead ms | per layer µs | / AdamW | / AdamW, 90% "
        "| / floor | capture µs "
        "| step µs | capture / AdamW | Python calls / layer | C calls / layer | ops / layer "
        "| GC / iter "
        "| reads per T steps | after the read µs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        after = "—" if r["after_read_us"] is None else f"{r['after_read_us']:.0f}"
        lines.append(
            f"| {r['optimizer']} | {r['iteration_ms']:.2f} | {r['overhead_ms']:.2f} | "
            f"{r['per_layer_us']:.0f} | {r['vs_adamw']:.2f}x | "
            f"{r['vs_adamw_90'][0]:.2f}–{r['vs_adamw_90'][1]:.2f} | {r['vs_floor']:.2f}x | "
            f"{r['capture_us']:.0f} | {r['step_us']:.0f} | {r['capture_vs_adamw']:.2f}x | "
            f"{r['py_calls']:.0f} | {r['c_calls']:.0f} | {r['ops']:.0f} | {r['gc']:.2f} | "
            f"{r['reads']} | {after} |"
        )
    lines += [
        "",
        "/ AdamW, 90%: the middle 90 % of that ratio over 1000 resamples of the rounds "
        "(with replacement, the same rounds for every row): a row whose interval lies below "
        "a target meets it beyond this run's round-to-round noise; one whose interval holds "
        "the target does not settle it. "
        "/ floor: the overhead over the floor's (the minimal optimizer above). Calls (Python "
        "functions; C functions: builtins such as list.append and torch's bindings), ops per "
        "layer and GC per iteration: whole iterations (forward + backward + step, the plain "
        "model's counts included; amortized over T), steady state. "
        "Per layer: capture = forward + backward with the optimizer's hooks minus AdamW's "
        "(hook-free) forward + backward, amortized over T; step = the rest of the overhead. "
        "Capture / AdamW: the part of the ratio the capture alone takes (the floor while "
        "statistics are captured in per-layer Python hooks; a ratio target leaves the step "
        "the rest). After the read: the step's host time after its one device->host "
        "read (median per step, not per layer); on a GPU the read drains the device, which "
        "then idles until this host work queues kernels again, so this bounds what the "
        "read costs there.",
    ]
    sites: Counter = Counter()
    for r in rows:
        sites.update(r["read_sites"])
    if sites:
        lines += ["", "Where the reads are (all rows together):", ""]
        lines += [f"- `{site}`: {count}" for site, count in sites.most_common()]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,mlp", help="comma-separated: tiny, mlp")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per competitor")
    parser.add_argument(
        "--block",
        type=int,
        default=1,
        help="consecutive iterations per competitor and round (default 1: every iteration "
        "follows another competitor's; N > 1: one untimed, then N timed, as in training)",
    )
    parser.add_argument("--out", type=Path, help="write the markdown record here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # LargeFactorWarning and friends are not the subject
    start, load = time.time(), os.getloadavg()[0]
    sections = []
    for name in args.models.split(","):
        rows = measure(name, args.steps, args.block)
        sections += [*table(name, rows, args.steps, args.block), ""]
    lines = [
        "# Host cost per layer",
        "",
        f"`python {' '.join(shlex.quote(a) for a in ['benchmarks/host_cost.py', *sys.argv[1:]])}`"
        f" — {datetime.date.today()}, torch {torch.__version__}, {platform.processor() or 'cpu'},"
        f" 1 thread; load average before {load:.1f}, after {os.getloadavg()[0]:.1f}; run took "
        f"{time.time() - start:.0f} s",
        "",
        *sections,
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
