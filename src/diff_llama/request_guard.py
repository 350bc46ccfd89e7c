"""The guard `diff-llama serve` puts in front of transformers' server: completion requests are checked before the
server sees them, none generates past the model's context, and none runs on once its client has gone or past the
request timeout.

transformers serve (5.25) answers a body without `messages`, or with messages that are not role/content objects, with
a 500 that gives no reason, and other bad fields with a 400 or 422 in its own format (a streamed `max_tokens: 0` gets
a 200 whose one event is an error). It runs a `max_tokens` far past the model's context for as long as that takes
(minutes on a CPU, memory growing all the while), and a request queued behind others (it generates one request at a
time) waits with no deadline. The guard, an ASGI middleware, refuses each such request with a 4xx in OpenAI's error
format, `{"error": {"message", "type", "param", "code"}}`, whose message names the limit and the fix (the
context-length messages are OpenAI's own words). A request without `max_tokens` would get the generation config's
`max_new_tokens` (at least 1024) however little room its prompt leaves; as OpenAI and vLLM do, the guard caps it at
the room left in the context (or in the server's `--max-model-len`). Anything else reaches transformers' server
unchanged.

Every guarded request gets `timeout` seconds, its wait for the model included. Past it, a request that has no
answer yet gets a 503 that says so, and a stream ends with an error event. Either way the request's generation
stops, and so it does once its client has gone. The guard cancels the request's handler, which cancels a
non-streamed request in the model's process (transformers' own `CancelOnDisconnect` does the same when the client
goes). A stream's generation is cancelled by its streamer, which transformers' server cancels only when the
cancellation reaches the stream's generator; it does not if the response was waiting to send a chunk then (the
generator is closed when garbage collected, thousands of tokens later). So the guard sets the request's stop flag,
which cancels the streamer itself.

Only torch-free imports at module level: `diff-llama serve --help` must not pay for them.
"""

import contextlib
import contextvars
import json
import typing

# Endpoint -> the field that holds its input. Others under /v1 with a JSON body get the JSON and model checks only.
COMPLETION_INPUTS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
JSON_PATHS = {*COMPLETION_INPUTS, "/v1/responses", "/v1/systemone"}
# A body is read before anything else, so its size is bounded by the context: JSON escapes a character in at most 12
# bytes and a token seldom spans more than 16 characters, so no prompt that fits the context comes near 256 bytes a
# token; tokenizing a longer body only to refuse it would cost seconds of CPU, with every stream waiting.
BODY_BYTES_PER_TOKEN = 256
MIN_BODY_BYTES = 1 << 20
TEXT_PARTS = ("text", "input_text", "output_text")


class RequestError(Exception):
    """A request refused: an HTTP status and a message in OpenAI's error format."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def json(self) -> bytes:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode()


# ---- checks on the request alone ------------------------------------------------------------------------------------


def parse_body(raw: bytes) -> dict:
    """The request's JSON object; refuses anything else."""
    try:
        body = json.loads(raw)
    except ValueError as error:  # UnicodeDecodeError too
        raise RequestError(400, f"the request body is not valid JSON ({error}): send one JSON object with "
                                "Content-Type: application/json") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body is a JSON {type(body).__name__}, not an object: send "
                                '{"messages": [...], ...} (or {"prompt": ...} to /v1/completions)')
    return body


def check_fields(path: str, body: dict) -> None:
    """The fields transformers' server reads without checking them, checked: what would otherwise be a 500."""
    _check_type(body, "model", str, "the served model's name, or leave it out")
    if path == "/v1/chat/completions":
        check_messages(body.get("messages"))
    elif path == "/v1/completions":
        _check_type(body, "prompt", str, "one string (lists of prompts are not supported)")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise RequestError(400, f"{name} must be a whole number of tokens, at least 1 (got {value!r}): ask for "
                                    "1 or more, or leave it out for the server's default", param=name)
    _check_number(body, "temperature", lambda t: t >= 0, "0 or more (0: greedy)")
    _check_number(body, "top_p", lambda p: 0 < p <= 1, "above 0 and at most 1")
    _check_number(body, "frequency_penalty", lambda p: True, "a number")
    _check_type(body, "seed", int, "a whole number")
    _check_type(body, "stream", bool, "true or false")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or isinstance(stop, list)
                                 and all(isinstance(s, str) for s in stop)):
        raise RequestError(400, f"stop must be a string or a list of strings (got {stop!r})", param="stop")
    config = body.get("generation_config")
    if config is not None:
        try:
            parsed = json.loads(config) if isinstance(config, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise RequestError(400, "generation_config must be a string holding a JSON object of GenerationConfig "
                                    f"fields (got {config!r:.80})", param="generation_config")


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        got = "none" if messages is None else repr(messages)[:80]
        raise RequestError(400, f"messages must be a non-empty list of {{\"role\": ..., \"content\": ...}} objects "
                                f"(got {got})", param="messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(400, f"{where} must be an object with a string role, such as "
                                    f'{{"role": "user", "content": "Hi"}} (got {message!r:.80})', param=where)
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError(400, f"{where}.content must be a string or a list of content parts (got "
                                    f"{content!r:.80})", param=f"{where}.content")
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str) or (
                    part["type"] in TEXT_PARTS and not isinstance(part.get("text"), str)):
                raise RequestError(400, f"{where}.content has a part that is not a content part such as "
                                        f'{{"type": "text", "text": "Hi"}} (got {part!r:.80})',
                                   param=f"{where}.content")


def _check_type(body, name, kind, expected):
    value = body.get(name)
    wrong_bool = kind is int and isinstance(value, bool)
    if value is not None and (not isinstance(value, kind) or wrong_bool):
        raise RequestError(400, f"{name} must be {expected} (got {value!r:.80})", param=name)


def _check_number(body, name, allowed, expected):
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not allowed(value):
        raise RequestError(400, f"{name} must be a number, {expected} (got {value!r:.80})", param=name)


# ---- checks against the served model ---------------------------------------------------------------------------------


def check_model(body: dict, served_name) -> None:
    """A request naming another model than the one the server is pinned to gets OpenAI's 404 (`model_not_found`)."""
    requested = body.get("model")
    if requested is not None and requested != served_name:
        raise RequestError(404, f"The model `{requested}` does not exist on this server, which serves "
                                f"`{served_name}`: name that model, or leave `model` out", param="model",
                           code="model_not_found")


def count_prompt_tokens(path: str, body: dict, processor) -> int:
    """The prompt's length in tokens as transformers' server builds it: the chat template over the messages' text
    (their images, audio and tool calls left out: a lower bound for models that read those), or the plain prompt."""
    if path == "/v1/completions":
        return len(getattr(processor, "tokenizer", processor)(body.get("prompt", ""))["input_ids"])
    messages = [{"role": message["role"], "content": message_text(message.get("content"))}
                for message in body["messages"]]
    from jinja2.exceptions import TemplateError

    try:
        ids = processor.apply_chat_template(messages, add_generation_prompt=True, tools=body.get("tools"),
                                            tokenize=True, return_dict=True,
                                            **(body.get("chat_template_kwargs") or {}))["input_ids"]
    except TemplateError as error:
        raise RequestError(400, f"the model's chat template refused these messages: {error}",
                           param="messages") from None
    return len(ids[0]) if ids and isinstance(ids[0], list) else len(ids)


def message_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return " ".join(part["text"] for part in content if part["type"] in TEXT_PARTS)


def check_length(path: str, body: dict, prompt_tokens: int, context: int) -> None:
    """OpenAI's `context_length_exceeded`: the prompt must leave room for the answer, and the answer asked for
    (`max_tokens`) must fit beside the prompt."""
    where = "messages" if path == "/v1/chat/completions" else "prompt"
    if prompt_tokens == 0:  # the model has no token to continue from (transformers' server: a 500)
        raise RequestError(400, f"the {where} is empty (0 tokens): send some text to complete", param=where)
    if prompt_tokens >= context:
        raise RequestError(400, f"This model's maximum context length is {context} tokens. However, your {where} "
                                f"resulted in {prompt_tokens} tokens, which leaves no room for an answer. Please "
                                f"reduce the length of the {where}.", param=where, code="context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    answer = body.get(name)
    if answer is not None and prompt_tokens + answer > context:
        raise RequestError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                                f"{prompt_tokens + answer} tokens ({prompt_tokens} in the {where}, {answer} in the "
                                f"completion). Please reduce the length of the {where} or completion: {name} can be "
                                f"at most {context - prompt_tokens} with these {where}.", param=name,
                           code="context_length_exceeded")


def fit_answer_to_context(body: dict, generation_config, room: int) -> dict:
    """The body to pass on, with `max_tokens` set where transformers' server would otherwise generate past the
    context: a request that names no answer length gets at most the `room` left in it."""
    if body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None:
        return body
    default = default_answer_tokens(body, generation_config)
    if default is None or default <= room:
        return body
    return {**body, "max_tokens": room}


def default_answer_tokens(body: dict, generation_config) -> int | None:
    """How many tokens transformers' server generates for a request that names no answer length: the request's own
    `generation_config`'s max_new_tokens, or the model's, at least 1024 (None: only a max_length bounds it)."""
    if body.get("generation_config") is not None:
        requested = json.loads(body["generation_config"]).get("max_new_tokens")
        return requested if isinstance(requested, int) else None
    return max(generation_config.max_new_tokens or 0, 1024)


# ---- stopping a request's generation ---------------------------------------------------------------------------------

# The stop flag (a RequestStop) of the guarded request whose handler is running: transformers' handler starts its
# stream from the request's own task, whose context the guard set.
REQUEST_STOP = contextvars.ContextVar("diff_llama_request_stop", default=None)


class RequestStop:
    """A guarded request's stop flag: once set, its stream's streamer is cancelled (see `stop_streams_on_request`).
    Used on the server's event loop only (transformers' handlers start their streams there), so it needs no lock."""

    def __init__(self):
        self._set, self._on_set = False, []

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        on_set, self._on_set = self._on_set, []
        for call in on_set:
            call()

    def call_on_set(self, call) -> None:
        """Calls `call` when the flag is set (now, if it is set already)."""
        if self._set:
            call()
        else:
            self._on_set.append(call)


def stop_streams_on_request(model_manager) -> None:
    """Makes the streams of guarded requests that `model_manager`'s engines start end on their request's stop flag:
    the stream's streamer is cancelled, which cancels its request in the model's process."""
    get_engine = model_manager.get_engine

    def get_stoppable_engine(*args, **kwargs):
        engine = get_engine(*args, **kwargs)
        if not getattr(engine, "stops_on_request", False):
            engine.generate_streaming = cancellable_streaming(engine.generate_streaming)
            engine.submit_streaming = cancellable_streaming(engine.submit_streaming)
            engine.stops_on_request = True
        return engine

    model_manager.get_engine = get_stoppable_engine


def cancellable_streaming(generate_streaming):
    """`generate_streaming` (an engine's), whose streamer is cancelled when the calling request's stop flag is set."""

    def generate_cancellable(*args, **kwargs):
        queue, streamer = generate_streaming(*args, **kwargs)
        flag = REQUEST_STOP.get()
        if flag is not None:
            flag.call_on_set(streamer.cancel)
        return queue, streamer

    return generate_cancellable


# ---- the middleware --------------------------------------------------------------------------------------------------


class ClientGone(Exception):
    """The client went away before its request body arrived."""


class ServedModel(typing.NamedTuple):
    """The model a server is pinned to: its name, its engine (which holds the model's config, generation config and
    processor in the server's process; the model runs in a process of its own) and the most tokens a request may
    take, prompt and answer (the model's context, or the server's `--max-model-len`)."""

    name: str
    engine: typing.Any
    context_length: int | None


class RequestGuard:
    """ASGI middleware over transformers' server app: checks the JSON requests of `JSON_PATHS` against the server's
    model (`model_manager.force_model`; without one, only the request's own fields are checked) and gives each
    `timeout` seconds (None: no limit). Everything else passes through untouched."""

    def __init__(self, app, model_manager, timeout: float | None = None):
        self.app, self.model_manager, self.timeout = app, model_manager, timeout or None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in JSON_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            served = self.served_model()
            raw = await read_body(receive, body_limit(served and served.context_length))
            body = parse_body(raw)
            passed = await self.check(scope["path"], body, served)
        except RequestError as error:
            await send_error(send, error)
            return
        except ClientGone:
            return
        if passed is not body:
            raw = json.dumps(passed).encode()
            scope = with_content_length(scope, len(raw))
        await self.answer_in_time(scope, raw, receive, send)

    def served_model(self) -> ServedModel | None:
        """The model the server is pinned to, or None when it serves any model."""
        name = self.model_manager.force_model
        if name is None:
            return None
        engine = self.model_manager.get_engine(None)
        return ServedModel(name, engine, self.model_manager.generation_state.context_length(engine.model_config))

    async def check(self, path: str, body: dict, served: ServedModel | None) -> dict:
        """The body to pass on to the server (`body`, or a copy whose answer fits the context); refuses a bad one."""
        if served is not None:
            check_model(body, served.name)
        check_fields(path, body)
        if served is None or path not in COMPLETION_INPUTS or not served.context_length:
            return body
        engine, context = served.engine, served.context_length
        import anyio.to_thread

        # off the event loop: a long prompt takes a while to tokenize, and the streams being answered go on
        prompt_tokens = await anyio.to_thread.run_sync(count_prompt_tokens, path, body, engine.processor)
        check_length(path, body, prompt_tokens, context)
        return fit_answer_to_context(body, engine.generation_config, context - prompt_tokens)

    async def answer_in_time(self, scope, raw: bytes, receive, send):
        import asyncio

        stop = RequestStop()
        client_gone = asyncio.Event()
        started = False

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        async def watch_client():
            # After its body, a client's only message is its disconnect (or the end of the response, which reads
            # the same); the server's app gets it from `replay`, so the guard is the one reader of `receive`.
            while (await receive())["type"] != "http.disconnect":
                pass
            stop.set()
            client_gone.set()

        watcher = asyncio.ensure_future(watch_client())
        token = REQUEST_STOP.set(stop)
        app = asyncio.ensure_future(self.app(scope, replay(raw, client_gone), watched_send))  # in this context
        REQUEST_STOP.reset(token)
        try:
            done, _ = await asyncio.wait({app}, timeout=self.timeout)
        except asyncio.CancelledError:
            stop.set()
            app.cancel()
            raise
        finally:
            watcher.cancel()
        if done:
            app.result()  # the server's own exceptions go on to its error handling
            return
        # Cancelling the handler cancels a non-streamed request in the model's process; a stream's flag cancels its
        # streamer, which the response may not reach in time (see the module docstring).
        stop.set()
        app.cancel()
        await asyncio.gather(app, return_exceptions=True)
        error = RequestError(503, f"the request ran past the server's request timeout of {self.timeout:g} s, its "
                                  "wait for the model included: retry later, send fewer requests at once or ask for "
                                  "fewer tokens, or start the server with a longer --request-timeout", code="timeout")
        if started:  # a stream: end it as transformers' server ends a failed one
            await send({"type": "http.response.body", "body": b"data: " + error.json() + b"\n\n",
                        "more_body": False})
        else:
            await send_error(send, error)


def body_limit(context: int | None) -> int | None:
    return None if not context else max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * context)


async def read_body(receive, limit: int | None) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise RequestError(413, f"the request body is over {limit} bytes, more than any prompt that fits this "
                                    f"model's context could take ({BODY_BYTES_PER_TOKEN} bytes a token): shorten "
                                    "the messages", code="context_length_exceeded")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def replay(raw: bytes, client_gone):
    """The app's `receive`: the body the guard read, then the client's disconnect once the guard has seen it."""
    replayed = False

    async def receive_again():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await client_gone.wait()
        return {"type": "http.disconnect"}

    return receive_again


def with_content_length(scope, size: int):
    headers = [(name, value) for name, value in scope["headers"] if name.lower() != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(size).encode())]}


async def send_error(send, error: RequestError) -> None:
    body = error.json()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def guarded_server(timeout: float | None):
    """Within this context, transformers' server (`transformers.cli.serve.Serve`, which imports `build_server` when
    it starts) puts a `RequestGuard` with `timeout` in front of its app, and its streams stop on the guard's word."""
    from transformers.cli.serving import server

    original = server.build_server

    def build_guarded_server(model_manager, *args, **kwargs):
        app = original(model_manager, *args, **kwargs)
        stop_streams_on_request(model_manager)
        app.add_middleware(RequestGuard, model_manager=model_manager, timeout=timeout)
        return app

    server.build_server = build_guarded_server
    try:
        yield
    finally:
        server.build_server = original
