"""`diff-llama serve` under bad requests and load (issue 42 §4).

Fast: `diff-llama serve` on a tiny model, each server a process of its own (with its model's process): each bad
request is refused with a 4xx in OpenAI's error format that names the problem, what passes is answered as before, and
a request past the request timeout gets a 503 (a stream: an error event) while its generation stops. Slow: the real SmolLM2
conversion behind `diff-llama serve`, the load bench's survival scenario (bench/serve_load.py)."""

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import skip_unless_serving, tiny_model, with_chat_template
from engine_serving import DiffLlamaServer

skip_unless_serving()

BENCH = Path(__file__).resolve().parent.parent / "bench"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
    "{% endif %}"
)
TIMEOUT = 3.0
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


CONTEXT = 4096  # long enough that a generation up to it takes seconds: what the timeout test needs
SMALL_CONTEXT = 128  # short enough that a generation up to it takes a second
PATIENT_TIMEOUT = 60.0  # a timeout that ends no request of these tests
SERVED, TYPED = "tiny", "./tiny"  # the served folder as the server names it, and as its command line typed it


def _never_ending_model(folder, tokenizer, context, layers=3):
    """A tiny DiffLlama with a `context`-token context that never writes EOS, so a generation runs to its limit."""
    tokenizer = with_chat_template(tokenizer, CHAT_TEMPLATE)
    model = tiny_model(vocab_size=len(tokenizer), max_position_embeddings=context, num_hidden_layers=layers)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 0
        model.lm_head.weight *= 10
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def served_folder(tmp_path_factory, tokenizer):
    return _never_ending_model(tmp_path_factory.mktemp("serve-load") / SERVED, tokenizer, CONTEXT)


def _server(folder, *options, worker=False):
    """A server on `folder`, named `TYPED` on its command line, from the folder above it, where its log goes too."""
    return DiffLlamaServer(folder.parent, TYPED, *options, cwd=folder.parent, worker=worker)


@pytest.fixture(scope="module")
def guarded(served_folder):
    server = _server(served_folder, "--request-timeout", str(TIMEOUT))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def patient(served_folder):
    """The same model behind a guard whose timeout ends no request here: what stops a generation is the test's."""
    server = _server(served_folder, "--request-timeout", str(PATIENT_TIMEOUT))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def batching(tmp_path_factory, tokenizer):
    """A deeper model of the same kind behind the guard, with continuous batching, where a request of a whole context
    takes far longer than the 10 seconds between the model process's reports of its batch (at log level info, while
    it holds requests); the paged cache holds one whole context (unsized, it would take most of this machine's RAM)."""
    folder = _never_ending_model(tmp_path_factory.mktemp("serve-batching") / SERVED, tokenizer, CONTEXT, layers=24)
    server = _server(folder, "--request-timeout", str(TIMEOUT), "--continuous-batching", "--cb-num-blocks",
                    str(CONTEXT // 256), "--log-level", "info")
    # The first request starts the batch (its cache allocated), which on a loaded machine can outlast the timeout.
    deadline = time.monotonic() + 60
    while _post(server.url, _ask())[0] != 200 and time.monotonic() < deadline:
        pass
    yield server
    server.stop()


@pytest.fixture(scope="module")
def small_context(tmp_path_factory, tokenizer):
    folder = _never_ending_model(tmp_path_factory.mktemp("serve-small") / SERVED, tokenizer, SMALL_CONTEXT)
    server = _server(folder, "--request-timeout", str(PATIENT_TIMEOUT))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def unguarded(served_folder):
    server = _server(served_folder, worker=True)
    yield server
    server.stop()


def _post(url, body, path="/v1/chat/completions", timeout=60):
    """(status, decoded JSON or text, seconds) of one POST; `body` bytes are sent as they are."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    try:
        answer = json.loads(text)
    except ValueError:
        answer = text
    return status, answer, time.monotonic() - started


def _ask(**fields):
    return {"messages": MESSAGES, "max_tokens": 4, **fields}


LONG = "fox " * (CONTEXT + 100)
# case -> (path, body, status, param, words the message must hold)
BAD_REQUESTS = {
    "malformed JSON": ("/v1/chat/completions", b'{"messages": [', 400, None, ["not valid JSON"]),
    "JSON that is not an object": ("/v1/chat/completions", b"[1, 2]", 400, None, ["JSON list, not an object"]),
    "unknown model": ("/v1/chat/completions", _ask(model="gpt-4"), 404, "model", ["`gpt-4` does not exist", "leave"]),
    "no messages": ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages", ["non-empty list", "got none"]),
    "messages not a list": ("/v1/chat/completions", _ask(messages="hi"), 400, "messages", ["non-empty list"]),
    "empty messages": ("/v1/chat/completions", _ask(messages=[]), 400, "messages", ["non-empty list"]),
    "message without a role": ("/v1/chat/completions", _ask(messages=[{"content": "hi"}]), 400, "messages[0]",
                               ["string role"]),
    "bad content part": ("/v1/chat/completions", _ask(messages=[{"role": "user", "content": [{"type": "text"}]}]),
                         400, "messages[0].content", ["content part"]),
    "max_tokens 0": ("/v1/chat/completions", _ask(max_tokens=0), 400, "max_tokens", ["at least 1", "got 0"]),
    "max_tokens 0 streamed": ("/v1/chat/completions", _ask(max_tokens=0, stream=True), 400, "max_tokens",
                              ["at least 1"]),
    "max_tokens below 0": ("/v1/chat/completions", _ask(max_tokens=-5), 400, "max_tokens", ["got -5"]),
    "max_tokens not a number": ("/v1/chat/completions", _ask(max_tokens="many"), 400, "max_tokens", ["whole number"]),
    "max_tokens past the context": ("/v1/chat/completions", _ask(max_tokens=10**9), 400, "max_tokens",
                                    [f"maximum context length is {CONTEXT} tokens", "1000000000 in the completion",
                                     "can be at most"]),
    "max_completion_tokens past the context": ("/v1/chat/completions", _ask(max_completion_tokens=CONTEXT), 400,
                                               "max_completion_tokens", ["max_completion_tokens can be at most"]),
    "prompt longer than the context": ("/v1/chat/completions", _ask(messages=[{"role": "user", "content": LONG}]),
                                       400, "messages", [f"maximum context length is {CONTEXT}",
                                                         "reduce the length of the messages"]),
    "prompt longer than the context, streamed": (
        "/v1/chat/completions", _ask(messages=[{"role": "user", "content": LONG}], stream=True), 400, "messages",
        ["reduce the length"]),
    "text prompt longer than the context": ("/v1/completions", {"prompt": LONG, "max_tokens": 4}, 400, "prompt",
                                            ["your prompt resulted in"]),
    "empty text prompt": ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "prompt", ["prompt is empty"]),
    "temperature not a number": ("/v1/chat/completions", _ask(temperature="hot"), 400, "temperature", ["a number"]),
    "temperature below 0": ("/v1/chat/completions", _ask(temperature=-1), 400, "temperature", ["0 or more"]),
    "top_p above 1": ("/v1/chat/completions", _ask(top_p=1.5), 400, "top_p", ["at most 1"]),
    "stream not a boolean": ("/v1/chat/completions", _ask(stream="yes"), 400, "stream", ["true or false"]),
    "body over the limit": ("/v1/chat/completions", b" " * (1 << 20) + b"{}", 413, None, ["over 1048576 bytes"]),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_a_bad_request_is_refused_with_a_4xx_that_says_why(guarded, case):
    path, body, status, param, words = BAD_REQUESTS[case]
    got, answer, seconds = _post(guarded.url, body, path)
    assert got == status, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]
    assert seconds < 10  # refused before any generation
    assert _post(guarded.url, _ask())[0] == 200  # and the server answers the next request


def test_what_the_guard_lets_through_is_answered_as_before(guarded):
    """Named as typed, by the server's name or not at all; plain and streamed; up to exactly the context."""
    from openai import OpenAI

    status, answer, _ = _post(guarded.url, _ask(model=TYPED))
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    status, text_answer, _ = _post(guarded.url, {"prompt": "The quick", "max_tokens": 3}, "/v1/completions")
    assert status == 200 and text_answer["usage"]["completion_tokens"] == 3
    prompt_tokens = answer["usage"]["prompt_tokens"]
    fits = _ask(max_tokens=CONTEXT - prompt_tokens)
    assert _post(guarded.url, {**fits, "max_tokens": fits["max_tokens"] + 1})[0] == 400  # one token past the context
    client = OpenAI(base_url=guarded.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    chunks = list(client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finish == ["length"] and chunks[-1].usage.completion_tokens == 5


def test_a_request_past_the_timeout_gets_a_503_and_its_generation_stops(guarded):
    start = guarded.log_size()
    status, answer, seconds = _post(guarded.url, _ask(max_tokens=CONTEXT - 100))  # seconds of generation
    assert status == 503 and answer["error"]["code"] == "timeout", answer
    assert "--request-timeout" in answer["error"]["message"] and f"{TIMEOUT:g} s" in answer["error"]["message"]
    assert TIMEOUT <= seconds < TIMEOUT + 5
    # its generation was cancelled: the next request is not queued behind thousands of tokens
    status, _, seconds = _post(guarded.url, _ask())
    assert status == 200 and seconds < TIMEOUT + 5
    assert guarded.errors_since(start) == []  # and its end raised nothing in the server


def _long_stream(url):
    """(status, the data of each event, seconds) of a stream asked for thousands of tokens."""
    request = urllib.request.Request(url + "/v1/chat/completions",
                                     json.dumps(_ask(max_tokens=CONTEXT - 100, stream=True)).encode(),
                                     {"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=60) as response:
        events = [line[len(b"data: "):] for line in response if line.startswith(b"data: ")]
    return response.status, events, time.monotonic() - started


def test_a_stream_past_the_timeout_ends_with_an_error_event(guarded):
    status, events, seconds = _long_stream(guarded.url)
    assert status == 200 and len(events) > 2  # it streamed tokens, then
    assert json.loads(events[-1])["error"]["code"] == "timeout" and TIMEOUT <= seconds < TIMEOUT + 5
    status, _, seconds = _post(guarded.url, _ask())
    assert status == 200 and seconds < TIMEOUT + 5  # the stream's generation was cancelled


def test_a_stream_past_the_timeout_stops_while_its_client_reads_slowly(served_folder):
    """A client on a slow network: the response is usually waiting to send a chunk when the time is up, where
    cancelling the response alone would not cancel the stream's generation (its generator, which would, stays open)
    and the next request would wait behind it. The guard's flag cancels the stream's streamer itself."""
    server = _server(served_folder, "--guard-timeout", str(TIMEOUT), "--slow-network", worker=True)
    try:
        for _ in range(3):  # without the guard's cancellation, most of them leave a generation running
            events = _long_stream(server.url)[1]
            assert json.loads(events[-1])["error"]["code"] == "timeout"
            status, _, seconds = _post(server.url, _ask())
            assert status == 200 and seconds < TIMEOUT, seconds
    finally:
        server.stop()


def _leave_mid_request(url, body, seconds, answers):
    """Sends `body` to /v1/chat/completions from a raw socket and closes it after `seconds`; `answers` gets the
    first byte of the answer by then, or None (it left mid-request)."""
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(url)
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((address.hostname, address.port)) as client:
        client.sendall(head + data)
        client.settimeout(seconds)
        try:
            answers.append(client.recv(1))
        except TimeoutError:
            answers.append(None)


def test_a_client_that_leaves_a_non_streamed_request_frees_the_model(patient):
    """Thousands of tokens asked for, non-streamed: once its client has gone, the generation stops, and so does one
    queued behind it whose client went too. The next request does not wait for either."""
    import threading

    start = patient.log_size()
    long_request, answers = _ask(max_tokens=CONTEXT - 100), []  # minutes of generation each
    first = threading.Thread(target=_leave_mid_request, args=(patient.url, long_request, 2.0, answers))
    first.start()
    time.sleep(0.5)
    _leave_mid_request(patient.url, long_request, 1.0, answers)  # queued behind the first
    first.join()
    assert answers == [None, None]
    status, answer, seconds = _post(patient.url, _ask(), timeout=PATIENT_TIMEOUT / 2)
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    assert seconds < 10  # not behind the generations of the requests that left
    assert patient.errors_since(start) == []


def test_a_client_that_leaves_a_stream_frees_the_model_too(patient):
    """The guard, the one reader of the client's messages, passes the disconnect on, and sets the stream's flag."""
    answers = []
    _leave_mid_request(patient.url, _ask(max_tokens=CONTEXT - 100, stream=True), 1.0, answers)
    assert answers == [b"H"]  # streaming had begun: HTTP/1.1 200 ...
    status, _, seconds = _post(patient.url, _ask(), timeout=PATIENT_TIMEOUT / 2)
    assert status == 200 and seconds < 10


def test_a_stop_flag_set_already_calls_at_once():
    """A stream that starts after its request was stopped is cancelled as it starts."""
    from diff_llama.request_guard import RequestStop

    flag, called = RequestStop(), []
    flag.call_on_set(lambda: called.append("before"))
    flag.set()
    flag.call_on_set(lambda: called.append("after"))
    assert called == ["before", "after"] and flag.is_set()


def _batch_reports(server, start: int) -> list[tuple[int, int]]:
    """(running, waiting) of each report of the model's batch in the server's log past `start` characters."""
    import re

    return [(int(running), int(waiting)) for running, waiting in
            re.findall(r"requests: (\d+) running, (\d+) waiting", server.log.read_text()[start:])]


@pytest.mark.parametrize("case", ["past the timeout", "client gone", "stream past the timeout"])
def test_under_continuous_batching_a_request_that_is_not_wanted_leaves_the_batch(batching, case):
    """Thousands of tokens asked for, then the time is up or the client goes: the request leaves the batch (its place
    and its cache go to others) instead of generating to its last token. The model's process reports its batch every
    10 seconds while it holds a request: a report after the request left says none is running, or none comes."""
    assert _post(batching.url, _ask())[0] == 200  # the batch is running
    start = batching.log_size()
    long_request = _ask(max_tokens=CONTEXT - 100)  # tens of seconds of generation
    if case == "past the timeout":
        status, answer, seconds = _post(batching.url, long_request)
        assert status == 503 and answer["error"]["code"] == "timeout" and TIMEOUT <= seconds < TIMEOUT + 5, answer
    elif case == "client gone":
        answers = []
        _leave_mid_request(batching.url, long_request, 1.5, answers)
        assert answers == [None]  # it left before any answer
    else:
        status, events, seconds = _long_stream(batching.url)
        assert status == 200 and len(events) > 2 and json.loads(events[-1])["error"]["code"] == "timeout"
    left = batching.log_size()
    time.sleep(11)  # one report's interval
    assert all(report == (0, 0) for report in _batch_reports(batching, left)), batching.log.read_text()[left:]
    status, answer, _ = _post(batching.url, _ask())
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    assert batching.errors_since(start) == []


def test_a_request_without_max_tokens_gets_at_most_the_room_left_in_the_context(small_context, tokenizer):
    """transformers' server would generate its default 1024 tokens, far past this 128-token context."""
    content = "The quick brown fox " * 4
    status, answer, _ = _post(small_context.url, {"messages": [{"role": "user", "content": content}]})
    assert status == 200, answer
    prompt_tokens, completion_tokens = answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]
    assert SMALL_CONTEXT - 60 < prompt_tokens < SMALL_CONTEXT - 10  # a prompt that leaves some room
    assert prompt_tokens + completion_tokens == SMALL_CONTEXT and answer["choices"][0]["finish_reason"] == "length"
    status, answer, _ = _post(small_context.url, {"prompt": content}, "/v1/completions")
    assert status == 200 and answer["usage"]["total_tokens"] == SMALL_CONTEXT
    assert answer["usage"]["completion_tokens"] == SMALL_CONTEXT - len(tokenizer(content)["input_ids"])
    status, answer, _ = _post(small_context.url, {"messages": MESSAGES, "max_completion_tokens": 3})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3


def test_max_model_len_caps_every_request_below_the_models_context(served_folder, capsys):
    """`--max-model-len 64` on a 4,096-token model: the guard measures prompts and answers against 64 tokens, and
    one longer than the model's context is refused before the server starts."""
    from diff_llama.cli import main

    capped = 64
    server = _server(served_folder, "--request-timeout", str(PATIENT_TIMEOUT), "--max-model-len", str(capped))
    try:
        status, answer, _ = _post(server.url, _ask(max_tokens=capped))
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert f"maximum context length is {capped} tokens" in answer["error"]["message"]
        status, answer, _ = _post(server.url, {"messages": MESSAGES})  # no max_tokens: the room left in the 64
        assert status == 200 and answer["usage"]["total_tokens"] == capped, answer
    finally:
        server.stop()
    assert main(["serve", str(served_folder), "--max-model-len", str(CONTEXT + 1), "--port", "8000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"--max-model-len {CONTEXT + 1} is longer than {served_folder}'s context of {CONTEXT} tokens: "
                        f"give at most {CONTEXT}, or leave it out for the whole context"), err


def test_max_tokens_is_set_only_where_the_server_would_run_past_the_context():
    from transformers import GenerationConfig

    from diff_llama.request_guard import fit_answer_to_context

    body = {"messages": MESSAGES}
    assert fit_answer_to_context(body, GenerationConfig(max_new_tokens=2048), 2048) is body
    assert fit_answer_to_context(body, GenerationConfig(max_new_tokens=2048), 2047) == {**body, "max_tokens": 2047}
    assert fit_answer_to_context(body, GenerationConfig(), 1023)["max_tokens"] == 1023  # the server's 1024 at least
    own = {**body, "generation_config": json.dumps({"max_new_tokens": 50})}
    assert fit_answer_to_context(own, None, 60) is own and fit_answer_to_context(own, None, 40)["max_tokens"] == 40
    asked = {**body, "max_tokens": 5}
    assert fit_answer_to_context(asked, GenerationConfig(), 3) is asked  # check_length refuses it before
    newer = {**body, "max_completion_tokens": 5}
    assert fit_answer_to_context(newer, GenerationConfig(), 10) is newer


@pytest.mark.parametrize("case", ["no messages", "messages not a list", "message without a role", "bad content part"])
def test_transformers_server_alone_answers_these_with_a_500(unguarded, case):
    """Why the guard checks fields that transformers' server reads: without it these are a 500 with no reason (and
    a `max_tokens` past the context generates until the client gives up). If this starts failing, transformers checks
    them itself and the guard's checks of them can go."""
    status, answer, _ = _post(unguarded.url, BAD_REQUESTS[case][1])
    assert status == 500 and answer == "Internal Server Error"


def test_the_request_timeout_is_a_transformers_server_option():
    from diff_llama.errors import UserError
    from diff_llama.options import ServeOptions

    with pytest.raises(UserError, match="--request-timeout must be 0"):
        ServeOptions(request_timeout=-1)
    with pytest.raises(UserError, match="--request-timeout is an option of the transformers server"):
        ServeOptions(engine="vllm", request_timeout=30)


def test_the_paged_cache_sizes_go_with_continuous_batching_on_the_transformers_server():
    from diff_llama.errors import UserError
    from diff_llama.options import ServeOptions

    with pytest.raises(UserError, match="--cb-num-blocks sizes continuous batching's cache: add --continuous-batching"):
        ServeOptions(cb_num_blocks=16)
    with pytest.raises(UserError, match="--cb-max-memory-percent must be a fraction above 0 and at most 1, not 50"):
        ServeOptions(continuous_batching=True, cb_max_memory_percent=50)
    with pytest.raises(UserError, match="--cb-max-batch-tokens must be 1 or more, not 0"):
        ServeOptions(continuous_batching=True, cb_max_batch_tokens=0)
    with pytest.raises(UserError, match="is an option of the transformers server"):
        ServeOptions(engine="vllm", continuous_batching=True, cb_num_blocks=16)


@pytest.mark.parametrize("sized", [False, True])
def test_an_unsized_paged_cache_on_a_cpu_is_named_before_the_server_starts(served_folder, capsys, sized):
    """Unsized, transformers gives the paged cache most of the free memory, which on a CPU is the machine's RAM. (The
    port is taken, so the command stops before loading the model.)"""
    import socket

    from diff_llama.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = ["serve", str(served_folder), "--device", "cpu", "--host", "127.0.0.1", "--port",
                str(taken.getsockname()[1]), "--continuous-batching", *(["--cb-num-blocks", "8"] if sized else [])]
        assert main(args) == 2
    out, err = capsys.readouterr()
    assert ("this machine's RAM" in out and "--cb-num-blocks N" in out) != sized
    assert "another server there?" in err


# ---- the load bench's own figures (bench/serve_load.py), from records of a run -------------------------------------


def _load_result(bad_status=400, after_mb=1010.0):
    streams = [{"kind": "stream", "outcome": "completed", "status": 200, "ttft_s": ttft, "latency_s": ttft + 2,
                "completion_tokens": 16, "finish_reason": "length", "chunks": 15} for ttft in (1.0, 3.0, 5.0, 7.0)]
    records = [*streams,
               {"kind": "disconnect", "outcome": "left mid-stream", "status": 200, "ttft_s": 4.0, "latency_s": 4.5,
                "chunks": 3},
               {"kind": "stream", "outcome": "client timeout", "status": None, "ttft_s": None, "latency_s": 660.0,
                "chunks": 0},
               {"kind": "bad", "name": "max_tokens 0", "outcome": f"HTTP {bad_status}", "status": bad_status,
                "expected_status": 400, "expected_words": "at least 1", "message": "max_tokens ... at least 1",
                "latency_s": 0.01}]
    return {"config": {"clients": 6, "disconnects": 1, "prompt_tokens": 128, "max_tokens": 16, "threads": 2,
                       "dtype": "float32", "context": 8192, "request_timeout_s": 600, "server": "diff-llama serve"},
            "wall_s": 10.0, "records": records, "memory_mb": {"idle": 1000.0, "peak": 1100.0, "after": after_mb},
            "after": {"process_running": True, "health": 200, "request_status": 200, "request_s": 1.0},
            "load_1min": {"before": 1.0, "after": 2.0}, "server_log_errors": []}


@pytest.fixture(scope="module")
def serve_load():
    sys.path.insert(0, str(BENCH))
    import serve_load

    return serve_load


def test_the_load_figures_count_completed_streams_over_the_wall_time(serve_load):
    result = _load_result()
    summary = serve_load.summarize(result)
    assert (summary["streams"], summary["completed"], summary["left_mid_stream"]) == (5, 4, 1)
    assert summary["completion_tokens"] == 64 and summary["tokens_per_s"] == pytest.approx(6.4)
    assert summary["requests_per_s"] == pytest.approx(0.6)  # the 6 answered (the timed-out one had no answer)
    assert summary["ttft_s"] == {"p50": 4.0, "p99": 7.0}  # nearest rank over the 5 streams with a first token
    assert summary["latency_s"]["p50"] == 5.0 and summary["latency_s"]["max"] == 660.0
    assert summary["errors"] == {"client timeout": 1} and summary["bad_requests"] == {"HTTP 400": 1}


def test_a_stream_that_completes_without_its_usage_is_not_counted_as_answered(serve_load):
    result = _load_result()
    before = serve_load.survival(result)["unanswered"]  # the stream that timed out
    del result["records"][0]["completion_tokens"]
    assert serve_load.survival(result)["unanswered"] == ["stream: completed without its usage", *before]


def test_survival_names_what_failed(serve_load):
    assert serve_load.survival(_load_result())["failures"] == ["every stream answered",
                                                                "no request past the request timeout"]
    failures = serve_load.survival(_load_result(bad_status=500, after_mb=1200.0))["failures"]
    assert {"every bad request refused with its 4xx and reason", "no 5xx",
            "memory after within 100 MB of idle"} <= set(failures)


def test_the_load_page_shows_the_figures_each_bad_request_and_each_check(serve_load):
    result = _load_result()
    result["summary"], result["survival"] = serve_load.summarize(result), serve_load.survival(result)
    page = serve_load.render(result)
    assert "| 4 of 5 | 1 | 64 | 10.0 | 6.4 | 0.60 | 4.0 / 7.0 |" in page
    assert "| max_tokens 0 | 400 | 0.01 | max_tokens ... at least 1 |" in page
    assert "| every stream answered | NO |" in page and "| no 5xx | yes |" in page
    assert "client timeout: 1" in page


def test_log_errors_keep_each_tracebacks_exception_line(serve_load):
    log = ("INFO: started\nTraceback (most recent call last):\n  File \"x.py\", line 1\n    raise ValueError\n"
           "ValueError: max_new_tokens must be greater than 0\nINFO: 500\n")
    assert serve_load.log_errors(log) == ["ValueError: max_new_tokens must be greater than 0"]
    assert serve_load.log_errors("INFO: fine\n") == []


# ---- slow: the real model under load -------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_real_model_survives_concurrent_streams_disconnects_and_bad_requests(tmp_path):
    """bench/serve_load.py's scenario, smaller (8 streams instead of 32: the real model generates one request at a
    time, a few tokens a second on a loaded 2-core CPU): the SmolLM2 conversion behind `diff-llama serve`, 2 of the
    clients leaving mid-stream, every bad request of the bench sent while the streams run."""
    sys.path.insert(0, str(BENCH))
    import serve_load

    from diff_llama.conversion.converter import ConversionOptions, convert_llama_to_diff_llama
    from diff_llama.smollm2 import smollm2_gguf_path

    folder = tmp_path / "SmolLM2-135M-Instruct-diff"  # `diff-llama convert smollm2`: DIFF V2, exact
    convert_llama_to_diff_llama(str(smollm2_gguf_path()), str(folder), ConversionOptions(), progress=False)
    result = serve_load.run(folder, clients=8, disconnects=2, max_tokens=8, prompt_tokens=64, work=tmp_path)
    verdict = serve_load.survival(result)
    bad = [record for record in result["records"] if record["kind"] == "bad"]
    assert len(bad) == len(serve_load.bad_requests("", 1)) and verdict["wrong_refusals"] == []  # each its 4xx, why
    assert verdict["server_errors"] == [] and result["server_log_errors"] == []  # no 5xx, no exception inside
    assert verdict["unanswered"] == []  # every stream completed or left as planned
    assert sum(record["outcome"] == "left mid-stream" for record in result["records"]) == 2
    assert result["after"]["process_running"] and result["after"]["health"] == 200
    assert result["after"]["request_status"] == 200  # alive after
    memory = result["memory_mb"]
    assert memory["after"] - memory["idle"] <= verdict["memory_tolerance_mb"], memory  # back near idle
    assert max(record["latency_s"] for record in result["records"]) < result["config"]["request_timeout_s"]
