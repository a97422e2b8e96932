"""What every API route of the ingress shares: limits, tokenizer, model names, the dispatcher."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from lora_cluster.config import ServeConfig
from lora_cluster.errors import PromptTooLongError, RequestError
from lora_cluster.serve.dispatch import Dispatcher, Generation
from lora_cluster.serve.errors import ApiException, describe
from lora_cluster.serve.model import served_name

_END = object()


@dataclass
class ApiContext:
    config: ServeConfig
    tokenizer: Any
    dispatcher: Dispatcher
    registered: dict[str, str] = field(default_factory=dict)  # vLLM load_lora_adapter: name -> path

    @property
    def base_name(self) -> str:
        return served_name(self.config)

    def adapter_for(self, model: str | None) -> str | None:
        """The adapter id a request's `model` names (None: the base model)."""
        if model is None or model in (self.base_name, self.config.model):
            return None
        return model

    def adapter_path(self, adapter_id: str | None) -> str | None:
        return None if adapter_id is None else self.registered.get(adapter_id)

    def encode(self, prompt: str | list[int], *, special: bool = True) -> list[int]:
        """Prompt token ids (as the engine would tokenize the text), checked against max_prompt_tokens."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=special)
        else:
            ids = list(prompt)
        if not ids:
            raise ApiException(describe(RequestError("the prompt is empty")))
        limit = self.config.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            raise ApiException(describe(PromptTooLongError(len(ids), limit)))
        return ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation rendered with the tokenizer's chat template (+ generation prompt)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiException(describe(RequestError("the base model's tokenizer has no chat template")))
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # a template may reject roles or orders it does not support
            raise ApiException(describe(RequestError(f"cannot apply the chat template: {exc}"))) from exc
        return self.encode(text, special=False)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def is_special(self, token_id: int) -> bool:
        return token_id in self.tokenizer.all_special_ids

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"


async def merge(generations: list[Generation]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """(index, item) of several generations as they arrive; cancels them all when left early."""
    if len(generations) == 1:
        async for item in generations[0].items():
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for item in generation.items():
                await queue.put((index, item))
        except Exception as exc:
            await queue.put((index, exc))
        finally:
            await queue.put((index, _END))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for g in generations:
            g.cancel()


async def finals(generations: list[Generation]) -> list[dict[str, Any]]:
    """Final items of every generation; on an error the others are cancelled and it is raised."""
    try:
        return list(await asyncio.gather(*(g.final() for g in generations)))
    except BaseException:
        for g in generations:
            g.cancel()
        raise
