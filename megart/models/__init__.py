"""Models built from the megart task library: a Llama-style decoder as one megakernel per decode step
(megart.models.llama) and its plain PyTorch reference (megart.models.reference)."""
