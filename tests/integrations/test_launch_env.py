"""A script started as one plain process gets the one-rank environment the deepspeed launcher would give it."""
import os
import socket

from ds_maximus.integrations.launch_env import LAUNCHED_VARS, single_process_env

ONE_RANK = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE")


def test_plain_process_gets_one_rank(monkeypatch):
    for k in set(ONE_RANK) | set(LAUNCHED_VARS):
        monkeypatch.delenv(k, raising=False)
    got = single_process_env()
    assert {k: os.environ[k] for k in ONE_RANK} == got
    assert (got["RANK"], got["LOCAL_RANK"], got["WORLD_SIZE"], got["MASTER_ADDR"]) == ("0", "0", "1", "127.0.0.1")
    with socket.socket() as s:  # the port is free to bind
        s.bind(("127.0.0.1", int(got["MASTER_PORT"])))


def test_plain_process_keeps_a_given_master(monkeypatch):
    for k in set(ONE_RANK) | set(LAUNCHED_VARS):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29555")
    got = single_process_env()
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("10.0.0.7", "29555")


def test_launched_rank_is_left_alone(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert single_process_env() == {}
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == ("3", "4", "29999")
