"""lora-cluster: serve many LoRA adapters on one shared base model, on Ray Serve."""

__version__ = "0.1.0"
