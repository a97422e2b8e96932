"""A name that no adapter can have (`request.adapter_id`) is answered by the ingress (no Ray): a 404
naming the id and the rule, as for an unknown adapter, and no job reaches a replica, so the name is
never counted as a replica's demand (the controller's hot list, which every replica prefetches from,
holds only names that can exist)."""

from __future__ import annotations

import pytest
from app_client import FakeDispatcher, FakeTokenizer, serving

# (name, how the error message shows it: a path never, odd characters escaped)
INVALID = [("b@d name", "b@d name"), ("../secrets", "../secrets"), ("/etc/passwd", "<path>"),
           ("fin@0", "fin@0"), ("Ñ\x92", "Ñ\\x92"), ("a" * 300, "a" * 40)]


def requests_for(name: str) -> list[tuple[str, dict]]:
    """The same adapter named by each API that takes one: OpenAI completions and chat, LoRAX generate."""
    return [("/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}),
            ("/generate", {"inputs": "hi", "parameters": {"adapter_id": name, "max_new_tokens": 2}})]


@pytest.mark.parametrize(("name", "shown"), INVALID, ids=range(len(INVALID)))
async def test_an_invalid_adapter_id_is_answered_at_the_ingress_and_never_dispatched(name, shown):
    dispatcher = FakeDispatcher()
    async with serving(FakeTokenizer(), dispatcher) as client:
        answers = [(path, await client.post(path, json=body)) for path, body in requests_for(name)]
        valid = await client.post("/v1/completions", json={"model": "a1", "prompt": "hi", "max_tokens": 2})
    for path, answer in answers:
        assert answer.status_code == 404, f"{path}: a name no adapter can have is not found: {answer.text}"
        error = answer.json()["error"]
        assert error["code"] == "adapter_not_found", f"{path}: as an unknown adapter: {error}"
        assert "invalid adapter id" in error["message"], f"{path}: the message says which rule: {error}"
        assert shown in error["message"], f"{path}: the message names the adapter: {error}"
    assert valid.status_code == 200, f"a valid name is still served: {valid.text}"
    assert [job.adapter_id for job in dispatcher.jobs] == ["a1"], (
        "no job for the invalid names reached a replica (so no replica counts them as demand)")
