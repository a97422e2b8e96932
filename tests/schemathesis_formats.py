"""Values for the `format`s of the API schema that JSON Schema cannot spell, for schemathesis.

`grammar` (a Lark or GBNF grammar: `guided_grammar`, `structured_outputs.grammar`) and `json-schema`
(a JSON schema as JSON text: `guided_json`, `structured_outputs.json`) are this API's names; a
generator that does not know them draws any string, which the server answers 400 naming the field
(its description says what it must be). The schemathesis CLI loads this file through the repository's
`schemathesis.toml` (`hooks`); tests/serve/test_fuzz_api.py imports it. It teaches generation only: no
check is changed and no body is filtered.
"""

from __future__ import annotations

import schemathesis
from hypothesis import strategies as st

GRAMMARS = ('start: "yes" | "no"', "start: /[a-z]{1,8}/")
SCHEMA_TEXTS = ("{}", '{"type": "object"}', '{"type": "integer", "minimum": 0, "maximum": 9}')

schemathesis.openapi.format("grammar", st.sampled_from(GRAMMARS))
schemathesis.openapi.format("json-schema", st.sampled_from(SCHEMA_TEXTS))
