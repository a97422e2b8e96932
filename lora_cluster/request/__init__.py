"""The request vocabulary: what a caller asks of the engine and what it gets back, without torch.

`SamplingParams` (how to pick tokens, when to stop), `GuidedSpec` (a constraint on the output),
`MergeSpec` (adapters merged per request), adapter ids (`check_adapter_id`), and the engine's answers
(`RequestOutput`, `TokenLogprob`, `FinishReason`). The HTTP layer, the wire protocol and the request
router build and read these; the engine, the store and the simulator use the same classes. Nothing
here imports torch, Ray or transformers (tests/project/test_layering.py checks it), so an ingress process
loads none of them to validate a request.
"""

from __future__ import annotations

from lora_cluster.request.adapter_id import check_adapter_id
from lora_cluster.request.guided_spec import GuidedKind, GuidedSpec
from lora_cluster.request.merge_spec import MergeSpec
from lora_cluster.request.output import FinishReason, RequestOutput, TokenLogprob
from lora_cluster.request.sampling_params import SamplingParams

__all__ = ["FinishReason", "GuidedKind", "GuidedSpec", "MergeSpec", "RequestOutput", "SamplingParams",
           "TokenLogprob", "check_adapter_id"]
