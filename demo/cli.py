"""``vlm-prune demo``: launch the Gradio app (needs the ``demo`` extra: gradio, gradio_client)."""
from __future__ import annotations

import argparse
import socket

from vlm_prune.cli import UsageError, checkpoint, hub_model_problem, positive_int

DESCRIPTION = """\
Launch the Gradio demo in the browser: upload an image or a video, ask a question, and compare
pruning methods side by side - what each keeps, its ideal FLOPs, visual tokens and measured time.
Without --model it serves the shipped toy models (trained on coloured shapes only)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", description=DESCRIPTION)
    p.add_argument("--model", action="append", default=[], metavar="ID_OR_PATH", type=checkpoint,
                   help="a supported Hugging Face VLM checkpoint (hub id or local folder); repeat it to offer "
                        "several in the model picker (the shipped toy models are always listed)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1; 0.0.0.0 for the network)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--share", choices=("yes", "no"), default="no", help="ask Gradio for a public share link (default no)")
    p.add_argument("--frames", type=positive_int, default=16, help="frames sampled from an uploaded video (default 16)")
    p.add_argument("--max-new-tokens", type=positive_int, default=16, help="length of each answer (default 16)")
    p.set_defaults(func=run)


def check_port(host: str, port: int) -> None:
    """Fail now, before the models load, when ``port`` cannot be served on."""
    if not 0 < port < 65536:
        raise UsageError(f"--port {port}: give a port between 1 and 65535")
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as err:
            raise UsageError(f"cannot serve on {host}:{port} ({err.strerror}); pick another one with --port, "
                             f"e.g. --port {port + 1}") from None


def run(args: argparse.Namespace) -> int:
    check_port(args.host, args.port)
    problem = next(filter(None, map(hub_model_problem, args.model)), None)
    if problem:
        raise UsageError(problem)
    try:
        from vlm_prune.demo.app import build_app, launch, make_sessions
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in ("gradio", "gradio_client"):
            raise UsageError(f"the demo needs {err.name}: pip install -e \".[demo]\" in the vlm-prune checkout") from None
        raise
    from vlm_prune.demo.session import DemoError

    try:
        sessions = make_sessions(args.model, args.frames, args.max_new_tokens)
    except DemoError as err:
        raise UsageError(str(err)) from None
    launch(build_app(sessions), host=args.host, port=args.port, share=args.share == "yes")
    return 0
