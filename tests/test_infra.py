"""The service scripts under infra/, started for real on free loopback ports."""

import json
import os
import sys
import urllib.request
from pathlib import Path

from tests.servers import free_port, start, stop, wait_http

ROOT = Path(__file__).resolve().parents[1]


def test_prefect_server_script_serves_its_ui_on_any_port(tmp_path):
    """The UI asks /ui-settings for the API URL: it must name the port the server listens on, even with an
    API URL for another server exported in the shell."""
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "RLSIFT_VENV": str(Path(sys.executable).parents[1]),
           "PREFECT_API_URL": "http://127.0.0.1:4200/api"}
    server = start(["bash", str(ROOT / "infra" / "prefect-server.sh"), str(port)], env, tmp_path / "server.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health", server, tmp_path / "server.log")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings", timeout=10) as r:
            settings = json.loads(r.read())
        assert settings["api_url"] == f"http://127.0.0.1:{port}/api"
    finally:
        stop(server)
