"""The sample room: from a step's logits to each request's next token, and when it stops.

`sampling` (the sampler: greedy, temperature, top-k/top-p, per-request generators), `logit_controls`
(min_tokens, logit_bias, penalties), `logprobs` (token and prompt logprobs of the raw distribution),
`token_mask` (structured output's allowed-token masks), `guided_state` (a request's grammar matcher),
`grammar_compiler` (grammars compiled off the step thread, cached), `detokenizer` (incremental text)
and `stopping` (stop ids, EOS, stop strings, length). The bottom room of the engine: it imports no
other room, and reads a sequence through small protocols (`logit_controls.ControlledRow`,
`token_mask.GuidedRow`, `stopping.StoppingRow`) that `schedule.sequence.Sequence` satisfies.
"""
