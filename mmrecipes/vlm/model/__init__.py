"""The model: loading and composing, module groups and freezing, LoRA, mixtures of experts, the step
(`step.VLMForTraining`) and its outputs, losses, FLOPs, evaluation."""
