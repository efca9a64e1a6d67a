"""A defect hit while serving one request of a KServe ModelStreamInfer stream (in parsing it,
or mid-way through its generation) fails that request alone, with an error_message: the
stream stays open and its other requests finish. The defects are injected into a real
`kiln serve` subprocess through its entry script; clients and server are real."""
from __future__ import annotations

import pytest
from tritonclient.grpc import service_pb2_grpc as kpb_grpc

from tests.model.test_server_hardening import kreq
from tests.server_helpers import ServerProcess

pytestmark = pytest.mark.model

# Request "bad-parse" breaks the parser; "bad-run" breaks the writing of its first response.
FAULTY_KSERVE = """
import sys
from kiln.runtime.server import kserve
parse, response = kserve.KServeService._parse, kserve.response
def faulty_parse(self, request):
    if request.id == "bad-parse":
        raise KeyError("injected defect in parsing")
    return parse(self, request)
def faulty_response(job, *args, **kwargs):
    if job.id == "bad-run":
        raise ZeroDivisionError("injected defect mid-request")
    return response(job, *args, **kwargs)
kserve.KServeService._parse, kserve.response = faulty_parse, faulty_response
from kiln.cli import main
sys.argv = ["kiln", *sys.argv[1:]]
main()
"""


def test_a_defect_in_one_request_leaves_the_stream_and_the_others_running(tiny_plan,
                                                                           tmp_path):
    server = ServerProcess(tiny_plan, "--drain-seconds", "5", log_path=tmp_path / "serve.log",
                           entry=("-c", FAULTY_KSERVE))
    server.wait_serving()
    try:
        reqs = [kreq(f"g{i}", f"good {i}", 6, ignore_eos=True, stream=True) for i in range(4)]
        reqs.insert(1, kreq("bad-parse", "x", 6, stream=True))
        reqs.insert(3, kreq("bad-run", "x", 6, ignore_eos=True, stream=True))
        finals, errors = {}, {}
        with server.channel() as ch:
            for r in kpb_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer(iter(reqs),
                                                                            timeout=120):
                if r.error_message:
                    errors[r.infer_response.id] = r.error_message
                elif r.infer_response.parameters["triton_final_response"].bool_param:
                    finals[r.infer_response.id] = True
        assert sorted(finals) == [f"g{i}" for i in range(4)], (finals, errors)
        assert sorted(errors) == ["bad-parse", "bad-run"], errors
        assert "KeyError" in errors["bad-parse"] and "internal error" in errors["bad-parse"]
        assert "ZeroDivisionError" in errors["bad-run"]
        server.wait_idle()
    finally:
        code = server.terminate()
    assert code == 0, server.log()
    assert "injected defect mid-request" in server.log()     # logged with its traceback
