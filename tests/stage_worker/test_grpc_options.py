"""The gRPC options every hop shares: servers must accept the keepalive pings their clients send.

A server with gRPC's default policy (a ping without data at most every 5 minutes, two strikes) closed the gateway's
idle Forward stream with GOAWAY "too_many_pings" about two minutes after the last request, and the next request
failed. The clients ping every keepalive_time_ms, so the servers' floor must be at most that, with no strike limit.
"""

from __future__ import annotations

from strata.settings import GRPC_OPTIONS

OPTIONS = dict(GRPC_OPTIONS)


def test_servers_accept_a_ping_as_often_as_clients_send_one() -> None:
    assert OPTIONS["grpc.http2.min_recv_ping_interval_without_data_ms"] <= OPTIONS["grpc.keepalive_time_ms"]


def test_servers_never_close_a_connection_for_its_keepalive_pings() -> None:
    assert OPTIONS["grpc.http2.max_ping_strikes"] == 0


def test_clients_ping_idle_connections_so_a_dead_stage_is_noticed() -> None:
    assert OPTIONS["grpc.keepalive_permit_without_calls"] == 1
    assert OPTIONS["grpc.keepalive_time_ms"] + OPTIONS["grpc.keepalive_timeout_ms"] <= 30_000
