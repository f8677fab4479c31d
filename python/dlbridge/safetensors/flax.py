"""``safetensors.flax`` over dlbridge: :mod:`dlbridge.safetensors.jax` under the name
``safetensors`` gives it (``from dlbridge.safetensors.flax import load_file``)."""

from __future__ import annotations

from .jax import load, load_file, save, save_file

__all__ = ["load", "load_file", "save", "save_file"]
