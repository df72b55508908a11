"""VidCom2 through the vlm_prune vLLM plugin side by side with vLLM's own video pruning
(``--video-pruning-rate``: EVS, the method vLLM 0.32 runs on Qwen2.5-VL) at the same rate, on a tiny
random Qwen2.5-VL checkpoint (docs/design/vllm-plugin.md, "VidCom2 and vLLM's own video pruning (EVS)"). Needs the vLLM environment.

    python scripts/vllm_vidcom2_vs_evs.py                      # rates 0.5 and 0.75, 4 clips, 8 greedy steps
    python scripts/vllm_vidcom2_vs_evs.py --rates 0.75 --model path/to/qwen2.5-vl-checkpoint
    python scripts/vllm_vidcom2_vs_evs.py --as-shipped         # vLLM's EVS as vLLM 0.32's CPU runner runs it

vLLM 0.32's CPU model runner never turns on the step that strips EVS's position channels and
recomputes M-RoPE positions (``CPUModelRunner.load_model`` skips what ``GPUModelRunner.load_model``
sets: ``is_multimodal_pruning_enabled``), so EVS fails on the first video there; the script sets that
flag on the worker (``collective_rpc``) after the engine starts, which is what the GPU runner does.

Each engine runs in a process of its own (two vLLM engines in one process share its distributed state):
vLLM unpruned, vLLM with ``video_pruning_rate=r`` (EVS), and the plugin with ``vidcom2`` at ``keep=1 - r``.
Printed per engine: the video tokens that reach the language model (placeholders in the prompt), the
greedy tokens that equal the unpruned engine's (all steps, and the first), the KL divergence of the
first next-token distribution from the unpruned engine's (KL(unpruned || pruned), mean over clips), and,
between EVS and VidCom2, the share of greedy tokens that agree.
The clips: a fixed noise background with a bright square moving across it (a little motion for EVS's
frame differences and VidCom2's frame uniqueness to find).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT = "<s> user : w9 w10 <|vision_start|><|video_pad|><|vision_end|> w12 w13 assistant :"
ENGINE_ARGS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 512, "max_num_seqs": 4, "seed": 0,
               "limit_mm_per_prompt": {"image": 0, "video": 1}, "mm_processor_cache_gb": 0, "max_logprobs": -1}


def clips(n: int, frames: int = 8, size: tuple[int, int] = (32, 48)) -> list:
    """``n`` clips of ``frames`` frames [T, H, W, 3] uint8: noise background, a moving 8 x 8 bright square."""
    import numpy as np

    out = []
    for k in range(n):
        rng = np.random.RandomState(k)
        background = (rng.rand(*size, 3) * 255).astype("uint8")
        video = np.repeat(background[None], frames, axis=0)
        for f in range(frames):
            y = (k * 5 + f * 2) % (size[0] - 8)
            x = (k * 7 + f * 5) % (size[1] - 8)
            video[f, y : y + 8, x : x + 8] = 255
        out.append(video)
    return out


def meta(frames: int) -> dict:
    return {"fps": 2.0, "total_num_frames": frames, "frames_indices": list(range(frames)), "duration": frames / 2,
            "video_backend": "opencv", "do_sample_frames": False}


def _enable_pruning(worker) -> None:
    worker.model_runner.is_multimodal_pruning_enabled = True


def child(model: str, kind: str, rate: float, n_clips: int, steps: int, out: str, repair_cpu_runner: bool) -> None:
    """One engine (``kind``: plain, evs or vidcom2) on the clips; writes its results to ``out``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import vllm
    from vllm import SamplingParams

    if kind == "vidcom2":
        import vlm_prune.vllm as vp

        args = {k: v for k, v in ENGINE_ARGS.items() if k != "mm_processor_cache_gb"}
        llm = vp.LLM(model, "vidcom2", keep=1.0 - rate, **args)
    else:
        llm = vllm.LLM(model=model, **ENGINE_ARGS, **({"video_pruning_rate": rate} if kind == "evs" else {}))
        if kind == "evs" and repair_cpu_runner:
            # vLLM 0.32's CPUModelRunner.load_model never sets the flag GPUModelRunner.load_model sets, so the
            # CPU runner never calls recompute_mrope_positions (which strips EVS's 4 position channels) and the
            # first video fails in embed_input_ids ("value tensor of shape [k, D + 4] cannot be broadcast")
            llm.collective_rpc(_enable_pruning)
    tok = llm.get_tokenizer()
    video_id = tok.convert_tokens_to_ids("<|video_pad|>")
    requests = [{"prompt": PROMPT, "multi_modal_data": {"video": (v, meta(len(v)))}} for v in clips(n_clips)]
    greedy = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=steps, min_tokens=steps, logprobs=-1),
                          use_tqdm=False)
    first = [o.outputs[0].logprobs[0] for o in greedy]  # the whole next-token distribution after the prompt
    result = {"video_tokens": [o.prompt_token_ids.count(video_id) for o in greedy],
              "tokens": [list(o.outputs[0].token_ids) for o in greedy],
              "first_logprobs": [[d[i].logprob for i in range(len(d))] for d in first]}
    Path(out).write_text(json.dumps(result))
    llm.llm_engine.engine_core.shutdown()


def run(model: str, kind: str, rate: float, n_clips: int, steps: int, tmp: Path, repair: bool = True) -> dict:
    out = tmp / f"{kind}-{rate}.json"
    argv = [sys.executable, __file__, "--child", json.dumps([model, kind, rate, n_clips, steps, str(out), repair])]
    log = tmp / f"{kind}-{rate}.log"
    with open(log, "wb") as f:
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=1200)
    if proc.returncode:
        raise RuntimeError(f"the {kind} engine failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Qwen2.5-VL checkpoint folder (default: a tiny random one)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--clips", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--as-shipped", action="store_true",
                    help="run vLLM's EVS without repairing its CPU runner (fails on the first video in vLLM 0.32)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(*json.loads(a.child))
        return
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = a.model
        if model is None:
            from vlm_prune.vllm.tiny import QwenShape, write_qwen2_vl

            model = str(write_qwen2_vl(tmp / "tiny-qwen2.5-vl", QwenShape(v25=True), seed=0))
        base = run(model, "plain", 0.0, a.clips, a.steps, tmp)
        ref, ref_lp = base["tokens"], np.array(base["first_logprobs"])
        print(f"{a.clips} clips of 8 frames (4 temporal slices x 24 tokens = 96 video tokens), {a.steps} greedy steps")
        print(f"{'engine':<26} {'video tokens':>14} {'= unpruned (all / first)':>26} {'KL first step':>14}"
              f" {'EVS = VidCom2':>14}")
        print(f"{'vLLM unpruned':<26} {str(base['video_tokens']):>14}")
        for rate in a.rates:
            res = {kind: run(model, kind, rate, a.clips, a.steps, tmp, not a.as_shipped) for kind in ("evs", "vidcom2")}
            both = np.mean([x == y for e, v in zip(res["evs"]["tokens"], res["vidcom2"]["tokens"]) for x, y in zip(e, v)])
            for kind, label in (("evs", f"vLLM EVS rate {rate}"), ("vidcom2", f"plugin vidcom2 keep {1 - rate:g}")):
                r = res[kind]
                same = np.mean([x == y for t, b in zip(r["tokens"], ref) for x, y in zip(t, b)])
                first = np.mean([t[0] == b[0] for t, b in zip(r["tokens"], ref)])
                kl = np.mean((np.exp(ref_lp) * (ref_lp - np.array(r["first_logprobs"]))).sum(-1))
                print(f"{label:<26} {str(r['video_tokens']):>14} {f'{same:.2f} / {first:.2f}':>26} {kl:>14.4f}"
                      f" {both:>14.2f}")


if __name__ == "__main__":
    main()
