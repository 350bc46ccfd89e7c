"""A fake of the few Hub HTTP endpoints an upload uses (the real Hub is unreachable from tests).

It runs on localhost and is driven by the real huggingface_hub client: repo creation, the model card's metadata check, the preupload check (every
file answered as a regular, non-LFS upload so that contents travel inline) and the commit, whose files it keeps.
"""

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self, refuse_with: int | None = None):
        self.refuse_with = refuse_with  # 401 or 403: how the Hub answers a token it does not accept for writing
        self.validated_cards: list[str] = []
        self.repos: dict[str, dict] = {}  # repo_id -> {"visibility": str, "files": {path: bytes}, "commits": [...]}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status: int, payload: dict):
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if not self.headers.get("authorization", "").startswith("Bearer "):
                    return self._reply(401, {"error": "Invalid credentials"})
                if hub.refuse_with:
                    return self._reply(hub.refuse_with, {"error": "Invalid credentials" if hub.refuse_with == 401
                                                         else "You don't have the rights to create a model"})
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts == ["api", "validate-yaml"]:  # the client checks a README's metadata before committing it
                    hub.validated_cards.append(json.loads(body)["content"])
                    return self._reply(200, {"errors": [], "warnings": []})
                if parts[:3] == ["api", "repos", "create"]:
                    request = json.loads(body)
                    repo_id = f"{request['organization']}/{request['name']}" if request.get("organization") \
                        else request["name"]
                    if repo_id in hub.repos:
                        return self._reply(409, {"error": "You already created this model repo",
                                                 "url": f"{hub.endpoint}/{repo_id}"})
                    hub.repos[repo_id] = {"visibility": request.get("visibility", "public"), "files": {}, "commits": []}
                    return self._reply(200, {"url": f"{hub.endpoint}/{repo_id}"})
                if parts[:2] == ["api", "models"] and parts[4] == "preupload":
                    files = json.loads(body)["files"]
                    return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                        "shouldIgnore": False, "oid": None} for f in files]})
                if parts[:2] == ["api", "models"] and parts[4] == "commit":
                    repo_id = f"{parts[2]}/{parts[3]}"
                    lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                    header = next(entry["value"] for entry in lines if entry["key"] == "header")
                    for entry in lines:
                        if entry["key"] == "file":
                            value = entry["value"]
                            hub.repos[repo_id]["files"][value["path"]] = base64.b64decode(value["content"])
                    hub.repos[repo_id]["commits"].append(header["summary"])
                    return self._reply(200, {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/abc123",
                                             "commitOid": "abc123" + "0" * 34})
                return self._reply(404, {"error": f"fake hub: no route for POST {self.path}"})

        return Handler


def cache_repo(cache_dir, repo_id: str, folder) -> None:
    """Put the files of `folder` into the Hub cache at `cache_dir` as repository `repo_id` at revision main, in the
    layout huggingface_hub downloads into (refs/main naming a snapshot folder): what a model downloaded earlier
    leaves behind."""
    import shutil
    from pathlib import Path

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def unreachable_endpoint() -> str:
    """The address of a port nothing listens on: a Hub that refuses every connection at once."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
