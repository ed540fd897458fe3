"""TEST DOUBLE: a scripted OpenAI-compatible `/v1/chat/completions` server on loopback, with faults.

Answers are a deterministic function of the conversation, so a test can check what was stored. A
fraction `fault_rate` of requests fails instead, each in one of the ways real servers fail: 429 with
Retry-After, 500, 503, a response slower than the client's timeout, a connection dropped without a
response, and a 200 whose body is malformed JSON. Thread-per-request, like a real server under load.
"""

from __future__ import annotations

import hashlib
import json
import random
import socket
import threading
import time
from collections import Counter

from tests.loopback_http import LoopbackServer, QuietHandler

FAULTS = ("429", "500", "503", "timeout", "drop", "malformed")


def scripted_answer(messages: list[dict], max_tokens: int) -> tuple[str, str]:
    """(content, finish_reason): a few words derived from the conversation so far."""
    last = messages[-1]["content"]
    turn = sum(m["role"] == "assistant" for m in messages)
    h = int(hashlib.sha256(json.dumps(messages).encode()).hexdigest()[:8], 16)
    words = [f"Turn {turn + 1} answers {last[:24]!r}:"] + [f"w{(h >> i) % 97}" for i in range(4 + h % 12)]
    if len(words) > max_tokens:
        return " ".join(words[:max_tokens]), "length"
    return " ".join(words), "stop"


class FakeOpenAIServer(LoopbackServer):
    def __init__(self, fault_rate: float = 0.0, seed: int = 0, latency: float = 0.0, slow_seconds: float = 2.0,
                 status_override: int | None = None, reasoning: str = ""):
        self.fault_rate, self.latency, self.slow_seconds = fault_rate, latency, slow_seconds
        self.status_override, self.reasoning = status_override, reasoning
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.counts: Counter[str] = Counter()
        self.auth_headers: list[str] = []
        server = self

        class Handler(QuietHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.auth_headers.append(self.headers.get("Authorization", ""))
                with server.lock:
                    fault = server.rng.choice(FAULTS) if server.rng.random() < server.fault_rate else None
                    server.counts[fault or "ok"] += 1
                time.sleep(server.latency)
                if server.status_override:
                    return self.reply(server.status_override, b'{"error": "scripted"}')
                if fault == "429":
                    return self.reply(429, b'{"error": "rate limited"}', headers={"Retry-After": "0"})
                if fault in ("500", "503"):
                    return self.reply(int(fault), b'{"error": "scripted failure"}')
                if fault == "timeout":
                    time.sleep(server.slow_seconds)
                if fault == "drop":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return None
                if fault == "malformed":
                    return self.reply(200, b'{"choices": [{"message": ')
                content, finish = scripted_answer(body["messages"], body.get("max_tokens", 1 << 30))
                msg = {"role": "assistant", "content": content}
                if server.reasoning:
                    msg["reasoning_content"] = server.reasoning
                reply = {"id": "x", "object": "chat.completion", "model": body["model"],
                         "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
                         "usage": {"completion_tokens": len(content.split()), "prompt_tokens": 1}}
                return self.reply(200, json.dumps(reply).encode())

        self.serve(Handler)
        self.url = f"http://127.0.0.1:{self.port}/v1"
