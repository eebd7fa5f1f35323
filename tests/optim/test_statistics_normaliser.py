"""The step's statistics normaliser: in ← in / w, out ← out · (w or 1) / loss_scale², per
layer, bitwise, on its fast path (every layer the same w and ``loss_average``, both sides)
and off it (mixed w, a norm layer without an input side, mixed ``loss_average``, w = 0)."""

import pytest
import torch

from singd_cuda.curvature.capture import Committed
from singd_cuda.optim.statistics import StatisticsNormaliser


def committed_of(terms: list[float], with_input: list[bool], dtype=torch.float32) -> dict:
    torch.manual_seed(0)
    committed = {}
    for i, (w, has_in) in enumerate(zip(terms, with_input, strict=True)):
        statistics = {"out": torch.randn(5 + i % 2, dtype=dtype)}
        if has_in:
            statistics["in"] = torch.randn(4 + i % 3, 4 + i % 3, dtype=dtype)
        committed[f"layer{i}"] = Committed(statistics=statistics, terms=w)
    return committed


def expected_of(committed: dict, averages: dict, loss_scale) -> dict:
    """Layer by layer, each product by a 0-dim tensor as the normaliser forms it."""

    def scalar(factor: float, dtype, by_scale: bool) -> torch.Tensor:
        s = torch.tensor(factor, dtype=dtype)
        if by_scale:
            s = loss_scale.to(dtype).reciprocal().square().mul(factor)
        return s

    expected = {}
    for layer, entry in committed.items():
        if entry.terms <= 0:
            continue
        out = {}
        for key, value in entry.statistics.items():
            if key == "in":
                factor, by_scale = 1.0 / entry.terms, False
            else:
                factor = 1.0 if averages[layer] is None else entry.terms
                by_scale = loss_scale is not None
            scaled = factor != 1.0 or by_scale
            out[key] = value * scalar(factor, value.dtype, by_scale) if scaled else value.clone()
        expected[layer] = out
    return expected


CASES = {
    "uniform": ([3.0] * 6, [True] * 6, ["mean"] * 6),
    "uniform-sum": ([3.0] * 6, [True] * 6, [None] * 6),
    "uniform-one-term": ([1.0] * 4, [True] * 4, ["mean"] * 4),
    "mixed-terms": ([3.0, 2.0, 3.0, 5.0], [True] * 4, ["mean"] * 4),
    "norm-layer": ([3.0] * 4, [True, False, True, True], ["mean"] * 4),
    "mixed-averages": ([3.0] * 4, [True] * 4, ["mean", None, "mean", None]),
    "zero-terms": ([3.0, 0.0, 3.0], [True] * 3, ["mean"] * 3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("with_scale", [False, True], ids=["unscaled", "loss-scaled"])
@pytest.mark.parametrize("case", list(CASES))
def test_normalised_as_layer_by_layer(case, with_scale, dtype):
    terms, with_input, average_list = CASES[case]
    committed = committed_of(terms, with_input, dtype)
    averages = dict(zip(committed, average_list, strict=True))
    loss_scale = torch.tensor(1024.0) if with_scale else None
    expected = expected_of(committed, averages, loss_scale)
    pending = StatisticsNormaliser()(committed, averages, loss_scale)
    assert list(pending) == list(expected)
    for layer, statistics in pending.items():
        assert statistics is committed[layer].statistics  # in place
        assert statistics.keys() == expected[layer].keys()
        for key, value in statistics.items():
            torch.testing.assert_close(value, expected[layer][key], rtol=0, atol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_fast_path_taken_only_when_uniform(case):
    terms, with_input, average_list = CASES[case]
    committed = committed_of(terms, with_input)
    averages = dict(zip(committed, average_list, strict=True))
    found = StatisticsNormaliser()._uniform(committed, list(committed), averages, None)
    assert (found is not None) == case.startswith("uniform")


def test_nothing_committed():
    assert StatisticsNormaliser()({}, {}, None) == {}


@pytest.mark.parametrize("case", ["uniform", "mixed-terms"])
def test_in_the_layers_order_not_the_commits(case):
    """The backward pass commits the last layer first; the statistics come back in the
    optimizer's layer order (that of ``loss_averages``), on and off the fast path."""
    terms, with_input, average_list = CASES[case]
    committed = committed_of(terms, with_input)
    layers = list(committed)
    backward = dict(reversed(list(committed.items())))
    averages = dict(zip(layers, average_list, strict=True))
    pending = StatisticsNormaliser()(backward, averages, None)
    assert list(pending) == layers
