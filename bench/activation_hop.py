"""One hop of activations to the next stage process: inline over gRPC against through shared memory. One table.

    python bench/activation_hop.py [--widths 4096]

From the sender's tensor on its device to the receiver's tensor on its device, as the stages do it: the sender's
NextStage puts the hidden state into a Forward request (`carry`: into the receiver's shared region, or inline as
protobuf bytes), the receiver takes it out (HopRegion.read, or tensor_from_proto) and answers on the same stream.
Both on GPU 0 when there is one, else on the CPU; bf16 [T, D] hidden states for a 512-position piece and a whole
4,096-token prompt. Each figure is the median of REPEATS hops after two warm-up hops.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import torch
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.stage_worker.next_stage import CHANNEL_OPTIONS, NextStage
from strata.stage_worker.shared_hop import HopRegion
from strata.stage_worker.wire import tensor_from_proto

TOKENS = (512, 4096)
REPEATS = 9


class Receiver(stage_pb2_grpc.StageServicer):  # type: ignore[misc]  # grpc's generated code is untyped
    def __init__(self, region: HopRegion | None, device: torch.device) -> None:
        self.region, self.device = region, device

    def GetLoadStatus(self, request: stage_pb2.LoadStatusRequest, context: Any) -> stage_pb2.LoadStatus:
        return stage_pb2.LoadStatus(hop_region=self.region.advert() if self.region else None)

    def Forward(self, requests: Iterator[stage_pb2.ForwardRequest], context: Any) -> Iterator[stage_pb2.ForwardReply]:
        for request in requests:
            self.take(request)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            yield stage_pb2.ForwardReply(step_id=request.step_id)

    def take(self, request: stage_pb2.ForwardRequest) -> torch.Tensor:
        """The request's hidden state on this side's device, as a stage takes it."""
        if request.WhichOneof("activations") == "hidden":
            return tensor_from_proto(request.hidden).to(self.device)
        assert self.region is not None, "the sender uses a region only where one is advertised"
        return self.region.read(request.shared_hidden, device=self.device)


def receive(shared: bool, slot_bytes: int, device: str, port: Any, ready: Any) -> None:
    region = HopRegion(slots=1, slot_bytes=slot_bytes) if shared else None  # one hop at a time
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    stage_pb2_grpc.add_StageServicer_to_server(Receiver(region, torch.device(device)), server)
    port.value = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ready.set()
    server.wait_for_termination()


def hop_ms(*, shared: bool, width: int, device: torch.device) -> dict[int, float]:
    context = multiprocessing.get_context("spawn")
    port, ready = context.Value("i", 0), context.Event()
    slot_bytes = max(TOKENS) * width * 2
    process = context.Process(target=receive, args=(shared, slot_bytes, str(device), port, ready), daemon=True)
    process.start()
    ready.wait(60)
    link = NextStage(f"127.0.0.1:{port.value}", step_timeout_s=60)
    stream = link.open_stream()
    figures = {}
    try:
        for tokens in TOKENS:
            hidden = torch.randn(tokens, width, device=device).to(torch.bfloat16)
            times = []
            for _ in range(REPEATS + 2):
                started = time.perf_counter()
                request = stage_pb2.ForwardRequest(step_id=1)
                stream.receive(stream.send(request, link.carry(request, hidden)))
                times.append(time.perf_counter() - started)
            assert (request.WhichOneof("activations") == "shared_hidden") == shared, "the hop took the other way"
            figures[tokens] = statistics.median(times[2:]) * 1e3
    finally:
        stream.close()
        link.close()
        process.terminate()
        process.join(10)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="4096")
    args = parser.parse_args()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"one hop, {name} to {name}, bf16, median of {REPEATS}, ms\n")
    print("| hidden state | inline (gRPC bytes) | shared memory |")
    print("| --- | ---: | ---: |")
    for width in (int(w) for w in args.widths.split(",")):
        inline = hop_ms(shared=False, width=width, device=device)
        shared = hop_ms(shared=True, width=width, device=device)
        for tokens in TOKENS:
            mib = tokens * width * 2 / (1 << 20)
            print(f"| {tokens} x {width} ({mib:.0f} MiB) | {inline[tokens]:.1f} | {shared[tokens]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
