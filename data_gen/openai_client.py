"""Async client for any OpenAI-compatible `/v1/chat/completions` (SGLang, vLLM, llama.cpp, OpenRouter), and its
raw-text `/v1/completions` (data_gen.self_prompts: the template's user header continued).

Why hand-rolled on httpx: runs of 10^4-10^6 prompts last hours, so every transient failure must be
retried the same way whatever the server: 408/409/429/5xx, timeouts, dropped connections and
malformed bodies are retried with exponential backoff and full jitter, waiting at least the
server's Retry-After; 400/422 reject one request (the sample is skipped and counted); 401/403/404
mean the run is misconfigured and stop it. The API key is sent as a header and never logged.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import httpx

from core.run.errors import UserError

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524, 529}
REJECT_STATUS = {400, 413, 422}


@dataclass
class Reply:
    content: str
    reasoning: str
    finish_reason: str  # "stop" | "length" | whatever the server says
    completion_tokens: int


class RequestRejected(Exception):
    """The server refused this request for good (e.g. context too long): skip the sample."""


class RetriesExhausted(Exception):
    """Still failing after max_retries: the sample is left for a rerun."""


class ServerMisconfigured(UserError):
    """401/403/404: wrong key, model or URL; retrying can't help."""


class BadResponse(Exception):
    """A 200 whose body is not a chat completion (malformed JSON, missing fields)."""


def retry_after_seconds(value: str | None) -> float | None:
    """Retry-After as seconds (it may be a number or an HTTP date), None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def backoff_delay(attempt: int, base: float, cap: float, retry_after: float | None, rng: random.Random) -> float:
    """Full-jitter exponential backoff, never shorter than the server's Retry-After."""
    delay = rng.uniform(0, min(cap, base * 2 ** attempt))
    return max(delay, retry_after) if retry_after is not None else delay


def parse_completion(body: bytes) -> Reply:
    try:
        data = json.loads(body)
        choice = data["choices"][0]
        msg = choice["message"]
        content, finish = msg.get("content"), choice.get("finish_reason")
        reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
        tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise BadResponse(f"not a chat completion: {type(e).__name__}: {e}") from None
    if not isinstance(content, (str, type(None))) or not isinstance(reasoning, str) or not finish:
        raise BadResponse("chat completion with non-string content or no finish_reason")
    return Reply(content or "", reasoning, str(finish), tokens)


def parse_text_completion(body: bytes) -> Reply:
    try:
        data = json.loads(body)
        choice = data["choices"][0]
        text, finish = choice["text"], choice.get("finish_reason")
        tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise BadResponse(f"not a text completion: {type(e).__name__}: {e}") from None
    if not isinstance(text, str) or not finish:
        raise BadResponse("text completion with non-string text or no finish_reason")
    return Reply(text, "", str(finish), tokens)


class Retries(NamedTuple):
    """How long one request may take and how a failed one is retried (data_gen.request_timeout, max_retries,
    backoff_base, backoff_max)."""
    timeout: float
    max_retries: int
    backoff_base: float
    backoff_max: float


class ChatClient:
    """One shared connection pool; `complete` is safe to call from many tasks at once."""

    def __init__(self, base_url: str, model: str, api_key: str | None, retries: Retries, params: dict, seed: int = 0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.text_url = base_url.rstrip("/") + "/completions"
        self.model, self.params, self.max_retries = model, params, retries.max_retries
        self.backoff_base, self.backoff_max = retries.backoff_base, retries.backoff_max
        self.client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(retries.timeout),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.rng = random.Random(seed)
        self.errors: Counter[str] = Counter()  # transient failures seen (each was retried)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def complete(self, messages: list[dict], seed: int | None = None) -> Reply:
        body = {"model": self.model, "messages": messages, **self.params}
        return await self._post(self.url, body if seed is None else {**body, "seed": seed}, parse_completion)

    async def complete_text(self, prompt: str, seed: int, **params) -> Reply:
        """The raw text `prompt` continued (special tokens in it parsed by the server), `params` over the
        client's own."""
        own = {k: v for k, v in self.params.items() if k != "chat_template_kwargs"}  # a chat request's only
        body = {"model": self.model, "prompt": prompt, **own, **params, "seed": seed}
        return await self._post(self.text_url, body, parse_text_completion)

    async def _post(self, url: str, body: dict, parse) -> Reply:
        for attempt in range(self.max_retries + 1):
            retry_after, kind = None, None
            try:
                resp = await self.client.post(url, json=body)
                if resp.status_code == 200:
                    return parse(resp.content)
                if resp.status_code in (401, 403, 404):
                    raise ServerMisconfigured(f"{url} answered {resp.status_code} ({resp.text[:120]!r}): "
                                              "check data_gen.base_url, data_gen.model_name and the API key env var")
                if resp.status_code in REJECT_STATUS:
                    raise RequestRejected(f"HTTP {resp.status_code}: {resp.text[:200]}")
                kind, retry_after = f"http_{resp.status_code}", retry_after_seconds(resp.headers.get("retry-after"))
            except httpx.TimeoutException:
                kind = "timeout"
            except httpx.TransportError as e:  # refused, reset, closed mid-response
                kind = f"connection_{type(e).__name__}"
            except BadResponse:
                kind = "malformed_response"
            self.errors[kind] += 1
            if attempt == self.max_retries:
                raise RetriesExhausted(f"{kind} after {self.max_retries} retries")
            await asyncio.sleep(backoff_delay(attempt, self.backoff_base, self.backoff_max, retry_after, self.rng))
        raise AssertionError("unreachable")
