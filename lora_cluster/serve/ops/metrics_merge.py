"""The sum of several ingress replicas' request metrics, as one scrape shows them (pure: no Ray).

Each ingress sends a `Snapshot` of its own request metrics (cumulative counters and histograms,
gauges; every label set) under its ingress id; `MetricsBook` keeps the latest one per ingress and
`merged()` answers their sum: counters and histogram samples (each bucket, `_count`, `_sum`) summed
sample by sample, gauges summed over the ingresses heard within `ingress_ttl_s`.

Invariants:
* Counters and histograms never go backwards, and what an ingress counted stays counted. Each
  sample has a retained offset, to which an ingress's last value of the sample is added when the
  ingress is gone for good, when it drops the series (a demoted adapter's) and when the series
  went down (a counter that restarted); the sum answered is the offset plus the ingresses' values.
  As a last guard the book remembers the value it last answered for each sample and never answers
  less (a difference goes into the offset). A sample that no ingress
  reports any more is answered (at its last value) for `retain_s`, then dropped (a dropped series is
  a series that ended, which Prometheus handles; a series going down would read as a reset).
* An ingress not heard for `ingress_ttl_s` is gone for good: its snapshot is dropped (its counts
  stay in the offsets). Should it report again, what it had counted is taken out of the offsets
  first, so it is not counted twice (the last `max_ingresses` departures are remembered).
* Bounded: at most `max_ingresses` snapshots (the least recently heard goes beyond), and at most
  `max_adapter_labels` / `max_tenant_labels` distinct `adapter` / `tenant` label values in the sum
  (each ingress already keeps its busiest ones, `metrics_max_*_labels`; ingresses may differ at the
  edge, so the union is larger): a value admitted stays while some ingress reports it (and
  `retain_s` after), a value beyond the bound is summed into "other".
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from lora_cluster.serve.ops.top_labels import OTHER

Labels = tuple[tuple[str, str], ...]  # label (name, value) pairs, in the metric's label order
Sample = tuple[str, Labels, float]  # sample name, labels, value
Family = tuple[str, str, str, list[Sample]]  # family name, type, help, samples
Snapshot = list[Family]
Key = tuple[str, str, Labels]  # family, sample name, labels

KEEP_LABELS = ("_base", "_none")  # base-model adapter and no-tenant labels: never capped
MAX_INGRESSES = 64


class MetricsBook:
    """The latest snapshot of each ingress and their monotonic sum (module docstring)."""

    def __init__(self, *, max_adapter_labels: int = 100, max_tenant_labels: int = 100,
                 max_ingresses: int = MAX_INGRESSES, ingress_ttl_s: float = 60.0, retain_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        if max_ingresses < 1:
            raise ValueError(f"max_ingresses must be at least 1, got {max_ingresses}")
        self.max_ingresses, self.ingress_ttl_s, self.retain_s = max_ingresses, ingress_ttl_s, retain_s
        self._clock = clock
        self._caps = {"adapter": max(0, max_adapter_labels), "tenant": max(0, max_tenant_labels)}
        self._admitted: dict[str, dict[str, float]] = {"adapter": {}, "tenant": {}}  # value -> last seen
        self._ingresses: OrderedDict[str, tuple[float, Snapshot]] = OrderedDict()  # by last heard
        self._departed: OrderedDict[str, dict[Key, float]] = OrderedDict()  # id -> what it counted
        self._families: dict[str, tuple[str, str]] = {}  # name -> (type, help)
        self._answered: dict[Key, float] = {}  # counters and histograms: the value last answered
        self._offset: dict[Key, float] = {}
        self._seen: dict[Key, float] = {}  # when some ingress last reported the sample

    def ingresses(self) -> int:
        """Ingresses whose snapshot is summed now."""
        self._expire(self._clock())
        return len(self._ingresses)

    def update(self, ingress: str, snapshot: Snapshot) -> None:
        """`ingress`'s cumulative request metrics, as of now."""
        now = self._clock()
        self._expire(now)
        counted = self._departed.pop(ingress, None)
        if counted is not None:  # it came back: what it counted is in its snapshot again
            for key, value in counted.items():
                if key in self._offset:
                    self._offset[key] = max(0.0, self._offset[key] - value)
        previous = self._ingresses.pop(ingress, None)
        if previous is not None:
            self._fold_dropped(previous[1], snapshot, now)
        self._ingresses[ingress] = (now, snapshot)
        while len(self._ingresses) > self.max_ingresses:
            self._depart(next(iter(self._ingresses)))

    def merged(self) -> Snapshot:
        """The sum over the ingresses (module docstring), families in first-reported order."""
        now = self._clock()
        self._expire(now)
        sums: dict[Key, float] = {}
        for _, snapshot in self._ingresses.values():
            for key, kind, value in self._samples(snapshot, now):
                sums[key] = sums.get(key, 0.0) + value
                if kind != "gauge":
                    self._seen[key] = now
        out: dict[Key, float] = {}
        for key, value in sums.items():
            if self._families[key[0]][0] == "gauge":
                out[key] = value
        new = [k for k in sums if k not in self._answered and self._families[k[0]][0] != "gauge"]
        new += [k for k in self._offset if k not in self._answered and k not in sums]
        for key, value in list(self._answered.items()) + [(k, 0.0) for k in new]:
            if now - self._seen.setdefault(key, now) > self.retain_s:
                self._answered.pop(key, None)
                self._offset.pop(key, None)
                self._seen.pop(key, None)
                continue
            total = sums.get(key, 0.0) + self._offset.get(key, 0.0)
            if total < value:
                self._offset[key] = self._offset.get(key, 0.0) + value - total
                total = value
            self._answered[key] = out[key] = total
        for kind in self._admitted.values():
            for label in [v for v, seen in kind.items() if now - seen > self.retain_s]:
                del kind[label]
        return _families(self._families, out)

    def _samples(self, snapshot: Snapshot, now: float) -> Iterable[tuple[Key, str, float]]:
        for name, kind, help_text, samples in snapshot:
            self._families.setdefault(name, (kind, help_text))
            for sample_name, labels, value in samples:
                yield (name, sample_name, self._capped(labels, now)), kind, float(value)

    def _capped(self, labels: Labels, now: float) -> Labels:
        """`labels` with an adapter or tenant value beyond the bound replaced by "other"."""
        out = []
        for name, value in labels:
            admitted = self._admitted.get(name)
            if admitted is not None and value != OTHER and value not in KEEP_LABELS:
                if value in admitted or len(admitted) < self._caps[name]:
                    admitted[value] = now
                else:
                    value = OTHER
            out.append((name, value))
        return tuple(out)

    def _counted(self, snapshot: Snapshot, now: float) -> dict[tuple[str, Labels], dict[Key, float]]:
        """The counter and histogram samples of `snapshot` by series (a histogram's samples together)."""
        out: dict[tuple[str, Labels], dict[Key, float]] = {}
        for key, kind, value in self._samples(snapshot, now):
            if kind != "gauge":
                series = out.setdefault((key[0], tuple(p for p in key[2] if p[0] != "le")), {})
                series[key] = series.get(key, 0.0) + value
        return out

    def _fold_dropped(self, previous: Snapshot, snapshot: Snapshot, now: float) -> None:
        """A series of the ingress's previous snapshot that is gone from `snapshot` (dropped on purpose)
        or went down (restarted): what it had counted becomes that series' offset."""
        new = self._counted(snapshot, now)
        for series, values in self._counted(previous, now).items():
            now_values = new.get(series)
            if now_values is None or any(now_values.get(k, 0.0) < v for k, v in values.items()):
                for key, value in values.items():
                    self._offset[key] = self._offset.get(key, 0.0) + value

    def _expire(self, now: float) -> None:
        for ingress in [i for i, (heard, _) in self._ingresses.items() if now - heard > self.ingress_ttl_s]:
            self._depart(ingress)

    def _depart(self, ingress: str) -> None:
        """Drop `ingress`'s snapshot; what it counted becomes offsets (and is remembered)."""
        _, snapshot = self._ingresses.pop(ingress)
        counted = {key: value for series in self._counted(snapshot, self._clock()).values()
                   for key, value in series.items()}
        for key, value in counted.items():
            self._offset[key] = self._offset.get(key, 0.0) + value
        self._departed[ingress] = counted
        while len(self._departed) > self.max_ingresses:
            self._departed.popitem(last=False)


def _families(kinds: dict[str, tuple[str, str]], values: dict[Key, float]) -> Snapshot:
    """Samples grouped by family, then by label set (a histogram's buckets, count and sum together)."""
    grouped: dict[str, dict[Labels, list[Sample]]] = {}
    for (family, sample_name, labels), value in values.items():
        group = tuple(pair for pair in labels if pair[0] != "le")
        grouped.setdefault(family, {}).setdefault(group, []).append((sample_name, labels, value))
    return [(name, kinds[name][0], kinds[name][1],
             [s for group in grouped[name].values() for s in sorted(group, key=_order)])
            for name in kinds if name in grouped]


def _order(sample: Sample) -> tuple[int, float]:
    """A histogram's samples in exposition order: buckets by bound, then count, then sum."""
    name, labels, _ = sample
    le = dict(labels).get("le")
    rank = 0 if name.endswith("_bucket") else 1 if name.endswith("_count") else 2
    return rank, float(le) if le is not None else 0.0
