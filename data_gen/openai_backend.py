"""`openai` backend: any OpenAI-compatible server (SGLang, vLLM, llama.cpp's llama-server, OpenRouter) answers
the conversations, turn after turn, through data_gen/openai_client.py's retrying client.

    python -m data_gen data_gen.backend=openai data_gen.base_url=http://127.0.0.1:30000/v1 data_gen.concurrency=64

`concurrency` workers share one queue, each driving one conversation through all its turns, so a slow answer
holds up only its own conversation; a rejected turn ends that conversation with its earlier turns kept, one
whose retries run out is not written (a rerun retries it). data_gen.self_prompts' user turns come from the same
server as raw-text completions of the template's user header (`openai_user_turns`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter

from core.run.config import RunConfig
from core.run.errors import UserError
from data_gen.chat_tokenize import ThinkingStyle
from data_gen.conversation import Regeneration, request_ids
from data_gen.openai_client import ChatClient, Reply, RequestRejected, Retries, RetriesExhausted
from data_gen.self_prompts import MAX_TURN_TOKENS

log = logging.getLogger("data_gen")


def chat_client(cfg: RunConfig) -> ChatClient:
    dg = cfg.data_gen
    api_key = os.environ.get(dg.api_key_env) if dg.api_key_env else None
    params = {"max_tokens": dg.max_new_tokens, "temperature": dg.temperature, "top_p": dg.top_p, "n": 1}
    if dg.stop:
        params["stop"] = dg.stop
    if dg.chat_template_kwargs:  # SGLang and vLLM pass these to the template (e.g. enable_thinking)
        params["chat_template_kwargs"] = dg.chat_template_kwargs
    retries = Retries(dg.request_timeout, dg.max_retries, dg.backoff_base, dg.backoff_max)
    return ChatClient(dg.base_url, dg.model_name or cfg.target.model, api_key, retries, params, seed=cfg.seed)


def openai_user_turns(cfg: RunConfig, header: str, index: int) -> list[str | None]:
    """Batch `index` of data_gen.self_prompts from a server: `concurrency` raw-text completions of the user
    header, each with its own seed; the text of each the server ended itself ("stop"), else None."""
    dg = cfg.data_gen

    async def batch() -> list[Reply | None]:
        client = chat_client(cfg)

        async def one(row: int) -> Reply | None:
            try:
                return await client.complete_text(header, (cfg.seed * 1_000_003 + index) * dg.concurrency + row,
                                                  max_tokens=MAX_TURN_TOKENS, temperature=dg.self_prompt_temperature)
            except RequestRejected:
                return None
        try:
            return await asyncio.gather(*(one(row) for row in range(dg.concurrency)))
        finally:
            await client.aclose()
    try:
        replies = asyncio.run(batch())
    except RetriesExhausted as e:
        raise UserError(f"data_gen.self_prompts: the server kept failing ({e}); the batches sampled so far are kept "
                        "in self_prompts.jsonl, so rerunning the same command continues") from None
    return [r.content if r is not None and r.finish_reason == "stop" else None for r in replies]


async def run_openai(todo: list[Regeneration], tok, cfg: RunConfig, sink, bar, thinking: ThinkingStyle) -> Counter:
    """A pool of `concurrency` workers, each driving one conversation at a time through all its turns; finished
    conversations go to sink.add (generate.PartSink) -> the count of failures by kind."""
    dg = cfg.data_gen
    client = chat_client(cfg)
    log.info("openai backend: %s, model %r, concurrency %d, API key %s", dg.base_url, client.model, dg.concurrency,
             f"from ${dg.api_key_env}" if "Authorization" in client.client.headers else "none")
    failed: Counter[str] = Counter()
    queue = iter(todo)

    async def worker() -> None:
        for conv in queue:  # one shared iterator: each conversation goes to exactly one worker
            try:
                while request_ids(conv, tok, dg) is not None:
                    try:
                        reply = await client.complete(conv.history, conv.seed)
                    except RequestRejected as e:
                        failed["rejected"] += 1
                        log.warning("conversation %s: turn rejected by the server (%s); kept earlier turns", conv.id, e)
                        conv.end("rejected")
                        break
                    conv.add_reply(reply, thinking)
            except RetriesExhausted as e:
                failed["retries_exhausted"] += 1
                log.warning("conversation %s not written (%s); a rerun retries it", conv.id, e)
                bar.update(1)
                continue
            sink.add(conv)
            bar.update(1)
            bar.set_postfix(samples=sink.stats["samples"], retried=sum(client.errors.values()),
                            failed=sum(failed.values()), refresh=False)

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(max(1, min(dg.concurrency, len(todo)))):
                group.create_task(worker())
    except ExceptionGroup as eg:  # e.g. ServerMisconfigured: report it as itself, not as a group
        raise eg.exceptions[0] from None
    finally:
        await client.aclose()
    return Counter({"transient_" + k: v for k, v in client.errors.items()}) + failed
