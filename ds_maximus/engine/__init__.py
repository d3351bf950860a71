"""The partitioner: wiring sharded modules into ``deepspeed.initialize`` under ZeRO 0-3."""
from ds_maximus.engine.initialize import disable, enable, initialize  # noqa: F401
