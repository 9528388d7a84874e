"""Encoders, the H-CLIP head and its baselines, losses, training and checkpoints (torch only)."""
