"""Monthly usage budgets of tenants: their spec in the tenants file, and the verdict on a request.

    tenants:
      - name: finance
        budget:
          tokens_per_month: 50000000        # prompt + output tokens, from the 1st of the month (UTC)
          device_seconds_per_month: 36000   # engine time charged to its requests (docs/metering.md)
          action: refuse                    # at 100%: refuse (429 naming the budget) or warn (default)

A budget names at least one limit. Usage is what the usage store holds for the tenant since the
start of the current UTC month (refused requests cost nothing). `BudgetBook` keeps the last such
reading of every tenant and when it was read (`update`); `uses` and `verdict` read only that, never
the store, so a check costs a dictionary lookup. The reading is at most the refresher's period old
(`usage_budget_refresh_s`); a reading from an earlier month counts as zero (the month rolled over).
A tenant at or past `ALERT_RATIO` of a limit is what the alert reports; at or past 100% the verdict
is the budget's action. Pure: the clock is passed in (Unix seconds).
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

ALERT_RATIO = 0.8  # the alert's threshold (deploy/k8s/usage-budgets.yaml), and where a warning starts


class BudgetAction(enum.StrEnum):
    WARN = "warn"  # served, with a warning header and a log line
    REFUSE = "refuse"  # refused: 429 `budget_exceeded` naming the budget


class BudgetSpec(BaseModel):
    """A tenant's monthly budget in the tenants file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens_per_month: int | None = Field(None, ge=1)
    device_seconds_per_month: float | None = Field(None, gt=0)
    action: BudgetAction = BudgetAction.WARN

    @model_validator(mode="after")
    def _names_a_limit(self) -> BudgetSpec:
        if self.tokens_per_month is None and self.device_seconds_per_month is None:
            raise ValueError("a budget needs tokens_per_month or device_seconds_per_month")
        return self

    def limits(self) -> dict[str, float]:
        """The limits it sets, by name."""
        named = {"tokens_per_month": self.tokens_per_month,
                 "device_seconds_per_month": self.device_seconds_per_month}
        return {name: float(limit) for name, limit in named.items() if limit is not None}


@dataclass(frozen=True)
class BudgetUse:
    """One limit of a tenant's budget and what the tenant used of it this month."""

    tenant: str
    budget: str  # tokens_per_month or device_seconds_per_month
    used: float
    limit: float

    @property
    def ratio(self) -> float:
        return self.used / self.limit


def month_start(now: float) -> float:
    """The start of `now`'s UTC month, in Unix seconds."""
    day = datetime.datetime.fromtimestamp(now, datetime.UTC)
    return day.replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()


def next_month_start(now: float) -> float:
    """The start of the UTC month after `now`'s, in Unix seconds (when budgets reset)."""
    start = datetime.datetime.fromtimestamp(month_start(now), datetime.UTC)
    year, month = (start.year + 1, 1) if start.month == 12 else (start.year, start.month + 1)
    return start.replace(year=year, month=month).timestamp()


class BudgetBook:
    """Each tenant's usage this month, as last read from the usage store (see the module docstring)."""

    def __init__(self) -> None:
        self._used: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, device-seconds)
        self.read_at: float | None = None  # Unix seconds of the last reading

    def update(self, rows: Iterable[Mapping[str, object]], read_at: float) -> None:
        """A reading of the store: its per-tenant sums since `month_start(read_at)`, taken at `read_at`."""
        used = {}
        for row in rows:
            tokens = _number(row.get("prompt_tokens")) + _number(row.get("output_tokens"))
            used[str(row["tenant"])] = (tokens, _number(row.get("device_s")))
        self._used, self.read_at = used, read_at

    def uses(self, tenant: str, budget: BudgetSpec, now: float) -> list[BudgetUse]:
        """What `tenant` used of each limit of `budget` this month (0 with no reading of this month)."""
        fresh = self.read_at is not None and self.read_at >= month_start(now)
        tokens, device_s = self._used.get(tenant, (0.0, 0.0)) if fresh else (0.0, 0.0)
        used = {"tokens_per_month": tokens, "device_seconds_per_month": device_s}
        return [BudgetUse(tenant, name, used[name], limit) for name, limit in budget.limits().items()]

    def verdict(self, tenant: str, budget: BudgetSpec, now: float) -> BudgetUse | None:
        """The most used limit at or past 100% (the budget's action applies), else None."""
        over = [use for use in self.uses(tenant, budget, now) if use.ratio >= 1.0]
        return max(over, key=lambda use: use.ratio, default=None)


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


__all__ = ["ALERT_RATIO", "BudgetAction", "BudgetBook", "BudgetSpec", "BudgetUse", "month_start",
           "next_month_start"]
