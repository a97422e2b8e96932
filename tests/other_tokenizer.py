"""A second tokenizer for tests of several base models: the demo tokenizer's pieces under other ids and
with another chat template, so the same text encodes to other ids and a conversation renders otherwise."""

from __future__ import annotations

import json
from pathlib import Path

OTHER_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}{{ eos_token }}{% endfor %}"
                  "{% if add_generation_prompt %}[assistant]: {% endif %}")


def write_other_tokenizer(model_dir: Path) -> None:
    """Rewrite the tokenizer of a demo-zoo checkpoint folder (a copy): every non-special token's id
    mirrored within the vocabulary (same size, so the model's embeddings still cover every id; the
    special tokens keep theirs) and OTHER_TEMPLATE as its chat template."""
    tokenizer_file = model_dir / "tokenizer.json"
    data = json.loads(tokenizer_file.read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    special = {t["id"] for t in data["added_tokens"]}
    low, high = max(special) + 1, max(vocab.values())
    data["model"]["vocab"] = {token: i if i in special else low + high - i for token, i in vocab.items()}
    tokenizer_file.write_text(json.dumps(data))
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = OTHER_TEMPLATE
    config_file.write_text(json.dumps(config))
