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
    assert over["vlm_prune"] == {"method": "divprune", "knobs": {"positions": None}, "keep": None, "budget": 4, "seed": 3}
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
    from vlm_prune.methods.prumerge import PruMerge

    with pytest.raises(ValueError, match="outliers='batch' counts the outliers over every image.*use outliers='image'"):
        vp.method_spec(PruMerge(outliers="batch", plus=True), keep=0.5)
    from vlm_prune.frames.fastvid import FastVID

    with pytest.raises(ValueError, match="fastvid top_up=False keeps the official counts.*use top_up=True"):
        vp.method_spec(FastVID(top_up=False), keep=0.5)
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


# ---- issue 27: one validation of a per-request spec (the server runs it before the engine) -------------
LLAVA = "LlavaForConditionalGeneration"
ONEVISION = "LlavaOnevisionForConditionalGeneration"
QWEN = "Qwen2VLForConditionalGeneration"
QWEN3 = "Qwen3VLForConditionalGeneration"
NEXT = "LlavaNextForConditionalGeneration"
NEXT_VIDEO = "LlavaNextVideoForConditionalGeneration"


def _spec(**over) -> str:
    return json.dumps({"method": "divprune", "keep": 0.5, **over})


@pytest.mark.parametrize("raw, arch, field, message", [
    # the three specs that killed the server on LLaVA-1.5 (issue 27) are refused up front
    (_spec(method="quota"), LLAVA, "vlm_prune.method", "runs the frames methods on the video of LlavaOnevision"),
    (_spec(method="uniform"), LLAVA, "vlm_prune.method", "runs the frames methods on the video of LlavaOnevision"),
    (_spec(method="quota", quota={"scores": [1.0, 0.5]}), LLAVA, "vlm_prune.method", "not of LlavaForConditionalGeneration"),
    (_spec(seed="abc"), LLAVA, "vlm_prune.seed", "seed must be a whole number (an integer), got 'abc'"),
    (_spec(seed=1.5), QWEN, "vlm_prune.seed", "got 1.5"),
    (_spec(seed=True), None, "vlm_prune.seed", "got True"),
    # bare QuoTA (no scores) on a video model: the recipe
    (_spec(method="quota"), ONEVISION, "vlm_prune.method", "send each QuoTA request through vlm_prune.vllm.quota_request"),
    # vague before: non-JSON text, unknown knobs; now they name the field and what is allowed
    ("{method: divprune}", None, "vlm_prune", "not JSON text (Expecting property name"),
    ("[1, 2]", None, "vlm_prune", "a spec is a JSON object"),
    (_spec(knobs={"dominant": 0.5}, method="visionzip"), LLAVA, "vlm_prune.knobs",
     "unknown knob 'dominant' of method 'visionzip'; its knobs: dominant_ratio, variant, positions"),
    (_spec(knobs={"theta": 0.5}), None, "vlm_prune.knobs", "unknown knob 'theta' of method 'divprune'; its knobs: positions"),
    (_spec(knobs={"dominant_ratio": "half"}, method="visionzip"), LLAVA, "vlm_prune.knobs.dominant_ratio",
     "method 'visionzip' takes a finite number, got 'half'"),
    (_spec(knobs={"dominant_ratio": 2.0}, method="visionzip"), LLAVA, "vlm_prune.knobs.dominant_ratio",
     "dominant_ratio must be in [0, 1]"),
    (_spec(knobs={"weights": [1, 2]}, method="keyscore"), ONEVISION, "vlm_prune.knobs.weights", "a list of 3"),
    (_spec(knobs={"encoder": "clip"}, method="keyscore"), ONEVISION, "vlm_prune.knobs.encoder", "which a request cannot send"),
    (_spec(budgett=3), None, "vlm_prune", "unknown key 'budgett'; a spec has the keys method, knobs, keep, budget"),
    (_spec(method=3), None, "vlm_prune.method", "a method name is required"),
    (_spec(method="divprun"), None, "vlm_prune.method", "Did you mean 'divprune'"),
    (_spec(method="fastv"), None, "vlm_prune", "paged KV cache"),
    (_spec(method="visionzip"), QWEN, "vlm_prune.method", "visionzip needs the vision tower's attention"),
    # issues 29-31: the methods added to the plugin, where they cannot run
    (_spec(method="dycoke", knobs={"decode_pruning": True}), ONEVISION, "vlm_prune.knobs.decode_pruning",
     "dycoke's decode-time KV pruning (decode_pruning=True) changes which cached keys each decode step attends to"),
    (_spec(method="fastvid"), QWEN3, "vlm_prune.method", "fastvid ranks a video's tokens by the attention they receive"),
    (_spec(method="holitom"), ONEVISION, "vlm_prune", 'the paper\'s \'w/o M\': pass inner=False (knobs {"inner": false})'),
    (_spec(method="holitom", knobs={"inner": "no"}), ONEVISION, "vlm_prune.knobs.inner", "takes true / false"),
    (_spec(method="vidcom2"), LLAVA, "vlm_prune.method", "frames method 'vidcom2' chooses video frames"),
    (_spec(method="keyscore"), QWEN3, "vlm_prune.method", "keyscore chooses a video's slices from the tower's features"),
    (_spec(method="fastervlm"), QWEN3, "vlm_prune.method", "fastervlm needs the vision tower's attention"),
    # issue 30: HiRED / PruMerge read the CLIP tower's [CLS] attention (LLaVA-1.5; HiRED also LLaVA-NeXT)
    (_spec(method="prumerge", keep=None), LLAVA, "vlm_prune.method",
     "prumerge without keep / budget keeps an adaptive count (the IQR outliers of the tower's [CLS] attention)"),
    (_spec(method="prumerge"), ONEVISION, "vlm_prune.method", "prumerge ranks an image's patches by the vision "
     "tower's [CLS] attention, which wrap() reads on LLaVA-1.5 images only"),
    (_spec(method="hired"), QWEN, "vlm_prune.method", "hired ranks an image's patches by the vision tower's [CLS] "
     "attention, which wrap() reads on LLaVA-NeXT and LLaVA-1.5 images only"),
    (_spec(method="hired", keep=None), QWEN3, "vlm_prune.method", "hired ranks an image's patches"),
    # issue 29: LLaVA-NeXT refuses what wrap() refuses there, and HiRED's official count (known after the tower)
    (_spec(method="visionzip"), NEXT, "vlm_prune.method", "visionzip reads one tower row per image, but a LLaVA-NeXT "
     "image is a base image plus anyres tiles"),
    (_spec(method="hired", keep=None), NEXT, "vlm_prune.method", "hired without keep / budget keeps the official "
     "count on LLaVA-NeXT"),
    (_spec(method="uniform"), NEXT, "vlm_prune.method", "frames method 'uniform' chooses video frames"),
    (_spec(method="hired"), NEXT_VIDEO, "vlm_prune.method", "hired is refused on LLaVA-NeXT-Video's video"),
    (_spec(method="quota"), NEXT_VIDEO, "vlm_prune.method", "send each QuoTA request through vlm_prune.vllm.quota_request"),
    (_spec(method="holitom"), NEXT_VIDEO, "vlm_prune.method", "holitom supports llava_onevision"),
    (_spec(keep=-1), None, "vlm_prune", "keep must be a fraction in (0, 1], got -1"),
    (_spec(keep="abc"), None, "vlm_prune", "keep must be a fraction"),
    (_spec(keep=None, budget=0), None, "vlm_prune", "budget must be a whole number of tokens >= 1, got 0"),
    (_spec(budget=4), None, "vlm_prune", "give either keep= (a fraction) or budget="),
    (_spec(quota={"scores": [1]}), ONEVISION, "vlm_prune.quota", "only method 'quota' takes it"),
    (_spec(method="quota", quota={"scores": [-1]}), ONEVISION, "vlm_prune.quota.scores", "finite scores >= 0"),
    (_spec(method="quota", quota={"phase": "score", "grid": [0, 2]}), ONEVISION, "vlm_prune.quota.grid", "[rows, cols]"),
])
def test_a_bad_spec_is_refused_naming_the_field_and_what_it_allows(raw, arch, field, message):
    from vlm_prune.vllm.config import SpecError, validate_spec

    with pytest.raises(SpecError) as err:
        validate_spec(raw, arch)
    assert err.value.field == f"mm_processor_kwargs.{field}"
    assert str(err.value).startswith(f"mm_processor_kwargs.{field}: ") and message in str(err.value)


def test_llava_next_checkpoints_get_their_plugin_classes(tmp_path):
    """issue 29: LLaVA-NeXT and LLaVA-NeXT-Video checkpoints are served by their plugin classes, with the
    one-row M-RoPE override; HiRED with a budget on NeXT passes, without one it is refused before vLLM starts."""
    from vlm_prune.vllm.tiny import write_llava_next, write_llava_next_video

    for write, name, method in ((write_llava_next, "VlmPruneLlavaNextForConditionalGeneration", "hired"),
                                (write_llava_next_video, "VlmPruneLlavaNextVideoForConditionalGeneration", "uniform")):
        folder = write(tmp_path / name)
        over = vp.engine_kwargs(str(folder), method, keep=0.5)["hf_overrides"]
        assert over["architectures"] == [name] and over["vlm_prune"]["method"] == method
        assert sum(over["text_config"]["rope_parameters"]["mrope_section"]) == 16
    with pytest.raises(ValueError, match="hired without keep / budget keeps the official count on LLaVA-NeXT"):
        vp.engine_kwargs(str(tmp_path / "VlmPruneLlavaNextForConditionalGeneration"), "hired")


def test_valid_specs_pass_with_their_defaults_and_any_integer_seed():
    from vlm_prune.vllm.config import validate_spec

    assert validate_spec('{"method": "Pool", "budget": 4}', LLAVA) == {
        "method": "pool", "knobs": {}, "keep": None, "budget": 4, "seed": 0}
    assert validate_spec(_spec(seed=10**30), LLAVA)["seed"] == 10**30  # the formula no longer overflows
    assert validate_spec(_spec(method="quota", quota={"scores": [0.2, 1]}), ONEVISION)["quota"] == {"scores": [0.2, 1]}
    assert validate_spec(_spec(method="quota", keep=1.0), QWEN)["method"] == "quota"  # nothing to score
    assert validate_spec(_spec(method="visionzip", knobs={"dominant_ratio": 1, "positions": None}), LLAVA)["knobs"] == {
        "dominant_ratio": 1, "positions": None}
    spec = vp.method_spec("cdpruner", keep=0.25, seed=-3)
    assert validate_spec(spec, "VlmPruneQwen2VLForConditionalGeneration") == spec  # the plugin's class name too


def test_holitom_runs_its_outer_stage_alone_as_wrap_does():
    """vLLM cannot merge inside the LLM: the default holitom (inner=True) is refused with the fix, and
    holitom inner=False keeps per video the count wrap(model, HoliTom(inner=False)) keeps, with a target
    and without one (the official retain=0.1)."""
    import tiny_models as T
    import vlm_prune
    from vlm_prune.frames.holitom import HoliTom
    from vlm_prune.vllm.config import method_of, validate_spec
    from vlm_prune.vllm.frames import frames_slots

    with pytest.raises(ValueError, match="merges a video's tokens inside the language model.*pass inner=False"):
        vp.method_spec("holitom", keep=0.25)
    with pytest.raises(ValueError, match="pass inner=False"):
        vp.method_spec(HoliTom(layer=2), budget=5)
    for target in ({"keep": 0.25}, {"budget": 5}, {}):
        spec = validate_spec(json.dumps({"method": "holitom", "knobs": {"inner": False}, **target}), ONEVISION)
        method = method_of(spec)
        assert (method.name, method.stage, method.inner) == ("holitom", "frames", False)
        model = T.tiny_onevision()
        vlm_prune.wrap(model, HoliTom(inner=False), **target)
        stats = T.forward_stats(model, T.onevision_video_inputs(model, frames=8))  # 8 frames of 2 x 2 tokens
        assert [frames_slots(method, 8, 4)] * 2 == stats["visual_tokens_out"] == [{"keep": 8, "budget": 5}.get(
            next(iter(target), ""), 3)] * 2


def test_request_kwargs_runs_the_same_validation(checkpoint):
    """vp.request_kwargs refuses what the server would refuse: with model=, also per model."""
    from vlm_prune.vllm.config import SpecError

    with pytest.raises(ValueError, match="seed must be a whole number"):
        vp.request_kwargs("random", keep=0.5, seed="abc")
    for method in ("quota", "uniform"):
        with pytest.raises(SpecError, match="runs the frames methods on the video"):
            vp.request_kwargs(method, keep=0.5, model=str(checkpoint))
        with pytest.raises(SpecError, match="runs the frames methods on the video"):
            vp.request_kwargs(method, keep=0.5, model=LLAVA)
    assert json.loads(vp.request_kwargs("random", keep=0.5, seed=10**30, model=str(checkpoint))["vlm_prune"])["seed"] == 10**30
    with pytest.raises(ValueError, match="seed must be a whole number"):
        vp.engine_kwargs(str(checkpoint), "random", keep=0.5, seed=2.5)


def test_item_generator_keeps_every_seed_torch_took_and_takes_any_integer():
    """The seed formula seed * 1_000_003 + rank overflowed torch's 64-bit seed above ~1.8e13 (issue 27);
    modulo 2**64 it gives the same generator for every seed that worked (negative ones too: torch reads
    them in two's complement) and a generator for any integer."""
    import torch

    from vlm_prune.methods.base import item_generator

    for seed, rank in [(0, 0), (7, 2), (-5, 1), (18_000_000_000_000, 3), (-9_000_000_000_000, 0)]:
        old = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        assert torch.equal(torch.rand(4, generator=item_generator(seed, rank)), torch.rand(4, generator=old))
    with pytest.raises((RuntimeError, ValueError)):
        torch.Generator().manual_seed(10**30 * 1_000_003)
    assert item_generator(10**30, 1).initial_seed() == (10**30 * 1_000_003 + 1) % 2**64


def test_wrap_refuses_a_seed_that_is_not_an_integer():
    import tiny_models as T

    import vlm_prune

    with pytest.raises(ValueError, match="seed must be a whole number"):
        vlm_prune.wrap(T.tiny_llava(), "random", keep=0.5, seed="abc")


def test_the_method_cache_is_bounded():
    """Distinct per-request budgets build distinct method objects; the cache keeps the CACHE_SIZE most
    recently used, so many distinct keeps do not grow memory forever (issue 27)."""
    import gc
    import weakref

    from vlm_prune.vllm import config

    first = config.method_of(json.loads(vp.request_kwargs("divprune", budget=1)["vlm_prune"]))
    ref = weakref.ref(first)
    del first
    for budget in range(2, 3 * config.CACHE_SIZE):
        spec = vp.request_kwargs("divprune", budget=budget)["vlm_prune"]
        assert config.method_of(config.validate_spec(spec)).budget == budget
    gc.collect()
    assert ref() is None, "the first method object outlived 3 x CACHE_SIZE newer specs"
    assert config._method_of.cache_info().currsize <= config.CACHE_SIZE
    assert config._validated.cache_info().currsize <= config.CACHE_SIZE


# ---- serving safety: every spec the server accepts runs in the engine (docs/serving-safety.md) ----------
#: float values from the whole float range: subnormals, the largest finite values, values that round to 0 or 1
#: in float32 / bfloat16, and ordinary ones
EDGE_FLOATS = [5e-324, 1e-310, 1e-46, 1e-40, 1.1754943508222875e-38, 1e-30, 2.0**-9, 0.0, 0.5, 1 - 2.0**-25,
               1 - 2.0**-9, 1.0, 1 + 2.0**-24, 7.5, 1e30, 3.3895313892515355e38, 3.4e38, 1.7976931348623157e308, -1e-46,
               -1.0]


def _float_knobs(name: str) -> list[str]:
    import typing

    from vlm_prune.registry import method_class, method_knobs

    hints = typing.get_type_hints(method_class(name).__init__)
    return [k for k in method_knobs(name) if "float" in str(hints.get(k)) and "tuple" not in str(hints.get(k))]


def _edge_specs(seed: int = 35) -> list[dict]:
    """Every float knob of every served method at every edge value (one knob at a time, the others at their
    defaults), KeyScore's weights too, and keep at the edges; a few random pairs of edge knobs."""
    import random

    from vlm_prune.vllm.config import FRAMES_SUPPORTED, SUPPORTED

    rng = random.Random(seed)
    specs = []
    for name in SUPPORTED + FRAMES_SUPPORTED + ("quota",):
        base = {"method": name, "keep": 0.5}
        base.update({"holitom": {"knobs": {"inner": False}}, "keyscore": {"knobs": {"proposals": "all"}},
                     "quota": {"quota": {"scores": [0.9, 0.1, 0.5, 0.3]}}}.get(name, {}))
        knobs = _float_knobs(name) + (["weights"] if name == "keyscore" else [])
        for knob in knobs:
            for value in EDGE_FLOATS:
                value = [value, 1.0, 1.0] if knob == "weights" else value
                specs.append({**base, "knobs": {**base.get("knobs", {}), knob: value}})
        for _ in range(3 if len(knobs) > 1 else 0):
            pair = rng.sample(knobs, 2)
            specs.append({**base, "knobs": {**base.get("knobs", {}), **{k: rng.choice(EDGE_FLOATS) for k in pair
                                                                           if k != "weights"}}})
        specs += [{**base, "keep": keep} for keep in (5e-324, 1e-300, 1e-46, 1 - 2.0**-60, 1.0)]
    return specs


#: an anyres image's tile map (LLaVA-NeXT: each packed row's tower row and patch, -1 for a newline): a 2 x 2 base
#: image, then two tiles side by side whose unpadding kept 2 x 2 patches each, a newline ending each row
TILES = ([0, 0, 0, 0, 1, 1, 2, 2, -1, 1, 1, 2, 2, -1], [0, 1, 2, 3, 0, 1, 0, 1, -1, 2, 3, 2, 3, -1])


def _tiles() -> tuple[bytes, bytes]:
    import torch

    return tuple(torch.tensor(m, dtype=torch.int16).numpy().tobytes() for m in TILES)


def test_every_accepted_spec_runs_the_engines_arithmetic_on_every_family():
    """The offline fuzz test: every float knob of every served method drawn from the whole float range. Each spec
    the validation accepts runs the method's count and allocation code as the engine runs it, on other features
    than the validation's dry run (Gaussian of another seed, an image / video of another shape, float32 and
    bfloat16; an anyres tile map for the methods that select per crop), and must not raise; every model class the
    plugin serves validates a share of them, and each refusal names a field of the spec."""
    import torch

    from vlm_prune.vllm.config import ARCHITECTURES, SpecError, method_of, validate_spec
    from vlm_prune.vllm.safety import run_synthetic

    accepted, refused, methods = 0, 0, set()
    for i, spec in enumerate(_edge_specs()):
        text = json.dumps(spec)
        for arch in [None] + [a for j, a in enumerate(ARCHITECTURES) if (i + j) % 8 == 0]:
            try:
                valid = validate_spec(text, arch)
            except SpecError as err:
                assert err.field.startswith("mm_processor_kwargs.vlm_prune"), err
                refused += 1
                continue
            if arch is not None:
                continue
            accepted += 1
            methods.add(valid["method"])
            video = method_of({k: v for k, v in valid.items() if k != "quota"}).stage == "frames"
            for dtype in (torch.float32, torch.bfloat16):
                shape = (4, 12, (3, 4), None, 24) if video else (20, (4, 5), 24)
                if dtype == torch.bfloat16:
                    shape = (4, 4, (2, 2), (3, 3), 8) if video else (7, None, 8)
                run_synthetic("video" if video else "image", valid, shape, dtype, 7)
                if not video:  # (the tile map's 12 visual tokens)
                    run_synthetic("image", valid, (12, None, shape[2], _tiles()), dtype, 7)
    assert accepted > 150 and refused > 300, (accepted, refused)
    assert methods >= {"vidcom2", "fastvid", "holitom", "dycoke", "quota", "keyscore", "cdpruner", "visionzip", "hired"}


def test_edge_floats_the_issue_named_are_refused_naming_the_knob():
    """VidCom2 temperature 1e-46 (0 in float32: 0 / 0, NaN counts, the engine died), a 401-digit theta, QuoTA's
    weights at 1e308: each a 400 naming the knob."""
    from vlm_prune.vllm.config import SpecError, validate_spec

    scores = {"scores": [1.0, 0.5, 0.2, 0.1]}
    for raw, arch, field, message in [
            (_spec(method="vidcom2", knobs={"temperature": 1e-46}), ONEVISION, "knobs.temperature", "become 0"),
            (_spec(method="vidcom2", knobs={"temperature": 1e-46}), QWEN, "knobs.temperature", "become 0"),
            ('{"method": "cdpruner", "keep": 0.5, "knobs": {"theta": ' + "9" * 401 + "}}", LLAVA, "knobs.theta",
             "takes a finite number or null, got 9999"),
            (_spec(method="quota", knobs={"weight_scale": 1e308}, quota=scores), ONEVISION, "knobs.weight_scale", "1e+308"),
            (_spec(method="quota", knobs={"weight_power": 1e308}, quota=scores), ONEVISION, "knobs.weight_power", "1e+308"),
            (_spec(method="quota", knobs={"weight_power": 1e30}, quota=scores), ONEVISION, "knobs.weight_power",
             "OverflowError"),
            (_spec(keep=10**400), LLAVA, "keep", "keep must be a fraction in (0, 1], got 1000")]:
        with pytest.raises(SpecError) as err:
            validate_spec(raw, arch)
        assert err.value.field == f"mm_processor_kwargs.vlm_prune.{field}" and message in str(err.value), err.value
        assert len(str(err.value)) < 400


def test_the_dry_run_refuses_what_fails_on_the_items_real_shape():
    """The processors' dry run (vlm_prune.vllm.safety.dry_run_video) runs the allocation on the video's real
    shape: a spec that passes validation's small probe but fails on this video is this request's 400."""
    from vlm_prune.vllm.config import SpecError, validate_spec
    from vlm_prune.vllm.config import method_of
    from vlm_prune.vllm.frames import frames_slots, strip_quota
    from vlm_prune.vllm.safety import dry_run_video

    spec = validate_spec(_spec(method="quota", quota={"scores": [0.5, 0.2, 0.3, 0.1]}), ONEVISION)
    want = frames_slots(method_of(strip_quota(spec)), 4, 9, spec, (5, 5), (3, 3))
    assert dry_run_video(spec, 4, 9, (3, 3), unpooled_grid=(5, 5), dim=16, dtype="bfloat16") == want == 14
    with pytest.raises(SpecError, match="4 scores for a video of 6 frames"):
        dry_run_video(spec, 6, 9, (3, 3), dim=16)


def test_a_spec_above_the_size_limit_or_nested_deep_is_refused():
    """A spec of more than MAX_SPEC_BYTES is refused before it is parsed (so the spec caches hold at most
    CACHE_SIZE x MAX_SPEC_BYTES of request text each), and one nested 100,000 levels deep is a 400, not a
    RecursionError (dict or text)."""
    from vlm_prune.vllm import config
    from vlm_prune.vllm.config import MAX_SPEC_BYTES, SpecError, validate_spec

    padded = _spec()[:-1] + " " * (MAX_SPEC_BYTES - len(_spec())) + "}"
    assert len(padded) == MAX_SPEC_BYTES and validate_spec(padded)["keep"] == 0.5
    cached = config._validated.cache_info().currsize
    for raw in (padded[:-1] + " }", "[" * 100_000 + "]" * 100_000):
        with pytest.raises(SpecError, match=f"at most {MAX_SPEC_BYTES} bytes"):
            validate_spec(raw)
    assert config._validated.cache_info().currsize == cached  # never parsed, never cached
    deep: dict = {}
    node = deep
    for _ in range(100_000):
        node["knobs"] = {}
        node = node["knobs"]
    for raw in ("[" * 900 + "]" * 900, '{"method": ' + "[" * 5000 + "]" * 5000 + "}", deep):
        with pytest.raises(SpecError, match="nested too deeply|a spec is a JSON object|method name is required"):
            validate_spec(raw)


def test_serve_allows_named_mm_kwargs_and_refuses_the_rest_at_start_up(checkpoint, tmp_path, capsys):
    """`vlm-prune serve --allow-mm-kwargs`: the keys travel in hf_overrides; geometry keys, unknown keys and keys
    the model's processor does not take fail at start-up (exit 2) with a one-line reason; --help shows the flag."""
    import shlex

    from vlm_prune.cli import main
    from vlm_prune.vllm.safety import ALLOW_KEY

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [QWEN]}))
    assert main(["serve", str(tmp_path), "--method", "pool", "--keep", "0.5", "--allow-mm-kwargs",
                 "min_pixels, max_pixels,fps", "--dry-run"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert json.loads(argv[argv.index("--hf-overrides") + 1])[ALLOW_KEY] == ["min_pixels", "max_pixels", "fps"]
    for model, keys, reason in [(tmp_path, "patch_size", "sets the processor's geometry"),
                                (checkpoint, "crop_size", "sets the processor's geometry"),
                                (tmp_path, "min_pixels,foo", "vlm_prune checks only min_pixels"),
                                (checkpoint, "max_pixels", "LlavaForConditionalGeneration's processor does not take it"),
                                (checkpoint, "fps", "does not take it")]:
        assert main(["serve", str(model), "--method", "pool", "--keep", "0.5", "--allow-mm-kwargs", keys,
                     "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert f"--allow-mm-kwargs {keys.split(',')[-1]}: " in err and reason in err, err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--allow-mm-kwargs" in capsys.readouterr().out


def test_other_mm_kwargs_are_refused_unless_allowed_and_checked():
    """A request's mm_processor_kwargs besides the spec: refused naming the key unless the operator allowed it;
    allowed values are checked (min / max pixels within one merged patch .. 16384 of them, min <= max; fps in
    (0, 60]; do_image_splitting a boolean)."""
    from types import SimpleNamespace

    from vlm_prune.vllm.config import SpecError
    from vlm_prune.vllm.safety import ALLOW_KEY, check_mm_kwargs

    qwen = SimpleNamespace(vision_config=SimpleNamespace(patch_size=14, spatial_merge_size=2),
                           **{ALLOW_KEY: ["min_pixels", "max_pixels", "fps"]})
    check_mm_kwargs({"vlm_prune": "{}", "min_pixels": 784, "max_pixels": 16384 * 784, "fps": 60}, qwen)
    check_mm_kwargs({"vlm_prune": "{}"}, SimpleNamespace())
    for kwargs, field, message in [
            ({"patch_size": 8}, "patch_size", "not accepted"), ({"crop_size": 64}, "crop_size", "not accepted"),
            ({"do_resize": False}, "do_resize", "also allows min_pixels, max_pixels, fps"),
            ({"min_pixels": 783}, "min_pixels", "[one merged patch"), ({"max_pixels": 16384 * 784 + 1}, "max_pixels", ""),
            ({"max_pixels": 2.5e6}, "max_pixels", "got 2500000.0"), ({"max_pixels": True}, "max_pixels", ""),
            ({"min_pixels": 5000, "max_pixels": 4000}, "min_pixels", "above max_pixels"),
            ({"fps": 0}, "fps", "in (0, 60]"), ({"fps": 1e308}, "fps", ""), ({"fps": float("nan")}, "fps", ""),
            ({"fps": "2"}, "fps", "got '2'")]:
        with pytest.raises(SpecError) as err:
            check_mm_kwargs(kwargs, qwen)
        assert err.value.field == f"mm_processor_kwargs.{field}" and message in str(err.value), err.value
    with pytest.raises(SpecError, match="mm_processor_kwargs.fps: not accepted"):
        check_mm_kwargs({"fps": 2}, SimpleNamespace())


def test_the_spec_caches_are_bounded_in_bytes():
    """300 distinct valid specs of the largest size (padded with spaces) keep at most CACHE_SIZE x MAX_SPEC_BYTES
    of request text in the validation cache (4 MiB; 300 specs of 1 MB kept about 240 MB before)."""
    import tracemalloc

    from vlm_prune.vllm import config
    from vlm_prune.vllm.config import CACHE_SIZE, MAX_SPEC_BYTES, validate_spec

    text = _spec()
    validate_spec(text)  # (imports, the method object, the dry run: before counting)
    config._validated.cache_clear()
    tracemalloc.start()
    try:
        for i in range(300):  # distinct texts (the padding moves), one spec
            assert validate_spec("{" + " " * i + text[1:-1] + " " * (MAX_SPEC_BYTES - len(text) - i) + "}")["keep"] == 0.5
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert config._validated.cache_info().currsize == CACHE_SIZE
    assert held < 1.25 * CACHE_SIZE * MAX_SPEC_BYTES, held


def test_the_dry_run_of_an_anyres_image_runs_the_per_crop_selection_on_its_tile_map():
    """LLaVA-NeXT's processor hands the dry run the image's tile map: CDPruner and HiRED (with a budget) select per
    crop there, as the encoder does, and keep the image's slots; a map that does not hold the image's visual
    tokens is refused (dry_run_image with crops)."""
    import torch

    from vlm_prune.vllm.config import SpecError, method_of, validate_spec
    from vlm_prune.vllm.safety import dry_run_image, image_slots

    crops = tuple(torch.tensor(m) for m in TILES)
    for raw in (_spec(method="cdpruner"), _spec(method="hired", budget=5, keep=None)):
        spec = validate_spec(raw, NEXT)
        want = image_slots(method_of(spec), 12)
        assert dry_run_image(spec, 12, None, crops=crops, dim=8, dtype="bfloat16") == want
    with pytest.raises(SpecError, match="the tile map holds 12 visual tokens, the image 13"):
        dry_run_image(validate_spec(_spec(method="cdpruner"), NEXT), 13, None, crops=crops)


def test_deepstack_replay_cannot_refuse_inside_the_engine():
    """Qwen3-VL's engine refuses (DEEPSTACK_REFUSAL, raised inside the engine) a method that rewrites features
    and picks other rows when replayed on a DeepStack map. Every served vision method that runs without the
    tower's [CLS] attention (all Qwen3-VL gives) either keeps original rows or picks its rows from the grid
    alone, so no accepted request reaches that refusal: two unrelated feature maps, the same rows."""
    import torch

    from vlm_prune.methods.base import VisionContext
    from vlm_prune.registry import method_class
    from vlm_prune.vllm.config import SUPPORTED

    rewriting = []
    for name in SUPPORTED:
        picks = []
        for seed in (0, 1):
            feats = torch.randn(48, 16, generator=torch.Generator().manual_seed(seed))
            ctx = VisionContext(features=feats, n_keep=10, grid=(6, 8), generator=torch.Generator().manual_seed(7))
            try:
                red = method_class(name)(keep=10 / 48).reduce_image(ctx)
            except ValueError as err:  # needs the tower's attention: refused on Qwen3-VL before the engine
                assert "attention" in str(err) or "[CLS]" in str(err) or "tower" in str(err), (name, err)
                break
            picks.append(red)
        if len(picks) == 2 and picks[0].features is not None:
            rewriting.append(name)
            assert torch.equal(picks[0].indices, picks[1].indices), name
    assert rewriting == ["pool"]  # the check above ran on the one served method that rewrites features
