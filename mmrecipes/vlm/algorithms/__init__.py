"""The algorithms: preference (DPO), GRPO with its rewards and sampling, the frozen reference,
distillation and its teacher."""
