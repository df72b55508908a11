"""The key bookkeeping a pruned prefill leaves on a transformers KV cache.

After a removal each decoder layer's cache holds only the rows that layer saw, so the cache
is shorter than the tokens it stands for. :class:`CacheSegments` records, per run of layers
with the same rows, which keys are valid and their log-size bias, and :func:`install` makes the
cache object report and edit the LOGICAL sequence (every token the model was given), as
transformers expects:

- ``get_seq_length()`` is the unpruned length, so ``generate()`` continuing a conversation
  with the returned cache slices the new input correctly;
- ``crop(-n)`` (assisted / prompt-lookup decoding) removes the last n tokens from every layer
  and from the bookkeeping; cropping into a pruned prompt raises;
- ``reorder_cache`` / ``batch_repeat_interleave`` / ``batch_select_indices`` (beam search,
  contrastive search) move the bookkeeping rows with the cached rows.

Decode-time KV pruning (docs/decode-kv.md) lives here too: a method that restricts what decode
steps attend to edits ``key_valid`` of its own segments (MustDrop), and a per-step one keeps its
per-sample state in ``decode_state`` (DyCoke), so beams, copies and crops carry both.
"""
from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CacheSegments:
    """Key bookkeeping stored on the KV cache: one segment per run of layers with the same rows."""

    layer_segment: list[int]
    key_valid: list[torch.Tensor]  # per segment [B, kv]
    key_bias: list[torch.Tensor]  # per segment [B, kv] float32 (log sizes)
    next_pos: torch.Tensor  # [P, B] next default position per sample
    #: per segment [P, B] next position, when a method renumbered positions after pruning
    #: (each layer then continues from its own row count, as AdaptInfer's official LLaVA code)
    segment_next_pos: list[torch.Tensor] | None = None
    #: tokens (columns) the cache stands for: the prompt and every step after it
    seen: int = 0
    #: columns of the prefill; those of a pruned prefill cannot be cropped
    prompt: int = 0
    #: per segment [B, kv] bool: which keys are visual tokens (decode-time KV pruning reads them)
    key_visual: list[torch.Tensor] | None = None
    #: a decode-time pruning method's per-sample state (tensors with the batch first), moved with
    #: the batch rows by beams and copies; reset by every new prompt on the cache
    decode_state: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.key_visual is None:
            self.key_visual = [torch.zeros_like(kv) for kv in self.key_valid]

    def extend(self, valid: torch.Tensor, next_pos: torch.Tensor) -> None:
        """Append the keys of ``valid`` [B, s] new rows (every segment sees them)."""
        b, s = valid.shape
        self.key_valid = [torch.cat([kv, valid], 1) for kv in self.key_valid]
        self.key_bias = [torch.cat([kb, torch.zeros(b, s, device=kb.device)], 1) for kb in self.key_bias]
        self.key_visual = [torch.cat([kv, torch.zeros_like(valid, device=kv.device)], 1) for kv in self.key_visual]
        self.next_pos = next_pos
        self.seen += s

    @property
    def pruned(self) -> bool:
        """True when some layer holds fewer rows than the tokens the cache stands for."""
        return any(kv.shape[1] != self.seen for kv in self.key_valid)

    def crop(self, n: int) -> None:
        if n > self.seen - self.prompt and self.pruned:
            raise ValueError(
                f"vlm_prune: cannot crop {n} tokens from this cache: only the last {self.seen - self.prompt} came "
                "after the pruned prompt, whose removed rows cannot be restored. Re-run the prompt instead "
                "(assisted decoding only crops rejected draft tokens, which is supported)"
            )
        self.key_valid = [kv[:, : kv.shape[1] - n] for kv in self.key_valid]
        self.key_bias = [kb[:, : kb.shape[1] - n] for kb in self.key_bias]
        self.key_visual = [kv[:, : kv.shape[1] - n] for kv in self.key_visual]
        self.next_pos = self.next_pos - n
        if self.segment_next_pos is not None:
            self.segment_next_pos = [p - n for p in self.segment_next_pos]
        self.seen -= n
        self.prompt = min(self.prompt, self.seen)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep / reorder / repeat batch rows (``index`` into the batch)."""
        self.key_valid = [kv[index.to(kv.device)] for kv in self.key_valid]
        self.key_bias = [kb[index.to(kb.device)] for kb in self.key_bias]
        self.key_visual = [kv[index.to(kv.device)] for kv in self.key_visual]
        self.decode_state = {k: v[index.to(v.device)] for k, v in self.decode_state.items()}
        self.next_pos = self.next_pos[:, index.to(self.next_pos.device)]
        if self.segment_next_pos is not None:
            self.segment_next_pos = [p[:, index.to(p.device)] for p in self.segment_next_pos]


def segments_of(cache: Any) -> CacheSegments | None:
    return getattr(cache, "_vlm_prune", None) if cache is not None else None


def install(cache: Any, segs: CacheSegments) -> None:
    """Put ``segs`` on ``cache`` and make the cache object speak in logical tokens (see module doc).

    The methods put on the cache reach it through a weak reference: a strong one (a closure over
    ``cache`` stored on ``cache``) would make every cache a reference cycle, freed only by Python's
    cyclic garbage collector instead of when the caller drops it (tests/test_wrapper.py,
    ``test_dropped_caches_are_freed_without_the_garbage_collector``)."""
    cls = type(cache)
    cache._vlm_prune = segs
    if "get_seq_length" in vars(cache):  # already speaking for an earlier prefill
        return
    ref = weakref.ref(cache)

    def get_seq_length(layer_idx: int = 0) -> int:
        return ref()._vlm_prune.seen

    def crop(tokens_to_remove: int) -> None:
        cache = ref()
        if tokens_to_remove > 0:  # transformers' legacy spelling: the length to keep
            tokens_to_remove = tokens_to_remove - cache._vlm_prune.seen
        if tokens_to_remove < 0:
            cache._vlm_prune.crop(-tokens_to_remove)
            cls.crop(cache, tokens_to_remove)

    def rows(name: str):
        def select(arg: Any) -> None:
            cache = ref()
            segs = cache._vlm_prune
            b = segs.key_valid[0].shape[0]
            if name == "batch_repeat_interleave":
                index = torch.arange(b).repeat_interleave(int(arg))
            else:
                index = torch.as_tensor(arg).reshape(-1)
                if index.dtype == torch.bool:
                    index = torch.nonzero(index).squeeze(1)
            getattr(cls, name)(cache, arg)
            segs.select_rows(index.long())

        return select

    def deepcopy(memo: dict) -> Any:
        """``copy.deepcopy(cache)`` (a cached prefix reused for several prompts): a copy that speaks
        for itself (these functions would otherwise keep pointing at the original)."""
        cache = ref()
        clone = cls.__new__(cls)
        memo[id(cache)] = clone
        for key, value in vars(cache).items():
            if key not in INSTALLED:
                setattr(clone, key, copy.deepcopy(value, memo))
        install(clone, clone._vlm_prune)
        return clone

    cache.get_seq_length = get_seq_length
    cache.crop = crop
    cache.__deepcopy__ = deepcopy
    for name in ("reorder_cache", "batch_repeat_interleave", "batch_select_indices"):
        setattr(cache, name, rows(name))


#: what :func:`install` puts on a cache object
INSTALLED = ("get_seq_length", "crop", "__deepcopy__", "reorder_cache", "batch_repeat_interleave",
             "batch_select_indices")
