"""Large CPU tables for the expert tier: see :mod:`ds_maximus.partition.host_memory`, which inference and
training share (this name stays for the training modules that import it)."""
from ds_maximus.partition.host_memory import HOST_REGISTER_PORTABLE, host_tensor  # noqa: F401

__all__ = ["host_tensor", "HOST_REGISTER_PORTABLE"]
