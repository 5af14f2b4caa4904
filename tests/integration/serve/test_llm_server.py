"""The OpenAI-compatible language-model server on 127.0.0.1, driven by the openai client: greedy
continuous batching equals transformers' generate() per request, streaming, stops, the context check,
the bounded queue, dropped streams and metrics."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from tests.llm_fixtures import tokenizer_folder
from tests.waiting import free_port, wait_for

pytestmark = pytest.mark.integration

CONTEXT = 256


def _free_port() -> int:
    return free_port()  # below the ephemeral range (tests.waiting)


def tiny_model(tmp: Path) -> Path:
    """A random Llama (hidden 32, 2 layers, GQA) with a trained tokenizer, saved in Hugging Face layout."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from gpuyard.data.tokens import load_tokenizer
    from gpuyard.train.hf import CausalLM, save_hf

    tok = tokenizer_folder(tmp)
    vocab = load_tokenizer(tok).vocab_size
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, eos_token_id=0, pad_token_id=1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger weights: sharper, more varied greedy text than the default init
        for p in model.parameters():
            p.mul_(8.0) if p.dim() > 1 else None
    return save_hf(CausalLM(model), None, tmp / "model", tok)


KEY = "gyk_llm-server-tests-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Served:
    """The OpenAI app behind its key gate on a uvicorn thread (what `gpuyard serve` runs)."""

    def __init__(
        self,
        folder: Path | None = None,
        max_batch: int = 8,
        max_queue: int = 64,
        start: bool = True,
        engine: Any = None,
        access: Any = None,
        drain_s: float = 1.0,
        **limits: Any,
    ) -> None:
        import uvicorn

        from gpuyard.serve.access import Access, KeyGate, draining_server, key_hash, openai_body
        from gpuyard.serve.llm.app import Limits, Metrics, build_app
        from gpuyard.serve.llm.engine import load_engine

        if engine is None:
            assert folder is not None
            engine, _ = load_engine(folder, "cpu", max_batch, max_queue, Metrics())
            if not start:
                engine.close()  # no engine thread: requests stay queued
        self.engine = engine
        self.port = _free_port()
        self.app = build_app(self.engine, "tiny", limits=Limits(**limits))
        gate = KeyGate(self.app, access or Access(key_hash(KEY), None, tokens=False), openai_body)
        config = uvicorn.Config(
            gate,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            log_config=None,
            timeout_graceful_shutdown=drain_s,
        )
        self.server = draining_server(config, self.engine.inflight)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, timeout=30)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def close(self, engine: bool = True) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.app.state.close()
        if engine:
            self.engine.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("llm"))


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[Served]:
    s = Served(model_dir)
    yield s
    s.close()


def test_batched_greedy_equals_generate_and_the_api_shapes(served: Served, model_dir: Path) -> None:
    from openai import AsyncOpenAI, OpenAI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = OpenAI(base_url=served.url, api_key=KEY)
    [m] = client.models.list().data
    assert m.id == "tiny"
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        "the cat", "a big red dog ran over the hill and", "old", "green house garden river saw the",
        "then", "bird flew", "the young cat liked the small mat under the tree then", "found",
    ]  # fmt: skip
    lengths = [12, 40, 25, 7, 33, 18, 29, 21]

    async def many() -> list[Any]:
        aclient = AsyncOpenAI(base_url=served.url, api_key=KEY)
        return list(await asyncio.gather(*[
            aclient.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0)
            for p, n in zip(prompts, lengths, strict=True)
        ]))  # fmt: skip

    results = asyncio.run(many())
    for p, n, r in zip(prompts, lengths, results, strict=True):
        ids = tok(p, return_tensors="pt")
        with torch.no_grad():
            ref = hf.generate(**ids, max_new_tokens=n, do_sample=False, eos_token_id=0, pad_token_id=1)
        expected = tok.decode(ref[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        assert r.choices[0].text == expected, p
        assert r.usage.prompt_tokens == ids["input_ids"].shape[1]
        assert r.choices[0].finish_reason in ("length", "stop")
    # Streaming chat: the chunks add up to the same text as the whole answer; seeds repeat.
    messages = [{"role": "user", "content": "the cat sat on"}]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, temperature=0.8, seed=7
    )
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, temperature=0.8, seed=7, stream=True
    )
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(chunks) == whole.choices[0].message.content and len(chunks) > 1
    # A stop string ends the text before it.
    text = results[0].choices[0].text
    if len(text) > 4:
        stop = text[2:4]
        cut = client.completions.create(
            model="tiny", prompt=prompts[0], max_tokens=12, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_hostile_requests_are_refused_in_one_line(served: Served) -> None:
    from openai import BadRequestError, NotFoundError, OpenAI

    client = OpenAI(base_url=served.url, api_key=KEY, max_retries=0)
    n = len(served.engine.tok.encode_batch(["the cat " * 10])[0])
    with pytest.raises(BadRequestError) as err:
        client.completions.create(model="tiny", prompt="the cat " * 10, max_tokens=10**9)
    msg = err.value.body["message"]  # type: ignore[index]
    assert (
        f"prompt has {n} tokens and max_tokens is 1000000000" in msg and f"context length of {CONTEXT}" in msg
    )
    with pytest.raises(BadRequestError, match=f"this server takes prompts of at most {CONTEXT - 1} tokens"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "dog " * 400}])
    # No max_tokens sent: the message says what was used instead of blaming the client for a value.
    size = lambda text: len(served.engine.tok.encode_batch([text])[0])  # noqa: E731
    long = "the cat"
    while size(long + " cat") < CONTEXT - 1:
        long += " cat"
    n_long = size(long)
    assert n_long + 16 > CONTEXT
    with pytest.raises(BadRequestError) as err:
        client.completions.create(model="tiny", prompt=long)
    msg = err.value.body["message"]  # type: ignore[index]
    assert f"max_tokens was not given; the default is 16: {n_long + 16}" in msg
    with pytest.raises(NotFoundError, match="is not served here"):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    bad = httpx.post(served.url + "/completions", content=b"\x00\xff not json", timeout=10, headers=AUTH)
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
    bad = httpx.post(
        served.url + "/completions", json={"model": "tiny", "prompt": [10**9]}, timeout=10, headers=AUTH
    )
    assert bad.status_code == 400 and "token ids must be in" in bad.json()["error"]["message"]
    bad = httpx.post(
        served.url + "/chat/completions",
        json={"model": "tiny", "messages": [{"role": "god", "content": "x"}]},
        headers=AUTH,
    )
    assert bad.status_code == 400


class DecodeGate:
    """The engine's executor with its decoding steps held until the test allows them (prefills run
    freely), so what the test sees does not depend on how fast the engine thread decodes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.permits = threading.Semaphore(0)
        self.opened = False

    def decode(self, reqs: list[Any]) -> Any:
        if not self.opened and not self.permits.acquire(timeout=120):
            raise RuntimeError("the test's gate held a decoding step for 120 s")
        return self.inner.decode(reqs)

    def allow(self, steps: int) -> None:
        for _ in range(steps):
            self.permits.release()

    def open(self) -> None:
        self.opened = True
        self.permits.release()  # a step held now goes through

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_dropped_stream_frees_its_slot_and_short_requests_pass_long_ones(served: Served) -> None:
    engine = served.engine
    gate = DecodeGate(engine.executor)
    engine.executor = gate
    try:
        body = {"model": "tiny", "prompt": "the", "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", served.url + "/completions", json=body, timeout=30, headers=AUTH) as resp:
            assert resp.status_code == 200
            # Prefilled (its first token sampled), it joins the batch; its first decoding step is held.
            # (Its text is not read: it may be held back a few tokens, for a character or a stop string.)
            [long_req] = wait_for(lambda: list(engine.running) or None)
            # A short request joins the running batch and finishes while the long one still decodes:
            # it queues behind the held step, then 3 steps let the long one make at most 3 tokens more.
            answer: dict[str, httpx.Response] = {}
            short = {"model": "tiny", "prompt": "a", "max_tokens": 3, "temperature": 0}
            poster = threading.Thread(
                target=lambda: answer.setdefault(
                    "short", httpx.post(served.url + "/completions", json=short, timeout=60, headers=AUTH)
                )
            )
            poster.start()
            wait_for(lambda: len(engine.waiting) == 1)
            gate.allow(3)  # the held step, then the 2 that decode the short one beside the long one
            wait_for(lambda: not poster.is_alive(), timeout=60)
            assert answer["short"].status_code == 200
            assert long_req.finish_reason is None and len(long_req.generated) <= 4
        # The client closed the stream: the request is cancelled while its next step is held, and it
        # leaves the batch without running to 200 tokens.
        wait_for(lambda: long_req.cancelled, timeout=30)
        gate.open()
        wait_for(lambda: not engine.running, timeout=30)
        assert long_req.cancelled and len(long_req.generated) <= 5
    finally:
        gate.open()
        engine.executor = gate.inner
    assert httpx.get(f"http://127.0.0.1:{served.port}/metrics").status_code == 401  # a key, here too
    metrics = httpx.get(f"http://127.0.0.1:{served.port}/metrics", headers=AUTH).text
    assert 'gpuyard_llm_requests_total{outcome="cancelled"}' in metrics
    count = next(
        line
        for line in metrics.splitlines()
        if line.startswith("gpuyard_llm_time_to_first_token_seconds_count")
    )
    assert float(count.split()[-1]) >= 2
    assert "gpuyard_llm_batch_size" in metrics and "gpuyard_llm_queue_depth" in metrics


def test_full_queue_answers_429(served: Served) -> None:
    """The module's model behind a second app whose engine never runs (requests stay queued), driven
    in-process through ASGI: no second model load or port."""
    from gpuyard.serve.llm.app import Metrics, build_app
    from gpuyard.serve.llm.engine import Engine

    engine = Engine(served.engine.model, served.engine.tok, CONTEXT, 1, 2, metrics=Metrics())
    engine.close()  # no engine thread: requests stay queued
    app = build_app(engine, "tiny")
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 4}

    async def fire() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gpuyard", timeout=30) as c:
            pending = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(2)]
            await asyncio.to_thread(wait_for, lambda: len(engine.waiting) == 2)
            third = await c.post("/v1/completions", json=body)
            for t in pending:
                t.cancel()
            assert "queue is full (2 requests waiting)" in third.json()["error"]["message"]
            return third.status_code

    assert asyncio.run(fire()) == 429


def _raw_request(port: int, body: dict[str, Any]) -> socket.socket:
    """A request sent on a socket of its own, left open (its answer is never read)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_clients_that_hang_up_while_waiting_free_their_queue_places(served: Served) -> None:
    """A queue of 2 on an engine that never runs: two waiting clients (one streaming) hang up, and their
    places are free at once, so the next requests are queued rather than refused with 429."""
    from gpuyard.serve.llm.app import Metrics
    from gpuyard.serve.llm.engine import Engine

    engine = Engine(served.engine.model, served.engine.tok, CONTEXT, 1, 2, metrics=Metrics())
    engine.close()  # no engine thread: requests stay queued
    other = Served(engine=engine)
    try:
        body = {"model": "tiny", "prompt": "the cat", "max_tokens": 4}
        waiting = [_raw_request(other.port, body), _raw_request(other.port, {**body, "stream": True})]
        wait_for(lambda: len(engine.waiting) == 2)
        full = httpx.post(other.url + "/completions", json=body, headers=AUTH, timeout=30)
        assert full.status_code == 429
        for sock in waiting:
            sock.close()
        wait_for(lambda: not engine.waiting)  # both places freed, without any batch slot freeing
        again = [_raw_request(other.port, body), _raw_request(other.port, body)]
        wait_for(lambda: len(engine.waiting) == 2)
        for sock in again:
            sock.close()
        wait_for(lambda: not engine.waiting)
    finally:
        other.close()


def test_stopping_waits_a_bounded_time_and_says_what_it_cut(
    served: Served, capfd: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM's path (should_exit) with a request that can never finish: the server stops after its
    drain limit and says what it waited for and what it cut."""
    from gpuyard.serve.llm.app import Metrics
    from gpuyard.serve.llm.engine import Engine

    engine = Engine(served.engine.model, served.engine.tok, CONTEXT, 1, 4, metrics=Metrics())
    engine.close()
    other = Served(engine=engine, drain_s=0.5)
    sock = _raw_request(other.port, {"model": "tiny", "prompt": "the cat", "max_tokens": 4})
    try:
        wait_for(lambda: len(engine.waiting) == 1)
        other.close()
        assert not other.thread.is_alive()
    finally:
        sock.close()
    err = capfd.readouterr().err
    assert "stopping; waiting up to 0.5 s for 1 open connection(s)" in err
    assert "(0 generating, 1 waiting)" in err
    assert "the drain limit of 0.5 s cut 1 request(s) still answering" in err
