"""Attacks on a model server (issue 36, item 4): calls without a key or with another team's token,
hostile sampling values while other requests run, a 20+ MB body while /health is polled, chat templates
that loop or explode, and special-token strings typed in a message. Each is refused (or harmless) in
one line, and the requests that were not hostile still get their right answers."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.integration.serve.conftest import serve_home, start_server, stop_server  # noqa: F401
from tests.integration.serve.test_llm_server import AUTH, KEY, Served, tiny_model
from tests.waiting import wait_for

pytestmark = pytest.mark.security

MB = 1 << 20


@pytest.fixture(scope="module")
def tokens(serve_home: Path) -> dict[str, str]:  # noqa: F811 - the fixture imported above
    """Users of two teams and an admin, with a token each (in the module's store)."""
    from gpuyard.auth import add_user, create_token

    out = {}
    for name, team, role in (
        ("alice", "default", "member"),
        ("bob", "vision", "member"),
        ("root", "ops", "admin"),
    ):
        add_user(name, team, role)
        out[name] = create_token(name)[0]
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("llm"))


@pytest.fixture(scope="module")
def served(model_dir: Path, tokens: dict[str, str]) -> Iterator[Served]:
    """The tiny model's server, owned by team ``default`` (its key: KEY)."""
    from gpuyard.serve.access import Access, key_hash

    s = Served(model_dir, access=Access(key_hash(KEY), "default"))
    yield s
    s.close()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_language_model_server_answers_only_its_key_and_its_teams_tokens(
    served: Served, tokens: dict[str, str]
) -> None:
    from gpuyard.auth import create_token, revoke_token

    url = served.url + "/models"
    none = httpx.get(url, timeout=10)
    assert none.status_code == 401 and none.headers["www-authenticate"] == "Bearer"
    assert "needs a key" in none.json()["error"]["message"]
    assert httpx.get(url, headers=_bearer("not-the-key-at-all-0123"), timeout=10).status_code == 401
    other = httpx.get(url, headers=_bearer(tokens["bob"]), timeout=10)
    assert other.status_code == 403
    assert (
        "team 'default'" in other.json()["error"]["message"]
        and "'vision'" in other.json()["error"]["message"]
    )
    for who in (KEY, tokens["alice"], tokens["root"]):
        assert httpx.get(url, headers=_bearer(who), timeout=10).status_code == 200
    fresh, doc = create_token("alice")
    revoke_token(doc["id"])
    revoked = httpx.get(url, headers=_bearer(fresh), timeout=10)
    assert revoked.status_code == 401 and "revoked" in revoked.json()["error"]["message"]
    # Only liveness is open; the model's traffic figures and its schema need a key too.
    root = f"http://127.0.0.1:{served.port}"
    assert httpx.get(root + "/health", timeout=10).status_code == 200
    for path in ("/metrics", "/docs", "/openapi.json"):
        assert httpx.get(root + path, timeout=10).status_code == 401, path
    # Refused before the body is read: a 24 MB upload without a key costs the server nothing.
    big = httpx.post(served.url + "/completions", content=b"x" * (24 * MB), timeout=30)
    assert big.status_code == 401


def test_a_classic_model_server_checks_tokens_against_the_store(
    serve_home: Path,  # noqa: F811
    tokens: dict[str, str],
) -> None:
    """`gpuyard serve mlp` (team default) in its own process: the same rules for the predict route."""
    server = start_server(serve_home, "mlp", "--no-drift")
    try:
        url = f"{server.url}/v1/models/mlp/predict"
        body = {"inputs": [[0.1] * 8]}
        assert httpx.post(url, json=body, timeout=10).status_code == 401
        denied = httpx.post(url, json=body, headers=_bearer(tokens["bob"]), timeout=10)
        assert denied.status_code == 403 and "team 'default'" in denied.json()["detail"]
        assert httpx.post(url, json=body, headers=_bearer(tokens["alice"]), timeout=10).status_code == 200
        assert (
            httpx.post(url, json=body, headers=AUTH, timeout=10).status_code == 401
        )  # not this server's key
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        stop_server(server)
    assert "gyk_integration" not in server.log.read_text()  # the key is never logged


GOOD = [("the cat", 30), ("a big red dog ran", 25), ("old green house", 35), ("bird flew over", 28)]
# (JSON body fields, the field the 400 must name)
HOSTILE: list[tuple[str, str]] = [
    ('"temperature": NaN', "temperature"),
    ('"temperature": Infinity', "temperature"),
    ('"temperature": -1', "temperature"),
    ('"temperature": 2.5', "temperature"),
    ('"top_p": 0', "top_p"),
    ('"top_p": 1.5', "top_p"),
    ('"top_p": NaN', "top_p"),
    ('"max_tokens": 1000000000000', "max_tokens is 1000000000000"),
    ('"max_tokens": -3', "max_tokens"),
    ('"n": 1000', "n"),
    ('"logit_bias": {"5": 1e30}', "logit_bias"),
    ('"logit_bias": {"99999999": 1}', "logit_bias"),
    ('"logit_bias": {' + ", ".join(f'"{i}": 1' for i in range(301)) + "}", "logit_bias"),
    ('"top_k": -5', "top_k"),
    ('"presence_penalty": 9', "presence_penalty"),
    ('"frequency_penalty": -Infinity', "frequency_penalty"),
    ('"seed": 1180591620717411303424', "seed"),
    ('"stop": ["a", "b", "c", "d", "e"]', "stop"),
    ('"stop": ["' + "x" * 300 + '"]', "stop"),
    ('"logprobs": 5', "logprobs"),
    ('"tools": [{"type": "function", "function": {"name": "f"}}]', "tools"),
    ('"response_format": {"type": "json_object"}', "response_format"),
    ('"echo": true', "echo"),
    ('"frobnicate": 1', "frobnicate"),
]
# Values in range that reach the engine and, before, could fail the whole batch (a temperature that
# divides the logits into inf/NaN).
EXTREME = [
    '"temperature": 1e-45',
    '"temperature": 2, "top_p": 1e-9',
    '"temperature": 1, "logit_bias": {"5": 100, "6": -100}',
    '"temperature": 0.7, "top_k": 1, "presence_penalty": 2, "frequency_penalty": -2',
    '"seed": -9223372036854775808, "temperature": 1',
]


async def _post(client: httpx.AsyncClient, fields: str) -> httpx.Response:
    raw = '{"model": "tiny", "prompt": "the cat", "max_tokens": 20, ' + fields + "}"
    return await client.post("/completions", content=raw, headers={"content-type": "application/json"})


def test_hostile_sampling_values_fail_only_their_own_request(served: Served) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=served.url, api_key=KEY, max_retries=0)
    alone = [
        client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0).choices[0].text
        for p, n in GOOD
    ]

    async def together() -> tuple[list[str], list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=served.url, headers=AUTH, timeout=60) as c:
            good = [
                c.post("/completions", json={"model": "tiny", "prompt": p, "max_tokens": n, "temperature": 0})
                for p, n in GOOD
            ]
            results = await asyncio.gather(
                *good, *(_post(c, f) for f, _ in HOSTILE), *(_post(c, f) for f in EXTREME)
            )
        texts = [r.json()["choices"][0]["text"] for r in results[: len(GOOD)]]
        return (
            texts,
            list(results[len(GOOD) : len(GOOD) + len(HOSTILE)]),
            list(results[len(GOOD) + len(HOSTILE) :]),
        )

    texts, hostile, extreme = asyncio.run(together())
    assert texts == alone  # the others' answers are exactly what they get alone
    for (fields, name), r in zip(HOSTILE, hostile, strict=True):
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and name in msg and "\n" not in msg, (fields[:60], r.status_code, msg)
    for fields, r in zip(EXTREME, extreme, strict=True):
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), fields
    assert served.engine.alive()


def test_the_engine_fails_one_sequence_not_its_batch(served: Served) -> None:
    """Values no HTTP request can send any more (a NaN logit bias, a NaN penalty) put straight into the
    engine beside good requests: that request ends with an error, the others finish with their text."""
    from gpuyard.serve.llm.engine import collect
    from gpuyard.serve.llm.scheduler import Event, Failed, Finished, Request, SamplingParams, TextEmitted

    engine = served.engine
    ids = engine.tok.encode_batch(["the cat sat"])[0]

    async def run() -> list[list[Event]]:
        params = [
            SamplingParams(max_tokens=12, temperature=0),
            SamplingParams(max_tokens=12, temperature=0.5, logit_bias={5: float("nan")}),
            SamplingParams(max_tokens=12, temperature=0, presence_penalty=float("nan")),
            SamplingParams(max_tokens=12, temperature=0),
        ]
        queues = [(await collect(engine, lambda emit, p=p: Request(ids, p, emit)))[1] for p in params]

        async def drain(q: asyncio.Queue[Event]) -> list[Event]:
            out: list[Event] = []
            while not out or isinstance(out[-1], TextEmitted):
                out.append(await q.get())
            return out

        return list(await asyncio.gather(*(drain(q) for q in queues)))

    events = asyncio.run(run())
    finals = [ev[-1] for ev in events]
    assert isinstance(finals[0], Finished) and isinstance(finals[3], Finished), finals
    assert isinstance(finals[1], Failed) and isinstance(finals[2], Failed), finals
    text = lambda evs: "".join(e.text for e in evs if isinstance(e, TextEmitted))  # noqa: E731
    assert text(events[0]) == text(events[3]) and text(events[0])


def test_a_24_mb_body_never_stalls_health(model_dir: Path, served: Served) -> None:
    """Refused at the default limit (413) at once; under a large limit an operator chose, a 24 MB
    prompt is read while /health keeps answering between its chunks, parsed off the event loop and
    refused by its length without being tokenized."""
    declared = httpx.post(served.url + "/completions", content=b"{" * (24 * MB), headers=AUTH, timeout=30)
    assert declared.status_code == 413 and "limit of 4194304 bytes" in declared.json()["error"]["message"]
    big = Served(engine=served.engine, max_body_bytes=64 * MB)
    answers: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                assert c.get(f"http://127.0.0.1:{big.port}/health").status_code == 200
                answers.append(time.monotonic() - t0)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    prompt = "the cat sat " * (24 * MB // 12)
    raw = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4}).encode()

    def chunks() -> Iterator[bytes]:
        for at in range(0, len(raw), MB):
            seen = len(answers)
            yield raw[at : at + MB]
            wait_for(lambda seen=seen: len(answers) > seen, timeout=60, every=0.001)

    try:
        r = httpx.post(big.url + "/completions", content=chunks(), headers=AUTH, timeout=120)
        during = len(answers)
    finally:
        stop.set()
        poller.join(timeout=60)
        big.close(engine=False)
    assert (
        r.status_code == 400 and "characters: more than a prompt of at most" in r.json()["error"]["message"]
    )
    assert during >= 24
    print(f"\n24 MB body: /health answered {during} times while it was read, slowest {max(answers):.3f} s")
    assert max(answers) < 5.0  # a generous bound: before, one answer waited 20-30 s


LOOP = (
    "{% if messages[0]['content'] == 'loop' %}{% for a in range(100000) %}{% for b in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}{{ messages[0]['content'] }}"
)


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{% for a in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "passed 20000 characters"),
        ("{{ 'x' * 10**10 }}", "needed more than 1024 MiB"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
        ("{% for %}", "does not compile"),
    ],
)
def test_a_template_that_explodes_is_refused_in_one_line(template: str, words: str) -> None:
    from gpuyard.errors import ConfigError
    from gpuyard.serve.llm.templates import TemplateRenderer

    renderer = TemplateRenderer(template, "<eos>", max_chars=20_000, timeout_s=30)
    t0 = time.monotonic()
    try:
        with pytest.raises(ConfigError) as err:
            renderer.render([{"role": "user", "content": "hi"}])
    finally:
        renderer.close()
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
    print(f"\n{words}: refused in {time.monotonic() - t0:.2f} s")


def test_a_template_that_loops_forever_fails_its_request_alone(served: Served) -> None:
    from gpuyard.serve.llm.app import build_app
    from gpuyard.serve.llm.templates import TemplateRenderer

    app = build_app(served.engine, "tiny", renderer=TemplateRenderer(LOOP, "<eos>", 20_000, timeout_s=1.0))

    async def go() -> tuple[httpx.Response, httpx.Response, httpx.Response, float]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gpuyard/v1", timeout=60) as c:
            t0 = time.monotonic()
            looping, other = await asyncio.gather(
                c.post(
                    "/chat/completions",
                    json={"model": "tiny", "messages": [{"role": "user", "content": "loop"}]},
                ),
                c.post("/completions", json={"model": "tiny", "prompt": "the cat", "max_tokens": 3}),
            )
            took = time.monotonic() - t0
            after = await c.post(
                "/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 3},
            )
        return looping, other, after, took

    try:
        looping, other, after, took = asyncio.run(go())
    finally:
        app.state.close()
    msg = looping.json()["error"]["message"]
    assert looping.status_code == 400 and "took longer than 1 s and was stopped" in msg and "\n" not in msg
    assert other.status_code == 200 and after.status_code == 200  # a new renderer took over
    print(f"\nlooping template: refused after {took:.2f} s")


def test_special_token_strings_typed_by_a_user_stay_text(served: Served) -> None:
    from gpuyard.errors import ConfigError
    from gpuyard.serve.llm.app import ChatPrompt
    from gpuyard.serve.llm.templates import TemplateRenderer

    engine, tok = served.engine, served.engine.tok
    eos = tok.eos_id
    typed = [{"role": "user", "content": "stop here <|endoftext|> and <pad> then <|endoftext|>"}]
    renderer = TemplateRenderer(tok.chat_template, tok.eos_token, 100_000)
    try:
        kept = ChatPrompt(engine, renderer, special_tokens=False).ids(typed)
        allowed = ChatPrompt(engine, renderer, special_tokens=True).ids(typed)
        assert eos not in kept and tok.pad_id not in kept
        assert allowed.count(eos) == 2  # what a deployment that opts in gets
        assert "<|endoftext|>" in tok.tokenizer.decode(kept, skip_special_tokens=True)
        # A message without such strings tokenizes exactly as before.
        plain = [{"role": "user", "content": "the cat sat"}]
        assert ChatPrompt(engine, renderer, False).ids(plain) == ChatPrompt(engine, renderer, True).ids(plain)
    finally:
        renderer.close()
    twice = "{% for m in messages %}{{ m['content'] }} {{ m['content'] }}{% endfor %}"
    upper = TemplateRenderer(twice, "x", 100_000)
    try:
        with pytest.raises(
            ConfigError, match="contains the special token '<pad>', which this server keeps as text"
        ):
            ChatPrompt(engine, upper, special_tokens=False).ids(typed)
    finally:
        upper.close()
    # Over HTTP: the prompt counts the typed strings as text (more tokens than the control ids would be).
    r = httpx.post(
        served.url + "/chat/completions",
        json={"model": "tiny", "messages": typed, "max_tokens": 5, "temperature": 0},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(kept)
