"""Evaluation: per-token metrics, passkey retrieval, gathering per-token outputs."""
