"""The loopback server's guards: the Host allow-list against DNS rebinding, a case-insensitive
Bearer scheme, HEAD /health, 500s that show an error id (the log has the traceback) and keep the
connection, the API key from a file or the environment, and the no-key exposure warning."""

from __future__ import annotations

import http.client
import json
import logging

import httpx
import pytest

from homelab_llm.errors import HomelabError
from homelab_llm.presets import API_KEY_ENV, Preset, exposure_warning
from homelab_llm.server.command import resolve_api_key
from homelab_llm.server.hosts import allowed_host_names, host_name, is_loopback_host
from tests.server.conftest import fake_server
from tests.server.fake_engine import FakeEngine, FakeTokenizer

USER = [{"role": "user", "content": "hi"}]


def port_of(base_url: str) -> str:
    return base_url.rsplit(":", 1)[1]


def test_loopback_names_and_host_headers() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback_host(host), host
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com"):
        assert not is_loopback_host(host), host
    assert host_name("Example.COM:8000") == "example.com"
    assert host_name("[::1]:8000") == "::1" and host_name("localhost.") == "localhost"
    assert allowed_host_names("0.0.0.0", ()) is None  # a LAN bind accepts any name ...
    assert "box.lan" in allowed_host_names("0.0.0.0", ["box.lan"])  # ... unless told otherwise
    assert allowed_host_names("127.0.0.1", ["*"]) is None


def test_host_allow_list_on_a_loopback_bind(server) -> None:
    port = port_of(server.base_url)
    url = f"{server.base_url}/v1/models"
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost"):
        assert httpx.get(url, headers={"host": host}).status_code == 200, host
    for host in (f"attacker.example:{port}", "attacker.example", "127.0.0.1.nip.io"):
        r = httpx.get(url, headers={"host": host})
        assert r.status_code == 421, host
        assert r.json()["error"]["code"] == "host_not_allowed"
        assert "--allowed-hosts" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                   headers={"host": "attacker.example"})
    assert r.status_code == 421


def test_allowed_hosts_flag() -> None:
    with fake_server(allowed_hosts=("box.lan",)) as running:
        url = f"{running.base_url}/v1/models"
        assert httpx.get(url, headers={"host": "box.lan:80"}).status_code == 200
        assert httpx.get(url, headers={"host": "other.lan"}).status_code == 421
    with fake_server(allowed_hosts=("*",)) as running:
        assert httpx.get(f"{running.base_url}/v1/models",
                         headers={"host": "other.lan"}).status_code == 200


def test_bearer_scheme_is_case_insensitive() -> None:
    with fake_server(api_key="sekret") as running:
        url = f"{running.base_url}/v1/models"
        for header in ("Bearer sekret", "bearer sekret", "BEARER  sekret"):
            assert httpx.get(url, headers={"authorization": header}).status_code == 200, header
        for header in ("Basic sekret", "bearer", "Bearer sekret2", "sekret"):
            assert httpx.get(url, headers={"authorization": header}).status_code == 401, header


def test_head_health(server) -> None:
    r = httpx.head(f"{server.base_url}/health")
    assert r.status_code == 200 and r.content == b""


class BrokenStatusEngine(FakeEngine):
    def status(self):
        raise RuntimeError("secret detail /home/user/models")


def test_500_shows_an_error_id_and_keeps_the_connection(caplog) -> None:
    caplog.set_level(logging.ERROR, logger="homelab_llm.server")
    with fake_server(BrokenStatusEngine) as running:
        host, port = running.base_url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", "/v1/status")
            first = conn.getresponse()
            err = json.loads(first.read())["error"]
            assert first.status == 500 and err["type"] == "server_error"
            assert "secret" not in err["message"] and "RuntimeError" not in err["message"]
            error_id = err["message"].split("id ", 1)[1].split(";", 1)[0]
            assert error_id.startswith("err-")
            sock = conn.sock
            conn.request("GET", "/health")
            second = conn.getresponse()
            assert second.status == 200 and second.read()
            assert conn.sock is sock
        finally:
            conn.close()
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and "secret detail" in logging.Formatter().formatException(logged[0].exc_info)


class BrokenTokenText(FakeTokenizer):
    def token_text(self, token_id: int) -> str:
        raise RuntimeError("secret detail in a stream")


def test_a_bug_mid_stream_sends_an_error_id_event() -> None:
    with fake_server(lambda: FakeEngine(tokenizer=BrokenTokenText())) as running:
        body = {"messages": USER, "max_tokens": 3, "stream": True, "logprobs": True}
        with httpx.stream("POST", f"{running.base_url}/v1/chat/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][6:])["error"]
    assert "err-" in err["message"] and "secret" not in err["message"]


def test_api_key_sources(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(None, None) is None
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert resolve_api_key(None, str(key_file)) == "from-file"
    assert resolve_api_key("flag", None) == "flag"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(None, None) == "from-env"
    assert resolve_api_key(None, str(key_file)) == "from-file"
    with pytest.raises(HomelabError, match="not both"):
        resolve_api_key("flag", str(key_file))
    with pytest.raises(HomelabError, match="--api-key-file"):
        resolve_api_key(None, str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(HomelabError, match="empty"):
        resolve_api_key(None, str(tmp_path / "empty"))


def test_exposure_warning(monkeypatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert exposure_warning("127.0.0.1", False) is None
    assert exposure_warning("0.0.0.0", True) is None
    warning = exposure_warning("0.0.0.0", False)
    assert warning and "0.0.0.0" in warning and API_KEY_ENV in warning
    lan = Preset(name="lan", model="m.gguf", host="0.0.0.0")
    assert lan.exposure_warning() == warning
    assert lan.with_changes(env={API_KEY_ENV: "k"}).exposure_warning() is None
    assert lan.with_changes(backend="vllm").exposure_warning() is None
    assert lan.with_changes(host="127.0.0.1").exposure_warning() is None
