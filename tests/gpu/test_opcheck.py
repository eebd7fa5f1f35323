"""torch.library.opcheck of every op on CUDA tensors (schema, fake tensors, autograd
registration, functionalization), with the arguments the CPU opcheck uses."""

from __future__ import annotations

import pytest
import torch

from ..ops.test_registration import _opcheck_cases

pytestmark = pytest.mark.gpu


def _to_cuda(value):
    if isinstance(value, torch.Tensor):
        return value.cuda()
    if isinstance(value, list):
        return [_to_cuda(v) for v in value]
    return value


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck_cuda(cuda_ops, name):
    args = tuple(_to_cuda(a) for a in _opcheck_cases()[name])
    torch.library.opcheck(getattr(cuda_ops, name).default, args)
