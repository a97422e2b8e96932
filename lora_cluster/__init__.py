"""lora-cluster: serve many LoRA adapters on one shared base model, on Ray Serve."""

from lora_cluster import compiled

__version__ = "0.1.0"

compiled.install()  # the compiled policy modules, or their sources (`lora_cluster.compiled`)
