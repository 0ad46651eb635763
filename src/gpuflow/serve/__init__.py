"""Serving a trained run: HTTP routes, dynamic batching, generation and offline prediction.

It reads the run dir (weights, config, serving spec) and never imports ``gpuflow.train``.
"""
