"""Two `kiln serve` replicas of the tiny plan behind Debian's nginx (tests/proxy_check.py):
requests reach both through the proxy, and a replica sent SIGTERM under 32 concurrent
streams (KServe gRPC via tritonclient, OpenAI HTTP via the openai SDK) goes NOT_SERVING,
drains and exits 0 without losing a request it accepted."""
from __future__ import annotations

import shutil

import pytest

from tests.proxy_check import run_check

pytestmark = pytest.mark.model


def test_sigterm_behind_nginx_drains_and_loses_no_request(tiny_plan, tmp_path):
    if not (shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")):
        pytest.skip("nginx is not installed (scripts/setup.sh installs it when run as root)")
    report = run_check(tiny_plan, tmp_path, streams=32, max_tokens=32)
    assert report.lost == 0 and report.errors == 0, report.samples
    assert report.requests == report.completed      # each ended once, completed
    assert all(report.replica_requests), report      # the proxy spread them over both
    assert report.not_serving_seen and report.exit_code == 0, report
    assert report.in_flight_at_sigterm > 0, report   # it drained accepted requests
    assert report.completed_after_exit > 0, report   # then the other replica took them all
