"""Prometheus metrics at /metrics on every role, read at scrape time from the counts each role
already keeps (the trainer's TrainerStatus, a client's transfer stats): nothing is counted twice."""

from __future__ import annotations

from typing import Callable, Iterable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sparrowrl.transport.http import ServingTLS, listen


class _Read(Collector):
    """A collector whose metrics `read()` makes at each scrape."""

    def __init__(self, read: Callable[[], Iterable[Metric]]):
        self.read = read

    def collect(self) -> Iterable[Metric]:
        return self.read()


def add_metrics(
    app: web.Application,
    read: Callable[[], Iterable[Metric]],
    open_at: tuple[str, int] | None = None,
    served: ServingTLS | None = None,
) -> None:
    """GET /metrics: what `read()` yields, in Prometheus' text format, behind the app's token.
    `open_at` (host, port): also there without the token, for a scraper that has none, on a
    port of its own that serves nothing else (HTTPS with `served`, as the role's own port)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Read(read))

    async def metrics(_request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    app.add_routes([web.get("/metrics", metrics)])
    if open_at is None:
        return

    async def open_port(_app: web.Application):
        scrape = web.Application()
        scrape.add_routes([web.get("/metrics", metrics)])
        runner = web.AppRunner(scrape, access_log=None)
        await runner.setup()
        try:
            await listen(runner, *open_at, served)
        except BaseException:
            await runner.cleanup()
            raise
        yield
        await runner.cleanup()

    app.cleanup_ctx.append(open_port)


def family(
    kind: str, name: str, doc: str, value: float | None = None, by: tuple[str | tuple[str, ...], dict] | None = None
) -> Metric:
    """A `counter` (exposed as sparrowrl_NAME_total) or `gauge` family: one value, or one per
    label value, `by` = (label, {label value: value}); with several labels, (labels, {values: value})."""
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    if by is None:
        return cls(f"sparrowrl_{name}", doc, value=value)
    labels, values = by
    names = [labels] if isinstance(labels, str) else list(labels)
    m = cls(f"sparrowrl_{name}", doc, labels=names)
    for key, v in values.items():
        m.add_metric([str(k) for k in (key if isinstance(key, tuple) else (key,))], v)
    return m
