"""``python -m singd_cuda.harness``: see :mod:`singd_cuda.harness.cli`."""

from .cli import main

raise SystemExit(main())
