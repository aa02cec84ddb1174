"""A stand-in OpenAI server for router tests (run as a preset's command): /health, /v1/models
answering as `--served NAME`, and chat completions that echo the model they were asked for,
plain or streamed. Starts in well under a second."""

from __future__ import annotations

import argparse
import http.server
import json

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--served", default="fake-upstream")
parser.add_argument("--key", default="", help="require 'Authorization: Bearer KEY' on POST")
args = parser.parse_args()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def reply(self, code: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            return self.reply(200, b'{"status": "ok"}')
        if self.path == "/v1/models":
            return self.reply(200, json.dumps({"data": [{"id": args.served}]}).encode())
        self.reply(404, b"{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if args.key and self.headers.get("Authorization") != f"Bearer {args.key}":
            return self.reply(401, json.dumps({"error": {"message": "bad key"}}).encode())
        if body.get("model") != args.served:
            return self.reply(404, json.dumps({"error": {"message": "wrong model"}}).encode())
        text = f"port {args.port} says hi"
        if body.get("stream"):
            chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": args.served,
                     "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
            events = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
            return self.reply(200, events, "text/event-stream")
        answer = {"id": "c1", "object": "chat.completion", "created": 0, "model": args.served,
                  "choices": [{"index": 0, "finish_reason": "stop",
                               "message": {"role": "assistant", "content": text}}],
                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        self.reply(200, json.dumps(answer).encode())

    def log_message(self, *a: object) -> None:
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
