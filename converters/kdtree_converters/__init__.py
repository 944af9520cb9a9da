"""kdtree-jax's checkpoint converters: `kdtree-convert` (a Hugging Face Kimi K2.x / DeepSeek-V3 checkpoint, optionally
with a DFlash drafter, -> the orbax checkpoint `kdtree_jax.load` restores) and the Hugging Face tensor names.

Installed with kdtree-jax; built on it, never imported by it (`tests/test_layers.py`).
"""
