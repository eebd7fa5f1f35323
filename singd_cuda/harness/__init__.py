"""Mixed-precision stability and memory harness (``python -m singd_cuda.harness``).

Trains small real models on data that ships with installed packages over optimizers x
structures x precision modes and reports stability, loss and optimizer-state memory;
the ``memory`` sub-command compares optimizer-state memory per structure on standard
architectures. See :mod:`singd_cuda.harness.cli` for the options.
"""
