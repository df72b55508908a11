"""Train a tiny benchmark VLM from scratch: ``python -m vlm_prune.eval.synthetic.train --kind image``.

Fresh samples every step from the train split; loss = cross-entropy on "answer </s>" plus an
auxiliary per-patch colour-and-side classification on the vision features entering the projector (a
training-only head, not shipped) that makes the tiny tower learn colour and side fast. The image
model's CLIP tower also trains its CLS token, as CLIP pre-training does: a second training-only
head predicts from the CLS output which colours the image holds (multi-label). LLaVA drops the CLS
output, so without this its last-layer query would stay at its random initialisation, and the
methods that rank patches by CLS attention (VisionZip, AS-ViT) would rank by noise.
AdamW with a one-cycle schedule and fixed seeds (CPU kernels reproduce for a fixed thread
count). Saves safetensors and the processor to eval/synthetic/models/<kind> every 200 steps and
at the end, and prints test accuracy per question type.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from vlm_prune.eval.synthetic.evaluate import accuracy_by_qtype, encode
from vlm_prune.eval.synthetic.models import build_model, model_path
from vlm_prune.eval.synthetic.processing import PATCH_SIZE, build_processor
from vlm_prune.eval.synthetic.scenes import COLOURS, Sample, make_dataset, make_sample

TRAIN_QTYPES = {"image": ("colour", "exist", "position"), "video": ("colour", "exist", "position")}
MIN_COVER = PATCH_SIZE * PATCH_SIZE // 4  # pixels of a colour that make a patch "that colour"


def patch_labels(samples: list[Sample]) -> torch.Tensor:
    """Per-patch class, [N * T, patches] in the tower's row-major patch order: 0 = no colour, else
    1 + 2 * colour_index + (1 if the patch is in the right half), so features carry colour and side."""
    maps = np.stack([s.colour_map for s in samples])
    maps = maps.reshape(-1, *maps.shape[-2:])
    n, h, w = maps.shape
    p = PATCH_SIZE
    onehot = np.eye(len(COLOURS) + 1, dtype=np.int32)[maps]  # [n, h, w, C]
    counts = onehot.reshape(n, h // p, p, w // p, p, -1).sum(axis=(2, 4))[..., 1:]
    right = (np.arange(w // p) >= w // p // 2).astype(np.int64)  # [w / p]
    labels = np.where(counts.max(-1) >= MIN_COVER, 2 * counts.argmax(-1) + 1 + right, 0)
    return torch.from_numpy(labels.reshape(n, -1)).long()


def colours_present(samples: list[Sample]) -> torch.Tensor:
    """[N, len(COLOURS)] multi-hot: which shape colours appear anywhere in each sample's image."""
    maps = np.stack([s.colour_map for s in samples]).reshape(len(samples), -1)
    return torch.from_numpy(np.stack([(maps == k + 1).any(1) for k in range(len(COLOURS))], 1)).float()


def train(kind: str, steps: int, batch_size: int, lr: float, seed: int, out: Path, threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    processor = build_processor(kind)
    model = build_model(kind).train()
    aux = nn.Linear(model.config.vision_config.hidden_size, 2 * len(COLOURS) + 1)
    aux_weight = torch.tensor([1.0] + [5.0] * 2 * len(COLOURS))
    captured: dict[str, torch.Tensor] = {}
    hooks = [model.model.multi_modal_projector.register_forward_hook(lambda m, args, o: captured.__setitem__("x", args[0]))]
    cls_head = nn.Linear(model.config.vision_config.hidden_size, len(COLOURS)) if kind == "image" else None
    if cls_head is not None:  # CLIP's CLS token: row 0 of the tower's last hidden state
        hooks.append(model.model.vision_tower.register_forward_hook(
            lambda m, args, o: captured.__setitem__("cls", o.last_hidden_state[:, 0])))
    params = list(model.parameters()) + list(aux.parameters()) + (list(cls_head.parameters()) if cls_head else [])
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    val = make_dataset(kind, "val", 64, qtypes=TRAIN_QTYPES[kind])
    out.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(out)
    start = time.time()
    bar = tqdm(range(steps), desc=f"train {kind}", mininterval=30)
    for step in bar:
        samples = [make_sample(kind, "train", step * batch_size + i, qtypes=TRAIN_QTYPES[kind]) for i in range(batch_size)]
        batch = encode(processor, samples, with_answers=True)
        labels = torch.full_like(batch["input_ids"], -100)
        labels[:, -2:] = batch["input_ids"][:, -2:]  # left padded: the last two tokens are "answer </s>"
        lm_loss = model(**batch, labels=labels).loss
        aux_logits = aux(captured["x"])
        aux_loss = nn.functional.cross_entropy(aux_logits.flatten(0, 1), patch_labels(samples).flatten(), weight=aux_weight)
        loss = lm_loss + aux_loss
        if cls_head is not None:
            loss = loss + nn.functional.binary_cross_entropy_with_logits(cls_head(captured["cls"]), colours_present(samples))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(lm=f"{lm_loss.item():.3f}", aux=f"{aux_loss.item():.3f}")
        if (step + 1) % 200 == 0 or step + 1 == steps:
            model.eval()
            accs = accuracy_by_qtype(model, processor, val, batch_size=32)
            model.save_pretrained(out)
            model.train()
            print(f"step {step + 1} {time.time() - start:.0f}s lm {lm_loss.item():.3f} aux {aux_loss.item():.3f} val {accs}", flush=True)
    for hook in hooks:
        hook.remove()
    test = make_dataset(kind, "test", 256)
    print(f"trained {kind} in {time.time() - start:.0f}s; test accuracy {accuracy_by_qtype(model, processor, test, 32)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=["image", "video"], default="image")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=24)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: the shipped model path)")
    args = parser.parse_args()
    train(args.kind, args.steps, args.batch_size, args.lr, args.seed, args.out or model_path(args.kind), args.threads)


if __name__ == "__main__":
    main()
