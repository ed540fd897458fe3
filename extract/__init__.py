"""Stage 2: conversations -> the target's aux-layer and final hidden states, in compact shards."""
