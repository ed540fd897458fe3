"""The drafter models: EAGLE-3 (Llama-style or MLA layer) and its config.json, DFlash, EAGLE-2 draft trees."""
