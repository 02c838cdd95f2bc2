"""flows/startup.py: Prefect's temporary server started from a thread while the calling thread imports the rest.
The thread must import nothing (two threads importing modules that import each other can stop on Python's module
locks): everything its start imports is imported first, in the calling thread (``SERVER_MODULES``)."""

import json
import os
import subprocess
import sys

from tests.conftest import ROOT

CODE = """
import json
from flows.startup import ServerStart
start = ServerStart()
start.wait()
print(json.dumps(sorted(start.imported)))
"""


def test_the_thread_that_starts_prefects_server_imports_nothing():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # the temporary server, as `rlsift run` starts it
    p = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [], "import these first, in flows/startup.py " \
        "SERVER_MODULES: " + p.stdout[-3000:]
