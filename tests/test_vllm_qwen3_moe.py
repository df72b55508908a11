"""vlm_prune inside vLLM on the MoE variants of Qwen3-VL and Qwen3.5 (issue 29): one engine per
architecture on a tiny random checkpoint laid out as the hub's (``vlm_prune.vllm.tiny.write_qwen3_vl_moe``:
fused, transposed experts and ``norm_topk_prob``; ``write_qwen3_5_moe``: one Linear per expert), which
vLLM 0.32 loads (transformers 5.19's own ``save_pretrained`` layout it does not: docs/design/vllm-plugin.md). The plugin
classes are the dense ones on vLLM's MoE classes; the experts route each kept token as it comes. A few
cases of each kind (the dense modules run the full matrices on the same plugin code).

Needs vLLM: CI runs this module in the vLLM environment (.ci/run); elsewhere it is skipped.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM test environment (.ci/run builds it)")

import numpy as np  # noqa: E402
from test_vllm_qwen import (  # noqa: E402  (the same prompts, media, requests and HF reference as Qwen2-VL)
    ENGINE_ARGS,
    PROMPTS,
    _case_id,
    _media,
    check_batch_equals_alone,
    check_plain_vllm,
    check_positions,
    load_hf,
    run_hf,
    run_vllm,
    vllm_request,
)
from test_vllm_qwen3 import FRAMES, check_slice_edges, check_slices_dry_run  # noqa: E402
from test_vllm_qwen3_5 import check_greedy_up_to_bf16  # noqa: E402

import vlm_prune.vllm as vp  # noqa: E402
from vlm_prune.vllm.tiny import write_qwen3_5_moe, write_qwen3_vl_moe  # noqa: E402

pytestmark = pytest.mark.timeout(900)
#: architecture -> (checkpoint writer, engine dtype: vLLM's CPU Gated DeltaNet kernel takes bfloat16 only)
ARCHS = {"Qwen3VLMoeForConditionalGeneration": (write_qwen3_vl_moe, "float32"),
         "Qwen3_5MoeForConditionalGeneration": (write_qwen3_5_moe, "bfloat16")}
CASES = [("image", "divprune", {"keep": 0.5}), ("image", "pool", {"budget": 5}), ("image", "cdpruner", {"keep": 0.5}),
         ("video", "random", {"keep": 0.5}), ("video", "uniform", {"budget": 10}), ("video", "dycoke", {"keep": 0.5})]


@pytest.fixture(scope="module", params=list(ARCHS), ids=["qwen3-vl-moe", "qwen3.5-moe"])
def arch(request, tmp_path_factory):
    """(architecture, checkpoint folder, engine dtype); its engine and HF model live while its tests run."""
    write, dtype = ARCHS[request.param]
    return request.param, write(tmp_path_factory.mktemp("moe") / "tiny", seed=0), dtype


@pytest.fixture(scope="module")
def llm(arch):
    engine = vp.LLM(str(arch[1]), "random", keep=1.0, **dict(ENGINE_ARGS, dtype=arch[2]))
    yield engine
    del engine


@pytest.fixture(scope="module")
def hf(arch):
    return load_hf(arch[1])


def check_equal(arch, llm, hf, kind: str, method, **budget) -> None:
    """vLLM's greedy answer is wrap()'s: token for token with log-probabilities within 2e-4 in float32; in
    bfloat16 the float32 wrapped model's greedy choices up to bfloat16 rounding (test_vllm_qwen3_5)."""
    tokens, logprobs = run_vllm(llm, kind, method, FRAMES, **budget)
    if arch[2] == "bfloat16":
        check_greedy_up_to_bf16(hf, kind, method, tokens, logprobs, **budget)
        return
    ref_tokens, ref_logprobs, _ = run_hf(hf, kind, method, FRAMES, **budget)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)


@pytest.mark.parametrize("kind", ["image", "video"])
def test_keep_all_equals_unwrapped_hf(arch, llm, hf, kind):
    check_equal(arch, llm, hf, kind, None)


@pytest.mark.timeout(600)
def test_keep_all_equals_plain_vllm(arch, llm, tmp_path):
    """The plugin with nothing pruned is vLLM's own MoE class, bit for bit, on the image and the video prompts."""
    check_plain_vllm(arch[1], llm, tmp_path, arch[0], dtype=arch[2])


@pytest.mark.parametrize("kind,method,budget", CASES, ids=[_case_id(*c) for c in CASES])
def test_method_equals_wrapped_hf(arch, llm, hf, kind, method, budget):
    """wrap()'s answer (check_equal) and its kept tokens at the same (t, h, w) positions."""
    _, _, ref_kept = run_hf(hf, kind, method, FRAMES, **budget)
    check_equal(arch, llm, hf, kind, method, **budget)
    check_positions(llm, kind, method, FRAMES, ref_kept, **budget)


def test_mixed_batch_equals_each_alone(llm):
    mixed = [("image", 0, "divprune", {"keep": 0.5}), ("video", 1, "uniform", {"keep": 0.5}), ("image", 1, None, {}),
             ("video", 0, "dycoke", {"keep": 0.5}), ("image", 0, "pool", {"budget": 5})]
    check_batch_equals_alone(llm, [vllm_request(PROMPTS[kind][i], _media(kind, FRAMES)[i], method, **budget)
                                   for kind, i, method, budget in mixed])


def test_refusals_per_request(arch, llm):
    name = "Qwen3-VL" if arch[0].startswith("Qwen3VL") else "Qwen3.5"
    with pytest.raises(ValueError, match="visionzip needs the vision tower's attention"):
        run_vllm(llm, "image", "visionzip", keep=0.5)
    with pytest.raises(ValueError, match=f"keyscore chooses a video's slices from the tower's features, but on {name}"):
        run_vllm(llm, "video", "keyscore", keep=0.5)
    with pytest.raises(ValueError, match=f"vidcom2 gives each slice of a video its own share.* on {name}"):
        run_vllm(llm, "video", "vidcom2", keep=0.5)
    with pytest.raises(ValueError, match=f"quota is refused on {name}"):
        run_vllm(llm, "video", "quota", keep=0.5)
    with pytest.raises(ValueError, match="prunes inside the language model"):
        run_vllm(llm, "image", "fastv", keep=0.5)


def test_the_dry_run_sees_the_real_slices(llm, monkeypatch):
    """Qwen3-VL's check on each MoE class (float32 and bfloat16 engines)."""
    check_slices_dry_run(llm, monkeypatch)


def test_edge_specs_keep_the_engine(llm):
    check_slice_edges(llm)
