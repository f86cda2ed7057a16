"""Evaluation: the extrapolation harness, decoding, translation scoring, checkpoint averaging."""
