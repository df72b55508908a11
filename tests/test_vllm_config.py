"""vlm_prune.vllm's configuration side (no vLLM needed): specs, hf_overrides, refusals."""
from __future__ import annotations

import json

import pytest

import vlm_prune.vllm as vp
from vlm_prune.vllm.config import build_method, mrope_rope_parameters
from vlm_prune.vllm.tiny import LlavaShape, write_llava


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llava(tmp_path_factory.mktemp("llava") / "tiny", LlavaShape())


def test_engine_kwargs_carry_method_budget_and_positions(checkpoint):
    kw = vp.engine_kwargs(str(checkpoint), "divprune", budget=4, seed=3, max_model_len=128)
    over = kw["hf_overrides"]
    assert over["architectures"] == ["VlmPruneLlavaForConditionalGeneration"]
    assert over["vlm_prune"] == {"method": "divprune", "knobs": {}, "keep": None, "budget": 4, "seed": 3}
    rope = over["text_config"]["rope_parameters"]
    assert sum(rope["mrope_section"]) == 32 // 2  # head_dim 32: three sections cover every rotary pair
    assert kw["max_model_len"] == 128 and kw["mm_processor_cache_gb"] == 0


def test_method_objects_and_knobs_round_trip():
    from vlm_prune.methods import VisionZip

    spec = vp.method_spec(VisionZip(dominant_ratio=0.5, variant="slots"), keep=0.25)
    assert {k: spec["knobs"][k] for k in ("dominant_ratio", "variant")} == {"dominant_ratio": 0.5, "variant": "slots"}
    m = build_method(json.loads(json.dumps(spec)))
    assert (m.name, m.dominant_ratio, m.variant, m.keep) == ("visionzip", 0.5, "slots", 0.25)
    assert m.n_keep(576) == 144  # the count wrap() keeps: floor(0.25 * 576)
    assert json.loads(vp.request_kwargs("pool", budget=64)["vlm_prune"])["budget"] == 64


@pytest.mark.parametrize("name", ["fastv", "pact", "adaptinfer"])
def test_in_llm_methods_are_refused_with_the_reason(name):
    with pytest.raises(ValueError, match=r"paged KV cache.*docs/vllm.md"):
        vp.method_spec(name, keep=0.25)


def test_other_refusals_name_the_fix(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="runs the frames methods on the video of LlavaOnevision"):
        vp.engine_kwargs(str(checkpoint), "uniform", keep=0.5)
    with pytest.raises(ValueError, match="QuoTA's token count per video follows its frame scores"):
        vp.engine_kwargs(str(checkpoint), "quota", keep=0.5)  # per request only, through vp.quota_request
    with pytest.raises(ValueError, match="frames methods uniform, keyscore"):
        vp.method_spec(["uniform", "pool"], keep=0.5)
    with pytest.raises(ValueError, match="Did you mean 'divprune'"):
        vp.method_spec("divprun", keep=0.5)
    with pytest.raises(ValueError, match="either keep"):
        vp.method_spec("pool", keep=0.5, budget=3)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GitForCausalLM"]}))
    with pytest.raises(ValueError, match="vlm_prune.vllm serves .* is GitForCausalLM"):
        vp.engine_kwargs(str(tmp_path), "pool", keep=0.5)
    with pytest.raises(FileNotFoundError, match="local checkpoint folder"):
        vp.engine_kwargs(str(tmp_path / "missing"), "pool", keep=0.5)


@pytest.mark.parametrize("arch", ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"])
def test_qwen_keeps_its_mrope_and_refuses_visionzip(arch, tmp_path):
    """Qwen's own M-RoPE sections stay (no rope override); VisionZip is refused as wrap() refuses it, QuoTA
    as the engine's default (it is served per request, through vp.quota_request)."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    kwargs = vp.engine_kwargs(str(tmp_path), "divprune", budget=4)
    assert kwargs["hf_overrides"]["architectures"] == [f"VlmPrune{arch}"] and "text_config" not in kwargs["hf_overrides"]
    with pytest.raises(ValueError, match="visionzip needs the vision tower's attention.*use divprune"):
        vp.engine_kwargs(str(tmp_path), "visionzip", keep=0.5)
    with pytest.raises(ValueError, match="QuoTA's token count per video follows its frame scores"):
        vp.engine_kwargs(str(tmp_path), "quota", keep=0.5)


def test_mrope_sections_cover_partial_rotary():
    params = mrope_rope_parameters({"hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 5e5})
    assert params["mrope_section"] == [22, 21, 21] and params["rope_theta"] == 5e5


def test_serve_command_line(checkpoint, capsys):
    """`vlm-prune serve` builds vLLM's OpenAI server command: the plugin's hf_overrides, the processor
    cache off, the user's vLLM options last; refusals are usage errors (exit 2)."""
    import shlex

    from vlm_prune.cli import main

    assert main(["serve", str(checkpoint), "--method", "pool", "--keep", "0.25", "--dry-run",
                 "--vllm", "--port 8001 --data-parallel-size 2"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
    over = json.loads(argv[argv.index("--hf-overrides") + 1])
    assert over["vlm_prune"]["method"] == "pool" and over["vlm_prune"]["keep"] == 0.25
    assert argv[argv.index("--mm-processor-cache-gb") + 1] == "0"
    assert argv[-4:] == ["--port", "8001", "--data-parallel-size", "2"]
    assert main(["serve", str(checkpoint), "--method", "pact", "--keep", "0.25", "--dry-run"]) == 2
    assert "paged KV cache" in capsys.readouterr().err
