"""Prometheus metrics on /metrics, read from the session manager when scraped, with the
process's own (memory, CPU, descriptors) and the C heap's.

Nothing is counted twice: the collector reads the same counters GetInfo reports. It runs on
the metrics server's thread, so it reads the last snapshot the manager published (an
immutable value), never the manager's live state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvkeepd.heap import heap_usage
from kvkeepd.sessions.flows.responses import SOURCES as RESUME_SOURCES
from kvkeepd.sessions.manager import SessionManager


class ManagerCollector:
    """A custom collector over a SessionManager's counters."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Any]:
        c = self.manager.counters
        yield GaugeMetricFamily("kvkeep_slots", "Engine slots.", value=self.manager.settings.slots)
        yield GaugeMetricFamily("kvkeep_slots_in_use", "Slots holding a session.", value=c.slots_in_use)
        sessions = GaugeMetricFamily("kvkeep_sessions", "Open sessions by tier.", labels=["tier"])
        for tier, n in (("hot", c.hot), ("warm", c.warm), ("cold", c.cold)):
            sessions.add_metric([tier], n)
        yield sessions
        yield GaugeMetricFamily("kvkeep_parked_bytes", "Bytes of KV parked in RAM.", value=c.parked_bytes)
        yield GaugeMetricFamily(
            "kvkeep_whole_state_bytes",
            "Bytes of ephemeral checkpoints' whole states kept in the RAM cache's free room.",
            value=c.whole_bytes,
        )
        yield CounterMetricFamily(
            "kvkeep_whole_state_loads",
            "Restores and forks that loaded a checkpoint's kept whole state, not its blocks.",
            value=c.whole_hits,
        )
        yield GaugeMetricFamily(
            "kvkeep_store_bytes",
            "Bytes of blocks in the durable store.",
            value=c.store_bytes,
        )
        yield GaugeMetricFamily(
            "kvkeep_catalog_reachable",
            "Whether the catalog answered its last request (1) or not (0); sqlite: always 1.",
            value=1 if self.manager.catalog_reachable else 0,
        )
        t = c.tally
        yield CounterMetricFamily("kvkeep_swap_ins", "Sessions loaded into a slot.", value=t.swap_ins)
        yield CounterMetricFamily(
            "kvkeep_swap_in_seconds", "Time spent loading sessions into slots.", value=t.swap_in_seconds
        )
        yield CounterMetricFamily(
            "kvkeep_journal_records",
            "Persistent turns made durable in the turn journal.",
            value=c.journal_records,
        )
        yield CounterMetricFamily(
            "kvkeep_journal_syncs",
            "fdatasync calls of the turn journal, or its round trips to a shared catalog's server "
            "(shared by turns that end together).",
            value=c.journal_syncs,
        )
        resumes = CounterMetricFamily(
            "kvkeep_response_resumes",
            "Stored responses continued (previous_response_id), by where their state came from: the "
            "session kept in place (slot, dock, ram, disk), the response's whole state kept in RAM "
            "(ram), its blocks (disk, shared), or nowhere (evaluated).",
            labels=["source"],
        )
        counted = dict(c.response_resumes)
        for source in RESUME_SOURCES:
            resumes.add_metric([source], counted.get(source, 0))
        yield resumes
        tokens = CounterMetricFamily("kvkeep_tokens", "Tokens by what happened to them.", labels=["kind"])
        for kind, n in (
            ("evaluated", t.tokens_evaluated),
            ("generated", t.tokens_generated),
            ("reused", t.tokens_reused),
        ):
            tokens.add_metric([kind], n)
        yield tokens
        heap = heap_usage()
        if heap is not None:
            # Beside process_resident_memory_bytes: growth "in_use" is a leak, growth "free"
            # is memory glibc keeps for reuse (heap.keep_freed_memory).
            family = GaugeMetricFamily("kvkeep_heap_bytes", "The C heap (glibc) by state.", labels=["state"])
            family.add_metric(["in_use"], heap.in_use)
            family.add_metric(["free"], heap.free)
            yield family


def serve_metrics(address: str, manager: SessionManager) -> Any:
    """Serve /metrics over HTTP on host:port (port 0: any free one), in a thread of its own.
    Returns the server: `.server_port` is its port, `.shutdown()` stops it."""
    host, _, port = address.rpartition(":")
    registry = CollectorRegistry(auto_describe=True)
    registry.register(ManagerCollector(manager))
    ProcessCollector(registry=registry)  # resident memory, CPU time, open descriptors
    server, _thread = start_http_server(int(port), addr=host or "127.0.0.1", registry=registry)
    return server
