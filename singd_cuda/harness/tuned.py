"""Tuned hyperparameters of the harness, written by ``singd-harness tune --record``.

The default run uses these values in every precision; re-tune with ``--tune``.
"""

COMMAND = "python -m singd_cuda.harness tune --tasks mnist1d_mlp mnist1d_cnn lm --optimizers adamw kfac adafisher singd --structures block_diagonal:32 diagonal --record --out benchmarks/results/harness/tune && python -m singd_cuda.harness tune --tasks mnist1d_mlp mnist1d_cnn lm --optimizers adafisher singd --structures block_diagonal:32 diagonal --workers 1 --record --out benchmarks/results/harness/tune_defaults && python -m singd_cuda.harness tune --tasks mnist1d_mlp mnist1d_cnn --optimizers sgd soap psgd_kron muon --workers 2 --device cpu --record --out benchmarks/results/harness/tune_peers && python -m singd_cuda.harness tune --tasks lm --optimizers sgd soap psgd_kron muon --workers 1 --device cpu --out benchmarks/results/harness/tune_peers_lm && python -m singd_cuda.harness tune --tasks llama_lm --optimizers adamw sgd kfac adafisher singd soap psgd_kron muon --structures block_diagonal:32 --steps 100 --workers 1 --device cpu --out benchmarks/results/harness/tune_llama && python -m singd_cuda.harness tune --tasks digits_vit --optimizers adamw sgd kfac adafisher singd ikfac soap psgd_kron muon --structures block_diagonal:32 diagonal --workers 1 --record --out benchmarks/results/harness/tune_digits_vit"  # noqa: E501
CREATED = "2026-12-03T22:07:34"
STEPS: dict[str, int] = {
    "digits_vit": 300,
    "llama_lm": 100,
    "lm": 200,
    "mnist1d_cnn": 500,
    "mnist1d_mlp": 500,
}
TUNED: dict[str, dict[str, dict[str, float]]] = {
    "digits_vit": {
        "adafisher": {"lr": 0.003},
        "adamw": {"lr": 0.003},
        "ikfac": {"lr": 0.0001},
        "kfac": {"lr": 0.003},
        "muon": {"lr": 0.01},
        "psgd_kron": {"lr": 0.001},
        "sgd": {"lr": 0.1},
        "singd:block_diagonal:32": {"lr": 0.0003},
        "singd:diagonal": {"lr": 0.0001},
        "soap": {"lr": 0.003},
    },
    "llama_lm": {
        "adafisher": {"lr": 0.003},
        "adamw": {"lr": 0.001},
        "kfac": {"lr": 0.0003},
        "muon": {"lr": 0.03},
        "psgd_kron": {"lr": 0.003},
        "sgd": {"lr": 0.1},
        "singd:block_diagonal:32": {"lr": 0.0001},
        "soap": {"lr": 0.01},
    },
    "lm": {
        "adafisher": {"lr": 0.1},
        "adamw": {"lr": 0.01},
        "kfac": {"lr": 0.01},
        "muon": {"lr": 0.03},
        "psgd_kron": {"lr": 0.003},
        "sgd": {"lr": 0.3},
        "singd:block_diagonal:32": {"lr": 0.003},
        "singd:diagonal": {"lr": 0.003},
        "soap": {"lr": 0.01},
    },
    "mnist1d_cnn": {
        "adafisher": {"lr": 0.03},
        "adamw": {"lr": 0.03},
        "kfac": {"lr": 0.01},
        "muon": {"lr": 0.1},
        "psgd_kron": {"lr": 0.003},
        "sgd": {"lr": 0.1},
        "singd:block_diagonal:32": {"lr": 0.003},
        "singd:diagonal": {"lr": 0.003},
        "soap": {"lr": 0.01},
    },
    "mnist1d_mlp": {
        "adafisher": {"lr": 0.03},
        "adamw": {"lr": 0.003},
        "kfac": {"lr": 0.001},
        "muon": {"lr": 0.01},
        "psgd_kron": {"lr": 0.001},
        "sgd": {"lr": 0.03},
        "singd:block_diagonal:32": {"lr": 0.001},
        "singd:diagonal": {"lr": 0.01},
        "soap": {"lr": 0.003},
    },
}
