"""`strata` forks stage processes while gRPC channels are open (`strata serve` restarts a dead stage with a
preexec_fn, so Popen forks rather than vforks). With gRPC's fork handlers on, about one such child in a hundred
aborted before exec (grpc/grpc#43055): a stage that never started. Importing strata.cli turns the handlers off."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

STARTS = 600

PROGRAM = textwrap.dedent(
    f"""
    import strata.cli  # first, as the console script does
    import subprocess, threading
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{{port}}"))
    busy = threading.Event()

    def calls():  # RPCs in flight on another thread while the children start, as in `strata serve`
        while not busy.is_set():
            stub.Check(health_pb2.HealthCheckRequest())

    threading.Thread(target=calls, daemon=True).start()
    failed = 0
    for _ in range({STARTS}):
        child = subprocess.Popen(["true"], start_new_session=True, preexec_fn=lambda: None)
        failed += child.wait(timeout=30) != 0
    busy.set()
    print(failed)
    """
)


def test_children_started_beside_open_channels_all_reach_exec() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    run = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "0", f"{run.stdout.strip()} of {STARTS} children aborted before exec"
