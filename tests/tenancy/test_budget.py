"""Tenants' monthly budgets (`tenancy.budget`): their spec in the tenants file, validated with errors
naming the field; the verdict from a reading of the usage store, per limit, and a new month that
starts from zero."""

from __future__ import annotations

import pytest

from lora_cluster.tenancy.budget import BudgetAction, BudgetBook, BudgetSpec, month_start, next_month_start
from lora_cluster.tenancy.tenants import TenantsFileError, hash_key, parse_tenants

NOV_30 = 1_796_083_200.0 - 86400  # 2026-11-30T00:00:00Z
DEC_1 = 1_796_083_200.0  # 2026-12-01T00:00:00Z


def tenants(budget: str) -> str:
    return f"""
tenants:
  - name: finance
    api_keys: ["{hash_key('sk-fin-0123456789')}"]
    budget: {budget}
"""


def test_a_budget_in_the_tenants_file_is_read_with_its_limits_and_action():
    spec = "{tokens_per_month: 1000, device_seconds_per_month: 3.5, action: refuse}"
    directory = parse_tenants(tenants(spec))
    budget = directory.tenants["finance"].budget
    assert budget is not None, "the tenant has its budget"
    assert budget.limits() == {"tokens_per_month": 1000.0, "device_seconds_per_month": 3.5}, "both limits"
    assert budget.action is BudgetAction.REFUSE, "its action"
    default = parse_tenants(tenants("{tokens_per_month: 10}")).tenants["finance"].budget
    assert default is not None and default.action is BudgetAction.WARN, "the default action is warn"


@pytest.mark.parametrize(("budget", "error"), [
    ("{action: refuse}", "tenants[0].budget: a budget needs tokens_per_month or device_seconds_per_month"),
    ("{tokens_per_month: 0}", "tenants[0].budget.tokens_per_month: Input should be greater than or equal"),
    ("{tokens_per_month: 5, action: block}", "tenants[0].budget.action: Input should be 'warn' or 'refuse'"),
    ("{tokens_per_month: 5, dollars: 3}", "tenants[0].budget.dollars: Extra inputs are not permitted"),
])
def test_a_wrong_budget_is_refused_with_an_error_naming_the_field(budget, error):
    with pytest.raises(TenantsFileError) as caught:
        parse_tenants(tenants(budget))
    assert error in str(caught.value), f"the error names the field and the rule: {caught.value}"


def test_the_months_are_utc_calendar_months():
    assert month_start(DEC_1 + 12 * 86400 + 5) == DEC_1, "a day in December starts on December 1st"
    assert month_start(DEC_1 - 1) == month_start(NOV_30), "a second before is November"
    assert next_month_start(DEC_1 + 86400) == DEC_1 + 31 * 86400, "December has 31 days: January 1st, 2027"


def test_the_verdict_is_the_most_used_limit_at_or_past_100_percent():
    budget = BudgetSpec(tokens_per_month=1000, device_seconds_per_month=2.0, action=BudgetAction.REFUSE)
    book = BudgetBook()
    book.update([{"tenant": "finance", "prompt_tokens": 600, "output_tokens": 200, "device_s": 2.5}],
                read_at=DEC_1 + 3600)
    uses = {u.budget: u.ratio for u in book.uses("finance", budget, DEC_1 + 3700)}
    assert uses == {"tokens_per_month": 0.8, "device_seconds_per_month": 1.25}, \
        f"prompt + output tokens, and device-seconds, against their limits: {uses}"
    verdict = book.verdict("finance", budget, DEC_1 + 3700)
    assert verdict is not None and verdict.budget == "device_seconds_per_month", "the limit used up"
    assert book.verdict("hr", budget, DEC_1 + 3700) is None, "a tenant with no usage is within its budget"


def test_a_reading_of_last_month_counts_as_zero_in_a_new_month():
    budget = BudgetSpec(tokens_per_month=10)
    book = BudgetBook()
    book.update([{"tenant": "finance", "prompt_tokens": 50, "output_tokens": 0, "device_s": 0.0}],
                read_at=NOV_30)
    assert book.verdict("finance", budget, NOV_30 + 60) is not None, "used up in November"
    assert book.verdict("finance", budget, DEC_1 + 60) is None, "December starts from zero before its reading"
