"""Synthetic offline benchmark: procedural scenes and clips with task families and difficulty
knobs, their tokenizer/processors and tiny trained VLMs (LLaVA image model, LLaVA-OneVision video
model; one or more training seeds each) shipped as float16 safetensors.

    samples = make_dataset("image", "test", 256)            # count, binding, relation, global, digit
    model, processor = load("image", seed=0)                # shipped_seeds("image") lists the seeds
    evaluate(model, processor, samples, batch_size=16)
"""
from vlm_prune.eval.synthetic.evaluate import accuracy_by_qtype, encode, evaluate, predict
from vlm_prune.eval.synthetic.models import build_model, load, model_card, model_path, shipped_seeds, trained_qtypes
from vlm_prune.eval.synthetic.processing import build_processor, build_tokenizer
from vlm_prune.eval.synthetic.scenes import DEFAULT_QTYPES, Difficulty, Sample, make_dataset, make_sample

__all__ = [
    "DEFAULT_QTYPES", "Difficulty", "Sample", "accuracy_by_qtype", "build_model", "build_processor", "build_tokenizer",
    "encode", "evaluate", "load", "make_dataset", "make_sample", "model_path", "model_card", "predict", "shipped_seeds",
    "trained_qtypes",
]
