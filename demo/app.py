"""The Gradio app: upload an image or a video, ask a question, pick methods and a budget; see
the unpruned and the pruned answer side by side, the visual tokens kept, the time to first
token of each, and what was kept (grid overlay / frame strip).

    app = build_app(make_session())          # the shipped synthetic models, offline
    launch(app, port=7860)
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import gradio as gr

from vlm_prune.demo.session import DemoError, Session, load_checkpoint, load_synthetic
from vlm_prune.registry import available_methods

EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"
PIPELINES = ["keyscore+pact", "uniform+pact", "quota+pact", "keyscore+divprune"]
log = logging.getLogger(__name__)

INTRO = """# vlm-prune: see what is pruned, and what it costs
Upload an image or a video (or click an example), ask a question, choose pruning method(s) and
how many visual tokens to keep. The same model answers twice: unwrapped, then wrapped with
`vlm_prune.wrap(model, methods, keep=...)`. Several methods form one pipeline (at most one per
stage: frames -> vision -> llm); `a+b` is a pipeline too."""


def make_session(model_id: str | None = None, num_frames: int = 16, max_new_tokens: int = 16) -> Session:
    """The shipped synthetic image and video models, or one checkpoint for both media."""
    if model_id is None:
        return Session(load_synthetic("image"), load_synthetic("video"), num_frames, max_new_tokens)
    loaded = load_checkpoint(model_id)
    return Session(loaded if loaded.takes("image") else None, loaded if loaded.takes("video") else None,
                   num_frames, max_new_tokens)


def load_examples(folder: Path = EXAMPLES_DIR) -> list[list[Any]]:
    """[file, question, methods, keep] rows from the folder's examples.json (none if absent)."""
    index = folder / "examples.json"
    if not index.is_file():
        return []
    rows = []
    for e in json.loads(index.read_text()):
        if (folder / e["file"]).is_file():
            rows.append([str(folder / e["file"]), e["question"], [e["methods"]], e["keep"]])
    return rows


def _model_notes(session: Session) -> str:
    seen, lines = set(), []
    for kind, loaded in session.models.items():
        if loaded is None:
            lines.append(f"- {kind}s: not supported by this model")
        elif id(loaded) not in seen:
            seen.add(id(loaded))
            lines += [f"- {note}" for note in loaded.notes]
    return "**Models**\n" + "\n".join(lines)


def build_app(session: Session, examples_dir: Path = EXAMPLES_DIR) -> gr.Blocks:
    """The demo's Blocks; the endpoint ``/run`` takes (file, question, methods, keep, layer)
    and returns (unpruned answer, pruned answer, summary markdown, picture, stats)."""

    def run(
        path: str | None, question: str, methods: list[str] | str, keep: float, layer: float | None,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 - how Gradio injects a progress tracker
    ) -> tuple[str, str, str, Any, dict[str, Any]]:
        try:
            out = session.run(path, question, methods, keep, int(layer or 0),
                              progress=lambda frac, desc: progress(frac, desc=desc))
        except DemoError as err:
            raise gr.Error(str(err), print_exception=False) from None
        except Exception as err:  # the page shows a message, the server console the traceback
            log.exception("demo request failed")
            raise gr.Error(f"the request failed ({type(err).__name__}: {err}); see the server console",
                           print_exception=False) from None
        return out.answer_unpruned, out.answer_pruned, out.markdown(), out.picture, out.summary()

    with gr.Blocks(title="vlm-prune demo", analytics_enabled=False) as app:
        gr.Markdown(INTRO)
        with gr.Row():
            with gr.Column(scale=2):
                media = gr.File(label="Image or video", file_types=["image", "video"], type="filepath",
                                elem_id="media")
                question = gr.Textbox(label="Question", placeholder="what colour is the shape ?", elem_id="question")
                methods = gr.Dropdown(available_methods() + PIPELINES, value=["random"], multiselect=True,
                                      allow_custom_value=True, label="Method(s)", elem_id="methods")
                keep = gr.Slider(0.05, 1.0, value=0.25, step=0.05, label="Keep", info="fraction of the visual tokens kept")
                layer = gr.Number(session.default_layer(), precision=0, minimum=0,
                                  label="Prune layer of in-LLM methods (0 = each method's default)")
                button = gr.Button("Run", variant="primary", elem_id="run")
                examples = load_examples(examples_dir)
                if examples:
                    gr.Examples(examples, [media, question, methods, keep], label="Examples")
                gr.Markdown(_model_notes(session))
            with gr.Column(scale=3):
                with gr.Row():
                    unpruned = gr.Textbox(label="Unpruned answer", interactive=False, elem_id="answer_unpruned")
                    pruned = gr.Textbox(label="Pruned answer", interactive=False, elem_id="answer_pruned")
                summary = gr.Markdown(elem_id="summary")
                picture = gr.Image(label="What was kept", type="pil", format="png", interactive=False,
                                   elem_id="kept")
                with gr.Accordion("Stats (model.vlm_prune.last_stats and timings)", open=False):
                    stats = gr.JSON(label="stats")
        button.click(run, [media, question, methods, keep, layer], [unpruned, pruned, summary, picture, stats],
                     api_name="run", concurrency_limit=1)
    return app


def launch(app: gr.Blocks, host: str = "127.0.0.1", port: int | None = None, share: bool = False,
           block: bool = True) -> Any:
    """Serve ``app``; with ``block=False`` return at once (tests), leaving the server running."""
    return app.launch(server_name=host, server_port=port, share=share, allowed_paths=[str(EXAMPLES_DIR)],
                      prevent_thread_lock=not block, quiet=not block)
