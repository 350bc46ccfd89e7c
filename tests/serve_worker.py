"""transformers' server on a DiffLlama folder as the serving tests need it beside `diff-llama serve` itself: without
the request guard (what transformers' server alone answers), or with the guard behind a slow network.

    python tests/serve_worker.py FOLDER PORT [--guard-timeout SECONDS] [--slow-network]

transformers serve (5.25 and later) spawns the model's process, which runs this file again as its main module: the
`__main__` guard keeps it from starting a second server there.
"""

import argparse
import asyncio
import contextlib


def slow_network(delay: float = 0.05):
    """Every message of the guard's answers waits `delay` before it is sent: a client on a slow network, where the
    response is usually waiting to send a chunk when the time is up."""
    from diff_llama.request_guard import RequestGuard

    guard = RequestGuard.__call__

    async def call_slowly(self, scope, receive, send):
        async def send_slowly(message):
            await asyncio.sleep(delay)
            await send(message)

        await guard(self, scope, receive, send_slowly)

    RequestGuard.__call__ = call_slowly


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("port", type=int)
    parser.add_argument("--guard-timeout", type=float, help="put the request guard in front, with this timeout")
    parser.add_argument("--slow-network", action="store_true")
    args = parser.parse_args()

    from transformers.cli.serve import Serve

    from diff_llama.request_guard import guarded_server
    from diff_llama.serving import diff_llama_model_loading

    if args.slow_network:
        slow_network()
    guard = guarded_server(args.guard_timeout) if args.guard_timeout is not None else contextlib.nullcontext()
    with diff_llama_model_loading(), guard:
        Serve(force_model=args.folder, host="127.0.0.1", port=args.port, device="cpu")


if __name__ == "__main__":
    main()
