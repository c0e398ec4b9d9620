"""Training FLOPs of a model, and the MFU that samples/s implies."""

import torch

# Dense bf16 peak (no sparsity) per device; extend it for your hardware or pass --peak_tflops.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def transformer_train_flops(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """6 N FLOPs per token for the matmuls plus 12 L h T for attention (PaLM appendix B), times T
    tokens."""
    return seq_len * (6 * num_params + 12 * num_layers * hidden_size * seq_len)


def peak_flops(peak_tflops: float | None = None) -> float | None:
    """Per-device peak FLOP/s: the given value, a known GPU's bf16 peak, or None (MFU not
    reported)."""
    if peak_tflops:
        return peak_tflops * 1e12
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, tflops in PEAK_BF16_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None
