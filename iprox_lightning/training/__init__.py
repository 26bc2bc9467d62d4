"""Training the target: the causal-LM module behind warm-up and fine-tuning."""
