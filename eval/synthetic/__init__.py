"""Synthetic offline benchmark: procedural scenes and clips, their tokenizer/processors and two
tiny trained VLMs (LLaVA image model, LLaVA-OneVision video model) shipped as safetensors.

    samples = make_dataset("image", "test", 256)
    model, processor = load("image")
    evaluate(model, processor, samples, batch_size=16)
"""
from vlm_prune.eval.synthetic.evaluate import accuracy_by_qtype, encode, evaluate, predict
from vlm_prune.eval.synthetic.models import build_model, load, model_path
from vlm_prune.eval.synthetic.processing import build_processor, build_tokenizer
from vlm_prune.eval.synthetic.scenes import DEFAULT_QTYPES, Sample, make_dataset, make_sample

__all__ = [
    "DEFAULT_QTYPES", "Sample", "accuracy_by_qtype", "build_model", "build_processor", "build_tokenizer",
    "encode", "evaluate", "load", "make_dataset", "make_sample", "model_path", "predict",
]
