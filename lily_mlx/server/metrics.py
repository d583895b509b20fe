"""Prometheus metrics of one server process (a private registry, so tests can run several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("lily_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("lily_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_tokens = Counter("lily_prompt_cached_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.completion_tokens = Counter("lily_completion_tokens", "Tokens generated", registry=r)
        self.cache_lookups = Counter("lily_prefix_cache_lookups", "Prefix cache lookups by result", ["result"], registry=r)
        self.cache_bytes = Gauge("lily_prefix_cache_bytes", "Bytes held by the prefix cache", registry=r)
        self.cache_entries = Gauge("lily_prefix_cache_entries", "Snapshots held by the prefix cache", registry=r)
        self.queue_depth = Gauge("lily_queue_depth", "Requests waiting to start prefill", registry=r)
        self.running = Gauge("lily_running_sequences", "Sequences in the decode batch", registry=r)
        self.decode_steps = Counter("lily_decode_steps", "Batched decode steps", registry=r)
        self.latency = Histogram("lily_request_latency_seconds", "Request latency, end to end", ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("lily_time_to_first_token_seconds", "Time from admission to the first token", buckets=LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
