"""The environment the ``deepspeed`` launcher gives a rank, set up for a script started as one plain process.

``python train.py`` (no launcher) leaves DeepSpeed without ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``, so its
``init_distributed`` falls back to MPI discovery and stops with ``ModuleNotFoundError: No module named
'mpi4py'``. :func:`single_process_env` sets what ``deepspeed --num_gpus 1`` would: one rank, a free local
port. Under a launcher (``deepspeed``, ``torchrun``, ``mpirun``) it changes nothing.

Example::

    from ds_maximus.integrations.launch_env import single_process_env
    single_process_env()          # before TrainingArguments / deepspeed.initialize
"""
from __future__ import annotations

import os
import socket
from typing import Dict

# set by the deepspeed launcher and torchrun (RANK), or by mpirun / Open MPI and MPICH (the others)
LAUNCHED_VARS = ("RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def launched() -> bool:
    """Whether a launcher started this process as a rank."""
    return any(v in os.environ for v in LAUNCHED_VARS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> Dict[str, str]:
    """Set the variables of a one-rank launch unless a launcher set them; returns what was set."""
    if launched():
        return {}
    env = {"MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
           "MASTER_PORT": os.environ.get("MASTER_PORT") or str(_free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    os.environ.update(env)
    return env
