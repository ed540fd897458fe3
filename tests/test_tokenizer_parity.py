"""Our target tokenizer makes the ids llama.cpp makes (`/tokenize` of the real llama-server b11434 on
the embedded GGUF), on real text: ShareGPT prompts and answers, code, numbers, chat markup. A drafter
trained on our ids is served on llama.cpp's, so one differing id is a sequence the drafter never saw.
Before the digit fix in core/target/gguf_checkpoint.py, 444 of 3,000 ShareGPT texts differed ("\\n\\n1")."""

import random

import httpx
import pytest

from core.target.model import cache_root, embedded_gguf_path, load_tokenizer
from core.target.prompts import load_sharegpt
from eval.llamacpp_build import server_binary
from eval.llamacpp_server import LlamaServer
from tests.test_gguf_checkpoint import CHAT, TEXTS

NUMBERS = ["1", "10", "0.5", "3.14159", "-42", "1e-10", "1,234,567.89", "2024-06-01T12:30:00Z", "+1 (555) 010-9999",
           "v2.13.0", "x=0x1F; y=0b1010", "a1b2c3", "99%", "$1.5M", "½ ² ³ ٣ ५ 七", "IPv4 192.168.0.1:8080",
           "\n\n1. first\n2. second", "Table: | 1 | 22 | 333 |", "  12  ", "\t7\n"]


@pytest.fixture(scope="module")
def texts():
    convs = load_sharegpt()[0]
    out = [m["content"] for p in convs[:1000] for m in p.messages[:2]]
    code = [m["content"] for p in convs[1000:] for m in p.messages if "```" in m["content"]][:200]
    rng = random.Random(0)
    numbers = NUMBERS + [" ".join(str(rng.randint(0, 10 ** rng.randint(1, 12))) for _ in range(8)) for _ in range(100)]
    return out + code + numbers + TEXTS


def test_token_ids_equal_llamacpp_tokenize(smol_cfg, texts):
    assert len(texts) >= 2000
    assert sum(any(c.isdigit() for c in t) for t in texts) >= 500 and sum("```" in t for t in texts) >= 100
    tok = load_tokenizer(smol_cfg)
    templated = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    differ = []
    with LlamaServer(server_binary(cache_root(smol_cfg)), embedded_gguf_path()) as url, httpx.Client() as http:
        for text in [*texts, templated]:
            r = http.post(f"{url}/tokenize", json={"content": text, "add_special": False, "parse_special": True})
            theirs, ours = r.json()["tokens"], tok.encode(text, add_special_tokens=False)
            if theirs != ours:
                at = next(i for i, (a, b) in enumerate(zip([*ours, None], [*theirs, None], strict=False)) if a != b)
                differ.append((text[:60], at, ours[at:at + 3], theirs[at:at + 3]))
    assert not differ, f"{len(differ)} of {len(texts) + 1} texts differ, e.g. {differ[:3]}"
