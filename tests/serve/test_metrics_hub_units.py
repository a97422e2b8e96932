"""Several ingress replicas' request metrics as one /metrics (`serve.ops.metrics_merge`, the pure sum;
`serve.ops.metrics_hub.SharedMetrics`, the ingress's side; `metrics_exposition.render` of a sum): counters and
histograms summed, never going backwards when an ingress leaves or drops a series, bounded, and a hub
that does not answer never fails a scrape."""

from __future__ import annotations

import asyncio
from typing import Any

from helpers import FakeClock
from prometheus_client.parser import text_string_to_metric_families

from lora_cluster.serve.ops import metrics, metrics_exposition
from lora_cluster.serve.ops.metrics_hub import MetricsHub, SharedMetrics
from lora_cluster.serve.ops.metrics_merge import MetricsBook, Snapshot
from lora_cluster.serve.ops.top_labels import OTHER


def _counter(value: float, route: str = "/v1/completions", status: str = "200") -> tuple:
    return ("lora_cluster_requests", "counter", "HTTP requests.",
            [("lora_cluster_requests_total", (("route", route), ("status", status)), value)])


def _generations(values: dict[str, float]) -> tuple:
    return ("lora_cluster_generations", "counter", "Generations.",
            [("lora_cluster_generations_total", (("adapter", a), ("tenant", "_none")), v)
             for a, v in values.items()])


def _histogram(counts: tuple[float, float], total: float, seconds: float) -> tuple:
    """A histogram of buckets le=0.1 and +Inf: counts per bucket as cumulative samples."""
    labels = (("route", "/v1/completions"),)
    return ("lora_cluster_request_duration_seconds", "histogram", "Latency.", [
        ("lora_cluster_request_duration_seconds_bucket", (*labels, ("le", "0.1")), counts[0]),
        ("lora_cluster_request_duration_seconds_bucket", (*labels, ("le", "+Inf")), counts[1]),
        ("lora_cluster_request_duration_seconds_count", labels, total),
        ("lora_cluster_request_duration_seconds_sum", labels, seconds)])


def _gauge(value: float) -> tuple:
    return ("lora_cluster_queue_depth", "gauge", "Waiting.",
            [("lora_cluster_queue_depth", (("priority_class", "standard"),), value)])


def _values(snapshot: Snapshot) -> dict[tuple[str, tuple], float]:
    return {(name, labels): value for _, _, _, samples in snapshot for name, labels, value in samples}


def _requests(snapshot: Snapshot) -> float:
    return sum(v for (name, _), v in _values(snapshot).items() if name == "lora_cluster_requests_total")


def test_counters_are_summed_over_the_ingresses():
    book = MetricsBook(clock=FakeClock())
    book.update("a", [_counter(3)])
    book.update("b", [_counter(4)])
    book.update("c", [_counter(5, status="500")])
    values = _values(book.merged())
    ok = ("lora_cluster_requests_total", (("route", "/v1/completions"), ("status", "200")))
    failed = ("lora_cluster_requests_total", (("route", "/v1/completions"), ("status", "500")))
    assert values[ok] == 7, f"the 200s of both ingresses are summed: {values}"
    assert values[failed] == 5, f"a label set one ingress has is kept as it is: {values}"
    assert book.ingresses() == 3, "three ingresses are summed"


def test_histograms_are_summed_bucket_by_bucket_in_exposition_order():
    book = MetricsBook(clock=FakeClock())
    book.update("a", [_histogram((1, 3), 3, 0.5)])
    book.update("b", [_histogram((2, 2), 2, 0.1)])
    [(_, kind, _, samples)] = book.merged()
    assert kind == "histogram", "the family keeps its type"
    assert [(n.rsplit("_", 1)[1], dict(lbl).get("le"), v) for n, lbl, v in samples] == [
        ("bucket", "0.1", 3), ("bucket", "+Inf", 5), ("count", None, 5), ("sum", None, 0.6)], (
        f"each bucket, the count and the sum are summed, buckets by bound then count and sum: {samples}")


def test_an_ingress_gone_for_good_stays_counted_and_counters_never_go_backwards():
    clock = FakeClock()
    book = MetricsBook(ingress_ttl_s=30.0, retain_s=300.0, clock=clock)
    book.update("a", [_counter(10)])
    book.update("b", [_counter(6)])
    assert _requests(book.merged()) == 16, "both counted"
    clock.advance(20)
    book.update("b", [_counter(8)])
    clock.advance(20)  # a: not heard for 40 s > 30 s: gone
    book.update("b", [_counter(9)])
    assert book.ingresses() == 1, "the silent ingress is no longer summed"
    assert _requests(book.merged()) == 19, "its last 10 requests stay counted, plus b's 9"
    book.update("b", [_counter(12)])
    assert _requests(book.merged()) == 22, "b's new requests add on top"


def test_an_ingress_that_comes_back_is_not_counted_twice():
    clock = FakeClock()
    book = MetricsBook(ingress_ttl_s=30.0, clock=clock)
    book.update("a", [_counter(10)])
    book.update("b", [_counter(5)])
    book.merged()
    clock.advance(40)
    book.update("b", [_counter(5)])
    assert _requests(book.merged()) == 15, "a's counts kept after it went silent"
    book.update("a", [_counter(11)])
    assert _requests(book.merged()) == 16, "a reports again with its cumulative 11: counted once"


def test_a_series_an_ingress_drops_or_restarts_does_not_go_backwards():
    book = MetricsBook(clock=FakeClock())
    book.update("a", [_generations({"x": 4, "y": 1})])
    book.update("b", [_generations({"x": 3})])
    book.merged()
    book.update("a", [_generations({"y": 1, OTHER: 2})])  # a demoted x: its series went away
    values = {dict(lbl)["adapter"]: v for (_, lbl), v in _values(book.merged()).items()}
    assert values["x"] == 7, f"x's sum holds at 7 though ingress a dropped its series: {values}"
    book.update("b", [_generations({"x": 1})])  # b restarted its counter, then counted 1
    values = {dict(lbl)["adapter"]: v for (_, lbl), v in _values(book.merged()).items()}
    assert values["x"] == 8, f"a restarted counter's earlier 3 stay counted, its new 1 adds: {values}"
    book.update("b", [_generations({"x": 5})])
    values = {dict(lbl)["adapter"]: v for (_, lbl), v in _values(book.merged()).items()}
    assert values["x"] == 12, f"then its new counts add on top: {values}"


def test_a_series_dropped_between_two_sums_is_still_counted():
    book = MetricsBook(clock=FakeClock())
    book.update("a", [_generations({"x": 4})])
    book.update("a", [_generations({OTHER: 1})])  # x demoted before any scrape
    values = {dict(lbl)["adapter"]: v for (_, lbl), v in _values(book.merged()).items()}
    assert values == {"x": 4, OTHER: 1}, f"x's 4 are answered though no snapshot shows x now: {values}"


def test_a_sample_no_ingress_reports_is_dropped_after_the_retention():
    clock = FakeClock()
    book = MetricsBook(retain_s=60.0, ingress_ttl_s=1000.0, clock=clock)
    book.update("a", [_generations({"x": 4, "y": 1})])
    book.merged()
    clock.advance(30)
    book.update("a", [_generations({"y": 2})])
    adapters = {dict(lbl)["adapter"] for (_, lbl) in _values(book.merged())}
    assert adapters == {"x", "y"}, "x is still answered at its last value within the retention"
    clock.advance(40)
    book.update("a", [_generations({"y": 3})])
    adapters = {dict(lbl)["adapter"] for (_, lbl) in _values(book.merged())}
    assert adapters == {"y"}, "x, reported by no ingress for longer than the retention, is dropped"


def test_gauges_are_summed_over_the_ingresses_heard_recently():
    clock = FakeClock()
    book = MetricsBook(ingress_ttl_s=30.0, clock=clock)
    book.update("a", [_gauge(2)])
    book.update("b", [_gauge(3)])
    assert list(_values(book.merged()).values()) == [5], "the queue depths of both ingresses"
    clock.advance(40)
    book.update("b", [_gauge(1)])
    assert list(_values(book.merged()).values()) == [1], "a gauge of an ingress gone is not kept"


def test_the_ingresses_are_bounded():
    book = MetricsBook(max_ingresses=3, clock=FakeClock())
    for i in range(10):
        book.update(f"i{i}", [_counter(1)])
    assert book.ingresses() == 3, "at most max_ingresses snapshots are kept"
    assert _requests(book.merged()) == 10, "the ingresses pushed out stay counted"
    book.update("i10", [_counter(1)])
    assert _requests(book.merged()) == 11, "and every new one adds its requests"
    assert book.ingresses() == 3, "still at most max_ingresses snapshots"


def test_adapter_and_tenant_values_of_the_union_are_bounded_the_rest_is_other():
    book = MetricsBook(max_adapter_labels=2, max_tenant_labels=1, clock=FakeClock())
    book.update("a", [_generations({"x": 1, "y": 2, "_base": 4})])
    book.update("b", [_generations({"z": 3, "w": 5, OTHER: 7})])
    values = {dict(lbl)["adapter"]: v for (_, lbl), v in _values(book.merged()).items()}
    assert values == {"x": 1, "y": 2, "_base": 4, OTHER: 15}, (
        f"two adapter values keep their label, z and w are summed into other, _base is never capped: "
        f"{values}")
    book.update("c", [("lora_cluster_slo_requests", "counter", "SLO.", [
        ("lora_cluster_slo_requests_total", (("tenant", t), ("outcome", "met")), 1.0) for t in "pqr"])])
    tenants = {dict(lbl)["tenant"]: v for (name, lbl), v in _values(book.merged()).items()
               if name == "lora_cluster_slo_requests_total"}
    assert tenants == {"p": 1, OTHER: 2}, f"one tenant value keeps its label: {tenants}"


def _scrape(text: bytes) -> dict[str, float]:
    """{sample name: sum over its label sets} of an exposition text."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_render_of_a_sum_is_valid_exposition_with_the_hub_gauges():
    book = MetricsBook(clock=FakeClock())
    metrics_exposition.set_replica_stats_source(lambda: {})  # as the ingress does
    metrics.REQUESTS.labels("/v1/hub-test", "200").inc(2)
    metrics.REQUEST_LATENCY.labels("/v1/hub-test").observe(0.2)
    book.update("a", metrics_exposition.request_snapshot())
    book.update("b", metrics_exposition.request_snapshot())
    own = _scrape(metrics_exposition.render())
    summed = _scrape(metrics_exposition.render(book.merged(), book.ingresses()))
    assert summed["lora_cluster_requests_total"] == 2 * own["lora_cluster_requests_total"], (
        "the rendered sum counts both ingresses' requests")
    assert summed["lora_cluster_request_duration_seconds_count"] == \
        2 * own["lora_cluster_request_duration_seconds_count"], "histograms too"
    assert summed["lora_cluster_metrics_hub_up"] == 1, "the scrape says it is a sum"
    assert summed["lora_cluster_metrics_hub_ingresses"] == 2, "over two ingresses"
    assert "lora_cluster_replicas" in summed, "the replica metrics are rendered too"
    assert "lora_cluster_metrics_hub_up" not in own, "one ingress (no hub): no hub gauges"


class _InProcess:
    """The hub deployment's class called in process, in its handle's `.method.remote(...)` shape; with
    `answers` False, no call is ever answered (a hub that cannot be reached)."""

    def __init__(self, answers: bool = True):
        self.hub, self.answers = MetricsHub.func_or_class(), answers

    def __getattr__(self, method: str) -> Any:
        hub, answers = self.hub, self.answers

        class Call:
            @staticmethod
            def remote(*args: Any) -> Any:
                async def run() -> Any:
                    if not answers:
                        await asyncio.Event().wait()
                    return await getattr(hub, method)(*args)

                return asyncio.ensure_future(run())  # awaitable and cancellable, as a response
        return Call()


async def test_the_ingress_pushes_and_a_scrape_shows_every_ingress():
    handle = _InProcess()
    metrics.REQUESTS.labels("/v1/hub-test", "200").inc()
    await handle.hub.push("other-ingress", metrics_exposition.request_snapshot())
    shared = SharedMetrics(handle, "this-ingress", push_s=0.01, timeout_s=5.0)
    try:
        shared.start()
        for _ in range(500):  # bounded: the push task runs every 10 ms
            if handle.hub.book.ingresses() == 2:
                break
            await asyncio.sleep(0.01)
        assert handle.hub.book.ingresses() == 2, "the ingress pushes its metrics without a scrape"
        scraped = _scrape(await shared.render())
        own = _scrape(metrics_exposition.render())
        assert scraped["lora_cluster_requests_total"] == 2 * own["lora_cluster_requests_total"], (
            "the scrape counts the other ingress's requests too")
        assert scraped["lora_cluster_metrics_hub_up"] == 1, "the scrape says it is the sum"
    finally:
        shared.stop()


async def test_an_unreachable_hub_never_fails_a_scrape():
    shared = SharedMetrics(_InProcess(answers=False), "this-ingress", push_s=60.0, timeout_s=0.05)
    try:
        scraped = _scrape(await shared.render())
    finally:
        shared.stop()
    own = _scrape(metrics_exposition.render())
    assert scraped["lora_cluster_metrics_hub_up"] == 0, "the scrape says the sum could not be had"
    assert scraped["lora_cluster_metrics_hub_ingresses"] == 1, "only this ingress is counted"
    assert scraped["lora_cluster_requests_total"] == own["lora_cluster_requests_total"], (
        "its own request metrics are answered")
