"""Assistant masks from prefix rendering, on five template families written as jinja over the SmolLM2
tokenizer (each family's markers added as special tokens, as its real tokenizer has them)."""

import copy

import pytest

from core.target.model import load_tokenizer
from data_gen.chat_tokenize import (
    TemplateError,
    assistant_message,
    split_reasoning,
    template_renders_reasoning,
    tokenize_conversation,
)
from tests.conftest import masked_spans

LLAMA3 = (
    "{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
    " + m['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

# Qwen3's reasoning rule: a think block (empty when there is no reasoning) is rendered only for
# assistant turns after the last user turn, so adding a user turn rewrites the earlier ones.
QWEN3 = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}"
    "{%- if loop.index0 > ns.last_user and (loop.last or m.reasoning_content) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + (m.reasoning_content or '').strip('\\n') + '\\n</think>\\n\\n'"
    " + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")

KIMI = (
    "{%- for m in messages %}{%- if m.role == 'user' %}{{ '<|im_user|>user<|im_middle|>' + m.content + '<|im_end|>' }}"
    "{%- elif m.role == 'assistant' %}{{ '<|im_assistant|>assistant<|im_middle|>' }}"
    "{%- if m.reasoning_content %}{{ '<think>' + m.reasoning_content + '</think>' }}{%- else %}{{ '<think></think>' }}"
    "{%- endif %}{{ m.content + '<|im_end|>' }}"
    "{%- else %}{{ '<|im_system|>system<|im_middle|>' + m.content + '<|im_end|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}")

# DeepSeek-R1 renders every assistant message with its <think> block cut off.
DEEPSEEK = (
    "{{ bos_token }}{%- for m in messages %}{%- if m.role == 'user' %}{{ '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'assistant' %}{%- set c = m.content %}{%- if '</think>' in c %}"
    "{%- set c = c.split('</think>')[-1] %}{%- endif %}{{ '<｜Assistant｜>' + c + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{%- endif %}")

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_user|>",
            "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<｜User｜>", "<｜Assistant｜>",
            "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"]

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 is 4."}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "3+3 is 6, twice 3."}]


@pytest.fixture(scope="module")
def base_tok(tmp_path_factory):
    from core.run.config import load_config
    cfg = load_config("configs/smollm2-135m-instruct.yaml", [f"run_dir={tmp_path_factory.mktemp('t')}"])
    return load_tokenizer(cfg)


def family(base_tok, template: str | None, bos: str | None = None):
    tok = copy.deepcopy(base_tok)
    tok.add_tokens(SPECIALS, special_tokens=True)
    if template is not None:
        tok.chat_template = template
    if bos is not None:
        tok.bos_token = bos
    return tok


@pytest.mark.parametrize("name,template,eot,bos,markup", [
    ("chatml-smollm2", None, ["<|im_end|>"], None, ""),
    ("llama3", LLAMA3, ["<|eot_id|>"], "<|begin_of_text|>", ""),
    ("kimi", KIMI, ["<|im_end|>"], None, "<think></think>"),  # the model emits the empty think block itself
    ("deepseek", DEEPSEEK, ["<｜end▁of▁sentence｜>"], "<｜begin▁of▁sentence｜>", ""),
])
def test_mask_is_each_answer_plus_its_end_of_turn(base_tok, name, template, eot, bos, markup):
    tok = family(base_tok, template, bos)
    (sample,) = tokenize_conversation(tok, CONV, eot, [False] * len(CONV))
    assert masked_spans(tok, sample.input_ids, sample.loss_mask) == [
        markup + m["content"] + eot[0] for m in CONV if m["role"] == "assistant"]
    whole = tok.apply_chat_template(CONV, tokenize=False)
    assert tok.decode(sample.input_ids) == whole  # the trailer after the last turn is kept, unmasked


def test_truncated_answer_masks_no_end_of_turn(base_tok):
    tok = family(base_tok, None)
    (sample,) = tokenize_conversation(tok, CONV, ["<|im_end|>"], [False, False, True, False, False])
    assert masked_spans(tok, sample.input_ids, sample.loss_mask) == ["2+2 is 4.", "3+3 is 6, twice 3.<|im_end|>"]


def test_reasoning_rendered_by_template_is_trained_on_and_history_rewrite_splits(base_tok):
    """Qwen3 drops past reasoning once a new user turn arrives: each turn becomes its own sample, the
    exact prefix the server saw, with the thinking markup inside the mask."""
    tok = family(base_tok, QWEN3)
    assert template_renders_reasoning(tok)
    conv = [CONV[1], assistant_message("4.", "2 plus 2", "render", True), CONV[3],
            assistant_message("6.", "3 plus 3", "render", True)]
    samples = tokenize_conversation(tok, conv, ["<|im_end|>"], [False] * 4)
    assert len(samples) == 2
    assert masked_spans(tok, samples[0].input_ids, samples[0].loss_mask) == ["<think>\n2 plus 2\n</think>\n\n4.<|im_end|>"]
    # the rewritten first answer is context there (the target never generated it without thinking)
    spans = masked_spans(tok, samples[1].input_ids, samples[1].loss_mask)
    assert spans == ["<think>\n3 plus 3\n</think>\n\n6.<|im_end|>"]
    assert "<|im_start|>assistant\n4.<|im_end|>" in tok.decode(samples[1].input_ids)
    # reasoning kept as a field only: never rendered, so no sample holds it
    plain = tokenize_conversation(tok, conv, ["<|im_end|>"], [False] * 4, render_reasoning=False)
    assert [masked_spans(tok, p.input_ids, p.loss_mask) for p in plain] == [
        ["<think>\n\n</think>\n\n4.<|im_end|>"], ["<think>\n\n</think>\n\n6.<|im_end|>"]]
    assert not any("plus" in tok.decode(p.input_ids) for p in plain)


def test_qwen3_thinking_off_puts_the_empty_think_block_in_the_prompt(base_tok):
    """enable_thinking=false (a template kwarg): the server forces the empty block, so it is prompt, not loss;
    with thinking on the target writes the block itself, so it is in the mask."""
    tok = family(base_tok, QWEN3)
    conv = [CONV[1], CONV[2]]
    (off,) = tokenize_conversation(tok, conv, ["<|im_end|>"], [False, False], {"enable_thinking": False})
    first = off.loss_mask.index(1)
    assert tok.decode(off.input_ids[:first]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert masked_spans(tok, off.input_ids, off.loss_mask) == ["2+2 is 4.<|im_end|>"]
    (on,) = tokenize_conversation(tok, conv, ["<|im_end|>"], [False, False])
    assert masked_spans(tok, on.input_ids, on.loss_mask) == ["<think>\n\n</think>\n\n2+2 is 4.<|im_end|>"]


def test_kimi_reasoning_is_prefix_stable_so_one_sample(base_tok):
    tok = family(base_tok, KIMI)
    conv = [CONV[1], assistant_message("4.", "sum", "render", template_renders_reasoning(tok)), CONV[3],
            assistant_message("6.", "sum again", "render", True)]
    (sample,) = tokenize_conversation(tok, conv, ["<|im_end|>"], [False] * 4)
    assert masked_spans(tok, sample.input_ids, sample.loss_mask) == ["<think>sum</think>4.<|im_end|>",
                                                                     "<think>sum again</think>6.<|im_end|>"]


def test_inline_think_for_templates_without_a_reasoning_field(base_tok):
    tok = family(base_tok, None)
    assert not template_renders_reasoning(tok)
    msg = assistant_message("4.", "2 plus 2", "render", False)
    (sample,) = tokenize_conversation(tok, [CONV[1], msg], ["<|im_end|>"], [False, False])
    assert masked_spans(tok, sample.input_ids, sample.loss_mask) == ["<think>\n2 plus 2\n</think>\n\n4.<|im_end|>"]


def test_unsegmentable_templates_are_clear_errors(base_tok):
    # DeepSeek-R1 cuts the <think> block out of the answer itself: rendering it can't be trained on.
    tok = family(base_tok, DEEPSEEK, "<｜begin▁of▁sentence｜>")
    msg = assistant_message("4.", "2 plus 2", "render", template_renders_reasoning(tok))
    with pytest.raises(TemplateError, match="not rendered verbatim"):
        tokenize_conversation(tok, [CONV[1], msg], ["<｜end▁of▁sentence｜>"], [False, False])
    # a generation prompt the full rendering does not continue
    odd = family(base_tok, "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                           "{% if add_generation_prompt %}<bot>{% endif %}")
    with pytest.raises(TemplateError, match="does not extend the generation prompt"):
        tokenize_conversation(odd, CONV[1:3], ["<|im_end|>"], [False, False])
    # no end-of-turn marker after the answer
    with pytest.raises(TemplateError, match="no end-of-turn marker"):
        tokenize_conversation(family(base_tok, None), CONV[1:3], ["<|eot_id|>"], [False, False])


def test_split_reasoning_from_server_fields_and_think_tags():
    assert split_reasoning("4.", "2 plus 2") == ("4.", "2 plus 2")
    assert split_reasoning("<think>\n2 plus 2\n</think>\n\n4.", "") == ("4.", "2 plus 2")
    assert split_reasoning("no think here", None) == ("no think here", "")
    assert split_reasoning(None, None) == ("", "")
