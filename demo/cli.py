"""``vlm-prune demo``: launch the Gradio app (needs the ``demo`` extra: gradio, gradio_client)."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="launch the Gradio demo: what a method prunes, and what it costs")
    p.add_argument("--model", default=None, metavar="ID_OR_PATH",
                   help="a supported Hugging Face VLM checkpoint (default: the shipped synthetic image and video models)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1; 0.0.0.0 for the network)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--share", choices=("yes", "no"), default="no", help="ask Gradio for a public share link (default no)")
    p.add_argument("--frames", type=int, default=16, help="frames sampled from an uploaded video (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="length of each answer (default 16)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from vlm_prune.demo.app import build_app, launch, make_session
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in ("gradio", "gradio_client"):
            raise SystemExit(f"the demo needs {err.name}: pip install 'vlm-prune[demo]'") from None
        raise
    from vlm_prune.demo.session import DemoError

    if args.frames < 1 or args.max_new_tokens < 1:
        raise SystemExit("--frames and --max-new-tokens must be at least 1")
    try:
        session = make_session(args.model, args.frames, args.max_new_tokens)
    except DemoError as err:
        raise SystemExit(str(err)) from None
    launch(build_app(session), host=args.host, port=args.port, share=args.share == "yes")
    return 0
