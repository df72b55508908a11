"""The one pruning config file: a JSON file that ``vlm_prune.wrap(model, config=PATH)``,
``vlm-prune eval --config PATH`` and ``vlm-prune serve --config PATH`` read as they are, and that
``vlm-prune tune`` writes for its recommendation (docs/config.md)::

    {
      "format": "vlm-prune-config/1",
      "methods": [{"method": "quota"}, {"method": "pact", "layer": 2}],
      "keep": 0.25,
      "seed": 0,
      "about": {"written_by": "vlm-prune tune", "retention_lower": 0.98}
    }

``methods``: one entry per stage (frames -> vision / vit -> llm, at most one each, as for wrap()),
each a registered method name under ``"method"`` and any of that method's knobs (``vlm-prune
methods`` lists them with their defaults); ``keep`` (a fraction) or ``budget`` (tokens per image,
per video for frames methods) as in wrap(); ``seed`` for methods that sample. ``about`` is free
JSON that nothing reads back (tune puts what it measured there). Any other key is an error.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

FORMAT = "vlm-prune-config/1"
KEYS = ("format", "methods", "keep", "budget", "seed", "about")


class ConfigError(ValueError):
    """A config file that does not follow the format; the message names the file, the field and the fix."""


@dataclass(frozen=True)
class PruneConfig:
    """A validated config: ``methods`` as (name, ((knob, value), ...)) in stage order, the budget, the seed."""

    methods: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]
    keep: float | None = None
    budget: int | None = None
    seed: int = 0

    def build(self) -> list[Any]:
        """Fresh configured method objects, as wrap() takes them."""
        from vlm_prune.registry import method_class

        return [method_class(name)(**dict(knobs)) for name, knobs in self.methods]

    def wrap_kwargs(self) -> dict[str, Any]:
        """``method`` / ``keep`` / ``budget`` / ``seed`` for :func:`vlm_prune.wrap`."""
        return {"method": self.build(), "keep": self.keep, "budget": self.budget, "seed": self.seed}

    @property
    def pipeline(self) -> str:
        """The method names joined with '+' ("quota+pact"), as ``vlm-prune eval --method`` spells them."""
        return "+".join(name for name, _ in self.methods)

    def label(self) -> str:
        """A short name, usable as a folder name: "quota+pact-layer2_keep0.25"."""
        parts = []
        for name, knobs in self.methods:
            parts.append(name + "".join(f"-{k}{_plain_text(v)}" for k, v in knobs))
        amount = f"keep{self.keep:g}" if self.keep is not None else f"budget{self.budget}"
        return f"{'+'.join(parts)}_{amount}"

    def to_dict(self, about: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT,
                               "methods": [{"method": name, **{k: _jsonable(v) for k, v in knobs}}
                                           for name, knobs in self.methods]}
        out.update({"keep": self.keep} if self.keep is not None else {"budget": self.budget})
        out["seed"] = self.seed
        if about:
            out["about"] = about
        return out

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys, no ``about``): equal configs give equal text."""
        return json.dumps(self.to_dict(), sort_keys=True)


def _plain_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(_plain_text, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, (list, tuple)) else value


def _frozen(value: Any) -> Any:
    """JSON lists as tuples (hashable; what the methods' knobs take)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def read_config(source: str | os.PathLike | dict[str, Any]) -> dict[str, Any]:
    """The raw JSON object of a config file (or the dict as given)."""
    if isinstance(source, dict):
        return source
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config {path}: cannot read it ({err})") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"config {path} is not JSON ({err}); see docs/config.md for the format") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path}: expected a JSON object with 'methods' and 'keep' or 'budget', "
                          f"got {type(raw).__name__}")
    return raw


def load_config(source: str | os.PathLike | dict[str, Any] | PruneConfig) -> PruneConfig:
    """Read and validate a config file (a path), a dict of the same shape, or pass a PruneConfig through.

    Checks every key, every method name and knob, the budget and the pipeline (one method per
    stage) with the rules wrap() applies; raises :class:`ConfigError` naming what is wrong.
    """
    if isinstance(source, PruneConfig):
        return source
    where = "config" if isinstance(source, dict) else f"config {os.fspath(source)}"
    raw = read_config(source)
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; a config has {', '.join(KEYS)}")
    if raw.get("format", FORMAT) != FORMAT:
        raise ConfigError(f"{where}: format {raw['format']!r} is not {FORMAT!r}, the one this version reads")
    entries = raw.get("methods")
    if isinstance(entries, (str, dict)):
        entries = [entries]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: 'methods' must be a non-empty list like [{{\"method\": \"fastv\", \"layer\": 2}}]")
    methods = tuple(_method_entry(e, f"{where}: methods[{i}]") for i, e in enumerate(entries))
    cfg = PruneConfig(methods, raw.get("keep"), raw.get("budget"), raw.get("seed", 0))
    from vlm_prune.api import build_pipeline
    from vlm_prune.methods.base import validate_seed

    try:
        validate_seed(cfg.seed)
        build_pipeline(cfg.build(), keep=cfg.keep, budget=cfg.budget)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from None
    return cfg


def _method_entry(entry: Any, where: str) -> tuple[str, tuple[tuple[str, Any], ...]]:
    from vlm_prune.registry import method_class, method_knobs

    if isinstance(entry, str):
        entry = {"method": entry}
    if not isinstance(entry, dict) or not isinstance(entry.get("method"), str):
        raise ConfigError(f"{where}: expected an object with a method name, like {{\"method\": \"pact\", \"layer\": 2}}")
    try:
        name = method_class(entry["method"]).name
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None
    knobs = method_knobs(name)
    given = {k: _frozen(v) for k, v in entry.items() if k != "method"}
    wrong = sorted(set(given) - set(knobs))
    if wrong:
        raise ConfigError(f"{where}: {name} has no knob {', '.join(wrong)}; its knobs: {', '.join(knobs) or '(none)'}")
    return name, tuple(sorted(given.items()))


def save_config(cfg: PruneConfig, path: str | os.PathLike, about: dict[str, Any] | None = None) -> str:
    """Write ``cfg`` (and the free ``about`` notes) as a config file; returns its path."""
    path = os.fspath(path)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(cfg.to_dict(about), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path
