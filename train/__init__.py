"""Stage 3: hidden-state shards -> an EAGLE-3 drafter (training-time test), exported for SGLang/vLLM."""
