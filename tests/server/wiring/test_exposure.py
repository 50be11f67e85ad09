"""`polyserve serve` refuses a non-loopback address with no key (the Docker image serves 0.0.0.0)
unless POLYSERVE_ALLOW_UNAUTHENTICATED=1, and says why, before anything is loaded."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from server.wiring.exposure import exposure_error, is_loopback
from server.wiring.serve_cli import serve
from server.wiring.settings import Settings


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.8.0.1", True), ("::1", True),
                                           ("[::1]", True), ("localhost", True), ("0.0.0.0", False), ("::", False),
                                           ("10.0.0.5", False), ("example.com", False)])
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


def test_keyless_non_loopback_is_refused_unless_allowed():
    assert "POLYSERVE_ALLOW_UNAUTHENTICATED" in exposure_error("0.0.0.0", Settings(api_keys=[]))
    assert exposure_error("127.0.0.1", Settings(api_keys=[])) is None
    assert exposure_error("0.0.0.0", Settings(api_keys=["k"])) is None
    assert exposure_error("0.0.0.0", Settings(admin_keys=["k"])) is None
    assert exposure_error("0.0.0.0", Settings(allow_unauthenticated=True)) is None


def test_the_serve_command_stops_before_loading_anything(monkeypatch):
    for name in ("POLYSERVE_API_KEYS", "POLYSERVE_ADMIN_KEYS", "POLYSERVE_ALLOW_UNAUTHENTICATED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("server.api.app.create_app", lambda *a, **k: pytest.fail("the app was built"))
    result = CliRunner().invoke(serve, ["--host", "0.0.0.0", "--port", "1"])
    assert result.exit_code == 2 and "refusing to serve 0.0.0.0 with no API key" in result.output
