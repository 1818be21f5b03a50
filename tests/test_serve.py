"""`lucegen serve` end to end: a real server on 127.0.0.1 (uvicorn in a thread; the numpy engine, and the cuda
engine where there is a GPU, on a tiny random checkpoint) driven by the official openai client, raw HTTP for
malformed requests, and the CLI in a subprocess."""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import openai
import pytest

from lucegen import reference
from lucegen.engine import load_model
from lucegen.model.weights import open_weights
from lucegen.serve.app import create_app
from serving import free_socket, running

KEY = "test-key"
NAME = "tiny-test"


class Spy:
    """The engine, watched: decode steps per request (one reset each), the threads that used it, and a switch that
    makes the next decode step fail."""

    def __init__(self, engine):
        self.engine, self.config, self.max_context = engine, engine.config, engine.max_context
        self.decodes: list[int] = []
        self.threads: set[int] = set()
        self.fail_next = False

    @property
    def position(self) -> int:
        return self.engine.position

    def reset(self) -> None:
        self.threads.add(threading.get_ident())
        self.decodes.append(0)
        self.engine.reset()

    def prefill(self, tokens):
        return self.engine.prefill(tokens)

    def decode(self, token):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        self.decodes[-1] += 1
        return self.engine.decode(token)


@pytest.fixture(scope="module", params=["numpy", pytest.param("cuda", marks=pytest.mark.gpu)])
def server(checkpoint, request):
    """The server on each backend: numpy everywhere, cuda (the decode megakernel) where there is a GPU."""
    engine, tokenizer = load_model(checkpoint, backend=request.param)
    spy = Spy(engine)
    with running(create_app(spy, tokenizer, NAME, api_key=KEY)) as port:
        weights = {name: np.asarray(w, np.float32)
                   for name, w in open_weights(checkpoint).load_all(progress=False).items()}
        yield SimpleNamespace(port=port, url=f"http://127.0.0.1:{port}", spy=spy, tokenizer=tokenizer,
                              weights=weights, config=engine.config)


def client(server, key=KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def raw(server, path: str, body: bytes | str | None = None, key: str | None = KEY, method: str = "POST"):
    """(status, parsed JSON body) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    status, data = response.status, response.read()
    conn.close()
    return status, json.loads(data)


def greedy(server, prompt_ids: list[int], max_tokens: int) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) of the reference's own greedy generation."""
    eos = server.tokenizer.eos_token_ids[0]
    tokens = reference.generate(server.weights, server.config, prompt_ids, max_tokens, eos_token_id=eos)
    finish = "stop" if tokens[-1] == eos else "length"
    return server.tokenizer.decode(tokens, skip_special_tokens=True), len(tokens), finish


def chat_ids(server, messages) -> list[int]:
    tok = server.tokenizer
    return tok.encode(tok.apply_chat_template(messages, enable_thinking=False))


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


# ---- models, health, greedy answers --------------------------------------------------------------------------
def test_models_and_health(server):
    assert [m.id for m in client(server).models.list()] == [NAME]
    assert raw(server, "/health", method="GET", key=None) == (200, {"status": "ok", "model": NAME})


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_is_the_reference(server, stream):
    text, n, finish = greedy(server, chat_ids(server, MESSAGES), 16)
    c = client(server)
    if not stream:
        r = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16, temperature=0)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text, finish)
        assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(chat_ids(server, MESSAGES)), n)
        return
    chunks = list(c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == finish
    assert all(ch.usage is None for ch in chunks[:-1]) and chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens,
            chunks[-1].usage.total_tokens) == (len(chat_ids(server, MESSAGES)), n, len(chat_ids(server, MESSAGES)) + n)


def test_chat_template_kwargs(server):
    r = client(server).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    tok = server.tokenizer
    assert r.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(MESSAGES, enable_thinking=True)))
    assert r.usage.prompt_tokens != len(chat_ids(server, MESSAGES))  # thinking off (by default) is another prompt


def test_completions_from_text_and_token_ids(server):
    ids = server.tokenizer.encode("The quick brown fox")
    text, n, finish = greedy(server, ids, 12)
    c = client(server)
    for prompt in ("The quick brown fox", ids):
        r = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (text, finish, n)
        assert r.usage.prompt_tokens == len(ids)
    chunks = list(c.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == text and chunks[-1].choices[0].finish_reason == finish
    assert all(ch.usage is None for ch in chunks)  # no usage without stream_options.include_usage


def test_stream_ends_with_done(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 3, "stream": True}),
                 headers={"Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    events = [line for line in response.read().decode().split("\n\n") if line]
    conn.close()
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


# ---- sampling, stop, length ----------------------------------------------------------------------------------
def sampled(server, seed: int, **kwargs):
    return client(server).completions.create(model=NAME, prompt="Once upon a time", max_tokens=40, temperature=1.0,
                                             seed=seed, extra_body={"ignore_eos": True}, **kwargs)


def test_seeded_sampling_repeats(server):
    first = sampled(server, 5).choices[0].text
    assert sampled(server, 5).choices[0].text == first
    assert sampled(server, 6).choices[0].text != first


def test_top_k_1_is_greedy(server):
    ids = server.tokenizer.encode("Once upon a time")
    r = client(server).completions.create(model=NAME, prompt=ids, max_tokens=20, temperature=1.5, seed=1,
                                          extra_body={"top_k": 1, "ignore_eos": True})
    assert r.choices[0].text == server.tokenizer.decode(
        reference.generate(server.weights, server.config, ids, 20), skip_special_tokens=True)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(server, stream):
    full = sampled(server, 9).choices[0].text
    assert len(full) >= 8, "the fixture's sampled text is too short to cut"
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert len(server.tokenizer.encode(stop)) >= 2  # the stop string spans several tokens
    want = full[:full.find(stop)]
    if stream:
        chunks = list(sampled(server, 9, stop=[stop, "never there"], stream=True))
        text, finish = "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason
    else:
        r = sampled(server, 9, stop=stop)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert (text, finish) == (want, "stop")


def test_max_tokens_is_length(server):
    r = client(server).completions.create(model=NAME, prompt="abc", max_tokens=7, extra_body={"ignore_eos": True})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 7)


# ---- queueing, disconnects, failures -------------------------------------------------------------------------
def test_concurrent_clients_get_their_own_answers(server):
    prompts = [[{"role": "user", "content": f"Question number {i}: {'why ' * i}?"}] for i in range(3)]
    want = [greedy(server, chat_ids(server, m), 20)[0] for m in prompts]

    def ask(i):
        c = client(server)
        if i == 1:
            stream = c.chat.completions.create(model=NAME, messages=prompts[i], max_tokens=20, temperature=0,
                                               stream=True)
            return "".join(ch.choices[0].delta.content or "" for ch in stream)
        return c.chat.completions.create(model=NAME, messages=prompts[i], max_tokens=20,
                                         temperature=0).choices[0].message.content

    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(ask, [0, 1, 2, 0, 1, 2]))
    assert got == want + want
    assert len(server.spy.threads) == 1  # every generation ran on the one engine thread


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_stops_the_generation(server, stream):
    max_tokens, runs = 3000, len(server.spy.decodes)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": "tell me everything", "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Authorization": f"Bearer {KEY}"})
    if stream:  # mid-stream: after the first event
        response = conn.getresponse()
        assert response.status == 200 and response.read1().startswith(b"data: ")
    deadline = time.monotonic() + 20
    while len(server.spy.decodes) == runs:  # until the generation has begun
        assert time.monotonic() < deadline
        time.sleep(0.01)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    r = client(server).completions.create(model=NAME, prompt="abc", max_tokens=5, temperature=0)
    assert r.choices[0].text == greedy(server, server.tokenizer.encode("abc"), 5)[0]
    cancelled = server.spy.decodes[runs]
    assert cancelled < max_tokens // 3, f"the dropped request went on for {cancelled} tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_a_failure_leaves_the_server_serving(server, stream):
    server.spy.fail_next = True
    c = client(server)
    # greedy, so that the request reaches a decode step (a sampled first token could be EOS: no decode, no failure)
    assert greedy(server, server.tokenizer.encode("abc"), 5)[1] > 1
    if stream:
        with pytest.raises(openai.APIError, match="injected failure"):
            list(c.completions.create(model=NAME, prompt="abc", max_tokens=5, temperature=0, stream=True))
    else:
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=NAME, prompt="abc", max_tokens=5, temperature=0)
        assert e.value.status_code == 500 and e.value.body["type"] == "server_error"
        assert "RuntimeError: injected failure" in e.value.body["message"]
    r = c.completions.create(model=NAME, prompt="abc", max_tokens=5, temperature=0)
    assert r.choices[0].text == greedy(server, server.tokenizer.encode("abc"), 5)[0]


# ---- bad requests ----------------------------------------------------------------------------------------------
def user(text="hi"):
    return [{"role": "user", "content": text}]


BAD = {  # name: (path, body, status, param, code, words of the message)
    "bad JSON": ("/v1/chat/completions", '{"messages": [', 400, None, None, "not valid JSON"),
    "not an object": ("/v1/completions", "[1, 2]", 400, None, None, "must be a JSON object"),
    "missing messages": ("/v1/chat/completions", {"model": NAME}, 400, "messages", None, "messages: Field required"),
    "empty messages": ("/v1/chat/completions", {"messages": []}, 400, "messages", None, "at least 1 item"),
    "message without content": ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages", None,
                                "messages.0.content"),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages",
                     None, "unsupported message role: robot"),
    "missing prompt": ("/v1/completions", {"max_tokens": 3}, 400, "prompt", None, "prompt: Field required"),
    "empty prompt": ("/v1/completions", {"prompt": ""}, 400, "prompt", None, "the prompt is empty"),
    "token outside the vocabulary": ("/v1/completions", {"prompt": [1, 100000]}, 400, "prompt", None,
                                     "token id 100000 is outside the vocabulary"),
    "unknown model": ("/v1/chat/completions", {"model": "gpt-9", "messages": user()}, 404, "model",
                      "model_not_found", "'gpt-9' does not exist"),
    "prompt longer than the context": ("/v1/completions", {"prompt": "x" * 5000}, 400, "prompt",
                                       "context_length_exceeded", "the prompt has 5000 tokens"),
    "max_tokens 0": ("/v1/chat/completions", {"messages": user(), "max_tokens": 0}, 400, "max_tokens", None,
                     "greater than or equal to 1"),
    "max_tokens past the context": ("/v1/completions", {"prompt": "abc", "max_tokens": 5000}, 400, "max_tokens",
                                    "context_length_exceeded", "max_tokens can be at most 4093"),
    "temperature < 0": ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature", None,
                        "temperature"),
    "top_p 0": ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p", None, "greater than 0"),
    "temperature infinite": ("/v1/completions", '{"prompt": "a", "temperature": Infinity}', 400, "temperature", None,
                             "finite number"),
    "a list of prompts": ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", None, "one prompt per request"),
    "empty stop string": ("/v1/completions", {"prompt": "a", "stop": ["", "x"]}, 400, "stop", None,
                          "must not be empty"),
    "n 2": ("/v1/chat/completions", {"messages": user(), "n": 2}, 400, "n", None, "n=2 is not supported"),
    "logprobs": ("/v1/chat/completions", {"messages": user(), "logprobs": True}, 400, "logprobs", None,
                 "not supported"),
    "stream_options without stream": ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}},
                                      400, "stream_options", None, "only allowed with stream=true"),
    "unknown route": ("/v1/embeddings", {"input": "a"}, 404, None, None, "Not Found"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_requests(server, case):
    path, body, status, param, code, words = BAD[case]
    got_status, got = raw(server, path, body if isinstance(body, str) else json.dumps(body))
    assert got_status == status and set(got) == {"error"}
    error = got["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code) and words in error["message"]


def test_api_key(server):
    with pytest.raises(openai.AuthenticationError) as e:
        client(server, key="wrong").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert "incorrect API key" in e.value.body["message"]
    status, body = raw(server, "/v1/chat/completions", json.dumps({"messages": user()}), key=None)
    assert status == 401 and "missing API key" in body["error"]["message"]


# ---- the command ------------------------------------------------------------------------------------------------
def test_the_serve_command(checkpoint):
    """`lucegen serve` as a user starts it: 127.0.0.1 by default, the key from LUCEGEN_API_KEY, the folder's name."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "LUCEGEN_API_KEY": "env-key"}
    proc = subprocess.Popen([sys.executable, "-m", "lucegen.cli", "serve", "--model", str(checkpoint),
                             "--port", str(port), "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner = proc.stdout.readline()
        assert f"at http://127.0.0.1:{port}/v1 (API key required)" in banner, banner
        deadline = time.monotonic() + 30
        while True:
            try:
                assert raw(SimpleNamespace(port=port), "/health", method="GET", key=None)[0] == 200
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline and proc.poll() is None, "lucegen serve did not come up"
                time.sleep(0.1)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="env-key", max_retries=0)
        assert [m.id for m in c.models.list()] == [checkpoint.name]
        r = c.chat.completions.create(model=checkpoint.name, messages=user(), max_tokens=4)
        assert r.usage.completion_tokens <= 4 and r.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="nope", max_retries=0).models.list()
    finally:
        proc.terminate()
        proc.wait(10)
