"""Ray Serve application of lora-cluster (see docs/serving.md; every module: docs/layout.md).

`serve.app.build_app` builds it. Four rooms over shared modules, each import pointing down
(tests/project/test_layering.py): `serve.http` (the ingress: `http.ingress`, the OpenAI, LoRAX and vLLM
routes, `http.context`, the request bodies and the schema's limits), `serve.routing` (ingress to
replica: `routing.dispatch`, `routing.request_router` scoring with `cluster.routing_score`,
`routing.admission`, `routing.auth`, `routing.quotas`), `serve.replica` (`replica.deployment`, the
engine deployment; `replica.model`, the demo zoo and tokenizers; `replica.reporter`), and `serve.ops`
(`ops.metrics`, `ops.logs`, `ops.ray_internals`, the private Ray names we rely on); shared:
`serve.protocol` (what ingress and replicas exchange), `serve.http_errors` (exception to HTTP status),
`serve.batch_window` and `serve.controller_actor` (the cluster controller's deployment). This package
imports nothing at import time, so the pure modules load without Ray.
"""
