"""Evidence for the library defaults: tiny Hugging Face LLaMA and GPT-2 as a new user
trains them (built from a config, nothing downloaded; 30 steps, bf16 autocast, batches
of byte tokens of Python's own source; only ``lr`` passed unless a setting says more).

Each setting is one optimizer configuration; the table gives the final training loss
(mean of the last 5 steps) per model and seed, next to AdamW at its default lr 1e-3.

    python benchmarks/defaults.py --out benchmarks/results/defaults_models.md
    python benchmarks/defaults.py --settings adamw singd-diagonal --seeds 0  # quick look
"""

from __future__ import annotations

import argparse
import inspect
import os
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from singd_cuda import SINGD, AdaFisher

VOCAB, WIDTH, LAYERS, HEADS, SEQ, BATCH, STEPS = 1024, 64, 2, 4, 64, 8, 30


def _singd(structures: str, **kw):
    return lambda model: SINGD(model, structures=structures, **kw)


#: name -> builder(model); "default" settings pass nothing but the structure
SETTINGS = {
    "adamw": lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3),
    "adafisher": lambda model: AdaFisher(model),
    "singd-diagonal": _singd("diagonal"),
    "singd-block_diagonal": _singd("block_diagonal:32"),
    "singd-dense": _singd("dense"),
    "singd-diagonal-cold": _singd("diagonal", warm_start=False),
    "singd-block_diagonal-cold": _singd("block_diagonal:32", warm_start=False),
    "singd-dense-cold": _singd("dense", warm_start=False),
}


def _value(key: str, text: str):
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    try:
        return int(text) if key == "T" else float(text)
    except ValueError:
        return text  # e.g. loss_average=batch+sequence


def parse_setting(spec: str):
    """(name, builder) from ``NAME=OPTIMIZER;key=value;...`` (see ``--extra``)."""
    name, rest = spec.split("=", 1)
    kind, *pairs = rest.split(";")
    kw = {}
    for pair in pairs:
        key, value = pair.split("=")
        kw[key] = _value(key, value)
    if kind == "adamw":
        return name, lambda model: torch.optim.AdamW(model.parameters(), **kw)
    if kind == "adafisher":
        return name, lambda model: AdaFisher(model, **kw)
    return name, _singd(kind, **kw)


def corpus() -> torch.Tensor:
    """Byte tokens of a few standard-library modules (as the harness's character LM)."""
    text = "".join(inspect.getsource(m) for m in (os, inspect, argparse))
    return torch.tensor(list(text.encode()), dtype=torch.long)


def build(name: str, seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            intermediate_size=4 * WIDTH,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS,
            max_position_embeddings=SEQ,
        )
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS
    )
    return transformers.GPT2LMHeadModel(config)


def train(model_name: str, setting, seed: int, data: torch.Tensor) -> list[float]:
    model = build(model_name, seed)
    opt = setting(model)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(STEPS):
        starts = torch.randint(0, len(data) - SEQ, (BATCH,), generator=gen)
        batch = torch.stack([data[s : s + SEQ] for s in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2"])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument(
        "--extra",
        nargs="*",
        default=[],
        help="more settings: NAME=OPTIMIZER;key=value;... with OPTIMIZER adamw, adafisher "
        "or a SINGD structure, e.g. 'bd-lr3e-3=block_diagonal:32;lr=3e-3;T=1'",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    settings = {name: SETTINGS[name] for name in args.settings}
    for spec in args.extra:
        settings.update([parse_setting(spec)])
    data = corpus()
    lines = [
        f"`python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        "",
        f"torch {torch.__version__}, 1 thread; vocab {VOCAB}, width {WIDTH}, {LAYERS} layers, "
        f"batch {BATCH} x {SEQ} tokens, {STEPS} steps, bf16 autocast. Loss: mean of the last "
        "5 steps (start: ln 1024 = 6.93).",
        "",
        "| setting | " + " | ".join(f"{m} (seeds {args.seeds})" for m in args.models) + " |",
        "|---|" + "---|" * len(args.models),
    ]
    start = time.time()
    for name, setting in settings.items():
        cells = []
        for model_name in args.models:
            finals = []
            for seed in args.seeds:
                losses = train(model_name, setting, seed, data)
                finals.append(statistics.fmean(losses[-5:]))
            cell = " / ".join(f"{f:.2f}" for f in finals)
            cells.append(f"{statistics.fmean(finals):.2f} ({cell})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines += ["", f"{time.time() - start:.0f} s"]
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
