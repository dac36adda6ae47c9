"""mok.integrations — mok inside training stacks: `transformers` (Hugging Face models: apply(model)
swaps their sparse-MoE blocks for mok's) and `megatron` (Megatron-Core's MoE layer through its
token-dispatcher / experts boundary). Each is imported on its own; neither is imported here, so
that `import mok.integrations` needs neither stack.
"""
