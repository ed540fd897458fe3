"""llama.cpp, the engine that checks our drafters on CPU: its own converter.

In the source tree eval/llamacpp_build.py fetches into <cache>/llama.cpp-b11434,
`convert_hf_to_gguf.py` turns an exported drafter into the GGUF that `llama-server
--spec-type draft-eagle3` loads. The converter reads the drafter's top-level
`eagle_aux_hidden_state_layer_ids` as input-of-layer ids (core/drafters/drafter_config.py writes them), and the top-level
`norm_before_fc` (EAGLE-3.1) as `eagle3.norm_before_fc`, with `input_norm.weight` -> `enc.output_norm.weight`.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

from core.drafters.dflash import ARCHITECTURE as DFLASH_ARCHITECTURE
from core.drafters.drafter_config import GQA_ARCHITECTURE, read_norm_before_fc
from core.run.errors import UserError
from core.storage.atomic_io import atomic_write
from eval.llamacpp_build import CONVERTER


def convert_to_gguf(tree: Path, model_dir: Path, out: Path, outtype: str = "f32",
                    target_dir: Path | None = None) -> Path:
    """An HF model dir -> GGUF by llama.cpp's own converter, written atomically (a killed conversion
    never leaves a GGUF that looks whole). target_dir: the drafter's target, which makes an exported
    (SGLang-format) drafter convert as EAGLE-3. Raises with the converter's last lines."""

    def run(tmp: Path) -> None:
        cmd = [sys.executable, str(Path(tree) / CONVERTER), str(model_dir), "--outtype", outtype, "--outfile", str(tmp)]
        if target_dir is not None:
            cmd += ["--target-model-dir", str(target_dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not tmp.is_file():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise RuntimeError(f"llama.cpp's converter failed on {model_dir} (rc={proc.returncode}):\n{tail}")

    return atomic_write(out, run)


LLAMACPP_IGNORES = ("fc_norm", "norm_output")  # drafter config.json keys convert_hf_to_gguf.py b11434 never reads


def convert_drafter(tree: Path, drafter_dir: Path, target_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """An exported drafter -> the GGUF that `llama-server --spec-type draft-eagle3` loads. Refuses a GGUF
    whose norm_before_fc is not the drafter's (SGLang's reading): llama-server would serve another model."""
    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    if config.get("architectures") == [DFLASH_ARCHITECTURE]:
        return convert_dflash(tree, drafter_dir, config, target_dir, out, outtype)
    if config.get("architectures") != [GQA_ARCHITECTURE]:
        raise UserError(f"{drafter_dir}: a drafter of architecture {config.get('architectures')}; llama.cpp b11434's "
                        f"converter takes {GQA_ARCHITECTURE} drafters only (an MLA drafter serves in SGLang): train "
                        "with train.draft_attention=gqa for llama.cpp")
    ignored = [flag for flag in LLAMACPP_IGNORES if config.get(flag)]
    if ignored:
        raise UserError(f"{drafter_dir}: a drafter with {' and '.join(ignored)} (EAGLE-3.1), which llama.cpp b11434's "
                        "converter ignores: llama-server would serve another model; serve it with SGLang, or train "
                        f"without {' / '.join('train.' + f for f in ignored)} for llama.cpp")
    gguf = convert_to_gguf(tree, drafter_dir, out, outtype, target_dir=target_dir)
    want = read_norm_before_fc(config)
    if gguf_norm_before_fc(gguf) != want:
        raise UserError(f"{gguf}: llama.cpp's converter wrote norm_before_fc = {not want}, but {drafter_dir} "
                        f"is a drafter with norm_before_fc = {want}: llama-server would serve another model")
    return gguf


def convert_dflash(tree: Path, drafter_dir: Path, config: dict, target_dir: Path, out: Path, outtype: str) -> Path:
    """A DFlash drafter -> the GGUF `llama-server --spec-type draft-dflash` loads (converter class DFlashModel:
    the target's tokenizer from target_dir, the mask token id, block size and target layers as metadata).
    Refuses a GGUF whose target layers are not the ones the drafter was trained on."""
    gguf = convert_to_gguf(tree, drafter_dir, out, outtype, target_dir=target_dir)
    want = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]  # output of layer i = input of i + 1
    if gguf_target_layers(gguf) != want:
        raise UserError(f"{gguf}: llama.cpp's converter wrote target layers {gguf_target_layers(gguf)}, but "
                        f"{drafter_dir} was trained on {want}")
    return gguf


def _eagle3_fields(path: Path) -> tuple[list[int] | None, bool, bool]:
    """-> (eagle3.target_layers or None, eagle3.norm_before_fc, whether enc.output_norm.weight is there),
    read once per file version: gguf-py's GGUFReader parses every key, the target's 49k tokens and 49k
    merges included (5.5 s the stock reader, 1.7 s core.target.gguf_checkpoint's plain-array one), and
    convert_drafter, eval's log line and the tests all ask about the same file."""
    st = Path(path).stat()
    return _read_eagle3_fields(str(Path(path).resolve()), st.st_ino, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=32)
def _read_eagle3_fields(path: str, _ino: int, _mtime_ns: int, _size: int) -> tuple[list[int] | None, bool, bool]:
    from core.target.gguf_checkpoint import _PlainArrayReader

    reader = _PlainArrayReader(path)
    field = reader.get_field("eagle3.target_layers") or reader.get_field("dflash.target_layers")
    layers = None if field is None else [int(field.parts[i][0]) for i in field.data]
    field = reader.get_field("eagle3.norm_before_fc")
    flag = bool(field.parts[field.data[0]][0]) if field is not None else False
    return layers, flag, any(t.name == "enc.output_norm.weight" for t in reader.tensors)


def gguf_target_layers(path: Path) -> list[int]:
    """The aux layers a converted drafter makes llama.cpp read (`eagle3.target_layers` or `dflash.target_layers`:
    layer inputs), via gguf-py."""
    layers, _, _ = _eagle3_fields(path)
    if layers is None:
        raise UserError(f"{path}: no eagle3/dflash target_layers key (not a drafter GGUF)")
    return list(layers)


def gguf_norm_before_fc(path: Path) -> bool:
    """Whether llama.cpp applies the EAGLE-3.1 input norm (`eagle3.norm_before_fc`, weight
    `enc.output_norm.weight`) to the aux before fc. A flag without its tensor (or the reverse) is refused:
    llama-server would fail to load it, or load it and drop the norm."""
    _, flag, tensor = _eagle3_fields(path)
    if flag != tensor:
        raise UserError(f"{path}: eagle3.norm_before_fc = {flag} but enc.output_norm.weight is "
                        f"{'present' if tensor else 'absent'}: the drafter's config.json and weights disagree")
    return flag
