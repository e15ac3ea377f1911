"""The server's counters in Prometheus' text format (``GET /metrics``)."""

from __future__ import annotations


def prometheus(served) -> str:
    """The runner's counters in Prometheus' text format."""
    m = served.runner.snapshot()
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP rdepth_{name} {help_text}")
        lines.append(f"# TYPE rdepth_{name} {kind}")
        for labels, value in samples:
            lines.append(f"rdepth_{name}{labels} {value:g}" if isinstance(value, float) else
                         f"rdepth_{name}{labels} {value}")

    metric("requests_total", "counter", "requests finished (choices)", [("", m["requests"])])
    metric("requests_failed_total", "counter", "requests that ended with an error", [("", m["requests_failed"])])
    metric("tokens_generated_total", "counter", "new tokens chosen", [("", m["tokens_generated"])])
    metric("positions_total", "counter", "positions decoded (prompt and fed-back tokens)", [("", m["positions"])])
    metric("ticks_total", "counter", "engine ticks (one batched call per stage each)", [("", m["ticks"])])
    metric("queue_length", "gauge", "requests waiting for a slot", [("", m["queue"])])
    metric("batch_occupancy", "gauge", "slots in use over the batch width, now", [("", m["in_flight"] / m["batch"])])
    metric("batch_occupancy_mean", "gauge", "mean slots in use per tick over the batch width",
           [("", m["occupied_slot_ticks"] / (m["ticks"] * m["batch"]) if m["ticks"] else 0.0)])
    metric("mean_loop_steps", "gauge", "loop steps executed per position, per group",
           [(f'{{group="{g}"}}', s / m["positions"] if m["positions"] else 0.0) for g, s in enumerate(m["loop_steps"])])
    metric("speculation_rounds_total", "counter", "loop-speculation rounds (--speculate)", [("", m["speculation_rounds"])])
    metric("speculation_drafted_total", "counter", "draft tokens made", [("", m["drafted"])])
    metric("speculation_accepted_total", "counter", "draft tokens kept (acceptance: accepted / drafted)",
           [("", m["accepted"])])
    metric("tokens_per_second", "gauge", "new tokens per second since the server started",
           [("", m["tokens_generated"] / m["uptime_s"] if m["uptime_s"] > 0 else 0.0)])
    return "\n".join(lines) + "\n"
