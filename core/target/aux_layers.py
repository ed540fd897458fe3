"""The aux-layer convention, in one place.

Layer id i = the INPUT of decoder layer i = HF `output_hidden_states` element i (0 = embeddings).
EAGLE-3 default [2, L//2, L-3]. SGLang 0.5.23 shifts explicit ids in some model files
(models/llama.py: always +1; models/deepseek_v2.py: +1 only when ids[0] == 1), so the ids written
into an exported drafter config are translated here; vLLM's speculators schema uses ours unshifted.
"""

from __future__ import annotations

from core.run.errors import UserError

# model_type -> how SGLang 0.5.23's set_eagle3_layers_to_capture treats explicit ids
_SHIFT_ALWAYS = {"llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe"}
_SHIFT_IF_FIRST_IS_ONE = {"deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25"}


def default_aux_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layers(configured: list[int] | None, num_layers: int) -> list[int]:
    layers = list(configured) if configured else default_aux_layers(num_layers)
    if len(layers) != 3 or sorted(layers) != layers or len(set(layers)) != 3:
        raise UserError(f"extract.aux_layers = {layers}: need 3 ascending distinct layer ids")
    if layers[0] < 1 or layers[-1] > num_layers - 1:
        raise UserError(f"extract.aux_layers = {layers}: ids must lie in [1, {num_layers - 1}] "
                         "(input of decoder layer i)")
    return layers


def sglang_layer_ids(aux_layers: list[int], model_type: str) -> list[int]:
    """Ids to give SGLang so that it captures exactly `aux_layers` (input-of-layer convention)."""
    if model_type in _SHIFT_ALWAYS:
        return [i - 1 for i in aux_layers]
    if model_type in _SHIFT_IF_FIRST_IS_ONE:
        if aux_layers[0] == 1:
            raise UserError("SGLang's deepseek_v2 file cannot capture the input of layer 1 with explicit "
                             "ids (it shifts ids starting at 1); choose aux layers starting at >= 2")
        return list(aux_layers)
    raise UserError(f"model_type {model_type!r}: SGLang's layer-id rule for it is unknown; add it to "
                     "core/target/aux_layers.py after reading its set_eagle3_layers_to_capture")


def aux_layers_from_sglang(ids: list[int] | None, model_type: str, num_layers: int) -> list[int]:
    """Inverse of sglang_layer_ids: what SGLang captures for a drafter config's ids."""
    if not ids:
        return default_aux_layers(num_layers)
    if model_type in _SHIFT_ALWAYS or (model_type in _SHIFT_IF_FIRST_IS_ONE and ids[0] == 1):
        return [i + 1 for i in ids]
    if model_type in _SHIFT_IF_FIRST_IS_ONE:
        return list(ids)
    return sglang_layer_ids(ids, model_type)  # raises the unknown-model error
