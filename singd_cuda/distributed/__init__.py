"""Distributed training (torch.distributed) and the large-batch K-FAC recipe.

The optimizers synchronise by themselves when a process group is initialised
(``process_group=`` selects one, default WORLD): gradients of plain models are
averaged, curvature statistics are averaged once per update step in one packed,
bucketed all-reduce, and with ``distribute_factors=True`` each rank updates only the
layers it owns and all-gathers the new parameters. ``opt.full_state_dict()`` /
``opt.load_full_state_dict()`` checkpoint the whole state in either mode. See
docs/distributed.md. Importing this package (``import singd_cuda`` does) plugs it
into the optimizers (:mod:`singd_cuda.optim.scale_out`); the large-batch recipe's
schedules live in :mod:`singd_cuda.optim.recipe` and are re-exported here.
"""

from ..optim import scale_out
from ..optim.recipe import Piecewise, Warmup, rescale_weight_
from ..optim.scale_out import DEFAULT_BUCKET_CAP_MB
from .plug import TorchDistributed
from .synchronizer import Synchronizer

scale_out.register(TorchDistributed())

__all__ = ["DEFAULT_BUCKET_CAP_MB", "Piecewise", "Synchronizer", "Warmup", "rescale_weight_"]
