"""One hop of activations between two processes over loopback gRPC, with Strata's channel options. One table.

    python bench/grpc_hop.py

The payload is a ForwardRequest carrying a bf16 hidden state of T tokens x D: a 256-token prefill chunk (the
gateway's default) and a whole 4,096-token prompt, for an 8B (D 4,096) and a 70B (D 8,192) model. The receiver
answers each request with an empty reply on the same Forward stream, as the next stage does. Each figure is the
median of the round trips after two warm-up calls.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import statistics
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import torch
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.settings import GRPC_OPTIONS

PAYLOADS = ((256, 4096), (4096, 4096), (256, 8192), (4096, 8192))  # (tokens, hidden width)
REPEATS = 9


class Receiver(stage_pb2_grpc.StageServicer):  # type: ignore[misc]  # grpc's generated code is untyped
    def Forward(self, requests: Iterator[stage_pb2.ForwardRequest], context: Any) -> Iterator[stage_pb2.ForwardReply]:
        for request in requests:
            yield stage_pb2.ForwardReply(step_id=request.step_id)


def receive(options: list[tuple[str, int]], port: Any, ready: Any) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=options)
    stage_pb2_grpc.add_StageServicer_to_server(Receiver(), server)
    port.value = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ready.set()
    server.wait_for_termination()


def measure(options: list[tuple[str, int]]) -> dict[tuple[int, int], float]:
    context = multiprocessing.get_context("spawn")
    port, ready = context.Value("i", 0), context.Event()
    process = context.Process(target=receive, args=(options, port, ready), daemon=True)
    process.start()
    ready.wait(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{port.value}", options=options)
    stub = stage_pb2_grpc.StageStub(channel)
    figures = {}
    try:
        for tokens, width in PAYLOADS:
            hidden = torch.randn(tokens, width).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
            request = stage_pb2.ForwardRequest(
                step_id=1, hidden=stage_pb2.Tensor(dtype="bfloat16", shape=[tokens, width], data=hidden)
            )
            times = []
            for i in range(2 + REPEATS):
                started = time.perf_counter()
                list(stub.Forward(iter([request])))
                if i >= 2:
                    times.append(time.perf_counter() - started)
            figures[(tokens, width)] = statistics.median(times)
    finally:
        channel.close()
        process.terminate()
    return figures


def main() -> None:
    print(f"machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} cores, grpcio {grpc.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")  # fmt: skip
    figures = measure(GRPC_OPTIONS)
    print("\n| payload | MiB | round trip, ms | MB/s |")
    print("| --- | ---: | ---: | ---: |")
    for (tokens, width), seconds in figures.items():
        mib = tokens * width * 2 / (1 << 20)
        print(f"| {tokens} tokens x {width} | {mib:.0f} | {seconds * 1e3:.1f} | {mib * 1.048576 / seconds:.0f} |")


if __name__ == "__main__":
    main()
