"""Whether the Hugging Face Hub can be asked, found out in seconds.

Without a network, huggingface_hub retries each file request for about a minute before it fails or falls back to its
cache, and loading one model asks for several files. One short request answers first: a repository already in the
cache then loads in offline mode, and anything else fails at once, in one line.
"""

import logging
import os
import threading
import time

from .errors import UserError

# Seconds to wait for any answer from the Hub; a reachable Hub answers in well under one.
REACHABILITY_TIMEOUT = 3.0
# Seconds an answer is reused: a command resolves its models several times, and a long-lived process (a notebook, a
# server) asks again later, when the network may be back.
REACHABILITY_MEMORY = 60.0
# (endpoint, timeout) -> (time.monotonic() when asked, the failure or None)
_answers: dict[tuple[str, float], tuple[float, str | None]] = {}

logger = logging.getLogger(__name__)


class HubUnreachableError(UserError, ConnectionError):
    """The Hub cannot be asked (no network, or offline mode); the message (one line) says what to do."""


def hub_endpoint() -> str:
    """The Hub's address: https://huggingface.co, or HF_ENDPOINT."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def offline_mode() -> bool:
    """True under HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE): huggingface_hub refuses every request."""
    from huggingface_hub import constants

    return constants.is_offline_mode()


def hub_unavailable_reason(endpoint: str | None = None, timeout: float = REACHABILITY_TIMEOUT) -> str | None:
    """Why the Hub at `endpoint` (default: `hub_endpoint()`) cannot be asked, as a clause for a one-line message;
    None when it answers within `timeout` seconds."""
    if offline_mode():
        return "offline mode is on (HF_HUB_OFFLINE), so the Hub is not asked"
    endpoint = (endpoint or hub_endpoint()).rstrip("/")
    failure = _request_failure(endpoint, timeout)
    return f"the Hugging Face Hub ({endpoint}) is not reachable ({failure})" if failure else None


def _request_failure(endpoint: str, timeout: float) -> str | None:
    """What went wrong asking `endpoint` for anything, or None when it answered (whatever the answer); an answer of
    the last `REACHABILITY_MEMORY` seconds is reused."""
    asked = _answers.get((endpoint, timeout))
    if asked is not None and time.monotonic() - asked[0] < REACHABILITY_MEMORY:
        return asked[1]
    failure = _ask(endpoint, timeout)
    _answers[(endpoint, timeout)] = (time.monotonic(), failure)
    return failure


def _ask(endpoint: str, timeout: float) -> str | None:
    from huggingface_hub import get_session

    outcome = []  # the failure, or None for an answer

    def ask():
        try:
            # huggingface_hub's own client: the proxy and certificate settings it would download with.
            get_session().head(endpoint, timeout=timeout, follow_redirects=False)
        except Exception as error:
            outcome.append(" ".join(f"{type(error).__name__}: {error}".split()))
        else:
            outcome.append(None)

    # In a thread joined with a deadline: resolving the host name has no timeout of its own.
    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout + 1)
    return outcome[0] if outcome else f"no answer within {timeout:.0f} s"


def use_cache_only(reason: str, repo_id: str) -> None:
    """Offline mode for the rest of this process, and its child processes: `repo_id` is in the cache but the Hub
    cannot be asked, and each file lookup would otherwise retry for a minute before it fell back to the cache."""
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        logger.warning("%s: loading %s from the local cache, offline.", reason[:1].upper() + reason[1:], repo_id)
    constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"


def is_cached(repo_id: str, revision: str | None = None) -> bool:
    """True when the Hub cache holds `repo_id`'s config.json (at `revision`, default main): a model that can load
    without the Hub."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str)


def hub_fix() -> str:
    """What to do when `hub_unavailable_reason` gives a reason, as a clause for a one-line message."""
    if offline_mode():
        return "unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) to let it be asked"
    return "check the network connection (or HF_ENDPOINT and the proxy settings)"
