"""Trainer integrations; each imports its framework lazily, from the trainer's environment."""
