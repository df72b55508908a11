"""The generic adapter path for the common transformers VLM layout.

Most ``*ForConditionalGeneration`` VLMs of transformers 5.x share one layout: ``model.model``
holds a vision tower, a projector and a language model; a feature function
(``get_image_features`` / ``get_video_features``) returns a ``BaseModelOutputWithPooling``
whose ``pooler_output`` holds the projected tokens; the model's ``forward`` writes them into
the placeholder rows of ``input_ids`` (``config.image_token_id``) with ``masked_scatter``.
:class:`HFVLMAdapter` already runs every stage on that layout; a family on this path is a
:class:`FamilyTable` (where things are, which placeholders) plus its quirks, as
methods of a small :class:`TableAdapter` subclass::

    class Mistral3Adapter(TableAdapter):
        table = FamilyTable(family="mistral3", model_classes=("Mistral3ForConditionalGeneration",))

        def item_grid(self, modality, out, index, features):   # a quirk: variable resolution
            ...

one line in ``vlm_prune.adapters.SUPPORTED`` and its stages in ``vlm_prune.adapters.FAMILY_STAGES``. See docs/adding-a-model.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch

from vlm_prune.adapters import FAMILY_STAGES
from vlm_prune.adapters.hf_vlm import HFVLMAdapter, Item


@dataclass(frozen=True)
class FamilyTable:
    """Where one family keeps things. Attribute names are looked up on ``model.model`` (the inner
    model) and on ``model.config``; the defaults are transformers' common layout."""

    family: str
    model_classes: tuple[str, ...]
    #: modality -> the inner model's feature function
    feature_functions: Mapping[str, str] = field(default_factory=lambda: {"image": "get_image_features"})
    #: modality -> the config attribute holding its placeholder token id
    placeholders: Mapping[str, str] = field(default_factory=lambda: {"image": "image_token_id"})
    #: inner-model attributes: the language model (decoder layers, embed_tokens, norm, rotary_emb),
    #: the vision tower and the projector
    language_model: str = "language_model"
    vision_tower: str = "vision_tower"
    projector: str = "multi_modal_projector"


class TableAdapter(HFVLMAdapter):
    """An :class:`HFVLMAdapter` whose layout comes from the class attribute ``table``.

    Subclasses set ``table`` and override quirk hooks only:
    :meth:`item_grid` (the token grid of one image / frame), :meth:`items` (what one image is
    when the encoder output is not one entry per image) and :meth:`rebuild` (the inverse).
    """

    table: ClassVar[FamilyTable]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        table = cls.__dict__.get("table")
        if table is not None:
            cls.family = table.family
            cls.model_classes = table.model_classes
            cls.stages = FAMILY_STAGES[table.family]
            cls.feature_functions = dict(table.feature_functions)

    @property
    def language_model(self) -> torch.nn.Module:
        return getattr(self.inner, self.table.language_model)

    @property
    def vision_tower(self) -> torch.nn.Module:
        return getattr(self.inner, self.table.vision_tower)

    @property
    def projector(self) -> torch.nn.Module:
        return getattr(self.inner, self.table.projector)

    def placeholder_ids(self) -> dict[str, int]:
        cfg = self.model.config
        return {m: getattr(cfg, attr) for m, attr in self.table.placeholders.items()
                if getattr(cfg, attr, None) is not None}

    def item_grid(self, modality: str, out: Any, index: int, features: torch.Tensor) -> tuple[int, int] | None:
        """(rows, cols) of the tokens of item ``index`` of an encoder output, None when they do not
        form one rectangular grid (grid-aware methods then pool 1-D). Default: a square count."""
        return self.image_grid(features.shape[0], index)

    def items(self, modality: str, out: Any) -> list[Item]:
        return [Item(f, 1, self.item_grid(modality, out, i, f)) for i, f in enumerate(out.pooler_output)]
