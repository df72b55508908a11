"""Gradio demo of vlm-prune: what a pruning method keeps, and what it costs."""
if __name__ != "vlm_prune.demo":  # imported as the bare `demo` from the checkout root: see vlm_prune/_bare_names.py
    from vlm_prune._bare_names import hand_over

    hand_over(__name__, __file__)
