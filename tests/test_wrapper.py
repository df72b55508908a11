"""The wrapper under real use: numpy / torch scalars, threads, failures, generate() paths."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny_models as T
import vlm_prune
from vlm_prune.methods.base import validate_budget


@pytest.mark.parametrize("keep, budget, expected", [
    (np.float32(0.5), None, (0.5, None)),
    (np.float64(1.0), None, (1.0, None)),
    (torch.tensor(0.25), None, (0.25, None)),
    (None, np.int64(4), (None, 4)),
    (None, torch.tensor(4), (None, 4)),
])
def test_numpy_and_torch_scalars_are_accepted(keep, budget, expected):
    out = validate_budget(keep, budget, required=True)
    assert out == expected and all(v is None or type(v) in (int, float) for v in out)


@pytest.mark.parametrize("keep, budget, message", [
    (np.float32(1.5), None, "keep must be a fraction in (0, 1], got 1.5"),
    (None, np.float64(4.0), "budget must be a whole number"),
    (torch.tensor([0.5, 0.5]), None, "keep must be a fraction"),
])
def test_bad_scalars_still_name_the_rule(keep, budget, message):
    with pytest.raises(ValueError) as err:
        validate_budget(keep, budget, required=True)
    assert message in str(err.value)


def test_wrap_with_numpy_budget_equals_python_budget():
    model = T.tiny_llava()
    inputs = T.llava_inputs()
    outs = []
    for budget in (4, np.int64(4)):
        vlm_prune.wrap(model, "fastv", budget=budget)
        try:
            with torch.no_grad():
                outs.append(model(**inputs).logits)
            assert model.vlm_prune.last_stats["visual_tokens_out"] == [4, 4]
        finally:
            vlm_prune.unwrap(model)
    assert torch.equal(outs[0], outs[1])
