"""Gradio demo of vlm-prune: what a pruning method keeps, and what it costs."""
