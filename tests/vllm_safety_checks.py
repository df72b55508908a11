"""Checks of the serving-safety dry run (vlm_prune.vllm.safety, docs/serving-safety.md) shared by the vLLM
family tests: each processor dry-runs a request's item on the item's real shape, and specs at the edges of
what validation lets through never stop the engine."""
from __future__ import annotations

import json
from typing import Any

#: float values at the edges of what validation lets through, and beyond (subnormals, 1e-46, the largest
#: finite float32 / bfloat16 values, values that round to 0 or 1 in bfloat16 / float32)
EDGE_FLOATS = [5e-324, 1e-46, 1e-40, 1.1754943508222875e-38, 2.0**-9, 1 - 2.0**-25, 1 - 2.0**-9, 1 + 2.0**-24,
               3.3895313892515355e38, 3.4e38]
#: hostile specs of the image methods every family runs: CDPruner's theta at the edges, budgets at theirs
EDGE_SPECS = [*({"method": "cdpruner", "keep": 0.5, "knobs": {"theta": v}} for v in EDGE_FLOATS),
              {"method": "pool", "keep": 5e-324}, {"method": "divprune", "keep": 1 - 2.0**-25},
              {"method": "random", "budget": 2**63 - 1}, {"method": "cdpruner", "budget": 1}]


def record_dry_runs(monkeypatch: Any) -> list[tuple[str, tuple, str, int]]:
    """Every dry run from now on, cached or not: (kind, shape, dtype name, slots)."""
    from vlm_prune.vllm import safety

    calls: list[tuple[str, tuple, str, int]] = []
    real = safety._dry_run

    def spy(kind: str, text: str, shape: tuple, dtype_name: str, field: str) -> int:
        slots = real(kind, text, shape, dtype_name, field)
        calls.append((kind, shape, dtype_name, slots))
        return slots

    monkeypatch.setattr(safety, "_dry_run", spy)
    return calls


def with_spec(req: dict, spec: dict) -> dict:
    """The request with the spec among its processor settings."""
    return {**req, "mm_processor_kwargs": {**req.get("mm_processor_kwargs", {}), "vlm_prune": json.dumps(spec)}}


def _canonical(kind: str, shape: tuple) -> bool:
    """config.validate_spec's probe (a 6 x 6 image, 3 x 3 frames, width 16), not an item's real shape."""
    return shape[:3] == (36, (6, 6), 16) if kind == "image" else shape[1:3] == (9, (3, 3)) and shape[4] == 16


def check_dry_run_sees_the_item(llm: Any, req: dict, spec: dict, monkeypatch: Any, runs: int = 1) -> tuple:
    """The processor dry-runs ``req``'s one media item pruned by ``spec`` (once) on the item's real shape, at the
    engine's width and dtype: the tokens the dry run saw less the slots it returned, times the item's ``runs``
    (the frames or slices that each get those slots), are exactly the tokens the pruned prompt lacks against
    the engine's unpruned one (keep=1.0). So the count it saw is the item's. Returns (kind, shape, slots)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    full = llm.generate(req, params, use_tqdm=False)[0]
    calls = record_dry_runs(monkeypatch)
    out = llm.generate(with_spec(req, spec), params, use_tqdm=False)[0]
    real = {(kind, shape, dtype, slots) for kind, shape, dtype, slots in calls if not _canonical(kind, shape)}
    assert len(real) == 1, real
    (kind, shape, dtype, slots), = real
    config = llm.llm_engine.model_config
    assert dtype == str(config.dtype).removeprefix("torch.")
    assert shape[2 if kind == "image" else 4] == config.hf_config.get_text_config().hidden_size
    seen = shape[0] if kind == "image" else shape[0] * shape[1]
    grid = shape[1] if kind == "image" else shape[2]
    assert grid is None or grid[0] * grid[1] == (seen if kind == "image" else shape[1])
    dropped = len(full.prompt_token_ids) - len(out.prompt_token_ids)
    assert 0 < dropped == runs * (seen - slots), (shape, slots, dropped)
    return kind, shape, slots


def check_edges_keep_the_engine(llm: Any, req: dict, specs: list[dict] = EDGE_SPECS) -> None:
    """Each hostile spec is refused (a ValueError naming the spec's field: the server's 400) or answered, and
    the engine then answers ``req`` as before."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=2)
    before = llm.generate(req, params, use_tqdm=False)[0]
    answered = 0
    for spec in specs:
        try:
            llm.generate(with_spec(req, spec), params, use_tqdm=False)
            answered += 1
        except ValueError as err:
            assert "vlm_prune" in str(err), (spec, err)
    after = llm.generate(req, params, use_tqdm=False)[0]
    assert list(after.outputs[0].token_ids) == list(before.outputs[0].token_ids)
    assert 0 < answered < len(specs)
