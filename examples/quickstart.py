"""The README's first example: torchvision ResNet-18 trained with SINGD next to AdamW.

    python examples/quickstart.py                 # CPU: 8x8 digits upscaled to 16x16
    python examples/quickstart.py --device cuda   # the same on a GPU

Data: scikit-learn's handwritten digits (they ship with scikit-learn; nothing is
downloaded), upscaled to 3 x 16 x 16. Model: ``torchvision.models.resnet18`` (random
init, 10 classes, channels_last), bf16 autocast on a GPU (float32 on the CPU, where bf16
convolutions are emulated and slow). Both optimizers get the same steps and
batches; the script prints held-out loss and accuracy, milliseconds per step and the
optimizer-state bytes of each, so the cost of the preconditioner is visible.
Needs the ``models`` and ``harness`` extras (torchvision, scikit-learn).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from singd_cuda import SINGD


def digits(device: str) -> tuple[torch.Tensor, ...]:
    """(train x, train y, test x, test y): 1437 / 360 images, (N, 3, 16, 16) float32."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).div_(16.0).unsqueeze(1)
    x = F.interpolate(x, size=16, mode="bilinear", align_corners=False).expand(-1, 3, -1, -1)
    x = ((x - 0.3) / 0.4).contiguous(memory_format=torch.channels_last)
    y = torch.tensor(data.target)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(y), generator=gen)
    train, test = order[:1437], order[1437:]
    return tuple(t.to(device) for t in (x[train], y[train], x[test], y[test]))


def resnet18(device: str) -> nn.Module:
    from torchvision.models import resnet18 as build

    torch.manual_seed(0)
    return build(num_classes=10).to(device, memory_format=torch.channels_last)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    def walk(value) -> int:
        if torch.is_tensor(value):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(walk(v) for v in value.values())
        return 0

    return sum(walk(s) for s in opt.state.values())


def train(name: str, steps: int, batch: int, device: str) -> dict:
    x, y, x_test, y_test = digits(device)
    model = resnet18(device)
    if name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    else:
        opt = SINGD(model, lr=1e-3)  # library defaults otherwise
    gen = torch.Generator(device="cpu").manual_seed(1)
    times = []
    for _ in range(steps):
        idx = torch.randint(0, len(y), (batch,), generator=gen).to(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    model.eval()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(x_test).float()
    return {
        "optimizer": name,
        "test loss": F.cross_entropy(logits, y_test).item(),
        "test accuracy": (logits.argmax(1) == y_test).float().mean().item(),
        "ms / step (median)": 1e3 * statistics.median(times[3:]),
        "state MiB": state_bytes(opt) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    for name in ("adamw", "singd"):
        result = train(name, args.steps, args.batch, args.device)
        print("  ".join(f"{k}: {v:.4g}" if isinstance(v, float) else v for k, v in result.items()))


if __name__ == "__main__":
    main()
