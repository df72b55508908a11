"""Train a tiny benchmark VLM from scratch: ``python -m vlm_prune.eval.synthetic.train --kind image``.

Fresh samples every step from the train split (the model seed also picks its own training stream);
loss = cross-entropy on "answer </s>" plus training-only heads (not shipped) on the vision features
entering the projector: per patch, the colour and the kind (shape or digit) of the object covering
it and, on images, its column, so the tiny tower learns what, which and where fast. The image model's
CLIP tower also trains its CLS token, as CLIP pre-training does: a head predicts from the CLS output
which colours the image holds (multi-label). LLaVA drops the CLS output, so without this its
last-layer query would stay at its random initialisation, and the methods that rank patches by CLS
attention (VisionZip, AS-ViT) would rank by noise. With ``--relation-heads`` (off by default; the
shipped image models were trained with them), on relation questions two more heads read the decoder:
after ``WORD_LAYER`` layers each colour word of the question predicts the patch column of the object
of that colour, and after ``ANSWER_LAYER`` layers the answer position predicts both.
The one-bit answer alone is too weak a signal to learn "find both objects, then compare" (without
these heads a relation-only run stays at chance); they teach the look-ups one step at a time and
leave the comparison to the last layer. ``--init`` goes on training a trained model (the shipped
image models: 4,000 steps from scratch, then 1,500 more at ``--lr 1e-3``; commands in BENCHMARKS.md).

AdamW with a one-cycle schedule (warm-up, cosine) over ``--steps``, or over ``--minutes`` of
wall-clock time on a shared machine (then not step-reproducible). Saves float16 safetensors and the
processor to eval/synthetic/models/<kind>[-seed<N>] every 250 steps and at the end, then
``synthetic.json``: the training settings, test accuracy and chance level per family, and the families
to benchmark on (``eval_qtypes``: those answered better than chance, see ``learned_families``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForImageTextToText

from vlm_prune.eval.synthetic.evaluate import accuracy_by_qtype, encode
from vlm_prune.eval.synthetic.models import build_model, model_path
from vlm_prune.eval.synthetic.processing import PATCH_SIZE, build_processor
from vlm_prune.eval.synthetic.scenes import (
    COLOURS, DEFAULT_QTYPES, DEFAULT_SEED, IMAGE_QTYPES, IMAGE_SIZE, OBJECT_KINDS, VIDEO_QTYPES, Sample, make_dataset,
    make_sample,
)

TRAIN_QTYPES = {"image": DEFAULT_QTYPES["image"], "video": DEFAULT_QTYPES["video"] + ("exist",)}
WORD_LAYER, ANSWER_LAYER = 3, 5  # of the six decoder layers: where the relation heads read the columns
MIN_COVER = PATCH_SIZE * PATCH_SIZE // 8  # pixels of an object that make a patch "that object"
IGNORE = -100


def patch_labels(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """Per-patch targets, each [N * T, patches] in the tower's row-major patch order.

    colour: 0 = no object, else 1 + the colour index of the object covering most of the patch;
    kind: that object's ``OBJECT_KINDS`` index (IGNORE where there is none); column: the patch's
    column on object patches (IGNORE elsewhere), so features carry what, which and where.
    """
    colour_maps = np.stack([s.colour_map for s in samples])
    colour_maps = colour_maps.reshape(-1, *colour_maps.shape[-2:])
    kind_maps = np.stack([s.kind_map for s in samples]).reshape(colour_maps.shape)
    n, h, w = colour_maps.shape
    p = PATCH_SIZE

    def cover(maps: np.ndarray, classes: int) -> np.ndarray:  # [n, h/p, w/p, classes - 1] pixel counts
        return np.eye(classes, dtype=np.int32)[maps].reshape(n, h // p, p, w // p, p, -1).sum(axis=(2, 4))[..., 1:]

    colours, kinds = cover(colour_maps, len(COLOURS) + 1), cover(kind_maps, len(OBJECT_KINDS) + 1)
    found = colours.max(-1) >= MIN_COVER
    column = np.broadcast_to(np.arange(w // p), found.shape)
    out = {"colour": np.where(found, colours.argmax(-1) + 1, 0), "kind": np.where(found, kinds.argmax(-1), IGNORE),
           "column": np.where(found, column, IGNORE)}
    return {k: torch.from_numpy(v.reshape(n, -1)).long() for k, v in out.items()}


def colours_present(samples: list[Sample]) -> torch.Tensor:
    """[N, len(COLOURS)] multi-hot: which object colours appear anywhere in each sample's image."""
    maps = np.stack([s.colour_map for s in samples]).reshape(len(samples), -1)
    return torch.from_numpy(np.stack([(maps == k + 1).any(1) for k in range(len(COLOURS))], 1)).float()


def relation_columns(samples: list[Sample]) -> torch.Tensor:
    """[N, 2]: the patch column of the horizontal centre of the first and the second object a relation
    question names ("is the red shape left of the blue shape ?": red's, then blue's); IGNORE for other families."""
    out = np.full((len(samples), 2), IGNORE)
    names = list(COLOURS)
    for i, s in enumerate(samples):
        if s.qtype != "relation":
            continue
        for j, colour in enumerate(w for w in s.question.split() if w in COLOURS):
            xs = np.nonzero(s.colour_map == names.index(colour) + 1)[1]
            out[i, j] = int(xs.mean() + 0.5) // PATCH_SIZE if xs.size else IGNORE
    return torch.from_numpy(out).long()


def colour_word_positions(input_ids: torch.Tensor, colour_ids: torch.Tensor) -> torch.Tensor:
    """[N, 2]: the sequence positions of the first two colour words of each prompt (0 where there are fewer)."""
    is_colour = torch.isin(input_ids, colour_ids)
    order = torch.where(is_colour, torch.arange(input_ids.shape[1], device=input_ids.device), input_ids.shape[1])
    first_two = order.sort(dim=1).values[:, :2]
    return torch.where(first_two < input_ids.shape[1], first_two, 0)


class AuxHeads(nn.Module):
    """Training-only heads on the vision features entering the projector (per patch), and for the
    image model on CLIP's CLS output (multi-label colours present) and on the decoder at a relation
    question's colour words (each its object's column) and answer position (both columns)."""

    def __init__(self, width: int, kind: str, text_width: int = 0) -> None:
        super().__init__()
        self.colour = nn.Linear(width, len(COLOURS) + 1)
        self.kind = nn.Linear(width, len(OBJECT_KINDS)) if kind == "image" else None
        columns = IMAGE_SIZE // PATCH_SIZE
        self.column = nn.Linear(width, columns) if kind == "image" else None
        self.cls = nn.Linear(width, len(COLOURS)) if kind == "image" else None
        self.word = nn.Linear(text_width, columns) if kind == "image" and text_width else None
        self.answer = nn.Linear(text_width, 2 * columns) if kind == "image" and text_width else None
        self.register_buffer("colour_weight", torch.tensor([1.0] + [5.0] * len(COLOURS)))

    def loss(self, patches: torch.Tensor, cls: torch.Tensor | None, samples: list[Sample],
             hidden: tuple[torch.Tensor, ...] | None = None, words: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of the heads' losses. ``hidden``: the decoder's hidden states (embeddings, then each
        layer; left padded, the answer is predicted at position -3); ``words`` [N, 2]: the positions
        of the colour words (``colour_word_positions``)."""
        targets = {k: v.to(patches.device) for k, v in patch_labels(samples).items()}
        ce = nn.functional.cross_entropy
        loss = ce(self.colour(patches).flatten(0, 1), targets["colour"].flatten(), weight=self.colour_weight)
        for name in ("kind", "column"):
            head = getattr(self, name)
            if head is not None and (targets[name] != IGNORE).any():
                loss = loss + ce(head(patches).flatten(0, 1), targets[name].flatten(), ignore_index=IGNORE)
        if self.cls is not None and cls is not None:
            loss = loss + nn.functional.binary_cross_entropy_with_logits(self.cls(cls), colours_present(samples).to(cls.device))
        if self.word is None or hidden is None or words is None:
            return loss
        columns = relation_columns(samples).to(patches.device)
        rows = (columns != IGNORE).all(1).nonzero().squeeze(1)
        if rows.numel():
            target = columns[rows].flatten()
            at_words = hidden[WORD_LAYER][rows[:, None], words[rows]]  # [R, 2, width]
            loss = loss + ce(self.word(at_words).flatten(0, 1), target)
            loss = loss + ce(self.answer(hidden[ANSWER_LAYER][rows, -3]).view(2 * len(rows), -1), target)
        return loss


def save_half(model: nn.Module, out: Path) -> None:
    """Save the weights as float16 safetensors (half the size; ``load`` reads them back as float32)."""
    model.to(torch.float16).save_pretrained(out)
    model.to(torch.float32)  # stays on its device


def one_cycle(progress: float, warmup: float = 0.1) -> float:
    """Learning-rate factor at ``progress`` in [0, 1]: linear warm-up from 0.04, then cosine to 0."""
    if progress < warmup:
        return 0.04 + 0.96 * progress / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))


def learned_families(samples: list[Sample], accs: dict[str, float]) -> tuple[list[str], dict[str, float]]:
    """The families a model answers better than chance (the 95% Wilson lower bound of its test
    accuracy above the family's chance level, 1 / options), in generator order, and each chance level.

    Only these are benchmarked: a family at chance ranks nothing and only adds noise to the mean."""
    learned, chance = [], {}
    for qtype in dict.fromkeys(s.qtype for s in samples):
        family = [s for s in samples if s.qtype == qtype]
        n, p = len(family), accs[qtype]
        chance[qtype] = sum(1 / len(s.options) for s in family) / n
        z = 1.96
        lower = (p + z * z / (2 * n) - z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)
        if lower > chance[qtype]:
            learned.append(qtype)
    return learned, chance


def write_card(out: Path, **record: Any) -> None:
    """``synthetic.json`` beside the weights: the families to test on and how the model was trained."""
    (out / "synthetic.json").write_text(json.dumps(record, indent=1) + "\n")


def train(kind: str, steps: int, batch_size: int, lr: float, seed: int, out: Path, threads: int,
          minutes: float | None = None, device: str = "cpu", val_samples: int = 96, test_samples: int = 256,
          qtypes: tuple[str, ...] | None = None, init: Path | None = None, relation_heads: bool = False) -> None:
    """Train ``steps`` steps, or with ``minutes`` for that much wall-clock time: the schedule then
    follows elapsed time instead of the step count (for a shared machine; not step-reproducible).
    ``qtypes``: the families to train on (default ``TRAIN_QTYPES[kind]``); the test still asks them all.
    ``init``: a trained model directory to go on training (fine-tuning) instead of a fresh model; its
    training stream continues where the model card says it stopped, and the new card keeps the old one.
    ``relation_heads``: add the decoder heads for relation questions (image only)."""
    qtypes = tuple(qtypes or TRAIN_QTYPES[kind])
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    processor = build_processor(kind)
    init_card = _init_card(init, kind) if init is not None else {}
    model = (build_model(kind) if init is None else
             AutoModelForImageTextToText.from_pretrained(init, local_files_only=True, dtype=torch.float32)).to(device).train()
    text_width = model.config.text_config.hidden_size if relation_heads else 0
    heads = AuxHeads(model.config.vision_config.hidden_size, kind, text_width).to(device)
    captured: dict[str, torch.Tensor] = {}
    hooks = [model.model.multi_modal_projector.register_forward_hook(lambda m, args, o: captured.__setitem__("x", args[0]))]
    if kind == "image":  # CLIP's CLS token: row 0 of the tower's last hidden state
        hooks.append(model.model.vision_tower.register_forward_hook(
            lambda m, args, o: captured.__setitem__("cls", o.last_hidden_state[:, 0])))
    colour_ids = torch.tensor(processor.tokenizer.convert_tokens_to_ids(list(COLOURS)), device=device)
    params = list(model.parameters()) + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    val = make_dataset(kind, "val", val_samples, qtypes=qtypes)
    data_seed = DEFAULT_SEED + 1000 * seed  # each model seed also sees its own training stream
    first = init_card.get("first_sample", 0) + init_card.get("steps", 0) * init_card.get("batch_size", 0)
    out.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(out)
    start = time.time()
    bar = tqdm(range(steps) if minutes is None else itertools.count(), desc=f"train {kind}", mininterval=30)
    for step in bar:
        progress = step / steps if minutes is None else (time.time() - start) / (60 * minutes)
        last = step + 1 == steps if minutes is None else progress >= 1
        for group in opt.param_groups:
            group["lr"] = lr * one_cycle(min(progress, 1.0))
        samples = [make_sample(kind, "train", first + step * batch_size + i, data_seed, qtypes) for i in range(batch_size)]
        batch = encode(processor, samples, with_answers=True).to(device)
        labels = torch.full_like(batch["input_ids"], -100)
        labels[:, -2:] = batch["input_ids"][:, -2:]  # left padded: the last two tokens are "answer </s>"
        output = model(**batch, labels=labels, output_hidden_states=relation_heads)
        lm_loss = output.loss
        words = colour_word_positions(batch["input_ids"], colour_ids) if relation_heads else None
        aux_loss = heads.loss(captured["x"], captured.get("cls"), samples, output.hidden_states, words)
        loss = lm_loss + aux_loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bar.set_postfix(lm=f"{lm_loss.item():.3f}", aux=f"{aux_loss.item():.3f}")
        if (step + 1) % 250 == 0 or last:
            model.eval()
            accs = accuracy_by_qtype(model, processor, val, batch_size=32)
            save_half(model, out)
            model.train()
            print(f"step {step + 1} {time.time() - start:.0f}s lm {lm_loss.item():.3f} aux {aux_loss.item():.3f} val {accs}", flush=True)
        if last:
            break
    for hook in hooks:
        hook.remove()
    model, processor = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).to(device).eval(), processor
    test = make_dataset(kind, "test", test_samples)
    accs = accuracy_by_qtype(model, processor, test, 32)
    seconds = time.time() - start
    learned, chance = learned_families(test, accs)
    write_card(out, kind=kind, seed=seed, eval_qtypes=learned, train_qtypes=list(qtypes), chance=chance,
               steps=step + 1, batch_size=batch_size, lr=lr, minutes=minutes, threads=threads, device=device, seconds=round(seconds),
               test_samples=test_samples, test_accuracy=accs, first_sample=first, relation_heads=relation_heads,
               **({"init": init_card} if init is not None else {}))
    print(f"trained {kind} in {seconds:.0f}s, {step + 1} steps; test accuracy (float16 weights) {accs}", flush=True)


def _init_card(init: Path, kind: str) -> dict[str, Any]:
    """The model card of the ``init`` model, checked to be a trained ``kind`` model."""
    if not (init / "model.safetensors").exists():
        raise FileNotFoundError(f"--init {init}: no model.safetensors there; point it at a trained model directory, "
                                f"e.g. {model_path(kind)}")
    card = json.loads((init / "synthetic.json").read_text()) if (init / "synthetic.json").exists() else {}
    if card.get("kind", kind) != kind:
        raise ValueError(f"--init {init} holds a model of kind {card['kind']!r}; --kind is {kind!r}")
    return card


def _families(text: str) -> tuple[str, ...]:
    families = tuple(f.strip() for f in text.split(",") if f.strip())
    if not families:
        raise argparse.ArgumentTypeError("name at least one family, e.g. relation or count,digit")
    return families


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=["image", "video"], default="image")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=24)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=None,
                        help="train for this much wall-clock time instead of --steps (the schedule follows time)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="torch device to train on, e.g. cuda (default cpu)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: the shipped model path)")
    parser.add_argument("--qtypes", type=_families, default=None,
                        help="comma-separated families to train on (default: every family of --kind); the test asks them all")
    parser.add_argument("--relation-heads", action="store_true",
                        help="image: train decoder heads that teach relation questions' two look-ups (see the module docstring)")
    parser.add_argument("--init", type=Path, default=None,
                        help="go on training this trained model directory (fine-tune) instead of a fresh model")
    args = parser.parse_args()
    if args.qtypes and set(args.qtypes) - set(IMAGE_QTYPES if args.kind == "image" else VIDEO_QTYPES):
        parser.error(f"--qtypes {','.join(args.qtypes)}: a {args.kind} model answers "
                     f"{', '.join(IMAGE_QTYPES if args.kind == 'image' else VIDEO_QTYPES)}")
    if args.relation_heads and args.kind != "image":
        parser.error("--relation-heads: only the image model answers relation questions; drop it for --kind video")
    train(args.kind, args.steps, args.batch_size, args.lr, args.seed, args.out or model_path(args.kind, args.seed), args.threads,
          args.minutes, args.device, qtypes=args.qtypes, init=args.init, relation_heads=args.relation_heads)


if __name__ == "__main__":
    main()
