"""The memory plan: the peak per rank of one training step traced on fake tensors, and the micro-batch that fits."""
