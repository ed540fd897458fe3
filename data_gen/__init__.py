"""Stage 1: prompts -> the target's own answers -> tokenized conversations with an assistant loss mask."""
