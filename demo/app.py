"""The Gradio app: pick a model, upload an image or a video (or click an example), ask a
question, pick one or more methods; see the unpruned answer and, one column per method, the
pruned answer, what was kept drawn over the upload, the method's token scores and (merging
methods) which tokens merged into which, under a
headline table of ideal FLOPs, visual tokens, measured time (median, with its range) and memory.

    app = build_app({"toy": make_session()})      # the shipped synthetic models, offline
    launch(app, port=7860)
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr
from PIL import Image, ImageDraw

from vlm_prune.adapters import supported_model_classes
from vlm_prune.demo.real_patches import add_tab, real_vit_available
from vlm_prune.demo.session import (
    Comparison, DemoError, Session, describe, escape, load_checkpoint, load_synthetic, read_media,
)

EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"
PIPELINES = ("keyscore+pact", "uniform+pact", "quota+pact", "keyscore+divprune")
MAX_COLUMNS = 4  # methods compared side by side in one request
TOY = "toy: synthetic shapes (shipped)"
log = logging.getLogger(__name__)

INTRO = """# vlm-prune: see what is pruned, and what it saves
Pick a model, upload an image or a video (or click an example), ask a question and choose up to
four methods: each gets its own column. The same model answers unwrapped, then wrapped with
`vlm_prune.wrap(model, method, keep=...)`; `a+b` is one pipeline of two stages
(frames -> vision -> llm). Only the methods this model accepts for this kind of upload are listed."""


def make_session(model_id: str | None = None, num_frames: int = 16, max_new_tokens: int = 16) -> Session:
    """The shipped synthetic image and video models, or one checkpoint for both media."""
    if model_id is None:
        return Session(load_synthetic("image"), load_synthetic("video"), num_frames, max_new_tokens)
    loaded = load_checkpoint(model_id)
    return Session(loaded if loaded.takes("image") else None, loaded if loaded.takes("video") else None,
                   num_frames, max_new_tokens)


def make_sessions(model_ids: list[str], num_frames: int = 16, max_new_tokens: int = 16) -> dict[str, Session]:
    """The model picker's entries: each checkpoint of ``model_ids``, then the shipped toy models."""
    sessions = {m: make_session(m, num_frames, max_new_tokens) for m in model_ids}
    sessions[TOY] = make_session(None, num_frames, max_new_tokens)
    return sessions


def load_examples(folder: Path = EXAMPLES_DIR) -> list[dict[str, Any]]:
    """The folder's examples.json entries whose file exists, with ``path`` set (none if absent)."""
    index = folder / "examples.json"
    if not index.is_file():
        return []
    return [{**e, "path": str(folder / e["file"])} for e in json.loads(index.read_text()) if (folder / e["file"]).is_file()]


def thumbnail(path: str, side: int = 160) -> Image.Image:
    """A square-ish preview of an example: the picture, or a video's first frame marked as a video."""
    media = read_media(path, num_frames=1)
    picture = media.image if media.kind == "image" else Image.fromarray(media.frames[0])
    picture = picture.copy()
    picture.thumbnail((side, side), Image.NEAREST if max(picture.size) < side / 2 else Image.BICUBIC)
    if picture.width < side // 2:
        picture = picture.resize((side, round(side * picture.height / picture.width)), Image.NEAREST)
    if media.kind == "video":
        ImageDraw.Draw(picture).polygon([(8, 8), (8, 32), (28, 20)], fill=(255, 255, 255), outline=(0, 0, 0))
    return picture


def media_kind(path: str | None) -> str | None:
    """"image" or "video" for an upload, None when there is none or it cannot be read."""
    if not path:
        return None
    try:
        with Image.open(path):
            return "image"
    except OSError:
        return "video" if Path(path).suffix.lower() in {".mp4", ".avi", ".webm", ".mov", ".mkv", ".gif"} else None


def method_choices(session: Session, kind: str) -> list[tuple[str, str]]:
    """(label, value) of every method or pipeline the session's model accepts for ``kind``."""
    if session.models.get(kind) is None:
        return []
    return [(f"{name} - {describe(name)}", name) for name in session.offered(kind, PIPELINES)]


def model_notes(session: Session) -> str:
    lines = [f"- {note}" for note in session.notes()]
    families = ", ".join(c.replace("ForConditionalGeneration", "") for c in supported_model_classes()
                         if c != "VisionTransformer")
    lines.append(f"- any checkpoint of {families}: `vlm-prune demo --model HUB_ID_OR_FOLDER` (repeat --model "
                 "to list several here)")
    return "**Model**\n\n" + "\n".join(lines)


def build_app(sessions: dict[str, Session] | Session, examples_dir: Path = EXAMPLES_DIR) -> gr.Blocks:
    """The demo's Blocks. The endpoint ``/run`` takes (model, file, question, methods, keep,
    layer) and returns (status, unpruned answer, headline markdown, stats, then per column
    slot: visibility, card markdown, kept picture, score heatmap, merge picture)."""
    if isinstance(sessions, Session):
        sessions = {sessions.name: sessions}
    names = list(sessions)
    examples = load_examples(examples_dir)

    def empty(message: str) -> list[Any]:
        out: list[Any] = [message, "", "", {}]
        for _ in range(MAX_COLUMNS):
            out += [gr.update(visible=False), "", None, None, None]
        return out

    def render(comp: Comparison, status: str) -> list[Any]:
        out: list[Any] = [status, comp.answer_unpruned, comp.markdown(), comp.summary()]
        for i in range(MAX_COLUMNS):
            if i < len(comp.columns):
                col = comp.columns[i]
                out += [gr.update(visible=True), col.card(), col.picture,
                        gr.update(value=col.heatmap, visible=col.heatmap is not None),
                        gr.update(value=col.merges, visible=col.merges is not None)]
            else:
                out += [gr.update(visible=False), "", None, None, None]
        return out

    def run(
        model: str, path: str | None, question: str, methods: list[str] | str, keep: float, layer: float | None,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 - how Gradio injects a progress tracker
    ) -> Iterator[list[Any]]:
        try:
            session = sessions[model] if model in sessions else sessions[names[0]]
            chosen = [methods] if isinstance(methods, str) else list(methods or [])
            if len(chosen) > MAX_COLUMNS:
                raise DemoError(f"pick at most {MAX_COLUMNS} methods to compare (got {len(chosen)})")
            yield empty("Running ...")  # the previous result goes at once
            comp = None
            for comp in session.stream(path, question, chosen, keep, int(layer or 0),
                                       progress=lambda frac, desc: progress(frac, desc=desc)):
                yield render(comp, _status(comp, done=False))
            if comp is not None:
                yield render(comp, _status(comp, done=True))
        except DemoError as err:
            gr.Warning(str(err))
            yield empty(f"**Cannot run this request:** {escape(str(err))}")
        except Exception as err:  # noqa: BLE001 - the page shows a message, the server console the traceback
            log.exception("demo request failed")
            message = f"the request failed ({type(err).__name__}: {err}); see the server console"
            gr.Warning(message)
            yield empty(f"**Error:** {escape(message)}")

    def on_inputs(model: str, path: str | None, current: list[str] | None) -> list[Any]:
        session = sessions.get(model, sessions[names[0]])
        kind = media_kind(path) or "image"
        choices = method_choices(session, kind)
        offered = {value for _, value in choices}
        keep_value = [m for m in (current or []) if m in offered] or [value for _, value in choices[:1]]
        return [
            gr.update(choices=choices, value=keep_value),
            gr.update(value=path if kind == "image" and path else None, visible=kind == "image" and bool(path)),
            gr.update(value=path if kind == "video" else None, visible=kind == "video"),
            model_notes(session),
        ]

    def pick_example(evt: gr.SelectData) -> list[Any]:
        e = examples[evt.index]
        return [e["path"], e["question"], [e["methods"]], e["keep"]]

    first = sessions[names[0]]
    with gr.Blocks(title="vlm-prune demo", analytics_enabled=False) as app:
        with gr.Tab("Compare methods"):
            gr.Markdown(INTRO)
            with gr.Row():
                with gr.Column(scale=2):
                    model = gr.Dropdown(names, value=names[0], label="Model", elem_id="model",
                                        info="the toy answers questions about coloured shapes only; see the notes below")
                    media = gr.File(label="Image or video", file_types=["image", "video"], type="filepath", elem_id="media")
                    preview_image = gr.Image(label="Upload", interactive=False, visible=False, elem_id="preview_image",
                                             height=240)
                    preview_video = gr.Video(label="Upload", interactive=False, visible=False, elem_id="preview_video",
                                             height=240)
                    question = gr.Textbox(label="Question", placeholder="what colour is the shape ?", elem_id="question")
                    choices = method_choices(first, "image")
                    values = [v for _, v in choices]
                    default = next((m for m in ("divprune", "random") if m in values), values[0] if values else None)
                    methods = gr.Dropdown(choices, value=[default] if default else [], multiselect=True,
                                          max_choices=MAX_COLUMNS, allow_custom_value=True, label="Methods",
                                          info=f"up to {MAX_COLUMNS}, one column each; 'a+b' is one two-stage pipeline",
                                          elem_id="methods")
                    keep = gr.Slider(0.05, 1.0, value=0.25, step=0.05, label="Keep", info="fraction of the visual tokens kept")
                    layer = gr.Number(first.default_layer(), precision=0, minimum=0,
                                      label="Prune layer of in-LLM methods (0 = each method's default)")
                    button = gr.Button("Run", variant="primary", elem_id="run")
                    if examples:
                        gallery = gr.Gallery([(thumbnail(e["path"]), f"{e['file']}: {e['methods']}") for e in examples],
                                             label="Examples (click one)", columns=4, height="auto", allow_preview=False,
                                             elem_id="examples")
                        gallery.select(pick_example, None, [media, question, methods, keep])
                    notes = gr.Markdown(model_notes(first), elem_id="model_notes")
                with gr.Column(scale=3):
                    status = gr.Markdown(elem_id="status")
                    unpruned = gr.Textbox(label="Unpruned answer", interactive=False, elem_id="answer_unpruned")
                    summary = gr.Markdown(elem_id="summary")
                    slots: list[Any] = []
                    with gr.Row(equal_height=False):
                        for i in range(MAX_COLUMNS):
                            with gr.Column(visible=False, min_width=120, elem_id=f"column{i}", elem_classes="method-column") as col:
                                card = gr.Markdown(elem_id=f"card{i}")
                                kept = gr.Image(label="What was kept", type="pil", format="png", interactive=False,
                                                elem_id=f"kept{i}")
                                heat = gr.Image(label="Token scores", type="pil", format="png", interactive=False,
                                                elem_id=f"heat{i}")
                                merge = gr.Image(label="Merged tokens", type="pil", format="png", interactive=False,
                                                 elem_id=f"merge{i}")
                            slots += [col, card, kept, heat, merge]
                    with gr.Accordion("Stats (model.vlm_prune.last_stats, FLOPs and timings)", open=False):
                        stats = gr.JSON(label="stats")
            for trigger in (media.change, model.change):
                trigger(on_inputs, [model, media, methods], [methods, preview_image, preview_video, notes])
            button.click(run, [model, media, question, methods, keep, layer], [status, unpruned, summary, stats, *slots],
                         api_name="run", concurrency_limit=1)
        if real_vit_available():
            add_tab(gr)
    return app


def _status(comp: Comparison, done: bool) -> str:
    lines = [f"**Note:** {comp.warning}"] if comp.warning else []
    failed = [c.name for c in comp.columns if c.error]
    ran = [c.name for c in comp.columns if not c.error]
    if done:
        lines.append(f"Done on `{comp.model}`: " + (f"ran {', '.join(ran)}" if ran else "nothing ran")
                     + (f"; could not run: {', '.join(failed)} (see their columns)" if failed else "") + ".")
    else:
        lines.append("Running ...")
    return "\n\n".join(lines)


def launch(app: gr.Blocks, host: str = "127.0.0.1", port: int | None = None, share: bool = False,
           block: bool = True) -> Any:
    """Serve ``app``; with ``block=False`` return at once (tests), leaving the server running."""
    return app.launch(server_name=host, server_port=port, share=share, allowed_paths=[str(EXAMPLES_DIR)],
                      prevent_thread_lock=not block, quiet=not block)
