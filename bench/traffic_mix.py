"""The soak's request mix: random requests of every shape, and what to expect of each.

See bench/traffic.py for the outcomes every request must end in.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "wise", "owls", "count", "silver", "stars", "above", "quiet", "rivers", "and", "distant",
    "mountains", "echo", "old", "songs", "of", "rain", "wind", "fire", "stone", "bread", "salt",
    "iron", "glass", "paper", "music", "river", "forest", "ocean", "garden", "winter", "summer",
    "engine", "kernel", "matrix", "vector", "tensor", "token", "block", "cache", "queue",
    "batch", "stream",
)
SHARED_PREFIX_LEN = 64  # tokens shared by a third of the prompts: the prefix cache is used
OUTCOMES = ("complete", "cancelled", "rejected", "invalid", "5xx", "unexpected")


@dataclass
class Req:
    """One request to send and what to expect of it."""

    kind: str  # label in the report
    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]
    prompt_tokens: int  # as the server will count them
    expect: str = "ok"  # "ok" (200) or "400" (context_length_exceeded)
    action: str = "read"  # read | cancel (close after `k` chunks) | abort (after `t` s) | rst
    k: int = 0
    t: float = 0.0

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Result:
    index: int
    kind: str
    stream: bool
    expect: str
    action: str
    burst: bool
    start_s: float
    end_s: float = 0.0
    status: int = 0
    outcome: str = "pending"  # until settled: one of OUTCOMES
    detail: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    retry_after: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Workload:
    max_seq_len: int
    vocab: int  # token ids are drawn below this
    max_queue: int
    request_timeout_s: float = 180.0
    max_tokens_cap: int = 48  # usual max_tokens draw: 1..cap
    long_tokens: int = 160  # streams that get cancelled or reset run this long
    burst_size: int = 24
    burst_every_s: float = 25.0


class RequestMaker:
    """Draws random requests; counts prompt tokens exactly as the server will."""

    def __init__(self, tokenizer: Any, work: Workload, model: str, rng: random.Random) -> None:
        self.tok, self.w, self.model, self.rng = tokenizer, work, model, rng
        self.prefix = [rng.randrange(100, work.vocab) for _ in range(SHARED_PREFIX_LEN)]

    # ---- prompts -------------------------------------------------------------------

    def ids(self, n: int) -> list[int]:
        """n token ids; a third of them start with the shared prefix."""
        r = self.rng
        head = self.prefix[: min(n, SHARED_PREFIX_LEN)] if r.random() < 0.33 else []
        return head + [r.randrange(100, self.w.vocab) for _ in range(n - len(head))]

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def chat_len(self, messages: list[dict[str, str]]) -> int:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
        if isinstance(out, dict):
            out = out["input_ids"]
        return len(out)

    def text_len(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=True)["input_ids"])

    def messages(self, n_words: int) -> list[dict[str, str]]:
        msgs = []
        if self.rng.random() < 0.5:
            msgs.append({"role": "system", "content": "You are a terse assistant."})
        msgs.append({"role": "user", "content": self.words(max(1, n_words))})
        return msgs

    # ---- bodies --------------------------------------------------------------------

    def sampling(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.rng
        body["model"] = self.model
        if r.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=round(r.uniform(0.3, 1.2), 2), top_p=0.9,
                        seed=r.randrange(2**31))
            if r.random() < 0.3:
                body["top_k"] = 40
        if r.random() < 0.1:
            body["stop"] = ["\n", "."]
        if r.random() < 0.2:
            body["ignore_eos"] = True
        return body

    def max_tokens(self, room: int) -> int:
        return max(1, min(room, self.rng.randint(1, self.w.max_tokens_cap)))

    def completion(self, stream: bool, n: int | None = None) -> Req:
        L, r = self.w.max_seq_len, self.rng
        n = n if n is not None else r.randint(1, L - 1)
        if r.random() < 0.15:  # a text prompt now and then
            text = self.words(max(1, n // 2))
            n = self.text_len(text)
            if n >= L:
                return self.completion(stream)
            prompt: Any = text
        else:
            prompt = self.ids(n)
        body = self.sampling({"prompt": prompt, "max_tokens": self.max_tokens(L - n)})
        if stream:
            body["stream"] = True
            if r.random() < 0.7:
                body["stream_options"] = {"include_usage": True}
        return Req("stream" if stream else "completion", "/v1/completions", body, n)

    def chat(self, stream: bool) -> Req:
        L, r = self.w.max_seq_len, self.rng
        for _ in range(20):
            msgs = self.messages(r.randint(1, int(L * 0.6)))
            n = self.chat_len(msgs)
            if n < L:
                break
        else:
            raise RuntimeError("could not draw a chat prompt under the context limit")
        body = self.sampling({"messages": msgs, "max_tokens": self.max_tokens(L - n)})
        if stream:
            body["stream"] = True
            if r.random() < 0.7:
                body["stream_options"] = {"include_usage": True}
        return Req("stream_chat" if stream else "chat", "/v1/chat/completions", body, n)

    def at_limit(self) -> Req:
        """Prompt + max_tokens exactly the context limit (often a prompt of L - 1 tokens)."""
        L, r = self.w.max_seq_len, self.rng
        if r.random() < 0.3:
            msgs = self.messages(int(L * 0.6))
            n = self.chat_len(msgs)
            while n >= L:
                msgs[-1]["content"] = msgs[-1]["content"][: len(msgs[-1]["content"]) // 2]
                n = self.chat_len(msgs)
            k = L - n
            if k > self.w.long_tokens:
                k = 0
            if k:
                body = self.sampling({"messages": msgs, "max_tokens": k,
                                      "stream": r.random() < 0.5})
                return Req("at_limit_chat", "/v1/chat/completions", body, n)
        k = 1 if r.random() < 0.5 else r.randint(2, 8)
        n = L - k
        body = self.sampling({"prompt": self.ids(n), "max_tokens": k, "stream": r.random() < 0.5})
        body.pop("stop", None)
        return Req("at_limit", "/v1/completions", body, n)

    def over_limit(self) -> Req:
        """A request the server must refuse with 400 context_length_exceeded."""
        L, r = self.w.max_seq_len, self.rng
        choice = r.randrange(4)
        if choice == 0:  # a prompt of exactly the limit: no room for one token
            n, body = L, {"prompt": self.ids(L), "max_tokens": 1}
        elif choice == 1:  # a prompt over the limit
            n = L + r.randint(1, 64)
            body = {"prompt": self.ids(n), "max_tokens": 1}
        elif choice == 2:  # prompt fits, prompt + max_tokens does not
            k = r.randint(1, 16)
            n = L - k
            body = {"prompt": self.ids(n), "max_tokens": k + r.randint(1, 16)}
        else:  # a chat conversation longer than the limit
            msgs = self.messages(L)
            n = self.chat_len(msgs)
            while n < L:
                msgs[-1]["content"] += " " + self.words(L // 2)
                n = self.chat_len(msgs)
            body = {"messages": msgs, "max_tokens": 4}
        body = self.sampling(body)
        body.pop("stop", None)
        body["stream"] = r.random() < 0.3
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        return Req("over_limit", path, body, n, expect="400")

    def long_stream(self) -> Req:
        """A long stream (chat or completion) for the cancel and reset actions."""
        L, r = self.w.max_seq_len, self.rng
        room = min(self.w.long_tokens, L // 2)
        n = r.randint(1, L - room)
        if r.random() < 0.5:
            body = self.sampling({"prompt": self.ids(n), "max_tokens": room, "stream": True})
            path = "/v1/completions"
        else:
            msgs = self.messages(r.randint(1, max(1, (L - room) // 3)))
            n = self.chat_len(msgs)
            body = self.sampling({"messages": msgs, "max_tokens": room, "stream": True})
            path = "/v1/chat/completions"
        body["ignore_eos"] = True
        body.pop("stop", None)
        return Req("long_stream", path, body, n)

    def next(self) -> Req:
        """One request of the steady mix."""
        r = self.rng
        x = r.random()
        if x < 0.18:
            return self.completion(stream=False)
        if x < 0.34:
            return self.completion(stream=True)
        if x < 0.45:
            return self.chat(stream=False)
        if x < 0.56:
            return self.chat(stream=True)
        if x < 0.65:
            return self.at_limit()
        if x < 0.74:  # instant 400s: cheap, so frequent
            return self.over_limit()
        if x < 0.83:  # a cancel: the client closes the stream after a few chunks
            req = self.long_stream()
            req.kind, req.action, req.k = "cancel", "cancel", r.randint(1, 6)
            return req
        if x < 0.91:  # a reset: the client's TCP connection dies mid-stream (RST)
            req = self.long_stream()
            req.kind, req.action, req.k = "reset", "rst", r.randint(0, 6)
            return req
        # a client that gives up waiting for a non-streamed answer
        req = self.long_stream()
        req.body["stream"] = False
        req.body.pop("stream_options", None)
        req.kind, req.action, req.t = "abort", "abort", round(r.uniform(0.2, 4.0), 2)
        return req

    def burst_request(self) -> Req:
        r = self.rng
        req = self.completion(stream=r.random() < 0.5, n=r.randint(1, 64))
        req.body["max_tokens"] = r.randint(1, 8)
        req.kind = "burst_" + req.kind
        return req
