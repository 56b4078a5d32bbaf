"""Full weights into a sharded model (:mod:`.loading`): from rank 0's state dict or from safetensors files, each
rank reading only what it holds."""
