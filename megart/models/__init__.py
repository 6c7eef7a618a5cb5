"""Models built from the megart task library: a Llama-style decoder as one megakernel per decode step
(megart.models.llama), its plain PyTorch reference (megart.models.reference), and Hugging Face Llama / Qwen3
checkpoint folders run on it (`from_pretrained`, megart.models.hf_model)."""
from .hf_config import CheckpointError  # noqa: F401
from .hf_model import CheckpointModel, from_pretrained, from_state_dict  # noqa: F401
