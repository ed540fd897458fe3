"""The target and its inputs: its config and weights, GGUF conversion, chat templates, prompt sources, aux layers, hidden-state capture, vLLM's extraction conventions."""
