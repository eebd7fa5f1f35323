"""Distributed training (torch.distributed) and the large-batch K-FAC recipe.

The optimizers synchronise by themselves when a process group is initialised
(``process_group=`` selects one, default WORLD): gradients of plain models are
averaged, curvature statistics are averaged once per update step in one packed,
bucketed all-reduce, and with ``distribute_factors=True`` each rank updates only the
layers it owns and all-gathers the new parameters. ``opt.full_state_dict()`` /
``opt.load_full_state_dict()`` checkpoint the whole state in either mode. See
DESIGN.md section 7 and the README.
"""

from .recipe import Piecewise, Warmup, rescale_weight_
from .synchronizer import DEFAULT_BUCKET_CAP_MB, Synchronizer

__all__ = ["DEFAULT_BUCKET_CAP_MB", "Piecewise", "Synchronizer", "Warmup", "rescale_weight_"]
