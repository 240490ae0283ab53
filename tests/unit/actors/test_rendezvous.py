"""Where process-group members listen, and the join error (actors/rendezvous.py)."""

from __future__ import annotations

import pickle

import pytest

from actors.rendezvous import (
    GroupJoinError,
    advertised_host,
    interface_of,
    node_ip,
    socket_ifname_env,
)


def test_node_ip_prefers_the_override(monkeypatch):
    monkeypatch.setenv("STPPO_NODE_IP", "10.1.2.3")
    assert node_ip() == "10.1.2.3"


def test_advertised_host_names_the_node_for_a_wildcard_bind(monkeypatch):
    monkeypatch.setenv("STPPO_NODE_IP", "10.1.2.3")
    assert advertised_host("0.0.0.0") == advertised_host("") == "10.1.2.3"
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("10.9.9.9") == "10.9.9.9"


def test_interface_of_loopback_and_unknown():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: on no interface here


def test_socket_ifname_env_leaves_the_users_choice(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert socket_ifname_env("127.0.0.1", "gloo") == {"GLOO_SOCKET_IFNAME": "lo"}
    assert socket_ifname_env("127.0.0.1", "nccl") == {
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
    }
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert socket_ifname_env("127.0.0.1", "gloo") == {}
    assert socket_ifname_env("192.0.2.77", "nccl") == {}  # no interface holds it: set nothing


@pytest.fixture
def error() -> GroupJoinError:
    joined = {
        0: {"ip": "10.0.0.1", "address": "10.0.0.1 (node IP)"},
        1: {"ip": "127.0.0.1", "address": "127.0.0.1"},
    }
    names = {0: "learner (10.0.0.1)", 1: "engine 1 (10.0.0.2)", 2: "engine 2 (10.0.0.3)"}
    return GroupJoinError("the weight-sync group", 3, 60.0, joined, names, "Timed out")


def test_join_error_names_who_is_missing_where_the_others_listen_and_what_to_set(error):
    text = str(error)
    assert error.missing == [2]
    assert "Did not join: engine 2 (10.0.0.3)" in text
    assert "learner (10.0.0.1) at 10.0.0.1 (node IP)" in text
    assert "engine 1 (10.0.0.2) listen(s) on loopback" in text
    assert "GLOO_SOCKET_IFNAME" in text and "STPPO_NODE_IP" in text
    assert "(60 s)" in text and "Timed out" in text


def test_join_error_survives_pickling(error):  # it crosses Ray's process boundary
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) and copy.missing == error.missing
