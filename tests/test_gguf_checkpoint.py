"""core.target.gguf_checkpoint writes what transformers' own GGUF loading + save_pretrained writes for the
embedded SmolLM2 GGUF: the same tensors bit for bit, config, generation config, tokenizer and logits;
the tokenizer differs only where it splits digits as llama.cpp does (tests/test_tokenizer_parity.py)."""

import hashlib
import importlib.metadata
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.run.config import load_config
from core.target.gguf_checkpoint import convert_gguf_to_hf
from core.target.model import cache_root, embedded_gguf_path
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

CONFIG_FIELDS = ["model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "rope_parameters", "rms_norm_eps",
                 "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
                 "max_position_embeddings"]
TEXTS = ["Hello world", " leading space", "trailing space ", "Ünïcödé naïve café 日本語 中文 한국어",
         "emoji 🦙🚀👍🏽 and a family 👨‍👩‍👧", "def f(x):\n    return x ** 2  # square\n", "tabs\tand\t\ttabs",
         "many     spaces   and\n\n\nnewlines", "numbers 0 7 42 3.14159 -1e10 1,000,000 2024-06-01",
         "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|><repo_name>x<file_sep>", "<|im_start|",
         "URL https://example.com/a?b=c&d=e", "JSON {\"k\": [1, 2, null]}", "Ελληνικά и русский",
         "   ", "", "a" * 300, "don't won't it's we're", "\u200b zero-width\u00a0nbsp"]
CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? 🤔"}]


PROMPT = "The capital of France is"
LIBRARIES = ("transformers", "tokenizers", "torch", "gguf", "safetensors", "numpy")


def tensor_digests(path: Path) -> dict[str, list]:
    """name -> [dtype, shape, sha256 of the bytes]: equal digests are equal tensors, bit for bit."""
    return {name: [str(t.dtype), list(t.shape), hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()]
            for name, t in load_file(path).items()}


def one_thread_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The logits on one thread: bit for bit the same on any machine and load (a matmul's sums split over
    threads are added in another order when the thread count differs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        torch.set_num_threads(before)


def build_reference(gguf: Path, out: Path) -> None:
    """transformers' own GGUF load (dequantized to fp32) + save_pretrained into `out`; its 538 MB of weights
    are kept as digests (tensors.json) and as the logits they give on PROMPT (logits.safetensors)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                         quantization_config=GgufConfig(dequantize=True)).save_pretrained(out)
    (out / "tensors.json").write_text(json.dumps(tensor_digests(out / "model.safetensors")))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(out)(PROMPT, return_tensors="pt")["input_ids"]
    save_file({"logits": one_thread_logits(model, ids)}, out / "logits.safetensors")
    (out / "model.safetensors").unlink()


def transformers_reference(gguf: Path) -> Path:
    """build_reference's output, kept in the model cache: it is a function of the GGUF's bytes, the libraries
    and build_reference alone, and all three are in its key, so a stale one is never read (a fresh machine
    builds it: ~40 s of dequantizing on 2 cores)."""
    key = hashlib.sha256(gguf.read_bytes())
    key.update(inspect.getsource(build_reference).encode())
    for lib in LIBRARIES:
        key.update(f"{lib}=={importlib.metadata.version(lib)}".encode())
    dest = cache_root(load_config(ROOT / "configs/smollm2-135m-instruct.yaml")) / "test-refs" / \
        f"transformers-gguf-{key.hexdigest()[:16]}"
    if not dest.is_dir():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            build_reference(gguf, tmp)
            os.chmod(tmp, 0o755)
            os.rename(tmp, dest)
        except OSError:
            if not dest.is_dir():  # lost a race to a complete copy: fine
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(dir written by transformers' GGUF path, less its weights: tensors.json and logits.safetensors hold
    them; dir written by convert_gguf_to_hf)."""
    gguf = embedded_gguf_path()
    new = tmp_path_factory.mktemp("gguf_checkpoint")
    convert_gguf_to_hf(gguf, new)
    return transformers_reference(gguf), new


@pytest.fixture(scope="module")
def tokenizers(dirs):
    from transformers import AutoTokenizer

    return tuple(AutoTokenizer.from_pretrained(d) for d in dirs)


def test_every_tensor_is_bit_identical(dirs):
    ref, new = json.loads((dirs[0] / "tensors.json").read_text()), tensor_digests(dirs[1] / "model.safetensors")
    assert sorted(new) == sorted(ref) and "lm_head.weight" not in new  # tied, as the GGUF has no output.weight
    for name, digest in ref.items():
        assert new[name][0] == "torch.float32" and new[name] == digest, name


def test_config_and_generation_config_match(dirs):
    from transformers import AutoConfig

    ref, new = (AutoConfig.from_pretrained(d) for d in dirs)
    for field in CONFIG_FIELDS:
        assert getattr(new, field) == getattr(ref, field), field
    for name in ("config.json", "generation_config.json"):  # and nothing else differs either
        assert json.loads((dirs[1] / name).read_text()) == json.loads((dirs[0] / name).read_text()), name


def test_tokenizer_files_match(dirs):
    ref, new = dirs
    ours, theirs = (json.loads((d / "tokenizer.json").read_text()) for d in (new, ref))
    # the one deliberate difference: SmolLM2's digits split one by one first, as llama.cpp splits them
    assert ours.pop("pre_tokenizer") == {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, theirs.pop("pre_tokenizer")]}
    assert ours == theirs
    assert (new / "chat_template.jinja").read_text() == (ref / "chat_template.jinja").read_text()
    # transformers also records how it was loaded (is_local, local_files_only); nothing else may differ
    loaded_from = {"is_local", "local_files_only"}
    ref_cfg, new_cfg = (json.loads((d / "tokenizer_config.json").read_text()) for d in dirs)
    assert new_cfg == {k: v for k, v in ref_cfg.items() if k not in loaded_from}


def test_tokenizers_agree(tokenizers):
    ref, new = tokenizers
    assert (type(new), len(new), new.get_vocab()) == (type(ref), len(ref), ref.get_vocab())
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id",
                 "pad_token_id", "unk_token_id", "all_special_tokens", "chat_template"):
        assert getattr(new, attr) == getattr(ref, attr), attr
    assert {i: str(t) for i, t in new.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in ref.added_tokens_decoder.items()}
    for text in [t for t in TEXTS if not any(c.isdigit() for c in t)]:  # digits: test_tokenizer_parity.py
        ids = ref(text)["input_ids"]
        assert new(text)["input_ids"] == ids, text
        assert new.decode(ids) == ref.decode(ids) and new.decode(ids, skip_special_tokens=True) == \
            ref.decode(ids, skip_special_tokens=True), text
    for tokenize in (False, True):
        expected = ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=tokenize)
        assert new.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=tokenize) == expected


def test_logits_are_identical(dirs, tokenizers):
    from transformers import AutoModelForCausalLM

    ids = tokenizers[0](PROMPT, return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(dirs[1], dtype=torch.float32).eval()
    assert torch.equal(one_thread_logits(model, ids), load_file(dirs[0] / "logits.safetensors")["logits"])
