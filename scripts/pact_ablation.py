"""PACT on the synthetic image models: its pruning layer L and its pruning share rho against the
budget, accuracy per task family averaged over the three image seeds (its earlier run is in the
history of BENCHMARKS.md, "PACT: where its loss comes from").

    python scripts/pact_ablation.py                  # the shipped models, about 4 minutes on one thread
    python scripts/pact_ablation.py --models DIR     # models laid out as DIR/image, DIR/image-seed1, ...
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

import vlm_prune
from vlm_prune.adapters import find_adapter
from vlm_prune.eval.synthetic import accuracy_by_qtype, make_dataset, model_path
from vlm_prune.methods.pact import PACT

FAMILIES = ("all", "count", "binding", "relation", "global", "digit")
SEEDS = (0, 1, 2)


def settings() -> list[tuple[int, float | None, float]]:
    """(layer, rho, keep): every layer at the default rho (None), then rho at the default layer 4."""
    by_layer = [(layer, None, keep) for layer in (1, 2, 3, 4, 5) for keep in (0.5, 0.11)]
    by_rho = [(4, rho, keep) for rho in (0.8, 1.0) for keep in (0.5, 0.11)]
    return by_layer + by_rho


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=None, help="root of image[-seedN] model folders (default: shipped)")
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    samples = make_dataset("image", "test", args.samples)
    results: dict[tuple, list[dict[str, float]]] = {}
    for seed in SEEDS:
        path = model_path("image", seed)
        path = path if args.models is None else args.models / path.name
        model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        results.setdefault(("unpruned", "-", 1.0), []).append(accuracy_by_qtype(model, processor, samples, batch_size=32))
        for layer, rho, keep in settings():
            method = PACT(layer=layer, rho=rho)
            vlm_prune.wrap(model, method, keep=keep, processor=processor)
            accs = accuracy_by_qtype(model, processor, samples, batch_size=32)
            vlm_prune.unwrap(model)
            rho_used = method.settings(find_adapter(model).family)[0]
            results.setdefault((layer, rho_used, keep), []).append(accs)
        print(f"seed {seed} done", flush=True)
    print("| layer L | rho | keep | " + " | ".join(FAMILIES) + " |")
    print("|---|---|---|" + "---|" * len(FAMILIES))
    for (layer, rho, keep), accs in results.items():
        means = [100 * sum(a.get(f, 0.0) for a in accs) / len(accs) for f in FAMILIES]
        print(f"| {layer} | {rho} | {keep} | " + " | ".join(f"{m:.1f}" for m in means) + " |")


if __name__ == "__main__":
    main()
