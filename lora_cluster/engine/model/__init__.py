"""The model room: a base model's weights, one step's batch, and the forward pass with sampling.

`model_loader` (find, check and load a checkpoint), `base_model` (the loaded weights, dimensions,
end-of-sequence ids), `family` and `moe_spec` (what each supported family changes, as data),
`memory_plan` (KV blocks and adapter slots sized from the device's free memory), `batch` (a step's
token layout and indices) with `step_buffers` (its index tensors in one copy), `lora_layer` (BGMV/SGMV
choice, fused shrinks), `attention`, `rope`, `moe`, and `runner` (`ModelRunner`: one step's forward pass
for every family, then the sample room's pipeline). The top room: it may import the adapter, schedule
and sample rooms below it.
"""
