"""ViT token pruning benchmark: AS-ViT (both modes), ToMe and random on a small trained ViT.

The ViT (timm VisionTransformer: 32x32 grey images, patch 4 = 64 patches + CLS, 12 blocks,
width 64, 4 heads, MLP ratio 2) is trained by this script on scikit-learn's bundled digits,
upscaled from 8x8 to 32x32 (1,347 train / 450 test images, stratified split, seed 0):

    python -m vlm_prune.eval.vit_bench --train            # a few minutes on 2 CPU cores
    python -m vlm_prune.eval.vit_bench                    # the table

Weights are cached at ``--weights`` (default ~/.cache/vlm-prune/vit_digits.safetensors).
Accuracy is measured one image at a time (so AS-ViT's threshold mode keeps exactly the
tokens above its thresholds per image); throughput on batches of ``--batch`` test images,
every configuration timed in turn for ``--repeats`` rounds in the same process, best round
kept, reported as a ratio to the unpruned model. Rows: AS-ViT keep mode (keep = the fraction
of patches left after the last stage), random scores with the same schedule, ToMe at r = 2..5
and at the same final keeps, AS-ViT threshold mode
calibrated on the train set (thresholds only; and with the whole model fine-tuned, plus a
target=1.0 fine-tuned control that gets the same extra training without pruning).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time
from datetime import date
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import vlm_prune
from vlm_prune.methods.asvit import ASViT, calibrate
from vlm_prune.methods.tome import ToMe
from vlm_prune.vit_blocks import AttentionResult

DEFAULT_WEIGHTS = Path.home() / ".cache" / "vlm-prune" / "vit_digits.safetensors"


def digits(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn digits as [N, 1, 32, 32] floats in [-1, 1] and labels; split 'train'/'test'."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(d.images, d.target, test_size=0.25, stratify=d.target, random_state=0)
    x, y = (x_tr, y_tr) if split == "train" else (x_te, y_te)
    x = torch.tensor(x, dtype=torch.float32)[:, None] / 16.0
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    return x * 2 - 1, torch.tensor(y)


def make_vit() -> torch.nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        img_size=32, patch_size=4, in_chans=1, num_classes=10, embed_dim=64, depth=12, num_heads=4, mlp_ratio=2.0
    )


def shift(x: torch.Tensor, gen: torch.Generator, pad: int = 3) -> torch.Tensor:
    """Random translation by up to ``pad`` pixels (the augmentation used in training)."""
    padded = F.pad(x, (pad,) * 4, value=-1.0)
    i, j = torch.randint(0, 2 * pad + 1, (2,), generator=gen).tolist()
    return padded[..., i : i + x.shape[-2], j : j + x.shape[-1]]


def train(weights: Path, epochs: int, batch: int, seed: int) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    x, y = digits("train")
    model = make_vit()
    steps = epochs * math.ceil(len(x) / batch)
    opt = torch.optim.AdamW(model.parameters(), lr=7e-4, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=7e-4, total_steps=steps, pct_start=0.15)
    bar = tqdm(total=steps, desc="train ViT on digits")
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).split(batch):
            loss = F.cross_entropy(model(shift(x[idx], gen)), y[idx], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    weights.parent.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict(), str(weights))
    xt, yt = digits("test")
    print(f"saved {weights}; test accuracy {accuracy(model.eval(), xt, yt)[0]:.4f}")


def load(weights: Path) -> torch.nn.Module:
    from safetensors.torch import load_file

    if not weights.exists():
        raise FileNotFoundError(f"no trained ViT at {weights}; run: python -m vlm_prune.eval.vit_bench --train")
    model = make_vit()
    model.load_state_dict(load_file(str(weights)))
    return model.eval()


class RandomScores(ASViT):
    """Baseline: AS-ViT's keep schedule with uniformly random token scores."""

    name = "asvit-random"

    def token_scores(self, a: AttentionResult, scale: float) -> torch.Tensor:
        return torch.rand(a.q.shape[0], a.q.shape[2], device=a.q.device)


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(top-1 accuracy, mean FLOPs ratio of the blocks), one image at a time."""
    correct, flops = 0, 0.0
    for i in range(len(x)):
        correct += int(model(x[i : i + 1]).argmax(-1).item() == y[i].item())
        stats = getattr(model, "vlm_prune", None)
        flops += stats.last_stats["vit"]["flops_ratio"] if stats is not None else 1.0
    return correct / len(x), flops / len(x)


@torch.no_grad()
def batch_seconds(model: torch.nn.Module, x: torch.Tensor, batch: int) -> float:
    start = time.perf_counter()
    for chunk in x.split(batch):
        model(chunk)
    return time.perf_counter() - start


Config = tuple[torch.nn.Module, Callable[[], object]]


def configurations(
    model: torch.nn.Module, calib: list[tuple[torch.Tensor, torch.Tensor]], steps: int, finetune_steps: int
) -> dict[str, Config]:
    """Name -> (model, factory of the method object; None = unpruned). AS-ViT's threshold
    mode is calibrated here: thresholds only, and thresholds plus the whole model (the paper's
    setting) on a copy of the model; target=1.0 with fine-tuning is the control that gets the
    same extra training without pruning."""
    configs: dict[str, Config] = {"unpruned": (model, lambda: None)}
    for keep in (0.7, 0.5, 0.35, 0.25, 0.125):
        configs[f"asvit keep={keep}"] = (model, lambda keep=keep: ASViT(keep=keep))
    for keep in (0.35, 0.125):
        configs[f"random keep={keep}"] = (model, lambda keep=keep: RandomScores(keep=keep))
    for r in (2, 3, 4, 5):
        configs[f"tome r={r}"] = (model, lambda r=r: ToMe(r=r))
    for keep in (0.35, 0.125):
        configs[f"tome keep={keep}"] = (model, lambda keep=keep: ToMe(keep=keep))
    runs = [(t, False) for t in (0.8, 0.65)] + [(t, True) for t in (1.0, 0.65, 0.5)]
    for target, train_model in runs:
        m = copy.deepcopy(model) if train_model else model
        vlm_prune.wrap(m, ASViT(mode="threshold"))
        thresholds = calibrate(
            m, calib, target=target, steps=finetune_steps if train_model else steps, train_model=train_model, model_lr=1e-4
        )
        vlm_prune.unwrap(m)
        name = f"asvit threshold target={target}" + (f" +finetune {finetune_steps} steps" if train_model else "")
        configs[name] = (m, lambda t=thresholds: ASViT(mode="threshold", thresholds=t))
    return configs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m vlm_prune.eval.vit_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--train", action="store_true", help="train the ViT and cache its weights, then exit")
    p.add_argument("--weights", type=Path, default=DEFAULT_WEIGHTS, help=f"weights file (default {DEFAULT_WEIGHTS})")
    p.add_argument("--epochs", type=int, default=25, help="training epochs (default 25)")
    p.add_argument("--train-batch", type=int, default=32, help="training batch size (default 32)")
    p.add_argument("--batch", type=int, default=64, help="batch size for calibration and throughput (default 64)")
    p.add_argument("--calib-steps", type=int, default=60, help="AS-ViT threshold calibration steps (default 60)")
    p.add_argument("--finetune-steps", type=int, default=100, help="AS-ViT calibration steps that also train the model (default 100)")
    p.add_argument("--repeats", type=int, default=7, help="throughput rounds; the best is kept (default 7)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.train:
        train(args.weights, args.epochs, args.train_batch, args.seed)
        return
    torch.manual_seed(args.seed)
    model = load(args.weights)
    x_te, y_te = digits("test")
    x_tr, y_tr = digits("train")
    calib = list(zip(x_tr.split(args.batch), y_tr.split(args.batch)))
    configs = configurations(model, calib, args.calib_steps, args.finetune_steps)
    rows = {}
    for name, (model, make) in tqdm(configs.items(), desc="accuracy"):
        method = make()
        if method is not None:
            vlm_prune.wrap(model, method)
        acc, flops = accuracy(model, x_te, y_te)
        if method is not None:
            vlm_prune.unwrap(model)
        rows[name] = {"accuracy": acc, "flops_ratio": flops, "seconds": math.inf}
    for _ in tqdm(range(args.repeats), desc="throughput rounds"):
        for name, (model, make) in configs.items():
            method = make()
            if method is not None:
                vlm_prune.wrap(model, method)
            rows[name]["seconds"] = min(rows[name]["seconds"], batch_seconds(model, x_te, args.batch))
            if method is not None:
                vlm_prune.unwrap(model)
    base = rows["unpruned"]["seconds"]
    print(f"\nViT digits benchmark, {date.today()}, torch threads {args.threads}, throughput batch {args.batch}")
    print("| configuration | accuracy | FLOPs ratio (blocks) | throughput ratio |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        r["throughput_ratio"] = base / r["seconds"]
        print(f"| {name} | {r['accuracy']:.4f} | {r['flops_ratio']:.3f} | {r['throughput_ratio']:.2f}x |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
